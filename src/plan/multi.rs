//! Multi-buffer units: one FSDP unit planned as up to `K` collective buffers, each with its own
//! shard size, when that pads less than one buffer by more than the extra collectives cost.
//!
//! **Why.** In one buffer every case-3 tensor forces `S` onto the lcm of its block and the
//! others'. A Mixtral layer at `V = 1024`, `rows:16`: the `w2` block (229,376 elements) and the
//! `w1` block (65,536) force `S` to a multiple of 458,752 while the layer needs 1.42 M per rank,
//! so `S` jumps to 1.83 M (29 % padding). With the `w2` tensors in a buffer of their own, each
//! buffer's lattice is its own block.
//!
//! **Search** ([`super::partition`]): tensors are grouped by block size, and for each `k` every
//! set partition of those classes into `k` buffers is ranked by the sum of its buffers'
//! single-buffer lower bounds; the best-ranked ones are planned by [`plan_items`], each buffer
//! at most once, until no partition left can beat the best one planned. Then
//! [`super::refine`] moves tensors between buffers (or into a new one) while that lowers the
//! cost: tensors with the same block do not always belong together. The moves start from one
//! buffer, from the best partition of every `k` (a worse start sometimes ends lower, even one
//! a little above one buffer, [`START_SLACK_DIVISOR`]) and from the split by count's result
//! where that wins ([`super::split`]), and the cheapest result wins. A last pass
//! ([`super::shard_fill`]) rebuilds each chosen buffer, and the single buffer, shard by shard
//! where that is smaller; the single buffer replaces the chosen ones where it then costs less.
//!
//! **Choice of `k`** ([`MultiOptions`]): per training step each buffer costs one all-gather
//! and one reduce-scatter, each a latency `α` plus `(V−1)·S·bytes / bandwidth` on the link. The
//! padding is moved by both and stored in every role, and both are proportional to `Σ S`, so
//! one term covers them: `cost(k) = 2k·α + 2(V−1)·Σ S_b·bytes / bandwidth`. The smallest cost
//! wins; ties go to fewer buffers, so one buffer is kept wherever it is as good.
//!
//! **Floor** ([`floor_shard_sum`], in [`super::floor`]): a lower bound on `Σ S_b` over every
//! partition of the unit into at most `k` buffers and every layout of each, proved in that
//! module's doc and tested against exhaustive search on small inputs. Where the chosen layout
//! of a unit is above it, the content floor ([`super::content_floor`]) is taken too, where it
//! is one buffer, the waste floor ([`super::waste_floor`]) up to its size, and where
//! such a layout of a small unit has two buffers, a deeper search of the common-step bound
//! ([`super::step_floor::step_floor_deep`]). Where it has one or two buffers and is still
//! above, the pair floor ([`super::pair_floor`]) excludes sums from the floor up; the split
//! it cannot exclude is tried as a layout (planned, filled shard by shard, or by least gaps,
//! [`super::shard_fill::least_gap_fill`]) and taken where it costs less: in a DeepSeek-V3 MoE
//! layer at `rows:1`, `V = 1024`, that is the experts' `gate/up_proj` with 111 `down_proj`,
//! `q_a_proj`, `q_b_proj` and the router in one buffer and the rest in the other, at the floor.

use super::content_floor::content_floor;
pub use super::floor::floor_shard_sum;
use super::pair_floor::{pair_floor, PairWitness};
use super::partition::{best_partition, Partition};
use super::piece_floor::main_step;
use super::refine::{refine, SIDEWAYS_MOVES};
use super::shard_fill::improve_layout;
use super::shard_fill::{least_gap_fill, shard_fill};
use super::split::split_partition;
use super::step_floor::step_floor_deep;
use super::waste_floor::waste_floor;
use super::{plan_items, Item, Layout, Order, PlanOptions};
use crate::{Error, Result};

/// The most buffers per unit [`MultiOptions::max_buffers`] takes: each buffer is one more
/// all-gather and reduce-scatter per unit and step, and the planner's time grows with the
/// count (76 s for deepseek_v3_671b at V = 1000 with 1000) while no model here gains past a
/// handful.
pub const MAX_BUFFERS: usize = 64;

