//! AdamW: golden values against an f64 reference, torch's operation order bitwise, sharded ≡
//! unsharded bitwise over world sizes and uneven shapes, state round trips, the weight-decay
//! rule and input validation.

use proptest::prelude::*;
use ragged::comm::SingleRank;
use ragged::model::{DType, TensorSpec};
use ragged::optim::MAX_LEARNING_RATE;
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::PlanOptions;
use ragged::{AtomicBlock, RoleRule, RoleSettings};
use ragged_optimizers::adamw::{adamw_update, PAR_MIN_ELEMS};
use ragged_optimizers::common::{self, AdamScale, MomentCoeffs};
use ragged_optimizers::{Adam8bit, Adam8bitConfig, AdamState, AdamW, AdamWConfig, DecayRule};

mod harness;
use harness::{bits, gather, numels, padding, planned_shards, scatter, whole_shard, Rng};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn specs(shapes: &[&[usize]]) -> Vec<TensorSpec> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| TensorSpec::new(format!("t{i}"), s, DType::F32).unwrap())
        .collect()
}

/// Global tensors after an AdamW run on `shards`: (params, m, v), each per tensor. Also
/// asserts that padding is exactly `+0.0` in params, m and v on every rank after every step,
/// although the gradient's padding holds `1.0`.
fn run(
    opt: &AdamW,
    shards: &[LocalShard],
    numels: &[usize],
    p0: &[Vec<f32>],
    grads: &[Vec<Vec<f32>>],
) -> [Vec<Vec<f32>>; 3] {
    let mut params: Vec<Vec<f32>> = shards.iter().map(|s| scatter(s, p0)).collect();
    let mut states: Vec<AdamState> = shards.iter().map(|s| opt.init(s).unwrap()).collect();
    for g in grads {
        for (r, shard) in shards.iter().enumerate() {
            let mut local_g = scatter(shard, g);
            // Garbage in the gradient's padding: the optimizer must not even read it.
            for i in padding(shard) {
                local_g[i] = 1.0;
            }
            opt.step_slices(&mut states[r], shard, &mut params[r], &local_g, &SingleRank)
                .unwrap();
            for i in padding(shard) {
                let (p, m, v) = (
                    params[r][i],
                    states[r].m.cpu().unwrap()[i],
                    states[r].v.cpu().unwrap()[i],
                );
                assert!(
                    p.to_bits() == 0 && m.to_bits() == 0 && v.to_bits() == 0,
                    "rank {r}/{}: padding at {i} became p={p} m={m} v={v}",
                    shard.world
                );
            }
        }
    }
    let ms: Vec<Vec<f32>> = states.iter().map(|s| s.m.to_vec().unwrap()).collect();
    let vs: Vec<Vec<f32>> = states.iter().map(|s| s.v.to_vec().unwrap()).collect();
    [
        gather(shards, &params, numels),
        gather(shards, &ms, numels),
        gather(shards, &vs, numels),
    ]
}

/// Initial parameters and `steps` gradients for `specs`, from `seed`.
fn data(specs: &[TensorSpec], steps: usize, seed: u64) -> (Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>) {
    let mut rng = Rng::new(seed);
    let p0 = specs.iter().map(|t| rng.vec(t.numel(), 0.5, 2.0)).collect();
    let grads = (0..steps)
        .map(|_| {
            specs
                .iter()
                .map(|t| rng.vec(t.numel(), 1e-3, 1.0))
                .collect()
        })
        .collect();
    (p0, grads)
}

/// Hyperparameters under which every term is visible: a large lr and wd (decay order), a
/// large eps next to small gradients (eps placement), short betas (bias corrections).
fn loud(decay_rule: DecayRule) -> AdamWConfig {
    AdamWConfig {
        lr: 0.05,
        beta1: 0.8,
        beta2: 0.95,
        eps: 1e-3,
        weight_decay: 0.2,
        decay_rule,
        ..AdamWConfig::default()
    }
}

/// The configs the bitwise tests sweep: torch defaults, `loud`, β₁ < 0.5 (torch's other
/// `lerp` branch) and β₁ = 0.5 exactly (lerp weight 0.5, which torch's `|w| < 0.5` test sends
/// to the `g − (g − m)·β₁` branch; the other branch rounds differently).
fn configs() -> Vec<AdamWConfig> {
    vec![
        AdamWConfig::default(),
        loud(DecayRule::NoDecayFor1D),
        AdamWConfig {
            beta1: 0.3,
            ..loud(DecayRule::All)
        },
        AdamWConfig {
            beta1: 0.5,
            ..loud(DecayRule::All)
        },
    ]
}

const SHAPES: [&[usize]; 5] = [&[7, 5], &[33], &[3, 4, 5], &[1], &[129, 2]];
const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];

