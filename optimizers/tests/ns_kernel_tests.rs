//! Newton–Schulz kernels: the `gemm` f32 path against the reference loops and an f64 NS,
//! bitwise independence from the thread count and from batching, bf16 (portable and oneDNN)
//! against f32 and the quintic's singular-value band, special inputs, named schedules.
//!
//! Tests that need oneDNN or AMX print why they skip and return when it is missing.

use half::bf16;
use ragged_optimizers::kernels::amx_bf16::{self, AlignedBf16, Epilogue, Rhs, Strides};
use ragged_optimizers::kernels::Parallelism;
use ragged_optimizers::kernels::{gemm_f32, onednn};
use ragged_optimizers::newton_schulz::{
    ns_macs, ns_working_bytes, orthogonalize_many, resolve_backend, resolve_config, resolve_method,
    NsMethod, POLAR_EXPRESS_NORM_SCALE,
};
use ragged_optimizers::{
    ns_backend_info, orthogonalize, orthogonalize_batch, NsBackend, NsConfig, NsPrecision,
    DION_QUINTIC, POLAR_EXPRESS, QUINTIC,
};

mod harness;
use harness::{bits, ns_f64, singular_range, Rng};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn cfg(precision: NsPrecision, backend: NsBackend) -> NsConfig {
    NsConfig {
        precision,
        backend,
        ..NsConfig::default()
    }
}

fn run(x: &[f32], rows: usize, cols: usize, c: &NsConfig) -> Vec<f32> {
    let mut y = x.to_vec();
    orthogonalize(&mut y, rows, cols, c).unwrap();
    y
}

/// `‖a − b‖_F / ‖b‖_F` in f64.
fn rel_frob(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - y).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// Whether oneDNN loads and runs bf16 matmuls here; prints why a test skips when not (oneDNN
/// 2.6 has no bf16 matmul without AVX-512, e.g. on AVX2-only AMD EPYC).
fn onednn_bf16_or_skip(test: &str) -> bool {
    match onednn::onednn().and_then(|d| d.bf16_impl()) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("{test}: skipped, oneDNN bf16 unavailable: {e}");
            false
        }
    }
}

/// Whether oneDNN loads (its f32 matmul runs on any x86-64); prints why a test skips if not.
fn onednn_or_skip(test: &str) -> bool {
    match onednn::onednn() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("{test}: skipped, oneDNN unavailable: {e}");
            false
        }
    }
}

/// Shapes: square, tall, wide, vectors, and sides above the symmetric-product leaf (256) so
/// the halving and mirroring path runs.
const SHAPES: [(usize, usize); 9] = [
    (64, 64),
    (100, 37),
    (37, 100),
    (1, 9),
    (9, 1),
    (3, 200),
    (300, 420),
    (420, 300),
    (520, 560),
];

// ---------------------------------------------------------------------------------------------
// 1. f32 on gemm
// ---------------------------------------------------------------------------------------------

/// Gemm vs the reference loops, both f32: they differ only in summation order (and gemm's
/// fused multiply-adds). One product's relative error is about `√k·2⁻²⁴ ≲ 1.5e-6` for
/// `k ≤ 560`; 5 steps amplify it at most by the polynomial's slope (`a = 3.4445` near 0,
/// below 1.5 near the band). Observed (seed 21, AVX2 gemm kernels) 4e-7–2.6e-6, and 4.3e-6
/// for 3×200 (small singular values get the full slope). The tolerance `2e-5` leaves room for
/// other microkernels (AVX-512 sums in another order) and is far below what any bug (a wrong
/// coefficient, a missing mirror, a transposed operand) gives (`> 1e-2`).
const GEMM_VS_REFERENCE_REL: f64 = 2e-5;

#[test]
fn gemm_f32_matches_the_reference_loops() {
    let mut rng = Rng::new(21);
    for (rows, cols) in SHAPES {
        let x = rng.units(rows * cols);
        let want = run(&x, rows, cols, &cfg(NsPrecision::F32, NsBackend::Reference));
        let got = run(&x, rows, cols, &cfg(NsPrecision::F32, NsBackend::Gemm));
        let err = rel_frob(&got, &widen(&want));
        assert!(
            err <= GEMM_VS_REFERENCE_REL,
            "{rows}×{cols}: gemm vs reference relative Frobenius error {err:e}"
        );
    }
}

/// Gemm f32 vs an f64 NS: the f32 rounding of each product (≈ `√k·2⁻²⁴`) amplified over 5
/// steps as above, plus the steeper schedules' larger slopes (dion's `a = 4.08`, Polar
/// Express's `a = 8.16` in step 1). Observed up to 6.7e-6; tolerance `5e-5`.
const GEMM_VS_F64_REL: f64 = 5e-5;

