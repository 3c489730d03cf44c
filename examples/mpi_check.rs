//! The MPI backend held to the thread backend; run under `mpirun -np V` (`.ci/run` does, with
//! V = 3 and 4, and with V = 3 again where rank 1 sets `RAGGED_MPI_MESSAGE_BYTES=7`, so every
//! data phase moves as point-to-point messages of 7 bytes):
//!
//! ```sh
//! cargo build --release --features mpi --example mpi_check
//! mpirun --allow-run-as-root --oversubscribe -np 3 target/release/examples/mpi_check
//! ```
//!
//! Each rank checks, and prints one line:
//! 1. every collective ([`exercise`]) gives bitwise the result rank `r` of a `V`-thread world
//!    gives in this same process;
//! 2. ranks that disagree (a rank-dependent buffer length, a rank-dependent segment layout in
//!    `all_gather_segments`) all get an `Err`, and the world still works afterwards;
//! 3. a sharded Muon step whose matrices are split over the ranks (gathered to their roots
//!    with MPI's all-to-all) equals the unsharded step on this rank's elements, bitwise;
//! 4. a checkpoint the MPI ranks save (two AdamW steps of the demo transformer) loads on 2
//!    thread ranks in each process with the parameters the MPI run ended with (digests equal),
//!    and those equal a `V`-thread run's; the MPI run copied nothing outside collectives (its
//!    gathers write the parameters' storages, its reduce-scatters the gradient shards);
//! 5. groups split from the world (`Communicator::split`, ranks by parity) run every collective
//!    as a thread world of their size does, a group's disagreement names the group by its
//!    ranks in the world, and HSDP training with Muon
//!    (`FsdpOptions::replicas`, the smallest divisor of `V` above 1) ends with the parameters of
//!    the same HSDP run on thread ranks (digests equal); its checkpoint's files are shared
//!    out over the replicas (the file of shard rank `j` from replica `j mod R`), as the bytes
//!    the kernel counted each process writing show, and so is loading it (the rank that wrote
//!    a file reads it back and sends the values to the other replicas, by the bytes the kernel
//!    counted each process reading) into a model that then holds the saved parameters.
//!
//! `--memory` instead checks a reduce-scatter's peak memory, `--large` buffers past MPI's `int`
//! counts (see `--help`).
//!
//! Exits with status 1 on any failure.
//!
//! `mpi_check --fail-rank R --fail-how err|panic|leave|stall|stall-at-end|stall-in-group|stop`
//! instead checks how a failing rank ends the job: every rank enters a barrier except rank
//! `R`, which returns an `Err` (passed to [`MpiComm::abort_job`]), panics, returns from `main`
//! with success (dropping its communicator), or stays alive without calling MPI again
//! (`stall-at-end`: while the others return from `main`; `stall-in-group`: after splitting the
//! world into the ranks below `R` and the rest, whose others wait in their group's barrier, so
//! `R` is rank 0 there); or (`stop`) every rank moves large all-gathers and rank `R` stops
//! itself with `SIGSTOP`, nearly always inside one's transfers. The job must end with a
//! message naming rank `R` (as a rank of the world) and the `MPI_Abort` code as `mpirun`'s
//! status (1, 101, 1, 1, 1, 1, 1), not hang: at once for the first three, after
//! `RAGGED_MPI_TIMEOUT_S` for the others; `.ci/run` checks all seven under `timeout`.

use std::path::PathBuf;
use std::process::ExitCode;

use half::bf16;
use ragged::checkpoint::fs::step_dir;
use ragged::checkpoint::manifest::rank_file;
use ragged::comm::conformance::exercise;
use ragged::comm::mpi::{MpiComm, FOLD_CHUNK, FOLD_WINDOW};
use ragged::comm::threads::ThreadWorld;
use ragged::comm::{Buf, BufMut, Communicator, ReduceOp, Segment, SingleRank};
use ragged::demo::{
    train_rank_with, Checkpointing, SplitMix, StepReport, TrainMode, TransformerConfig,
};
use ragged::fsdp::{fully_shard, FsdpOptions};
use ragged::model::{DType, TensorSpec, Unit};
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::{plan_unit, PlanOptions};
use ragged::{AtomicBlock, Result};
use ragged_optimizers::{AdamW, AdamWConfig, Muon, MuonConfig, NsConfig, NsPrecision};

