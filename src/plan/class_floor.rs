//! The shape-class floor: a third lower bound on `Σ S_b` over every partition of a unit into at
//! most `k ≤ 3` buffers, for units made of many identical tensors (the experts of an MoE layer),
//! taken with the others by [`super::floor::floor_shard_sum`].
//!
//! **Why.** [`super::heavy_floor`] follows a few tensors one by one, so with 8 copies of each
//! expert tensor it sees only some of them; the rest count as divisible elements, and their
//! lattice is lost. Here tensors of one shape `(elements e, block g)` are followed together.
//!
//! **Proof.** Take the [`TRACKED_CLASSES`] shapes with the most elements; shape `c` has `m_c`
//! tensors. In any layout with at most `k` buffers, let `P_c` be the non-empty set of buffers
//! holding a tensor of shape `c`. Then, whatever else the buffers hold:
//! 1. a buffer `b ∈ P_c` has `S_b ≥ ⌈g_c⌉_coll` and `V·S_b ≥ e_c`;
//! 2. if `e_c ≥ 2·S_b` then `g_c | S_b` (planner.md §2), and `coll | S_b`: `S_b` is a size that
//!    [`ForcedLattice`] of the shapes in `b` accepts;
//! 3. for every set `B` of buffers, the shapes with `P_c ⊆ B` lie in `B`:
//!    `V·Σ_{b∈B} S_b ≥ Σ_{P_c ⊆ B} m_c·e_c`; and all buffers hold everything: `V·Σ S_b ≥ E`.
//!
//! The floor is the smallest `Σ S` meeting 1–3 over every choice of the sets `P_c` (each a
//! non-empty subset of `k` labelled buffers). Buffers without tracked shapes only have `S ≥ 0`:
//! they take what the total still needs. The others are searched buffer by buffer, each from
//! the smallest size meeting its conditions given the ones before; after [`SIZES_PER_BUFFER`]
//! sizes of one buffer, every larger one is covered at once by dropping its lattice and the
//! conditions of the buffers after it, so the result stays a lower bound.

use super::search::ForcedLattice;
use super::Item;

/// Shapes followed together (`7^4 = 2,401` choices of the sets for `k = 3`).
pub const TRACKED_CLASSES: usize = 4;

/// Most buffers the bound enumerates.
pub const MAX_BUFFERS: usize = 3;

/// Sizes of one buffer searched one by one before the bound of the rest takes over.
pub const SIZES_PER_BUFFER: usize = 12;

/// The shape-class lower bound on `Σ S_b` for at most `k` buffers (module doc); `None` when it
/// does not apply (`k > MAX_BUFFERS`) or the sizes overflow.
pub fn class_floor(items: &[Item], world: usize, coll: usize, k: usize) -> Option<usize> {
    if items.is_empty() || world == 0 || coll == 0 || k == 0 || k > MAX_BUFFERS {
        return None;
    }
    let total: u128 = items.iter().map(|t| t.numel as u128).sum();
    let share = usize::try_from(total.div_ceil(world as u128))
        .ok()?
        .checked_next_multiple_of(coll)?;
    let classes = tracked_classes(items);
    let subsets = (1u32 << k) - 1;
    let mut best: Option<usize> = None;
    let mut choice = vec![0u32; classes.len()];
    loop {
        if let Some(sum) = assignment_floor(&classes, &choice, k, world, coll, share) {
            best = Some(best.map_or(sum, |b| b.min(sum)));
        }
        // Next choice of the sets: a counter in base `subsets` over the classes.
        let mut i = 0;
        while i < choice.len() {
            choice[i] = (choice[i] + 1) % subsets;
            if choice[i] != 0 {
                break;
            }
            i += 1;
        }
        if i == choice.len() {
            return best;
        }
    }
}

/// One shape and how many tensors have it.
#[derive(Clone, Copy, Debug)]
struct Class {
    item: Item,
    count: u128,
}

fn tracked_classes(items: &[Item]) -> Vec<Class> {
    let mut classes: Vec<Class> = Vec::new();
    for &t in items {
        match classes
            .iter_mut()
            .find(|c| c.item.numel == t.numel && c.item.block == t.block)
        {
            Some(c) => c.count += 1,
            None => classes.push(Class { item: t, count: 1 }),
        }
    }
    classes.sort_by_key(|c| std::cmp::Reverse(c.count * c.item.numel as u128));
    classes.truncate(TRACKED_CLASSES);
    classes
}

