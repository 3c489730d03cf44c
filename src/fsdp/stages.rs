//! The unit-by-unit runtime: a model as a sequence of stages, each computing with one FSDP
//! unit's parameters, run in the FSDP rhythm.
//!
//! Forward runs the stages in order, each on its unit's gathered parameters. Backward runs them
//! in reverse from the next stage's input gradient (candle's `backward` starts at a scalar, so
//! the seed is `Σ out · g`); after a unit's first stage is done its gradients are
//! reduce-scattered at once and its buffers freed. Between the two, per [`super::FsdpOptions`]:
//! - `reshard_after_forward` without `recompute` (FSDP2's rhythm): each stage's graph is kept;
//!   after a unit's last forward stage its parameters' storages are emptied (the graph keeps the
//!   tensors) and before its backward the re-gather moves fresh storages into the same tensors;
//! - with `recompute`: stages run forward without a graph (detached inputs and parameters),
//!   only their inputs are kept, the unit is freed, and backward re-gathers it and recomputes
//!   the stage with a graph;
//! - without `reshard_after_forward`: units stay gathered from forward to backward.
//!
//! The last stage returns the loss; its graph is always kept (its unit stays gathered for the
//! backward that starts right after). A unit used by several stages (the root: embedding first,
//! head last) stays gathered from its first forward use to its first stage's backward.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;

use super::activations::{graph_bytes, StageActivations};
use super::param_pool::ParamPool;
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
    /// False while backward recomputes the stage only for its graph.
    output_value_needed: bool,
}

impl UnitParams {
    pub(crate) fn new(map: HashMap<String, Tensor>, dtype: DType) -> Self {
        UnitParams {
            map,
            dtype,
            output_value_needed: true,
        }
    }

    /// Parameters for running a [`Stages`] model without sharding (a reference run, a check of
    /// the staged model against plain candle): one `UnitParams` over all of the model's
    /// parameters serves every stage (each reads its own by name; see [`forward_unsharded`]).
    /// Give it `Var`s' tensors to backpropagate the loss into them. The compute dtype is the
    /// tensors' (f32 for none); `Err` for a name listed twice or tensors of two dtypes.
    pub fn from_tensors(tensors: impl IntoIterator<Item = (String, Tensor)>) -> Result<Self> {
        let mut map = HashMap::new();
        let mut dtype = None;
        for (name, t) in tensors {
            let bad = |reason: String| Error::BadInput {
                op: "UnitParams::from_tensors",
                what: format!("tensor {name}"),
                reason,
            };
            let first = *dtype.get_or_insert(t.dtype());
            if first != t.dtype() {
                return Err(bad(format!(
                    "is {:?}, the ones before {first:?}",
                    t.dtype()
                )));
            }
            if map.insert(name.clone(), t).is_some() {
                return Err(bad("listed twice".into()));
            }
        }
        Ok(UnitParams::new(map, dtype.unwrap_or(DType::F32)))
    }

    /// These parameters for a recomputation whose output value nothing reads.
    fn for_gradients_only(self) -> Self {
        UnitParams {
            output_value_needed: false,
            ..self
        }
    }

    /// `x · wᵀ`, as candle-nn's `Linear::new(w, None)`, for a product that is the stage's output
    /// or reaches it only through ops whose backward reads no values (a residual add). When
    /// backward recomputes the stage (`FsdpOptions::recompute`) the product is not computed
    /// (zeros stand in; nothing reads them), and its gradients are still `Linear`'s, bitwise.
    /// Anywhere else (before a norm, an activation, a product with another tensor, the loss)
    /// use `Linear`: there the value is needed and skipping it would give wrong gradients.
    pub fn output_linear(&self, x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        super::output_linear::output_linear(x, w, self.output_value_needed)
    }

    /// The tensor named `name` (full name, as given to `fully_shard`).
    pub fn get(&self, name: &str) -> candle_core::Result<&Tensor> {
        self.map.get(name).ok_or_else(|| {
            candle_core::Error::Msg(format!("stage parameters have no tensor {name}"))
        })
    }

