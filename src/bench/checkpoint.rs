//! `ragged bench checkpoint`: a sharded save and load against this disk's sequential write
//! and read bandwidth, measured in the same run on files of the same size, with the heap a
//! rank adds while saving or loading (the counting allocator of [`super::alloc`]).
//!
//! Page cache: every file is fsynced after writing and then dropped from the cache
//! (`posix_fadvise(DONTNEED)`), for the baseline and for the checkpoint alike, so reads come
//! from the disk (as far as the kernel lets a process evict; shared caches below it aside).
//! Before each timed write, as much scratch as will be written is written and deleted, so
//! both sides write into recycled page-cache memory (`prime_page_cache`).

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::bench::alloc;
use crate::checkpoint::{fs as ckpt_fs, CheckpointState, SaveOptions};
use crate::comm::threads::ThreadWorld;
use crate::comm::Communicator;
use crate::demo::{MlpConfig, MlpStages};
use crate::fsdp::{fully_shard, FsdpOptions};
use crate::{Error, Result};

/// What to measure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointBench {
    pub model: MlpConfig,
    pub worlds: Vec<usize>,
    /// Scratch folder: created if absent, and it must be empty (the bench writes `ckpt/`,
    /// `baseline.bin` and `prime.bin` there and removes exactly those, so it never deletes
    /// files of yours).
    pub dir: PathBuf,
    /// Measurements per world size; each rate is the median over them (the disk is shared).
    pub repeats: usize,
}

/// One world size's measurement.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointRow {
    pub world: usize,
    /// Bytes of all rank files.
    pub bytes: u64,
    pub disk_write_gbs: f64,
    pub disk_read_gbs: f64,
    pub save_gbs: f64,
    pub load_gbs: f64,
    /// Heap added above the model while saving / loading, per rank (all ranks' peak over V).
    pub save_extra_per_rank: usize,
    pub load_extra_per_rank: usize,
    /// The largest parameter, f32.
    pub largest_tensor: usize,
    /// Bytes of one rank's file (its parameter and optimizer-state shards).
    pub file_per_rank: u64,
}

const BLOCK: usize = 8 << 20;

/// What the bench writes in its scratch folder: the checkpoint root, the disk baseline's file
/// and the page-cache primer's file.
const CKPT: &str = "ckpt";
const BASELINE_FILE: &str = "baseline.bin";
const PRIME_FILE: &str = "prime.bin";

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |e| Error::io(op, path, e)
}

/// Drops a file's clean pages from the page cache.
fn evict(path: &Path) -> Result<()> {
    let f = File::open(path).map_err(io("bench checkpoint: open", path))?;
    // SAFETY: a valid open descriptor; fadvise only advises the kernel about its pages.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(Error::io(
            "bench checkpoint: fadvise",
            path,
            std::io::Error::from_raw_os_error(rc),
        ));
    }
    Ok(())
}

/// Writes and deletes `bytes` of scratch, so the page cache the next write takes is memory
/// this machine has touched. (In a VM the first touch of a guest page faults on the host:
/// page-cache writes into never-used memory ran 3-8x slower here than into recycled memory,
/// which would favour whichever side runs second.)
fn prime_page_cache(dir: &Path, bytes: u64, block: &[u8]) -> Result<()> {
    let path = dir.join(PRIME_FILE);
    drop(write_blocks(&path, bytes, block)?);
    std::fs::remove_file(&path).map_err(io("bench checkpoint: remove", &path))
}

/// Creates `path` and writes `bytes` of `block` repeated (not synced).
fn write_blocks(path: &Path, bytes: u64, block: &[u8]) -> Result<File> {
    let mut f = File::create(path).map_err(io("bench checkpoint: create", path))?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block.len() as u64) as usize;
        f.write_all(&block[..n])
            .map_err(io("bench checkpoint: write", path))?;
        left -= n as u64;
    }
    Ok(f)
}

/// Random bytes: a storage layer that compresses or deduplicates must not flatter the
/// baseline.
fn random_block() -> Vec<u8> {
    let mut rng = crate::demo::SplitMix(0x5eed);
    (0..BLOCK / 8)
        .flat_map(|_| rng.next_u64().to_le_bytes())
        .collect()
}

