//! Times ragged's AMX bf16 products on the shapes Newton–Schulz multiplies for the d = 1024
//! Llama stack (and square ones), best of `reps`, on every rayon thread: for tuning
//! `kernels::amx_bf16`. Prints the rate in multiply-adds actually done ×2 (a symmetric
//! product does about half of the full one's). First, per thread and summed: the unit's
//! peak (`TDPBF16PS` without loads), the kernel's 2×2 tile loop with its operands cycling
//! through buffers of L1 to L2 sizes, and the same loop storing and reloading its
//! accumulators every 8, 16 or 32 steps: what the blocking constants trade.
//!
//! `cargo run --release -p ragged-optimizers --example amx_products -- [reps] [only]` (`only`:
//! run just the products whose name contains it, e.g. `"matmul 2048"`, `"sym 1024x"`).
//! Exits with the reason where the CPU or kernel gives no AMX.

use std::time::Instant;

use half::bf16;
use ragged_optimizers::kernels::amx_bf16::{amx, Epilogue, Rhs};
use ragged_optimizers::kernels::Parallelism;

fn filled(len: usize, seed: u32) -> Vec<bf16> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            bf16::from_f32((s % 2001) as f32 / 1000.0 - 1.0)
        })
        .collect()
}

fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() -> ragged::Result<()> {
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let only = std::env::args().nth(2).unwrap_or_default();
    let amx = amx()?;
    let plain = Epilogue::PLAIN;
    println!("threads {}", rayon::current_num_threads());
    let pool = Parallelism::Rayon(rayon::current_num_threads());
    let peak: f64 = rayon::broadcast(|_| tdp_peak()).iter().sum();
    println!("TDPBF16PS loop without loads: {peak:.0} GFLOP/s over the threads");
    let loops: &[(usize, usize)] = if only.is_empty() {
        &[
            (16, 16),
            (32, 16),
            (64, 16),
            (64, 64),
            (256, 256),
            (1024, 1024),
        ]
    } else {
        &[]
    };
    for &(a_kib, b_kib) in loops {
        let r: f64 = rayon::broadcast(|_| tile_loop(a_kib << 10, b_kib << 10))
            .iter()
            .sum();
        println!("2x2 tile loop, A cycling {a_kib} KiB, B {b_kib} KiB: {r:.0} GFLOP/s");
    }
    for &every in if only.is_empty() {
        &[8usize, 16, 32][..]
    } else {
        &[]
    } {
        let r: f64 = rayon::broadcast(|_| tile_loop_acc(64 << 10, 16 << 10, every))
            .iter()
            .sum();
        println!("2x2 tile loop, A 64 KiB, B 16 KiB, accumulators out and in every {every} steps: {r:.0} GFLOP/s");
    }
    // (m, n, k): full products `m×k · k×n`.
    for (m, n, k) in [
        (1024, 1024, 1024),
        (2048, 2048, 2048),
        (1024, 3584, 1024),
        (3584, 1024, 1024),
        (256, 1024, 256),
    ] {
        if !format!("matmul {m}x{k}x{n}").contains(&only) {
            continue;
        }
        let (a, b) = (filled(m * k, 1), filled(k * n, 2));
        let mut out = vec![bf16::ZERO; m * n];
        let add = filled(m * n, 3);
        let t = best(reps, || {
            let epi = Epilogue {
                alpha: 0.5,
                add: Some((2.0, &add)),
            };
            amx.matmul(m, n, k, &a, Rhs::Plain(&b), &mut out, epi, pool)
        });
        let flops = 2.0 * (m * n * k) as f64;
        println!(
            "matmul {m}x{k}·{k}x{n}: {:8.3} ms  {:6.0} GFLOP/s",
            t * 1e3,
            flops / t / 1e9
        );
    }
    // (n, k): symmetric `n×k · (n×k)ᵀ`, lower blocks only.
    for (n, k) in [(1024, 1024), (1024, 3584), (2048, 2048), (256, 1024)] {
        if !format!("sym {n}x{k}").contains(&only) {
            continue;
        }
        let a = filled(n * k, 4);
        let mut out = vec![bf16::ZERO; n * n];
        let blocks = n.div_ceil(32);
        let done = (blocks * (blocks + 1) / 2 * 32 * 32 * k) as f64 * 2.0;
        let t = best(reps, || amx.sym_nt(n, k, &a, &mut out, plain, pool));
        println!(
            "sym_nt {n}x{k}: {:8.3} ms  {:6.0} GFLOP/s (done)",
            t * 1e3,
            done / t / 1e9
        );
        // The same Gram matrix from the tall `k×n` (a tall matrix's Newton–Schulz).
        let t = best(reps, || amx.sym_tn(n, k, &a, &mut out, plain, pool));
        println!(
            "sym_tn {n}x{k}: {:8.3} ms  {:6.0} GFLOP/s (done)",
            t * 1e3,
            done / t / 1e9
        );
    }
    Ok(())
}

/// Palette 1 with all eight tiles 16 rows of 64 bytes (as `kernels::amx_bf16` configures
/// them).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> TileConfig {
        let mut cfg = TileConfig([0; 64]);
        cfg.0[0] = 1;
        for t in 0..8 {
            cfg.0[16 + 2 * t] = 64;
            cfg.0[48 + t] = 16;
        }
        cfg
    }
}

