//! Element ops on device `f32` runs (a gradient slot, a local shard), one kernel launch each
//! (`kernels/group_ops.cu`): zero, scale, add, axpy, copy. Each is one IEEE `f32` operation per
//! element, so it equals the host loop bit for bit (and the count of non-finite elements is an
//! exact integer); [`crate::storage`] dispatches host and
//! device views to the loop or the kernel, so callers have one code path.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{check_len, count, elementwise, guarded, Device, GROUP_OPS};
use crate::Result;

/// Entry points of `kernels/group_ops.cu`.
pub const GROUP_ZERO: &str = "group_zero";
pub const GROUP_SCALE: &str = "group_scale";
pub const GROUP_ADD: &str = "group_add";
pub const GROUP_COPY: &str = "group_copy";
pub const GROUP_AXPY: &str = "group_axpy";
pub const GROUP_COUNT_NON_FINITE: &str = "group_count_non_finite";

/// `x ← 0`.
pub fn zero(dev: &Device, x: &mut CudaViewMut<'_, f32>) -> Result<()> {
    let f = dev.function(&GROUP_OPS, GROUP_ZERO)?;
    let n = count(x.len());
    let cfg = elementwise(x.len());
    // SAFETY: `group_zero(float*, u64)` writes elements `[0, n)` of `x`, which holds `n`.
    guarded("cuda::ops::zero", || unsafe {
        dev.stream().launch_builder(&f).arg(x).arg(&n).launch(cfg)
    })
    .map(drop)
}

/// `x ← a·x`.
pub fn scale(dev: &Device, x: &mut CudaViewMut<'_, f32>, a: f32) -> Result<()> {
    let f = dev.function(&GROUP_OPS, GROUP_SCALE)?;
    let n = count(x.len());
    let cfg = elementwise(x.len());
    // SAFETY: `group_scale(float*, float, u64)` reads and writes elements `[0, n)` of `x`.
    guarded("cuda::ops::scale", || unsafe {
        dev.stream()
            .launch_builder(&f)
            .arg(x)
            .arg(&a)
            .arg(&n)
            .launch(cfg)
    })
    .map(drop)
}

/// `x ← x + y` (same lengths).
pub fn add(dev: &Device, x: &mut CudaViewMut<'_, f32>, y: &CudaView<'_, f32>) -> Result<()> {
    binary(dev, x, y, GROUP_ADD, "cuda::ops::add")
}

/// `x ← y` (same lengths).
pub fn copy(dev: &Device, x: &mut CudaViewMut<'_, f32>, y: &CudaView<'_, f32>) -> Result<()> {
    binary(dev, x, y, GROUP_COPY, "cuda::ops::copy")
}

/// `x ← x + a·y` (same lengths; the product rounded before the sum).
pub fn axpy(
    dev: &Device,
    x: &mut CudaViewMut<'_, f32>,
    y: &CudaView<'_, f32>,
    a: f32,
) -> Result<()> {
    const OP: &str = "cuda::ops::axpy";
    check_len(OP, y.len(), x.len())?;
    let f = dev.function(&GROUP_OPS, GROUP_AXPY)?;
    let n = count(x.len());
    let cfg = elementwise(x.len());
    // SAFETY: `group_axpy(float* x, const float* y, float a, u64 n)` touches elements `[0, n)`
    // of both, and both hold `n` (checked above).
    guarded(OP, || unsafe {
        dev.stream()
            .launch_builder(&f)
            .arg(x)
            .arg(y)
            .arg(&a)
            .arg(&n)
            .launch(cfg)
    })
    .map(drop)
}

fn binary(
    dev: &Device,
    x: &mut CudaViewMut<'_, f32>,
    y: &CudaView<'_, f32>,
    entry: &str,
    op: &'static str,
) -> Result<()> {
    check_len(op, y.len(), x.len())?;
    let f = dev.function(&GROUP_OPS, entry)?;
    let n = count(x.len());
    let cfg = elementwise(x.len());
    // SAFETY: the kernel `(float* x, const float* y, u64 n)` touches elements `[0, n)` of both,
    // and both hold `n` (checked above).
    guarded(op, || unsafe {
        dev.stream()
            .launch_builder(&f)
            .arg(x)
            .arg(y)
            .arg(&n)
            .launch(cfg)
    })
    .map(drop)
}

/// Adds to `total[0]` how many elements of `x` are NaN or infinite: one kernel, queued (the
/// count is read with one download after any number of these: `storage::NonFiniteCounts`).
pub fn add_non_finite(
    dev: &Device,
    x: &CudaView<'_, f32>,
    total: &mut CudaViewMut<'_, u64>,
) -> Result<()> {
    const OP: &str = "cuda::ops::add_non_finite";
    check_len(OP, total.len(), 1)?;
    let f = dev.function(&GROUP_OPS, GROUP_COUNT_NON_FINITE)?;
    let n = count(x.len());
    let cfg = elementwise(x.len());
    // SAFETY: `group_count_non_finite(const float* x, u64 n, u64* count)` reads elements
    // `[0, n)` of `x`, which holds `n`, and adds to the one element of `total` (checked).
    guarded(OP, || unsafe {
        dev.stream()
            .launch_builder(&f)
            .arg(x)
            .arg(&n)
            .arg(total)
            .launch(cfg)
    })
    .map(drop)
}
