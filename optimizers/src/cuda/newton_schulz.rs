//! Newton–Schulz on cuBLAS: the algorithm of [`crate::newton_schulz`] on a stack of `batch`
//! equal-shape row-major `rows × cols` matrices in device memory (an `[E, m, n]` expert stack
//! is one call), every product one strided-batched GEMM.
//!
//! | # | operation | device |
//! |---|---|---|
//! | 1 | if `rows > cols`, `X ← Xᵀ` | `ns_transpose` (kernels/newton_schulz.cu) |
//! | 2 | `X ← X / max(s·‖X‖_F, eps)` (`s` = `norm_scale`; a non-finite norm makes every entry NaN) | `ns_sumsq_partial` + `ns_normalize` (f64 sum, f32 division) |
//! | 3 | `P = X·Xᵀ` | GEMM, `α = 1, β = 0`; or syrk + `ns_symmetrize_lower` ([`GramProduct`]) |
//! |   | `Q = b·P + c·P·P` | copy `P → Q`, GEMM `α = c, β = b`; or syrk (`P·P = P·Pᵀ`) + symmetrize |
//! |   | `X ← a·X + Q·X` | copy `X → Y`, GEMM `α = 1, β = a`, swap |
//! | 4 | transpose back | `ns_transpose` |
//!
//! Step 3 takes the method `cfg` gives the shape on the CPU
//! ([`crate::newton_schulz::NsMethod`]; `Auto`: Gram Newton–Schulz where it pays): Gram's
//! products are the same GEMMs (`R = X·Xᵀ` and `b·R + c·R·R` on syrk where the standard
//! iteration's are), `a` is added to `Q`'s diagonal by `ns_add_diagonal_f32` /
//! `ns_add_diagonal_bf16`, and the products of two `s × s` polynomials and `M·X` are plain
//! GEMMs; the restarts are the CPU's (one `gram_steps` runs both). `NsConfig::backend` names
//! the CPU's kernels: here it only keeps `Auto` standard when it names the reference loops.
//!
//! The buffers a call works in (`X` normalized, `Y`, the `s × s` products, the norm's partial
//! sums) are views of an [`NsWorkspace`] whose size [`NsNeed::of`] declares from the shape and
//! the configuration: [`orthogonalize_cuda_in`] runs in one the caller keeps (Muon's step
//! reserves the largest call of the step before the first, so it allocates nothing after its
//! first step); [`orthogonalize_cuda`] makes one for the call.
//!
//! Row-major buffers are column-major transposes, so each product is issued as its transpose
//! (`Cᵀ = Bᵀ·Aᵀ`); no data moves. GEMMs use `cublasGemmStridedBatchedEx` with
//! `CUBLAS_COMPUTE_32F` (no TF32) and `f32` α, β from the host.
//!
//! # The symmetric products ([`GramProduct`])
//! `P = X·Xᵀ` and `P·P` (`P` symmetric, so `P·P = P·Pᵀ`) are symmetric: `cublasSsyrk` computes
//! one triangle with half the multiply-adds, and `ns_symmetrize_lower` copies it onto the other
//! (the next GEMM needs the whole matrix). That cuts a step from `4s²l + 2s³` to `3s²l + s³`
//! FLOPs. cuBLAS has syrk for `f32` only (bf16 stays on the tensor-core GEMM) and no batched
//! form (one call per matrix), so [`GramProduct::Auto`] takes syrk for `f32` with `s ≥ 256` and
//! GEMM otherwise; `ragged bench optim --device cuda` measures both.
//!
//! # Precision (`NsConfig::precision`)
//! - [`NsPrecision::F32`]: `f32` operands and results. Equal to the CPU up to summation order:
//!   cuBLAS accumulates dot products in its own (blocked, FMA) order, the CPU in index order
//!   without FMA, so the results differ by rounding. Tests compare with a tolerance of `1e-4`
//!   absolute on the orthogonalized matrix (entries are `O(1/√min(m, n))`…`O(1)`; five steps
//!   of rounding differences of `~1e-7` relative each, amplified by the polynomial's slope ≤ 3).
//! - [`NsPrecision::Bf16`]: the CPU's bf16 semantics: the input is rounded to bf16, the norm
//!   taken of the rounded values and the division done in `f32`, then `X`, `P`, `Q` are stored
//!   in bf16 (round to nearest even); each GEMM multiplies bf16 operands with `f32`
//!   accumulation and adds its addend (`b·P`, `a·X`, GEMM β) in `f32` before one rounding to
//!   bf16 (torch's `use_addmm` form). The result is widened back to `f32`. Equal to the CPU's
//!   bf16 path up to summation order; tests allow a relative Frobenius difference of `5e-2`.

