//! Feasibility of one shard size for one tensor order: greedy earliest fit.
//!
//! Given the shard size `S`, each tensor is placed at the smallest valid start at or after the
//! end of the previous one. A start `s` is valid when every shard boundary strictly inside
//! `[s, s + e)` lies a whole number of blocks from `s` (constraint 1 of `planner.md`), and `s` is
//! a multiple of the tensor's start alignment. Because an earlier end never removes a valid
//! start for the next tensor, the greedy finds a layout whenever any layout exists for this
//! order and `S` (planner.md §3); the planner relies on that exactness.

use super::Item;

/// Where a tensor may start inside one shard, derived from integers only.
///
/// With `d = B − s` the distance to the next boundary `B`, a start is valid iff `e ≤ d` (no
/// boundary inside), or `d ≡ 0 (mod g)` and either a second boundary is not inside
/// (`e − d ≤ S`) or every later boundary is aligned too (`g | S`).
fn start_in_shard(c: usize, item: &Item, shard: usize) -> Option<usize> {
    // Past usize::MAX there is no boundary: a start whose next boundary overflows is useless
    // anyway, since no buffer that large can be addressed.
    let boundary = (c / shard + 1).checked_mul(shard)?;
    let first = c.checked_next_multiple_of(item.align)?;
    if first >= boundary {
        return None;
    }
    if item.numel <= boundary - first {
        return Some(first);
    }
    // Latest start whose second boundary is still outside the tensor (only matters if g ∤ S).
    let last = if shard % item.block == 0 {
        boundary - 1
    } else {
        match boundary.checked_add(shard) {
            Some(second) => second.checked_sub(item.numel)?,
            None => boundary - 1, // the second boundary lies past any addressable end
        }
    };
    let s = aligned_start(first, boundary % item.block, item.block, item.align)?;
    (s <= last.min(boundary - 1)).then_some(s)
}

/// The earliest valid start `≥ c` for `item` with shard size `shard`, if any exists.
///
/// Validity is periodic in `s mod S` (the alignment divides `S`), so looking at the rest of the
/// current shard and at one full shard after it is exhaustive.
pub fn earliest_start(c: usize, item: &Item, shard: usize) -> Option<usize> {
    start_in_shard(c, item, shard).or_else(|| {
        let next = (c / shard + 1).checked_mul(shard)?;
        start_in_shard(next, item, shard)
    })
}

/// Places `items` in order with shard size `shard` on `world` ranks; returns the offsets, or
/// `None` when they do not fit in `world · shard` elements (or that product overflows).
pub fn greedy(items: &[Item], shard: usize, world: usize) -> Option<Vec<usize>> {
    let mut offsets = Vec::with_capacity(items.len());
    fits(items, shard, world, |s| offsets.push(s)).then_some(offsets)
}

/// Whether `items` fit in order; calls `place` with each start. Stops as soon as the tensors
/// still to place cannot fit behind the cursor. Sizes whose sum or product overflows `usize`
/// do not fit.
pub fn fits(items: &[Item], shard: usize, world: usize, mut place: impl FnMut(usize)) -> bool {
    if shard == 0 {
        return false;
    }
    let Some(capacity) = shard.checked_mul(world) else {
        return false;
    };
    let Some(mut rest) = total_numel(items) else {
        return false;
    };
    let mut cursor = 0usize;
    for item in items {
        let Some(s) = earliest_start(cursor, item, shard) else {
            return false;
        };
        rest -= item.numel;
        // `rest` elements still follow; they need room behind this tensor.
        match s.checked_add(item.numel) {
            Some(end) if end <= capacity && capacity - end >= rest => cursor = end,
            _ => return false,
        }
        place(s);
    }
    true
}

/// `Σ numel`, `None` on overflow.
pub fn total_numel(items: &[Item]) -> Option<usize> {
    items
        .iter()
        .try_fold(0usize, |acc, t| acc.checked_add(t.numel))
}

/// Smallest `s ≥ lo` with `s ≡ r (mod g)` and `s ≡ 0 (mod a)` (Chinese remainder theorem);
/// `None` when no such `s` exists or it overflows.
fn aligned_start(lo: usize, r: usize, g: usize, a: usize) -> Option<usize> {
    if a == 1 {
        return lo.checked_add(steps_to_residue(lo, r, g));
    }
    let h = gcd(a, g);
    if r % h != 0 {
        return None;
    }
    let m = g / h;
    let x = ((r / h) as u128 * mod_inverse((a / h) % m, m) as u128 % m.max(1) as u128) as usize;
    let period = a.checked_mul(m)?;
    // x < m, so a·x < a·m = period.
    let s0 = a * x;
    lo.checked_add(steps_to_residue(lo, s0, period))
}

/// `(r − lo) mod p` for `r < p`, without overflow.
fn steps_to_residue(lo: usize, r: usize, p: usize) -> usize {
    let have = lo % p;
    if r >= have {
        r - have
    } else {
        p - (have - r)
    }
}

/// Inverse of `x` modulo `m` (`gcd(x, m) = 1`); 0 when `m ≤ 1`.
fn mod_inverse(x: usize, m: usize) -> usize {
    if m <= 1 {
        return 0;
    }
    let (mut old_r, mut r) = (x as i128, m as i128);
    let (mut old_s, mut s) = (1i128, 0i128);
    while r != 0 {
        let q = old_r / r;
        (old_r, r) = (r, old_r - q * r);
        (old_s, s) = (s, old_s - q * s);
    }
    old_s.rem_euclid(m as i128) as usize
}

/// Greatest common divisor.
pub fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Greatest common divisor of `u128`s (the floors' exact sums), by [`gcd`] where both fit 64
/// bits (a 128-bit remainder is a library call).
pub fn gcd_u128(a: u128, b: u128) -> u128 {
    match (u64::try_from(a), u64::try_from(b)) {
        (Ok(a), Ok(b)) => gcd(a as usize, b as usize) as u128,
        _ => {
            let (mut a, mut b) = (a, b);
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        }
    }
}

/// Least common multiple, `None` on overflow.
pub fn lcm(a: usize, b: usize) -> Option<usize> {
    (a / gcd(a, b)).checked_mul(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute force: scan every start of two periods.
    fn brute(c: usize, item: &Item, shard: usize) -> Option<usize> {
        (c..c + 3 * shard + item.numel).find(|&s| {
            s % item.align == 0
                && (s / shard + 1..)
                    .map(|k| k * shard)
                    .take_while(|&b| b < s + item.numel)
                    .all(|b| (b - s) % item.block == 0)
        })
    }

    #[test]
    fn earliest_start_matches_brute_force() {
        let mut checked = 0;
        for shard in [4usize, 6, 8, 9, 12] {
            for block in 1..=7 {
                for numel in 1..=30usize {
                    let block = block.min(numel);
                    for align in [1usize, 2, 4] {
                        if shard % align != 0 {
                            continue;
                        }
                        for c in 0..2 * shard {
                            let item = Item {
                                numel,
                                block,
                                align,
                            };
                            assert_eq!(
                                earliest_start(c, &item, shard),
                                brute(c, &item, shard),
                                "c={c} {item:?} S={shard}"
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked > 10_000);
    }

    #[test]
    fn aligned_start_solves_both_congruences() {
        for lo in 0..40 {
            for g in 1..10 {
                for a in [1, 2, 3, 4, 6] {
                    for r in 0..g {
                        let got = aligned_start(lo, r, g, a);
                        let want = (lo..lo + 200).find(|s| s % g == r && s % a == 0);
                        assert_eq!(got, want, "lo={lo} r={r} g={g} a={a}");
                    }
                }
            }
        }
    }
}