/// Sequential write (fsynced) and read of `bytes` in 8 MiB blocks: GB/s each.
fn disk_baseline(dir: &Path, bytes: u64) -> Result<(f64, f64)> {
    let path = dir.join(BASELINE_FILE);
    let block = random_block();
    prime_page_cache(dir, bytes, &block)?;
    let start = Instant::now();
    let f = write_blocks(&path, bytes, &block)?;
    f.sync_all().map_err(io("bench checkpoint: fsync", &path))?;
    let write = start.elapsed().as_secs_f64();
    drop(f);
    evict(&path)?;
    let mut buf = vec![0u8; BLOCK];
    let start = Instant::now();
    let mut f = File::open(&path).map_err(io("bench checkpoint: open", &path))?;
    while f
        .read(&mut buf)
        .map_err(io("bench checkpoint: read", &path))?
        > 0
    {}
    let read = start.elapsed().as_secs_f64();
    std::fs::remove_file(&path).map_err(io("bench checkpoint: remove", &path))?;
    Ok((bytes as f64 / write / 1e9, bytes as f64 / read / 1e9))
}

/// Evicts every file of the newest checkpoint under `root`.
fn evict_checkpoint(root: &Path) -> Result<()> {
    let dir = ckpt_fs::resolve(root)?;
    for e in std::fs::read_dir(&dir).map_err(io("bench checkpoint: list", &dir))? {
        evict(&e.map_err(io("bench checkpoint: list", &dir))?.path())?;
    }
    Ok(())
}

/// Runs every world size with `optimizer`'s state.
pub fn run<O: CheckpointState + Clone>(
    cfg: &CheckpointBench,
    optimizer: O,
    mut progress: impl FnMut(&str),
) -> Result<Vec<CheckpointRow>> {
    let created = claim_scratch(&cfg.dir)?;
    let rows = run_worlds(cfg, optimizer, &mut progress);
    remove_scratch(&cfg.dir);
    if created {
        let _ = std::fs::remove_dir(&cfg.dir);
    }
    rows
}

/// Removes everything the bench may have left in `dir`, whether it ended or failed part way (a
/// full disk stops it mid-file, and the disk it filled must be given back); nothing else.
fn remove_scratch(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir.join(CKPT));
    for file in [BASELINE_FILE, PRIME_FILE] {
        let _ = std::fs::remove_file(dir.join(file));
    }
}

/// Prefix of the default scratch folders, under the system's temporary folder; this process's
/// is [`default_scratch`].
const SCRATCH_PREFIX: &str = "ragged-bench-checkpoint-";

/// This process's default scratch folder (`$TMPDIR/ragged-bench-checkpoint-PID`).
pub fn default_scratch() -> PathBuf {
    std::env::temp_dir().join(format!("{SCRATCH_PREFIX}{}", std::process::id()))
}

/// Removes what benches that were interrupted (Ctrl-C, a kill: no cleanup runs) left in their
/// default scratch folders, gigabytes at the default size: folders of processes that no
/// longer run (no `/proc/PID`), and in them only the files a bench writes, then the folder if
/// that empties it. Returns the folders removed.
pub fn remove_abandoned_scratch() -> Vec<PathBuf> {
    let left =
        crate::checkpoint::fs::left_by_ended_processes(&std::env::temp_dir(), SCRATCH_PREFIX);
    left.into_iter()
        .filter(|dir| dir.is_dir())
        .filter(|dir| {
            remove_scratch(dir);
            std::fs::remove_dir(dir).is_ok()
        })
        .collect()
}

/// Creates the scratch folder `dir` if absent (`Ok(true)`); `Err` if it holds anything.
fn claim_scratch(dir: &Path) -> Result<bool> {
    match std::fs::read_dir(dir) {
        Ok(mut entries) => match entries.next() {
            None => Ok(false),
            Some(_) => Err(Error::BadInput {
                op: "bench checkpoint",
                what: format!("--dir {}", dir.display()),
                reason: "is not empty: name an empty or new folder for the bench's scratch files"
                    .into(),
            }),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir).map_err(io("bench checkpoint: create", dir))?;
            Ok(true)
        }
        Err(e) => Err(io("bench checkpoint: open", dir)(e)),
    }
}

