//! The k-buffer floor: a lower bound on `Σ S_b` over every partition of a unit into at most
//! `k` collective buffers and every layout of each (used by [`super::multi`]).
//!
//! **Proof.** For one buffer the bound is [`super::search::any_order_lower_bound`]. For
//! `k' ≥ 2` buffers, sort them by their largest block, `G_1 ≥ … ≥ G_k'`; `G_1` is the largest
//! block of all and every `G_i` is one of the block sizes. Buffer `i` then needs:
//! 1. `S_i ≥ ⌈G_i⌉_coll`: a block fits in one shard, and `S` is a multiple of `coll`;
//! 2. a lattice: buffer `i` holds a tensor `t` with block `G_i`, of at least `e_min(G_i)`
//!    elements (the smallest tensor with that block). If `2·S_i ≤ e_min(G_i) ≤ e_t`, `t`
//!    contains a whole shard, so `G_i | S_i` (planner.md §2): below `e_min/2 + 1`, `S_i` is a
//!    multiple of `lcm(G_i, coll)`;
//! 3. capacity: a tensor whose block exceeds `G_{i+1}` can only be in buffers `1..=i`, so
//!    `V·Σ_{j≤i} S_j ≥ M_i`, the elements of those tensors; and `V·Σ_j S_j ≥ E`.
//!
//! The floor is the smallest `Σ S` meeting 1–3 over every non-increasing choice of
//! `G_2..G_k'` and every `k' ≤ k`, and the one-buffer bound. For a fixed choice, the sizes are
//! searched buffer by buffer in increasing order and pruned by the best sum found; after
//! [`SIZES_PER_BUFFER`] sizes of one buffer, every larger size is covered at once by the bound
//! without the lattice (condition 2 dropped), so the result stays a lower bound. With more than
//! [`FLOOR_RANGES`] distinct block sizes, `G_i` is only known to lie in a range `[lo, hi]`:
//! condition 1 uses `lo`, condition 3 the tensors with blocks above `hi`, and condition 2 is
//! dropped, which only lowers the bound. Shapes of more than [`FLOOR_MAX_BUFFERS`] buffers are
//! not enumerated; for a larger `k`, `max(⌈G_1⌉_coll, ⌈⌈E/V⌉⌉_coll)`, true for any number of
//! buffers, is taken as well.
//!
//! The result is the largest of this bound, [`super::heavy_floor`]'s, which places the unit's
//! largest tensors one by one, [`super::class_floor`]'s, which follows the tensors of each
//! large shape together, and [`super::step_floor`]'s, which uses that the sizes of buffers
//! holding forced tensors sum to a multiple of their lattices' gcd (of their lcm where `k`
//! leaves them one buffer),
//! [`super::lattice_floor`]'s, which splits those tensors into a coarse and a fine lattice, and
//! [`super::piece_floor`]'s, which uses that the part of a tensor inside one shard is a
//! multiple of `gcd(e, g)`, and, for `k = 1`, [`super::residue_floor`]'s, which follows the
//! residues of those parts when every shard must hold exactly `m` pieces, and, for `k = 1`,
//! [`super::excess_floor`]'s, which counts the shards that tensors whose parts are not
//! multiples of a step can reach past it; all eight hold for every layout. (A ninth, for
//! `k = 1`, [`super::waste_floor`], is searched only above this one and below a plan, by
//! [`super::multi`]; so is an eleventh, for `k ≤ 2`, [`super::pair_floor`], which excludes
//! the sums between this one and a plan one by one over every split between two buffers.)

use super::fit::gcd_u128;
use super::Item;
use crate::{Error, Result};

/// Distinct block sizes beyond this are merged into this many ranges.
pub const FLOOR_RANGES: usize = 64;

/// Shapes of at most this many buffers are enumerated (`C(64 + 2, 3)` choices at most).
pub const FLOOR_MAX_BUFFERS: usize = 4;

/// Shard sizes of one buffer searched one by one before the lattice-free bound takes over.
pub const SIZES_PER_BUFFER: usize = 16;

