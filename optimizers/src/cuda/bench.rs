//! `ragged bench optim --device cuda`: the device optimizer steps against baselines measured in
//! the same run on the same GPU.
//!
//! | case | measure | baseline |
//! |---|---|---|
//! | Newton–Schulz, one `n × n` matrix, bf16 (GEMM) and f32 (GEMM, and syrk for the symmetric products) | TFLOP/s (`steps · 3` GEMMs of `2n³`, whichever product ran) | one plain cuBLAS GEMM `n³` of the same precision on random data |
//! | Newton–Schulz, a stack of 8 `n/4 × n/4` experts (strided-batched), bf16 | TFLOP/s | the same GEMM |
//! | Newton–Schulz, one `n × 3.5n` matrix (an MLP weight), bf16, standard and Gram | TFLOP/s in the standard iteration's nominal FLOPs (Gram's rate over the standard one is its speed-up) | the same GEMM |
//! | AdamW step on one `len`-element shard, and on a Llama-3-8B decoder layer (7 matrices, 2 norms) | GB/s (28 B per element: p, g, m, v read; p, m, v written) | device-to-device memcpy of `len` elements, read + write bytes |
//! | 8-bit Adam step, the same shards | GB/s (16 B per element: p, g, both codes read; p, both codes written; 28 B for the norms' f32 fallback) | the same memcpy |
//! | Shampoo step on a `2d × 2d` matrix (four `d × d` blocks), no grafting, roots not due | TFLOP/s of its four products per block (`8d³`, summed in `f64` lanes) | one plain cuBLAS f32 GEMM `d³` |
//!
//! Sizes: `n = 4096`, `len = 2^26`, the layer's 218 M elements, `d = 1024` (`quick`: 512,
//! 2^20, the layer's dimensions / 32 and 64, for tests). Every timing
//! synchronizes the device before reading the clock, after one untimed warm-up.

use std::sync::Arc;
use std::time::Instant;

use ragged::comm::SingleRank;
use ragged::cuda::Device;
use ragged::demo::SplitMix;
use ragged::optim::{LocalShard, Optimizer};
use ragged::storage::Placement;
use ragged::Result;

use super::newton_schulz::{
    gemm_seconds, orthogonalize_cuda_in, GramProduct, NsShape, NsWorkspace,
};
use crate::newton_schulz::{NsConfig, NsMethod, NsPrecision};
use crate::{Adam8bit, Adam8bitConfig, AdamW, AdamWConfig, Shampoo, ShampooConfig};

/// One row of the GPU table: a measured rate and the same-run baseline it is compared with.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuRow {
    pub case: String,
    pub value: f64,
    pub unit: &'static str,
    pub baseline: String,
    pub baseline_value: f64,
}

impl GpuRow {
    /// `value / baseline_value`.
    pub fn ratio(&self) -> f64 {
        self.value / self.baseline_value
    }
}

/// The GPU table and the device it ran on.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuReport {
    pub device: String,
    pub rows: Vec<GpuRow>,
}

impl GpuReport {
    /// A markdown table.
    pub fn markdown(&self) -> String {
        let mut out = format!(
            "| case ({}) | value | unit | same-run baseline | baseline | ratio |\n|---|---|---|---|---|---|\n",
            self.device
        );
        for r in &self.rows {
            out += &format!(
                "| {} | {:.1} | {} | {} | {:.1} | {:.0} % |\n",
                r.case,
                r.value,
                r.unit,
                r.baseline,
                r.baseline_value,
                100.0 * r.ratio()
            );
        }
        out
    }
}

/// Mean seconds of `f` over `iters` runs after one warm-up, the device synchronized around.
fn time(dev: &Device, iters: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.sync()?;
    let start = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.sync()?;
    Ok(start.elapsed().as_secs_f64() / iters as f64)
}

fn units(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix(seed);
    (0..n).map(|_| rng.uniform()).collect()
}

