//! Multi-buffer plans of whole units and models: [`super::multi`]'s layouts with names, shapes
//! and blocks attached. Each buffer is an ordinary [`Plan`] over a subset of the unit's tensors,
//! so the runtime can back each by its own DBuffer; with one buffer it is the single-buffer plan.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::multi::{plan_multi_items, MultiLayout, MultiOptions};
use super::{assemble, unit_items, Item, Plan, PlanOptions};
use crate::model::{numbered_block_of, Inventory, TensorSpec, Unit};
use crate::{AtomicBlock, Context, Error, Result};

/// One unit planned as `k` buffers.
#[derive(Clone, Debug)]
pub struct MultiPlan {
    /// Unit name (`root`, `layers.3`, `transformer.h.3`, `layers.0-3` when layers are wrapped
    /// together).
    pub unit: String,
    pub world: usize,
    /// The `k` buffers; buffer `b` of a unit with `k > 1` is named `<unit>#<b>`.
    pub buffers: Vec<Plan>,
    /// The single-buffer plan of the whole unit, for comparison.
    pub single: Plan,
    /// No layout with at most `k` buffers has a smaller `Σ S` ([`super::multi::floor_shard_sum`]).
    pub floor_shard_sum: usize,
    /// Seconds per step in collectives under the cost model ([`MultiOptions::cost_s`]).
    pub cost_s: f64,
}

impl MultiPlan {
    /// Number of buffers `k`.
    pub fn k(&self) -> usize {
        self.buffers.len()
    }

    /// Elements of all tensors.
    pub fn numel(&self) -> usize {
        self.single.numel()
    }

    /// `Σ V·S_b` (fits in usize: each buffer is addressable and their sum is checked when the
    /// model is planned).
    pub fn buffer_elems(&self) -> u64 {
        self.buffers.iter().map(|b| b.buffer_elems() as u64).sum()
    }

    /// `V·floor`: the fewest buffer elements any layout with at most `k` buffers has.
    pub fn floor_elems(&self) -> u64 {
        self.world as u64 * self.floor_shard_sum as u64
    }

    /// Whether this unit is a (wrap of) numbered block(s), not `root`.
    pub fn is_block(&self) -> bool {
        self.unit != "root"
    }

    /// The unit's share per rank, `⌈E/V⌉`, is smaller than its largest block: no per-unit
    /// layout can avoid padding of at least one block per buffer holding such a tensor.
    pub fn share_below_block(&self) -> bool {
        let largest = self.single.placements.iter().map(|p| p.block_elems).max();
        largest.is_some_and(|g| self.numel().div_ceil(self.world) < g)
    }
}

/// Plans one unit as at most `mopts.max_buffers` buffers.
pub fn plan_multi_unit(
    unit: &Unit,
    block_of: &dyn Fn(&TensorSpec) -> AtomicBlock,
    world: usize,
    opts: &PlanOptions,
    mopts: &MultiOptions,
) -> Result<MultiPlan> {
    let (items, blocks) = unit_items(unit, block_of, opts)?;
    let layout = plan_multi_items(&items, world, opts, mopts)
        .with_context(|| format!("unit {}", unit.name))?;
    Ok(assemble_multi(unit, &items, &blocks, &layout, opts))
}

fn assemble_multi(
    unit: &Unit,
    items: &[Item],
    blocks: &[AtomicBlock],
    layout: &MultiLayout,
    opts: &PlanOptions,
) -> MultiPlan {
    let single = assemble(unit, items, blocks, &layout.single, opts);
    let buffers = if layout.groups.len() == 1 {
        // One buffer under the unit's own name; its layout may be the last pass's, not `single`.
        vec![assemble(unit, items, blocks, &layout.layouts[0], opts)]
    } else {
        let parts = layout.groups.iter().zip(&layout.layouts).enumerate();
        parts
            .map(|(b, (group, l))| {
                let sub = Unit {
                    name: format!("{}#{b}", unit.name),
                    tensors: group.iter().map(|&i| unit.tensors[i]).collect(),
                };
                let sub_items: Vec<Item> = group.iter().map(|&i| items[i]).collect();
                let sub_blocks: Vec<AtomicBlock> = group.iter().map(|&i| blocks[i]).collect();
                assemble(&sub, &sub_items, &sub_blocks, l, opts)
            })
            .collect()
    };
    MultiPlan {
        unit: unit.name.clone(),
        world: layout.single.world,
        buffers,
        single,
        floor_shard_sum: layout.floor,
        cost_s: layout.cost_s,
    }
}