/// One check: `Some(passed)`, or `None` when it needs more ranks than this world has.
type Check = fn(&MpiComm) -> Result<Option<bool>>;
/// One check that runs instead of the others (`--large`, `--memory`): passed or not.
type Mode = fn(&MpiComm) -> Result<bool>;

/// What `--help` prints.
const USAGE: &str = "\
mpi_check: the MPI backend held to the thread backend (collectives, disagreeing ranks, sharded
Muon, a checkpoint saved over MPI, groups and HSDP); run under mpirun, e.g.
  mpirun --allow-run-as-root --oversubscribe -np 3 target/release/examples/mpi_check

Usage: mpi_check [--large | --memory | --fail-rank R --fail-how HOW]

  --large                        instead move buffers past MPI's int counts (over 2 GiB; about
                                 4 GiB of memory per rank): all-gather, reduce-scatter,
                                 broadcast and all-reduce, each checked element by element
  --memory                       instead reduce-scatter 64 MiB slices of f32, then of bf16
                                 (V + 1 of them per rank) and check, by the peak resident
                                 memory the kernel counts, that each call holds no more than
                                 FOLD_WINDOW peers' chunks of FOLD_CHUNK elements and an
                                 accumulator of one beyond its buffers (not V slices)

  --fail-rank R --fail-how HOW   instead check how rank R failing ends the job; HOW is err,
                                 panic, leave, stall, stall-at-end (while the others return
                                 from main), stall-in-group (the ranks from R on wait in a
                                 group's barrier, the others in the world's) or stop (SIGSTOP
                                 inside large all-gathers); the job must end with a message
                                 naming R
  -h, --help                     print this and exit";

fn main() -> ExitCode {
    // Before MPI starts: a help request is not bad input to abort the job over.
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let comm = match MpiComm::init() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mpi_check: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (rank, world) = (comm.rank(), comm.world_size());
    let modes: [(&str, &str, Mode); 2] = [
        ("--large", "buffers past MPI's int counts", large_buffers),
        (
            "--memory",
            "a reduce-scatter's memory",
            reduce_scatter_memory,
        ),
    ];
    for (flag, what, check) in modes {
        if std::env::args().skip(1).eq([flag.to_string()]) {
            let verdict = match check(&comm) {
                Ok(true) => "ok".to_string(),
                Ok(false) => "MISMATCH".to_string(),
                Err(e) => format!("ERROR {e}"),
            };
            println!("mpi_check rank {rank}/{world}: {what}: {verdict}");
            return match verdict.as_str() {
                "ok" => ExitCode::SUCCESS,
                _ => ExitCode::FAILURE,
            };
        }
    }
    match failure_mode() {
        Ok(Some((bad, FailHow::Leave))) if rank == bad => {
            // Returns early, as a program whose loop ends sooner does: dropping the
            // communicator posts this rank's leaving, and the others must fail, not wait.
            drop(comm);
            return ExitCode::SUCCESS;
        }
        Ok(Some((bad, FailHow::StallAtEnd))) if rank != bad => {
            // The others end their program while rank `bad` never calls again: the drop's
            // leaving exchange must not wait for it for ever either.
            drop(comm);
            return ExitCode::SUCCESS;
        }
        Ok(Some((bad, how))) => fail_on(&comm, bad, how),
        Ok(None) => {}
        Err(e) => comm.abort_job(&e),
    }
    let checks: [(&str, Check); 5] = [
        ("collectives equal the thread backend", collectives),
        ("disagreeing ranks all get an Err", disagreement),
        ("sharded Muon equals unsharded", sharded_muon),
        (
            "a checkpoint saved over MPI loads on thread ranks",
            checkpoint,
        ),
        ("groups and HSDP equal the thread backend", groups_and_hsdp),
    ];
    let mut ok = true;
    for (what, check) in checks {
        let verdict = match check(&comm) {
            Ok(Some(true)) => "ok".to_string(),
            Ok(Some(false)) => "MISMATCH".to_string(),
            Ok(None) => "skipped (needs 2 or more ranks)".to_string(),
            Err(e) => format!("ERROR {e}"),
        };
        ok &= verdict == "ok" || verdict.starts_with("skipped");
        println!("mpi_check rank {rank}/{world}: {what}: {verdict}");
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// How `--fail-rank R --fail-how ...` asks a rank to fail.
#[derive(Clone, Copy)]
enum FailHow {
    Err,
    Panic,
    /// Return from `main` with success, dropping the communicator.
    Leave,
    /// Stay alive and never call MPI again (a rank stuck in its own work).
    Stall,
    /// As `Stall`, while the other ranks return from `main` instead of entering a barrier.
    StallAtEnd,
    /// As `Stall`, after a split into the ranks below the failing one and the rest: the
    /// failing rank's group waits in a group barrier, the others in the world's.
    StallInGroup,
    /// Stop (`SIGSTOP`, as a debugger or a frozen node would) while every rank moves large
    /// all-gathers: nearly always inside one's transfers, after its descriptor exchange.
    Stop,
}

/// The failure mode from the command line: `None` for the ordinary checks.
fn failure_mode() -> Result<Option<(usize, FailHow)>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .map(|i| args.get(i + 1).cloned().unwrap_or_default())
    };
    let bad_arg = |what: String| ragged::Error::BadInput {
        op: "mpi_check",
        what,
        reason: "usage: mpi_check [--fail-rank R --fail-how \
             err|panic|leave|stall|stall-at-end|stall-in-group|stop]"
            .into(),
    };
    let (Some(rank), Some(how)) = (value("--fail-rank"), value("--fail-how")) else {
        return match args.is_empty() {
            true => Ok(None),
            false => Err(bad_arg(args.join(" "))),
        };
    };
    let rank = rank
        .parse()
        .map_err(|_| bad_arg(format!("--fail-rank {rank}")))?;
    let how = match how.as_str() {
        "err" => FailHow::Err,
        "panic" => FailHow::Panic,
        "leave" => FailHow::Leave,
        "stall" => FailHow::Stall,
        "stall-at-end" => FailHow::StallAtEnd,
        "stall-in-group" => FailHow::StallInGroup,
        "stop" => FailHow::Stop,
        _ => return Err(bad_arg(format!("--fail-how {how}"))),
    };
    Ok(Some((rank, how)))
}

