//! `fully_shard`: a candle model's parameters, sharded over the ranks of a communicator.
//!
//! # Note: the buffers of a unit
//! Each FSDP unit (one decoder layer, or the root) has, on every rank (module
//! [`crate::dbuffer`]):
//! - **params** ([`ParamBuffer`]): the fp32 master shard, and while materialized, one compute
//!   storage per tensor that the all-gather writes and the model uses as its parameter tensors;
//! - **grads** ([`GradBuffer`]): the full gradient buffer backward accumulates into (it exists
//!   from the unit's backward to its reduce-scatter) and the reduced local shard;
//! - **optimizer state**: the optimizer's `State`, laid out like the local shard.
//!
//! # Two ways to run a step
//! - **Unit by unit** ([`ShardedModel::forward_backward`], the FSDP rhythm): the model is a
//!   sequence of stages ([`Stages`]); forward gathers each unit just before its stage and frees
//!   its parameters' storages after (`reshard_after_forward`) while the stage's graph is kept;
//!   backward re-gathers them into the same tensors (or, with `recompute`, recomputes the stage
//!   from its saved input), backpropagates, reduce-scatters the unit's gradients at once and
//!   frees them. Peak memory: the shards plus about one unit's full parameters and gradients,
//!   plus the activations.
//! - **Whole model** ([`ShardedModel::unshard`] / [`ShardedModel::reduce_gradients`]), for
//!   models that fit: every unit gathered at once; the model is built once from the returned
//!   tensors, which later `unshard`s rewrite in place.
//!
//! Either way a step ends with [`ShardedModel::step`] (the optimizer on local shards).

mod activations;
mod agree;
mod checkpoint;
pub(crate) mod clip;
mod describe;
pub mod fsdp2;
mod layout;
mod mesh;
mod output_linear;
mod param_pool;
mod stages;

pub use activations::StageActivations;
pub use describe::{ParamRow, ParamTable};
pub use stages::{forward_unsharded, StageReport, Stages, UnitParams};

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::comm::{BufMut, Communicator, ReduceOp};
use crate::dbuffer::{
    anchor_on, placement_of, CopyStats, GradBuffer, GradPool, GradSink, Materialized, ParamBuffer,
};
use crate::model::{DType as ModelDType, Inventory, TensorSpec, Unit};
use crate::optim::{LocalShard, Optimizer};
use crate::plan::multi::MultiOptions;
use crate::plan::PlanOptions;
use crate::schedule::Schedule;
use crate::storage::{NonFiniteCounts, Placement, Storage, ViewMut};
use crate::Result;
use layout::UnitLayout;
pub use mesh::check_replicas;
use mesh::Mesh;
use param_pool::ParamPool;

/// How parameters are laid out over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShardLayout {
    /// Planned RaggedShard layout: collectives write the tensors' storages and read the
    /// gradient buffer directly, no copies.
    Ragged,
    /// PyTorch FSDP2's layout: per-parameter even `Shard(0)` with padding, a rank-major
    /// collective buffer, copy-out after all-gather and copy-in before reduce-scatter.
    Fsdp2,
}

/// Element types of the compute copy and of the gradient reduction, as FSDP2's
/// `MixedPrecisionPolicy`. Master weights, optimizer state and the gradient buffer backward
/// accumulates into are always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MixedPrecision {
    /// The all-gathered compute copy (`F32` or `BF16`; bf16 gathers move half the bytes). The
    /// f32 master shard is cast once before each gather.
    pub param_dtype: DType,
    /// The reduce-scatter's element type (`F32` or `BF16`: the full gradient buffer is cast
    /// before the reduction, which sums in f32 and rounds once, and the shard widened after).
    pub reduce_dtype: DType,
}

impl Default for MixedPrecision {
    fn default() -> Self {
        MixedPrecision {
            param_dtype: DType::F32,
            reduce_dtype: DType::F32,
        }
    }
}

impl MixedPrecision {
    fn check(&self) -> Result<()> {
        for (what, d) in [
            ("param_dtype", self.param_dtype),
            ("reduce_dtype", self.reduce_dtype),
        ] {
            if !matches!(d, DType::F32 | DType::BF16) {
                return Err(crate::Error::BadInput {
                    op: "fully_shard",
                    what: format!("mixed precision {what}"),
                    reason: format!("{d:?}; f32 and bf16 are supported"),
                });
            }
        }
        Ok(())
    }
}

/// A wrap rule: a parameter's unit by name (`None`: root).
pub type UnitRule = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// A yes/no rule on parameter names (which parameters are frozen).
#[derive(Clone)]
pub struct NameRule(pub Arc<dyn Fn(&str) -> bool + Send + Sync>);

impl NameRule {
    pub fn new(rule: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        NameRule(Arc::new(rule))
    }

    pub fn matches(&self, name: &str) -> bool {
        (self.0)(name)
    }
}

impl std::fmt::Debug for NameRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NameRule(..)")
    }
}

/// Which parameters form one FSDP unit (as FSDP's auto-wrap policy).
#[derive(Clone, Default)]
pub enum WrapPolicy {
    /// One unit per repeated numbered block under any prefix (`layers.N`, `h.N`, `blocks.N`,
    /// `layer.N`: [`crate::model::numbered_block_of`]), everything else in `root`.
    #[default]
    NumberedBlocks,
    /// `unit_of(name)` names each parameter's unit; `None` puts it in `root`.
    Custom(UnitRule),
}

impl WrapPolicy {
    /// The unit of parameter `name` (`None`: root).
    pub fn unit_of(&self, name: &str) -> Option<String> {
        match self {
            WrapPolicy::NumberedBlocks => crate::model::numbered_block_of(name).map(str::to_string),
            WrapPolicy::Custom(f) => f(name),
        }
    }
}

impl std::fmt::Debug for WrapPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WrapPolicy::NumberedBlocks => f.write_str("NumberedBlocks"),
            WrapPolicy::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// What [`ShardedModel::step`] does when a loss or a reduced gradient is NaN or infinite on
/// any rank (one flag, all-reduced, so every rank decides alike).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NonFinitePolicy {
    /// Return [`crate::Error::NonFinite`] on every rank; parameters and optimizer state are
    /// untouched, the gradients dropped (the next step needs a new backward).
    #[default]
    Error,
    /// Skip the step (gradients dropped, parameters and state untouched) and count it
    /// ([`ShardedModel::skipped_steps`]).
    SkipStep,
}

