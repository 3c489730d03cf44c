//! Device optimizer steps against the CPU steps (feature `cuda`). Each test opens device 0
//! through the gate; without a driver or GPU it prints `skipped: <reason>` and returns.
//!
//! Tolerances: AdamW, 8-bit Adam and Muon's element steps perform the CPU's operations in the
//! CPU's order with no FMA (kernels compiled with `--fmad=false`), so they are compared **bit
//! for bit**. Newton–Schulz goes through cuBLAS, which sums dot products in its own blocked
//! order with FMAs: `f32` results are compared within `2e-3` absolute per entry (rounding
//! differences of ~1e-7 relative per product, amplified by up to `a⁵ ≈ 480` along the smallest
//! singular directions over 5 quintic steps), bf16 within a relative Frobenius error of `5e-2`
//! (8 significant bits per operand).
#![cfg(feature = "cuda")]

use std::sync::Arc;

use ragged::checkpoint::{CheckpointState, FieldArray, FieldData, FieldLayout};
use ragged::comm::{Communicator, SingleRank};
use ragged::cuda::Device;
use ragged::model::{DType, TensorSpec};
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::PlanOptions;
use ragged::storage::Placement;
use ragged_optimizers::cuda::orthogonalize_cuda;
use ragged_optimizers::newton_schulz::{NsMethod, NsPrecision};
use ragged_optimizers::quant::{dynamic_map, quantize};
use ragged_optimizers::{
    orthogonalize, Adam8bit, Adam8bitConfig, Adam8bitState, AdamW, AdamWConfig, DecayRule,
    Grafting, Muon, MuonConfig, MuonState, NsConfig, Shampoo, ShampooConfig, ShampooState,
};

mod harness;
use harness::{
    bits, device, globals, planned_shards, scatter, specs, split_case, split_rows, whole_shard_by,
    Rng,
};

const STEPS: usize = 3;

/// Local parameters and the state after some steps.
type Trained<S> = (Vec<f32>, S);

/// `opt`'s steps on `shard` from the local parameters `p` with the local gradients `grads`,
/// once on host memory and once on device memory (state from `init_on`): the parameters and
/// states of both, the device ones still on the device.
fn host_and_device<O: Optimizer>(
    opt: &O,
    shard: &LocalShard,
    dev: &Arc<Device>,
    mut p: Vec<f32>,
    grads: &[Vec<f32>],
) -> (Trained<O::State>, Trained<O::State>) {
    let mut state = opt.init(shard).unwrap();
    let mut dp = dev.upload(&p).unwrap();
    let mut ds = opt.init_on(shard, &Placement::Cuda(dev.clone())).unwrap();
    for g in grads {
        opt.step_slices(&mut state, shard, &mut p, g, &SingleRank)
            .unwrap();
        let dg = dev.upload(g).unwrap();
        let (pv, gv) = (dp.slice_mut(..).into(), dg.slice(..).into());
        opt.step(&mut ds, shard, pv, gv, &SingleRank).unwrap();
    }
    ((p, state), (dev.download(&dp).unwrap(), ds))
}

/// [`host_and_device`] on every rank's planned shard of `spec` at each of `worlds`, `steps`
/// steps from parameters and gradients drawn from `seed + world` (the parameters once per
/// world, then each rank's gradients in rank order); `check` gets the world, the shard and
/// both results.
fn each_rank_host_and_device<O: Optimizer>(
    opt: &O,
    spec: &[TensorSpec],
    dev: &Arc<Device>,
    (worlds, seed, steps): (&[usize], u64, usize),
    mut check: impl FnMut(usize, &LocalShard, Trained<O::State>, Trained<O::State>),
) {
    for &world in worlds {
        let shards = planned_shards(opt, spec, world, &PlanOptions::default());
        let mut rng = Rng::new(seed + world as u64);
        let p0 = globals(spec, &mut rng, 1.0);
        for shard in &shards {
            let grads: Vec<Vec<f32>> = (0..steps)
                .map(|_| scatter(shard, &globals(spec, &mut rng, 0.1)))
                .collect();
            let (host, device) = host_and_device(opt, shard, dev, scatter(shard, &p0), &grads);
            check(world, shard, host, device);
        }
    }
}

/// Bitwise equality of the moments `[m, v]` of a host and a device state (AdamW's or Muon's).
fn assert_moments_equal(
    host: [&ragged::storage::Storage<f32>; 2],
    dev: [&ragged::storage::Storage<f32>; 2],
) {
    for ((h, d), what) in host.into_iter().zip(dev).zip(["m", "v"]) {
        assert_eq!(bits(h.cpu().unwrap()), bits(&d.to_vec().unwrap()), "{what}");
    }
}

/// Equal bits, or both NaN (a GPU's arithmetic writes its canonical NaN, not the CPU's
/// payload; every other value must match bit for bit).
fn same_or_both_nan(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{what}[{i}]: device {g:e} ({:#010x}), host {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

/// Every array of an 8-bit state and the parameters, device against host.
fn assert_adam8bit_equal(
    (p, state): &Trained<Adam8bitState>,
    (dp, ds): &Trained<Adam8bitState>,
    what: &str,
) {
    let got = ds.to_placement(&Placement::Cpu).unwrap();
    assert_eq!(got.step, state.step, "{what}: step");
    same_or_both_nan(dp, p, &format!("{what}: params"));
    assert_eq!(got.m, state.m, "{what}: m codes");
    assert_eq!(got.v, state.v, "{what}: v codes");
    assert_eq!(got.scale_m, state.scale_m, "{what}: scale_m");
    assert_eq!(got.scale_v, state.scale_v, "{what}: scale_v");
    assert_eq!(got.m32, state.m32, "{what}: m32");
    assert_eq!(got.v32, state.v32, "{what}: v32");
}

#[test]
fn adamw_step_cuda_is_bitwise_equal_to_cpu() {
    let Some(dev) = device() else { return };
    let spec = specs(&[
        ("w0", &[64, 96]),
        ("b0", &[33]),
        ("w1", &[5, 7]),
        ("experts", &[3, 64, 64]),
    ]);
    let opt = AdamW::new(AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    })
    .unwrap();
    let run = (&[1, 3][..], 7, STEPS);
    each_rank_host_and_device(&opt, &spec, &dev, run, |_, _, (p, state), (dp, ds)| {
        assert_eq!(ds.step, state.step);
        assert_eq!(bits(&dp), bits(&p), "params");
        assert_moments_equal([&state.m, &state.v], [&ds.m, &ds.v]);
    });
}

#[test]
fn adam8bit_step_cuda_is_bitwise_equal_to_cpu() {
    let Some(dev) = device() else { return };
    let spec = specs(&[
        ("w0", &[64, 96]),
        ("w1", &[100, 64]),
        ("experts", &[3, 64, 64]),
        ("odd_experts", &[3, 40, 64]),
        ("bias", &[33]),
        ("embed", &[128, 64]),
    ]);
    let opt = Adam8bit::new(Adam8bitConfig {
        min_8bit_size: 1024,
        ..Default::default()
    })
    .unwrap();
    let run = (&[1, 2, 3][..], 11, STEPS);
    each_rank_host_and_device(&opt, &spec, &dev, run, |_, _, host, device| {
        assert_adam8bit_equal(&host, &device, "sharded")
    });
}

/// Protects each 8-bit parameter's own decay factor on the device (`segments` in
/// optimizers/src/cuda/adam8bit.rs reads it from the piece's parameter): with `NoDecayFor1D`,
/// large 1-D gains held in 8 bits are not decayed while the matrices beside them are, and the
/// device step equals the CPU's bitwise on every rank of worlds of 1 and 2. The other 8-bit
/// tests decay every parameter by one factor, so a factor taken from another parameter (the
/// shard's first, say) passed them.
#[test]
fn adam8bit_device_step_decays_each_8bit_parameter_by_its_own_rule() {
    let Some(dev) = device() else { return };
    let spec = specs(&[
        ("norm", &[2048]),
        ("w0", &[64, 96]),
        ("gain", &[1536]),
        ("w1", &[40, 64]),
    ]);
    let opt = Adam8bit::new(Adam8bitConfig {
        adam: AdamWConfig {
            lr: 1e-2,
            weight_decay: 0.1,
            decay_rule: DecayRule::NoDecayFor1D,
            ..Default::default()
        },
        min_8bit_size: 1024,
    })
    .unwrap();
    let run = (&[1, 2][..], 31, STEPS);
    each_rank_host_and_device(&opt, &spec, &dev, run, |world, shard, host, device| {
        let what = format!("world {world}, rank {}", shard.rank);
        assert_adam8bit_equal(&host, &device, &what);
    });
}

/// Shampoo's device step (`kernels/shampoo.cu`, roots on the host) against the host step:
/// the parameters and every state array (filtered gradient, grafting accumulator, factors,
/// roots) **bitwise**, at worlds 1 and 3, over parameters that give blocks of every order
/// (`[.., 1]` columns: `L` only; 1-D and one-row tails: `R` only; a single element: none),
/// 16-row blocks with 16-column chunks, and four settings: Adam grafting with weight decay
/// and roots every 2 steps; no grafting, `β₁ = 0` and decayed, bias-corrected factors
/// (`β₂ = 0.99`); AdaGrad grafting alone until the start step 4; and 48-row blocks (products
/// of several 32 × 32 output tiles and 16-term slices). A non-finite gradient is an
/// `Err` that leaves the device parameters and the state as they were.
#[test]
fn shampoo_device_step_is_bitwise_the_host_step() {
    let Some(dev) = device() else { return };
    let spec = specs(&[
        ("w0", &[40, 24]),
        ("bias", &[33]),
        ("experts", &[2, 20, 16]),
        ("column", &[20, 1]),
        ("scale", &[1]),
        ("wide", &[50, 70]),
    ]);
    let base = ShampooConfig {
        lr: 1e-2,
        max_preconditioner_dim: 16,
        ..Default::default()
    };
    let configs = [
        ShampooConfig {
            weight_decay: 1e-2,
            precondition_frequency: 2,
            grafting: Grafting::Adam {
                beta2: 0.999,
                eps: 1e-8,
            },
            ..base
        },
        ShampooConfig {
            beta1: 0.0,
            beta2: 0.99,
            ..base
        },
        ShampooConfig {
            precondition_frequency: 2,
            start_preconditioning_step: Some(4),
            grafting: Grafting::ADAGRAD,
            ..base
        },
        ShampooConfig {
            max_preconditioner_dim: 48,
            grafting: Grafting::ADAM,
            ..base
        },
    ];
    for (k, config) in configs.into_iter().enumerate() {
        let opt = Shampoo::new(config).unwrap();
        let run = (&[1, 3][..], 11 + k as u64, 5);
        each_rank_host_and_device(
            &opt,
            &spec,
            &dev,
            run,
            |world, shard, (p, state), (dp, ds)| {
                let what = format!("config {k}, world {world}, rank {}", shard.rank);
                let identity = opt.init(shard).unwrap().roots;
                assert!(state.roots != identity, "{what}: roots recomputed");
                same_bits(&dp, &p, &format!("{what}: params"));
                assert_shampoo_equal(&state, &ds, &what);
            },
        );
    }

    let opt = Shampoo::new(configs[0]).unwrap();
    let shard = &planned_shards(&opt, &spec, 1, &PlanOptions::default())[0];
    let mut rng = Rng::new(3);
    let p0 = scatter(shard, &globals(&spec, &mut rng, 1.0));
    let mut grads = scatter(shard, &globals(&spec, &mut rng, 0.1));
    let mut state = opt.init_on(shard, &Placement::Cuda(dev.clone())).unwrap();
    let mut dp = dev.upload(&p0).unwrap();
    grads[7] = f32::NAN;
    let dg = dev.upload(&grads).unwrap();
    let (pv, gv) = (dp.slice_mut(..).into(), dg.slice(..).into());
    let err = opt
        .step(&mut state, shard, pv, gv, &SingleRank)
        .unwrap_err();
    assert!(err.to_string().contains("1 non-finite"), "{err}");
    assert_eq!(bits(&dev.download(&dp).unwrap()), bits(&p0), "params kept");
    assert_shampoo_equal(&opt.init(shard).unwrap(), &state, "state kept");
}

/// The device products add their four `f64` lanes in the host's order, `(s₀ + s₁) + (s₂ + s₃)`:
/// gradient rows `[1, 0, 2³⁰, 2³⁰]` and `[1, 0, 2³⁰, −2³⁰]` make the lanes of `L[0][1]`
/// `1, 0, 2⁶⁰, −2⁶⁰`, which sum to 1 in that order and to 0 left to right (`1 + 2⁶⁰` rounds
/// to `2⁶⁰` in `f64`). Random data cannot tell the orders apart: the `f32` rounding hides it.
#[test]
fn shampoo_device_products_add_their_lanes_in_the_hosts_order() {
    let Some(dev) = device() else { return };
    let spec = specs(&[("w", &[2, 4])]);
    let opt = Shampoo::new(ShampooConfig {
        max_preconditioner_dim: 16,
        ..Default::default()
    })
    .unwrap();
    let shard = &planned_shards(&opt, &spec, 1, &PlanOptions::default())[0];
    let big = (1u32 << 30) as f32;
    let g = scatter(shard, &[vec![1.0, 0.0, big, big, 1.0, 0.0, big, -big]]);
    let p = scatter(shard, &[vec![0.5; 8]]);
    let ((p, state), (dp, ds)) = host_and_device(&opt, shard, &dev, p, &[g]);
    let (blocks, _) = opt.blocks(shard).unwrap();
    let l01 = state.factors.cpu().unwrap()[blocks[0].factor_at + 1];
    assert_eq!(l01, 1.0, "the host's L[0][1]: the case is sharp");
    same_bits(&dp, &p, "params");
    assert_shampoo_equal(&state, &ds, "state");
}

/// Bitwise equality of a host and a device Shampoo state (the device state brought to the
/// host by `ShampooState::to_placement`).
fn assert_shampoo_equal(host: &ShampooState, dev: &ShampooState, what: &str) {
    let dev = dev.to_placement(&Placement::Cpu).unwrap();
    assert_eq!(host.step, dev.step, "{what}: step");
    assert_eq!(
        host.root_failures, dev.root_failures,
        "{what}: root failures"
    );
    let fields = [
        (&host.m, &dev.m, "m"),
        (&host.v, &dev.v, "v"),
        (&host.factors, &dev.factors, "factors"),
        (&host.roots, &dev.roots, "roots"),
    ];
    for (h, d, name) in fields {
        let (h, d) = (h.cpu().unwrap(), d.cpu().unwrap());
        same_bits(d, h, &format!("{what}: {name}"));
    }
}

/// Equal lengths and bits, or the first element that differs.
fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}[{i}]: device {:e}, host {:e}", got[i], want[i]);
    }
}

