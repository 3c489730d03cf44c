//! The optimizer benchmark that `ragged bench optim` and `cargo bench -p ragged-optimizers`
//! share: step time of each optimizer on a one-rank shard, against the machine's peak and
//! against baselines measured in the same run (memcpy bandwidth, one large plain GEMM).
//!
//! # What is measured
//! Every case runs the optimizer through its public [`Optimizer::step`] on a one-rank
//! [`LocalShard`] holding every parameter of a [`ShapeSet`] back to back, with
//! [`SingleRank`] as the communicator: exactly what a user's training step runs. One untimed
//! step first (page faults, 8-bit state leaving all-zero), then `reps` timed steps; the table
//! shows the best and the median.
//!
//! # Counting
//! - **FLOPs per step** ([`Cost`]): element-wise optimizers count the IEEE operations of their
//!   formula per element (`sqrt` and division count one each; the comparisons of 8-bit Adam's
//!   code search do not count). Newton–Schulz on an `s × l` matrix (`s` the short side) counts
//!   `2·s²·l` (`X·Xᵀ`) + `2·s³` (`A·A`) + `2·s²·l` (`B·X`) per iteration plus its element
//!   operations; see [`ns_flops`]. These are nominal FLOPs, torch's iteration with full
//!   products: the symmetric halves and Gram Newton–Schulz do fewer (0.75× on a square
//!   1024² matrix, 0.5× on a 1024×3584 one), so a step's nominal rate can pass its GEMM's.
//! - **Bytes per step**: compulsory traffic only: every byte of parameters, gradients and
//!   optimizer state read once, and written once when the step updates it. Scratch (the
//!   8-bit tile buffers, Muon's Nesterov copy and Newton–Schulz workspace) is not counted, so
//!   GB/s is a lower bound of the traffic the step causes.
//! - **memcpy GB/s** counts read + write bytes (twice the copy size), the same accounting,
//!   so "vs memcpy" compares like with like. A step much smaller than the 256 MiB baseline
//!   copy cannot reach its streaming rate from memory, so AdamW's and 8-bit Adam's rows also
//!   compare each step with a copy of the **same** bytes after the same cache eviction
//!   ([`Row::vs_same_bytes_memcpy`]).
//! - **MFU**: GFLOP/s over the peak of the ISA and dtype the optimizer computes in (`f32`, and
//!   bf16 for `muon-bf16`, whose Newton–Schulz runs in bf16; [`Peak`]).
//!
//! # Adding an optimizer (Shampoo)
//! Add a variant to [`OptimKind`] (and to [`OptimKind::ALL`] and its `name`), build it in
//! [`Case::new`], and give its per-parameter [`Cost`] in [`cost`]; the CLI, the criterion
//! bench and the table pick it up from there.

use rayon::prelude::*;
use std::fmt::Write as _;
use std::str::FromStr;
use std::time::Instant;

use ragged::comm::SingleRank;
use ragged::demo::SplitMix;
use ragged::optim::{LocalShard, Optimizer};
use ragged::{Error, Result};

use ragged::model::{DType, TensorSpec, Unit};
use ragged::plan::PlanOptions;

use crate::{
    Adam8bit, Adam8bitConfig, Adam8bitKernel, Adam8bitState, AdamState, AdamW, Grafting,
    MatrixLayout, Muon, MuonConfig, MuonState, NsMethod, NsPrecision, Shampoo, ShampooConfig,
    ShampooState,
};
use half::bf16;

// ---------------------------------------------------------------------------------------------
// Machine peak
// ---------------------------------------------------------------------------------------------

/// The machine's peak arithmetic rate: cores × clock × FLOP/cycle of the widest vector (or
/// matrix) unit the CPU reports, where the effective clock is **measured** by an FMA loop on
/// every core ([`crate::peak_probe`]) unless `--ghz` gives it.
#[derive(Clone, Debug, PartialEq)]
pub struct Peak {
    /// `std::thread::available_parallelism()`.
    pub cores: usize,
    /// Clock in GHz.
    pub ghz: f64,
    /// Where the clock came from (`--ghz`, or the measured FMA rate, with the loop that ran
    /// and `/proc/cpuinfo`'s nominal clock for comparison).
    pub clock_source: String,
    /// The f32 unit: `AVX-512 f32` (64 FLOP/cycle/core: two 16-lane FMA ports), `AVX2+FMA f32`
    /// (32: two 8-lane FMA ports), or a scalar guess.
    pub f32_isa: &'static str,
    pub f32_flops_per_cycle: f64,
    /// The bf16 unit: `AMX-BF16` (≈1024 FLOP/cycle/core) when `/proc/cpuinfo` lists
    /// `amx_bf16`; AVX512-BF16 dot products (2× the f32 unit) when it lists `avx512_bf16`;
    /// otherwise bf16 runs on the f32 unit (widened, as candle's CPU matmul does).
    pub bf16_isa: &'static str,
    pub bf16_flops_per_cycle: f64,
}

impl Peak {
    /// Detects the peak of this machine; `ghz` overrides the clock. Without it the clock is
    /// the measured FMA rate over all cores divided by cores × FLOP/cycle (a VM reports its
    /// nominal clock in `/proc/cpuinfo`, and turbo is unknown), so the f32 peak is the
    /// measured one. `Err` when `ghz` is not finite and positive.
    pub fn detect(ghz: Option<f64>) -> Result<Peak> {
        if let Some(g) = ghz {
            ragged::limits::positive_finite("Peak::detect", "--ghz", g)?;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let mhz = cpuinfo
            .lines()
            .find(|l| l.starts_with("cpu MHz"))
            .and_then(|l| l.split(':').nth(1))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|m| m.is_finite() && *m > 0.0);
        let (f32_isa, f32_flops_per_cycle) = f32_unit();
        let nominal = mhz.map_or_else(|| "unknown".into(), |m| format!("{:.2} GHz", m / 1000.0));
        let (ghz, clock_source) = match ghz {
            Some(g) => (g, "--ghz".to_string()),
            None => {
                let m = crate::peak_probe::measure_f32_peak(cores, 40);
                let g = m.gflops / (cores as f64 * f32_flops_per_cycle);
                let why = format!(
                    "measured: {} on {} threads, {:.0} GFLOP/s; /proc/cpuinfo's nominal clock \
                     is {nominal}",
                    m.kernel, m.threads, m.gflops
                );
                (g, why)
            }
        };
        let has = |flag: &str| {
            cpuinfo
                .lines()
                .find(|l| l.starts_with("flags"))
                .is_some_and(|l| l.split_whitespace().any(|f| f == flag))
        };
        // AVX512-BF16's `vdpbf16ps` does two bf16 multiply-adds per f32 lane, twice the f32
        // FMA's FLOPs per instruction (what oneDNN's `brg:avx512_core_bf16` runs).
        let (bf16_isa, bf16_flops_per_cycle) = if has("amx_bf16") {
            ("AMX-BF16", 1024.0)
        } else if has("avx512_bf16") {
            (
                "AVX512-BF16 dot products, 2× the f32 unit",
                2.0 * f32_flops_per_cycle,
            )
        } else {
            ("no AMX: bf16 widened to the f32 unit", f32_flops_per_cycle)
        };
        Ok(Peak {
            cores,
            ghz,
            clock_source,
            f32_isa,
            f32_flops_per_cycle,
            bf16_isa,
            bf16_flops_per_cycle,
        })
    }

    /// Peak f32 GFLOP/s: cores × GHz × FLOP/cycle.
    pub fn f32_gflops(&self) -> f64 {
        self.cores as f64 * self.ghz * self.f32_flops_per_cycle
    }

