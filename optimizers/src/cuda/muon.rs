//! Muon on the device: momentum and apply as kernels (`kernels/muon.cu`, bitwise the CPU's
//! element steps), Newton–Schulz on cuBLAS (an `[E, m, n]` piece of whole matrices is one
//! strided-batched call), AdamW for the other parameters.
//!
//! Matrices whole on their rank are orthogonalized in place. Matrices the layout splits over
//! ranks travel to their root and back exactly as on the CPU ([`crate::roots`]: the same
//! roots, the same two [`Exchange`]s of copy runs around one all-to-all each), here with
//! device-to-device copies and a [`Communicator`] that takes device buffers (NCCL's grouped
//! send/recv, or thread ranks on one GPU): [`Muon::step_cuda_comm`]. [`Muon::step_cuda`] has no communicator and refuses
//! such shards.

use ragged::comm::Communicator;
use ragged::cuda::cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};
use ragged::cuda::{check_len, count, elementwise, guarded, Device, ADAMW, MUON};
use ragged::optim::LocalShard;
use ragged::Result;

use super::newton_schulz::orthogonalize_cuda;
use super::{launch_adamw, DeviceAdamState, ADAMW_STEP};
use crate::common::{check_shard, next_step, MomentCoeffs};
use crate::muon::{whole_matrices, Muon};
use crate::roots::Exchange;

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
        self.step_device(dev, state, shard, params, grads, None)
    }

    /// [`Muon::step_cuda`] for any layout: split matrices go to their roots and back through
    /// `comm`, a communicator that takes device buffers on `dev` (every rank of the shard's
    /// world must call it). `Err` before anything is modified when `comm` is not this shard's
    /// world and rank.
    pub fn step_cuda_comm(
        &self,
        dev: &Device,
        state: &mut DeviceAdamState,
        shard: &LocalShard,
        params: &mut CudaViewMut<'_, f32>,
        grads: &CudaView<'_, f32>,
        comm: &dyn Communicator,
    ) -> Result<()> {
        self.step_device(dev, state, shard, params, grads, Some(comm))
    }

    fn step_device(
        &self,
        dev: &Device,
        state: &mut DeviceAdamState,
        shard: &LocalShard,
        params: &mut CudaViewMut<'_, f32>,
        grads: &CudaView<'_, f32>,
        comm: Option<&dyn Communicator>,
    ) -> Result<()> {
        const OP: &str = "Muon::step_cuda";
        let lens = [params.len(), grads.len(), state.m.len(), state.v.len()];
        let world = comm.map(|c| (c.world_size(), c.rank()));
        let (roots, routes) = self.prologue(OP, shard, lens, world)?;
        let t = next_step(OP, state.step)?;
        let a = self.adamw.config();
        let moments = MomentCoeffs::new(a.beta1, a.beta2);
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
                None => {
                    // The piece's role's rates; a frozen piece is not stepped.
                    let Some(scale) = self.adamw.scale_for(meta, t) else {
                        continue;
                    };
                    launch_adamw(
                        dev,
                        &adamw,
                        &mut params.slice_mut(r.clone()),
                        &grads.slice(r.clone()),
                        &mut state.m.slice_mut(r.clone()),
                        &mut state.v.slice_mut(r),
                        self.adamw.decay_for(meta),
                        &moments,
                        &scale,
                    )?
                }
            }
        }

        // Step 3: the whole matrices of each piece in place; split ones on their roots.
        let mut arena = dev.zeros::<f32>(routes.as_ref().map_or(0, |r| r.arena_len()).max(1))?;
        if let (Some(r), Some(c)) = (&routes, comm) {
            exchange(&r.gather_exchange(), dev, &u, &mut arena, c)?;
        }
        for piece in &shard.pieces {
            let Some(step) = self.matrix_step(&shard.params[piece.param]) else {
                continue;
            };
            let mn = step.rows * step.cols;
            let Some(whole) = whole_matrices(piece, mn) else {
                continue;
            };
            let batch = whole.len() / mn;
            orthogonalize_cuda(
                dev,
                &mut u.slice_mut(whole),
                batch,
                step.rows,
                step.cols,
                step.ns,
            )?;
        }
        if let (Some(r), Some(c)) = (&routes, comm) {
            let mut at = 0;
            for (&n, k) in r.sizes().iter().zip(roots.rooted_here(shard.rank)) {
                let job = &roots.jobs[k];
                let ns = &self.config().ns;
                orthogonalize_cuda(
                    dev,
                    &mut arena.slice_mut(at..at + n),
                    1,
                    job.rows,
                    job.cols,
                    ns,
                )?;
                at += n;
            }
            exchange(&r.scatter_exchange(), dev, &arena, &mut u, c)?;
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

/// One [`Exchange`] on device buffers: pack `from`'s runs into a send buffer, all-to-all,
/// unpack into `to`, and copy the own runs from `from` to `to` (device-to-device copies).
fn exchange(
    ex: &Exchange,
    dev: &Device,
    from: &CudaSlice<f32>,
    to: &mut CudaSlice<f32>,
    comm: &dyn Communicator,
) -> Result<()> {
    let (ns, nr) = (ex.send_len(), ex.recv_len());
    let mut send = dev.zeros::<f32>(ns.max(1))?;
    copy_runs(dev, &ex.pack, from, &mut send)?;
    let mut recv = dev.zeros::<f32>(nr.max(1))?;
    comm.all_to_all_v(
        send.slice(..ns).into(),
        &ex.send_counts,
        recv.slice_mut(..nr).into(),
        &ex.recv_counts,
    )?;
    copy_runs(dev, &ex.unpack, &recv, to)?;
    copy_runs(dev, &ex.own, from, to)
}

fn copy_runs(
    dev: &Device,
    runs: &[crate::roots::Run],
    from: &CudaSlice<f32>,
    to: &mut CudaSlice<f32>,
) -> Result<()> {
    for r in runs {
        // cudarc asserts on out-of-range views: check first.
        check_len(
            "Muon::step_cuda (runs)",
            from.len().max(r.src + r.len),
            from.len(),
        )?;
        check_len(
            "Muon::step_cuda (runs)",
            to.len().max(r.dst + r.len),
            to.len(),
        )?;
        let src = from.slice(r.src..r.src + r.len);
        let mut dst = to.slice_mut(r.dst..r.dst + r.len);
        guarded("Muon::step_cuda (runs)", || {
            dev.stream().memcpy_dtod(&src, &mut dst)
        })?;
    }
    Ok(())
}
