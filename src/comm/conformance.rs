//! One run of every collective, for comparing backends: [`exercise`] calls each collective of
//! the [`Communicator`] trait once (every element type, both reduce ops, an uneven
//! all-to-all-v, a broadcast from the last rank) on data made from the rank, and returns the
//! bits of every result. Two backends whose runs return the same bits on every rank move and
//! reduce data identically; the thread backend is the reference the others are held to (GPU
//! thread ranks, MPI).

use half::bf16;

use super::{Buf, BufMut, Communicator, ReduceOp, Segment};
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
    out.push(f32_bits(&uneven_all_to_all(c)?));
    let mut x = u8s(rank + 8);
    c.broadcast((&mut x[..]).into(), world - 1)?;
    out.push(u8_bits(&x));
    c.barrier()?;
    // Out-of-place reduce-scatter, on the in-place form's inputs (results 2 and 6).
    for op in [ReduceOp::Sum, ReduceOp::Avg] {
        let mut x = f(rank + 3);
        let mut own = vec![0f32; s];
        c.reduce_scatter((&mut x[..]).into(), (&mut own[..]).into(), op)?;
        out.push(f32_bits(&own));
    }
    // All-gather into uneven segments with gaps, on the all-gather's input (result 1).
    let send = f(rank + 2)[..s].to_vec();
    let (gathered, _) = gather_into_segments(c, &send, &segment_spans(world))?;
    out.push(f32_bits(&gathered));
    out.push(bf16_bits(&uneven_all_to_all_bf16(c)?));
    Ok(out)
}

/// An uneven all-to-all-v: rank `r` sends `((r + j) mod 3)·5` seeded values to rank `j`; what
/// this rank received.
pub fn uneven_all_to_all(c: &dyn Communicator) -> Result<Vec<f32>> {
    uneven_all_to_all_of(c, 7, |x| x)
}

/// [`uneven_all_to_all`]'s counts with bf16 values (Muon's routes when its Newton–Schulz
/// runs in bf16).
fn uneven_all_to_all_bf16(c: &dyn Communicator) -> Result<Vec<bf16>> {
    uneven_all_to_all_of(c, 11, bf16::from_f32)
}

/// The uneven all-to-all-v of values seeded `seed + rank`, as `T`.
fn uneven_all_to_all_of<T: Copy + Default>(
    c: &dyn Communicator,
    seed: u32,
    to: impl Fn(f32) -> T,
) -> Result<Vec<T>>
where
    for<'a> &'a [T]: Into<Buf<'a>>,
    for<'a> &'a mut [T]: Into<BufMut<'a>>,
{
    let (rank, world) = (c.rank(), c.world_size());
    let send_counts: Vec<usize> = (0..world).map(|j| (rank + j) % 3 * 5).collect();
    let recv_counts: Vec<usize> = (0..world).map(|j| (j + rank) % 3 * 5).collect();
    let send: Vec<T> = values(send_counts.iter().sum(), rank as u32 + seed)
        .into_iter()
        .map(to)
        .collect();
    let mut recv = vec![T::default(); recv_counts.iter().sum()];
    c.all_to_all_v(
        (&send[..]).into(),
        &send_counts,
        (&mut recv[..]).into(),
        &recv_counts,
    )?;
    Ok(recv)
}

/// All-gathers `send` into fresh host segments at `spans` (ascending, disjoint, in the full
/// buffer); their values back to back, and the bytes the backend staged.
pub fn gather_into_segments(
    c: &dyn Communicator,
    send: &[f32],
    spans: &[std::ops::Range<usize>],
) -> Result<(Vec<f32>, usize)> {
    let mut parts: Vec<Vec<f32>> = spans.iter().map(|r| vec![0f32; r.len()]).collect();
    let mut segments: Vec<Segment<'_>> = spans
        .iter()
        .zip(parts.iter_mut())
        .map(|(r, p)| Segment {
            offset: r.start,
            buf: (&mut p[..]).into(),
        })
        .collect();
    let staged = c.all_gather_segments(send.into(), &mut segments)?;
    drop(segments);
    Ok((parts.concat(), staged))
}

