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
//! multiple of `d`, so their sum `x` is one, and `V·x ≥ M_F`: `Σ S ≥ x ≥ ⌈M_F/V⌉_d`. With
//! `V·Σ S ≥ E` for all tensors, `Σ S ≥ min(T, max(⌈M_F/V⌉_d, ⌈E/V⌉_coll))`. `F` only changes
//! where `T − 1` passes half a tensor, so it suffices to take, for each tensor size `e_j`
//! (largest first), `T = ⌊e_j/2⌋ + 1` and `F` = the tensors of at least `e_j` elements. The
//! floor is the largest of these bounds. Every product is taken in `u128`; a lattice past
//! 64 bits cannot be any buffer's size, so the threshold's bound is `T` alone then.

use super::fit::gcd;
use super::Item;

/// The common-step lower bound on `Σ S_b` for any number of buffers (module doc); `None`
/// when the inputs are empty or zero.
pub fn step_floor(items: &[Item], world: usize, coll: usize) -> Option<usize> {
    if items.is_empty() || world == 0 || coll == 0 {
        return None;
    }
    let (v, c) = (world as u128, coll as u128);
    let total: u128 = items.iter().map(|t| t.numel as u128).sum();
    let share = total.div_ceil(v).next_multiple_of(c);
    let mut by_size: Vec<&Item> = items.iter().collect();
    by_size.sort_by_key(|t| std::cmp::Reverse(t.numel));
    // `step`: the gcd of F's lattices; `None` once one passes 64 bits (no buffer holds it).
    let (mut mass, mut step, mut best) = (0u128, Some(0u128), 0u128);
    for (j, t) in by_size.iter().enumerate() {
        mass += t.numel as u128;
        step = step
            .zip(lattice(t.block, coll))
            .map(|(s, l)| gcd_u128(s, l));
        // Ties belong to the same F: take the bound after the last of them.
        if by_size.get(j + 1).is_some_and(|n| n.numel == t.numel) {
            continue;
        }
        let threshold = (t.numel / 2) as u128 + 1;
        let bound = match step {
            Some(d) => threshold.min(mass.div_ceil(v).next_multiple_of(d).max(share)),
            None => threshold,
        };
        best = best.max(bound);
    }
    usize::try_from(best.max(share)).ok()
}

/// `lcm(coll, g)`, `None` past 64 bits.
fn lattice(block: usize, coll: usize) -> Option<u128> {
    let l = (block / gcd(block, coll)) as u128 * coll as u128;
    (l <= u64::MAX as u128).then_some(l)
}

fn gcd_u128(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}