/// Knobs of the multi-buffer planner.
#[derive(Clone, Debug, PartialEq)]
pub struct MultiOptions {
    /// `K`: at most this many collective buffers per unit (1 = the single-buffer planner).
    pub max_buffers: usize,
    /// `α`: latency of one collective (all-gather or reduce-scatter), seconds.
    pub collective_latency_s: f64,
    /// Bandwidth of one rank's link, bytes per second.
    pub link_bytes_per_s: f64,
    /// Bytes per element on the wire.
    pub elem_bytes: usize,
}

impl Default for MultiOptions {
    /// `K = 3`; `α = 20 µs` (the order of an NCCL ring collective's launch-plus-hop latency
    /// across nodes); 50 GB/s per rank (one 400 Gb/s NIC); bf16 (2 bytes) on the wire. At
    /// `V = 1024` one more buffer then pays for itself once it saves about 490 elements of
    /// `S`; at `V = 8`, about 71,000.
    fn default() -> Self {
        MultiOptions {
            max_buffers: 3,
            collective_latency_s: 20e-6,
            link_bytes_per_s: 50e9,
            elem_bytes: 2,
        }
    }
}

impl MultiOptions {
    pub(crate) fn validate(&self) -> Result<()> {
        // Named by field and value (not the whole struct): a caller maps the field to its flag.
        let bad = |what: String, reason: &str| Error::BadInput {
            op: "MultiOptions",
            what,
            reason: reason.into(),
        };
        if !(1..=MAX_BUFFERS).contains(&self.max_buffers) {
            return Err(bad(
                format!("max_buffers {}", self.max_buffers),
                &format!("from 1 to {MAX_BUFFERS} buffers per unit"),
            ));
        }
        let latency = self.collective_latency_s;
        if !(latency.is_finite() && latency >= 0.0) {
            return Err(bad(
                format!("collective_latency_s {latency}"),
                "the collective latency must be finite and non-negative",
            ));
        }
        let bandwidth = self.link_bytes_per_s;
        if !(bandwidth.is_finite() && bandwidth > 0.0) {
            return Err(bad(
                format!("link_bytes_per_s {bandwidth}"),
                "the link bandwidth must be finite and positive",
            ));
        }
        if self.elem_bytes == 0 {
            return Err(bad(
                "elem_bytes 0".into(),
                "elements have at least one byte",
            ));
        }
        Ok(())
    }

    /// Seconds per step that `buffers` buffers with shard sizes summing to `shard_sum` spend
    /// in collectives on `world` ranks (the module doc's cost model).
    pub fn cost_s(&self, buffers: usize, shard_sum: usize, world: usize) -> f64 {
        let moved = 2.0 * (world as f64 - 1.0) * shard_sum as f64 * self.elem_bytes as f64;
        2.0 * buffers as f64 * self.collective_latency_s + moved / self.link_bytes_per_s
    }
}

impl MultiOptions {
    /// An exclusive bound on `Σ S` for `k` buffers on `world` ranks to cost less than `cost`
    /// seconds: every sum that does is below it (sums just under it are compared exactly by
    /// [`MultiOptions::cost_s`]); `None` when even `Σ S = 0` does not.
    pub fn shard_sum_below_cost(&self, k: usize, world: usize, cost: f64) -> Option<usize> {
        let fixed = self.cost_s(k, 0, world);
        let per_elem = self.cost_s(k, 1, world) - fixed;
        let room = cost - fixed;
        if room.is_nan() || room <= 0.0 {
            return None;
        }
        if per_elem.is_nan() || per_elem <= 0.0 {
            return Some(usize::MAX);
        }
        let limit = (room / per_elem).ceil();
        // `as` saturates at usize::MAX; one more covers the rounding of the division.
        Some((limit as usize).saturating_add(1))
    }
}

/// One unit planned as `k` buffers.
#[derive(Clone, Debug, PartialEq)]
pub struct MultiLayout {
    /// Indices of the input items in each buffer (unit order inside a buffer).
    pub groups: Vec<Vec<usize>>,
    /// One layout per buffer; its offsets index the buffer's own items.
    pub layouts: Vec<Layout>,
    /// The single-buffer layout of all items (what `k = 1` gives).
    pub single: Layout,
    /// No partition into at most `groups.len()` buffers has a smaller `Σ S` ([`floor_shard_sum`]).
    pub floor: usize,
    /// [`MultiOptions::cost_s`] of the chosen layout.
    pub cost_s: f64,
}

