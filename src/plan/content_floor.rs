//! The content floor: an eighth lower bound on `Σ S_b`, for any number of buffers, taken by
//! [`super::multi`] where a plan is above the other seven.
//!
//! **Why.** The other floors bound the sizes of the buffers; this one bounds their padding.
//! A buffer holds a whole number of tensors, so its padding `V·S − C` (`C` its elements) is
//! at least `−C mod V·L`, `L` its lattice. In a Qwen3-235B-A22B layer at `rows:1`, `V = 1024`
//! every tensor but the norms has a multiple of 512 elements per rank, and the buffer holding
//! the router cannot end on its lattice: on 4,096 (next to `q_proj` or the experts'
//! `gate/up_proj`) the per-rank contents reach only 0, 512, 2,048 or 2,560 modulo 4,096 (one
//! router, and `k_proj`, `v_proj` and the experts are 2,048 modulo 4,096); on 1,536 (with
//! `down_proj` only) the router leaves 512 modulo 1,536. Either way the buffer pads at least
//! 1,015.75 elements per rank, so `Σ S ≥ 2,430,464`: the plan (the floors before said
//! 2,429,952, the share rounded to the gcd of the lattices).
//!
//! **Proof.** Fix a threshold `T`. Either some `S_b ≥ T`, and `Σ S ≥ T`, or every tensor of at
//! least `2(T − 1)` elements (the set `F`) is forced wherever it lies. Group the tensors by
//! shape `(e, g)`. A buffer `B` of size `S < T` holds some of each shape; a shape of `F` there
//! is forced; any other shape there is either forced (`e ≥ 2S`: `S ≤ ⌊e/2⌋`) or not
//! (`S ≥ ⌊e/2⌋ + 1`). For such a *kind* (the shapes present, each with its state), `S` is a
//! multiple of `L = lcm(coll, g of the forced shapes)`, at least every block present and
//! `⌊e/2⌋ + 1` for the unforced ones (`S_lo`, rounded up to `L`), at most `⌊e/2⌋` for the
//! forced ones outside `F` and below `T`. Its padding `W = V·S − C` is then at least
//! `V·S_lo − C_max` (`C_max`: every tensor of its shapes), and `W ≡ −C (mod V·L)` with
//! `C = Σ n_s e_s`, `1 ≤ n_s ≤ count_s`, so `W ≥ min (−C mod V·L)` over those counts. A shape
//! whose counts run over a whole period of `e_s` modulo the modulus makes every multiple of
//! `gcd(modulus, e_s)` reachable, so the modulus drops to that gcd (exact, and it keeps the
//! residue search small); the residues of the other shapes are enumerated, and past
//! [`MAX_RESIDUES`] the kind's residue bound is 0 (still a bound). Every tensor lies in one
//! buffer, so for each shape `w` the buffer holding one of its tensors pads at least
//! `W_w = min W` over the kinds holding `w`, the others at least 0:
//! `V·Σ S ≥ E + max_w W_w`, and `Σ S` is a multiple of `coll`. So
//! `Σ S ≥ min(T, ⌈⌈(E + max_w W_w)/V⌉⌉_coll)`. Shapes beyond the [`TRACKED_FORCED`] of `F`
//! and the [`TRACKED_OTHER`] others with the most elements are dropped (a layout without
//! their tensors stays valid with the same sizes, so a bound for the rest is one for all).
//! Start alignment only adds constraints, so it is ignored. The residue search has a budget
//! per call ([`MAX_WORK`]). `T` runs over `⌊e/2⌋ + 1` for the
//! tracked sizes, largest first, at most [`MAX_THRESHOLDS`], until one is no larger than the
//! best bound so far; the largest bound wins.

use std::cell::Cell;

use super::fit::gcd_u128;
use super::Item;
use crate::{Error, Result};

/// Shapes of `F` (the forced tensors) followed; the others are dropped.
pub const TRACKED_FORCED: usize = 5;

/// Shapes outside `F` followed (three states each: absent, forced, not forced).
pub const TRACKED_OTHER: usize = 4;

/// Thresholds tried, at most.
pub const MAX_THRESHOLDS: usize = 6;

