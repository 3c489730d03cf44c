//! Helpers shared by the optimizer test files: layouts from the planner and moving global
//! tensors in and out of local shards.
#![allow(dead_code)] // each test file uses a different subset

use ragged::model::{TensorSpec, Unit};
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::{plan_unit, PlanOptions};
use ragged::AtomicBlock;

/// Every rank's shard of `specs` on `world` ranks, planned with `block_of`.
pub fn planned_shards_by(
    specs: &[TensorSpec],
    world: usize,
    block_of: &dyn Fn(&TensorSpec) -> AtomicBlock,
    opts: &PlanOptions,
) -> Vec<LocalShard> {
    let unit = Unit {
        name: "unit".into(),
        tensors: specs.iter().collect(),
    };
    let plan = plan_unit(&unit, block_of, world, opts).unwrap();
    plan.validate().unwrap();
    (0..world)
        .map(|r| LocalShard::from_plan(&plan, r).unwrap())
        .collect()
}

/// Every rank's shard of `specs` planned with `opt`'s blocks on `world` ranks.
pub fn planned_shards<O: Optimizer>(
    opt: &O,
    specs: &[TensorSpec],
    world: usize,
    opts: &PlanOptions,
) -> Vec<LocalShard> {
    planned_shards_by(specs, world, &|t| opt.atomic_block(&t.name, &t.shape), opts)
}

pub fn numels(specs: &[TensorSpec]) -> Vec<usize> {
    specs.iter().map(TensorSpec::numel).collect()
}

/// A local buffer holding this shard's pieces of the global tensors; padding zero.
pub fn scatter(shard: &LocalShard, global: &[Vec<f32>]) -> Vec<f32> {
    let mut local = vec![0.0; shard.len];
    for p in &shard.pieces {
        local[p.offset..p.offset + p.range.len()]
            .copy_from_slice(&global[p.param][p.range.clone()]);
    }
    local
}

/// Local positions that no piece covers.
pub fn padding(shard: &LocalShard) -> Vec<usize> {
    let mut covered = vec![false; shard.len];
    for p in &shard.pieces {
        covered[p.offset..p.offset + p.range.len()].fill(true);
    }
    (0..shard.len).filter(|&i| !covered[i]).collect()
}

pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|x| x.to_bits()).collect()
}