fn assert_bitwise(got: &[Vec<Vec<f32>>; 3], want: &[Vec<Vec<f32>>; 3], what: &str) {
    for (role, (g, w)) in ["params", "m", "v"].iter().zip(got.iter().zip(want)) {
        for (i, (g, w)) in g.iter().zip(w).enumerate() {
            assert_eq!(bits(g), bits(w), "{what}: {role} of tensor {i} differs");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Golden values
// ---------------------------------------------------------------------------------------------

/// The textbook AdamW in f64 (Loshchilov & Hutter, Algorithm 2, with torch's lr-scaled decay),
/// written from the formula: `β₁·m + (1 − β₁)·g` (not lerp), `√(v / bc₂)` (not `√v / √bc₂`).
fn reference_f64(
    c: &AdamWConfig,
    decays: bool,
    p0: &[f32],
    grads: &[&[f32]],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut p: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
    let mut m = vec![0.0; p.len()];
    let mut v = vec![0.0; p.len()];
    for (k, g) in grads.iter().enumerate() {
        let t = (k + 1) as i32;
        let (bc1, bc2) = (1.0 - c.beta1.powi(t), 1.0 - c.beta2.powi(t));
        for i in 0..p.len() {
            let g = g[i] as f64;
            if decays {
                p[i] *= 1.0 - c.lr * c.weight_decay;
            }
            m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * g;
            v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * g * g;
            let m_hat = m[i] / bc1;
            let v_hat = v[i] / bc2;
            p[i] -= c.lr * m_hat / (v_hat.sqrt() + c.eps);
        }
    }
    (p, m, v)
}

/// Tolerance of the golden test: relative `1.5e-6` for parameters (|p| stays above 0.5), and
/// `1.5e-6` of max|g| for m and of max g² for v (moments are convex combinations of the
/// gradients, so that is their scale; relative to m itself would be unbounded where m
/// cancels to ~0).
///
/// Why: the run is f32 against an f64 reference, with unit roundoff u = 2⁻²⁴ ≈ 6e-8. Per
/// step a parameter takes the rounding of `p·decay`, the error of the f32 decay factor
/// (`(1 − lr·wd) as f32`, systematic, ≤ u), the rounding of the final addition, and the
/// error of the f32 update term (≈ 6 roundings of a term ≤ 0.2·|p|): ≲ 4.2u per step, so
/// ≤ 21u ≈ 1.25e-6 after 5 steps. The moments take ≈ 3–4 roundings of a quantity ≤ max|g|
/// (max g²) per step, damped by β. Measured worst cases: 3.3e-7 (p), 6e-8 (m), 2e-8 (v). An
/// error in the formula is far larger under `loud`: decay after instead of before the update
/// moves p by ~1e-3 relative, eps inside the square root by ~1e-2, a missing bias correction
/// by > 1e-1.
const GOLDEN_RTOL: f64 = 1.5e-6;

#[test]
fn adamw_matches_an_f64_reference_within_f32_rounding() {
    let n = 64;
    let steps = 5;
    for (ci, c) in [
        AdamWConfig::default(),
        loud(DecayRule::All),
        AdamWConfig {
            beta1: 0.3,
            ..loud(DecayRule::All)
        },
    ]
    .iter()
    .enumerate()
    {
        let mut rng = Rng::new(7 + ci as u64);
        // |p| ∈ [1, 3]: far from 0 (the updates move it by < 0.5), so relative errors are fair.
        let p0 = rng.vec(n, 1.0, 3.0);
        // Gradients over four decades, so eps = 1e-3 matters for some elements and not others.
        let grads: Vec<Vec<f32>> = (0..steps).map(|_| rng.vec(n, 1e-4, 1.0)).collect();
        let spec = specs(&[&[8, 8]]);
        let shard = whole_shard(&spec);
        let opt = AdamW::new(*c).unwrap();
        let mut state = opt.init(&shard).unwrap();
        let mut p = p0.clone();
        for (k, g) in grads.iter().enumerate() {
            opt.step_slices(&mut state, &shard, &mut p, g, &SingleRank)
                .unwrap();
            let gs: Vec<&[f32]> = grads[..=k].iter().map(Vec::as_slice).collect();
            let (rp, rm, rv) = reference_f64(c, true, &p0, &gs);
            let gmax = gs
                .iter()
                .flat_map(|g| g.iter())
                .fold(0f64, |a, &g| a.max(g.abs() as f64));
            for i in 0..n {
                let ep = (p[i] as f64 - rp[i]).abs() / rp[i].abs();
                let em = (state.m.cpu().unwrap()[i] as f64 - rm[i]).abs() / gmax;
                let ev = (state.v.cpu().unwrap()[i] as f64 - rv[i]).abs() / (gmax * gmax);
                assert!(
                    ep <= GOLDEN_RTOL && em <= GOLDEN_RTOL && ev <= GOLDEN_RTOL,
                    "config {ci}, step {}, element {i}: relative errors p {ep:e}, m {em:e}, \
                     v {ev:e} (p {} vs {}, m {} vs {}, v {} vs {})",
                    k + 1,
                    p[i],
                    rp[i],
                    state.m.cpu().unwrap()[i],
                    rm[i],
                    state.v.cpu().unwrap()[i],
                    rv[i]
                );
            }
        }
        assert_eq!(state.step, steps as u64);
    }
}

/// torch's single-tensor AdamW written out in f32 scalar operations, in its order: Python
/// scalars in f64 rounded once, `mul_`, `lerp_`, `mul_` + `addcmul_`, `sqrt` / scalar + eps,
/// `addcdiv_`.
fn torch_order_f32(
    c: &AdamWConfig,
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[f32],
    t: u64,
) {
    let bc1 = 1.0 - c.beta1.powf(t as f64);
    let bc2 = 1.0 - c.beta2.powf(t as f64);
    let decay = (1.0 - c.lr * c.weight_decay) as f32;
    let w = (1.0 - c.beta1) as f32;
    let (b2, c2) = (c.beta2 as f32, (1.0 - c.beta2) as f32);
    let neg_step = (-(c.lr / bc1)) as f32;
    let bc2_sqrt = bc2.powf(0.5) as f32;
    let eps = c.eps as f32;
    for i in 0..p.len() {
        p[i] *= decay;
        m[i] = if w.abs() < 0.5 {
            m[i] + w * (g[i] - m[i])
        } else {
            g[i] - (g[i] - m[i]) * (1.0 - w)
        };
        v[i] *= b2;
        v[i] += c2 * g[i] * g[i];
        let denom = v[i].sqrt() / bc2_sqrt + eps;
        p[i] += neg_step * m[i] / denom;
    }
}

#[test]
fn adamw_follows_torch_operation_order_bitwise() {
    for (ci, c) in configs().iter().enumerate() {
        let c = AdamWConfig {
            decay_rule: DecayRule::All,
            ..*c
        };
        let mut rng = Rng::new(100 + ci as u64);
        let n = 257;
        let spec = specs(&[&[n]]);
        let shard = whole_shard(&spec);
        let opt = AdamW::new(c).unwrap();
        let mut state = opt.init(&shard).unwrap();
        let mut p = rng.vec(n, 1e-3, 3.0);
        let (mut tp, mut tm, mut tv) = (p.clone(), vec![0.0; n], vec![0.0; n]);
        for t in 1..=6 {
            let g = rng.vec(n, 1e-5, 2.0);
            opt.step_slices(&mut state, &shard, &mut p, &g, &SingleRank)
                .unwrap();
            torch_order_f32(&c, &mut tp, &mut tm, &mut tv, &g, t);
            assert_eq!(bits(&p), bits(&tp), "config {ci}, step {t}: params");
            assert_eq!(
                bits(state.m.cpu().unwrap()),
                bits(&tm),
                "config {ci}, step {t}: m"
            );
            assert_eq!(
                bits(state.v.cpu().unwrap()),
                bits(&tv),
                "config {ci}, step {t}: v"
            );
        }
    }
}

#[test]
fn fused_update_is_bitwise_the_chain_of_common_pieces() {
    // Sizes below, at and above the rayon threshold, and not multiples of any vector width.
    for &n in &[1, 15, 1000, PAR_MIN_ELEMS, PAR_MIN_ELEMS * 3 + 17] {
        for (ci, c) in configs().iter().enumerate() {
            for decay in [None, Some(common::decay_factor(c.lr, c.weight_decay))] {
                let mut rng = Rng::new(n as u64 * 31 + ci as u64);
                let mc = MomentCoeffs::new(c.beta1, c.beta2);
                let s = AdamScale::new(c.lr, c.beta1, c.beta2, c.eps, 3);
                let (p0, g) = (rng.vec(n, 1e-3, 2.0), rng.vec(n, 1e-4, 1.0));
                let (m0, v0) = (rng.vec(n, 0.0, 0.5), rng.vec(n, 0.0, 0.5));
                let v0: Vec<f32> = v0.iter().map(|x| x.abs()).collect();

                let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
                adamw_update(&mut p, &g, &mut m, &mut v, decay, &mc, &s);

                let (mut cp, mut cm, mut cv) = (p0, m0, v0);
                if let Some(d) = decay {
                    common::decay(&mut cp, d);
                }
                common::update_moments(&mut cm, &mut cv, &g, &mc);
                common::apply_adam(&mut cp, &cm, &cv, &s);

                let what = format!("n {n}, config {ci}, decay {decay:?}");
                assert_eq!(bits(&p), bits(&cp), "{what}: params");
                assert_eq!(bits(&m), bits(&cm), "{what}: m");
                assert_eq!(bits(&v), bits(&cv), "{what}: v");
            }
        }
    }
}

#[test]
fn scalars_are_computed_in_f64_and_rounded_once() {
    // 1 − 0.9 in f64 is 0.09999999999999998; rounded to f32 it is 0.1f32. 1 − 0.9f32 is not.
    let mc = MomentCoeffs::new(0.9, 0.999);
    assert_eq!(mc.lerp_weight.to_bits(), ((1.0f64 - 0.9) as f32).to_bits());
    assert_ne!(mc.lerp_weight.to_bits(), (1.0f32 - 0.9f32).to_bits());
    assert_eq!(
        mc.one_minus_beta2.to_bits(),
        ((1.0f64 - 0.999) as f32).to_bits()
    );
    let s = AdamScale::new(1e-3, 0.9, 0.999, 1e-8, 2);
    let bc1 = 1.0 - 0.9f64.powf(2.0);
    let bc2 = 1.0 - 0.999f64.powf(2.0);
    assert_eq!(s.neg_step_size.to_bits(), ((-1e-3 / bc1) as f32).to_bits());
    assert_eq!(s.bc2_sqrt.to_bits(), (bc2.sqrt() as f32).to_bits());
    assert_eq!(common::decay_factor(1e-3, 1e-2), (1.0f64 - 1e-5) as f32);
    // β^t as Python's `beta ** step` computes it: C `pow` on two doubles (not repeated
    // multiplication, which rounds differently for some t).
    for t in 1..=5000u64 {
        for beta in [0.9, 0.95, 0.999] {
            let want = 1.0 - f64::powf(beta, t as f64);
            assert_eq!(
                common::bias_correction(beta, t).to_bits(),
                want.to_bits(),
                "β {beta}, t {t}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Sharded ≡ unsharded, bitwise
// ---------------------------------------------------------------------------------------------

fn plan_options() -> [PlanOptions; 2] {
    [
        PlanOptions {
            coll_align: 1,
            ..PlanOptions::default()
        },
        PlanOptions::default(),
    ]
}

#[test]
fn sharded_adamw_step_is_bitwise_equal_to_unsharded() {
    let spec = specs(&SHAPES);
    let n = numels(&spec);
    let (p0, grads) = data(&spec, 4, 42);
    for (ci, c) in configs().iter().enumerate() {
        let opt = AdamW::new(*c).unwrap();
        let want = run(&opt, &[whole_shard(&spec)], &n, &p0, &grads);
        for opts in plan_options() {
            for world in WORLDS {
                let shards = planned_shards(&opt, &spec, world, &opts);
                let got = run(&opt, &shards, &n, &p0, &grads);
                let what = format!("config {ci}, world {world}, coll_align {}", opts.coll_align);
                assert_bitwise(&got, &want, &what);
            }
        }
    }
}

#[test]
fn sharded_adamw_with_parallel_pieces_is_bitwise_equal_to_unsharded() {
    // One tensor large enough for the rayon path on few ranks and the serial path on many.
    let spec = specs(&[&[300, 700], &[513], &[2, 3]]);
    assert!(spec[0].numel() / 8 < PAR_MIN_ELEMS && spec[0].numel() >= PAR_MIN_ELEMS);
    let n = numels(&spec);
    let (p0, grads) = data(&spec, 3, 9);
    let opt = AdamW::new(loud(DecayRule::NoDecayFor1D)).unwrap();
    let want = run(&opt, &[whole_shard(&spec)], &n, &p0, &grads);
    for world in [1, 3, 8] {
        let shards = planned_shards(&opt, &spec, world, &PlanOptions::default());
        let got = run(&opt, &shards, &n, &p0, &grads);
        assert_bitwise(&got, &want, &format!("world {world}"));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn sharded_adamw_is_bitwise_equal_to_unsharded_for_random_layouts(
        shapes in prop::collection::vec(prop::collection::vec(1usize..12, 1..4), 1..6),
        world in 1usize..9,
        coll_align in prop::sample::select(vec![1usize, 4, 64]),
        config in 0usize..4,
        seed in any::<u64>(),
    ) {
        let shape_refs: Vec<&[usize]> = shapes.iter().map(Vec::as_slice).collect();
        let spec = specs(&shape_refs);
        let n = numels(&spec);
        let (p0, grads) = data(&spec, 3, seed);
        let opt = AdamW::new(configs()[config]).unwrap();
        let want = run(&opt, &[whole_shard(&spec)], &n, &p0, &grads);
        let opts = PlanOptions { coll_align, ..PlanOptions::default() };
        let got = run(&opt, &planned_shards(&opt, &spec, world, &opts), &n, &p0, &grads);
        for (g, w) in got.iter().zip(&want) {
            for (g, w) in g.iter().zip(w) {
                prop_assert_eq!(bits(g), bits(w));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. State round trip
// ---------------------------------------------------------------------------------------------

fn f32s_to_le(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s_from_le(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn state_round_trip_through_bytes_continues_bitwise() {
    let spec = specs(&SHAPES);
    let (p0, grads) = data(&spec, 6, 5);
    let shard = whole_shard(&spec);
    let opt = AdamW::new(loud(DecayRule::NoDecayFor1D)).unwrap();
    let flat = |g: &[Vec<f32>]| scatter(&shard, g);

    let mut state = opt.init(&shard).unwrap();
    let mut p = flat(&p0);
    for g in &grads[..3] {
        opt.step_slices(&mut state, &shard, &mut p, &flat(g), &SingleRank)
            .unwrap();
    }
    let saved_state = state.to_le_bytes().unwrap();
    let saved_params = f32s_to_le(&p);
    assert_eq!(saved_state.len(), 16 + 8 * shard.len);
    assert_eq!(saved_state[..8], 3u64.to_le_bytes());

    let mut loaded = AdamState::from_le_bytes(&saved_state).unwrap();
    let mut lp = f32s_from_le(&saved_params);
    assert_eq!(loaded.step, state.step);
    assert_eq!(bits(loaded.m.cpu().unwrap()), bits(state.m.cpu().unwrap()));
    assert_eq!(bits(loaded.v.cpu().unwrap()), bits(state.v.cpu().unwrap()));

    for g in &grads[3..] {
        opt.step_slices(&mut state, &shard, &mut p, &flat(g), &SingleRank)
            .unwrap();
        opt.step_slices(&mut loaded, &shard, &mut lp, &flat(g), &SingleRank)
            .unwrap();
    }
    assert_eq!(loaded.step, 6);
    assert_eq!(bits(&lp), bits(&p));
    assert_eq!(bits(loaded.m.cpu().unwrap()), bits(state.m.cpu().unwrap()));
    assert_eq!(bits(loaded.v.cpu().unwrap()), bits(state.v.cpu().unwrap()));
}

#[test]
fn state_saved_on_one_world_size_resumes_bitwise_on_another() {
    let spec = specs(&SHAPES);
    let n = numels(&spec);
    let (p0, grads) = data(&spec, 5, 77);
    let opt = AdamW::new(loud(DecayRule::NoDecayFor1D)).unwrap();
    let want = run(&opt, &[whole_shard(&spec)], &n, &p0, &grads);
    let opts = PlanOptions::default();

    // Three steps on 3 ranks; save every rank's state as bytes; reassemble global tensors.
    let before = planned_shards(&opt, &spec, 3, &opts);
    let mut params: Vec<Vec<f32>> = before.iter().map(|s| scatter(s, &p0)).collect();
    let mut states: Vec<AdamState> = before.iter().map(|s| opt.init(s).unwrap()).collect();
    for g in &grads[..3] {
        for (r, s) in before.iter().enumerate() {
            opt.step_slices(
                &mut states[r],
                s,
                &mut params[r],
                &scatter(s, g),
                &SingleRank,
            )
            .unwrap();
        }
    }
    let loaded: Vec<AdamState> = states
        .iter()
        .map(|s| AdamState::from_le_bytes(&s.to_le_bytes().unwrap()).unwrap())
        .collect();
    let gp = gather(&before, &params, &n);
    let gm = gather(
        &before,
        &loaded
            .iter()
            .map(|s| s.m.to_vec().unwrap())
            .collect::<Vec<_>>(),
        &n,
    );
    let gv = gather(
        &before,
        &loaded
            .iter()
            .map(|s| s.v.to_vec().unwrap())
            .collect::<Vec<_>>(),
        &n,
    );

    // Two more steps on 4 ranks from the reassembled state.
    let after = planned_shards(&opt, &spec, 4, &opts);
    let mut params: Vec<Vec<f32>> = after.iter().map(|s| scatter(s, &gp)).collect();
    let mut states: Vec<AdamState> = after
        .iter()
        .map(|s| AdamState {
            step: loaded[0].step,
            m: scatter(s, &gm).into(),
            v: scatter(s, &gv).into(),
        })
        .collect();
    for g in &grads[3..] {
        for (r, s) in after.iter().enumerate() {
            opt.step_slices(
                &mut states[r],
                s,
                &mut params[r],
                &scatter(s, g),
                &SingleRank,
            )
            .unwrap();
        }
    }
    let got = [
        gather(&after, &params, &n),
        gather(
            &after,
            &states
                .iter()
                .map(|s| s.m.to_vec().unwrap())
                .collect::<Vec<_>>(),
            &n,
        ),
        gather(
            &after,
            &states
                .iter()
                .map(|s| s.v.to_vec().unwrap())
                .collect::<Vec<_>>(),
            &n,
        ),
    ];
    assert_bitwise(&got, &want, "saved on 3 ranks, resumed on 4");
}

#[test]
fn truncated_or_inconsistent_state_bytes_are_rejected() {
    let state = AdamState {
        step: 4,
        m: vec![1.0, -2.0, 3.5].into(),
        v: vec![0.25, 0.0, 9.0].into(),
    };
    let bytes = state.to_le_bytes().unwrap();
    assert_eq!(AdamState::from_le_bytes(&bytes).unwrap(), state);
    assert!(AdamState::from_le_bytes(&bytes[..bytes.len() - 1]).is_err());
    assert!(AdamState::from_le_bytes(&bytes[..10]).is_err());
    let mut longer = bytes.clone();
    longer.extend_from_slice(&[0; 4]);
    assert!(AdamState::from_le_bytes(&longer).is_err());
    let mut huge = bytes;
    huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(AdamState::from_le_bytes(&huge).is_err());
}

// ---------------------------------------------------------------------------------------------
// 4. Weight-decay rule
// ---------------------------------------------------------------------------------------------

#[test]
fn no_decay_for_1d_leaves_vectors_and_scalars_undecayed() {
    // With zero gradients Adam's update is exactly 0 (m = 0, so 0 / denom), and only the
    // decay can change a parameter.
    let spec = specs(&[&[4, 3], &[33], &[], &[2, 2, 2], &[1]]);
    let n = numels(&spec);
    let (p0, _) = data(&spec, 0, 3);
    let zero: Vec<Vec<Vec<f32>>> = vec![n.iter().map(|&k| vec![0.0; k]).collect(); 3];
    let c = loud(DecayRule::NoDecayFor1D);
    let opt = AdamW::new(c).unwrap();
    let d = common::decay_factor(c.lr, c.weight_decay);
    for world in [1, 2, 3] {
        let shards = planned_shards(&opt, &spec, world, &PlanOptions::default());
        let [p, _, _] = run(&opt, &shards, &n, &p0, &zero);
        for (i, t) in spec.iter().enumerate() {
            let want: Vec<f32> = if t.shape.len() >= 2 {
                p0[i].iter().map(|&x| x * d * d * d).collect()
            } else {
                p0[i].clone()
            };
            assert_eq!(
                bits(&p[i]),
                bits(&want),
                "world {world}, tensor {:?}",
                t.shape
            );
        }
    }
    // The default rule decays everything, vectors included.
    let all = AdamW::new(loud(DecayRule::All)).unwrap();
    let [p, _, _] = run(&all, &[whole_shard(&spec)], &n, &p0, &zero);
    assert_ne!(bits(&p[1]), bits(&p0[1]));
}

#[test]
fn no_decay_for_1d_equals_zero_decay_on_vectors_and_full_decay_on_matrices() {
    let spec = specs(&SHAPES);
    let n = numels(&spec);
    let (p0, grads) = data(&spec, 4, 11);
    let shard = [whole_shard(&spec)];
    let rule = run(
        &AdamW::new(loud(DecayRule::NoDecayFor1D)).unwrap(),
        &shard,
        &n,
        &p0,
        &grads,
    );
    let none = AdamWConfig {
        weight_decay: 0.0,
        ..loud(DecayRule::All)
    };
    let none = run(&AdamW::new(none).unwrap(), &shard, &n, &p0, &grads);
    let all = run(
        &AdamW::new(loud(DecayRule::All)).unwrap(),
        &shard,
        &n,
        &p0,
        &grads,
    );
    for (i, t) in spec.iter().enumerate() {
        let want = if t.shape.len() >= 2 { &all } else { &none };
        assert_eq!(bits(&rule[0][i]), bits(&want[0][i]), "tensor {:?}", t.shape);
        assert_ne!(
            bits(&all[0][i]),
            bits(&none[0][i]),
            "decay must show on {:?}",
            t.shape
        );
    }
}

#[test]
fn decay_rule_is_decided_by_the_global_shape() {
    assert!(DecayRule::All.decays(&[5]));
    assert!(DecayRule::All.decays(&[]));
    assert!(!DecayRule::NoDecayFor1D.decays(&[5]));
    assert!(!DecayRule::NoDecayFor1D.decays(&[]));
    assert!(DecayRule::NoDecayFor1D.decays(&[1, 5]));
    assert!(DecayRule::NoDecayFor1D.decays(&[2, 3, 4]));
    assert_eq!(DecayRule::default(), DecayRule::All);
}

// ---------------------------------------------------------------------------------------------
// 5. Bad input, defaults, interface
// ---------------------------------------------------------------------------------------------

#[test]
fn step_with_wrong_lengths_errs_and_changes_nothing() {
    let spec = specs(&[&[3, 3], &[4]]);
    let shard = whole_shard(&spec);
    let opt = AdamW::default();
    let mut state = opt.init(&shard).unwrap();
    let good_p = vec![1.0f32; shard.len];
    let good_g = vec![0.5f32; shard.len];
    let short = vec![0.5f32; shard.len - 1];
    let long = vec![0.5f32; shard.len + 1];

    let mut p = short.clone();
    assert!(opt
        .step_slices(&mut state, &shard, &mut p, &good_g, &SingleRank)
        .is_err());
    let mut p = long.clone();
    assert!(opt
        .step_slices(&mut state, &shard, &mut p, &good_g, &SingleRank)
        .is_err());
    let mut p = good_p.clone();
    assert!(opt
        .step_slices(&mut state, &shard, &mut p, &short, &SingleRank)
        .is_err());
    assert!(opt
        .step_slices(&mut state, &shard, &mut p, &long, &SingleRank)
        .is_err());
    assert_eq!(
        bits(&p),
        bits(&good_p),
        "params must be untouched by a failed step"
    );
    assert_eq!(
        state,
        AdamState::zeros(shard.len),
        "state must be untouched by a failed step"
    );

    let mut bad_state = AdamState {
        step: 0,
        m: vec![0.0; shard.len - 1].into(),
        v: vec![0.0; shard.len].into(),
    };
    assert!(opt
        .step_slices(&mut bad_state, &shard, &mut p, &good_g, &SingleRank)
        .is_err());
    bad_state.m = vec![0.0; shard.len].into();
    bad_state.v = vec![0.0; shard.len + 1].into();
    assert!(opt
        .step_slices(&mut bad_state, &shard, &mut p, &good_g, &SingleRank)
        .is_err());
    assert_eq!(bad_state.step, 0);

    // And with correct lengths the same call succeeds.
    opt.step_slices(&mut state, &shard, &mut p, &good_g, &SingleRank)
        .unwrap();
    assert_eq!(state.step, 1);
}

#[test]
fn inconsistent_shards_are_rejected_not_indexed() {
    let spec = specs(&[&[3, 3], &[4]]);
    let good = whole_shard(&spec);
    let opt = AdamW::default();
    let mut cases = Vec::new();
    let mut s = good.clone();
    s.pieces[1].offset = good.len - 1; // runs past the shard
    cases.push(s);
    let mut s = good.clone();
    s.pieces[1].range = 0..5; // past the parameter's 4 elements
    cases.push(s);
    let mut s = good.clone();
    s.pieces[1].param = 7; // no such parameter
    cases.push(s);
    let mut s = good.clone();
    s.pieces[1].offset = 8; // overlaps the first piece
    cases.push(s);
    let mut s = good.clone();
    s.pieces[1].offset = usize::MAX; // offset + len wraps past zero
    cases.push(s);
    for (k, s) in cases.iter().enumerate() {
        assert!(opt.init(s).is_err(), "case {k}: init");
        let mut state = AdamState::zeros(s.len);
        let mut p = vec![1.0; s.len];
        let g = vec![1.0; s.len];
        assert!(
            opt.step_slices(&mut state, s, &mut p, &g, &SingleRank)
                .is_err(),
            "case {k}: step"
        );
    }
}

#[test]
fn invalid_hyperparameters_are_rejected() {
    let d = AdamWConfig::default();
    for bad in [
        AdamWConfig { lr: -1e-3, ..d },
        AdamWConfig { eps: -1.0, ..d },
        AdamWConfig { beta1: 1.0, ..d },
        AdamWConfig { beta2: -0.1, ..d },
        AdamWConfig {
            weight_decay: -0.1,
            ..d
        },
        AdamWConfig { lr: f64::NAN, ..d },
        AdamWConfig {
            eps: f64::INFINITY,
            ..d
        },
        // ε = 0 (torch takes it) divides 0 by 0 where a gradient is zero; 1e-50 is 0 in f32.
        AdamWConfig { eps: 0.0, ..d },
        AdamWConfig { eps: 1e-50, ..d },
        // Finite in f64, infinite in the f32 the kernels use.
        AdamWConfig { lr: 1e39, ..d },
        AdamWConfig {
            lr: 1e30,
            weight_decay: 1e10,
            ..d
        },
    ] {
        assert!(AdamW::new(bad).is_err(), "{bad:?}");
    }
    assert!(AdamW::new(AdamWConfig {
        beta1: 0.0,
        weight_decay: 0.0,
        ..d
    })
    .is_ok());
}

/// A role's rate `lr·lr_scale` and decay `lr·lr_scale·wd` are what a step multiplies by:
/// each value finite alone does not make their product finite, so the products are checked
/// (these wrote NaN into the parameters and the step returned `Ok`).
#[test]
fn role_rates_whose_products_overflow_are_refused() {
    let d = AdamWConfig::default();
    let role = |lr_scale: f64, weight_decay: Option<f64>| RoleRule {
        matrix: RoleSettings {
            lr_scale,
            weight_decay,
        },
        ..RoleRule::default()
    };
    for roles in [
        role(1e300, None),
        role(1.0, Some(1e300)),
        role(1e30, Some(1e10)),
    ] {
        let err = AdamW::new(AdamWConfig { roles, ..d })
            .unwrap_err()
            .to_string();
        assert!(err.contains("matrix lr·lr_scale"), "{err}");
    }
    // A role at rate 0 (lr_scale 0) is frozen in place, and that is fine.
    assert!(AdamW::new(AdamWConfig {
        roles: role(0.0, Some(1e300)),
        ..d
    })
    .is_ok());
}

/// The rates of 0 and of [1.2e-38, 2^64] are accepted: a rate that is subnormal in f32 is not
/// (it would scale anything kept in proportion by up to 1e45), nor one whose update can
/// overflow f32 (`lr = 3e38` is finite, its updates were not). Refusals write the value as
/// `1e-300` (they printed its 300 decimal digits).
#[test]
fn learning_rates_are_zero_or_normal_up_to_two_to_the_64() {
    let d = AdamWConfig::default();
    for lr in [
        0.0,
        1e-6,
        1e-3,
        10.0,
        f64::from(f32::MIN_POSITIVE),
        MAX_LEARNING_RATE,
    ] {
        assert!(
            AdamW::new(AdamWConfig {
                lr,
                weight_decay: 0.0,
                ..d
            })
            .is_ok(),
            "{lr}"
        );
    }
    for lr in [1e-40, 1e-300, 2.0 * MAX_LEARNING_RATE, 3e38, f64::INFINITY] {
        let err = AdamW::new(AdamWConfig {
            lr,
            weight_decay: 0.0,
            ..d
        })
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("learning rate must be 0 or lie in"),
            "{err}"
        );
        // The rate as written (`1e-300`), not its 300 decimal digits.
        let text = err.to_string();
        assert!(
            text.contains(&format!("lr = {lr:?}:")) && text.len() < 300,
            "{text}"
        );
    }
    // Every hyperparameter likewise: `weight_decay = 1e300`, not 301 digits.
    let err = AdamW::new(AdamWConfig {
        weight_decay: 1e300,
        ..d
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("weight_decay = 1e300:"), "{err}");
}

/// `set_learning_rate` checks what construction checks, at the new rate: a decay or a role's
/// rate finite at the configured rate can overflow at the next. Refused, the rate stays.
#[test]
fn set_learning_rate_rechecks_the_decay_and_role_rates() {
    let mut opt = AdamW::new(AdamWConfig {
        weight_decay: 1e15,
        ..AdamWConfig::default()
    })
    .unwrap();
    let err = opt.set_learning_rate(1e5).unwrap_err().to_string();
    assert!(err.contains("lr·weight_decay"), "{err}");
    assert_eq!(opt.learning_rate(), Some(1e-3));
    opt.set_learning_rate(1e-4).unwrap();

    let mut opt = AdamW::new(AdamWConfig {
        roles: RoleRule {
            fp32_state: RoleSettings {
                lr_scale: 1e15,
                weight_decay: Some(0.0),
            },
            ..RoleRule::default()
        },
        ..AdamWConfig::default()
    })
    .unwrap();
    let err = opt.set_learning_rate(1e5).unwrap_err().to_string();
    assert!(err.contains("fp32-state lr·lr_scale"), "{err}");
    assert_eq!(opt.config().lr, 1e-3);
    // An 8-bit Adam steps with the same AdamW rates, and checks them the same way.
    let mut a8 = Adam8bit::new(Adam8bitConfig {
        adam: *opt.config(),
        ..Adam8bitConfig::default()
    })
    .unwrap();
    assert!(a8.set_learning_rate(1e5).is_err());
    assert_eq!(a8.learning_rate(), Some(1e-3));
}

/// At the smallest ε accepted, elements whose gradient has always been zero stay where they
/// are: `0 / (0 + ε) = 0`, not NaN.
#[test]
fn the_smallest_eps_keeps_zero_gradients_finite() {
    let spec = specs(&[&[4, 4]]);
    let shard = whole_shard(&spec);
    let opt = AdamW::new(AdamWConfig {
        eps: common::MIN_EPS,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    })
    .unwrap();
    let mut state = opt.init(&shard).unwrap();
    let mut p = vec![0.5; shard.len];
    let mut g = vec![0.0; shard.len];
    g[0] = 1.0;
    for _ in 0..3 {
        opt.step_slices(&mut state, &shard, &mut p, &g, &SingleRank)
            .unwrap();
    }
    assert!(p.iter().all(|x| x.is_finite()), "{p:?}");
    assert!(p[1..].iter().all(|&x| x == 0.5), "{p:?}");
    assert!(p[0] < 0.5);
}

#[test]
fn defaults_are_torch_adamw_defaults() {
    let c = AdamWConfig::default();
    assert_eq!(
        (c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, c.decay_rule),
        (1e-3, 0.9, 0.999, 1e-8, 1e-2, DecayRule::All)
    );
    assert_eq!(AdamW::default().config(), &c);
}

#[test]
fn adamw_needs_element_blocks_and_starts_from_zero_state() {
    let opt = AdamW::default();
    assert_eq!(opt.name(), "adamw");
    assert_eq!(opt.atomic_block("w", &[128, 64]), AtomicBlock::Element);
    assert_eq!(opt.atomic_block("b", &[64]), AtomicBlock::Element);
    let spec = specs(&SHAPES);
    for shard in planned_shards(&opt, &spec, 3, &PlanOptions::default()) {
        let state = opt.init(&shard).unwrap();
        assert_eq!(state.step, 0);
        assert_eq!(state.m.len(), shard.len);
        assert!(state
            .m
            .cpu()
            .unwrap()
            .iter()
            .chain(state.v.cpu().unwrap())
            .all(|x| x.to_bits() == 0));
    }
}
