//! The runtime benchmark: thread-rank collectives against a plain memcpy of the same bytes, and
//! one training step of the ragged layout against the FSDP2-style layout, measured in one run.

use std::fmt::Write as _;
use std::time::Instant;

use crate::checkpoint::CheckpointState;
use crate::comm::threads::ThreadWorld;
use crate::comm::{BufMut, Communicator, ReduceOp};
use crate::demo::{train_rank, StepReport, TrainMode, TransformerConfig};
use crate::fsdp::{FsdpOptions, ShardLayout};
use crate::limits::{at_least, checked_product, fits_in_memory};
use crate::Result;

/// A collective measured against memcpy.
#[derive(Clone, Debug)]
pub struct CollectiveRow {
    pub op: &'static str,
    pub world: usize,
    /// Bytes every rank receives, summed over ranks: `V·(V−1)·S·4`.
    pub bytes: usize,
    pub seconds: f64,
    /// One thread copying `bytes` bytes, best of the same number of repeats.
    pub memcpy_seconds: f64,
    /// The same copy split over every core (the ranks use every core too).
    pub memcpy_all_cores_seconds: f64,
}

impl CollectiveRow {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.seconds / 1e9
    }
    pub fn memcpy_gbps(&self) -> f64 {
        self.bytes as f64 / self.memcpy_seconds / 1e9
    }
    pub fn memcpy_all_cores_gbps(&self) -> f64 {
        self.bytes as f64 / self.memcpy_all_cores_seconds / 1e9
    }
}

