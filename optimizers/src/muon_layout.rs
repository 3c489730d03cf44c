//! Whole or split: where each Muon matrix lives, chosen per tensor by a byte cost model.
//!
//! Keeping a matrix whole on one rank (block [`AtomicBlock::Matrix`]) makes its
//! Newton–Schulz local, but a large block can force padding into every collective buffer of
//! the group. Letting the planner cut it (block [`AtomicBlock::Element`]) removes that padding
//! and costs a trip to a root and back every step ([`crate::roots`]).
//!
//! # Cost model (bytes on the wire per step, all ranks together)
//! - Padding: every padded element rides in each step's parameter all-gather and gradient
//!   reduce-scatter and reaches the `V − 1` other ranks: `2·(V − 1)·padding` elements.
//! - Split matrices: each element not already on its root travels there and back:
//!   `2·moved` elements ([`RootPlan::moved_elems`](crate::roots::RootPlan::moved_elems)).
//!
//! [`MatrixLayout::Auto`] searches greedily from both ends, every Muon tensor whole (then
//! splitting one at a time while that lowers the total) and every one split (then making one
//! whole at a time), and keeps the cheaper of the two. Every choice is reported
//! ([`LayoutReport`]). The model counts bytes, not time: Newton–Schulz load balance is left to
//! the root assignment.

use std::fmt;

use ragged::model::{TensorSpec, Unit};
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::{plan_unit, Plan, PlanOptions};
use ragged::{AtomicBlock, Result};

use crate::muon::Muon;

/// How Muon lays out its matrices (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MatrixLayout {
    /// Per tensor, by the byte cost model.
    #[default]
    Auto,
    /// Every matrix whole on one rank: no Muon communication.
    Whole,
    /// Every matrix may be cut: no padding from Muon's blocks.
    Split,
}

/// The choice for one Muon tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorChoice {
    pub name: String,
    pub shape: Vec<usize>,
    /// [`AtomicBlock::Matrix`] (whole) or [`AtomicBlock::Element`] (split).
    pub block: AtomicBlock,
    /// Its elements that travel to roots per step and direction in the final plan.
    pub moved: usize,
}

/// What [`Muon::plan_layout`] chose for a unit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutReport {
    pub unit: String,
    pub world: usize,
    pub layout: MatrixLayout,
    /// Muon tensors in unit order.
    pub tensors: Vec<TensorChoice>,
    /// Padding elements of the final plan (all ranks).
    pub padding: usize,
    /// Padding elements with every Muon matrix whole (what splitting saves from).
    pub whole_padding: usize,
    /// Elements sent to roots per step and direction by the final plan.
    pub moved: usize,
}

impl LayoutReport {
    /// Bytes on the wire per step that the layout costs (module doc), for `f32` elements.
    pub fn cost_bytes(&self) -> u64 {
        wire_elems(self.world, self.padding, self.moved) * 4
    }
}

impl fmt::Display for LayoutReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let split = self
            .tensors
            .iter()
            .filter(|t| t.block != AtomicBlock::Matrix)
            .count();
        writeln!(
            f,
            "{} (V = {}, {:?}): {} of {} Muon tensors split; padding {} elements ({} with all \
             whole), {} elements to roots per step; {:.2} MB on the wire per step",
            self.unit,
            self.world,
            self.layout,
            split,
            self.tensors.len(),
            self.padding,
            self.whole_padding,
            self.moved,
            self.cost_bytes() as f64 / 1e6
        )?;
        for t in &self.tensors {
            let how = if t.block == AtomicBlock::Matrix {
                "whole".to_string()
            } else {
                format!("split (moves {} per way)", t.moved)
            };
            writeln!(f, "  {:<40} {:?}: {how}", t.name, t.shape)?;
        }
        Ok(())
    }
}

fn wire_elems(world: usize, padding: usize, moved: usize) -> u64 {
    2 * (world.saturating_sub(1) as u64) * padding as u64 + 2 * moved as u64
}