use ragged::cuda::cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use ragged::cuda::cudarc::driver::{
    CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use ragged::cuda::ops::{bf16_to_f32, f32_to_bf16};
use ragged::cuda::{count, elementwise, guarded, Device, NEWTON_SCHULZ};
use ragged::{Error, Result};

pub use crate::newton_schulz::NsShape;
use crate::newton_schulz::{iterate_with, resolve_method, NsConfig, NsMethod, NsOps, NsPrecision};
use ragged::cuda::Scratch;

/// Entry points of `kernels/newton_schulz.cu`.
pub const NS_TRANSPOSE: &str = "ns_transpose";
pub const NS_SUMSQ_PARTIAL: &str = "ns_sumsq_partial";
pub const NS_NORMALIZE: &str = "ns_normalize";
pub const NS_SYMMETRIZE_LOWER: &str = "ns_symmetrize_lower";
pub const NS_ADD_DIAGONAL_F32: &str = "ns_add_diagonal_f32";
pub const NS_ADD_DIAGONAL_BF16: &str = "ns_add_diagonal_bf16";

/// Blocks per matrix of the sum-of-squares pass (fixed, so the partial sums are always added
/// in the same order: the result does not depend on the device).
/// CUDA's limit on a grid's y and z dimensions.
const GRID_YZ_MAX: usize = 65_535;
const SUMSQ_BLOCKS: u32 = 64;

fn data_type(prec: NsPrecision) -> blas_sys::cudaDataType_t {
    match prec {
        NsPrecision::F32 => blas_sys::cudaDataType_t::CUDA_R_32F,
        NsPrecision::Bf16 => blas_sys::cudaDataType_t::CUDA_R_16BF,
    }
}

fn int(op: &'static str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::BadInput {
        op,
        what: format!("dimension {x}"),
        reason: "larger than cuBLAS's i32 dimensions".into(),
    })
}

/// The arguments of one column-major strided-batched cuBLAS GEMM
/// `C = α·op(first)·op(second) + β·C` (cuBLAS's `A`, `B` slots are `first`, `second`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmArgs {
    pub trans_first: bool,
    pub trans_second: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub ld_first: i32,
    pub stride_first: i64,
    pub ld_second: i32,
    pub stride_second: i64,
    pub ldc: i32,
    pub stride_c: i64,
}

impl GemmArgs {
    /// Row-major `C = A·B` (`A: rows×inner`, `B: inner×cols`, `C: rows×cols`), issued as the
    /// column-major `Cᵀ = Bᵀ·Aᵀ`: the row-major buffers of `B` and `A` are the column-major
    /// `Bᵀ` (`cols×inner`, ld `cols`) and `Aᵀ` (`inner×rows`, ld `inner`), so **`first` is
    /// `B`'s buffer and `second` is `A`'s**.
    pub fn row_major(rows: i32, cols: i32, inner: i32) -> Self {
        let (r, c, i) = (i64::from(rows), i64::from(cols), i64::from(inner));
        GemmArgs {
            trans_first: false,
            trans_second: false,
            m: cols,
            n: rows,
            k: inner,
            ld_first: cols,
            stride_first: i * c,
            ld_second: inner,
            stride_second: r * i,
            ldc: cols,
            stride_c: r * c,
        }
    }

    /// Row-major Gram matrix `P = X·Xᵀ` of `X: s×l` (`P: s×s`): the buffer of `X` is the
    /// column-major `Xᵀ` (`l×s`, ld `l`), and `P = (Xᵀ)ᵀ·Xᵀ` is symmetric, so row- and
    /// column-major agree up to rounding: **`first` and `second` are both `X`'s buffer**,
    /// the first used transposed.
    pub fn row_major_gram(s: i32, l: i32) -> Self {
        let (s6, l6) = (i64::from(s), i64::from(l));
        GemmArgs {
            trans_first: true,
            trans_second: false,
            m: s,
            n: s,
            k: l,
            ld_first: l,
            stride_first: s6 * l6,
            ld_second: l,
            stride_second: s6 * l6,
            ldc: s,
            stride_c: s6 * s6,
        }
    }
}

/// One strided-batched GEMM (`args`) on the device, `f32` α and β from the host, `f32`
/// accumulation (`CUBLAS_COMPUTE_32F`, no TF32). `T` is `f32` or the `u16` bits of bf16 (per
/// `prec`).
#[allow(clippy::too_many_arguments)]
fn gemm<T>(
    blas: &CudaBlas,
    dev: &Device,
    prec: NsPrecision,
    batch: i32,
    args: &GemmArgs,
    first: &impl DevicePtr<T>,
    second: &impl DevicePtr<T>,
    c: &mut impl DevicePtrMut<T>,
    (alpha, beta): (f32, f32),
) -> Result<()> {
    use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
    let stream = dev.stream();
    let dt = data_type(prec);
    let (fp, _gf) = first.device_ptr(stream);
    let (sp, _gs) = second.device_ptr(stream);
    let (cp, _gc) = c.device_ptr_mut(stream);
    // SAFETY: the callers size `first`, `second` and `c` for `batch` matrices at `args`'
    // dense strides (`GemmArgs`' constructors); α and β are host pointers (the handle's
    // default pointer mode); the guards keep the buffers alive until the call is queued.
    guarded("newton_schulz gemm", || unsafe {
        blas::gemm_strided_batched_ex(
            *blas.handle(),
            op(args.trans_first),
            op(args.trans_second),
            args.m,
            args.n,
            args.k,
            (&alpha) as *const f32 as *const _,
            fp as *const _,
            dt,
            args.ld_first,
            args.stride_first,
            sp as *const _,
            dt,
            args.ld_second,
            args.stride_second,
            (&beta) as *const f32 as *const _,
            cp as *mut _,
            dt,
            args.ldc,
            args.stride_c,
            batch,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    })
}

/// How the two symmetric products of a step are computed (module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GramProduct {
    /// syrk for `f32` when the short side is at least 256, else GEMM.
    #[default]
    Auto,
    /// Full GEMMs (strided-batched).
    Gemm,
    /// `cublasSsyrk` and a symmetrizing kernel (`f32` only; `Err` for bf16).
    Syrk,
}

