//! An exact search for small units: the smallest `Σ S_b` over every partition of the tensors into
//! at most `k` buffers and every order inside each buffer. It settles whether a gap between the
//! planner and the floor ([`super::floor`]) is the plan's or the floor's; the planner never calls
//! it (its cost is exponential in the tensor count).
//!
//! - **One buffer, every order.** For a fixed order the greedy earliest fit is exact
//!   ([`super::fit`]), and [`earliest_start`] is monotone in the cursor (a later cursor never
//!   gives an earlier start), so the smallest end reachable after placing a set of tensors in
//!   some order dominates every other end for that set. A dynamic program over subsets,
//!   `end[M ∪ {j}] = min(end[M ∪ {j}], earliest_start(end[M], j) + e_j)`, therefore decides
//!   whether *any* order fits `S` in `2^m · m` steps instead of `m!` greedy runs.
//! - **Every shard size in a window.** Feasibility is not monotone in `S` (block lattices), so
//!   each multiple of `coll` is tried from the group's lower bound upward; the first feasible
//!   one is the group's optimum.
//! - **Partitions, branch and bound.** Each group's window ends where the rest of the tensors,
//!   at `⌈Σ e / V⌉` rounded to `coll` (a bound for any split of them), would push the total past
//!   the cap, so the scans stay short when the cap is a known plan's `Σ S`. The partitions into
//!   at most `k` blocks are then enumerated with the lowest unplaced tensor opening each buffer,
//!   pruned by the same bound.

use super::fit::{earliest_start, total_numel};
use super::search::{lower_bound, upper_bound};
use super::Item;
use crate::{Error, Result};

/// Largest unit the exact search accepts (`2^n` subsets, each with its own scan).
pub const MAX_EXACT_TENSORS: usize = 16;

/// The optimum the exact search found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExactPartition {
    /// Input indices of each buffer (increasing).
    pub groups: Vec<Vec<usize>>,
    /// Each buffer's smallest shard size over every order.
    pub shards: Vec<usize>,
}

impl ExactPartition {
    /// `Σ S_b` over the buffers.
    pub fn shard_sum(&self) -> usize {
        self.shards.iter().sum()
    }
}

/// The smallest `Σ S_b` at most `cap` over every partition of `items` into at most `k` buffers
/// and every order in each, each `S_b` a multiple of `coll` (`Ok(None)`: nothing at or below
/// `cap`). Errors on more than [`MAX_EXACT_TENSORS`] tensors, a zero `world`, `coll` or `k`, or
/// sizes that overflow.
pub fn exact_partition(
    items: &[Item],
    world: usize,
    coll: usize,
    k: usize,
    cap: usize,
) -> Result<Option<ExactPartition>> {
    let n = items.len();
    if n == 0 || n > MAX_EXACT_TENSORS || world == 0 || coll == 0 || k == 0 {
        return Err(Error::BadInput {
            op: "exact_partition",
            what: format!("{n} tensors, V = {world}, coll {coll}, k = {k}"),
            reason: format!(
                "needs 1..={MAX_EXACT_TENSORS} tensors, ranks, a collective alignment and a buffer"
            ),
        });
    }
    let full = (1usize << n) - 1;
    let lbs = (0..=full)
        .map(|m| share_bound(&subset(items, m), world, coll))
        .collect::<Result<Vec<usize>>>()?;
    let mut best_shard = vec![None; full + 1];
    for mask in 1..=full {
        let window_end = cap.saturating_sub(lbs[full & !mask]);
        best_shard[mask] = min_shard_any_order(&subset(items, mask), world, coll, window_end)?;
    }
    let mut search = PartitionSearch {
        best_shard: &best_shard,
        lbs: &lbs,
        k,
        best: None,
        cap,
    };
    search.descend(full, 0, &mut Vec::new());
    Ok(search.best.map(|(_, masks)| ExactPartition {
        groups: masks.iter().map(|&m| members(m)).collect(),
        shards: masks.iter().map(|&m| best_shard[m].unwrap_or(0)).collect(),
    }))
}

