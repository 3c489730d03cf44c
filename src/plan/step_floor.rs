//! The common-step floor: a fourth lower bound on `Σ S_b`, for any number of buffers, taken
//! with the others by [`super::floor::floor_shard_sum`].
//!
//! **Why.** The other floors treat the mass of a buffer as able to land anywhere between two
//! lattice points. When every large tensor of a unit is forced in whatever buffer holds it,
//! each of those buffers has a size that is a multiple of one of their lattices, so the sum of
//! those sizes is a multiple of the lattices' gcd. In a Qwen3-235B-A22B layer at `rows:16`,
//! `V = 4096`, the lattices are 131,072, 65,536 and 24,576: the sizes sum to a multiple of
//! 8,192, and the 607,232 elements per rank of those tensors need 614,400, while the share
//! rounded to `coll` is 607,424 (1.16 % padding against 0.01 %).
//!
//! **Proof.** Fix a threshold `T`. A layout either has a buffer with `S_b ≥ T`, and then
//! `Σ S ≥ T`; or every `S_b ≤ T − 1`. In that case a tensor `t` with `e_t ≥ 2(T − 1)` has
//! `e_t ≥ 2·S_b` in the buffer holding it, so `g_t | S_b` (planner.md §2) and `coll | S_b`:
//! `S_b` is a multiple of `ℓ_t = lcm(coll, g_t)`. Let `F` be those tensors, `M_F` their
//! elements and `d = gcd_{t∈F} ℓ_t`. Every buffer holding a tensor of `F` has a size that is a
//! multiple of `d`, so their sum `x` is one, and `V·x ≥ M_F`: `Σ S ≥ x ≥ ⌈M_F/V⌉_d`. Any
//! layout also has `Σ S ≥ B = max(⌈E/V⌉_coll, ⌈g_max⌉_coll)` (all tensors fit; the shard of
//! the buffer holding the largest block holds that block), so
//! `Σ S ≥ min(T, max(⌈M_F/V⌉_d, B))`. `F` only changes
//! where `T − 1` passes half a tensor, so it suffices to take, for each tensor size `e_j`
//! (largest first), `T = ⌊e_j/2⌋ + 1` and `F` = the tensors of at least `e_j` elements. The
//! floor is the largest of these bounds.
//!
//! **The tensors outside `F`.** Let `N` be the rest and `Q ⊆ N` the tensors that lie in
//! buffers holding nothing of `F`. The buffers with `F` hold `F` and `N ∖ Q`, so
//! `x ≥ ⌈(M_F + M_{N∖Q})/V⌉_d` and `x ≥ ⌈g_F⌉_coll` for the largest block of `F`; the others
//! hold exactly `Q`, and removing tensors from a
//! layout keeps it valid, so their sizes sum to at least any lower bound for `Q` alone: this
//! floor for `Q`, refined [`NESTING`] levels deep, `y`. So `Σ S ≥ max(B, x + y)` for the `Q` of the
//! layout, and the smallest value over every `Q` is a bound. Tensors of `N` of one shape are
//! interchangeable, so `Q` is a count per shape: the counts of the [`TRACKED_SHAPES`] shapes
//! of `N` with the most elements are searched best first in boxes of ranges (a range
//! `[lo, hi]` takes `x` at `hi` and `y` at `lo`: the least `Σ S` of a set of tensors only grows
//! with more of them; at most [`MAX_BOXES`] boxes), and the other tensors of `N` are dropped
//! from both sides (fewer tensors only lower a bound). In a
//! Mixtral-8x7B layer at `rows:128`, `V = 64`, this is what sees that the attention tensors
//! need a lattice of their own wherever they go, and at `rows:16` that the router (one
//! 32,768-element block) needs a shard of 32,768 wherever it goes. Every product is taken in `u128`; a lattice
//! past 64 bits cannot be any buffer's size, so the threshold's bound is `T` alone then.
//!
//! **At most `k` buffers** ([`step_floor_k`]). The buffers holding `Q` hold nothing of `F`, and
//! `F` needs at least one, so a `Q` that is not empty leaves at most `k − 1` buffers for `F`
//! and `Q` itself gets at most `k − 1`: its bound `y` is taken with `k − 1` buffers. Where that
//! leaves `F` one buffer (`k = 2` and `Q` not empty, or `k = 1`, where `Q` is empty), every
//! tensor of `F` is forced in that same buffer, so its size `x` is a multiple of the *lcm* of
//! their lattices, not only of their gcd: two forced tensors with lattices 2 and 3 and a small
//! one, in at most two buffers, either share one buffer (a multiple of 6, the small one with
//! them or alone) or each have their own (the small one joining one of them). A box of
//! counts whose lower ends are all zero also holds an empty `Q`, so it keeps the gcd.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::fit::gcd_u128;
use super::Item;

