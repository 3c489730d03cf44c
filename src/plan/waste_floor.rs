//! The waste floor: a tenth lower bound on `S`, for **one** buffer, taken by
//! [`super::multi`] where a one-buffer plan is above [`super::floor::floor_shard_sum`] (the
//! search costs up to some tens of milliseconds, so it runs only where the plan leaves a gap,
//! and only below the plan's size). It is the residue floor ([`super::residue_floor`]) with a
//! budget of waste: the shards need not hold exactly `m` pieces each, only at most
//! `M = ⌊S/D⌋`, and the pieces they leave empty sum to exactly `W = V·M − n_A`.
//!
//! **Why.** In a Qwen3-30B-A3B layer at `rows:16`, `V = 64` (pieces of 4,096 elements), the
//! 384 expert tensors are 384 pieces each, `gate/up_proj` cut at multiples of 8 pieces and
//! `down_proj` at multiples of 3. At `S = 2,378` pieces the layer leaves 64 pieces of room in
//! all, but `2,378 ≡ 74 (mod 384)`: a shard of whole experts and two cut ones holds
//! `y − y' ≡ 74` where `y`, `y'` are the parts of the experts crossing its two boundaries; from
//! a cut at a multiple of 8 (or 3), `74` away is a cut at neither unless pieces go empty, about
//! two per shard, and the five attention tensors fix only a few shards. The residue floor
//! (no waste) stops at 2,378, the plan has 2,379.
//!
//! **Proof.** Let `D | gcd(e_t, g_t)` for the tensors `A` (every part of one inside a shard is
//! a multiple of `D`, see [`super::piece_floor`]); sizes below are in pieces of `D`. Take a
//! layout with shard size `S`, `M = ⌊S/D⌋`, and let every `t ∈ A` have `e_t ≤ M` (so
//! `e_t·D ≤ S`: no tensor of `A` has two boundaries strictly inside it). Shard `r` holds
//! `a_r ≤ M` pieces of `A` (a multiple of `D`, at most `S`); `Σ a_r = n_A`, so the *waste*
//! `w_r = M − a_r ≥ 0` sums to `W = V·M − n_A`. Shard `r`'s part of `A` is the tail of the
//! tensor of `A` crossing its left boundary (if one does), the tensors of `A` wholly inside it
//! and the head of the one crossing its right boundary; a head is `g_t·i` with `0 < g_t·i < e_t`
//! (a block edge strictly inside), its tail `e_t − g_t·i`; shard 0 has no tail and shard
//! `V − 1` no head. *Rare* tensors (shapes of at most [`super::residue_floor::RARE`] tensors,
//! at most [`MAX_RARE`] of them) are followed one by one: each lies whole in one shard or
//! crosses one boundary. The others (*frequent*) are relaxed: any number of them may cross
//! boundaries, and those wholly inside a shard sum to a multiple of `X`, the gcd of their
//! sizes. So, modulo `X`, `tail_r + rare_r + head_r + w_r ≡ M`; the relaxation also drops
//! every bound on room (only residues are kept) and asks only `Σ w_r ≤ W`. With no frequent
//! tensor the frequent part is 0, and any modulus keeps the relaxation true; `M + 1` is taken
//! (capped at [`MAX_MODULUS`]). A search over the shards in order (the state: residue of the
//! tail, rare tensors used, least waste so far) that finds no assignment proves that no
//! layout has `⌊S/D⌋ = M`. From `M_0 = ⌈n_A/V⌉` (below it the shards cannot hold `A`) the
//! levels are tried upwards while each is proved empty, at most [`MAX_LEVELS`]; if `M_0..M`
//! are empty, `S ≥ ⌈(M + 1)·D⌉_coll`. A level whose bound would pass `cap` (a size known to
//! have a layout) cannot be proved empty and is not searched.
//!
//! **Work.** Only for `V ≤` [`MAX_RANKS`], `W ≤` [`MAX_WASTE`], `X ≤` [`MAX_MODULUS`]; at most
//! [`MAX_STATES`] states per shard and [`MAX_WORK`] transitions in all; past any limit the
//! level counts as not proved (no bound from it). Every sum and product of sizes is checked;
//! inside the search, residues are below `X ≤ 2^16` and waste at most `W ≤ 256`, so its sums
//! of a few of them cannot overflow.

use std::collections::BTreeMap;

use super::fit::gcd_u128;
use super::residue_floor::RARE;
use super::Item;

/// At most this many rare tensors (their subsets are enumerated per shard).
pub const MAX_RARE: usize = 8;
/// The search runs only up to this many ranks.
pub const MAX_RANKS: usize = 64;
/// The largest waste budget `W`, in pieces, searched.
pub const MAX_WASTE: u128 = 256;
/// The largest modulus `X`, in pieces (residue tables are this long).
pub const MAX_MODULUS: u128 = 1 << 16;
/// At most this many `(residue, rare used)` states per shard.
pub const MAX_STATES: usize = 1 << 16;
/// At most this many transitions in all, over every level.
pub const MAX_WORK: u64 = 1 << 22;
/// At most this many levels `M` above `⌈n_A/V⌉` are tried.
pub const MAX_LEVELS: usize = 4;
/// At most this many distinct shapes in `A` (each has a residue table).
pub const MAX_SHAPES: usize = 64;

