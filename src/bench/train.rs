//! `ragged bench train`: one training step of the MLP stack ([`MlpConfig`]) on thread ranks,
//! plain candle (no ragged: variables, candle-nn SGD) as the floor, next to the unit-by-unit
//! runtime on the ragged and FSDP2-style layouts, with per-phase times, bytes copied, and peak
//! heap per rank, predicted from the plans and measured by the counting allocator
//! ([`super::alloc`]). The optimizer is SGD on both sides so the step measures the runtime;
//! `bench optim` measures the optimizers. On a GPU ([`TrainBench::device`] CUDA, feature
//! `candle-cuda`) the same rows run on candle's CUDA tensors and thread ranks on the GPU's
//! stream, each step ends with a device synchronization, the heap column is left out (device
//! memory is not the host allocator's), and every row gets its MFU against a same-run cuBLAS
//! f32 GEMM.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType, Device, Var};
use candle_nn::{Optimizer as _, VarBuilder, SGD};

use super::alloc;
use crate::comm::threads::ThreadWorld;
use crate::comm::Communicator;
use crate::dbuffer::candle;
use crate::demo::{MlpBatch, MlpConfig, MlpStages};
use crate::fsdp::{fully_shard, FsdpOptions, ShardLayout, Stages};
use crate::optim::Sgd;
use crate::{Error, Result};

const LR: f64 = 1e-3;

/// What to run.
#[derive(Clone, Debug)]
pub struct TrainBench {
    pub model: MlpConfig,
    /// Global batch rows (split evenly over ranks).
    pub batch: usize,
    pub worlds: Vec<usize>,
    /// Timed steps after one untimed warm-up step.
    pub steps: usize,
    /// Run only the runtime variants whose name contains this (plain candle always runs).
    pub only: Option<String>,
    /// Where the model and the sharded state live (the CPU, or a CUDA device).
    pub device: Device,
}

/// One variant's measurement (means over the timed steps, on rank 0).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainRow {
    pub variant: String,
    pub world: usize,
    pub step_seconds: f64,
    /// The fastest timed step (robust to a machine loaded now and then).
    pub best_step_seconds: f64,
    pub forward_seconds: f64,
    pub backward_seconds: f64,
    pub gather_seconds: f64,
    pub reduce_seconds: f64,
    pub optimizer_seconds: f64,
    /// Of `gather_seconds + reduce_seconds`, the time spent waiting at the collectives'
    /// rendezvous for slower ranks (load imbalance, not transfer; thread ranks only, and only
    /// without overlap, where every collective runs on the step's own thread).
    pub peer_wait_seconds: Option<f64>,
    /// Bytes copied outside collectives per step (all ranks).
    pub copied_per_step: u64,
    /// Bytes of all-gather traffic per step on rank 0 (the full buffers gathered).
    pub gathered_per_step: u64,
    /// Heap per rank: the runtime's buffers predicted from the plans (`None` for plain candle).
    pub predicted_bytes: Option<usize>,
    /// Heap per rank measured: process peak above the bytes alive before, over the ranks
    /// (`None` without the counting allocator, and on a GPU).
    pub measured_bytes: Option<usize>,
    /// Model FLOPs per second over a same-run GEMM's (GPU rows only).
    pub mfu: Option<f64>,
    pub loss: f32,
}

