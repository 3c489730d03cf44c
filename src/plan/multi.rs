//! Multi-buffer units: one FSDP unit planned as up to `K` collective buffers, each with its own
//! shard size, when that pads less than one buffer by more than the extra collectives cost.
//!
//! **Why.** In one buffer every case-3 tensor forces `S` onto the lcm of its block and the
//! others'. A Mixtral layer at `V = 1024`, `rows:16`: the `w2` block (229,376 elements) and the
//! `w1` block (65,536) force `S` to a multiple of 458,752 while the layer needs 1.42 M per rank,
//! so `S` jumps to 1.83 M (29 % padding). With the `w2` tensors in a buffer of their own, each
//! buffer's lattice is its own block.
//!
//! **Search.** Tensors are grouped by block size: the distinct block sizes, largest first, are
//! cut into `k` contiguous runs and each run's tensors (in unit order) are planned as one
//! ordinary buffer by [`plan_items`]. Splits are tried in order of the summed lower bounds of
//! their runs, each run planned at most once, until no remaining split can beat the best one.
//! More than [`MAX_CLASSES`] block sizes are merged into that many classes first, so the work
//! is bounded.
//!
//! **Choice of `k`** ([`MultiOptions`]): per training step each buffer costs one all-gather
//! and one reduce-scatter, each a latency `α` plus `(V−1)·S·bytes / bandwidth` on the link. The
//! padding is moved by both and stored in every role, and both are proportional to `Σ S`, so
//! one term covers them: `cost(k) = 2k·α + 2(V−1)·Σ S_b·bytes / bandwidth`. The smallest cost
//! wins; ties go to fewer buffers, so one buffer is kept wherever it is as good.
//!
//! **Floor** ([`floor_shard_sum`], in [`super::floor`]): a lower bound on `Σ S_b` over every
//! partition of the unit into at most `k` buffers and every layout of each, proved in that
//! module's doc and tested against exhaustive search on small inputs.

pub use super::floor::floor_shard_sum;
use super::{plan_items, Item, Layout, PlanOptions};
use crate::{Error, Result};