impl GramProduct {
    /// Whether syrk runs for short side `s` in `prec`; `Err` for syrk in bf16.
    fn use_syrk(self, prec: NsPrecision, s: usize) -> Result<bool> {
        match (self, prec) {
            (GramProduct::Syrk, NsPrecision::Bf16) => Err(no_bf16_syrk()),
            (GramProduct::Syrk, NsPrecision::F32) => Ok(true),
            (GramProduct::Gemm, _) => Ok(false),
            (GramProduct::Auto, p) => Ok(p == NsPrecision::F32 && s >= 256),
        }
    }
}

/// Orthogonalizes the `batch` row-major `rows × cols` matrices stored back to back in `x`, in
/// place (the module table), with [`GramProduct::Auto`]. Queued on the device's stream; the
/// workspace is allocated for this call ([`orthogonalize_cuda_in`] keeps one).
pub fn orthogonalize_cuda(
    dev: &Device,
    x: &mut CudaViewMut<'_, f32>,
    batch: usize,
    rows: usize,
    cols: usize,
    cfg: &NsConfig,
) -> Result<()> {
    orthogonalize_cuda_with(dev, x, batch, rows, cols, cfg, GramProduct::Auto)
}

/// [`orthogonalize_cuda`] with the symmetric products computed as `gram` says.
pub fn orthogonalize_cuda_with(
    dev: &Device,
    x: &mut CudaViewMut<'_, f32>,
    batch: usize,
    rows: usize,
    cols: usize,
    cfg: &NsConfig,
    gram: GramProduct,
) -> Result<()> {
    let shape = NsShape::new(batch, rows, cols);
    orthogonalize_cuda_in(dev, x, shape, cfg, gram, &mut NsWorkspace::default())
}

/// The device memory one Newton–Schulz call works in, in elements of each type it stores:
/// `f32` (`X` normalized; in `f32` also `Y` and the `s × s` products), bf16 bits (in bf16:
/// `X`, `Y` and the products) and the `f64` partial sums of the norm. Declared before use: a
/// caller that reserves the largest need of a step ([`NsWorkspace::reserve`]) allocates
/// nothing during it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NsNeed {
    pub f32: usize,
    pub bf16: usize,
    pub f64: usize,
}

impl NsNeed {
    /// What [`orthogonalize_cuda_in`] takes for `shape` under `cfg`: the products of `s × s`
    /// (`s` the short side) are two for the standard iteration, four for Gram's; each buffer
    /// of the iteration starts at a multiple of [`ALIGN_BYTES`]. `Err` for a shape whose
    /// workspace has more elements than a `usize` counts.
    pub fn of(shape: NsShape, cfg: &NsConfig) -> Result<NsNeed> {
        carving(shape, cfg).map(|(need, _)| need)
    }

    /// The larger of each count: a workspace for both calls.
    pub fn max(self, other: NsNeed) -> NsNeed {
        NsNeed {
            f32: self.f32.max(other.f32),
            bf16: self.bf16.max(other.bf16),
            f64: self.f64.max(other.f64),
        }
    }
}

/// How a call's workspace is cut, in elements of the iteration's type (`f32` or bf16): `X`
/// and `Y` of `x` each (the `stack`, padded), then the products, `square` each (a stack of
/// `s × s` matrices, padded).
#[derive(Clone, Copy, Debug)]
struct Carving {
    stack: usize,
    x: usize,
    square: usize,
}

/// [`NsNeed::of`] and the [`Carving`] it is made of.
fn carving(shape: NsShape, cfg: &NsConfig) -> Result<(NsNeed, Carving)> {
    let NsShape { batch, rows, cols } = shape;
    let (s, l) = (rows.min(cols), rows.max(cols));
    let products = if iterates_gram(cfg, s, l) { 4 } else { 2 };
    let elem = match cfg.precision {
        NsPrecision::F32 => 4,
        NsPrecision::Bf16 => 2,
    };
    let count = |factors: &[usize]| factors.iter().try_fold(1usize, |n, &f| n.checked_mul(f));
    let cut = (|| {
        let stack = count(&[batch, rows, cols])?;
        let carving = Carving {
            stack,
            x: aligned(stack, elem)?,
            square: aligned(count(&[batch, s, s])?, elem)?,
        };
        let iteration = count(&[2, carving.x])?.checked_add(count(&[products, carving.square])?)?;
        let f64 = count(&[batch, SUMSQ_BLOCKS as usize])?;
        let need = match cfg.precision {
            // `X` is the normalized stack itself.
            NsPrecision::F32 => NsNeed {
                f32: iteration,
                bf16: 0,
                f64,
            },
            NsPrecision::Bf16 => NsNeed {
                f32: stack,
                bf16: iteration,
                f64,
            },
        };
        Some((need, carving))
    })();
    cut.ok_or_else(|| Error::BadInput {
        op: "NsNeed::of",
        what: format!("{batch} matrices of {rows}×{cols}"),
        reason: "the Newton–Schulz workspace's element count overflows usize".into(),
    })
}

/// Where each buffer of the iteration starts in the workspace: a multiple of 256 bytes, as a
/// buffer of its own would (`cuMemAlloc`'s alignment), so cuBLAS picks the kernels it picks
/// for aligned operands (Hopper's TMA kernels need at least 16).
pub const ALIGN_BYTES: usize = 256;

/// `n` elements of `elem` bytes rounded up to whole [`ALIGN_BYTES`] (`None` on overflow).
fn aligned(n: usize, elem: usize) -> Option<usize> {
    let per = ALIGN_BYTES / elem;
    n.div_ceil(per).checked_mul(per)
}

