//! Element ops on device `f32` runs (a gradient slot, a local shard), one kernel launch each
//! (`kernels/group_ops.cu`): zero, scale, add, axpy, copy. Each is one IEEE `f32` operation per
//! element, so it equals the host loop bit for bit (and the count of non-finite elements is an
//! exact integer); [`crate::storage`] dispatches host and
//! device views to the loop or the kernel, so callers have one code path.

use cudarc::driver::{CudaView, CudaViewMut, DeviceRepr, PushKernelArg};

use super::{check_len, count, elementwise, guarded, Device, GROUP_OPS};
use crate::Result;

/// Entry points of `kernels/group_ops.cu`.
pub const GROUP_ZERO: &str = "group_zero";
pub const GROUP_SCALE: &str = "group_scale";
pub const GROUP_ADD: &str = "group_add";
pub const GROUP_COPY: &str = "group_copy";
pub const GROUP_AXPY: &str = "group_axpy";
pub const GROUP_COUNT_NON_FINITE: &str = "group_count_non_finite";
pub const GROUP_EXACT_SQUARES: &str = "group_exact_squares";
pub const GROUP_F32_TO_BF16: &str = "group_f32_to_bf16";
pub const GROUP_BF16_TO_F32: &str = "group_bf16_to_f32";
pub const GROUP_ACCUMULATE_BF16: &str = "group_accumulate_bf16";

/// Words of [`add_exact_squares`]'s accumulator: the count of non-finite elements, then a low
/// and a high word per bin of gradient clipping's exact sum (`fsdp::clip`).
pub const EXACT_SQUARES_WORDS: usize = 1 + 2 * crate::fsdp::clip::BINS;

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

/// Adds the exact squares of `x`'s elements, and its count of non-finite ones, to `acc`
/// ([`EXACT_SQUARES_WORDS`] words; `fsdp::clip` reads them into its bins): one kernel, queued.
/// Integer sums only, so the result is the same whatever the threads' order.
pub fn add_exact_squares(
    dev: &Device,
    x: &CudaView<'_, f32>,
    acc: &mut CudaViewMut<'_, u64>,
) -> Result<()> {
    const OP: &str = "cuda::ops::add_exact_squares";
    check_len(OP, acc.len(), EXACT_SQUARES_WORDS)?;
    if x.is_empty() {
        return Ok(());
    }
    let f = dev.function(&GROUP_OPS, GROUP_EXACT_SQUARES)?;
    // Every thread block adds its nonzero bins to `acc` at the end: two blocks per
    // multiprocessor keep the device busy without many more of those additions.
    let most = 2 * dev.multiprocessors()?;
    let mut cfg = elementwise(x.len());
    cfg.grid_dim.0 = cfg.grid_dim.0.min(u32::try_from(most).unwrap_or(u32::MAX));
    let n = count(x.len());
    // SAFETY: `group_exact_squares(const float* x, u64 n, u64* out)` reads elements `[0, n)` of
    // `x`, which holds `n`, and adds to the EXACT_SQUARES_WORDS words of `acc` (checked).
    guarded(OP, || unsafe {
        dev.stream()
            .launch_builder(&f)
            .arg(x)
            .arg(&n)
            .arg(acc)
            .launch(cfg)
    })
    .map(drop)
}

/// A bf16 element as the conversion kernels take it: `half::bf16`, or its bits as `u16`
/// (cuBLAS's element type in Newton–Schulz).
pub trait Bf16Bits: DeviceRepr + sealed::Sealed {}
impl Bf16Bits for half::bf16 {}
impl Bf16Bits for u16 {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for u16 {}
}

/// `out ← x` rounded to bf16, to nearest even (`half::bf16::from_f32`'s rounding; a NaN stays
/// a quiet NaN): mixed precision's compute copies, cast before the all-gather, and
/// Newton–Schulz's bf16 operands.
pub fn f32_to_bf16<B: Bf16Bits>(
    dev: &Device,
    x: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, B>,
) -> Result<()> {
    convert(dev, "cuda::ops::f32_to_bf16", GROUP_F32_TO_BF16, x, out)
}

/// `out ← x` widened to f32 (exact): a bf16 reduction's shard, Newton–Schulz's result.
pub fn bf16_to_f32<B: Bf16Bits>(
    dev: &Device,
    x: &CudaView<'_, B>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    convert(dev, "cuda::ops::bf16_to_f32", GROUP_BF16_TO_F32, x, out)
}

/// One of the conversion kernels `entry(const A* x, B* out, u64 n)` over equal lengths.
fn convert<A: DeviceRepr, B: DeviceRepr>(
    dev: &Device,
    op: &'static str,
    entry: &str,
    x: &CudaView<'_, A>,
    out: &mut CudaViewMut<'_, B>,
) -> Result<()> {
    check_len(op, out.len(), x.len())?;
    if x.is_empty() {
        return Ok(());
    }
    let f = dev.function(&GROUP_OPS, entry)?;
    let n = count(x.len());
    // SAFETY: `group_f32_to_bf16` / `group_bf16_to_f32` read `n` elements of `x` and write `n`
    // of `out` (checked: equal lengths); their callers type them f32 and 16-bit `Bf16Bits`.
    guarded(op, || unsafe {
        dev.stream()
            .launch_builder(&f)
            .arg(x)
            .arg(out)
            .arg(&n)
            .launch(elementwise(x.len()))
    })
    .map(drop)
}

/// `x ← g` widened when `first`, else `x ← x + g` widened: a bf16 gradient into its f32
/// slot (the host loop's operations, so the same bits).
pub fn accumulate_bf16(
    dev: &Device,
    x: &mut CudaViewMut<'_, f32>,
    g: &CudaView<'_, half::bf16>,
    first: bool,
) -> Result<()> {
    const OP: &str = "cuda::ops::accumulate_bf16";
    check_len(OP, g.len(), x.len())?;
    if x.is_empty() {
        return Ok(());
    }
    let f = dev.function(&GROUP_OPS, GROUP_ACCUMULATE_BF16)?;
    let (n, first) = (count(x.len()), u32::from(first));
    // SAFETY: `group_accumulate_bf16(float* x, const u16* g, u64 n, u32 first)` reads and
    // writes `n` elements of `x` and reads `n` of `g` (checked: equal lengths).
    guarded(OP, || unsafe {
        dev.stream()
            .launch_builder(&f)
            .arg(x)
            .arg(g)
            .arg(&n)
            .arg(&first)
            .launch(elementwise(n as usize))
    })
    .map(drop)
}