/// GFLOP/s of a loop of independent `TDPBF16PS` on tiles already loaded (the unit's peak on
/// this thread).
fn tdp_peak() -> f64 {
    let cfg = TileConfig::new();
    let iters = 2_000_000u64;
    let t = Instant::now();
    // SAFETY: `amx()` succeeded (tile state granted); a valid palette-1 configuration; the
    // loop touches tiles only.
    unsafe {
        std::arch::asm!(
            "ldtilecfg [{cfg}]",
            "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
            "tilezero tmm4", "tilezero tmm5", "tilezero tmm6", "tilezero tmm7",
            "2:",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "dec {n}",
            "jnz 2b",
            "tilerelease",
            cfg = in(reg) cfg.0.as_ptr(),
            n = inout(reg) iters => _,
        );
    }
    let flops = iters as f64 * 4.0 * 16.0 * 16.0 * 32.0 * 2.0;
    flops / t.elapsed().as_secs_f64() / 1e9
}

/// One 64-byte line of tile data.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct L([u8; 64]);

/// `n` lines of bf16 values in [-1, 1] (as products see them: the unit's power, and so its
/// clock, may depend on the data; zeros would flatter it).
fn random_lines(n: usize, seed: u32) -> Vec<L> {
    let values = filled(n * 32, seed);
    values
        .chunks_exact(32)
        .map(|c| {
            let mut line = L([0; 64]);
            for (pair, v) in line.0.chunks_exact_mut(2).zip(c) {
                pair.copy_from_slice(&v.to_bits().to_le_bytes());
            }
            line
        })
        .collect()
}

/// GFLOP/s of the 2×2 microkernel's loop (2 A tiles, 2 B tiles, 4 `TDPBF16PS` a step) with
/// its operands cycling through buffers of `a_bytes` and `b_bytes`.
fn tile_loop(a_bytes: usize, b_bytes: usize) -> f64 {
    tile_loop_acc(a_bytes, b_bytes, 0)
}

/// As [`tile_loop`], and every `acc_every` steps (0: never) the four accumulators are stored
/// to and reloaded from a 256 KiB buffer (the next block's place in it).
///
/// The loop body repeats `kernels::amx_bf16::block_product`'s (less its prefetches of the
/// next panel) on purpose: this times that loop with its operands where the test puts them,
/// apart from the kernel's packing and blocking.
fn tile_loop_acc(a_bytes: usize, b_bytes: usize, acc_every: usize) -> f64 {
    let cfg = TileConfig::new();
    let a = random_lines(a_bytes / 64, 5);
    let b = random_lines(b_bytes / 64, 6);
    let (a_steps, b_steps) = (a_bytes / 2048, b_bytes / 2048);
    let mut accs = vec![L([0; 64]); 4096];
    let mut next_acc = 0;
    let rounds = 200_000 / a_steps.max(b_steps);
    let steps = rounds * a_steps.max(b_steps);
    let t = Instant::now();
    // SAFETY: `amx()` succeeded; every tile load reads 1 KiB inside `a` or `b` (pointers wrap
    // at the buffers' ends).
    unsafe {
        std::arch::asm!("ldtilecfg [{cfg}]", "tilezero tmm0", "tilezero tmm1", "tilezero tmm2",
            "tilezero tmm3", cfg = in(reg) cfg.0.as_ptr());
        for s in 0..steps {
            if acc_every > 0 && s % acc_every == 0 {
                let c = accs.as_mut_ptr().cast::<u8>().add(next_acc * 4096);
                // 62 places: the reload reads the next 4 KiB, inside the buffer.
                next_acc = (next_acc + 1) % 62;
                std::arch::asm!(
                    "tilestored [{c} + {s128}*1], tmm0",
                    "tilestored [{c} + {s128}*1 + 64], tmm1",
                    "tilestored [{c} + {s128}*1 + 2048], tmm2",
                    "tilestored [{c} + {s128}*1 + 2112], tmm3",
                    "tileloadd tmm0, [{c} + {s128}*1 + 4096]",
                    "tileloadd tmm1, [{c} + {s128}*1 + 4160]",
                    "tileloadd tmm2, [{c} + {s128}*1 + 6144]",
                    "tileloadd tmm3, [{c} + {s128}*1 + 6208]",
                    c = in(reg) c, s128 = in(reg) 128usize,
                );
            }
            let pa = a.as_ptr().cast::<u8>().add((s % a_steps) * 2048);
            let pb = b.as_ptr().cast::<u8>().add((s % b_steps) * 2048);
            std::arch::asm!(
                "tileloadd tmm4, [{a} + {s64}*1]",
                "tileloadd tmm6, [{b} + {s64}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b} + {s64}*1 + 1024]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a} + {s64}*1 + 1024]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a = in(reg) pa, b = in(reg) pb, s64 = in(reg) 64usize,
            );
        }
        std::arch::asm!("tilerelease");
    }
    let flops = steps as f64 * 4.0 * 16.0 * 16.0 * 32.0 * 2.0;
    flops / t.elapsed().as_secs_f64() / 1e9
}