/// Newton–Schulz's device workspace ([`NsNeed`]), kept by the caller between calls: it grows
/// to the largest need it meets and is reused after that.
#[derive(Default)]
pub struct NsWorkspace {
    f32: Scratch<f32>,
    bf16: Scratch<u16>,
    f64: Scratch<f64>,
}

impl NsWorkspace {
    /// At least `need` on `dev` from now on.
    pub fn reserve(&mut self, dev: &Device, need: NsNeed) -> Result<()> {
        self.f32.reserve(dev, need.f32)?;
        self.bf16.reserve(dev, need.bf16)?;
        self.f64.reserve(dev, need.f64)
    }

    /// The device bytes it holds.
    pub fn bytes(&self) -> usize {
        self.f32.bytes() + self.bf16.bytes() + self.f64.bytes()
    }
}

/// Whether step 3 runs Gram Newton–Schulz on short side `s`, long side `l`: the method `cfg`
/// gives this shape on the CPU (and in `ns_macs`); `Auto` is Gram where it pays, unless `cfg`
/// names the CPU's reference loops.
fn iterates_gram(cfg: &NsConfig, s: usize, l: usize) -> bool {
    resolve_method(cfg, cfg.backend, s, l) == NsMethod::Gram
}

/// [`orthogonalize_cuda_with`] in `work` (grown to [`NsNeed::of`] this call where smaller).
pub fn orthogonalize_cuda_in(
    dev: &Device,
    x: &mut CudaViewMut<'_, f32>,
    shape: NsShape,
    cfg: &NsConfig,
    gram: GramProduct,
    work: &mut NsWorkspace,
) -> Result<()> {
    const OP: &str = "orthogonalize_cuda";
    cfg.validate()?;
    let NsShape { batch, rows, cols } = shape;
    let prec = cfg.precision;
    let stack = rows.checked_mul(cols).and_then(|mn| mn.checked_mul(batch));
    if stack != Some(x.len()) {
        return Err(Error::BadInput {
            op: OP,
            what: format!("{} elements", x.len()),
            reason: format!("{batch} matrices of {rows}×{cols}"),
        });
    }
    if x.is_empty() {
        return Ok(());
    }
    let mn = rows * cols; // (`batch · mn` elements are there: no overflow)
    let transposed = rows > cols;
    let (s, l) = if transposed {
        (cols, rows)
    } else {
        (rows, cols)
    };
    // cuBLAS takes dimensions and leading dimensions as i32, strides as i64, and the kernels
    // index in 64 bits: a stack may hold more than 2^31 elements.
    let (bi, si, li) = (int(OP, batch)?, int(OP, s)?, int(OP, l)?);
    let syrk = gram.use_syrk(prec, s)?;
    let stream = dev.stream();
    // The batch is a grid's y (steps 2-3) or z (the transpose) dimension, and the transpose's
    // y counts 32-row tiles of the long side: each at most 65 535, checked before any launch.
    if batch > GRID_YZ_MAX || (transposed && l.div_ceil(32) > GRID_YZ_MAX) {
        return Err(Error::BadInput {
            op: OP,
            what: format!("{batch} matrices of {rows}×{cols}"),
            reason: format!(
                "at most {GRID_YZ_MAX} matrices per call, and for a tall matrix at most \
                 {GRID_YZ_MAX} tiles of 32 rows"
            ),
        });
    }
    let (need, cut) = carving(shape, cfg)?;
    let stack = cut.stack;
    let mut f32s = work.f32.view_mut(dev, need.f32)?;
    let mut bf16s = work.bf16.view_mut(dev, need.bf16)?;
    let mut partial = work.f64.view_mut(dev, need.f64)?;
    // `f32`: `X` padded, `Y` and the products after it; bf16: `X` normalized in `f32`, the
    // iteration's buffers in `bf16s`.
    let x_len = match prec {
        NsPrecision::F32 => cut.x,
        NsPrecision::Bf16 => stack,
    };
    let (mut xw, mut rest) = f32s.split_at_mut(x_len);

    // Step 1 into the working buffer.
    if transposed {
        transpose(dev, &*x, &mut xw, batch, rows, cols)?;
    } else {
        guarded(OP, || stream.memcpy_dtod(&*x, &mut xw))?;
    }

    // bf16: the input is rounded to bf16 first (the norm is taken of the rounded values).
    if prec == NsPrecision::Bf16 {
        let mut xb = bf16s.slice_mut(..stack);
        f32_to_bf16(dev, &xw.as_view(), &mut xb)?;
        bf16_to_f32(dev, &xb.as_view(), &mut xw)?;
    }

    // Step 2.
    normalize(dev, &mut xw, &mut partial, (batch, mn), cfg)?;

    // Step 3, by the method `cfg` gives this shape on the CPU. The iteration's buffers are
    // padded views (its operations take their sizes from the shape); the conversions take
    // the stack's exact length.
    let blas = dev.blas()?;
    let gram = iterates_gram(cfg, s, l);
    let dims = (bi, si, li);
    match prec {
        NsPrecision::F32 => {
            let (y, products) = rest.split_at_mut(cut.x);
            let work = Iteration {
                y,
                squares: products.chunks_exact_mut(cut.square).collect(),
            };
            iterate::<f32>(&blas, dev, prec, &mut xw, work, dims, cfg, syrk, gram)?;
        }
        NsPrecision::Bf16 => {
            let (mut xb, mut rest16) = bf16s.split_at_mut(cut.x);
            let (y, products) = rest16.split_at_mut(cut.x);
            f32_to_bf16(dev, &xw.as_view(), &mut xb.slice_mut(..stack))?;
            let work = Iteration {
                y,
                squares: products.chunks_exact_mut(cut.square).collect(),
            };
            iterate::<u16>(&blas, dev, prec, &mut xb, work, dims, cfg, syrk, gram)?;
            bf16_to_f32(dev, &xb.slice(..stack), &mut xw)?;
        }
    }

    // Step 4.
    if transposed {
        transpose(dev, &xw, x, batch, s, l)
    } else {
        guarded(OP, || stream.memcpy_dtod(&xw.slice(..stack), x))
    }
}