/// At most this many block-size classes are split (more distinct sizes are merged).
pub const MAX_CLASSES: usize = 16;

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
    fn validate(&self) -> Result<()> {
        let bad = |reason: &str| Error::BadInput {
            op: "MultiOptions",
            what: format!("{self:?}"),
            reason: reason.into(),
        };
        if self.max_buffers == 0 {
            return Err(bad("at least one buffer per unit"));
        }
        if !(self.collective_latency_s.is_finite() && self.collective_latency_s >= 0.0) {
            return Err(bad(
                "the collective latency must be finite and non-negative",
            ));
        }
        if !(self.link_bytes_per_s.is_finite() && self.link_bytes_per_s > 0.0) {
            return Err(bad("the link bandwidth must be finite and positive"));
        }
        if self.elem_bytes == 0 {
            return Err(bad("elements have at least one byte"));
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

/// Plans `items` as at most `mopts.max_buffers` buffers (see the module doc).
pub fn plan_multi_items(
    items: &[Item],
    world: usize,
    opts: &PlanOptions,
    mopts: &MultiOptions,
) -> Result<MultiLayout> {
    mopts.validate()?;
    let single = plan_items(items, world, opts)?;
    let classes = block_classes(items);
    let max_k = mopts.max_buffers.min(classes.len());
    let mut best = Choice {
        groups: vec![(0..items.len()).collect()],
        layouts: vec![single.clone()],
        cost_s: mopts.cost_s(1, single.shard_size, world),
    };
    let mut best_floor = single.lower_bound;
    if max_k > 1 {
        let mut runs = RunPlans::new(items, &classes, world, opts);
        for k in 2..=max_k {
            let floor = floor_shard_sum(items, world, opts.coll_align, k)?;
            // No k-buffer layout can beat the best so far: skip the search.
            if mopts.cost_s(k, floor, world) >= best.cost_s {
                continue;
            }
            if let Some(choice) = runs.best_split(k, best.cost_s, mopts) {
                if choice.cost_s < best.cost_s {
                    best = choice;
                    best_floor = floor;
                }
            }
        }
    }
    Ok(MultiLayout {
        groups: best.groups,
        layouts: best.layouts,
        single,
        floor: best_floor,
        cost_s: best.cost_s,
    })
}

struct Choice {
    groups: Vec<Vec<usize>>,
    layouts: Vec<Layout>,
    cost_s: f64,
}

/// Item indices of each block-size class, largest block first; at most [`MAX_CLASSES`]
/// classes (adjacent sizes merged evenly when there are more).
fn block_classes(items: &[Item]) -> Vec<Vec<usize>> {
    let mut sizes: Vec<usize> = items.iter().map(|t| t.block).collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.dedup();
    let per_class = sizes.len().div_ceil(MAX_CLASSES);
    let mut classes = vec![Vec::new(); sizes.len().div_ceil(per_class)];
    for (i, t) in items.iter().enumerate() {
        let rank = sizes.partition_point(|&s| s > t.block);
        classes[rank / per_class].push(i);
    }
    classes
}

/// Single-buffer plans of contiguous runs of classes, made on demand and kept: a split is
/// planned only if the lower bounds of its runs could still beat the best split found.
struct RunPlans<'a> {
    items: &'a [Item],
    classes: Vec<Vec<usize>>,
    world: usize,
    opts: &'a PlanOptions,
    /// `bounds[i][j]`: [`super::search::any_order_lower_bound`] of classes `i..=j` (`None`:
    /// the run's sizes overflow).
    bounds: Vec<Vec<Option<usize>>>,
    /// `plans[i][j]`: the plan of classes `i..=j`, once made (inner `None`: it failed).
    plans: Vec<Vec<Option<Option<Layout>>>>,
}

impl<'a> RunPlans<'a> {
    fn new(items: &'a [Item], classes: &[Vec<usize>], world: usize, opts: &'a PlanOptions) -> Self {
        let d = classes.len();
        let mut bounds = vec![vec![None; d]; d];
        for (i, row) in bounds.iter_mut().enumerate() {
            for (j, slot) in row.iter_mut().enumerate().skip(i) {
                let run: Vec<Item> = run_indices(classes, i, j).map(|x| items[x]).collect();
                *slot = super::search::any_order_lower_bound(&run, world, opts.coll_align).ok();
            }
        }
        RunPlans {
            items,
            classes: classes.to_vec(),
            world,
            opts,
            bounds,
            plans: vec![vec![None; d]; d],
        }
    }

    fn plan(&mut self, i: usize, j: usize) -> Option<&Layout> {
        if self.plans[i][j].is_none() {
            let run: Vec<Item> = run_indices(&self.classes, i, j)
                .map(|x| self.items[x])
                .collect();
            self.plans[i][j] = Some(plan_items(&run, self.world, self.opts).ok());
        }
        self.plans[i][j].as_ref().and_then(Option::as_ref)
    }

    /// The split of the classes into exactly `k` runs with the smallest `Σ S`, if it costs less
    /// than `to_beat` seconds. Splits are tried in order of their runs' summed lower bounds, and
    /// the search stops once that sum cannot beat the best split found.
    fn best_split(&mut self, k: usize, to_beat: f64, mopts: &MultiOptions) -> Option<Choice> {
        let mut splits: Vec<(usize, Vec<(usize, usize)>)> = splits(self.classes.len(), k)
            .into_iter()
            .filter_map(|runs| {
                let lb = runs
                    .iter()
                    .try_fold(0usize, |acc, &(i, j)| acc.checked_add(self.bounds[i][j]?))?;
                Some((lb, runs))
            })
            .collect();
        splits.sort_by_key(|(lb, _)| *lb);
        let mut best: Option<(usize, Vec<(usize, usize)>)> = None;
        for (lb, runs) in splits {
            let limit = best.as_ref().map_or(usize::MAX, |b| b.0);
            if lb >= limit || mopts.cost_s(k, lb, self.world) >= to_beat {
                break;
            }
            let mut sum = Some(0usize);
            for &(i, j) in &runs {
                let s = self.plan(i, j).map(|l| l.shard_size);
                sum = sum.zip(s).and_then(|(a, b)| a.checked_add(b));
            }
            if let Some(sum) = sum.filter(|&s| s < limit) {
                best = Some((sum, runs));
            }
        }
        let (shard_sum, runs) = best?;
        let cost_s = mopts.cost_s(k, shard_sum, self.world);
        let groups = runs
            .iter()
            .map(|&(i, j)| run_indices(&self.classes, i, j).collect())
            .collect();
        let layouts = runs
            .iter()
            .map(|&(i, j)| self.plan(i, j).cloned())
            .collect::<Option<Vec<_>>>()?;
        Some(Choice {
            groups,
            layouts,
            cost_s,
        })
    }
}

/// Every split of classes `0..d` into exactly `k` non-empty contiguous runs `(first, last)`.
fn splits(d: usize, k: usize) -> Vec<Vec<(usize, usize)>> {
    fn go(
        start: usize,
        d: usize,
        k: usize,
        cur: &mut Vec<(usize, usize)>,
        out: &mut Vec<Vec<(usize, usize)>>,
    ) {
        if k == 1 {
            cur.push((start, d - 1));
            out.push(cur.clone());
            cur.pop();
            return;
        }
        // Leave at least one class for each of the k − 1 runs after this one.
        for end in start..d - (k - 1) {
            cur.push((start, end));
            go(end + 1, d, k - 1, cur, out);
            cur.pop();
        }
    }
    let mut out = Vec::new();
    if k >= 1 && k <= d {
        go(0, d, k, &mut Vec::new(), &mut out);
    }
    out
}

/// Item indices of classes `i..=j`, in unit order.
fn run_indices(classes: &[Vec<usize>], i: usize, j: usize) -> impl Iterator<Item = usize> + '_ {
    let mut idx: Vec<usize> = classes[i..=j].iter().flatten().copied().collect();
    idx.sort_unstable();
    idx.into_iter()
}
