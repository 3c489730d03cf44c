//! Muon's device backend (its `MuonKernels` on device memory): momentum and apply as kernels
//! (`kernels/muon.cu`, bitwise the host's element steps), Newton–Schulz on cuBLAS (an
//! `[E, m, n]` piece of whole matrices is one strided-batched call), AdamW for the other
//! parameters; the piece walk is the host's (`Muon::run_step`).
//!
//! Matrices whole on their rank are orthogonalized in place. Matrices the layout splits over
//! ranks travel to their root and back exactly as on the host ([`crate::roots`]: the same
//! roots, the same two [`Exchange`]s of copy runs around one all-to-all each), here with
//! device-to-device copies and a [`Communicator`] that takes device buffers (NCCL's grouped
//! send/recv, or thread ranks on one GPU).

use std::ops::Range;

use ragged::comm::Communicator;

use half::bf16;
use ragged::cuda::cudarc::driver::{CudaFunction, CudaSlice, CudaView, CudaViewMut, PushKernelArg};
use ragged::cuda::ops::{bf16_to_f32, f32_to_bf16};
use ragged::cuda::{check_len, count, elementwise, guarded, Device, ADAMW, MUON};
use ragged::storage::View;
use ragged::Result;

use super::newton_schulz::orthogonalize_cuda;
use super::{device_moments, device_view, launch_adamw, ADAMW_STEP};
use crate::adamw::AdamRun;
use crate::common::MomentCoeffs;
use crate::muon::{whole_matrices, MatrixStep, Muon, MuonKernels, MuonState, StepPlan};
use crate::roots::Exchange;

/// Entry points of `kernels/muon.cu`.
pub const MUON_MOMENTUM: &str = "muon_momentum";
pub const MUON_APPLY: &str = "muon_apply";

/// Muon's step on device memory ([`Muon::run_step`] over [`DeviceMuon`]); the caller checked
/// the shard and built `plan`.
pub(crate) fn step(
    muon: &Muon,
    state: &mut MuonState,
    params: &mut CudaViewMut<'_, f32>,
    grads: View<'_, f32>,
    plan: &StepPlan<'_>,
) -> Result<()> {
    let grads = device_view(OP, grads)?;
    let (dev, m, v) = device_moments(OP, &mut state.m, &mut state.v)?;
    let mut device = DeviceMuon {
        adamw: dev.function(&ADAMW, ADAMW_STEP)?,
        momentum: dev.function(&MUON, MUON_MOMENTUM)?,
        apply: dev.function(&MUON, MUON_APPLY)?,
        u: dev.zeros::<f32>(plan.shard.len)?,
        dev: &dev,
        params,
        grads: &grads,
        m,
        v,
    };
    muon.run_step(&mut device, plan)
}

/// [`MuonKernels`] on device memory: the kernels of `kernels/muon.cu` and `kernels/adamw.cu`,
/// Newton–Schulz on cuBLAS, `U` in device memory.
struct DeviceMuon<'a, 'p, 'g> {
    dev: &'a Device,
    adamw: CudaFunction,
    momentum: CudaFunction,
    apply: CudaFunction,
    params: &'a mut CudaViewMut<'p, f32>,
    grads: &'a CudaView<'g, f32>,
    m: &'a mut CudaSlice<f32>,
    v: &'a mut CudaSlice<f32>,
    u: CudaSlice<f32>,
}

const OP: &str = "Muon::step_cuda";

