//! The unit-by-unit runtime: a model as a sequence of stages, each computing with one FSDP
//! unit's parameters, run in the FSDP rhythm.
//!
//! Forward runs the stages in order. Before stage `s` its unit is gathered; with
//! `reshard_after_forward` the stage runs without a graph (detached inputs and parameters) and
//! the unit is freed after its last forward use, keeping only the stage's input. Backward runs
//! the stages in reverse: the unit is re-gathered, the stage recomputed from its saved input
//! with a graph, and backpropagated from the next stage's input gradient (candle's `backward`
//! starts at a scalar, so the seed is `Σ out · g`). After a unit's first stage is done its
//! gradients are reduce-scattered at once and its buffers freed. Without
//! `reshard_after_forward`, units stay gathered and each stage's forward graph is kept until its
//! backward (no recomputation).
//!
//! The last stage returns the loss; its graph is always kept (its unit stays gathered for the
//! backward that starts right after). A unit used by several stages (the root: embedding first,
//! head last) stays gathered from its first forward use to its first stage's backward.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;

use super::ShardedModel;
use crate::dbuffer::candle;
use crate::optim::Optimizer;
use crate::{Context, Error, Result};

/// A model as the unit-by-unit runtime sees it (as FSDP wraps modules): stages in forward
/// order, each reading the parameters of one FSDP unit.
pub trait Stages {
    /// What a step consumes (token ids, inputs and targets, ...).
    type Batch: ?Sized;

    /// The unit (a name of [`ShardedModel::unit_names`]) whose parameters each stage reads, in
    /// forward order. A unit may serve several stages.
    fn stage_units(&self) -> Vec<String>;

    /// Runs stage `stage` with its unit's parameters on `x`, the previous stage's output (`None`
    /// for the first stage). The last stage returns the scalar loss.
    fn forward(
        &self,
        stage: usize,
        params: &UnitParams,
        x: Option<&Tensor>,
        batch: &Self::Batch,
    ) -> candle_core::Result<Tensor>;
}

/// One unit's parameter tensors for a stage, by full name.
pub struct UnitParams {
    map: HashMap<String, Tensor>,
    dtype: DType,
}

impl UnitParams {
    pub(crate) fn new(map: HashMap<String, Tensor>, dtype: DType) -> Self {
        UnitParams { map, dtype }
    }

    /// The tensor named `name` (full name, as given to `fully_shard`).
    pub fn get(&self, name: &str) -> candle_core::Result<&Tensor> {
        self.map.get(name).ok_or_else(|| {
            candle_core::Error::Msg(format!("stage parameters have no tensor {name}"))
        })
    }

    /// A `VarBuilder` over these tensors (candle-nn layers built from it share their storage).
    pub fn vb(&self) -> VarBuilder<'static> {
        VarBuilder::from_tensors(self.map.clone(), self.dtype, &Device::Cpu)
    }

    /// The compute dtype (f32, or bf16 under mixed precision).
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

/// What one [`ShardedModel::forward_backward`] measured on this rank.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageReport {
    /// This rank's loss (the last stage's output).
    pub loss: f32,
    /// Time the step waited for all-gathers (forward gathers and backward re-gathers): the
    /// gathers not hidden behind compute.
    pub gather_seconds: f64,
    /// Time collectives (prefetched gathers, deferred reduce-scatters) ran while a stage
    /// computed ([`super::FsdpOptions::overlap`]).
    pub overlapped_seconds: f64,
    pub forward_seconds: f64,
    /// Backward, recomputation included.
    pub backward_seconds: f64,
    /// Time the step waited for reduce-scatters of the units' gradients.
    pub reduce_seconds: f64,
}

impl StageReport {
    /// Counts `seconds` the step waited for `job` as gather or reduce time.
    fn add_exposed(&mut self, job: Job, seconds: f64) {
        match job {
            Job::Gather(_) => self.gather_seconds += seconds,
            Job::Reduce(_) => self.reduce_seconds += seconds,
        }
    }
}