/// Options of [`fully_shard`].
#[derive(Clone, Debug)]
pub struct FsdpOptions {
    pub layout: ShardLayout,
    /// How parameters are grouped into units.
    pub wrap: WrapPolicy,
    /// Unit-by-unit runtime: free a unit's full parameters after its last forward stage and
    /// re-gather them before its backward (default on, as FSDP2). Off: units stay gathered from
    /// forward to backward.
    pub reshard_after_forward: bool,
    /// Unit-by-unit runtime: how backward gets a stage's graph back. Off (default, FSDP2's
    /// rhythm): each stage's graph is kept from forward to backward; a resharded unit's
    /// parameter tensors stay in it with their storages emptied, and the re-gather moves fresh
    /// storages into the same tensors (no copy, no recomputation; the activations stay). On
    /// (activation checkpointing): stages run forward without a graph, only their inputs are
    /// kept, and backward recomputes each stage with a graph (one more forward, fewer
    /// activations).
    pub recompute: bool,
    /// Unit-by-unit runtime: run collectives on a second thread while a stage computes (default
    /// on): gather the next stage's unit (forward) or the previous one (backward), as FSDP2's
    /// forward and backward prefetch, and reduce-scatter a unit's gradients behind the next
    /// stage's backward. Costs about one more unit's full buffers at the peak. Not at world 1
    /// on a device ([`ShardedModel::overlaps`]).
    pub overlap: bool,
    /// Average (default) or sum gradients over ranks.
    pub reduce: ReduceOp,
    pub mixed_precision: MixedPrecision,
    /// Plan each unit of the ragged layout as up to `max_buffers` collective buffers where that
    /// pads less ([`crate::plan::multi`]); `None` (default): one buffer per unit, planned by the
    /// optimizer's own [`Optimizer::plan_unit`]. The FSDP2-style layout has one buffer.
    pub buffers: Option<MultiOptions>,
    pub non_finite: NonFinitePolicy,
    /// Fail the first backward if a parameter got no gradient, naming every such parameter
    /// once all units are reduced (default: only report them,
    /// [`ShardedModel::params_without_gradient`]).
    pub require_gradients: bool,
    /// Frozen parameters: those the rule matches are gathered for compute like the others, but
    /// in a buffer of their own per unit that takes no gradient, is never reduce-scattered and
    /// never stepped. A name rule kept for convenience: the optimizer's role rule
    /// ([`Optimizer::role`] returning [`crate::Role::Frozen`]) freezes parameters the same way.
    pub frozen: Option<NameRule>,
    pub plan: PlanOptions,
    /// HSDP (hybrid sharding, FSDP2's 2-D mesh): with `R > 1` replicas, each unit is sharded
    /// over groups of `V / R` consecutive ranks and replicated over the `R` groups; reduced
    /// gradient shards are all-reduced over the replicas, so gathers and reduce-scatters stay
    /// within a group (a node) and only shard-sized traffic crosses groups. `R` must divide the
    /// world size; 1 (default): every unit sharded over the whole world. The groups come from
    /// [`Communicator::split`] (every backend of ragged's).
    pub replicas: usize,
}

impl FsdpOptions {
    /// The options that change the numbers a step computes (mixed precision, the reduction,
    /// the non-finite policy), as text in `Debug` form: what a checkpoint records and a load
    /// compares. The others change where values live and when, not what they are.
    pub fn numerics(&self) -> String {
        format!(
            "FsdpNumerics {{ mixed_precision: {:?}, reduce: {:?}, non_finite: {:?} }}",
            self.mixed_precision, self.reduce, self.non_finite
        )
    }
}

impl Default for FsdpOptions {
    fn default() -> Self {
        FsdpOptions {
            layout: ShardLayout::Ragged,
            wrap: WrapPolicy::default(),
            reshard_after_forward: true,
            recompute: false,
            overlap: true,
            reduce: ReduceOp::Avg,
            mixed_precision: MixedPrecision::default(),
            buffers: None,
            non_finite: NonFinitePolicy::default(),
            require_gradients: false,
            frozen: None,
            plan: PlanOptions::default(),
            replicas: 1,
        }
    }
}

/// One FSDP unit on one rank.
struct ShardedUnit<S> {
    name: String,
    local: LocalShard,
    layout: UnitLayout,
    params: ParamBuffer,
    grads: GradBuffer,
    state: S,
    /// Whether parameters without a gradient were looked for (on the first reduction).
    reported: bool,
}

impl<S> ShardedUnit<S> {
    /// The shard as the optimizer sees it ([`optimizer_shard`]).
    fn optimizer_shard(&self) -> std::borrow::Cow<'_, LocalShard> {
        optimizer_shard(&self.local, self.params.is_frozen())
    }
}

/// A buffer's shard as its optimizer sees it: a frozen buffer's parameters belong to no
/// optimizer, whatever its role rule says of them ([`FsdpOptions::frozen`] freezes by name), so
/// its state holds none of them and no optimizer's block constraint applies to their
/// element-granular layout ([`UnitLayout::frozen`]).
fn optimizer_shard(local: &LocalShard, frozen: bool) -> std::borrow::Cow<'_, LocalShard> {
    if !frozen {
        return std::borrow::Cow::Borrowed(local);
    }
    std::borrow::Cow::Owned(LocalShard {
        rank: local.rank,
        world: local.world,
        len: local.len,
        params: Vec::new(),
        pieces: Vec::new(),
    })
}

/// A load that failed while reading: some values replaced, others not.
#[derive(Clone, Debug)]
struct PartlyLoaded {
    cause: String,
    /// The optimizer state was being read too ([`ShardedModel::load`]; a safetensors
    /// import replaces parameters only).
    state_too: bool,
}

/// A model's parameters sharded over the ranks of `comm`, with their optimizer.
pub struct ShardedModel<'c, O: Optimizer> {
    /// The world, and under HSDP this rank's shard and replica groups.
    mesh: Mesh<'c>,
    optimizer: O,
    opts: FsdpOptions,
    /// Every collective buffer of every unit, in unit order (one per unit unless
    /// [`FsdpOptions::buffers`] splits it).
    units: Vec<ShardedUnit<O::State>>,
    /// Each unit's name and the indices of its buffers in `units`.
    groups: Vec<(String, Vec<usize>)>,
    stats: Arc<CopyStats>,
    /// Parameters that got no gradient in the first reduction of their unit.
    without_gradient: Option<Vec<String>>,
    /// A loss seen since the last step was not finite (on this rank).
    loss_not_finite: bool,
    /// Why a backward since the last step failed part way: [`ShardedModel::step`] refuses
    /// the gradients until [`ShardedModel::discard_gradients`].
    partial_gradients: Option<String>,
    /// Why the last load failed after replacing values: every use of the parameters refuses
    /// until a load succeeds.
    partly_loaded: Option<PartlyLoaded>,
    /// The stage list (unit indices) every rank was last found to run.
    agreed_stages: Vec<usize>,
    skipped: usize,
    /// Steps taken (skipped ones not counted): the schedule's clock.
    steps: usize,
    /// The learning-rate schedule and the rate it multiplies.
    schedule: Option<(Schedule, f64)>,
    /// Activation bytes per stage, measured by the last `forward_backward`.
    activations: Vec<StageActivations>,
    /// Compute-copy storages between a unit's free and the next gather.
    param_pool: ParamPool,
    /// This run's id, recorded in every checkpoint it saves: new from `fully_shard`, the
    /// loaded checkpoint's after a load (only rank 0's is used, to save and to check a root).
    run_id: String,
}

