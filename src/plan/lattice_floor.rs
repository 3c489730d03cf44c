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
//! `F_2`, the tensors with `D | ℓ_t`, and `F_1`, the rest; call the tensors outside `F` free.
//! Three kinds of buffers partition the layout's:
//! - those holding a tensor of `F_2`: each a multiple of `D`; their sum `X_2`;
//! - those holding tensors of `F_1` and none of `F_2`: each a multiple of every `ℓ_t` of its
//!   `F_1` tensors; their sum `X_1`;
//! - those holding no tensor of `F`: their sum `Y`.
//!
//! Let `c` count, per shape of `F_1`, its tensors in the second kind, and per free shape its
//! tensors in the second and in the third kind; `ℓ(c)` is the gcd of the lattices of the `F_1`
//! shapes present in the second kind. Then `X_2` is a multiple of `D` holding every tensor not
//! counted, so `X_2 ≥ ⌈m_2(c)/V⌉_D`, and at least the largest block of `F_2`; `X_1` is a
//! multiple of `ℓ(c)` with `V·X_1 ≥ m_1(c)`, and at least the largest block it holds (zero
//! when it holds nothing, and free tensors need an `F_1` tensor to be there); `Y` is a
//! multiple of `coll` with `V·Y ≥ m_Y(c)`, and at least the largest block it holds; and for
//! each size `e_j` of its tensors, either one of its buffers reaches `⌊e_j/2⌋ + 1`, or its
//! tensors of at least `e_j` elements are forced there, so the buffers holding them are a
//! multiple of their lattices' gcd, and the rest of `Y`'s tensors join them or add a buffer of
//! at least the smallest of their blocks (`k_proj` and `v_proj` of a Mixtral layer at `rows:1`,
//! V = 256, not forced next to the experts but forced in a buffer of their own). Also
//! `X_2 + X_1` is a multiple of `gcd(D, ℓ(c))` holding everything but `Y`'s tensors. Shapes of
//! `F_1` beyond the [`TRACKED_SHAPES`] largest and free shapes beyond the [`TRACKED_FREE`]
//! largest are dropped (a layout without them stays valid, so a bound for the rest is one for
//! all). So `Σ S ≥ min(T, min_c (X_2(c) + X_1(c) + Y(c)))`. The counts are searched in boxes,
//! best first, as in [`super::step_floor`] (split along the narrowest open range, which closes
//! the free shapes' few counts first): a box of ranges takes each mass where it is least
//! and each lattice gcd over every shape that may be present (a gcd of more lattices divides
//! it), so its value bounds every count vector in it; boxes that hold none (more free tensors
//! in the second and third kinds than there are) are dropped, and after [`MAX_BOXES`] boxes
//! the smallest bound left holds. `D` runs over the gcds of some of the [`SPLIT_BASE`]
//! lattices of `F` with the most elements, above the gcd of all of them; thresholds run from
//! the largest down, at most [`MAX_THRESHOLDS`], until one is no larger than the best bound so
//! far (every bound is at most its threshold); the largest bound wins.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::fit::gcd_u128;
use super::Item;

/// Shapes of `F_1` whose counts are enumerated; the others are dropped.
pub const TRACKED_SHAPES: usize = 4;

/// Shapes outside `F` (the most elements first) whose counts are enumerated; the others are
/// dropped.
pub const TRACKED_FREE: usize = 3;

/// Boxes of counts evaluated per threshold and `D`.
pub const MAX_BOXES: usize = 1024;

/// Thresholds evaluated, at most (the largest first; any of them gives a valid bound).
pub const MAX_THRESHOLDS: usize = 16;

/// Distinct lattices (of the most elements) whose gcds are candidate `D`.
pub const SPLIT_BASE: usize = 32;

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
    let mut thresholds = 0;
    for j in 0..shapes.len() {
        // Shapes of one size belong to the same F: take the bound after the last of them.
        if shapes
            .get(j + 1)
            .is_some_and(|n| n.numel == shapes[j].numel)
        {
            continue;
        }
        // Thresholds fall with j and a bound is at most its threshold: the rest cannot win.
        let threshold = shapes[j].numel / 2 + 1;
        if threshold <= best || thresholds == MAX_THRESHOLDS {
            break;
        }
        thresholds += 1;
        let (forced, free) = shapes.split_at(j + 1);
        let split = splits(forced)
            .into_iter()
            .map(|d| split_bound(forced, free, d, world as u128, coll as u128))
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
    let mut counts: std::collections::HashMap<(usize, usize), u128> =
        std::collections::HashMap::new();
    for t in items {
        *counts.entry((t.numel, t.block)).or_insert(0) += 1;
    }
    let mut shapes = counts
        .into_iter()
        .map(|((numel, block), count)| {
            Some(Shape {
                numel: numel as u128,
                block: block as u128,
                lattice: super::fit::lcm(block, coll)? as u128,
                count,
            })
        })
        .collect::<Option<Vec<Shape>>>()?;
    // Largest tensors first; the rest of the order only makes the result deterministic.
    shapes.sort_by_key(|s| (Reverse(s.numel), s.block));
    Some(shapes)
}

