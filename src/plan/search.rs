//! The search over the shard size `S` for one tensor order (planner.md §4).
//!
//! 1. **Prefix lattices.** Sort tensors by size (descending, smaller block first on ties); for
//!    each prefix `C_j` of that list (the candidate case-3 tensors), `S` runs over multiples of
//!    `L = lcm(coll, g_t : t ∈ C_j)` from `max(⌈E/V⌉, e_t/2 + 1 for t ∉ C_j)`; bisection finds
//!    the smallest `S` the greedy accepts, assuming monotonicity. The best over all prefixes is a
//!    feasible upper bound `U`.
//! 2. **Exact finish.** Feasibility is *not* monotone in `S` (test vector TV1: 16 feasible, 17
//!    not, 18 feasible), so bisection may overshoot. The sizes below `U` are then checked from
//!    the lower bound up; the first feasible one is the true minimum for this order, because the
//!    greedy is exact for a fixed order and `S`. The scan skips only sizes that violate a
//!    necessary condition: a tensor with `e ≥ 2S` always has two interior boundaries (or one at
//!    distance `S`), so `g | S` for all such tensors ([`ForcedLattice`]).

use super::fit::{fits, greedy, lcm};
use super::Item;

/// What one search did; reported by `ragged plan` and the benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SearchStats {
    /// Greedy feasibility checks run.
    pub checks: usize,
    /// The bisection's upper bound `U`, before the exact finish.
    pub bisection_bound: usize,
}

/// The smallest shard size that any layout can have: every tensor fits, and every block fits
/// in one shard. Rounded up to `coll`.
pub fn lower_bound(items: &[Item], world: usize, coll: usize) -> usize {
    let total: usize = items.iter().map(|t| t.numel).sum();
    let max_block = items.iter().map(|t| t.block).max().unwrap_or(1);
    total
        .div_ceil(world)
        .max(max_block)
        .max(1)
        .next_multiple_of(coll)
}

/// A lower bound on `S` for *every* order and layout: the smallest size at or above
/// [`lower_bound`] that satisfies the forced-case-3 lattice ([`ForcedLattice`]), a condition
/// no order can escape. Padding at this size is padding the blocks themselves force.
pub fn any_order_lower_bound(items: &[Item], world: usize, coll: usize) -> usize {
    ForcedLattice::new(items, coll).next_candidate(lower_bound(items, world, coll))
}

/// A shard size that always works: every tensor inside shard 0, none cut.
pub fn upper_bound(items: &[Item], coll: usize) -> usize {
    let all: usize = items.iter().map(|t| t.numel + t.align - 1).sum();
    all.max(1).next_multiple_of(coll)
}

/// The smallest feasible `S` (a multiple of `coll`) for `items` in the given order, with the
/// offsets the greedy assigns at that `S`.
pub fn min_shard(items: &[Item], world: usize, coll: usize) -> (usize, Vec<usize>, SearchStats) {
    let mut stats = SearchStats::default();
    let mut feasible = |s: usize| {
        stats.checks += 1;
        fits(items, s, world, |_| {})
    };
    let lo = lower_bound(items, world, coll);
    let bound = prefix_bisection(items, coll, lo, &mut feasible);
    let lattice = ForcedLattice::new(items, coll);
    let mut exact = bound;
    let mut s = lo;
    while s < bound {
        match lattice.next_candidate(s) {
            c if c >= bound => break,
            c if feasible(c) => {
                exact = c;
                break;
            }
            c => s = c + coll,
        }
    }
    stats.bisection_bound = bound;
    let offsets = greedy(items, exact, world).expect("the search returns a feasible size");
    stats.checks += 1;
    (exact, offsets, stats)
}

/// Step 1: the best `S` over all prefix lattices, by bisection on each.
fn prefix_bisection(
    items: &[Item],
    coll: usize,
    lo: usize,
    feasible: &mut impl FnMut(usize) -> bool,
) -> usize {
    let hi = upper_bound(items, coll);
    let mut by_size: Vec<&Item> = items.iter().collect();
    by_size.sort_by(|a, b| b.numel.cmp(&a.numel).then(a.block.cmp(&b.block)));
    let mut best = hi;
    let mut lattice = coll;
    let mut tried = Vec::new();
    for j in 0..=by_size.len() {
        if j > 0 {
            match lcm(lattice, by_size[j - 1].block) {
                Some(l) if l <= hi => lattice = l,
                _ => break, // larger prefixes only grow the lattice past the trivial bound
            }
        }
        // Tensors outside the prefix must not be case 3, so S > e/2 for each of them.
        let half = by_size.get(j).map_or(0, |t| t.numel / 2 + 1);
        let start = lo.max(half).next_multiple_of(lattice);
        if start >= best || tried.contains(&(lattice, start)) {
            continue;
        }
        tried.push((lattice, start));
        best = best.min(bisect(start, best, lattice, feasible));
    }
    best
}

/// Smallest multiple of `step` in `[start, limit)` that `feasible` accepts, assuming
/// monotonicity; `limit` (known feasible) when there is none.
fn bisect(
    start: usize,
    limit: usize,
    step: usize,
    feasible: &mut impl FnMut(usize) -> bool,
) -> usize {
    // Every multiple below `hi · step` is below `limit`, the size known to be feasible.
    let (mut lo, mut hi) = (start / step, limit.div_ceil(step));
    let mut found = None;
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if feasible(mid * step) {
            found = Some(mid * step);
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    found.unwrap_or(limit)
}

/// The lattice that tensors forced into case 3 impose on `S`: for a given `S`, every tensor
/// with `e ≥ 2S` needs `g | S`, so `S` must be a multiple of `lcm(coll, g_t : e_t ≥ 2S)`.
pub struct ForcedLattice {
    /// Tensor sizes, descending.
    sizes: Vec<usize>,
    /// `lcm[p]` = lcm of `coll` and the blocks of the `p` largest tensors (`None`: overflow).
    lcm: Vec<Option<usize>>,
    coll: usize,
}

impl ForcedLattice {
    pub fn new(items: &[Item], coll: usize) -> Self {
        let mut by_size: Vec<&Item> = items.iter().collect();
        by_size.sort_by_key(|t| std::cmp::Reverse(t.numel));
        let mut lcm_acc = Some(coll);
        let mut prefix = vec![lcm_acc];
        for t in &by_size {
            lcm_acc = lcm_acc.and_then(|l| lcm(l, t.block));
            prefix.push(lcm_acc);
        }
        ForcedLattice {
            sizes: by_size.iter().map(|t| t.numel).collect(),
            lcm: prefix,
            coll,
        }
    }

    /// The smallest size `≥ s` (a multiple of `coll`) that satisfies the forced lattice.
    pub fn next_candidate(&self, mut s: usize) -> usize {
        s = s.next_multiple_of(self.coll);
        loop {
            let forced = self.sizes.partition_point(|&e| e >= 2 * s);
            let Some(step) = self.lcm[forced] else {
                // Only larger S shrink the forced set: go to where the smallest one drops out.
                s = (self.sizes[forced - 1] / 2 + 1).next_multiple_of(self.coll);
                continue;
            };
            if s % step == 0 {
                return s;
            }
            // The forced set shrinks once S passes half the smallest forced tensor.
            let release = match forced {
                0 => usize::MAX,
                p => (self.sizes[p - 1] / 2 + 1).next_multiple_of(self.coll),
            };
            s = s.next_multiple_of(step).min(release);
        }
    }
}