/// Checkpoints of states in device memory ([`CheckpointState`] on device storage): every
/// field's spans, read from the device range by range, are the host state's bytes after the
/// same steps (bitwise: the steps are), a fresh device state filled span by span from those
/// bytes reads back the same, and so does a fresh one on another GPU thread rank that
/// receives every field by broadcast (an HSDP load's replicas: `FieldDataMut::as_buf_mut`,
/// `u16` scales as their bytes). 8-bit Adam has fields of all three element types; Shampoo
/// packed fields (factors and roots, by row block) beside shard-shaped ones.
#[test]
fn checkpoint_fields_of_device_states_read_and_fill_like_host_ones() {
    let Some(dev) = device() else { return };
    let spec = specs(&[
        ("w0", &[64, 96]),
        ("bias", &[33]),
        ("experts", &[3, 40, 64]),
    ]);
    let adam8bit = Adam8bit::new(Adam8bitConfig {
        min_8bit_size: 1024,
        ..Default::default()
    })
    .unwrap();
    fields_round_trip(&adam8bit, &spec, &dev);
    fields_round_trip(&AdamW::new(AdamWConfig::default()).unwrap(), &spec, &dev);
    let shampoo = Shampoo::new(ShampooConfig {
        max_preconditioner_dim: 16,
        grafting: Grafting::ADAM,
        ..Default::default()
    })
    .unwrap();
    fields_round_trip(&shampoo, &spec, &dev);
}

/// Every field's spans of `data` as bytes, in the layout's order.
fn span_bytes(layout: &[FieldLayout], data: &[FieldData<'_>]) -> Vec<Vec<u8>> {
    assert_eq!(layout.len(), data.len());
    layout
        .iter()
        .zip(data)
        .map(|(f, d)| {
            let mut out = Vec::new();
            for s in &f.spans {
                let range = s.local..s.local + s.global.len();
                d.with_bytes(range, |b| {
                    out.extend_from_slice(b);
                    Ok(())
                })
                .unwrap();
            }
            out
        })
        .collect()
}

fn fields_round_trip<O: CheckpointState + Sync>(opt: &O, spec: &[TensorSpec], dev: &Arc<Device>) {
    let run = (&[1, 2][..], 5, 2);
    each_rank_host_and_device(
        opt,
        spec,
        dev,
        run,
        |_, shard, (_, host), (_, on_device)| {
            let layout = opt.state_layout(shard).unwrap();
            let want = span_bytes(&layout, &opt.state_data(&host).unwrap());
            let data = opt.state_data(&on_device).unwrap();
            let on_device_storage = |d: &FieldData<'_>| {
                matches!(
                    d,
                    FieldData::F32(FieldArray::Storage(_))
                        | FieldData::U16(FieldArray::Storage(_))
                        | FieldData::U8(FieldArray::Storage(_))
                )
            };
            assert!(
                data.iter().all(on_device_storage),
                "read from device storage"
            );
            assert_eq!(span_bytes(&layout, &data), want, "read from the device");
            let mut fresh = opt.init_on(shard, &Placement::Cuda(dev.clone())).unwrap();
            fill_spans(opt, &layout, &mut fresh, &want);
            let filled = span_bytes(&layout, &opt.state_data(&fresh).unwrap());
            assert_eq!(filled, want, "filled on the device");
            let received = ragged::cuda::threads::ThreadDeviceComm::run(dev.clone(), 2, |c| {
                let mut state = opt.init_on(shard, &Placement::Cuda(dev.clone()))?;
                if c.rank() == 0 {
                    fill_spans(opt, &layout, &mut state, &want);
                }
                for mut d in opt.state_data_mut(&mut state)? {
                    c.broadcast(d.as_buf_mut(), 0)?;
                }
                Ok(span_bytes(&layout, &opt.state_data(&state)?))
            })
            .unwrap();
            assert_eq!(received[1], want, "received by a device broadcast");
        },
    );
}

/// Fills every field's spans of `state` from `bytes` (each field's spans in order).
fn fill_spans<O: CheckpointState>(
    opt: &O,
    layout: &[FieldLayout],
    state: &mut O::State,
    bytes: &[Vec<u8>],
) {
    let fields = opt.state_data_mut(state).unwrap();
    for ((f, mut d), src) in layout.iter().zip(fields).zip(bytes) {
        let mut at = 0;
        for s in &f.spans {
            let n = s.global.len() * f.dtype.size();
            let range = s.local..s.local + s.global.len();
            d.fill_bytes(range, |b| {
                b.copy_from_slice(&src[at..at + n]);
                Ok(())
            })
            .unwrap();
            at += n;
        }
    }
}

/// More scale blocks than the grid has warps on an H200 (at most 132 multiprocessors × 8
/// resident thread blocks × 8 warps = 8448; cuda-emu reports those figures too), so warps
/// take several passes; and
/// every row block at its own magnitude, from 1e-38 (subnormal products) to 1e30, with
/// all-zero row blocks (zero scales, the zero codes) between, so the quantizer meets every
/// octave slot of both maps. Still bitwise.
#[test]
fn adam8bit_step_cuda_is_bitwise_equal_to_cpu_over_many_blocks_and_magnitudes() {
    let Some(dev) = device() else { return };
    let (rows, cols) = (1088, 2048); // 34 row blocks × 256 scale blocks = 8704
    let spec = specs(&[("w", &[rows, cols])]);
    let opt = Adam8bit::new(Adam8bitConfig::default()).unwrap();
    let shard = &planned_shards(&opt, &spec, 1, &PlanOptions::default())[0];
    let mut rng = Rng::new(5);
    let magnitude = |row_block: usize| match row_block % 5 {
        4 => 0.0,
        k => 10f32.powi(-38 + 17 * k as i32 + (row_block % 3) as i32),
    };
    let p0 = scatter(shard, &globals(&spec, &mut rng, 1.0));
    let grads: Vec<Vec<f32>> = (0..STEPS)
        .map(|_| {
            let g = rng.units(rows * cols);
            let g: Vec<f32> = (g.iter().enumerate())
                .map(|(i, x)| x * magnitude(i / (32 * cols)))
                .collect();
            scatter(shard, &[g])
        })
        .collect();
    let (host, device) = host_and_device(&opt, shard, &dev, p0, &grads);
    let blocks = host.1.scale_m.len();
    assert!(blocks > 8448, "{blocks} scale blocks");
    assert_adam8bit_equal(&host, &device, "many blocks");
}

