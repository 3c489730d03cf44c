//! Which tensors of a unit share a collective buffer: the partition search of [`super::multi`].
//!
//! **Classes.** Tensors that can force a lattice are grouped by block size (the distinct sizes,
//! largest first; with more than the enumeration allows, adjacent sizes are merged evenly), the
//! ones that never can (fewer than two blocks) form one more class, and a buffer holds whole
//! classes. A block size is what forces a lattice: every tensor of at least `2S` elements needs
//! its block to divide `S`, so tensors with the same block never disagree about it.
//! ([`super::refine`] later moves single tensors between buffers.)
//!
//! **Any grouping, not only runs of sizes.** The lattices that agree are not always neighbours
//! in size: in a gpt-oss-120b layer at `rows:16`, the experts' `gate_up_proj` block (92,160)
//! and `down_proj` block (46,080) divide each other, while `o_proj`'s (65,536) lies between
//! them and agrees with neither. A search over contiguous runs of sizes must give `o_proj` a
//! buffer between the two experts' buffers (3.4 % padding at `V = 1024`); the partition that
//! puts both expert tensors in one buffer and `o_proj` with the small tensors pads 1.9 %.
//! So every set partition of the classes into `k` groups is a candidate.
//!
//! **Search.** Each group's single-buffer lower bound ([`super::search::any_order_lower_bound`])
//! is computed from class summaries (total elements, largest block, and per distinct block its
//! largest tensor, which alone decides whether the block is forced), once per group. The
//! partitions are taken in order of the sum of their groups' bounds. A partition is tested
//! group by group with the quick search of [`min_shard_below`]: only below the size that could
//! still beat the best partition so far (or the cost of `to_beat`), with a bounded exact
//! finish, so a group that cannot win costs little. The search stops when the next sum of
//! bounds cannot win or after [`CHECK_BUDGET`] quick tests; the winner is then planned by
//! [`plan_items`]. The enumeration is bounded: the classes are merged until at most
//! [`MAX_PARTITIONS`] partitions remain (12 classes for `k = 3`), so the work does not grow
//! with the number of tensors beyond the class summaries and the quick tests.

use std::collections::HashMap;

use super::multi::MultiOptions;
use super::search::{min_shard_below, ForcedLattice};
use super::{plan_items, Item, Layout, PlanOptions};

/// At most this many block-size classes (masks are `u32`; more distinct sizes are merged).
pub const MAX_CLASSES: usize = 20;

/// At most this many set partitions are enumerated for one `k` (classes are merged to fit).
pub const MAX_PARTITIONS: u64 = 100_000;

/// At most this many quick tests of a group's size ([`min_shard_below`]) for one `k`.
pub const CHECK_BUDGET: usize = 48;

/// Tensor placements one quick test may spend in its exact finish, per order.
pub const QUICK_WORK: usize = 1 << 18;

/// The best partition into exactly `k` groups found by [`best_partition`].
#[derive(Clone, Debug)]
pub struct Partition {
    /// Item indices of each group, in unit order.
    pub groups: Vec<Vec<usize>>,
    /// The single-buffer layout of each group.
    pub layouts: Vec<Layout>,
    /// `Σ S` over the groups.
    pub shard_sum: usize,
}

/// The partition of `items` into exactly `k` buffers with the smallest `Σ S` that the search
/// of the module doc finds, if one costs less than `to_beat` seconds under `mopts`.
pub fn best_partition(
    items: &[Item],
    world: usize,
    opts: &PlanOptions,
    mopts: &MultiOptions,
    k: usize,
    to_beat: f64,
) -> Option<Partition> {
    let classes = block_classes(items, k);
    if classes.len() < k || k < 2 {
        return None;
    }
    let summaries: Vec<ClassSummary> = classes.iter().map(|c| summarize(items, c)).collect();
    let bounds = GroupBounds::new(&summaries, world, opts.coll_align);
    let mut candidates = partitions_by_bound(classes.len(), k, &bounds);
    candidates.sort_unstable_by_key(|c| c.0);
    let mut plans = GroupPlans::new(items, &classes, world, opts);
    let affordable = mopts.shard_sum_below_cost(k, world, to_beat)?;
    let mut best: Option<(usize, Vec<u32>)> = None;
    for (bound, masks) in candidates {
        let limit = best.as_ref().map_or(affordable, |b| b.0.min(affordable));
        if bound >= limit || plans.checked() >= CHECK_BUDGET {
            break;
        }
        if let Some(sum) = sizes_below(&masks, bound, limit, &bounds, &mut plans) {
            best = Some((sum, masks));
        }
    }
    // The winner is planned exactly; its layouts are what the caller keeps.
    let (_, masks) = best?;
    let layouts = masks
        .iter()
        .map(|&m| plans.plan(m))
        .collect::<Option<Vec<_>>>()?;
    let shard_sum = layouts
        .iter()
        .try_fold(0usize, |acc, l| acc.checked_add(l.shard_size))?;
    if mopts.cost_s(k, shard_sum, world) >= to_beat {
        return None;
    }
    Some(Partition {
        groups: masks.iter().map(|&m| plans.indices(m)).collect(),
        layouts,
        shard_sum,
    })
}