    /// Peak bf16 GFLOP/s.
    pub fn bf16_gflops(&self) -> f64 {
        self.cores as f64 * self.ghz * self.bf16_flops_per_cycle
    }

    /// How the peaks were derived, in one line.
    pub fn derivation(&self) -> String {
        format!(
            "f32: {} cores × {:.2} GHz effective ({}) × {} FLOP/cycle ({}) = {:.0} GFLOP/s; \
             bf16: × {} FLOP/cycle ({}) = {:.0} GFLOP/s",
            self.cores,
            self.ghz,
            self.clock_source,
            self.f32_flops_per_cycle,
            self.f32_isa,
            self.f32_gflops(),
            self.bf16_flops_per_cycle,
            self.bf16_isa,
            self.bf16_gflops()
        )
    }
}

#[cfg(target_arch = "x86_64")]
fn f32_unit() -> (&'static str, f64) {
    if is_x86_feature_detected!("avx512f") {
        ("AVX-512 f32", 64.0)
    } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        ("AVX2+FMA f32", 32.0)
    } else {
        ("SSE f32 (no FMA)", 8.0)
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn f32_unit() -> (&'static str, f64) {
    ("unknown ISA (scalar FMA assumed)", 2.0)
}

// ---------------------------------------------------------------------------------------------
// Same-run baselines
// ---------------------------------------------------------------------------------------------

/// Baselines measured in the same run as the optimizers.
#[derive(Clone, Debug, PartialEq)]
pub struct Baselines {
    /// Bytes copied per memcpy (the source size).
    pub memcpy_bytes: usize,
    /// memcpy bandwidth on one thread, read + write bytes per second / 1e9 (best of the reps).
    pub memcpy_1t_gbps: f64,
    /// The same copy split over `threads` threads.
    pub memcpy_all_gbps: f64,
    pub threads: usize,
    /// Side of the square f32 GEMM.
    pub gemm_n: usize,
    /// `2n³ / t`, best and median of the reps, GFLOP/s.
    pub gemm_best_gflops: f64,
    pub gemm_median_gflops: f64,
    /// The same on oneDNN's bf16 matmul (best, median), where oneDNN has one.
    pub bf16_gemm_gflops: Option<(f64, f64)>,
    /// The same on ragged's AMX products, where the CPU has AMX.
    pub bf16_amx_gemm_gflops: Option<(f64, f64)>,
}

/// memcpy bandwidth in GB/s counting read + write bytes (`2·bytes / t`), best of `reps`, with
/// the copy split over `threads` threads.
pub fn memcpy_gbps(bytes: usize, reps: usize, threads: usize) -> f64 {
    2.0 * bytes as f64 / ragged::bench::comm::memcpy_seconds(bytes, reps, threads) / 1e9
}

/// A memcpy of a fixed buffer (the baseline's size, [`memcpy_gbps`]) on rayon's threads, one
/// contiguous chunk each, ready to time again and again: the one `run_case` interleaves with
/// the element-wise optimizers' steps, so that each step's GB/s is compared with a copy under
/// the same machine load. On rayon's threads, not the baseline's fresh ones, so that the
/// steps do not pay for waking rayon's workers after a copy.
pub struct MemcpyProbe {
    src: Vec<f32>,
    dst: Vec<f32>,
}

impl MemcpyProbe {
    /// Buffers of `bytes` each (touched once, so no timed copy faults pages in).
    pub fn new(bytes: usize) -> Self {
        let mut probe = MemcpyProbe {
            src: vec![1.0; (bytes / 4).max(1)],
            dst: vec![0.0; (bytes / 4).max(1)],
        };
        probe.gbps();
        probe
    }

    /// GB/s of one copy, read + write bytes (`2·bytes / t`).
    pub fn gbps(&mut self) -> f64 {
        let chunk = self.src.len().div_ceil(rayon::current_num_threads());
        let t = Instant::now();
        self.dst
            .par_chunks_mut(chunk)
            .zip(self.src.par_chunks(chunk))
            .for_each(|(d, src)| d.copy_from_slice(std::hint::black_box(src)));
        std::hint::black_box(&mut self.dst);
        8.0 * self.src.len() as f64 / t.elapsed().as_secs_f64() / 1e9
    }
}

impl MemcpyProbe {
    /// GB/s of one copy (read + write bytes) dispatched as 8-bit Adam's step is: 64 KiB
    /// chunks claimed by the calling thread and rayon's workers
    /// (`kernels::work_share`). The same-bytes baseline of a small step: a
    /// `par_chunks` copy from outside rayon's pool would pay the sleep and wake-up hand-off
    /// that the step no longer does, and be slower than the copy can be.
    pub fn gbps_shared(&mut self) -> f64 {
        const CHUNK: usize = 16 << 10; // f32 elements: 64 KiB
        let helpers = rayon::current_num_threads().saturating_sub(1);
        let t = Instant::now();
        let items: Vec<(&mut [f32], &[f32])> = self
            .dst
            .chunks_mut(CHUNK)
            .zip(self.src.chunks(CHUNK))
            .collect();
        crate::kernels::work_share::share(items, helpers, |(d, src)| {
            d.copy_from_slice(std::hint::black_box(src))
        });
        std::hint::black_box(&mut self.dst);
        8.0 * self.src.len() as f64 / t.elapsed().as_secs_f64() / 1e9
    }
}

/// A square GEMM `C = A·B` (row-major `n × n`, seeded operands), ready to time again and
/// again: the baselines, and the one `run_case` interleaves with Muon's steps. `f32` on the
/// `gemm` crate (AVX-512 kernels compiled in, picked at run time) on rayon's threads, or `bf16`
/// on oneDNN's matmul primitive (what bf16 Newton–Schulz runs on where oneDNN has it).
pub struct GemmProbe {
    n: usize,
    operands: Operands,
}

enum Operands {
    F32([Vec<f32>; 3]),
    /// On oneDNN.
    Bf16([Vec<bf16>; 3]),
    /// On ragged's AMX products.
    Bf16Amx([Vec<bf16>; 3]),
}

impl GemmProbe {
    /// `f32` operands for side `n`.
    pub fn new(n: usize) -> Self {
        let [a, b] = seeded_operands(n);
        GemmProbe {
            n,
            operands: Operands::F32([a, b, vec![0.0; n * n]]),
        }
    }

    /// `bf16` operands for side `n` on oneDNN; `Err` where oneDNN has no bf16 matmul here.
    pub fn bf16_onednn(n: usize) -> Result<Self> {
        crate::kernels::onednn::onednn()
            .and_then(|d| d.bf16_impl())
            .map_err(unsupported)?;
        Ok(GemmProbe {
            n,
            operands: Operands::Bf16(seeded_bf16_operands(n)),
        })
    }

    /// `bf16` operands for side `n` on ragged's AMX products; `Err` without AMX.
    pub fn bf16_amx(n: usize) -> Result<Self> {
        crate::kernels::amx_bf16::amx().map_err(unsupported)?;
        Ok(GemmProbe {
            n,
            operands: Operands::Bf16Amx(seeded_bf16_operands(n)),
        })
    }

    /// The GEMM Newton–Schulz for `kind` is compared with: the bf16 product bf16
    /// Newton–Schulz runs on (`NsBackend::Auto`'s: AMX, else oneDNN), else `f32` (the
    /// portable bf16 path rounds operands around the `f32` GEMM).
    pub fn for_ns(kind: OptimKind, n: usize) -> Self {
        use crate::newton_schulz::{resolve_backend, NsBackend};
        let bf16 = resolve_backend(NsPrecision::Bf16, NsBackend::Auto).ok();
        let probe = match (kind, bf16) {
            (OptimKind::MuonBf16, Some(NsBackend::Amx)) => GemmProbe::bf16_amx(n),
            (OptimKind::MuonBf16, Some(NsBackend::OneDnn)) => GemmProbe::bf16_onednn(n),
            _ => Ok(GemmProbe::new(n)),
        };
        probe.unwrap_or_else(|_| GemmProbe::new(n))
    }

    /// `f32 GEMM`, `bf16 GEMM (oneDNN)` or `bf16 GEMM (AMX)`.
    pub fn label(&self) -> &'static str {
        match self.operands {
            Operands::F32(_) => "f32 GEMM",
            Operands::Bf16(_) => "bf16 GEMM (oneDNN)",
            Operands::Bf16Amx(_) => "bf16 GEMM (AMX)",
        }
    }

    /// Side of the matrices.
    pub fn side(&self) -> usize {
        self.n
    }

    /// FLOPs of one product, `2n³`.
    pub fn flops(&self) -> f64 {
        2.0 * (self.n as f64).powi(3)
    }

    /// Seconds of one product.
    pub fn seconds(&mut self) -> Result<f64> {
        let n = self.n;
        let t = Instant::now();
        match &mut self.operands {
            Operands::F32([a, b, c]) => {
                let par = gemm::Parallelism::Rayon(rayon::current_num_threads());
                crate::kernels::gemm_f32::matmul(n, n, n, a, b, c, false, 0.0, 1.0, par);
                std::hint::black_box(c);
            }
            Operands::Bf16([a, b, c]) => {
                let dnnl = crate::kernels::onednn::onednn().map_err(unsupported)?;
                dnnl.matmul(n, n, n, a, b, false, c, 1.0, None)
                    .map_err(unsupported)?;
                std::hint::black_box(c);
            }
            Operands::Bf16Amx([a, b, c]) => {
                let amx = crate::kernels::amx_bf16::amx().map_err(unsupported)?;
                let epi = crate::kernels::amx_bf16::Epilogue::PLAIN;
                let par = crate::kernels::Parallelism::Rayon(rayon::current_num_threads());
                amx.matmul(
                    n,
                    n,
                    n,
                    a,
                    crate::kernels::amx_bf16::Rhs::Plain(b),
                    c,
                    epi,
                    par,
                );
                std::hint::black_box(c);
            }
        }
        Ok(t.elapsed().as_secs_f64())
    }
}