/// Residues enumerated per kind of buffer, at most (past it the kind's residue bound is 0).
pub const MAX_RESIDUES: usize = 1 << 14;

/// Residue steps one call may spend in all; past it every kind's residue bound is 0 (still a
/// bound), so the time is bounded whatever the counts and sizes.
pub const MAX_WORK: usize = 1 << 23;

/// One shape `(e, g)` and how many tensors have it.
#[derive(Clone, Copy, Debug)]
struct Shape {
    e: u128,
    g: u128,
    count: u128,
}

/// The content lower bound on `Σ S_b` over every layout with any number of buffers (module
/// doc); `Ok(None)` where no threshold gives a bound. Errors on empty input, a zero `world`
/// or `coll`.
pub fn content_floor(items: &[Item], world: usize, coll: usize) -> Result<Option<usize>> {
    if items.is_empty() || world == 0 || coll == 0 {
        return Err(Error::BadInput {
            op: "content_floor",
            what: format!("{} tensors, V = {world}, coll {coll}", items.len()),
            reason: "needs tensors, ranks and a collective alignment".into(),
        });
    }
    let shapes = shapes_of(items);
    let mut sizes: Vec<u128> = shapes.iter().map(|s| s.e).collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.dedup();
    let mut best: Option<u128> = None;
    let budget = Cell::new(MAX_WORK);
    for e in sizes.into_iter().take(MAX_THRESHOLDS) {
        let t = e / 2 + 1;
        if best.is_some_and(|b| t <= b) {
            break;
        }
        if let Some(b) = bound_below(&shapes, world as u128, coll as u128, t, &budget) {
            best = Some(best.map_or(b, |x| x.max(b)));
        }
    }
    Ok(best.and_then(|b| usize::try_from(b).ok()))
}

/// Tensors grouped by `(numel, block)`, the most elements first.
fn shapes_of(items: &[Item]) -> Vec<Shape> {
    let mut shapes: Vec<Shape> = Vec::new();
    for t in items {
        let (e, g) = (t.numel as u128, t.block as u128);
        match shapes.iter_mut().find(|s| s.e == e && s.g == g) {
            Some(s) => s.count += 1,
            None => shapes.push(Shape { e, g, count: 1 }),
        }
    }
    shapes.sort_by_key(|s| std::cmp::Reverse(s.e * s.count));
    shapes
}

/// `min(t, bound)` for threshold `t` (module doc), `None` on overflow.
fn bound_below(
    shapes: &[Shape],
    v: u128,
    coll: u128,
    t: u128,
    budget: &Cell<usize>,
) -> Option<u128> {
    let limit = 2 * (t - 1);
    let forced: Vec<Shape> = shapes
        .iter()
        .copied()
        .filter(|s| s.e >= limit)
        .take(TRACKED_FORCED)
        .collect();
    let other: Vec<Shape> = shapes
        .iter()
        .copied()
        .filter(|s| s.e < limit)
        .take(TRACKED_OTHER)
        .collect();
    let kept: Vec<Shape> = forced.iter().chain(&other).copied().collect();
    let total = kept
        .iter()
        .try_fold(0u128, |acc, s| acc.checked_add(s.e.checked_mul(s.count)?))?;
    // least[w]: the least padding of a buffer holding shape w (None: no such buffer below t).
    let mut least: Vec<Option<u128>> = vec![None; kept.len()];
    for kind in kinds(forced.len(), other.len()) {
        let Some(w) = kind_padding(&kept, &kind, (v, coll, t), budget) else {
            continue;
        };
        for (slot, _) in least
            .iter_mut()
            .zip(&kind)
            .filter(|(_, &st)| st != State::Absent)
        {
            *slot = Some(slot.map_or(w, |x| x.min(w)));
        }
    }
    // A shape no buffer below t can hold means some buffer is at least t.
    let worst = least.iter().try_fold(0u128, |acc, w| w.map(|w| acc.max(w)));
    let Some(worst) = worst else {
        return Some(t);
    };
    let sum = total
        .checked_add(worst)?
        .div_ceil(v)
        .checked_next_multiple_of(coll)?;
    Some(sum.min(t))
}

