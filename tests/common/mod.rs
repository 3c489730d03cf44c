//! Helpers shared by the integration tests of `ragged` that drive a whole sharded model
//! (each test file is its own crate, so not every file uses every helper).
#![allow(dead_code)]

use std::path::PathBuf;

use ragged::fsdp::ShardedModel;
use ragged::optim::Optimizer;
use ragged_optimizers::{AdamW, AdamWConfig};

/// An empty scratch folder `suite/name-PID` under the system's temporary folder.
pub fn scratch(suite: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir()
        .join(suite)
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// AdamW with a learning rate of 0.1 (large enough that a wrong gradient shows in one step).
pub fn adamw() -> AdamW {
    AdamW::new(AdamWConfig {
        lr: 0.1,
        ..AdamWConfig::default()
    })
    .unwrap()
}

/// Every gradient element this rank holds (the pieces of its local shard, not the padding).
pub fn local_grads<O: Optimizer>(s: &ShardedModel<'_, O>) -> Vec<f32> {
    let mut out = Vec::new();
    s.with_local_grads(|local, g| {
        for p in &local.pieces {
            out.extend_from_slice(&g[p.offset..p.offset + p.range.len()]);
        }
    })
    .unwrap();
    out
}