/// [`seeded_operands`] rounded to bf16, and a zero product.
fn seeded_bf16_operands(n: usize) -> [Vec<bf16>; 3] {
    let to_bf16 = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    let [a, b] = seeded_operands(n);
    [to_bf16(a), to_bf16(b), vec![bf16::ZERO; n * n]]
}

/// The two seeded `n × n` operands of a [`GemmProbe`], in `f32`.
fn seeded_operands(n: usize) -> [Vec<f32>; 2] {
    let mut rng = SplitMix(7);
    let mut v = || (0..n * n).map(|_| rng.uniform()).collect::<Vec<f32>>();
    [v(), v()]
}

fn unsupported(e: impl std::fmt::Display) -> Error {
    Error::Infeasible {
        op: "bf16 GEMM baseline",
        reason: e.to_string(),
    }
}

/// [`GemmProbe`] `probe`: best and median GFLOP/s (`2n³/t`) of `reps` runs after one warm-up.
pub fn probe_gflops(mut probe: GemmProbe, reps: usize) -> Result<(f64, f64)> {
    probe.seconds()?;
    let times = (0..reps.max(1))
        .map(|_| probe.seconds())
        .collect::<Result<Vec<f64>>>()?;
    let t = Timing::of(times);
    Ok((probe.flops() / t.best / 1e9, probe.flops() / t.median / 1e9))
}

/// The `f32` [`GemmProbe`] of side `n`: best and median GFLOP/s.
pub fn gemm_gflops(n: usize, reps: usize) -> (f64, f64) {
    probe_gflops(GemmProbe::new(n), reps).unwrap_or((f64::NAN, f64::NAN))
}

/// Side of the GEMM interleaved with Muon's steps on `set`: its longest matrix side, within
/// 256..=2048.
pub fn interleaved_gemm_side(set: &ShapeSet) -> usize {
    let longest = set.params.iter().flat_map(|(_, s)| s.iter().copied()).max();
    longest.unwrap_or(256).clamp(256, 2048)
}

/// Runs both baselines.
pub fn baselines(memcpy_bytes: usize, gemm_n: usize, reps: usize) -> Baselines {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (gemm_best_gflops, gemm_median_gflops) = gemm_gflops(gemm_n, reps);
    Baselines {
        memcpy_bytes,
        memcpy_1t_gbps: memcpy_gbps(memcpy_bytes, reps, 1),
        memcpy_all_gbps: memcpy_gbps(memcpy_bytes, reps, threads),
        threads,
        gemm_n,
        gemm_best_gflops,
        gemm_median_gflops,
        bf16_gemm_gflops: GemmProbe::bf16_onednn(gemm_n)
            .and_then(|p| probe_gflops(p, reps))
            .ok(),
        bf16_amx_gemm_gflops: GemmProbe::bf16_amx(gemm_n)
            .and_then(|p| probe_gflops(p, reps))
            .ok(),
    }
}

// ---------------------------------------------------------------------------------------------
// Shapes and optimizers
// ---------------------------------------------------------------------------------------------

/// A named set of parameters stepped together as one group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeSet {
    pub name: String,
    /// `(name, global shape)` in shard order.
    pub params: Vec<(String, Vec<usize>)>,
}

impl ShapeSet {
    /// Elements over all parameters.
    pub fn numel(&self) -> usize {
        self.params
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }
}

/// One decoder layer of Llama-3-8B with every dimension divided by `div` (hidden 4096,
/// intermediate 14336, kv 1024 = 8 heads × 128): q/o `h×h`, k/v `kv×h`, gate/up `i×h`,
/// down `h×i`, two RMSNorm gains of `h`. `div = 4` is the benchmark's "llama3-8b/4".
pub fn llama3_8b_layer(div: usize) -> ShapeSet {
    let (h, i, kv) = (4096 / div, 14336 / div, 1024 / div);
    let p = |name: &str, shape: &[usize]| (format!("layers.0.{name}.weight"), shape.to_vec());
    ShapeSet {
        name: format!("llama3-8b/{div} layer"),
        params: vec![
            p("input_layernorm", &[h]),
            p("self_attn.q_proj", &[h, h]),
            p("self_attn.k_proj", &[kv, h]),
            p("self_attn.v_proj", &[kv, h]),
            p("self_attn.o_proj", &[h, h]),
            p("post_attention_layernorm", &[h]),
            p("mlp.gate_proj", &[i, h]),
            p("mlp.up_proj", &[i, h]),
            p("mlp.down_proj", &[h, i]),
        ],
    }
}

/// The matrices of a Llama-style stack of `layers` decoder layers of width `d`, Llama-3's
/// ratios (kv = d/4, intermediate = 3.5·d): per layer q/o `d×d`, k/v `kv×d`, gate/up `i×d`,
/// down `d×i`; no norms, so every parameter is a Muon matrix. `d = 1024, layers = 4` is the
/// benchmark's 28-matrix row, the one `scripts/muon_vs_torch.py` times `torch.optim.Muon` on.
pub fn llama_stack(d: usize, layers: usize) -> ShapeSet {
    let (kv, i) = (d / 4, d * 7 / 2);
    let mut params = Vec::with_capacity(7 * layers);
    for l in 0..layers {
        let p =
            |name: &str, shape: [usize; 2]| (format!("layers.{l}.{name}.weight"), shape.to_vec());
        params.extend([
            p("self_attn.q_proj", [d, d]),
            p("self_attn.k_proj", [kv, d]),
            p("self_attn.v_proj", [kv, d]),
            p("self_attn.o_proj", [d, d]),
            p("mlp.gate_proj", [i, d]),
            p("mlp.up_proj", [i, d]),
            p("mlp.down_proj", [d, i]),
        ]);
    }
    ShapeSet {
        name: format!("llama d={d} ×{layers} ({} matrices)", params.len()),
        params,
    }
}

