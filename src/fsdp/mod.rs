//! `fully_shard`: a candle model's parameters, sharded over the ranks of a communicator.
//!
//! # Note: the four buffers of a unit
//! Each FSDP unit (one decoder layer, or the root) has, on every rank:
//! - **params** ([`DBuffer`], role `Params`): the unsharded fp32 buffer the model's parameters
//!   are views of, and the *master* local shard (its own slice, or a separate shard when the
//!   full buffer is freed between steps);
//! - **grads** (role `Grads`): the flat gradient candle computes for the params buffer, adopted
//!   without copying, reduce-scattered in place;
//! - **optimizer state**: the optimizer's `State`, laid out like the local shard;
//! - for the FSDP2-style baseline only, a separate model buffer and the copies between it and
//!   the collective buffer ([`fsdp2`]).
//!
//! A step is `unshard` (all-gather) → forward/backward → `reduce_gradients` (reduce-scatter)
//! → `step` (optimizer on local shards) → `reshard`.
//!
//! # Candle and zero copy
//! The params buffer is one candle `Var`; the model's parameters are `narrow(..).reshape(..)`
//! views of it, so all-gather writes straight into them. Backward then produces one gradient
//! tensor for the whole buffer (padding zero) and the reduce-scatter runs on it in place.
//! Candle builds that gradient by zero-padding each view's gradient to the buffer size, an
//! O(params × buffer) cost inside backward; per-layer units keep it small.

pub mod fsdp2;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::Tensor;

use crate::comm::{Communicator, ReduceOp};
use crate::dbuffer::{
    candle, f32_mut, f32_ref, with_mut, with_ref, CopyStats, DBuffer, Geometry, Role,
};
use crate::model::{DType, Inventory, TensorSpec};
use crate::optim::{LocalShard, Optimizer};
use crate::plan::PlanOptions;
use crate::{Error, Result};

/// How parameters are laid out over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShardLayout {
    /// Planned RaggedShard layout: one buffer per unit, collectives in place, no copies.
    Ragged,
    /// PyTorch FSDP2's layout: per-parameter even `Shard(0)` with padding, a rank-major
    /// collective buffer, copy-out after all-gather and copy-in before reduce-scatter.
    Fsdp2,
}

/// Options of [`fully_shard`].
#[derive(Clone, Debug)]
pub struct FsdpOptions {
    pub layout: ShardLayout,
    /// Free the unsharded buffer after each step and keep only the local shard (re-gathered
    /// by the next `unshard`). Off: the unsharded buffer is kept and the local shard is its own
    /// slice, so all-gather runs in place.
    pub reshard_after_forward: bool,
    /// Average (default) or sum gradients over ranks.
    pub reduce: ReduceOp,
    pub plan: PlanOptions,
}

impl Default for FsdpOptions {
    fn default() -> Self {
        FsdpOptions {
            layout: ShardLayout::Ragged,
            reshard_after_forward: false,
            reduce: ReduceOp::Avg,
            plan: PlanOptions::default(),
        }
    }
}

/// One FSDP unit on one rank.
struct ShardedUnit<S> {
    name: String,
    local: LocalShard,
    params: DBuffer,
    grads: Option<DBuffer>,
    state: S,
    /// The FSDP2-style baseline's model buffer and copy geometry.
    fsdp2: Option<fsdp2::Fsdp2Unit>,
}

/// A model's parameters sharded over the ranks of `comm`, with their optimizer.
pub struct ShardedModel<'c, O: Optimizer> {
    comm: &'c dyn Communicator,
    optimizer: O,
    opts: FsdpOptions,
    units: Vec<ShardedUnit<O::State>>,
    stats: Arc<CopyStats>,
}