/// Runs every variant: plain candle once, then for each world size every runtime variant of
/// [`variants`].
pub fn run(cfg: &TrainBench, mut progress: impl FnMut(&str)) -> Result<Vec<TrainRow>> {
    validate(cfg)?;
    let params = on_device(cfg.model.init_params(0)?, &cfg.device)?;
    let gemm = if cfg.device.is_cpu() {
        None
    } else {
        progress("same-run GEMM");
        Some(gemm_flops_per_second(&cfg.device)?)
    };
    progress("plain candle");
    let mut rows = vec![plain(cfg, &params)?];
    for &world in &cfg.worlds {
        let chosen = variants()
            .into_iter()
            .filter(|(name, _)| cfg.only.as_deref().is_none_or(|only| name.contains(only)));
        for (name, opts) in chosen {
            if !cfg.device.is_cpu() && opts.layout == ShardLayout::Fsdp2 {
                continue; // host only (fully_shard says so)
            }
            progress(&format!("{name} V={world}"));
            rows.push(sharded(cfg, &params, world, opts, name)?);
        }
    }
    if let Some(gemm) = gemm {
        // Forward 2, backward 4 FLOPs per weight and row (no biases).
        let weights: usize = params.iter().map(|(_, t)| t.elem_count()).sum();
        let flops = 6.0 * weights as f64 * cfg.batch as f64;
        for r in &mut rows {
            r.mfu = Some(flops / r.step_seconds / gemm);
        }
    }
    Ok(rows)
}

/// The CPU, as [`TrainBench::device`] (callers need no candle dependency).
pub fn cpu_device() -> Device {
    Device::Cpu
}

/// candle's CUDA device `ordinal` (feature `candle-cuda`; `Err` in other builds).
pub fn cuda_device(ordinal: usize) -> Result<Device> {
    #[cfg(feature = "candle-cuda")]
    {
        // The gate first: its error says why (no driver, no device), candle's is the driver's.
        crate::cuda::Device::open(ordinal)?;
        Device::new_cuda(ordinal).map_err(candle("bench train --device cuda"))
    }
    #[cfg(not(feature = "candle-cuda"))]
    {
        let _ = ordinal;
        Err(Error::CudaUnavailable {
            op: "bench train --device cuda",
            reason: "the model on the GPU needs a build with --features candle-cuda".into(),
        })
    }
}

/// `params` on `device`.
fn on_device(
    params: Vec<(String, candle_core::Tensor)>,
    device: &Device,
) -> Result<Vec<(String, candle_core::Tensor)>> {
    if device.is_cpu() {
        return Ok(params);
    }
    params
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_device(device).map_err(candle("bench train"))?)))
        .collect()
}

/// A batch on `device`.
fn batch_on(b: MlpBatch, device: &Device) -> Result<MlpBatch> {
    if device.is_cpu() {
        return Ok(b);
    }
    let to = |t: candle_core::Tensor| t.to_device(device).map_err(candle("bench train batch"));
    Ok(MlpBatch {
        x: to(b.x)?,
        y: to(b.y)?,
    })
}

/// Waits for `device`'s queued work (a no-op on the CPU), so a step's time is its own.
fn sync(device: &Device) -> Result<()> {
    device.synchronize().map_err(candle("bench train sync"))
}