/// One square `s × s` matrix.
pub fn square(s: usize) -> ShapeSet {
    ShapeSet {
        name: format!("square {s}"),
        params: vec![("w".into(), vec![s, s])],
    }
}

/// The square sweep; 4096 only with `full`.
pub fn square_sides(full: bool) -> &'static [usize] {
    if full {
        &[256, 512, 1024, 2048, 4096]
    } else {
        &[256, 512, 1024, 2048]
    }
}

/// The optimizers the benchmark knows. Shampoo: add a variant here (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OptimKind {
    AdamW,
    Adam8bit,
    Muon,
    /// Muon with Newton–Schulz in bf16 (oneDNN on AMX where the CPU has it).
    MuonBf16,
    /// Shampoo with [`shampoo_config`].
    Shampoo,
}

impl OptimKind {
    pub const ALL: [OptimKind; 5] = [
        OptimKind::AdamW,
        OptimKind::Adam8bit,
        OptimKind::Muon,
        OptimKind::MuonBf16,
        OptimKind::Shampoo,
    ];

    /// The name used on the command line and in the table.
    pub fn name(self) -> &'static str {
        match self {
            OptimKind::AdamW => "adamw",
            OptimKind::Adam8bit => "adam8bit",
            OptimKind::Muon => "muon",
            OptimKind::MuonBf16 => "muon-bf16",
            OptimKind::Shampoo => "shampoo",
        }
    }

    /// The dtype its heavy math runs in (MFU is against that dtype's peak).
    pub fn dtype(self) -> &'static str {
        match self {
            OptimKind::MuonBf16 => "bf16",
            _ => "f32",
        }
    }
}

/// The kernel a step of `kind` runs on this CPU, in a few words (the table's `kernel` column):
/// the same run-time choice the optimizer makes.
pub fn kernel_name(kind: OptimKind) -> String {
    let ns = crate::ns_backend_info();
    let forced = ns_backend_override().filter(|b| *b != crate::newton_schulz::NsBackend::Auto);
    if let (Some(b), OptimKind::Muon | OptimKind::MuonBf16) = (forced, kind) {
        return format!("NS {}: {b:?} (RAGGED_NS_BACKEND)", kind.dtype());
    }
    match kind {
        OptimKind::AdamW => "fused element loop (compiler-vectorized, baseline ISA)".into(),
        OptimKind::Adam8bit => crate::adam8bit::kernel_name().into(),
        OptimKind::Muon => format!(
            "NS f32: {:?} ({}), {}",
            ns.f32_backend,
            ns_method_name(),
            ns.f32
        ),
        OptimKind::MuonBf16 => format!(
            "NS bf16: {:?} ({}), {}",
            ns.bf16_backend,
            ns_method_name(),
            ns.bf16
        ),
        OptimKind::Shampoo => format!(
            "faer eigh roots, products in {}",
            crate::kernels::lane_dot::kernel_name()
        ),
    }
}

/// The Muon of the benchmark: torch defaults, NS in `precision`.
pub fn muon_config(precision: NsPrecision) -> MuonConfig {
    let mut c = MuonConfig::default();
    c.ns.precision = precision;
    if let Some(backend) = ns_backend_override() {
        c.ns.backend = backend;
    }
    if let Some(method) = ns_method_override() {
        c.ns.method = method;
    }
    c
}

/// `RAGGED_NS_METHOD` (`auto`, `standard`, `gram`), for timing Gram Newton–Schulz against the
/// standard iteration; unset or unparsable means `Auto`.
pub fn ns_method_override() -> Option<NsMethod> {
    std::env::var("RAGGED_NS_METHOD").ok()?.parse().ok()
}

/// The Newton–Schulz method of the benchmark's Muon, in a few words.
fn ns_method_name() -> String {
    match ns_method_override() {
        None | Some(NsMethod::Auto) => "Gram NS where it pays, else standard".into(),
        Some(m) => format!("{m:?} NS, RAGGED_NS_METHOD"),
    }
}

/// `RAGGED_NS_BACKEND` (`auto`, `reference`, `gemm`, `onednn`, `amx`), for timing one
/// Newton–Schulz backend against another; unset or unparsable means `Auto`.
pub fn ns_backend_override() -> Option<crate::newton_schulz::NsBackend> {
    std::env::var("RAGGED_NS_BACKEND").ok()?.parse().ok()
}

/// The Shampoo of the benchmark: fb defaults with Adam grafting and 256-side blocks (roots
/// every step, so the step time includes two eigendecompositions per block).
pub fn shampoo_config() -> ShampooConfig {
    ShampooConfig {
        max_preconditioner_dim: SHAMPOO_DIM,
        grafting: Grafting::Adam {
            beta2: 0.999,
            eps: 1e-10,
        },
        ..ShampooConfig::default()
    }
}

/// Block side of the benchmark's Shampoo.
pub const SHAMPOO_DIM: usize = 256;

/// World size at which Muon's communication is counted (a row-split layout).
pub const COMM_WORLD: usize = 8;

impl FromStr for OptimKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        OptimKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| Error::BadInput {
                op: "OptimKind::from_str",
                what: s.to_string(),
                reason: "expected adamw, adam8bit, muon, muon-bf16 or shampoo".into(),
            })
    }
}

impl std::fmt::Display for OptimKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A one-rank shard holding every parameter of `set` back to back (no padding), each planned
/// with the block `opt` asks for.
pub fn whole_shard<O: Optimizer>(opt: &O, set: &ShapeSet) -> Result<LocalShard> {
    LocalShard::unsharded(
        set.params.iter().map(|(n, s)| (n.as_str(), s.as_slice())),
        &|name, shape| opt.atomic_block(name, shape),
    )
}

/// An optimizer with its shard, state, parameters and gradients, ready to step.
trait Stepper {
    fn step(&mut self) -> Result<()>;
    fn state_bytes(&self) -> usize;
}

struct Run<O: Optimizer> {
    opt: O,
    shard: LocalShard,
    state: O::State,
    params: Vec<f32>,
    grads: Vec<f32>,
    state_bytes: fn(&O::State) -> usize,
}

impl<O: Optimizer> Stepper for Run<O> {
    fn step(&mut self) -> Result<()> {
        self.opt.step(
            &mut self.state,
            &self.shard,
            (&mut self.params).into(),
            (&self.grads).into(),
            &SingleRank,
        )
    }

    fn state_bytes(&self) -> usize {
        (self.state_bytes)(&self.state)
    }
}

fn adam_state_bytes(s: &AdamState) -> usize {
    4 * (s.m.len() + s.v.len())
}

fn shampoo_state_bytes(s: &ShampooState) -> usize {
    4 * (s.m.len() + s.v.len() + s.factors.len() + s.roots.len())
}

fn adam8bit_state_bytes(s: &Adam8bitState) -> usize {
    s.state_bytes()
}

/// What one step costs by the counting rules of the module doc.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Cost {
    pub flops: f64,
    pub bytes: f64,
    /// Bytes sent + received per step; `None` where the path is not implemented or not
    /// counted yet (Muon's gather-to-root path will fill it).
    pub comm_bytes: Option<u64>,
}