#[test]
fn adam8bit_state_round_trips_through_the_device() {
    let Some(dev) = device() else { return };
    let spec = specs(&[("w0", &[64, 96]), ("bias", &[33])]);
    let opt = Adam8bit::new(Adam8bitConfig {
        min_8bit_size: 1024,
        ..Default::default()
    })
    .unwrap();
    let shard = &planned_shards(&opt, &spec, 1, &PlanOptions::default())[0];
    let mut state = opt.init(shard).unwrap();
    let mut rng = Rng::new(3);
    let mut p = scatter(shard, &globals(&spec, &mut rng, 1.0));
    let g = scatter(shard, &globals(&spec, &mut rng, 0.1));
    opt.step_slices(&mut state, shard, &mut p, &g, &SingleRank)
        .unwrap();
    let back = state
        .to_placement(&Placement::Cuda(dev.clone()))
        .and_then(|d| d.to_placement(&Placement::Cpu))
        .unwrap();
    assert_eq!(back, state);
}

/// Newton–Schulz fixed to the standard iteration, for the comparisons whose tolerance is the
/// standard iteration's (`NsMethod::Auto` takes Gram's for some shapes, on the host and on
/// the device alike).
fn standard_ns() -> NsConfig {
    NsConfig {
        method: NsMethod::Standard,
        ..Default::default()
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, |m, d| {
            if d.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(d)
            }
        })
}

/// The largest `|a − b|` (NaN if any difference is NaN: `f32::max` would drop it, so a NaN
/// from the device would pass a `<=` bound) and the relative Frobenius error.
fn diffs(a: &[f32], b: &[f32]) -> (f32, f64) {
    let max = max_abs_diff(a, b);
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (max, (num / den.max(1e-300)).sqrt())
}

#[test]
fn newton_schulz_cuda_matches_cpu_within_tolerance() {
    use ragged_optimizers::cuda::newton_schulz::{orthogonalize_cuda_with, GramProduct};
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(5);
    // (batch, rows, cols): wide, tall (transposed path), a stack, a square matrix, and one
    // with a short side of 256 (where `Auto` takes syrk in f32).
    let shapes = [
        (1, 32, 96),
        (1, 96, 40),
        (3, 48, 32),
        (2, 64, 64),
        (1, 256, 320),
    ];
    for (batch, rows, cols) in shapes {
        let x = rng.units(batch * rows * cols);
        let cases = [
            (NsPrecision::F32, GramProduct::Auto, 2e-3f32, 1e-3f64),
            (NsPrecision::F32, GramProduct::Gemm, 2e-3, 1e-3),
            (NsPrecision::F32, GramProduct::Syrk, 2e-3, 1e-3),
            (NsPrecision::Bf16, GramProduct::Auto, f32::INFINITY, 5e-2),
        ];
        // Both methods, each against the CPU's: Gram Newton–Schulz (the CPU's restarts too)
        // on every shape, including the square ones the `Auto` method leaves standard.
        for ((prec, gram, max_abs, max_rel), method) in cases
            .into_iter()
            .flat_map(|c| [(c, NsMethod::Standard), (c, NsMethod::Gram)])
        {
            // The CPU reference in the same precision (its bf16 path has the same semantics)
            // and the device's iteration.
            let cfg = NsConfig {
                precision: prec,
                method,
                ..standard_ns()
            };
            let mut want = x.clone();
            for m in want.chunks_mut(rows * cols) {
                orthogonalize(m, rows, cols, &cfg).unwrap();
            }
            let mut d = dev.upload(&x).unwrap();
            orthogonalize_cuda_with(&dev, &mut d.slice_mut(..), batch, rows, cols, &cfg, gram)
                .unwrap();
            let got = dev.download(&d).unwrap();
            let (abs, rel) = diffs(&got, &want);
            assert!(
                abs <= max_abs && rel <= max_rel,
                "{prec:?} {gram:?} {method:?} {batch}×{rows}×{cols}: max |Δ| = {abs}, \
                 relative {rel}"
            );
        }
    }
    // cuBLAS has no bf16 syrk: asked for, it is an error, not a silent GEMM.
    let cfg = NsConfig {
        precision: NsPrecision::Bf16,
        ..Default::default()
    };
    let mut d = dev.upload(&rng.units(64 * 64)).unwrap();
    let err = orthogonalize_cuda_with(
        &dev,
        &mut d.slice_mut(..),
        1,
        64,
        64,
        &cfg,
        GramProduct::Syrk,
    );
    assert!(err.is_err());
}

#[test]
fn newton_schulz_cuda_keeps_a_zero_matrix_zero() {
    let Some(dev) = device() else { return };
    let mut d = dev.zeros::<f32>(32 * 64).unwrap();
    orthogonalize_cuda(&dev, &mut d.slice_mut(..), 1, 32, 64, &NsConfig::default()).unwrap();
    assert!(dev.download(&d).unwrap().iter().all(|&x| x == 0.0));
    // A non-finite input makes every entry NaN, as on the CPU.
    let mut x = vec![0.5f32; 32 * 64];
    x[7] = f32::INFINITY;
    let mut d = dev.upload(&x).unwrap();
    orthogonalize_cuda(&dev, &mut d.slice_mut(..), 1, 32, 64, &NsConfig::default()).unwrap();
    assert!(dev.download(&d).unwrap().iter().all(|x| x.is_nan()));
}

/// The workspace a Newton–Schulz call declares: `X` and `Y` as long as the stack and two `s × s`
/// products per matrix (four for Gram's iteration) in the iteration's type, each padded to
/// start at a multiple of 256 bytes (64 `f32`, 128 bf16), the normalized stack in `f32`, 64
/// partial sums per matrix; a shape whose count overflows is an `Err`, not a wrapped size.
/// (No device needed.)
#[test]
fn newton_schulz_declares_its_workspace_and_refuses_an_overflowing_one() {
    use ragged_optimizers::cuda::newton_schulz::{NsNeed, NsShape, ALIGN_BYTES};
    assert_eq!(ALIGN_BYTES, 256);
    let need = |shape, precision, method| {
        let cfg = NsConfig {
            precision,
            method,
            ..Default::default()
        };
        let n = NsNeed::of(shape, &cfg).unwrap();
        (n.f32, n.bf16, n.f64)
    };
    use NsMethod::{Gram, Standard};
    use NsPrecision::{Bf16, F32};
    // A stack of 30 elements (one padded buffer: 64 f32, 128 bf16), products of 18.
    let small = NsShape::new(2, 5, 3);
    assert_eq!(need(small, F32, Standard), (2 * 64 + 2 * 64, 0, 128));
    assert_eq!(need(small, F32, Gram), (2 * 64 + 4 * 64, 0, 128));
    assert_eq!(need(small, Bf16, Standard), (30, 2 * 128 + 2 * 128, 128));
    assert_eq!(need(small, Bf16, Gram), (30, 2 * 128 + 4 * 128, 128));
    // 3 × 64 × 100: a stack of 19 200 (a multiple of both paddings), products of 3 × 64².
    let large = NsShape::new(3, 100, 64);
    assert_eq!(need(large, F32, Gram), (2 * 19_200 + 4 * 12_288, 0, 192));
    assert_eq!(
        need(large, Bf16, Standard),
        (19_200, 2 * 19_200 + 2 * 12_288, 192)
    );
    let huge = NsShape::new(1 << 40, 1 << 20, 1 << 20);
    assert!(NsNeed::of(huge, &NsConfig::default()).is_err());
}

/// One Newton–Schulz workspace kept over calls of other shapes, precisions and methods gives
/// the bits a fresh workspace gives: no call reads what an earlier one left. The calls run
/// largest first, each after one on a non-finite input, so the kept workspace holds
/// NaNs and other matrices' values wherever a later call could read before writing.
#[test]
fn a_kept_newton_schulz_workspace_gives_the_bits_of_a_fresh_one() {
    use ragged_optimizers::cuda::newton_schulz::{
        orthogonalize_cuda_in, GramProduct, NsShape, NsWorkspace,
    };
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(8);
    let mut kept = NsWorkspace::default();
    let shapes = [(2, 64, 96), (1, 96, 40), (3, 24, 24), (1, 16, 40)];
    for (i, (batch, rows, cols)) in shapes.into_iter().enumerate() {
        for (precision, method) in [
            (NsPrecision::F32, NsMethod::Gram),
            (NsPrecision::Bf16, NsMethod::Standard),
            (NsPrecision::F32, NsMethod::Standard),
            (NsPrecision::Bf16, NsMethod::Gram),
        ] {
            let cfg = NsConfig {
                precision,
                method,
                ..Default::default()
            };
            let shape = NsShape::new(batch, rows, cols);
            let run = |x: &[f32], work: &mut NsWorkspace| {
                let mut d = dev.upload(x).unwrap();
                let gram = GramProduct::Auto;
                orthogonalize_cuda_in(&dev, &mut d.slice_mut(..), shape, &cfg, gram, work).unwrap();
                dev.download(&d).unwrap()
            };
            let mut poison = rng.units(batch * rows * cols);
            poison[i] = f32::NAN;
            // Its first matrix all NaN (each matrix is normalized by its own norm).
            let poisoned = run(&poison, &mut kept);
            assert!(poisoned[..rows * cols].iter().all(|v| v.is_nan()));
            let x = rng.units(batch * rows * cols);
            let got = run(&x, &mut kept);
            let want = run(&x, &mut NsWorkspace::default());
            assert!(got.iter().all(|v| v.is_finite()));
            let what = format!("{precision:?} {method:?} {batch}×{rows}×{cols}");
            assert_eq!(bits(&got), bits(&want), "{what}");
        }
    }
    assert!(kept.bytes() > 0);
}

fn muon_shard(opt: &Muon, spec: &[TensorSpec]) -> LocalShard {
    whole_shard_by(spec, &|t| opt.atomic_block(&t.name, &t.shape))
}