impl MultiLayout {
    /// `Σ S_b` over the buffers.
    pub fn shard_sum(&self) -> usize {
        self.layouts.iter().map(|l| l.shard_size).sum()
    }
}

/// The best partition of each `k` is a start of the moves if its cost is below one buffer's
/// with `Σ S` raised by this fraction of it (1/`START_SLACK_DIVISOR`): a start that costs a
/// little more than one buffer may still end lower. In a Qwen3-235B-A22B layer at `rows:1`,
/// `V = 1024`, `o_proj` alone, the attention with the experts' `gate/up_proj`, and the
/// `down_proj` tensors need 0.06 % more than one buffer, and moving the router and the norms
/// to the `down_proj` buffer then makes it 0.1 % less. Wider starts cost time (every start is
/// refined) for nothing more on the benchmark's models.
pub const START_SLACK_DIVISOR: usize = 1024;

/// Plans `items` as at most `mopts.max_buffers` buffers (see the module doc).
pub fn plan_multi_items(
    items: &[Item],
    world: usize,
    opts: &PlanOptions,
    mopts: &MultiOptions,
) -> Result<MultiLayout> {
    mopts.validate()?;
    let single = plan_items(items, world, opts)?;
    let mut best = Partition {
        groups: vec![(0..items.len()).collect()],
        layouts: vec![single.clone()],
        shard_sum: single.shard_size,
    };
    let single_cost = mopts.cost_s(1, single.shard_size, world);
    let max_k = mopts.max_buffers.min(items.len());
    // The best partition of each k is a starting point of the moves, not only the best one:
    // moves from a worse partition sometimes end lower.
    // floors[k]: the k-buffer floor; a k whose floor cannot beat one buffer is not searched.
    // No layout holds its tensors in less than their elements per rank, rounded up to the
    // alignment: once a floor reaches that, it is every larger k's floor too (computing them
    // would cost more than the rest of the plan: the heavy floor's search grows steeply with k).
    let data_bound = usize::try_from(super::floor::data_bound(items, world, opts.coll_align))
        .unwrap_or(usize::MAX);
    let mut floors = vec![0usize; max_k + 1];
    for k in 1..=max_k {
        floors[k] = if k > 1 && floors[k - 1] <= data_bound {
            data_bound
        } else {
            floor_shard_sum(items, world, opts.coll_align, k)?
        };
    }
    let worth = |k: usize| mopts.cost_s(k, floors[k], world) < single_cost;
    // A start may cost a little more than one buffer: the moves can still take it lower.
    let start_slack = single.shard_size / START_SLACK_DIVISOR;
    let start_cost = mopts.cost_s(1, single.shard_size.saturating_add(start_slack), world);
    let mut starts = Vec::new();
    for k in (2..=max_k.min(distinct_blocks(items))).filter(|&k| worth(k)) {
        if let Some(found) = best_partition(items, world, opts, mopts, k, start_cost) {
            starts.push(found);
        }
    }
    // Identical tensors split by count can use more buffers than there are block sizes. These
    // buffers are filled to their lattices already, so they are candidates, not starts of the
    // moves (which would double the time for no gain on the benchmark's models).
    let mut filled: Vec<Partition> = Vec::new();
    for k in (2..=max_k).filter(|&k| worth(k)) {
        if let Some(found) = split_partition(items, world, opts, mopts, k, single_cost) {
            if !filled.iter().any(|f| f.groups == found.groups) {
                filled.push(found);
            }
        }
    }
    if max_k > 1 {
        // `choose` always has the single buffer; `None` cannot happen, keep it then.
        best = choose(items, world, opts, mopts, best.clone(), starts, filled).unwrap_or(best);
    }
    // The last pass: the chosen buffers, and the single buffer, built shard by shard where
    // that is smaller (super::shard_fill). The rebuilt single buffer replaces the chosen ones
    // where it costs less; with α > 0 that includes an equal Σ S. (At α = 0 an equal Σ S keeps
    // the buffers chosen: the multi-buffer runtime tests rely on free collectives splitting.)
    fill_buffers(items, world, opts, &mut best)?;
    if best.groups.len() > 1 {
        let mut alone = Partition {
            groups: vec![(0..items.len()).collect()],
            layouts: vec![single.clone()],
            shard_sum: single.shard_size,
        };
        fill_buffers(items, world, opts, &mut alone)?;
        let cost = |p: &Partition| mopts.cost_s(p.groups.len(), p.shard_sum, world);
        if cost(&alone) < cost(&best) {
            best = alone;
        }
    }
    let floor = match floors.get(best.groups.len()) {
        Some(&f) if !best.groups.is_empty() => f,
        _ => floor_shard_sum(items, world, opts.coll_align, best.groups.len())?,
    };
    let floor = deepen_floor(items, world, opts.coll_align, &best, floor);
    // The pair floor searches the sums between the floor and the plan; where it stops below
    // the plan, the split it could not exclude is a candidate layout.
    let mut floor = floor;
    if best.groups.len() <= 2 && best.shard_sum > floor {
        let k = best.groups.len();
        if let Some(pair) = pair_floor(items, world, opts.coll_align, k, floor, best.shard_sum)? {
            floor = floor.max(pair.bound);
            if let Some(found) = pair.witness.and_then(|w| realize(items, world, opts, &w)) {
                let cost = |p: &Partition| mopts.cost_s(p.groups.len(), p.shard_sum, world);
                if found.shard_sum < best.shard_sum && cost(&found) < cost(&best) {
                    best = found;
                }
            }
        }
    }
    let best_cost = mopts.cost_s(best.groups.len(), best.shard_sum, world);
    Ok(MultiLayout {
        groups: best.groups,
        layouts: best.layouts,
        single,
        floor,
        cost_s: best_cost,
    })
}

