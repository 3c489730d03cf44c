//! One run of every collective, for comparing backends: [`exercise`] calls each collective of
//! the [`Communicator`] trait once (every element type, both reduce ops, an uneven
//! all-to-all-v, a broadcast from the last rank) on data made from the rank, and returns the
//! bits of every result. Two backends whose runs return the same bits on every rank move and
//! reduce data identically; the thread backend is the reference the others are held to (GPU
//! thread ranks, MPI).

use half::bf16;

use super::{Communicator, ReduceOp};
use crate::Result;

/// Elements per rank slice in [`exercise`] (odd, so no buffer is a power of two).
pub const SLICE: usize = 37;

/// Values from a seed: a multiplicative hash of the index in `[-1, 1)`, times a scale that
/// cycles over five magnitudes, so they carry full mantissas and their sums round (a
/// reduction in another order gives other bits, which [`exercise`] must be able to see).
fn values(n: usize, seed: u32) -> Vec<f32> {
    const SCALES: [f32; 5] = [0.013, 0.37, 1.3, 4.1, 29.0];
    (0..n)
        .map(|i| {
            let h = (i as u32 ^ seed).wrapping_mul(2_654_435_761);
            ((h >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * SCALES[i % SCALES.len()]
        })
        .collect()
}

fn f32_bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn bf16_bits(x: &[bf16]) -> Vec<u32> {
    x.iter().map(|v| u32::from(v.to_bits())).collect()
}

fn u8_bits(x: &[u8]) -> Vec<u32> {
    x.iter().map(|&v| u32::from(v)).collect()
}

/// Every collective once on `c` (module doc); the bits of each result, in call order.
pub fn exercise(c: &dyn Communicator) -> Result<Vec<Vec<u32>>> {
    let (rank, world, s) = (c.rank(), c.world_size(), SLICE);
    let f = |seed: usize| values(world * s, seed as u32);
    let b16 = |seed: usize| -> Vec<bf16> { f(seed).into_iter().map(bf16::from_f32).collect() };
    // (The sums of bf16 values are taken in f32, rounded once: order shows there too.)
    let u8s = |seed: usize| -> Vec<u8> {
        (0..world * s)
            .map(|i| ((i * 31 + seed * 7) % 256) as u8)
            .collect()
    };
    let mut out = Vec::new();

    let mut x = f(rank + 1);
    c.all_gather_in_place((&mut x[..]).into())?;
    out.push(f32_bits(&x));
    let send = f(rank + 2)[..s].to_vec();
    let mut recv = vec![0f32; world * s];
    c.all_gather((&send[..]).into(), (&mut recv[..]).into())?;
    out.push(f32_bits(&recv));
    for op in [ReduceOp::Sum, ReduceOp::Avg] {
        let mut x = f(rank + 3);
        c.reduce_scatter_in_place((&mut x[..]).into(), op)?;
        out.push(f32_bits(&x[rank * s..(rank + 1) * s]));
        let mut x = f(rank + 4);
        c.all_reduce((&mut x[..]).into(), op)?;
        out.push(f32_bits(&x));
        let mut x = b16(rank + 5);
        c.all_reduce((&mut x[..]).into(), op)?;
        out.push(bf16_bits(&x));
        let mut x = u8s(rank + 6);
        c.all_reduce((&mut x[..]).into(), op)?;
        out.push(u8_bits(&x));
    }
    // A buffer shorter than the world (a loss value): some ranks reduce an empty range.
    let mut x = vec![values(1, rank as u32 + 9)[0]; 1];
    c.all_reduce((&mut x[..]).into(), ReduceOp::Sum)?;
    out.push(f32_bits(&x));
    // Uneven all-to-all: rank r sends ((r + j) mod 3)·5 elements to rank j.
    let send_counts: Vec<usize> = (0..world).map(|j| (rank + j) % 3 * 5).collect();
    let recv_counts: Vec<usize> = (0..world).map(|j| (j + rank) % 3 * 5).collect();
    let send = values(send_counts.iter().sum(), rank as u32 + 7);
    let mut recv = vec![0f32; recv_counts.iter().sum()];
    c.all_to_all_v(
        (&send[..]).into(),
        &send_counts,
        (&mut recv[..]).into(),
        &recv_counts,
    )?;
    out.push(f32_bits(&recv));
    let mut x = u8s(rank + 8);
    c.broadcast((&mut x[..]).into(), world - 1)?;
    out.push(u8_bits(&x));
    c.barrier()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::threads::ThreadWorld;
    use crate::comm::SingleRank;

    #[test]
    fn the_data_makes_the_reduction_order_visible() {
        // Three ranks' all-reduce inputs: summed in rank order and in reverse, some sums
        // differ, so a backend that reduces in another order fails the comparison.
        let xs: Vec<Vec<f32>> = (0..3).map(|r| values(3 * SLICE, r as u32 + 4)).collect();
        let differ = (0..3 * SLICE)
            .filter(|&i| (xs[0][i] + xs[1][i]) + xs[2][i] != (xs[2][i] + xs[1][i]) + xs[0][i])
            .count();
        assert!(differ > 5, "only {differ} sums depend on the order");
    }

    #[test]
    fn a_world_of_one_thread_equals_the_single_rank_and_results_depend_on_the_world() {
        let single = exercise(&SingleRank).unwrap();
        let one = ThreadWorld::run(1, |c| exercise(c)).unwrap();
        assert_eq!(one[0], single);
        // Larger worlds reduce over more ranks: the runs differ, and agree on every rank
        // wherever the collective's result is the same for all (all-gather, all-reduce).
        let three = ThreadWorld::run(3, |c| exercise(c)).unwrap();
        assert_ne!(three[0], single);
        for r in 1..3 {
            assert_eq!(three[r][0], three[0][0], "all-gather in place, rank {r}");
            assert_eq!(three[r][3], three[0][3], "all-reduce, rank {r}");
        }
    }
}