/// Multi-buffer plans of every unit of a model.
#[derive(Clone, Debug)]
pub struct MultiModelPlan {
    pub model: String,
    pub world: usize,
    /// Decoder layers per FSDP unit (1: one unit per layer).
    pub layers_per_unit: usize,
    pub units: Vec<MultiPlan>,
    /// Wall time of planning (units with identical tensor lists are planned once).
    pub elapsed: Duration,
    /// Distinct unit signatures actually searched.
    pub distinct_units: usize,
}

impl MultiModelPlan {
    /// Elements of all tensors.
    pub fn numel(&self) -> u64 {
        self.units.iter().map(|u| u.numel() as u64).sum()
    }

    /// Elements of all buffers of all units.
    pub fn buffer_elems(&self) -> u64 {
        self.units.iter().map(MultiPlan::buffer_elems).sum()
    }

    /// Padding as a fraction of the model's elements.
    pub fn padding_frac(&self) -> f64 {
        frac(self.buffer_elems(), self.numel())
    }

    /// The padding fraction no layout with at most each unit's `k` buffers can avoid.
    pub fn floor_padding_frac(&self) -> f64 {
        frac(
            self.units.iter().map(MultiPlan::floor_elems).sum(),
            self.numel(),
        )
    }

    /// Padding of the single-buffer plans of the same units.
    pub fn single_padding_frac(&self) -> f64 {
        let single = self.units.iter().map(|u| u.single.buffer_elems() as u64);
        frac(single.sum(), self.numel())
    }

    /// The most buffers any unit uses.
    pub fn max_k(&self) -> usize {
        self.units.iter().map(MultiPlan::k).max().unwrap_or(0)
    }
}

fn frac(buffer: u64, numel: u64) -> f64 {
    (buffer - numel) as f64 / numel as f64
}

/// Plans every unit of `inv` as at most `mopts.max_buffers` buffers, with `layers_per_unit`
/// consecutive decoder layers wrapped into one unit (the coarser wrap for ranks whose share of
/// one layer is smaller than a block).
pub fn plan_model_multi(
    inv: &Inventory,
    block_of: &dyn Fn(&TensorSpec) -> AtomicBlock,
    world: usize,
    layers_per_unit: usize,
    opts: &PlanOptions,
    mopts: &MultiOptions,
) -> Result<MultiModelPlan> {
    // Once, before the units: a bad option is no one unit's error.
    mopts.validate()?;
    let start = Instant::now();
    let mut cache: HashMap<Vec<Item>, MultiLayout> = HashMap::new();
    let mut units = Vec::new();
    for unit in wrap_layers(inv.units(), layers_per_unit)? {
        let (items, blocks) = unit_items(&unit, block_of, opts)?;
        let layout = match cache.get(&items) {
            Some(l) => l.clone(),
            None => {
                let l = plan_multi_items(&items, world, opts, mopts)
                    .with_context(|| format!("unit {}", unit.name))?;
                cache.insert(items.clone(), l.clone());
                l
            }
        };
        units.push(assemble_multi(&unit, &items, &blocks, &layout, opts));
    }
    // The model-wide sums are u64: make sure they cannot wrap.
    let mut total = 0u64;
    for b in units
        .iter()
        .flat_map(|u| u.buffers.iter().chain([&u.single]))
    {
        total = total
            .checked_add(b.buffer_elems() as u64)
            .ok_or_else(|| Error::BadInput {
                op: "plan_model_multi",
                what: format!("model {}", inv.model),
                reason: "the buffers of all units overflow a 64-bit element count".into(),
            })?;
    }
    Ok(MultiModelPlan {
        model: inv.model.clone(),
        world,
        layers_per_unit,
        units,
        elapsed: start.elapsed(),
        distinct_units: cache.len(),
    })
}