/// First and last stage of every unit (`usize::MAX` for unused units).
fn uses(stage_units: &[usize], units: usize) -> (Vec<usize>, Vec<usize>) {
    let (mut first, mut last) = (vec![usize::MAX; units], vec![usize::MAX; units]);
    for (s, &u) in stage_units.iter().enumerate() {
        if first[u] == usize::MAX {
            first[u] = s;
        }
        last[u] = s;
    }
    (first, last)
}

/// The largest sum of full parameter and gradient bytes alive at once while the schedule runs
/// (`full[u]` = (parameters, gradients) of unit `u`), replaying the gathers, frees, gradient
/// allocations and reductions of [`ShardedModel::forward_backward`].
pub(crate) fn peak_of_schedule(
    full: &[(usize, usize)],
    stage_units: &[usize],
    reshard_after_forward: bool,
    overlap: bool,
) -> usize {
    let (first, last) = uses(stage_units, full.len());
    let n = stage_units.len();
    let (mut params, mut grads) = (vec![false; full.len()], vec![false; full.len()]);
    let alive = |p: &[bool], g: &[bool]| -> usize {
        (0..full.len())
            .map(|u| usize::from(p[u]) * full[u].0 + usize::from(g[u]) * full[u].1)
            .sum()
    };
    let mut peak = 0;
    for (s, &u) in stage_units.iter().enumerate() {
        params[u] = true;
        if overlap && s + 1 < n {
            params[stage_units[s + 1]] = true;
        }
        peak = peak.max(alive(&params, &grads));
        if reshard_after_forward && s + 1 < n && last[u] == s {
            params[u] = false;
        }
    }
    // With overlap a unit's reduce-scatter (and its release) runs behind the next stage's
    // backward, so its buffers live one stage longer.
    let mut pending = None;
    for (s, &u) in stage_units.iter().enumerate().rev() {
        params[u] = true;
        grads[u] = true;
        if overlap && s > 0 {
            params[stage_units[s - 1]] = true;
        }
        peak = peak.max(alive(&params, &grads));
        let free = |v: usize, p: &mut [bool], g: &mut [bool]| {
            g[v] = false;
            if reshard_after_forward {
                p[v] = false;
            }
        };
        if let Some(v) = pending.take() {
            free(v, &mut params, &mut grads);
        }
        if first[u] == s {
            if overlap && s > 0 {
                pending = Some(u);
            } else {
                free(u, &mut params, &mut grads);
            }
        }
    }
    peak
}