fn run_worlds<O: CheckpointState + Clone>(
    cfg: &CheckpointBench,
    optimizer: O,
    progress: &mut impl FnMut(&str),
) -> Result<Vec<CheckpointRow>> {
    let params = cfg.model.init_params(0)?;
    let largest = params
        .iter()
        .map(|(_, t)| 4 * t.elem_count())
        .max()
        .unwrap_or(0);
    let mut rows = Vec::new();
    for &world in &cfg.worlds {
        let mut runs = Vec::with_capacity(cfg.repeats);
        for i in 0..cfg.repeats.max(1) {
            progress(&format!(
                "V={world}: save, load and the disk baseline ({})",
                i + 1
            ));
            // Every other run measures the baseline first, so neither side always meets the
            // disk state (write-back, burst credit) the other left behind.
            let first: Option<&CheckpointRow> = runs.first();
            let baseline_first = first.filter(|_| i % 2 == 1).map(|r| r.bytes);
            runs.push(measure(
                cfg,
                &params,
                optimizer.clone(),
                world,
                baseline_first,
            )?);
        }
        let median = |f: &dyn Fn(&CheckpointRow) -> f64| {
            let mut v: Vec<f64> = runs.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let mut row = runs[0].clone();
        row.disk_write_gbs = median(&|r| r.disk_write_gbs);
        row.disk_read_gbs = median(&|r| r.disk_read_gbs);
        row.save_gbs = median(&|r| r.save_gbs);
        row.load_gbs = median(&|r| r.load_gbs);
        row.save_extra_per_rank = runs
            .iter()
            .map(|r| r.save_extra_per_rank)
            .max()
            .unwrap_or(0);
        row.load_extra_per_rank = runs
            .iter()
            .map(|r| r.load_extra_per_rank)
            .max()
            .unwrap_or(0);
        row.largest_tensor = largest;
        rows.push(row);
    }
    Ok(rows)
}

/// One save, load and disk baseline at `world` ranks.
fn measure<O: CheckpointState + Clone>(
    cfg: &CheckpointBench,
    params: &[(String, candle_core::Tensor)],
    optimizer: O,
    world: usize,
    baseline_first: Option<u64>,
) -> Result<CheckpointRow> {
    let root = cfg.dir.join(CKPT);
    let _ = std::fs::remove_dir_all(&root);
    let early = baseline_first
        .map(|b| disk_baseline(&cfg.dir, b))
        .transpose()?;
    let times = ThreadWorld::run(world, |c| {
        save_and_load(cfg.model, params, optimizer.clone(), c, &root)
    })?;
    let (save_s, load_s, save_extra, load_extra, bytes) = times[0];
    let _ = std::fs::remove_dir_all(&root);
    let (w, r) = match early {
        Some(rates) => rates,
        None => disk_baseline(&cfg.dir, bytes)?,
    };
    Ok(CheckpointRow {
        world,
        bytes,
        disk_write_gbs: w,
        disk_read_gbs: r,
        save_gbs: bytes as f64 / save_s / 1e9,
        load_gbs: bytes as f64 / load_s / 1e9,
        save_extra_per_rank: save_extra / world,
        load_extra_per_rank: load_extra / world,
        largest_tensor: 0,
        file_per_rank: bytes / world as u64,
    })
}

type Times = (f64, f64, usize, usize, u64);

/// One rank: a model stepped once (so the state is not zeros), then a timed save and load;
/// rank 0 times them between barriers and reads the heap peaks.
fn save_and_load<O: CheckpointState>(
    model: MlpConfig,
    params: &[(String, candle_core::Tensor)],
    optimizer: O,
    c: &dyn Communicator,
    root: &Path,
) -> Result<Times> {
    let mut m = fully_shard(params, optimizer, c, FsdpOptions::default())?;
    let batch = model.batch(0, 8)?;
    m.forward_backward(&MlpStages(model), &batch)?;
    m.step()?;
    let timed = |what: &mut dyn FnMut() -> Result<()>| -> Result<(f64, usize)> {
        c.barrier()?;
        let (before, start) = (alloc::current(), Instant::now());
        if c.rank() == 0 {
            alloc::reset_peak();
        }
        c.barrier()?;
        what()?;
        c.barrier()?;
        Ok((
            start.elapsed().as_secs_f64(),
            alloc::peak().saturating_sub(before),
        ))
    };
    if c.rank() == 0 {
        // Master and two moments, f32: about the checkpoint's size.
        let numel: usize = params.iter().map(|(_, t)| t.elem_count()).sum();
        let scratch = root.parent().unwrap_or(root);
        prime_page_cache(scratch, 12 * numel as u64, &random_block())?;
    }
    let mut bytes = 0;
    let (save_s, save_extra) = timed(&mut || {
        bytes = m.save(root, &SaveOptions::default())?.bytes;
        Ok(())
    })?;
    if c.rank() == 0 {
        evict_checkpoint(root)?;
    }
    let (load_s, load_extra) = timed(&mut || m.load(root).map(drop))?;
    Ok((save_s, load_s, save_extra, load_extra, bytes))
}

/// The rows as a markdown table.
pub fn markdown(rows: &[CheckpointRow]) -> String {
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let mut s = String::from(
        "| V | checkpoint MB | disk write GB/s | save GB/s | save / disk | disk read GB/s | \
         load GB/s | load / disk | rank file MiB | largest tensor MiB | save extra MiB/rank | \
         load extra MiB/rank |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s += &format!(
            "| {} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            r.world,
            r.bytes as f64 / 1e6,
            r.disk_write_gbs,
            r.save_gbs,
            r.save_gbs / r.disk_write_gbs,
            r.disk_read_gbs,
            r.load_gbs,
            r.load_gbs / r.disk_read_gbs,
            mib(r.file_per_rank as usize),
            mib(r.largest_tensor),
            mib(r.save_extra_per_rank),
            mib(r.load_extra_per_rank),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a failed run leaves (a save cut off, a baseline or primer file part written) is
    /// removed; a file the bench did not write is kept.
    #[test]
    fn remove_scratch_removes_every_file_the_bench_writes_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("ragged-scratch-{}", std::process::id()));
        std::fs::create_dir_all(dir.join(CKPT).join("step-00000001")).unwrap();
        for file in [BASELINE_FILE, PRIME_FILE, "yours.txt"] {
            std::fs::write(dir.join(file), b"x").unwrap();
        }
        remove_scratch(&dir);
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["yours.txt"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Default scratch folders of processes that no longer run are emptied of the bench's
    /// files and removed; a file of the user's keeps its folder, and a running process's
    /// folder (this one's) is left alone.
    #[test]
    fn abandoned_default_scratch_folders_are_removed_and_nothing_else() {
        let tmp = std::env::temp_dir();
        // Above any pid_max (2^22 at most): no such process.
        let dead = tmp.join(format!("{SCRATCH_PREFIX}4294967000"));
        let dead_kept = tmp.join(format!("{SCRATCH_PREFIX}4294967001"));
        let live = default_scratch();
        for dir in [&dead, &dead_kept, &live] {
            std::fs::create_dir_all(dir.join(CKPT).join("step-00000001")).unwrap();
            std::fs::write(dir.join(BASELINE_FILE), b"x").unwrap();
        }
        std::fs::write(dead_kept.join("yours.txt"), b"x").unwrap();
        let removed = remove_abandoned_scratch();
        assert!(removed.contains(&dead) && !dead.exists(), "{removed:?}");
        assert!(!removed.contains(&dead_kept) && dead_kept.join("yours.txt").exists());
        assert!(!dead_kept.join(BASELINE_FILE).exists());
        assert!(live.join(BASELINE_FILE).exists() && !removed.contains(&live));
        for dir in [&dead_kept, &live] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}
