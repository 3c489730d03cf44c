//! 8-bit Adam's kernel builds (portable, AVX2 + FMA, AVX-512 F/BW/VBMI) compute the same bits:
//! whole steps through `Optimizer::step` on every build this CPU has, from random states that
//! use every code and edge scales, on gradients with zeros, signed zeros, subnormals, huge and
//! non-finite values, with fallback pieces, short row blocks and 32-element scale blocks; and
//! the step shared with rayon's workers computes the same bits as on the calling thread.

use ragged::comm::SingleRank;
use ragged::model::{DType, TensorSpec};
use ragged::optim::Optimizer;
use ragged_optimizers::quant::encode_scale;
use ragged_optimizers::{
    Adam8bit, Adam8bitConfig, Adam8bitKernel, Adam8bitState, AdamWConfig, DecayRule,
};

mod harness;
use harness::{bits, whole_shard_by, Rng};

/// Shapes that reach every loop edge: full 32-row blocks (`[64, 320]`: 40 scale blocks of
/// 256), a short row block that ends in a 128-element scale block (`[100, 96]`: 4 rows),
/// stacked matrices with `m % 32 ≠ 0` (`[3, 50, 96]`: an 18-row block ending in 192), a
/// single-row block of 32 elements (`[33, 32]`), a 1-D fallback and an embedding fallback.
/// `[64, 320]`'s 10 240-element row blocks are cut into a work item of 8192 elements and one
/// of 2048, `bias.long`'s 20 000 into two fallback items.
const SHAPES: [(&str, &[usize]); 7] = [
    ("layer.w", &[64, 320]),
    ("bias.long", &[20000]),
    ("layer.short", &[100, 96]),
    ("experts.w", &[3, 50, 96]),
    ("narrow", &[33, 32]),
    ("norm", &[300]),
    ("embed_tokens", &[64, 64]),
];

fn specs() -> Vec<TensorSpec> {
    SHAPES
        .iter()
        .map(|(name, shape)| TensorSpec::new(*name, shape, DType::F32).unwrap())
        .collect()
}

/// A value from a mix that hits the edges: ordinary, exact zeros of both signs, subnormals,
/// tiny normals, and where `wild`, huge (whose square overflows), infinities and NaN (one of
/// those makes its whole scale block non-finite, so they are kept to some blocks).
fn edgy(rng: &mut Rng, scale: f32, wild: bool) -> f32 {
    match rng.next_u64() % 64 {
        0 => 0.0,
        1 => -0.0,
        2 => rng.signed(1e-45, 1e-38), // subnormal
        3 => rng.signed(1e-30, 1e-20),
        4 if wild => rng.signed(1e18, 1e20), // g² overflows above ~1.8e19
        5 if wild && rng.next_u64().is_multiple_of(8) => f32::INFINITY,
        6 if wild && rng.next_u64().is_multiple_of(8) => f32::NAN,
        _ => rng.signed(0.0, scale),
    }
}

/// A random 8-bit state: every code value occurs, and the scales include zero, subnormal
/// (encoded as zero), tiny, ordinary, huge and infinite ones.
fn random_state(opt: &Adam8bit, shard: &ragged::optim::LocalShard, rng: &mut Rng) -> Adam8bitState {
    let mut s = opt.init(shard).unwrap();
    s.step = 4;
    for c in
        s.m.cpu_mut()
            .unwrap()
            .iter_mut()
            .chain(s.v.cpu_mut().unwrap().iter_mut())
    {
        *c = rng.next_u64() as u8;
    }
    for x in s
        .scale_m
        .cpu_mut()
        .unwrap()
        .iter_mut()
        .chain(s.scale_v.cpu_mut().unwrap().iter_mut())
    {
        *x = match rng.next_u64() % 40 {
            0 => 0,
            1 => encode_scale(1e-40),
            2 => encode_scale(rng.uniform(1e-30, 1e-20)),
            3 => encode_scale(rng.uniform(1e20, 1e30)),
            4 => encode_scale(f32::INFINITY),
            _ => encode_scale(rng.uniform(1e-6, 1.0)),
        };
    }
    for x in s.m32.cpu_mut().unwrap().iter_mut() {
        *x = rng.signed(0.0, 0.1);
    }
    for x in s.v32.cpu_mut().unwrap().iter_mut() {
        *x = rng.uniform(0.0, 0.01);
    }
    s
}