/// Shards `params` (full initial values, identical on every rank) into FSDP units (one per
/// decoder layer, `layers.<i>.`, plus a root unit), plans each unit from the optimizer's atomic
/// blocks, and allocates parameters, gradients and optimizer state by that plan.
pub fn fully_shard<'c, O: Optimizer>(
    params: &[(String, Tensor)],
    optimizer: O,
    comm: &'c dyn Communicator,
    opts: FsdpOptions,
) -> Result<ShardedModel<'c, O>> {
    let inv = inventory_of(params)?;
    let values: HashMap<&str, &Tensor> = params.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let stats = Arc::new(CopyStats::default());
    let (world, rank) = (comm.world_size(), comm.rank());
    let mut units = Vec::new();
    for unit in inv.units() {
        let (local, params, fsdp2) = match opts.layout {
            ShardLayout::Ragged => {
                let plan = optimizer.plan_unit(&unit, world, &opts.plan)?;
                let geometry = Geometry {
                    world,
                    rank,
                    shard_size: plan.shard_size,
                    tensors: plan
                        .placements
                        .iter()
                        .map(|p| (p.name.clone(), p.shape.clone(), p.offset))
                        .collect(),
                };
                let keep = !opts.reshard_after_forward;
                let params = DBuffer::zeros(Role::Params, Arc::new(geometry), keep, stats.clone())?;
                (LocalShard::from_plan(&plan, rank)?, params, None)
            }
            ShardLayout::Fsdp2 => {
                let f = fsdp2::Fsdp2Unit::new(&unit, world, rank, stats.clone())?;
                (f.local_shard(&unit), f.collective_buffer()?, Some(f))
            }
        };
        let mut sharded = ShardedUnit {
            name: unit.name.clone(),
            state: optimizer.init(&local)?,
            local,
            params,
            grads: None,
            fsdp2,
        };
        load_local(&mut sharded, &values)?;
        units.push(sharded);
    }
    Ok(ShardedModel {
        comm,
        optimizer,
        opts,
        units,
        stats,
    })
}

/// The parameter list as an inventory (f32), so units are grouped exactly as [`fully_shard`]
/// groups them.
pub fn inventory_of(params: &[(String, Tensor)]) -> Result<Inventory> {
    let tensors = params
        .iter()
        .map(|(name, t)| TensorSpec::new(name.clone(), t.dims(), DType::F32))
        .collect::<Result<Vec<_>>>()?;
    Ok(Inventory {
        model: "fully_shard".into(),
        tensors,
    })
}

/// Writes this rank's pieces of the initial values into the master local shard.
fn load_local<S>(unit: &mut ShardedUnit<S>, values: &HashMap<&str, &Tensor>) -> Result<()> {
    let local = &unit.local;
    let mut flat = Vec::with_capacity(local.params.len());
    for p in &local.params {
        let t = values[p.name.as_str()];
        flat.push(
            t.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(candle("fully_shard: initial values"))?,
        );
    }
    unit.params.with_local_mut(|shard| {
        for piece in &local.pieces {
            let src = &flat[piece.param][piece.range.clone()];
            shard[piece.offset..piece.offset + src.len()].copy_from_slice(src);
        }
        Ok(())
    })
}

