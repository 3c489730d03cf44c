//! 8-bit Adam steps in a loop, for profiling (`perf record`) and quick per-element timings:
//! `cargo run --release -p ragged-optimizers --example adam8bit_steps -- [llama | SIDE] [STEPS]
//! [portable | avx2 | avx512] [warm | cold]` steps one case of [`ragged_optimizers::bench`]
//! (the Llama-3-8B layer ÷ 4, or one `SIDE × SIDE` matrix) `STEPS` times (default 200) on the
//! given kernel (default: the fastest this CPU runs) and prints the best and median
//! nanoseconds per element. `RAYON_NUM_THREADS=1` times one core.
//!
//! `warm` (the default) steps back to back, so a case that fits the caches steps from them.
//! `cold` runs, before every step, a 256 MiB copy on rayon's threads (which evicts the caches,
//! as the benchmark's interleaved probe does) and times, after another such eviction, a copy
//! of the step's compulsory bytes ([`MemcpyProbe::gbps_shared`]): the like-for-like
//! baseline of a small step that starts from memory; it prints both and their ratio.
//!
//! `threshold [STEPS] [warm | cold]` measures where sharing a step with rayon's workers pays
//! back (`Adam8bit::with_parallel_min`): for one matrix of 4096 to 65 536 elements it
//! alternates a step that always shares with one that never does, `STEPS` pairs (default 400),
//! and prints both medians and their ratio.

use std::time::Instant;

use ragged::{Error, Result};
use ragged_optimizers::adam8bit::Adam8bitKernel;
use ragged_optimizers::bench::{
    cost, llama3_8b_layer, square, Case, MemcpyProbe, OptimKind, ShapeSet,
};
use ragged_optimizers::{Adam8bit, Adam8bitConfig};

fn bad(what: &str, reason: &str) -> Error {
    Error::BadInput {
        op: "adam8bit_steps",
        what: what.into(),
        reason: reason.into(),
    }
}

/// Best and median of `times` (non-empty), sorted in place.
fn best_median(times: &mut [f64]) -> (f64, f64) {
    times.sort_by(f64::total_cmp);
    (times[0], times[(times.len() - 1) / 2])
}

fn parse_cold(arg: Option<&String>) -> Result<bool> {
    match arg.map(String::as_str) {
        None | Some("warm") => Ok(false),
        Some("cold") => Ok(true),
        Some(s) => Err(bad(s, "expected warm or cold")),
    }
}

fn parse_steps(arg: Option<&String>, default: usize) -> Result<usize> {
    arg.map_or(Ok(default), |s| {
        s.parse().map_err(|_| bad(s, "expected a step count"))
    })
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("threshold") {
        return threshold(parse_steps(args.get(1), 400)?, parse_cold(args.get(2))?);
    }
    let set = match args.first().map(String::as_str) {
        None | Some("llama") => llama3_8b_layer(4),
        Some(s) => square(s.parse().map_err(|_| bad(s, "expected llama or a side"))?),
    };
    let steps = parse_steps(args.get(1), 200)?;
    let kernel = match args.get(2).map(String::as_str) {
        None => Adam8bitKernel::detect(),
        Some("portable") => Adam8bitKernel::Portable,
        Some("avx2") => Adam8bitKernel::Avx2,
        Some("avx512") => Adam8bitKernel::Avx512,
        Some(s) => return Err(bad(s, "expected portable, avx2 or avx512")),
    };
    let cold = parse_cold(args.get(3))?;
    let bytes = cost(OptimKind::Adam8bit, &set)?.bytes;
    let mut evict = cold.then(|| MemcpyProbe::new(256 << 20));
    // The same read + write bytes as the step's compulsory traffic: a copy of half of them.
    let mut same = cold.then(|| MemcpyProbe::new((bytes / 2.0) as usize));
    let mut case = Case::with_adam8bit_kernel(OptimKind::Adam8bit, &set, kernel)?;
    case.step()?;
    let (mut times, mut copies) = (Vec::new(), Vec::new());
    for _ in 0..steps.max(1) {
        if let Some(e) = evict.as_mut() {
            e.gbps();
        }
        let t = Instant::now();
        case.step()?;
        times.push(t.elapsed().as_secs_f64());
        if let (Some(e), Some(s)) = (evict.as_mut(), same.as_mut()) {
            e.gbps();
            copies.push(s.gbps_shared());
        }
    }
    let (best, median) = best_median(&mut times);
    let per = |s: f64| 1e9 * s / set.numel() as f64;
    println!(
        "{} | {kernel:?} | {} threads | {} | best {:.3} ns/element ({:.1} µs), median {:.3}",
        set.name,
        rayon::current_num_threads(),
        if cold { "cold" } else { "warm" },
        per(best),
        1e6 * best,
        per(median)
    );
    if !copies.is_empty() {
        let (lo, mid) = best_median(&mut copies);
        let hi = copies[copies.len() - 1];
        let step_gbps = bytes / median / 1e9;
        println!(
            "  step {step_gbps:.1} GB/s (median); same-bytes copy from memory {mid:.1} GB/s (median, {lo:.1}–{hi:.1}): {:.2}×",
            step_gbps / mid
        );
    }
    Ok(())
}

/// Shared against calling-thread steps, alternating, on matrices of 4096 to 65 536 elements.
fn threshold(steps: usize, cold: bool) -> Result<()> {
    let mut evict = cold.then(|| MemcpyProbe::new(256 << 20));
    println!(
        "{} threads, {}: median µs per step, always shared / never shared",
        rayon::current_num_threads(),
        if cold {
            "each step after a 256 MiB copy"
        } else {
            "back to back"
        }
    );
    for (rows, cols) in [(64, 64), (64, 128), (128, 128), (128, 256), (256, 256)] {
        let set = ShapeSet {
            name: format!("{rows}×{cols}"),
            params: vec![("w".into(), vec![rows, cols])],
        };
        let opt = |min: usize| Adam8bit::new(Adam8bitConfig::default())?.with_parallel_min(min);
        let mut cases = [
            Case::with_adam8bit(opt(0)?, &set)?,
            Case::with_adam8bit(opt(usize::MAX)?, &set)?,
        ];
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..steps.max(1) {
            for (case, times) in cases.iter_mut().zip(&mut times) {
                if let Some(e) = evict.as_mut() {
                    e.gbps();
                }
                let t = Instant::now();
                case.step()?;
                times.push(t.elapsed().as_secs_f64());
            }
        }
        let [shared, alone] = times.map(|mut t| best_median(&mut t).1);
        println!(
            "{:>9} ({:>5} elements): {:7.1} / {:7.1} µs, shared at {:.2}× the time",
            set.name,
            rows * cols,
            1e6 * shared,
            1e6 * alone,
            shared / alone
        );
    }
    Ok(())
}
