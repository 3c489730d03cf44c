//! The heavy-tensor floor: a second lower bound on `Σ S_b` over every partition of a unit into
//! at most `k` buffers, which places the unit's largest tensors one by one (used by
//! [`super::floor::floor_shard_sum`], which takes the larger of the two bounds).
//!
//! **Why.** The block-size floor of [`super::floor`] treats a buffer's elements as divisible and
//! knows a block's lattice only through the smallest tensor with that block, so one small
//! tensor sharing a block with a huge one (a router next to the experts' `down_proj`) hides the
//! huge one's lattice. Whole large tensors are what make the padding; this bound follows them.
//!
//! **Proof.** Let `H` be the [`HEAVY_TENSORS`] largest tensors. Any layout with at most `k`
//! buffers assigns each tensor of `H` to one buffer; group the buffers by the tensors of `H`
//! they hold (at most `k` non-empty groups `H_b`, the other buffers hold none of `H`). Buffer `b`
//! holding `H_b` satisfies, whatever else it holds:
//! 1. `S_b ≥ ⌈g_t⌉_coll` for `t ∈ H_b` (a block fits in one shard), and `V·S_b ≥ Σ_{H_b} e_t`;
//! 2. `g_t | S_b` for every `t ∈ H_b` with `e_t ≥ 2·S_b` (planner.md §2), and `coll | S_b`:
//!    `S_b` is a size that [`ForcedLattice`] of `H_b` accepts;
//! 3. all buffers together hold every tensor: `V·Σ_b S_b ≥ E`.
//!
//! So `Σ S_b` is at least the smallest sum meeting 1–3 for that assignment, and the floor is the
//! smallest over every assignment of `H` to at most `k` groups (restricted growth strings). A
//! buffer that holds none of `H` has no condition but `S ≥ 0`, so when fewer than `k` groups
//! are used the sum is `max(Σ_b min_b, ⌈E/V⌉_coll)`. Otherwise the sizes are searched buffer by
//! buffer from each one's smallest allowed size; after [`SIZES_PER_BUFFER`] sizes of one buffer,
//! every larger size of it is covered at once by the bound that drops its lattice, so the
//! result stays a lower bound. Every sum is checked; an assignment whose sizes overflow has no
//! layout and is skipped.

use super::search::ForcedLattice;
use super::Item;

/// The largest tensors placed one by one (`Σ_{j≤3} S(8, j) = 1,094` assignments for `k = 3`).
pub const HEAVY_TENSORS: usize = 8;

/// Sizes of one buffer searched one by one before the lattice-free bound takes over.
pub const SIZES_PER_BUFFER: usize = 12;

/// The heavy-tensor lower bound on `Σ S_b` for at most `k` buffers (module doc); `None` when
/// the unit's sizes overflow (the caller keeps its other bound).
pub fn heavy_floor(items: &[Item], world: usize, coll: usize, k: usize) -> Option<usize> {
    heavy_floor_of(items, world, coll, k, HEAVY_TENSORS)
}

/// [`heavy_floor`] with the `heavy` largest tensors placed one by one (a lower bound for any
/// `heavy ≥ 1`; tests use small counts to check the tensors left out).
pub fn heavy_floor_of(
    items: &[Item],
    world: usize,
    coll: usize,
    k: usize,
    heavy: usize,
) -> Option<usize> {
    if items.is_empty() || world == 0 || coll == 0 || k == 0 || heavy == 0 {
        return None;
    }
    let total = items
        .iter()
        .try_fold(0usize, |acc, t| acc.checked_add(t.numel))?;
    let share = total.div_ceil(world).checked_next_multiple_of(coll)?;
    let heavy_count = heavy;
    let mut heavy: Vec<Item> = items.to_vec();
    heavy.sort_by(|a, b| b.numel.cmp(&a.numel).then(a.block.cmp(&b.block)));
    heavy.truncate(heavy_count);
    let mut walk = Walk {
        heavy: &heavy,
        world,
        coll,
        k,
        share,
        groups: Vec::new(),
        best: None,
    };
    walk.go(0);
    walk.best
}