/// Rank `bad` fails while every other rank waits in a barrier (or, for `Stop`, in transfers);
/// the job must end here.
fn fail_on(comm: &MpiComm, bad: usize, how: FailHow) -> ! {
    if let FailHow::Stop = how {
        comm.abort_job(&stop_in_transfers(comm, bad))
    }
    let split = match how {
        FailHow::StallInGroup => Some(comm.split(usize::from(comm.rank() >= bad))),
        _ => None,
    };
    let group = match split.transpose() {
        Ok(group) => group,
        Err(e) => comm.abort_job(&e),
    };
    let result = if comm.rank() == bad {
        match how {
            FailHow::Err => Err(ragged::Error::Msg(format!(
                "rank {bad} fails on purpose (--fail-how err)"
            ))),
            FailHow::Panic => panic!("rank {bad} panics on purpose (--fail-how panic)"),
            FailHow::Leave => unreachable!("rank {bad} returned from main"),
            FailHow::Stop => unreachable!("handled above"),
            // Until the others' wait runs out and their MPI_Abort ends this process too.
            FailHow::Stall | FailHow::StallAtEnd | FailHow::StallInGroup => loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            },
        }
    } else {
        match &group {
            Some(g) if comm.rank() > bad => g.barrier(),
            _ => comm.barrier(),
        }
    };
    let e = result.err().unwrap_or_else(|| {
        ragged::Error::Msg(format!(
            "rank {} passed a barrier that rank {bad} never entered",
            comm.rank()
        ))
    });
    comm.abort_job(&e)
}

