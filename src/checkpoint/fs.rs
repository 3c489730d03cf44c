//! The checkpoint folder on disk: `ROOT/step-00000042/` holds one complete checkpoint; a save
//! in progress writes `ROOT/.step-00000042.tmp/` and renames it into place only when every
//! rank's file and the manifest are fsynced, so a crash at any moment leaves the previous
//! complete checkpoint as it was.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The folder of the checkpoint taken after `step` steps.
pub fn step_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step-{step:08}"))
}

/// Where a save of `step` writes before it is complete.
pub fn tmp_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!(".step-{step:08}.tmp"))
}

fn step_of(name: &str) -> Option<usize> {
    name.strip_prefix("step-")?.parse().ok()
}

/// Writes `bytes` to `path` and fsyncs it.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = fs::File::create(path).map_err(|e| Error::io("checkpoint: create", path, e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| Error::io("checkpoint: write", path, e))
}

/// Fsyncs a folder, so the names created or renamed in it are durable.
pub fn sync_dir(path: &Path) -> Result<()> {
    fs::File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io("checkpoint: fsync folder", path, e))
}

/// Creates `root` if needed and an empty temporary folder for `step`, after removing what
/// saves that died left behind (`.step-*.tmp`, `.step-*.old`; one job saves into a root).
pub fn prepare(root: &Path, step: usize) -> Result<PathBuf> {
    fs::create_dir_all(root).map_err(|e| Error::io("checkpoint: create folder", root, e))?;
    for leftover in leftovers(root)? {
        fs::remove_dir_all(&leftover).map_err(|e| Error::io("checkpoint: remove", &leftover, e))?;
    }
    let tmp = tmp_dir(root, step);
    fs::create_dir(&tmp).map_err(|e| Error::io("checkpoint: create folder", &tmp, e))?;
    Ok(tmp)
}

/// Folders of saves that did not finish under `root`.
pub fn leftovers(root: &Path) -> Result<Vec<PathBuf>> {
    let entries = fs::read_dir(root).map_err(|e| Error::io("checkpoint: list", root, e))?;
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("checkpoint: list", root, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(".step-") && (name.ends_with(".tmp") || name.ends_with(".old")) {
            out.push(entry.path());
        }
    }
    Ok(out)
}

/// Renames the complete temporary folder into place (replacing a checkpoint of the same step)
/// and fsyncs the root.
pub fn publish(root: &Path, tmp: &Path, step: usize) -> Result<PathBuf> {
    sync_dir(tmp)?;
    let dst = step_dir(root, step);
    if dst.exists() {
        let old = root.join(format!(".step-{step:08}.old"));
        let _ = fs::remove_dir_all(&old);
        fs::rename(&dst, &old).map_err(|e| Error::io("checkpoint: rename", &dst, e))?;
        fs::rename(tmp, &dst).map_err(|e| Error::io("checkpoint: rename", tmp, e))?;
        fs::remove_dir_all(&old).map_err(|e| Error::io("checkpoint: remove", &old, e))?;
    } else {
        fs::rename(tmp, &dst).map_err(|e| Error::io("checkpoint: rename", tmp, e))?;
    }
    sync_dir(root)?;
    Ok(dst)
}

/// The complete checkpoints under `root` (folders `step-N` with a manifest), oldest first.
pub fn list(root: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let entries = fs::read_dir(root).map_err(|e| Error::io("checkpoint: list", root, e))?;
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("checkpoint: list", root, e))?;
        let name = entry.file_name();
        let Some(step) = name.to_str().and_then(step_of) else {
            continue;
        };
        if entry.path().join("manifest.json").is_file() {
            out.push((step, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Removes all but the newest `keep` complete checkpoints under `root`; returns what it
/// removed.
pub fn rotate(root: &Path, keep: usize) -> Result<Vec<PathBuf>> {
    let all = list(root)?;
    let drop = all.len().saturating_sub(keep.max(1));
    let mut removed = Vec::new();
    for (_, path) in all.into_iter().take(drop) {
        fs::remove_dir_all(&path).map_err(|e| Error::io("checkpoint: remove", &path, e))?;
        removed.push(path);
    }
    Ok(removed)
}

/// The checkpoint folder `path` names: itself if it holds a manifest, else the newest complete
/// checkpoint under it.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join("manifest.json").is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(Error::Checkpoint {
            path: path.display().to_string(),
            reason: "no such folder".into(),
        });
    }
    list(path)?
        .pop()
        .map(|(_, p)| p)
        .ok_or_else(|| Error::Checkpoint {
            path: path.display().to_string(),
            reason: "no complete checkpoint (step-N folder with a manifest.json) in it".into(),
        })
}
