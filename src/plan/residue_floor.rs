//! The residue floor: a seventh lower bound, on the shard size of **one** buffer, taken with
//! the others by [`super::floor::floor_shard_sum`] for `k = 1`.
//!
//! **Why.** The piece floor ([`super::piece_floor`]) says a shard holds a whole number of
//! pieces `D` of the tensors whose parts are multiples of `D`. When those tensors fill exactly
//! `m` pieces per rank, every shard must hold exactly `m` of them at any `S < (m+1)·D`, and
//! which tensors can end a shard exactly there is a question of residues. In a Qwen3-30B-A3B
//! layer at `rows:128`, `V = 8` (pieces of 32,768; 2,377 per rank) the experts are 48 pieces,
//! so every shard's expert part is a multiple of 48 except the parts of the two tensors that
//! cross its boundaries (a `down_proj` is cut at multiples of 3 pieces, a `gate/up_proj` at
//! multiples of 8); the few attention tensors must fix the rest, and they cannot for all eight
//! shards: no layout has `S < 2,378` pieces.
//!
//! **Proof.** Let `D | gcd(e_t, g_t)` for the tensors `A` (all parts of them inside a shard are
//! multiples of `D`, see the piece floor) with `E_A = V·m·D`, and let every `t ∈ A` have
//! `e_t ≤ m·D`. Take a layout with `m·D ≤ S < (m+1)·D` (below `m·D` the shards cannot hold
//! `A`). Each shard's part of `A` is a multiple of `D` and at most `S`, so at most `m·D`; they
//! sum to `V·m·D`, so each is exactly `m·D`. No tensor of `A` spans two boundaries (`e_t ≤ S`),
//! so shard `r`'s part is the tail of the tensor of `A` crossing its left boundary (if any),
//! the tensors of `A` wholly inside it, and the head of the one crossing its right boundary;
//! a head is a positive multiple of `g_t` below `e_t` (the cut is a block edge) and the tail is
//! the rest of that tensor; the first shard has no tail and the last no head. The *rare*
//! tensors (shapes of at most [`RARE`] tensors, at most [`MAX_RARE`] of them) are followed one
//! by one: each lies whole in one shard or crosses one boundary. The others are relaxed: any
//! number of them may cross boundaries, and the sum of those wholly inside a shard is only
//! required to be a non-negative multiple of `X`, the gcd of their sizes. A search over the
//! shards (the crossing at each boundary, the rare tensors inside each shard) that finds no
//! assignment with every shard at exactly `m` pieces proves that no layout has
//! `S < (m+1)·D`; the real layouts are among the relaxed ones. Then `S ≥ ⌈(m+1)·D⌉_coll`.
//!
//! **Work.** Only for `V ≤ ` [`MAX_RANKS`]; at most [`MAX_OPTIONS`] crossing options per
//! boundary and [`MAX_STATES`] search states; past any limit there is no bound (`None`).

use std::cell::Cell;
use std::collections::HashSet;

use super::fit::gcd;
use super::Item;

/// Shapes of at most this many tensors are followed one tensor at a time.
pub const RARE: usize = 4;

/// At most this many rare tensors (their subsets are enumerated per shard).
pub const MAX_RARE: usize = 8;

/// The search runs only up to this many ranks.
pub const MAX_RANKS: usize = 64;

/// At most this many ways to cross one boundary.
pub const MAX_OPTIONS: usize = 16384;

/// At most this many `(shard, tail, rare tensors used)` states are visited.
pub const MAX_STATES: usize = 1 << 16;

/// At most this many (crossing, rare subset) pairs are tried in all.
pub const MAX_WORK: usize = 1 << 22;

/// The residue lower bound on one buffer's shard size with pieces of `d` elements (module
/// doc), or `None` where it does not apply or the search stops at a limit.
pub fn residue_floor(items: &[Item], world: usize, coll: usize, d: usize) -> Option<usize> {
    if world == 0 || world > MAX_RANKS || coll == 0 || d == 0 {
        return None;
    }
    let a: Vec<&Item> = items
        .iter()
        .filter(|t| gcd(t.numel, t.block) % d == 0)
        .collect();
    let mass: u128 = a.iter().map(|t| t.numel as u128).sum();
    let per_rank = world as u128 * d as u128;
    if a.is_empty() || mass % per_rank != 0 {
        return None;
    }
    let m = usize::try_from(mass / per_rank).ok()?;
    if a.iter().any(|t| t.numel / d > m) {
        return None;
    }
    let search = Search::new(&a, d, m, world)?;
    if search.feasible()? {
        return None;
    }
    let bound = (m as u128 + 1) * d as u128;
    usize::try_from(bound.next_multiple_of(coll as u128)).ok()
}