/// The waste lower bound on one buffer's shard size with pieces of `d` elements (module doc),
/// searching only levels whose bound is at most `cap`; `None` where it does not apply, proves
/// no level empty, or stops at a limit.
pub fn waste_floor(
    items: &[Item],
    world: usize,
    coll: usize,
    d: usize,
    cap: usize,
) -> Option<usize> {
    if world == 0 || world > MAX_RANKS || coll == 0 || d == 0 {
        return None;
    }
    let d128 = d as u128;
    // A's shapes in pieces: (e, g, count).
    let mut shapes: Vec<(u128, u128, usize)> = Vec::new();
    for t in items {
        let (e, g) = (t.numel as u128, t.block as u128);
        if gcd_u128(e, g) % d128 != 0 {
            continue;
        }
        let (e, g) = (e / d128, g / d128);
        match shapes.iter_mut().find(|s| s.0 == e && s.1 == g) {
            Some(s) => s.2 += 1,
            None => shapes.push((e, g, 1)),
        }
    }
    if shapes.len() > MAX_SHAPES {
        return None;
    }
    let mut n_a = 0u128;
    for &(e, _, n) in &shapes {
        n_a = n_a.checked_add(e.checked_mul(n as u128)?)?;
    }
    if n_a == 0 {
        return None;
    }
    let v = world as u128;
    let largest = shapes.iter().map(|s| s.0).max()?;
    let mut work = 0u64;
    let first = n_a.div_ceil(v);
    let mut proved: Option<u128> = None;
    for level in 0..MAX_LEVELS as u128 {
        let m = first.checked_add(level)?;
        let bound = m.checked_add(1)?.checked_mul(d128)?;
        if largest > m || bound.checked_next_multiple_of(coll as u128)? > cap as u128 {
            break;
        }
        let waste = v.checked_mul(m)?.checked_sub(n_a)?;
        if waste > MAX_WASTE {
            break;
        }
        let search = Search::new(&shapes, m, waste, world)?;
        match search.feasible(&mut work) {
            Some(false) => proved = Some(m),
            _ => break,
        }
    }
    let m = proved?;
    let bound = m.checked_add(1)?.checked_mul(d128)?;
    usize::try_from(bound.checked_next_multiple_of(coll as u128)?).ok()
}

/// One kind of crossing: the residues (mod `X`) of its heads and its size.
struct Crossing {
    /// `e mod X`.
    e: u64,
    /// `heads[h]`: some head `g·i`, `0 < g·i < e`, is `≡ h (mod X)`.
    heads: Vec<bool>,
    /// The rare tensor crossing (`None`: a frequent shape).
    rare: Option<usize>,
}

/// The relaxed problem of the module doc, modulo `x`.
struct Search {
    /// `M mod x`.
    m: u64,
    waste: u64,
    world: usize,
    /// The modulus, at most [`MAX_MODULUS`] (so every residue sum here fits in 64 bits).
    x: u64,
    /// Sizes mod `x` of the rare tensors.
    rare: Vec<u64>,
    /// Bits of each shape's rare tensors (interchangeable: a set keeps the lowest bits).
    groups: Vec<u32>,
    crossings: Vec<Crossing>,
}

impl Search {
    fn new(shapes: &[(u128, u128, usize)], m: u128, waste: u128, world: usize) -> Option<Self> {
        let mut x = 0u128;
        let mut rare_sizes: Vec<(u128, u128)> = Vec::new();
        let mut frequent: Vec<(u128, u128)> = Vec::new();
        let mut groups: Vec<u32> = Vec::new();
        for &(e, g, n) in shapes {
            if n <= RARE {
                if rare_sizes.len() + n > MAX_RARE {
                    return None;
                }
                let first = rare_sizes.len();
                groups.push(((1u32 << n) - 1) << first);
                for _ in 0..n {
                    rare_sizes.push((e, g));
                }
            } else {
                x = gcd_u128(x, e);
                frequent.push((e, g));
            }
        }
        if rare_sizes.len() > MAX_RARE {
            return None;
        }
        // No frequent tensor: their part is 0, a multiple of any modulus.
        if x == 0 {
            x = m.checked_add(1)?.min(MAX_MODULUS);
        }
        if x > MAX_MODULUS {
            return None;
        }
        let heads = |e: u128, g: u128| -> Option<Vec<bool>> {
            let mut table = vec![false; x as usize];
            let count = (e - 1) / g;
            // Residues of g·i repeat with period x / gcd(g, x).
            let period = x / gcd_u128(g, x);
            let mut h = 0u128;
            for _ in 0..count.min(period) {
                h = h.checked_add(g % x)? % x;
                table[h as usize] = true;
            }
            Some(table)
        };
        let mut crossings = Vec::new();
        let small = |v: u128| u64::try_from(v % x).ok();
        for &(e, g) in &frequent {
            crossings.push(Crossing {
                e: small(e)?,
                heads: heads(e, g)?,
                rare: None,
            });
        }
        for (i, &(e, g)) in rare_sizes.iter().enumerate() {
            crossings.push(Crossing {
                e: small(e)?,
                heads: heads(e, g)?,
                rare: Some(i),
            });
        }
        Some(Search {
            m: small(m)?,
            waste: u64::try_from(waste).ok()?,
            world,
            x: u64::try_from(x).ok()?,
            rare: rare_sizes
                .iter()
                .map(|&(e, _)| small(e))
                .collect::<Option<Vec<u64>>>()?,
            groups,
            crossings,
        })
    }

