//! Sharded checkpoints: save from every rank, resume bit for bit, load at another world size
//! or layout, and trade consolidated safetensors files with candle and Hugging Face.
//!
//! # Format (version [`manifest::VERSION`])
//! A checkpoint is a folder `ROOT/step-00000042/` ([`fs`]) holding
//! - `rank-00003-of-00004.safetensors` per rank ([`safetensors`]): the rank's range of every
//!   parameter it holds (f32 master values, tensor named like the parameter) and of every
//!   optimizer state field (`NAME::m`, `NAME::scale_v`, ...; [`state`]), each a 1-D tensor;
//! - `manifest.json` ([`manifest::Manifest`]): the model's tensors, the plan, every saved
//!   array's global length and which rank holds which range of it (its RaggedShard), the
//!   optimizer and its config, the step counters and learning rate, the world size, the format
//!   version, checksums of every rank file (XXH3-128 per 4 MiB chunk, SHA-256 over them) and
//!   the manifest's own SHA-256 ([`manifest::Manifest::checksum`]).
//!
//! # Guarantees
//! - **Atomic:** files are written into `ROOT/.step-N.tmp/`, fsynced, and the folder is renamed
//!   into place by rank 0 only after every rank has finished; a save that dies leaves the
//!   previous checkpoint untouched (and the next save removes the leftover).
//! - **Exact:** every saved array is the bits in memory; loading restores them bit for bit,
//!   and the optimizer state's layout is global (per parameter, per block), so a load at any
//!   world size or layout puts every element where that layout keeps it
//!   ([`crate::ragged::redistribute`] from the saved RaggedShard to the new one).
//! - **Checked:** every rank reads only the byte ranges it needs, and verifies each chunk it
//!   touches; a truncated or damaged file, a missing rank file, another model, other shapes
//!   or element types, or a manifest from a newer format is an `Err` naming the file and the
//!   problem, on every rank.

pub mod fs;
pub mod manifest;
pub mod read;
pub mod safetensors;
pub mod sources;
pub mod state;

pub use manifest::Manifest;
pub use state::{
    CheckpointState, FieldArray, FieldArrayMut, FieldData, FieldDataMut, FieldLayout, FieldSpan,
    FieldType,
};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::comm::{all_gather_bytes, Communicator};
use crate::{Error, Result};

#[cfg(not(target_endian = "little"))]
compile_error!("checkpoints write memory as little-endian bytes (safetensors' byte order)");

/// Options of a save.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SaveOptions {
    /// Keep only the newest `keep` checkpoints under the root, this save's and those of
    /// earlier steps (`0`: keep all). Checkpoints of later steps (from a run this one resumed
    /// before the end of) are removed with `keep > 0`, and with `0` moved into a new
    /// `abandoned-K` folder under the root, so the newest is always this run's.
    pub keep: usize,
    /// Bytes per checksum chunk.
    pub chunk_bytes: u64,
    /// The caller's own facts about the run (a data position, the global batch, a config
    /// name), saved in the manifest and returned by a load as [`Loaded::metadata`]. Every rank
    /// passes the same `keep` and `metadata` (a save where they differ is refused on every
    /// rank).
    pub metadata: BTreeMap<String, String>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            keep: 0,
            chunk_bytes: safetensors::CHUNK_BYTES,
            metadata: BTreeMap::new(),
        }
    }
}

/// What a save wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Saved {
    /// The checkpoint folder.
    pub dir: PathBuf,
    /// Bytes of all rank files.
    pub bytes: u64,
    /// Wall time of the save on this rank.
    pub seconds: f64,
    /// Checkpoints removed by rotation ([`SaveOptions::keep`]).
    pub removed: Vec<PathBuf>,
    /// Checkpoints of later steps moved into an `abandoned-K` folder, where they now are
    /// ([`SaveOptions::keep`] `0`).
    pub set_aside: Vec<PathBuf>,
}

/// What a load read.
#[derive(Clone, Debug, PartialEq)]
pub struct Loaded {
    pub dir: PathBuf,
    /// The world size that wrote it.
    pub saved_world: usize,
    /// Steps taken when it was saved.
    pub steps: usize,
    /// Bytes of saved arrays this rank read (under HSDP 0 on the replicas that received
    /// their shard from the one that read it).
    pub bytes_read: u64,
    pub seconds: f64,
    /// The optimizer settings that differ from the checkpoint's (`name: saved → now`, one
    /// added since it was written `name: not recorded → now`; [`crate::settings::changes`]). The
    /// learning rate is restored from the checkpoint; the others are this model's, as its
    /// optimizer was configured (a resumed run may change them; here they are said). The
    /// FSDP options that change the numbers follow, as `fsdp.<path>: saved → now`.
    pub changed_settings: Vec<String>,
    /// What the saving run recorded ([`SaveOptions::metadata`]; empty for checkpoints saved
    /// before it was recorded).
    pub metadata: BTreeMap<String, String>,
}

/// A checkpoint error about `path` (the one constructor the checkpoint modules share).
pub(crate) fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// `e`'s text inside the combined error of [`agree`], which names `dir` once: a checkpoint
/// error about `dir` itself gives its reason, one about a file under it the file's path
/// relative to `dir` and the reason; any other error its whole text.
fn reason_within(dir: &Path, e: &Error) -> String {
    let Error::Checkpoint { path, reason } = e else {
        return e.to_string();
    };
    match Path::new(path).strip_prefix(dir) {
        Ok(inside) if inside.as_os_str().is_empty() => reason.clone(),
        Ok(inside) => format!("{}: {reason}", inside.display()),
        Err(_) => e.to_string(),
    }
}

/// Every rank's outcome of a local part of a checkpoint operation: every rank's payload when
/// all succeeded, else the same `Err` on every rank naming each failed rank's problem (one
/// exchange; on one rank the error itself).
pub(crate) fn agree(
    comm: &dyn Communicator,
    dir: &Path,
    local: Result<Vec<u8>>,
) -> Result<Vec<Vec<u8>>> {
    if comm.world_size() == 1 {
        return local.map(|p| vec![p]);
    }
    let msg = match &local {
        Ok(p) => [&[0u8][..], p].concat(),
        Err(e) => [&[1u8][..], reason_within(dir, e).as_bytes()].concat(),
    };
    let all = all_gather_bytes(comm, &msg)?;
    // Failed ranks grouped by their message, in rank order (all ranks often fail alike).
    let mut failed: Vec<(Vec<usize>, &[u8])> = Vec::new();
    for (r, m) in all
        .iter()
        .enumerate()
        .filter(|(_, m)| m.first() != Some(&0))
    {
        let text = m.get(1..).unwrap_or(&[]);
        match failed.iter_mut().find(|(_, t)| *t == text) {
            Some((ranks, _)) => ranks.push(r),
            None => failed.push((vec![r], text)),
        }
    }
    let failed: Vec<String> = failed
        .iter()
        .map(|(ranks, text)| {
            let who = match ranks.as_slice() {
                [r] => format!("rank {r}"),
                _ if ranks.len() == all.len() => "every rank".to_string(),
                _ => format!("ranks {ranks:?}"),
            };
            format!("{who}: {}", String::from_utf8_lossy(text))
        })
        .collect();
    if failed.is_empty() {
        return Ok(all.into_iter().map(|m| m[1..].to_vec()).collect());
    }
    Err(Error::Checkpoint {
        path: dir.display().to_string(),
        reason: failed.join("; "),
    })
}
