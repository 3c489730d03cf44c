//! The pair floor: an eleventh lower bound on `Σ S_b`, for at most **two** buffers, taken by
//! [`super::multi`] where a plan of one or two buffers is above the other floors (it searches
//! the sums between the floor and the plan, one by one).
//!
//! **Why.** The other floors bound each buffer's size or padding from its own lattices. Where
//! a buffer is *off* the lattice of most of its tensors, its padding comes from how its shards
//! are cut, which none of them sees. In a DeepSeek-V3 MoE layer at `rows:1`, `V = 1024`, every
//! part of a `gate/up_proj` expert inside a shard is a multiple of 7,168, and a buffer holding
//! the experts with `S ≢ 0 (mod 7,168)` pads `S mod 7,168` in every shard between two of them,
//! unless runs of `down_proj` (parts multiples of 2,048) carry the residue across boundaries.
//! Over every split `S_a + S_b` of a sum, every count of each shape in each buffer and this
//! padding, no two-buffer layout has `Σ S` below 11,238,400 (the floors before: 11,237,888).
//!
//! **Proof.** Fix a sum `Σ` (a multiple of `coll`) and take any layout with at most two
//! buffers and `Σ S = Σ`; its padding is `P = V·Σ − E`. Let `o` be a shape of the largest
//! tensor, with `e_o ≥ 2Σ`: it contains a whole shard in any buffer, so the buffer `b` holding
//! one of its tensors has `S_b` a multiple of `lcm(g_o, coll)`; the other buffer `a` (perhaps
//! none) has `S_a = Σ − S_b`. A tensor `(e, g)` can only be in a buffer with `g ≤ S` and, where
//! `e ≥ 2S`, `g | S` (planner.md §2). Each buffer's padding `V·S − C` (`C` its elements) is at
//! least the *segment bound* below, `W_a` and `W_b`, so `C_a`, a sum of whole tensors with a
//! count of each shape in its allowed range, lies in `[V·S_a − P + W_b, V·S_a − W_a]`. A split
//! where no count vector reaches that window, for every split, excludes `Σ`; the floor is the
//! first sum from the floor so far up that is not excluded.
//!
//! *Segment bound* of one buffer of size `S` for a modulus `D`, `r = S mod D`: call a tensor
//! *regular* when `D | gcd(e, g)`; each part of it inside a shard is a multiple of `D` (see
//! [`super::piece_floor`]). A boundary strictly inside no irregular tensor is *free of them*;
//! those boundaries and the buffer's two ends cut the shards into segments. An irregular tensor
//! lies inside one segment (every boundary inside it is within the segment), so a segment of
//! `L` shards holds regular parts (`≡ 0`) and whole irregular tensors: its padding is
//! `≡ L·r − Σ e_t (mod D)`. For a segment whose irregular tensors all have `D | e` this is
//! `f(L) = L·r mod D`; the others (at most `R` segments, `R` the irregular tensors with
//! `D ∤ e`) are counted as 0. A tensor crosses at most `⌈e/S⌉` boundaries, and at most one
//! where `g ∤ S`, so the segments use at most `B = Σ` of those boundaries (capped at `V − 1`)
//! over the irregular tensors that may be in the buffer (more tensors only allow more). A
//! segment longer than `p = D/gcd(D, r)` splits into one of `p` shards (`f(p) = 0`) and the
//! rest, same padding, fewer boundaries; so `L ≤ p`. The least total padding of `V` shards in
//! segments using at most `B` boundaries is then bounded from below by Lagrange duality: for
//! any `λ ≥ 0`, each normal segment pads at least `μ·L − λ(L − 1)` with
//! `μ = min_{1≤L≤p} (f(L) + λ(L − 1))/L`, each of the `R` others at least `0 ≥ μ·L − λ(L − 1) − w`
//! with `w = max_{L≤p} (μ·L − λ(L − 1))`, and the boundaries used are at most `B`: the buffer
//! pads at least `V·μ − λ·B − R·w`. `λ` runs over `0` and `(L·r − f(L))/(L − 1)` for the `L`
//! where `f` reaches a new low (the points where a segment of `L` shards pads as little as `L`
//! single shards); `D` over the distinct `gcd(e, g)` of the shapes with the most elements, at
//! most [`MAX_MODULI`]. Every value is exact (rationals over a common denominator, checked).
//!
//! **Work.** Units of at most [`MAX_SHAPES`] shapes; at most [`MAX_SUMS`] sums,
//! [`MAX_SPLITS`] splits per sum and [`MAX_NODES`] units of work in all (splits, count vectors
//! visited, residue periods of the segment bounds computed); past a limit
//! the sum is not excluded (the bound stops there, still true). Overflow skips the bound.