/// Every rank all-gathers 32 MiB a rank, over and over, while rank `bad` stops itself after
/// 300 ms; the others' wait must run out and end the job. Returns the error to abort with if
/// the job goes on for 60 s instead.
fn stop_in_transfers(comm: &MpiComm, bad: usize) -> ragged::Error {
    if comm.rank() == bad {
        std::thread::spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(300));
            // SAFETY: raising a signal has no memory effects; SIGSTOP stops the whole process.
            unsafe { libc::raise(libc::SIGSTOP) };
        });
    }
    let n = 8 << 20;
    let mine = vec![comm.rank() as f32; n];
    let mut all = vec![0f32; n * comm.world_size()];
    let start = std::time::Instant::now();
    while start.elapsed() < std::time::Duration::from_secs(60) {
        if let Err(e) = comm.all_gather(Buf::F32(&mine), BufMut::F32(&mut all)) {
            return e;
        }
    }
    ragged::Error::Msg(format!(
        "rank {} moved all-gathers for 60 s although rank {bad} stopped",
        comm.rank()
    ))
}

/// Buffers of more than 2³¹ − 1 bytes (MPI's `int` counts), which the backend moves as
/// point-to-point messages of at most that size: an all-gather into `2^31 + 8·V` bytes, a
/// reduce-scatter of as many (sums), a broadcast of `2^31 + 12` bytes and an all-reduce of
/// as many, checked element by element. The values are small integers, so every sum is exact
/// in f32.
fn large_buffers(comm: &MpiComm) -> Result<bool> {
    let (v, r) = (comm.world_size(), comm.rank());
    let s = (1usize << 29) / v + 2; // f32 elements per rank: V·S·4 > 2^31 bytes
    let value = |rank: usize, i: usize| ((i % 1013) + 7 * rank) as f32;
    let mut ok = true;
    {
        let send: Vec<f32> = (0..s).map(|i| value(r, i)).collect();
        let mut full = vec![0f32; v * s];
        comm.all_gather((&send[..]).into(), (&mut full[..]).into())?;
        ok &= full
            .chunks(s)
            .enumerate()
            .all(|(j, part)| part.iter().enumerate().all(|(i, &x)| x == value(j, i)));
    }
    {
        let mut full: Vec<f32> = (0..v * s).map(|i| value(r, i)).collect();
        let mut own = vec![0f32; s];
        comm.reduce_scatter((&mut full[..]).into(), (&mut own[..]).into(), ReduceOp::Sum)?;
        let sum = |i: usize| (0..v).map(|j| value(j, r * s + i)).sum::<f32>();
        ok &= own.iter().enumerate().all(|(i, &x)| x == sum(i));
    }
    {
        let n = (1usize << 29) + 3; // 2^31 + 12 bytes
        let mut buf: Vec<f32> = match r {
            0 => (0..n).map(|i| value(5, i)).collect(),
            _ => vec![0f32; n],
        };
        comm.broadcast((&mut buf[..]).into(), 0)?;
        ok &= buf.iter().enumerate().all(|(i, &x)| x == value(5, i));
        // The same length summed over the ranks in place (HSDP's replica all-reduce of a
        // large gradient shard).
        buf.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = value(r, i));
        comm.all_reduce((&mut buf[..]).into(), ReduceOp::Sum)?;
        let sum = |i: usize| (0..v).map(|j| value(j, i)).sum::<f32>();
        ok &= buf.iter().enumerate().all(|(i, &x)| x == sum(i));
    }
    comm.barrier()?;
    Ok(ok)
}

/// `--memory`: reduce-scatters of `V` slices of 64 MiB (sums of small integers, exact in
/// either type, checked element by element) hold no more than a fold of [`FOLD_CHUNK`]
/// elements needs beyond their input and output, whatever `V`: [`FOLD_WINDOW`] peers' pieces
/// of a chunk and an `f32` accumulator of one, not the `V` slices a receive of every peer's
/// slice at once takes. Measured as the growth of the peak resident memory the kernel counts
/// (`VmHWM`, reset through `/proc/self/clear_refs` right before the call) over the resident
/// memory then, with 16 MiB for MPI's own buffers.
fn reduce_scatter_memory(comm: &MpiComm) -> Result<bool> {
    let value = |rank: usize, i: usize| ((i % 13) + rank) as f32;
    let f32s = reduce_scatter_peak(comm, "f32", value)?;
    let bf16s = reduce_scatter_peak(comm, "bf16", |r, i| bf16::from_f32(value(r, i)))?;
    Ok(f32s && bf16s)
}

