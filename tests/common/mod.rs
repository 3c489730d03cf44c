//! Helpers shared by the integration tests of `ragged` that drive a whole sharded model
//! (each test file is its own crate, so not every file uses every helper).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use ragged::checkpoint::read::read_global;
use ragged::checkpoint::{fs as ckpt_fs, Manifest};
use ragged::demo::{Transformer, TransformerConfig};
use ragged::fsdp::ShardedModel;
use ragged::optim::Optimizer;
use ragged_optimizers::{AdamW, AdamWConfig};

/// Wide enough that 8-bit Adam keeps 8-bit state (rows of 64 and 96, ≥ 4096 elements) and
/// falls back to f32 for the embedding; Shampoo blocks of 32 rows cut every matrix.
pub const SMALL: TransformerConfig = TransformerConfig {
    vocab: 61,
    d_model: 64,
    n_layers: 2,
    n_heads: 2,
    d_ff: 96,
    seq_len: 12,
};

/// Every saved array of the newest checkpoint under `root`: `(param, field)` → bytes.
pub fn saved_arrays(root: &Path) -> BTreeMap<(String, String), Vec<u8>> {
    let dir = ckpt_fs::resolve(root).unwrap();
    let m = Manifest::read(&dir).unwrap();
    m.fields
        .iter()
        .map(|f| {
            let bytes = read_global(&dir, &m, f).unwrap();
            ((f.param.clone(), f.field.clone()), bytes)
        })
        .collect()
}

/// One backward of the demo transformer `cfg` over the whole model gathered
/// ([`ShardedModel::unshard`]) on `ids`, in which only rank `holder` keeps its loss (the
/// others' are scaled by 0: with summed gradients every sum then adds exact zeros, so a sharded
/// run's reduced gradients are the unsharded run's bits), then the reduction.
pub fn backward_on_one_rank<O: Optimizer>(
    m: &mut ShardedModel<'_, O>,
    cfg: TransformerConfig,
    ids: &candle_core::Tensor,
    rank: usize,
    holder: usize,
) -> ragged::Result<()> {
    let views = m.unshard()?;
    let model = Transformer::new(
        cfg,
        VarBuilder::from_tensors(views, DType::F32, &Device::Cpu),
    )?;
    let scale = if rank == holder { 1.0 } else { 0.0 };
    (model.loss(ids)? * scale)?.backward()?;
    m.reduce_gradients()
}

/// An empty scratch folder `suite/name-PID` under the system's temporary folder, removed when
/// the value is dropped after a passing test; kept (and its path printed) when the test fails,
/// so what it wrote can be inspected.
pub fn scratch(suite: &str, name: &str) -> Scratch {
    let dir = std::env::temp_dir()
        .join(suite)
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// See [`scratch`].
#[derive(Debug)]
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("scratch folder kept: {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
            // The suite's folder goes too once no other test (or process) has one in it.
            if let Some(suite) = self.0.parent() {
                let _ = std::fs::remove_dir(suite);
            }
        }
    }
}

/// AdamW with a learning rate of 0.1 (large enough that a wrong gradient shows in one step).
pub fn adamw() -> AdamW {
    AdamW::new(AdamWConfig {
        lr: 0.1,
        ..AdamWConfig::default()
    })
    .unwrap()
}

/// AdamW at rate `lr` with weight decay 0.1 (so the decay path is in every step).
pub fn adamw_decayed(lr: f64) -> AdamW {
    AdamW::new(AdamWConfig {
        lr,
        weight_decay: 0.1,
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

/// Elements of `t`'s whole storage object, read through candle's own API (0 once freed).
pub fn storage_elements(t: &candle_core::Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.len(),
        candle_core::Storage::Cpu(candle_core::CpuStorage::BF16(v)) => v.len(),
        // A freed parameter's placeholder (bytes, so that a stage reading it fails cleanly).
        candle_core::Storage::Cpu(candle_core::CpuStorage::U8(v)) => v.len(),
        _ => unreachable!("CPU f32 or bf16 parameters"),
    }
}

/// The address of `t`'s storage object's first element (CPU `f32`).
pub fn storage_address(t: &candle_core::Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.as_ptr() as usize,
        _ => unreachable!("CPU f32 parameters"),
    }
}

/// A Hugging Face split checkpoint under `root`: each `(file, tensors)` written as one
/// safetensors file, and `model.safetensors.index.json` naming each tensor's file; returns the
/// index's path.
pub fn write_split_checkpoint(
    root: &std::path::Path,
    files: &[(String, Vec<(String, candle_core::Tensor)>)],
) -> PathBuf {
    let mut weight_map = serde_json::Map::new();
    for (file, tensors) in files {
        let map: std::collections::HashMap<&String, candle_core::Tensor> =
            tensors.iter().map(|(n, t)| (n, t.clone())).collect();
        candle_core::safetensors::save(&map, root.join(file)).unwrap();
        for (n, _) in tensors {
            weight_map.insert(n.clone(), file.clone().into());
        }
    }
    let index = root.join("model.safetensors.index.json");
    let json = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(&index, json.to_string()).unwrap();
    index
}

/// `stages` with `watch(stage, params)` called before each stage's forward: what a test
/// records of the tensors a stage reads (addresses, storage lengths, values), the stages'
/// results unchanged.
pub struct Watching<S, F> {
    pub stages: S,
    pub watch: F,
}

impl<S, F> ragged::fsdp::Stages for Watching<S, F>
where
    S: ragged::fsdp::Stages,
    F: Fn(usize, &ragged::fsdp::UnitParams) -> candle_core::Result<()>,
{
    type Batch = S::Batch;
    fn stage_units(&self) -> Vec<String> {
        self.stages.stage_units()
    }
    fn forward(
        &self,
        s: usize,
        p: &ragged::fsdp::UnitParams,
        x: Option<&candle_core::Tensor>,
        b: &S::Batch,
    ) -> candle_core::Result<candle_core::Tensor> {
        (self.watch)(s, p)?;
        self.stages.forward(s, p, x, b)
    }
}

/// `t`'s values as `f32`, flattened (any dtype).
pub fn f32_values(t: &candle_core::Tensor) -> Vec<f32> {
    t.to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Bytes the calling thread has read so far, as the kernel counts them (`rchar` of
/// `/proc/thread-self/io`: every `read` and `pread`, of files or not): what a thread rank read
/// from a checkpoint, measured outside the code that reads it.
pub fn thread_read_bytes() -> u64 {
    let io = std::fs::read_to_string("/proc/thread-self/io").expect("/proc/thread-self/io");
    io.lines()
        .find_map(|l| l.strip_prefix("rchar:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("an rchar line in /proc/thread-self/io")
}
