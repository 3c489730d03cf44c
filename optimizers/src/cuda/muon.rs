//! Muon on the device, for layouts whose Muon matrices are **whole on their rank** (the
//! `whole` layout of [`crate::muon_layout`]): momentum and apply as kernels
//! (`kernels/muon.cu`, bitwise the CPU's element steps), Newton–Schulz on cuBLAS per piece (an
//! `[E, m, n]` piece is one strided-batched call), AdamW for the other parameters. Split
//! matrices need the gather to a root over NCCL, which is not here yet: such shards get `Err`.

use ragged::cuda::cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use ragged::cuda::{count, elementwise, guarded, Device, ADAMW, MUON};
use ragged::optim::LocalShard;
use ragged::{Error, Result};

use super::newton_schulz::orthogonalize_cuda;
use super::{launch_adamw, DeviceAdamState, ADAMW_STEP};
use crate::common::{check_shard, check_step_inputs, next_step, AdamScale, MomentCoeffs};
use crate::muon::Muon;

/// Entry points of `kernels/muon.cu`.
pub const MUON_MOMENTUM: &str = "muon_momentum";
pub const MUON_APPLY: &str = "muon_apply";

impl Muon {
    /// Zero device state for `shard` (the layout of [`crate::MuonState`]).
    pub fn init_cuda(&self, dev: &Device, shard: &LocalShard) -> Result<DeviceAdamState> {
        check_shard("Muon::init_cuda", shard)?;
        DeviceAdamState::zeros(dev, shard.len)
    }

    /// [`Optimizer::step`](ragged::optim::Optimizer::step) on device buffers, for shards whose
    /// Muon matrices are all whole here (`Err` otherwise, before anything is modified).
    /// Newton–Schulz runs on cuBLAS in `config.ns.precision` (its CPU `backend` is ignored);
    /// the step equals the CPU step up to the GEMM summation order (see
    /// [`super::newton_schulz`]).
    pub fn step_cuda(
        &self,
        dev: &Device,
        state: &mut DeviceAdamState,
        shard: &LocalShard,
        params: &mut CudaViewMut<'_, f32>,
        grads: &CudaView<'_, f32>,
    ) -> Result<()> {
        const OP: &str = "Muon::step_cuda";
        check_step_inputs(
            OP,
            shard,
            params.len(),
            grads.len(),
            state.m.len(),
            state.v.len(),
        )?;
        shard.check_holdings(OP)?;
        if self.roots(shard).has_split() {
            return Err(Error::InvalidShard {
                op: OP,
                reason: "a Muon matrix is split over ranks; the device step handles whole \
                         matrices only until the NCCL communicator lands (plan with \
                         MatrixLayout::Whole)"
                    .into(),
            });
        }
        let t = next_step(OP, state.step)?;
        let a = self.adamw.config();
        let moments = MomentCoeffs::new(a.beta1, a.beta2);
        let scale = AdamScale::new(a.lr, a.beta1, a.beta2, a.eps, t);
        let adamw = dev.function(&ADAMW, ADAMW_STEP)?;
        let momentum = dev.function(&MUON, MUON_MOMENTUM)?;
        let apply = dev.function(&MUON, MUON_APPLY)?;
        let mut u = dev.zeros::<f32>(shard.len)?;

        // Steps 1–2 (Muon pieces) and AdamW (the others).
        for piece in &shard.pieces {
            let r = piece.offset..piece.offset + piece.range.len();
            let meta = &shard.params[piece.param];
            match self.matrix_step(meta) {
                Some(step) => {
                    let n = r.len();
                    let len = count(n);
                    let w = (1.0 - step.momentum) as f32;
                    let mu = step.momentum as f32;
                    let nesterov = i32::from(step.nesterov);
                    let g = grads.slice(r.clone());
                    let mut m = state.m.slice_mut(r.clone());
                    let mut uu = u.slice_mut(r);
                    guarded(OP, || unsafe {
                        dev.stream()
                            .launch_builder(&momentum)
                            .arg(&g)
                            .arg(&mut m)
                            .arg(&mut uu)
                            .arg(&len)
                            .arg(&w)
                            .arg(&mu)
                            .arg(&nesterov)
                            .launch(elementwise(n))
                    })?;
                }
                None => launch_adamw(
                    dev,
                    &adamw,
                    &mut params.slice_mut(r.clone()),
                    &grads.slice(r.clone()),
                    &mut state.m.slice_mut(r.clone()),
                    &mut state.v.slice_mut(r),
                    self.adamw.decay_for(meta),
                    &moments,
                    &scale,
                )?,
            }
        }

        // Step 3: every piece of a Muon parameter is whole matrices (checked above).
        for piece in &shard.pieces {
            let Some(step) = self.matrix_step(&shard.params[piece.param]) else {
                continue;
            };
            let mn = step.rows * step.cols;
            if mn == 0 || piece.range.is_empty() {
                continue;
            }
            let r = piece.offset..piece.offset + piece.range.len();
            let batch = r.len() / mn;
            orthogonalize_cuda(
                dev,
                &mut u.slice_mut(r),
                batch,
                step.rows,
                step.cols,
                step.ns,
            )?;
        }

        // Steps 4–5.
        for piece in &shard.pieces {
            let Some(step) = self.matrix_step(&shard.params[piece.param]) else {
                continue;
            };
            let r = piece.offset..piece.offset + piece.range.len();
            let n = r.len();
            let len = count(n);
            let decay = step.decay.unwrap_or(1.0);
            let neg_lr = step.neg_lr;
            let mut p = params.slice_mut(r.clone());
            let o = u.slice(r);
            guarded(OP, || unsafe {
                dev.stream()
                    .launch_builder(&apply)
                    .arg(&mut p)
                    .arg(&o)
                    .arg(&len)
                    .arg(&decay)
                    .arg(&neg_lr)
                    .launch(elementwise(n))
            })?;
        }
        state.step = t;
        Ok(())
    }
}