/// The cheapest of the refined `starts` and the `filled` candidates (ties: fewer buffers). A
/// filled winner is refined too: its buffers are full by count, but a tensor of another shape
/// may still belong elsewhere. In a DeepSeek-V3 dense layer at `rows:128`, `V = 8`, the split
/// gives `o_proj`, the MLP and the rest of the attention a buffer each; moving `kv_b_proj`
/// next to `o_proj` fills that buffer to the next `o_proj` block exactly and takes 11 blocks
/// of `q_b_proj` off the third (the exact optimum). From one buffer that layout is several
/// moves away, each ranked behind moves that fail; from the filled one it is one move.
fn choose(
    items: &[Item],
    world: usize,
    opts: &PlanOptions,
    mopts: &MultiOptions,
    single: Partition,
    starts: Vec<Partition>,
    filled: Vec<Partition>,
) -> Option<Partition> {
    let cost = |p: &Partition| mopts.cost_s(p.groups.len(), p.shard_sum, world);
    let cheaper = |a: &Partition, b: &Partition| {
        cost(a)
            .total_cmp(&cost(b))
            .then(a.groups.len().cmp(&b.groups.len()))
    };
    // The first of equals wins, as in the order of `starts` (the single buffer last).
    let pick = |a: Partition, b: Partition| if cheaper(&b, &a).is_lt() { b } else { a };
    let refined = starts
        .into_iter()
        .chain(std::iter::once(single))
        .map(|start| refine(items, world, opts, mopts, start, 0))
        .reduce(pick)?;
    let winner = match filled.into_iter().reduce(pick) {
        Some(f) if cheaper(&f, &refined).is_lt() => {
            pick(f.clone(), refine(items, world, opts, mopts, f, 0))
        }
        _ => refined,
    };
    // The winner once more, where a move that keeps its cost may lead to one that lowers it.
    Some(pick(
        winner.clone(),
        refine(items, world, opts, mopts, winner, SIDEWAYS_MOVES),
    ))
}

/// Units of at most this many tensors whose two-buffer plan is above its floor get the deeper
/// common-step search ([`step_floor_deep`]); larger units (MoE layers of one tensor per expert)
/// have too many combinations for it to help within its budget.
pub const DEEP_FLOOR_MAX_TENSORS: usize = 64;