/// Shapes of `N` (module doc) whose counts in buffers without `F` are enumerated.
pub const TRACKED_SHAPES: usize = 4;

/// Boxes of counts evaluated per threshold, by nesting level (the outer level is the last).
pub const MAX_BOXES: [usize; NESTING + 1] = [1, 24, 600];

/// Levels of the refinement: the bound for `Q` alone is refined once more (its own `F` and
/// `N`), then taken plain.
pub const NESTING: usize = 2;

/// The common-step lower bound on `Σ S_b` for any number of buffers (module doc); `None`
/// when the inputs are empty or zero, or the bound passes 64 bits.
pub fn step_floor(items: &[Item], world: usize, coll: usize) -> Option<usize> {
    step_floor_k(items, world, coll, usize::MAX)
}

/// The common-step lower bound on `Σ S_b` for at most `k` buffers (module doc, last part); at
/// least [`step_floor`]'s. `None` when the inputs are empty or zero (`k = 0` included), or the
/// bound passes 64 bits.
pub fn step_floor_k(items: &[Item], world: usize, coll: usize, k: usize) -> Option<usize> {
    if items.is_empty() || world == 0 || coll == 0 || k == 0 {
        return None;
    }
    let shapes = shapes_of(items.iter().map(|&t| (t, 1u128)));
    let bound = step_bound(
        &shapes,
        world as u128,
        coll as u128,
        NESTING,
        k,
        Budget::USUAL,
    );
    usize::try_from(bound).ok()
}

/// [`step_floor_k`] with the outer search of `Q` over [`DEEP_TRACKED_SHAPES`] shapes and up to
/// [`DEEP_MAX_BOXES`] boxes: the same proof, more of it searched (about a second on a
/// gpt-oss-120b layer at `rows:1`, `V = 256`, where it proves the two-buffer plan optimal and
/// the usual budget stops at the share). [`super::multi`] takes it only for small units whose
/// two-buffer plan is above their floor.
pub fn step_floor_deep(items: &[Item], world: usize, coll: usize, k: usize) -> Option<usize> {
    if items.is_empty() || world == 0 || coll == 0 || k == 0 {
        return None;
    }
    let shapes = shapes_of(items.iter().map(|&t| (t, 1u128)));
    let deep = Budget {
        tracked: DEEP_TRACKED_SHAPES,
        boxes: DEEP_MAX_BOXES,
    };
    let bound = step_bound(&shapes, world as u128, coll as u128, NESTING, k, deep);
    usize::try_from(bound).ok()
}

/// Shapes of `N` tracked by the outer search of [`step_floor_deep`].
pub const DEEP_TRACKED_SHAPES: usize = 12;

/// Boxes of the outer search of [`step_floor_deep`], per threshold.
pub const DEEP_MAX_BOXES: usize = 50_000;

/// How much of the outer search of `Q` is done (the inner levels keep [`TRACKED_SHAPES`] and
/// [`MAX_BOXES`]).
#[derive(Clone, Copy, Debug)]
struct Budget {
    tracked: usize,
    boxes: usize,
}