/// Feasible sizes of the partition's groups summing below `limit`, if the quick test finds
/// them: each group is searched only below what is left once the groups after it get their
/// lower bounds (`bound` is the sum of all of them).
fn sizes_below(
    masks: &[u32],
    bound: usize,
    limit: usize,
    bounds: &GroupBounds,
    plans: &mut GroupPlans,
) -> Option<usize> {
    let (mut rest, mut sum) = (bound, 0usize);
    for &m in masks {
        rest = rest.checked_sub(bounds.bound(m)?)?;
        let cap = limit.checked_sub(sum)?.checked_sub(rest)?;
        sum += plans.size_below(m, cap)?;
    }
    (sum < limit).then_some(sum)
}

/// `S(n, k)`, the number of partitions of `n` things into exactly `k` non-empty groups,
/// saturating at `u64::MAX`.
pub fn stirling2(n: usize, k: usize) -> u64 {
    // row[j] = S(i, j) for the current i.
    let mut row = vec![0u64; k + 1];
    row[0] = 1;
    for _ in 0..n {
        for j in (1..=k).rev() {
            row[j] = (j as u64).saturating_mul(row[j]).saturating_add(row[j - 1]);
        }
        row[0] = 0;
    }
    row[k]
}

/// Item indices of each class: one class per block size of the tensors that can force a
/// lattice, largest block first (as many as the enumeration of partitions into `k` groups
/// allows, [`MAX_PARTITIONS`]; adjacent sizes merged evenly when there are more), then one
/// class of the tensors that never can. A tensor of fewer than `2g` elements is never forced:
/// any buffer holding it has `S ≥ g`. Keeping those (norms, biases) in one class stops the
/// search from trying every way to scatter them, which only moves a few elements.
fn block_classes(items: &[Item], k: usize) -> Vec<Vec<usize>> {
    let free = |t: &Item| t.numel / 2 < t.block;
    let has_free = items.iter().any(free);
    let mut sizes: Vec<usize> = items.iter().filter(|t| !free(t)).map(|t| t.block).collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.dedup();
    let room = MAX_CLASSES - usize::from(has_free);
    let mut max_classes = sizes.len().min(room);
    let total = |forcing: usize| forcing + usize::from(has_free);
    while max_classes > 1 && stirling2(total(max_classes), k) > MAX_PARTITIONS {
        max_classes -= 1;
    }
    let per_class = sizes.len().div_ceil(max_classes.max(1)).max(1);
    let forcing_classes = sizes.len().div_ceil(per_class);
    let mut classes = vec![Vec::new(); total(forcing_classes)];
    for (i, t) in items.iter().enumerate() {
        let class = if free(t) {
            forcing_classes
        } else {
            sizes.partition_point(|&s| s > t.block) / per_class
        };
        classes[class].push(i);
    }
    classes
}

/// What a group's lower bound needs from one class.
struct ClassSummary {
    /// `Σ numel` (`None`: overflow).
    total: Option<usize>,
    largest_block: usize,
    /// Per distinct block, the class's largest tensor with it: the block is forced at `S`
    /// exactly when that tensor has at least `2S` elements.
    forcing: Vec<Item>,
}

fn summarize(items: &[Item], class: &[usize]) -> ClassSummary {
    let mut forcing: Vec<Item> = Vec::new();
    for &i in class {
        let t = items[i];
        match forcing.iter_mut().find(|f| f.block == t.block) {
            Some(f) => f.numel = f.numel.max(t.numel),
            None => forcing.push(t),
        }
    }
    ClassSummary {
        total: class
            .iter()
            .try_fold(0usize, |acc, &i| acc.checked_add(items[i].numel)),
        largest_block: class.iter().map(|&i| items[i].block).max().unwrap_or(1),
        forcing,
    }
}

/// The single-buffer lower bound of every group of classes (a bit mask), computed on demand.
struct GroupBounds<'a> {
    summaries: &'a [ClassSummary],
    world: usize,
    coll: usize,
    /// `cache[mask]`: `None` not computed yet, `Some(None)` the group's sizes overflow.
    cache: std::cell::RefCell<Vec<Option<Option<usize>>>>,
}

impl<'a> GroupBounds<'a> {
    fn new(summaries: &'a [ClassSummary], world: usize, coll: usize) -> Self {
        GroupBounds {
            summaries,
            world,
            coll,
            cache: std::cell::RefCell::new(vec![None; 1 << summaries.len()]),
        }
    }

    /// [`super::search::any_order_lower_bound`] of the group's tensors; `None` on overflow.
    fn bound(&self, mask: u32) -> Option<usize> {
        if let Some(known) = self.cache.borrow()[mask as usize] {
            return known;
        }
        let value = self.compute(mask);
        self.cache.borrow_mut()[mask as usize] = Some(value);
        value
    }