/// One reduce-scatter of [`reduce_scatter_memory`], of `T` (accumulated in `f32`), with
/// element `i` of rank `r`'s buffer `value(r, i)`.
fn reduce_scatter_peak<T>(
    comm: &MpiComm,
    name: &str,
    value: impl Fn(usize, usize) -> T,
) -> Result<bool>
where
    T: Copy + PartialEq + Into<f32>,
    for<'a> BufMut<'a>: From<&'a mut [T]>,
{
    let (v, r, es) = (comm.world_size(), comm.rank(), std::mem::size_of::<T>());
    let s = (64usize << 20) / es; // elements per slice: 64 MiB
    let mut full: Vec<T> = (0..v * s).map(|i| value(r, i)).collect();
    let mut own = vec![value(0, 1); s]; // written, so resident before the call
    comm.barrier()?;
    std::fs::write("/proc/self/clear_refs", "5")
        .map_err(|e| ragged::Error::Msg(format!("resetting the peak RSS: {e}")))?;
    let before = proc_status_kib("VmRSS")?;
    comm.reduce_scatter((&mut full[..]).into(), (&mut own[..]).into(), ReduceOp::Sum)?;
    let grew = proc_status_kib("VmHWM")?.saturating_sub(before);
    let sum = |i: usize| (0..v).map(|j| value(j, r * s + i).into()).sum::<f32>();
    let right = own.iter().enumerate().all(|(i, &x)| x.into() == sum(i));
    let fold_bytes = FOLD_CHUNK * (FOLD_WINDOW.min(v - 1) * es + 4);
    let bound = (fold_bytes / 1024) as u64 + 16 * 1024;
    println!(
        "mpi_check rank {r}/{v}: the {name} reduce-scatter's peak grew {} MiB (bound {} MiB; \
         all {v} slices: {} MiB)",
        grew / 1024,
        bound / 1024,
        v * 64
    );
    comm.barrier()?;
    Ok(right && grew <= bound)
}

/// A `kB` line of `/proc/self/status` (`VmRSS`, `VmHWM`), in KiB.
fn proc_status_kib(key: &str) -> Result<u64> {
    proc_field("status", key)
}

/// The number on line `key:` of `/proc/self/<file>` (a trailing unit, `kB`, dropped).
fn proc_field(file: &str, key: &str) -> Result<u64> {
    let path = format!("/proc/self/{file}");
    let text =
        std::fs::read_to_string(&path).map_err(|e| ragged::Error::Msg(format!("{path}: {e}")))?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|n| n.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| ragged::Error::Msg(format!("no {key} line in {path}")))
}

fn collectives(comm: &MpiComm) -> Result<Option<bool>> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let threads = ThreadWorld::run(world, |c| exercise(c))?;
    Ok(Some(exercise(comm)? == threads[rank]))
}

fn disagreement(comm: &MpiComm) -> Result<Option<bool>> {
    if comm.world_size() < 2 {
        return Ok(None);
    }
    let mut x = vec![0f32; 6 * comm.world_size() + comm.rank()];
    let refused = comm.all_gather_in_place((&mut x[..]).into()).is_err();
    comm.barrier()?;
    // Segments laid out differently on rank 1 (each rank sends only the pieces the layout
    // covers, so the layouts must agree): refused on every rank, not a hang.
    let send = [1f32; 4];
    let mut part = [0f32; 3];
    let offset = if comm.rank() == 1 { 1 } else { 0 };
    let mut segments = [Segment {
        offset,
        buf: (&mut part[..]).into(),
    }];
    let other_layout = comm
        .all_gather_segments((&send[..]).into(), &mut segments)
        .is_err();
    comm.barrier()?;
    Ok(Some(refused && other_layout))
}

/// An empty checkpoint folder in the temporary directory (rank 0 clears the last run's) and
/// checkpointing into it.
fn fresh_checkpoints(comm: &MpiComm, name: &str) -> Result<(PathBuf, Checkpointing)> {
    let world = comm.world_size();
    let dir = std::env::temp_dir().join(format!("ragged-mpi-check-{name}-{world}"));
    if comm.rank() == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    comm.barrier()?;
    let ckpt = Checkpointing {
        dir: Some(dir.clone()),
        ..Checkpointing::default()
    };
    Ok((dir, ckpt))
}

