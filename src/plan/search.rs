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
//!    distance `S`), so `g | S` for all such tensors ([`ForcedLattice`]). The finish has a
//!    budget ([`MAX_FINISH_WORK`]); [`SearchStats::exact`] says whether it covered every size.
//!
//! Every size, sum and product is checked: a unit whose sizes overflow 64 bits, or whose `V·S`
//! cannot be addressed at any `S`, is an error. Bisection runs once per distinct prefix lattice;
//! each is a proper multiple of the one before, so there are at most 64 of them.

use super::fit::{fits, greedy, lcm, total_numel};
use super::Item;
use crate::{Error, Result};

/// Fewest candidate sizes the exact finish may check one by one, whatever the unit's size.
pub const MIN_FINISH_CHECKS: usize = 4096;

/// Tensor placements the exact finish may spend in all (each check places every tensor once):
/// a unit of `n` tensors may check `max(MIN_FINISH_CHECKS, MAX_FINISH_WORK / n)` sizes. Below
/// that, the search is exact for its order; past it (a gap of thousands of collective-alignment
/// steps between the lower bound and the bisection's result, which only huge tensors with
/// coarse blocks produce) the search keeps the bisection's size and says so in
/// [`SearchStats::exact`]. This is what bounds the time of a search whatever the tensor sizes.
pub const MAX_FINISH_WORK: usize = 1 << 22;

/// What one search did; reported by `ragged plan` and the benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SearchStats {
    /// Greedy feasibility checks run.
    pub checks: usize,
    /// The bisection's upper bound `U`, before the exact finish.
    pub bisection_bound: usize,
    /// The exact finish covered every candidate below `U` ([`MAX_FINISH_WORK`]), so the size
    /// is the smallest feasible one for this order.
    pub exact: bool,
}

fn overflow(what: &str) -> Error {
    Error::BadInput {
        op: "plan search",
        what: what.into(),
        reason: "the sizes overflow a 64-bit element count".into(),
    }
}

/// The smallest shard size that any layout can have: every tensor fits, and every block fits
/// in one shard. Rounded up to `coll`. Errors when the sizes overflow.
pub fn lower_bound(items: &[Item], world: usize, coll: usize) -> Result<usize> {
    let total = total_numel(items).ok_or_else(|| overflow("sum of tensor sizes"))?;
    let max_block = items.iter().map(|t| t.block).max().unwrap_or(1);
    total
        .div_ceil(world.max(1))
        .max(max_block)
        .max(1)
        .checked_next_multiple_of(coll)
        .ok_or_else(|| overflow("lower bound on the shard size"))
}

/// A lower bound on `S` for *every* order and layout: the smallest size at or above
/// [`lower_bound`] that satisfies the forced-case-3 lattice ([`ForcedLattice`]), a condition
/// no order can escape. Padding at this size is padding the blocks themselves force.
pub fn any_order_lower_bound(items: &[Item], world: usize, coll: usize) -> Result<usize> {
    ForcedLattice::new(items, coll)
        .next_candidate(lower_bound(items, world, coll)?)
        .ok_or_else(|| overflow("forced-lattice lower bound"))
}

/// A shard size that always works (every tensor inside shard 0, none cut), provided `V·S`
/// is addressable. Errors when it overflows.
pub fn upper_bound(items: &[Item], coll: usize) -> Result<usize> {
    items
        .iter()
        .try_fold(0usize, |acc, t| {
            acc.checked_add(t.numel)?.checked_add(t.align - 1)
        })
        .and_then(|all| all.max(1).checked_next_multiple_of(coll))
        .ok_or_else(|| overflow("upper bound on the shard size"))
}

/// The smallest feasible `S` (a multiple of `coll`) for `items` in the given order, with the
/// offsets the greedy assigns at that `S` (exact when [`SearchStats::exact`]). Errors when the
/// sizes overflow or no shard size gives an addressable `V·S` buffer.
pub fn min_shard(
    items: &[Item],
    world: usize,
    coll: usize,
) -> Result<(usize, Vec<usize>, SearchStats)> {
    let mut stats = SearchStats::default();
    let mut feasible = |s: usize| {
        stats.checks += 1;
        fits(items, s, world, |_| {})
    };
    let lo = lower_bound(items, world, coll)?;
    let hi = upper_bound(items, coll)?;
    let bound = prefix_bisection(items, coll, lo, hi, &mut feasible);
    let checks = MIN_FINISH_CHECKS.max(MAX_FINISH_WORK / items.len().max(1));
    let (exact, complete) = exact_finish(items, coll, lo, bound, checks, &mut feasible);
    stats.bisection_bound = bound;
    stats.exact = complete;
    let offsets = greedy(items, exact, world).ok_or_else(|| Error::Infeasible {
        op: "plan search",
        reason: format!(
            "no shard size up to {hi} elements fits {} tensors on {world} ranks in an \
             addressable buffer (V·S must fit in 64 bits)",
            items.len()
        ),
    })?;
    stats.checks += 1;
    Ok((exact, offsets, stats))
}

