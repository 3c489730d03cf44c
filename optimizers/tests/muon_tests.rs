//! Muon: Newton–Schulz against an f64 reference and its singular-value band, sharded ≡
//! unsharded bitwise over world sizes and uneven shapes (thread-rank communicators), partial
//! matrices refused, state round trips, config validation.

use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;
use ragged::comm::threads::ThreadWorld;
use ragged::comm::{Buf, BufMut, Communicator, ReduceOp, SingleRank};
use ragged::model::{DType, TensorSpec, Unit};
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::PlanOptions;
use ragged::{AtomicBlock, Error, RoleRule, RoleSettings};
use ragged_optimizers::common::lerp_elem;
use ragged_optimizers::muon::MatrixStep;
use ragged_optimizers::newton_schulz::ns_macs;
use ragged_optimizers::{
    orthogonalize, AdamWConfig, LrScale, MatrixLayout, Muon, MuonConfig, MuonState, NsBackend,
    NsConfig, NsMethod, NsPrecision, TensorChoice, QUINTIC,
};

mod harness;
use harness::{
    bits, data, default_ns_method, fsdp2_shards, gather, ns_f64, numels, padding,
    planned_shards_by, scatter, singular_range, specs, whole_shard_by, Rng,
};

/// The unsharded reference shard, with Muon's blocks.
fn whole_shard(opt: &Muon, specs: &[TensorSpec]) -> LocalShard {
    whole_shard_by(specs, &|t| opt.atomic_block(&t.name, &t.shape))
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// One rank's run: `steps` Muon steps; garbage in the gradient's padding; asserts padding
/// stays `+0.0` in params and `m` (`v` holds no padding). Returns (params, state).
fn run_rank(
    opt: &Muon,
    shard: &LocalShard,
    p0: &[Vec<f32>],
    grads: &[Vec<Vec<f32>>],
    comm: &dyn Communicator,
) -> (Vec<f32>, MuonState) {
    let mut params = scatter(shard, p0);
    let mut state = opt.init(shard).unwrap();
    for g in grads {
        let mut local_g = scatter(shard, g);
        for i in padding(shard) {
            local_g[i] = 1.0;
        }
        opt.step_slices(&mut state, shard, &mut params, &local_g, comm)
            .unwrap();
        for i in padding(shard) {
            assert!(
                params[i].to_bits() == 0 && state.m.cpu().unwrap()[i].to_bits() == 0,
                "rank {}/{}: padding at {i} changed",
                shard.rank,
                shard.world
            );
        }
    }
    (params, state)
}

/// `v` (the second moments of the pieces that are not Muon matrices, in shard order) at
/// those pieces' places in the shard, zero elsewhere: an array that gathers like the
/// parameters. Asserts `v` holds exactly those pieces.
fn v_like_shard(opt: &Muon, shard: &LocalShard, v: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; shard.len];
    let mut at = 0;
    for piece in &shard.pieces {
        let meta = &shard.params[piece.param];
        if !opt.uses_muon(&meta.name, &meta.shape) {
            let n = piece.range.len();
            out[piece.offset..piece.offset + n].copy_from_slice(&v[at..at + n]);
            at += n;
        }
    }
    assert_eq!(at, v.len(), "v holds the fallback pieces and nothing else");
    assert_eq!(at, opt.fallback_len(shard));
    out
}

/// Every rank on its own thread with a `ThreadWorld` communicator; global (params, m, v).
fn run_world(
    opt: &Muon,
    shards: &[LocalShard],
    numels: &[usize],
    p0: &[Vec<f32>],
    grads: &[Vec<Vec<f32>>],
) -> [Vec<Vec<f32>>; 3] {
    let results: Vec<(Vec<f32>, MuonState)> = ThreadWorld::run(shards.len(), |comm| {
        Ok(run_rank(opt, &shards[comm.rank()], p0, grads, comm))
    })
    .unwrap();
    let ps: Vec<Vec<f32>> = results.iter().map(|r| r.0.clone()).collect();
    let ms: Vec<Vec<f32>> = results.iter().map(|r| r.1.m.to_vec().unwrap()).collect();
    let vs: Vec<Vec<f32>> = results
        .iter()
        .zip(shards)
        .map(|(r, shard)| v_like_shard(opt, shard, &r.1.v.to_vec().unwrap()))
        .collect();
    [
        gather(shards, &ps, numels),
        gather(shards, &ms, numels),
        gather(shards, &vs, numels),
    ]
}