/// Runs every case (module doc) on `dev`; `quick` shrinks the sizes.
pub fn bench_gpu(dev: &Arc<Device>, quick: bool) -> Result<GpuReport> {
    let (n, len) = if quick {
        (512, 1 << 20)
    } else {
        (4096, 1 << 26)
    };
    let mut rows = Vec::new();
    let nf = n as f64;
    for prec in [NsPrecision::Bf16, NsPrecision::F32] {
        let cfg = NsConfig {
            precision: prec,
            ..NsConfig::default()
        };
        let gemm = 2.0 * nf.powi(3) / gemm_seconds(dev, n, prec, 10)? / 1e12;
        let baseline = format!("cuBLAS GEMM {n}³ {prec:?}");
        // bf16: one matrix and a stack of experts on GEMMs; f32: one matrix with the
        // symmetric products on GEMM and on syrk (FLOPs counted as GEMMs in both, so the
        // syrk row shows what the saved half-products buy).
        let cases: &[(usize, usize, GramProduct)] = match prec {
            NsPrecision::Bf16 => &[(1, n, GramProduct::Gemm), (8, n / 4, GramProduct::Gemm)],
            NsPrecision::F32 => &[(1, n, GramProduct::Gemm), (1, n, GramProduct::Syrk)],
        };
        for &(batch, side, gram) in cases {
            let mut x = dev.upload(&units(batch * side * side, 7))?;
            // Its workspace kept between calls, as Muon's step keeps it (the warm-up run
            // allocates it).
            let (shape, mut work) = (NsShape::new(batch, side, side), NsWorkspace::default());
            let secs = time(dev, 3, &mut || {
                orthogonalize_cuda_in(dev, &mut x.slice_mut(..), shape, &cfg, gram, &mut work)
            })?;
            let flop = (batch * cfg.steps * 3 * 2) as f64 * (side as f64).powi(3);
            let case = if batch == 1 {
                format!(
                    "Newton–Schulz {prec:?} {side}², {} steps, {gram:?}",
                    cfg.steps
                )
            } else {
                format!(
                    "Newton–Schulz {prec:?} {batch}×{side}² experts (strided-batched), {} steps",
                    cfg.steps
                )
            };
            rows.push(GpuRow {
                case,
                value: flop / secs / 1e12,
                unit: "TFLOP/s",
                baseline: baseline.clone(),
                baseline_value: gemm,
            });
        }
        if prec == NsPrecision::Bf16 {
            rows.extend(bench_methods(dev, n, &cfg, gemm, &baseline)?);
        }
    }
    rows.extend(bench_elementwise(dev, len, quick)?);
    rows.push(bench_shampoo(dev, if quick { 64 } else { 1024 })?);
    Ok(GpuReport {
        device: dev.name().unwrap_or_else(|_| "unknown GPU".into()),
        rows,
    })
}

/// Newton–Schulz on one `n × 3.5n` matrix (a Llama MLP weight's shape) by the standard
/// iteration and by Gram Newton–Schulz, both in the standard iteration's nominal FLOPs
/// (`steps · (4s²l + 2s³)`), so the Gram row's rate over the standard one is its speed-up.
fn bench_methods(
    dev: &Arc<Device>,
    n: usize,
    cfg: &NsConfig,
    gemm: f64,
    baseline: &str,
) -> Result<Vec<GpuRow>> {
    let long = n * 7 / 2;
    let (s, l) = (n as f64, long as f64);
    let flop = cfg.steps as f64 * (4.0 * s * s * l + 2.0 * s * s * s);
    let mut rows = Vec::new();
    for method in [NsMethod::Standard, NsMethod::Gram] {
        let cfg = NsConfig {
            method,
            ..cfg.clone()
        };
        let mut x = dev.upload(&units(n * long, 11))?;
        let (shape, mut work) = (NsShape::new(1, n, long), NsWorkspace::default());
        let secs = time(dev, 3, &mut || {
            let gram = GramProduct::Gemm;
            orthogonalize_cuda_in(dev, &mut x.slice_mut(..), shape, &cfg, gram, &mut work)
        })?;
        rows.push(GpuRow {
            case: format!(
                "Newton–Schulz {:?} {n}×{long} (an MLP weight), {method:?}, {} steps, nominal \
                 FLOPs of the standard iteration",
                cfg.precision, cfg.steps
            ),
            value: flop / secs / 1e12,
            unit: "TFLOP/s",
            baseline: baseline.to_string(),
            baseline_value: gemm,
        });
    }
    Ok(rows)
}

/// Llama-3-8B's decoder layer: the seven matrices and the two norms (218 M elements), each
/// dimension divided by `shrink`.
fn llama3_8b_layer(shrink: usize) -> Vec<(String, Vec<usize>)> {
    let (d, kv, ff) = (4096 / shrink, 1024 / shrink, 14336 / shrink);
    [
        ("attn.q", vec![d, d]),
        ("attn.k", vec![kv, d]),
        ("attn.v", vec![kv, d]),
        ("attn.o", vec![d, d]),
        ("mlp.gate", vec![ff, d]),
        ("mlp.up", vec![ff, d]),
        ("mlp.down", vec![d, ff]),
        ("attn_norm", vec![d]),
        ("mlp_norm", vec![d]),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_string(), s))
    .collect()
}