/// Best time of `repeats` copies of `bytes` bytes (f32 elements) split over `threads` threads.
pub fn memcpy_seconds(bytes: usize, repeats: usize, threads: usize) -> f64 {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    let chunk = (bytes / 4).div_ceil(threads.max(1)).max(1);
    (0..repeats.max(1))
        .map(|_| {
            let t = Instant::now();
            std::thread::scope(|s| {
                for (d, src) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                    s.spawn(move || d.copy_from_slice(std::hint::black_box(src)));
                }
            });
            std::hint::black_box(&mut dst);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Times in-place all-gather and reduce-scatter of `shard` f32 elements per rank on `world`
/// thread ranks (best of `repeats`, slowest rank). `Err` before allocating anything for the
/// inputs [`check_collectives`] refuses.
pub fn collectives(world: usize, shard: usize, repeats: usize) -> Result<Vec<CollectiveRow>> {
    check_collectives(world, shard, repeats)?;
    let bytes = world * (world - 1) * shard * 4;
    let memcpy = memcpy_seconds(bytes, repeats, 1);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let memcpy_all = memcpy_seconds(bytes, repeats, cores);
    let mut rows = Vec::new();
    for op in ["all-gather", "reduce-scatter"] {
        let times = ThreadWorld::run(world, |c| time_collective(c, op, shard, repeats))?;
        let seconds = times.into_iter().fold(0.0, f64::max);
        rows.push(CollectiveRow {
            op,
            world,
            bytes,
            seconds,
            memcpy_seconds: memcpy,
            memcpy_all_cores_seconds: memcpy_all,
        });
    }
    Ok(rows)
}

/// What [`collectives`] refuses before allocating: fewer than 2 ranks, an empty shard or 0
/// `repeats` (nothing to measure), buffers that
/// overflow or exceed the available memory (the CLI checks every world size before starting).
pub fn check_collectives(world: usize, shard: usize, repeats: usize) -> Result<()> {
    const OP: &str = "bench comm";
    if world < 2 || shard == 0 {
        // Nothing would move between ranks: every GB/s and ratio would be 0 or 0/0.
        return Err(crate::Error::BadInput {
            op: OP,
            what: format!("--worlds {world} with --shard {shard}"),
            reason: "the collectives need at least 2 ranks and 1 element per rank to move any \
                     bytes"
                .into(),
        });
    }
    at_least(OP, "--repeats", repeats, 1)?;
    let what = format!("collectives of {shard} f32 elements per rank (--shard) on {world} ranks");
    fits_in_memory(OP, &what, collectives_bytes(world, shard)?).map(drop)
}

/// Bytes [`collectives`] allocates at once: the memcpy baseline's source and destination
/// (`V·(V−1)·S·4` each) and one `V·S`-element buffer per rank (`V²·S·4`); `Err` on overflow.
pub fn collectives_bytes(world: usize, shard: usize) -> Result<usize> {
    let what = "collective benchmark buffers";
    let received = checked_product(
        "bench comm",
        what,
        &[world, world.saturating_sub(1), shard, 4],
    )?;
    let ranks = checked_product("bench comm", what, &[world, world, shard, 4])?;
    checked_product("bench comm", what, &[received, 2])?
        .checked_add(ranks)
        .ok_or_else(|| crate::Error::BadInput {
            op: "bench comm",
            what: what.into(),
            reason: "the size overflows this machine's address space".into(),
        })
}

fn time_collective(c: &dyn Communicator, op: &str, shard: usize, repeats: usize) -> Result<f64> {
    let mut buf = vec![c.rank() as f32; c.world_size() * shard];
    let mut best = f64::INFINITY;
    for _ in 0..repeats.max(1) {
        c.barrier()?;
        let t = Instant::now();
        match op {
            "all-gather" => c.all_gather_in_place(BufMut::F32(&mut buf))?,
            _ => c.reduce_scatter_in_place(BufMut::F32(&mut buf), ReduceOp::Sum)?,
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Mean step time (after the first step) and bytes copied per step of one layout.
#[derive(Clone, Debug)]
pub struct StepRow {
    pub layout: ShardLayout,
    pub world: usize,
    pub seconds: f64,
    /// Of which unshard, gradient reduction, optimizer step and reshard.
    pub fsdp_seconds: f64,
    pub copied_per_step: u64,
    pub final_loss: f32,
}

/// Trains `steps` steps of `cfg` on `world` thread ranks with `layout` and reports rank 0
/// (`steps` at least 1: the first step is reported when it is the only one).
pub fn train_step<O: CheckpointState + Clone>(
    cfg: TransformerConfig,
    optimizer: O,
    layout: ShardLayout,
    world: usize,
    steps: usize,
    global_batch: usize,
) -> Result<StepRow> {
    at_least("bench comm", "--train-steps", steps, 1)?;
    at_least("bench comm", "--train-ranks", world, 1)?;
    let params = cfg.init_params(0)?;
    let opts = FsdpOptions {
        layout,
        ..FsdpOptions::default()
    };
    let runs = ThreadWorld::run(world, |c| {
        train_rank(
            cfg,
            &params,
            optimizer.clone(),
            c,
            opts.clone(),
            TrainMode::UnitByUnit,
            steps,
            global_batch,
            |_, _| {},
        )
    })?;
    let reports = runs.into_iter().next().map(|r| r.0).unwrap_or_default();
    let Some(last) = reports.last() else {
        crate::bail!("bench comm: the training run returned no step reports");
    };
    // The first step is not timed, unless it is the only one.
    let timed = &reports[1.min(reports.len() - 1)..];
    let mean = |f: fn(&StepReport) -> f64| timed.iter().map(f).sum::<f64>() / timed.len() as f64;
    let (seconds, fsdp_seconds) = (mean(|r| r.seconds), mean(|r| r.fsdp_seconds));
    Ok(StepRow {
        layout,
        world,
        seconds,
        fsdp_seconds,
        copied_per_step: last.copied_bytes / reports.len() as u64,
        final_loss: last.loss,
    })
}

/// The markdown section for `docs/benchmarks.md` (no training table when `steps` is empty).
pub fn markdown(collectives: &[CollectiveRow], steps: &[StepRow], model: &str) -> String {
    let mut s = String::new();
    s.push_str(
        "| collective | V | bytes | GB/s | memcpy GB/s (1 thread) | ratio | memcpy GB/s (all cores) | ratio |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in collectives {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            r.op,
            r.world,
            r.bytes,
            r.gbps(),
            r.memcpy_gbps(),
            r.gbps() / r.memcpy_gbps(),
            r.memcpy_all_cores_gbps(),
            r.gbps() / r.memcpy_all_cores_gbps()
        );
    }
    if steps.is_empty() {
        return s;
    }
    let _ = write!(
        s,
        "\nTraining step ({model}):\n\n| layout | V | step s | sharding s | bytes copied per step | step vs ragged | sharding vs ragged | final loss |\n|---|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    let ragged = steps.iter().find(|r| r.layout == ShardLayout::Ragged);
    let (base, base_fsdp) = ragged.map_or((f64::NAN, f64::NAN), |r| (r.seconds, r.fsdp_seconds));
    for r in steps {
        let _ = writeln!(
            s,
            "| {:?} | {} | {:.3} | {:.4} | {} | {:.2} | {:.2} | {:.4} |",
            r.layout,
            r.world,
            r.seconds,
            r.fsdp_seconds,
            r.copied_per_step,
            r.seconds / base,
            r.fsdp_seconds / base_fsdp,
            r.final_loss
        );
    }
    s
}