fn checkpoint(comm: &MpiComm) -> Result<Option<bool>> {
    let world = comm.world_size();
    let cfg = TransformerConfig::TINY;
    let params = cfg.init_params(3)?;
    let adamw = || AdamW::new(AdamWConfig::default());
    let (dir, ckpt) = fresh_checkpoints(comm, "checkpoint")?;
    let job = (cfg, TrainMode::UnitByUnit, 2, 2 * world);
    let opts = FsdpOptions::default();
    let mut copied = u64::MAX;
    let on_step = |_: usize, r: &StepReport| copied = r.copied_bytes;
    let mpi = train_rank_with(&params, adamw()?, comm, opts.clone(), job, &ckpt, on_step)?;
    let none = Checkpointing::default();
    let threads = ThreadWorld::run(world, |c| {
        train_rank_with(&params, adamw()?, c, opts.clone(), job, &none, |_, _| {})
    })?;
    let loaded = ThreadWorld::run(2, |c| {
        let mut m = fully_shard(&params, adamw()?, c, opts.clone())?;
        m.load(&dir)?;
        m.param_digest()
    })?;
    comm.barrier()?;
    Ok(Some(
        loaded.iter().all(|d| *d == mpi.digest) && threads[0].digest == mpi.digest && copied == 0,
    ))
}

fn groups_and_hsdp(comm: &MpiComm) -> Result<Option<bool>> {
    let world = comm.world_size();
    if world < 2 {
        return Ok(None);
    }
    let group = comm.split(comm.rank() % 2)?;
    let threads = ThreadWorld::run(group.world_size(), |c| exercise(c))?;
    let same_collectives = exercise(&*group)? == threads[group.rank()];
    // A group's disagreement is an Err on each member that names the group by world ranks.
    let members: Vec<usize> = (0..world).filter(|j| j % 2 == comm.rank() % 2).collect();
    let mut x = vec![0f32; 6 * group.world_size() + group.rank()];
    let refused = group.all_gather_in_place((&mut x[..]).into()).err();
    let named = match refused {
        Some(e) => e
            .to_string()
            .contains(&format!("in the group of ranks {members:?}")),
        None => members.len() == 1, // a group of one agrees with itself
    };
    group.barrier()?;
    drop(group);
    let replicas = (2..=world)
        .find(|r| world % r == 0)
        .expect("world itself divides");
    let cfg = TransformerConfig::TINY;
    let params = cfg.init_params(5)?;
    let opts = FsdpOptions {
        replicas,
        ..FsdpOptions::default()
    };
    let job = (cfg, TrainMode::UnitByUnit, 2, 2 * world);
    let none = Checkpointing::default();
    let (dir, ckpt) = fresh_checkpoints(comm, "hsdp")?;
    // Muon: its matrices gathered to their roots within each shard group.
    let muon = || Muon::new(MuonConfig::default());
    let before = proc_io("wchar")?;
    let mpi = train_rank_with(&params, muon()?, comm, opts.clone(), job, &ckpt, |_, _| {})?;
    let wrote = proc_io("wchar")? - before;
    // The replicas share the checkpoint's files: shard rank j's from replica j mod R.
    let shards = world / replicas;
    let j = comm.rank() % shards;
    let writes_file = comm.rank() == (j % replicas) * shards + j;
    let file = step_dir(&dir, 2).join(rank_file(j, shards));
    let file_bytes = std::fs::metadata(&file)
        .map_err(|e| ragged::Error::Msg(format!("{}: {e}", file.display())))?
        .len();
    let shared = match writes_file {
        true => wrote >= file_bytes,
        false => wrote < file_bytes / 4,
    };
    // Loaded by a model initialized otherwise: the writers read, the others receive.
    let mut m = fully_shard(&cfg.init_params(6)?, muon()?, comm, opts.clone())?;
    let before = proc_io("rchar")?;
    m.load(&dir)?;
    let read = proc_io("rchar")? - before;
    let loaded = m.param_digest()? == mpi.digest;
    drop(m);
    // Every rank reads the manifest; only the writer its file.
    let manifest = std::fs::metadata(step_dir(&dir, 2).join("manifest.json"))
        .map_err(|e| ragged::Error::Msg(format!("the manifest: {e}")))?
        .len();
    let read_shared = match writes_file {
        true => read >= file_bytes,
        false => read < manifest + file_bytes / 4,
    };
    let threads = ThreadWorld::run(world, |c| {
        train_rank_with(&params, muon()?, c, opts.clone(), job, &none, |_, _| {})
    })?;
    comm.barrier()?;
    Ok(Some(
        same_collectives
            && named
            && shared
            && loaded
            && read_shared
            && threads.iter().all(|t| t.digest == mpi.digest),
    ))
}

