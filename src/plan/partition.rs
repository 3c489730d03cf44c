//! Which tensors of a unit share a collective buffer: the partition search of [`super::multi`].
//!
//! **Classes.** Tensors are grouped by block size (the distinct sizes, largest first; with more
//! than the enumeration allows, adjacent sizes are merged evenly), and a buffer holds whole
//! classes. A class is what forces a lattice: every tensor of at least `2S` elements needs its
//! block to divide `S`, so tensors with the same block never disagree about it.
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
//! partitions are sorted by the sum of their groups' bounds and planned in that order, each
//! group at most once, until that sum cannot beat the best planned partition, or the cost model
//! says no partition left can beat `to_beat`, or [`PLAN_BUDGET`] groups have been planned. The
//! enumeration is bounded: the classes are merged until at most [`MAX_PARTITIONS`] partitions
//! remain (12 classes for `k = 3`), so the work does not grow with the number of tensors beyond
//! computing the class summaries.

use std::collections::HashMap;

use super::multi::MultiOptions;
use super::search::ForcedLattice;
use super::{plan_items, Item, Layout, PlanOptions};

/// At most this many block-size classes (masks are `u32`; more distinct sizes are merged).
pub const MAX_CLASSES: usize = 20;

/// At most this many set partitions are enumerated for one `k` (classes are merged to fit).
pub const MAX_PARTITIONS: u64 = 100_000;

/// At most this many distinct groups are planned exactly for one `k`.
pub const PLAN_BUDGET: usize = 24;

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
    let mut best: Option<(usize, Vec<u32>)> = None;
    for (bound, masks) in candidates {
        let limit = best.as_ref().map_or(usize::MAX, |b| b.0);
        if bound >= limit || mopts.cost_s(k, bound, world) >= to_beat {
            break;
        }
        if plans.planned() >= PLAN_BUDGET && masks.iter().any(|&m| !plans.has(m)) {
            continue;
        }
        let sum = masks
            .iter()
            .try_fold(0usize, |acc, &m| acc.checked_add(plans.plan(m)?.shard_size));
        if let Some(sum) = sum.filter(|&s| s < limit) {
            best = Some((sum, masks));
        }
    }
    let (shard_sum, masks) = best?;
    if mopts.cost_s(k, shard_sum, world) >= to_beat {
        return None;
    }
    let groups = masks.iter().map(|&m| plans.indices(m)).collect();
    let layouts = masks
        .iter()
        .map(|&m| plans.plan(m).cloned())
        .collect::<Option<Vec<_>>>()?;
    Some(Partition {
        groups,
        layouts,
        shard_sum,
    })
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

/// Single-buffer plans of groups of classes, made on demand and kept.
struct GroupPlans<'a> {
    items: &'a [Item],
    classes: &'a [Vec<usize>],
    world: usize,
    opts: &'a PlanOptions,
    /// `None` inside: planning the group failed (its sizes overflow).
    plans: HashMap<u32, Option<Layout>>,
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
            plans: HashMap::new(),
        }
    }

    fn planned(&self) -> usize {
        self.plans.len()
    }

    fn has(&self, mask: u32) -> bool {
        self.plans.contains_key(&mask)
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

    fn plan(&mut self, mask: u32) -> Option<&Layout> {
        if !self.plans.contains_key(&mask) {
            let group: Vec<Item> = self.indices(mask).iter().map(|&i| self.items[i]).collect();
            let layout = plan_items(&group, self.world, self.opts).ok();
            self.plans.insert(mask, layout);
        }
        self.plans.get(&mask).and_then(Option::as_ref)
    }
}