/// A feasible `S` below `cap` for `items` in the given order, searched as [`min_shard`] does
/// but only below `cap` and with the exact finish limited to `work` tensor placements: a quick
/// test of whether a group can beat a known size. `Some` is always feasible (and the smallest
/// one when the finish was complete); `None` means none was found, not that none exists.
pub fn min_shard_below(
    items: &[Item],
    world: usize,
    coll: usize,
    cap: usize,
    work: usize,
) -> Option<usize> {
    let mut feasible = |s: usize| fits(items, s, world, |_| {});
    let lo = lower_bound(items, world, coll).ok()?;
    if lo >= cap {
        return None;
    }
    let hi = upper_bound(items, coll).ok()?.min(cap);
    // Sizes the bisection or the finish return below `cap` were checked feasible.
    let bound = prefix_bisection(items, coll, lo, hi, &mut feasible);
    let checks = (work / items.len().max(1)).max(1);
    let (found, _) = exact_finish(items, coll, lo, bound, checks, &mut feasible);
    (found < cap).then_some(found)
}

/// Step 2: the smallest feasible candidate below `bound` (the forced lattice's sizes, from the
/// lower bound up), checking at most `budget` of them. Returns the size and whether every
/// candidate below it was checked.
fn exact_finish(
    items: &[Item],
    coll: usize,
    lo: usize,
    bound: usize,
    budget: usize,
    feasible: &mut impl FnMut(usize) -> bool,
) -> (usize, bool) {
    let lattice = ForcedLattice::new(items, coll);
    let mut s = lo;
    for _ in 0..budget {
        match lattice.next_candidate(s) {
            Some(c) if c < bound => {
                if feasible(c) {
                    return (c, true);
                }
                match c.checked_add(coll) {
                    Some(next) => s = next,
                    None => return (bound, true),
                }
            }
            _ => return (bound, true),
        }
    }
    (bound, false)
}

/// Step 1: the best `S` over all prefix lattices, by bisection on each. Prefixes that share a
/// lattice are searched once, from the smallest start among them (the last such prefix); since
/// each new lattice is a proper multiple of the previous one, there are at most 64 of them.
fn prefix_bisection(
    items: &[Item],
    coll: usize,
    lo: usize,
    hi: usize,
    feasible: &mut impl FnMut(usize) -> bool,
) -> usize {
    let mut by_size: Vec<&Item> = items.iter().collect();
    by_size.sort_by(|a, b| b.numel.cmp(&a.numel).then(a.block.cmp(&b.block)));
    let mut best = hi;
    let mut lattice = coll;
    for j in 0..=by_size.len() {
        // The lattice of the next prefix; the current one is searched when it is about to change.
        let next = by_size.get(j).map(|t| lcm(lattice, t.block));
        if next == Some(Some(lattice)) {
            continue;
        }
        // Tensors outside the prefix must not be case 3, so S > e/2 for each of them.
        let half = by_size.get(j).map_or(0, |t| t.numel / 2 + 1);
        if let Some(start) = lo.max(half).checked_next_multiple_of(lattice) {
            if start < best {
                best = best.min(bisect(start, best, lattice, feasible));
            }
        }
        match next {
            Some(Some(l)) if l <= hi => lattice = l,
            _ => break, // larger prefixes only grow the lattice past the trivial bound
        }
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

    /// The smallest size `≥ s` (a multiple of `coll`) that satisfies the forced lattice;
    /// `None` when it overflows.
    pub fn next_candidate(&self, s: usize) -> Option<usize> {
        let mut s = s.checked_next_multiple_of(self.coll)?;
        // A pass returns, or moves `s` past half the smallest forced tensor (the forced set
        // shrinks), or onto the lattice (the next pass returns unless the set shrank): at most
        // `2(n + 1)` passes.
        loop {
            // e ≥ 2S ⇔ ⌊e/2⌋ ≥ S, which cannot overflow.
            let forced = self.sizes.partition_point(|&e| e / 2 >= s);
            // The forced set shrinks once S passes half the smallest forced tensor.
            let release = || match forced {
                0 => None,
                p => (self.sizes[p - 1] / 2 + 1).checked_next_multiple_of(self.coll),
            };
            s = match self.lcm[forced] {
                // Only larger S shrink the forced set: go to where the smallest one drops out.
                None => release()?,
                Some(step) if s % step == 0 => return Some(s),
                Some(step) => match (s.checked_next_multiple_of(step), release()) {
                    (Some(up), Some(r)) => up.min(r),
                    (Some(up), None) => up,
                    (None, r) => r?,
                },
            };
        }
    }
}
