//! Exact oracles for small inputs (planner.md §5). Tests measure the planner against them.
//!
//! - [`exact_for_order`]: a linear scan of `S` from the lower bound, one greedy check each; the
//!   first feasible `S` is optimal for the order because each check is exact.
//! - [`exact_any_order`]: the same over every permutation (small `n` only).
//! - [`exhaustive_for_order`]: a depth-first search over every start position of every tensor,
//!   checking the block rule directly; it shares no code with the greedy, so it checks the
//!   greedy's exactness on tiny inputs.

use super::fit::greedy;
use super::search::{lower_bound, upper_bound};
use super::Item;
use crate::{Error, Result};

/// Largest `n` for which [`exact_any_order`] enumerates all `n!` orders.
pub const MAX_PERMUTED: usize = 8;

/// The smallest feasible `S` (multiple of `coll`) for `items` in this order.
pub fn exact_for_order(items: &[Item], world: usize, coll: usize) -> Result<usize> {
    let hi = upper_bound(items, coll)?;
    Ok((lower_bound(items, world, coll)?..hi)
        .step_by(coll)
        .find(|&s| greedy(items, s, world).is_some())
        .unwrap_or(hi))
}

/// The smallest `S` over every order, with the order (a permutation of input indices) that
/// reaches it first.
pub fn exact_any_order(items: &[Item], world: usize, coll: usize) -> Result<(usize, Vec<usize>)> {
    if items.len() > MAX_PERMUTED {
        return Err(Error::BadInput {
            op: "exact_any_order",
            what: format!("{} tensors", items.len()),
            reason: format!("the exact oracle enumerates orders only up to {MAX_PERMUTED}"),
        });
    }
    let mut perm: Vec<usize> = (0..items.len()).collect();
    let mut best = (usize::MAX, perm.clone());
    loop {
        let arranged: Vec<Item> = perm.iter().map(|&i| items[i]).collect();
        let s = exact_for_order(&arranged, world, coll)?;
        if s < best.0 {
            best = (s, perm.clone());
        }
        if !next_permutation(&mut perm) {
            return Ok(best);
        }
    }
}

/// Whether any placement of `items` in this order fits shard size `shard`, by trying every
/// start of every tensor (exponential: tiny inputs only).
pub fn exhaustive_fits(items: &[Item], shard: usize, world: usize) -> bool {
    fn place(items: &[Item], cursor: usize, shard: usize, capacity: usize) -> bool {
        let Some((t, rest)) = items.split_first() else {
            return true;
        };
        let Some(last) = capacity.checked_sub(t.numel) else {
            return false;
        };
        (cursor..=last)
            .filter(|&s| s % t.align == 0 && block_rule_holds(s, t, shard))
            .any(|s| place(rest, s + t.numel, shard, capacity))
    }
    shard
        .checked_mul(world)
        .is_some_and(|capacity| place(items, 0, shard, capacity))
}

/// The smallest `S` for this order found by [`exhaustive_fits`].
pub fn exhaustive_for_order(items: &[Item], world: usize, coll: usize) -> Result<usize> {
    let hi = upper_bound(items, coll)?;
    Ok((coll..hi)
        .step_by(coll)
        .find(|&s| exhaustive_fits(items, s, world))
        .unwrap_or(hi))
}

/// Constraint 1 checked directly: every boundary strictly inside the tensor is a block edge.
fn block_rule_holds(start: usize, t: &Item, shard: usize) -> bool {
    (1..)
        .map(|k| k * shard)
        .skip_while(|&b| b <= start)
        .take_while(|&b| b < start + t.numel)
        .all(|b| (b - start) % t.block == 0)
}

/// Advances `p` to the next lexicographic permutation; false after the last one.
fn next_permutation(p: &mut [usize]) -> bool {
    let Some(i) = (1..p.len()).rev().find(|&i| p[i - 1] < p[i]) else {
        return false;
    };
    let j = (i..p.len())
        .rev()
        .find(|&j| p[j] > p[i - 1])
        .expect("p[i] qualifies");
    p.swap(i - 1, j);
    p[i..].reverse();
    true
}
