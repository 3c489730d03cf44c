//! The two-lattice floor: a sixth lower bound on `Σ S_b`, for any number of buffers, taken with
//! the others by [`super::floor::floor_shard_sum`].
//!
//! **Why.** [`super::step_floor`] sums the sizes of the buffers holding forced tensors to a
//! multiple of the gcd of all their lattices. One tensor with a fine lattice lowers that gcd for
//! everything, although it can only make the buffers that hold it fine. In a DeepSeek-V3 MoE
//! layer at `rows:16`, `V = 4096`, the experts, `q_a_proj` and `o_proj` have lattices that are
//! multiples of 16,384, while `kv_b_proj` (8,192) and `q_b_proj` (24,576) are odd multiples of
//! 8,192. The gcd is 8,192, and 343 of those hold the layer's 2,809,395 elements per rank; but
//! an odd multiple of 8,192 needs a buffer holding `kv_b_proj` or `q_b_proj` without a coarse
//! tensor, and those two fill little of it, so the layer needs 344 (0.31 % padding, against
//! 0.02 %).
//!
//! **Proof.** Fix a threshold `T` and, as in [`super::step_floor`], either some `S_b ≥ T` or
//! every tensor `t` of `F` (the tensors of at least `2(T − 1)` elements) is forced wherever it
//! lies: its buffer's size is a multiple of `ℓ_t = lcm(coll, g_t)`. Pick `D` and split `F` into
//! `F_2`, the tensors with `D | ℓ_t`, and `F_1`, the rest. A buffer holding a tensor of `F_2`
//! has a size that is a multiple of `D`; call their sum `X_2`. A buffer holding tensors of
//! `F_1` and none of `F_2` has a size that is a multiple of every `ℓ_t` of its `F_1` tensors;
//! call their sum `X_1`. Let `c` count, per shape of `F_1`, its tensors in the second kind of
//! buffer, `m(c)` their elements and `ℓ(c)` the gcd of the lattices of the shapes with
//! `c > 0`. Then `X_2` is a multiple of `D` holding the rest of `F`, so
//! `X_2 ≥ ⌈(M_F − m(c))/V⌉_D`, and at least the largest block of `F_2`; `X_1` is a multiple of
//! `ℓ(c)` with `V·X_1 ≥ m(c)`, and at least the largest block among those shapes. Tensors
//! outside `F`, and shapes of `F_1` beyond the [`TRACKED_SHAPES`] largest, are dropped (a
//! layout without them stays valid, so a bound for the rest is one for all). So
//! `Σ S ≥ min(T, min_c (X_2(c) + X_1(c)))`. The counts are searched in boxes, best first, as in
//! [`super::step_floor`]: a box `[lo, hi]` per shape takes `X_2` at `hi` and `X_1` at `lo`, with
//! `ℓ` over the shapes with `hi > 0` (a gcd of more lattices divides it); after [`MAX_BOXES`]
//! boxes the smallest bound left holds. `D` runs over the gcds of the lattices of some of
//! `F`'s shapes, above the gcd of all of them, and the largest bound wins.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::Item;

/// Shapes of `F_1` whose counts are enumerated; the others are dropped.
pub const TRACKED_SHAPES: usize = 4;

/// Boxes of counts evaluated per threshold and `D`.
pub const MAX_BOXES: usize = 64;

/// Candidate `D` per threshold, at most.
pub const MAX_SPLITS: usize = 16;

/// The two-lattice lower bound on `Σ S_b` for any number of buffers (module doc); `None` when
/// the inputs are empty or zero, or a size passes 64 bits.
pub fn lattice_floor(items: &[Item], world: usize, coll: usize) -> Option<usize> {
    if items.is_empty() || world == 0 || coll == 0 {
        return None;
    }
    let shapes = shapes_of(items, coll)?;
    let mut best = 0u128;
    for j in 0..shapes.len() {
        // Shapes of one size belong to the same F: take the bound after the last of them.
        if shapes.get(j + 1).is_some_and(|n| n.numel == shapes[j].numel) {
            continue;
        }
        let threshold = shapes[j].numel / 2 + 1;
        let forced = &shapes[..=j];
        let split = splits(forced)
            .into_iter()
            .map(|d| split_bound(forced, d, world as u128, coll as u128))
            .max()
            .unwrap_or(0);
        best = best.max(threshold.min(split));
    }
    usize::try_from(best).ok()
}

/// Tensors of one `(elements, block)`, with their lattice `lcm(coll, g)`.
#[derive(Clone, Copy, Debug)]
struct Shape {
    numel: u128,
    block: u128,
    lattice: u128,
    count: u128,
}