impl<O: Optimizer> ShardedModel<'_, O> {
    /// One forward and backward of `model` on `batch`, unit by unit (module doc): every unit's
    /// gradients end reduce-scattered into its local gradient shard (added to earlier
    /// micro-batches' since the last [`ShardedModel::step`]). Returns this rank's loss and the
    /// time per phase.
    pub fn forward_backward<M: Stages>(
        &mut self,
        model: &M,
        batch: &M::Batch,
    ) -> Result<StageReport> {
        let stage_units = self.stage_indices(&model.stage_units())?;
        let n = stage_units.len();
        let (first, last) = uses(&stage_units, self.unit_names().len());
        let reshard = self.options().reshard_after_forward;
        let mut report = StageReport::default();
        let mut inputs: Vec<Option<Var>> = vec![None; n];
        let mut graphs: Vec<Option<Tensor>> = vec![None; n];
        let overlap = self.options().overlap;
        for (s, &u) in stage_units.iter().enumerate() {
            self.timed_gather(u, &mut report)?;
            let start = Instant::now();
            let tracked = s + 1 == n || !reshard;
            let params = self.unit_params(u, tracked)?;
            let next = stage_units.get(s + 1).copied().filter(|_| overlap);
            let input = inputs[s].as_ref();
            let jobs: Vec<Job> = next.map(Job::Gather).into_iter().collect();
            let out = self.overlapped(&jobs, &mut report, || {
                stage_forward(model, s, &params, tracked, input, batch)
            })?;
            let out = out.with_context(|| format!("stage {s} (unit {})", self.unit_names()[u]))?;
            if s + 1 < n {
                let next = Var::from_tensor(&out.detach()).map_err(candle("stage output"))?;
                self.stats_arc()
                    .add_activations(out.elem_count() * out.dtype().size_in_bytes());
                inputs[s + 1] = Some(next);
            }
            if tracked {
                graphs[s] = Some(out);
            }
            if reshard && s + 1 < n && last[u] == s {
                self.release_unit(u);
            }
            report.forward_seconds += start.elapsed().as_secs_f64();
        }
        report.loss = scalar_loss(graphs[n - 1].as_ref().expect("the last graph is kept"))?;
        self.note_loss(report.loss);
        let mut g: Option<Tensor> = None;
        // A unit whose gradients are complete, reduce-scattered behind the next stage's backward.
        let mut pending: Option<usize> = None;
        for (s, &u) in stage_units.iter().enumerate().rev() {
            // A stage whose output no gradient reached (a later stage cut the graph) has nothing
            // to backpropagate: its parameters get no gradient, and are reported as such.
            let graph = graphs[s].take();
            let mut jobs: Vec<Job> = pending.take().map(Job::Reduce).into_iter().collect();
            if s + 1 == n || g.is_some() {
                let source = match graph {
                    Some(out) => Ok(out),
                    None => {
                        self.timed_gather(u, &mut report)?;
                        Err(self.unit_params(u, true)?)
                    }
                };
                let prev = s.checked_sub(1).map(|p| stage_units[p]);
                jobs.extend(prev.filter(|_| overlap).map(Job::Gather));
                let (input, seed) = (inputs[s].as_ref(), g.take());
                let start = Instant::now();
                let grad = self.overlapped(&jobs, &mut report, || {
                    let out = match source {
                        Ok(out) => out,
                        Err(params) => stage_forward(model, s, &params, true, input, batch)?,
                    };
                    backward_stage(out, seed.as_ref(), input)
                })?;
                g = grad.with_context(|| format!("backward of stage {s}"))?;
                report.backward_seconds += start.elapsed().as_secs_f64();
            } else {
                self.run_now(&jobs, &mut report)?;
            }
            if first[u] == s {
                if overlap && s > 0 {
                    pending = Some(u);
                } else {
                    self.run_now(&[Job::Reduce(u)], &mut report)?;
                }
            }
        }
        Ok(report)
    }

    /// Unit indices of the stages, or an error naming an unknown unit.
    fn stage_indices(&self, names: &[String]) -> Result<Vec<usize>> {
        if names.is_empty() {
            return Err(Error::BadInput {
                op: "forward_backward",
                what: "stages".into(),
                reason: "the model has no stages".into(),
            });
        }
        names
            .iter()
            .map(|name| {
                self.unit_index(name).ok_or_else(|| Error::BadInput {
                    op: "forward_backward",
                    what: format!("stage unit {name}"),
                    reason: format!("no such unit; the units are {:?}", self.unit_names()),
                })
            })
            .collect()
    }

    fn timed_gather(&mut self, u: usize, report: &mut StageReport) -> Result<()> {
        let start = Instant::now();
        self.ensure_gathered(u)?;
        report.gather_seconds += start.elapsed().as_secs_f64();
        Ok(())
    }

    /// Runs one collective job now: gathers unit `u` unless current, or reduce-scatters its
    /// gradients and (with `reshard_after_forward`) frees it. Returns its time span.
    fn run_job(&mut self, job: Job) -> Result<(Instant, Instant)> {
        let start = Instant::now();
        match job {
            Job::Gather(u) => self.ensure_gathered(u)?,
            Job::Reduce(u) => {
                self.reduce_unit_now(u)?;
                if self.options().reshard_after_forward {
                    self.release_unit(u);
                }
            }
        }
        Ok((start, Instant::now()))
    }

    /// Runs `jobs` on this thread, all their time exposed.
    fn run_now(&mut self, jobs: &[Job], report: &mut StageReport) -> Result<()> {
        for &job in jobs {
            let (a, b) = self.run_job(job)?;
            report.add_exposed(job, (b - a).as_secs_f64());
        }
        Ok(())
    }

    /// Runs `work` (a stage's compute, which touches no runtime state) while `jobs` run in
    /// order on a second thread. They are the only collectives in flight meanwhile, and every
    /// rank issues the same jobs at the same point, so collectives stay in the same order on
    /// every rank. A job's time not hidden behind `work` counts as gather or reduce time; the
    /// hidden part as [`StageReport::overlapped_seconds`].
    fn overlapped<T>(
        &mut self,
        jobs: &[Job],
        report: &mut StageReport,
        work: impl FnOnce() -> T,
    ) -> Result<T> {
        let jobs: Vec<Job> = jobs
            .iter()
            .copied()
            .filter(|j| !matches!(j, Job::Gather(u) if self.is_gathered(*u)))
            .collect();
        if jobs.is_empty() {
            return Ok(work());
        }
        let (out, spans, work_span) = std::thread::scope(|scope| {
            let this = &mut *self;
            let comm = scope.spawn(move || {
                jobs.into_iter()
                    .map(|j| this.run_job(j).map(|span| (j, span)))
                    .collect::<Result<Vec<_>>>()
            });
            let start = Instant::now();
            let out = work();
            let end = Instant::now();
            (out, comm.join(), (start, end))
        });
        let spans = spans.map_err(|_| Error::Msg("the collectives thread panicked".into()))??;
        for (job, (a, b)) in spans {
            let hidden = b
                .min(work_span.1)
                .saturating_duration_since(a.max(work_span.0))
                .as_secs_f64();
            report.overlapped_seconds += hidden;
            report.add_exposed(job, (b - a).as_secs_f64() - hidden);
        }
        Ok(out)
    }
}