/// The smallest `S ≤ window_end` (a multiple of `coll`) at which some order of `items` fits on
/// `world` ranks, or `None`.
pub fn min_shard_any_order(
    items: &[Item],
    world: usize,
    coll: usize,
    window_end: usize,
) -> Result<Option<usize>> {
    let start = lower_bound(items, world, coll)?;
    // Past the upper bound everything fits in shard 0 already, so it always is feasible.
    let end = window_end.min(upper_bound(items, coll)?);
    Ok((start..=end)
        .step_by(coll)
        .find(|&s| any_order_fits(items, s, world)))
}

/// Whether some order of `items` fits shard size `shard` (the subset dynamic program).
pub fn any_order_fits(items: &[Item], shard: usize, world: usize) -> bool {
    let Some(capacity) = shard.checked_mul(world) else {
        return false;
    };
    let Some(total) = total_numel(items) else {
        return false;
    };
    let m = items.len();
    // end[M]: the smallest cursor after placing the tensors of M in some order.
    let mut end = vec![usize::MAX; 1 << m];
    let mut placed = vec![0usize; 1 << m];
    end[0] = 0;
    for mask in 0..end.len() {
        if mask > 0 {
            let low = mask.trailing_zeros() as usize;
            placed[mask] = placed[mask & (mask - 1)] + items[low].numel;
        }
        let cursor = end[mask];
        if cursor == usize::MAX {
            continue;
        }
        let rest = total - placed[mask];
        for (j, item) in items
            .iter()
            .enumerate()
            .filter(|&(j, _)| mask >> j & 1 == 0)
        {
            let Some(stop) = earliest_start(cursor, item, shard)
                .and_then(|s| s.checked_add(item.numel))
                .filter(|&stop| stop <= capacity && capacity - stop >= rest - item.numel)
            else {
                continue;
            };
            let next = &mut end[mask | 1 << j];
            *next = (*next).min(stop);
        }
    }
    end[end.len() - 1] <= capacity
}

/// Depth-first enumeration of partitions, the lowest unplaced tensor opening each buffer.
struct PartitionSearch<'a> {
    best_shard: &'a [Option<usize>],
    lbs: &'a [usize],
    k: usize,
    /// The best `Σ S` so far and its buffers (as masks).
    best: Option<(usize, Vec<usize>)>,
    cap: usize,
}

impl PartitionSearch<'_> {
    fn descend(&mut self, left: usize, sum: usize, chosen: &mut Vec<usize>) {
        let bound = self
            .best
            .as_ref()
            .map_or(self.cap, |b| b.0.saturating_sub(1));
        if left == 0 {
            if sum <= bound {
                self.best = Some((sum, chosen.clone()));
            }
            return;
        }
        if chosen.len() == self.k || sum.saturating_add(self.lbs[left]) > bound {
            return;
        }
        let low = left & left.wrapping_neg();
        let others = left & !low;
        // Every subset of the other unplaced tensors joins the lowest one in this buffer.
        let mut sub = others;
        loop {
            let group = low | sub;
            if let Some(s) = self.best_shard[group] {
                chosen.push(group);
                self.descend(left & !group, sum.saturating_add(s), chosen);
                chosen.pop();
            }
            if sub == 0 {
                break;
            }
            sub = (sub - 1) & others;
        }
    }
}

/// A bound on `Σ S` for any split of `items` into buffers: `⌈Σ e / V⌉` rounded up to `coll`
/// (each buffer's `S_b ≥ ⌈e_b / V⌉`, and the sum of multiples of `coll` is one); 0 when empty.
fn share_bound(items: &[Item], world: usize, coll: usize) -> Result<usize> {
    if items.is_empty() {
        return Ok(0);
    }
    let total = total_numel(items).ok_or_else(|| Error::BadInput {
        op: "exact_partition",
        what: format!("{} tensors", items.len()),
        reason: "the sum of tensor sizes overflows".into(),
    })?;
    total
        .div_ceil(world)
        .checked_next_multiple_of(coll)
        .ok_or_else(|| Error::BadInput {
            op: "exact_partition",
            what: format!("{total} elements on {world} ranks"),
            reason: "the share rounded to the collective alignment overflows".into(),
        })
}

fn subset(items: &[Item], mask: usize) -> Vec<Item> {
    members(mask).into_iter().map(|i| items[i]).collect()
}

fn members(mask: usize) -> Vec<usize> {
    (0..usize::BITS as usize)
        .filter(|&i| mask >> i & 1 == 1)
        .collect()
}
