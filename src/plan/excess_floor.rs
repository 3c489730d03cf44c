//! The excess floor: a ninth lower bound on `S`, for one buffer, taken by
//! [`super::floor::floor_shard_sum`] with the others.
//!
//! **Why.** The piece floor ([`super::piece_floor`]) counts the pieces of the tensors whose
//! parts inside a shard are multiples of `D`; the tensors whose parts are not (the *special*
//! ones) are left out. But a shard that holds no part of a special tensor holds a multiple of
//! `D`, so at `S = D·m + r` it holds at most `D·m`: only the shards that special tensors touch
//! can use the last `r` elements, and few tensors touch few shards. A DeepSeek-V3 MoE layer at
//! `rows:16`, `V = 64`: every part of the experts, `o_proj`, `q_a_proj`, `kv_a_proj` and the
//! router is a multiple of 16,384; `q_b_proj` (blocks of 24,576), `kv_b_proj` (8,192) and five
//! norms are not. 10,974 pieces per rank fall 213,248 elements short of the layer, the two
//! projections touch at most four shards and the norms hold 16,640 elements, so no `S` below
//! 10,975 pieces (179,814,400, the plan) holds it; the piece floor (with `D = 8,192`) says
//! 10,974.5.
//!
//! **Proof.** Let `d_t = gcd(e_t, g_t)`; every part of tensor `t` inside one shard is a
//! multiple of `d_t` (the proof of [`super::piece_floor`]). Fix `D`; call `t` special when
//! `D ∤ d_t`. Take any layout with shard size `S = D·m + r`, `0 ≤ r < D`. Shard `k` holds
//! `c_k ≤ S` elements, `c_k = D·a_k + σ_k`, `σ_k` the elements of special tensors in it and
//! `a_k` a whole number (the other parts are multiples of `D`). Its *excess* `c_k − D·m` is:
//! at most `r` (as `c_k ≤ S`); at most `σ_k` (if `σ_k ≤ r`, `D·a_k ≤ S − σ_k < D·(m + 1)`, so
//! `a_k ≤ m`; otherwise the first bound is smaller); so at most `min(r, σ_k)`, which is at most
//! `Σ_t min(r, σ_{t,k})` over the special tensors. Tensor `t` has parts in at most `n_t(S)`
//! shards: one when its block is the whole tensor (no boundary may lie inside it), else
//! `min(V, ⌊(e_t − 1)/S⌋ + 2)` (an interval of `e_t` elements meets no more). So
//! `Σ_k min(r, σ_{t,k}) ≤ min(n_t(S)·r, e_t)`, and the excesses sum to at most
//! `X(S) = min(V·r, Σ_t min(n_t(S)·r, e_t))`. The shards hold every element:
//! `E = Σ_k c_k ≤ V·D·m + X(S)`. A size that breaks this has no layout.
//!
//! The bound: given `start`, a lower bound on `S` that is at least `⌈E/V⌉`, let
//! `S_0 = ⌈start⌉_coll` and `m = ⌊S_0/D⌋`. Every `S` in `[S_0, D·(m + 1))` has the same `m`,
//! and `n_t(S) ≤ n_t(S_0)`, so `X(S) ≤ X'(S) = min(V·r, Σ_t min(n_t(S_0)·r, e_t))`, which only
//! grows with `r`: the smallest multiple of `coll` there with `E ≤ V·D·m + X'(S)` (binary
//! search) is a lower bound on `S`; if there is none, `⌈D·(m + 1)⌉_coll` is. The bound is the
//! largest over the candidate `D` (the `d_t` and the gcds of pairs of them, at most
//! [`MAX_DIVISORS`]): each is a lower bound by itself. The start alignment only adds
//! constraints, so it is ignored.

use super::fit::gcd_u128;
use super::Item;
use crate::{Error, Result};

/// Candidate divisors `D` tried, at most (any subset gives a valid bound).
pub const MAX_DIVISORS: usize = 64;