    /// The tensors, in no particular order.
    pub(crate) fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        self.map.values()
    }

    /// A `VarBuilder` over these tensors (candle-nn layers built from it share their storage),
    /// on their device.
    pub fn vb(&self) -> VarBuilder<'static> {
        VarBuilder::from_tensors(self.map.clone(), self.dtype, &self.device())
    }

    /// The device the tensors live on (the CPU for none).
    pub fn device(&self) -> Device {
        self.map
            .values()
            .next()
            .map_or(Device::Cpu, |t| t.device().clone())
    }

    /// The compute dtype (f32, or bf16 under mixed precision).
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

/// Runs every stage of `model` in order on `params` (all of the model's parameters,
/// [`UnitParams::from_tensors`]) and returns the last stage's output, the loss: the model's
/// forward without sharding, for a reference run or to check the staged model against plain
/// candle. Over `Var`s, `loss.backward()` gives the gradients that a world of one rank
/// reduces, bitwise (`a_staged_model_runs_unsharded_with_the_gradients_a_world_of_one_reduces`).
pub fn forward_unsharded<S: Stages + ?Sized>(
    model: &S,
    params: &UnitParams,
    batch: &S::Batch,
) -> Result<Tensor> {
    let stages = model.stage_units().len();
    let mut x: Option<Tensor> = None;
    for stage in 0..stages {
        let out = model
            .forward(stage, params, x.as_ref(), batch)
            .map_err(candle("forward_unsharded"))
            .with_context(|| format!("stage {stage}"))?;
        x = Some(out);
    }
    x.ok_or_else(|| Error::BadInput {
        op: "forward_unsharded",
        what: "the model".into(),
        reason: "lists no stages".into(),
    })
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

/// What the memory replay knows of one unit: bytes of its full parameters, of its full
/// gradient buffer, and of candle's gradient temporaries while one of its stages backpropagates;
/// and its storage class (units of one class reuse each other's freed parameter storages).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct UnitBytes {
    pub params: usize,
    pub grads: usize,
    pub backward_temporaries: usize,
    pub class: usize,
}

/// The runtime's buffers during a replay: which units' full parameters and gradient buffers
/// exist, and whose freed parameter storages wait in the pool (`param_pool`, same policy).
struct Buffers<'a> {
    full: &'a [UnitBytes],
    params: Vec<bool>,
    grads: Vec<bool>,
    /// Units whose freed storages are kept, at most [`ParamPool::SPARE`].
    pool: Vec<usize>,
}

impl Buffers<'_> {
    fn gather(&mut self, u: usize) {
        if !self.params[u] {
            self.params[u] = true;
            let class = self.full[u].class;
            if let Some(i) = self.pool.iter().position(|&v| self.full[v].class == class) {
                self.pool.swap_remove(i);
            }
        }
    }

    fn free_params(&mut self, u: usize) {
        if self.params[u] {
            self.params[u] = false;
            if self.pool.len() < ParamPool::SPARE {
                self.pool.push(u);
            }
        }
    }

    fn alive(&self) -> usize {
        let units: usize = (0..self.full.len())
            .map(|u| {
                usize::from(self.params[u]) * self.full[u].params
                    + usize::from(self.grads[u]) * self.full[u].grads
            })
            .sum();
        units
            + self
                .pool
                .iter()
                .map(|&v| self.full[v].params)
                .sum::<usize>()
    }
}

/// The largest number of bytes alive at once while the schedule of
/// [`ShardedModel::forward_backward`] runs: full parameters, gradient buffers and spare
/// parameter storages (replaying its gathers, frees, gradient allocations and reductions under
/// `opts`' reshard, recompute and overlap settings, over two steps so the second starts with
/// the storages the first left in the pool) plus activations (`acts`, per stage; missing
/// stages count zero): saved stage inputs, kept or recomputed graphs, and candle's temporaries
/// during a stage's backward.
pub(crate) fn peak_of_schedule(
    full: &[UnitBytes],
    stage_units: &[usize],
    opts: &super::FsdpOptions,
    acts: &[super::StageActivations],
) -> usize {
    let mut buffers = Buffers {
        full,
        params: vec![false; full.len()],
        grads: vec![false; full.len()],
        pool: Vec::new(),
    };
    let first = replay_step(&mut buffers, stage_units, opts, acts);
    first.max(replay_step(&mut buffers, stage_units, opts, acts))
}