/// FLOP/s of a 4096³ f32 matmul on `device` (candle's cuBLAS call), best of 5 after a warm-up.
fn gemm_flops_per_second(device: &Device) -> Result<f64> {
    let n = 4096;
    let op = candle("bench train GEMM");
    let a = candle_core::Tensor::ones((n, n), DType::F32, device).map_err(&op)?;
    let mut best = f64::INFINITY;
    for rep in 0..6 {
        sync(device)?;
        let start = Instant::now();
        let c = a.matmul(&a).map_err(&op)?;
        sync(device)?;
        drop(c);
        if rep > 0 {
            best = best.min(start.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * (n as f64).powi(3) / best)
}

/// Runs `f` on `world` thread ranks: CPU ones, or (a CUDA `device`) ones whose collectives run
/// on the GPU, on candle's stream.
fn on_ranks<T: Send>(
    device: &Device,
    world: usize,
    f: impl Fn(&dyn Communicator) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    match device {
        Device::Cpu => ThreadWorld::run(world, |c| f(c)),
        #[cfg(feature = "candle-cuda")]
        Device::Cuda(cuda) => {
            let dev = std::sync::Arc::new(crate::cuda::Device::from_candle(cuda)?);
            crate::cuda::threads::ThreadDeviceComm::run(dev, world, |c| f(c))
        }
        #[allow(unreachable_patterns)]
        other => Err(Error::BadInput {
            op: "bench train",
            what: format!("device {other:?}"),
            reason: "the CPU, or CUDA in a build with --features candle-cuda".into(),
        }),
    }
}

/// The runtime variants measured at every world size, by name.
pub fn variants() -> Vec<(&'static str, FsdpOptions)> {
    let with = |layout, reshard_after_forward, recompute, overlap| FsdpOptions {
        layout,
        reshard_after_forward,
        recompute,
        overlap,
        ..FsdpOptions::default()
    };
    use ShardLayout::{Fsdp2, Ragged};
    vec![
        (
            "ragged, reshard, keep graph",
            with(Ragged, true, false, true),
        ),
        (
            "ragged, reshard, keep graph, no overlap",
            with(Ragged, true, false, false),
        ),
        ("ragged, recompute", with(Ragged, true, true, true)),
        (
            "ragged, recompute, no overlap",
            with(Ragged, true, true, false),
        ),
        ("ragged, keep units", with(Ragged, false, false, true)),
        (
            "fsdp2-style, reshard, keep graph",
            with(Fsdp2, true, false, true),
        ),
    ]
}

fn validate(cfg: &TrainBench) -> Result<()> {
    let bad = |reason: String| {
        Err(Error::BadInput {
            op: "bench train",
            what: "configuration".into(),
            reason,
        })
    };
    if cfg.steps == 0 || cfg.worlds.is_empty() || cfg.model.layers == 0 {
        return bad("steps, worlds and layers must be positive".into());
    }
    if let Some(only) = &cfg.only {
        if !variants()
            .iter()
            .any(|(name, _)| name.contains(only.as_str()))
        {
            let names: Vec<&str> = variants().iter().map(|(n, _)| *n).collect();
            return bad(format!("--only {only:?} matches no variant of {names:?}"));
        }
    }
    if let Some(w) = cfg.worlds.iter().find(|&&w| w == 0 || cfg.batch % w != 0) {
        return bad(format!("batch {} does not split over {w} ranks", cfg.batch));
    }
    Ok(())
}

/// Plain candle: one variable per parameter, candle-nn SGD.
struct Plain {
    vb: VarBuilder<'static>,
    sgd: SGD,
}

/// One step's times (forward, backward, whole step) and loss.
struct StepTimes {
    forward: f64,
    backward: f64,
    total: f64,
    loss: f32,
}

impl Plain {
    fn new(params: &[(String, candle_core::Tensor)]) -> Result<Self> {
        let vars: Vec<(String, Var)> = params
            .iter()
            .map(|(n, t)| Ok((n.clone(), Var::from_tensor(&t.copy()?)?)))
            .collect::<Result<_>>()?;
        let map: HashMap<String, candle_core::Tensor> = vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let device = params
            .first()
            .map_or(Device::Cpu, |(_, t)| t.device().clone());
        let vb = VarBuilder::from_tensors(map, DType::F32, &device);
        let sgd = SGD::new(vars.into_iter().map(|(_, v)| v).collect(), LR)
            .map_err(candle("plain SGD"))?;
        Ok(Plain { vb, sgd })
    }

    /// Forward, backward and SGD step on `batch`.
    fn step(&mut self, m: &MlpConfig, batch: &MlpBatch) -> Result<StepTimes> {
        let start = Instant::now();
        let mut x = batch.x.clone();
        for i in 0..m.layers {
            let get = |n: &str| self.vb.get_unchecked_dtype(n, DType::F32);
            x = m.block(i, get, &x).map_err(candle("plain forward"))?;
        }
        let loss = MlpConfig::loss(&x, &batch.y).map_err(candle("plain loss"))?;
        let forward = start.elapsed().as_secs_f64();
        let grads = loss.backward().map_err(candle("plain backward"))?;
        let backward = start.elapsed().as_secs_f64() - forward;
        self.sgd.step(&grads).map_err(candle("plain step"))?;
        sync(batch.x.device())?;
        let total = start.elapsed().as_secs_f64();
        let loss = loss.to_scalar::<f32>().map_err(candle("plain loss"))?;
        Ok(StepTimes {
            forward,
            backward,
            total,
            loss,
        })
    }
}

/// Plain candle's row: forward, backward, candle-nn SGD.
fn plain(cfg: &TrainBench, params: &[(String, candle_core::Tensor)]) -> Result<TrainRow> {
    let before = alloc::current();
    alloc::reset_peak();
    let mut model = Plain::new(params)?;
    let mut row = empty_row("plain candle", 1);
    for step in 0..=cfg.steps {
        let batch = batch_on(cfg.model.batch(step, cfg.batch)?, &cfg.device)?;
        let t = model.step(&cfg.model, &batch)?;
        if step > 0 {
            row.forward_seconds += t.forward;
            row.backward_seconds += t.backward;
            row.optimizer_seconds += t.total - t.forward - t.backward;
            row.step_seconds += t.total;
            row.best_step_seconds = row.best_step_seconds.min(t.total);
        }
        row.loss = t.loss;
    }
    finish(&mut row, cfg, None, before, 1);
    Ok(row)
}

/// A world-1 variant against plain candle with their steps interleaved.
#[derive(Clone, Debug, PartialEq)]
pub struct PairedRow {
    pub variant: String,
    /// Median over the pairs of (variant step / the plain step just before it).
    pub median_ratio: f64,
    pub min_ratio: f64,
    pub max_ratio: f64,
    pub plain_median_seconds: f64,
    pub variant_median_seconds: f64,
}

/// Step-time ratios at world 1 against plain candle, with the steps interleaved (plain,
/// variant, plain, variant, ...; both models alive): each ratio compares neighbouring steps,
/// so load that comes and goes on a shared machine weighs on both sides alike. `cfg.steps`
/// pairs after one warm-up pair.
pub fn paired(cfg: &TrainBench, mut progress: impl FnMut(&str)) -> Result<Vec<PairedRow>> {
    validate(cfg)?;
    if !cfg.device.is_cpu() {
        return Err(Error::BadInput {
            op: "bench train --paired",
            what: "device".into(),
            reason: "the paired run is a CPU measurement; use bench train --device cuda".into(),
        });
    }
    let params = cfg.model.init_params(0)?;
    let chosen = variants()
        .into_iter()
        .filter(|(name, _)| cfg.only.as_deref().is_none_or(|only| name.contains(only)));
    let mut rows = Vec::new();
    for (name, opts) in chosen.filter(|(_, o)| o.layout == ShardLayout::Ragged) {
        progress(name);
        let runs = ThreadWorld::run(1, |c| {
            let mut plain = Plain::new(&params)?;
            let mut sharded = fully_shard(&params, Sgd { lr: LR as f32 }, c, opts.clone())?;
            let stages = MlpStages(cfg.model);
            let mut pairs = Vec::new();
            for step in 0..=cfg.steps {
                let batch = cfg.model.batch(step, cfg.batch)?;
                let p = plain.step(&cfg.model, &batch)?.total;
                let start = Instant::now();
                sharded.forward_backward(&stages, &batch)?;
                sharded.step()?;
                if step > 0 {
                    pairs.push((p, start.elapsed().as_secs_f64()));
                }
            }
            Ok(pairs)
        })?;
        let pairs = runs.into_iter().next().expect("rank 0");
        rows.push(paired_row(name, &pairs));
    }
    Ok(rows)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn paired_row(name: &str, pairs: &[(f64, f64)]) -> PairedRow {
    let ratios: Vec<f64> = pairs.iter().map(|(p, v)| v / p).collect();
    PairedRow {
        variant: name.to_string(),
        median_ratio: median(ratios.clone()),
        min_ratio: ratios.iter().copied().fold(f64::INFINITY, f64::min),
        max_ratio: ratios.iter().copied().fold(0.0, f64::max),
        plain_median_seconds: median(pairs.iter().map(|p| p.0).collect()),
        variant_median_seconds: median(pairs.iter().map(|p| p.1).collect()),
    }
}

/// The paired table.
pub fn paired_markdown(rows: &[PairedRow]) -> String {
    let mut s = String::from(
        "| variant (V = 1) | step / plain step, median | min | max | plain s (median) | \
         variant s (median) |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s += &format!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |\n",
            r.variant,
            r.median_ratio,
            r.min_ratio,
            r.max_ratio,
            r.plain_median_seconds,
            r.variant_median_seconds
        );
    }
    s
}

/// The unit-by-unit runtime on `world` thread ranks.
fn sharded(
    cfg: &TrainBench,
    params: &[(String, candle_core::Tensor)],
    world: usize,
    opts: FsdpOptions,
    name: &str,
) -> Result<TrainRow> {
    let stages = MlpStages(cfg.model);
    let rows = cfg.batch / world;
    let before = alloc::current();
    alloc::reset_peak();
    let runs = on_ranks(&cfg.device, world, |c| {
        let mut sharded = fully_shard(params, Sgd { lr: LR as f32 }, c, opts.clone())?;
        let order: Vec<usize> = stages
            .stage_units()
            .iter()
            .map(|n| {
                sharded
                    .unit_names()
                    .iter()
                    .position(|u| u == n)
                    .unwrap_or(0)
            })
            .collect();
        // Parameters and gradients from the plans; activations as measured on the warm-up step.
        let plan = sharded.memory_plan();
        let mut predicted = 0;
        let mut row = empty_row(name, world);
        for step in 0..=cfg.steps {
            let full = cfg.model.batch(step, cfg.batch)?;
            let batch = batch_on(rank_rows(&full, c.rank() * rows, rows)?, &cfg.device)?;
            let (copied, gathered) = (sharded.stats().copied(), sharded.stats().collective());
            let waited = c.peer_wait_seconds();
            let start = Instant::now();
            let r = sharded.forward_backward(&stages, &batch)?;
            let waited = c.peer_wait_seconds().zip(waited).map(|(b, a)| b - a);
            if step == 0 {
                predicted = plan.peak_unit_by_unit(&order, &opts, sharded.activations())?;
            }
            let opt = Instant::now();
            sharded.step()?;
            sync(&cfg.device)?;
            if step > 0 {
                row.optimizer_seconds += opt.elapsed().as_secs_f64();
                let total = start.elapsed().as_secs_f64();
                row.step_seconds += total;
                row.best_step_seconds = row.best_step_seconds.min(total);
                row.forward_seconds += r.forward_seconds;
                row.backward_seconds += r.backward_seconds;
                row.gather_seconds += r.gather_seconds;
                row.reduce_seconds += r.reduce_seconds;
                if !sharded.overlaps() {
                    row.peer_wait_seconds =
                        waited.map(|w| w + row.peer_wait_seconds.unwrap_or(0.0));
                }
                row.copied_per_step += sharded.stats().copied() - copied;
                row.gathered_per_step += sharded.stats().collective() - gathered;
            }
            row.loss = r.loss;
        }
        Ok((row, predicted))
    })?;
    let (mut row, predicted) = runs.into_iter().next().expect("rank 0");
    row.copied_per_step *= world as u64;
    finish(&mut row, cfg, Some(predicted), before, world);
    Ok(row)
}

/// Rows `first..first + n` of a batch.
fn rank_rows(b: &MlpBatch, first: usize, n: usize) -> Result<MlpBatch> {
    let take = |t: &candle_core::Tensor| t.narrow(0, first, n).map_err(candle("rank rows"));
    Ok(MlpBatch {
        x: take(&b.x)?,
        y: take(&b.y)?,
    })
}

fn empty_row(name: &str, world: usize) -> TrainRow {
    TrainRow {
        variant: name.to_string(),
        world,
        step_seconds: 0.0,
        best_step_seconds: f64::INFINITY,
        forward_seconds: 0.0,
        backward_seconds: 0.0,
        gather_seconds: 0.0,
        reduce_seconds: 0.0,
        optimizer_seconds: 0.0,
        peer_wait_seconds: None,
        copied_per_step: 0,
        gathered_per_step: 0,
        predicted_bytes: None,
        measured_bytes: None,
        mfu: None,
        loss: 0.0,
    }
}

/// Turns sums over the timed steps into means and adds the memory figures (the measured heap
/// only on the CPU: device memory is not the host allocator's).
fn finish(
    row: &mut TrainRow,
    cfg: &TrainBench,
    predicted: Option<usize>,
    before: usize,
    world: usize,
) {
    let steps = cfg.steps;
    let n = steps as f64;
    for t in [
        &mut row.step_seconds,
        &mut row.forward_seconds,
        &mut row.backward_seconds,
        &mut row.gather_seconds,
        &mut row.reduce_seconds,
        &mut row.optimizer_seconds,
    ] {
        *t /= n;
    }
    row.peer_wait_seconds = row.peer_wait_seconds.map(|w| w / n);
    row.copied_per_step /= steps as u64;
    row.gathered_per_step /= steps as u64;
    row.predicted_bytes = predicted;
    row.measured_bytes = (alloc::installed() && cfg.device.is_cpu())
        .then(|| alloc::peak().saturating_sub(before) / world);
}

/// The table: times, the sharding share (gather + reduce, not overlapped), the step against
/// plain candle at world 1, bytes, and memory per rank.
pub fn markdown(rows: &[TrainRow]) -> String {
    let plain = rows
        .iter()
        .find(|r| r.variant == "plain candle")
        .map_or((f64::NAN, f64::NAN), |r| {
            (r.step_seconds, r.best_step_seconds)
        });
    let mib = |b: Option<usize>| {
        b.map_or("–".into(), |b| {
            format!("{:.1}", b as f64 / (1 << 20) as f64)
        })
    };
    let mut s = String::from(
        "| variant | V | step s | vs plain | best step s | best vs plain | forward s | backward s | gather s | reduce s | \
         optimizer s | sharding % | peer wait s | sharding % less peer wait | copied B/step | gathered B/step (rank 0) | \
         predicted MiB/rank | measured MiB/rank | loss |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let with_mfu = rows.iter().any(|r| r.mfu.is_some());
    if with_mfu {
        s = s.replacen(" loss |\n", " loss | MFU % (vs same-run GEMM) |\n", 1);
        s = s.replacen("---:|\n", "---:|---:|\n", 1);
    }
    for r in rows {
        let exposed = r.gather_seconds + r.reduce_seconds;
        let sharding = 100.0 * exposed / r.step_seconds;
        let (wait, less_wait) = r.peer_wait_seconds.map_or(("–".into(), "–".into()), |w| {
            let transfer = 100.0 * (exposed - w).max(0.0) / r.step_seconds;
            (format!("{w:.3}"), format!("{transfer:.1}"))
        });
        let mfu = r
            .mfu
            .map_or(String::new(), |m| format!(" {:.1} |", 100.0 * m));
        s += &format!(
            "| {} | {} | {:.3} | {:.2} | {:.3} | {:.2} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.1} | {wait} | {less_wait} | {} | {} | {} | {} | {:.5} |{mfu}\n",
            r.variant,
            r.world,
            r.step_seconds,
            r.step_seconds / plain.0,
            r.best_step_seconds,
            r.best_step_seconds / plain.1,
            r.forward_seconds,
            r.backward_seconds,
            r.gather_seconds,
            r.reduce_seconds,
            r.optimizer_seconds,
            sharding,
            r.copied_per_step,
            r.gathered_per_step,
            mib(r.predicted_bytes),
            mib(r.measured_bytes),
            r.loss,
        );
    }
    s
}