impl<O: Optimizer> ShardedModel<'_, O> {
    /// All-gathers every unit and returns zero-copy views of every parameter, by name (feed
    /// them to `candle_nn::VarBuilder::from_tensors` to build the model).
    pub fn unshard(&mut self) -> Result<HashMap<String, Tensor>> {
        let mut views = HashMap::new();
        for unit in &mut self.units {
            unit.params.unshard(self.comm)?;
            let named = match &unit.fsdp2 {
                None => unit.params.views()?,
                Some(f) => {
                    f.copy_out(&unit.params)?;
                    f.views()?
                }
            };
            views.extend(named);
        }
        Ok(views)
    }

    /// Takes each unit's flat gradient out of `grads` and reduce-scatters it (average or sum
    /// over ranks, per [`FsdpOptions::reduce`]). A unit the loss did not reach gets zeros.
    pub fn reduce_gradients(&mut self, grads: &mut GradStore) -> Result<()> {
        for unit in &mut self.units {
            let geometry = Arc::new(unit.params.geometry().clone());
            let model_var = match &unit.fsdp2 {
                None => unit.params.full()?,
                Some(f) => f.model_buffer(),
            };
            let stats = self.stats.clone();
            let mut buffer = match (grads.remove(model_var.as_tensor()), &unit.fsdp2) {
                (Some(g), None) => DBuffer::from_full(Role::Grads, geometry, g, stats)?,
                (Some(g), Some(f)) => {
                    let buffer = DBuffer::zeros(Role::Grads, geometry, true, stats)?;
                    f.copy_in(&g, &buffer)?;
                    buffer
                }
                (None, _) => DBuffer::zeros(Role::Grads, geometry, true, stats)?,
            };
            buffer.reduce_scatter(self.comm, self.opts.reduce)?;
            unit.grads = Some(buffer);
        }
        Ok(())
    }

    /// One optimizer step on every unit's local shard (after [`Self::reduce_gradients`]).
    pub fn step(&mut self) -> Result<()> {
        for unit in &mut self.units {
            let ShardedUnit {
                name,
                local,
                params,
                grads,
                state,
                ..
            } = unit;
            let grads = grads.take().ok_or_else(|| Error::InvalidShard {
                op: "ShardedModel::step",
                reason: format!("unit {name} has no reduced gradients"),
            })?;
            params.with_local_mut(|p| {
                grads.with_local(|g| self.optimizer.step(state, local, p, g, self.comm))
            })?;
        }
        Ok(())
    }

    /// Frees unsharded buffers where the policy says so.
    pub fn reshard(&mut self) {
        for unit in &mut self.units {
            unit.params.reshard();
        }
    }

    /// The full value of every parameter, gathered (for checks and checkpoints; copies).
    pub fn full_params(&mut self) -> Result<HashMap<String, Vec<f32>>> {
        let views = self.unshard()?;
        views
            .into_iter()
            .map(|(name, t)| {
                let v = t
                    .flatten_all()
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(candle("full_params"))?;
                Ok((name, v))
            })
            .collect()
    }

    /// Bytes moved outside collectives since construction, and bytes moved by collectives.
    pub fn stats(&self) -> &CopyStats {
        &self.stats
    }

    /// Unit names with their shard sizes `S` (elements per rank).
    pub fn shard_sizes(&self) -> Vec<(String, usize)> {
        self.units
            .iter()
            .map(|u| (u.name.clone(), u.local.len))
            .collect()
    }

    /// `(unit, parameter, element offset in the unit's full buffer)` of every parameter of the
    /// ragged layout (empty for the FSDP2-style baseline, whose collective buffer is rank-major).
    pub fn offsets(&self) -> Vec<(String, String, usize)> {
        self.units
            .iter()
            .flat_map(|u| {
                u.params
                    .geometry()
                    .tensors
                    .iter()
                    .map(|(name, _, off)| (u.name.clone(), name.clone(), *off))
            })
            .collect()
    }

    /// The optimizer state of every unit, in unit order.
    pub fn states(&self) -> Vec<&O::State> {
        self.units.iter().map(|u| &u.state).collect()
    }

    /// The local shard geometry of every unit, in unit order.
    pub fn local_shards(&self) -> Vec<&LocalShard> {
        self.units.iter().map(|u| &u.local).collect()
    }

    /// Runs `f` on every unit's master local shard (read-only), in unit order.
    pub fn with_local_params(&self, mut f: impl FnMut(&LocalShard, &[f32])) -> Result<()> {
        for unit in &self.units {
            unit.params.with_local(|p| {
                f(&unit.local, p);
                Ok(())
            })?;
        }
        Ok(())
    }
}

/// Copies `len` elements between two contiguous tensors at element offsets (used only by the
/// FSDP2-style baseline; counted by the caller).
pub(crate) fn copy_between(
    src: &Tensor,
    src_off: usize,
    dst: &Tensor,
    dst_off: usize,
    len: usize,
) -> Result<()> {
    with_ref(src, |s| {
        let s = f32_ref(s)?;
        with_mut(dst, |d| {
            f32_mut(d)?[dst_off..dst_off + len].copy_from_slice(&s[src_off..src_off + len]);
            Ok(())
        })
    })
}