    fn compute(&self, mask: u32) -> Option<usize> {
        let members = (0..self.summaries.len()).filter(|c| mask & (1 << c) != 0);
        let (mut total, mut largest, mut forcing) = (0usize, 1usize, Vec::new());
        for c in members {
            let s = &self.summaries[c];
            total = total.checked_add(s.total?)?;
            largest = largest.max(s.largest_block);
            forcing.extend_from_slice(&s.forcing);
        }
        let start = total.div_ceil(self.world).max(largest).max(1);
        ForcedLattice::new(&forcing, self.coll).next_candidate(start)
    }
}

/// Every partition of `d` classes into exactly `k` groups (restricted growth strings), as
/// (summed group bounds, group masks); partitions whose bounds overflow are left out.
fn partitions_by_bound(d: usize, k: usize, bounds: &GroupBounds) -> Vec<(usize, Vec<u32>)> {
    struct Walk<'b, 'c> {
        d: usize,
        k: usize,
        bounds: &'b GroupBounds<'c>,
        masks: Vec<u32>,
        out: Vec<(usize, Vec<u32>)>,
    }
    impl Walk<'_, '_> {
        fn go(&mut self, c: usize) {
            // The groups still to open need a class each.
            if self.k - self.masks.len() > self.d - c {
                return;
            }
            if c == self.d {
                let sum = self
                    .masks
                    .iter()
                    .try_fold(0usize, |acc, &m| acc.checked_add(self.bounds.bound(m)?));
                if let Some(sum) = sum {
                    self.out.push((sum, self.masks.clone()));
                }
                return;
            }
            for g in 0..self.masks.len() {
                self.masks[g] |= 1 << c;
                self.go(c + 1);
                self.masks[g] &= !(1 << c);
            }
            if self.masks.len() < self.k {
                self.masks.push(1 << c);
                self.go(c + 1);
                self.masks.pop();
            }
        }
    }
    let mut walk = Walk {
        d,
        k,
        bounds,
        masks: Vec::with_capacity(k),
        out: Vec::new(),
    };
    walk.go(0);
    walk.out
}

/// Sizes and plans of groups of classes, found on demand and kept.
struct GroupPlans<'a> {
    items: &'a [Item],
    classes: &'a [Vec<usize>],
    world: usize,
    opts: &'a PlanOptions,
    /// A feasible size found for the group by the quick test.
    found: HashMap<u32, usize>,
    /// The largest cap below which the quick test found no size.
    none_below: HashMap<u32, usize>,
    /// Quick tests run.
    checks: usize,
}

impl<'a> GroupPlans<'a> {
    fn new(
        items: &'a [Item],
        classes: &'a [Vec<usize>],
        world: usize,
        opts: &'a PlanOptions,
    ) -> Self {
        GroupPlans {
            items,
            classes,
            world,
            opts,
            found: HashMap::new(),
            none_below: HashMap::new(),
            checks: 0,
        }
    }

    fn checked(&self) -> usize {
        self.checks
    }

    /// Item indices of the group, in unit order.
    fn indices(&self, mask: u32) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..self.classes.len())
            .filter(|c| mask & (1 << c) != 0)
            .flat_map(|c| self.classes[c].iter().copied())
            .collect();
        idx.sort_unstable();
        idx
    }

    /// The group's items as [`plan_items`] sees them (the start alignment applied).
    fn group_items(&self, mask: u32) -> Option<Vec<Item>> {
        self.indices(mask)
            .iter()
            .map(|&i| {
                let t = self.items[i];
                Item::new(t.numel, t.block, t.align.max(self.opts.start_align)).ok()
            })
            .collect()
    }

    /// A feasible size below `cap` for the group, by the quick test of [`min_shard_below`] over
    /// the planner's orders ([`QUICK_WORK`] placements each).
    fn size_below(&mut self, mask: u32, cap: usize) -> Option<usize> {
        if let Some(&s) = self.found.get(&mask) {
            if s < cap {
                return Some(s);
            }
        }
        if self.none_below.get(&mask).is_some_and(|&c| c >= cap) {
            return None;
        }
        self.checks += 1;
        let group = self.group_items(mask)?;
        let coll = self.opts.coll_align;
        let size = self
            .opts
            .orders
            .iter()
            .filter_map(|order| {
                let arranged: Vec<Item> = order.arrange(&group).iter().map(|&i| group[i]).collect();
                min_shard_below(&arranged, self.world, coll, cap, QUICK_WORK)
            })
            .min();
        match size {
            Some(s) => {
                self.found.insert(mask, s);
            }
            None => {
                self.none_below.insert(mask, cap);
            }
        }
        size
    }

    /// The group's single-buffer layout ([`plan_items`]).
    fn plan(&self, mask: u32) -> Option<Layout> {
        let group: Vec<Item> = self.indices(mask).iter().map(|&i| self.items[i]).collect();
        plan_items(&group, self.world, self.opts).ok()
    }
}