/// Shards `params` (full initial values, identical on every rank, checked) into FSDP units
/// ([`FsdpOptions::wrap`]: by default one per numbered block plus a root unit), plans each unit from the optimizer's atomic
/// blocks, and allocates master shards, gradient shards and optimizer state by that plan. No
/// full buffer exists until the first gather. Initial values of any float dtype become `f32`
/// masters (f64 rounded to nearest, bf16/f16 widened), and stages compute in `f32` unless
/// [`MixedPrecision::param_dtype`] is bf16.
pub fn fully_shard<'c, O: Optimizer>(
    params: &[(String, Tensor)],
    optimizer: O,
    comm: &'c dyn Communicator,
    opts: FsdpOptions,
) -> Result<ShardedModel<'c, O>> {
    opts.mixed_precision.check()?;
    let inv = inventory_of(params)?;
    let values: HashMap<&str, &Tensor> = params.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let stats = Arc::new(CopyStats::default());
    let device = device_of(params)?;
    let placement = placement_of(&device)?;
    let anchor = anchor_on(&device)?;
    if !placement.is_cpu() && opts.layout == ShardLayout::Fsdp2 {
        return Err(crate::Error::BadInput {
            op: "fully_shard",
            what: "ShardLayout::Fsdp2 on a GPU".into(),
            reason: "the FSDP2-style comparison layout copies in and out on the host only; use \
                     the ragged layout"
                .into(),
        });
    }
    let fsdp2 = opts.layout == ShardLayout::Fsdp2;
    let mesh = Mesh::new(comm, opts.replicas)?;
    let mut planned = Vec::new();
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    // Frozen: by the optimizer's role rule, or by the older name rule.
    let is_frozen = |name: &str, shape: &[usize]| {
        optimizer.role(name, shape) == crate::Role::Frozen
            || opts.frozen.as_ref().is_some_and(|f| f.matches(name))
    };
    for unit in inv.units_by(&|name| opts.wrap.unit_of(name)) {
        check_unit_name(&unit)?;
        let (frozen, trained): (Vec<_>, Vec<_>) = unit
            .tensors
            .iter()
            .partition(|t| is_frozen(&t.name, &t.shape));
        let first = planned.len();
        let multi = opts.buffers.as_ref();
        for (tensors, frozen) in [(trained, false), (frozen, true)] {
            if tensors.is_empty() {
                continue;
            }
            let part = Unit {
                name: unit.name.clone(),
                tensors,
            };
            let buffers = if frozen {
                UnitLayout::frozen(&part, mesh.shard(), &opts.plan)?
            } else {
                UnitLayout::new(&part, &optimizer, mesh.shard(), fsdp2, &opts.plan, multi)?
            };
            planned.extend(
                buffers
                    .into_iter()
                    .map(|(l, s)| (unit.name.clone(), l, s, frozen)),
            );
        }
        groups.push((unit.name.clone(), (first..planned.len()).collect()));
    }
    let shards: Vec<&LocalShard> = planned.iter().map(|(_, _, l, _)| l).collect();
    let optimizer_id = agree::OptimizerId {
        name: optimizer.name(),
        lr: optimizer.learning_rate(),
        settings: optimizer.settings(),
        roles: params
            .iter()
            .map(|(name, t)| optimizer.role(name, t.dims()))
            .collect(),
        options: format!("{opts:?}"),
    };
    let trained: Vec<bool> = params
        .iter()
        .map(|(name, t)| !is_frozen(name, t.dims()))
        .collect();
    agree::check_ranks_agree(comm, params, &trained, &shards, &optimizer_id)?;
    let mut units = Vec::with_capacity(planned.len());
    // Full gradient buffers are reused from one unit's backward to the next.
    let pool = Arc::new(GradPool::default());
    for (name, layout, local, frozen) in planned {
        let (grad_slots, grad_len) = layout.grad_slots();
        let sink = GradSink::new(grad_slots, grad_len, stats.clone())?
            .with_pool(pool.clone())
            .on(placement.clone());
        let grads = GradBuffer::new(sink, local.len)?;
        let mut params = ParamBuffer::new(
            layout.slots(),
            &placement,
            local.len,
            opts.mixed_precision.param_dtype,
            grads.sink().clone(),
            anchor.clone(),
        )?;
        let mut master = vec![0.0; local.len];
        load_local(&local, &mut master, &values)?;
        params.set_master(master)?;
        if frozen {
            params.freeze();
        }
        units.push(ShardedUnit {
            name,
            state: optimizer.init_on(&optimizer_shard(&local, frozen), &placement)?,
            local,
            layout,
            params,
            grads,
            reported: false,
        });
    }
    let buffers: Vec<Vec<&ParamBuffer>> = groups
        .iter()
        .map(|(_, bs)| bs.iter().map(|&b| &units[b].params).collect())
        .collect();
    let param_pool = ParamPool::new(&buffers);
    Ok(ShardedModel {
        mesh,
        optimizer,
        opts,
        units,
        groups,
        stats,
        without_gradient: None,
        loss_not_finite: false,
        partial_gradients: None,
        partly_loaded: None,
        agreed_stages: Vec::new(),
        skipped: 0,
        steps: 0,
        schedule: None,
        activations: Vec::new(),
        param_pool,
        run_id: crate::checkpoint::fs::new_run_id(),
    })
}