    /// Whether some relaxed assignment exists; `None` past a limit. Each shard is three
    /// steps: the rare tensors wholly inside it (the residue left for the head and the waste),
    /// the waste (`w` lowers that residue by `w` at a cost of `w`), and the crossing of its
    /// right boundary (a head of exactly the residue left).
    fn feasible(&self, work: &mut u64) -> Option<bool> {
        let x = self.x;
        let xs = x as usize;
        let all = (1u32 << self.rare.len()) - 1;
        let mref = self.m;
        let mut spend = |n: usize| -> Option<()> {
            *work = work.saturating_add(n as u64);
            (*work <= MAX_WORK).then_some(())
        };
        // Least waste so far at each residue, and the residues set (reset after each use).
        let mut cost = vec![u64::MAX; xs];
        let mut touched: Vec<usize> = Vec::new();
        // (tail residue, rare used) and the least waste so far, one entry per pair.
        let mut layer: Vec<((u64, u32), u64)> = vec![((0, 0), 0)];
        for _ in 0..self.world - 1 {
            // Rare tensors placed -> (residue left for head and waste, least waste so far).
            let mut left: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
            for &((tail, used), spent) in &layer {
                let free = all & !used;
                let mut subset = free;
                loop {
                    spend(1)?;
                    let base = (mref + 2 * x - tail - self.sum(subset)) % x;
                    left.entry(self.canonical(used | subset))
                        .or_default()
                        .push((base, spent));
                    if subset == 0 {
                        break;
                    }
                    subset = (subset - 1) & free;
                }
            }
            let mut next: Vec<((u64, u32), u64)> = Vec::new();
            for (&placed, bases) in &left {
                // Spread each base down by the waste it may still spend; a residue already as
                // cheap stops the walk (its own spread, done or to come, covers the rest).
                for &(base, spent) in bases {
                    let mut b = base as usize;
                    let mut c = spent;
                    while c <= self.waste && c < cost[b] {
                        spend(1)?;
                        if cost[b] == u64::MAX {
                            touched.push(b);
                        }
                        cost[b] = c;
                        b = if b == 0 { xs - 1 } else { b - 1 };
                        c += 1;
                    }
                }
                for &b in &touched {
                    spend(1 + self.crossings.len())?;
                    let spent = cost[b];
                    let head = b as u64;
                    let mut push = |key: (u64, u32)| next.push((key, spent));
                    if head == 0 {
                        push((0, placed));
                    }
                    for c in &self.crossings {
                        if !c.heads[b] {
                            continue;
                        }
                        let key = match c.rare {
                            Some(i) if placed & (1 << i) != 0 => continue,
                            Some(i) => self.canonical(placed | (1 << i)),
                            None => placed,
                        };
                        push(((c.e + x - head) % x, key));
                    }
                }
                for &b in &touched {
                    cost[b] = u64::MAX;
                }
                touched.clear();
            }
            // One entry per state, its least waste (sorted by state, then waste).
            spend(next.len())?;
            next.sort_unstable();
            next.dedup_by_key(|entry| entry.0);
            if next.is_empty() {
                return Some(false);
            }
            if next.len() > MAX_STATES {
                return None;
            }
            layer = next;
        }
        // The last shard holds every rare tensor left, whole, and crosses nothing.
        Some(layer.iter().any(|&((tail, used), spent)| {
            let need = (mref + 2 * x - tail - self.sum(all & !used)) % x;
            need <= self.waste - spent
        }))
    }

    /// `set` with each shape's rare tensors moved to its lowest bits (they are
    /// interchangeable, so the states of equal counts are one).
    fn canonical(&self, set: u32) -> u32 {
        self.groups.iter().fold(0, |acc, &g| {
            let n = (set & g).count_ones();
            acc | (((1u32 << n) - 1) << g.trailing_zeros())
        })
    }

    /// Residue of the sizes of the rare tensors in `set` (each is below `x`).
    fn sum(&self, set: u32) -> u64 {
        (0..self.rare.len())
            .filter(|&i| set & (1 << i) != 0)
            .fold(0, |acc, i| (acc + self.rare[i]) % self.x)
    }
}