/// One shape `(e, g)`: elements, whether it is one block (never crosses a boundary), its
/// piece step `gcd(e, g)` and how many tensors have it.
#[derive(Clone, Copy, Debug)]
struct Shape {
    e: u128,
    whole: bool,
    d: u128,
    count: u128,
}

/// The excess lower bound on the shard size of one buffer holding `items` on `world` ranks
/// (module doc), at least `start` (which must itself be a lower bound); `Ok(None)` when it
/// overflows. Errors on empty input, a zero `world` or `coll`.
pub fn excess_floor(
    items: &[Item],
    world: usize,
    coll: usize,
    start: usize,
) -> Result<Option<usize>> {
    if items.is_empty() || world == 0 || coll == 0 {
        return Err(Error::BadInput {
            op: "excess_floor",
            what: format!("{} tensors, V = {world}, coll {coll}", items.len()),
            reason: "needs tensors, ranks and a collective alignment".into(),
        });
    }
    let mut shapes: Vec<Shape> = Vec::new();
    for t in items {
        let (e, g) = (t.numel as u128, t.block as u128);
        match shapes
            .iter_mut()
            .find(|s| s.e == e && s.d == gcd_u128(e, g))
        {
            // Equal e and d but a different block: keep the weaker (crossing) form.
            Some(s) => {
                s.count += 1;
                s.whole &= g >= e;
            }
            None => shapes.push(Shape {
                e,
                whole: g >= e,
                d: gcd_u128(e, g),
                count: 1,
            }),
        }
    }
    let v = world as u128;
    let c = coll as u128;
    let total: u128 = shapes.iter().map(|s| s.e * s.count).sum();
    let start = (start as u128).max(total.div_ceil(v)).next_multiple_of(c);
    let mut best = start;
    for d in divisors(&shapes) {
        let Some(bound) = bound_for(&shapes, v, c, total, start, d) else {
            return Ok(None);
        };
        best = best.max(bound);
    }
    Ok(usize::try_from(best).ok())
}

/// The distinct `d` and the gcds of pairs of them (above 1), largest first, at most
/// [`MAX_DIVISORS`].
fn divisors(shapes: &[Shape]) -> Vec<u128> {
    let mut steps: Vec<u128> = shapes.iter().map(|s| s.d).collect();
    steps.sort_unstable();
    steps.dedup();
    let mut out = steps.clone();
    for (i, &a) in steps.iter().enumerate() {
        for &b in &steps[i + 1..] {
            out.push(gcd_u128(a, b));
        }
    }
    out.retain(|&d| d > 1);
    out.sort_unstable_by(|a, b| b.cmp(a));
    out.dedup();
    out.truncate(MAX_DIVISORS);
    out
}

/// The bound for one `D` (module doc), `None` on overflow.
fn bound_for(
    shapes: &[Shape],
    v: u128,
    c: u128,
    total: u128,
    start: u128,
    d: u128,
) -> Option<u128> {
    let m = start / d;
    let regular = v.checked_mul(d)?.checked_mul(m)?;
    if regular >= total {
        return Some(start);
    }
    let need = total - regular;
    // Shards each special shape may touch, at the period's smallest size (the most).
    let special: Vec<(u128, u128, u128)> = shapes
        .iter()
        .filter(|s| s.d % d != 0)
        .map(|s| {
            let touch = if s.whole {
                1
            } else {
                ((s.e - 1) / start + 2).min(v)
            };
            (touch, s.e, s.count)
        })
        .collect();
    let excess = |r: u128| -> Option<u128> {
        let mut sum = 0u128;
        for &(touch, e, count) in &special {
            sum = sum.checked_add(touch.checked_mul(r)?.min(e).checked_mul(count)?)?;
        }
        Some(v.checked_mul(r)?.min(sum))
    };
    let end = d.checked_mul(m + 1)?;
    // Multiples of coll in [start, end): start + j·c for j < steps.
    let steps = (end - start).div_ceil(c);
    let (mut lo, mut hi) = (0u128, steps);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let s = start + mid * c;
        if excess(s - d * m)? >= need {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    if lo < steps {
        Some(start + lo * c)
    } else {
        end.checked_next_multiple_of(c)
    }
}