use std::collections::HashMap;

use super::fit::gcd_u128;
use super::Item;
use crate::{Error, Result};

/// Units of more distinct shapes than this are not searched.
pub const MAX_SHAPES: usize = 24;
/// Sums examined per call, at most.
pub const MAX_SUMS: usize = 64;
/// Sizes of the buffer holding the largest tensor per sum, at most.
pub const MAX_SPLITS: usize = 4096;
/// Work units over the whole call, at most: a split, a count vector visited, or a segment bound
/// computed (its residue period).
pub const MAX_NODES: usize = 1 << 18;
/// Moduli `D` of the segment bound per buffer, at most.
pub const MAX_MODULI: usize = 8;
/// Residue periods `p` longer than this give no segment bound (the dual costs `p` per `λ`).
pub const MAX_PERIOD: u128 = 4096;

/// What [`pair_floor`] proved: the bound, and the split and counts it could not exclude.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairFloor {
    /// No layout with at most `k` buffers has a smaller `Σ S`.
    pub bound: usize,
    /// At `Σ = bound`, the first split `(S_a, S_b)` not excluded and the tensors of each of
    /// `items` in buffer `a` (`true`), if the search stopped at one (not at a limit or the cap).
    pub witness: Option<PairWitness>,
}

/// A split and assignment the pair floor could not exclude (a candidate layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairWitness {
    /// Shard size of buffer `a` (0: one buffer).
    pub shard_a: usize,
    /// Shard size of buffer `b` (holding the largest tensor).
    pub shard_b: usize,
    /// `in_a[i]`: item `i` goes to buffer `a`.
    pub in_a: Vec<bool>,
}

/// One shape: elements, block, count (all tensors of it interchangeable).
#[derive(Clone, Copy, Debug)]
struct Shape {
    e: u128,
    g: u128,
    n: u128,
}

/// The pair lower bound on `Σ S_b` over layouts with at most `k ≤ 2` buffers, searched from
/// `start` (a bound already proved) up to `cap` (module doc); `Ok(None)` where it does not
/// apply (`k > 2`, too many shapes, the largest tensor not forced, or an overflow). Errors on
/// empty input or a zero `world` or `coll`.
pub fn pair_floor(
    items: &[Item],
    world: usize,
    coll: usize,
    k: usize,
    start: usize,
    cap: usize,
) -> Result<Option<PairFloor>> {
    if items.is_empty() || world == 0 || coll == 0 {
        return Err(Error::BadInput {
            op: "pair_floor",
            what: format!("{} tensors, V = {world}, coll {coll}", items.len()),
            reason: "needs tensors, ranks and a collective alignment".into(),
        });
    }
    if k == 0 || k > 2 {
        return Ok(None);
    }
    let mut shapes: Vec<Shape> = Vec::new();
    for t in items {
        let (e, g) = (t.numel as u128, t.block as u128);
        match shapes.iter_mut().find(|s| s.e == e && s.g == g) {
            Some(s) => s.n += 1,
            None => shapes.push(Shape { e, g, n: 1 }),
        }
        if shapes.len() > MAX_SHAPES {
            return Ok(None);
        }
    }
    // The pivot: a shape of the largest tensor.
    shapes.sort_by(|a, b| b.e.cmp(&a.e).then(a.g.cmp(&b.g)));
    let search = Search::new(shapes, world as u128, coll as u128, k);
    let Some(mut search) = search else {
        return Ok(None);
    };
    let found = search.run(start as u128, cap as u128);
    let Some((bound, split)) = found else {
        return Ok(None);
    };
    let Ok(bound) = usize::try_from(bound) else {
        return Ok(None);
    };
    let witness = split.map(|(sa, sb, counts)| search.witness(items, sa, sb, &counts));
    Ok(Some(PairFloor {
        bound,
        witness: witness.flatten(),
    }))
}

/// The search of one call: shapes (largest first), sizes, the budget and a cache of segment
/// bounds.
struct Search {
    shapes: Vec<Shape>,
    v: u128,
    c: u128,
    k: usize,
    total: u128,
    moduli: Vec<u128>,
    nodes: usize,
    /// `(r, D, B, R)` → segment bound.
    cache: HashMap<(u128, u128, u128, u128), u128>,
}