/// AdamW and 8-bit Adam against a device memcpy of `len` elements: on one `len`-element
/// matrix 8192 wide, and on a Llama-3-8B decoder layer (many pieces, two of them 8-bit Adam's
/// f32 fallbacks; `quick`: its dimensions / 32).
fn bench_elementwise(dev: &Arc<Device>, len: usize, quick: bool) -> Result<Vec<GpuRow>> {
    let src = dev.upload(&units(len, 1))?;
    let mut dst = dev.zeros::<f32>(len)?;
    let copy = time(dev, 5, &mut || {
        ragged::cuda::guarded("bench_gpu memcpy", || {
            dev.stream().memcpy_dtod(&src, &mut dst)
        })
    })?;
    drop((src, dst));
    let baseline = Baseline {
        name: format!("device memcpy {} MiB", (4 * len) >> 20),
        gbs: 8.0 * len as f64 / copy / 1e9,
    };
    let matrix = vec![("w".to_string(), vec![len / 8192, 8192])];
    let layer = llama3_8b_layer(if quick { 32 } else { 1 });
    let mut rows = Vec::new();
    for (label, specs) in [
        (format!("{len} elements"), &matrix),
        ("a Llama-3-8B layer".to_string(), &layer),
    ] {
        rows.extend(bench_steps(dev, &label, specs, &baseline)?);
    }
    Ok(rows)
}

/// The same-run memcpy rate the element-wise steps are compared with.
struct Baseline {
    name: String,
    gbs: f64,
}

/// AdamW and 8-bit Adam steps on one unsharded shard of `specs`.
fn bench_steps(
    dev: &Arc<Device>,
    label: &str,
    specs: &[(String, Vec<usize>)],
    baseline: &Baseline,
) -> Result<Vec<GpuRow>> {
    let len: usize = specs.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    let shapes = || specs.iter().map(|(n, s)| (n.as_str(), &s[..]));
    let mut p = dev.upload(&units(len, 2))?;
    let g = dev.upload(&units(len, 3))?;
    let row = |case: String, bytes: f64, secs: f64| GpuRow {
        case,
        value: bytes / secs / 1e9,
        unit: "GB/s",
        baseline: baseline.name.clone(),
        baseline_value: baseline.gbs,
    };
    let on_gpu = Placement::Cuda(Arc::clone(dev));

    let adamw = AdamW::new(AdamWConfig::default())?;
    let shard = LocalShard::unsharded(shapes(), &|n, s| adamw.atomic_block(n, s))?;
    let mut st = adamw.init_on(&shard, &on_gpu)?;
    let secs = time(dev, 5, &mut || {
        let (pv, gv) = (p.slice_mut(..).into(), g.slice(..).into());
        adamw.step(&mut st, &shard, pv, gv, &SingleRank)
    })?;
    let mut rows = vec![row(format!("AdamW step, {label}"), 28.0 * len as f64, secs)];
    drop(st);

    let a8 = Adam8bit::new(Adam8bitConfig::default())?;
    let shard = LocalShard::unsharded(shapes(), &|n, s| a8.atomic_block(n, s))?;
    let mut st = a8.init_on(&shard, &on_gpu)?;
    // 16 B per 8-bit element, 28 B per element of an f32 fallback (the norms).
    let fallback = st.m32.len();
    let bytes = 16.0 * (len - fallback) as f64 + 28.0 * fallback as f64;
    let secs = time(dev, 5, &mut || {
        let (pv, gv) = (p.slice_mut(..).into(), g.slice(..).into());
        a8.step(&mut st, &shard, pv, gv, &SingleRank)
    })?;
    let shape = super::adam8bit::launch_note(dev)?;
    rows.push(row(
        format!("8-bit Adam step, {label} ({shape})"),
        bytes,
        secs,
    ));
    Ok(rows)
}

/// Shampoo's device step on a `2d × 2d` matrix cut into four `d × d` blocks, without grafting
/// and with the roots not due in the timed steps (they run on the host: what is timed is the
/// device's work, dominated by the four `f64`-lane products of each block, `8d³` FLOPs),
/// against a cuBLAS f32 GEMM `d³` of the same run.
fn bench_shampoo(dev: &Arc<Device>, d: usize) -> Result<GpuRow> {
    let opt = Shampoo::new(ShampooConfig {
        max_preconditioner_dim: d,
        precondition_frequency: 1 << 20,
        ..ShampooConfig::default()
    })?;
    let shape = [2 * d, 2 * d];
    let shard = LocalShard::unsharded([("w", &shape[..])], &|n, s| opt.atomic_block(n, s))?;
    let mut st = opt.init_on(&shard, &Placement::Cuda(Arc::clone(dev)))?;
    let mut p = dev.upload(&units(shard.len, 4))?;
    let g = dev.upload(&units(shard.len, 5))?;
    let secs = time(dev, 3, &mut || {
        let (pv, gv) = (p.slice_mut(..).into(), g.slice(..).into());
        opt.step(&mut st, &shard, pv, gv, &SingleRank)
    })?;
    let df = d as f64;
    let gemm = 2.0 * df.powi(3) / gemm_seconds(dev, d, NsPrecision::F32, 10)? / 1e12;
    Ok(GpuRow {
        case: format!("Shampoo step, 2×2 blocks of {d}², roots not due (f64-lane products)"),
        value: 4.0 * 8.0 * df.powi(3) / secs / 1e12,
        unit: "TFLOP/s",
        baseline: format!("cuBLAS GEMM {d}³ F32"),
        baseline_value: gemm,
    })
}