/// A lower bound on `Σ S_b` for any partition of `items` into at most `k` buffers, each laid
/// out in any order (sizes multiples of `coll`); see the module doc for the proof.
pub fn floor_shard_sum(items: &[Item], world: usize, coll: usize, k: usize) -> Result<usize> {
    if items.is_empty() || world == 0 || coll == 0 || k == 0 {
        return Err(Error::BadInput {
            op: "floor_shard_sum",
            what: format!("{} tensors, V = {world}, coll {coll}, k = {k}", items.len()),
            reason: "needs tensors, ranks, a collective alignment and a buffer".into(),
        });
    }
    let one = super::search::any_order_lower_bound(items, world, coll)?;
    let c = coll as u128;
    let v = world as u128;
    let total: u128 = items.iter().map(|t| t.numel as u128).sum();
    let largest = items.iter().map(|t| t.block).max().unwrap_or(1);
    let mut best = one as u128;
    if k > FLOOR_MAX_BUFFERS {
        best = best.min(round(largest as u128, c).max(data_bound(items, world, coll)));
    }
    let ranges = block_ranges(items);
    let first = Need::exact(largest, smallest_with_block(items, largest), c);
    // A shape: each buffer's need and the elements that must sit in the buffers before it.
    let mut stack = vec![(vec![(first, 0u128)], 0usize)];
    while let Some((shape, last)) = stack.pop() {
        if shape.len() >= 2 {
            best = best.min(min_shard_sum(&shape, total.div_ceil(v), c, best));
        }
        if shape.len() == k.min(FLOOR_MAX_BUFFERS) {
            continue;
        }
        for (r, range) in ranges.iter().enumerate().skip(last) {
            let mut next = shape.clone();
            next.push((range.need(c), range.mass_above.div_ceil(v)));
            stack.push((next, r));
        }
    }
    // Every bound holds for every layout, so the largest one does.
    if let Some(heavy) = super::heavy_floor::heavy_floor(items, world, coll, k) {
        best = best.max(heavy as u128);
    }
    if let Some(classes) = super::class_floor::class_floor(items, world, coll, k) {
        best = best.max(classes as u128);
    }
    if let Some(step) = super::step_floor::step_floor_k(items, world, coll, k) {
        best = best.max(step as u128);
    }
    if let Some(pieces) = super::piece_floor::piece_floor(items, world, coll) {
        best = best.max(pieces as u128);
    }
    if let Some(lattices) = super::lattice_floor::lattice_floor(items, world, coll) {
        best = best.max(lattices as u128);
    }
    // The residue floor bounds one buffer only.
    let residue = super::piece_floor::main_step(items)
        .filter(|_| k == 1)
        .and_then(|d| super::residue_floor::residue_floor(items, world, coll, d));
    if let Some(residue) = residue {
        best = best.max(residue as u128);
    }
    // The excess floor bounds one buffer only, and starts from the bound so far.
    if k == 1 {
        let start = usize::try_from(best).unwrap_or(usize::MAX);
        if let Some(excess) = super::excess_floor::excess_floor(items, world, coll, start)? {
            best = best.max(excess as u128);
        }
    }
    usize::try_from(best).map_err(|_| Error::BadInput {
        op: "floor_shard_sum",
        what: format!("{} tensors", items.len()),
        reason: "the floor overflows a 64-bit element count".into(),
    })
}

/// The bound no layout of `items` beats, with any number of buffers: their elements per rank,
/// rounded up to the collective alignment `coll` (each buffer's `S` is a multiple of it).
pub fn data_bound(items: &[Item], world: usize, coll: usize) -> u128 {
    let total: u128 = items.iter().map(|t| t.numel as u128).sum();
    round(total.div_ceil(world as u128), coll as u128)
}

fn round(x: u128, c: u128) -> u128 {
    x.next_multiple_of(c)
}

/// What one buffer's shard size must satisfy (conditions 1 and 2 of the module doc).
#[derive(Clone, Copy, Debug)]
struct Need {
    /// `⌈G⌉_coll`.
    min: u128,
    /// Below `free_from`, sizes are multiples of `lattice`.
    lattice: u128,
    /// `⌈e_min/2 + 1⌉_coll` (0: no lattice).
    free_from: u128,
}

impl Need {
    fn exact(block: usize, min_numel: usize, c: u128) -> Self {
        let g = block as u128;
        Need {
            min: round(g, c),
            lattice: g / gcd_u128(g, c) * c,
            free_from: round(min_numel as u128 / 2 + 1, c),
        }
    }