/// Params, state and every step's codes after `steps` steps on `kernel`; steps of at least
/// `parallel_min` elements shared with rayon's workers.
fn run(
    config: Adam8bitConfig,
    (kernel, parallel_min): (Adam8bitKernel, usize),
    steps: usize,
    seed: u64,
) -> (Vec<u32>, Adam8bitState, Adam8bitState) {
    let opt = Adam8bit::new(config)
        .unwrap()
        .with_kernel(kernel)
        .unwrap()
        .with_parallel_min(parallel_min)
        .unwrap();
    assert_eq!(opt.kernel(), kernel);
    let specs = specs();
    let shard = whole_shard_by(&specs, &|t| opt.atomic_block(&t.name, &t.shape));
    let mut rng = Rng::new(seed);
    let state0 = random_state(&opt, &shard, &mut rng);
    let mut state = state0.try_clone().unwrap();
    let mut params: Vec<f32> = (0..shard.len).map(|_| edgy(&mut rng, 2.0, true)).collect();
    for _ in 0..steps {
        let grads: Vec<f32> = (0..shard.len)
            .map(|i| edgy(&mut rng, 0.05, (i / 4096) % 4 == 0))
            .collect();
        opt.step_slices(&mut state, &shard, &mut params, &grads, &SingleRank)
            .unwrap();
    }
    (bits(&params), state0, state)
}

/// The bits of `x`, every NaN as one: a NaN parameter stays NaN in every build, but which
/// NaN's sign and payload survive depends on operand order (x86 returns the first NaN
/// operand, and the compiler may commute an addition), so builds agree on NaN-ness only.
/// Codes and scales are integers and compared exactly; the fallback moments are compared
/// the same way as the parameters.
fn nan_as_one(b: u32) -> u32 {
    if f32::from_bits(b).is_nan() {
        f32::NAN.to_bits()
    } else {
        b
    }
}

/// A state's fields as comparable bits (NaN as one NaN in the `f32` ones).
type StateBits = (
    u64,
    Vec<u8>,
    Vec<u8>,
    Vec<u16>,
    Vec<u16>,
    Vec<u32>,
    Vec<u32>,
);

fn state_bits(s: &Adam8bitState) -> StateBits {
    (
        s.step,
        s.m.to_vec().unwrap(),
        s.v.to_vec().unwrap(),
        s.scale_m.to_vec().unwrap(),
        s.scale_v.to_vec().unwrap(),
        bits(s.m32.cpu().unwrap())
            .into_iter()
            .map(nan_as_one)
            .collect(),
        bits(s.v32.cpu().unwrap())
            .into_iter()
            .map(nan_as_one)
            .collect(),
    )
}

