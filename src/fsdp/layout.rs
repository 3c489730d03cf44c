//! How one unit's tensors sit in its collective buffers, and the two collectives of the FSDP
//! rhythm on that layout: gather the compute copies from the master shards, reduce the full
//! gradient buffer into the local gradient shard.

use std::sync::Arc;

use super::fsdp2::Fsdp2Unit;
use crate::comm::{Buf, BufMut, Communicator, ReduceOp, Segment};
use crate::dbuffer::{CopyStats, Geometry, TensorSlot};
use crate::model::{TensorSpec, Unit};
use crate::optim::{LocalShard, Optimizer};
use crate::plan::multi::MultiOptions;
use crate::plan::multi_model::plan_multi_unit;
use crate::plan::{Plan, PlanOptions};
use crate::{Error, Result};

/// A unit's layout over ranks.
pub(crate) enum UnitLayout {
    /// The planned RaggedShard layout: tensors at plan offsets of one `V·S` buffer; the
    /// all-gather writes the tensors' storages and the reduce-scatter reads the gradient buffer,
    /// both directly.
    Ragged(Arc<Geometry>),
    /// PyTorch FSDP2's layout (per-parameter even `Shard(0)`, rank-major buffer), with its
    /// copy-out after the all-gather and copy-in before the reduce-scatter.
    Fsdp2(Fsdp2Unit),
}

impl UnitLayout {
    /// Plans `unit` for `optimizer`: the FSDP2 way (one buffer), or the ragged layout as one
    /// buffer (the optimizer's own [`Optimizer::plan_unit`]) or, with `multi`, as up to
    /// `multi.max_buffers` buffers (each tensor's [`Optimizer::atomic_block`], grouped by the
    /// multi-buffer planner). Returns every buffer's layout and this rank's shard of it.
    pub(crate) fn new<O: Optimizer>(
        unit: &Unit<'_>,
        optimizer: &O,
        comm: &dyn Communicator,
        fsdp2: bool,
        plan: &PlanOptions,
        multi: Option<&MultiOptions>,
    ) -> Result<Vec<(Self, LocalShard)>> {
        let (world, rank) = (comm.world_size(), comm.rank());
        if fsdp2 {
            let f = Fsdp2Unit::new(unit, world, rank)?;
            let local = f.local_shard(unit);
            return Ok(vec![(UnitLayout::Fsdp2(f), local)]);
        }
        let plans = match multi {
            None => vec![optimizer.plan_unit(unit, world, plan)?],
            Some(m) => {
                let block_of = |t: &TensorSpec| optimizer.atomic_block(&t.name, &t.shape);
                plan_multi_unit(unit, &block_of, world, plan, m)?.buffers
            }
        };
        plans.iter().map(|p| Self::ragged(p, rank)).collect()
    }

    /// A buffer for a unit's frozen parameters: element blocks (no optimizer touches them), one
    /// buffer.
    pub(crate) fn frozen(
        unit: &Unit<'_>,
        comm: &dyn Communicator,
        plan: &PlanOptions,
    ) -> Result<Vec<(Self, LocalShard)>> {
        let element = |_: &TensorSpec| crate::AtomicBlock::Element;
        let p = crate::plan::plan_unit(unit, &element, comm.world_size(), plan)?;
        Ok(vec![Self::ragged(&p, comm.rank())?])
    }

    /// One ragged buffer from its plan.
    fn ragged(plan: &Plan, rank: usize) -> Result<(Self, LocalShard)> {
        let geometry = Geometry {
            world: plan.world,
            rank,
            shard_size: plan.shard_size,
            tensors: plan
                .placements
                .iter()
                .map(|p| (p.name.clone(), p.shape.clone(), p.offset))
                .collect(),
        };
        let local = LocalShard::from_plan(plan, rank)?;
        Ok((UnitLayout::Ragged(Arc::new(geometry)), local))
    }

    /// The unit's tensors, in the order the gathers fill them.
    pub(crate) fn slots(&self) -> Vec<TensorSlot> {
        match self {
            UnitLayout::Ragged(g) => g
                .tensors
                .iter()
                .map(|(name, shape, _)| TensorSlot {
                    name: name.clone(),
                    shape: shape.clone(),
                })
                .collect(),
            UnitLayout::Fsdp2(f) => f.slots(),
        }
    }

    /// `(offset, elements)` of each tensor's gradient in the full gradient buffer, and its length.
    pub(crate) fn grad_slots(&self) -> (Vec<(usize, usize)>, usize) {
        match self {
            UnitLayout::Ragged(g) => {
                let slots = g
                    .tensors
                    .iter()
                    .map(|(_, shape, off)| (*off, shape.iter().product()))
                    .collect();
                (slots, g.full_len())
            }
            UnitLayout::Fsdp2(f) => f.grad_slots(),
        }
    }

    /// Fills every tensor's compute copy (`dsts`, slot order) from the master shards of all
    /// ranks (`master` already in the compute dtype).
    pub(crate) fn gather(
        &self,
        comm: &dyn Communicator,
        master: Buf<'_>,
        dsts: &mut [BufMut<'_>],
        stats: &CopyStats,
    ) -> Result<()> {
        // From the element type, so device bf16 counts 2 bytes too.
        let elem_bytes = master.elem_type().size();
        match self {
            UnitLayout::Ragged(g) => {
                let mut segments: Vec<Segment<'_>> = g
                    .tensors
                    .iter()
                    .zip(dsts.iter_mut())
                    .map(|((_, _, offset), buf)| Segment {
                        offset: *offset,
                        buf: buf.reborrow(),
                    })
                    .collect();
                // A plan may place tensors out of their unit order; segments go in offset order.
                segments.sort_by_key(|s| s.offset);
                let staged = comm.all_gather_segments(master, &mut segments)?;
                stats.add_copied(staged);
                stats.add_collective(g.full_len() * elem_bytes);
            }
            UnitLayout::Fsdp2(f) => f.gather(comm, master, dsts, stats)?,
        }
        Ok(())
    }

    /// Reduces the full gradient buffer `full` over ranks into `local` (average or sum), in
    /// their element type (f32, or bf16 under mixed precision).
    pub(crate) fn reduce(
        &self,
        comm: &dyn Communicator,
        full: BufMut<'_>,
        local: BufMut<'_>,
        op: ReduceOp,
        stats: &CopyStats,
    ) -> Result<()> {
        let elem_bytes = full.elem_type().size();
        match self {
            UnitLayout::Ragged(g) => {
                if full.len() != g.full_len() || local.len() != g.shard_size {
                    return Err(Error::InvalidShard {
                        op: "reduce gradients",
                        reason: format!(
                            "buffers of {} and {} for V·S = {} and S = {}",
                            full.len(),
                            local.len(),
                            g.full_len(),
                            g.shard_size
                        ),
                    });
                }
                let staged = comm.reduce_scatter(full, local, op)?;
                stats.add_copied(staged);
                stats.add_collective(g.full_len() * elem_bytes);
                Ok(())
            }
            UnitLayout::Fsdp2(f) => match (full, local) {
                (BufMut::F32(full), BufMut::F32(local)) => f.reduce(comm, full, local, op, stats),
                (BufMut::BF16(full), BufMut::BF16(local)) => f.reduce(comm, full, local, op, stats),
                _ => Err(Error::InvalidShard {
                    op: "fsdp2 reduce",
                    reason: "gradient buffers of different element types".into(),
                }),
            },
        }
    }
}