/// What a buffer holds of one shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Absent,
    /// Present and forced: its block divides `S`.
    Forced,
    /// Present, not forced: `S ≥ ⌊e/2⌋ + 1`.
    Free,
}

/// Every kind of buffer: shapes of `F` absent or forced, the others absent, forced or free;
/// at least one shape present.
fn kinds(forced: usize, other: usize) -> Vec<Vec<State>> {
    let mut out: Vec<Vec<State>> = vec![Vec::new()];
    for i in 0..forced + other {
        let states: &[State] = if i < forced {
            &[State::Absent, State::Forced]
        } else {
            &[State::Absent, State::Forced, State::Free]
        };
        out = out
            .into_iter()
            .flat_map(|k| {
                states.iter().map(move |&s| {
                    let mut k = k.clone();
                    k.push(s);
                    k
                })
            })
            .collect();
    }
    out.retain(|k| k.iter().any(|&s| s != State::Absent));
    out
}

/// The least padding `V·S − C` of a buffer of this kind below `t`, or `None` when no such
/// buffer exists (or a size overflows, which only drops a kind's bound to "none possible"
/// for a kind that cannot be addressed anyway).
fn kind_padding(
    shapes: &[Shape],
    kind: &[State],
    (v, coll, t): (u128, u128, u128),
    budget: &Cell<usize>,
) -> Option<u128> {
    let mut lattice = coll;
    let (mut lo, mut hi, mut c_max) = (1u128, t - 1, 0u128);
    let mut present = Vec::new();
    for (s, &state) in shapes.iter().zip(kind) {
        match state {
            State::Absent => continue,
            State::Forced => {
                lattice = lcm(lattice, s.g)?;
                // e ≥ 2S (a shape of F has e/2 ≥ t − 1 already).
                hi = hi.min(s.e / 2);
            }
            State::Free => lo = lo.max(s.e / 2 + 1),
        }
        lo = lo.max(s.g);
        c_max = c_max.checked_add(s.e.checked_mul(s.count)?)?;
        present.push(*s);
    }
    let lo = lo.checked_next_multiple_of(lattice)?;
    if lo > hi {
        return None;
    }
    let magnitude = v.checked_mul(lo)?.saturating_sub(c_max);
    let residue = v
        .checked_mul(lattice)
        .map_or(0, |m| residue_padding(&present, m, budget));
    Some(magnitude.max(residue))
}

/// `min (−Σ n_s e_s) mod m` over `1 ≤ n_s ≤ count_s` (module doc); 0 past [`MAX_RESIDUES`].
fn residue_padding(present: &[Shape], m: u128, budget: &Cell<usize>) -> u128 {
    let mut m = m;
    let mut rest: Vec<Shape> = present.to_vec();
    // Shapes whose counts sweep a whole period reduce the modulus; repeat until none does.
    loop {
        let sweeping = rest.iter().position(|s| {
            let h = gcd_u128(m, s.e);
            s.count >= m / h
        });
        let Some(i) = sweeping else { break };
        m = gcd_u128(m, rest[i].e);
        rest.swap_remove(i);
    }
    // Residues below 2^64 keep `x + e` from overflowing; larger moduli get no residue bound.
    if m > u64::MAX as u128 {
        return 0;
    }
    let mut reach: Vec<u128> = vec![0];
    for s in &rest {
        let work = reach
            .len()
            .saturating_mul(usize::try_from(s.count).unwrap_or(usize::MAX));
        if work > MAX_RESIDUES.saturating_mul(16) || work > budget.get() {
            return 0;
        }
        budget.set(budget.get() - work);
        let mut next = Vec::with_capacity(work);
        for &r in &reach {
            let mut x = r;
            for _ in 0..s.count {
                x = (x + s.e % m) % m;
                next.push(x);
            }
        }
        next.sort_unstable();
        next.dedup();
        if next.len() > MAX_RESIDUES {
            return 0;
        }
        reach = next;
    }
    reach.iter().map(|&r| (m - r) % m).min().unwrap_or(0)
}

fn lcm(a: u128, b: u128) -> Option<u128> {
    (a / gcd_u128(a, b)).checked_mul(b)
}