/// Step 2 on the stack `xw` (`batch` matrices of `mn` elements): `X ← X / max(s·‖X‖_F, eps)`,
/// the squares summed in `f64` by `SUMSQ_BLOCKS` blocks per matrix into `partial`.
fn normalize(
    dev: &Device,
    xw: &mut CudaViewMut<'_, f32>,
    partial: &mut CudaViewMut<'_, f64>,
    (batch, mn): (usize, usize),
    cfg: &NsConfig,
) -> Result<()> {
    const OP: &str = "orthogonalize_cuda";
    let stream = dev.stream();
    let len = count(mn);
    let by = batch as u32; // checked against GRID_YZ_MAX by the caller
    let f = dev.function(&NEWTON_SCHULZ, NS_SUMSQ_PARTIAL)?;
    let cfg2 = LaunchConfig {
        grid_dim: (SUMSQ_BLOCKS, by, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: block (x, m) reads a stride of matrix m's `len` elements of `xw` (`batch`
    // matrices) and writes slot `m·SUMSQ_BLOCKS + x` of `partial`, which has them all.
    guarded(OP, || unsafe {
        stream
            .launch_builder(&f)
            .arg(&mut *xw)
            .arg(&len)
            .arg(&mut *partial)
            .launch(cfg2)
    })?;
    let f = dev.function(&NEWTON_SCHULZ, NS_NORMALIZE)?;
    let (nparts, eps, scale) = (SUMSQ_BLOCKS, cfg.eps, cfg.norm_scale);
    // SAFETY: matrix m's threads scale its `len` elements of `xw` in place, reading its
    // `nparts` partial sums, both inside their buffers.
    guarded(OP, || unsafe {
        stream
            .launch_builder(&f)
            .arg(&mut *xw)
            .arg(&len)
            .arg(&mut *partial)
            .arg(&nparts)
            .arg(&scale)
            .arg(&eps)
            .launch(per_matrix(mn, batch))
    })
    .map(drop)
}

/// The buffers step 3 works in beside `X`: `Y` (as long as `X`) and the `s × s` products
/// (two for the standard iteration, four for Gram's), each `batch` matrices.
struct Iteration<'w, T> {
    y: CudaViewMut<'w, T>,
    squares: Vec<CudaViewMut<'w, T>>,
}

/// An element type the iteration stores (`f32`, or the `u16` bits of bf16): how it forms the
/// two symmetric products on syrk (module doc) and adds a scalar to diagonals.
trait NsElem: DeviceRepr + ValidAsZeroBits + Sized {
    /// `P = X·Xᵀ` as syrk's lower triangle made whole. `dims` = (batch, s, l).
    fn gram_syrk(
        blas: &CudaBlas,
        dev: &Device,
        x: &CudaViewMut<'_, Self>,
        p: &mut CudaViewMut<'_, Self>,
        dims: (usize, usize, usize),
    ) -> Result<()>;

    /// `Q = b·P + c·P·Pᵀ` (`P` symmetric and whole) as syrk's lower triangle made whole;
    /// `q` holds a copy of `P` on entry. `dims` = (batch, s).
    fn square_syrk(
        blas: &CudaBlas,
        dev: &Device,
        p: &CudaViewMut<'_, Self>,
        q: &mut CudaViewMut<'_, Self>,
        dims: (usize, usize),
        bc: (f32, f32),
    ) -> Result<()>;

    /// The `ns_add_diagonal_*` kernel for this element ([`add_diagonal`]).
    const ADD_DIAGONAL: &'static str;
}

impl NsElem for f32 {
    const ADD_DIAGONAL: &'static str = NS_ADD_DIAGONAL_F32;

    fn gram_syrk(
        blas: &CudaBlas,
        dev: &Device,
        x: &CudaViewMut<'_, f32>,
        p: &mut CudaViewMut<'_, f32>,
        (batch, s, l): (usize, usize, usize),
    ) -> Result<()> {
        // X's buffer is the column-major Xᵀ (l×s, ld l): P = (Xᵀ)ᵀ·Xᵀ, trans = T.
        syrk_each(blas, dev, x, p, (batch, s, l), true, (1.0, 0.0))?;
        symmetrize(dev, p, batch, s)
    }

    fn square_syrk(
        blas: &CudaBlas,
        dev: &Device,
        p: &CudaViewMut<'_, f32>,
        q: &mut CudaViewMut<'_, f32>,
        (batch, s): (usize, usize),
        (b, c): (f32, f32),
    ) -> Result<()> {
        syrk_each(blas, dev, p, q, (batch, s, s), false, (c, b))?;
        symmetrize(dev, q, batch, s)
    }
}

impl NsElem for u16 {
    const ADD_DIAGONAL: &'static str = NS_ADD_DIAGONAL_BF16;

    fn gram_syrk(
        _: &CudaBlas,
        _: &Device,
        _: &CudaViewMut<'_, u16>,
        _: &mut CudaViewMut<'_, u16>,
        _: (usize, usize, usize),
    ) -> Result<()> {
        Err(no_bf16_syrk())
    }

    fn square_syrk(
        _: &CudaBlas,
        _: &Device,
        _: &CudaViewMut<'_, u16>,
        _: &mut CudaViewMut<'_, u16>,
        _: (usize, usize),
        _: (f32, f32),
    ) -> Result<()> {
        Err(no_bf16_syrk())
    }
}

fn no_bf16_syrk() -> Error {
    Error::BadInput {
        op: "orthogonalize_cuda",
        what: "GramProduct::Syrk with bf16".into(),
        reason: "cuBLAS has syrk for f32 only".into(),
    }
}

/// Step 3 on the normalized stack `x` (in place; `dims` = batch, s, l) in `work`, as Gram
/// Newton–Schulz when `gram`; the symmetric products `X·Xᵀ` and `b·P + c·P·P` on syrk when
/// `syrk`. On return `x` is the view that holds the result (`X` and `Y` are swapped, not
/// copied).
#[allow(clippy::too_many_arguments)]
fn iterate<'w, T: NsElem>(
    blas: &CudaBlas,
    dev: &Device,
    prec: NsPrecision,
    x: &mut CudaViewMut<'w, T>,
    work: Iteration<'w, T>,
    (batch, s, l): (i32, i32, i32),
    cfg: &NsConfig,
    syrk: bool,
    gram: bool,
) -> Result<()> {
    let Iteration { mut y, squares } = work;
    let ops = DeviceOps {
        blas,
        dev,
        prec,
        batch,
        s,
        l,
        syrk,
        elem: std::marker::PhantomData,
    };
    let mut squares = squares.into_iter();
    iterate_with(&ops, cfg, gram, x, &mut y, || {
        squares.next().ok_or_else(|| Error::Cuda {
            op: "orthogonalize_cuda",
            reason: "workspace sized for fewer products than the iteration takes".into(),
        })
    })?;
    std::mem::swap(x, &mut y);
    Ok(())
}