/// AdamW FLOPs per element: decay 1, `lerp` 3, second moment 4, denominator 3 (`sqrt`, `/`,
/// `+`), update 3.
pub const ADAMW_FLOPS: f64 = 14.0;
/// AdamW bytes per element: params r+w 8, grads r 4, `m` r+w 8, `v` r+w 8.
pub const ADAMW_BYTES: f64 = 28.0;
/// 8-bit Adam FLOPs per element: AdamW's 14, dequantize 2, absmax 3 (`abs`, two `max`),
/// scale 2 (`x / absmax`), nearest code 4 (two distances per moment).
pub const ADAM8BIT_FLOPS: f64 = 25.0;
/// 8-bit Adam bytes per element: params r+w 8, grads r 4, two codes r+w 4; plus 16 bytes of
/// absmax (two `f32`, read and written) per tile.
pub const ADAM8BIT_BYTES: f64 = 16.0;
/// Muon element FLOPs per matrix element outside Newton–Schulz: momentum `lerp` 3, Nesterov
/// `lerp` 3, decay 1, update 2.
pub const MUON_ELEM_FLOPS: f64 = 9.0;
/// Muon bytes per element: params r+w 8, grads r 4, momentum r+w 8.
pub const MUON_BYTES: f64 = 20.0;

/// FLOPs of Newton–Schulz on a `rows × cols` matrix with `steps` iterations: with `s` the
/// short side and `l` the long one, per iteration `2·s²·l + 2·s³ + 2·s²·l` for the three
/// products plus `3·s² + 3·s·l` element operations; plus `3·s·l` for the norm and scaling.
pub fn ns_flops(rows: usize, cols: usize, steps: usize) -> f64 {
    let (s, l) = (rows.min(cols) as f64, rows.max(cols) as f64);
    let per_iter = 4.0 * s * s * l + 2.0 * s * s * s + 3.0 * s * s + 3.0 * s * l;
    steps as f64 * per_iter + 3.0 * s * l
}

/// The cost of one step of `kind` on `set` (the benchmark's configs).
pub fn cost(kind: OptimKind, set: &ShapeSet) -> Result<Cost> {
    let adam8 = Adam8bit::new(Adam8bitConfig::default())?;
    let precision = match kind {
        OptimKind::MuonBf16 => NsPrecision::Bf16,
        _ => NsPrecision::F32,
    };
    let muon = Muon::new(muon_config(precision))?;
    let steps = muon.config().ns.steps;
    let mut c = Cost {
        comm_bytes: Some(0),
        ..Cost::default()
    };
    for (name, shape) in &set.params {
        let n = shape.iter().product::<usize>() as f64;
        let (flops, bytes) = match kind {
            OptimKind::AdamW => (ADAMW_FLOPS * n, ADAMW_BYTES * n),
            OptimKind::Adam8bit => match adam8.tiling(name, shape) {
                Some(t) => (
                    ADAM8BIT_FLOPS * n,
                    ADAM8BIT_BYTES * n + 16.0 * t.num_tiles() as f64,
                ),
                None => (ADAMW_FLOPS * n, ADAMW_BYTES * n),
            },
            OptimKind::Muon | OptimKind::MuonBf16 if muon.uses_muon(name, shape) => {
                let (matrices, rows, cols) = muon.config().matrices_of(name, shape)?;
                let matrices = matrices as f64;
                (
                    matrices * ns_flops(rows, cols, steps) + MUON_ELEM_FLOPS * n,
                    MUON_BYTES * n,
                )
            }
            OptimKind::Muon | OptimKind::MuonBf16 => (ADAMW_FLOPS * n, ADAMW_BYTES * n),
            OptimKind::Shampoo => shampoo_cost(shape),
        };
        c.flops += flops;
        c.bytes += bytes;
    }
    if matches!(kind, OptimKind::Muon | OptimKind::MuonBf16) {
        c.comm_bytes = Some(muon_comm_bytes(&muon, set)?);
    }
    Ok(c)
}

/// Bytes Muon's two all-to-alls move per step (all ranks, both directions, `f32`) when `set`
/// is one FSDP unit row-split over [`COMM_WORLD`] ranks ([`MatrixLayout::Split`]): the
/// gather-to-root path's worst case; a whole-matrix layout moves 0.
pub fn muon_comm_bytes(muon: &Muon, set: &ShapeSet) -> Result<u64> {
    let split = Muon::new(MuonConfig {
        layout: MatrixLayout::Split,
        ..muon.config().clone()
    })?;
    let specs = set
        .params
        .iter()
        .map(|(n, s)| TensorSpec::new(n.clone(), s, DType::F32))
        .collect::<Result<Vec<_>>>()?;
    let unit = Unit {
        name: set.name.clone(),
        tensors: specs.iter().collect(),
    };
    let (_, report) = split.plan_layout(&unit, COMM_WORLD, &PlanOptions::default())?;
    Ok(2 * report.route_elem_bytes * report.moved as u64)
}

/// Shampoo on a `[.., c]` tensor cut into blocks of at most `SHAMPOO_DIM` rows and columns:
/// per `r × c` block the factor updates (`2r²c + 2rc²`) and the preconditioning
/// (`2r²c + 2rc²`); the eigendecompositions are not counted (no fixed FLOP count), so MFU is
/// a lower bound. Bytes: params r+w, grads r, filtered gradient and grafting `v` r+w, factors
/// and roots read and written once.
fn shampoo_cost(shape: &[usize]) -> (f64, f64) {
    let n: usize = shape.iter().product();
    let cols = *shape.last().unwrap_or(&1);
    let rows = n / cols.max(1);
    let (mut flops, mut factor_elems) = (0.0, 0.0);
    for r in sides(rows) {
        for c in sides(cols) {
            let (r, c) = (r as f64, c as f64);
            flops += 4.0 * (r * r * c + r * c * c);
            factor_elems += if r > 1.0 { r * r } else { 0.0 } + c * c;
        }
    }
    (flops, ADAMW_BYTES * n as f64 + 16.0 * factor_elems)
}

/// Block sides along one dimension of `len`: full `SHAMPOO_DIM` blocks and the remainder.
fn sides(len: usize) -> impl Iterator<Item = usize> {
    (0..len.div_ceil(SHAMPOO_DIM)).map(move |k| SHAMPOO_DIM.min(len - k * SHAMPOO_DIM))
}

/// One benchmark case: an optimizer stepping one shape set.
pub struct Case {
    pub kind: OptimKind,
    pub set: ShapeSet,
    runner: Box<dyn Stepper>,
}

impl Case {
    /// Builds the optimizer (default hyperparameters), a one-rank shard of `set`, its state,
    /// and seeded random parameters and gradients.
    pub fn new(kind: OptimKind, set: &ShapeSet) -> Result<Case> {
        Self::with_adam8bit_kernel(kind, set, Adam8bitKernel::detect())
    }

    /// [`Case::new`] with 8-bit Adam on `adam8bit_kernel` (ignored by the other optimizers);
    /// `Err` when this CPU cannot run it.
    pub fn with_adam8bit_kernel(
        kind: OptimKind,
        set: &ShapeSet,
        adam8bit_kernel: Adam8bitKernel,
    ) -> Result<Case> {
        let runner = match kind {
            OptimKind::AdamW => make(AdamW::default(), set, adam_state_bytes)?,
            OptimKind::Adam8bit => make(
                Adam8bit::new(Adam8bitConfig::default())?.with_kernel(adam8bit_kernel)?,
                set,
                adam8bit_state_bytes,
            )?,
            OptimKind::Muon => make(
                Muon::new(muon_config(NsPrecision::F32))?,
                set,
                MuonState::state_bytes,
            )?,
            OptimKind::MuonBf16 => make(
                Muon::new(muon_config(NsPrecision::Bf16))?,
                set,
                MuonState::state_bytes,
            )?,
            OptimKind::Shampoo => make(Shampoo::new(shampoo_config())?, set, shampoo_state_bytes)?,
        };
        Ok(Case {
            kind,
            set: set.clone(),
            runner,
        })
    }