/// The parameter list as an inventory (f32); `inventory_of(p)?.units_by(..)` with the same
/// wrap rule groups exactly as [`fully_shard`] does.
pub fn inventory_of(params: &[(String, Tensor)]) -> Result<Inventory> {
    use crate::error::Context;
    let tensors = params
        .iter()
        .map(|(name, t)| {
            // Integer and boolean tensors are buffers, not parameters: an optimizer would
            // move them by weight decay.
            if !t.dtype().is_float() {
                return Err(crate::Error::BadInput {
                    op: "fully_shard",
                    what: format!("parameter {name} of dtype {:?}", t.dtype()),
                    reason: "only floating-point tensors train; keep buffers out of the list"
                        .into(),
                });
            }
            if name.is_empty() {
                return Err(crate::Error::BadInput {
                    op: "fully_shard",
                    what: format!("an unnamed parameter of shape {:?}", t.dims()),
                    reason: "names key the parameters' values, units, roles and checkpoint \
                             entries: name every parameter (a prefix left empty?)"
                        .into(),
                });
            }
            if t.elem_count() == 0 {
                return Err(crate::Error::BadInput {
                    op: "fully_shard",
                    what: format!("parameter {name} of shape {:?}", t.dims()),
                    reason:
                        "holds no elements, so nothing of it shards, trains or is saved: leave it \
                             out of the list (a stage that needs it can make it with \
                             `Tensor::zeros`)"
                            .into(),
                });
            }
            if name.contains("::") {
                return Err(crate::Error::BadInput {
                    op: "fully_shard",
                    what: format!("parameter name {name:?}"),
                    reason: "`::` separates a parameter from its optimizer state in checkpoint \
                             files (`name::m`), so such a name could collide with another \
                             parameter's state"
                        .into(),
                });
            }
            TensorSpec::new(name.clone(), t.dims(), ModelDType::F32)
                .with_context(|| format!("fully_shard: parameter {name}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let inventory = Inventory {
        model: "fully_shard".into(),
        tensors,
    };
    // Names key the values, the gathered parameters and the checkpoint: one name, one tensor.
    inventory.validate(None, None)?;
    check_untied(params)?;
    Ok(inventory)
}

/// `Err` when one candle tensor is listed under two names (a tied embedding and head passed
/// as both): each name would get its own master copy and the two would train apart, untied.
fn check_untied(params: &[(String, Tensor)]) -> Result<()> {
    let mut first_name = HashMap::new();
    for (name, t) in params {
        let first = first_name.entry(t.id()).or_insert(name.as_str());
        if *first != name.as_str() {
            return Err(crate::Error::BadInput {
                op: "fully_shard",
                what: format!("parameters {first} and {name}"),
                reason: "are one tensor (tied weights?): sharded, each name would train a copy \
                         of its own and the two would drift apart; list it once and read it \
                         under that name in every stage that uses it (stages of one unit)"
                    .into(),
            });
        }
    }
    Ok(())
}

/// `Err` for a unit a custom wrap rule named `""`: unit names key the stages, the describe
/// table and the checkpoint's layout, where an empty one would show as nothing.
fn check_unit_name(unit: &Unit) -> Result<()> {
    match unit.tensors.first() {
        Some(t) if unit.name.is_empty() => Err(crate::Error::BadInput {
            op: "fully_shard",
            what: format!("the unit of parameter {}", t.name),
            reason: "the wrap rule named it \"\": name every unit (return None for root)".into(),
        }),
        _ => Ok(()),
    }
}

/// Writes this rank's pieces of the initial values into the master shard.
fn load_local(
    local: &LocalShard,
    shard: &mut [f32],
    values: &HashMap<&str, &Tensor>,
) -> Result<()> {
    for piece in &local.pieces {
        let meta = &local.params[piece.param];
        let t = values[meta.name.as_str()];
        let flat = t
            .flatten_all()
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.narrow(0, piece.range.start, piece.range.len()))
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(crate::dbuffer::candle("fully_shard: initial values"))?;
        shard[piece.offset..piece.offset + flat.len()].copy_from_slice(&flat);
    }
    Ok(())
}

/// A reduction in bf16 (as FSDP2's `reduce_dtype`): the full f32 gradient buffer rounded to
/// bf16, reduced (summed in f32, rounded once), the shard widened into `local`; where the
/// buffers live (host loops, or `cuda::ops` kernels with the same bits).
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn reduce_bf16(
    comm: &dyn Communicator,
    placement: &Placement,
    layout: &UnitLayout,
    full: ViewMut<'_, f32>,
    local: ViewMut<'_, f32>,
    op: ReduceOp,
    stats: &CopyStats,
) -> Result<()> {
    stats.add_converted(2 * full.len() + 4 * local.len());
    match (full, local) {
        (ViewMut::Cpu(full), ViewMut::Cpu(local)) => {
            let mut cast: Vec<half::bf16> = full.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let mut out = vec![half::bf16::ZERO; local.len()];
            let (cast_buf, out_buf) = (BufMut::BF16(&mut cast), BufMut::BF16(&mut out));
            layout.reduce(comm, cast_buf, out_buf, op, stats)?;
            local
                .iter_mut()
                .zip(&out)
                .for_each(|(l, o)| *l = o.to_f32());
            Ok(())
        }
        #[cfg(feature = "cuda")]
        (ViewMut::Cuda(full), ViewMut::Cuda(mut local)) => {
            let Placement::Cuda(dev) = placement else {
                return Err(crate::storage::mixed("reduce (bf16)", "device gradients"));
            };
            let mut cast = dev.zeros::<half::bf16>(full.len())?;
            crate::cuda::ops::f32_to_bf16(dev, &full.as_view(), &mut cast.slice_mut(..))?;
            let mut out = dev.zeros::<half::bf16>(local.len())?;
            let (cast_buf, out_buf) = (cast.slice_mut(..).into(), out.slice_mut(..).into());
            layout.reduce(comm, cast_buf, out_buf, op, stats)?;
            crate::cuda::ops::bf16_to_f32(dev, &out.slice(..), &mut local)
        }
        #[allow(unreachable_patterns)]
        _ => Err(crate::storage::mixed(
            "reduce (bf16)",
            "host and device buffers",
        )),
    }
}

impl<O: Optimizer> ShardedModel<'_, O> {
    /// Gathers buffer `u`'s compute copies unless current, into `spare` storages where they fit.
    fn gather_unit(&mut self, u: usize, spare: Option<Vec<candle_core::Storage>>) -> Result<()> {
        self.check_not_partly_loaded("ShardedModel: gather a unit")?;
        let comm = self.mesh.shard();
        let stats = self.stats.clone();
        let unit = &mut self.units[u];
        if unit.params.state() == Materialized::Unsharded {
            return Ok(());
        }
        let layout = &unit.layout;
        match unit.params.dtype() {
            DType::BF16 => {
                // The cast before the all-gather (as FSDP2): one pass over the shard.
                let cast = unit.params.master_bf16()?;
                unit.params.gather_into(spare, |_, dsts| {
                    layout.gather(comm, cast.buf(), dsts, &stats)
                })
            }
            _ => unit.params.gather_into(spare, |master, dsts| {
                layout.gather(comm, master, dsts, &stats)
            }),
        }
    }

    /// Reduce-scatters unit `u`'s gradient buffer into its local gradient shard, and records
    /// parameters that got no gradient on any rank in the first reduction (one small
    /// all-gather of a flag per parameter, that time only).
    fn reduce_unit(&mut self, u: usize) -> Result<()> {
        if self.units[u].params.is_frozen() {
            return Ok(());
        }
        if self.units[u].params.state() == Materialized::Stale {
            // Whole-model mode without a new `unshard`: the step moved the masters, not the
            // tensors the model computed with, and the loss would stop falling silently.
            return Err(crate::Error::BadInput {
                op: "reduce gradients",
                what: format!("unit {}", self.units[u].name),
                reason: "its parameters changed in a step after they were gathered, so this \
                         backward ran on the old values: call unshard() before each step's \
                         forward (it rewrites the same tensors in place)"
                    .into(),
            });
        }
        let op = self.opts.reduce;
        let bf16 = self.opts.mixed_precision.reduce_dtype == DType::BF16;
        let (stats, placement) = (self.stats.clone(), self.placement());
        let mesh = &self.mesh;
        let comm = mesh.shard();
        let unit = &mut self.units[u];
        let layout = &unit.layout;
        let single = mesh.world().world_size() == 1 && matches!(layout, UnitLayout::Ragged(_));
        let touched = if single && !bf16 {
            unit.grads.adopt_as_local(&stats)?
        } else {
            unit.grads.reduce_with(&stats, |full, mut local| {
                if bf16 {
                    reduce_bf16(comm, &placement, layout, full, local.reborrow(), op, &stats)?;
                } else {
                    layout.reduce(comm, full.into(), local.reborrow().into(), op, &stats)?;
                }
                mesh.reduce_over_replicas(local.into(), op)
            })?
        };
        if unit.reported {
            return Ok(());
        }
        unit.reported = true;
        // Over all ranks (every rank reduces every unit first at the same point): a gradient
        // that reached a parameter on any rank trains it, and a per-rank verdict would make
        // `require_gradients` fail on some ranks only, the others waiting in the next step.
        let touched = agree::any_rank(self.mesh.world(), &touched)?;
        let slots = unit.params.slots().iter().zip(&touched);
        let missing = slots.filter(|(_, &t)| !t).map(|(s, _)| s.name.clone());
        let without = self.without_gradient.get_or_insert_with(Vec::new);
        without.extend(missing);
        let all_reported = self
            .units
            .iter()
            .all(|u| u.reported || u.params.is_frozen());
        if self.opts.require_gradients && all_reported && !without.is_empty() {
            // Once every unit has been reduced: the error names every such parameter.
            return Err(crate::Error::BadInput {
                op: "reduce gradients",
                what: "the first backward".into(),
                reason: format!(
                    "no gradient reached {without:?} (a forward-only kernel such as \
                     candle_nn::LayerNorm's, or a parameter the loss does not use)"
                ),
            });
        }
        Ok(())
    }

    /// Gathers every unit and returns its parameter tensors by name (feed them to
    /// `candle_nn::VarBuilder::from_tensors` to build the model, once: later calls rewrite the
    /// same tensors in place). Their gradients accumulate in the units' gradient buffers on
    /// every `backward`. A unit-by-unit [`Self::forward_backward`] in between frees what these
    /// tensors hold (each storage becomes an empty byte placeholder, on which candle's ops
    /// fail or panic): call `unshard` again, and rebuild the model, before using them.
    pub fn unshard(&mut self) -> Result<HashMap<String, Tensor>> {
        let mut views = HashMap::new();
        for u in 0..self.units.len() {
            self.gather_unit(u, None)?;
            let unit = &self.units[u];
            let tensors = unit.params.tensors()?;
            for (slot, t) in unit.params.slots().iter().zip(tensors) {
                views.insert(slot.name.clone(), t.clone());
            }
        }
        Ok(views)
    }

    /// Reduce-scatters every unit's accumulated gradients (average or sum over ranks, per
    /// [`FsdpOptions::reduce`]) into its local gradient shard. A unit the loss did not reach
    /// reduces zeros, so every rank runs the same collectives.
    /// An `Err` part way leaves some units reduced and others not: [`ShardedModel::step`]
    /// then refuses until [`ShardedModel::discard_gradients`].
    pub fn reduce_gradients(&mut self) -> Result<()> {
        let reduced = (0..self.units.len()).try_for_each(|u| self.reduce_unit(u));
        if let Err(e) = &reduced {
            self.note_partial_gradients(e);
        }
        reduced
    }

    /// `Err` after a load that failed while reading: the values are part old, part new.
    pub(crate) fn check_not_partly_loaded(&self, op: &'static str) -> Result<()> {
        let Some(p) = &self.partly_loaded else {
            return Ok(());
        };
        let what = match p.state_too {
            true => "parameters and optimizer state",
            false => "parameters",
        };
        Err(crate::Error::BadInput {
            op,
            what: "the model".into(),
            reason: format!(
                "a load failed while reading ({}), leaving its {what} partly replaced: load a \
                 checkpoint again, or build the model anew with fully_shard",
                p.cause
            ),
        })
    }

    /// Records that a backward or reduction failed part way (`error`), so that `step` refuses
    /// gradients that count the failed batch for some units and not others.
    pub(crate) fn note_partial_gradients(&mut self, error: &crate::Error) {
        self.partial_gradients = Some(error.to_string());
    }

    /// Drops every gradient since the last step (reduced or still in a unit's buffer) and the
    /// losses noted with them: after a `forward_backward` or `reduce_gradients` that failed
    /// part way, run the step's micro-batches again from here.
    pub fn discard_gradients(&mut self) {
        self.units.iter_mut().for_each(|u| u.grads.discard());
        self.loss_not_finite = false;
        self.partial_gradients = None;
    }

    /// Compares the stage list with every rank's (one exchange) when it is not the list they
    /// last agreed on: ranks whose stages differ would gather different units in lockstep, and
    /// same-length gathers pass every collective's checks.
    pub(crate) fn check_stages_agree(&mut self, names: &[String], units: &[usize]) -> Result<()> {
        if units != self.agreed_stages.as_slice() {
            agree::check_stages_agree(self.mesh.world(), names)?;
            self.agreed_stages = units.to_vec();
        }
        Ok(())
    }

    /// One optimizer step on every unit's local shard, with the gradients reduced since the
    /// last step (several micro-batches accumulate). If a loss or gradient is not finite on any
    /// rank, [`FsdpOptions::non_finite`] decides, alike on every rank; ranks about to step at
    /// different learning rates all get `Err` and take no step (one small all-gather).
    pub fn step(&mut self) -> Result<()> {
        const OP: &str = "ShardedModel::step";
        self.check_not_partly_loaded(OP)?;
        if let Some(cause) = &self.partial_gradients {
            return Err(crate::Error::BadInput {
                op: OP,
                what: "the gradients".into(),
                reason: format!(
                    "a backward since the last step failed part way ({cause}), so some units' \
                     gradients count its batch and others not: call discard_gradients() and run \
                     the step's micro-batches again"
                ),
            });
        }
        let trained: Vec<_> = self
            .units
            .iter()
            .filter(|u| !u.params.is_frozen())
            .collect();
        let mut counts = NonFiniteCounts::new(&self.placement(), trained.len())?;
        for (slot, unit) in trained.iter().enumerate() {
            unit.grads.add_non_finite_to(&mut counts, slot, OP)?;
        }
        let shards = counts.read()?.iter().filter(|&&c| c > 0).count();
        let bad = u64::from(self.loss_not_finite) + shards as u64;
        let scheduled = self
            .schedule
            .map(|(schedule, base)| base * schedule.factor(self.steps));
        let rate = scheduled.or_else(|| self.optimizer.learning_rate());
        let bad = agree::step_flags(self.mesh.world(), bad, rate)?;
        self.loss_not_finite = false;
        if bad > 0 {
            self.units.iter_mut().for_each(|u| u.grads.consume());
            if self.opts.non_finite == NonFinitePolicy::SkipStep {
                self.skipped += 1;
                return Ok(());
            }
            return Err(crate::Error::NonFinite {
                op: "ShardedModel::step",
                what: format!(
                    "{bad} loss or gradient shards over all ranks are NaN or infinite; the step \
                     was not taken (lower the learning rate, or set NonFinitePolicy::SkipStep)"
                ),
            });
        }
        if let Some(lr) = scheduled {
            self.optimizer.set_learning_rate(lr)?;
        }
        for unit in self.units.iter_mut().filter(|u| !u.params.is_frozen()) {
            let ShardedUnit {
                local,
                params,
                grads,
                state,
                ..
            } = unit;
            let g = grads.local(OP)?;
            self.optimizer
                .step(state, local, params.master_view_mut(), g, self.mesh.shard())?;
            grads.consume();
        }
        self.steps += 1;
        Ok(())
    }

    /// The learning rate of the last step taken (`None` if the optimizer has none); before the
    /// first step under a schedule, the rate the first step will take (the base times
    /// `factor(0)`, as torch's `LambdaLR` sets it at construction).
    pub fn learning_rate(&self) -> Option<f64> {
        match self.schedule {
            Some((schedule, base)) if self.steps == 0 => Some(base * schedule.factor(0)),
            _ => self.optimizer.learning_rate(),
        }
    }

    /// Sets the optimizer's learning rate (as candle-nn's `Optimizer::set_learning_rate`) and
    /// drops any schedule.
    pub fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        self.optimizer.set_learning_rate(lr)?;
        self.schedule = None;
        Ok(())
    }

    /// From the next step on, the learning rate is a base rate times `schedule.factor(step)`,
    /// `step` counting the steps taken so far. The base is the current rate when no schedule
    /// is set, else the running schedule's base: a schedule set again after [`Self::load`]
    /// (which restores the saved schedule and base) does not take the decayed rate as its
    /// base. [`Self::set_learning_rate`] drops the schedule, and with it the base.
    pub fn set_schedule(&mut self, schedule: Schedule) -> Result<()> {
        use crate::error::Context;
        schedule.validate()?;
        let current = self
            .optimizer
            .learning_rate()
            .ok_or_else(|| crate::Error::BadInput {
                op: "set_schedule",
                what: self.optimizer.name().into(),
                reason: "the optimizer has no learning rate to schedule".into(),
            })?;
        let base = self.schedule.map_or(current, |(_, base)| base);
        // Every rate the schedule will set is checked now, not at the step that reaches it
        // (a `min_factor` of 1e-300 was refused only at step `total`, mid-run): each of the
        // lowest is set and the current rate put back; a refused one changes nothing.
        for step in schedule.lowest_steps() {
            let lr = base * schedule.factor(step);
            self.optimizer.set_learning_rate(lr).with_context(|| {
                format!("set_schedule: {schedule:?} sets the rate {lr:?} at step {step}")
            })?;
            self.optimizer.set_learning_rate(current)?;
        }
        self.schedule = Some((schedule, base));
        Ok(())
    }

    /// Steps taken since construction (skipped steps not counted).
    pub fn steps_taken(&self) -> usize {
        self.steps
    }

    /// This run's id (16 hex digits), recorded in every checkpoint it saves: new from
    /// [`fully_shard`], the loaded checkpoint's after [`ShardedModel::load`]. A save refuses a
    /// root holding checkpoints of another run. Rank 0's is the one saved and compared.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Clips the reduced gradients to a global L2 norm of at most `max_norm` (torch's
    /// `clip_grad_norm_`: scaled by `max_norm / (norm + 1e-6)` when that is below 1) and returns
    /// the norm before clipping. The norm is summed exactly (`fsdp::clip`), so it is the same bits
    /// on every rank and unsharded, given the same gradients; one all-gather. A non-finite
    /// gradient gives a NaN norm and leaves the gradients to [`Self::step`]'s policy. Finite
    /// gradients whose norm exceeds `f32::MAX` return `+inf` but are clipped by the exact norm
    /// (torch's f32 norm overflows and zeroes them).
    pub fn clip_grad_norm(&mut self, max_norm: f32) -> Result<f32> {
        crate::limits::positive_finite("clip_grad_norm", "max_norm", f64::from(max_norm))?;
        let mut squares = clip::ExactSquares::new();
        for unit in self.units.iter().filter(|u| !u.params.is_frozen()) {
            squares.add(unit.grads.local_storage("clip_grad_norm")?)?;
        }
        // Over the shard group: its replicas hold the same reduced gradients.
        let norm = squares.total(self.mesh.shard())?.sqrt();
        let coef = f64::from(max_norm) / (norm + 1e-6);
        if norm.is_finite() && coef < 1.0 {
            // A subnormal f32 factor (a norm beyond ~1e38·max_norm) has too few bits: scale by
            // an exact power of two first and the rest after, both normal.
            let factors = if coef >= f64::from(f32::MIN_POSITIVE) {
                vec![coef as f32]
            } else {
                vec![2f32.powi(-64), (coef * 2f64.powi(64)) as f32]
            };
            for unit in self.units.iter_mut().filter(|u| !u.params.is_frozen()) {
                for &f in &factors {
                    unit.grads.scale_local(f)?;
                }
            }
        }
        Ok(norm as f32)
    }

    /// Steps skipped for non-finite values ([`NonFinitePolicy::SkipStep`]).
    pub fn skipped_steps(&self) -> usize {
        self.skipped
    }

    /// Records a loss seen by this rank (checked by the next [`Self::step`]).
    pub fn note_loss(&mut self, loss: f32) {
        self.loss_not_finite |= !loss.is_finite();
    }

    /// Frees every unit's compute copies (their memory returns once the model holding them is
    /// dropped; the next [`Self::unshard`] makes new tensors, so rebuild the model).
    pub fn reshard(&mut self) {
        for unit in &mut self.units {
            unit.params.release();
        }
    }

    /// The full f32 value of every parameter (the master weights, whatever the compute
    /// dtype), gathered by a fresh all-gather; for checks and checkpoints (copies).
    pub fn full_params(&mut self) -> Result<HashMap<String, Vec<f32>>> {
        let mut out = HashMap::new();
        for u in 0..self.units.len() {
            let values = self.gather_buffer(u)?;
            for (slot, v) in self.units[u].params.slots().iter().zip(values) {
                out.insert(slot.name.clone(), v);
            }
        }
        Ok(out)
    }

    /// Buffer `u`'s parameters, gathered in full (f32 master values) where the master lives
    /// (device to device on a GPU), then read to the host, in slot order: what
    /// [`Self::full_params`], the digest and the export read.
    pub(crate) fn gather_buffer(&self, u: usize) -> Result<Vec<Vec<f32>>> {
        self.check_not_partly_loaded("ShardedModel: gather a buffer")?;
        let unit = &self.units[u];
        let (slots, placement) = (unit.params.slots(), unit.params.placement());
        let mut values = slots
            .iter()
            .map(|s| placement.zeros::<f32>(s.numel()))
            .collect::<Result<Vec<_>>>()?;
        let mut dsts: Vec<BufMut<'_>> = values.iter_mut().map(|v| v.view_mut().into()).collect();
        let master = unit.params.master_view().into();
        unit.layout
            .gather(self.mesh.shard(), master, &mut dsts, &self.stats)?;
        drop(dsts);
        values.into_iter().map(Storage::into_vec).collect()
    }

    /// Parameters that received no gradient on any rank in the first reduction of their unit
    /// (the same list on every rank; `None` before any reduction). candle's forward-only
    /// kernels (`*_no_bwd`) are the usual cause.
    pub fn params_without_gradient(&self) -> Option<&[String]> {
        self.without_gradient.as_deref()
    }

    /// Bytes moved outside collectives since construction, and bytes moved by collectives.
    pub fn stats(&self) -> &CopyStats {
        &self.stats
    }

    /// Every buffer's unit name and shard size `S` (elements per rank), in buffer order (a unit
    /// planned as `k` buffers appears `k` times).
    pub fn shard_sizes(&self) -> Vec<(String, usize)> {
        self.units
            .iter()
            .map(|u| (u.name.clone(), u.local.len))
            .collect()
    }

    /// Unit names, in order.
    pub fn unit_names(&self) -> Vec<&str> {
        self.groups.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Collective buffers per unit, in unit order.
    pub fn buffers_per_unit(&self) -> Vec<(&str, usize)> {
        self.groups
            .iter()
            .map(|(n, b)| (n.as_str(), b.len()))
            .collect()
    }

    /// `(unit, parameter, element offset in the unit's full buffer)` of every parameter of the
    /// ragged layout (empty for the FSDP2-style baseline, whose collective buffer is rank-major).
    pub fn offsets(&self) -> Vec<(String, String, usize)> {
        self.units
            .iter()
            .flat_map(|u| match &u.layout {
                UnitLayout::Ragged(g) => g
                    .tensors
                    .iter()
                    .map(|(name, _, off)| (u.name.clone(), name.clone(), *off))
                    .collect(),
                UnitLayout::Fsdp2(_) => Vec::new(),
            })
            .collect()
    }

    /// The optimizer's [`Optimizer::events`] summed over this rank's units and over every
    /// rank (one all-gather: call it on every rank), in the optimizer's order; the same on
    /// every rank. `Err` when the ranks name different events.
    pub fn optimizer_events(&self) -> Result<Vec<(&'static str, u64)>> {
        const OP: &str = "ShardedModel::optimizer_events";
        let mut mine: Vec<(&'static str, u64)> = Vec::new();
        for unit in &self.units {
            for (what, n) in self.optimizer.events(&unit.state) {
                match mine.iter_mut().find(|(w, _)| *w == what) {
                    Some((_, total)) => *total = total.saturating_add(n),
                    None => mine.push((what, n)),
                }
            }
        }
        // Each rank's names and counts; the names must agree, the counts add (exactly: u64).
        // Over the shard group: replicas step the same shards and count the same events.
        let every = crate::comm::all_gather_bytes(self.mesh.shard(), &encode_events(&mine))?;
        let mut total: Vec<(&'static str, u64)> = mine.iter().map(|&(w, _)| (w, 0)).collect();
        for (rank, bytes) in every.iter().enumerate() {
            let theirs = decode_events(bytes)
                .filter(|e| e.len() == mine.len() && e.iter().zip(&mine).all(|(a, b)| a.0 == b.0));
            let Some(theirs) = theirs else {
                return Err(crate::Error::Comm {
                    op: OP,
                    rank: self.mesh.world().rank(),
                    reason: format!(
                        "rank {} counts other optimizer events than this rank",
                        self.mesh.world_rank_of(rank)
                    ),
                });
            };
            for ((_, n), (_, t)) in total.iter_mut().zip(theirs) {
                *n = n.saturating_add(t);
            }
        }
        Ok(total)
    }

    /// The optimizer state of every unit, in unit order.
    pub fn states(&self) -> Vec<&O::State> {
        self.units.iter().map(|u| &u.state).collect()
    }

    /// The local shard geometry of every unit, in unit order.
    pub fn local_shards(&self) -> Vec<&LocalShard> {
        self.units.iter().map(|u| &u.local).collect()
    }

    /// Runs `f` on every unit's master shard (read-only), in unit order.
    pub fn with_local_params(&self, mut f: impl FnMut(&LocalShard, &[f32])) -> Result<()> {
        for unit in &self.units {
            f(&unit.local, &unit.params.master_host()?);
        }
        Ok(())
    }

    /// Runs `f` on every unit's reduced local gradient shard, in unit order (`Err` before a
    /// reduction); frozen buffers, which have none, are skipped.
    pub fn with_local_grads(&self, mut f: impl FnMut(&LocalShard, &[f32])) -> Result<()> {
        for unit in self.units.iter().filter(|u| !u.params.is_frozen()) {
            f(&unit.local, &unit.grads.local_host("with_local_grads")?);
        }
        Ok(())
    }

    /// Whether each unit's compute copies are materialized, in unit order.
    pub fn unshard_state(&self) -> Vec<Materialized> {
        self.units.iter().map(|u| u.params.state()).collect()
    }

    /// The gradient sink of unit `name`'s first buffer (storage identity checks: where backward
    /// writes).
    pub fn grad_sink(&self, name: &str) -> Option<&Arc<GradSink>> {
        self.units
            .iter()
            .find(|u| u.name == name)
            .map(|u| u.grads.sink())
    }

    /// The memory this rank's runtime holds, predicted from the plans before any full buffer
    /// exists.
    pub fn memory_plan(&self) -> MemoryPlan {
        let units = self
            .groups
            .iter()
            .enumerate()
            .map(|(g, (name, buffers))| {
                let mut m = UnitMemory {
                    name: name.clone(),
                    shard_bytes: 0,
                    full_param_bytes: 0,
                    full_grad_bytes: 0,
                    largest_param_bytes: 0,
                    storage_class: self.param_pool.class_of(g),
                };
                for u in buffers.iter().map(|&b| &self.units[b]) {
                    m.shard_bytes += 8 * u.local.len;
                    m.full_param_bytes += u.params.full_bytes();
                    m.full_grad_bytes += 4 * u.layout.grad_slots().1;
                    let elem = u.params.dtype().size_in_bytes();
                    let largest = u.params.slots().iter().map(|s| s.numel() * elem).max();
                    m.largest_param_bytes = m.largest_param_bytes.max(largest.unwrap_or(0));
                }
                m
            })
            .collect();
        MemoryPlan {
            units,
            overlap_possible: self.overlap_possible(),
        }
    }

    /// Activation bytes per stage measured by the last [`Self::forward_backward`] (walking each
    /// stage's graph: [`StageActivations`]); empty before the first. Feed them to
    /// [`MemoryPlan::peak_unit_by_unit`].
    pub fn activations(&self) -> &[StageActivations] {
        &self.activations
    }

    pub(crate) fn set_activations(&mut self, activations: Vec<StageActivations>) {
        self.activations = activations;
    }

    pub(crate) fn stats_arc(&self) -> &Arc<CopyStats> {
        &self.stats
    }

    pub(crate) fn options(&self) -> &FsdpOptions {
        &self.opts
    }

    /// Whether the unit-by-unit runtime runs collectives on a second thread beside the stages:
    /// [`FsdpOptions::overlap`], except at world 1 on a device. There a collective is a copy
    /// queued on the rank's own stream, in order with the stages, so a thread hides nothing,
    /// and it would cost two device synchronizations a stage, each stalling every later
    /// launch (its stream is not the rank's). Measured on an H200 (docs/benchmarks.md,
    /// `train-cuda`): at 64 rows the demo model's sharded step took 1.17× the plain one without
    /// the thread, and 1.4–1.6× with its jobs queued before each stage.
    pub fn overlaps(&self) -> bool {
        self.opts.overlap && self.overlap_possible()
    }

    /// Whether a collectives thread can hide anything: not at world 1 on a device
    /// ([`Self::overlaps`]).
    fn overlap_possible(&self) -> bool {
        self.mesh.world().world_size() > 1 || self.placement().is_cpu()
    }

    /// The index of unit `name` (its group of buffers).
    pub(crate) fn unit_index(&self, name: &str) -> Option<usize> {
        self.groups.iter().position(|(n, _)| n == name)
    }

    fn buffers_of(&self, g: usize) -> Vec<usize> {
        self.groups[g].1.clone()
    }

    /// Unit `g`'s parameter tensors by name, from all its buffers: tracked (gradients reach the
    /// sinks) or detached (forward only, no graph).
    pub(crate) fn unit_params(&self, g: usize, tracked: bool) -> Result<UnitParams> {
        let mut map = HashMap::new();
        let mut dtype = self.opts.mixed_precision.param_dtype;
        for b in self.buffers_of(g) {
            let unit = &self.units[b];
            dtype = unit.params.dtype();
            for (s, t) in unit.params.slots().iter().zip(unit.params.tensors()?) {
                let t = if tracked { t.clone() } else { t.detach() };
                map.insert(s.name.clone(), t);
            }
        }
        Ok(UnitParams::new(map, dtype))
    }

    /// Gathers every buffer of unit `g` that is not current.
    pub(crate) fn ensure_gathered(&mut self, g: usize) -> Result<()> {
        let buffers = self.buffers_of(g);
        let needs_storage = buffers.iter().any(|&b| {
            matches!(
                self.units[b].params.state(),
                Materialized::Sharded | Materialized::Freed
            )
        });
        let mut spare = needs_storage
            .then(|| self.param_pool.take(g))
            .flatten()
            .unwrap_or_default();
        for (i, b) in buffers.into_iter().enumerate() {
            let mine = spare.get_mut(i).map(std::mem::take);
            self.gather_unit(b, mine)?;
        }
        Ok(())
    }

    /// Where the model's buffers live (all in one place: `fully_shard` checks it).
    pub(crate) fn placement(&self) -> Placement {
        self.units
            .first()
            .map_or(Placement::Cpu, |u| u.params.placement())
    }

    /// Whether every buffer of unit `g` holds current compute copies.
    pub(crate) fn is_gathered(&self, g: usize) -> bool {
        self.groups[g]
            .1
            .iter()
            .all(|&b| self.units[b].params.state() == Materialized::Unsharded)
    }

    /// Empties the storages of every buffer of unit `g` but keeps its tensors (a kept graph
    /// holds them); the next gather refills them.
    pub(crate) fn free_unit_storages(&mut self, g: usize) -> Result<()> {
        let storages = self
            .buffers_of(g)
            .into_iter()
            .map(|b| self.units[b].params.take_storages())
            .collect::<Result<Vec<_>>>()?;
        self.param_pool.give_back(g, storages);
        Ok(())
    }

    /// Frees unit `g`'s compute copies for good (until the next gather makes new tensors), their
    /// storages kept for the next gather of a unit like it. Only for units no graph or caller
    /// still reads: their tensors are left with empty storages.
    pub(crate) fn recycle_unit(&mut self, g: usize) -> Result<()> {
        self.free_unit_storages(g)?;
        for b in self.buffers_of(g) {
            self.units[b].params.release();
        }
        Ok(())
    }

    /// Bytes of compute-copy storages kept for the next gathers.
    pub fn spare_param_bytes(&self) -> usize {
        self.param_pool.spare_bytes()
    }

    /// Reduce-scatters every buffer of unit `g`.
    pub(crate) fn reduce_unit_now(&mut self, g: usize) -> Result<()> {
        self.buffers_of(g)
            .into_iter()
            .try_for_each(|b| self.reduce_unit(b))
    }
}

/// The device every parameter of `params` lives on (the CPU for none); `Err` for a mix.
fn device_of(params: &[(String, Tensor)]) -> Result<candle_core::Device> {
    let device = params
        .first()
        .map_or(candle_core::Device::Cpu, |(_, t)| t.device().clone());
    match params
        .iter()
        .find(|(_, t)| !t.device().same_device(&device))
    {
        None => Ok(device),
        Some((name, t)) => Err(crate::Error::BadInput {
            op: "fully_shard",
            what: format!("parameter {name}"),
            reason: format!(
                "on {:?} while the first parameter is on {device:?}: every parameter must live \
                 on one device",
                t.device()
            ),
        }),
    }
}

/// A unit's memory on one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitMemory {
    pub name: String,
    /// Master and gradient shards (f32 each), persistent.
    pub shard_bytes: usize,
    /// The compute copies while gathered.
    pub full_param_bytes: usize,
    /// The full gradient buffer between backward and reduce-scatter.
    pub full_grad_bytes: usize,
    /// The unit's largest parameter in the compute dtype (sizes candle's gradient temporaries).
    pub largest_param_bytes: usize,
    /// The first unit whose tensors have the same sizes and dtypes: units of one class reuse
    /// each other's freed compute-copy storages.
    pub storage_class: usize,
}

/// Tensors of a parameter's size candle's backward holds at once while it computes one
/// parameter's gradient, besides the unit's gradient buffer: measured with the counting
/// allocator on the `bench train` model (Linear 1024×4096, candle 0.11.1: 84 MiB for 16 MiB
/// weights). By candle's code there are at least three (the matmul's weight gradient, the zeros
/// `GradStore::or_insert` accumulates into, their sum; again through the transpose node); the
/// constant is the measurement, not a derivation.
const CANDLE_GRADIENT_TEMPORARIES: usize = 5;

/// What the runtime holds per rank, from the plans (optimizer state and activations apart).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    pub units: Vec<UnitMemory>,
    /// Whether the runtime can overlap collectives with stages ([`ShardedModel::overlaps`]
    /// with overlap on): `peak_unit_by_unit` replays without overlap where it cannot.
    pub overlap_possible: bool,
}

impl MemoryPlan {
    /// Master plus gradient shards of every unit.
    pub fn shard_bytes(&self) -> usize {
        self.units.iter().map(|u| u.shard_bytes).sum()
    }

    /// Peak of the unit-by-unit runtime running stages on `stage_units` (unit index per
    /// stage) with `opts`' reshard, recompute and overlap settings (overlap only where
    /// [`Self::overlap_possible`]), from a replay of its
    /// schedule (`stages::peak_of_schedule`): the shards and full buffers from the plans, plus
    /// `activations` per stage ([`ShardedModel::activations`], measured on a step; empty: none)
    /// and candle's gradient temporaries in backward. `Err` for a stage naming a unit the plan
    /// does not have.
    pub fn peak_unit_by_unit(
        &self,
        stage_units: &[usize],
        opts: &FsdpOptions,
        activations: &[StageActivations],
    ) -> Result<usize> {
        if let Some((s, u)) = stage_units
            .iter()
            .enumerate()
            .find(|&(_, &u)| u >= self.units.len())
        {
            return Err(crate::Error::BadInput {
                op: "MemoryPlan::peak_unit_by_unit",
                what: format!("stage {s} on unit {u}"),
                reason: format!("the plan has {} units", self.units.len()),
            });
        }
        let full: Vec<stages::UnitBytes> = self
            .units
            .iter()
            .map(|u| stages::UnitBytes {
                params: u.full_param_bytes,
                grads: u.full_grad_bytes,
                backward_temporaries: CANDLE_GRADIENT_TEMPORARIES * u.largest_param_bytes,
                class: u.storage_class,
            })
            .collect();
        let opts = FsdpOptions {
            overlap: opts.overlap && self.overlap_possible,
            ..opts.clone()
        };
        Ok(self.shard_bytes() + stages::peak_of_schedule(&full, stage_units, &opts, activations))
    }
}

/// One rank's events as [`ShardedModel::optimizer_events`] sends them: per event, the name's
/// length, the name, the count (little-endian `u64`s).
fn encode_events(events: &[(&str, u64)]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for (what, n) in events {
        bytes.extend((what.len() as u64).to_le_bytes());
        bytes.extend(what.as_bytes());
        bytes.extend(n.to_le_bytes());
    }
    bytes
}

/// [`encode_events`]' list back; `None` when the bytes are not such a list.
fn decode_events(mut bytes: &[u8]) -> Option<Vec<(String, u64)>> {
    let mut out = Vec::new();
    let word = |b: &mut &[u8]| -> Option<u64> {
        let (w, rest) = b.split_first_chunk::<8>()?;
        *b = rest;
        Some(u64::from_le_bytes(*w))
    };
    while !bytes.is_empty() {
        let len = usize::try_from(word(&mut bytes)?).ok()?;
        let (what, rest) = bytes.split_at_checked(len)?;
        bytes = rest;
        let what = String::from_utf8(what.to_vec()).ok()?;
        out.push((what, word(&mut bytes)?));
    }
    Some(out)
}