/// Newton–Schulz's products ([`NsOps`]) on a stack of `batch` matrices, each one
/// strided-batched GEMM (`X·Xᵀ` and `b·P + c·P·P` on syrk when `syrk`), a scalar added to
/// diagonals by `ns_add_diagonal_*`: the CPU's iterations up to summation order.
struct DeviceOps<'a, 'w, T> {
    blas: &'a CudaBlas,
    dev: &'a Device,
    prec: NsPrecision,
    batch: i32,
    s: i32,
    l: i32,
    syrk: bool,
    elem: std::marker::PhantomData<CudaViewMut<'w, T>>,
}

/// A buffer of the iteration: a view of the workspace.
type View<'w, T> = CudaViewMut<'w, T>;

impl<'w, T: NsElem> DeviceOps<'_, 'w, T> {
    /// `c ← α·(row-major a·b) + β·c`, `a: m×k`, `b: k×n` (cuBLAS sees the transpose).
    fn product(
        &self,
        (m, n, k): (i32, i32, i32),
        a: &View<'w, T>,
        b: &View<'w, T>,
        c: &mut View<'w, T>,
        ab: (f32, f32),
    ) -> Result<()> {
        let args = GemmArgs::row_major(m, n, k);
        gemm(
            self.blas, self.dev, self.prec, self.batch, &args, b, a, c, ab,
        )
    }

    fn copy(&self, from: &View<'w, T>, to: &mut View<'w, T>) -> Result<()> {
        guarded("newton_schulz copy", || {
            self.dev.stream().memcpy_dtod(from, to)
        })
    }
}

impl<'w, T: NsElem> NsOps for DeviceOps<'_, 'w, T> {
    type Buf = View<'w, T>;
    fn gram(&self, x: &View<'w, T>, p: &mut View<'w, T>) -> Result<()> {
        let (batch, s, l) = (self.batch as usize, self.s as usize, self.l as usize);
        if self.syrk {
            return T::gram_syrk(self.blas, self.dev, x, p, (batch, s, l));
        }
        // Xᵀ is X stored l-major, used transposed.
        let args = GemmArgs::row_major_gram(self.s, self.l);
        gemm(
            self.blas,
            self.dev,
            self.prec,
            self.batch,
            &args,
            x,
            x,
            p,
            (1.0, 0.0),
        )
    }
    fn poly(&self, p: &View<'w, T>, b: f32, c: f32, q: &mut View<'w, T>) -> Result<()> {
        self.copy(p, q)?;
        if self.syrk {
            let dims = (self.batch as usize, self.s as usize);
            return T::square_syrk(self.blas, self.dev, p, q, dims, (b, c));
        }
        self.product((self.s, self.s, self.s), p, p, q, (c, b))
    }
    fn add_diagonal(&self, q: &mut View<'w, T>, a: f32) -> Result<()> {
        add_diagonal(
            self.dev,
            T::ADD_DIAGONAL,
            q,
            self.batch as usize,
            self.s as usize,
            a,
        )
    }
    fn sym_product(&self, u: &View<'w, T>, v: &View<'w, T>, out: &mut View<'w, T>) -> Result<()> {
        self.product((self.s, self.s, self.s), u, v, out, (1.0, 0.0))
    }
    fn apply(
        &self,
        m: &View<'w, T>,
        x: &View<'w, T>,
        a: Option<f32>,
        y: &mut View<'w, T>,
    ) -> Result<()> {
        if a.is_some() {
            self.copy(x, y)?;
        }
        let dims = (self.s, self.l, self.s);
        self.product(dims, m, x, y, (1.0, a.unwrap_or(0.0)))
    }
}

