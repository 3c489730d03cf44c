//! The device backends of the optimizer steps (feature `cuda`): what `Optimizer::step` runs
//! when the local shard, its gradients and the state are device memory
//! ([`ragged::storage`]): the kernels of `kernels/*.cu` and Newton–Schulz on cuBLAS.
//!
//! There is one piece walk per optimizer, shared with the host: AdamW's runs
//! ([`AdamW::run_of`](crate::AdamW::run_of)), Muon's `run_step` over its `MuonKernels`
//! ([`muon`]), 8-bit Adam's tiles from [`Adam8bit`](crate::Adam8bit)'s own layout and
//! row-block walk ([`adam8bit`]). The scalars (`1 − lr·wd`, `lr/bc₁`, `√bc₂`, `1 − μ`,
//! `−lr·scale`) are the host's `f64` computations rounded once; the kernels do the element
//! operations in the host order with no FMA contraction (see `ragged::cuda`).
//!
//! | step on device memory | equals the host step |
//! |---|---|
//! | AdamW | bitwise |
//! | 8-bit Adam | bitwise (codes, scales, fallback moments, parameters) |
//! | Muon | momentum bitwise; Newton–Schulz within a tolerance (cuBLAS sums in its own order; see [`newton_schulz`]) |
//! | Shampoo | bitwise (products in the host's `f64` lanes, roots computed on the host; see [`shampoo`]) |
//!
//! The device comes from the state's storage ([`ragged::storage::DeviceVec`]), which the
//! caller allocated with `Optimizer::init_on(shard, &Placement::Cuda(dev))` after opening the
//! device through [`Device::open`], the gate that returns `Err` instead of panicking when
//! there is no driver.

pub mod adam8bit;
pub mod bench;
pub mod muon;
pub mod newton_schulz;
pub mod shampoo;

use std::sync::Arc;

use ragged::cuda::cudarc::driver::{CudaFunction, CudaSlice, CudaView, CudaViewMut, PushKernelArg};
use ragged::cuda::{count, elementwise, guarded, Device, ADAMW};
use ragged::storage::{mixed, Storage, View};
use ragged::Result;

use crate::adamw::AdamRun;
use crate::common::MomentCoeffs;

pub use newton_schulz::orthogonalize_cuda;

/// Entry point of `kernels/adamw.cu`.
pub const ADAMW_STEP: &str = "adamw_step";

/// The device view of the gradients (`Err` for host memory beside device parameters).
pub(crate) fn device_view<'a>(op: &'static str, v: View<'a, f32>) -> Result<CudaView<'a, f32>> {
    match v {
        View::Cuda(v) => Ok(v),
        _ => Err(mixed(op, "host gradients for device parameters")),
    }
}

/// A device array of the state and its device (`Err` for host memory beside device
/// parameters).
pub(crate) fn device_array<'a, T>(
    op: &'static str,
    s: &'a mut Storage<T>,
) -> Result<(Arc<Device>, &'a mut CudaSlice<T>)> {
    match s {
        Storage::Cuda(d) => Ok((Arc::clone(&d.dev), &mut d.data)),
        _ => Err(mixed(op, "host state for device parameters")),
    }
}

/// Both device moments of an Adam state and their device.
pub(crate) fn device_moments<'a>(
    op: &'static str,
    m: &'a mut Storage<f32>,
    v: &'a mut Storage<f32>,
) -> Result<(Arc<Device>, &'a mut CudaSlice<f32>, &'a mut CudaSlice<f32>)> {
    let (dev, m) = device_array(op, m)?;
    let (_, v) = device_array(op, v)?;
    Ok((dev, m, v))
}

/// AdamW's runs on device memory: one launch of `kernels/adamw.cu` each.
pub(crate) fn adamw_runs(
    dev: &Device,
    runs: impl Iterator<Item = AdamRun>,
    params: &mut CudaViewMut<'_, f32>,
    grads: &CudaView<'_, f32>,
    m: &mut CudaSlice<f32>,
    v: &mut CudaSlice<f32>,
    moments: &MomentCoeffs,
) -> Result<()> {
    let f = dev.function(&ADAMW, ADAMW_STEP)?;
    for run in runs {
        let r = run.range.clone();
        launch_adamw(
            dev,
            &f,
            &mut params.slice_mut(r.clone()),
            &grads.slice(r.clone()),
            &mut m.slice_mut(r.clone()),
            &mut v.slice_mut(r),
            &run,
            moments,
        )?;
    }
    Ok(())
}

/// Launches `kernels/adamw.cu` on one run (`decay = None`: no decay, passed as the exact `×1`);
/// the slices are the run's elements.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_adamw(
    dev: &Device,
    f: &CudaFunction,
    p: &mut CudaViewMut<'_, f32>,
    g: &CudaView<'_, f32>,
    m: &mut CudaViewMut<'_, f32>,
    v: &mut CudaViewMut<'_, f32>,
    run: &AdamRun,
    mc: &MomentCoeffs,
) -> Result<()> {
    let n = p.len();
    if n == 0 {
        return Ok(());
    }
    let len = count(n);
    let decay = run.decay.unwrap_or(1.0);
    let s = &run.scale;
    guarded("adamw_step launch", || unsafe {
        dev.stream()
            .launch_builder(f)
            .arg(p)
            .arg(g)
            .arg(m)
            .arg(v)
            .arg(&len)
            .arg(&decay)
            .arg(&mc.lerp_weight)
            .arg(&mc.beta2)
            .arg(&mc.one_minus_beta2)
            .arg(&s.neg_step_size)
            .arg(&s.bc2_sqrt)
            .arg(&s.eps)
            .launch(elementwise(n))
    })
    .map(drop)
}