impl MuonKernels for DeviceMuon<'_, '_, '_> {
    fn momentum(&mut self, step: &MatrixStep<'_>, r: Range<usize>) -> Result<()> {
        let n = r.len();
        let len = count(n);
        let w = (1.0 - step.momentum) as f32;
        let mu = step.momentum as f32;
        let nesterov = i32::from(step.nesterov);
        let g = self.grads.slice(r.clone());
        let mut m = self.m.slice_mut(r.clone());
        let mut u = self.u.slice_mut(r);
        // SAFETY: the arguments follow `muon_momentum`'s signature; the three views hold `n`
        // elements each (a piece's range, checked against the shard by the prologue).
        guarded(OP, || unsafe {
            self.dev
                .stream()
                .launch_builder(&self.momentum)
                .arg(&g)
                .arg(&mut m)
                .arg(&mut u)
                .arg(&len)
                .arg(&w)
                .arg(&mu)
                .arg(&nesterov)
                .launch(elementwise(n))
        })
        .map(drop)
    }

    fn adamw(&mut self, run: &AdamRun, v: Range<usize>, moments: &MomentCoeffs) -> Result<()> {
        let r = run.range.clone();
        launch_adamw(
            self.dev,
            &self.adamw,
            &mut self.params.slice_mut(r.clone()),
            &self.grads.slice(r.clone()),
            &mut self.m.slice_mut(r),
            &mut self.v.slice_mut(v),
            run,
            moments,
        )
    }

    fn orthogonalize(&mut self, muon: &Muon, plan: &StepPlan<'_>) -> Result<()> {
        let (dev, shard) = (self.dev, plan.shard);
        let arena_len = plan.routes.map_or(0, |r| r.arena_len()).max(1);
        let mut arena = dev.zeros::<f32>(arena_len)?;
        // As on the host: split matrices travel in bf16 when Newton–Schulz runs in bf16.
        let bf16_wire = muon.route_elem_bytes() == 2;
        if let (Some(r), Some(c)) = (plan.routes, plan.comm) {
            exchange(&r.gather_exchange(), dev, &self.u, &mut arena, c, bf16_wire)?;
        }
        for piece in &shard.pieces {
            let Some(step) = muon.matrix_step(&shard.params[piece.param]) else {
                continue;
            };
            let mn = step.rows * step.cols;
            let Some(whole) = whole_matrices(piece, mn) else {
                continue;
            };
            let batch = whole.len() / mn;
            let mut x = self.u.slice_mut(whole);
            orthogonalize_cuda(dev, &mut x, batch, step.rows, step.cols, step.ns)?;
        }
        if let (Some(r), Some(c)) = (plan.routes, plan.comm) {
            let mut at = 0;
            for (&n, k) in r.sizes().iter().zip(plan.roots.rooted_here(shard.rank)) {
                let job = &plan.roots.jobs[k];
                let mut x = arena.slice_mut(at..at + n);
                orthogonalize_cuda(dev, &mut x, 1, job.rows, job.cols, &muon.config().ns)?;
                at += n;
            }
            exchange(
                &r.scatter_exchange(),
                dev,
                &arena,
                &mut self.u,
                c,
                bf16_wire,
            )?;
        }
        Ok(())
    }

    fn update(&mut self, step: &MatrixStep<'_>, r: Range<usize>) -> Result<()> {
        let n = r.len();
        let len = count(n);
        let decay = step.decay.unwrap_or(1.0);
        let neg_lr = step.neg_lr;
        let mut p = self.params.slice_mut(r.clone());
        let o = self.u.slice(r);
        // SAFETY: the arguments follow `muon_apply`'s signature; both views hold `n` elements.
        guarded(OP, || unsafe {
            self.dev
                .stream()
                .launch_builder(&self.apply)
                .arg(&mut p)
                .arg(&o)
                .arg(&len)
                .arg(&decay)
                .arg(&neg_lr)
                .launch(elementwise(n))
        })
        .map(drop)
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
    bf16_wire: bool,
) -> Result<()> {
    let (ns, nr) = (ex.send_len(), ex.recv_len());
    let mut send = dev.zeros::<f32>(ns.max(1))?;
    copy_runs(dev, &ex.pack, from, &mut send)?;
    let mut recv = dev.zeros::<f32>(nr.max(1))?;
    if bf16_wire {
        // The send buffer rounded to bf16 (nearest, ties to even: the host's rounding),
        // exchanged, widened back.
        let (mut send16, mut recv16) =
            (dev.zeros::<bf16>(ns.max(1))?, dev.zeros::<bf16>(nr.max(1))?);
        if ns > 0 {
            f32_to_bf16(dev, &send.slice(..ns), &mut send16.slice_mut(..ns))?;
        }
        comm.all_to_all_v(
            send16.slice(..ns).into(),
            &ex.send_counts,
            recv16.slice_mut(..nr).into(),
            &ex.recv_counts,
        )?;
        if nr > 0 {
            bf16_to_f32(dev, &recv16.slice(..nr), &mut recv.slice_mut(..nr))?;
        }
    } else {
        comm.all_to_all_v(
            send.slice(..ns).into(),
            &ex.send_counts,
            recv.slice_mut(..nr).into(),
            &ex.recv_counts,
        )?;
    }
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