/// The candidate `D`: gcds of the lattices of some shapes, larger than the gcd of all of them
/// (at most [`MAX_SPLITS`], coarsest first).
fn splits(forced: &[Shape]) -> Vec<u128> {
    let all_gcd = forced.iter().fold(0u128, |a, s| gcd_u128(a, s.lattice));
    let mut by_mass: Vec<&Shape> = forced.iter().collect();
    by_mass.sort_by_key(|s| Reverse(s.numel * s.count));
    let mut base: Vec<u128> = Vec::new();
    for s in by_mass {
        if !base.contains(&s.lattice) && base.len() < SPLIT_BASE {
            base.push(s.lattice);
        }
    }
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

/// `min (X_2 + X_1 + Y)` of the module doc for one `D`, or a lower bound of it: `forced` are
/// the shapes of `F`, `free` the others.
fn split_bound(forced: &[Shape], free: &[Shape], d: u128, v: u128, c: u128) -> u128 {
    let (coarse, mut fine): (Vec<Shape>, Vec<Shape>) =
        forced.iter().partition(|s| s.lattice % d == 0);
    fine.sort_by_key(|s| Reverse(s.numel * s.count));
    fine.truncate(TRACKED_SHAPES);
    let mut free = free.to_vec();
    free.sort_by_key(|s| Reverse(s.numel * s.count));
    free.truncate(TRACKED_FREE);
    let coarse_mass: u128 = coarse.iter().map(|s| s.numel * s.count).sum();
    let coarse_block = coarse.iter().map(|s| s.block).max().unwrap_or(0);
    let split = Split {
        fine: &fine,
        free: &free,
        coarse_mass,
        coarse_floor: coarse_block.next_multiple_of(c).next_multiple_of(d),
        d,
        v,
        c,
    };
    // One range per fine shape (its count in X_1), two per free shape (in X_1, in Y).
    let whole: Vec<(u128, u128)> = fine
        .iter()
        .map(|s| (0, s.count))
        .chain(free.iter().flat_map(|s| [(0, s.count), (0, s.count)]))
        .collect();
    let Some(first) = split.bound_of(&whole) else {
        return 0;
    };
    let mut heap = BinaryHeap::new();
    heap.push(Reverse((first, whole)));
    let mut evaluated = 1usize;
    while let Some(Reverse((bound, b))) = heap.pop() {
        // The narrowest open range first: the free shapes' few tensors decide which kind of
        // buffer pays a step, and their ranges close in one or two splits.
        let narrowest = (0..b.len())
            .filter(|&i| b[i].1 > b[i].0)
            .min_by_key(|&i| b[i].1 - b[i].0);
        let Some(i) = narrowest else {
            return bound; // a single count vector: the smallest value of all
        };
        if evaluated >= MAX_BOXES {
            return bound; // every box left bounds at least this
        }
        let mid = b[i].0 + (b[i].1 - b[i].0) / 2;
        for half in [(b[i].0, mid), (mid + 1, b[i].1)] {
            let mut next = b.clone();
            next[i] = half;
            if let Some(x) = split.bound_of(&next) {
                heap.push(Reverse((x, next)));
            }
            evaluated += 1;
        }
    }
    // Every count vector with everything in X_2 is a box left; not reached.
    0
}

/// One `D`'s classes: what [`Split::bound_of`] needs.
struct Split<'a> {
    fine: &'a [Shape],
    free: &'a [Shape],
    coarse_mass: u128,
    /// The largest block of `F_2`, rounded to `coll` and `D`.
    coarse_floor: u128,
    d: u128,
    v: u128,
    c: u128,
}