    /// 8-bit Adam as configured by the caller (kernel, parallel threshold) on `set`.
    pub fn with_adam8bit(opt: Adam8bit, set: &ShapeSet) -> Result<Case> {
        Ok(Case {
            kind: OptimKind::Adam8bit,
            set: set.clone(),
            runner: make(opt, set, adam8bit_state_bytes)?,
        })
    }

    /// One `Optimizer::step`.
    pub fn step(&mut self) -> Result<()> {
        self.runner.step()
    }

    /// Bytes of optimizer state held now.
    pub fn state_bytes(&self) -> usize {
        self.runner.state_bytes()
    }
}

/// `opt` on a one-rank shard of `set`, its fresh state, and seeded parameters and gradients.
fn make<O: Optimizer + 'static>(
    opt: O,
    set: &ShapeSet,
    state_bytes: fn(&O::State) -> usize,
) -> Result<Box<dyn Stepper>>
where
    O::State: 'static,
{
    let shard = whole_shard(&opt, set)?;
    let state = opt.init(&shard)?;
    let mut rng = SplitMix(0x5eed);
    let params: Vec<f32> = (0..shard.len).map(|_| rng.uniform()).collect();
    let grads: Vec<f32> = (0..shard.len).map(|_| 1e-2 * rng.uniform()).collect();
    Ok(Box::new(Run {
        opt,
        shard,
        state,
        params,
        grads,
        state_bytes,
    }))
}

/// Best and median of a set of times, in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    pub best: f64,
    pub median: f64,
    /// Timed steps; 0 when the untimed first step was the only one (a very slow case).
    pub reps: usize,
}

impl Timing {
    /// Best and median (the lower middle for an even count) of `times` (non-empty).
    pub fn of(mut times: Vec<f64>) -> Timing {
        assert!(!times.is_empty(), "Timing::of: no times");
        times.sort_by(f64::total_cmp);
        Timing {
            best: times[0],
            median: times[(times.len() - 1) / 2],
            reps: times.len(),
        }
    }
}

/// A case with one step slower than this runs fewer timed reps (at least one), so that a
/// slow case (Muon on large matrices) takes about this long in total.
pub const CASE_SECONDS: f64 = 20.0;

/// One row of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub optimizer: OptimKind,
    pub shapes: String,
    pub params: usize,
    pub timing: Timing,
    pub cost: Cost,
    /// Optimizer-state bytes after the timed steps.
    pub state_bytes: usize,
    /// The kernel that ran ([`kernel_name`]), and for 8-bit Adam on a CPU with a faster
    /// build than AVX2, the AVX2 build's time on the same case, interleaved step by step.
    pub kernel: String,
    /// Muon only: per timed step, the step's nominal GFLOP/s over the rate of an `f32` GEMM
    /// ([`GemmProbe`], side [`interleaved_gemm_side`]) timed right after it; sorted.
    pub vs_interleaved_gemm: Vec<f64>,
    /// Muon only: which GEMM that is ([`GemmProbe::label`]: oneDNN's bf16 matmul for bf16
    /// Newton–Schulz on oneDNN, else `f32`).
    pub interleaved_gemm: &'static str,
    /// AdamW and 8-bit Adam only: per timed step, the step's GB/s of compulsory traffic over
    /// that of a memcpy ([`MemcpyProbe`], the baseline's size) timed right after it; sorted.
    pub vs_interleaved_memcpy: Vec<f64>,
    /// AdamW and 8-bit Adam only: per timed step, the step's GB/s over that of a copy of the
    /// **same** read + write bytes ([`MemcpyProbe::gbps_shared`]), timed after the same eviction (the
    /// interleaved probe), so that both start from memory: the like-for-like baseline of a
    /// step too small to reach the streaming rate of the 256 MiB copy; sorted.
    pub vs_same_bytes_memcpy: Vec<f64>,
}

impl Row {
    /// GFLOP/s at the best time.
    pub fn gflops(&self) -> f64 {
        self.cost.flops / self.timing.best / 1e9
    }
    /// GB/s of compulsory traffic at the best time.
    pub fn gbps(&self) -> f64 {
        self.cost.bytes / self.timing.best / 1e9
    }
    pub fn state_bytes_per_param(&self) -> f64 {
        self.state_bytes as f64 / self.params as f64
    }
}

/// Times `kind` on `set`: one untimed step, then `reps` timed steps; fewer when a step takes
/// longer than [`CASE_SECONDS`]` / reps`, and when the first step alone takes longer than
/// [`CASE_SECONDS`], that step is the only sample (`Timing::reps` is then 0).
///
/// For 8-bit Adam on a CPU whose default build is faster than AVX2, the AVX2 build steps the
/// same case too, alternating step by step with the default one (so both see the same
/// machine load), and the kernel column gives its best time and the speed-up.
///
/// AdamW and 8-bit Adam steps alternate with a memcpy of `memcpy_bytes` on rayon's threads
/// ([`Row::vs_interleaved_memcpy`]); Muon's with an `f32` GEMM ([`Row::vs_interleaved_gemm`]).
pub fn run_case(kind: OptimKind, set: &ShapeSet, reps: usize, memcpy_bytes: usize) -> Result<Row> {
    let default = Adam8bitKernel::detect();
    let compare = (kind == OptimKind::Adam8bit
        && default == Adam8bitKernel::Avx512
        && Adam8bitKernel::Avx2.is_available())
    .then_some(Adam8bitKernel::Avx2);
    let mut case = Case::with_adam8bit_kernel(kind, set, default)?;
    let mut other = compare
        .map(|k| Case::with_adam8bit_kernel(kind, set, k))
        .transpose()?;
    let mut gemm = matches!(kind, OptimKind::Muon | OptimKind::MuonBf16)
        .then(|| GemmProbe::for_ns(kind, interleaved_gemm_side(set)));
    let elementwise = matches!(kind, OptimKind::AdamW | OptimKind::Adam8bit);
    let mut memcpy = elementwise.then(|| MemcpyProbe::new(memcpy_bytes));
    let Cost { flops, bytes, .. } = cost(kind, set)?;
    // Half the counted bytes: a copy's GB/s counts its source read and destination write.
    let mut same_bytes = elementwise.then(|| MemcpyProbe::new((bytes / 2.0) as usize));
    let t = Instant::now();
    case.step()?;
    let first = t.elapsed().as_secs_f64();
    if let Some(o) = other.as_mut() {
        o.step()?;
    }
    if let Some(g) = gemm.as_mut() {
        g.seconds()?;
    }
    let reps = reps.max(1).min((CASE_SECONDS / first) as usize);
    let mut times = Vec::with_capacity(reps.max(1));
    let mut other_times = Vec::with_capacity(reps);
    let mut vs_gemm = Vec::with_capacity(reps);
    let mut vs_memcpy = Vec::with_capacity(reps);
    let mut vs_same = Vec::with_capacity(reps);
    if let Some(m) = memcpy.as_mut() {
        m.gbps(); // the first timed step starts from memory too
    }
    for _ in 0..reps {
        let t = Instant::now();
        case.step()?;
        let step = t.elapsed().as_secs_f64();
        times.push(step);
        if let Some(o) = other.as_mut() {
            let t = Instant::now();
            o.step()?;
            other_times.push(t.elapsed().as_secs_f64());
        }
        if let Some(g) = gemm.as_mut() {
            let rate = g.flops() / g.seconds()?;
            vs_gemm.push(flops / step / rate);
        }
        if let (Some(m), Some(same)) = (memcpy.as_mut(), same_bytes.as_mut()) {
            // The big copy evicts the caches; the same-bytes copy then starts from memory,
            // as the next step does.
            vs_memcpy.push(bytes / step / 1e9 / m.gbps());
            vs_same.push(bytes / step / 1e9 / same.gbps_shared());
        }
    }
    vs_gemm.sort_by(f64::total_cmp);
    vs_memcpy.sort_by(f64::total_cmp);
    vs_same.sort_by(f64::total_cmp);
    let timing = if times.is_empty() {
        Timing {
            reps: 0,
            ..Timing::of(vec![first])
        }
    } else {
        Timing::of(times)
    };
    let mut kernel = kernel_name(kind);
    if let (Some(k), false) = (compare, other_times.is_empty()) {
        let o = Timing::of(other_times);
        kernel = format!(
            "{kernel}; same run, interleaved: {} {:.3} ms best, {:.3} median: {:.2}× faster (best), {:.2}× (median)",
            k.name(),
            1e3 * o.best,
            1e3 * o.median,
            o.best / timing.best,
            o.median / timing.median
        );
    }
    Ok(Row {
        optimizer: kind,
        shapes: set.name.clone(),
        params: set.numel(),
        timing,
        cost: cost(kind, set)?,
        state_bytes: case.state_bytes(),
        kernel,
        vs_interleaved_gemm: vs_gemm,
        interleaved_gemm: gemm.as_ref().map_or("", GemmProbe::label),
        vs_interleaved_memcpy: vs_memcpy,
        vs_same_bytes_memcpy: vs_same,
    })
}