/// Shapes with their counts, largest tensors first; `None` when a lattice passes 64 bits.
fn shapes_of(items: &[Item], coll: usize) -> Option<Vec<Shape>> {
    let mut shapes: Vec<Shape> = Vec::new();
    for t in items {
        let (numel, block) = (t.numel as u128, t.block as u128);
        match shapes
            .iter_mut()
            .find(|s| s.numel == numel && s.block == block)
        {
            Some(s) => s.count += 1,
            None => {
                let lattice = super::fit::lcm(t.block, coll)? as u128;
                shapes.push(Shape {
                    numel,
                    block,
                    lattice,
                    count: 1,
                });
            }
        }
    }
    shapes.sort_by_key(|s| Reverse(s.numel));
    Some(shapes)
}

/// The candidate `D`: gcds of the lattices of some shapes, larger than the gcd of all of them
/// (at most [`MAX_SPLITS`], coarsest first).
fn splits(forced: &[Shape]) -> Vec<u128> {
    let base: Vec<u128> = forced.iter().map(|s| s.lattice).collect();
    let all_gcd = base.iter().fold(0u128, |a, &l| gcd_u128(a, l));
    let mut found: Vec<u128> = base.clone();
    found.sort_unstable();
    found.dedup();
    // Gcds with one more lattice until nothing new appears (or the cap is reached).
    loop {
        let mut added = Vec::new();
        for &x in &found {
            for &y in &base {
                let g = gcd_u128(x, y);
                if !found.contains(&g) && !added.contains(&g) {
                    added.push(g);
                }
            }
        }
        added.truncate((4 * MAX_SPLITS).saturating_sub(found.len()));
        if added.is_empty() {
            break;
        }
        found.extend(added);
    }
    found.retain(|&d| d > all_gcd);
    found.sort_unstable_by_key(|&d| Reverse(d));
    found.dedup();
    found.truncate(MAX_SPLITS);
    found
}

/// `min_c (X_2(c) + X_1(c))` of the module doc for one `D`, or a lower bound of it.
fn split_bound(forced: &[Shape], d: u128, v: u128, c: u128) -> u128 {
    let (coarse, mut fine): (Vec<Shape>, Vec<Shape>) =
        forced.iter().partition(|s| s.lattice % d == 0);
    fine.sort_by_key(|s| Reverse(s.numel * s.count));
    fine.truncate(TRACKED_SHAPES);
    let mass: u128 = coarse
        .iter()
        .chain(&fine)
        .map(|s| s.numel * s.count)
        .sum();
    let coarse_block = coarse.iter().map(|s| s.block).max().unwrap_or(0);
    let coarse_floor = coarse_block.next_multiple_of(c).next_multiple_of(d);
    let bound_of = |b: &[(u128, u128)]| -> u128 {
        let moved_most: u128 = fine.iter().zip(b).map(|(s, &(_, hi))| s.numel * hi).sum();
        let x2 = (mass - moved_most)
            .div_ceil(v)
            .next_multiple_of(d)
            .max(coarse_floor);
        let moved_least: u128 = fine.iter().zip(b).map(|(s, &(lo, _))| s.numel * lo).sum();
        let x1 = if moved_least == 0 {
            0
        } else {
            let step = fine
                .iter()
                .zip(b)
                .filter(|(_, &(_, hi))| hi > 0)
                .fold(0u128, |a, (s, _)| gcd_u128(a, s.lattice));
            let block = fine
                .iter()
                .zip(b)
                .filter(|(_, &(lo, _))| lo > 0)
                .map(|(s, _)| s.block.next_multiple_of(c))
                .max()
                .unwrap_or(0);
            moved_least.div_ceil(v).next_multiple_of(step).max(block)
        };
        x2 + x1
    };
    let whole: Vec<(u128, u128)> = fine.iter().map(|s| (0, s.count)).collect();
    let mut heap = BinaryHeap::new();
    heap.push(Reverse((bound_of(&whole), whole)));
    let mut evaluated = 1usize;
    while let Some(Reverse((bound, b))) = heap.pop() {
        let widest = (0..b.len()).max_by_key(|&i| b[i].1 - b[i].0);
        let Some(i) = widest.filter(|&i| b[i].1 > b[i].0) else {
            return bound; // a single count vector: the smallest value of all
        };
        if evaluated >= MAX_BOXES {
            return bound; // every box left bounds at least this
        }
        let mid = b[i].0 + (b[i].1 - b[i].0) / 2;
        for half in [(b[i].0, mid), (mid + 1, b[i].1)] {
            let mut next = b.clone();
            next[i] = half;
            heap.push(Reverse((bound_of(&next), next)));
            evaluated += 1;
        }
    }
    0
}

fn gcd_u128(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_are_gcds_above_the_common_one() {
        let shape = |lattice| Shape {
            numel: 1,
            block: 1,
            lattice,
            count: 1,
        };
        let forced = [shape(12), shape(18), shape(8)];
        // gcds: 12, 18, 8, 6, 4, 2 (all); above 2: 18, 12, 8, 6, 4.
        assert_eq!(splits(&forced), vec![18, 12, 8, 6, 4]);
    }
}