impl Budget {
    const USUAL: Budget = Budget {
        tracked: TRACKED_SHAPES,
        boxes: MAX_BOXES[NESTING],
    };
}

/// Tensors of one `(elements, block)` and how many there are.
#[derive(Clone, Copy, Debug)]
struct Shape {
    numel: u128,
    block: usize,
    count: u128,
}

/// Shapes with their counts, largest tensors first.
fn shapes_of(items: impl Iterator<Item = (Item, u128)>) -> Vec<Shape> {
    let mut shapes: Vec<Shape> = Vec::new();
    for (t, n) in items.filter(|x| x.1 > 0) {
        let numel = t.numel as u128;
        match shapes
            .iter_mut()
            .find(|s| s.numel == numel && s.block == t.block)
        {
            Some(s) => s.count += n,
            None => shapes.push(Shape {
                numel,
                block: t.block,
                count: n,
            }),
        }
    }
    shapes.sort_by_key(|s| std::cmp::Reverse(s.numel));
    shapes
}

/// The bound of the module doc for `shapes` (largest first) in at most `buffers` buffers, `Q`
/// enumerated `nesting` levels deep.
fn step_bound(
    shapes: &[Shape],
    v: u128,
    c: u128,
    nesting: usize,
    buffers: usize,
    budget: Budget,
) -> u128 {
    let total: u128 = shapes.iter().map(|s| s.numel * s.count).sum();
    let share = total.div_ceil(v).next_multiple_of(c);
    // The buffer holding the largest block has a shard at least that large.
    let largest = shapes.iter().map(|s| s.block as u128).max().unwrap_or(0);
    let share = share.max(largest.next_multiple_of(c));
    // `step`: the gcd of F's lattices; `None` once one passes 64 bits (no buffer holds it).
    let (mut mass, mut step, mut best) = (0u128, Some(0u128), share);
    // `common`: the lcm of F's lattices (what F's size is a multiple of in one buffer).
    let mut common = Some(1u128);
    // The largest block of F, rounded to `coll`: some buffer with F holds it.
    let mut block_f = 0u128;
    for (j, s) in shapes.iter().enumerate() {
        mass += s.numel * s.count;
        block_f = block_f.max((s.block as u128).next_multiple_of(c));
        step = step.zip(lattice(s.block, c)).map(|(a, l)| gcd_u128(a, l));
        common = common
            .zip(lattice(s.block, c))
            .and_then(|(a, l)| lcm_u64(a, l));
        // Shapes of one size belong to the same F: take the bound after the last of them.
        if shapes.get(j + 1).is_some_and(|n| n.numel == s.numel) {
            continue;
        }
        let threshold = s.numel / 2 + 1;
        let bound = if buffers == 1 {
            // One buffer: Q is empty and F is forced in it, so its size sits on the lcm.
            match common {
                Some(l) => threshold.min(total.div_ceil(v).next_multiple_of(l).max(share)),
                None => threshold,
            }
        } else {
            match step {
                Some(d) if nesting > 0 => {
                    let f = ForcedSet {
                        mass,
                        block: block_f,
                        step: d,
                        common,
                    };
                    let rest = &shapes[j + 1..];
                    let split = split_bound(&f, rest, v, c, share, nesting - 1, buffers, budget);
                    threshold.min(split)
                }
                Some(d) => threshold.min(mass.div_ceil(v).next_multiple_of(d).max(share)),
                None => threshold,
            }
        };
        best = best.max(bound);
    }
    best
}

/// The forced tensors `F` of one threshold.
struct ForcedSet {
    /// Their elements.
    mass: u128,
    /// Their largest block, rounded to `coll`.
    block: u128,
    /// The gcd of their lattices.
    step: u128,
    /// The lcm of their lattices; `None` past 64 bits.
    common: Option<u128>,
}

