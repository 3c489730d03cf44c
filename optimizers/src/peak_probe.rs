//! The machine's f32 peak, measured: every core runs a loop of independent fused multiply-adds
//! on the widest vectors the CPU has, and the rate is counted. A VM's `/proc/cpuinfo` reports
//! its nominal (base) clock, and turbo and the number of FMA ports are not reported at all, so
//! a peak derived from them can sit below what the cores do (MFU above 100 %); this one cannot.
//!
//! Each thread keeps `CHAINS` independent accumulators (more than FMA latency × ports, 4 ×
//! 2), so the loop is throughput-bound. Each thread times its own short repeats and keeps its
//! best (a shared machine deschedules threads now and then; the best repeat is the one that
//! ran undisturbed); the peak is the sum over the threads, which start together.

use std::time::Instant;

/// Independent FMA chains per thread.
const CHAINS: usize = 12;

// `run_avx512`'s assembly spells out its accumulators.
const _: () = assert!(
    CHAINS == 12,
    "run_avx512 has 12 accumulators in zmm0..zmm11"
);

/// FMAs per chain per repeat.
const ITERS: usize = 500_000;

/// Which FMA loop ran, and the measured f32 GFLOP/s over `threads` threads.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredPeak {
    pub kernel: &'static str,
    pub threads: usize,
    pub gflops: f64,
}

/// Measures the f32 FMA rate on `threads` threads (each thread's best of `repeats`).
pub fn measure_f32_peak(threads: usize, repeats: usize) -> MeasuredPeak {
    let threads = threads.max(1);
    let (kernel, lanes) = fma_kernel();
    let flops = (CHAINS * ITERS * lanes * 2) as f64;
    let best_rate = |k: usize| {
        let mut best = f64::INFINITY;
        let mut sink = 0f32;
        for _ in 0..repeats.max(1) {
            let t = Instant::now();
            sink += run(k as f32);
            best = best.min(t.elapsed().as_secs_f64());
        }
        std::hint::black_box(sink);
        flops / best / 1e9
    };
    let gflops = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|k| s.spawn(move || best_rate(k)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
    });
    MeasuredPeak {
        kernel,
        threads,
        gflops,
    }
}

/// The loop this CPU runs and its lanes per FMA.
fn fma_kernel() -> (&'static str, usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            return ("AVX-512 FMA (16 lanes)", 16);
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return ("AVX2 FMA (8 lanes)", 8);
        }
    }
    ("scalar mul_add (1 lane)", 1)
}

/// One thread's loop; returns a sum of the accumulators so nothing is optimized away.
fn run(seed: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F.
            return unsafe { run_avx512(seed) };
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { run_avx2(seed) };
        }
    }
    let mut acc = [seed; CHAINS];
    for _ in 0..ITERS {
        for a in &mut acc {
            *a = a.mul_add(0.999_999, 1e-7);
        }
    }
    acc.iter().sum()
}

/// The AVX-512 loop in inline assembly: the `_mm512` intrinsics and the `avx512f` target
/// feature need Rust 1.89, above this workspace's MSRV (1.85); `asm!` does not.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
unsafe fn run_avx512(seed: f32) -> f32 {
    let consts = [seed, 0.999_999f32, 1e-7f32];
    let mut out = 0f32;
    // SAFETY: the caller checked AVX-512F. The block reads `consts` (3 floats), writes one
    // float to `out`, and clobbers only the vector registers it names and the counter.
    unsafe {
        std::arch::asm!(
            "vbroadcastss zmm12, dword ptr [{c}]",
            "vbroadcastss zmm13, dword ptr [{c} + 4]",
            "vbroadcastss zmm14, dword ptr [{c} + 8]",
            "vmovaps zmm0, zmm12", "vmovaps zmm1, zmm12", "vmovaps zmm2, zmm12",
            "vmovaps zmm3, zmm12", "vmovaps zmm4, zmm12", "vmovaps zmm5, zmm12",
            "vmovaps zmm6, zmm12", "vmovaps zmm7, zmm12", "vmovaps zmm8, zmm12",
            "vmovaps zmm9, zmm12", "vmovaps zmm10, zmm12", "vmovaps zmm11, zmm12",
            "2:",
            "vfmadd213ps zmm0, zmm13, zmm14", "vfmadd213ps zmm1, zmm13, zmm14",
            "vfmadd213ps zmm2, zmm13, zmm14", "vfmadd213ps zmm3, zmm13, zmm14",
            "vfmadd213ps zmm4, zmm13, zmm14", "vfmadd213ps zmm5, zmm13, zmm14",
            "vfmadd213ps zmm6, zmm13, zmm14", "vfmadd213ps zmm7, zmm13, zmm14",
            "vfmadd213ps zmm8, zmm13, zmm14", "vfmadd213ps zmm9, zmm13, zmm14",
            "vfmadd213ps zmm10, zmm13, zmm14", "vfmadd213ps zmm11, zmm13, zmm14",
            "dec {n}",
            "jnz 2b",
            "vaddps zmm0, zmm0, zmm11",
            "vmovss dword ptr [{o}], xmm0",
            "vzeroupper",
            c = in(reg) consts.as_ptr(),
            o = in(reg) &mut out as *mut f32,
            n = inout(reg) ITERS => _,
            out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _,
            out("xmm4") _, out("xmm5") _, out("xmm6") _, out("xmm7") _,
            out("xmm8") _, out("xmm9") _, out("xmm10") _, out("xmm11") _,
            out("xmm12") _, out("xmm13") _, out("xmm14") _,
            options(nostack),
        );
    }
    out
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2(seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let (mul, add) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    let mut acc = [_mm256_set1_ps(seed); CHAINS];
    for _ in 0..ITERS {
        for a in &mut acc {
            *a = _mm256_fmadd_ps(*a, mul, add);
        }
    }
    let mut out = [0f32; 8];
    let mut sum = 0.0;
    for a in acc {
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), a) };
        sum += out.iter().sum::<f32>();
    }
    sum
}