    fn plain(block: usize, c: u128) -> Self {
        Need {
            min: round(block as u128, c),
            lattice: c,
            free_from: 0,
        }
    }

    /// The smallest allowed size `≥ x`.
    fn next(&self, x: u128, c: u128) -> u128 {
        let up = round(x.max(self.min), c);
        if up >= self.free_from {
            up
        } else {
            round(up, self.lattice).min(self.free_from)
        }
    }
}

/// The smallest `Σ S` of one shape (`(need, elements before)` per buffer) with every prefix
/// holding the elements that must precede the next buffer and all `V·Σ S ≥ E`; `best` prunes.
fn min_shard_sum(shape: &[(Need, u128)], share: u128, c: u128, best: u128) -> u128 {
    let n = shape.len();
    // required[i]: Σ_{j≤i} S_j must reach it (elements ahead of buffer i + 1, or all of them).
    let required: Vec<u128> = (0..n)
        .map(|i| shape.get(i + 1).map_or(share, |&(_, before)| before))
        .collect();
    // rest[i]: the least the buffers from i on can add.
    let mut rest = vec![0u128; n + 1];
    for i in (0..n).rev() {
        rest[i] = rest[i + 1] + shape[i].0.next(0, c);
    }
    let mut best = best;
    search(shape, &required, &rest, 0, 0, round(share, c), c, &mut best);
    best
}

#[allow(clippy::too_many_arguments)]
fn search(
    shape: &[(Need, u128)],
    required: &[u128],
    rest: &[u128],
    i: usize,
    prefix: u128,
    final_floor: u128,
    c: u128,
    best: &mut u128,
) {
    if i == shape.len() {
        *best = (*best).min(prefix);
        return;
    }
    let need = shape[i].0;
    let mut s = need.next(required[i].saturating_sub(prefix), c);
    for _ in 0..SIZES_PER_BUFFER {
        if prefix + s + rest[i + 1] >= *best {
            return;
        }
        search(
            shape,
            required,
            rest,
            i + 1,
            prefix + s,
            final_floor,
            c,
            best,
        );
        s = need.next(s + 1, c);
    }
    // Every larger size of this buffer, at once, without the lattice.
    let bound = (prefix + s + rest[i + 1]).max(final_floor);
    *best = (*best).min(bound);
}

/// Elements of the smallest tensor whose block is `block`.
fn smallest_with_block(items: &[Item], block: usize) -> usize {
    items
        .iter()
        .filter(|t| t.block == block)
        .map(|t| t.numel)
        .min()
        .unwrap_or(block)
}

/// A range of distinct block sizes.
struct BlockRange {
    lo: usize,
    hi: usize,
    /// Elements of the tensors whose block is larger than `hi`.
    mass_above: u128,
    /// Elements of the smallest tensor with block `lo` (used only when `lo == hi`).
    min_numel: usize,
}

impl BlockRange {
    fn need(&self, c: u128) -> Need {
        if self.lo == self.hi {
            Need::exact(self.lo, self.min_numel, c)
        } else {
            Need::plain(self.lo, c)
        }
    }
}

/// The distinct block sizes, largest first, in at most [`FLOOR_RANGES`] ranges.
fn block_ranges(items: &[Item]) -> Vec<BlockRange> {
    let mut by_block: Vec<(usize, usize)> = items.iter().map(|t| (t.block, t.numel)).collect();
    by_block.sort_unstable_by_key(|b| std::cmp::Reverse(b.0));
    // (size, elements of tensors with a larger block, smallest tensor), one per distinct size.
    let mut distinct: Vec<(usize, u128, usize)> = Vec::new();
    let mut mass = 0u128;
    for &(g, e) in &by_block {
        match distinct.last_mut() {
            Some(d) if d.0 == g => d.2 = d.2.min(e),
            _ => distinct.push((g, mass, e)),
        }
        mass += e as u128;
    }
    let per_range = distinct.len().div_ceil(FLOOR_RANGES);
    distinct
        .chunks(per_range)
        .map(|chunk| BlockRange {
            lo: chunk[chunk.len() - 1].0,
            hi: chunk[0].0,
            mass_above: chunk[0].1,
            min_numel: chunk[chunk.len() - 1].2,
        })
        .collect()
}