// ---------------------------------------------------------------------------------------------
// Configuration and report
// ---------------------------------------------------------------------------------------------

/// What `ragged bench optim` runs.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchConfig {
    /// Add the 4096 point to the square sweep.
    pub full: bool,
    /// Tiny shapes and buffers (tests): llama3-8b/32 layer, squares 64 and 128.
    pub quick: bool,
    /// Timed steps per case.
    pub reps: usize,
    /// Run only this optimizer.
    pub only: Option<OptimKind>,
    /// Clock override for the peak.
    pub ghz: Option<f64>,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            full: false,
            quick: false,
            reps: 5,
            only: None,
            ghz: None,
        }
    }
}

impl BenchConfig {
    /// The shape sets, in table order.
    pub fn shape_sets(&self) -> Vec<ShapeSet> {
        let (layer, sides): (usize, &[usize]) = if self.quick {
            (32, &[64, 128])
        } else {
            (4, square_sides(self.full))
        };
        std::iter::once(llama3_8b_layer(layer))
            .chain(sides.iter().map(|&s| square(s)))
            .collect()
    }

    /// The optimizers, in table order.
    pub fn kinds(&self) -> Vec<OptimKind> {
        OptimKind::ALL
            .into_iter()
            .filter(|k| self.only.is_none_or(|o| o == *k))
            .collect()
    }

    /// Every (optimizer, shape set) case, in table order; the Muon rows end with the
    /// Llama-style stack ([`llama_stack`]: d = 1024, 4 layers; d = 128 quick).
    pub fn cases(&self) -> Vec<(OptimKind, ShapeSet)> {
        let sets = self.shape_sets();
        let stack = llama_stack(if self.quick { 128 } else { 1024 }, 4);
        self.kinds()
            .into_iter()
            .flat_map(|k| {
                let muon = matches!(k, OptimKind::Muon | OptimKind::MuonBf16);
                let extra = muon.then(|| (k, stack.clone()));
                sets.iter().map(move |s| (k, s.clone())).chain(extra)
            })
            .collect()
    }

    /// memcpy source size: 256 MiB (4 MiB quick), well past the last-level cache.
    pub fn memcpy_bytes(&self) -> usize {
        if self.quick {
            4 << 20
        } else {
            256 << 20
        }
    }

    /// Side of the baseline GEMM: 2048 (256 quick).
    pub fn gemm_n(&self) -> usize {
        if self.quick {
            256
        } else {
            2048
        }
    }
}

/// Everything one run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    pub peak: Peak,
    pub baselines: Baselines,
    pub rows: Vec<Row>,
}

/// Column headers of the optimizer table (the CLI test checks them).
pub const COLUMNS: [&str; 19] = [
    "optimizer",
    "shapes",
    "params",
    "reps",
    "best ms",
    "median ms",
    "GFLOP/step",
    "GFLOP/s",
    "MFU %",
    "vs GEMM",
    "MB/step",
    "GB/s",
    "vs memcpy",
    "state B/param",
    "comm B/step",
    "dtype",
    "kernel",
    "vs interleaved GEMM or memcpy (median, min–max, n)",
    "vs same-bytes memcpy from memory (median, min–max, n)",
];

/// The peak GFLOP/s an optimizer's MFU is measured against.
fn peak_of(p: &Peak, kind: OptimKind) -> f64 {
    match kind.dtype() {
        "bf16" => p.bf16_gflops(),
        _ => p.f32_gflops(),
    }
}

/// The baseline GEMM rate (best, GFLOP/s) of `kind`'s precision: for bf16 Newton–Schulz the
/// bf16 product it runs on where measured (AMX, else oneDNN), else the `f32` GEMM.
fn gemm_of(b: &Baselines, kind: OptimKind) -> f64 {
    match (kind, b.bf16_amx_gemm_gflops.or(b.bf16_gemm_gflops)) {
        (OptimKind::MuonBf16, Some((best, _))) => best,
        _ => b.gemm_best_gflops,
    }
}

/// A sorted sample of ratios as `median (min–max, n)`; `–` when empty.
fn interleaved(r: &[f64]) -> String {
    match (r.first(), r.last()) {
        (Some(lo), Some(hi)) => format!("{:.2} ({lo:.2}–{hi:.2}, {})", r[r.len() / 2], r.len()),
        _ => "–".into(),
    }
}

/// The interleaved column of `row`: `GEMM …` (Muon), `memcpy …` (AdamW, 8-bit Adam), `–`.
fn interleaved_cell(row: &Row) -> String {
    match (&row.vs_interleaved_gemm[..], &row.vs_interleaved_memcpy[..]) {
        ([], []) => "–".into(),
        (gemm, []) => format!("{} {}", row.interleaved_gemm, interleaved(gemm)),
        (_, memcpy) => format!("memcpy {}", interleaved(memcpy)),
    }
}