/// A split not excluded: `S_a`, `S_b` and the count of each shape in `a`.
type Split = (u128, u128, Vec<u128>);

impl Search {
    fn new(shapes: Vec<Shape>, v: u128, c: u128, k: usize) -> Option<Self> {
        let mut total = 0u128;
        for s in &shapes {
            total = total.checked_add(s.e.checked_mul(s.n)?)?;
        }
        // Moduli: the distinct gcd(e, g), the shapes of the most elements first.
        let mut by_mass: Vec<&Shape> = shapes.iter().collect();
        by_mass.sort_by_key(|s| std::cmp::Reverse(s.e * s.n));
        let mut moduli: Vec<u128> = Vec::new();
        for s in by_mass {
            let d = gcd_u128(s.e, s.g);
            if d > 1 && !moduli.contains(&d) && moduli.len() < MAX_MODULI {
                moduli.push(d);
            }
        }
        Some(Search {
            shapes,
            v,
            c,
            k,
            total,
            moduli,
            nodes: 0,
            cache: HashMap::new(),
        })
    }

    /// The first sum from `start` (rounded up to `coll`) not excluded, with the split found
    /// there if the search stopped at one; `None` on overflow or an inapplicable pivot.
    fn run(&mut self, start: u128, cap: u128) -> Option<(u128, Option<Split>)> {
        let mut sum = start.checked_next_multiple_of(self.c)?;
        let pivot = self.shapes[0];
        let lattice = pivot.g.checked_mul(self.c / gcd_u128(pivot.g, self.c))?;
        for _ in 0..MAX_SUMS {
            if sum >= cap {
                break;
            }
            // The pivot is forced in every buffer only while e_o ≥ 2Σ.
            if pivot.e < sum.checked_mul(2)? {
                return Some((sum, None));
            }
            match self.excluded(sum, lattice)? {
                Verdict::Excluded => sum = sum.checked_add(self.c)?,
                Verdict::Open(split) => return Some((sum, split)),
            }
        }
        Some((sum, None))
    }

    /// Whether no layout has `Σ S = sum` (module doc); `None` on overflow.
    fn excluded(&mut self, sum: u128, lattice: u128) -> Option<Verdict> {
        let capacity = self.v.checked_mul(sum)?;
        let Some(padding) = capacity.checked_sub(self.total) else {
            return Some(Verdict::Excluded);
        };
        let splits = sum / lattice;
        if splits > MAX_SPLITS as u128 {
            return Some(Verdict::Open(None));
        }
        for j in 1..=splits {
            let sb = j * lattice;
            let sa = sum - sb;
            // One buffer only: the pivot's buffer is all of it.
            if self.k == 1 && sa != 0 {
                continue;
            }
            self.nodes += 1;
            if self.nodes > MAX_NODES {
                return Some(Verdict::Open(None));
            }
            if let Some(counts) = self.split_open(sa, sb, padding)? {
                return Some(Verdict::Open(Some((sa, sb, counts))));
            }
        }
        Some(Verdict::Excluded)
    }

    /// A count of each shape in `a` that the split `(sa, sb)` does not exclude, if any
    /// (`None` inside: overflow).
    fn split_open(&mut self, sa: u128, sb: u128, padding: u128) -> Option<Option<Vec<u128>>> {
        let mut ranges: Vec<(u128, u128)> = Vec::with_capacity(self.shapes.len());
        let (mut avail_a, mut avail_b) = (Vec::new(), Vec::new());
        for (i, s) in self.shapes.iter().enumerate() {
            let in_a = sa > 0 && allowed(s, sa)?;
            let in_b = allowed(s, sb)?;
            let lo = if in_b { 0 } else { s.n };
            let mut hi = if in_a { s.n } else { 0 };
            if i == 0 {
                // Buffer b holds at least one pivot tensor.
                if !in_b {
                    return Some(None);
                }
                hi = hi.min(s.n - 1);
            }
            if lo > hi {
                return Some(None);
            }
            ranges.push((lo, hi));
            if hi > 0 {
                avail_a.push(Shape { n: hi, ..*s });
            }
            if lo < s.n {
                avail_b.push(Shape { n: s.n - lo, ..*s });
            }
        }
        let wa = if sa > 0 {
            self.segments(sa, &avail_a)?
        } else {
            0
        };
        let wb = self.segments(sb, &avail_b)?;
        let Some(room) = padding.checked_sub(wa).and_then(|p| p.checked_sub(wb)) else {
            return Some(None);
        };
        // C_a in [V·S_a − P + W_b, V·S_a − W_a], a window of `room` elements.
        let top = self.v.checked_mul(sa)?.checked_sub(wa);
        let Some(top) = top else {
            return Some(None);
        };
        let low = top.saturating_sub(room);
        Some(self.counts_in(&ranges, low, top))
    }