/// A collective the runtime runs beside a stage's compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Job {
    /// All-gather unit `u` (unless current).
    Gather(usize),
    /// Reduce-scatter unit `u`'s gradients, then free it under `reshard_after_forward`.
    Reduce(usize),
}

/// Runs stage `s` of `model` on `params`: tracked (a graph to backpropagate) or detached.
fn stage_forward<M: Stages>(
    model: &M,
    s: usize,
    params: &UnitParams,
    tracked: bool,
    input: Option<&Var>,
    batch: &M::Batch,
) -> Result<Tensor> {
    let x = input.map(|v| {
        if tracked {
            v.as_tensor().clone()
        } else {
            v.as_tensor().detach()
        }
    });
    model
        .forward(s, params, x.as_ref(), batch)
        .map_err(candle("stage forward"))
}

/// Backpropagates one stage's output: from the loss itself (`g` is `None`) or from `Σ out · g`;
/// returns the gradient of the stage's input (`None` if none reached it).
fn backward_stage(out: Tensor, g: Option<&Tensor>, input: Option<&Var>) -> Result<Option<Tensor>> {
    // candle's gradients are built from the graph's tensors (a matmul's input gradient from its
    // weight), so they carry a graph of their own: detached, `g` is the constant of a
    // vector-Jacobian product, and the next stage's parameters are neither kept alive nor
    // reached again.
    let seed = match g {
        None => out,
        Some(g) => (out * g.detach())
            .and_then(|t| t.sum_all())
            .map_err(candle("backward seed"))?,
    };
    let grads = seed.backward().map_err(candle("backward"))?;
    Ok(input.and_then(|x| grads.get(x.as_tensor()).map(Tensor::detach)))
}

/// The loss as f32, or an error if the last stage did not return a scalar.
fn scalar_loss(loss: &Tensor) -> Result<f32> {
    if loss.elem_count() != 1 {
        return Err(Error::BadInput {
            op: "forward_backward",
            what: "last stage output".into(),
            reason: format!(
                "shape {:?}; the last stage must return the scalar loss",
                loss.dims()
            ),
        });
    }
    loss.to_dtype(DType::F32)
        .and_then(|l| l.flatten_all())
        .and_then(|l| l.to_vec1::<f32>())
        .map(|v| v[0])
        .map_err(candle("loss"))
}
