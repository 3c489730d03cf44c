//! Criterion timing of the thread backend's in-place all-gather and reduce-scatter (Sum) against
//! a one-thread memcpy, measured in the same run.
//!
//! Every rank holds a 16 MiB f32 buffer (the full group buffer of the in-place collectives).
//! Bytes counted for a collective: what moves between ranks, summed over ranks, (V−1) · 16 MiB
//! (each rank reads V−1 foreign slices of 16/V MiB; that is V × NCCL's "bus bandwidth"). The
//! memcpy baseline copies 16 MiB on one thread. Ranks are threads, so with V ranks on a machine
//! with fewer cores they take turns; the timing is wall clock from a barrier before the batch to
//! a barrier after it, on every rank, taking the slowest. Since the ranks use every core, a
//! second baseline copies the same 16 MiB split over all cores.
//!
//! After criterion's report a table gives GiB/s and the ratio to memcpy for every case, from the
//! same iterations criterion timed (warm-up included).

use std::hint::black_box;
use std::sync::{Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use ragged::comm::threads::{ThreadComm, ThreadWorld};
use ragged::comm::{BufMut, Communicator, ReduceOp};

const BYTES: usize = 16 << 20;
const ELEMS: usize = BYTES / 4;
const WORLD_SIZES: [usize; 2] = [2, 4];

/// One rank's call of the collective under test.
type RankOp = fn(&ThreadComm, &mut [f32]);

/// (name, bytes per iteration, iterations, time) of every case, for the closing table.
static TALLY: Mutex<Vec<(String, u64, u64, Duration)>> = Mutex::new(Vec::new());

fn record(name: &str, bytes: u64, iters: u64, time: Duration) {
    let mut tally = TALLY.lock().unwrap();
    match tally.iter_mut().find(|t| t.0 == name) {
        Some(t) => {
            t.2 += iters;
            t.3 += time;
        }
        None => tally.push((name.to_string(), bytes, iters, time)),
    }
}

/// Runs `iters` collectives on `v` fresh rank threads over `bufs` and returns the slowest rank's
/// time from the first barrier to the last.
fn time_batch(v: usize, iters: u64, bufs: &mut [Vec<f32>], op: RankOp) -> Duration {
    let comms = ThreadWorld::new(v).expect("world");
    thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(bufs.iter_mut())
            .map(|(c, buf)| {
                s.spawn(move || {
                    c.barrier().expect("barrier");
                    let start = Instant::now();
                    for _ in 0..iters {
                        op(&c, black_box(buf.as_mut_slice()));
                    }
                    c.barrier().expect("barrier");
                    start.elapsed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .max()
            .unwrap_or_default()
    })
}

/// `iters` copies of `src` into `dst`, split over `threads` threads started together; the
/// slowest thread's time.
fn time_memcpy(threads: usize, iters: u64, src: &[u8], dst: &mut [u8]) -> Duration {
    let part = src.len().div_ceil(threads);
    let start_line = Barrier::new(threads);
    thread::scope(|s| {
        let handles: Vec<_> = src
            .chunks(part)
            .zip(dst.chunks_mut(part))
            .map(|(src, dst)| {
                let start_line = &start_line;
                s.spawn(move || {
                    start_line.wait();
                    let start = Instant::now();
                    for _ in 0..iters {
                        black_box(&mut *dst).copy_from_slice(black_box(src));
                    }
                    start.elapsed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("copy thread"))
            .max()
            .unwrap_or_default()
    })
}

fn all_gather_in_place(c: &ThreadComm, buf: &mut [f32]) {
    c.all_gather_in_place(BufMut::F32(buf))
        .expect("all_gather_in_place");
}

fn reduce_scatter_in_place(c: &ThreadComm, buf: &mut [f32]) {
    // Only the own slice changes (to own + Σ others), so values grow linearly: no overflow.
    c.reduce_scatter_in_place(BufMut::F32(buf), ReduceOp::Sum)
        .expect("reduce_scatter_in_place");
}

fn memcpy(c: &mut Criterion) {
    let mut group = c.benchmark_group("memcpy");
    group.throughput(Throughput::Bytes(BYTES as u64));
    let src = vec![1u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    let cores = thread::available_parallelism().map_or(1, |n| n.get());
    let mut thread_counts = vec![1];
    if cores > 1 {
        thread_counts.push(cores);
    }
    for threads in thread_counts {
        let name = format!("memcpy 16MiB, {threads} thread(s)");
        group.bench_function(format!("16MiB/{threads}threads"), |b| {
            b.iter_custom(|iters| {
                let time = time_memcpy(threads, iters, &src, &mut dst);
                record(&name, BYTES as u64, iters, time);
                time
            })
        });
    }
    group.finish();
}

fn collectives(c: &mut Criterion) {
    let cases: [(&str, RankOp); 2] = [
        ("all_gather_in_place", all_gather_in_place),
        ("reduce_scatter_in_place_sum", reduce_scatter_in_place),
    ];
    for (name, op) in cases {
        let mut group = c.benchmark_group(name);
        for v in WORLD_SIZES {
            let bytes = ((v - 1) * BYTES) as u64;
            group.throughput(Throughput::Bytes(bytes));
            let mut bufs: Vec<Vec<f32>> = (0..v).map(|r| vec![r as f32 + 1.0; ELEMS]).collect();
            group.bench_function(format!("f32/16MiB-per-rank/V{v}"), |b| {
                b.iter_custom(|iters| {
                    let time = time_batch(v, iters, &mut bufs, op);
                    record(&format!("{name} V={v}"), bytes, iters, time);
                    time
                })
            });
        }
        group.finish();
    }
}

fn summary() {
    let tally = TALLY.lock().unwrap();
    let gibs = |t: &(String, u64, u64, Duration)| {
        (t.1 * t.2) as f64 / t.3.as_secs_f64().max(1e-12) / (1u64 << 30) as f64
    };
    let memcpy: Vec<f64> = tally
        .iter()
        .filter(|t| t.0.starts_with("memcpy"))
        .map(gibs)
        .collect();
    let (Some(&one), Some(&all)) = (memcpy.first(), memcpy.last()) else {
        return;
    };
    println!("\nbytes per second vs memcpy of the same run (collectives: bytes between ranks):");
    println!(
        "  {:<34} {:>7}        {:>15}  {:>15}",
        "", "", "vs 1-thread", "vs all-core"
    );
    for t in tally.iter() {
        println!(
            "  {:<34} {:>7.2} GiB/s  {:>13.1} %  {:>13.1} %",
            t.0,
            gibs(t),
            100.0 * gibs(t) / one,
            100.0 * gibs(t) / all
        );
    }
}

/// One training step of the demo transformer on 2 thread ranks, ragged vs the FSDP2-style
/// layout (AdamW); the bytes each copies outside collectives are printed beside the times.
fn train_step(c: &mut Criterion) {
    use ragged::bench::comm::train_step;
    use ragged::demo::TransformerConfig;
    use ragged::fsdp::ShardLayout;
    use ragged_optimizers::AdamW;

    let mut group = c.benchmark_group("train_step");
    group.sample_size(10);
    for layout in [ShardLayout::Ragged, ShardLayout::Fsdp2] {
        let mut copied = 0;
        group.bench_function(format!("{layout:?} V=2 tiny"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let cfg = TransformerConfig::TINY;
                    let row = train_step(cfg, AdamW::default(), layout, 2, 3, 4).expect("train");
                    copied = row.copied_per_step;
                    total += Duration::from_secs_f64(row.seconds);
                }
                total
            })
        });
        println!("  {layout:?}: {copied} bytes copied outside collectives per step");
    }
    group.finish();
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    memcpy(&mut c);
    collectives(&mut c);
    train_step(&mut c);
    c.final_summary();
    summary();
}