/// One step of [`peak_of_schedule`]'s replay, from `b`'s state; returns its peak.
fn replay_step(
    b: &mut Buffers<'_>,
    stage_units: &[usize],
    opts: &super::FsdpOptions,
    acts: &[super::StageActivations],
) -> usize {
    let (reshard, overlap) = (opts.reshard_after_forward, opts.overlap);
    let (first, last) = uses(stage_units, b.full.len());
    let n = stage_units.len();
    let act = |s: usize| acts.get(s).copied().unwrap_or_default();
    let tracked = |s: usize| s + 1 == n || !opts.recompute;
    // Saved inputs: stage t's output copied for stage t + 1, kept until backward ends.
    let inputs_before = |s: usize| {
        (0..s.min(n - 1))
            .map(|t| act(t).output_bytes)
            .sum::<usize>()
    };
    let kept_graphs = |range: std::ops::Range<usize>| {
        range
            .filter(|&t| tracked(t))
            .map(|t| act(t).graph_bytes)
            .sum::<usize>()
    };
    let mut peak = b.alive();
    for (s, &u) in stage_units.iter().enumerate() {
        b.gather(u);
        if overlap && s + 1 < n {
            b.gather(stage_units[s + 1]);
        }
        let running = if tracked(s) {
            act(s).graph_bytes
        } else {
            act(s).output_bytes
        };
        let activations = inputs_before(s) + kept_graphs(0..s) + running;
        peak = peak.max(b.alive() + activations);
        if reshard && s + 1 < n && last[u] == s {
            b.free_params(u);
        }
    }
    // With overlap a unit's reduce-scatter (and its release) runs behind the next stage's
    // backward, so its buffers live one stage longer; the collectives thread finishes it (its
    // storages going to the pool) before it prefetches the previous stage's unit.
    let mut pending: Option<usize> = None;
    let free = |b: &mut Buffers<'_>, v: usize| {
        b.grads[v] = false;
        if reshard {
            b.free_params(v);
        }
    };
    for (s, &u) in stage_units.iter().enumerate().rev() {
        b.gather(u);
        b.grads[u] = true;
        let recomputed = if tracked(s) { 0 } else { act(s).graph_bytes };
        // The gradient arriving at the stage's output has the output's size.
        let activations = inputs_before(n)
            + kept_graphs(0..s + 1)
            + recomputed
            + act(s).output_bytes
            + b.full[u].backward_temporaries;
        let before = b.alive();
        if let Some(v) = pending.take() {
            free(b, v);
        }
        if let Some(p) = s.checked_sub(1).filter(|_| overlap) {
            b.gather(stage_units[p]);
        }
        peak = peak.max(before.max(b.alive()) + activations);
        if first[u] == s {
            if overlap && s > 0 {
                pending = Some(u);
            } else {
                free(b, u);
            }
        }
    }
    peak.max(b.alive())
}

/// What the forward pass leaves the backward pass.
struct Forward {
    /// Each stage's unit.
    stage_units: Vec<usize>,
    activations: Vec<StageActivations>,
    /// Each stage's saved input (`None` for the first).
    inputs: Vec<Option<Var>>,
    /// Each stage's kept graph (the last stage's always).
    graphs: Vec<Option<Tensor>>,
    /// The loss, detached from the last graph.
    loss: Tensor,
}