/// The relaxed problem of the module doc, in pieces.
struct Search {
    /// Pieces per shard.
    m: usize,
    world: usize,
    /// Sizes of the rare tensors, in pieces.
    rare: Vec<usize>,
    /// gcd of the frequent sizes (0: none).
    x: usize,
    /// `(rare tensor crossing or None for a frequent one, head, tail)`.
    options: Vec<(Option<usize>, usize, usize)>,
    /// Pairs tried so far ([`MAX_WORK`]).
    work: Cell<usize>,
}

impl Search {
    fn new(a: &[&Item], d: usize, m: usize, world: usize) -> Option<Self> {
        let mut shapes: Vec<(Item, usize)> = Vec::new();
        for t in a {
            match shapes.iter_mut().find(|s| s.0 == **t) {
                Some(s) => s.1 += 1,
                None => shapes.push((**t, 1)),
            }
        }
        let (mut rare, mut x, mut options) = (Vec::new(), 0usize, Vec::new());
        for (t, n) in &shapes {
            let (e, g) = (t.numel / d, t.block / d);
            let rare_shape = *n <= RARE;
            for _ in 0..if rare_shape { *n } else { 0 } {
                rare.push(e);
            }
            if !rare_shape {
                x = gcd(x, e);
            }
            // Every cut at a block edge strictly inside the tensor.
            let ids: Vec<Option<usize>> = if rare_shape {
                (rare.len() - n..rare.len()).map(Some).collect()
            } else {
                vec![None]
            };
            for id in ids {
                for head in (g..e).step_by(g.max(1)) {
                    options.push((id, head, e - head));
                    if options.len() > MAX_OPTIONS {
                        return None;
                    }
                }
            }
        }
        if rare.len() > MAX_RARE {
            return None;
        }
        Some(Search {
            m,
            world,
            rare,
            x,
            options,
            work: Cell::new(0),
        })
    }

    /// Whether some assignment gives every shard exactly `m` pieces; `None` past the limits.
    fn feasible(&self) -> Option<bool> {
        let mut dead: HashSet<(usize, usize, u32)> = HashSet::new();
        self.shard(0, 0, 0, &mut dead)
    }

    /// The whole-tensor sum left for the frequent shapes fits their relaxation.
    fn fits(&self, w: i128) -> bool {
        w >= 0
            && if self.x == 0 {
                w == 0
            } else {
                w % self.x as i128 == 0
            }
    }

    /// Shard `r` with `tail` pieces from the left and the rare tensors in `used` placed.
    fn shard(
        &self,
        r: usize,
        tail: usize,
        used: u32,
        dead: &mut HashSet<(usize, usize, u32)>,
    ) -> Option<bool> {
        if dead.contains(&(r, tail, used)) {
            return Some(false);
        }
        if dead.len() >= MAX_STATES {
            return None;
        }
        let all = (1u32 << self.rare.len()) - 1;
        let left = self.m as i128 - tail as i128;
        if r + 1 == self.world {
            // The last shard holds every rare tensor not placed yet, and crosses nothing.
            return Some(self.fits(left - self.sum(all & !used) as i128));
        }
        // Nothing of `A` crossing the right boundary, or one of the options.
        let none = std::iter::once((None, 0usize, 0usize));
        for (id, head, next_tail) in none.chain(self.options.iter().copied()) {
            let crossing = match id {
                Some(i) if used & (1 << i) != 0 => continue,
                Some(i) => used | (1 << i),
                None => used,
            };
            // Every subset of the rare tensors still free, placed whole in this shard.
            let free = all & !crossing;
            let mut subset = free;
            loop {
                self.work.set(self.work.get() + 1);
                if self.work.get() > MAX_WORK {
                    return None;
                }
                if self.fits(left - head as i128 - self.sum(subset) as i128)
                    && self.shard(r + 1, next_tail, crossing | subset, dead)?
                {
                    return Some(true);
                }
                if subset == 0 {
                    break;
                }
                subset = (subset - 1) & free;
            }
        }
        dead.insert((r, tail, used));
        Some(false)
    }

    fn sum(&self, set: u32) -> usize {
        (0..self.rare.len())
            .filter(|&i| set & (1 << i) != 0)
            .map(|i| self.rare[i])
            .sum()
    }
}
