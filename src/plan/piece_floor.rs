//! The piece floor: a fifth lower bound on `Σ S_b`, for any number of buffers, taken with the
//! others by [`super::floor::floor_shard_sum`].
//!
//! **Why.** The other floors only see the lattice of tensors that are forced (`e ≥ 2S`).
//! A tensor that crosses one boundary without being forced still cuts the shard at one of
//! its block edges, so the part of it inside a shard is a whole number of blocks, or the rest
//! of the tensor after whole blocks. In a Qwen3-30B-A3B layer at `rows:128`, `V = 256`, every
//! expert tensor (1,572,864 elements, blocks of 262,144 or 98,304) is shorter than `2S`, yet
//! every part of one inside a shard is a multiple of 32,768: a shard holding only expert parts
//! holds a multiple of 32,768 elements, and 2,434,048 elements per rank need 75 of those,
//! 2,457,600 (0.97 % padding, against 0.002 % for the share).
//!
//! **Proof.** Let `d_t = gcd(e_t, g_t)`. Tensor `t` occupies `[o, o + e)` of its buffer; the
//! boundaries strictly inside it lie at `o + j·g` (constraint 1 of `planner.md`). The part of
//! `t` in one shard runs between two of the points `o`, `o + j·g`, `o + e`, so its length is a
//! multiple of `d_t`. Fix `D` and let `A` be the tensors with `D | d_t`, `E_A` their elements.
//! In a buffer `b`, shard `r` holds parts of `A` summing to `a_r`, a multiple of `D`, with
//! `a_r ≤ S_b`, so `a_r ≤ D·⌊S_b/D⌋`; the shards hold all of `A`'s elements in `b`, so
//! `V·D·⌊S_b/D⌋ ≥ E_{A,b}`, and `m_b = ⌊S_b/D⌋ ≥ E_{A,b}/(V·D)`. Summed over the buffers,
//! `Σ m_b ≥ E_A/(V·D)`, an integer, so `Σ S_b ≥ D·Σ m_b ≥ D·⌈E_A/(V·D)⌉`; and `Σ S_b` is a
//! multiple of `coll`. This holds for every `D`; the floor is the largest over the `D` that
//! are gcds of some of the `d_t` (a `D` that is no such gcd has the same `A` as the gcd of
//! its `A`'s `d_t`, which is a multiple of `D` and gives at least as much).

use super::fit::gcd;
use super::Item;

/// At most this many candidate divisors `D` (the gcd closure of the `d_t`); any subset of
/// them gives a valid bound, so the closure may stop there.
pub const MAX_DIVISORS: usize = 512;

/// At most this many distinct `d_t` (those of the most elements) are followed; the tensors of
/// the others are dropped (a layout without them stays valid), so the work does not grow with
/// the number of tensors beyond grouping them.
pub const MAX_STEPS: usize = 64;

/// The piece lower bound on `Σ S_b` for any number of buffers (module doc); `None` when the
/// inputs are empty or zero, or the bound passes 64 bits.
pub fn piece_floor(items: &[Item], world: usize, coll: usize) -> Option<usize> {
    if items.is_empty() || world == 0 || coll == 0 {
        return None;
    }
    let v = world as u128;
    let c = coll as u128;
    let groups = step_groups(items);
    let mut best = 0u128;
    for d in divisors(&groups) {
        let mass: u128 = groups.iter().filter(|g| g.0 % d == 0).map(|g| g.1).sum();
        let d = d as u128;
        let bound = (mass.div_ceil(v * d) * d).next_multiple_of(c);
        best = best.max(bound);
    }
    usize::try_from(best).ok()
}

/// Share of the elements whose piece steps give [`main_step`].
pub const MAIN_SHARE: f64 = 0.99;

/// The gcd of `d_t` over the tensors holding [`MAIN_SHARE`] of the elements, the largest
/// groups of equal `d_t` first: the piece most parts of tensors inside a shard are made of.
pub fn main_step(items: &[Item]) -> Option<usize> {
    let groups = step_groups(items);
    let total: u128 = groups.iter().map(|g| g.1).sum();
    let (mut step, mut covered) = (0usize, 0u128);
    for (d, mass) in groups {
        if covered as f64 >= MAIN_SHARE * total as f64 {
            break;
        }
        step = gcd(step, d);
        covered += mass;
    }
    (step > 0).then_some(step)
}

/// `d_t = gcd(e_t, g_t)`: every part of the tensor inside one shard is a multiple of it.
fn piece_step(t: &Item) -> usize {
    gcd(t.numel, t.block).max(1)
}

/// `(d, elements of the tensors with d_t = d)`, the [`MAX_STEPS`] with the most elements.
fn step_groups(items: &[Item]) -> Vec<(usize, u128)> {
    let mut groups: std::collections::HashMap<usize, u128> = std::collections::HashMap::new();
    for t in items {
        *groups.entry(piece_step(t)).or_insert(0) += t.numel as u128;
    }
    let mut groups: Vec<(usize, u128)> = groups.into_iter().collect();
    groups.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    groups.truncate(MAX_STEPS);
    groups
}

/// The distinct `d_t` and the gcds of any of them (up to [`MAX_DIVISORS`]), largest first.
fn divisors(groups: &[(usize, u128)]) -> Vec<usize> {
    let base: Vec<usize> = groups.iter().map(|g| g.0).collect();
    let mut all = base.clone();
    all.sort_unstable();
    // Each pass adds the gcd of a known value with one `d_t`; gcds of any subset appear after
    // at most `base.len()` passes, and a pass that adds nothing ends the closure.
    loop {
        let mut added = Vec::new();
        for &x in &all {
            for &y in &base {
                let g = gcd(x, y);
                if all.binary_search(&g).is_err() && !added.contains(&g) {
                    added.push(g);
                }
            }
        }
        added.truncate(MAX_DIVISORS.saturating_sub(all.len()));
        if added.is_empty() {
            break;
        }
        all.extend(added);
        all.sort_unstable();
    }
    all.reverse();
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_are_the_gcd_closure_of_the_steps() {
        let groups = [(12usize, 1u128), (18, 1), (8, 1)];
        assert_eq!(divisors(&groups), vec![18, 12, 8, 6, 4, 2]);
    }

    #[test]
    fn parts_of_unforced_tensors_round_the_share_up() {
        // Three tensors of 12 elements in blocks of 4 and 6 (parts are multiples of 2) on
        // 4 ranks: 9 elements per rank, so at least 10; the norm-like 1-element tensor is
        // not a multiple of 2 and does not count.
        let items = [
            Item::new(12, 4, 1).unwrap(),
            Item::new(12, 6, 1).unwrap(),
            Item::new(12, 6, 1).unwrap(),
            Item::new(1, 1, 1).unwrap(),
        ];
        assert_eq!(piece_floor(&items, 4, 1), Some(10));
        assert_eq!(piece_floor(&items, 4, 4), Some(12));
        assert_eq!(piece_floor(&[], 4, 1), None);
    }
}