impl Split<'_> {
    /// The least `X_2 + X_1 + Y` over the count vectors of the box `b` (ranges of the fine
    /// shapes' counts in X_1, then of each free shape's counts in X_1 and in Y); `None` when no
    /// layout has counts in it.
    fn bound_of(&self, b: &[(u128, u128)]) -> Option<u128> {
        let (fine_b, free_b) = b.split_at(self.fine.len());
        let pairs: Vec<((u128, u128), (u128, u128))> =
            free_b.chunks(2).map(|p| (p[0], p[1])).collect();
        // A free shape cannot have more tensors in X_1 and Y than it has.
        if self
            .free
            .iter()
            .zip(&pairs)
            .any(|(s, (x1, y))| x1.0 + y.0 > s.count)
        {
            return None;
        }
        // Without a fine tensor in X_1 there is no X_1 buffer for free tensors.
        let fine_possible = fine_b.iter().any(|r| r.1 > 0);
        if !fine_possible && pairs.iter().any(|(x1, _)| x1.0 > 0) {
            return None;
        }
        // X_2 holds the rest: least when the most moved out.
        let kept_fine: u128 = self
            .fine
            .iter()
            .zip(fine_b)
            .map(|(s, r)| s.numel * (s.count - r.1))
            .sum();
        let kept_free: u128 = self
            .free
            .iter()
            .zip(&pairs)
            .map(|(s, (x1, y))| s.numel * s.count.saturating_sub(x1.1 + y.1))
            .sum();
        let x2 = (self.coarse_mass + kept_fine + kept_free)
            .div_ceil(self.v)
            .next_multiple_of(self.d)
            .max(self.coarse_floor);
        let x1_mass: u128 = self
            .fine
            .iter()
            .zip(fine_b)
            .map(|(s, r)| s.numel * r.0)
            .sum::<u128>()
            + self
                .free
                .iter()
                .zip(&pairs)
                .map(|(s, (x1, _))| s.numel * x1.0)
                .sum::<u128>();
        let x1 = if x1_mass == 0 {
            0
        } else {
            // Each X_1 buffer is a multiple of a fine lattice present there.
            let step = self
                .fine
                .iter()
                .zip(fine_b)
                .filter(|(_, r)| r.1 > 0)
                .fold(0u128, |a, (s, _)| gcd_u128(a, s.lattice));
            let fine_blocks = self.fine.iter().zip(fine_b).filter(|(_, r)| r.0 > 0);
            let free_blocks = self.free.iter().zip(&pairs).filter(|(_, (x1, _))| x1.0 > 0);
            let block = fine_blocks
                .map(|(s, _)| s.block)
                .chain(free_blocks.map(|(s, _)| s.block))
                .max()
                .unwrap_or(0);
            x1_mass
                .div_ceil(self.v)
                .next_multiple_of(step)
                .max(block.next_multiple_of(self.c))
        };
        let alone: Vec<(Shape, u128)> = self
            .free
            .iter()
            .zip(&pairs)
            .filter(|(_, (_, y))| y.0 > 0)
            .map(|(s, (_, y))| (*s, y.0))
            .collect();
        let y = own_buffers_bound(&alone, self.v, self.c);
        // Every point of the box has X_2 + X_1 a multiple of gcd(D, step) holding all but the
        // most Y can take: this is what bounds a wide box.
        let step_all = self
            .fine
            .iter()
            .zip(fine_b)
            .filter(|(_, r)| r.1 > 0)
            .fold(self.d, |a, (s, _)| gcd_u128(a, s.lattice));
        let y_most: u128 = self
            .free
            .iter()
            .zip(&pairs)
            .map(|(s, (_, y))| s.numel * y.1.min(s.count))
            .sum();
        let all = self.coarse_mass
            + self.fine.iter().map(|s| s.numel * s.count).sum::<u128>()
            + self.free.iter().map(|s| s.numel * s.count).sum::<u128>();
        let together = (all - y_most).div_ceil(self.v).next_multiple_of(step_all);
        Some((x2 + x1).max(together) + y)
    }
}

/// A lower bound on the sizes of buffers holding no tensor of `F`, which hold `count` tensors of
/// each shape (largest first after sorting): they hold the elements and the largest block;
/// and for each size `e_j` of theirs, either one of them reaches `⌊e_j/2⌋ + 1` or the tensors
/// of at least `e_j` elements are forced there, so the buffers holding them sum to a multiple
/// `x` of their lattices' gcd with `V·x` holding them, and the other tensors either join those
/// buffers or add a buffer of at least the smallest of their blocks.
fn own_buffers_bound(alone: &[(Shape, u128)], v: u128, c: u128) -> u128 {
    if alone.is_empty() {
        return 0;
    }
    let mut sorted = alone.to_vec();
    sorted.sort_by_key(|(s, _)| Reverse(s.numel));
    let mass: u128 = sorted.iter().map(|(s, n)| s.numel * n).sum();
    let block = sorted.iter().map(|(s, _)| s.block).max().unwrap_or(0);
    let mut best = mass.div_ceil(v).max(block).next_multiple_of(c);
    let (mut forced_mass, mut step) = (0u128, 0u128);
    for (j, (s, n)) in sorted.iter().enumerate() {
        forced_mass += s.numel * n;
        step = gcd_u128(step, s.lattice);
        if sorted
            .get(j + 1)
            .is_some_and(|(next, _)| next.numel == s.numel)
        {
            continue;
        }
        let forced = forced_mass.div_ceil(v).next_multiple_of(step);
        let rest = &sorted[j + 1..];
        let with_rest = match rest.iter().map(|(r, _)| r.block).min() {
            None => forced,
            Some(smallest) => {
                (mass.div_ceil(v).next_multiple_of(step)).min(forced + smallest.next_multiple_of(c))
            }
        };
        best = best.max((s.numel / 2 + 1).min(with_rest));
    }
    best
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