impl Muon {
    /// Plans `unit` under [`crate::MuonConfig::layout`] and reports the choice per tensor.
    pub fn plan_layout(
        &self,
        unit: &Unit,
        world: usize,
        opts: &PlanOptions,
    ) -> Result<(Plan, LayoutReport)> {
        let muon: Vec<bool> = unit
            .tensors
            .iter()
            .map(|t| self.uses_muon(&t.name, &t.shape))
            .collect();
        let layout = self.config().layout;
        let base: Vec<AtomicBlock> = unit
            .tensors
            .iter()
            .map(|t| self.atomic_block(&t.name, &t.shape))
            .collect();
        let all = |block: AtomicBlock| -> Vec<AtomicBlock> {
            base.iter()
                .zip(&muon)
                .map(|(&b, &m)| if m { block } else { b })
                .collect()
        };
        let whole_blocks = all(AtomicBlock::Matrix);
        let whole = self.costed(unit, &whole_blocks, world, opts)?;
        let (blocks, best) = match layout {
            MatrixLayout::Whole => (whole_blocks, whole.clone()),
            MatrixLayout::Split => {
                let blocks = all(AtomicBlock::Element);
                let best = self.costed(unit, &blocks, world, opts)?;
                (blocks, best)
            }
            MatrixLayout::Auto => {
                // Greedy from both ends (splitting one matrix alone may free no padding while
                // the others stay whole, and vice versa); keep the cheaper result.
                let split_blocks = all(AtomicBlock::Element);
                let split = self.costed(unit, &split_blocks, world, opts)?;
                let from_whole = self.improve(
                    unit,
                    (whole_blocks, whole.clone()),
                    &muon,
                    AtomicBlock::Element,
                    world,
                    opts,
                )?;
                let from_split = self.improve(
                    unit,
                    (split_blocks, split),
                    &muon,
                    AtomicBlock::Matrix,
                    world,
                    opts,
                )?;
                if from_split.1.wire < from_whole.1.wire {
                    from_split
                } else {
                    from_whole
                }
            }
        };
        let tensors = unit
            .tensors
            .iter()
            .enumerate()
            .filter(|&(i, _)| muon[i])
            .map(|(i, t)| TensorChoice {
                name: t.name.clone(),
                shape: t.shape.clone(),
                block: blocks[i],
                moved: best.per_param[i],
            })
            .collect();
        let report = LayoutReport {
            unit: unit.name.clone(),
            world,
            layout,
            tensors,
            padding: best.plan.padding(),
            whole_padding: whole.plan.padding(),
            moved: best.moved,
        };
        Ok((best.plan, report))
    }

    /// From `start` (blocks and their costed plan), flips Muon tensors to `to` one at a time,
    /// largest first, keeping each flip that lowers the wire cost.
    fn improve(
        &self,
        unit: &Unit,
        start: (Vec<AtomicBlock>, Costed),
        muon: &[bool],
        to: AtomicBlock,
        world: usize,
        opts: &PlanOptions,
    ) -> Result<(Vec<AtomicBlock>, Costed)> {
        let (mut blocks, mut best) = start;
        let mut order: Vec<usize> = (0..blocks.len()).filter(|&i| muon[i]).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(unit.tensors[i].numel())); // stable
        for i in order {
            let was = std::mem::replace(&mut blocks[i], to);
            let trial = self.costed(unit, &blocks, world, opts)?;
            if trial.wire < best.wire {
                best = trial;
            } else {
                blocks[i] = was;
            }
        }
        Ok((blocks, best))
    }

    /// The plan for `blocks` with its wire cost.
    fn costed(
        &self,
        unit: &Unit,
        blocks: &[AtomicBlock],
        world: usize,
        opts: &PlanOptions,
    ) -> Result<Costed> {
        let index = |t: &TensorSpec| {
            unit.tensors
                .iter()
                .position(|u| std::ptr::eq(*u, t))
                .expect("a tensor of the unit")
        };
        let plan = plan_unit(unit, &|t| blocks[index(t)], world, opts)?;
        let shard = LocalShard::from_plan(&plan, 0)?;
        let roots = self.roots(&shard);
        let mut per_param = vec![0; plan.placements.len()];
        for job in &roots.jobs {
            per_param[job.param] += roots.moved(&shard, job);
        }
        let moved = per_param.iter().sum();
        Ok(Costed {
            wire: wire_elems(world, plan.padding(), moved),
            plan,
            moved,
            per_param,
        })
    }
}

#[derive(Clone)]
struct Costed {
    plan: Plan,
    moved: usize,
    per_param: Vec<usize>,
    wire: u64,
}