/// The smallest `Σ S` meeting conditions 1–3 when class `c` lies in the buffers of the bit set
/// `choice[c] + 1`.
fn assignment_floor(
    classes: &[Class],
    choice: &[u32],
    k: usize,
    world: usize,
    coll: usize,
    share: usize,
) -> Option<usize> {
    let sets: Vec<u32> = choice.iter().map(|&c| c + 1).collect();
    let used: Vec<usize> = (0..k)
        .filter(|&b| sets.iter().any(|s| s & (1 << b) != 0))
        .collect();
    let buffers: Vec<Buffer> = used
        .iter()
        .map(|&b| Buffer::new(classes, &sets, b, world, coll))
        .collect::<Option<_>>()?;
    // need[mask over `used`]: what the buffers of `mask` must hold, in elements per rank.
    let mut need = vec![0usize; 1 << used.len()];
    for (mask, slot) in need.iter_mut().enumerate() {
        let buffers_of = |set: u32| -> u32 {
            let mut m = 0u32;
            for (j, &b) in used.iter().enumerate() {
                if set & (1 << b) != 0 {
                    m |= 1 << j;
                }
            }
            m
        };
        let mass: u128 = classes
            .iter()
            .zip(&sets)
            .filter(|(_, &set)| buffers_of(set) & !(mask as u32) == 0)
            .map(|(c, _)| c.count * c.item.numel as u128)
            .sum();
        *slot = usize::try_from(mass.div_ceil(world as u128)).ok()?;
    }
    let free = used.len() < k;
    let mut search = Search {
        buffers: &buffers,
        need: &need,
        share,
        free,
        best: None,
    };
    search.go(0, 0, &mut Vec::new());
    search.best
}

/// One buffer's conditions 1 and 2.
struct Buffer {
    lattice: ForcedLattice,
    min: usize,
}

impl Buffer {
    fn new(classes: &[Class], sets: &[u32], b: usize, world: usize, coll: usize) -> Option<Self> {
        let here: Vec<Item> = classes
            .iter()
            .zip(sets)
            .filter(|(_, &set)| set & (1 << b) != 0)
            .map(|(c, _)| c.item)
            .collect();
        let least = here
            .iter()
            .map(|t| t.block.max(t.numel.div_ceil(world)))
            .max()?;
        let lattice = ForcedLattice::new(&here, coll);
        let min = lattice.next_candidate(least)?;
        Some(Buffer { lattice, min })
    }

    fn next(&self, x: usize) -> Option<usize> {
        self.lattice.next_candidate(x.max(self.min))
    }
}

struct Search<'a> {
    buffers: &'a [Buffer],
    need: &'a [usize],
    share: usize,
    /// Some buffer holds no tracked shape and can take whatever the total still needs.
    free: bool,
    best: Option<usize>,
}

impl Search<'_> {
    fn better(&self, x: usize) -> bool {
        self.best.is_none_or(|b| x < b)
    }

    fn offer(&mut self, x: usize) {
        if self.better(x) {
            self.best = Some(x);
        }
    }

    /// Chooses the size of buffer `j` given `sizes` of the ones before (summing to `prefix`).
    fn go(&mut self, j: usize, prefix: usize, sizes: &mut Vec<usize>) {
        let n = self.buffers.len();
        if j == n {
            // A free buffer covers the rest of the total; otherwise the total must be met.
            if self.free || prefix >= self.share {
                self.offer(prefix.max(self.share));
            }
            return;
        }
        // Condition 3 for every set whose last buffer is j.
        let mut floor = 0usize;
        for mask in (1usize << j)..(1usize << (j + 1)) {
            // Saturating: a sum past 64 bits already covers any need.
            let before = (0..j)
                .filter(|&i| mask & (1 << i) != 0)
                .fold(0usize, |acc, i| acc.saturating_add(sizes[i]));
            floor = floor.max(self.need[mask].saturating_sub(before));
        }
        if j + 1 == n && !self.free {
            floor = floor.max(self.share.saturating_sub(prefix));
        }
        // Saturating: past 64 bits no sum below is offered, and none of those layouts has a
        // sum that small.
        let rest = self.buffers[j + 1..]
            .iter()
            .fold(0usize, |acc, b| acc.saturating_add(b.min));
        let Some(mut s) = self.buffers[j].next(floor) else {
            return;
        };
        for _ in 0..SIZES_PER_BUFFER {
            let Some(low) = prefix.checked_add(s).and_then(|p| p.checked_add(rest)) else {
                return;
            };
            if !self.better(low.max(self.share)) {
                return;
            }
            sizes.push(s);
            self.go(j + 1, prefix + s, sizes);
            sizes.pop();
            match s.checked_add(1).and_then(|x| self.buffers[j].next(x)) {
                Some(next) => s = next,
                None => return,
            }
        }
        // Every larger size of buffer j at once, the later buffers at their least.
        if let Some(low) = prefix.checked_add(s).and_then(|p| p.checked_add(rest)) {
            self.offer(low.max(self.share));
        }
    }
}
