//! The checkpoint folder on disk: `ROOT/step-00000042/` holds one complete checkpoint; a save
//! in progress writes `ROOT/.step-00000042.tmp/` and renames it into place only when every
//! rank's file and the manifest are fsynced, so a crash at any moment leaves the previous
//! complete checkpoint as it was. A save over an existing step moves the old one aside to
//! `ROOT/.step-00000042.old/` for the instant between two renames; if the save dies there, the
//! old one is still found ([`list`]) and put back by the next save ([`prepare`]). A checkpoint
//! being removed is first renamed to `ROOT/.step-00000042.del/` (out of [`list`]'s sight in
//! one step), so a crash while its files go leaves no half checkpoint that looks complete.

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

/// Where a save over `step` keeps the previous checkpoint of that step while it renames.
fn old_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!(".step-{step:08}.old"))
}

fn step_of(name: &str) -> Option<usize> {
    name.strip_prefix("step-")?.parse().ok()
}

/// The step of a `.step-N.old` folder name.
fn old_step_of(name: &str) -> Option<usize> {
    name.strip_prefix(".step-")?
        .strip_suffix(".old")?
        .parse()
        .ok()
}

/// The entries of `dir` named `prefix` and a process id, of processes that no longer run (no
/// `/proc/PID`): what interrupted processes left (no cleanup runs on a kill). Empty where
/// `dir` does not read.
pub fn left_by_ended_processes(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let ended = |name: &str| {
        let pid = name
            .strip_prefix(prefix)
            .and_then(|p| p.parse::<u32>().ok());
        pid.is_some_and(|pid| !Path::new("/proc").join(pid.to_string()).exists())
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(ended))
        .map(|e| e.path())
        .collect()
}

/// Whether `name` is a checkpoint's (`step-N`) or a save's (`.step-N.*`) folder name.
pub fn is_step_name(name: &str) -> bool {
    step_of(name).is_some() || name.starts_with(".step-")
}

/// The checkpoint folder `path` is in: the nearest of `path` and its ancestors that holds a
/// checkpoint's manifest (whatever the folder's name: checkpoints are copied and renamed) or
/// is a save's `.step-N.*` folder; `None` elsewhere (another program's `manifest.json`, a web
/// app's, makes no checkpoint). `path` should be absolute (canonical where it exists).
pub fn enclosing_checkpoint(path: &Path) -> Option<PathBuf> {
    let in_a_save = |p: &Path| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with(".step-"))
    };
    path.ancestors()
        .find(|p| in_a_save(p) || holds_checkpoint_manifest(p))
        .map(Path::to_path_buf)
}

/// Whether `dir/manifest.json` is a regular file whose `format` is a ragged checkpoint's.
fn holds_checkpoint_manifest(dir: &Path) -> bool {
    #[derive(serde::Deserialize)]
    struct Format {
        format: String,
    }
    let manifest = dir.join("manifest.json");
    manifest.is_file()
        && fs::read(&manifest)
            .ok()
            .and_then(|text| serde_json::from_slice::<Format>(&text).ok())
            .is_some_and(|f| f.format == super::manifest::FORMAT)
}