/// `opt` on the whole-unit shard of `spec`, stepped `STEPS` times on the host and on `dev` from
/// parameters and gradients drawn from `seed`.
fn muon_host_and_device(
    opt: &Muon,
    spec: &[TensorSpec],
    dev: &Arc<Device>,
    seed: u64,
) -> (Trained<MuonState>, Trained<MuonState>) {
    let shard = muon_shard(opt, spec);
    let mut rng = Rng::new(seed);
    let p0 = scatter(&shard, &globals(spec, &mut rng, 1.0));
    let grads: Vec<Vec<f32>> = (0..STEPS)
        .map(|_| scatter(&shard, &globals(spec, &mut rng, 0.1)))
        .collect();
    host_and_device(opt, &shard, dev, p0, &grads)
}

#[test]
fn muon_step_cuda_matches_cpu_momentum_bitwise_and_params_within_tolerance() {
    let Some(dev) = device() else { return };
    let spec = specs(&[
        ("w0", &[64, 32]),
        ("w1", &[32, 96]),
        ("experts", &[2, 48, 32]),
        ("norm", &[17]),
        ("embed", &[40, 16]),
    ]);
    let opt = Muon::new(MuonConfig {
        lr: 1e-2,
        ns: standard_ns(),
        ..Default::default()
    })
    .unwrap();
    let ((p, state), (dp, ds)) = muon_host_and_device(&opt, &spec, &dev, 9);
    // Momentum and the AdamW moments never see Newton–Schulz: bitwise. The parameters differ
    // by lr·scale·(NS difference) per step: ≤ 3 · 1e-2 · 1.5 · 2e-3 ≈ 1e-4.
    assert_moments_equal([&state.m, &state.v], [&ds.m, &ds.v]);
    let (abs, _) = diffs(&dp, &p);
    assert!(abs <= 1e-4, "params: max |Δ| = {abs}");
}

/// Protects Muon's apply kernel bit for bit (`muon_apply`: `p·decay + (−lr·scale)·o`, the
/// CPU's operations in its order). With the identity Newton–Schulz step (`identity_ns`, whose
/// device result is the CPU's bit for bit) every part of the step is bitwise, so the
/// parameters must be too; the test above compares them within cuBLAS's tolerance, inside
/// which the decay applied after the update (`(p − lr·scale·o)·decay`, off by
/// lr²·scale·wd·o a step) passed.
#[test]
fn muon_device_step_with_the_identity_newton_schulz_is_bitwise_equal_to_cpu() {
    let Some(dev) = device() else { return };
    let spec = specs(&[
        ("w0", &[64, 32]),
        ("w1", &[32, 96]),
        ("experts", &[2, 48, 32]),
        ("norm", &[17]),
    ]);
    let opt = Muon::new(MuonConfig {
        lr: 0.05,
        weight_decay: 0.5,
        ns: identity_ns(NsPrecision::F32),
        ..Default::default()
    })
    .unwrap();
    let ((p, state), (dp, ds)) = muon_host_and_device(&opt, &spec, &dev, 21);
    assert_moments_equal([&state.m, &state.v], [&ds.m, &ds.v]);
    same_or_both_nan(&dp, &p, "params");
}

#[test]
fn muon_step_on_device_memory_refuses_host_state_and_host_gradients() {
    let Some(dev) = device() else { return };
    let spec = specs(&[("w0", &[48, 32]), ("b", &[7])]);
    let opt = Muon::new(MuonConfig::default()).unwrap();
    let shard = muon_shard(&opt, &spec);
    let mut host_state = opt.init(&shard).unwrap();
    let mut dp = dev.zeros::<f32>(shard.len).unwrap();
    let dg = dev.zeros::<f32>(shard.len).unwrap();
    let hg = vec![0.0f32; shard.len];
    let (pv, gv) = (dp.slice_mut(..).into(), dg.slice(..).into());
    let err = opt
        .step(&mut host_state, &shard, pv, gv, &SingleRank)
        .unwrap_err();
    assert!(err.to_string().contains("device memory"), "{err}");
    let mut ds = opt.init_on(&shard, &Placement::Cuda(dev.clone())).unwrap();
    let (pv, gv) = (dp.slice_mut(..).into(), (&hg).into());
    assert!(opt.step(&mut ds, &shard, pv, gv, &SingleRank).is_err());
    assert_eq!((host_state.step, ds.step), (0, 0), "nothing modified");
}

/// Sharded Muon with split matrices over thread ranks on one GPU (host Muon step, the
/// all-to-alls on device copies through the GPU thread ranks' device path, [`ViaDevice`]) is bitwise the CPU thread-rank run: data
/// movement is exact on both backends.
#[test]
fn sharded_muon_over_gpu_thread_ranks_equals_cpu_thread_ranks_bitwise() {
    use ragged::comm::threads::ThreadWorld;
    use ragged::comm::Communicator;
    use ragged::cuda::collective::ViaDevice;
    use ragged::cuda::threads::ThreadDeviceComm;
    let Some(dev) = device() else { return };
    let spec = specs(&[
        ("w0", &[48, 32]),
        ("w1", &[48, 32]),
        ("w2", &[48, 32]),
        ("b", &[7]),
    ]);
    let opt = Muon::new(MuonConfig::default()).unwrap();
    let world = 3;
    let shards = split_rows(&opt, &spec, world);
    let mut rng = Rng::new(21);
    let p0 = globals(&spec, &mut rng, 1.0);
    let grads: Vec<Vec<Vec<f32>>> = (0..STEPS).map(|_| globals(&spec, &mut rng, 0.1)).collect();
    let run = |rank: usize, comm: &dyn Communicator| -> ragged::Result<Vec<u32>> {
        let shard = &shards[rank];
        let mut p = scatter(shard, &p0);
        let mut state = opt.init(shard)?;
        for g in &grads {
            opt.step_slices(&mut state, shard, &mut p, &scatter(shard, g), comm)?;
        }
        Ok(bits(&p).into_iter().chain(bits(state.m.cpu()?)).collect())
    };
    let cpu = ThreadWorld::run(world, |c| run(c.rank(), c)).unwrap();
    let gpu = ThreadDeviceComm::run(dev, world, |c| {
        run(c.rank(), &ViaDevice::new(c, c.device()))
    })
    .unwrap();
    assert_eq!(gpu, cpu);
}

/// Each rank's parameters, momentum and second moment after `opt`'s steps on `grads` from
/// `p0`: on CPU thread ranks, then on thread ranks on one GPU (device memory, device
/// collectives).
#[allow(clippy::type_complexity)]
fn sharded_muon_on_cpu_and_gpu_threads(
    opt: &Muon,
    shards: &[LocalShard],
    dev: &Arc<Device>,
    p0: &[Vec<f32>],
    grads: &[Vec<Vec<f32>>],
) -> (
    Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>,
    Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>,
) {
    use ragged::comm::threads::ThreadWorld;
    use ragged::comm::Communicator;
    use ragged::cuda::threads::ThreadDeviceComm;
    let world = shards.len();
    let cpu = ThreadWorld::run(world, |c| {
        let shard = &shards[c.rank()];
        let (mut p, mut st) = (scatter(shard, p0), opt.init(shard)?);
        for g in grads {
            opt.step_slices(&mut st, shard, &mut p, &scatter(shard, g), c)?;
        }
        Ok((p, st.m.to_vec()?, st.v.to_vec()?))
    })
    .unwrap();
    let gpu = ThreadDeviceComm::run(dev.clone(), world, |c| {
        let (shard, d) = (&shards[c.rank()], c.device());
        let mut p = d.upload(&scatter(shard, p0))?;
        let mut st = opt.init_on(shard, &Placement::Cuda(dev.clone()))?;
        for g in grads {
            let g = d.upload(&scatter(shard, g))?;
            opt.step(
                &mut st,
                shard,
                p.slice_mut(..).into(),
                g.slice(..).into(),
                c,
            )?;
        }
        Ok((d.download(&p)?, st.m.to_vec()?, st.v.to_vec()?))
    })
    .unwrap();
    (cpu, gpu)
}

/// The device step on a split layout over thread ranks on one GPU (matrices gathered to their
/// roots with device copies and the device all-to-all) against the CPU sharded step: momentum
/// and the AdamW moments bitwise, parameters within the Newton–Schulz tolerance.
#[test]
fn muon_step_cuda_comm_on_split_matrices_matches_the_cpu_sharded_step() {
    use ragged::cuda::threads::ThreadDeviceComm;
    let Some(dev) = device() else { return };
    let opt = Muon::new(MuonConfig {
        lr: 1e-2,
        ns: standard_ns(),
        ..Default::default()
    })
    .unwrap();
    let (spec, p0, grads) = split_case(33, STEPS);
    let shards = split_rows(&opt, &spec, 3);
    let (cpu, gpu) = sharded_muon_on_cpu_and_gpu_threads(&opt, &shards, &dev, &p0, &grads);
    for (r, ((gp, gm, gv), (cp, cm, cv))) in gpu.iter().zip(&cpu).enumerate() {
        assert_eq!(bits(gm), bits(cm), "rank {r}: m");
        assert_eq!(bits(gv), bits(cv), "rank {r}: v");
        let (abs, _) = diffs(gp, cp);
        assert!(abs <= 1e-4, "rank {r}: params max |Δ| = {abs}");
    }
    // A communicator of another world is refused before anything changes.
    let lonely = ThreadDeviceComm::world(dev.clone(), 1).unwrap();
    let shard = shards.iter().find(|s| opt.roots(s).has_split()).unwrap();
    let d = lonely[0].device();
    let mut st = opt.init_on(shard, &Placement::Cuda(dev.clone())).unwrap();
    let mut p = d.zeros::<f32>(shard.len).unwrap();
    let g = d.zeros::<f32>(shard.len).unwrap();
    let (pv, gv) = (p.slice_mut(..).into(), g.slice(..).into());
    let err = opt.step(&mut st, shard, pv, gv, &lonely[0]).unwrap_err();
    assert!(
        matches!(err, ragged::Error::WorldSizeMismatch { .. }),
        "{err}"
    );
    assert_eq!(st.step, 0, "nothing modified");
}