/// `kernel` (`ns_add_diagonal_f32` or `_bf16`) on `batch` `n × n` matrices.
fn add_diagonal<T: DeviceRepr>(
    dev: &Device,
    kernel: &str,
    q: &mut CudaViewMut<'_, T>,
    batch: usize,
    n: usize,
    a: f32,
) -> Result<()> {
    const OP: &str = "newton_schulz add_diagonal";
    let f = dev.function(&NEWTON_SCHULZ, kernel)?;
    let nu = n as u32;
    // SAFETY: the kernel writes element `i·n + i` of each of `batch` matrices of `n·n`,
    // `i < n`: inside `q`, which holds them.
    guarded(OP, || unsafe {
        dev.stream()
            .launch_builder(&f)
            .arg(q)
            .arg(&nu)
            .arg(&a)
            .launch(per_matrix(n, batch))
    })
    .map(drop)
}

/// An element-wise launch over `len` elements of each of `batch` stacked matrices: the
/// matrix is the grid's y (`batch` is checked against [`GRID_YZ_MAX`] before step 1).
fn per_matrix(len: usize, batch: usize) -> LaunchConfig {
    let mut cfg = elementwise(len);
    cfg.grid_dim = (
        cfg.grid_dim.0.min(1024),
        u32::try_from(batch).unwrap_or(u32::MAX),
        1,
    );
    cfg
}

/// `C_i = α·op(A_i)·op(A_i)ᵀ + β·C_i` (lower triangle) for each of the `batch` matrices `i`
/// of the stacks: `A_i` is column-major `k × n` used transposed (`trans`, `(batch, n, k) =
/// dims`, ld `k`) or `n × k` as is (ld `n`); `C_i` is `n × n`. (The buffers may be longer:
/// workspace views are padded to [`ALIGN_BYTES`].)
fn syrk_each(
    blas: &CudaBlas,
    dev: &Device,
    a: &CudaViewMut<'_, f32>,
    c: &mut CudaViewMut<'_, f32>,
    (batch, n, k): (usize, usize, usize),
    trans: bool,
    (alpha, beta): (f32, f32),
) -> Result<()> {
    use blas_sys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER;
    use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    const OP: &str = "newton_schulz syrk";
    let (ni, ki) = (int(OP, n)?, int(OP, k)?);
    let lda = if trans { ki } else { ni };
    let op = if trans { CUBLAS_OP_T } else { CUBLAS_OP_N };
    let stream = dev.stream();
    let (ap, _ga) = a.device_ptr(stream);
    let (cp, _gc) = c.device_ptr_mut(stream);
    for i in 0..batch {
        let (ai, ci) = (ap + (i * n * k * 4) as u64, cp + (i * n * n * 4) as u64);
        // SAFETY: matrix i of each stack, in bounds (the stacks hold `batch` matrices of
        // n·k and n·n elements); host α, β (the handle's default pointer mode).
        guarded(OP, || unsafe {
            blas_sys::cublasSsyrk_v2(
                *blas.handle(),
                CUBLAS_FILL_MODE_LOWER,
                op,
                ni,
                ki,
                &alpha,
                ai as *const f32,
                lda,
                &beta,
                ci as *mut f32,
                ni,
            )
            .result()
        })?;
    }
    Ok(())
}

/// `ns_symmetrize_lower` on `batch` column-major `n × n` matrices.
fn symmetrize(dev: &Device, c: &mut CudaViewMut<'_, f32>, batch: usize, n: usize) -> Result<()> {
    const OP: &str = "newton_schulz symmetrize";
    let f = dev.function(&NEWTON_SCHULZ, NS_SYMMETRIZE_LOWER)?;
    let nu = n as u32;
    // SAFETY: each matrix's threads copy its lower triangle onto the upper one: elements
    // of its `n·n`, inside `c`, which holds `batch` of them.
    guarded(OP, || unsafe {
        dev.stream()
            .launch_builder(&f)
            .arg(c)
            .arg(&nu)
            .launch(per_matrix(n * n, batch))
    })
    .map(drop)
}