/// Hyperparameters under which every term is visible.
fn loud() -> MuonConfig {
    MuonConfig {
        lr: 0.05,
        weight_decay: 0.3,
        momentum: 0.9,
        nesterov: false,
        lr_scale: LrScale::MatchRmsAdamW,
        adamw: AdamWConfig {
            lr: 0.01,
            weight_decay: 0.1,
            ..AdamWConfig::default()
        },
        ..MuonConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Newton–Schulz
// ---------------------------------------------------------------------------------------------

/// NS of f32 vs f64 reference. Each f32 product carries a relative error of about
/// `k·2⁻²⁴` (`k ≤ 80`, ≈ 5e-6) and each NS step can amplify an error by at most about
/// `a = 3.4445` (the polynomial's slope at 0), so after 5 steps the bound is roughly
/// `5e-6 · 3.4445⁵ ≈ 2.5e-3` of the entry scale. Observed (seed 7): at most 8.5e-7 with the
/// quintic triple, 5.7e-7 with dion's five-triple schedule (a made-up schedule of dion's first
/// two triples then the quintic, which `NsConfig::validate` now refuses, reached 6.4e-5: it
/// amplified errors as it amplified singular values). The tolerance, `5e-4` absolute on
/// entries of size `~1/√short side`, stays under the bound and still fails for any real bug (a
/// wrong coefficient or a missing transpose changes entries by `> 1e-2`).
const NS_ATOL: f64 = 5e-4;

#[test]
fn newton_schulz_matches_an_f64_reference_within_f32_rounding() {
    let mut rng = Rng::new(7);
    // dion's five triples. (Its first two followed by the quintic, tested here before, can
    // send a singular value of 0.86 to 6: `NsConfig::validate` refuses that schedule.)
    let schedule = NsConfig::dion_quintic();
    for cfg in [NsConfig::default(), schedule] {
        for (rows, cols) in [
            (48, 80),
            (80, 48),
            (16, 24),
            (7, 5),
            (5, 7),
            (1, 9),
            (9, 1),
            (6, 6),
        ] {
            let x = rng.units(rows * cols);
            let want = ns_f64(&x, rows, cols, &cfg);
            let mut got = x.clone();
            orthogonalize(&mut got, rows, cols, &cfg).unwrap();
            let err = got
                .iter()
                .zip(&want)
                .map(|(&g, w)| (f64::from(g) - w).abs())
                .fold(0.0, f64::max);
            assert!(err < NS_ATOL, "{rows}×{cols}, {cfg:?}: max error {err}");
        }
    }
}

#[test]
fn newton_schulz_schedule_uses_one_triple_per_step_and_repeats_the_last() {
    let mut rng = Rng::new(3);
    let x = rng.units(12 * 20);
    let run = |cfg: &NsConfig| {
        let mut y = x.clone();
        orthogonalize(&mut y, 12, 20, cfg).unwrap();
        bits(&y)
    };
    let fixed = run(&NsConfig::default());
    let repeated = run(&NsConfig {
        coeffs: vec![QUINTIC; 2],
        ..NsConfig::default()
    });
    assert_eq!(
        fixed, repeated,
        "a schedule of equal triples is the fixed triple"
    );
    let other = run(&NsConfig {
        coeffs: vec![QUINTIC, QUINTIC, QUINTIC, QUINTIC, [3.0, -3.2, 1.2]],
        ..NsConfig::default()
    });
    assert_ne!(fixed, other, "the fifth triple must be used");
}

#[test]
fn newton_schulz_singular_values_land_in_the_quintic_band() {
    // Rectangular inputs only: a random square matrix has singular values near 0 (relative to
    // its norm) that 5 quintic steps cannot lift into the band (32×32 gives σ_min ≈ 0.19);
    // that is NS's known behaviour, not a bug. Random m×n with m/n ≤ 0.7 keeps σ_min well away
    // from 0.
    let mut rng = Rng::new(11);
    for (rows, cols) in [(48, 80), (80, 48), (16, 24)] {
        let mut x = rng.units(rows * cols);
        orthogonalize(&mut x, rows, cols, &NsConfig::default()).unwrap();
        let (lo, hi) = singular_range(&x, rows, cols);
        assert!(
            (0.6..=1.25).contains(&lo) && (0.6..=1.25).contains(&hi),
            "{rows}×{cols}: singular values in [{lo}, {hi}], want within [0.6, 1.25]"
        );
    }
}

#[test]
fn newton_schulz_leaves_a_zero_matrix_zero() {
    let mut x = vec![0.0f32; 6 * 4];
    orthogonalize(&mut x, 6, 4, &NsConfig::default()).unwrap();
    assert!(x.iter().all(|v| v.to_bits() == 0));
}

// ---------------------------------------------------------------------------------------------
// 2. The Muon step
// ---------------------------------------------------------------------------------------------

#[test]
fn atomic_block_is_matrix_for_muon_params_and_element_for_the_fallback() {
    let opt = Muon::new(MuonConfig::default()).unwrap();
    assert_eq!(opt.atomic_block("w", &[48, 80]), AtomicBlock::Matrix);
    assert_eq!(
        opt.atomic_block("experts", &[3, 16, 24]),
        AtomicBlock::Matrix
    );
    assert_eq!(opt.atomic_block("bias", &[31]), AtomicBlock::Element);
    assert_eq!(opt.atomic_block("scalar", &[]), AtomicBlock::Element);
    assert_eq!(
        opt.atomic_block("tok_embed", &[100, 16]),
        AtomicBlock::Element
    );
    assert_eq!(
        opt.atomic_block("lm_head", &[16, 100]),
        AtomicBlock::Element
    );
}

#[test]
fn muon_step_follows_torch_operation_order() {
    // Hand-written torch order on one 2-D matrix, default (Nesterov, `original` scale), with
    // f32 and bf16 Newton–Schulz (bf16 on an AMX CPU: the step keeps `U` in bf16, this
    // order keeps it in f32 and `orthogonalize` rounds it).
    for precision in [NsPrecision::F32, NsPrecision::Bf16] {
        let c = MuonConfig {
            lr: 0.02,
            ns: NsConfig {
                precision,
                ..NsConfig::default()
            },
            ..MuonConfig::default()
        };
        torch_order_on_one_matrix(&c);
    }
}

fn torch_order_on_one_matrix(c: &MuonConfig) {
    let opt = Muon::new(c.clone()).unwrap();
    let (rows, cols) = (20, 12);
    let spec = specs(&[("w", &[rows, cols])]);
    let shard = whole_shard(&opt, &spec);
    let mut rng = Rng::new(5);
    let mut p = rng.units(rows * cols);
    let mut want_p = p.clone();
    let mut buf = vec![0.0f32; rows * cols];
    let mut state = opt.init(&shard).unwrap();
    for _ in 0..3 {
        let g = rng.units(rows * cols);
        opt.step_slices(&mut state, &shard, &mut p, &g, &SingleRank)
            .unwrap();
        for (b, &g) in buf.iter_mut().zip(&g) {
            *b = lerp_elem(*b, g, (1.0 - c.momentum) as f32);
        }
        let mut u: Vec<f32> = g
            .iter()
            .zip(&buf)
            .map(|(&g, &b)| lerp_elem(g, b, c.momentum as f32))
            .collect();
        orthogonalize(&mut u, rows, cols, &c.ns).unwrap();
        let decay = (1.0 - c.lr * c.weight_decay) as f32;
        let neg_lr = (-(c.lr * (rows as f64 / cols as f64).sqrt())) as f32;
        for (p, &o) in want_p.iter_mut().zip(&u) {
            *p = *p * decay + neg_lr * o;
        }
        assert_eq!(bits(&p), bits(&want_p), "{:?}", c.ns.precision);
        assert_eq!(bits(state.m.cpu().unwrap()), bits(&buf));
    }
}

/// The Muon step of the module table in f64 (momentum, Nesterov or not, NS in f64, decoupled
/// decay with the unadjusted lr, `original`, `match_rms_adamw` or `spectral_unclamped`
/// scale), for one matrix.
fn muon_f64(c: &MuonConfig, p: &mut [f64], buf: &mut [f64], g: &[f32], rows: usize, cols: usize) {
    let mu = c.momentum;
    for (b, &g) in buf.iter_mut().zip(g) {
        *b += (1.0 - mu) * (f64::from(g) - *b);
    }
    let u: Vec<f32> = g
        .iter()
        .zip(buf.iter())
        .map(|(&g, &b)| if c.nesterov { (1.0 - mu) * f64::from(g) + mu * b } else { b } as f32)
        .collect();
    let o = ns_f64(&u, rows, cols, &c.ns);
    let (a, b) = (rows as f64, cols as f64);
    let scale = match c.lr_scale {
        LrScale::Original => (a / b).max(1.0).sqrt(),
        LrScale::MatchRmsAdamW => 0.2 * a.max(b).sqrt(),
        LrScale::SpectralUnclamped => (a / b).sqrt(),
    };
    for (p, o) in p.iter_mut().zip(o) {
        *p = *p * (1.0 - c.lr * c.weight_decay) - c.lr * scale * o;
    }
}

#[test]
fn muon_step_matches_an_f64_reference_for_every_scale_rule() {
    for (scale, nesterov) in [
        (LrScale::Original, true),
        (LrScale::MatchRmsAdamW, true),
        (LrScale::MatchRmsAdamW, false),
        (LrScale::SpectralUnclamped, true),
    ] {
        let c = MuonConfig {
            lr: 0.02,
            weight_decay: 0.2,
            nesterov,
            lr_scale: scale,
            ..MuonConfig::default()
        };
        let opt = Muon::new(c.clone()).unwrap();
        for (rows, cols) in [(20, 12), (12, 20)] {
            let shard = whole_shard(&opt, &specs(&[("w", &[rows, cols])]));
            let mut rng = Rng::new(31);
            let mut p = rng.units(rows * cols);
            let p0 = p.clone();
            let mut want: Vec<f64> = p.iter().map(|&v| f64::from(v)).collect();
            let mut buf = vec![0.0f64; rows * cols];
            let mut state = opt.init(&shard).unwrap();
            for step in 0..3 {
                let g = rng.units(rows * cols);
                opt.step_slices(&mut state, &shard, &mut p, &g, &SingleRank)
                    .unwrap();
                muon_f64(&c, &mut want, &mut buf, &g, rows, cols);
                // Per step the f32 update differs from f64 by the NS error (NS_ATOL) times
                // lr·scale, plus f32 rounding of p (≈ 6e-8 per step); errors add over steps.
                let tol = (step + 1) as f64 * (c.lr * scale.factor(rows, cols) * NS_ATOL + 1e-7);
                let err = p
                    .iter()
                    .zip(&want)
                    .map(|(&p, w)| (f64::from(p) - w).abs())
                    .fold(0.0, f64::max);
                assert!(
                    err <= tol,
                    "{scale:?} {rows}×{cols} step {step}: {err:e} > {tol:e}"
                );
                // The update is visible at this tolerance (so a wrong scale rule fails).
                let moved = p
                    .iter()
                    .zip(&p0)
                    .map(|(&p, &q)| (p - q).abs())
                    .fold(0.0f32, f32::max);
                assert!(f64::from(moved) > 100.0 * tol);
            }
        }
    }
}

#[test]
fn each_expert_matrix_steps_like_an_independent_2d_param() {
    let opt = Muon::new(loud()).unwrap();
    let (e, rows, cols) = (3, 16, 24);
    let mut rng = Rng::new(8);
    let p0 = rng.units(e * rows * cols);
    let g = rng.units(e * rows * cols);
    let shard = whole_shard(&opt, &specs(&[("experts", &[e, rows, cols])]));
    let mut p = p0.clone();
    let mut state = opt.init(&shard).unwrap();
    opt.step_slices(&mut state, &shard, &mut p, &g, &SingleRank)
        .unwrap();
    let one = whole_shard(&opt, &specs(&[("w", &[rows, cols])]));
    let mn = rows * cols;
    for k in 0..e {
        let mut pk = p0[k * mn..(k + 1) * mn].to_vec();
        let mut sk = opt.init(&one).unwrap();
        opt.step_slices(
            &mut sk,
            &one,
            &mut pk,
            &g[k * mn..(k + 1) * mn],
            &SingleRank,
        )
        .unwrap();
        assert_eq!(bits(&pk), bits(&p[k * mn..(k + 1) * mn]), "expert {k}");
    }
}

/// A conv filter `[out, in, kh, kw]` is one matrix `[out, in·kh·kw]`, as Keller Jordan's Muon
/// flattens it (`torch.optim.Muon` refuses it): it steps bitwise as that 2-D parameter (scale
/// rule included), as one `Whole` block. `flatten_min_dims` moves the line: 3 flattens every
/// 3-D parameter (experts with conv1d weights), `usize::MAX` steps the filter per `kh × kw`
/// kernel, as the 3-D `[out·in, kh, kw]`; below 2 is refused. A 3-D parameter whose name
/// matches `flatten_patterns` (default `conv`) is flattened whatever the dimension count: a
/// conv1d weight, not an expert.
#[test]
fn a_conv_filter_steps_as_one_flattened_matrix() {
    let (out, inp, kh, kw) = (8, 3, 3, 3);
    let n = out * inp * kh * kw;
    let mut rng = Rng::new(9);
    let (p0, g) = (rng.units(n), rng.units(n));
    let step = |c: MuonConfig, name: &str, shape: &[usize]| {
        let opt = Muon::new(c).unwrap();
        let shard = whole_shard(&opt, &specs(&[(name, shape)]));
        let (mut p, mut state) = (p0.clone(), opt.init(&shard).unwrap());
        opt.step_slices(&mut state, &shard, &mut p, &g, &SingleRank)
            .unwrap();
        bits(&p)
    };
    let dims = |flatten_min_dims| MuonConfig {
        flatten_min_dims,
        ..loud()
    };
    let conv = step(dims(4), "conv.weight", &[out, inp, kh, kw]);
    assert_eq!(conv, step(dims(4), "w", &[out, inp * kh * kw]), "flattened");
    let per_kernel = step(dims(usize::MAX), "w", &[out, inp, kh, kw]);
    assert_eq!(
        per_kernel,
        step(dims(4), "w", &[out * inp, kh, kw]),
        "per kernel"
    );
    assert_ne!(conv, per_kernel);
    // A 3-D parameter: batched (as experts) by default, flattened from 3 dimensions or by name.
    let three_d = [out, inp * kh, kw];
    let flat = step(dims(4), "w", &[out, inp * kh * kw]);
    let batched = step(dims(4), "experts.w", &three_d);
    assert_ne!(batched, flat);
    assert_eq!(step(dims(3), "experts.w", &three_d), flat);
    assert_eq!(step(dims(4), "encoder.conv1.weight", &three_d), flat);
    let no_patterns = MuonConfig {
        flatten_patterns: &[],
        ..loud()
    };
    assert_eq!(step(no_patterns, "encoder.conv1.weight", &three_d), batched);
    let (opt, c) = (Muon::new(loud()).unwrap(), loud());
    assert_eq!(
        opt.atomic_block("c", &[out, inp, kh, kw]),
        AtomicBlock::Whole
    );
    assert_eq!(opt.atomic_block("experts.w", &three_d), AtomicBlock::Matrix);
    assert_eq!(
        opt.atomic_block("mixer.conv1d.weight", &three_d),
        AtomicBlock::Whole
    );
    // A matrix is its own matrix whatever the rule.
    assert_eq!(
        opt.atomic_block("conv.proj", &[out, kw]),
        AtomicBlock::Matrix
    );
    assert_eq!(
        c.matrices_of("c", &[out, inp, kh, kw]).unwrap(),
        (1, out, 27)
    );
    assert_eq!(c.matrices_of("experts.w", &three_d).unwrap(), (out, 9, 3));
    assert_eq!(c.matrices_of("conv1d", &three_d).unwrap(), (1, out, 27));
    for vector in [&[5][..], &[]] {
        let err = c.matrices_of("bias", vector).unwrap_err().to_string();
        assert!(err.contains("bias has no matrix"), "{err}");
    }
    for bad in [0, 1] {
        let c = MuonConfig {
            flatten_min_dims: bad,
            ..MuonConfig::default()
        };
        let err = Muon::new(c).unwrap_err().to_string();
        assert!(
            err.contains("flatten_min_dims") && err.contains("at least 2"),
            "{err}"
        );
    }
}

#[test]
fn lr_scale_rules_match_torch() {
    assert_eq!(LrScale::Original.factor(80, 48), (80.0f64 / 48.0).sqrt());
    assert_eq!(LrScale::Original.factor(48, 80), 1.0);
    assert_eq!(LrScale::MatchRmsAdamW.factor(48, 80), 0.2 * 80.0f64.sqrt());
    // torch's `math.sqrt(A / B)`, below 1 for a wide matrix.
    assert_eq!(
        LrScale::SpectralUnclamped.factor(48, 80),
        (48.0f64 / 80.0).sqrt()
    );
    assert_eq!(
        LrScale::SpectralUnclamped.factor(80, 48),
        (80.0f64 / 48.0).sqrt()
    );
    // MatrixStep is public; its zero-lr, no-decay form leaves parameters unchanged.
    let ns = NsConfig::default();
    let s = MatrixStep {
        rows: 2,
        cols: 3,
        momentum: 0.95,
        nesterov: true,
        decay: None,
        neg_lr: 0.0,
        ns: &ns,
    };
    let mut p = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let mut m = [0.0f32; 6];
    s.apply(&mut p, &[1.0; 6], &mut m).unwrap();
    assert_eq!(p, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
}

// ---------------------------------------------------------------------------------------------
// 3. Sharded ≡ unsharded
// ---------------------------------------------------------------------------------------------

// "wide" (48×160) takes Gram Newton–Schulz under `NsMethod::Auto` (0.71× the multiply-adds),
// "tall" (80×48) the standard iteration: both methods go through every layout below
// (`sharded_muon_step_takes_both_newton_schulz_methods` checks which runs).
const TENSORS: [(&str, &[usize]); 9] = [
    ("wide", &[48, 160]),
    ("tall", &[80, 48]),
    ("experts", &[3, 16, 24]),
    ("conv", &[6, 3, 3, 3]),       // one flattened 6 × 27 matrix
    ("conv1d.weight", &[5, 2, 7]), // named a conv: one flattened 5 × 14 matrix
    ("small", &[7, 5]),
    ("bias", &[31]),
    ("tok_embed", &[10, 6]),
    ("gain", &[1]),
];
const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];

/// The layouts a sharded Muon must handle: the planner with Muon's own blocks (whole
/// matrices), the planner with row and element blocks (matrices split over ranks: the
/// gather-to-root path), and FSDP2's even `Shard(0)`.
#[derive(Clone, Copy, Debug)]
enum Layout {
    Whole,
    Rows,
    Elements,
    Fsdp2,
}

fn layout_shards(
    opt: &Muon,
    spec: &[TensorSpec],
    world: usize,
    layout: Layout,
    opts: &PlanOptions,
) -> Vec<LocalShard> {
    let split = |to: AtomicBlock| {
        move |t: &TensorSpec| match opt.atomic_block(&t.name, &t.shape) {
            AtomicBlock::Matrix | AtomicBlock::Whole => to,
            b => b,
        }
    };
    let own = |t: &TensorSpec| opt.atomic_block(&t.name, &t.shape);
    match layout {
        Layout::Whole => planned_shards_by(spec, world, &own, opts),
        Layout::Rows => planned_shards_by(spec, world, &split(AtomicBlock::Rows(1)), opts),
        Layout::Elements => planned_shards_by(spec, world, &split(AtomicBlock::Element), opts),
        Layout::Fsdp2 => fsdp2_shards(spec, world),
    }
}

#[test]
fn sharded_muon_step_takes_both_newton_schulz_methods() {
    let method = |shape: &[usize]| default_ns_method(shape[0], shape[1]);
    assert_eq!(method(TENSORS[0].1), NsMethod::Gram, "{:?}", TENSORS[0]);
    assert_eq!(method(TENSORS[1].1), NsMethod::Standard, "{:?}", TENSORS[1]);
}

#[test]
fn sharded_muon_step_is_bitwise_equal_to_unsharded() {
    let spec = specs(&TENSORS);
    let n = numels(&spec);
    let (p0, grads) = data(&spec, 3, 42);
    // bf16 Newton–Schulz too: its roundings depend on the input bits only, so it is as
    // bitwise as f32 across layouts and worlds.
    let bf16 = MuonConfig {
        ns: NsConfig {
            precision: NsPrecision::Bf16,
            ..NsConfig::default()
        },
        ..MuonConfig::default()
    };
    // bf16 on the gemm backend too: an `f32` `U` whose split matrices travel in bf16 (on an
    // AMX CPU the default bf16 backend keeps `U` itself in bf16).
    let bf16_gemm = MuonConfig {
        ns: NsConfig {
            backend: NsBackend::Gemm,
            ..bf16.ns.clone()
        },
        ..bf16.clone()
    };
    for (ci, c) in [MuonConfig::default(), loud(), bf16, bf16_gemm]
        .into_iter()
        .enumerate()
    {
        // One `Muon` for every run, its ranks stepping it at once: the `U` it keeps between
        // steps goes from the whole shard to each smaller one with what the last step left in
        // it, and from rank to rank, so this also checks that none of it is ever read.
        let opt = Muon::new(c).unwrap();
        let want = run_world(&opt, &[whole_shard(&opt, &spec)], &n, &p0, &grads);
        let layouts = [Layout::Whole, Layout::Rows, Layout::Elements, Layout::Fsdp2];
        for (layout, coll_align) in layouts.into_iter().flat_map(|l| [(l, 1), (l, 64)]) {
            let opts = PlanOptions {
                coll_align,
                ..PlanOptions::default()
            };
            for world in WORLDS {
                let shards = layout_shards(&opt, &spec, world, layout, &opts);
                let got = run_world(&opt, &shards, &n, &p0, &grads);
                for (role, (g, w)) in ["params", "m", "v"].iter().zip(got.iter().zip(&want)) {
                    for (i, (g, w)) in g.iter().zip(w).enumerate() {
                        assert_eq!(
                            bits(g),
                            bits(w),
                            "config {ci}, {layout:?}, world {world}, coll_align {coll_align}: \
                             {role} of {}",
                            TENSORS[i].0
                        );
                    }
                }
            }
        }
        // The run moved every parameter, so the comparison is not vacuous.
        for (i, (p, q)) in want[0].iter().zip(&p0).enumerate() {
            assert_ne!(bits(p), bits(q), "config {ci}: {} unchanged", TENSORS[i].0);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Split matrices: roots and routes
// ---------------------------------------------------------------------------------------------

/// A communicator that forwards to a real one and counts all-to-alls and the elements and
/// bytes each rank sends through them.
struct Counting<'a> {
    inner: &'a dyn Communicator,
    calls: AtomicUsize,
    sent: AtomicUsize,
    sent_bytes: AtomicUsize,
}

impl Communicator for Counting<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather_in_place(&self, buf: BufMut<'_>) -> ragged::Result<()> {
        self.inner.all_gather_in_place(buf)
    }
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> ragged::Result<()> {
        self.inner.all_gather(send, recv)
    }
    fn reduce_scatter_in_place(&self, buf: BufMut<'_>, op: ReduceOp) -> ragged::Result<()> {
        self.inner.reduce_scatter_in_place(buf, op)
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> ragged::Result<()> {
        self.inner.all_reduce(buf, op)
    }
    fn all_to_all_v(
        &self,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> ragged::Result<()> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let me = self.rank();
        let away: usize = (0..send_counts.len())
            .filter(|&j| j != me)
            .map(|j| send_counts[j])
            .sum();
        self.sent.fetch_add(away, Ordering::Relaxed);
        self.sent_bytes
            .fetch_add(send.elem_type().size() * away, Ordering::Relaxed);
        self.inner
            .all_to_all_v(send, send_counts, recv, recv_counts)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> ragged::Result<()> {
        self.inner.broadcast(buf, root)
    }
    fn barrier(&self) -> ragged::Result<()> {
        self.inner.barrier()
    }
}

/// ... in `f32`, and in bf16 when Newton–Schulz runs in bf16 (half the bytes).
#[test]
fn split_matrices_travel_in_one_all_to_all_each_way_to_a_holding_root() {
    let bf16 = MuonConfig {
        ns: NsConfig {
            precision: NsPrecision::Bf16,
            ..NsConfig::default()
        },
        ..MuonConfig::default()
    };
    for (config, elem_bytes) in [(MuonConfig::default(), 4), (bf16, 2)] {
        travel_to_holding_roots(&Muon::new(config).unwrap(), elem_bytes);
    }
}

fn travel_to_holding_roots(opt: &Muon, elem_bytes: usize) {
    let spec = specs(&TENSORS);
    let (p0, grads) = data(&spec, 1, 17);
    let muon_elems: usize = spec
        .iter()
        .filter(|t| opt.uses_muon(&t.name, &t.shape))
        .map(TensorSpec::numel)
        .sum();
    let opts = PlanOptions {
        coll_align: 1,
        ..PlanOptions::default()
    };
    for layout in [Layout::Rows, Layout::Fsdp2] {
        for world in [2, 3, 4, 8] {
            let shards = layout_shards(opt, &spec, world, layout, &opts);
            let roots = opt.roots(&shards[0]);
            assert!(roots.has_split(), "{layout:?} world {world}: nothing split");
            // Every rank derives the same roots; each root holds part of its matrix.
            for shard in &shards[1..] {
                assert_eq!(opt.roots(shard), roots);
            }
            for job in roots.jobs.iter().filter(|j| j.split) {
                let holds = shards[0].params[job.param]
                    .holders_of(job.elems.clone())
                    .any(|h| h.rank == job.root);
                assert!(
                    holds,
                    "{layout:?} world {world}: root {} holds none",
                    job.root
                );
            }
            // Each matrix weighs its Newton–Schulz multiply-adds (by the method it runs) plus
            // its elements.
            for job in &roots.jobs {
                let macs = ns_macs(job.rows, job.cols, &opt.config().ns);
                assert_eq!(u128::from(job.cost), macs + (job.rows * job.cols) as u128);
            }
            // LPT: no rank carries more than the average plus the largest matrix.
            let total: u64 = roots.load.iter().sum();
            let largest = roots.jobs.iter().map(|j| j.cost).max().unwrap();
            let worst = *roots.load.iter().max().unwrap();
            assert!(worst <= total / world as u64 + largest, "{:?}", roots.load);

            let counted: Vec<(usize, usize, usize)> = ThreadWorld::run(world, |comm| {
                let c = Counting {
                    inner: comm,
                    calls: AtomicUsize::new(0),
                    sent: AtomicUsize::new(0),
                    sent_bytes: AtomicUsize::new(0),
                };
                run_rank(opt, &shards[comm.rank()], &p0, &grads, &c);
                Ok((
                    c.calls.into_inner(),
                    c.sent.into_inner(),
                    c.sent_bytes.into_inner(),
                ))
            })
            .unwrap();
            let sent: usize = counted.iter().map(|c| c.1).sum();
            let bytes: usize = counted.iter().map(|c| c.2).sum();
            assert_eq!(bytes, elem_bytes * sent, "{layout:?} world {world}: bytes");
            for (rank, (calls, ..)) in counted.iter().enumerate() {
                assert_eq!(
                    *calls, 2,
                    "{layout:?} world {world} rank {rank}: all-to-alls"
                );
            }
            assert_eq!(sent, 2 * roots.moved_elems(&shards[0]));
            assert!(
                sent <= 2 * muon_elems,
                "{layout:?} world {world}: {sent} elements moved for {muon_elems}"
            );
        }
    }
}

/// The host routes carry bf16 elements on a bf16 wire as they are: every split matrix arrives
/// at its root with the bits of the global matrix, and goes back to its holders unchanged,
/// a signaling NaN's payload included (a conversion through `f32` would quiet it). On any
/// CPU: the bf16 Muon step takes this path only where Newton–Schulz runs on AMX.
#[test]
fn split_matrices_travel_as_bf16_bits_on_a_bf16_wire() {
    let spec = specs(&TENSORS);
    let opt = Muon::new(MuonConfig::default()).unwrap();
    let opts = PlanOptions {
        coll_align: 1,
        ..PlanOptions::default()
    };
    let mut rng = Rng::new(23);
    let mut global: Vec<Vec<bf16>> = spec
        .iter()
        .map(|t| {
            rng.units(t.numel())
                .into_iter()
                .map(bf16::from_f32)
                .collect()
        })
        .collect();
    let (wide, tall) = (0, 1);
    global[wide][5] = bf16::from_bits(0x7f81); // signaling NaN, payload 1
    global[tall][77] = bf16::from_bits(0x0001); // smallest subnormal
    for world in [2, 3, 4] {
        let shards = layout_shards(&opt, &spec, world, Layout::Rows, &opts);
        let roots = opt.roots(&shards[0]);
        assert!(roots.has_split(), "world {world}: nothing split");
        // Through the entry point users call: a rank that fails ends the others at once.
        ThreadWorld::run(world, |comm| {
            let shard = &shards[comm.rank()];
            let local = scatter(shard, &global);
            let routes = roots.routes(shard).unwrap();
            let arena = routes.gather::<bf16, bf16>(&local, comm).unwrap();
            let want: Vec<u16> = roots
                .rooted_here(shard.rank)
                .filter(|&k| roots.jobs[k].split)
                .flat_map(|k| &global[roots.jobs[k].param][roots.jobs[k].elems.clone()])
                .map(|x| x.to_bits())
                .collect();
            let got: Vec<u16> = arena.iter().map(|x| x.to_bits()).collect();
            assert_eq!(got.len(), want.len(), "world {world} rank {}", shard.rank);
            if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
                panic!(
                    "world {world} rank {}: gathered element {i} is {:#06x}, not {:#06x}",
                    shard.rank, got[i], want[i]
                );
            }
            let mut back = vec![bf16::ZERO; shard.len];
            routes
                .scatter::<bf16, bf16>(&arena, &mut back, comm)
                .unwrap();
            // Every element this rank holds of a split matrix comes back as it was.
            let mut checked = 0;
            for job in roots.jobs.iter().filter(|j| j.split) {
                for p in shard.pieces.iter().filter(|p| p.param == job.param) {
                    let lo = p.range.start.max(job.elems.start);
                    let hi = p.range.end.min(job.elems.end);
                    for e in lo..hi {
                        let at = p.offset + e - p.range.start;
                        assert_eq!(
                            back[at].to_bits(),
                            local[at].to_bits(),
                            "world {world} rank {}: element {e} of param {}",
                            shard.rank,
                            job.param
                        );
                        checked += 1;
                    }
                }
            }
            assert!(
                checked > 0,
                "world {world} rank {}: holds no split part",
                shard.rank
            );
            Ok(())
        })
        .unwrap();
    }
}

/// `x` rounded to the nearest bf16, ties to the even one, found by distance (not by the bit
/// trick the library's conversion uses): of the two bf16 values around a finite `x`, the nearer,
/// or on a tie the one whose last mantissa bit is 0.
fn bf16_nearest_even(x: f32) -> f32 {
    let bits = x.to_bits();
    let down = f32::from_bits(bits & 0xffff_0000);
    let up = f32::from_bits((bits & 0xffff_0000) + 0x1_0000);
    let (dd, du) = (
        (f64::from(x) - f64::from(down)).abs(),
        (f64::from(up) - f64::from(x)).abs(),
    );
    if dd < du || (dd == du && (down.to_bits() >> 16) & 1 == 0) {
        down
    } else {
        up
    }
}

/// The host routes carry `f32` elements on a bf16 wire rounded to the nearest bf16, ties to
/// even (as Newton–Schulz's own first rounding, so the wire changes no bit of its result):
/// exact ties of even and odd bf16s, both signs, one unit either side of a tie, and a carry
/// into the exponent. The runs a rank holds of its own matrices never travel and keep every
/// bit, in the gather and in the scatter back.
#[test]
fn split_matrices_round_to_nearest_even_on_a_bf16_wire() {
    let spec = specs(&TENSORS);
    let opt = Muon::new(MuonConfig::default()).unwrap();
    let opts = PlanOptions {
        coll_align: 1,
        ..PlanOptions::default()
    };
    let mut rng = Rng::new(31);
    let global: Vec<Vec<f32>> = spec
        .iter()
        .map(|t| {
            rng.units(t.numel())
                .into_iter()
                .enumerate()
                .map(|(i, u)| {
                    let upper = ((0.5 + u.abs()).copysign(u).to_bits() >> 16) & !1;
                    let bits = match i % 8 {
                        0 => (upper << 16) | 0x8000,          // tie, even below: down
                        1 => ((upper | 1) << 16) | 0x8000,    // tie, odd below: up
                        2 => ((upper | 1) << 16) | 0x7fff,    // just under a tie: down
                        3 => (upper << 16) | 0x8001,          // just over a tie: up
                        4 => ((upper | 0x7f) << 16) | 0xc000, // up, carrying into the exponent
                        5 => u.to_bits(),
                        6 => upper << 16, // a bf16 already
                        _ => ((upper ^ 0x8000 | 1) << 16) | 0x8000, // other sign, tie, up
                    };
                    f32::from_bits(bits)
                })
                .collect()
        })
        .collect();
    assert_eq!(
        bf16_nearest_even(f32::from_bits(0x3f80_8000)).to_bits(),
        0x3f80_0000
    );
    for (x, rounded) in global.iter().flatten().map(|&x| (x, bf16_nearest_even(x))) {
        assert_eq!(
            bf16::from_f32(x).to_f32().to_bits(),
            rounded.to_bits(),
            "{x:e}"
        );
    }
    for world in [2, 3, 4] {
        let shards = layout_shards(&opt, &spec, world, Layout::Rows, &opts);
        let roots = opt.roots(&shards[0]);
        assert!(roots.has_split(), "world {world}: nothing split");
        // Through `ThreadWorld::run`: a rank whose assertion fails ends the others' waits.
        let counts = ThreadWorld::run(world, |comm| {
            let shard = &shards[comm.rank()];
            let rank = shard.rank;
            let holds = |param: usize, e: usize| {
                shard
                    .pieces
                    .iter()
                    .any(|p| p.param == param && p.range.contains(&e))
            };
            let local = scatter(shard, &global);
            let routes = roots.routes(shard).unwrap();
            let arena = routes.gather::<f32, bf16>(&local, comm).unwrap();
            let (mut at, mut own, mut carried) = (0, 0, 0);
            for k in roots.rooted_here(rank) {
                let job = &roots.jobs[k];
                for e in job.elems.clone() {
                    let x = global[job.param][e];
                    let want = if holds(job.param, e) {
                        own += 1;
                        x
                    } else {
                        carried += 1;
                        bf16_nearest_even(x)
                    };
                    assert_eq!(
                        arena[at].to_bits(),
                        want.to_bits(),
                        "world {world} rank {rank}: element {e} of param {} ({x:e})",
                        job.param
                    );
                    at += 1;
                }
            }
            assert_eq!(at, arena.len());
            let mut back = vec![f32::NAN; shard.len];
            routes
                .scatter::<f32, bf16>(&arena, &mut back, comm)
                .unwrap();
            for job in roots.jobs.iter().filter(|j| j.split) {
                for p in shard.pieces.iter().filter(|p| p.param == job.param) {
                    let lo = p.range.start.max(job.elems.start);
                    let hi = p.range.end.min(job.elems.end);
                    for e in lo..hi {
                        let x = global[job.param][e];
                        let want = match job.root == rank {
                            true => x,
                            false => bf16_nearest_even(x),
                        };
                        assert_eq!(
                            back[p.offset + e - p.range.start].to_bits(),
                            want.to_bits(),
                            "world {world} rank {rank}: back, element {e} of param {}",
                            job.param
                        );
                    }
                }
            }
            // An arena of another length than this rank's matrices is refused on
            // every rank, before anything is sent.
            let mut longer = arena.clone();
            longer.push(0.0);
            let err = routes
                .scatter::<f32, bf16>(&longer, &mut back, comm)
                .unwrap_err();
            assert!(err.to_string().contains("an arena of"), "{err}");
            Ok((own, carried))
        })
        .unwrap();
        let (own, carried) = counts.iter().fold((0, 0), |(a, b), &(o, c)| (a + o, b + c));
        assert!(
            own > 0 && carried > 0,
            "world {world}: {own} own, {carried} carried"
        );
    }
}

/// A rank that roots several split matrices of different sizes lays them back to back in its
/// arena, each at the sum of the sizes before it: under FSDP2's `Shard(0)` every matrix below
/// is split, so each rank roots three or more, no two of one size, and the sharded step is
/// still bitwise the unsharded one.
#[test]
fn a_root_of_several_split_matrices_of_different_sizes_steps_bitwise() {
    const MATRICES: [(&str, &[usize]); 7] = [
        ("a", &[24, 16]),
        ("b", &[12, 20]),
        ("c", &[30, 10]),
        ("d", &[18, 14]),
        ("e", &[9, 26]),
        ("f", &[22, 18]),
        ("g", &[6, 30]),
    ];
    let spec = specs(&MATRICES);
    let n = numels(&spec);
    let (p0, grads) = data(&spec, 2, 17);
    let opt = Muon::new(MuonConfig::default()).unwrap();
    let want = run_world(&opt, &[whole_shard(&opt, &spec)], &n, &p0, &grads);
    for world in [2, 3] {
        let shards = fsdp2_shards(&spec, world);
        let roots = opt.roots(&shards[0]);
        let many = (0..world).any(|r| {
            let sizes: Vec<usize> = roots
                .rooted_here(r)
                .map(|k| roots.jobs[k].elems.len())
                .collect();
            sizes.len() >= 3 && sizes[0] != sizes[1]
        });
        assert!(
            many,
            "world {world}: no rank roots three matrices: {roots:?}"
        );
        let got = run_world(&opt, &shards, &n, &p0, &grads);
        for (i, (g, w)) in got[0].iter().zip(&want[0]).enumerate() {
            assert_eq!(bits(g), bits(w), "world {world}: {}", MATRICES[i].0);
        }
    }
}

#[test]
fn whole_matrix_layouts_need_no_communication() {
    let spec = specs(&TENSORS);
    let opt = Muon::new(MuonConfig::default()).unwrap();
    for world in WORLDS {
        let shards = layout_shards(&opt, &spec, world, Layout::Whole, &PlanOptions::default());
        for shard in &shards {
            let roots = opt.roots(shard);
            assert!(!roots.has_split(), "world {world}");
            assert_eq!(roots.moved_elems(shard), 0);
        }
    }
}

#[test]
fn a_split_matrix_is_refused_without_its_ranks_before_anything_changes() {
    let spec = specs(&TENSORS);
    let (p0, grads) = data(&spec, 1, 9);
    let opt = Muon::new(MuonConfig::default()).unwrap();
    let opts = PlanOptions {
        coll_align: 1,
        ..PlanOptions::default()
    };
    for world in [2, 3, 4, 8] {
        let shards = layout_shards(&opt, &spec, world, Layout::Rows, &opts);
        for shard in &shards {
            let mut params = scatter(shard, &p0);
            let before = params.clone();
            let mut state = opt.init(shard).unwrap();
            // A one-rank communicator cannot reach the other holders: never orthogonalize
            // the partial matrix this rank holds.
            let res = opt.step_slices(
                &mut state,
                shard,
                &mut params,
                &scatter(shard, &grads[0]),
                &SingleRank,
            );
            assert!(
                matches!(res, Err(Error::WorldSizeMismatch { .. })),
                "world {world} rank {}: {res:?}",
                shard.rank
            );
            assert_eq!(bits(&params), bits(&before), "params changed on refusal");
            assert_eq!(state, opt.init(shard).unwrap(), "state changed on refusal");
        }
        // Holdings that contradict the pieces are refused too.
        let mut bad = shards[0].clone();
        let i = bad.pieces[0].param;
        bad.params[i].holdings.reverse();
        let mut params = scatter(&bad, &p0);
        let mut state = opt.init(&bad).unwrap();
        let g = scatter(&bad, &grads[0]);
        let res = opt.step_slices(&mut state, &bad, &mut params, &g, &SingleRank);
        if bad.params[i].holdings.len() > 1 {
            assert!(matches!(res, Err(Error::InvalidShard { .. })), "{res:?}");
        }
    }
}

fn unit_of(spec: &[TensorSpec]) -> Unit<'_> {
    Unit {
        name: "unit".into(),
        tensors: spec.iter().collect(),
    }
}

fn muon_with(layout: MatrixLayout) -> Muon {
    Muon::new(MuonConfig {
        layout,
        ..MuonConfig::default()
    })
    .unwrap()
}

#[test]
fn layout_cost_model_splits_a_matrix_only_when_padding_costs_more_than_moving_it() {
    let opts = PlanOptions {
        coll_align: 1,
        ..PlanOptions::default()
    };
    // One 64×64 matrix among small ones on 8 ranks: whole, it forces S ≥ 4096 and about
    // 7·4096 padding elements into every collective; split, it moves under 4096 per way.
    let big = specs(&[("w_big", &[64, 64]), ("b", &[100]), ("w_small", &[8, 8])]);
    // The same as a conv filter: one flattened 64 × 64 matrix, whole as one `Whole` block.
    let conv = specs(&[
        ("w_big", &[64, 4, 4, 4]),
        ("b", &[100]),
        ("w_small", &[8, 8]),
    ]);
    // Eight equal 32×32 matrices on 8 ranks pack whole with no padding at all.
    let even: Vec<TensorSpec> = (0..8)
        .map(|i| TensorSpec::new(format!("w{i}"), &[32, 32], DType::F32).unwrap())
        .collect();
    for (spec, want_split) in [(&big, true), (&conv, true), (&even, false)] {
        let unit = unit_of(spec);
        let (_, auto) = muon_with(MatrixLayout::Auto)
            .plan_layout(&unit, 8, &opts)
            .unwrap();
        let (_, whole) = muon_with(MatrixLayout::Whole)
            .plan_layout(&unit, 8, &opts)
            .unwrap();
        let (_, split) = muon_with(MatrixLayout::Split)
            .plan_layout(&unit, 8, &opts)
            .unwrap();
        assert_eq!(whole.moved, 0, "whole matrices never travel");
        let whole_block = |t: &TensorChoice| match t.shape.len() {
            4 => AtomicBlock::Whole,
            _ => AtomicBlock::Matrix,
        };
        assert!(whole.tensors.iter().all(|t| t.block == whole_block(t)));
        assert!(whole.tensors.iter().all(|t| !t.is_split()));
        assert!(split
            .tensors
            .iter()
            .all(|t| t.block == AtomicBlock::Element));
        assert!(split.padding <= whole.padding);
        assert!(auto.cost_bytes() <= whole.cost_bytes(), "{auto}{whole}");
        assert!(auto.cost_bytes() <= split.cost_bytes(), "{auto}{split}");
        assert_eq!(auto.tensors[0].is_split(), want_split, "{auto}");
        if want_split {
            assert!(auto.cost_bytes() < whole.cost_bytes(), "{auto}{whole}");
            assert!(auto.padding < auto.whole_padding && auto.tensors[0].moved > 0);
            assert!(auto.to_string().contains("split (moves"), "{auto}");
        } else {
            assert_eq!(auto.padding, 0, "{auto}");
            assert_eq!(auto.moved, 0, "{auto}");
        }
        // The report adds up.
        let moved: usize = auto.tensors.iter().map(|t| t.moved).sum();
        assert_eq!(moved, auto.moved);
    }
}

#[test]
fn auto_layout_plans_step_bitwise_like_unsharded() {
    // TENSORS plus one matrix large enough that splitting it pays at several world sizes.
    let mut spec = specs(&TENSORS);
    spec.push(TensorSpec::new("w_big".to_string(), &[64, 72], DType::F32).unwrap());
    let n = numels(&spec);
    let (p0, grads) = data(&spec, 2, 23);
    let opt = Muon::new(loud()).unwrap();
    let want = run_world(&opt, &[whole_shard(&opt, &spec)], &n, &p0, &grads);
    let mut any_split = false;
    for world in WORLDS {
        let plan = opt
            .plan_unit(
                &unit_of(&spec),
                world,
                &PlanOptions {
                    coll_align: 1,
                    ..PlanOptions::default()
                },
            )
            .unwrap();
        plan.validate().unwrap();
        let shards: Vec<LocalShard> = (0..world)
            .map(|r| LocalShard::from_plan(&plan, r).unwrap())
            .collect();
        any_split |= opt.roots(&shards[0]).has_split();
        let got = run_world(&opt, &shards, &n, &p0, &grads);
        for (g, w) in got.iter().zip(&want) {
            for (g, w) in g.iter().zip(w) {
                assert_eq!(bits(g), bits(w), "world {world}");
            }
        }
    }
    assert!(
        any_split,
        "the cost model never split a matrix: the test lost its point"
    );
}

// ---------------------------------------------------------------------------------------------
// 5. State
// ---------------------------------------------------------------------------------------------

#[test]
fn state_round_trip_through_bytes_continues_bitwise() {
    let spec = specs(&TENSORS);
    let (p0, grads) = data(&spec, 6, 5);
    let opt = Muon::new(loud()).unwrap();
    let block_of = |t: &TensorSpec| opt.atomic_block(&t.name, &t.shape);
    let shards = planned_shards_by(&spec, 3, &block_of, &PlanOptions::default());
    for shard in &shards {
        let (p_all, s_all) = run_rank(&opt, shard, &p0, &grads, &SingleRank);
        let (mut p, s_half) = run_rank(&opt, shard, &p0, &grads[..3], &SingleRank);
        let bytes = s_half.to_le_bytes().unwrap();
        let mut s = MuonState::from_le_bytes(&bytes).unwrap();
        assert_eq!(s, s_half);
        assert_eq!(s.to_le_bytes().unwrap(), bytes);
        for g in &grads[3..] {
            opt.step_slices(&mut s, shard, &mut p, &scatter(shard, g), &SingleRank)
                .unwrap();
        }
        assert_eq!(bits(&p), bits(&p_all), "rank {}: params", shard.rank);
        assert_eq!(
            bits(s.m.cpu().unwrap()),
            bits(s_all.m.cpu().unwrap()),
            "rank {}: m",
            shard.rank
        );
        assert_eq!(
            bits(s.v.cpu().unwrap()),
            bits(s_all.v.cpu().unwrap()),
            "rank {}: v",
            shard.rank
        );
        assert_eq!(s.step, 6);
    }
}

/// Muon's matrices keep only their momentum: `v` holds the AdamW fallback's elements (here
/// the bias, the embedding and the gain) and nothing for the matrices, at every world size;
/// the bytes say so, and a truncated, longer or overflowing serialization is refused.
#[test]
fn state_keeps_a_second_moment_only_for_the_adamw_fallback() {
    let spec = specs(&TENSORS);
    let opt = Muon::new(loud()).unwrap();
    let fallback: usize = spec
        .iter()
        .filter(|t| !opt.uses_muon(&t.name, &t.shape))
        .map(|t| t.numel())
        .sum();
    assert_eq!(fallback, 31 + 60 + 1, "the bias, tok_embed and gain");
    let block_of = |t: &TensorSpec| opt.atomic_block(&t.name, &t.shape);
    for world in WORLDS {
        let shards = planned_shards_by(&spec, world, &block_of, &PlanOptions::default());
        let mut total = 0;
        for shard in &shards {
            let state = opt.init(shard).unwrap();
            assert_eq!(state.m.len(), shard.len);
            assert_eq!(state.v.len(), opt.fallback_len(shard));
            assert_eq!(state.state_bytes(), 4 * (shard.len + state.v.len()));
            total += state.v.len();
        }
        assert_eq!(total, fallback, "V = {world}: v over the ranks");
    }
    let shard = whole_shard(&opt, &spec);
    let bytes = opt.init(&shard).unwrap().to_le_bytes().unwrap();
    assert_eq!(bytes.len(), 24 + 4 * (shard.len + fallback));
    assert!(MuonState::from_le_bytes(&bytes[..bytes.len() - 1]).is_err());
    assert!(MuonState::from_le_bytes(&bytes[..20]).is_err());
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(MuonState::from_le_bytes(&longer).is_err());
    let mut huge = bytes.clone();
    huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(MuonState::from_le_bytes(&huge).is_err());
}

/// `release_buffers` frees the kept `U` (its bytes: one `f32` per shard element at least)
/// and the steps after it give the bits of a run that never released it.
#[test]
fn released_buffers_are_freed_and_change_no_bit() {
    let spec = specs(&TENSORS);
    let (p0, grads) = data(&spec, 4, 9);
    let opt = Muon::new(loud()).unwrap();
    let shard = whole_shard(&opt, &spec);
    assert_eq!(opt.release_buffers(), 0, "nothing kept before a step");
    let (p_kept, s_kept) = run_rank(&opt, &shard, &p0, &grads, &SingleRank);
    let mut p = scatter(&shard, &p0);
    let mut s = opt.init(&shard).unwrap();
    for g in &grads {
        opt.step_slices(&mut s, &shard, &mut p, &scatter(&shard, g), &SingleRank)
            .unwrap();
        assert!(opt.release_buffers() >= 4 * shard.len, "U was kept");
        assert_eq!(opt.release_buffers(), 0, "and is gone");
    }
    assert_eq!(bits(&p), bits(&p_kept));
    assert_eq!(s, s_kept);
}

/// bf16 Newton–Schulz on the AMX products keeps `U` in bf16, whole matrices and split ones
/// alike: the kept buffer is 2 bytes an element, not 4 (the bits are those of an `f32` `U`:
/// `sharded_muon_step_is_bitwise_equal_to_unsharded` with the gemm backend); elsewhere `U`
/// stays `f32`.
#[test]
fn bf16_newton_schulz_on_amx_keeps_u_in_bf16() {
    let spec = specs(&TENSORS);
    let (p0, grads) = data(&spec, 1, 5);
    let opt = Muon::new(MuonConfig {
        ns: NsConfig {
            precision: NsPrecision::Bf16,
            ..NsConfig::default()
        },
        ..MuonConfig::default()
    })
    .unwrap();
    let amx = ragged_optimizers::kernels::amx_bf16::amx();
    if let Err(e) = &amx {
        eprintln!("bf16_newton_schulz_on_amx_keeps_u_in_bf16: U stays f32 here ({e})");
    }
    let kept_as_expected = |bytes: usize, len: usize| {
        if amx.is_ok() {
            (2 * len..4 * len).contains(&bytes)
        } else {
            bytes >= 4 * len
        }
    };
    let shard = whole_shard(&opt, &spec);
    run_rank(&opt, &shard, &p0, &grads, &SingleRank);
    let bytes = opt.release_buffers();
    assert!(kept_as_expected(bytes, shard.len), "{bytes} bytes");
    // Rows split over 2 ranks: the split matrices travel to their roots and back.
    let shards = layout_shards(&opt, &spec, 2, Layout::Rows, &PlanOptions::default());
    assert!(opt.roots(&shards[0]).has_split());
    let opts: Vec<Muon> = shards.iter().map(|_| opt.clone()).collect();
    ThreadWorld::run(2, |comm| {
        let r = comm.rank();
        run_rank(&opts[r], &shards[r], &p0, &grads, comm);
        Ok(())
    })
    .unwrap();
    for (o, sh) in opts.iter().zip(&shards) {
        let bytes = o.release_buffers();
        assert!(kept_as_expected(bytes, sh.len), "{bytes} bytes");
    }
}

// ---------------------------------------------------------------------------------------------
// 6. Validation
// ---------------------------------------------------------------------------------------------

#[test]
fn invalid_configs_are_refused() {
    let bad = [
        MuonConfig {
            momentum: 1.0,
            ..MuonConfig::default()
        },
        MuonConfig {
            lr: -1.0,
            ..MuonConfig::default()
        },
        MuonConfig {
            weight_decay: f64::NAN,
            ..MuonConfig::default()
        },
        MuonConfig {
            ns: NsConfig {
                steps: 0,
                ..NsConfig::default()
            },
            ..MuonConfig::default()
        },
        MuonConfig {
            ns: NsConfig {
                steps: 100,
                ..NsConfig::default()
            },
            ..MuonConfig::default()
        },
        MuonConfig {
            ns: NsConfig {
                coeffs: vec![],
                ..NsConfig::default()
            },
            ..MuonConfig::default()
        },
        MuonConfig {
            ns: NsConfig {
                eps: 0.0,
                ..NsConfig::default()
            },
            ..MuonConfig::default()
        },
    ];
    for c in bad {
        assert!(Muon::new(c.clone()).is_err(), "{c:?} accepted");
    }
    assert!(Muon::new(MuonConfig::default()).is_ok());
}

/// Muon's matrix rate `lr·lr_scale` and decay are checked as products, and a Newton–Schulz
/// schedule that lets a singular value grow is refused: each of these was accepted, and the
/// first step wrote NaN into the parameters and returned `Ok`.
#[test]
fn configs_whose_updates_overflow_are_refused() {
    let d = MuonConfig::default;
    let matrix = |lr_scale: f64, weight_decay: Option<f64>| RoleRule {
        matrix: RoleSettings {
            lr_scale,
            weight_decay,
        },
        ..RoleRule::default()
    };
    let ns = |coeffs: Vec<[f32; 3]>, norm_scale: f32| NsConfig {
        coeffs,
        norm_scale,
        ..NsConfig::default()
    };
    for (c, says) in [
        (
            MuonConfig {
                roles: matrix(1e300, None),
                ..d()
            },
            "matrix lr·lr_scale",
        ),
        (
            MuonConfig {
                roles: matrix(1.0, Some(1e300)),
                ..d()
            },
            "matrix lr·lr_scale",
        ),
        (
            MuonConfig { lr: 1e-40, ..d() },
            "learning rate must be 0 or",
        ),
        (
            MuonConfig {
                lr: 3e38,
                weight_decay: 0.0,
                ..d()
            },
            "learning rate must be 0 or",
        ),
        (
            MuonConfig {
                ns: ns(vec![[3.4445, 4.7750, 2.0315]], 1.0),
                ..d()
            },
            "does not orthogonalize",
        ),
        (
            MuonConfig {
                ns: ns(vec![QUINTIC], 1e-30),
                ..d()
            },
            "does not orthogonalize",
        ),
    ] {
        let err = Muon::new(c.clone()).unwrap_err().to_string();
        assert!(err.contains(says), "{c:?}: {err}");
    }
}

/// Muon's `set_learning_rate` runs construction's rate checks at the new rate, and the AdamW
/// fallback's, whose rate follows in proportion: from a tiny configured rate the proportion
/// is huge. Refused, nothing changes.
#[test]
fn set_learning_rate_checks_muons_and_the_fallbacks_rates_and_changes_nothing_on_error() {
    let mut opt = Muon::new(MuonConfig {
        lr: 1e-30,
        ..MuonConfig::default()
    })
    .unwrap();
    let fallback = opt.config().adamw.lr;
    // The fallback would be at fallback·1e30 = 1e27, past 2^64.
    let err = opt.set_learning_rate(1.0).unwrap_err().to_string();
    assert!(err.contains("learning rate must be 0 or"), "{err}");
    assert_eq!((opt.config().lr, opt.config().adamw.lr), (1e-30, fallback));
    opt.set_learning_rate(1e-29).unwrap();
    assert_eq!(opt.config().adamw.lr, fallback * (1e-29 / 1e-30));

    let mut opt = Muon::new(MuonConfig {
        weight_decay: 1e15,
        ..MuonConfig::default()
    })
    .unwrap();
    let err = opt.set_learning_rate(1e5).unwrap_err().to_string();
    assert!(err.contains("lr·weight_decay"), "{err}");
    assert_eq!(opt.learning_rate(), Some(1e-3));
}

#[test]
fn a_backend_that_cannot_run_the_config_fails_the_step_before_anything_changes() {
    // The AMX backend in f32 is refused at the step (the backend is resolved at run time,
    // and AMX runs bf16 only): parameters and momentum keep their bits, the step count stays.
    let opt = Muon::new(MuonConfig {
        ns: NsConfig {
            method: NsMethod::Gram,
            backend: NsBackend::Amx,
            precision: NsPrecision::F32,
            ..NsConfig::default()
        },
        ..MuonConfig::default()
    })
    .unwrap();
    let shard = whole_shard(&opt, &specs(&[("w", &[8, 24]), ("b", &[5])]));
    let mut state = opt.init(&shard).unwrap();
    let mut rng = Rng::new(3);
    let (p0, g) = (rng.units(shard.len), rng.units(shard.len));
    let mut p = p0.clone();
    let err = opt.step_slices(&mut state, &shard, &mut p, &g, &SingleRank);
    assert!(err.is_err());
    assert_eq!(bits(&p), bits(&p0));
    assert!(state.m.cpu().unwrap().iter().all(|&m| m == 0.0));
    assert_eq!(state.step, 0);
}

#[test]
fn step_refuses_buffers_of_the_wrong_length() {
    let opt = Muon::new(MuonConfig::default()).unwrap();
    let shard = whole_shard(&opt, &specs(&[("w", &[4, 3])]));
    let mut state = opt.init(&shard).unwrap();
    let mut p = vec![0.0; 11];
    assert!(opt
        .step_slices(&mut state, &shard, &mut p, &[0.0; 12], &SingleRank)
        .is_err());
}

/// An MoE-like layer: `experts` interchangeable expert matrices, an attention matrix, a
/// router and a norm, named as `layer`'s.
fn moe_layer(layer: usize, experts: usize) -> Vec<TensorSpec> {
    let mut spec: Vec<(String, Vec<usize>)> = (0..experts)
        .map(|e| (format!("layers.{layer}.experts.{e}.w"), vec![48, 40]))
        .collect();
    spec.push((format!("layers.{layer}.attn.o"), vec![64, 64]));
    spec.push((format!("layers.{layer}.router"), vec![16, 64]));
    spec.push((format!("layers.{layer}.norm"), vec![64]));
    spec.iter()
        .map(|(n, s)| TensorSpec::new(n.clone(), s, DType::F32).unwrap())
        .collect()
}

/// Every layout is remembered for units equal up to names (Auto's search, which moves classes
/// of interchangeable tensors, too). A remembered plan must be the one a fresh `Muon` makes,
/// for every world size and planner option (the cache key must hold all of them), and what
/// Auto finds never costs more than all-whole or all-split.
#[test]
fn layouts_are_remembered_per_unit_shape_and_auto_is_never_worse_than_either_end() {
    let aligned = PlanOptions::default();
    let loose = PlanOptions {
        coll_align: 1,
        ..PlanOptions::default()
    };
    let layers: Vec<Vec<TensorSpec>> = (0..3).map(|l| moe_layer(l, 12)).collect();
    let layouts = [MatrixLayout::Auto, MatrixLayout::Whole, MatrixLayout::Split];
    let remembering = layouts.map(muon_with);
    let mut split_somewhere = false;
    for (world, opts) in [(8, &loose), (8, &aligned), (5, &loose), (8, &loose)] {
        for spec in &layers {
            let unit = unit_of(spec);
            let mut reports = Vec::new();
            for (layout, muon) in layouts.iter().zip(&remembering) {
                let (plan, report) = muon.plan_layout(&unit, world, opts).unwrap();
                let (fresh_plan, fresh) =
                    muon_with(*layout).plan_layout(&unit, world, opts).unwrap();
                assert_eq!(report, fresh, "{layout:?}, V = {world}, {opts:?}");
                assert_eq!(plan, fresh_plan);
                reports.push(report);
            }
            let report = &reports[0];
            for other in &reports[1..] {
                assert!(report.cost_bytes() <= other.cost_bytes(), "{report}{other}");
            }
            split_somewhere |= report
                .tensors
                .iter()
                .any(|t| t.block != AtomicBlock::Matrix);
        }
    }
    // The shapes are chosen so that splitting pays somewhere: the search did move something.
    assert!(split_somewhere);
}
