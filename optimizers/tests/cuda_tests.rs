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

use ragged::comm::SingleRank;
use ragged::cuda::Device;
use ragged::model::{DType, TensorSpec};
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::PlanOptions;
use ragged::storage::Placement;
use ragged_optimizers::cuda::orthogonalize_cuda;
use ragged_optimizers::newton_schulz::{NsMethod, NsPrecision};
use ragged_optimizers::{
    orthogonalize, Adam8bit, Adam8bitConfig, AdamW, AdamWConfig, Muon, MuonConfig, NsConfig,
};

mod harness;
use harness::{bits, planned_shards, scatter, whole_shard_by, Rng};

/// Device 0, or `None` after printing why the test is skipped.
fn device() -> Option<Arc<Device>> {
    match Device::open(0) {
        Ok(d) => Some(Arc::new(d)),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

fn specs(shapes: &[(&str, &[usize])]) -> Vec<TensorSpec> {
    shapes
        .iter()
        .map(|(n, s)| TensorSpec::new(*n, s, DType::F32).unwrap())
        .collect()
}

/// Random global tensors for `specs`.
fn globals(specs: &[TensorSpec], rng: &mut Rng, scale: f32) -> Vec<Vec<f32>> {
    specs
        .iter()
        .map(|t| {
            rng.units(t.numel())
                .into_iter()
                .map(|x| x * scale)
                .collect()
        })
        .collect()
}

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

/// Bitwise equality of the moments of a host and a device Adam state.
fn assert_moments_equal(host: &ragged_optimizers::AdamState, dev: &ragged_optimizers::AdamState) {
    let m = (host.m.cpu().unwrap(), dev.m.to_vec().unwrap());
    assert_eq!(bits(m.0), bits(&m.1), "m");
    let v = (host.v.cpu().unwrap(), dev.v.to_vec().unwrap());
    assert_eq!(bits(v.0), bits(&v.1), "v");
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
    for world in [1, 3] {
        let shards = planned_shards(&opt, &spec, world, &PlanOptions::default());
        let mut rng = Rng::new(7 + world as u64);
        let p0 = globals(&spec, &mut rng, 1.0);
        for shard in &shards {
            let grads: Vec<Vec<f32>> = (0..STEPS)
                .map(|_| scatter(shard, &globals(&spec, &mut rng, 0.1)))
                .collect();
            let ((p, state), (dp, ds)) =
                host_and_device(&opt, shard, &dev, scatter(shard, &p0), &grads);
            assert_eq!(ds.step, state.step);
            assert_eq!(bits(&dp), bits(&p), "params");
            assert_moments_equal(&state, &ds);
        }
    }
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
    for world in [1, 2, 3] {
        let shards = planned_shards(&opt, &spec, world, &PlanOptions::default());
        let mut rng = Rng::new(11 + world as u64);
        let p0 = globals(&spec, &mut rng, 1.0);
        for shard in &shards {
            let grads: Vec<Vec<f32>> = (0..STEPS)
                .map(|_| scatter(shard, &globals(&spec, &mut rng, 0.1)))
                .collect();
            let ((p, state), (dp, ds)) =
                host_and_device(&opt, shard, &dev, scatter(shard, &p0), &grads);
            let got = ds.to_placement(&Placement::Cpu).unwrap();
            assert_eq!(got.step, state.step);
            assert_eq!(bits(&dp), bits(&p), "params");
            assert_eq!(got.m, state.m, "m codes");
            assert_eq!(got.v, state.v, "v codes");
            assert_eq!(got.scale_m, state.scale_m, "scale_m");
            assert_eq!(got.scale_v, state.scale_v, "scale_v");
            assert_eq!(got.m32, state.m32, "m32");
            assert_eq!(got.v32, state.v32, "v32");
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
    let ((p, state), (dp, ds)) = host_and_device(&opt, shard, &dev, p0, &grads);
    let got = ds.to_placement(&Placement::Cpu).unwrap();
    assert!(
        state.scale_m.len() > 8448,
        "{} scale blocks",
        state.scale_m.len()
    );
    assert_eq!(bits(&dp), bits(&p), "params");
    assert_eq!(got.m, state.m, "m codes");
    assert_eq!(got.v, state.v, "v codes");
    assert_eq!(got.scale_m, state.scale_m, "scale_m");
    assert_eq!(got.scale_v, state.scale_v, "scale_v");
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

/// Max |a − b| and ‖a − b‖ / ‖b‖.
/// Newton–Schulz as the device runs it: the standard iteration (`NsMethod::Auto` may take Gram
/// on the CPU, which the device does not have), so host and device compare like for like.
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
        for (prec, gram, max_abs, max_rel) in [
            (NsPrecision::F32, GramProduct::Auto, 2e-3f32, 1e-3f64),
            (NsPrecision::F32, GramProduct::Gemm, 2e-3, 1e-3),
            (NsPrecision::F32, GramProduct::Syrk, 2e-3, 1e-3),
            (NsPrecision::Bf16, GramProduct::Auto, f32::INFINITY, 5e-2),
        ] {
            // The CPU reference in the same precision (its bf16 path has the same semantics)
            // and the device's iteration.
            let cfg = NsConfig {
                precision: prec,
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
                "{prec:?} {gram:?} {batch}×{rows}×{cols}: max |Δ| = {abs}, relative {rel}"
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

fn muon_shard(opt: &Muon, spec: &[TensorSpec]) -> LocalShard {
    whole_shard_by(spec, &|t| opt.atomic_block(&t.name, &t.shape))
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
    let shard = muon_shard(&opt, &spec);
    let mut rng = Rng::new(9);
    let p0 = scatter(&shard, &globals(&spec, &mut rng, 1.0));
    let grads: Vec<Vec<f32>> = (0..STEPS)
        .map(|_| scatter(&shard, &globals(&spec, &mut rng, 0.1)))
        .collect();
    let ((p, state), (dp, ds)) = host_and_device(&opt, &shard, &dev, p0, &grads);
    // Momentum and the AdamW moments never see Newton–Schulz: bitwise. The parameters differ
    // by lr·scale·(NS difference) per step: ≤ 3 · 1e-2 · 1.5 · 2e-3 ≈ 1e-4.
    assert_moments_equal(&state, &ds);
    let (abs, _) = diffs(&dp, &p);
    assert!(abs <= 1e-4, "params: max |Δ| = {abs}");
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

/// Row-granular shards of `spec` on `world` ranks, in which some Muon matrix is split.
fn split_rows(opt: &Muon, spec: &[TensorSpec], world: usize) -> Vec<LocalShard> {
    let shards = harness::planned_shards_by(
        spec,
        world,
        &|_| ragged::AtomicBlock::Rows(1),
        &PlanOptions::default(),
    );
    assert!(
        shards.iter().any(|s| opt.roots(s).has_split()),
        "a split layout"
    );
    shards
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

/// The device step on a split layout over thread ranks on one GPU (matrices gathered to their
/// roots with device copies and the device all-to-all) against the CPU sharded step: momentum
/// and the AdamW moments bitwise, parameters within the Newton–Schulz tolerance.
#[test]
fn muon_step_cuda_comm_on_split_matrices_matches_the_cpu_sharded_step() {
    use ragged::comm::threads::ThreadWorld;
    use ragged::comm::Communicator;
    use ragged::cuda::threads::ThreadDeviceComm;
    let Some(dev) = device() else { return };
    let spec = specs(&[
        ("w0", &[48, 32]),
        ("w1", &[48, 32]),
        ("w2", &[40, 24]),
        ("b", &[7]),
    ]);
    let opt = Muon::new(MuonConfig {
        lr: 1e-2,
        ns: standard_ns(),
        ..Default::default()
    })
    .unwrap();
    let world = 3;
    let shards = split_rows(&opt, &spec, world);
    let mut rng = Rng::new(33);
    let p0 = globals(&spec, &mut rng, 1.0);
    let grads: Vec<Vec<Vec<f32>>> = (0..STEPS).map(|_| globals(&spec, &mut rng, 0.1)).collect();
    let cpu = ThreadWorld::run(world, |c| {
        let shard = &shards[c.rank()];
        let (mut p, mut st) = (scatter(shard, &p0), opt.init(shard)?);
        for g in &grads {
            opt.step_slices(&mut st, shard, &mut p, &scatter(shard, g), c)?;
        }
        Ok((p, st.m.to_vec()?, st.v.to_vec()?))
    })
    .unwrap();
    let gpu = ThreadDeviceComm::run(dev.clone(), world, |c| {
        let (shard, d) = (&shards[c.rank()], c.device());
        let mut p = d.upload(&scatter(shard, &p0))?;
        let mut st = opt.init_on(shard, &Placement::Cuda(dev.clone()))?;
        for g in &grads {
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

/// The GPU benchmark (`ragged bench optim --device cuda`) on tiny sizes: every row is a finite
/// positive rate with a positive same-run baseline, and the table names the device.
#[test]
fn gpu_bench_rows_are_finite_positive_rates_against_same_run_baselines() {
    use ragged_optimizers::cuda::bench::bench_gpu;
    let Some(dev) = device() else { return };
    let report = bench_gpu(&dev, true).unwrap();
    assert_eq!(report.rows.len(), 8, "{report:?}");
    for r in &report.rows {
        assert!(r.value.is_finite() && r.value > 0.0, "{r:?}");
        assert!(
            r.baseline_value.is_finite() && r.baseline_value > 0.0,
            "{r:?}"
        );
    }
    let table = report.markdown();
    assert!(table.contains(&report.device), "{table}");
    println!("{table}");
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
    use ragged::comm::threads::ThreadWorld;
    use ragged::comm::Communicator;
    use ragged::cuda::threads::ThreadDeviceComm;
    use ragged::demo::{MlpBatch, MlpConfig, MlpStages};
    use ragged::fsdp::{fully_shard, FsdpOptions};
    use std::collections::HashMap;
    if device().is_none() {
        return;
    }
    let gpu = match candle_core::Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("skipped: candle's CUDA device: {e}");
            return;
        }
    };
    let candle_core::Device::Cuda(cuda) = &gpu else {
        unreachable!()
    };
    // candle's stream for its kernels, this crate's and the collectives' (the per-thread
    // default stream: each rank thread's work is ordered on its own).
    let dev = Arc::new(Device::from_candle(cuda).unwrap());
    let mlp = MlpConfig {
        width: 64,
        hidden: 128,
        layers: 3,
    };
    let world = 2;
    // Freed units and kept ones (a kept unit goes stale at each step and is refilled through its
    // own device storages); the digest gathers where the master lives, as `train` prints it.
    for opts in [
        FsdpOptions::default(),
        FsdpOptions {
            reshard_after_forward: false,
            ..FsdpOptions::default()
        },
    ] {
        let train = |comm: &dyn Communicator,
                     device: &candle_core::Device|
         -> ragged::Result<(HashMap<String, Vec<f32>>, String)> {
            let params: Vec<_> = mlp
                .init_params(3)?
                .into_iter()
                .map(|(n, t)| (n, t.to_device(device).unwrap()))
                .collect();
            let adamw = AdamW::new(AdamWConfig {
                lr: 1e-3,
                ..AdamWConfig::default()
            })?;
            let mut sharded = fully_shard(&params, adamw, comm, opts.clone())?;
            for step in 0..3 {
                let b = mlp.batch(step, 4 * world)?;
                let rows = |t: &candle_core::Tensor| {
                    t.narrow(0, 4 * comm.rank(), 4)
                        .and_then(|t| t.to_device(device))
                        .unwrap()
                };
                let b = MlpBatch {
                    x: rows(&b.x),
                    y: rows(&b.y),
                };
                sharded.forward_backward(&MlpStages(mlp), &b)?;
                sharded.step()?;
            }
            Ok((sharded.full_params()?, sharded.param_digest()?))
        };
        let cpu = ThreadWorld::run(world, |c| train(c, &candle_core::Device::Cpu)).unwrap();
        let on_gpu = ThreadDeviceComm::run(dev.clone(), world, |c| train(c, &gpu)).unwrap();
        for (name, want) in &cpu[0].0 {
            let got = &on_gpu[0].0[name];
            let worst = max_abs_diff(got, want);
            assert!(worst < 1e-4, "{name}: {worst}");
        }
        assert_eq!(on_gpu[0], on_gpu[1], "ranks disagree");
    }
}