/// With bf16 Newton–Schulz the device step's split matrices travel to their roots and back
/// in bf16 (as the host step's): bitwise the device step of the whole matrices on one rank,
/// since Newton–Schulz rounds its input to bf16 first and returns bf16 values.
#[test]
fn bf16_split_matrices_on_the_device_equal_whole_ones_bitwise() {
    let Some(dev) = device() else { return };
    let opt = Muon::new(MuonConfig {
        lr: 1e-2,
        ns: NsConfig {
            precision: NsPrecision::Bf16,
            ..standard_ns()
        },
        ..Default::default()
    })
    .unwrap();
    assert_eq!(opt.route_elem_bytes(), 2);
    let (spec, p0, grads) = split_case(35, STEPS);
    let shards = split_rows(&opt, &spec, 3);
    let whole = [muon_shard(&opt, &spec)];
    let (_, split) = sharded_muon_on_cpu_and_gpu_threads(&opt, &shards, &dev, &p0, &grads);
    let (_, one) = sharded_muon_on_cpu_and_gpu_threads(&opt, &whole, &dev, &p0, &grads);
    let numels: Vec<usize> = spec.iter().map(TensorSpec::numel).collect();
    let locals: Vec<Vec<f32>> = split.iter().map(|r| r.0.clone()).collect();
    let got = harness::gather(&shards, &locals, &numels);
    let want = harness::gather(&whole, &[one[0].0.clone()], &numels);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(bits(g), bits(w), "params of {}", spec[i].name);
    }
}

/// The GPU benchmark (`ragged bench optim --device cuda`) on tiny sizes: every row is a finite
/// positive rate with a positive same-run baseline, the 8-bit rows say the kernel's launch
/// shape (cuda-emu reports 0 registers), and the table names the device.
#[test]
fn gpu_bench_rows_are_finite_positive_rates_against_same_run_baselines() {
    use ragged_optimizers::cuda::bench::bench_gpu;
    let Some(dev) = device() else { return };
    let report = bench_gpu(&dev, true).unwrap();
    assert_eq!(report.rows.len(), 11, "{report:?}");
    assert!(report.rows[10].case.starts_with("Shampoo"), "{report:?}");
    for r in &report.rows {
        assert!(r.value.is_finite() && r.value > 0.0, "{r:?}");
        assert!(
            r.baseline_value.is_finite() && r.baseline_value > 0.0,
            "{r:?}"
        );
        if r.case.starts_with("8-bit") {
            assert!(r.case.contains("warps/SM"), "{r:?}");
        }
    }
    let table = report.markdown();
    assert!(table.contains(&report.device), "{table}");
    println!("{table}");
}

/// What the `candle-cuda` tests (models on the GPU) use.
#[cfg(feature = "candle-cuda")]
use {
    ragged::checkpoint::SaveOptions,
    ragged::comm::threads::ThreadWorld,
    ragged::cuda::threads::ThreadDeviceComm,
    ragged::demo::{MlpBatch, MlpStages},
    ragged::fsdp::{fully_shard, FsdpOptions, MixedPrecision},
    std::collections::HashMap,
};

/// candle's CUDA device 0 and this crate's device on candle's stream (the per-thread default
/// stream: each rank thread's work, candle's kernels, this crate's and the collectives', is
/// ordered on its own), or `None` after printing why the test is skipped.
#[cfg(feature = "candle-cuda")]
fn candle_gpu() -> Option<(candle_core::Device, Arc<Device>)> {
    device()?;
    let gpu = match candle_core::Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("skipped: candle's CUDA device: {e}");
            return None;
        }
    };
    let candle_core::Device::Cuda(cuda) = &gpu else {
        unreachable!()
    };
    let dev = Arc::new(Device::from_candle(cuda).unwrap());
    Some((gpu, dev))
}

/// The demo MLP of the `candle-cuda` tests.
#[cfg(feature = "candle-cuda")]
fn small_mlp() -> ragged::demo::MlpConfig {
    ragged::demo::MlpConfig {
        width: 64,
        hidden: 128,
        layers: 3,
    }
}

/// `mlp`'s parameters from `seed`, on `device`.
#[cfg(feature = "candle-cuda")]
fn mlp_params(
    mlp: &ragged::demo::MlpConfig,
    seed: u64,
    device: &candle_core::Device,
) -> ragged::Result<Vec<(String, candle_core::Tensor)>> {
    let on = |t: candle_core::Tensor| t.to_device(device).map_err(ragged::dbuffer::candle("to"));
    mlp.init_params(seed)?
        .into_iter()
        .map(|(n, t)| Ok((n, on(t)?)))
        .collect()
}

/// This rank's rows of `mlp`'s global batch of step `step` (`rows` rows, split evenly over
/// the ranks of `comm`), as `dtype` on `device`.
#[cfg(feature = "candle-cuda")]
fn rank_batch(
    mlp: &ragged::demo::MlpConfig,
    step: usize,
    rows: usize,
    comm: &dyn Communicator,
    dtype: candle_core::DType,
    device: &candle_core::Device,
) -> ragged::Result<MlpBatch> {
    let b = mlp.batch(step, rows)?;
    let n = rows / comm.world_size();
    let mine = |t: &candle_core::Tensor| {
        t.narrow(0, n * comm.rank(), n)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.to_device(device))
            .map_err(ragged::dbuffer::candle("rank_batch"))
    };
    Ok(MlpBatch {
        x: mine(&b.x)?,
        y: mine(&b.y)?,
    })
}

/// `fully_shard` on the GPU (feature `candle-cuda`): the demo MLP's parameters are candle CUDA
/// tensors, its master shards, gradient buffers and AdamW state device memory, and two thread
/// ranks on the one GPU gather, reduce and step through device buffers. Three steps match the
/// same training on CPU thread ranks within 1e-4 absolute per weight: the element steps are
/// bitwise (above) but candle's cuBLAS matmuls sum in another order than its CPU GEMM, so
/// gradients differ by rounding (~1e-6 relative), and three AdamW steps of lr 1e-3 move each
/// weight by at most 3e-3, normalized: a difference in a gradient's sign-level direction stays
/// far below 1e-4 unless the runtime mixes up tensors, ranks or steps.
#[cfg(feature = "candle-cuda")]
#[test]
fn fully_shard_trains_the_mlp_on_gpu_thread_ranks_like_on_cpu_thread_ranks() {
    let Some((gpu, dev)) = candle_gpu() else {
        return;
    };
    let mlp = small_mlp();
    // Freed units and kept ones (a kept unit goes stale at each step and is refilled through its
    // own device storages); the digest gathers where the master lives, as `train` prints it.
    // A world of one on the GPU runs its collectives without the overlap thread
    // (`ShardedModel::overlaps`), and its memory plan replays the schedule without it.
    let cases = [
        (2, FsdpOptions::default()),
        (
            2,
            FsdpOptions {
                reshard_after_forward: false,
                ..FsdpOptions::default()
            },
        ),
        (1, FsdpOptions::default()),
    ];
    // Full parameters, their digest and the gradient norms before clipping.
    type Outcome = (HashMap<String, Vec<f32>>, String, Vec<f32>);
    for (world, opts) in cases {
        let train =
            |comm: &dyn Communicator, device: &candle_core::Device| -> ragged::Result<Outcome> {
                let params = mlp_params(&mlp, 3, device)?;
                let adamw = AdamW::new(AdamWConfig {
                    lr: 1e-3,
                    ..AdamWConfig::default()
                })?;
                let mut sharded = fully_shard(&params, adamw, comm, opts.clone())?;
                let threaded = world > 1 || device.is_cpu();
                assert_eq!(sharded.overlaps(), threaded, "world {world}, {device:?}");
                assert_eq!(sharded.memory_plan().overlap_possible, threaded);
                let mut norms = Vec::new();
                for step in 0..3 {
                    let f32 = candle_core::DType::F32;
                    let b = rank_batch(&mlp, step, 4 * world, comm, f32, device)?;
                    sharded.forward_backward(&MlpStages(mlp), &b)?;
                    // Clipped (the norms are well above 0.05): on the GPU the exact sum of
                    // squares runs on the device (`cuda::ops::add_exact_squares`).
                    norms.push(sharded.clip_grad_norm(0.05)?);
                    sharded.step()?;
                }
                Ok((sharded.full_params()?, sharded.param_digest()?, norms))
            };
        let cpu = ThreadWorld::run(world, |c| train(c, &candle_core::Device::Cpu)).unwrap();
        let on_gpu = ThreadDeviceComm::run(dev.clone(), world, |c| train(c, &gpu)).unwrap();
        for (name, want) in &cpu[0].0 {
            let got = &on_gpu[0].0[name];
            let worst = max_abs_diff(got, want);
            assert!(worst < 1e-4, "{name}: {worst}");
        }
        // The gradients differ by rounding (above), so the norms do, relatively, about as
        // much; each is clipped.
        for (got, want) in on_gpu[0].2.iter().zip(&cpu[0].2) {
            assert!((got - want).abs() <= 1e-4 * want, "norm {got} vs {want}");
            assert!(*want > 0.05, "norm {want}: not clipped");
        }
        assert!(on_gpu.iter().all(|r| *r == on_gpu[0]), "ranks disagree");
    }
}