/// The smallest `max(share, x + y)` over every count of each tracked shape of `rest` (the
/// module doc's `N`) in buffers without `F`, or a lower bound of it. Counts are searched as
/// boxes of ranges, best first: a box `[lo, hi]` per shape bounds every count in it by taking
/// `x` with `hi` tensors out of the `F` buffers and `y` with `lo` in the others (the least
/// `Σ S` of a set of tensors only grows with more tensors); the box with the smallest bound is
/// split in half along its widest range, until that box is a single count vector (its value
/// is then the minimum) or [`MAX_BOXES`] boxes were evaluated (the smallest bound left holds).
///
/// With at most `buffers` buffers, a box whose lower ends are not all zero has a `Q` that is
/// not empty: its `y` is taken with `buffers − 1` buffers, and with `buffers = 2` the one
/// buffer left for `F` puts `x` on the lcm of `F`'s lattices (module doc); a box that needs a
/// lattice past 64 bits there holds no layout.
#[allow(clippy::too_many_arguments)]
fn split_bound(
    f: &ForcedSet,
    rest: &[Shape],
    v: u128,
    c: u128,
    share: u128,
    nesting: usize,
    buffers: usize,
    budget: Budget,
) -> u128 {
    let mut tracked: Vec<Shape> = rest.to_vec();
    tracked.sort_by_key(|s| std::cmp::Reverse(s.numel * s.count));
    let outer = nesting + 1 == NESTING;
    tracked.truncate(if outer {
        budget.tracked
    } else {
        TRACKED_SHAPES
    });
    let bound_of = |b: &[(u128, u128)]| -> u128 {
        let kept: u128 = tracked
            .iter()
            .zip(b)
            .map(|(s, &(_, hi))| s.numel * (s.count - hi))
            .sum();
        let alone = shapes_of(tracked.iter().zip(b).map(|(s, &(lo, _))| (item_of(s), lo)));
        // F alone in its buffers (an empty Q is in this box) or F sharing them with Q's buffers.
        let step = match (alone.is_empty(), buffers == 2) {
            (false, true) => match f.common {
                Some(l) => l,
                None => return u128::MAX,
            },
            _ => f.step,
        };
        let x = (f.mass + kept)
            .div_ceil(v)
            .next_multiple_of(step)
            .max(f.block);
        let y = if alone.is_empty() {
            0
        } else {
            step_bound(&alone, v, c, nesting, buffers - 1, budget)
        };
        share.max(x.saturating_add(y))
    };
    let whole: Vec<(u128, u128)> = tracked.iter().map(|s| (0, s.count)).collect();
    let mut heap = BinaryHeap::new();
    heap.push(Reverse((bound_of(&whole), whole)));
    let mut evaluated = 1usize;
    while let Some(Reverse((bound, b))) = heap.pop() {
        let widest = (0..b.len()).max_by_key(|&i| b[i].1 - b[i].0);
        let Some(i) = widest.filter(|&i| b[i].1 > b[i].0) else {
            return bound; // a single count vector: the smallest value of all
        };
        let cap = if outer {
            budget.boxes
        } else {
            MAX_BOXES[nesting + 1]
        };
        if evaluated >= cap {
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
    share
}

/// A shape as an [`Item`] again (its sizes came from one, so they fit).
fn item_of(s: &Shape) -> Item {
    Item {
        numel: s.numel as usize,
        block: s.block,
        align: 1,
    }
}

/// `lcm(coll, g)`, `None` past 64 bits.
fn lattice(block: usize, coll: u128) -> Option<u128> {
    let g = block as u128;
    let l = g / gcd_u128(g, coll) * coll;
    (l <= u64::MAX as u128).then_some(l)
}

/// `lcm(a, b)` of two lattices, `None` past 64 bits (no buffer's size).
fn lcm_u64(a: u128, b: u128) -> Option<u128> {
    let l = (a / gcd_u128(a, b)).checked_mul(b)?;
    (l <= u64::MAX as u128).then_some(l)
}