/// Batched transpose of `batch` row-major `rows × cols` matrices into `out` (`cols × rows`).
fn transpose<S, D>(
    dev: &Device,
    x: &S,
    out: &mut D,
    batch: usize,
    rows: usize,
    cols: usize,
) -> Result<()>
where
    S: DevicePtr<f32>,
    D: DevicePtrMut<f32>,
{
    const OP: &str = "newton_schulz transpose";
    let f = dev.function(&NEWTON_SCHULZ, NS_TRANSPOSE)?;
    let cfg = LaunchConfig {
        grid_dim: (
            cols.div_ceil(32) as u32,
            rows.div_ceil(32) as u32,
            batch as u32,
        ),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    let (r, c) = (rows as u32, cols as u32);
    let stream = dev.stream();
    let (xp, _gx) = x.device_ptr(stream);
    let (op, _go) = out.device_ptr_mut(stream);
    // SAFETY: the kernel reads `rows × cols` elements of each of `batch` matrices of `x` and
    // writes their transposes to `out` (the callers size both for that); the guards keep
    // them alive until the launch is queued.
    guarded(OP, || unsafe {
        stream
            .launch_builder(&f)
            .arg(&xp)
            .arg(&op)
            .arg(&r)
            .arg(&c)
            .launch(cfg)
    })
    .map(drop)
}

/// Seconds per plain cuBLAS GEMM `C = A·B` of `n × n` matrices in `prec` (mean over `iters`
/// after one warm-up, device synchronized before the clock is read): the same-run peak that
/// Newton–Schulz throughput is compared against.
pub fn gemm_seconds(dev: &Device, n: usize, prec: NsPrecision, iters: usize) -> Result<f64> {
    match prec {
        NsPrecision::F32 => timed_gemm(dev, n, prec, iters, |s| uniform(n * n, s)),
        NsPrecision::Bf16 => timed_gemm(dev, n, prec, iters, |s| {
            let x = uniform(n * n, s);
            x.iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect::<Vec<u16>>()
        }),
    }
}

fn timed_gemm<T: DeviceRepr + ValidAsZeroBits>(
    dev: &Device,
    n: usize,
    prec: NsPrecision,
    iters: usize,
    random: impl Fn(u64) -> Vec<T>,
) -> Result<f64> {
    const OP: &str = "gemm_seconds";
    let ni = int(OP, n)?;
    int(OP, n * n)?;
    let blas = dev.blas()?;
    let args = GemmArgs::row_major(ni, ni, ni);
    // Random operands: tensor cores on zeros draw less power and can clock higher, which
    // would flatter the baseline.
    let (a, b) = (dev.upload(&random(1))?, dev.upload(&random(2))?);
    let mut c = dev.zeros::<T>(n * n)?;
    let iters = iters.max(1);
    gemm(&blas, dev, prec, 1, &args, &a, &b, &mut c, (1.0, 0.0))?;
    dev.sync()?;
    let start = std::time::Instant::now();
    for _ in 0..iters {
        gemm(&blas, dev, prec, 1, &args, &a, &b, &mut c, (1.0, 0.0))?;
    }
    dev.sync()?;
    Ok(start.elapsed().as_secs_f64() / iters as f64)
}

/// `len` values uniform in `[-1, 1)` from `seed`.
fn uniform(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = ragged::demo::SplitMix(seed);
    (0..len).map(|_| rng.uniform()).collect()
}

#[cfg(test)]
mod tests {
    use super::GemmArgs;

    /// cuBLAS's column-major strided-batched GEMM semantics, on the CPU, in f64.
    fn cublas_reference(
        g: &GemmArgs,
        batch: usize,
        first: &[f64],
        second: &[f64],
        c: &mut [f64],
        (alpha, beta): (f64, f64),
    ) {
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        for bi in 0..batch {
            let f = &first[bi * g.stride_first as usize..];
            let s = &second[bi * g.stride_second as usize..];
            let cc = &mut c[bi * g.stride_c as usize..];
            for j in 0..n {
                for i in 0..m {
                    let mut acc = 0.0;
                    for p in 0..k {
                        let a = if g.trans_first {
                            f[p + i * g.ld_first as usize]
                        } else {
                            f[i + p * g.ld_first as usize]
                        };
                        let b = if g.trans_second {
                            s[j + p * g.ld_second as usize]
                        } else {
                            s[p + j * g.ld_second as usize]
                        };
                        acc += a * b;
                    }
                    let o = &mut cc[i + j * g.ldc as usize];
                    *o = alpha * acc + beta * *o;
                }
            }
        }
    }

    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                crate::common::lcg(&mut x);
                ((x >> 33) as f64 / (1u64 << 31) as f64) - 0.5
            })
            .collect()
    }

    /// Row-major `a (r×i) · b (i×c)`.
    fn matmul(a: &[f64], b: &[f64], r: usize, c: usize, i: usize) -> Vec<f64> {
        let mut out = vec![0.0; r * c];
        for x in 0..r {
            for y in 0..c {
                out[x * c + y] = (0..i).map(|p| a[x * i + p] * b[p * c + y]).sum();
            }
        }
        out
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12)
    }

    #[test]
    fn row_major_args_give_the_row_major_product_with_alpha_and_beta() {
        let (batch, r, c, i) = (3usize, 5usize, 7usize, 4usize);
        let a = values(batch * r * i, 1);
        let b = values(batch * i * c, 2);
        let c0 = values(batch * r * c, 3);
        let g = GemmArgs::row_major(r as i32, c as i32, i as i32);
        let mut got = c0.clone();
        // `first` is B's buffer, `second` is A's.
        cublas_reference(&g, batch, &b, &a, &mut got, (2.0, 0.5));
        for k in 0..batch {
            let ab = matmul(&a[k * r * i..][..r * i], &b[k * i * c..][..i * c], r, c, i);
            let want: Vec<f64> = ab
                .iter()
                .zip(&c0[k * r * c..][..r * c])
                .map(|(p, q)| 2.0 * p + 0.5 * q)
                .collect();
            assert!(close(&got[k * r * c..][..r * c], &want), "batch {k}");
        }
    }

    #[test]
    fn gram_args_give_x_times_x_transposed() {
        let (batch, s, l) = (2usize, 3usize, 8usize);
        let x = values(batch * s * l, 4);
        let g = GemmArgs::row_major_gram(s as i32, l as i32);
        let mut got = vec![0.0; batch * s * s];
        cublas_reference(&g, batch, &x, &x, &mut got, (1.0, 0.0));
        for k in 0..batch {
            let xk = &x[k * s * l..][..s * l];
            let mut xt = vec![0.0; l * s];
            for p in 0..s {
                for q in 0..l {
                    xt[q * s + p] = xk[p * l + q];
                }
            }
            let want = matmul(xk, &xt, s, s, l);
            assert!(close(&got[k * s * s..][..s * s], &want), "batch {k}");
        }
    }
}