/// Mixed precision on the GPU (feature `candle-cuda`): bf16 compute copies (`param_dtype`),
/// rounded from the f32 master on the device before each all-gather, bf16 gradients added
/// into the f32 gradient buffer on the device, reductions in f32 and in bf16 (`reduce_dtype`:
/// the buffer rounded, reduced and the shard widened on the device). Against the same
/// training on CPU thread ranks under the same policy: every product of the bf16 forward and
/// backward rounds to 8 mantissa bits and cuBLAS sums in another order than the CPU, so
/// gradients differ in about the third digit, and AdamW steps each element by about lr
/// whatever its gradient's size: parameters stay within 2·steps·lr (a gradient's sign
/// flipped costs 2·lr a step). The masters stay f32.
#[cfg(feature = "candle-cuda")]
#[test]
fn bf16_compute_copies_train_on_the_gpu_like_on_the_cpu() {
    let Some((gpu, dev)) = candle_gpu() else {
        return;
    };
    let mlp = small_mlp();
    let (lr, steps) = (1e-3, 3);
    for reduce_dtype in [candle_core::DType::F32, candle_core::DType::BF16] {
        let opts = FsdpOptions {
            mixed_precision: MixedPrecision {
                param_dtype: candle_core::DType::BF16,
                reduce_dtype,
            },
            ..FsdpOptions::default()
        };
        let train = |comm: &dyn Communicator,
                     device: &candle_core::Device|
         -> ragged::Result<(HashMap<String, Vec<f32>>, u64)> {
            let params = mlp_params(&mlp, 3, device)?;
            let adamw = AdamW::new(AdamWConfig {
                lr,
                ..AdamWConfig::default()
            })?;
            let mut sharded = fully_shard(&params, adamw, comm, opts.clone())?;
            for step in 0..steps {
                let bf16 = candle_core::DType::BF16;
                let b = rank_batch(&mlp, step, 8, comm, bf16, device)?;
                sharded.forward_backward(&MlpStages(mlp), &b)?;
                sharded.step()?;
            }
            Ok((sharded.full_params()?, sharded.stats().collective()))
        };
        let cpu = ThreadWorld::run(2, |c| train(c, &candle_core::Device::Cpu)).unwrap();
        let on_gpu = ThreadDeviceComm::run(dev.clone(), 2, |c| train(c, &gpu)).unwrap();
        // The collectives' bytes as counted: bf16 device buffers at 2 bytes an element, as
        // on the host (they were counted at 4).
        assert_eq!(on_gpu[0].1, cpu[0].1, "{reduce_dtype:?}: collective bytes");
        let (cpu, on_gpu): (Vec<_>, Vec<_>) = (
            cpu.into_iter().map(|r| r.0).collect(),
            on_gpu.into_iter().map(|r| r.0).collect(),
        );
        let bound = 2.0 * steps as f32 * lr as f32;
        let mut f32_only = 0;
        for (name, want) in &cpu[0] {
            let got = &on_gpu[0][name];
            let worst = max_abs_diff(got, want);
            assert!(
                worst <= bound,
                "{reduce_dtype:?}: {name}: {worst} > {bound}"
            );
            f32_only += got
                .iter()
                .filter(|&&x| half::bf16::from_f32(x).to_f32() != x)
                .count();
        }
        assert!(f32_only > 0, "the master weights must stay f32");
        assert!(on_gpu.iter().all(|r| *r == on_gpu[0]), "ranks disagree");
    }
}

