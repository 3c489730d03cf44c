//! 8-bit Adam steps in a loop, for profiling (`perf record`) and quick per-element timings:
//! `cargo run --release -p ragged-optimizers --example adam8bit_steps -- [llama | SIDE] [STEPS]
//! [portable | avx2 | avx512]` steps one case of [`ragged_optimizers::bench`] (the Llama-3-8B
//! layer ÷ 4, or one `SIDE × SIDE` matrix) `STEPS` times (default 200) on the given kernel
//! (default: the fastest this CPU runs) and prints the best and median nanoseconds per
//! element. `RAYON_NUM_THREADS=1` times one core.

use std::time::Instant;

use ragged::{Error, Result};
use ragged_optimizers::adam8bit::Adam8bitKernel;
use ragged_optimizers::bench::{llama3_8b_layer, square, Case, OptimKind};

fn bad(what: &str, reason: &str) -> Error {
    Error::BadInput {
        op: "adam8bit_steps",
        what: what.into(),
        reason: reason.into(),
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let set = match args.first().map(String::as_str) {
        None | Some("llama") => llama3_8b_layer(4),
        Some(s) => square(s.parse().map_err(|_| bad(s, "expected llama or a side"))?),
    };
    let steps: usize = match args.get(1) {
        Some(s) => s.parse().map_err(|_| bad(s, "expected a step count"))?,
        None => 200,
    };
    let kernel = match args.get(2).map(String::as_str) {
        None => Adam8bitKernel::detect(),
        Some("portable") => Adam8bitKernel::Portable,
        Some("avx2") => Adam8bitKernel::Avx2,
        Some("avx512") => Adam8bitKernel::Avx512,
        Some(s) => return Err(bad(s, "expected portable, avx2 or avx512")),
    };
    let mut case = Case::with_adam8bit_kernel(OptimKind::Adam8bit, &set, kernel)?;
    case.step()?;
    let mut times: Vec<f64> = (0..steps.max(1))
        .map(|_| {
            let t = Instant::now();
            case.step().map(|()| t.elapsed().as_secs_f64())
        })
        .collect::<Result<_>>()?;
    times.sort_by(f64::total_cmp);
    let per = |s: f64| 1e9 * s / set.numel() as f64;
    println!(
        "{} | {kernel:?} | {} threads | best {:.3} ns/element, median {:.3}",
        set.name,
        rayon::current_num_threads(),
        per(times[0]),
        per(times[(times.len() - 1) / 2])
    );
    Ok(())
}