    /// A count vector within `ranges` whose elements sum into `[low, top]`, by depth-first
    /// search with the sums the rest can still reach; past the node budget the search answers
    /// with the ranges' lower ends (not excluded, so the bound stays true).
    fn counts_in(&mut self, ranges: &[(u128, u128)], low: u128, top: u128) -> Option<Vec<u128>> {
        let n = self.shapes.len();
        // Least and most the shapes from i on can add (they fit: at most the unit's total).
        let (mut least, mut most) = (vec![0u128; n + 1], vec![0u128; n + 1]);
        for i in (0..n).rev() {
            least[i] = least[i + 1] + self.shapes[i].e * ranges[i].0;
            most[i] = most[i + 1] + self.shapes[i].e * ranges[i].1;
        }
        let mut counts = vec![0u128; n];
        let bounds = Reach {
            least: &least,
            most: &most,
            low,
            top,
        };
        match self.walk(ranges, &bounds, 0, 0, &mut counts) {
            Walked::Found | Walked::Budget => Some(counts),
            Walked::None => None,
        }
    }

    fn walk(
        &mut self,
        ranges: &[(u128, u128)],
        reach: &Reach,
        i: usize,
        acc: u128,
        counts: &mut [u128],
    ) -> Walked {
        if acc + reach.least[i] > reach.top || acc + reach.most[i] < reach.low {
            return Walked::None;
        }
        if i == ranges.len() {
            return Walked::Found;
        }
        self.nodes += 1;
        if self.nodes > MAX_NODES {
            for (slot, r) in counts.iter_mut().zip(ranges).skip(i) {
                *slot = r.0;
            }
            return Walked::Budget;
        }
        let e = self.shapes[i].e;
        let (lo, hi) = ranges[i];
        // Counts whose sum can still land in the window.
        let need = reach.low.saturating_sub(acc + reach.most[i + 1]);
        let first = lo.max(need.div_ceil(e));
        let last = match reach.top.checked_sub(acc + reach.least[i + 1]) {
            Some(room) => hi.min(room / e),
            None => return Walked::None,
        };
        let mut x = first;
        while x <= last {
            counts[i] = x;
            match self.walk(ranges, reach, i + 1, acc + x * e, counts) {
                Walked::None => {}
                done => return done,
            }
            x += 1;
        }
        Walked::None
    }

    /// The largest segment bound over the moduli for a buffer of size `s` that may hold
    /// `avail` (module doc); `None` on overflow.
    fn segments(&mut self, s: u128, avail: &[Shape]) -> Option<u128> {
        let mut best = 0u128;
        for di in 0..self.moduli.len() {
            let d = self.moduli[di];
            let r = s % d;
            if r == 0 {
                continue;
            }
            let (mut crossings, mut rare) = (0u128, 0u128);
            for t in avail.iter().filter(|t| gcd_u128(t.e, t.g) % d != 0) {
                let each = if s % t.g == 0 { t.e.div_ceil(s) } else { 1 };
                crossings = crossings.saturating_add(t.n.saturating_mul(each));
                if t.e % d != 0 {
                    rare = rare.saturating_add(t.n);
                }
            }
            let crossings = crossings.min(self.v - 1);
            let key = (r, d, crossings, rare);
            let bound = match self.cache.get(&key) {
                Some(&b) => b,
                None => {
                    // Its work (the period, about, per λ) counts against the budget.
                    let period = d / gcd_u128(d, r);
                    self.nodes = self
                        .nodes
                        .saturating_add(usize::try_from(period).unwrap_or(usize::MAX));
                    let b = segment_bound(self.v, d, r, crossings, rare).unwrap_or(0);
                    self.cache.insert(key, b);
                    b
                }
            };
            best = best.max(bound);
        }
        Some(best)
    }

