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
//!
//! The step's device buffers (`U`, the roots' arena, the all-to-all buffers, Newton–Schulz's
//! workspace) are a `DeviceWork` the [`Muon`] keeps between steps, as it keeps the host
//! step's `U`: sized before the first kernel of a step from its plan, so a step allocates
//! nothing once the first has run ([`Muon::release_buffers`] frees them). Newton–Schulz's
//! buffers are kept only up to [`Muon::keep_device_workspace`] (64 MiB by default); larger
//! ones live for one step.

use std::ops::Range;

use ragged::comm::Communicator;

use half::bf16;
use ragged::cuda::cudarc::driver::{CudaFunction, CudaSlice, CudaView, CudaViewMut, PushKernelArg};
use ragged::cuda::ops::{bf16_to_f32, f32_to_bf16};
use ragged::cuda::{check_len, count, elementwise, guarded, Device, ADAMW, MUON};
use ragged::storage::View;
use ragged::Result;

use super::newton_schulz::{orthogonalize_cuda_in, GramProduct, NsNeed, NsWorkspace};
use super::{device_moments, device_view, launch_adamw, ADAMW_STEP};
use crate::adamw::AdamRun;
use crate::common::MomentCoeffs;
use crate::muon::{MatrixStep, Muon, MuonKernels, MuonState, StepPlan};
use crate::roots::Exchange;
use ragged::cuda::Scratch;

/// Entry points of `kernels/muon.cu`.
pub const MUON_MOMENTUM: &str = "muon_momentum";
pub const MUON_APPLY: &str = "muon_apply";

/// Muon's step on device memory ([`Muon::run_step`] over [`DeviceMuon`]) in `work`; the
/// caller checked the shard and built `plan`.
pub(crate) fn step(
    muon: &Muon,
    state: &mut MuonState,
    params: &mut CudaViewMut<'_, f32>,
    grads: View<'_, f32>,
    plan: &StepPlan<'_>,
    work: &mut DeviceWork,
) -> Result<()> {
    let grads = device_view(OP, grads)?;
    let (dev, m, v) = device_moments(OP, &mut state.m, &mut state.v)?;
    let DeviceWork { u, roots } = work;
    let mut device = DeviceMuon {
        adamw: dev.function(&ADAMW, ADAMW_STEP)?,
        momentum: dev.function(&MUON, MUON_MOMENTUM)?,
        apply: dev.function(&MUON, MUON_APPLY)?,
        u: u.view_mut(&dev, plan.shard.len)?,
        work: roots,
        dev: &dev,
        params,
        grads: &grads,
        m,
        v,
    };
    muon.run_step(&mut device, plan)
}

/// The device buffers of a Muon step, kept between steps by the [`Muon`] that ran it (module
/// doc): `U` (4 bytes per element of the local shard) and what Newton–Schulz works in.
#[derive(Default)]
pub(crate) struct DeviceWork {
    u: Scratch<f32>,
    roots: OrthoWork,
}

impl DeviceWork {
    /// After a step: Newton–Schulz's buffers are kept for the next step up to `keep` bytes
    /// ([`Muon::keep_device_workspace`]) and freed above it; `U` stays, as the host's does.
    pub(crate) fn trim(&mut self, keep: usize) {
        if self.roots.bytes() > keep {
            self.roots = OrthoWork::default();
        }
    }

    /// The device bytes it holds.
    pub(crate) fn bytes(&self) -> usize {
        self.u.bytes() + self.roots.bytes()
    }
}

impl OrthoWork {
    fn bytes(&self) -> usize {
        let w = &self.wire;
        let wire = w.send.bytes() + w.recv.bytes() + w.send16.bytes() + w.recv16.bytes();
        self.arena.bytes() + wire + self.ns.bytes()
    }
}

/// Newton–Schulz's buffers: the arena of the matrices rooted here, the all-to-all buffers
/// that carry split matrices to their roots and back, and the workspace of the calls.
#[derive(Default)]
struct OrthoWork {
    arena: Scratch<f32>,
    wire: Wire,
    ns: NsWorkspace,
}

/// An [`Exchange`]'s buffers: runs are packed into `send` and unpacked from `recv`; on a
/// bf16 wire the all-to-all moves `send16` and `recv16` (the `f32` buffers rounded).
#[derive(Default)]
struct Wire {
    send: Scratch<f32>,
    recv: Scratch<f32>,
    send16: Scratch<bf16>,
    recv16: Scratch<bf16>,
}

impl Wire {
    /// Room for each of `exchanges` (declared before the first runs), on a bf16 wire or not.
    fn reserve(&mut self, dev: &Device, exchanges: [&Exchange; 2], bf16: bool) -> Result<()> {
        let send = exchanges.iter().map(|e| e.send_len()).max().unwrap_or(0);
        let recv = exchanges.iter().map(|e| e.recv_len()).max().unwrap_or(0);
        self.send.reserve(dev, send)?;
        self.recv.reserve(dev, recv)?;
        if bf16 {
            self.send16.reserve(dev, send)?;
            self.recv16.reserve(dev, recv)?;
        }
        Ok(())
    }
}