struct Walk<'a> {
    heavy: &'a [Item],
    world: usize,
    coll: usize,
    k: usize,
    share: usize,
    /// The tensors of `H` in each group so far.
    groups: Vec<Vec<Item>>,
    best: Option<usize>,
}

impl Walk<'_> {
    fn go(&mut self, i: usize) {
        if i == self.heavy.len() {
            if let Some(sum) = self.assignment_floor() {
                self.best = Some(self.best.map_or(sum, |b| b.min(sum)));
            }
            return;
        }
        let t = self.heavy[i];
        for g in 0..self.groups.len() {
            self.groups[g].push(t);
            self.go(i + 1);
            self.groups[g].pop();
        }
        if self.groups.len() < self.k {
            self.groups.push(vec![t]);
            self.go(i + 1);
            self.groups.pop();
        }
    }

    /// The smallest `Σ S_b` meeting conditions 1–3 for the current assignment.
    fn assignment_floor(&self) -> Option<usize> {
        let buffers: Vec<Buffer> = self
            .groups
            .iter()
            .map(|g| Buffer::new(g, self.world, self.coll))
            .collect::<Option<_>>()?;
        let least = buffers
            .iter()
            .try_fold(0usize, |acc, b| acc.checked_add(b.min))?;
        if self.groups.len() < self.k || least >= self.share {
            // A buffer without heavy tensors (or the minimal sizes already) covers the rest.
            return Some(least.max(self.share));
        }
        let mut rest = vec![0usize; buffers.len() + 1];
        for b in (0..buffers.len()).rev() {
            rest[b] = rest[b + 1] + buffers[b].min;
        }
        let mut best = None;
        search(&buffers, &rest, self.share, 0, 0, &mut best);
        best
    }
}

/// One group's conditions 1 and 2.
struct Buffer {
    lattice: ForcedLattice,
    /// The smallest allowed size.
    min: usize,
}

impl Buffer {
    fn new(group: &[Item], world: usize, coll: usize) -> Option<Self> {
        let elems = group
            .iter()
            .try_fold(0usize, |acc, t| acc.checked_add(t.numel))?;
        let largest = group.iter().map(|t| t.block).max().unwrap_or(1);
        let lattice = ForcedLattice::new(group, coll);
        let min = lattice.next_candidate(elems.div_ceil(world).max(largest).max(1))?;
        Some(Buffer { lattice, min })
    }

    /// The smallest allowed size `≥ x`.
    fn next(&self, x: usize) -> Option<usize> {
        self.lattice.next_candidate(x.max(self.min))
    }
}

/// Smallest `Σ S` over buffers `b..` given `prefix = Σ S` of the ones before, with the total
/// reaching `share`; `rest[b]` is the least buffers `b..` can add; `best` prunes.
fn search(
    buffers: &[Buffer],
    rest: &[usize],
    share: usize,
    b: usize,
    prefix: usize,
    best: &mut Option<usize>,
) {
    let better = |x: usize, best: &Option<usize>| best.is_none_or(|v| x < v);
    if b + 1 == buffers.len() {
        // The last buffer takes what is left of the share.
        let need = share.saturating_sub(prefix);
        if let Some(sum) = buffers[b].next(need).and_then(|s| prefix.checked_add(s)) {
            if better(sum, best) {
                *best = Some(sum);
            }
        }
        return;
    }
    let mut s = buffers[b].min;
    for _ in 0..SIZES_PER_BUFFER {
        let Some(low) = prefix
            .checked_add(s)
            .and_then(|p| p.checked_add(rest[b + 1]))
        else {
            return;
        };
        if !better(low, best) {
            return;
        }
        search(buffers, rest, share, b + 1, prefix + s, best);
        match s.checked_add(1).and_then(|x| buffers[b].next(x)) {
            Some(next) => s = next,
            None => return,
        }
    }
    // Every larger size of buffer b at once: its lattice dropped, the rest at their least.
    let bound = prefix
        .checked_add(s)
        .and_then(|p| p.checked_add(rest[b + 1]))
        .map(|p| p.max(share));
    if let Some(bound) = bound.filter(|&x| better(x, best)) {
        *best = Some(bound);
    }
}
