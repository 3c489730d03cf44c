//! Device optimizer steps (feature `cuda`): AdamW, 8-bit Adam and Muon on a rank's local shard
//! held in device memory, with the kernels of `kernels/*.cu` and Newton–Schulz on cuBLAS.
//!
//! The layout logic is the CPU crate's, not a copy: the steps walk the same
//! [`LocalShard`] pieces, 8-bit Adam takes its tiles from [`Adam8bit`](crate::Adam8bit)'s own
//! layout (and `Tiling`), Muon its matrices and scalars from [`Muon`](crate::Muon)'s
//! `MatrixStep`. The scalars (`1 − lr·wd`, `lr/bc₁`, `√bc₂`, `1 − μ`, `−lr·scale`) are the
//! CPU's `f64` computations rounded once; the kernels do the element operations in the CPU
//! order with no FMA contraction (see `ragged::cuda`).
//!
//! | step | equals the CPU step |
//! |---|---|
//! | [`AdamW::step_cuda`] | bitwise |
//! | [`Adam8bit::step_cuda`](crate::Adam8bit::step_cuda) | bitwise (codes, scales, fallback moments, parameters) |
//! | [`Muon::step_cuda`](crate::Muon::step_cuda) | momentum bitwise; Newton–Schulz within a tolerance (cuBLAS sums in its own order; see [`newton_schulz`]) |
//!
//! Every device entry point opens nothing itself: it takes a [`Device`] the caller got from
//! [`Device::open`], the gate that returns `Err` instead of panicking when there is no driver.

pub mod adam8bit;
pub mod bench;
pub mod muon;
pub mod newton_schulz;

use ragged::cuda::cudarc::driver::{CudaFunction, CudaSlice, CudaView, CudaViewMut, PushKernelArg};
use ragged::cuda::{count, elementwise, guarded, Device, ADAMW};
use ragged::optim::LocalShard;
use ragged::Result;

use crate::adamw::{AdamRun, AdamState, AdamW};
use crate::common::{check_shard, check_step_inputs, next_step, MomentCoeffs};

pub use newton_schulz::orthogonalize_cuda;

/// Entry point of `kernels/adamw.cu`.
pub const ADAMW_STEP: &str = "adamw_step";

/// [`AdamState`] in device memory (`m`, `v`: `shard.len` `f32` each; `step` on the host).
pub struct DeviceAdamState {
    pub step: u64,
    pub m: CudaSlice<f32>,
    pub v: CudaSlice<f32>,
}

impl DeviceAdamState {
    /// Zero moments for a shard of `len` elements, step 0.
    pub fn zeros(dev: &Device, len: usize) -> Result<Self> {
        Ok(DeviceAdamState {
            step: 0,
            m: dev.zeros(len)?,
            v: dev.zeros(len)?,
        })
    }

    /// A device copy of a host state.
    pub fn upload(dev: &Device, s: &AdamState) -> Result<Self> {
        Ok(DeviceAdamState {
            step: s.step,
            m: dev.upload(&s.m)?,
            v: dev.upload(&s.v)?,
        })
    }

    /// A host copy (for checkpoints and tests).
    pub fn download(&self, dev: &Device) -> Result<AdamState> {
        Ok(AdamState {
            step: self.step,
            m: dev.download(&self.m)?,
            v: dev.download(&self.v)?,
        })
    }
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

impl AdamW {
    /// Zero device state for `shard` ([`Optimizer::init`](ragged::optim::Optimizer::init) on
    /// the device).
    pub fn init_cuda(&self, dev: &Device, shard: &LocalShard) -> Result<DeviceAdamState> {
        check_shard("AdamW::init_cuda", shard)?;
        DeviceAdamState::zeros(dev, shard.len)
    }

    /// [`Optimizer::step`](ragged::optim::Optimizer::step) on device buffers: one launch of
    /// `kernels/adamw.cu` per local piece. Bitwise equal to the CPU step. Queued on the
    /// device's stream (call [`Device::sync`] before timing or reading on the host).
    pub fn step_cuda(
        &self,
        dev: &Device,
        state: &mut DeviceAdamState,
        shard: &LocalShard,
        params: &mut CudaViewMut<'_, f32>,
        grads: &CudaView<'_, f32>,
    ) -> Result<()> {
        const OP: &str = "AdamW::step_cuda";
        check_step_inputs(
            OP,
            shard,
            params.len(),
            grads.len(),
            state.m.len(),
            state.v.len(),
        )?;
        let f = dev.function(&ADAMW, ADAMW_STEP)?;
        let t = next_step(OP, state.step)?;
        let c = self.config();
        let moments = MomentCoeffs::new(c.beta1, c.beta2);
        // The host step's runs (a frozen piece has none).
        for run in shard.pieces.iter().filter_map(|p| self.run_of(shard, p, t)) {
            let r = run.range.clone();
            launch_adamw(
                dev,
                &f,
                &mut params.slice_mut(r.clone()),
                &grads.slice(r.clone()),
                &mut state.m.slice_mut(r.clone()),
                &mut state.v.slice_mut(r),
                &run,
                &moments,
            )?;
        }
        state.step = t;
        Ok(())
    }
}
