//! The thread backend against naive single-threaded references, and its failure behaviour.
//!
//! Sweeps world sizes 1, 2, 3, 4, 8 with uneven sizes (including empty buffers, buffers shorter
//! than the world, and sizes past the reduction's 2048-element chunk) for f32, bf16 and u8 from
//! seeded generators. Reductions are compared bitwise with the rank-order left fold
//! `((b0 + b1) + b2) + …` written out here; no tolerance, since the order is part of the contract
//! (the f32 data spans 2⁻¹⁰..2¹⁰ so another order changes the bits, see
//! `test_data_makes_the_reduction_order_observable`). Collectives run through
//! `&dyn Communicator`.
//!
//! Failure tests bound their waits: a hang shows up as an elapsed-time assertion (or the world's
//! own timeout), not as a stuck test run.

use std::fmt::Debug;
use std::thread;
use std::time::{Duration, Instant};

use half::bf16;
use ragged::comm::threads::{ThreadComm, ThreadWorld, DEFAULT_TIMEOUT};
use ragged::comm::{Buf, BufMut, Communicator, ReduceOp};
use ragged::Error;

const WORLD_SIZES: [usize; 5] = [1, 2, 3, 4, 8];
/// Per-rank slice sizes for the in-place collectives (2500 and 5000 cross the 2048 chunk).
const SLICES: [usize; 6] = [0, 1, 5, 333, 2500, 5000];
/// Whole-buffer lengths for all-reduce and broadcast, most not divisible by any world size > 1.
const LENGTHS: [usize; 7] = [0, 1, 3, 7, 1001, 4099, 10007];
/// For the failure tests: long enough that only a bug makes them wait for it.
const GENEROUS: Duration = Duration::from_secs(60);
/// A failure must be seen well before this.
const PROMPT: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------------------------------------
// Helpers

/// SplitMix64: a seeded generator, so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Uniform in [-1, 1) times 2^e, e in -10..10: sums of these depend on the order.
    fn wide_f32(&mut self) -> f32 {
        let unit = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * unit - 1.0) * 2f32.powi(self.below(20) as i32 - 10)
    }
}

/// An element type under test, with its reference rank-order reduction.
trait El: Copy + Send + Sync + Debug + 'static {
    fn random(rng: &mut Rng) -> Self;
    fn buf(s: &[Self]) -> Buf<'_>;
    fn buf_mut(s: &mut [Self]) -> BufMut<'_>;
    /// For bitwise comparison (f32 `==` would equate 0.0 and -0.0).
    fn bits(self) -> u32;
    /// The reduction of `vals` (one per rank, in rank order).
    fn fold(vals: &[Self], op: ReduceOp) -> Self;
}

impl El for f32 {
    fn random(rng: &mut Rng) -> f32 {
        rng.wide_f32()
    }
    fn buf(s: &[f32]) -> Buf<'_> {
        Buf::F32(s)
    }
    fn buf_mut(s: &mut [f32]) -> BufMut<'_> {
        BufMut::F32(s)
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
    fn fold(vals: &[f32], op: ReduceOp) -> f32 {
        let mut acc = vals[0];
        for &x in &vals[1..] {
            acc += x;
        }
        match op {
            ReduceOp::Sum => acc,
            ReduceOp::Avg => acc / vals.len() as f32,
        }
    }
}

impl El for bf16 {
    fn random(rng: &mut Rng) -> bf16 {
        bf16::from_f32(rng.wide_f32())
    }
    fn buf(s: &[bf16]) -> Buf<'_> {
        Buf::BF16(s)
    }
    fn buf_mut(s: &mut [bf16]) -> BufMut<'_> {
        BufMut::BF16(s)
    }
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
    /// Accumulates in f32 and rounds once.
    fn fold(vals: &[bf16], op: ReduceOp) -> bf16 {
        let widened: Vec<f32> = vals.iter().map(|x| x.to_f32()).collect();
        bf16::from_f32(f32::fold(&widened, op))
    }
}

impl El for u8 {
    fn random(rng: &mut Rng) -> u8 {
        rng.below(256) as u8
    }
    fn buf(s: &[u8]) -> Buf<'_> {
        Buf::U8(s)
    }
    fn buf_mut(s: &mut [u8]) -> BufMut<'_> {
        BufMut::U8(s)
    }
    fn bits(self) -> u32 {
        u32::from(self)
    }
    /// Sum: saturating adds in rank order. Avg: exact sum / V, rounded to nearest, ties up.
    fn fold(vals: &[u8], op: ReduceOp) -> u8 {
        match op {
            ReduceOp::Sum => vals.iter().fold(0u8, |a, &x| a.saturating_add(x)),
            ReduceOp::Avg => {
                let sum: u64 = vals.iter().map(|&x| u64::from(x)).sum();
                let v = vals.len() as u64;
                let q = sum / v;
                let rem = sum % v;
                (if 2 * rem >= v { q + 1 } else { q }) as u8
            }
        }
    }
}

fn random_vec<E: El>(rng: &mut Rng, n: usize) -> Vec<E> {
    (0..n).map(|_| E::random(rng)).collect()
}

#[track_caller]
fn assert_bitwise<E: El>(got: &[E], want: &[E], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].bits() != want[i].bits()) {
        panic!(
            "{what}: element {i} is {:?}, expected {:?}",
            got[i], want[i]
        );
    }
}

fn world(v: usize, timeout: Duration) -> Vec<ThreadComm> {
    ThreadWorld::with_timeout(v, timeout).expect("world")
}

/// Runs `f(comm, input)` with one thread per rank (each owns its communicator) and returns the
/// results in rank order. A rank thread that panics fails the test.
fn run<I: Send, R: Send>(
    comms: Vec<ThreadComm>,
    inputs: Vec<I>,
    f: impl Fn(ThreadComm, I) -> R + Sync,
) -> Vec<R> {
    assert_eq!(comms.len(), inputs.len());
    let f = &f;
    thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(inputs)
            .map(|(c, i)| s.spawn(move || f(c, i)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank thread panicked"))
            .collect()
    })
}