/// `Err` unless `root` can hold checkpoints: a folder or nothing yet (not a file), and not
/// inside a checkpoint (whose `step-N` folders would nest there, out of sight of `list` on
/// the real root).
fn check_root(root: &Path) -> Result<()> {
    let refuse = |reason: String| Error::Checkpoint {
        path: root.display().to_string(),
        reason,
    };
    if root.as_os_str().is_empty() {
        // `create_dir_all("")` succeeds and the lock would land in the working folder.
        return Err(refuse(
            "an empty path: name the folder to save into (`.` for the working folder)".into(),
        ));
    }
    if root.exists() && !root.is_dir() {
        return Err(refuse(
            "not a folder: checkpoints are saved into a folder".into(),
        ));
    }
    let absolute = root.canonicalize().unwrap_or_else(|_| root.to_path_buf());
    match enclosing_checkpoint(&absolute) {
        Some(ck) => Err(refuse(format!(
            "is inside the checkpoint folder {}: save into the folder that holds the step-N \
             folders, or into another",
            ck.display()
        ))),
        None => Ok(()),
    }
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

/// Creates `root` if needed and an empty temporary folder for `step`, after putting back a
/// checkpoint a save that died had moved aside (`.step-N.old` without `step-N`) and removing
/// what such saves left behind (`.step-*.tmp`, `.step-*.old`; one job saves into a root).
/// `Err` for a root that is a file or inside a checkpoint, one another save holds, or one
/// holding checkpoints of a run other than `run`.
pub fn prepare(root: &Path, step: usize, run: &str) -> Result<(PathBuf, RootLock)> {
    check_root(root)?;
    fs::create_dir_all(root).map_err(|e| Error::io("checkpoint: create folder", root, e))?;
    let lock = RootLock::take(root)?;
    // One listing serves the whole preparation: the lock keeps other saves out meanwhile.
    let listing = Listing::of(root)?;
    check_one_run(root, &listing, run)?;
    let aside = listing.moved_aside(root);
    for (n, old) in &aside {
        let dst = step_dir(root, *n);
        fs::rename(old, &dst).map_err(|e| Error::io("checkpoint: rename", old, e))?;
    }
    let put_back = |path: &PathBuf| aside.iter().any(|(_, old)| old == path);
    for leftover in listing.leftovers().into_iter().filter(|p| !put_back(p)) {
        fs::remove_dir_all(&leftover).map_err(|e| Error::io("checkpoint: remove", &leftover, e))?;
    }
    let tmp = tmp_dir(root, step);
    fs::create_dir(&tmp).map_err(|e| Error::io("checkpoint: create folder", &tmp, e))?;
    Ok((tmp, lock))
}

/// A new run id: 16 hex digits from the clock, the process and the standard library's random
/// hash keys (unique enough to tell two runs' checkpoints apart; not a secret).
pub fn new_run_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(now);
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

/// The run id a checkpoint's manifest records, read without the rest of the manifest (`None`
/// for a checkpoint from before runs had one, or a manifest that does not read: the load
/// reports those).
fn run_of(checkpoint: &Path) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Training {
        run: Option<String>,
    }
    #[derive(serde::Deserialize)]
    struct RunOnly {
        training: Option<Training>,
    }
    let text = fs::read(checkpoint.join("manifest.json")).ok()?;
    serde_json::from_slice::<RunOnly>(&text).ok()?.training?.run
}

/// `Err` when `root` holds checkpoints another run saved: two jobs saving into one root (both
/// started while it was empty, or one not resumed from it) would otherwise replace each
/// other's steps and leave a line of checkpoints mixed from both. Every save checks this, so a
/// root holds one run's line and its newest checkpoint that records a run names it: one
/// manifest is read, however many checkpoints the root keeps (older ones, from before runs were
/// recorded, name none and are skipped).
fn check_one_run(root: &Path, listing: &Listing, run: &str) -> Result<()> {
    // Newest first by the names alone: a folder without a manifest records no run.
    let newest_run = listing
        .by_name(root, |_| true)
        .iter()
        .rev()
        .find_map(|(step, path)| run_of(path).map(|r| (*step, r)));
    match newest_run {
        Some((step, other)) if other != run => Err(Error::Checkpoint {
            path: root.display().to_string(),
            reason: format!(
                "holds checkpoints of another run ({} in all, the newest of step {step}): save \
                 into another folder, or load one of them first to continue that run",
                listing.complete_where(root, |_| true).len()
            ),
        }),
        _ => Ok(()),
    }
}

/// An exclusive lock on a checkpoint root (`flock` on `ROOT/.lock`), held by the saving rank 0
/// from [`prepare`] to the end of the save and released when dropped: a second job saving
/// into the same root at the same time gets an `Err` naming the cause, instead of each
/// removing the other's temporary folder as a leftover.
#[derive(Debug)]
pub struct RootLock {
    _file: fs::File,
}