/// The segments [`exercise`] gathers into: uneven, with gaps, some crossing rank slices.
pub fn segment_spans(world: usize) -> Vec<std::ops::Range<usize>> {
    let full = world * SLICE;
    let mut spans = Vec::new();
    let mut at = 1;
    let mut len = 3;
    while at + len <= full {
        spans.push(at..at + len);
        at += len + 2;
        len = len * 2 % 41 + 1;
    }
    spans
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::threads::{ThreadComm, ThreadWorld};
    use crate::comm::{Buf, BufMut, SingleRank};

    /// One mistake a backend could make, planted on top of the thread backend.
    #[derive(Clone, Copy, Debug)]
    enum Bug {
        /// Broadcasts from rank 0 whatever the root.
        RootZero,
        /// All-to-all-v as if every segment held `len / V` elements, whatever the counts.
        EvenSegments,
        /// All-reduces only the first `⌊len / V⌋ · V` elements (the remainder of an uneven
        /// split left unreduced).
        DropsRemainder,
    }

    /// The thread backend with only the required methods (the trait's staged defaults for
    /// the rest), with `Some` planted bug or `None`.
    struct Staged<'a>(&'a ThreadComm, Option<Bug>);

    impl Communicator for Staged<'_> {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn world_size(&self) -> usize {
            self.0.world_size()
        }
        fn all_gather_in_place(&self, buf: BufMut<'_>) -> Result<()> {
            self.0.all_gather_in_place(buf)
        }
        fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
            self.0.all_gather(send, recv)
        }
        fn reduce_scatter_in_place(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
            self.0.reduce_scatter_in_place(buf, op)
        }
        // The catch-all arm is for device buffers (feature `cuda`).
        #[allow(unreachable_patterns)]
        fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
            let Some(Bug::DropsRemainder) = self.1 else {
                return self.0.all_reduce(buf, op);
            };
            let n = buf.len() / self.world_size() * self.world_size();
            match buf {
                BufMut::F32(b) => self.0.all_reduce(BufMut::F32(&mut b[..n]), op),
                BufMut::BF16(b) => self.0.all_reduce(BufMut::BF16(&mut b[..n]), op),
                BufMut::U8(b) => self.0.all_reduce(BufMut::U8(&mut b[..n]), op),
                other => self.0.all_reduce(other, op),
            }
        }
        fn all_to_all_v(
            &self,
            send: Buf<'_>,
            sc: &[usize],
            recv: BufMut<'_>,
            rc: &[usize],
        ) -> Result<()> {
            let Some(Bug::EvenSegments) = self.1 else {
                return self.0.all_to_all_v(send, sc, recv, rc);
            };
            let v = self.world_size();
            let (sc, rc) = (vec![send.len() / v; v], vec![recv.len() / v; v]);
            self.0.all_to_all_v(send, &sc, recv, &rc)
        }
        fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
            match self.1 {
                Some(Bug::RootZero) => self.0.broadcast(buf, 0),
                _ => self.0.broadcast(buf, root),
            }
        }
        fn barrier(&self) -> Result<()> {
            self.0.barrier()
        }
    }

    /// `exercise` sees each planted bug: with it, a run returns other bits than the thread
    /// backend's (or fails), at every world size that can show it. A change that made the
    /// suite check less (a broadcast from rank 0, even all-to-all segments, no buffer shorter
    /// than the world) would let a backend with the bug pass.
    #[test]
    fn exercise_tells_a_backend_with_a_planted_bug_from_the_reference() {
        for world in [2, 3, 4] {
            let reference = ThreadWorld::run(world, |c| exercise(c)).unwrap();
            for bug in [Bug::RootZero, Bug::EvenSegments, Bug::DropsRemainder] {
                let got = ThreadWorld::run(world, |c| exercise(&Staged(c, Some(bug))));
                assert!(
                    !matches!(&got, Ok(g) if g == &reference),
                    "V={world}: exercise did not see {bug:?}"
                );
            }
        }
    }

    #[test]
    fn out_of_place_forms_equal_the_in_place_ones_natively_and_staged() {
        for world in [1, 2, 3, 4] {
            let native = ThreadWorld::run(world, |c| exercise(c)).unwrap();
            let staged = ThreadWorld::run(world, |c| exercise(&Staged(c, None))).unwrap();
            assert_eq!(native, staged, "V={world}: native and staged forms differ");
            for (r, out) in native.iter().enumerate() {
                assert_eq!(out[13], out[2], "V={world} rank {r}: reduce-scatter sum");
                assert_eq!(
                    out[14], out[6],
                    "V={world} rank {r}: reduce-scatter average"
                );
                let gathered: Vec<u32> = segment_spans(world)
                    .into_iter()
                    .flat_map(|span| out[1][span].to_vec())
                    .collect();
                assert_eq!(out[15], gathered, "V={world} rank {r}: segments");
            }
        }
        let single = exercise(&SingleRank).unwrap();
        assert_eq!(single[13], single[2]);
        assert_eq!(
            single[15],
            segment_spans(1)
                .into_iter()
                .flat_map(|s| single[1][s].to_vec())
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn segments_that_overlap_or_overrun_are_refused_on_every_backend() {
        let bad = |c: &dyn Communicator| {
            let send = [1f32; SLICE];
            let (mut a, mut b) = (vec![0f32; 4], vec![0f32; 4]);
            let mut segs = [
                Segment {
                    offset: 2,
                    buf: (&mut a[..]).into(),
                },
                Segment {
                    offset: 4,
                    buf: (&mut b[..]).into(),
                },
            ];
            c.all_gather_segments((&send[..]).into(), &mut segs)
        };
        assert!(bad(&SingleRank).is_err());
        for r in ThreadWorld::run(2, |c| Ok(bad(c).is_err())).unwrap() {
            assert!(r);
        }
    }

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
