//! The device twin of the host DBuffer ([`crate::dbuffer`]): one device allocation per group and role,
//! laid out by the same [`Geometry`] (the plan's shard size and per-tensor offsets), with the
//! fused group ops (zero, scale, add, copy) as one kernel launch each (`kernels/group_ops.cu`).
//!
//! Like the CPU buffer, it holds either the full buffer (`V·S` elements; the local shard is
//! the slice `[rank·S, (rank+1)·S)`) or only the persistent `S`-element local shard. Padding
//! starts zero and no op here writes outside the local shard. The group ops are single IEEE
//! `f32` operations per element, so they equal the CPU ops bit for bit.
//!
//! In-place collectives on any communicator that takes device buffers (NCCL
//! or thread ranks on one GPU): [`super::collective::all_gather_dbuffer`] and
//! [`super::collective::reduce_scatter_dbuffer`], on buffers that keep their full buffer.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};

use super::{check_len, count, elementwise, guarded, Device, GROUP_OPS};
use crate::dbuffer::{Geometry, Role};
use crate::{Error, Result};

/// Entry points of `kernels/group_ops.cu`.
pub const GROUP_ZERO: &str = "group_zero";
pub const GROUP_SCALE: &str = "group_scale";
pub const GROUP_ADD: &str = "group_add";
pub const GROUP_COPY: &str = "group_copy";

/// One group's device buffer for one role.
pub struct DeviceDBuffer {
    role: Role,
    geometry: Arc<Geometry>,
    /// The full buffer (`keep_full`), or the `S`-element local shard.
    data: CudaSlice<f32>,
    full: bool,
}

impl DeviceDBuffer {
    /// A zeroed buffer: the full `V·S` buffer when `keep_full`, else only the local shard.
    pub fn zeros(
        dev: &Device,
        role: Role,
        geometry: Arc<Geometry>,
        keep_full: bool,
    ) -> Result<Self> {
        let len = if keep_full {
            geometry.full_len()
        } else {
            geometry.shard_size
        };
        Ok(DeviceDBuffer {
            role,
            data: dev.zeros::<f32>(len)?,
            geometry,
            full: keep_full,
        })
    }

    pub fn role(&self) -> Role {
        self.role
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Whether the full buffer is held.
    pub fn is_unsharded(&self) -> bool {
        self.full
    }

    /// The local shard's range inside the allocation.
    fn local(&self) -> std::ops::Range<usize> {
        if self.full {
            self.geometry.local_range()
        } else {
            0..self.geometry.shard_size
        }
    }

    /// The local shard, read-only.
    pub fn local_view(&self) -> CudaView<'_, f32> {
        self.data.slice(self.local())
    }

    /// The local shard, mutable (what the device optimizer steps take).
    pub fn local_view_mut(&mut self) -> CudaViewMut<'_, f32> {
        let r = self.local();
        self.data.slice_mut(r)
    }

    /// The full buffer, or `Err` when only the shard is held.
    pub fn full_view(&self) -> Result<CudaView<'_, f32>> {
        if !self.full {
            return Err(Error::InvalidShard {
                op: "DeviceDBuffer::full_view",
                reason: format!("{:?} buffer holds only its local shard", self.role),
            });
        }
        Ok(self.data.slice(..))
    }

    /// The whole allocation when it is the full buffer (for the in-place NCCL collectives).
    pub(crate) fn full_slice_mut(&mut self, op: &'static str) -> Result<&mut CudaSlice<f32>> {
        if !self.full {
            return Err(Error::InvalidShard {
                op,
                reason: format!(
                    "{:?} buffer holds only its local shard; in-place collectives need the \
                     full buffer (keep_full)",
                    self.role
                ),
            });
        }
        Ok(&mut self.data)
    }

    /// Copies `host` (the local shard, `S` elements) to the device.
    pub fn upload_local(&mut self, dev: &Device, host: &[f32]) -> Result<()> {
        const OP: &str = "DeviceDBuffer::upload_local";
        check_len(OP, host.len(), self.geometry.shard_size)?;
        let mut view = self.local_view_mut();
        guarded(OP, || dev.stream().memcpy_htod(host, &mut view))
    }

    /// A host copy of the local shard.
    pub fn download_local(&self, dev: &Device) -> Result<Vec<f32>> {
        dev.download(&self.local_view())
    }

    /// Fused group op: `x ← 0` over the local shard.
    pub fn zero_local(&mut self, dev: &Device) -> Result<()> {
        let f = dev.function(&GROUP_OPS, GROUP_ZERO)?;
        let n = count(self.geometry.shard_size);
        let cfg = elementwise(self.geometry.shard_size);
        let mut x = self.local_view_mut();
        guarded("DeviceDBuffer::zero_local", || unsafe {
            dev.stream()
                .launch_builder(&f)
                .arg(&mut x)
                .arg(&n)
                .launch(cfg)
        })
        .map(drop)
    }

    /// Fused group op: `x ← a·x` over the local shard.
    pub fn scale_local(&mut self, dev: &Device, a: f32) -> Result<()> {
        let f = dev.function(&GROUP_OPS, GROUP_SCALE)?;
        let n = count(self.geometry.shard_size);
        let cfg = elementwise(self.geometry.shard_size);
        let mut x = self.local_view_mut();
        guarded("DeviceDBuffer::scale_local", || unsafe {
            dev.stream()
                .launch_builder(&f)
                .arg(&mut x)
                .arg(&a)
                .arg(&n)
                .launch(cfg)
        })
        .map(drop)
    }

    /// Fused group op: `x ← x + y` over the local shard (`y` has the same geometry).
    pub fn add_local(&mut self, dev: &Device, y: &DeviceDBuffer) -> Result<()> {
        self.binary(dev, y, GROUP_ADD, "DeviceDBuffer::add_local")
    }

    /// Fused group op: `x ← y` over the local shard.
    pub fn copy_local_from(&mut self, dev: &Device, y: &DeviceDBuffer) -> Result<()> {
        self.binary(dev, y, GROUP_COPY, "DeviceDBuffer::copy_local_from")
    }

    fn binary(
        &mut self,
        dev: &Device,
        y: &DeviceDBuffer,
        entry: &str,
        op: &'static str,
    ) -> Result<()> {
        check_len(op, y.geometry.shard_size, self.geometry.shard_size)?;
        let f = dev.function(&GROUP_OPS, entry)?;
        let n = count(self.geometry.shard_size);
        let cfg = elementwise(self.geometry.shard_size);
        let yv = y.local_view();
        let mut x = self.local_view_mut();
        guarded(op, || unsafe {
            dev.stream()
                .launch_builder(&f)
                .arg(&mut x)
                .arg(&yv)
                .arg(&n)
                .launch(cfg)
        })
        .map(drop)
    }
}