    /// The items of a split as a witness: the first `counts[i]` tensors of each shape go to `a`.
    fn witness(&self, items: &[Item], sa: u128, sb: u128, counts: &[u128]) -> Option<PairWitness> {
        let mut left = counts.to_vec();
        let in_a = items
            .iter()
            .map(|t| {
                let (e, g) = (t.numel as u128, t.block as u128);
                let i = self.shapes.iter().position(|s| s.e == e && s.g == g)?;
                let take = left[i] > 0;
                if take {
                    left[i] -= 1;
                }
                Some(take)
            })
            .collect::<Option<Vec<bool>>>()?;
        Some(PairWitness {
            shard_a: usize::try_from(sa).ok()?,
            shard_b: usize::try_from(sb).ok()?,
            in_a,
        })
    }
}

/// The outcome of one sum.
enum Verdict {
    Excluded,
    /// Not excluded: the split found, or `None` where a limit stopped the search.
    Open(Option<Split>),
}

/// The outcome of the count search.
enum Walked {
    Found,
    None,
    Budget,
}

/// The window of [`Search::counts_in`] and what the remaining shapes can add.
struct Reach<'a> {
    least: &'a [u128],
    most: &'a [u128],
    low: u128,
    top: u128,
}

/// Whether a tensor of `s` can lie in a buffer of shard size `size`: its block fits in a shard
/// and, where it contains a whole shard (`e ≥ 2S`), the block divides `S`.
fn allowed(s: &Shape, size: u128) -> Option<bool> {
    Some(size >= s.g && (size % s.g == 0 || s.e < size.checked_mul(2)?))
}

/// The segment bound of the module doc: the least padding of `v` shards with `r = S mod d`,
/// segments using at most `crossings` boundaries, `rare` of them free; `None` on overflow or
/// a period past [`MAX_PERIOD`].
fn segment_bound(v: u128, d: u128, r: u128, crossings: u128, rare: u128) -> Option<u128> {
    let p = d / gcd_u128(d, r);
    if p > MAX_PERIOD {
        return None;
    }
    let f = |l: u128| (l * r) % d;
    // λ = n/den candidates: 0, and the ties of a segment of L shards with L single ones, at
    // the lengths where f reaches a new low.
    let mut lambdas: Vec<(u128, u128)> = vec![(0, 1)];
    let mut low = f(1);
    for l in 2..=p {
        let fl = f(l);
        if fl < low {
            low = fl;
            lambdas.push((l * r - fl, l - 1));
        }
    }
    let mut best = 0u128;
    for (n, den) in lambdas {
        // μ = min_L (den·f(L) + n(L − 1)) / (den·L): keep the numerator `a` and the length `m`.
        let (mut a, mut m) = (den.checked_mul(f(1))?, 1u128);
        for l in 2..=p {
            let num = den.checked_mul(f(l))?.checked_add(n.checked_mul(l - 1)?)?;
            if num.checked_mul(m)? < a.checked_mul(l)? {
                (a, m) = (num, l);
            }
        }
        // Over the denominator den·m: V·μ − λ·B − R·w, w = max_L (a·L − n(L − 1)·m).
        let mut w = 0u128;
        for l in 1..=p {
            let gain = a.checked_mul(l)?;
            let cost = n.checked_mul(l - 1)?.checked_mul(m)?;
            w = w.max(gain.saturating_sub(cost));
        }
        let plus = v.checked_mul(a)?;
        let minus = n
            .checked_mul(crossings)?
            .checked_mul(m)?
            .checked_add(rare.checked_mul(w)?)?;
        if let Some(num) = plus.checked_sub(minus) {
            best = best.max(num.div_ceil(den.checked_mul(m)?));
        }
    }
    Some(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_of_seven_shards_carry_a_residue_of_a_seventh() {
        // r = 1,024 of D = 7,168: 7 shards in a row end on the lattice (p = 7). With 267
        // boundaries, 44 runs of 7 are free and the other shards pad 1,024 each (733,184);
        // the dual gives at least 729,600 of it.
        let b = segment_bound(1024, 7168, 1024, 267, 0).unwrap();
        assert!((729_600..=733_184).contains(&b), "{b}");
        // No boundary to spend: every shard pads r.
        assert_eq!(segment_bound(1024, 7168, 1024, 0, 0), Some(1024 * 1024));
        // On the lattice there is nothing to pad.
        assert_eq!(segment_bound(1024, 7168, 0, 0, 0), Some(0));
    }
}