/// The floor of `partition`'s number of buffers, raised where the plan is above it by
/// [`content_floor`], where the plan is one buffer by [`waste_floor`] (below the plan's size),
/// and, where the plan has two buffers and the unit is small, by
/// [`step_floor_deep`] (a lower bound either way: all are).
/// Two buffers is where the deeper search pays: there a `Q` of its own leaves the forced
/// tensors one buffer (their lattices' lcm), so which small tensors join them matters; with
/// three or more it found nothing on the benchmark's units and cost up to 0.4 s per unit.
fn deepen_floor(
    items: &[Item],
    world: usize,
    coll: usize,
    partition: &Partition,
    floor: usize,
) -> usize {
    let k = partition.groups.len();
    if partition.shard_sum <= floor {
        return floor;
    }
    // The content floor holds for any number of buffers; it only runs above the others.
    let mut floor = floor.max(
        content_floor(items, world, coll)
            .ok()
            .flatten()
            .unwrap_or(0),
    );
    // The waste floor bounds one buffer; it only searches sizes up to the plan's.
    if k == 1 && partition.shard_sum > floor {
        let waste =
            main_step(items).and_then(|d| waste_floor(items, world, coll, d, partition.shard_sum));
        floor = floor.max(waste.unwrap_or(0));
    }
    if k != 2 || partition.shard_sum <= floor || items.len() > DEEP_FLOOR_MAX_TENSORS {
        return floor;
    }
    let deep = step_floor_deep(items, world, coll, k);
    floor.max(deep.unwrap_or(0))
}

/// Replaces each buffer's layout by [`improve_layout`]'s where that finds a smaller size (if
/// the options allow filled layouts).
fn fill_buffers(
    items: &[Item],
    world: usize,
    opts: &PlanOptions,
    partition: &mut Partition,
) -> Result<()> {
    if !opts.fill_allowed() {
        return Ok(());
    }
    for (group, layout) in partition.groups.iter().zip(partition.layouts.iter_mut()) {
        let sub = group_items(items, group, opts)?;
        if let Some(better) = improve_layout(&sub, world, opts.coll_align, layout)? {
            *layout = better;
        }
    }
    partition.shard_sum = partition
        .layouts
        .iter()
        .try_fold(0usize, |acc, l| acc.checked_add(l.shard_size))
        .ok_or_else(|| Error::BadInput {
            op: "plan_multi_items",
            what: format!("{} buffers", partition.layouts.len()),
            reason: "their shard sizes overflow a 64-bit element count".into(),
        })?;
    Ok(())
}

/// Number of distinct block sizes: a buffer holds whole classes of equal blocks, so at most
/// this many buffers are useful.
fn distinct_blocks(items: &[Item]) -> usize {
    let mut sizes: Vec<usize> = items.iter().map(|t| t.block).collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes.len()
}

/// The items of `group` as [`plan_items`] sees them (the start alignment applied).
fn group_items(items: &[Item], group: &[usize], opts: &PlanOptions) -> Result<Vec<Item>> {
    group
        .iter()
        .map(|&i| {
            let it = items[i];
            Item::new(it.numel, it.block, it.align.max(opts.start_align))
        })
        .collect()
}

/// The pair floor's witness as a layout: its two groups (one where buffer `a` is empty), each
/// planned, or filled shard by shard at the witness's size where the planner needs more (and
/// the options allow filled layouts); `None` where a group does not fit its size.
fn realize(
    items: &[Item],
    world: usize,
    opts: &PlanOptions,
    witness: &PairWitness,
) -> Option<Partition> {
    let a: Vec<usize> = (0..items.len()).filter(|&i| witness.in_a[i]).collect();
    let b: Vec<usize> = (0..items.len()).filter(|&i| !witness.in_a[i]).collect();
    let mut groups = Vec::new();
    let mut layouts = Vec::new();
    for (group, size) in [(a, witness.shard_a), (b, witness.shard_b)] {
        if group.is_empty() {
            continue;
        }
        let sub = group_items(items, &group, opts).ok()?;
        let planned = plan_items(&sub, world, opts).ok()?;
        let layout = if planned.shard_size <= size {
            planned
        } else if !opts.fill_allowed() {
            return None;
        } else {
            let filled = match shard_fill(&sub, world, size).ok()? {
                Some(offsets) => Some(offsets),
                None => least_gap_fill(&sub, world, size).ok()?,
            };
            let offsets = filled?;
            Layout {
                world,
                shard_size: size,
                order: Order::Filled,
                offsets,
                stats: planned.stats,
                lower_bound: planned.lower_bound,
            }
        };
        groups.push(group);
        layouts.push(layout);
    }
    let shard_sum = layouts
        .iter()
        .try_fold(0usize, |acc, l| acc.checked_add(l.shard_size))?;
    Some(Partition {
        groups,
        layouts,
        shard_sum,
    })
}