/// Runs `f` on a thread of its own and returns its result, or fails the test if it is still
/// running after `limit` (the thread is left behind: a hang becomes a failure, not a stall).
fn within<R: Send + 'static>(limit: Duration, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || tx.send(f()));
    match rx.recv_timeout(limit) {
        Ok(r) => r,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("still running after {limit:?}"),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("the body panicked"),
    }
}

/// Asserts that `res` is an `Error::Comm` reported by `rank` and returns its reason.
#[track_caller]
fn comm_err(res: &ragged::Result<()>, rank: usize) -> String {
    match res {
        Err(Error::Comm {
            rank: r, reason, ..
        }) if *r == rank => reason.clone(),
        other => panic!("rank {rank}: expected Error::Comm, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Construction

#[test]
fn a_world_of_zero_ranks_is_an_error() {
    assert!(matches!(ThreadWorld::new(0), Err(Error::Comm { .. })));
}

/// More thread ranks than one process can run is an error before any thread starts (far
/// beyond, the system would abort the process), not an abort.
#[test]
fn a_world_of_too_many_thread_ranks_is_an_error() {
    use ragged::comm::threads::MAX_THREAD_RANKS;
    let started = std::sync::atomic::AtomicUsize::new(0);
    let err = ThreadWorld::run(MAX_THREAD_RANKS + 1, |_| {
        started.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    })
    .unwrap_err();
    assert!(matches!(err, Error::BadInput { .. }), "{err}");
    assert_eq!(started.into_inner(), 0);
    // The bound itself is a world (its communicators only: no thread starts).
    let most = ThreadWorld::new(MAX_THREAD_RANKS).expect("a world of MAX_THREAD_RANKS ranks");
    assert_eq!(most.len(), MAX_THREAD_RANKS);
    assert_eq!(most[MAX_THREAD_RANKS - 1].rank(), MAX_THREAD_RANKS - 1);
    // Far beyond, refused before the world's tables are allocated: `1 << 40` ranks aborted
    // the process (an 8 TB allocation) and `usize::MAX` panicked (capacity overflow).
    for n in [1 << 40, usize::MAX] {
        let err = ThreadWorld::run(n, |_| Ok(())).unwrap_err();
        assert!(matches!(err, Error::BadInput { .. }), "{err}");
        let err = ThreadWorld::new(n).unwrap_err();
        assert!(matches!(err, Error::BadInput { .. }), "{err}");
    }
}

#[test]
fn communicators_come_in_rank_order_with_the_world_size() {
    for v in WORLD_SIZES {
        let comms = ThreadWorld::new(v).unwrap();
        assert_eq!(comms.len(), v);
        for (r, c) in comms.iter().enumerate() {
            assert_eq!(c.rank(), r);
            assert_eq!(c.world_size(), v);
        }
    }
    assert_eq!(DEFAULT_TIMEOUT, Duration::from_secs(120));
}

/// A timeout too long to add to a clock ("wait for ever") is a very late deadline, not an
/// overflow panic at every collective.
#[test]
fn the_longest_timeout_is_waited_not_overflowed() {
    let sums = ThreadWorld::run_with_timeout(2, Duration::MAX, |c| {
        let mut x = [c.rank() as f32 + 1.0];
        c.all_reduce(BufMut::F32(&mut x), ReduceOp::Sum)?;
        Ok(x[0])
    })
    .unwrap();
    assert_eq!(sums, [3.0, 3.0]);
}

#[test]
fn thread_comm_is_a_send_sync_trait_object() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ThreadComm>();
    let comms = ThreadWorld::new(1).unwrap();
    let dynamic: Box<dyn Communicator> = Box::new(comms.into_iter().next().unwrap());
    let mut x = [1.0f32, 2.0];
    dynamic
        .all_reduce(BufMut::F32(&mut x), ReduceOp::Avg)
        .unwrap();
    assert_eq!(x, [1.0, 2.0]);
}

// ---------------------------------------------------------------------------------------------
// Collectives against references

fn check_all_gather_in_place<E: El>(seed: u64) {
    let mut rng = Rng(seed);
    for v in WORLD_SIZES {
        for s in SLICES {
            // Rank r's own slice holds its data; the other slices hold garbage that must go.
            let inputs: Vec<Vec<E>> = (0..v).map(|_| random_vec(&mut rng, v * s)).collect();
            let want: Vec<E> = (0..v)
                .flat_map(|r| inputs[r][r * s..(r + 1) * s].to_vec())
                .collect();
            let outs = run(world(v, GENEROUS), inputs, |c, mut buf| {
                let c: &dyn Communicator = &c;
                c.all_gather_in_place(E::buf_mut(&mut buf)).unwrap();
                buf
            });
            for (r, out) in outs.iter().enumerate() {
                assert_bitwise(out, &want, &format!("V={v} S={s} rank {r}"));
            }
        }
    }
}

#[test]
fn all_gather_in_place_leaves_every_owners_slice_on_every_rank() {
    check_all_gather_in_place::<f32>(1);
    check_all_gather_in_place::<bf16>(2);
    check_all_gather_in_place::<u8>(3);
}

fn check_all_gather<E: El>(seed: u64) {
    let mut rng = Rng(seed);
    for v in WORLD_SIZES {
        for s in SLICES {
            let sends: Vec<Vec<E>> = (0..v).map(|_| random_vec(&mut rng, s)).collect();
            let want: Vec<E> = sends.concat();
            let inputs: Vec<(Vec<E>, Vec<E>)> = sends
                .iter()
                .map(|send| (send.clone(), random_vec(&mut rng, v * s)))
                .collect();
            let outs = run(world(v, GENEROUS), inputs, |c, (send, mut recv)| {
                let c: &dyn Communicator = &c;
                c.all_gather(E::buf(&send), E::buf_mut(&mut recv)).unwrap();
                recv
            });
            for (r, out) in outs.iter().enumerate() {
                assert_bitwise(out, &want, &format!("V={v} S={s} rank {r}"));
            }
        }
    }
}

#[test]
fn all_gather_out_of_place_concatenates_the_inputs_in_rank_order() {
    check_all_gather::<f32>(4);
    check_all_gather::<bf16>(5);
    check_all_gather::<u8>(6);
}

fn check_reduce_scatter<E: El>(seed: u64) {
    let mut rng = Rng(seed);
    for op in [ReduceOp::Sum, ReduceOp::Avg] {
        for v in WORLD_SIZES {
            for s in SLICES {
                let inputs: Vec<Vec<E>> = (0..v).map(|_| random_vec(&mut rng, v * s)).collect();
                let outs = run(world(v, GENEROUS), inputs.clone(), |c, mut buf| {
                    let c: &dyn Communicator = &c;
                    c.reduce_scatter_in_place(E::buf_mut(&mut buf), op).unwrap();
                    buf
                });
                for (r, out) in outs.iter().enumerate() {
                    let want: Vec<E> = (r * s..(r + 1) * s)
                        .map(|i| {
                            let column: Vec<E> = inputs.iter().map(|b| b[i]).collect();
                            E::fold(&column, op)
                        })
                        .collect();
                    let own = &out[r * s..(r + 1) * s];
                    assert_bitwise(own, &want, &format!("{op:?} V={v} S={s} rank {r}"));
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_in_place_sum_and_avg_are_bitwise_the_rank_order_fold() {
    check_reduce_scatter::<f32>(7);
    check_reduce_scatter::<bf16>(8);
    check_reduce_scatter::<u8>(9);
}

fn check_all_reduce<E: El>(seed: u64) {
    let mut rng = Rng(seed);
    for op in [ReduceOp::Sum, ReduceOp::Avg] {
        for v in WORLD_SIZES {
            for len in LENGTHS {
                let inputs: Vec<Vec<E>> = (0..v).map(|_| random_vec(&mut rng, len)).collect();
                let want: Vec<E> = (0..len)
                    .map(|i| {
                        let column: Vec<E> = inputs.iter().map(|b| b[i]).collect();
                        E::fold(&column, op)
                    })
                    .collect();
                let outs = run(world(v, GENEROUS), inputs, |c, mut buf| {
                    let c: &dyn Communicator = &c;
                    c.all_reduce(E::buf_mut(&mut buf), op).unwrap();
                    buf
                });
                for (r, out) in outs.iter().enumerate() {
                    // Equal to the fold on every rank, hence identical across ranks.
                    assert_bitwise(out, &want, &format!("{op:?} V={v} len={len} rank {r}"));
                }
            }
        }
    }
}

#[test]
fn all_reduce_is_identical_on_every_rank_and_bitwise_the_rank_order_fold() {
    check_all_reduce::<f32>(10);
    check_all_reduce::<bf16>(11);
    check_all_reduce::<u8>(12);
}

fn check_broadcast<E: El>(seed: u64) {
    let mut rng = Rng(seed);
    for v in WORLD_SIZES {
        for len in LENGTHS {
            for root in 0..v {
                let inputs: Vec<Vec<E>> = (0..v).map(|_| random_vec(&mut rng, len)).collect();
                let want = inputs[root].clone();
                let outs = run(world(v, GENEROUS), inputs, |c, mut buf| {
                    let c: &dyn Communicator = &c;
                    c.broadcast(E::buf_mut(&mut buf), root).unwrap();
                    buf
                });
                for (r, out) in outs.iter().enumerate() {
                    assert_bitwise(out, &want, &format!("V={v} len={len} root {root} rank {r}"));
                }
            }
        }
    }
}

#[test]
fn broadcast_from_every_root_copies_the_roots_buffer_to_every_rank() {
    check_broadcast::<f32>(13);
    check_broadcast::<bf16>(14);
    check_broadcast::<u8>(15);
}

/// `counts[i][j]`: elements rank `i` sends to rank `j`; about a third are zero.
fn random_counts(rng: &mut Rng, v: usize) -> Vec<Vec<usize>> {
    (0..v)
        .map(|_| {
            (0..v)
                .map(|_| match rng.below(3) {
                    0 => 0,
                    1 => rng.below(5) as usize,
                    _ => rng.below(3000) as usize,
                })
                .collect()
        })
        .collect()
}

fn check_all_to_all_v<E: El>(seed: u64) {
    let mut rng = Rng(seed);
    for v in WORLD_SIZES {
        for _ in 0..3 {
            let counts = random_counts(&mut rng, v);
            let sends: Vec<Vec<E>> = counts
                .iter()
                .map(|row| random_vec(&mut rng, row.iter().sum()))
                .collect();
            // Reference: rank j receives, from each i in order, i's segment for j.
            let segment = |i: usize, j: usize| {
                let start: usize = counts[i][..j].iter().sum();
                &sends[i][start..start + counts[i][j]]
            };
            let wants: Vec<Vec<E>> = (0..v)
                .map(|j| (0..v).flat_map(|i| segment(i, j).to_vec()).collect())
                .collect();
            let inputs: Vec<_> = (0..v)
                .map(|r| {
                    let send_counts = counts[r].clone();
                    let recv_counts: Vec<usize> = (0..v).map(|i| counts[i][r]).collect();
                    let recv = random_vec::<E>(&mut rng, recv_counts.iter().sum());
                    (sends[r].clone(), send_counts, recv, recv_counts)
                })
                .collect();
            let outs = run(world(v, GENEROUS), inputs, |c, (send, sc, mut recv, rc)| {
                let c: &dyn Communicator = &c;
                c.all_to_all_v(E::buf(&send), &sc, E::buf_mut(&mut recv), &rc)
                    .unwrap();
                recv
            });
            for (r, out) in outs.iter().enumerate() {
                assert_bitwise(out, &wants[r], &format!("V={v} counts {counts:?} rank {r}"));
            }
        }
    }
}

#[test]
fn all_to_all_v_with_uneven_counts_including_zeros_delivers_every_segment() {
    check_all_to_all_v::<f32>(16);
    check_all_to_all_v::<bf16>(17);
    check_all_to_all_v::<u8>(18);
}

#[test]
fn test_data_makes_the_reduction_order_observable() {
    // If another summation order gave the same bits on this data, the bitwise fold tests could
    // not catch an implementation that sums in a different order.
    let mut rng = Rng(7);
    let v = 4;
    let cols: Vec<Vec<f32>> = (0..1000).map(|_| random_vec(&mut rng, v)).collect();
    let differing = cols
        .iter()
        .filter(|c| {
            let reversed: Vec<f32> = c.iter().rev().copied().collect();
            f32::fold(c, ReduceOp::Sum).to_bits() != f32::fold(&reversed, ReduceOp::Sum).to_bits()
        })
        .count();
    assert!(
        differing > 100,
        "only {differing} of 1000 sums depend on the order"
    );
    // bf16 rounds once at the end: rounding after every add would differ.
    let cols: Vec<Vec<bf16>> = (0..1000).map(|_| random_vec(&mut rng, v)).collect();
    let differing = cols
        .iter()
        .filter(|c| {
            let stepwise = c[1..]
                .iter()
                .fold(c[0], |a, &x| bf16::from_f32(a.to_f32() + x.to_f32()));
            bf16::fold(c, ReduceOp::Sum) != stepwise
        })
        .count();
    assert!(
        differing > 10,
        "only {differing} of 1000 bf16 sums depend on the rounding"
    );
}

#[test]
fn u8_sum_saturates_and_avg_rounds_to_nearest() {
    let inputs = vec![
        vec![200u8, 1, 1, 0],
        vec![100u8, 1, 2, 0],
        vec![0u8, 0, 2, 1],
    ];
    let outs = run(world(3, GENEROUS), inputs.clone(), |c, mut buf| {
        c.all_reduce(BufMut::U8(&mut buf), ReduceOp::Sum).unwrap();
        buf
    });
    assert_eq!(outs[0], [255, 2, 5, 1]);
    let outs = run(world(3, GENEROUS), inputs, |c, mut buf| {
        c.all_reduce(BufMut::U8(&mut buf), ReduceOp::Avg).unwrap();
        buf
    });
    // 300/3 = 100, 2/3 → 1, 5/3 → 2, 1/3 → 0.
    assert_eq!(outs[0], [100, 1, 2, 0]);
}

#[test]
fn back_to_back_mixed_collectives_stay_in_step() {
    // Ranks leave one collective and post the next while slower ranks are still finishing:
    // descriptors must not be overwritten before every rank is done with them.
    let v = 4;
    let n = 64;
    let outs = run(world(v, GENEROUS), (0..v).collect(), |c, r| {
        let mut checks = 0;
        for round in 0..300usize {
            let mut buf = vec![(r * 1000 + round) as f32; v * n];
            match round % 4 {
                0 => {
                    c.all_reduce(BufMut::F32(&mut buf), ReduceOp::Sum).unwrap();
                    let want = (0..v).map(|j| (j * 1000 + round) as f32).sum::<f32>();
                    checks += usize::from(buf.iter().all(|&x| x == want));
                }
                1 => {
                    c.all_gather_in_place(BufMut::F32(&mut buf)).unwrap();
                    checks +=
                        usize::from((0..v * n).all(|i| buf[i] == ((i / n) * 1000 + round) as f32));
                }
                2 => {
                    c.broadcast(BufMut::F32(&mut buf), round % v).unwrap();
                    let want = ((round % v) * 1000 + round) as f32;
                    checks += usize::from(buf.iter().all(|&x| x == want));
                }
                _ => {
                    c.barrier().unwrap();
                    checks += 1;
                }
            }
        }
        checks
    });
    assert_eq!(outs, vec![300; v]);
}

// ---------------------------------------------------------------------------------------------
// Disagreements: Err on every rank, no rank touches memory

/// Runs `f` on every rank of a `v`-rank world; every rank must return `Err` promptly without
/// changing its buffer (each rank's buffer starts as `[rank; len]`).
fn assert_rejected_everywhere(
    v: usize,
    len_of: impl Fn(usize) -> usize + Sync,
    f: impl Fn(&ThreadComm, &mut [f32]) -> ragged::Result<()> + Sync,
) -> Vec<String> {
    let start = Instant::now();
    let inputs: Vec<Vec<f32>> = (0..v).map(|r| vec![r as f32; len_of(r)]).collect();
    let outs = run(world(v, GENEROUS), inputs, |c, mut buf| {
        let res = f(&c, &mut buf);
        let reason = comm_err(&res, c.rank());
        (reason, buf)
    });
    assert!(start.elapsed() < PROMPT, "took {:?}", start.elapsed());
    outs.into_iter()
        .enumerate()
        .map(|(r, (reason, buf))| {
            assert!(
                buf.iter().all(|&x| x == r as f32),
                "rank {r} buffer was touched"
            );
            reason
        })
        .collect()
}

#[test]
fn mismatched_lengths_are_an_error_on_every_rank_and_touch_no_memory() {
    for v in [2, 3, 8] {
        let reasons = assert_rejected_everywhere(
            v,
            |r| if r == v - 1 { 11 } else { 10 },
            |c, buf| c.all_reduce(BufMut::F32(buf), ReduceOp::Sum),
        );
        assert!(reasons.iter().all(|m| m.contains("length")), "{reasons:?}");
        // Same table, same verdict: every rank reports the same reason.
        assert!(reasons.iter().all(|m| *m == reasons[0]), "{reasons:?}");
        assert_rejected_everywhere(
            v,
            |r| if r == 0 { 2 * v } else { v },
            |c, buf| c.all_gather_in_place(BufMut::F32(buf)),
        );
    }
}

#[test]
fn mismatched_collectives_are_an_error_on_every_rank() {
    let reasons = assert_rejected_everywhere(
        3,
        |_| 6,
        |c, buf| match c.rank() {
            1 => c.reduce_scatter_in_place(BufMut::F32(buf), ReduceOp::Sum),
            _ => c.all_gather_in_place(BufMut::F32(buf)),
        },
    );
    assert!(
        reasons[0].contains("reduce_scatter_in_place"),
        "{reasons:?}"
    );
    // Every mismatch says the likely cause: the ranks' programs diverged.
    assert!(
        reasons
            .iter()
            .all(|m| m.contains("every rank must make the same collective calls")),
        "{reasons:?}"
    );
    // A barrier against a data collective is a disagreement too.
    assert_rejected_everywhere(
        2,
        |_| 4,
        |c, buf| match c.rank() {
            0 => c.barrier(),
            _ => c.all_reduce(BufMut::F32(buf), ReduceOp::Sum),
        },
    );
}

#[test]
fn mismatched_reduce_ops_roots_and_element_types_are_errors_on_every_rank() {
    assert_rejected_everywhere(
        3,
        |_| 6,
        |c, buf| {
            let op = if c.rank() == 2 {
                ReduceOp::Avg
            } else {
                ReduceOp::Sum
            };
            c.reduce_scatter_in_place(BufMut::F32(buf), op)
        },
    );
    assert_rejected_everywhere(
        3,
        |_| 5,
        |c, buf| c.broadcast(BufMut::F32(buf), c.rank() / 2),
    );
    // All-reduce: one rank averages where the others sum.
    assert_rejected_everywhere(
        3,
        |_| 6,
        |c, buf| {
            let op = if c.rank() == 1 {
                ReduceOp::Avg
            } else {
                ReduceOp::Sum
            };
            c.all_reduce(BufMut::F32(buf), op)
        },
    );
    // Out of place: send and recv of different element types, alike on every rank.
    assert_rejected_everywhere(
        2,
        |_| 4,
        |c, _| {
            let send = vec![1.0f32; 2];
            let mut recv = vec![bf16::ZERO; 4];
            c.all_gather(Buf::F32(&send), BufMut::BF16(&mut recv))
        },
    );
    // A root outside the world, the same on every rank.
    assert_rejected_everywhere(3, |_| 5, |c, buf| c.broadcast(BufMut::F32(buf), 3));
    assert_rejected_everywhere(
        2,
        |_| 4,
        |c, buf| {
            if c.rank() == 0 {
                c.all_reduce(BufMut::F32(buf), ReduceOp::Sum)
            } else {
                let mut other = vec![0u8; 4];
                c.all_reduce(BufMut::U8(&mut other), ReduceOp::Sum)
            }
        },
    );
    // Out of place: a recv buffer that is not V × send.
    assert_rejected_everywhere(
        2,
        |_| 4,
        |c, buf| {
            let send = vec![1.0f32; 3];
            c.all_gather(Buf::F32(&send), BufMut::F32(buf))
        },
    );
}

#[test]
fn in_place_lengths_not_divisible_by_the_world_size_are_errors_on_every_rank() {
    assert_rejected_everywhere(3, |_| 7, |c, buf| c.all_gather_in_place(BufMut::F32(buf)));
    assert_rejected_everywhere(
        4,
        |_| 6,
        |c, buf| c.reduce_scatter_in_place(BufMut::F32(buf), ReduceOp::Avg),
    );
}

#[test]
fn inconsistent_all_to_all_counts_are_errors_on_every_rank() {
    // Rank 0 sends 2 to rank 1, but rank 1 expects 3 from rank 0 (lengths add up locally).
    let reasons = assert_rejected_everywhere(
        2,
        |r| if r == 0 { 4 } else { 5 },
        |c, buf| {
            let send = vec![0.0f32; 4];
            let (sc, rc) = match c.rank() {
                0 => ([2, 2], [2, 2]),
                _ => ([2, 2], [3, 2]),
            };
            c.all_to_all_v(Buf::F32(&send), &sc, BufMut::F32(buf), &rc)
        },
    );
    assert!(
        reasons[0].contains("sends 2 elements to rank 1"),
        "{reasons:?}"
    );
    // Counts that do not add up to the buffer, on one rank only.
    assert_rejected_everywhere(
        2,
        |_| 4,
        |c, buf| {
            let send = vec![0.0f32; 4];
            let sc = if c.rank() == 1 { [2, 1] } else { [2, 2] };
            c.all_to_all_v(Buf::F32(&send), &sc, BufMut::F32(buf), &[2, 2])
        },
    );
    // Wrong number of counts.
    assert_rejected_everywhere(
        2,
        |_| 4,
        |c, buf| {
            let send = vec![0.0f32; 4];
            c.all_to_all_v(Buf::F32(&send), &[4], BufMut::F32(buf), &[2, 2])
        },
    );
}

#[test]
fn an_error_poisons_the_world_for_every_later_call() {
    // Bounded: with the poison check broken, the ranks' call counts drift apart and a rank
    // waits in a data phase (which has no timeout) for ever.
    let outs = within(GENEROUS, || {
        run(world(3, PROMPT), (0..3).collect(), |c, r| {
            let mut buf = vec![0.0f32; 3 + usize::from(r == 1)];
            let first = c.all_gather_in_place(BufMut::F32(&mut buf));
            comm_err(&first, r);
            // Now everything matches, but the world has failed.
            let mut buf = vec![0.0f32; 3];
            let later = [
                c.barrier(),
                c.all_reduce(BufMut::F32(&mut buf), ReduceOp::Sum),
                c.broadcast(BufMut::F32(&mut buf), 0),
            ];
            later.iter().map(|res| comm_err(res, r)).collect::<Vec<_>>()
        })
    });
    for reasons in outs {
        assert!(
            reasons.iter().all(|m| m.contains("failed earlier")),
            "{reasons:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Ranks that leave, and timeouts

/// Spawns one thread per rank; rank `bad` runs `bad_rank`, the others run `good_rank` and
/// report how long after the world's start they returned. Returns the good ranks' results and the bad rank's join result.
fn with_one_bad_rank<R: Send>(
    v: usize,
    timeout: Duration,
    bad: usize,
    bad_rank: impl Fn(ThreadComm) + Sync,
    good_rank: impl Fn(&ThreadComm) -> R + Sync,
) -> (Vec<(R, Duration)>, thread::Result<()>) {
    let (bad_rank, good_rank) = (&bad_rank, &good_rank);
    // One start for all ranks, so a rank woken by another's timeout still counts from it.
    let start = Instant::now();
    thread::scope(|s| {
        let mut handles = Vec::new();
        let mut bad_handle = None;
        for c in world(v, timeout) {
            if c.rank() == bad {
                bad_handle = Some(s.spawn(move || bad_rank(c)));
            } else {
                handles.push(s.spawn(move || {
                    let res = good_rank(&c);
                    (res, start.elapsed())
                }));
            }
        }
        let good = handles
            .into_iter()
            .map(|h| h.join().expect("a good rank panicked"))
            .collect();
        (good, bad_handle.unwrap().join())
    })
}

#[test]
fn a_rank_that_panics_makes_the_others_fail_promptly_not_at_the_timeout() {
    for v in [2, 4] {
        let (good, bad) = with_one_bad_rank(
            v,
            GENEROUS,
            1,
            |c| {
                let mut buf = vec![1.0f32; 8];
                c.all_reduce(BufMut::F32(&mut buf), ReduceOp::Sum).unwrap();
                thread::sleep(Duration::from_millis(50));
                panic!("rank 1 fails on purpose (expected in this test)");
            },
            |c| {
                let mut buf = vec![1.0f32; 8];
                c.all_reduce(BufMut::F32(&mut buf), ReduceOp::Sum).unwrap();
                assert_eq!(buf, vec![v as f32; 8]);
                // Rank 1 panics instead of joining this one.
                let second = c.all_reduce(BufMut::F32(&mut buf), ReduceOp::Sum);
                let later = c.barrier();
                (comm_err(&second, c.rank()), comm_err(&later, c.rank()))
            },
        );
        assert!(bad.is_err(), "the bad rank was meant to panic");
        for ((reason, _), elapsed) in good {
            assert!(
                reason.contains("rank 1") && reason.contains("panicked"),
                "{reason}"
            );
            assert!(elapsed < PROMPT, "detected after {elapsed:?}");
        }
    }
}

#[test]
fn a_rank_that_drops_its_communicator_makes_the_others_fail_promptly() {
    let (good, bad) = with_one_bad_rank(
        3,
        GENEROUS,
        2,
        |c| {
            thread::sleep(Duration::from_millis(100));
            drop(c);
        },
        |c| {
            let mut buf = vec![0u8; 6];
            comm_err(&c.all_gather_in_place(BufMut::U8(&mut buf)), c.rank())
        },
    );
    assert!(bad.is_ok());
    for (reason, elapsed) in good {
        assert!(
            reason.contains("rank 2") && reason.contains("dropped"),
            "{reason}"
        );
        assert!(elapsed < PROMPT, "detected after {elapsed:?}");
    }
}

#[test]
fn a_rank_that_never_calls_makes_the_others_time_out() {
    let timeout = Duration::from_millis(200);
    let hold = Duration::from_millis(1500);
    let (good, bad) = with_one_bad_rank(
        3,
        timeout,
        0,
        |c| {
            // Alive but absent: only the timeout can end the others' wait.
            thread::sleep(hold);
            let late = c.barrier();
            assert!(comm_err(&late, 0).contains("failed earlier"));
        },
        |c| {
            let mut buf = vec![0.0f32; 9];
            comm_err(
                &c.reduce_scatter_in_place(BufMut::F32(&mut buf), ReduceOp::Sum),
                c.rank(),
            )
        },
    );
    bad.expect("the absent rank's late call must fail cleanly");
    for (reason, elapsed) in good {
        assert!(
            reason.contains("timed out") || reason.contains("failed earlier"),
            "{reason}"
        );
        assert!(
            elapsed >= timeout,
            "failed after {elapsed:?}, before the timeout"
        );
        assert!(
            elapsed < hold,
            "failed after {elapsed:?}: not by the timeout"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Failures through `ThreadWorld::run` (the entry point the examples and benches use)

/// How fast the other ranks must notice a rank that panicked, failed or returned: the issue's
/// bound, far below the world's timeout (`GENEROUS`), so only the leave-on-return path meets it.
const AT_ONCE: Duration = Duration::from_secs(1);

/// What a good rank saw: its rank, its error's text and how long after the bad rank's failure
/// it came.
type Sighting = (usize, String, Duration);
type Seen = std::sync::Mutex<Vec<Sighting>>;

/// Runs a `v`-rank world through `ThreadWorld::run` (timeout `GENEROUS`): rank `bad` does one
/// all-reduce with the others, then `fail` (which marks when it fails in `failed_at`); the
/// others do the same all-reduce, then a barrier the bad rank never joins, and record what
/// that barrier returned. Returns `run`'s result and what the good ranks saw.
fn run_with_one_failing_rank(
    v: usize,
    bad: usize,
    fail: impl Fn(&std::sync::OnceLock<Instant>) -> ragged::Result<()> + Sync,
) -> (ragged::Result<Vec<()>>, Vec<Sighting>) {
    let failed_at = std::sync::OnceLock::new();
    let seen = Seen::default();
    let result = ThreadWorld::run_with_timeout(v, GENEROUS, |c| {
        let mut buf = vec![1.0f32; 8];
        c.all_reduce(BufMut::F32(&mut buf), ReduceOp::Sum)?;
        if c.rank() == bad {
            return fail(&failed_at);
        }
        let res = c.barrier();
        let elapsed = failed_at.get().map_or(Duration::MAX, Instant::elapsed);
        let text = res
            .as_ref()
            .map_or_else(|e| e.to_string(), |()| "Ok".into());
        seen.lock().unwrap().push((c.rank(), text, elapsed));
        res
    });
    let mut seen = seen.into_inner().unwrap();
    seen.sort_by_key(|s| s.0);
    (result, seen)
}

#[track_caller]
fn assert_others_failed_at_once(seen: &[Sighting], v: usize, wants: &[&str]) {
    assert_eq!(seen.len(), v - 1, "{seen:?}");
    for (rank, text, elapsed) in seen {
        for want in wants {
            assert!(text.contains(want), "rank {rank}: {text:?} lacks {want:?}");
        }
        assert!(
            *elapsed < AT_ONCE,
            "rank {rank} failed {elapsed:?} after the bad rank"
        );
    }
}

#[test]
fn run_returns_a_panicking_ranks_error_and_the_others_fail_at_once() {
    for (v, bad) in [(2, 1), (4, 2)] {
        let (result, seen) = run_with_one_failing_rank(v, bad, |at| {
            at.set(Instant::now()).unwrap();
            panic!("rank fails on purpose (expected in this test)");
        });
        match result {
            Err(Error::Comm { rank, reason, .. }) => {
                assert_eq!(rank, bad);
                assert!(
                    reason.contains("panicked: rank fails on purpose"),
                    "{reason}"
                );
            }
            other => panic!("expected the panicking rank's Err, got {other:?}"),
        }
        assert_others_failed_at_once(&seen, v, &[&format!("rank {bad} left"), "panicked"]);
    }
}

#[test]
fn run_returns_a_failing_ranks_own_error_and_the_others_fail_at_once() {
    let (result, seen) = run_with_one_failing_rank(3, 0, |at| {
        at.set(Instant::now()).unwrap();
        Err(Error::Msg("rank 0 gives up".into()))
    });
    assert!(
        matches!(&result, Err(Error::Msg(m)) if m == "rank 0 gives up"),
        "{result:?}"
    );
    assert_others_failed_at_once(&seen, 3, &["rank 0 left", "failed: rank 0 gives up"]);
}

#[test]
fn a_rank_that_returns_ok_while_others_wait_is_noticed_at_once() {
    let (result, seen) = run_with_one_failing_rank(3, 1, |at| {
        at.set(Instant::now()).unwrap();
        Ok(())
    });
    let err = result.expect_err("the waiting ranks cannot complete their barrier");
    assert!(err.to_string().contains("rank 1 left the world"), "{err}");
    assert_others_failed_at_once(&seen, 3, &["rank 1 left", "closure returned"]);
}

#[test]
fn under_run_a_rank_that_stops_calling_is_bounded_by_the_configured_timeout() {
    let timeout = Duration::from_millis(200);
    let hold = Duration::from_millis(1500);
    let start = Instant::now();
    let result = ThreadWorld::run_with_timeout(3, timeout, |c| {
        if c.rank() == 2 {
            // Alive but absent from the barrier below: only the timeout ends the others' wait.
            thread::sleep(hold);
            return Ok(Duration::ZERO);
        }
        let res = c.barrier();
        let elapsed = start.elapsed();
        res.map(|()| elapsed)
    });
    let err = result.expect_err("the barrier cannot complete").to_string();
    assert!(err.contains("timed out") && err.contains("[2]"), "{err}");
    // Returned at the timeout (the error comes from a waiting rank, before the absent one ends).
    assert!(
        start.elapsed() >= hold,
        "run returns once every rank is joined"
    );
}

#[test]
fn a_zero_timeout_is_refused() {
    let err = ThreadWorld::run_with_timeout(2, Duration::ZERO, |_| Ok(())).unwrap_err();
    assert!(err.to_string().contains("timeout 0 s"), "{err}");
}

#[test]
fn run_returns_every_result_in_rank_order_when_all_succeed() {
    let out = ThreadWorld::run(4, |c| {
        let mut buf = [c.rank() as f32];
        c.all_reduce(BufMut::F32(&mut buf), ReduceOp::Sum)?;
        Ok((c.rank(), buf[0]))
    })
    .unwrap();
    assert_eq!(out, vec![(0, 6.0), (1, 6.0), (2, 6.0), (3, 6.0)]);
}

/// Copies of 4 MiB or more run in parts on several threads: a world of one and of three gather
/// shards of a few million odd-sized elements, every byte in place.
#[test]
fn large_gathers_copy_every_element() {
    for world in [1, 3] {
        let s = 1_500_001; // 6 MB per shard, odd, so the halves are not aligned to elements
        let out = ThreadWorld::run(world, |c| {
            let shard: Vec<f32> = (0..s).map(|i| (c.rank() * s + i) as f32).collect();
            let mut full = vec![0.0f32; world * s];
            c.all_gather(Buf::F32(&shard), BufMut::F32(&mut full))?;
            Ok(full)
        })
        .unwrap();
        let want: Vec<f32> = (0..world * s).map(|i| i as f32).collect();
        for (r, full) in out.iter().enumerate() {
            assert!(full == &want, "world {world}, rank {r}");
        }
    }
}

/// The rendezvous wait is measured where it happens: the rank that arrives first waits for the
/// late one, the late one does not wait; backends that cannot tell say so.
#[test]
fn thread_ranks_report_time_spent_waiting_for_late_peers() {
    let waits = ThreadWorld::run(2, |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(500));
        }
        c.barrier()?;
        Ok(c.peer_wait_seconds()
            .expect("thread ranks report their waits"))
    })
    .unwrap();
    assert!(waits[0] >= 0.2, "the early rank waited {:.3} s", waits[0]);
    assert!(waits[1] < 0.2, "the late rank waited {:.3} s", waits[1]);
    assert_eq!(ragged::comm::single::SingleRank.peer_wait_seconds(), None);
}

// ---------------------------------------------------------------------------------------------
// Groups (`Communicator::split`)

/// A split makes worlds of their own: each group, contiguous (`rank / 3`) or interleaved
/// (`rank % 2`), runs every collective (`conformance::exercise`) to the same bits as a fresh
/// world of its size at the same rank, all groups at once; the parent world still works after.
#[test]
fn split_groups_run_every_collective_as_worlds_of_their_own() {
    use ragged::comm::conformance::exercise;
    let reference = |size: usize| ThreadWorld::run(size, |c| exercise(c)).unwrap();
    let (of_3, of_2) = (reference(3), reference(2));
    let ranks = ThreadWorld::run(6, |c| {
        let contiguous = c.split(c.rank() / 3)?;
        let interleaved = c.split(c.rank() % 2)?;
        let shape = |g: &dyn Communicator| (g.rank(), g.world_size());
        let shapes = (shape(&*contiguous), shape(&*interleaved));
        let bits = (exercise(&*contiguous)?, exercise(&*interleaved)?);
        let mut after = vec![0f32; 6];
        after[c.rank()] = c.rank() as f32;
        c.all_gather_in_place(BufMut::F32(&mut after))?;
        Ok((shapes, bits, after))
    })
    .unwrap();
    for (r, (shapes, bits, after)) in ranks.iter().enumerate() {
        assert_eq!(*shapes, ((r % 3, 3), (r / 2, 3)), "rank {r}");
        assert!(bits.0 == of_3[r % 3], "rank {r}: contiguous group");
        assert!(bits.1 == of_3[r / 2], "rank {r}: interleaved group");
        assert_eq!(*after, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    }
    // Groups of unequal sizes, and a group of one.
    let sizes = ThreadWorld::run(5, |c| {
        let g = c.split(usize::from(c.rank() >= 2) + usize::from(c.rank() == 4))?;
        Ok((g.world_size(), exercise(&*g)?))
    })
    .unwrap();
    assert_eq!(
        sizes.iter().map(|s| s.0).collect::<Vec<_>>(),
        [2, 2, 2, 2, 1]
    );
    assert!(sizes[2].1 == of_2[0] && sizes[3].1 == of_2[1]);
    assert!(sizes[4].1 == reference(1)[0]);
}

/// A group member that fails makes its group's pending collective fail promptly through
/// `ThreadWorld::run`, naming it; ranks of the other group are not held.
#[test]
fn a_failing_group_member_fails_its_group_promptly() {
    let start = Instant::now();
    let out = within(GENEROUS, || {
        ThreadWorld::run(4, |c| {
            let g = c.split(c.rank() / 2)?;
            if c.rank() == 1 {
                return Err(Error::BadInput {
                    op: "test",
                    what: "rank 1".into(),
                    reason: "fails on purpose".into(),
                });
            }
            let mut buf = vec![0u8; 2];
            let group = g.all_gather_in_place(BufMut::U8(&mut buf));
            Ok(group.map_err(|e| e.to_string()))
        })
    });
    let err = out.expect_err("rank 1 failed").to_string();
    assert!(err.contains("fails on purpose"), "{err}");
    assert!(start.elapsed() < PROMPT, "took {:?}", start.elapsed());
    // Seen from inside: rank 0's group call fails naming its group's rank 1, ranks 2 and 3's
    // succeeds.
    let seen = within(GENEROUS, || {
        ThreadWorld::run(4, |c| {
            let g = c.split(c.rank() / 2)?;
            if c.rank() == 1 {
                drop(g);
                return Ok(Ok(()));
            }
            let mut buf = vec![0u8; 2];
            Ok(g.all_gather_in_place(BufMut::U8(&mut buf))
                .map_err(|e| e.to_string()))
        })
    })
    .unwrap();
    assert!(
        seen[0].as_ref().is_err_and(|e| e.contains("rank 1")),
        "{:?}",
        seen[0]
    );
    assert!(seen[2].is_ok() && seen[3].is_ok(), "{seen:?}");
}

/// One rank splits alone: the others never call, so the world's timeout names them.
#[test]
fn a_split_is_a_collective_of_the_whole_world() {
    let out = ThreadWorld::run_with_timeout(3, Duration::from_millis(300), |c| {
        if c.rank() == 0 {
            return c.split(0).map(|_| ());
        }
        thread::sleep(Duration::from_millis(800));
        Ok(())
    });
    let err = out.expect_err("rank 0 split alone").to_string();
    assert!(err.contains("waiting for ranks [1, 2]"), "{err}");
    assert!(ragged::comm::single::SingleRank
        .split(7)
        .is_ok_and(|g| g.world_size() == 1));
}

/// A rank that leaves a group (dropping it, as a sharded model's HSDP groups drop when its
/// closure ends) and then returns `Err` is the cause `ThreadWorld::run` reports, though the
/// group's other member fails at once and returns first; that member's error names the group
/// (ranks numbered within it) and reports the rank it is in the world.
#[test]
fn the_rank_that_left_a_group_first_is_the_failure_run_reports() {
    let out = within(GENEROUS, || {
        ThreadWorld::run(4, |c| {
            let g = c.split(c.rank() % 2)?;
            if c.rank() == 3 {
                drop(g);
                thread::sleep(Duration::from_millis(300));
                return Err(Error::Msg("rank 3's own failure".into()));
            }
            let mut buf = vec![0u8; 2];
            let r = g.all_gather_in_place(BufMut::U8(&mut buf));
            if c.rank() == 1 {
                let e = r.expect_err("group rank 1 (rank 3) left");
                let text = e.to_string();
                assert!(matches!(e, Error::Comm { rank: 1, .. }), "{text}");
                assert!(text.contains("in the group of ranks [1, 3]"), "{text}");
                return Err(e);
            }
            r
        })
    });
    let err = out.expect_err("rank 3 failed").to_string();
    assert!(err.contains("rank 3's own failure"), "{err}");
    // Groups every rank left before a collective they all came to do not count: rank 0,
    // failing first after it, is the failure reported.
    let out = within(GENEROUS, || {
        ThreadWorld::run(4, |c| {
            drop(c.split(c.rank() % 2)?);
            c.barrier()?;
            match c.rank() {
                0 => Err(Error::Msg("rank 0 fails first".into())),
                3 => {
                    thread::sleep(Duration::from_millis(300));
                    Err(Error::Msg("rank 3 fails later".into()))
                }
                _ => Ok(()),
            }
        })
    });
    let err = out.expect_err("ranks 0 and 3 failed").to_string();
    assert!(err.contains("rank 0 fails first"), "{err}");
}