/// Checkpoints of a model whose parameters and 8-bit Adam state live on the GPU: saved from
/// two GPU thread ranks, loaded into three CPU thread ranks, into one GPU rank and into two
/// GPU replicas of one rank (HSDP: rank 0 reads the file, rank 1 receives the parameters and
/// the state, its `u16` scales as bytes, by a device broadcast), the parameters come back bit
/// for bit (a checkpoint holds the exact bits), and the step after the load on one GPU rank
/// and on each replica is the saving run's next step within the tolerance above (its
/// gradients are summed over two ranks there, in another order).
#[cfg(feature = "candle-cuda")]
#[test]
fn checkpoints_of_a_model_on_the_gpu_load_at_other_world_sizes_and_on_the_cpu() {
    let Some((gpu, dev)) = candle_gpu() else {
        return;
    };
    let mlp = small_mlp();
    let root = std::env::temp_dir().join(format!("ragged-gpu-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    // `steps` steps from `load` (or from the start), the parameters after `save_after` of them
    // saved to `root` when asked; the full parameters after every step.
    type Params = HashMap<String, Vec<f32>>;
    let run = |comm: &dyn Communicator,
               device: &candle_core::Device,
               load: bool,
               steps: std::ops::Range<usize>,
               save_after: Option<usize>,
               replicas: usize|
     -> ragged::Result<Vec<Params>> {
        let params = mlp_params(&mlp, 5, device)?;
        let opt = Adam8bit::new(Adam8bitConfig {
            min_8bit_size: 1024,
            ..Default::default()
        })?;
        let opts = FsdpOptions {
            replicas,
            ..FsdpOptions::default()
        };
        let mut sharded = fully_shard(&params, opt, comm, opts)?;
        if load {
            sharded.load(&root)?;
        }
        let mut out = vec![sharded.full_params()?];
        for step in steps {
            let b = rank_batch(&mlp, step, 8, comm, candle_core::DType::F32, device)?;
            sharded.forward_backward(&MlpStages(mlp), &b)?;
            sharded.step()?;
            if save_after == Some(step) {
                sharded.save(&root, &SaveOptions::default())?;
            }
            out.push(sharded.full_params()?);
        }
        Ok(out)
    };
    // Two GPU ranks: 3 steps, saved after the second.
    let saving = ThreadDeviceComm::run(dev.clone(), 2, |c| run(c, &gpu, false, 0..3, Some(1), 1))
        .unwrap()
        .swap_remove(0);
    let saved = &saving[2];
    let on_cpu = ThreadWorld::run(3, |c| {
        run(c, &candle_core::Device::Cpu, true, 0..0, None, 1)
    })
    .unwrap();
    let one_gpu =
        ThreadDeviceComm::run(dev.clone(), 1, |c| run(c, &gpu, true, 2..3, None, 1)).unwrap();
    let replicas =
        ThreadDeviceComm::run(dev.clone(), 2, |c| run(c, &gpu, true, 2..3, None, 2)).unwrap();
    let loaded = [
        ("on the CPU", &on_cpu[0]),
        ("on the GPU", &one_gpu[0]),
        ("by GPU replica 0", &replicas[0]),
        ("by GPU replica 1", &replicas[1]),
    ];
    for (name, want) in saved {
        for (how, run) in loaded {
            assert_eq!(bits(&run[0][name]), bits(want), "{name}: loaded {how}");
        }
    }
    // The step after the load: one GPU rank against the saving run's two (the same
    // gradients up to the order of their sum over ranks, so within the tolerance above).
    for (name, want) in &saving[3] {
        for (how, run) in &loaded[1..] {
            let worst = max_abs_diff(&run[1][name], want);
            assert!(
                worst < 1e-4,
                "{name}: {worst} after the step that follows the load {how}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

// ---- Edge cases a mutation audit of the GPU code found unprotected (session 22) ----
// Short row blocks whose last scale block is partial, the quantizer's ties, NaN and overflow,
// `lerp` at weight ½, Newton–Schulz's normalization (the last partial sum, the f64 fallback,
// transposes of partial tiles, bf16 ties), several split Muon matrices rooted on one rank, and
// the 8-bit step's one-learning-rate rule.
//
// Tolerances: the element steps (AdamW, 8-bit Adam, Muon's momentum) are bit for bit, as
// above. Newton–Schulz with the identity coefficients `(a, b, c) = (1, 0, 0)` has products
// that vanish exactly (`b·P + c·P·P = 0`, then `X + 0·X = X`), so cuBLAS's summation order
// never shows, and the inputs are multiples of `2⁻⁸` (or bf16 values plus half an ulp), whose
// squares add up exactly in `f64` in any order: the normalized output is compared bit for bit
// too. The full quintic iteration keeps the tolerance above (Muon parameters within `1e-4`).

/// Protects the last, **partial** scale block of a short row block (fewer than 256 elements:
/// `m mod 32` rows whose length is no multiple of 256) and the runs built around it: the
/// kernel's block length bound (`span.len`), its row-block offsets (`k / per · row-block
/// length`, not `· per · 256`, in runs of several short row blocks) and the host's scale
/// blocks per row block (`div_ceil`, not a floor). The shapes above all have row blocks of
/// whole scale blocks.
#[test]
fn adam8bit_partial_scale_blocks_of_short_row_blocks_are_bitwise_equal_to_cpu() {
    let Some(dev) = device() else { return };
    let spec = specs(&[
        // 3 full row blocks of 4 scale blocks, then 4 rows × 32 = 128: one partial block.
        ("short", &[100, 32]),
        // Each matrix: 32 × 96 = 12 blocks, then 5 × 96 = 480 = 256 + 224.
        ("experts_short", &[3, 37, 96]),
        // 13 × 160 = 2080 = 8 × 256 + 32.
        ("odd", &[45, 160]),
        // Matrices of one short row block each: runs of several equal short row blocks
        // (480 = 256 + 224 and 2080 elements), where a row block's offset in its run is
        // (row blocks before it) × 480, not × 512.
        ("stack_short", &[4, 5, 96]),
        ("stack_odd", &[3, 13, 160]),
        ("bias", &[33]),
    ]);
    let opt = Adam8bit::new(Adam8bitConfig {
        min_8bit_size: 1024,
        ..Default::default()
    })
    .unwrap();
    let run = (&[1, 2, 3][..], 41, 3);
    each_rank_host_and_device(&opt, &spec, &dev, run, |world, shard, host, device| {
        let what = format!("world {world} rank {}", shard.rank);
        assert_adam8bit_equal(&host, &device, &what);
    });
}

/// Protects the vector path's alignment check (`vector_span` in `kernels/adam8bit.cu`): whole
/// scale blocks at offsets that are no multiple of 4 (`w0`, after a 3-element bias: its f32
/// arrays are misaligned for 16-byte vectors) or a multiple of 4 but not of 8 (`w1`: its
/// f32 arrays are aligned, its code arrays not, for 8-byte vectors) must be stepped element
/// by element. Taken as vectors, a GPU faults on the
/// misaligned 16-byte loads and tools/cuda-emu built with `-fsanitize=alignment` (as `.ci/run`
/// builds it) aborts; either way the step is no longer bitwise the host's.
#[test]
fn adam8bit_whole_scale_blocks_at_unaligned_offsets_are_bitwise_equal_to_cpu() {
    let Some(dev) = device() else { return };
    let opt = Adam8bit::new(Adam8bitConfig {
        min_8bit_size: 1024,
        ..Default::default()
    })
    .unwrap();
    let shapes: [(&str, &[usize]); 4] = [
        ("b0", &[3]),
        ("w0", &[64, 256]),
        ("b1", &[1]),
        ("w1", &[32, 512]),
    ];
    let shard = LocalShard::unsharded(shapes, &|n, s| opt.atomic_block(n, s)).unwrap();
    let offsets: Vec<usize> = shard.pieces.iter().map(|p| p.offset).collect();
    assert_eq!(
        offsets,
        [0, 3, 3 + 64 * 256, 4 + 64 * 256],
        "the packing the test needs"
    );
    let spec = specs(&shapes);
    let mut rng = Rng::new(43);
    let p0 = globals(&spec, &mut rng, 1.0);
    let grads: Vec<Vec<f32>> = (0..3)
        .map(|_| scatter(&shard, &globals(&spec, &mut rng, 0.1)))
        .collect();
    let (host, device) = host_and_device(&opt, &shard, &dev, scatter(&shard, &p0), &grads);
    assert_adam8bit_equal(&host, &device, "unaligned");
}

/// `x`'s position in the order of the f32 values (negative values below positive ones).
fn order_key(x: f32) -> i64 {
    let b = i64::from(x.to_bits());
    if b & 0x8000_0000 != 0 {
        -(b & 0x7fff_ffff)
    } else {
        b
    }
}

fn from_order_key(k: i64) -> f32 {
    if k < 0 {
        f32::from_bits((-k) as u32 | 0x8000_0000)
    } else {
        f32::from_bits(k as u32)
    }
}

/// For each pair of neighbouring codes of `map`, the smallest `f32` that the CPU quantizer
/// (`quant::quantize`) sends to the upper one: the ties, found by bisection on the CPU's own
/// function.
fn thresholds(map: &[f32; 256]) -> Vec<f32> {
    (0..255)
        .map(|k| {
            let (mut lo, mut hi) = (order_key(map[k]), order_key(map[k + 1]));
            assert!(usize::from(quantize(from_order_key(hi), map)) > k);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if usize::from(quantize(from_order_key(mid), map)) > k {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            from_order_key(hi)
        })
        .collect()
}

/// Protects the quantizer's special cases, which random moments never reach:
/// - **ties**: with β₁ = 0 the new first moment is the gradient itself (`lerp(m, g, 1) = g`),
///   so a scale block whose maximum is a power of two (`1/s` exact) holds every threshold of
///   the signed map exactly, and each must go to the upper code (`x >= T`, not `x > T`);
/// - **NaN**: a NaN moment gets code 0, as on the CPU (the kernel's `isnan` check);
/// - **overflow**: gradients of 1e30 make `v = (1 − β₂)·g·g` infinite; an infinite block
///   maximum is stored as the largest finite 16-bit scale (`encode_scale`'s clamp), and an
///   infinite gradient makes `m` NaN and `v` infinite.
///
/// Two steps, so the second dequantizes the codes and scales the first wrote.
#[test]
fn adam8bit_quantizer_ties_nan_and_overflow_are_bitwise_equal_to_cpu() {
    let Some(dev) = device() else { return };
    let (rows, cols) = (32, 256); // one row block of 32 scale blocks (block k = row k)
    let spec = specs(&[("w", &[rows, cols])]);
    let opt = Adam8bit::new(Adam8bitConfig {
        min_8bit_size: 1024,
        adam: AdamWConfig {
            beta1: 0.0,
            weight_decay: 0.0,
            ..Default::default()
        },
    })
    .unwrap();
    let shard = &planned_shards(&opt, &spec, 1, &PlanOptions::default())[0];
    let ties = thresholds(&dynamic_map(true));
    let mut rng = Rng::new(77);
    let mut grads = Vec::new();
    for step in 0..2 {
        let mut g = rng.units(rows * cols);
        let scale = [1.0f32, 0.5][step];
        for (b, block) in g.chunks_mut(cols).enumerate() {
            match b % 8 {
                // The maximum (a power of two) and every tie of the map, in some order.
                0 | 1 => {
                    block[0] = scale;
                    for (j, x) in block[1..].iter_mut().enumerate() {
                        *x = ties[(j * 37 + b) % ties.len()] * scale;
                    }
                }
                // NaN (both signs) among ordinary values.
                2 => {
                    block[3] = f32::NAN;
                    block[100] = -f32::NAN;
                }
                // v overflows to +inf (and a block whose maximum m is 1e30).
                3 => {
                    block[7] = 1e30;
                    block[8] = -1e30;
                }
                // An infinite gradient: m = inf − inf·0 = NaN, v = inf.
                4 => block[9] = f32::INFINITY,
                // All zero: zero scales, the zero codes.
                5 => block.fill(0.0),
                _ => {}
            }
        }
        grads.push(scatter(shard, &[g]));
    }
    let p0 = scatter(shard, &globals(&spec, &mut rng, 1.0));
    let (host, device) = host_and_device(&opt, shard, &dev, p0, &grads);
    assert_adam8bit_equal(&host, &device, "ties, NaN, overflow");
}

/// A state with stored scales that are not finite (a checkpoint's: the step itself never
/// writes one, `encode_scale` clamps) steps as on the CPU. An infinite v scale times the
/// map's 0 is NaN, so v is NaN where m is not, and its block must take the kernel's guarded
/// quantization (`isfinite(old_sv)` in `kernels/adam8bit.cu`); a NaN or infinite m scale
/// makes m NaN, which the kernel's per-lane NaN flag catches. Only a GPU tells that guard's
/// absence: there `0·∞` is the positive canonical NaN, which the unsigned map's last bucket
/// would code 255, while on x86 (tools/cuda-emu) it is a negative NaN, which falls into
/// bucket 0 and code 0 anyway.
#[test]
fn adam8bit_non_finite_stored_scales_step_bitwise_as_on_cpu() {
    let Some(dev) = device() else { return };
    let (rows, cols) = (32, 256); // one row block of 32 scale blocks
    let spec = specs(&[("w", &[rows, cols])]);
    let opt = Adam8bit::new(Adam8bitConfig {
        min_8bit_size: 1024,
        ..Default::default()
    })
    .unwrap();
    let shard = &planned_shards(&opt, &spec, 1, &PlanOptions::default())[0];
    let mut rng = Rng::new(91);
    let mut p = scatter(shard, &globals(&spec, &mut rng, 1.0));
    let mut state = opt.init(shard).unwrap();
    // Zero gradients in scale block 1 (row 1): v = 0 there, code 0, whose map value times an
    // infinite scale is NaN.
    let mut g = globals(&spec, &mut rng, 0.1);
    g[0][cols..cols + 16].fill(0.0);
    let g = scatter(shard, &g);
    opt.step_slices(&mut state, shard, &mut p, &g, &SingleRank)
        .unwrap();
    // 16-bit scale codes (bits 30..15 of the f32): +inf, and a NaN.
    let (inf, nan) = (0x7f80_0000u32 >> 15, 0x7fc0_0000u32 >> 15);
    let v_scales = state.scale_v.cpu_mut().unwrap();
    (v_scales[1], v_scales[2]) = (inf as u16, nan as u16);
    let m_scales = state.scale_m.cpu_mut().unwrap();
    (m_scales[3], m_scales[4]) = (inf as u16, nan as u16);
    let mut ds = state.to_placement(&Placement::Cuda(dev.clone())).unwrap();
    let mut dp = dev.upload(&p).unwrap();
    let g = scatter(shard, &globals(&spec, &mut rng, 0.1));
    opt.step_slices(&mut state, shard, &mut p, &g, &SingleRank)
        .unwrap();
    let dg = dev.upload(&g).unwrap();
    let (pv, gv) = (dp.slice_mut(..).into(), dg.slice(..).into());
    opt.step(&mut ds, shard, pv, gv, &SingleRank).unwrap();
    let device = (dev.download(&dp).unwrap(), ds);
    assert_adam8bit_equal(&(p, state), &device, "non-finite stored scales");
}

/// Gradients whose magnitudes vary by element over 2⁻¹²…2¹², so that `end − start` in `lerp`
/// is often inexact and its two forms round differently.
fn spread_grads(
    shard: &LocalShard,
    spec: &[TensorSpec],
    rng: &mut Rng,
    steps: usize,
) -> Vec<Vec<f32>> {
    (0..steps)
        .map(|_| {
            let g: Vec<Vec<f32>> = globals(spec, rng, 1.0)
                .into_iter()
                .map(|t| {
                    let k = rng.next_u64();
                    t.iter()
                        .enumerate()
                        .map(|(i, x)| {
                            let e = ((i as u64).wrapping_mul(7).wrapping_add(k) % 25) as i32 - 12;
                            x * 2f32.powi(e)
                        })
                        .collect()
                })
                .collect();
            scatter(shard, &g)
        })
        .collect()
}

/// Protects `lerp`'s switch between torch's two forms at `|w| < 0.5` (not `<=`): at β₁ = ½
/// (momentum ½ for Muon) the weight is exactly ½, where torch and the CPU take the
/// large-weight form `end − (end − start)·(1 − w)`. AdamW and 8-bit Adam bitwise (parameters
/// and moments), Muon's momentum bitwise (Nesterov's second lerp at μ = ½ too).
#[test]
fn lerp_at_weight_one_half_takes_the_cpus_form_bitwise() {
    let Some(dev) = device() else { return };
    let spec = specs(&[("w", &[64, 96]), ("b", &[33])]);
    let adam = AdamWConfig {
        beta1: 0.5,
        lr: 1e-2,
        ..Default::default()
    };
    let mut rng = Rng::new(91);

    let opt = AdamW::new(adam).unwrap();
    let shard = &planned_shards(&opt, &spec, 1, &PlanOptions::default())[0];
    let grads = spread_grads(shard, &spec, &mut rng, 4);
    let p0 = scatter(shard, &globals(&spec, &mut rng, 1.0));
    let ((p, state), (dp, ds)) = host_and_device(&opt, shard, &dev, p0, &grads);
    assert_eq!(bits(&dp), bits(&p), "AdamW params");
    assert_eq!(
        bits(&ds.m.to_vec().unwrap()),
        bits(state.m.cpu().unwrap()),
        "AdamW m"
    );

    let opt = Adam8bit::new(Adam8bitConfig {
        min_8bit_size: 1024,
        adam,
    })
    .unwrap();
    let shard = &planned_shards(&opt, &spec, 1, &PlanOptions::default())[0];
    let grads = spread_grads(shard, &spec, &mut rng, 4);
    let p0 = scatter(shard, &globals(&spec, &mut rng, 1.0));
    let (host, device) = host_and_device(&opt, shard, &dev, p0, &grads);
    assert_adam8bit_equal(&host, &device, "8-bit Adam at beta1 = 1/2");

    let opt = Muon::new(MuonConfig {
        lr: 1e-2,
        momentum: 0.5,
        nesterov: true,
        ns: NsConfig {
            method: NsMethod::Standard,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let shard = &harness::whole_shard_by(&spec, &|t| opt.atomic_block(&t.name, &t.shape));
    let grads = spread_grads(shard, &spec, &mut rng, 4);
    let p0 = scatter(shard, &globals(&spec, &mut rng, 1.0));
    let ((_, state), (_, ds)) = host_and_device(&opt, shard, &dev, p0, &grads);
    assert_eq!(
        bits(&ds.m.to_vec().unwrap()),
        bits(state.m.cpu().unwrap()),
        "Muon momentum"
    );
}

/// One Newton–Schulz step with `(a, b, c) = (1, 0, 0)`: `X ← X + 0·X`, so the result is the
/// normalized input (in bf16: the rounded input, normalized, rounded again), which isolates
/// the transposes, the Frobenius normalization and the bf16 conversions.
fn identity_ns(precision: NsPrecision) -> NsConfig {
    NsConfig {
        steps: 1,
        coeffs: vec![[1.0, 0.0, 0.0]],
        precision,
        method: NsMethod::Standard,
        ..Default::default()
    }
}

/// The CPU's and the device's Newton–Schulz of `batch` `rows × cols` matrices.
fn cpu_and_device_ns(
    dev: &Device,
    x: &[f32],
    batch: usize,
    (rows, cols): (usize, usize),
    cfg: &NsConfig,
) -> (Vec<f32>, Vec<f32>) {
    let mut want = x.to_vec();
    for m in want.chunks_mut(rows * cols) {
        orthogonalize(m, rows, cols, cfg).unwrap();
    }
    let mut d = dev.upload(x).unwrap();
    orthogonalize_cuda(dev, &mut d.slice_mut(..), batch, rows, cols, cfg).unwrap();
    (dev.download(&d).unwrap(), want)
}

/// `n` nonzero multiples of 2⁻⁸ in [−1, 1]: squares and their sums are exact in f64.
fn eighths(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let k = (rng.next_u64() % 256) as f32 + 1.0;
            if rng.next_u64() & 1 == 0 {
                k / 256.0
            } else {
                -k / 256.0
            }
        })
        .collect()
}

/// A named input of `batch` `rows × cols` matrices.
type NsCase = (&'static str, Vec<f32>, usize, (usize, usize));

/// Protects the normalization and the transposes around Newton–Schulz, bit for bit (see the
/// module doc for why bitwise holds here):
/// - a 64 × 256 matrix is exactly 64 sum-of-squares blocks of 256 threads, so its last row
///   is the **last partial sum** alone (made dominant here): `ns_normalize` must add all 64;
/// - tall matrices (300 × 40, and a stack of 3 × 45 × 33) take the transposed path with
///   **partial 32 × 32 tiles** on both sides;
/// - entries near 1e38 make the f32 norm overflow while the f64 one is finite: the CPU then
///   divides in f64, and so must the device (not by an infinite f32 norm, giving zeros).
#[test]
fn newton_schulz_normalization_and_transposes_are_bitwise_equal_to_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(13);
    let cfg = identity_ns(NsPrecision::F32);
    let mut last_row = eighths(&mut rng, 64 * 256);
    last_row[63 * 256..].iter_mut().for_each(|x| *x *= 64.0);
    let huge: Vec<f32> = eighths(&mut rng, 16 * 32)
        .into_iter()
        .map(|x| x * 2f32.powi(126))
        .collect();
    let cases: [NsCase; 5] = [
        ("64×256, heavy last row", last_row, 1, (64, 256)),
        ("300×40", eighths(&mut rng, 300 * 40), 1, (300, 40)),
        ("3×45×33", eighths(&mut rng, 3 * 45 * 33), 3, (45, 33)),
        ("40×300", eighths(&mut rng, 40 * 300), 1, (40, 300)),
        ("16×32 near f32::MAX", huge, 1, (16, 32)),
    ];
    for (what, x, batch, shape) in cases {
        let (got, want) = cpu_and_device_ns(&dev, &x, batch, shape, &cfg);
        assert!(
            want.iter().all(|v| v.is_finite() && *v != 0.0),
            "{what}: CPU"
        );
        assert_eq!(bits(&got), bits(&want), "{what}");
    }
}

/// A matrix with a non-finite entry (∞, or NaN) comes out NaN in every entry, on the device
/// as on the CPU: the normalization must say so itself, since nothing else spreads it. With
/// the identity step (module doc) the products are scaled by 0, and a product scaled by 0 is
/// not formed (BLAS: `A` and `B` are not read, as `tools/cuda-emu` does it), so `0 · NaN`
/// cannot carry the NaN either.
#[test]
fn newton_schulz_of_a_non_finite_matrix_is_nan_everywhere_like_the_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(17);
    for (bad, precision) in [
        (f32::INFINITY, NsPrecision::F32),
        (f32::NAN, NsPrecision::F32),
        (f32::NEG_INFINITY, NsPrecision::Bf16),
    ] {
        let mut x = eighths(&mut rng, 2 * 24 * 40);
        x[24 * 40 + 7] = bad; // the second matrix only
        let (got, want) = cpu_and_device_ns(&dev, &x, 2, (24, 40), &identity_ns(precision));
        let (first, second) = want.split_at(24 * 40);
        assert!(second.iter().all(|v| v.is_nan()), "the CPU's reference");
        assert!(first.iter().all(|v| v.is_finite()), "the CPU's reference");
        same_or_both_nan(&got, &want, &format!("{bad} ({precision:?})"));
    }
}

/// Protects the bf16 rounding of Newton–Schulz's input (`group_f32_to_bf16`: round to nearest,
/// **ties to even**), which the bf16 tolerance above (5e-2 relative) cannot see:
/// every input is a bf16 value plus exactly half an ulp (a tie), of both signs and several
/// binades, and with the identity step (module doc) the output is the rounded input,
/// normalized in f32 and rounded again: bit for bit the CPU's bf16 path.
#[test]
fn newton_schulz_bf16_rounds_ties_to_even_like_the_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(17);
    let (rows, cols) = (24, 64);
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| {
            // 1 + (2k + 1)·2⁻⁸: halfway between two bf16 values (7 fraction bits).
            let k = (rng.next_u64() % 128) as f32;
            let t = (1.0 + (2.0 * k + 1.0) / 256.0) * 2f32.powi((i % 5) as i32 - 2);
            if i % 3 == 0 {
                -t
            } else {
                t
            }
        })
        .collect();
    let (got, want) = cpu_and_device_ns(&dev, &x, 1, (rows, cols), &identity_ns(NsPrecision::Bf16));
    assert_eq!(bits(&got), bits(&want));
}

/// Protects the placement of the matrices a rank roots (`orthogonalize`: each rooted job at
/// its own offset of the gathered arena): with six split matrices on two ranks, a rank roots
/// several, and each must be orthogonalized where it was gathered. Momentum and the AdamW
/// moments bitwise, parameters within the Newton–Schulz bound above (1e-4) (cuBLAS's
/// summation order; see the module doc).
#[test]
fn muon_device_step_orthogonalizes_every_matrix_a_rank_roots() {
    let Some(dev) = device() else { return };
    let shapes: Vec<(String, [usize; 2])> = (0..6)
        .map(|k| (format!("w{k}"), [40 + 8 * (k % 2), 32]))
        .collect();
    let spec: Vec<TensorSpec> = shapes
        .iter()
        .map(|(n, s)| TensorSpec::new(n, s, DType::F32).unwrap())
        .collect();
    let opt = Muon::new(MuonConfig {
        lr: 1e-2,
        ns: NsConfig {
            method: NsMethod::Standard,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    // The first world whose row-granular layout has a rank rooting two split matrices or more.
    let (world, shards) = (2..=8)
        .map(|world| {
            let shards = harness::planned_shards_by(
                &spec,
                world,
                &|_| ragged::AtomicBlock::Rows(1),
                &PlanOptions::default(),
            );
            (world, shards)
        })
        .find(|(_, shards)| {
            shards
                .iter()
                .any(|s| opt.roots(s).rooted_here(s.rank).count() >= 2)
        })
        .expect("a layout where a rank roots several split matrices");
    println!("world {world}");
    let mut rng = Rng::new(23);
    let p0 = globals(&spec, &mut rng, 1.0);
    let grads: Vec<Vec<Vec<f32>>> = (0..2).map(|_| globals(&spec, &mut rng, 0.1)).collect();
    let (cpu, gpu) = sharded_muon_on_cpu_and_gpu_threads(&opt, &shards, &dev, &p0, &grads);
    for (r, ((gp, gm, _), (cp, cm, _))) in gpu.iter().zip(&cpu).enumerate() {
        assert_eq!(bits(gm), bits(cm), "rank {r}: momentum");
        let worst = gp
            .iter()
            .zip(cp)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, |m, d| if d.is_nan() { f32::NAN } else { m.max(d) });
        assert!(worst <= 1e-4, "rank {r}: params max |Δ| = {worst}");
    }
}

/// Protects the device 8-bit step's rule that every 8-bit block runs at the one learning rate
/// it takes: a role `lr_scale` other than 1 on an 8-bit parameter is refused (the host step
/// honours it; the device step would silently use the base rate), and nothing is modified.
#[test]
fn adam8bit_device_step_refuses_a_scaled_learning_rate_on_8bit_parameters() {
    use ragged::roles::{RoleRule, RoleSettings};
    let Some(dev) = device() else { return };
    let spec = specs(&[("w", &[64, 96]), ("b", &[33])]);
    let opt = Adam8bit::new(Adam8bitConfig {
        min_8bit_size: 1024,
        adam: AdamWConfig {
            roles: RoleRule {
                matrix: RoleSettings {
                    lr_scale: 0.5,
                    weight_decay: None,
                },
                element_wise: RoleSettings {
                    lr_scale: 0.5,
                    weight_decay: None,
                },
                ..Default::default()
            },
            ..Default::default()
        },
    })
    .unwrap();
    let shard = &planned_shards(&opt, &spec, 1, &PlanOptions::default())[0];
    let mut rng = Rng::new(29);
    let p0 = scatter(shard, &globals(&spec, &mut rng, 1.0));
    let g = scatter(shard, &globals(&spec, &mut rng, 0.1));
    let mut dp = dev.upload(&p0).unwrap();
    let dg = dev.upload(&g).unwrap();
    let mut ds = opt.init_on(shard, &Placement::Cuda(dev.clone())).unwrap();
    let (pv, gv) = (dp.slice_mut(..).into(), dg.slice(..).into());
    let err = opt.step(&mut ds, shard, pv, gv, &SingleRank);
    assert!(
        err.is_err(),
        "the device step ran 8-bit blocks at lr_scale 0.5"
    );
    assert_eq!(
        bits(&dev.download(&dp).unwrap()),
        bits(&p0),
        "params untouched"
    );
}