/// Bytes this process has written (`wchar`) or read (`rchar`) so far, as the kernel counts
/// them in `/proc/self/io`: every `write` or `read`, of files or not.
fn proc_io(key: &str) -> Result<u64> {
    proc_field("io", key)
}

fn sharded_muon(comm: &MpiComm) -> Result<Option<bool>> {
    if comm.world_size() < 2 {
        return Ok(None);
    }
    let specs = [
        ("w0", vec![48, 32]),
        ("w1", vec![48, 32]),
        ("w2", vec![40, 24]),
        ("b", vec![7]),
    ]
    .into_iter()
    .map(|(n, s)| TensorSpec::new(n.to_string(), &s, DType::F32))
    .collect::<Result<Vec<_>>>()?;
    // f32 Newton–Schulz, and bf16 (its split matrices then travel in bf16).
    let bf16 = MuonConfig {
        ns: NsConfig {
            precision: NsPrecision::Bf16,
            ..NsConfig::default()
        },
        ..MuonConfig::default()
    };
    let mut all_same = true;
    for config in [MuonConfig::default(), bf16] {
        all_same &= sharded_muon_with(comm, &specs, Muon::new(config)?)?;
    }
    Ok(Some(all_same))
}

/// [`sharded_muon`] with one configuration: whether this rank's elements equal the unsharded
/// run's bit for bit, with matrices split.
fn sharded_muon_with(comm: &MpiComm, specs: &[TensorSpec], opt: Muon) -> Result<bool> {
    let rank = comm.rank();
    let world = comm.world_size();
    // Row-granular blocks, so the planner splits matrices between ranks.
    let unit = Unit {
        name: "unit".into(),
        tensors: specs.iter().collect(),
    };
    let plan = plan_unit(
        &unit,
        &|_| AtomicBlock::Rows(1),
        world,
        &PlanOptions::default(),
    )?;
    let shard = LocalShard::from_plan(&plan, rank)?;
    let whole = LocalShard::unsharded(
        specs.iter().map(|t| (t.name.as_str(), &t.shape[..])),
        &|n, s| opt.atomic_block(n, s),
    )?;
    let mut rng = SplitMix(5);
    let mut globals = |scale: f32| -> Vec<Vec<f32>> {
        specs
            .iter()
            .map(|t| (0..t.numel()).map(|_| scale * rng.uniform()).collect())
            .collect()
    };
    let p0 = globals(1.0);
    let grads: Vec<Vec<Vec<f32>>> = (0..3).map(|_| globals(0.1)).collect();
    let run = |shard: &LocalShard, comm: &dyn Communicator| -> Result<Vec<f32>> {
        let mut p = scatter(shard, &p0);
        let mut state = opt.init(shard)?;
        for g in &grads {
            opt.step_slices(&mut state, shard, &mut p, &scatter(shard, g), comm)?;
        }
        Ok(p)
    };
    let mine = run(&shard, comm)?;
    let reference = run(&whole, &SingleRank)?;
    // This rank's elements of every parameter, against the same elements unsharded.
    let same = shard.pieces.iter().all(|piece| {
        let at = whole.pieces[piece.param].offset + piece.range.start;
        let got = &mine[piece.offset..piece.offset + piece.range.len()];
        let want = &reference[at..at + piece.range.len()];
        got.iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    });
    Ok(same && opt.roots(&shard).has_split())
}

/// A local buffer holding this shard's pieces of the global tensors; padding zero.
fn scatter(shard: &LocalShard, global: &[Vec<f32>]) -> Vec<f32> {
    let mut local = vec![0.0; shard.len];
    for p in &shard.pieces {
        local[p.offset..p.offset + p.range.len()]
            .copy_from_slice(&global[p.param][p.range.clone()]);
    }
    local
}