/// Merges every `w` consecutive numbered-block units of one family into one (`layers.0-3`,
/// `transformer.h.4-7`); `root` stays. A family is the name before the block number, so an
/// encoder's blocks are never wrapped with a decoder's.
pub fn wrap_layers(units: Vec<Unit<'_>>, w: usize) -> Result<Vec<Unit<'_>>> {
    if w == 0 {
        return Err(Error::BadInput {
            op: "wrap_layers",
            what: "0 layers per unit".into(),
            reason: "a unit holds at least one layer".into(),
        });
    }
    if w == 1 {
        return Ok(units);
    }
    let (root, blocks): (Vec<Unit>, Vec<Unit>) = units.into_iter().partition(|u| u.name == "root");
    let mut out = root;
    for family in blocks.chunk_by(|a, b| unit_family(a) == unit_family(b)) {
        for chunk in family.chunks(w) {
            let first = chunk[0].name.as_str();
            let last = &chunk[chunk.len() - 1].name;
            let last_index = last.rsplit('.').next().unwrap_or(last);
            out.push(Unit {
                name: if chunk.len() == 1 {
                    first.to_string()
                } else {
                    format!("{first}-{last_index}")
                },
                tensors: chunk.iter().flat_map(|u| u.tensors.clone()).collect(),
            });
        }
    }
    Ok(out)
}

fn unit_family<'a>(unit: &Unit<'a>) -> &'a str {
    unit.tensors.first().map_or("", |t| block_family(&t.name))
}

/// The family of the numbered block tensor `name` belongs to: the block's name without its
/// number (`transformer.h` of `transformer.h.3.mlp.c_fc.weight`); "" outside a block.
fn block_family(name: &str) -> &str {
    numbered_block_of(name)
        .and_then(|block| block.rsplit_once('.'))
        .map_or("", |(family, _)| family)
}

/// The fewest numbered blocks (decoder layers) per unit, a power of two at most 64, for which
/// every block unit's share per rank reaches its largest block; `None` if even 64 does not
/// (the root unit is not wrapped, so it does not count).
pub fn coarse_wrap(multi: &MultiModelPlan) -> Option<usize> {
    let mut need = None::<f64>;
    for u in &multi.units {
        if !(u.is_block() && u.share_below_block()) {
            continue;
        }
        let g = u.single.placements.iter().map(|p| p.block_elems).max()?;
        // Layers needed for one rank's share to reach one block.
        let ratio = g as f64 * multi.world as f64 / u.numel() as f64;
        need = Some(need.map_or(ratio, |n| n.max(ratio)));
    }
    let need = need?;
    // More layers per unit than the longest family of blocks has would not be a wrap that
    // exists.
    let blocks: Vec<&str> = multi
        .units
        .iter()
        .filter(|u| u.is_block())
        .map(|u| {
            u.single
                .placements
                .first()
                .map_or("", |p| block_family(&p.name))
        })
        .collect();
    let layers = blocks
        .chunk_by(|a, b| a == b)
        .map(<[&str]>::len)
        .max()
        .unwrap_or(0);
    (1..=6)
        .map(|p| 1usize << p)
        .find(|&w| w as f64 >= need)
        .filter(|&w| w <= layers)
}

/// The largest HSDP shard group `V / r` (`r` = 2..=1024 replicas dividing `V`) in which every
/// numbered-block unit's share per rank reaches its largest block, if some block unit is below
/// a block at `V`. The model is then replicated over the `r` groups.
pub fn hsdp_group(multi: &MultiModelPlan) -> Option<usize> {
    let mut fits = None::<usize>;
    let mut any_below = false;
    for u in multi.units.iter().filter(|u| u.is_block()) {
        any_below |= u.share_below_block();
        let g = u.single.placements.iter().map(|p| p.block_elems).max()?;
        // Ranks at which one rank's share is still at least one block.
        let ranks = u.numel() / g;
        fits = Some(fits.map_or(ranks, |f| f.min(ranks)));
    }
    let ranks = fits.filter(|_| any_below)?;
    (2..=1024usize)
        .filter(|r| multi.world % r == 0)
        .map(|r| multi.world / r)
        .find(|&group| group <= ranks)
        .filter(|&group| group > 1) // a group of one rank shards nothing
}