#[test]
fn gemm_f32_matches_an_f64_newton_schulz_for_every_schedule() {
    let mut rng = Rng::new(5);
    for c in [
        NsConfig::default(),
        NsConfig::dion_quintic(),
        NsConfig::polar_express(),
    ] {
        let c = NsConfig {
            backend: NsBackend::Gemm,
            ..c
        };
        for (rows, cols) in [(64, 64), (100, 37), (37, 100), (300, 420), (1, 9)] {
            let x = rng.units(rows * cols);
            let want = ns_f64(&x, rows, cols, &c);
            let got = run(&x, rows, cols, &c);
            let err = rel_frob(&got, &want);
            assert!(
                err <= GEMM_VS_F64_REL,
                "{rows}×{cols}, coeffs {:?}: relative Frobenius error {err:e}",
                c.coeffs[0]
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 1a'. Gram Newton–Schulz (the iteration on X·Xᵀ)
// ---------------------------------------------------------------------------------------------

fn with_method(c: NsConfig, method: NsMethod) -> NsConfig {
    NsConfig { method, ..c }
}

/// Inputs whose spectra stress the Gram iteration (it works on `X·Xᵀ`, whose small eigenvalues
/// `f32` resolves only to about `2⁻²⁴` of the largest): uniform noise; rank 1; rank 4 plus
/// noise of 1e-6; rows scaled geometrically from 1 down to 1e-6 (singular values over six
/// decades).
fn hard_inputs(rng: &mut Rng, rows: usize, cols: usize) -> Vec<(&'static str, Vec<f32>)> {
    let low_rank = |rng: &mut Rng, rank: usize, noise: f32| {
        let u = rng.units(rows * rank);
        let v = rng.units(rank * cols);
        let e = rng.units(rows * cols);
        (0..rows * cols)
            .map(|ij| {
                let (i, j) = (ij / cols, ij % cols);
                let uv: f32 = (0..rank).map(|r| u[i * rank + r] * v[r * cols + j]).sum();
                uv + noise * e[ij]
            })
            .collect::<Vec<f32>>()
    };
    let graded: Vec<f32> = rng
        .units(rows * cols)
        .iter()
        .enumerate()
        .map(|(ij, &g)| g * 10f32.powf(-6.0 * (ij / cols) as f32 / rows as f32))
        .collect();
    vec![
        ("uniform", rng.units(rows * cols)),
        ("rank 1", low_rank(rng, 1, 0.0)),
        ("rank 4 + 1e-6", low_rank(rng, 4, 1e-6)),
        ("rows graded to 1e-6", graded),
    ]
}

/// Gram Newton–Schulz (explicit, gemm) against an f64 standard Newton–Schulz, with the
/// quintic and with Polar Express (steeper: `a = 8.16` in step 1). Observed (seed 31, AVX2
/// gemm) at most 2.4e-4, on rank-1 inputs, where the standard `f32` iteration's worst is
/// 2.3e-4; elsewhere within 11× of the standard one and at most 2.4e-5. Without restarts
/// (`GRAM_MAX_GROWTH` infinite) the first rank-1 case already reaches 6.8e-4, so the
/// tolerance `5e-4` fails then; a wrong coefficient or a missing product is off by > 1e-2.
const GRAM_VS_F64_REL: f64 = 5e-4;

#[test]
fn gram_newton_schulz_matches_an_f64_newton_schulz_on_hard_spectra() {
    let mut rng = Rng::new(31);
    for (rows, cols) in [(96, 320), (320, 96), (300, 700), (40, 41)] {
        for (what, x) in hard_inputs(&mut rng, rows, cols) {
            for base in [NsConfig::default(), NsConfig::polar_express()] {
                let c = with_method(
                    NsConfig {
                        backend: NsBackend::Gemm,
                        ..base
                    },
                    NsMethod::Gram,
                );
                let want = ns_f64(&x, rows, cols, &c);
                let err = rel_frob(&run(&x, rows, cols, &c), &want);
                let standard = with_method(c.clone(), NsMethod::Standard);
                let err_std = rel_frob(&run(&x, rows, cols, &standard), &want);
                eprintln!("{rows}×{cols} {what}: gram {err:.2e}, standard {err_std:.2e}");
                assert!(
                    err <= GRAM_VS_F64_REL,
                    "{rows}×{cols} {what}, norm scale {}: Gram vs f64 relative error {err:e}",
                    c.norm_scale
                );
            }
        }
    }
}

#[test]
fn gram_on_the_reference_loops_matches_gram_on_gemm() {
    // The same iteration through both backends' products (the reference's are full products,
    // gemm's symmetric halves), on shapes that split around gemm_f32::sym_leaf() (128 or 256).
    let mut rng = Rng::new(37);
    for (rows, cols) in [(37, 100), (300, 700), (700, 300)] {
        let x = rng.units(rows * cols);
        let gram = |backend| with_method(cfg(NsPrecision::F32, backend), NsMethod::Gram);
        let want = run(&x, rows, cols, &gram(NsBackend::Reference));
        let got = run(&x, rows, cols, &gram(NsBackend::Gemm));
        let err = rel_frob(&got, &widen(&want));
        assert!(err <= GEMM_VS_REFERENCE_REL, "{rows}×{cols}: {err:e}");
    }
}

/// `a·b` in f64 for row-major `n × k` and `k × n` operands given as `a` and `bt = bᵀ` (`n × k`).
fn product_f64(a: &[f32], bt: &[f32], n: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..n {
            let (ai, bj) = (&a[i * k..(i + 1) * k], &bt[j * k..(j + 1) * k]);
            out[i * n + j] = ai
                .iter()
                .zip(bj)
                .map(|(&x, &y)| f64::from(x) * f64::from(y))
                .sum();
        }
    }
    out
}

/// The lower triangle's bits against the upper's: `None` when `m` is exactly symmetric.
fn asymmetry(m: &[f32], n: usize) -> Option<(usize, usize)> {
    (0..n)
        .flat_map(|i| (0..i).map(move |j| (i, j)))
        .find(|&(i, j)| m[i * n + j].to_bits() != m[j * n + i].to_bits())
}

#[test]
fn gemm_symmetric_products_are_exact_mirrors_around_the_leaf_side() {
    // gemm_f32's Gram matrix and product of commuting symmetric matrices compute the upper
    // off-diagonal block once and mirror it, splitting down to sym_leaf() (128 with the AVX2
    // microkernels, else 256): on sides each side of one and two splits, every result is
    // exactly symmetric, the same bits threaded or not, and within f32 rounding of the f64
    // product (k = 96 terms of |x| < 1: 1e-6 of the Frobenius norm is ~30 ulps).
    let leaf = gemm_f32::sym_leaf();
    let mut rng = Rng::new(41);
    let k = 96;
    for n in [1, leaf - 1, leaf, leaf + 1, 2 * leaf + 3] {
        let x = rng.units(n * k);
        let (mut p, mut p_threads) = (vec![0f32; n * n], vec![0f32; n * n]);
        gemm_f32::gram(&x, n, k, &mut p, Parallelism::None);
        gemm_f32::gram(&x, n, k, &mut p_threads, Parallelism::Rayon(2));
        assert_eq!(
            bits(&p),
            bits(&p_threads),
            "gram n = {n}: threads change bits"
        );
        assert_eq!(asymmetry(&p, n), None, "gram n = {n} not exactly symmetric");
        let err = rel_frob(&p, &product_f64(&x, &x, n, k));
        assert!(err <= 1e-6, "gram n = {n}: {err:e} from f64");

        // `p` and `p` commute; `p·p = p·pᵀ`, so `p` is its own transposed operand.
        let (mut q, mut q_threads) = (vec![0f32; n * n], vec![0f32; n * n]);
        gemm_f32::sym_product(&p, &p, n, &mut q, Parallelism::None);
        gemm_f32::sym_product(&p, &p, n, &mut q_threads, Parallelism::Rayon(2));
        assert_eq!(
            bits(&q),
            bits(&q_threads),
            "sym_product n = {n}: threads change bits"
        );
        assert_eq!(
            asymmetry(&q, n),
            None,
            "sym_product n = {n} not exactly symmetric"
        );
        let err = rel_frob(&q, &product_f64(&p, &p, n, n));
        assert!(err <= 1e-6, "sym_product n = {n}: {err:e} from f64");
    }
    // The multiply-adds the splits leave: a side of 1024 does 1/2 + 1/16 of the full
    // product with leaves of 128, 1/2 + 1/8 with leaves of 256.
    let full = 1024u128 * 1024 * 96;
    assert_eq!(gemm_f32::sym_macs(1024, 96, 128) * 16, full * 9);
    assert_eq!(gemm_f32::sym_macs(1024, 96, 256) * 8, full * 5);
}

#[test]
fn auto_method_takes_gram_for_wide_matrices_except_on_the_reference_loops() {
    let method = |c: &NsConfig, backend, s, l| resolve_method(c, backend, s, l);
    for (precision, backend) in [
        (NsPrecision::F32, NsBackend::Gemm),
        (NsPrecision::F32, NsBackend::OneDnn),
        (NsPrecision::Bf16, NsBackend::Gemm),
        (NsPrecision::Bf16, NsBackend::OneDnn),
        (NsPrecision::Bf16, NsBackend::Amx),
    ] {
        let c = cfg(precision, backend);
        let what = format!("{precision:?} on {backend:?}");
        assert_eq!(method(&c, backend, 1024, 3584), NsMethod::Gram, "{what}");
        assert_eq!(method(&c, backend, 256, 1024), NsMethod::Gram, "{what}");
        assert_eq!(
            method(&c, backend, 1024, 1024),
            NsMethod::Standard,
            "{what}"
        );
        assert_eq!(
            method(&c, backend, 1024, 1280),
            NsMethod::Standard,
            "{what}"
        );
        // The reference loops stay the standard iteration unless asked (they are the oracle).
        assert_eq!(
            method(&c, NsBackend::Reference, 256, 1024),
            NsMethod::Standard,
            "{what}"
        );
        let standard = with_method(c.clone(), NsMethod::Standard);
        assert_eq!(method(&standard, backend, 1024, 3584), NsMethod::Standard);
        let gram = with_method(c, NsMethod::Gram);
        assert_eq!(
            method(&gram, NsBackend::Reference, 1024, 1024),
            NsMethod::Gram
        );
    }
    assert_eq!("GRAM".parse::<NsMethod>().unwrap(), NsMethod::Gram);
    assert!("grams".parse::<NsMethod>().is_err());
}

/// bf16 Gram Newton–Schulz against an `f64` standard Newton–Schulz, measured against torch's
/// standard bf16 iteration on the same input (both on the reference loops): the Gram iteration
/// may err at most this many times as much. Observed (seed 53): 3.6× (quintic) and 4.3×
/// (Polar Express) on the tall matrix with rows graded to 1e-6 (3.4e-2 and 4.6e-2 against
/// 9.6e-3 and 1.1e-2), at most 2.0× elsewhere; with `f32`'s restart bound (`GRAM_MAX_GROWTH`)
/// the graded tall input reaches 11×, without restarts the rank-1 input 6·10³×, so a wrong
/// restart rule, coefficient or product fails here.
const GRAM_BF16_VS_STANDARD: f64 = 6.0;

#[test]
fn bf16_gram_newton_schulz_errs_about_as_much_as_the_standard_bf16_iteration() {
    let mut rng = Rng::new(53);
    for (rows, cols) in [(96, 320), (320, 96), (200, 700)] {
        for (what, x) in hard_inputs(&mut rng, rows, cols) {
            for base in [NsConfig::default(), NsConfig::polar_express()] {
                let c = NsConfig {
                    precision: NsPrecision::Bf16,
                    backend: NsBackend::Reference,
                    ..base
                };
                let want = ns_f64(&x, rows, cols, &c);
                let gram = with_method(c.clone(), NsMethod::Gram);
                let err = rel_frob(&run(&x, rows, cols, &gram), &want);
                let err_std = rel_frob(&run(&x, rows, cols, &c), &want);
                eprintln!("{rows}×{cols} {what}: gram {err:.3e}, standard {err_std:.3e}");
                assert!(
                    err <= GRAM_BF16_VS_STANDARD * err_std,
                    "{rows}×{cols} {what}, norm scale {}: bf16 Gram {err:e} against \
                     standard {err_std:e}",
                    c.norm_scale
                );
            }
        }
    }
}

/// bf16 Gram Newton–Schulz on the fast backends against the reference loops' (the same
/// roundings, sums in another order: bf16 results differ in their last bit here and there,
/// and Newton–Schulz carries that on).
const BF16_GRAM_BACKENDS_REL: f64 = 2e-2;

fn assert_bf16_gram_agrees_with_reference(backend: NsBackend) {
    let mut rng = Rng::new(59);
    for (rows, cols) in [(37, 100), (100, 37), (300, 1100), (1100, 300)] {
        let x = rng.units(rows * cols);
        let gram = |backend| with_method(cfg(NsPrecision::Bf16, backend), NsMethod::Gram);
        let want = run(&x, rows, cols, &gram(NsBackend::Reference));
        let got = run(&x, rows, cols, &gram(backend));
        let err = rel_frob(&got, &widen(&want));
        eprintln!("{backend:?} {rows}×{cols}: {err:.2e}");
        assert!(
            err <= BF16_GRAM_BACKENDS_REL,
            "{backend:?} {rows}×{cols}: {err:e}"
        );
        // A different iteration, not the same one by another name: the standard iteration's
        // bits differ.
        let standard = with_method(cfg(NsPrecision::Bf16, backend), NsMethod::Standard);
        let standard = run(&x, rows, cols, &standard);
        assert_ne!(bits(&standard), bits(&got), "{backend:?} {rows}×{cols}");
    }
}

#[test]
fn bf16_gram_on_gemm_and_onednn_agrees_with_the_reference_loops() {
    assert_bf16_gram_agrees_with_reference(NsBackend::Gemm);
    if onednn_bf16_or_skip("bf16_gram_on_gemm_and_onednn_agrees_with_the_reference_loops") {
        assert_bf16_gram_agrees_with_reference(NsBackend::OneDnn);
    }
}

#[test]
fn amx_bf16_gram_agrees_with_the_reference_loops() {
    if amx_or_skip("amx_bf16_gram_agrees_with_the_reference_loops") {
        assert_bf16_gram_agrees_with_reference(NsBackend::Amx);
    }
}

#[test]
fn amx_bf16_gram_of_a_tall_matrix_is_that_of_its_transpose_bit_for_bit() {
    // The AMX path takes a tall matrix as it is (`Xᵀ·X`, `X·M`): the same bits as the wide
    // iteration on its transpose, because every `s × s` matrix it multiplies by is exactly
    // symmetric (the symmetric products mirror their diagonal blocks too).
    if !amx_or_skip("amx_bf16_gram_of_a_tall_matrix_is_that_of_its_transpose_bit_for_bit") {
        return;
    }
    let c = with_method(cfg(NsPrecision::Bf16, NsBackend::Amx), NsMethod::Gram);
    let mut rng = Rng::new(67);
    for (rows, cols) in [(100, 37), (1100, 300), (700, 260)] {
        let x = rng.units(rows * cols);
        let xt: Vec<f32> = (0..rows * cols)
            .map(|e| x[(e % rows) * cols + e / rows])
            .collect();
        let tall = run(&x, rows, cols, &c);
        let wide = run(&xt, cols, rows, &c);
        let wide_t: Vec<f32> = (0..rows * cols)
            .map(|e| wide[(e % cols) * rows + e / cols])
            .collect();
        assert_eq!(bits(&tall), bits(&wide_t), "{rows}×{cols}");
    }
}

#[test]
fn ns_macs_follow_the_method_each_matrix_runs() {
    // The config-only cost (Muon's root plan) must name the method the step resolves on this
    // machine, for f32 and bf16 and wide, tall and square shapes.
    let shapes = [
        (1024, 3584),
        (3584, 1024),
        (1024, 1024),
        (1024, 1280),
        (64, 256),
        (3, 200),
    ];
    for precision in [NsPrecision::F32, NsPrecision::Bf16] {
        let auto = cfg(precision, NsBackend::Auto);
        let backend = resolve_config(&auto).unwrap();
        for (rows, cols) in shapes {
            let (s, l) = (rows.min(cols), rows.max(cols));
            let ran = resolve_method(&auto, backend, s, l);
            let resolved = with_method(auto.clone(), ran);
            assert_eq!(
                ns_macs(rows, cols, &auto),
                ns_macs(rows, cols, &resolved),
                "{precision:?} {rows}×{cols}: the cost is not that of {ran:?}"
            );
        }
    }
    // The quintic on a Llama MLP weight: Gram needs 20.125 s³ against 31.5625 s³, counted
    // with symmetric leaves of 256 on every CPU (the AVX2 products split to 128, but every
    // rank of a group must weigh its matrices alike, whatever its CPU).
    let f32 = NsConfig::default();
    let standard = with_method(f32.clone(), NsMethod::Standard);
    let s3 = 1024u128.pow(3);
    assert_eq!(ns_macs(1024, 3584, &f32) * 32, 644 * s3);
    assert_eq!(ns_macs(1024, 3584, &standard) * 32, 1010 * s3);
    assert_eq!(ns_macs(1024, 1024, &f32), ns_macs(1024, 1024, &standard));
}

#[test]
fn gemm_f32_is_bitwise_independent_of_thread_count_and_repeat_calls() {
    let mut rng = Rng::new(9);
    for (rows, cols) in [(64, 160), (300, 420), (420, 300), (520, 560)] {
        let x = rng.units(rows * cols);
        let c = cfg(NsPrecision::F32, NsBackend::Gemm);
        let results: Vec<Vec<u32>> = [1, 2, 3, 2]
            .iter()
            .map(|&n| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .unwrap();
                pool.install(|| bits(&run(&x, rows, cols, &c)))
            })
            .collect();
        for (i, r) in results.iter().enumerate().skip(1) {
            assert!(
                r == &results[0],
                "{rows}×{cols}: run {i} differs from the 1-thread run"
            );
        }
    }
}

#[test]
fn batched_newton_schulz_equals_one_matrix_at_a_time_bitwise() {
    // (8, 40, 64), (3, 64, 40): short side < 256, matrices split over threads with
    // single-threaded GEMMs (`Parallelism::None`); (3, 200, 250) likewise, with products above
    // gemm's threading threshold (48·48·256 multiply-adds), which `orthogonalize` runs on 3
    // threads; (2, 260, 300): one matrix at a time with threaded GEMMs; (6, 260, 300): two
    // per thread (`ACROSS_MIN_PER_THREAD`), so one per thread again. All must equal
    // `orthogonalize` of each matrix under a 3-thread pool.
    let mut rng = Rng::new(13);
    for (count, rows, cols) in [
        (8, 40, 64),
        (3, 64, 40),
        (3, 200, 250),
        (2, 260, 300),
        (6, 260, 300),
    ] {
        for precision in [NsPrecision::F32, NsPrecision::Bf16] {
            let c = cfg(precision, NsBackend::Gemm);
            let x = rng.units(count * rows * cols);
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(3)
                .build()
                .unwrap();
            let mut batched = x.clone();
            pool.install(|| orthogonalize_batch(&mut batched, rows, cols, &c))
                .unwrap();
            let one_by_one: Vec<f32> = x
                .chunks(rows * cols)
                .flat_map(|m| pool.install(|| run(m, rows, cols, &c)))
                .collect();
            assert_eq!(
                bits(&batched),
                bits(&one_by_one),
                "{count}×{rows}×{cols} {precision:?}"
            );
        }
    }
}

#[test]
fn many_matrices_of_mixed_shapes_equal_one_matrix_at_a_time_bitwise() {
    // Nine matrices, wide and tall, short sides from 40 to 300, on 3 threads: at least
    // `ACROSS_MIN_PER_THREAD` per thread fit, so all run one per thread (on the AMX backend
    // their products on the calling thread), handed out largest first (not in the order
    // given); with the last four alone, 300×300 runs with threaded products. Each must keep
    // its own shape and bits.
    let shapes = [
        (40, 64),
        (300, 260),
        (64, 300),
        (260, 280),
        (256, 256),
        (280, 40),
        (90, 300),
        (300, 300),
        (128, 257),
    ];
    let mut rng = Rng::new(17);
    // gemm in f32, and the AMX products (bf16) where the CPU has them.
    let mut configs = vec![cfg(NsPrecision::F32, NsBackend::Gemm)];
    if amx_bf16::amx().is_ok() {
        configs.push(cfg(NsPrecision::Bf16, NsBackend::Amx));
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    for (c, first) in configs.iter().flat_map(|c| [(c, 0), (c, 5)]) {
        let shapes = &shapes[first..];
        let inputs: Vec<Vec<f32>> = shapes.iter().map(|&(r, c)| rng.units(r * c)).collect();
        let mut many = inputs.clone();
        let tasks = many
            .iter_mut()
            .zip(shapes)
            .map(|(x, &(r, c))| (x.as_mut_slice(), r, c))
            .collect();
        pool.install(|| orthogonalize_many(tasks, c)).unwrap();
        for ((x, y), &(r, cols)) in inputs.iter().zip(&many).zip(shapes) {
            let alone = pool.install(|| run(x, r, cols, c));
            assert_eq!(
                bits(y),
                bits(&alone),
                "{r}×{cols} of {} matrices, {:?}",
                shapes.len(),
                c.backend
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 1b. oneDNN plumbing in f32 (runs wherever oneDNN loads, AVX-512 or not)
// ---------------------------------------------------------------------------------------------

/// oneDNN's symmetric products, `scale·a·aᵀ + sum·dst` and `u·v` of commuting symmetric
/// matrices, against gemm's full product, on sides that split once and twice around
/// `OneDnn::sym_leaf` (its blocks are products into a wider `dst`, mirrored): the same
/// `√k·2⁻²⁴` summation-order bound as below (`1e-5`); the mirrored blocks exactly symmetric;
/// and a strided product leaves the elements between its rows as they were, bit for bit.
#[test]
fn onednn_symmetric_and_strided_products_match_gemm() {
    use ragged_optimizers::kernels::{gemm_f32, Parallelism};
    if !onednn_or_skip("onednn_symmetric_and_strided_products_match_gemm") {
        return;
    }
    let d = onednn::onednn().unwrap();
    let mut rng = Rng::new(41);
    let leaf = d.sym_leaf();
    for (n, k) in [(leaf + 9, 70), (2 * leaf + 77, 33)] {
        let a = rng.units(n * k);
        let mut at = vec![0.0f32; k * n];
        for i in 0..n {
            for j in 0..k {
                at[j * n + i] = a[i * k + j];
            }
        }
        // A symmetric `dst` on entry, for the sum term.
        let r = rng.units(n * n);
        let c0: Vec<f32> = (0..n * n).map(|e| r[e] + r[(e % n) * n + e / n]).collect();
        for (scale, sum) in [(1.0f32, None), (-4.775f32, Some(2.0315f32))] {
            let mut want = c0.clone();
            let read = sum.is_some();
            let alpha = sum.unwrap_or(0.0);
            gemm_f32::matmul(
                n,
                n,
                k,
                &a,
                &at,
                &mut want,
                read,
                alpha,
                scale,
                Parallelism::None,
            );
            let mut got = c0.clone();
            d.sym_nt(n, k, &a, &mut got, n, scale, sum).unwrap();
            let err = rel_frob(&got, &widen(&want));
            assert!(err <= 1e-5, "{n}×{k} scale {scale} sum {sum:?}: {err:e}");
            // The top split's off-diagonal blocks are one product and its mirror.
            let h = n / 2;
            for i in h..n {
                for j in 0..h {
                    assert_eq!(
                        got[i * n + j].to_bits(),
                        got[j * n + i].to_bits(),
                        "({i}, {j})"
                    );
                }
            }
        }
        // The product of commuting symmetric matrices `u` and `v = u·u` (Gram
        // Newton–Schulz's `Q·M`), by the same halves: against gemm's full `u·v`, the top
        // split's off-diagonal blocks one product and its mirror.
        let u = c0;
        let mut v = vec![0.0f32; n * n];
        gemm_f32::sym_product(&u, &u, n, &mut v, Parallelism::None);
        let mut want = vec![0.0f32; n * n];
        gemm_f32::matmul(
            n,
            n,
            n,
            &u,
            &v,
            &mut want,
            false,
            0.0,
            1.0,
            Parallelism::None,
        );
        let mut got = vec![0.0f32; n * n];
        d.sym_product(n, &u, &v, &mut got).unwrap();
        let err = rel_frob(&got, &widen(&want));
        assert!(err <= 1e-5, "sym_product {n}: {err:e}");
        let h = n / 2;
        let mirrored =
            (h..n).all(|i| (0..h).all(|j| got[i * n + j].to_bits() == got[j * n + i].to_bits()));
        assert!(
            mirrored,
            "sym_product {n}: the off-diagonal blocks are not mirrors"
        );
    }
    // A 5×3 product into columns 2..5 of a 5×9 matrix.
    let (m, nn, k, ldd) = (5, 3, 4, 9);
    let a = rng.units(m * k);
    let b = rng.units(k * nn);
    let mut want = vec![0.0f32; m * nn];
    gemm_f32::matmul(
        m,
        nn,
        k,
        &a,
        &b,
        &mut want,
        false,
        0.0,
        1.0,
        Parallelism::None,
    );
    let before = rng.units(m * ldd);
    let mut got = before.clone();
    d.matmul_strided(m, nn, k, &a, &b, false, &mut got[2..], ldd, 1.0, None)
        .unwrap();
    for i in 0..m {
        for j in 0..ldd {
            let (g, e) = (got[i * ldd + j], before[i * ldd + j]);
            if (2..2 + nn).contains(&j) {
                let w = want[i * nn + j - 2];
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "({i}, {j}): {g} vs {w}"
                );
            } else {
                assert_eq!(
                    g.to_bits(),
                    e.to_bits(),
                    "({i}, {j}) outside the block changed"
                );
            }
        }
    }
}

/// One oneDNN f32 matmul vs gemm: only the summation order differs, relative error about
/// `√k·2⁻²⁴ ≈ 1e-6` for `k ≤ 300` (observed ≤ 8e-8); tolerance `1e-5`. A wrong layout tag, a dropped scale
/// or sum, or a transposed operand gives errors of order 1.
#[test]
fn onednn_f32_matmul_with_scale_sum_and_transposed_weights_matches_gemm() {
    use ragged_optimizers::kernels::{gemm_f32, Parallelism};
    if !onednn_or_skip("onednn_f32_matmul_with_scale_sum_and_transposed_weights_matches_gemm") {
        return;
    }
    let d = onednn::onednn().unwrap();
    let mut rng = Rng::new(31);
    for (m, n, k) in [(7, 5, 3), (64, 48, 80), (300, 17, 129), (1, 9, 4)] {
        let a = rng.units(m * k);
        let b = rng.units(k * n);
        let c0 = rng.units(m * n);
        // bᵀ (n×k) row-major, for the transposed-weights layout.
        let mut bt = vec![0.0f32; n * k];
        for i in 0..k {
            for j in 0..n {
                bt[j * k + i] = b[i * n + j];
            }
        }
        for (scale, sum) in [
            (1.0f32, None),
            (-2.5f32, Some(0.75f32)),
            (1.0, Some(3.4445)),
        ] {
            let mut want = c0.clone();
            gemm_f32::matmul(
                m,
                n,
                k,
                &a,
                &b,
                &mut want,
                sum.is_some(),
                sum.unwrap_or(0.0),
                scale,
                Parallelism::None,
            );
            for transposed in [false, true] {
                let mut got = c0.clone();
                let wei = if transposed { &bt } else { &b };
                d.matmul(m, n, k, &a, wei, transposed, &mut got, scale, sum)
                    .unwrap();
                let err = rel_frob(&got, &widen(&want));
                assert!(
                    err <= 1e-5,
                    "{m}×{n}×{k} scale {scale} sum {sum:?} transposed {transposed}: {err:e}"
                );
            }
        }
    }
}

#[test]
fn onednn_f32_newton_schulz_matches_gemm() {
    if !onednn_or_skip("onednn_f32_newton_schulz_matches_gemm") {
        return;
    }
    let mut rng = Rng::new(37);
    for (rows, cols) in SHAPES {
        let x = rng.units(rows * cols);
        let want = run(&x, rows, cols, &cfg(NsPrecision::F32, NsBackend::Gemm));
        let got = run(&x, rows, cols, &cfg(NsPrecision::F32, NsBackend::OneDnn));
        let err = rel_frob(&got, &widen(&want));
        assert!(
            err <= GEMM_VS_REFERENCE_REL,
            "{rows}×{cols}: oneDNN f32 vs gemm relative Frobenius error {err:e}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 2. bf16
// ---------------------------------------------------------------------------------------------

/// bf16 vs f32 NS. bf16 keeps 8 significant bits (unit roundoff `u = 2⁻⁹ ≈ 2e-3`); each step
/// rounds `P`, `Q` and `X` once (error `≈ u` each, relative to the entry), and the iteration
/// is contracting near the band but can amplify by up to `a ≈ 3.4` for small singular values,
/// so a few `u` per step accumulate to `~1e-2`. Observed 7e-3 (1×9) to 1.4e-2 (48×80), seed
/// 17, for the reference and portable paths; the tolerance `3e-2` is well below a real error
/// (a missing step or a wrong sign changes the result by `> 0.1`).
const BF16_VS_F32_REL: f64 = 3e-2;

#[test]
fn bf16_newton_schulz_matches_f32_within_bf16_rounding() {
    let mut rng = Rng::new(17);
    let mut backends = vec![NsBackend::Reference, NsBackend::Gemm];
    if onednn_bf16_or_skip("bf16_newton_schulz_matches_f32 (OneDnn part)") {
        backends.push(NsBackend::OneDnn);
    }
    for (rows, cols) in [(48, 80), (80, 48), (300, 420), (1, 9), (520, 560)] {
        let x = rng.units(rows * cols);
        let want = widen(&run(
            &x,
            rows,
            cols,
            &cfg(NsPrecision::F32, NsBackend::Gemm),
        ));
        for &b in &backends {
            let got = run(&x, rows, cols, &cfg(NsPrecision::Bf16, b));
            let err = rel_frob(&got, &want);
            assert!(
                err <= BF16_VS_F32_REL,
                "{rows}×{cols}, {b:?}: bf16 vs f32 relative Frobenius error {err:e}"
            );
            assert!(
                got.iter()
                    .all(|v| half::bf16::from_f32(*v).to_f32().to_bits() == v.to_bits()),
                "{rows}×{cols}, {b:?}: a bf16 result must be exactly representable in bf16"
            );
        }
    }
}

#[test]
fn bf16_singular_values_land_in_the_quintic_band() {
    // As in muon_tests: rectangular inputs with aspect ≤ 0.7 keep σ_min away from 0. The
    // quintic's band is ≈ [0.7, 1.2]; bf16 rounding of X (≈ 2e-3 relative) widens it a little,
    // so the bound checked is [0.6, 1.25].
    let mut rng = Rng::new(11);
    let mut backends = vec![NsBackend::Gemm, NsBackend::Reference];
    if onednn_bf16_or_skip("bf16_singular_values (OneDnn part)") {
        backends.push(NsBackend::OneDnn);
    }
    for (rows, cols) in [(48, 80), (80, 48), (16, 24)] {
        let x = rng.units(rows * cols);
        for &b in &backends {
            let y = run(&x, rows, cols, &cfg(NsPrecision::Bf16, b));
            let (lo, hi) = singular_range(&y, rows, cols);
            assert!(
                (0.6..=1.25).contains(&lo) && (0.6..=1.25).contains(&hi),
                "{rows}×{cols} {b:?}: singular values in [{lo}, {hi}], want within [0.6, 1.25]"
            );
        }
    }
}

/// oneDNN vs the portable bf16 path: both round the same quantities once per operation, but
/// their `f32` accumulation orders differ, so some results fall on the other side of a bf16
/// rounding boundary (one bf16 ulp, `2⁻⁸` relative); those flips propagate through the
/// remaining steps like the rounding itself, so the difference is of the order of the
/// bf16-vs-f32 one (≈ 1e-2). Not observed here (no AVX-512 on the development host);
/// tolerance `2e-2`, below the bf16-vs-f32 bound, far below a real error.
const ONEDNN_VS_PORTABLE_REL: f64 = 2e-2;

/// `backend`'s bf16 Newton–Schulz against the portable bf16 path, within
/// [`ONEDNN_VS_PORTABLE_REL`] (the same roundings, another `f32` summation order), and the
/// same bits on a repeat call (oneDNN: cached primitives; AMX: reused buffers).
fn assert_bf16_backend_agrees_with_portable(backend: NsBackend, seed: u64) {
    let mut rng = Rng::new(seed);
    for (rows, cols) in [(64, 64), (100, 37), (37, 100), (1, 9), (9, 1), (520, 560)] {
        let x = rng.units(rows * cols);
        let portable = cfg(NsPrecision::Bf16, NsBackend::Gemm);
        let want = widen(&run(&x, rows, cols, &portable));
        let got = run(&x, rows, cols, &cfg(NsPrecision::Bf16, backend));
        let err = rel_frob(&got, &want);
        assert!(
            err <= ONEDNN_VS_PORTABLE_REL,
            "{rows}×{cols}: {backend:?} vs portable bf16 relative Frobenius error {err:e}"
        );
        let again = run(&x, rows, cols, &cfg(NsPrecision::Bf16, backend));
        assert_eq!(bits(&got), bits(&again), "{rows}×{cols}: repeat call");
    }
}

#[test]
fn onednn_bf16_agrees_with_the_portable_bf16_path() {
    if !onednn_bf16_or_skip("onednn_bf16_agrees_with_the_portable_bf16_path") {
        return;
    }
    assert_bf16_backend_agrees_with_portable(NsBackend::OneDnn, 19);
    eprintln!("{}", ns_backend_info());
}

/// The AMX products spread over rayon's pool.
const POOL: Parallelism = Parallelism::Rayon(0);

/// Whether this process may use the AMX tiles; prints why a test skips when not.
fn amx_or_skip(test: &str) -> bool {
    match amx_bf16::amx() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("{test}: skipped, {e}");
            false
        }
    }
}

/// `alpha·Σ_k a·b + beta·add` with the `f32` sum over `k` ascending and separate multiply
/// and add, rounded once: the order `TDPBF16PS` sums in.
#[allow(clippy::too_many_arguments)]
fn sequential_product(
    m: usize,
    n: usize,
    k: usize,
    a: &[bf16],
    b: &[bf16],
    b_transposed: bool,
    alpha: f32,
    add: Option<(f32, &[bf16])>,
) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f32;
            for kk in 0..k {
                let bv = if b_transposed {
                    b[j * k + kk]
                } else {
                    b[kk * n + j]
                };
                acc += a[i * k + kk].to_f32() * bv.to_f32();
            }
            let mut v = alpha * acc;
            if let Some((beta, add)) = add {
                v += beta * add[i * n + j].to_f32();
            }
            out[i * n + j] = bf16::from_f32(v);
        }
    }
    out
}

/// AMX products against [`sequential_product`] and the exact (f64) value. `TDPBF16PS` sums
/// in the same order but flushes denormals and adds the two products of a pair as the unit
/// does, so a rare `f32` sum lands on the other side of a bf16 rounding boundary: at least
/// 98 % of the elements must be bitwise equal to the sequential sum (seen: all but ≤ 2 of
/// 87,040), and every element within the bound of any `f32` summation order,
/// `2⁻⁸·|exact| + (k + 2)·2⁻²³·(|α|·Σ|a·b| + |β·add|)` (bf16 rounding plus `f32` rounding of
/// every partial sum).
#[allow(clippy::too_many_arguments)]
fn assert_amx_product(
    got: &[bf16],
    want: &[bf16],
    (m, n, k): (usize, usize, usize),
    a: &[bf16],
    b: &dyn Fn(usize, usize) -> bf16,
    alpha: f32,
    add: Option<(f32, &[bf16])>,
    what: &str,
) {
    let differing = got.iter().zip(want).filter(|(x, y)| x != y).count();
    assert!(
        differing * 50 <= got.len().max(50),
        "{what}: {differing} of {} elements differ from the sequential sum",
        got.len()
    );
    for i in 0..m {
        for j in 0..n {
            let (mut exact, mut magnitude) = (0.0f64, 0.0f64);
            for kk in 0..k {
                let p = f64::from(a[i * k + kk].to_f32()) * f64::from(b(kk, j).to_f32());
                exact += f64::from(alpha) * p;
                magnitude += (f64::from(alpha) * p).abs();
            }
            if let Some((beta, add)) = add {
                let t = f64::from(beta) * f64::from(add[i * n + j].to_f32());
                exact += t;
                magnitude += t.abs();
            }
            let tol = exact.abs() / 256.0 + (k as f64 + 2.0) * magnitude / f64::from(1u32 << 23);
            let err = (f64::from(got[i * n + j].to_f32()) - exact).abs();
            assert!(
                err <= tol,
                "{what}: ({i}, {j}) is {} for {exact} (tolerance {tol:e})",
                got[i * n + j]
            );
        }
    }
}

fn bf16_units(rng: &mut Rng, n: usize) -> Vec<bf16> {
    rng.units(n).into_iter().map(bf16::from_f32).collect()
}

#[test]
fn amx_products_match_the_sequential_sum_at_every_edge_and_do_not_depend_on_threads() {
    if !amx_or_skip(
        "amx_products_match_the_sequential_sum_at_every_edge_and_do_not_depend_on_threads",
    ) {
        return;
    }
    let amx = amx_bf16::amx().unwrap();
    let mut rng = Rng::new(23);
    // Full blocks, every partial edge, more blocks than one task region (128×512), and a `k`
    // of three accumulation passes (1024 each), the last one partial.
    for (m, n, k) in [
        (1, 1, 1),
        (32, 32, 32),
        (33, 47, 65),
        (100, 70, 130),
        (96, 96, 96),
        (160, 544, 40),
        (40, 36, 2100),
    ] {
        let a = bf16_units(&mut rng, m * k);
        let b = bf16_units(&mut rng, k * n);
        let add = bf16_units(&mut rng, m * n);
        for (transposed, alpha, addend) in
            [(false, 1.0, None), (true, -0.75, Some((2.5, &add[..])))]
        {
            let mut got = vec![bf16::ZERO; m * n];
            let rhs = if transposed {
                Rhs::Transposed(&b)
            } else {
                Rhs::Plain(&b)
            };
            let epi = Epilogue { alpha, add: addend };
            amx.matmul(m, n, k, &a, rhs, &mut got, epi, POOL);
            let want = sequential_product(m, n, k, &a, &b, transposed, alpha, addend);
            let rhs_at = |kk: usize, j: usize| {
                if transposed {
                    b[j * k + kk]
                } else {
                    b[kk * n + j]
                }
            };
            let what = format!("{m}×{k}·{k}×{n} transposed={transposed}");
            assert_amx_product(&got, &want, (m, n, k), &a, &rhs_at, alpha, addend, &what);
            // A pool of one thread, and the calling thread alone, give the same bits (the sum
            // order is per element, not per task).
            let one = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            let mut again = vec![bf16::ZERO; m * n];
            one.install(|| amx.matmul(m, n, k, &a, rhs, &mut again, epi, POOL));
            assert_eq!(got, again, "{m}×{k}·{k}×{n}: one thread");
            let mut here = vec![bf16::ZERO; m * n];
            amx.matmul(m, n, k, &a, rhs, &mut here, epi, Parallelism::None);
            assert_eq!(got, here, "{m}×{k}·{k}×{n}: on the calling thread");
        }
    }
}

/// `rows × cols` of `v` (dense) into an aligned buffer with rows `ld` apart, its padding a
/// NaN pattern that would show in any result that read it.
fn strided_copy(v: &[bf16], rows: usize, cols: usize, ld: usize) -> AlignedBf16 {
    let mut buf = AlignedBf16::default();
    let out = buf.get(rows.max(1) * ld);
    out.fill(bf16::from_bits(0x7fc1));
    for (r, row) in v.chunks(cols.max(1)).enumerate().take(rows) {
        out[r * ld..][..cols].copy_from_slice(row);
    }
    buf
}

/// The strided products (Newton–Schulz's padded rows, [`amx_bf16::padded_ld`]) give the
/// dense products' bits, read no padding (it holds NaNs) and write none: plain and
/// transposed right operands, both symmetric products, an epilogue addend (also with its
/// own stride beside a dense output), left operands in place (sides multiples of 32) and
/// packed.
#[test]
fn amx_strided_products_are_the_dense_ones_bit_for_bit() {
    if !amx_or_skip("amx_strided_products_are_the_dense_ones_bit_for_bit") {
        return;
    }
    let amx = amx_bf16::amx().unwrap();
    let mut rng = Rng::new(37);
    let ld = amx_bf16::padded_ld;
    assert_eq!(
        (ld(1024), ld(3584), ld(1056), ld(33)),
        (1056, 3616, 1056, 96)
    );
    for (m, n, k) in [(64, 96, 128), (96, 64, 1056), (33, 47, 65), (128, 160, 64)] {
        let a = bf16_units(&mut rng, m * k);
        let b = bf16_units(&mut rng, k * n);
        let add = bf16_units(&mut rng, m * n);
        let epi = Epilogue {
            alpha: 0.75,
            add: Some((-1.5, &add[..])),
        };
        let (mut sa, mut sadd) = (
            strided_copy(&a, m, k, ld(k)),
            strided_copy(&add, m, n, ld(n)),
        );
        let (sa, sadd) = (sa.get(m * ld(k)), sadd.get(m * ld(n)));
        let sepi = Epilogue {
            alpha: 0.75,
            add: Some((-1.5, &sadd[..])),
        };
        // The strided output, its padding a NaN pattern that must survive.
        let rows_of = |out: &[bf16], rows: usize, cols: usize, ld: usize| -> Vec<bf16> {
            for r in 0..rows {
                let pad = &out[r * ld + cols..(r * ld + ld).min(out.len())];
                assert!(pad.iter().all(|x| x.to_bits() == 0x7fc1), "padding written");
            }
            (0..rows)
                .flat_map(|r| out[r * ld..][..cols].to_vec())
                .collect()
        };
        for transposed in [false, true] {
            let (b_rows, b_cols) = if transposed { (n, k) } else { (k, n) };
            let mut sb = strided_copy(&b, b_rows, b_cols, ld(b_cols));
            let sb = sb.get(b_rows * ld(b_cols));
            let (rhs, srhs) = if transposed {
                (Rhs::Transposed(&b), Rhs::Transposed(&sb[..]))
            } else {
                (Rhs::Plain(&b), Rhs::Plain(&sb[..]))
            };
            let mut want = vec![bf16::ZERO; m * n];
            amx.matmul(m, n, k, &a, rhs, &mut want, epi, POOL);
            let mut got = AlignedBf16::default();
            let got = got.get(m * ld(n));
            got.fill(bf16::from_bits(0x7fc1));
            let strides = Strides {
                a: ld(k),
                b: ld(b_cols),
                out: ld(n),
                add: ld(n),
            };
            amx.matmul_strided(m, n, k, sa, srhs, got, sepi, POOL, strides);
            let what = format!("{m}×{k}·{k}×{n} transposed={transposed}");
            assert_eq!(
                bits_bf16(&rows_of(got, m, n, ld(n))),
                bits_bf16(&want),
                "{what}"
            );
            // A dense output beside a padded addend (Newton–Schulz's last product).
            let mut dense = vec![bf16::ZERO; m * n];
            let strides = Strides { out: n, ..strides };
            amx.matmul_strided(m, n, k, sa, srhs, &mut dense, sepi, POOL, strides);
            assert_eq!(bits_bf16(&dense), bits_bf16(&want), "{what}, dense output");
        }
        // Symmetric: `a·aᵀ` (a: m×k) and `aᵀ·a` (a as k×m: the same buffer read tall).
        for tall in [false, true] {
            let (nn, kk) = if tall { (k, m) } else { (m, k) };
            let sym_add = bf16_units(&mut rng, nn * nn);
            let sym_add: Vec<bf16> = (0..nn * nn)
                .map(|e| sym_add[(e % nn).max(e / nn) * nn + (e % nn).min(e / nn)])
                .collect();
            let mut ssym_add = strided_copy(&sym_add, nn, nn, ld(nn));
            let ssym_add = ssym_add.get(nn * ld(nn));
            let (e_dense, e_strided) = (
                Epilogue {
                    alpha: 0.5,
                    add: Some((2.0, &sym_add[..])),
                },
                Epilogue {
                    alpha: 0.5,
                    add: Some((2.0, &ssym_add[..])),
                },
            );
            let mut want = vec![bf16::ZERO; nn * nn];
            let mut got = AlignedBf16::default();
            let got = got.get(nn * ld(nn));
            got.fill(bf16::from_bits(0x7fc1));
            let strides = Strides {
                a: ld(k),
                b: 0,
                out: ld(nn),
                add: ld(nn),
            };
            if tall {
                amx.sym_tn(nn, kk, &a, &mut want, e_dense, POOL);
                amx.sym_strided(nn, kk, sa, got, e_strided, POOL, true, strides);
            } else {
                amx.sym_nt(nn, kk, &a, &mut want, e_dense, POOL);
                amx.sym_strided(nn, kk, sa, got, e_strided, POOL, false, strides);
            }
            let what = format!("sym {m}×{k} tall={tall}");
            assert_eq!(
                bits_bf16(&rows_of(got, nn, nn, ld(nn))),
                bits_bf16(&want),
                "{what}"
            );
        }
    }
}

fn bits_bf16(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A left operand in an [`AlignedBf16`] with sides that are multiples of 32 is read in place
/// (no packing); the same values one element off alignment are packed first. Both give the
/// same bits, in every product that takes a left operand.
#[test]
fn amx_left_operand_in_place_equals_packed() {
    if !amx_or_skip("amx_left_operand_in_place_equals_packed") {
        return;
    }
    let amx = amx_bf16::amx().unwrap();
    let mut rng = Rng::new(31);
    let raw = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
    for (m, n, k) in [(32, 32, 32), (64, 96, 1056), (96, 64, 160), (160, 33, 64)] {
        let a = bf16_units(&mut rng, m * k);
        let b = bf16_units(&mut rng, k * n);
        let add = bf16_units(&mut rng, m * n);
        let mut buf = AlignedBf16::default();
        let aligned = buf.get(m * k);
        aligned.copy_from_slice(&a);
        let mut off = vec![bf16::ZERO; m * k + 1];
        off[1..].copy_from_slice(&a);
        let epi = Epilogue {
            alpha: 0.75,
            add: Some((-1.5, &add[..])),
        };
        for rhs in [Rhs::Plain(&b), Rhs::Transposed(&b)] {
            let (mut here, mut packed) = (vec![bf16::ZERO; m * n], vec![bf16::ZERO; m * n]);
            amx.matmul(m, n, k, aligned, rhs, &mut here, epi, POOL);
            amx.matmul(m, n, k, &off[1..], rhs, &mut packed, epi, POOL);
            assert_eq!(raw(&here), raw(&packed), "{m}×{k}·{k}×{n} {rhs:?}");
        }
        let (mut here, mut packed) = (vec![bf16::ZERO; m * m], vec![bf16::ZERO; m * m]);
        let plain = Epilogue::PLAIN;
        amx.sym_nt(m, k, aligned, &mut here, plain, POOL);
        amx.sym_nt(m, k, &off[1..], &mut packed, plain, POOL);
        assert_eq!(raw(&here), raw(&packed), "sym {m}×{k}");
    }
}

#[test]
fn amx_product_of_commuting_symmetric_matrices_is_exactly_symmetric() {
    if !amx_or_skip("amx_product_of_commuting_symmetric_matrices_is_exactly_symmetric") {
        return;
    }
    let amx = amx_bf16::amx().unwrap();
    let mut rng = Rng::new(61);
    let plain = Epilogue::PLAIN;
    for n in [1, 31, 33, 100, 200] {
        // `u` symmetric and `v = u·u` (exactly symmetric, `sym_nt`): they commute up to
        // rounding, as Gram Newton–Schulz's `Q` and `M` do.
        let a = bf16_units(&mut rng, n * n);
        let mut u = vec![bf16::ZERO; n * n];
        amx.sym_nt(n, n, &a, &mut u, plain, POOL);
        let mut v = vec![bf16::ZERO; n * n];
        amx.sym_nt(n, n, &u, &mut v, plain, POOL);
        let mut full = vec![bf16::ZERO; n * n];
        amx.matmul(n, n, n, &u, Rhs::Plain(&v), &mut full, plain, POOL);
        // Stored with padded rows, on the pool and on the calling thread.
        let ld = amx_bf16::padded_ld(n);
        let pad = |m: &[bf16]| {
            let mut out = vec![bf16::from_f32(7.0); n * ld];
            for i in 0..n {
                out[i * ld..i * ld + n].copy_from_slice(&m[i * n..(i + 1) * n]);
            }
            out
        };
        let (up, vp) = (pad(&u), pad(&v));
        let strides = Strides {
            a: ld,
            b: ld,
            out: ld,
            add: ld,
        };
        let mut asymmetric = 0;
        for par in [POOL, Parallelism::None] {
            let mut out = vec![bf16::ZERO; n * ld];
            amx.sym_product_strided(n, &up, &vp, &mut out, plain, par, strides);
            for i in 0..n {
                for j in 0..=i {
                    let what = format!("n = {n}, {par:?}, ({i}, {j})");
                    assert_eq!(
                        out[i * ld + j].to_bits(),
                        full[i * n + j].to_bits(),
                        "{what}"
                    );
                    assert_eq!(
                        out[j * ld + i].to_bits(),
                        out[i * ld + j].to_bits(),
                        "{what}"
                    );
                    asymmetric += usize::from(full[j * n + i] != full[i * n + j]);
                }
            }
        }
        // The full product of the rounded matrices is not symmetric itself (beyond tiny n):
        // the mirroring is what makes the result so.
        if n >= 100 {
            assert!(asymmetric > 0, "n = {n}: u·v came out symmetric by itself");
        }
    }
}

#[test]
fn amx_symmetric_products_are_exactly_symmetric_and_match_the_full_product() {
    if !amx_or_skip("amx_symmetric_products_are_exactly_symmetric_and_match_the_full_product") {
        return;
    }
    let amx = amx_bf16::amx().unwrap();
    let mut rng = Rng::new(29);
    for (n, k) in [
        (1, 3),
        (31, 64),
        (33, 65),
        (200, 130),
        (160, 32),
        (40, 2100),
    ] {
        let a = bf16_units(&mut rng, n * k);
        // A symmetric addend, as Newton–Schulz's `P`.
        let mut add = bf16_units(&mut rng, n * n);
        for i in 0..n {
            for j in 0..i {
                add[j * n + i] = add[i * n + j];
            }
        }
        let epi = Epilogue {
            alpha: 2.0,
            add: Some((-0.5, &add[..])),
        };
        let mut sym = vec![bf16::ZERO; n * n];
        amx.sym_nt(n, k, &a, &mut sym, epi, POOL);
        let mut here = vec![bf16::ZERO; n * n];
        amx.sym_nt(n, k, &a, &mut here, epi, Parallelism::None);
        assert_eq!(sym, here, "{n}×{k}: on the calling thread");
        // `aᵀ·a` of the transpose (`k×n`): the same bits, on the pool and on this thread.
        let at: Vec<bf16> = (0..k * n).map(|e| a[(e % n) * k + e / n]).collect();
        for par in [POOL, Parallelism::None] {
            let mut tn = vec![bf16::ZERO; n * n];
            amx.sym_tn(n, k, &at, &mut tn, epi, par);
            let raw = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
            assert_eq!(raw(&tn), raw(&sym), "{n}×{k}: sym_tn {par:?}");
        }
        let mut full = vec![bf16::ZERO; n * n];
        amx.matmul(n, n, k, &a, Rhs::Transposed(&a), &mut full, epi, POOL);
        for i in 0..n {
            for j in 0..n {
                assert_eq!(
                    sym[i * n + j],
                    sym[j * n + i],
                    "{n}×{k}: ({i}, {j}) not symmetric"
                );
            }
        }
        // The lower blocks are the full product's, element for element.
        for i in 0..n {
            for j in 0..=(i / 32 * 32 + 31).min(n - 1) {
                if j / 32 <= i / 32 {
                    assert_eq!(sym[i * n + j], full[i * n + j], "{n}×{k}: ({i}, {j})");
                }
            }
        }
        let want = sequential_product(n, n, k, &a, &a, true, 2.0, Some((-0.5, &add)));
        let rhs_at = |kk: usize, j: usize| a[j * k + kk];
        let addend = Some((-0.5, &add[..]));
        assert_amx_product(
            &sym,
            &want,
            (n, n, k),
            &a,
            &rhs_at,
            2.0,
            addend,
            &format!("sym {n}×{k}"),
        );
    }
}

/// Newton–Schulz in bf16 spelled out on the public AMX products: a tall matrix transposed,
/// the input rounded to bf16, its norm summed in `f64` (element `i` of the matrix as given
/// into lane `i mod 8`, the lanes in order), divided by `max(scale·norm, eps)` and rounded, then per step
/// `P = X·Xᵀ`, `Q = c·P·Pᵀ + b·P`, `X ← Q·X + a·X`, and the result widened (and transposed
/// back). What `orthogonalize` must give to the bit on the AMX backend, however it fuses its
/// passes.
fn amx_newton_schulz_by_hand(x: &[f32], rows: usize, cols: usize, c: &NsConfig) -> Vec<f32> {
    let amx = amx_bf16::amx().unwrap();
    let tall = rows > cols;
    let (s, l) = if tall { (cols, rows) } else { (rows, cols) };
    let at = |i: usize, j: usize| {
        if tall {
            x[j * cols + i]
        } else {
            x[i * cols + j]
        }
    };
    let round = |v: f32| bf16::from_f32(v).to_f32();
    let rounded: Vec<f32> = (0..s * l).map(|e| round(at(e / l, e % l))).collect();
    // The norm over the matrix as given (row-major), not its transpose.
    let mut lanes = [0.0f64; 8];
    for (e, &v) in x.iter().enumerate() {
        lanes[e % 8] += f64::from(round(v)) * f64::from(round(v));
    }
    let norm = lanes.iter().sum::<f64>().sqrt() as f32;
    let denom = (c.norm_scale * norm).max(c.eps);
    let mut xb: Vec<bf16> = rounded.iter().map(|&v| bf16::from_f32(v / denom)).collect();
    let (mut p, mut q, mut y) = (
        vec![bf16::ZERO; s * s],
        vec![bf16::ZERO; s * s],
        vec![bf16::ZERO; s * l],
    );
    for k in 0..c.steps {
        let [a, b, cc] = c.coeffs_at(k);
        amx.sym_nt(s, l, &xb, &mut p, Epilogue::PLAIN, POOL);
        amx.sym_nt(
            s,
            s,
            &p,
            &mut q,
            Epilogue {
                alpha: cc,
                add: Some((b, &p)),
            },
            POOL,
        );
        amx.matmul(
            s,
            l,
            s,
            &q,
            Rhs::Plain(&xb),
            &mut y,
            Epilogue {
                alpha: 1.0,
                add: Some((a, &xb)),
            },
            POOL,
        );
        std::mem::swap(&mut xb, &mut y);
    }
    let mut out = vec![0.0f32; rows * cols];
    for i in 0..s {
        for j in 0..l {
            let v = xb[i * l + j].to_f32();
            if tall {
                out[j * cols + i] = v;
            } else {
                out[i * cols + j] = v;
            }
        }
    }
    out
}

#[test]
fn amx_newton_schulz_is_its_products_composed_bit_for_bit() {
    if !amx_or_skip("amx_newton_schulz_is_its_products_composed_bit_for_bit") {
        return;
    }
    let mut rng = Rng::new(47);
    let c = with_method(cfg(NsPrecision::Bf16, NsBackend::Amx), NsMethod::Standard);
    // Wide, tall, square, vectors, a side that is no multiple of 32, and one large enough
    // that the elementwise passes split into chunks over threads.
    for (rows, cols) in [
        (64, 64),
        (37, 100),
        (100, 37),
        (1, 9),
        (9, 1),
        (300, 1100),
        (1100, 300),
    ] {
        let x: Vec<f32> = rng.units(rows * cols).iter().map(|v| v * 3.0).collect();
        let want = amx_newton_schulz_by_hand(&x, rows, cols, &c);
        let got = run(&x, rows, cols, &c);
        assert_eq!(bits(&got), bits(&want), "{rows}×{cols}");
    }
}

#[test]
fn amx_bf16_agrees_with_the_portable_bf16_path() {
    if !amx_or_skip("amx_bf16_agrees_with_the_portable_bf16_path") {
        return;
    }
    assert_bf16_backend_agrees_with_portable(NsBackend::Amx, 31);
    let f32_amx = resolve_backend(NsPrecision::F32, NsBackend::Amx);
    assert!(f32_amx.is_err(), "AMX is bf16 only: {f32_amx:?}");
}

#[test]
fn backend_resolution_and_info_name_what_runs() {
    assert_eq!(
        resolve_backend(NsPrecision::F32, NsBackend::Auto).unwrap(),
        NsBackend::Gemm
    );
    assert_eq!(
        resolve_backend(NsPrecision::F32, NsBackend::OneDnn).is_ok(),
        onednn::onednn().is_ok()
    );
    let info = ns_backend_info();
    eprintln!("{info}");
    let bf16 = resolve_backend(NsPrecision::Bf16, NsBackend::Auto).unwrap();
    assert_eq!(info.bf16_backend, bf16);
    if let Err(e) = amx_bf16::amx() {
        assert!(
            resolve_backend(NsPrecision::Bf16, NsBackend::Amx).is_err(),
            "an explicit Amx without AMX must be Err ({e})"
        );
    } else {
        assert_eq!(bf16, NsBackend::Amx);
        assert!(info.bf16.contains("AMX"), "{info}");
        return;
    }
    match onednn::onednn().and_then(|d| d.bf16_impl()) {
        Ok(_) => {
            assert_eq!(bf16, NsBackend::OneDnn);
            assert!(info.bf16.contains("oneDNN"), "{info}");
        }
        Err(e) => {
            assert_eq!(bf16, NsBackend::Gemm);
            assert!(
                resolve_backend(NsPrecision::Bf16, NsBackend::OneDnn).is_err(),
                "an explicit OneDnn without the library must be Err ({e})"
            );
            assert!(info.bf16.contains("portable"), "{info}");
        }
    }
    assert!(info.f32.contains("gemm"), "{info}");
}

// ---------------------------------------------------------------------------------------------
// 3. Special inputs and schedules
// ---------------------------------------------------------------------------------------------

fn all_configs() -> Vec<NsConfig> {
    let mut v = vec![
        cfg(NsPrecision::F32, NsBackend::Reference),
        cfg(NsPrecision::F32, NsBackend::Gemm),
        cfg(NsPrecision::Bf16, NsBackend::Reference),
        cfg(NsPrecision::Bf16, NsBackend::Gemm),
    ];
    if onednn::onednn().is_ok() {
        v.push(cfg(NsPrecision::F32, NsBackend::OneDnn));
    }
    if onednn::onednn().and_then(|d| d.bf16_impl()).is_ok() {
        v.push(cfg(NsPrecision::Bf16, NsBackend::OneDnn));
    }
    if amx_bf16::amx().is_ok() {
        v.push(cfg(NsPrecision::Bf16, NsBackend::Amx));
    }
    v
}

#[test]
fn a_zero_matrix_stays_zero_on_every_backend() {
    for c in all_configs() {
        for (rows, cols) in [(6, 4), (4, 6), (1, 5), (300, 280)] {
            let y = run(&vec![0.0; rows * cols], rows, cols, &c);
            assert!(
                y.iter().all(|v| v.to_bits() == 0),
                "{rows}×{cols} {:?} {:?}",
                c.precision,
                c.backend
            );
        }
    }
}

#[test]
fn non_finite_input_gives_all_nan_and_ok() {
    for c in all_configs() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = vec![0.5f32; 5 * 7];
            x[11] = bad;
            orthogonalize(&mut x, 5, 7, &c).unwrap();
            assert!(
                x.iter().all(|v| v.is_nan()),
                "{bad} with {:?} {:?}",
                c.precision,
                c.backend
            );
        }
    }
}

#[test]
fn a_vector_is_normalized_then_mapped_by_the_scalar_polynomial() {
    // A 1×n (or n×1) matrix has one singular value, 1 after normalization; NS maps it by
    // σ ← aσ + bσ³ + cσ⁵ per step. Checked against that scalar recursion in f64.
    let mut rng = Rng::new(23);
    let x = rng.units(9);
    let norm = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
    let mut sigma = 1.0f64;
    let [a, b, c] = QUINTIC.map(f64::from);
    for _ in 0..5 {
        sigma = a * sigma + b * sigma.powi(3) + c * sigma.powi(5);
    }
    for c in all_configs() {
        let tol = if c.precision == NsPrecision::F32 {
            1e-5
        } else {
            2e-2
        };
        for (rows, cols) in [(1, 9), (9, 1)] {
            let y = run(&x, rows, cols, &c);
            for (i, (&yi, &xi)) in y.iter().zip(&x).enumerate() {
                let want = sigma * f64::from(xi) / norm;
                assert!(
                    (f64::from(yi) - want).abs() <= tol,
                    "{rows}×{cols} {:?} {:?} [{i}]: {yi} vs {want}",
                    c.precision,
                    c.backend
                );
            }
        }
    }
}

/// A finite matrix whose Frobenius norm overflows f32 (entries of ±1e37) is normalized in
/// f64: the result is the orthogonalization of the same direction at a sane scale, not NaN.
#[test]
fn a_finite_matrix_whose_norm_overflows_f32_is_orthogonalized() {
    let n = 64;
    let unit: Vec<f32> = (0..n * n)
        .map(|i| if (i * 7 + i / n) % 3 == 0 { -1.0 } else { 1.0 } * (1.0 + (i % 5) as f32 / 8.0))
        .collect();
    // f32: the scaled inputs of the two runs differ by an f32 rounding or two (the f32 path
    // rounds the norm and the divisor, the f64 path the quotient once), 5 steps amplify that
    // by at most the polynomial's slope: 1e-4. bf16 (every backend, 2^123 ≈ 1.1e37 so the
    // huge input rounds as the unit one does): that difference can move a scaled element
    // across a bf16 rounding boundary (2^-8 relative), amplified alike: 0.05, far from the
    // all-NaN result this guards against.
    for (c, tolerance) in all_configs()
        .into_iter()
        .map(|c| (c.precision == NsPrecision::Bf16, c))
        .map(|(bf16, c)| (c, if bf16 { 0.05 } else { 1e-4 }))
    {
        let mut want = unit.clone();
        orthogonalize(&mut want, n, n, &c).unwrap();
        let mut huge: Vec<f32> = unit.iter().map(|&x| x * 2f32.powi(123)).collect();
        orthogonalize(&mut huge, n, n, &c).unwrap();
        let worst = huge
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, |m, d| if d.is_nan() { f32::NAN } else { m.max(d) });
        assert!(
            worst <= tolerance,
            "{:?} {:?}: max difference {worst}",
            c.precision,
            c.backend
        );
    }
}

#[test]
fn bad_shapes_and_configs_are_errors_not_panics() {
    let mut x = vec![1.0f32; 10];
    assert!(orthogonalize(&mut x, 3, 4, &NsConfig::default()).is_err());
    assert!(orthogonalize_batch(&mut x, 3, 4, &NsConfig::default()).is_err());
    assert!(orthogonalize_batch(&mut x, 0, 4, &NsConfig::default()).is_err());
    let bad = NsConfig {
        norm_scale: 0.0,
        ..NsConfig::default()
    };
    assert!(orthogonalize(&mut x, 2, 5, &bad).is_err());
    let mut empty: Vec<f32> = Vec::new();
    orthogonalize(&mut empty, 0, 5, &NsConfig::default()).unwrap();
    orthogonalize_batch(&mut empty, 3, 4, &NsConfig::default()).unwrap();
    // 2^33 × 2^31 wraps to 0 in usize: still not the shape of an empty slice.
    let (rows, cols) = (1usize << 33, 1usize << 31);
    assert!(orthogonalize(&mut empty, rows, cols, &NsConfig::default()).is_err());
    assert!(orthogonalize_many(vec![(&mut empty[..], rows, cols)], &NsConfig::default()).is_err());
    assert_eq!(ns_working_bytes(rows, cols), usize::MAX);
    assert_eq!(x, vec![1.0f32; 10], "errors leave the input unchanged");
}

/// A schedule that sends a singular value of the normalized input past `MAX_SINGULAR_VALUE`
/// is refused before anything runs: a sign typo in the quintic, a huge coefficient, or a
/// `norm_scale` that leaves singular values above 1 (a rank-1 matrix's is `1/norm_scale`).
/// These diverged to an all-NaN or infinite update. The published schedules pass, repeated
/// over the most steps accepted, and so does a `norm_scale` just above each one's limit.
#[test]
fn schedules_that_let_singular_values_grow_are_refused() {
    let cfg = |coeffs: Vec<[f32; 3]>, norm_scale: f32| NsConfig {
        coeffs,
        norm_scale,
        ..NsConfig::default()
    };
    let mut x = vec![1.0f32; 6]; // rank 1: its singular value after step 2 is 1/norm_scale
    for bad in [
        cfg(vec![[3.4445, 4.7750, 2.0315]], 1.0),
        cfg(vec![[1e30, 0.0, 0.0]], 1.0),
        cfg(vec![QUINTIC], 1e-30),
        cfg(vec![QUINTIC], 0.5),
        cfg(POLAR_EXPRESS.to_vec(), 0.9),
        cfg(vec![[1.1, 0.0, 0.0]], 1.0), // grows 10 % a step: past 4 by step 15
    ] {
        let bad = NsConfig { steps: 20, ..bad };
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("does not orthogonalize"), "{bad:?}: {err}");
        assert!(orthogonalize(&mut x, 2, 3, &bad).is_err());
    }
    assert_eq!(x, vec![1.0f32; 6], "refused before anything runs");
    for good in [
        NsConfig::default(),
        NsConfig::dion_quintic(),
        NsConfig::polar_express(),
        cfg(vec![QUINTIC], 0.8),
        cfg(POLAR_EXPRESS.to_vec(), 0.98),
        cfg(vec![[1.0, 0.0, 0.0]], 1.0),
        cfg(vec![[0.0, 0.0, 0.0]], 1e30),
    ] {
        let good = NsConfig { steps: 99, ..good };
        good.validate().unwrap_or_else(|e| panic!("{good:?}: {e}"));
    }
}

#[test]
fn named_schedules_are_the_published_values() {
    assert_eq!(NsConfig::default().coeffs, vec![QUINTIC]);
    let d = NsConfig::dion_quintic();
    assert_eq!((d.coeffs.len(), d.steps, d.norm_scale), (5, 5, 1.0));
    assert_eq!(d.coeffs[0], DION_QUINTIC[0]);
    let p = NsConfig::polar_express();
    assert_eq!(p.coeffs, POLAR_EXPRESS.to_vec());
    assert_eq!(p.norm_scale, POLAR_EXPRESS_NORM_SCALE);
    assert_eq!(p.norm_scale, 1.02);
    assert!((f64::from(POLAR_EXPRESS[0][0]) - 8.156554524902461).abs() < 1e-6);
    p.validate().unwrap();
    d.validate().unwrap();
    // Polar Express lands closer to 1 than the quintic's [0.7, 1.2]: observed [0.86, 1.12] on
    // this 40×72 matrix; checked against [0.8, 1.15].
    let mut rng = Rng::new(29);
    let x = rng.units(40 * 72);
    let y = run(&x, 40, 72, &p);
    let (lo, hi) = singular_range(&y, 40, 72);
    assert!(
        lo > 0.8 && hi < 1.15,
        "Polar Express: singular values in [{lo}, {hi}]"
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Throughput (not a test of speed; run with --ignored --nocapture in release)
// ---------------------------------------------------------------------------------------------

/// GFLOP/s of NS (nominal `steps·(4·s²·l + 2·s³)` flops) and of plain GEMMs, in the same run:
/// the kernels are measured in interleaved rounds and each keeps its best time, so load from
/// other processes on a shared host hits them alike.
#[test]
#[ignore = "benchmark: cargo test -p ragged-optimizers --test ns_kernel_tests -- --ignored --nocapture ns_throughput (the test profile is opt-level 3)"]
fn ns_throughput() {
    use half::bf16;
    use ragged_optimizers::kernels::{gemm_f32, Parallelism};
    use std::time::Instant;
    eprintln!("{}", ns_backend_info());
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    let mut rng = Rng::new(1);
    let dnn = onednn::onednn().ok();
    let dnn_bf16 = dnn.filter(|d| d.bf16_impl().is_ok());
    for n in [1024usize, 2048] {
        let rounds = if n <= 1024 { 5 } else { 3 };
        let x = rng.units(n * n);
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let mm = 2.0 * (n as f64).powi(3);
        let ns = 5.0 * 6.0 * (n as f64).powi(3);
        let par = Parallelism::Rayon(rayon::current_num_threads());
        let mut out = vec![0.0f32; n * n];
        let mut outb = vec![bf16::from_f32(0.0); n * n];
        let ns_run = |c: &NsConfig| {
            let mut y = x.clone();
            orthogonalize(&mut y, n, n, c).unwrap();
        };
        // (name, flops, best seconds)
        let mut rows: Vec<(String, f64, f64)> = Vec::new();
        let mut record =
            |name: &str, flops: f64, t: f64| match rows.iter_mut().find(|r| r.0 == name) {
                Some(r) => r.2 = r.2.min(t),
                None => rows.push((name.to_string(), flops, t)),
            };
        for round in 0..=rounds {
            // Round 0 warms up (primitive creation, page faults) and is not recorded.
            let mut rec = |name: &str, flops: f64, t: f64| {
                if round > 0 {
                    record(name, flops, t)
                }
            };
            let t = time(&mut || gemm_f32::matmul(n, n, n, &x, &x, &mut out, false, 0.0, 1.0, par));
            rec("matmul f32 (gemm)", mm, t);
            let t = time(&mut || ns_run(&cfg(NsPrecision::F32, NsBackend::Gemm)));
            rec("NS f32 (gemm)", ns, t);
            if let Some(d) = dnn {
                let t = time(&mut || {
                    d.matmul(n, n, n, &x, &x, false, &mut out, 1.0, None)
                        .unwrap();
                });
                rec("matmul f32 (oneDNN)", mm, t);
                let t = time(&mut || ns_run(&cfg(NsPrecision::F32, NsBackend::OneDnn)));
                rec("NS f32 (oneDNN)", ns, t);
            }
            if let Some(d) = dnn_bf16 {
                let t = time(&mut || {
                    d.matmul(n, n, n, &xb, &xb, false, &mut outb, 1.0, None)
                        .unwrap();
                });
                rec("matmul bf16 (oneDNN)", mm, t);
                let t = time(&mut || ns_run(&cfg(NsPrecision::Bf16, NsBackend::OneDnn)));
                rec("NS bf16 (oneDNN)", ns, t);
            }
            if round <= 1 {
                let t = time(&mut || ns_run(&cfg(NsPrecision::Bf16, NsBackend::Gemm)));
                rec("NS bf16 (portable)", ns, t);
            }
        }
        let gf = |name: &str| rows.iter().find(|r| r.0 == name).map(|r| r.1 / r.2 / 1e9);
        for (name, flops, t) in &rows {
            eprintln!("n={n}: {name:22} {:7.1} GFLOP/s", flops / t / 1e9);
        }
        let ratio = |a: &str, b: &str| match (gf(a), gf(b)) {
            (Some(a), Some(b)) => format!("{:.0} %", 100.0 * a / b),
            _ => "n/a".into(),
        };
        eprintln!(
            "n={n}: NS f32 (gemm) / matmul f32 (gemm) = {}; NS bf16 (oneDNN) / matmul bf16 \
             (oneDNN) = {}",
            ratio("NS f32 (gemm)", "matmul f32 (gemm)"),
            ratio("NS bf16 (oneDNN)", "matmul bf16 (oneDNN)")
        );
    }
}