/// The baselines and the optimizer table, as markdown.
pub fn markdown(r: &Report) -> String {
    let (p, b) = (&r.peak, &r.baselines);
    let mut out = String::new();
    let _ = writeln!(out, "Peak: {}.\n", p.derivation());
    let _ = writeln!(
        out,
        "Newton–Schulz backends: {}.\n",
        crate::ns_backend_info()
    );
    let _ = writeln!(
        out,
        "`comm B/step`: bytes Muon's gather and scatter all-to-alls move per step when the \
         shapes are one unit row-split over {COMM_WORLD} ranks, `f32` or, with bf16 \
         Newton–Schulz, bf16 (0 for whole-matrix layouts and for the element-wise optimizers, \
         whose only traffic is FSDP's own). Shampoo's \
         GFLOP/step leaves out its eigendecompositions.\n"
    );
    let _ = writeln!(
        out,
        "`vs same-bytes memcpy from memory`: AdamW and 8-bit Adam, per timed step, its GB/s over \
         a copy of the same read + write bytes (64 KiB chunks claimed by the calling thread and \
         rayon's workers, as 8-bit Adam's step claims its work), timed right after the \
         interleaved probe's 256 MiB copy has evicted the caches, as the step is: the \
         like-for-like baseline where a step is too small for the streaming rate of the \
         baseline copy (`vs memcpy`).\n"
    );
    let _ = writeln!(out, "| baseline | size | result |\n|---|---|---|");
    let _ = writeln!(
        out,
        "| memcpy, 1 thread | {} MiB | {:.1} GB/s |",
        b.memcpy_bytes >> 20,
        b.memcpy_1t_gbps
    );
    let _ = writeln!(
        out,
        "| memcpy, {} threads | {} MiB | {:.1} GB/s |",
        b.threads,
        b.memcpy_bytes >> 20,
        b.memcpy_all_gbps
    );
    let _ = writeln!(
        out,
        "| f32 GEMM (`gemm` 0.19, rayon) | {n}×{n}×{n} | {:.1} GFLOP/s best, {:.1} median ({:.1} % of f32 peak) |",
        b.gemm_best_gflops,
        b.gemm_median_gflops,
        100.0 * b.gemm_best_gflops / p.f32_gflops(),
        n = b.gemm_n
    );
    let bf16_gemms = [
        ("oneDNN matmul", b.bf16_gemm_gflops),
        ("ragged AMX", b.bf16_amx_gemm_gflops),
    ];
    for (name, (best, median)) in bf16_gemms.into_iter().filter_map(|(n, g)| Some((n, g?))) {
        let _ = writeln!(
            out,
            "| bf16 GEMM ({name}) | {n}×{n}×{n} | {best:.1} GFLOP/s best, {median:.1} median ({:.1} % of bf16 peak) |",
            100.0 * best / p.bf16_gflops(),
            n = b.gemm_n
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "| {} |", COLUMNS.join(" | "));
    let _ = writeln!(out, "|{}", "---|".repeat(COLUMNS.len()));
    for row in &r.rows {
        let comm = row
            .cost
            .comm_bytes
            .map_or_else(|| "n/a".to_string(), |c| c.to_string());
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.1} | {:.1} | {:.3} | {:.1} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} | {} |",
            row.optimizer,
            row.shapes,
            row.params,
            row.timing.reps,
            1e3 * row.timing.best,
            1e3 * row.timing.median,
            row.cost.flops / 1e9,
            row.gflops(),
            100.0 * row.gflops() / peak_of(p, row.optimizer),
            row.gflops() / gemm_of(b, row.optimizer),
            row.cost.bytes / 1e6,
            row.gbps(),
            row.gbps() / b.memcpy_all_gbps,
            row.state_bytes_per_param(),
            comm,
            row.optimizer.dtype(),
            row.kernel,
            interleaved_cell(row),
            interleaved(&row.vs_same_bytes_memcpy),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::newton_schulz::{resolve_backend, NsBackend};

    #[test]
    fn bf16_muon_moves_half_the_bytes_of_f32_muon() {
        for set in [square(512), llama_stack(256, 1)] {
            let f32_bytes = cost(OptimKind::Muon, &set).unwrap().comm_bytes.unwrap();
            let bf16_bytes = cost(OptimKind::MuonBf16, &set).unwrap().comm_bytes.unwrap();
            assert!(f32_bytes > 0, "{}: nothing moved", set.name);
            assert_eq!(2 * bf16_bytes, f32_bytes, "{}", set.name);
        }
    }

    #[test]
    fn ns_flops_of_a_square_matrix_is_six_cubes_per_iteration_plus_element_ops() {
        let s = 64.0f64;
        let want = 5.0 * (6.0 * s * s * s + 6.0 * s * s) + 3.0 * s * s;
        assert_eq!(ns_flops(64, 64, 5), want);
        // Orientation does not matter: the short side is used.
        assert_eq!(ns_flops(32, 128, 5), ns_flops(128, 32, 5));
    }

    #[test]
    fn quick_cases_step_and_count_their_parameters() {
        let cfg = BenchConfig {
            quick: true,
            reps: 1,
            ..BenchConfig::default()
        };
        for (kind, set) in cfg.cases() {
            let row = run_case(kind, &set, 1, 1 << 20).unwrap();
            assert_eq!(row.params, set.numel());
            assert!(row.cost.flops > 0.0 && row.cost.bytes > 0.0);
            assert!(row.timing.best > 0.0);
            // One interleaved ratio per timed step, against the GEMM or the copy.
            let n = row.timing.reps;
            let want = match kind {
                OptimKind::AdamW | OptimKind::Adam8bit => (0, n),
                OptimKind::Muon | OptimKind::MuonBf16 => (n, 0),
                OptimKind::Shampoo => (0, 0),
            };
            let (gemm, memcpy) = (&row.vs_interleaved_gemm, &row.vs_interleaved_memcpy);
            let same = &row.vs_same_bytes_memcpy;
            assert_eq!((gemm.len(), memcpy.len()), want, "{kind}");
            assert_eq!(same.len(), memcpy.len(), "{kind}");
            let bf16 = resolve_backend(NsPrecision::Bf16, NsBackend::Auto).ok();
            let probe = match kind {
                OptimKind::MuonBf16 if bf16 == Some(NsBackend::Amx) => "bf16 GEMM (AMX)",
                OptimKind::MuonBf16 if bf16 == Some(NsBackend::OneDnn) => "bf16 GEMM (oneDNN)",
                OptimKind::Muon | OptimKind::MuonBf16 => "f32 GEMM",
                _ => "",
            };
            assert_eq!(row.interleaved_gemm, probe, "{kind}");
            let ratios = gemm.iter().chain(memcpy).chain(same);
            assert!(ratios.into_iter().all(|r| r.is_finite() && *r > 0.0));
        }
    }

    /// Both baseline GEMMs compute the product they time (bf16: within bf16's rounding of the
    /// output, against f32 on the same rounded operands).
    #[test]
    fn gemm_probes_compute_the_product() {
        let n = 48;
        let mut f = GemmProbe::new(n);
        f.seconds().unwrap();
        let Operands::F32([a, b, c]) = &f.operands else {
            panic!("f32 operands")
        };
        let product = |a: &dyn Fn(usize) -> f32, b: &dyn Fn(usize) -> f32, i: usize, j: usize| {
            (0..n).map(|k| a(i * n + k) * b(k * n + j)).sum::<f32>()
        };
        for (i, j) in [(0, 0), (5, 17), (47, 47)] {
            let want = product(&|x| a[x], &|x| b[x], i, j);
            assert!((c[i * n + j] - want).abs() <= 1e-4 * want.abs().max(1.0));
        }
        let Ok(mut h) = GemmProbe::bf16_onednn(n) else {
            println!("skipped the bf16 probe: oneDNN has no bf16 matmul here");
            return;
        };
        h.seconds().unwrap();
        let Operands::Bf16([a, b, c]) = &h.operands else {
            panic!("bf16 operands")
        };
        for (i, j) in [(0, 0), (5, 17), (47, 47)] {
            let want = product(&|x| a[x].to_f32(), &|x| b[x].to_f32(), i, j);
            let got = c[i * n + j].to_f32();
            assert!(
                (got - want).abs() <= 1e-2 * want.abs().max(1.0),
                "{got} vs {want}"
            );
        }
    }

    #[test]
    fn llama_stack_has_28_matrices_of_llama3_ratios() {
        let set = llama_stack(1024, 4);
        assert_eq!(set.params.len(), 28);
        let per_layer = 2 * 1024 * 1024 + 2 * 256 * 1024 + 3 * 3584 * 1024;
        assert_eq!(set.numel(), 4 * per_layer);
        assert!(set.params.iter().all(|(_, s)| s.len() == 2));
    }

    #[test]
    fn llama_layer_has_the_divided_dimensions() {
        let set = llama3_8b_layer(4);
        let n = 2 * 1024 * 1024 + 2 * 256 * 1024 + 3 * 3584 * 1024 + 2 * 1024;
        assert_eq!(set.numel(), n);
    }
}