impl<O: Optimizer> ShardedModel<'_, O> {
    /// One forward and backward of `model` on `batch`, unit by unit (module doc): every unit's
    /// gradients end reduce-scattered into its local gradient shard (added to earlier
    /// micro-batches' since the last [`ShardedModel::step`]). Returns this rank's loss and the
    /// time per phase.
    ///
    /// The ranks must run the same stages: the stage lists are compared across ranks on the
    /// first call and whenever this rank's list changes, and differing lists are an `Err` on
    /// every rank. An `Err` once backward has begun leaves some units' gradients with this
    /// batch's contribution and others without: [`ShardedModel::step`] then refuses until
    /// [`ShardedModel::discard_gradients`].
    pub fn forward_backward<M: Stages>(
        &mut self,
        model: &M,
        batch: &M::Batch,
    ) -> Result<StageReport> {
        let names = model.stage_units();
        let stage_units = self.stage_indices(&names)?;
        self.check_stages_agree(&names, &stage_units)?;
        let mut report = StageReport::default();
        let forward = self.forward_pass(model, batch, stage_units, &mut report)?;
        let loss = forward.loss.clone();
        if let Err(e) = self.backward_pass(model, batch, forward, &mut report) {
            self.note_partial_gradients(&e);
            return Err(e);
        }
        report.loss = scalar_value(&loss)?;
        self.note_loss(report.loss);
        Ok(report)
    }

    /// Runs the stages forward, freeing each unit after its last forward stage (module doc).
    fn forward_pass<M: Stages>(
        &mut self,
        model: &M,
        batch: &M::Batch,
        stage_units: Vec<usize>,
        report: &mut StageReport,
    ) -> Result<Forward> {
        let n = stage_units.len();
        let (_, last) = uses(&stage_units, self.unit_names().len());
        let reshard = self.options().reshard_after_forward;
        let recompute = self.options().recompute;
        let mut activations = vec![StageActivations::default(); n];
        let mut inputs: Vec<Option<Var>> = vec![None; n];
        let mut graphs: Vec<Option<Tensor>> = vec![None; n];
        let overlap = self.overlaps();
        // Units resharded so far in this forward, named in a later stage's error.
        let mut freed: Vec<String> = Vec::new();
        for (s, &u) in stage_units.iter().enumerate() {
            self.timed_gather(u, report)?;
            let start = Instant::now();
            let tracked = s + 1 == n || !recompute;
            let params = self.unit_params(u, tracked)?;
            let next = stage_units.get(s + 1).copied().filter(|_| overlap);
            let input = inputs[s].as_ref();
            let jobs: Vec<Job> = next.map(Job::Gather).into_iter().collect();
            let out = self.overlapped(&jobs, report, || {
                stage_forward(model, s, &params, tracked, input, batch)
            })?;
            let out = match out {
                Ok(out) => out,
                Err(e) => {
                    let hint = self.stage_hint(u, &freed, &e);
                    let unit = &self.units[u].name;
                    return Err(e).with_context(|| format!("stage {s} (unit {unit}){hint}"));
                }
            };
            let output_bytes = out.elem_count() * out.dtype().size_in_bytes();
            activations[s].output_bytes = output_bytes;
            if s + 1 < n {
                let next = Var::from_tensor(&out.detach()).map_err(candle("stage output"))?;
                self.stats_arc().add_activations(output_bytes);
                inputs[s + 1] = Some(next);
            }
            if tracked {
                activations[s].graph_bytes = graph_bytes(&out, &params);
                graphs[s] = Some(out);
            }
            drop(params);
            if reshard && s + 1 < n && last[u] == s {
                freed.push(self.unit_names()[u].to_string());
                if tracked {
                    // The graph keeps the tensors; only their elements go (FSDP2's rhythm).
                    self.free_unit_storages(u)?;
                } else {
                    self.recycle_unit(u)?;
                }
            }
            report.forward_seconds += start.elapsed().as_secs_f64();
        }
        // The loss is read after backward: reading it here would make the host wait for the
        // device's forward before it queues any backward kernel. Its shape is checked now;
        // detached, it keeps only its own storage, not the last stage's graph.
        let loss = graphs[n - 1]
            .as_ref()
            .expect("the last graph is kept")
            .detach();
        check_scalar(&loss)?;
        Ok(Forward {
            stage_units,
            activations,
            inputs,
            graphs,
            loss,
        })
    }

    /// Runs the stages backward from the loss, reduce-scattering each unit's gradients after
    /// its first stage (module doc).
    fn backward_pass<M: Stages>(
        &mut self,
        model: &M,
        batch: &M::Batch,
        forward: Forward,
        report: &mut StageReport,
    ) -> Result<()> {
        let Forward {
            stage_units,
            mut activations,
            inputs,
            mut graphs,
            ..
        } = forward;
        let n = stage_units.len();
        let (first, _) = uses(&stage_units, self.unit_names().len());
        let overlap = self.overlaps();
        let mut g: Option<Tensor> = None;
        // A unit whose gradients are complete, reduce-scattered behind the next stage's backward.
        let mut pending: Option<usize> = None;
        for (s, &u) in stage_units.iter().enumerate().rev() {
            // A stage whose output no gradient reached (a later stage cut the graph) has nothing
            // to backpropagate: its parameters get no gradient, and are reported as such.
            let graph = graphs[s].take();
            let mut jobs: Vec<Job> = pending.take().map(Job::Reduce).into_iter().collect();
            // The collectives never depend on this rank's graph: a rank whose stage got no
            // gradient (its loss times 0, a detached output) gathers and prefetches as the
            // others do, or the ranks would call different collectives.
            self.timed_gather(u, report)?;
            let prev = s.checked_sub(1).map(|p| stage_units[p]);
            jobs.extend(prev.filter(|_| overlap).map(Job::Gather));
            if s + 1 == n || g.is_some() {
                // A kept graph whose unit was resharded gets its storages back (the same
                // tensors); a dropped one is recomputed from the saved input.
                let source = match graph {
                    Some(out) => Ok(out),
                    None => Err(self.unit_params(u, true)?.for_gradients_only()),
                };
                let (input, seed) = (inputs[s].as_ref(), g.take());
                let start = Instant::now();
                let recomputed = &mut activations[s].graph_bytes;
                let grad = self.overlapped(&jobs, report, || {
                    let out = match source {
                        Ok(out) => out,
                        Err(params) => {
                            let out = stage_forward(model, s, &params, true, input, batch)?;
                            *recomputed = graph_bytes(&out, &params);
                            out
                        }
                    };
                    backward_stage(out, seed.as_ref(), input)
                })?;
                g = grad.with_context(|| format!("backward of stage {s}"))?;
                report.backward_seconds += start.elapsed().as_secs_f64();
            } else {
                self.run_now(&jobs, report)?;
            }
            if first[u] == s {
                if overlap && s > 0 {
                    pending = Some(u);
                } else {
                    self.run_now(&[Job::Reduce(u)], report)?;
                }
            }
        }
        self.set_activations(activations);
        Ok(())
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
            .collect::<Result<Vec<_>>>()
            .and_then(|stages| self.check_every_unit_staged(&stages).map(|_| stages))
    }

    /// `Err` naming a unit with trainable parameters that no stage runs: its gradients would
    /// never be reduced, and every `step` would fail without saying why.
    fn check_every_unit_staged(&self, stages: &[usize]) -> Result<()> {
        let unstaged = (0..self.groups.len()).find(|&g| {
            !stages.contains(&g)
                && self
                    .buffers_of(g)
                    .iter()
                    .any(|&b| !self.units[b].params.is_frozen())
        });
        match unstaged {
            Some(g) => Err(Error::BadInput {
                op: "forward_backward",
                what: format!("unit {}", self.unit_names()[g]),
                reason: format!(
                    "no stage runs it (the stages are {:?}): list it in stage_units(), or give its \
                     parameters the Frozen role",
                    stages.iter().map(|&g| self.unit_names()[g]).collect::<Vec<_>>()
                ),
            }),
            None => Ok(()),
        }
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
                    self.recycle_unit(u)?;
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
        // On a GPU each thread queues on its own stream (candle's per-thread default stream),
        // and nothing orders the two: the jobs read gradients and reuse storages that this
        // thread's queued kernels write or read. So this thread's work finishes before the jobs
        // start, and the jobs' work before they count as done (the join); the stage's own
        // compute, queued meanwhile, touches neither. A no-op on the host.
        let placement = self.placement();
        placement.synchronize()?;
        let (out, spans, work_span) = std::thread::scope(|scope| {
            let this = &mut *self;
            let comm = scope.spawn(move || -> Result<Vec<_>> {
                let spans = jobs
                    .into_iter()
                    .map(|j| this.run_job(j).map(|span| (j, span)))
                    .collect::<Result<Vec<_>>>()?;
                placement.synchronize()?;
                Ok(spans)
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

impl<O: Optimizer> ShardedModel<'_, O> {
    /// What stage `u`'s error adds: the unit that holds a parameter the error names when it
    /// is not the stage's own (a wrap rule that put it elsewhere), else, when the error is one
    /// a freed storage causes, [`freed_hint`] or [`STALE_HINT`].
    fn stage_hint(&self, u: usize, freed: &[String], e: &Error) -> String {
        let error = e.to_string();
        let others = self.units.iter().enumerate().filter(|&(k, _)| k != u);
        let named = others
            .flat_map(|(_, unit)| unit.params.slots().iter().map(move |s| (&s.name, unit)))
            .filter(|(name, _)| error.contains(name.as_str()))
            .max_by_key(|(name, _)| name.len());
        match named {
            Some((name, owner)) => format!(
                "; {name} is a parameter of unit {}, not of unit {}: a stage sees its own \
                 unit's parameters only (does the wrap rule put {name} in the unit whose stage \
                 uses it?)",
                owner.name, self.units[u].name
            ),
            None if !placeholder_symptom(e, &error) => String::new(),
            None if freed.is_empty() => STALE_HINT.into(),
            None => freed_hint(freed),
        }
    }
}

/// What a stage's `U8` error adds when nothing was freed in this forward: a freed storage is a
/// byte placeholder, so the likely cause is a parameter tensor kept from an earlier step.
const STALE_HINT: &str = "; a parameter's freed storage is a U8 placeholder: if this stage \
                          computes with a tensor kept from an earlier forward_backward (or from \
                          unshard()), take it from the stage's params on every call";

/// Whether a stage's error (its text `error`) is one that computing with a freed storage, a
/// `U8` placeholder of no elements, causes: an op that checks its operands names the `U8`
/// dtype; one that reads the storage directly panics on an index past its end (caught as the
/// stage's `Err`, [`stage_forward`]). The user's own errors (a shape mismatch, a missing
/// parameter) get no hint about freed units.
fn placeholder_symptom(e: &Error, error: &str) -> bool {
    let panicked = matches!(e, Error::BadInput { op: STAGE_FORWARD, reason, .. }
        if reason.starts_with(PANICKED));
    panicked || error.contains("U8")
}

/// The `op` of a stage's own error, and how the reason of one that panicked starts.
const STAGE_FORWARD: &str = "stage forward";
const PANICKED: &str = "it panicked: ";

/// What a stage's error adds when units were resharded before it: the likely cause of a
/// failure that only such a stage meets (computing with a freed parameter, whose storage is a
/// byte placeholder: `dbuffer::tap`).
fn freed_hint(freed: &[String]) -> String {
    if freed.is_empty() {
        return String::new();
    }
    format!(
        "; the parameters of units {freed:?} were freed after their forward \
         (reshard_after_forward): if this stage computes with any of them (a tensor kept from \
         their stage, a weight shared between units), share it through the root unit or set \
         reshard_after_forward: false"
    )
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
    // A panic in the stage (user code) is this rank's `Err`, as a candle error is: the runtime
    // then reports which stage failed, and what may have caused it (`forward_backward`).
    let forward = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        model.forward(s, params, x.as_ref(), batch)
    }));
    match forward {
        Ok(out) => out.map_err(candle(STAGE_FORWARD)),
        Err(payload) => Err(Error::BadInput {
            op: STAGE_FORWARD,
            what: format!("stage {s}"),
            reason: format!("{PANICKED}{}", crate::error::panic_text(payload.as_ref())),
        }),
    }
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

/// An error if the last stage did not return a scalar (the loss).
fn check_scalar(loss: &Tensor) -> Result<()> {
    // An integer loss has no gradient: backward would reach no parameter, silently.
    if !loss.dtype().is_float() {
        return Err(Error::BadInput {
            op: "forward_backward",
            what: "last stage output".into(),
            reason: format!(
                "dtype {:?}; the last stage must return the loss as a float scalar",
                loss.dtype()
            ),
        });
    }
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
    Ok(())
}

/// The value of a scalar loss as f32 (from a device: a download, which waits for it).
fn scalar_value(loss: &Tensor) -> Result<f32> {
    loss.to_dtype(DType::F32)
        .and_then(|l| l.flatten_all())
        .and_then(|l| l.to_vec1::<f32>())
        .map(|v| v[0])
        .map_err(candle("loss"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fsdp::{FsdpOptions, StageActivations};

    fn unit(params: usize, grads: usize, backward_temporaries: usize, class: usize) -> UnitBytes {
        UnitBytes {
            params,
            grads,
            backward_temporaries,
            class,
        }
    }

    fn stage(graph_bytes: usize, output_bytes: usize) -> StageActivations {
        StageActivations {
            graph_bytes,
            output_bytes,
        }
    }

    /// The replay's peak, worked by hand for two stages on two units, gathered from forward to
    /// backward (no reshard, no overlap, graphs kept), with a last output far larger than the
    /// scalar loss it stands for, so that counting it twice (as a saved input and as the
    /// gradient arriving at it) shows. The peak is the last stage's backward:
    /// both units' parameters (100 + 200) and its gradient buffer (200) = 500 bytes, plus the
    /// saved input of stage 1 (stage 0's output, 7), both graphs (50 + 70), the gradient at
    /// stage 1's output (1000) and its temporaries (20) = 1147 bytes; 1647 in all. The other
    /// moments are smaller: forward 100 + 50 then 300 + 7 + 50 + 70; stage 0's backward
    /// 300 + 100 + 7 + 50 + 7 + 10.
    #[test]
    fn the_peak_of_a_two_stage_schedule_is_the_one_worked_by_hand() {
        let full = [unit(100, 100, 10, 0), unit(200, 200, 20, 1)];
        let acts = [stage(50, 7), stage(70, 1000)];
        let opts = FsdpOptions {
            reshard_after_forward: false,
            overlap: false,
            recompute: false,
            ..FsdpOptions::default()
        };
        assert_eq!(peak_of_schedule(&full, &[0, 1], &opts, &acts), 1647);
    }

    /// The replay's peak worked by hand for three stages on three units of distinct storage
    /// classes, resharded after forward, with overlap (prefetch one stage ahead, each unit's
    /// reduction finished during the next stage's backward). Parameters 10, 20, 40 bytes (and
    /// as much gradient), backward temporaries 1, 600, 4; graphs 100, 200, 400; outputs 3, 5,
    /// 9. Forward keeps the next unit gathered and the freed ones pooled (at most two): alive
    /// 30, 70, 70 beside activations 100, 303, 708 (778). The last stage's backward holds unit
    /// 2's parameters and gradients (80), the pooled units 0 and 1 (30; unit 1's storages are
    /// taken back by its prefetch: still 110) beside 8 + 700 + 9 + 4 = 721 (831). Stage 1's
    /// backward starts with 130 alive, unit 2's buffers not yet released (its reduction runs
    /// behind this stage), beside 8 + 300 + 5 + 600 = 913: 1043, the peak (1003 had unit 2
    /// been released at once); stage 0's, 100 beside 112. The second step starts from the
    /// first's pool and peaks the same.
    #[test]
    fn the_peak_with_reshard_and_overlap_is_the_one_worked_by_hand() {
        let full = [unit(10, 10, 1, 0), unit(20, 20, 600, 1), unit(40, 40, 4, 2)];
        let acts = [stage(100, 3), stage(200, 5), stage(400, 9)];
        let opts = FsdpOptions {
            reshard_after_forward: true,
            overlap: true,
            recompute: false,
            ..FsdpOptions::default()
        };
        assert_eq!(peak_of_schedule(&full, &[0, 1, 2], &opts, &acts), 1043);
    }
}