impl RootLock {
    fn take(root: &Path) -> Result<RootLock> {
        use std::os::fd::AsRawFd as _;
        let path = root.join(".lock");
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io("checkpoint: open lock", &path, e))?;
        // SAFETY: `flock` on a descriptor this function owns (open until the lock drops).
        let taken = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if taken != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Err(Error::Checkpoint {
                    path: root.display().to_string(),
                    reason: "another process is saving into this folder (it holds .lock): \
                             one job saves into a root at a time"
                        .into(),
                });
            }
            return Err(Error::io("checkpoint: lock", &path, e));
        }
        Ok(RootLock { _file: file })
    }
}

/// `Err` unless a save could create its files under `root` (created if missing): checked
/// before a run trains, so an unwritable folder is found at the start, not at the first save.
pub fn check_writable(root: &Path, rank: usize) -> Result<()> {
    check_root(root)?;
    fs::create_dir_all(root).map_err(|e| Error::io("checkpoint: create folder", root, e))?;
    let probe = root.join(format!(".write-probe-rank-{rank}"));
    fs::write(&probe, b"").map_err(|e| Error::io("checkpoint: write", &probe, e))?;
    fs::remove_file(&probe).map_err(|e| Error::io("checkpoint: remove", &probe, e))
}

/// One listing of a root: the names of its entries (lossy UTF-8) and their paths. What a
/// save needs is read from the names first, and only the folders it wants are looked into
/// (looking into every one cost a save about 7 µs per checkpoint kept); a save lists its root
/// once before writing and once before publishing (and once more to rotate), where it listed
/// it six to eight times.
struct Listing {
    entries: Vec<(String, PathBuf)>,
}

impl Listing {
    fn of(root: &Path) -> Result<Listing> {
        let list = |e| Error::io("checkpoint: list", root, e);
        let entries = fs::read_dir(root)
            .map_err(list)?
            .map(|entry| {
                let entry = entry.map_err(list)?;
                let name = entry.file_name().to_string_lossy().into_owned();
                Ok((name, entry.path()))
            })
            .collect::<Result<_>>()?;
        Ok(Listing { entries })
    }

    /// `(step, path)` of the entries whose name `step_of_name` reads a step from and `wanted`
    /// accepts; nothing inside them is looked at.
    fn named_steps(
        &self,
        step_of_name: fn(&str) -> Option<usize>,
        wanted: impl Fn(usize) -> bool,
    ) -> Vec<(usize, PathBuf)> {
        let steps = self.entries.iter().filter_map(|(name, path)| {
            let step = step_of_name(name)?;
            wanted(step).then(|| (step, path.clone()))
        });
        steps.collect()
    }

    /// Folders of saves and removals that did not finish.
    fn leftovers(&self) -> Vec<PathBuf> {
        let unfinished = |n: &str| {
            n.starts_with(".step-") && [".tmp", ".old", ".del"].iter().any(|s| n.ends_with(s))
        };
        let found = self.entries.iter().filter(|(name, _)| unfinished(name));
        found.map(|(_, path)| path.clone()).collect()
    }

    /// Complete checkpoints a save moved aside and did not replace: `(step, .step-N.old)`
    /// where `step-N` is not listed and the folder has a manifest.
    fn moved_aside(&self, root: &Path) -> Vec<(usize, PathBuf)> {
        let mut aside = self.named_steps(old_step_of, |_| true);
        let listed = |step| self.entries.iter().any(|(_, p)| *p == step_dir(root, step));
        aside.retain(|(step, path)| has_manifest(path) && !listed(*step));
        aside
    }

    /// The folders `step-N`, and the checkpoints a save that died had moved aside, of the
    /// steps `wanted` accepts, oldest first.
    fn by_name(&self, root: &Path, wanted: impl Fn(usize) -> bool) -> Vec<(usize, PathBuf)> {
        let mut out = self.named_steps(step_of, &wanted);
        out.extend(
            self.moved_aside(root)
                .into_iter()
                .filter(|&(n, _)| wanted(n)),
        );
        out.sort();
        out
    }

    /// [`list`]'s checkpoints of the steps `wanted` accepts.
    fn complete_where(&self, root: &Path, wanted: impl Fn(usize) -> bool) -> Vec<(usize, PathBuf)> {
        let mut out = self.by_name(root, wanted);
        out.retain(|(_, path)| has_manifest(path));
        out
    }
}