/// [`MuonKernels`] on device memory: the kernels of `kernels/muon.cu` and `kernels/adamw.cu`,
/// Newton–Schulz on cuBLAS, `U` and the workspace in device memory kept between steps.
struct DeviceMuon<'a, 'p, 'g> {
    dev: &'a Device,
    adamw: CudaFunction,
    momentum: CudaFunction,
    apply: CudaFunction,
    params: &'a mut CudaViewMut<'p, f32>,
    grads: &'a CudaView<'g, f32>,
    m: &'a mut CudaSlice<f32>,
    v: &'a mut CudaSlice<f32>,
    u: CudaViewMut<'a, f32>,
    work: &'a mut OrthoWork,
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
        let ns_cfg = &muon.config().ns;
        // Every call of this step, and the workspace they all fit in, before the first.
        let sizes = plan.routes.map_or(&[][..], |r| r.sizes());
        let [whole, rooted] = muon.ns_calls(shard, plan.roots, sizes);
        let need = whole
            .iter()
            .chain(&rooted)
            .map(|&(_, shape)| NsNeed::of(shape, ns_cfg))
            .try_fold(NsNeed::default(), |a, b| b.map(|b| a.max(b)))?;
        let work = &mut *self.work;
        work.ns.reserve(dev, need)?;
        // As on the host: split matrices travel in bf16 when Newton–Schulz runs in bf16.
        let bf16_wire = muon.route_elem_bytes() == 2;
        let routes = match (plan.routes, plan.comm) {
            (Some(r), Some(c)) => Some((r, c, r.gather_exchange(), r.scatter_exchange())),
            _ => None,
        };
        let mut arena = work
            .arena
            .view_mut(dev, routes.as_ref().map_or(0, |r| r.0.arena_len()))?;
        if let Some((_, c, gather, scatter)) = &routes {
            work.wire.reserve(dev, [gather, scatter], bf16_wire)?;
            let wire = (&mut work.wire, bf16_wire);
            exchange(gather, dev, &self.u.as_view(), &mut arena, *c, wire)?;
        }
        for (range, shape) in whole {
            let mut x = self.u.slice_mut(range);
            orthogonalize_cuda_in(dev, &mut x, shape, ns_cfg, GramProduct::Auto, &mut work.ns)?;
        }
        let Some((_, c, _, scatter)) = routes else {
            return Ok(());
        };
        for (range, shape) in rooted {
            let mut x = arena.slice_mut(range);
            orthogonalize_cuda_in(dev, &mut x, shape, ns_cfg, GramProduct::Auto, &mut work.ns)?;
        }
        let from = arena.as_view();
        exchange(
            &scatter,
            dev,
            &from,
            &mut self.u,
            c,
            (&mut work.wire, bf16_wire),
        )
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

/// One [`Exchange`] on device buffers: pack `from`'s runs into the send buffer, all-to-all
/// (in bf16 on a bf16 wire), unpack into `to`, and copy the own runs from `from` to `to`
/// (device-to-device copies).
fn exchange(
    ex: &Exchange,
    dev: &Device,
    from: &CudaView<'_, f32>,
    to: &mut CudaViewMut<'_, f32>,
    comm: &dyn Communicator,
    (wire, bf16_wire): (&mut Wire, bool),
) -> Result<()> {
    let (ns, nr) = (ex.send_len(), ex.recv_len());
    let mut send = wire.send.view_mut(dev, ns)?;
    copy_runs(dev, &ex.pack, from, &mut send)?;
    let mut recv = wire.recv.view_mut(dev, nr)?;
    if bf16_wire {
        // The send buffer rounded to bf16 (nearest, ties to even: the host's rounding),
        // exchanged, widened back.
        let mut send16 = wire.send16.view_mut(dev, ns)?;
        let mut recv16 = wire.recv16.view_mut(dev, nr)?;
        if ns > 0 {
            f32_to_bf16(dev, &send.as_view(), &mut send16)?;
        }
        comm.all_to_all_v(
            send16.as_view().into(),
            &ex.send_counts,
            recv16.slice_mut(..).into(),
            &ex.recv_counts,
        )?;
        if nr > 0 {
            bf16_to_f32(dev, &recv16.as_view(), &mut recv)?;
        }
    } else {
        comm.all_to_all_v(
            send.as_view().into(),
            &ex.send_counts,
            recv.slice_mut(..).into(),
            &ex.recv_counts,
        )?;
    }
    copy_runs(dev, &ex.unpack, &recv.as_view(), to)?;
    copy_runs(dev, &ex.own, from, to)
}

fn copy_runs(
    dev: &Device,
    runs: &[crate::roots::Run],
    from: &CudaView<'_, f32>,
    to: &mut CudaViewMut<'_, f32>,
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