fn configs() -> [(&'static str, Adam8bitConfig); 2] {
    let base = Adam8bitConfig {
        min_8bit_size: 1024,
        ..Adam8bitConfig::default()
    };
    [
        // Decay on every parameter, β₁ = 0.9: torch's small-weight `lerp` branch.
        (
            "decay, small lerp weight",
            Adam8bitConfig {
                adam: AdamWConfig {
                    weight_decay: 0.1,
                    decay_rule: DecayRule::All,
                    ..AdamWConfig::default()
                },
                ..base
            },
        ),
        // No decay, β₁ = 0.3: the large-weight branch; a large ε.
        (
            "no decay, large lerp weight",
            Adam8bitConfig {
                adam: AdamWConfig {
                    beta1: 0.3,
                    eps: 1e-3,
                    weight_decay: 0.0,
                    ..AdamWConfig::default()
                },
                ..base
            },
        ),
    ]
}

#[test]
fn every_kernel_build_steps_to_the_same_bits_as_the_portable_one() {
    let available: Vec<Adam8bitKernel> = Adam8bitKernel::ALL
        .into_iter()
        .filter(|k| k.is_available())
        .collect();
    println!("kernel builds on this CPU: {available:?}");
    for (what, config) in configs() {
        // The reference: the portable build, every item on the calling thread.
        let reference = (Adam8bitKernel::Portable, usize::MAX);
        let (p_ref, s0, s_ref) = run(config, reference, 3, 7);
        // The inputs have teeth: all 256 codes occur in the start state, the steps move codes,
        // scales and parameters, and some parameters stay finite.
        for codes in [s0.m.cpu().unwrap(), s0.v.cpu().unwrap()] {
            let mut seen = [false; 256];
            codes.iter().for_each(|&c| seen[c as usize] = true);
            assert!(seen.iter().all(|&x| x), "{what}: not every code occurs");
        }
        let changed =
            s0.m.cpu()
                .unwrap()
                .iter()
                .zip(s_ref.m.cpu().unwrap())
                .filter(|(a, b)| a != b)
                .count();
        assert!(
            changed > s0.m.len() / 4,
            "{what}: only {changed} m codes moved"
        );
        assert_ne!(
            s0.scale_v, s_ref.scale_v,
            "{what}: the v scales never moved"
        );
        let finite = p_ref
            .iter()
            .filter(|&&b| f32::from_bits(b).is_finite())
            .count();
        let nan = p_ref
            .iter()
            .filter(|&&b| f32::from_bits(b).is_nan())
            .count();
        assert!(
            finite > p_ref.len() / 2,
            "{what}: {finite} finite parameters"
        );
        assert!(nan > 0, "{what}: no NaN reached a parameter");
        // Every build, on the calling thread and always shared (on rayon's threads: 2 or more
        // in CI, so the helpers run items).
        let runs = available.iter().flat_map(|&k| [(k, usize::MAX), (k, 0)]);
        for kernel in runs {
            let (p, _, s) = run(config, kernel, 3, 7);
            let diffs: Vec<(usize, f32, f32)> = p
                .iter()
                .zip(&p_ref)
                .enumerate()
                .filter(|(_, (a, b))| nan_as_one(**a) != nan_as_one(**b))
                .map(|(i, (&a, &b))| (i, f32::from_bits(a), f32::from_bits(b)))
                .collect();
            assert!(
                diffs.is_empty(),
                "{what}: {kernel:?} differs in {} parameters, first {:?}",
                diffs.len(),
                &diffs[..diffs.len().min(4)]
            );
            assert!(
                state_bits(&s) == state_bits(&s_ref),
                "{what}: {kernel:?}'s state differs from the portable build's"
            );
        }
    }
}

#[test]
fn a_kernel_this_cpu_lacks_is_refused_and_the_default_is_the_fastest_available() {
    let opt = Adam8bit::new(Adam8bitConfig::default()).unwrap();
    assert_eq!(opt.kernel(), Adam8bitKernel::detect());
    assert!(opt.kernel().is_available());
    for kernel in Adam8bitKernel::ALL {
        let chosen = Adam8bit::new(Adam8bitConfig::default())
            .unwrap()
            .with_kernel(kernel);
        assert_eq!(chosen.is_ok(), kernel.is_available(), "{kernel:?}");
    }
    // Nothing faster than the detected build is available.
    let rank = |k: Adam8bitKernel| Adam8bitKernel::ALL.iter().position(|&x| x == k);
    for kernel in Adam8bitKernel::ALL {
        if kernel.is_available() {
            assert!(rank(kernel) <= rank(Adam8bitKernel::detect()));
        }
    }
}