/// Whether checkpoint folder `path` holds a manifest (a complete save).
fn has_manifest(path: &Path) -> bool {
    path.join("manifest.json").is_file()
}

/// Folders of saves and removals that did not finish under `root`.
pub fn leftovers(root: &Path) -> Result<Vec<PathBuf>> {
    Ok(Listing::of(root)?.leftovers())
}

/// Renames the complete temporary folder into place (replacing a checkpoint of the same step)
/// and fsyncs the root.
pub fn publish(root: &Path, tmp: &Path, step: usize) -> Result<PathBuf> {
    sync_dir(tmp)?;
    let dst = step_dir(root, step);
    if dst.exists() {
        let old = old_dir(root, step);
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

/// The complete checkpoints under `root` (folders `step-N` with a manifest, and any a save
/// that died had moved aside), oldest first.
pub fn list(root: &Path) -> Result<Vec<(usize, PathBuf)>> {
    complete_where(root, |_| true)
}

/// [`list`]'s checkpoints of the steps `wanted` accepts.
fn complete_where(root: &Path, wanted: impl Fn(usize) -> bool) -> Result<Vec<(usize, PathBuf)>> {
    Ok(Listing::of(root)?.complete_where(root, wanted))
}

/// After a save of step `saved`, keeps it and the `keep − 1` newest checkpoints before it
/// and removes the older ones; returns what it removed.
pub fn rotate(root: &Path, keep: usize, saved: usize) -> Result<Vec<PathBuf>> {
    let mut before: Vec<_> = list(root)?
        .into_iter()
        .filter(|&(n, _)| n <= saved)
        .collect();
    before.truncate(before.len().saturating_sub(keep.max(1)));
    before
        .into_iter()
        .map(|(_, path)| remove(root, path))
        .collect()
}

/// Before a save of step `saved` is published, removes the checkpoints of later steps: they
/// belong to a run this one went back from (it resumed from an earlier step into the same
/// root), and left in place they would be what "the newest checkpoint" resolves to. Removed
/// before publishing, so a crash at any moment leaves a newest checkpoint of this run's own
/// line. Returns what it removed.
pub fn remove_later(root: &Path, saved: usize) -> Result<Vec<PathBuf>> {
    let later = later_than(root, saved)?.into_iter();
    later.map(|(_, path)| remove(root, path)).collect()
}

/// The complete checkpoints under `root` of steps after `saved` ([`list`]'s, oldest first).
fn later_than(root: &Path, saved: usize) -> Result<Vec<(usize, PathBuf)>> {
    complete_where(root, |n| n > saved)
}

/// Before a save of step `saved` that keeps every checkpoint, moves the checkpoints of later
/// steps (of a run this one went back from, as for [`remove_later`]) into a new folder
/// `root/abandoned-K/` (`K` the first free number): complete and loadable there (resume from
/// that folder to continue that run), out of what "the newest checkpoint" under `root`
/// resolves to. Each move is one rename, made before publishing. Returns the new paths.
pub fn set_aside_later(root: &Path, saved: usize) -> Result<Vec<PathBuf>> {
    let later = later_than(root, saved)?;
    if later.is_empty() {
        return Ok(Vec::new());
    }
    let folder = (1..)
        .map(|k| root.join(format!("abandoned-{k}")))
        .find(|p| !p.exists())
        .expect("some number is free");
    fs::create_dir(&folder).map_err(|e| Error::io("checkpoint: create folder", &folder, e))?;
    let mut moved = Vec::with_capacity(later.len());
    for (step, path) in later {
        let to = step_dir(&folder, step);
        fs::rename(&path, &to).map_err(|e| Error::io("checkpoint: rename", &path, e))?;
        moved.push(to);
    }
    sync_dir(&folder)?;
    sync_dir(root)?;
    Ok(moved)
}

/// Removes the checkpoint folder `path` of `root`: renamed to `.<name>.del` first (out of
/// [`list`]'s sight at once), then deleted. Returns `path`.
fn remove(root: &Path, path: PathBuf) -> Result<PathBuf> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let aside = root.join(format!(".{}.del", name.trim_start_matches('.')));
    let _ = fs::remove_dir_all(&aside);
    fs::rename(&path, &aside).map_err(|e| Error::io("checkpoint: rename", &path, e))?;
    sync_dir(root)?;
    fs::remove_dir_all(&aside).map_err(|e| Error::io("checkpoint: remove", &aside, e))?;
    Ok(path)
}

/// The checkpoint folder `path` names: itself if it holds a manifest, else the newest complete
/// checkpoint under it.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    let manifest = path.join("manifest.json");
    if manifest.is_file() {
        return Ok(path.to_path_buf());
    }
    if std::fs::symlink_metadata(&manifest).is_ok() {
        return Err(Error::Checkpoint {
            path: manifest.display().to_string(),
            reason: "not a regular file (a folder, a device, a FIFO, a link to nothing or a \
                     link loop): a checkpoint's manifest is a file"
                .into(),
        });
    }
    if !path.is_dir() {
        let reason = if path.exists() {
            "not a folder: name a checkpoint folder (step-N) or the folder that holds them"
        } else {
            "no such folder"
        };
        return Err(Error::Checkpoint {
            path: path.display().to_string(),
            reason: reason.into(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder that `list` counts as a complete checkpoint.
    fn fake_checkpoint(dir: &Path) {
        fs::create_dir_all(dir).unwrap();
        fs::write(
            dir.join("manifest.json"),
            br#"{"format": "ragged-checkpoint"}"#,
        )
        .unwrap();
    }

    fn steps(root: &Path) -> Vec<usize> {
        list(root).unwrap().into_iter().map(|(n, _)| n).collect()
    }

    fn scratch(name: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("ragged-fs-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        root
    }

    /// A save that died between moving the old checkpoint of its step aside and renaming the
    /// new one into place: the old one is still listed, and the next save puts it back.
    #[test]
    fn a_checkpoint_moved_aside_by_a_dead_save_is_found_and_put_back() {
        let root = scratch("aside");
        fake_checkpoint(&step_dir(&root, 3));
        fake_checkpoint(&old_dir(&root, 5));
        fs::create_dir_all(tmp_dir(&root, 5)).unwrap();
        assert_eq!(steps(&root), [3, 5]);
        assert_eq!(resolve(&root).unwrap(), old_dir(&root, 5));
        prepare(&root, 6, "run").unwrap();
        assert!(step_dir(&root, 5).join("manifest.json").is_file());
        assert!(!old_dir(&root, 5).exists() && !tmp_dir(&root, 5).exists());
        assert_eq!(resolve(&root).unwrap(), step_dir(&root, 5));
        // An `.old` beside its replacement is a leftover: removed, not put back.
        fake_checkpoint(&old_dir(&root, 3));
        prepare(&root, 7, "run").unwrap();
        assert!(!old_dir(&root, 3).exists());
        let _ = fs::remove_dir_all(&root);
    }

    /// Before a save of step 15 is published, the checkpoints of later steps (an abandoned
    /// run's) go, so the newest is of this run's line even if the save dies now (here 10);
    /// rotation after the save keeps it and the `keep − 1` newest before it (here one).
    #[test]
    fn rotation_keeps_the_save_just_made_and_drops_later_steps() {
        let root = scratch("rotate");
        for n in [5, 10, 20, 30] {
            fake_checkpoint(&step_dir(&root, n));
        }
        assert_eq!(remove_later(&root, 15).unwrap().len(), 2);
        assert_eq!(resolve(&root).unwrap(), step_dir(&root, 10));
        fake_checkpoint(&step_dir(&root, 15));
        let removed = rotate(&root, 2, 15).unwrap();
        assert_eq!(steps(&root), [10, 15]);
        assert_eq!(removed, [step_dir(&root, 5)]);
        rotate(&root, 1, 15).unwrap();
        assert_eq!(steps(&root), [15]);
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn one_save_at_a_time_holds_a_root_and_unwritable_roots_are_found_early() {
        let root = scratch("lock");
        let (_, held) = prepare(&root, 1, "run").unwrap();
        let err = prepare(&root, 2, "run").unwrap_err().to_string();
        assert!(
            err.contains("another process is saving into this folder"),
            "{err}"
        );
        assert!(
            tmp_dir(&root, 1).is_dir(),
            "the first save's folder is left alone"
        );
        drop(held);
        prepare(&root, 2, "run").unwrap();
        check_writable(&root.join("new"), 3).unwrap();
        assert!(
            fs::read_dir(root.join("new")).unwrap().next().is_none(),
            "no probe left"
        );
        let file = root.join("a-file");
        fs::write(&file, b"").unwrap();
        assert!(check_writable(&file.join("sub"), 0).is_err());
        let err = check_writable(&file, 0).unwrap_err().to_string();
        assert!(err.contains("not a folder"), "{err}");
        let _ = fs::remove_dir_all(&root);
    }

    /// A root inside a checkpoint (`--checkpoint-dir ck/step-2`) nested `step-3` in there,
    /// where neither the real root nor the checkpoint lists it: refused early and at the save.
    #[test]
    fn a_root_inside_a_checkpoint_is_refused() {
        let root = scratch("nested");
        fake_checkpoint(&step_dir(&root, 2));
        for inner in [step_dir(&root, 2), step_dir(&root, 2).join("deeper")] {
            let err = check_writable(&inner, 0).unwrap_err().to_string();
            assert!(err.contains("is inside the checkpoint folder"), "{err}");
            let err = prepare(&inner, 3, "run").unwrap_err().to_string();
            assert!(err.contains("is inside the checkpoint folder"), "{err}");
        }
        assert!(!step_dir(&root, 2).join("deeper").exists());
        assert_eq!(steps(&root), [2]);
        // Another program's manifest.json (a web app's) makes no checkpoint of its folder.
        let app = root.join("app");
        fs::create_dir_all(&app).unwrap();
        fs::write(app.join("manifest.json"), b"{}").unwrap();
        check_writable(&app.join("ckpt"), 0).unwrap();
        assert_eq!(enclosing_checkpoint(&app.join("ckpt")), None);
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn keeping_all_sets_later_steps_aside_whole_and_loadable() {
        let root = scratch("set-aside");
        for n in [5, 10, 20] {
            fake_checkpoint(&step_dir(&root, n));
        }
        // A save that died moving step 30 aside left only `.step-30.old`: it moves too.
        fake_checkpoint(&old_dir(&root, 30));
        let first = root.join("abandoned-1");
        let moved = set_aside_later(&root, 15).unwrap();
        assert_eq!(moved, [20, 30].map(|n| step_dir(&first, n)));
        assert_eq!(steps(&root), [5, 10]);
        assert_eq!(resolve(&first).unwrap(), step_dir(&first, 30));
        // Going back again takes the next free folder; nothing later: nothing moves.
        fake_checkpoint(&step_dir(&root, 12));
        let moved = set_aside_later(&root, 8).unwrap();
        assert_eq!(
            moved,
            [10, 12].map(|n| step_dir(&root.join("abandoned-2"), n))
        );
        assert!(set_aside_later(&root, 8).unwrap().is_empty());
        assert_eq!(steps(&root), [5]);
        assert_eq!(
            steps(&first),
            [20, 30],
            "the first folder is left as it was"
        );
        let _ = fs::remove_dir_all(&root);
    }

    /// A removal that died while deleting files (the folder already renamed to `.del`) leaves
    /// nothing `list` counts, and the next save clears it; before, the half-deleted folder
    /// kept its manifest and stayed "the newest checkpoint" (or failed to load).
    #[test]
    fn a_removal_that_died_part_way_leaves_no_checkpoint_behind() {
        let root = scratch("removal");
        fake_checkpoint(&step_dir(&root, 4));
        fake_checkpoint(&step_dir(&root, 6));
        // What a kill after the rename leaves: the whole folder, manifest and all, under `.del`.
        fs::rename(step_dir(&root, 6), root.join(".step-00000006.del")).unwrap();
        assert_eq!(steps(&root), [4]);
        assert_eq!(resolve(&root).unwrap(), step_dir(&root, 4));
        prepare(&root, 5, "run").unwrap();
        assert!(!root.join(".step-00000006.del").exists());
        let _ = fs::remove_dir_all(&root);
    }
}
