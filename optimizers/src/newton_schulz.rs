//! Newton–Schulz orthogonalization on plain row-major `f32` slices: Muon's "zeroth power"
//! `X ↦ U·Vᵀ` (for `X = U·Σ·Vᵀ`), approximated by an odd matrix polynomial.
//!
//! torch.optim.Muon's `_zeropower_via_newtonschulz` (Jordan et al., "Muon: An optimizer for
//! hidden layers in neural networks", 2024), in `f32` (default) or bf16 ([`NsPrecision`]):
//!
//! | # | operation | torch |
//! |---|---|---|
//! | 1 | if `rows > cols`, `X ← Xᵀ` (so the Gram matrix is (short side)²) | `ortho_grad.T` |
//! | 2 | `X ← X / max(s·‖X‖_F, eps)` (`s` = [`NsConfig::norm_scale`], 1 by default) | `div_(norm().clamp(min=eps))` |
//! | 3 | per step `k`, with `(a, b, c)` = the `k`-th coefficients: `P = X·Xᵀ`, `Q = b·P + c·(P·P)`, `X ← a·X + Q·X` | `use_addmm` form in bf16 |
//! | 4 | transpose back if step 1 transposed | `.T` |
//!
//! The AMX backend takes a tall matrix as it is, without steps 1 and 4: `P = Xᵀ·X` and
//! `X ← a·X + X·Q`, which give each element the bits of the transposed form (the same pairs
//! summed in the same order, `Q` exactly symmetric) without two transposes of the matrix.
//!
//! # Backends ([`NsBackend`])
//! | backend | `f32` | bf16 | threads | bits depend on |
//! |---|---|---|---|---|
//! | `Reference` | plain loops (the oracle) | the same loops, rounding to bf16 after each op | rayon, by output row | input bits only |
//! | `Gemm` | `gemm` crate, fused forms, symmetric products; Gram Newton–Schulz where it pays (Methods) | portable: bf16-rounded operands on `f32` gemm | rayon inside the GEMM, or one matrix per thread across a batch ([`orthogonalize_many`]) | input bits and the CPU's microkernel, not the thread count |
//! | `OneDnn` | oneDNN `f32` matmul primitive, symmetric products by halves | oneDNN bf16 matmul primitive (AMX), the same halves | oneDNN's OpenMP threads (passive wait unless `OMP_WAIT_POLICY` says otherwise) | input bits, the CPU and `OMP_NUM_THREADS` |
//! | `Amx` | — (`Err`) | ragged's own products on the AMX tiles ([`crate::kernels::amx_bf16`]): lower blocks of the symmetric products, addends fused into the rounding | rayon, an output region per task | input bits and the CPU (the sum order is per element: not the thread count) |
//! | `Auto` (default) | `Gemm` | `Amx` where the CPU has AMX, else `OneDnn` when oneDNN loads and has bf16 matmul on this CPU, else `Gemm` | | |
//!
//! oneDNN is opened at run time ([`crate::kernels::onednn`]); an explicit `OneDnn` returns
//! `Err` where it is missing or (bf16) where this CPU has no bf16 matmul (oneDNN 2.6 needs
//! AVX-512). Its `f32` path exists to test the oneDNN plumbing on any CPU; `Auto` never picks
//! it (gemm is faster).
//!
//! [`ns_backend_info`] says which backend and instruction set run here.
//!
//! # Precision
//! - `F32`: every product accumulates in `f32`; `Gemm` evaluates `Q = b·P + c·P·P` and
//!   `X ← a·X + Q·X` as single GEMMs (`dst ← α·dst + β·lhs·rhs`) and computes the two
//!   symmetric products (`X·Xᵀ`, `P·P`) by halves, mirroring the off-diagonal block; its result
//!   differs from `Reference` by `f32` summation order only (relative Frobenius difference
//!   about `1e-6` after 5 steps, `tests/ns_kernel_tests.rs`).
//! - `Bf16` (torch.optim.Muon's working dtype): the input is rounded to bf16; the norm is
//!   summed in `f64` over the rounded values and the division done in `f32`, then rounded; in
//!   step 3 `P`, `Q` and the new `X` are each one bf16×bf16 product accumulated in `f32`,
//!   combined with its addend (`b·P`, `a·X`) in `f32` and rounded once to bf16 (torch's
//!   `use_addmm=True` form; the default torch form also rounds `P·P` and `Q·X` before adding).
//!   The result is returned widened to `f32`.
//!
//! # Methods ([`NsMethod`])
//! Step 3 either follows torch (`Standard`) or iterates on the Gram matrix (`Gram`, "Gram
//! Newton–Schulz", Dao AI Lab 2026; DeepSpeed's Muon default). With `R = X·Xᵀ` and
//! `Q = a + b·R + c·R²`, a step maps `X` to `Q·X`, so after `k` steps `X = M·X₀` with `M` the
//! product of the `Q`s, and the next Gram matrix is `Q²·R`: only the first Gram matrix and
//! the final `M·X₀` touch the `s × l` matrix, every other product is `s × s` and symmetric.
//! On a Llama MLP weight (`l = 3.5·s`) that is 0.64× the multiply-adds. Both compute the same
//! polynomial of `X`; the Gram iteration resolves `R`'s small eigenvalues only to its
//! precision (`2⁻²⁴` of the largest in `f32`, `2⁻⁹` in bf16) and multiplies that noise by
//! `a²` at every step, so it restarts (`X = M·X₀`, `R` afresh) before the growth passes
//! [`GRAM_MAX_GROWTH`] (`f32`: once in 5 quintic steps) or [`GRAM_MAX_GROWTH_BF16`] (bf16:
//! every second step). In `f32` it stays within 2.4e-4 of an `f64` Newton–Schulz on rank-1
//! and graded-spectrum inputs where the standard iteration is within 2.3e-4; in bf16 it errs
//! 0.7–2× as much as torch's standard bf16 iteration (about 1.5e-2 relative on uniform
//! inputs), and up to 4.3× on a tall matrix with rows graded to 1e-6
//! (`tests/ns_kernel_tests.rs`). `Auto` takes it where it needs at most 0.9× the
//! multiply-adds ([`gram_pays`]) on every backend but the reference loops (the oracle, which
//! run it when asked): a bf16 Muon step of the d = 1024 Llama stack on AMX takes 0.84× the
//! standard iteration's time. `NsMethod::Standard` keeps torch's iteration (numerics parity
//! with torch.optim.Muon). Each iteration is written once (`standard_steps`, `gram_steps`)
//! over a backend's products (`NsOps`: the reference loops and gemm on `f32` buffers,
//! oneDNN, the AMX tiles, and cuBLAS in `crate::cuda::newton_schulz`).
//!
//! # Determinism
//! For a given backend and precision the result is a function of the input bits (and, for
//! `Gemm`/`OneDnn`, the machine), never of the rayon thread count or of how matrices are
//! split over threads: this is what makes a sharded Muon step bitwise equal to the unsharded
//! one. `Reference` sums with `k` ascending, no fused multiply-add, so it is also portable
//! across machines. The Frobenius norm is summed in `f64` in eight lanes (element `i` of the
//! matrix as given, row-major, in lane `i mod 8`) and rounded once.
//!
//! # Special inputs
//! A zero matrix stays zero (the norm clamps at `eps`). If any element is non-finite, every
//! output element is NaN and the call returns `Ok` (a NaN gradient poisons the update as in
//! torch, but predictably and on every backend). A finite matrix whose norm overflows `f32`
//! (entries ≳ 1e37 on a 64×64 matrix) is divided by its `f64` norm instead, where torch's
//! `f32` norm would be infinite and the update zero.
//!
//! # Accuracy
//! The quintic coefficients (3.4445, −4.7750, 2.0315) trade exactness for speed: after 5
//! steps the singular values land in roughly `[0.7, 1.2]`, not at 1 (Jordan 2024).

use std::borrow::{Borrow, BorrowMut};
use std::fmt;

use half::bf16;
use rayon::prelude::*;

use ragged::{Error, Result};

use crate::kernels::amx_bf16::{self, AlignedBf16, Amx, Epilogue, Rhs, Strides};
use crate::kernels::gemm_f32;
use crate::kernels::onednn::{self, DnnlError, Element};
use crate::kernels::transpose_f32::transpose_raw;
use crate::kernels::work_share::share;
use crate::kernels::{retained, threaded, Parallelism, RETAIN_BYTES};

/// Keller Jordan's quintic coefficients, torch.optim.Muon's default `(a, b, c)`.
pub const QUINTIC: [f32; 3] = [3.4445, -4.7750, 2.0315];

/// microsoft/dion `dion/muon.py`'s five-step schedule (NVIDIA Emerging-Optimizers calls it
/// `quintic`), one triple per step.
pub const DION_QUINTIC: [[f32; 3]; 5] = [
    [4.0848, -6.8946, 2.9270],
    [3.9505, -6.3029, 2.6377],
    [3.7418, -5.5913, 2.3037],
    [2.8769, -3.1427, 1.2046],
    [2.8366, -3.0525, 1.2012],
];

/// Polar Express (Amsel et al. 2025) as in microsoft/dion `dion/polar_express.py`, one triple
/// per step; use with [`POLAR_EXPRESS_NORM_SCALE`] ([`NsConfig::polar_express`]).
pub const POLAR_EXPRESS: [[f32; 3]; 5] = {
    // dion's f64 values, rounded to f32 once.
    const F64: [[f64; 3]; 5] = [
        [8.156554524902461, -22.48329292557795, 15.878769915207462],
        [4.042929935166739, -2.808917465908714, 0.5000178451051316],
        [3.8916678022926607, -2.772484153217685, 0.5060648178503393],
        [3.285753657755655, -2.3681294933425376, 0.46449024233003106],
        [2.3465413258596377, -1.7097828382687081, 0.42323551169305323],
    ];
    let mut out = [[0.0f32; 3]; 5];
    let mut i = 0;
    while i < 5 {
        let mut j = 0;
        while j < 3 {
            out[i][j] = F64[i][j] as f32;
            j += 1;
        }
        i += 1;
    }
    out
};

/// dion's Polar Express divides by `1.02·‖X‖_F` so the spectrum starts safely below 1.
pub const POLAR_EXPRESS_NORM_SCALE: f32 = 1.02;

/// The largest singular value a Newton–Schulz schedule may produce, at any step, from any
/// input ([`NsConfig::validate`]). Newton–Schulz drives singular values towards 1: the
/// published schedules peak at 1.20 ([`QUINTIC`]), 1.27 ([`DION_QUINTIC`]) and 1.99 (the
/// first, overshooting step of [`POLAR_EXPRESS`]). A schedule that sends one past 4 does not
/// orthogonalize: with a typo'd coefficient, or a `norm_scale` below 0.8 ([`QUINTIC`]; 0.98
/// for Polar Express), a step's `c·σ⁵` passes it, each further step raises it to the fifth
/// power again, and within a few steps the update is infinite.
pub const MAX_SINGULAR_VALUE: f64 = 4.0;

/// Points of `[0, 1/norm_scale]` whose path through the schedule [`NsConfig::validate`]
/// follows. The published schedules' steps have slopes below 17 where they act (Polar
/// Express's first step), so a peak between two points lies at most about 0.03 above them;
/// measured, these points' maximum is within 1e-5 of a 100 000-point grid's.
const SCHEDULE_CHECK_POINTS: usize = 256;

/// Products with at least this many output elements are split over rayon tasks by row
/// (`Reference` backend).
pub const PAR_MIN_OUT: usize = 1 << 14;

/// In [`orthogonalize_many`] with the `Gemm` backend, matrices whose short side is below this
/// run one per thread with single-threaded GEMMs (when their buffers fit in
/// [`RETAIN_BYTES`]); larger ones do when there are enough of them
/// ([`ACROSS_MIN_PER_THREAD`]), else one after another, each GEMM using every thread. (Either
/// choice gives the same bits.)
pub const BATCH_INNER_MIN_SIDE: usize = 256;

/// The working precision of Newton–Schulz.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum NsPrecision {
    /// `f32` throughout (default).
    #[default]
    F32,
    /// bf16 storage between operations, `f32` accumulation (torch.optim.Muon's dtype).
    Bf16,
}

/// Which kernels run Newton–Schulz (module table).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum NsBackend {
    /// The fastest available for the precision: `Gemm` for `F32`; for `Bf16`, `Amx` where the
    /// CPU has AMX, else `OneDnn` when oneDNN loads with a bf16 matmul, else `Gemm`.
    #[default]
    Auto,
    /// Plain loops, bitwise portable; the oracle for the others.
    Reference,
    /// The `gemm` crate (`f32`; bf16 as rounded `f32`).
    Gemm,
    /// oneDNN's matmul primitive (`Err` when oneDNN, or for bf16 its bf16 matmul, is not
    /// available).
    OneDnn,
    /// ragged's own bf16 products on the AMX tile unit ([`crate::kernels::amx_bf16`]; bf16
    /// only, `Err` where the CPU or the kernel does not offer AMX).
    Amx,
}

impl std::str::FromStr for NsBackend {
    type Err = Error;

    /// `auto`, `reference`, `gemm`, `onednn` or `amx`.
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(NsBackend::Auto),
            "reference" => Ok(NsBackend::Reference),
            "gemm" => Ok(NsBackend::Gemm),
            "onednn" => Ok(NsBackend::OneDnn),
            "amx" => Ok(NsBackend::Amx),
            _ => Err(Error::BadInput {
                op: "NsBackend::from_str",
                what: s.into(),
                reason: "expected auto, reference, gemm, onednn or amx".into(),
            }),
        }
    }
}

/// How step 3 arranges its products (module doc, "Methods"). Both compute the same
/// polynomial of `X` in exact arithmetic; they differ in rounding and in cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum NsMethod {
    /// `Gram` where it needs fewer multiply-adds ([`gram_pays`]), on every backend but the
    /// reference loops (the oracle), else `Standard`.
    #[default]
    Auto,
    /// torch's iteration on the `s × l` matrix: `P = X·Xᵀ`, `Q = b·P + c·P²`, `X ← a·X + Q·X`.
    Standard,
    /// Gram Newton–Schulz: the iteration on the `s × s` Gram matrix, `X` multiplied once at
    /// the end and at each restart ([`GRAM_MAX_GROWTH`], [`GRAM_MAX_GROWTH_BF16`]), on every
    /// backend, the device's (`cuda::orthogonalize_cuda`) included.
    Gram,
}

impl std::str::FromStr for NsMethod {
    type Err = Error;

    /// `auto`, `standard` or `gram`.
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(NsMethod::Auto),
            "standard" => Ok(NsMethod::Standard),
            "gram" => Ok(NsMethod::Gram),
            _ => Err(Error::BadInput {
                op: "NsMethod::from_str",
                what: s.into(),
                reason: "expected auto, standard or gram".into(),
            }),
        }
    }
}

/// Newton–Schulz hyperparameters. Step `k` uses `coeffs[min(k, coeffs.len() − 1)]` (a
/// schedule shorter than `steps` repeats its last triple).
#[derive(Clone, Debug, PartialEq)]
pub struct NsConfig {
    /// Iterations (default 5; torch refuses 100 or more).
    pub steps: usize,
    /// `(a, b, c)` per step (default: [`QUINTIC`] for every step).
    pub coeffs: Vec<[f32; 3]>,
    /// Lower clamp of the scaled Frobenius norm in step 2 (default `1e-7`, torch's).
    pub eps: f32,
    /// Multiplies the Frobenius norm in step 2 (default 1; Polar Express 1.02).
    pub norm_scale: f32,
    /// Working precision (default `F32`).
    pub precision: NsPrecision,
    /// Kernels (default `Auto`).
    pub backend: NsBackend,
    /// Arrangement of the products (default `Auto`).
    pub method: NsMethod,
}

impl Default for NsConfig {
    fn default() -> Self {
        NsConfig {
            steps: 5,
            coeffs: vec![QUINTIC],
            eps: 1e-7,
            norm_scale: 1.0,
            precision: NsPrecision::F32,
            backend: NsBackend::Auto,
            method: NsMethod::Auto,
        }
    }
}

impl NsConfig {
    /// dion's five-triple schedule ([`DION_QUINTIC`]), 5 steps, otherwise the defaults.
    pub fn dion_quintic() -> Self {
        NsConfig {
            coeffs: DION_QUINTIC.to_vec(),
            ..NsConfig::default()
        }
    }

    /// Polar Express ([`POLAR_EXPRESS`], norm scale [`POLAR_EXPRESS_NORM_SCALE`]), 5 steps.
    pub fn polar_express() -> Self {
        NsConfig {
            coeffs: POLAR_EXPRESS.to_vec(),
            norm_scale: POLAR_EXPRESS_NORM_SCALE,
            ..NsConfig::default()
        }
    }

    /// `Err` unless `1 ≤ steps < 100`, the schedule is non-empty and every value is finite
    /// (`eps > 0`, `norm_scale > 0`), and the schedule keeps every singular value at most
    /// [`MAX_SINGULAR_VALUE`] (`NsConfig::check_schedule`).
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String, reason: &str| {
            Err(Error::BadInput {
                op: "NsConfig::validate",
                what,
                reason: reason.into(),
            })
        };
        if self.steps == 0 || self.steps >= 100 {
            return bad(format!("steps = {}", self.steps), "must lie in [1, 100)");
        }
        if self.coeffs.is_empty() {
            return bad("coeffs = []".into(), "needs at least one (a, b, c)");
        }
        if self.coeffs.iter().flatten().any(|c| !c.is_finite()) {
            return bad(format!("coeffs = {:?}", self.coeffs), "must be finite");
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad(format!("eps = {}", self.eps), "must be finite and positive");
        }
        if !(self.norm_scale.is_finite() && self.norm_scale > 0.0) {
            return bad(
                format!("norm_scale = {}", self.norm_scale),
                "must be finite and positive",
            );
        }
        self.check_schedule()
    }

    /// `Err(BadInput)` if a singular value of the normalized input can pass
    /// [`MAX_SINGULAR_VALUE`] at some step. Step 2 leaves every singular value in
    /// `[0, 1/norm_scale]` (`σ ≤ ‖X‖_F`, equal for a rank-1 matrix, which a one-example
    /// gradient is), and step `k` maps each `σ` to `|p(σ)|`, `p(x) = a·x + b·x³ + c·x⁵`: the
    /// check follows [`SCHEDULE_CHECK_POINTS`] points of that interval through `steps` steps
    /// in `f64` (a few thousand multiply-adds).
    fn check_schedule(&self) -> Result<()> {
        let top = 1.0 / f64::from(self.norm_scale);
        let n = SCHEDULE_CHECK_POINTS;
        let mut sigma: Vec<f64> = (0..=n).map(|i| top * i as f64 / n as f64).collect();
        for k in 0..self.steps {
            let [a, b, c] = self.coeffs_at(k).map(f64::from);
            for x in &mut sigma {
                let x2 = *x * *x;
                *x = (*x * (a + x2 * (b + c * x2))).abs();
            }
            // NaN: the ∞ − ∞ of a value that overflowed f64.
            let past = |x: &f64| x.is_nan() || *x > MAX_SINGULAR_VALUE;
            if let Some(i) = sigma.iter().position(past) {
                return Err(Error::BadInput {
                    op: "NsConfig::validate",
                    what: format!(
                        "coeffs = {:?}, norm_scale = {}",
                        self.coeffs, self.norm_scale
                    ),
                    reason: format!(
                        "step {k} sends the singular value {:.3} of the normalized input to {:e}, \
                         past {MAX_SINGULAR_VALUE}: the schedule does not orthogonalize (the \
                         published ones stay below 2)",
                        top * i as f64 / n as f64,
                        sigma[i]
                    ),
                });
            }
        }
        Ok(())
    }

    /// The `(a, b, c)` of step `k`.
    pub fn coeffs_at(&self, k: usize) -> [f32; 3] {
        self.coeffs[k.min(self.coeffs.len() - 1)]
    }
}

/// Whether oneDNN loads and has the bf16 matmuls Newton–Schulz needs on this CPU.
fn onednn_bf16() -> std::result::Result<String, DnnlError> {
    onednn::onednn()?.bf16_impl()
}

/// The concrete backend `backend` means for `precision` here: `Auto` resolved; `Err` for
/// `OneDnn` when oneDNN does not load or, for `Bf16`, has no bf16 matmul on this CPU, and for
/// `Amx` without AMX or with `F32` (the error says why).
pub fn resolve_backend(precision: NsPrecision, backend: NsBackend) -> Result<NsBackend> {
    match (precision, backend) {
        (NsPrecision::F32, NsBackend::Auto) => Ok(NsBackend::Gemm),
        (NsPrecision::Bf16, NsBackend::Auto) => Ok(if amx_bf16::amx().is_ok() {
            NsBackend::Amx
        } else if onednn_bf16().is_ok() {
            NsBackend::OneDnn
        } else {
            NsBackend::Gemm
        }),
        (NsPrecision::F32, NsBackend::Amx) => Err(Error::BadInput {
            op: "resolve_backend",
            what: "NsBackend::Amx with NsPrecision::F32".into(),
            reason: "the AMX products are bf16 only".into(),
        }),
        (NsPrecision::Bf16, NsBackend::Amx) => {
            amx_bf16::amx()?;
            Ok(NsBackend::Amx)
        }
        (NsPrecision::F32, NsBackend::OneDnn) => {
            onednn::onednn()?;
            Ok(NsBackend::OneDnn)
        }
        (NsPrecision::Bf16, NsBackend::OneDnn) => {
            onednn_bf16()?;
            Ok(NsBackend::OneDnn)
        }
        (_, b) => Ok(b),
    }
}

/// What runs Newton–Schulz on this machine, for benchmark tables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NsBackendInfo {
    /// `Auto`'s backend for `F32`.
    pub f32_backend: NsBackend,
    /// e.g. `gemm 0.19 f32, AVX-512 microkernels, symmetric leaves of 256, 2 rayon threads`.
    pub f32: String,
    /// `Auto`'s backend for `Bf16`.
    pub bf16_backend: NsBackend,
    /// e.g. `oneDNN 2.6.3 matmul primitive, brg:avx512_core_amx_bf16`, or the portable path
    /// with the reason oneDNN is unavailable.
    pub bf16: String,
}

impl fmt::Display for NsBackendInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "f32: {:?} ({}); bf16: {:?} ({})",
            self.f32_backend, self.f32, self.bf16_backend, self.bf16
        )
    }
}

/// Which backends `Auto` picks here and which instruction sets they use (the oneDNN ISA is
/// the implementation its primitive descriptor reports for a 1024³ bf16 matmul).
pub fn ns_backend_info() -> NsBackendInfo {
    let f32 = format!(
        "gemm 0.19 f32, {} microkernels, symmetric leaves of {}, {} rayon threads",
        gemm_f32::Microkernels::detect().name(),
        gemm_f32::sym_leaf(),
        rayon::current_num_threads()
    );
    // The same choice the step makes (`Auto` resolves without error), described.
    let bf16_backend =
        resolve_backend(NsPrecision::Bf16, NsBackend::Auto).unwrap_or(NsBackend::Gemm);
    let onednn_info = || {
        onednn::onednn().and_then(|d| {
            let isa = d.bf16_impl()?;
            Ok(format!(
                "oneDNN {} matmul primitive, {isa}, OpenMP threads, {}",
                d.version(),
                d.wait_policy()
            ))
        })
    };
    // oneDNN is opened only where AMX does not run bf16 (as in the step); there it has bf16
    // matmul exactly when `Auto` chose it.
    let bf16 = match bf16_backend {
        NsBackend::Amx => format!(
            "ragged AMX bf16 tiles (TDPBF16PS, 32×32 blocks), {} rayon threads",
            rayon::current_num_threads()
        ),
        _ => onednn_info()
            .unwrap_or_else(|e| format!("portable: bf16-rounded operands on gemm f32 ({e})")),
    };
    NsBackendInfo {
        f32_backend: NsBackend::Gemm,
        f32,
        bf16_backend,
        bf16,
    }
}

/// `out = x·yᵀ` for `x: n×k`, `y: m×k` (row-major), `out: n×m`; `f32` dot products summed
/// with `k` ascending.
fn matmul_nt(x: &[f32], y: &[f32], n: usize, m: usize, k: usize, out: &mut [f32]) {
    let row = |i: usize, o: &mut [f32]| {
        let xi = &x[i * k..(i + 1) * k];
        for (j, o) in o.iter_mut().enumerate() {
            let yj = &y[j * k..(j + 1) * k];
            let mut s = 0.0f32;
            for (a, b) in xi.iter().zip(yj) {
                s += a * b;
            }
            *o = s;
        }
    };
    if n * m >= PAR_MIN_OUT {
        out.par_chunks_mut(m)
            .enumerate()
            .for_each(|(i, o)| row(i, o));
    } else {
        out.chunks_mut(m).enumerate().for_each(|(i, o)| row(i, o));
    }
}

/// `out = x·y` for `x: n×k`, `y: k×m` (row-major), `out: n×m`; each output row accumulates
/// `x[i,l]·y[l,:]` for `l` ascending, in `f32`.
fn matmul_nn(x: &[f32], y: &[f32], n: usize, m: usize, k: usize, out: &mut [f32]) {
    let row = |i: usize, o: &mut [f32]| {
        o.fill(0.0);
        for l in 0..k {
            let a = x[i * k + l];
            for (o, &b) in o.iter_mut().zip(&y[l * m..(l + 1) * m]) {
                *o += a * b;
            }
        }
    };
    if n * m >= PAR_MIN_OUT {
        out.par_chunks_mut(m)
            .enumerate()
            .for_each(|(i, o)| row(i, o));
    } else {
        out.chunks_mut(m).enumerate().for_each(|(i, o)| row(i, o));
    }
}

/// Output rows per task of the threaded transpose (32 columns of the source).
const TRANSPOSE_BAND: usize = 32;

/// Elements per task of the element-wise passes (256 KiB of `f32`).
const ELEMENTWISE_CHUNK: usize = 1 << 16;

/// `rows × cols` row-major `x` transposed into `out` (`cols × rows`) by
/// [`transpose_f32`](crate::kernels::transpose_f32), bands of output rows spread over threads
/// when `par` allows (a copy: the same bits either way).
///
/// # Panics
/// If the lengths are not `rows·cols` (an internal invariant).
fn transpose(x: &[f32], rows: usize, cols: usize, out: &mut [f32], par: Parallelism) {
    assert!(x.len() == rows * cols && out.len() == rows * cols);
    let t = TRANSPOSE_BAND;
    let band = |(jb, dst): (usize, &mut [f32])| {
        let j0 = jb * t;
        let width = dst.len() / rows.max(1);
        // SAFETY: the band's source columns j0..j0 + width of `rows` rows of `cols` lie in
        // `x` (j0 + width ≤ cols), its `width` rows of `rows` are `dst`; distinct borrows.
        unsafe {
            transpose_raw(
                x.as_ptr().add(j0),
                cols,
                dst.as_mut_ptr(),
                rows,
                rows,
                width,
            )
        }
    };
    if threaded(par) {
        out.par_chunks_mut(t * rows).enumerate().for_each(band);
    } else {
        out.chunks_mut(t * rows).enumerate().for_each(band);
    }
}

/// `out[i] = f(src[i])`, chunks spread over threads when `par` allows.
fn map_into<S: Copy + Sync, D: Send>(
    src: &[S],
    out: &mut [D],
    par: Parallelism,
    f: impl Fn(S) -> D + Sync,
) {
    map_chunks(src, out, par, |s, o| map_loop(s, o, &f));
}

/// `chunk(part of src, same part of out)` over [`ELEMENTWISE_CHUNK`]s, spread over threads
/// when `par` allows.
fn map_chunks<S: Sync, D: Send>(
    src: &[S],
    out: &mut [D],
    par: Parallelism,
    chunk: impl Fn(&[S], &mut [D]) + Sync,
) {
    let n = ELEMENTWISE_CHUNK;
    if threaded(par) {
        out.par_chunks_mut(n)
            .zip(src.par_chunks(n))
            .for_each(|(o, s)| chunk(s, o));
    } else {
        out.chunks_mut(n)
            .zip(src.chunks(n))
            .for_each(|(o, s)| chunk(s, o));
    }
}

#[inline(always)]
fn map_loop<S: Copy, D>(src: &[S], out: &mut [D], f: &impl Fn(S) -> D) {
    for (o, &s) in out.iter_mut().zip(src) {
        *o = f(s);
    }
}

/// [`map_into`] on the AMX backend, its loop compiled for AVX-512 ([`wide`]), between two
/// `rows × cols` matrices stored with the row strides `src_ld` and `out_ld` (a dense one and
/// one of Newton–Schulz's padded bf16 matrices), row by row: the padding is neither read nor
/// written.
#[allow(clippy::too_many_arguments)]
fn map_rows_amx<S: Copy + Sync, D: Send>(
    amx: &Amx,
    (rows, cols): (usize, usize),
    src: &[S],
    src_ld: usize,
    out: &mut [D],
    out_ld: usize,
    par: Parallelism,
    f: impl Fn(S) -> D + Sync,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    let rows_per_task = (ELEMENTWISE_CHUNK / cols).max(1);
    let task = |(t, out): (usize, &mut [D])| {
        for (r, out) in out.chunks_mut(out_ld).enumerate() {
            let row = t * rows_per_task + r;
            wide::map_loop(amx, &src[row * src_ld..][..cols], &mut out[..cols], &f);
        }
    };
    let out = &mut out[..(rows - 1) * out_ld + cols];
    if threaded(par) {
        out.par_chunks_mut(rows_per_task * out_ld)
            .enumerate()
            .for_each(task);
    } else {
        out.chunks_mut(rows_per_task * out_ld)
            .enumerate()
            .for_each(task);
    }
}

/// The AMX backend's element-wise loops compiled for AVX-512 F and BW, which every CPU with
/// an [`Amx`] has: the same scalar code, so the same bits, in 16 lanes a vector where the
/// default x86-64 build has SSE2's 4 (they were ~9 % of a bf16 Muon step).
mod wide {
    use super::Amx;

    /// [`super::map_loop`] in AVX-512 lanes.
    pub(super) fn map_loop<S: Copy, D>(amx: &Amx, src: &[S], out: &mut [D], f: &impl Fn(S) -> D) {
        let _ = amx;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Amx` exists only where the CPU has AVX-512 F and BW (`amx()`).
        unsafe {
            avx512_map(src, out, f)
        }
        #[cfg(not(target_arch = "x86_64"))]
        super::map_loop(src, out, f)
    }

    /// [`super::sum_of_squares_f64`] in AVX-512 lanes.
    pub(super) fn sum_of_squares<S: Copy>(amx: &Amx, v: &[S], f: &impl Fn(S) -> f32) -> f64 {
        let _ = amx;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        unsafe {
            avx512_sum_of_squares(v, f)
        }
        #[cfg(not(target_arch = "x86_64"))]
        super::sum_of_squares_f64(v, f)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn avx512_map<S: Copy, D>(src: &[S], out: &mut [D], f: &impl Fn(S) -> D) {
        super::map_loop(src, out, f)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn avx512_sum_of_squares<S: Copy>(v: &[S], f: &impl Fn(S) -> f32) -> f64 {
        super::sum_of_squares_f64(v, f)
    }
}

/// `v[i] = f(v[i])`, chunks spread over threads when `par` allows.
fn map_in_place(v: &mut [f32], par: Parallelism, f: impl Fn(f32) -> f32 + Sync) {
    let chunk = |c: &mut [f32]| c.iter_mut().for_each(|x| *x = f(*x));
    if threaded(par) {
        v.par_chunks_mut(ELEMENTWISE_CHUNK).for_each(chunk);
    } else {
        v.chunks_mut(ELEMENTWISE_CHUNK).for_each(chunk);
    }
}

/// `out[i] = f(src[i])` from `src`, or in place (`out[i] = f(out[i])`) without one.
fn map_from(src: Option<&[f32]>, out: &mut [f32], par: Parallelism, f: impl Fn(f32) -> f32 + Sync) {
    match src {
        Some(src) => map_into(src, out, par, f),
        None => map_in_place(out, par, f),
    }
}

/// Rounds every element to the nearest bf16 (ties to even), kept as `f32`.
fn round_bf16(v: &mut [f32], par: Parallelism) {
    map_in_place(v, par, |x| bf16::from_f32(x).to_f32());
}

/// The three products of one step, on `f32` buffers (`s` = short side, `l` = long side).
trait StepOps {
    /// `p ← x·xᵀ`.
    fn gram(&self, x: &[f32], s: usize, l: usize, p: &mut [f32]);
    /// `q ← b·p + c·p·p`.
    fn poly(&self, p: &[f32], s: usize, b: f32, c: f32, q: &mut [f32]);
    /// `y ← a·x + q·x`.
    fn update(&self, q: &[f32], x: &[f32], s: usize, l: usize, a: f32, y: &mut [f32]);
    /// `y ← m·x` (`m: s×s`; Gram Newton–Schulz's `X = M·X₀`).
    fn product(&self, m: &[f32], x: &[f32], s: usize, l: usize, y: &mut [f32]);
    /// `out ← u·v` for symmetric `u`, `v` that commute (Gram Newton–Schulz).
    fn sym_product(&self, u: &[f32], v: &[f32], s: usize, out: &mut [f32]);
}

/// The plain loops (module table, `Reference`).
struct ReferenceOps;

impl StepOps for ReferenceOps {
    fn gram(&self, x: &[f32], s: usize, l: usize, p: &mut [f32]) {
        matmul_nt(x, x, s, s, l, p);
    }
    fn poly(&self, p: &[f32], s: usize, b: f32, c: f32, q: &mut [f32]) {
        matmul_nn(p, p, s, s, s, q);
        for (q, &p) in q.iter_mut().zip(p) {
            *q = b * p + c * *q;
        }
    }
    fn update(&self, q: &[f32], x: &[f32], s: usize, l: usize, a: f32, y: &mut [f32]) {
        matmul_nn(q, x, s, l, s, y);
        for (y, &x) in y.iter_mut().zip(x) {
            *y += a * x;
        }
    }
    fn product(&self, m: &[f32], x: &[f32], s: usize, l: usize, y: &mut [f32]) {
        matmul_nn(m, x, s, l, s, y);
    }
    fn sym_product(&self, u: &[f32], v: &[f32], s: usize, out: &mut [f32]) {
        matmul_nn(u, v, s, s, s, out);
    }
}

/// The `gemm` crate with fused forms and symmetric products (`Gemm`).
struct GemmOps(Parallelism);

impl StepOps for GemmOps {
    fn gram(&self, x: &[f32], s: usize, l: usize, p: &mut [f32]) {
        gemm_f32::gram(x, s, l, p, self.0);
    }
    fn poly(&self, p: &[f32], s: usize, b: f32, c: f32, q: &mut [f32]) {
        gemm_f32::poly(p, s, b, c, q, self.0);
    }
    fn update(&self, q: &[f32], x: &[f32], s: usize, l: usize, a: f32, y: &mut [f32]) {
        gemm_f32::update(q, x, s, l, a, y, self.0);
    }
    fn product(&self, m: &[f32], x: &[f32], s: usize, l: usize, y: &mut [f32]) {
        gemm_f32::matmul(s, l, s, m, x, y, false, 0.0, 1.0, self.0);
    }
    fn sym_product(&self, u: &[f32], v: &[f32], s: usize, out: &mut [f32]) {
        gemm_f32::sym_product(u, v, s, out, self.0);
    }
}

/// Gram Newton–Schulz restarts (forms `X = M·X₀` and its Gram matrix afresh) in `f32`
/// before the `R` updates since the last restart would multiply `R`'s rounding noise by more
/// than this. Near `R`'s zero eigenvalues an update multiplies by `Q(0)² = a²`: 11.9 for the
/// quintic triple, so it restarts after step 3 of 5; 66.6 then 16.3 for Polar Express, so
/// after step 2. Without restarts the `f32` Gram iteration drifts from an `f64` Newton–Schulz
/// up to 1.8e-3 (relative Frobenius) on a rank-1 input and 1e-4 at condition number 1e6,
/// 20–30× the standard iteration's error; restarting after step 3 of the quintic brings it to
/// within 2× (1.4e-4, 9e-6; measured on 256×896 inputs).
pub const GRAM_MAX_GROWTH: f32 = 200.0;

/// [`GRAM_MAX_GROWTH`] for bf16, where every product rounds to 8 bits: the quintic restarts
/// after steps 2 and 4 of 5, Polar Express after steps 1, 2 and 4. Against an `f64`
/// Newton–Schulz the bf16 Gram iteration then errs 0.7–2× as much as torch's standard bf16
/// iteration on uniform, rank-1, rank-4 and graded inputs, except a tall matrix whose rows
/// are graded to 1e-6: 3.6× (quintic) and 4.3× (Polar Express), 3.4e-2 and 4.6e-2 relative
/// Frobenius (`tests/ns_kernel_tests.rs`; a torch emulation found up to 5.2× on 3584×1024).
/// With `f32`'s bound (one restart in 5 steps) the graded tall matrix reaches 11×; the
/// restarts cost a wide step 0.91× the time of `f32`'s bound (bf16 Muon step, AMX, d = 1024
/// stack) and save 0.84× against the standard iteration.
pub const GRAM_MAX_GROWTH_BF16: f32 = 16.0;

/// Per step of `cfg`, whether Gram Newton–Schulz restarts after it ([`GRAM_MAX_GROWTH`],
/// [`GRAM_MAX_GROWTH_BF16`]).
fn gram_restarts(cfg: &NsConfig) -> Vec<bool> {
    let max_growth = match cfg.precision {
        NsPrecision::F32 => GRAM_MAX_GROWTH,
        NsPrecision::Bf16 => GRAM_MAX_GROWTH_BF16,
    };
    let mut growth = 1.0f32;
    (0..cfg.steps)
        .map(|k| {
            let a = cfg.coeffs_at(k)[0];
            let grown = growth * a * a;
            let restart = k + 1 < cfg.steps && grown > max_growth;
            growth = if restart { 1.0 } else { grown };
            restart
        })
        .collect()
}

/// The products of Newton–Schulz's step 3 on one backend's matrices ([`NsOps::Buf`]: an
/// `s × l` working matrix `X` and `s × s` ones; the device's hold a stack of them), each
/// rounding its result to the working precision. Both methods run on them:
/// [`standard_steps`] and [`gram_steps`].
pub(crate) trait NsOps {
    /// A matrix as the backend holds it.
    type Buf: ?Sized;
    /// `p ← X·Xᵀ`.
    fn gram(&self, x: &Self::Buf, p: &mut Self::Buf) -> Result<()>;
    /// `q ← b·p + c·p·p` (`p` symmetric).
    fn poly(&self, p: &Self::Buf, b: f32, c: f32, q: &mut Self::Buf) -> Result<()>;
    /// `q ← q + a·I`, each diagonal element rounded again.
    fn add_diagonal(&self, q: &mut Self::Buf, a: f32) -> Result<()>;
    /// `out ← u·v` for symmetric `u`, `v` that commute (`u·v` symmetric).
    fn sym_product(&self, u: &Self::Buf, v: &Self::Buf, out: &mut Self::Buf) -> Result<()>;
    /// `y ← m·X`, plus `a·X` with `Some(a)` (one rounding).
    fn apply(&self, m: &Self::Buf, x: &Self::Buf, a: Option<f32>, y: &mut Self::Buf) -> Result<()>;
}

/// Step 3 whole on `ops`: [`gram_steps`] when `gram`, else [`standard_steps`], then the last
/// product, so that `y` holds the result. `x` holds `X₀` on entry and is workspace after;
/// `square` makes each `s × s` work buffer (two, or four for Gram). The drivers of the
/// backends whose products write a plain `Buf` share it (the AMX one fuses its last product
/// into the result's layout instead).
pub(crate) fn iterate_with<O: NsOps, B: BorrowMut<O::Buf>>(
    ops: &O,
    cfg: &NsConfig,
    gram: bool,
    x: &mut B,
    y: &mut B,
    mut square: impl FnMut() -> Result<B>,
) -> Result<()> {
    let (mut p, mut q) = (square()?, square()?);
    if gram {
        let (mut m, mut t) = (square()?, square()?);
        gram_steps(ops, cfg, x, y, [&mut p, &mut q, &mut m, &mut t])?;
        ops.apply(mat(&m), mat(x), None, mat_mut(y))
    } else {
        let a = standard_steps(ops, cfg, x, y, [&mut p, &mut q])?;
        ops.apply(mat(&q), mat(x), Some(a), mat_mut(y))
    }
}

/// Step 3 as torch's iteration, up to its last product: per step `P = X·Xᵀ`,
/// `Q = b·P + c·P·P`, `X ← a·X + Q·X`. On return `q` holds the last `Q` and `x` the `X` it
/// applies to; the result is `apply(q, x, Some(a))` with the returned `a`. `x` holds `X₀` on
/// entry; `y` and `p` are workspace; buffers are swapped, not copied.
pub(crate) fn standard_steps<O: NsOps, B: BorrowMut<O::Buf>>(
    ops: &O,
    cfg: &NsConfig,
    x: &mut B,
    y: &mut B,
    [p, q]: [&mut B; 2],
) -> Result<f32> {
    for k in 0..cfg.steps {
        let [a, b, c] = cfg.coeffs_at(k);
        ops.gram(mat(x), mat_mut(p))?;
        ops.poly(mat(p), b, c, mat_mut(q))?;
        if k + 1 == cfg.steps {
            return Ok(a);
        }
        ops.apply(mat(q), mat(x), Some(a), mat_mut(y))?;
        std::mem::swap(x, y);
    }
    unreachable!("NsConfig::validate: at least one step")
}

/// Step 3 as Gram Newton–Schulz, up to its last product: on return `m` holds `M` and `x` the
/// `X` it applies to (the result is `apply(m, x, None)`); `y`, `r`, `q`, `t` are workspace.
/// `x` holds `X₀` on entry; buffers are swapped, not copied.
///
/// With `R = X·Xᵀ` and `Q = a + b·R + c·R²`, a step maps `X` to `Q·X`, so `X_k = M_k·X₀` with
/// `M_k = Q_{k−1}···Q₀`, and `R_{k+1} = Q·R·Q = Q²·R`: every product but the first Gram
/// matrix and the last `M·X₀` is `s × s`. All of `R`, `Q`, `M` are polynomials of `R₀`, so
/// they are symmetric and commute: their products are symmetric products (half the
/// multiply-adds on the gemm and AMX backends). At a restart ([`gram_restarts`]) `X ← M·X`
/// and `R` is formed afresh.
pub(crate) fn gram_steps<O: NsOps, B: BorrowMut<O::Buf>>(
    ops: &O,
    cfg: &NsConfig,
    x: &mut B,
    y: &mut B,
    [r, q, m, t]: [&mut B; 4],
) -> Result<()> {
    ops.gram(mat(x), mat_mut(r))?;
    // `M = Q` (no product yet) since the start or the last restart.
    let mut fresh = true;
    for (k, restart) in gram_restarts(cfg).into_iter().enumerate() {
        let [a, b, c] = cfg.coeffs_at(k);
        ops.poly(mat(r), b, c, mat_mut(q))?;
        ops.add_diagonal(mat_mut(q), a)?;
        if fresh {
            // `M` takes `Q`'s buffer; `q` keeps `Q` (an alias) until the next poly.
            std::mem::swap(m, q);
        } else {
            ops.sym_product(mat(q), mat(m), mat_mut(t))?;
            std::mem::swap(m, t);
        }
        if k + 1 == cfg.steps {
            break;
        }
        if restart {
            ops.apply(mat(m), mat(x), None, mat_mut(y))?;
            std::mem::swap(x, y);
            ops.gram(mat(x), mat_mut(r))?;
        } else {
            let qk: &O::Buf = if fresh { mat(m) } else { mat(q) };
            ops.sym_product(qk, qk, mat_mut(t))?;
            ops.sym_product(mat(t), mat(r), mat_mut(q))?;
            std::mem::swap(r, q);
        }
        fresh = restart;
    }
    Ok(())
}

/// A buffer as the backend's matrix (`Borrow` named: every buffer also borrows as itself).
fn mat<T: ?Sized, B: Borrow<T>>(b: &B) -> &T {
    Borrow::<T>::borrow(b)
}

/// [`mat`], mutable.
fn mat_mut<T: ?Sized, B: BorrowMut<T>>(b: &mut B) -> &mut T {
    BorrowMut::<T>::borrow_mut(b)
}

/// [`NsOps`] on `f32` buffers through a [`StepOps`] (the reference loops or gemm), each
/// result rounded to bf16 (kept as `f32`) when `bf16`.
struct F32Ops<'o, O> {
    ops: &'o O,
    s: usize,
    l: usize,
    bf16: bool,
    par: Parallelism,
}

impl<O: StepOps> F32Ops<'_, O> {
    fn round(&self, v: &mut [f32]) {
        if self.bf16 {
            round_bf16(v, self.par);
        }
    }
}

impl<O: StepOps> NsOps for F32Ops<'_, O> {
    type Buf = [f32];
    fn gram(&self, x: &[f32], p: &mut [f32]) -> Result<()> {
        self.ops.gram(x, self.s, self.l, p);
        self.round(p);
        Ok(())
    }
    fn poly(&self, p: &[f32], b: f32, c: f32, q: &mut [f32]) -> Result<()> {
        self.ops.poly(p, self.s, b, c, q);
        self.round(q);
        Ok(())
    }
    fn add_diagonal(&self, q: &mut [f32], a: f32) -> Result<()> {
        for d in q.iter_mut().step_by(self.s + 1) {
            *d += a;
            self.round(std::slice::from_mut(d));
        }
        Ok(())
    }
    fn sym_product(&self, u: &[f32], v: &[f32], out: &mut [f32]) -> Result<()> {
        self.ops.sym_product(u, v, self.s, out);
        self.round(out);
        Ok(())
    }
    fn apply(&self, m: &[f32], x: &[f32], a: Option<f32>, y: &mut [f32]) -> Result<()> {
        match a {
            Some(a) => self.ops.update(m, x, self.s, self.l, a, y),
            None => self.ops.product(m, x, self.s, self.l, y),
        }
        self.round(y);
        Ok(())
    }
}

/// Step 3 on `f32` buffers through `ops` (`xw` = `X₀` on entry, the result on exit), as Gram
/// Newton–Schulz when `gram`; with `bf16`, every product's result is rounded to bf16.
fn iterate_f32(
    xw: &mut Vec<f32>,
    (s, l): (usize, usize),
    cfg: &NsConfig,
    (gram, bf16): (bool, bool),
    ops: &impl StepOps,
    par: Parallelism,
) -> Result<()> {
    let mut y = vec![0.0f32; s * l];
    let ops = F32Ops {
        ops,
        s,
        l,
        bf16,
        par,
    };
    iterate_with(&ops, cfg, gram, xw, &mut y, || Ok(vec![0.0f32; s * s]))?;
    std::mem::swap(xw, &mut y);
    Ok(())
}

/// Multiply-adds of step 3 on an `s × l` matrix (`s ≤ l`) with the gemm backend's products:
/// `(standard, gram)`. Counted with symmetric leaves of [`gemm_f32::SYM_LEAF`] on every CPU
/// (the AVX2 products split further, [`gemm_f32::sym_leaf`]): the method and the cost must
/// be the same on every rank of a group, whatever its CPU ([`ns_macs`]).
fn step_macs(s: usize, l: usize, cfg: &NsConfig) -> (u128, u128) {
    let leaf = gemm_f32::SYM_LEAF;
    let (sq, xs) = (
        gemm_f32::sym_macs(s, s, leaf),
        gemm_f32::sym_macs(s, l, leaf),
    );
    let full = (s * s) as u128 * l as u128;
    let n = cfg.steps as u128;
    let standard = n * (xs + sq + full);
    // Stretches of steps between restarts; each starts with a Gram matrix, ends with `M·X₀`
    // and updates `M` (by `Q·M`) and `R` (by `Q·Q` and `·R`) at every step but its first
    // (`M = Q`) and its last (no `R` needed).
    let stretches = 1 + gram_restarts(cfg).iter().filter(|&&r| r).count() as u128;
    let m_updates = n - stretches;
    let gram = stretches * (xs + full) + n * sq + m_updates * sq + m_updates * 2 * sq;
    (standard, gram)
}

/// Whether [`NsMethod::Auto`] takes Gram Newton–Schulz for an `s × l` matrix (`s ≤ l`): when
/// it needs at most [`GRAM_MAX_COST`] of the standard iteration's multiply-adds. With the
/// quintic on a square matrix it needs more (12 against 11.25 units of `s³` for 5 steps at
/// 1024²); at `l = 1.5·s` 0.89×, at `l = 3.5·s` 0.64× (20.1 against 31.6).
pub fn gram_pays(s: usize, l: usize, cfg: &NsConfig) -> bool {
    let (standard, gram) = step_macs(s.min(l), s.max(l), cfg);
    gram * GRAM_MAX_COST.1 <= standard * GRAM_MAX_COST.0
}

/// [`gram_pays`]' bound, as a fraction `(numerator, denominator)`. The time follows the
/// multiply-adds: one thread, AVX2 gemm, the methods alternating (4 rounds each), Gram took
/// 1.00× the standard iteration's time on 1024×1280 (0.965× the multiply-adds), 0.87× on
/// 1024×1536 (0.89×), 0.78× on 1024×2048 (0.79×), 0.66× on 1024×3584 (0.64×) and 1.02–1.07×
/// on 1024² (1.07×). Below 0.9 the gain is clear of that machine's noise.
pub const GRAM_MAX_COST: (u128, u128) = (9, 10);

/// The method that runs for an `s × l` matrix on `backend`: [`NsMethod::Auto`] resolved.
pub fn resolve_method(cfg: &NsConfig, backend: NsBackend, s: usize, l: usize) -> NsMethod {
    if takes_gram(cfg, backend, s, l) {
        NsMethod::Gram
    } else {
        NsMethod::Standard
    }
}

/// Whether `cfg`'s method is Gram for an `s × l` matrix on `backend` (`Auto` as it stands in
/// `cfg`, or resolved). `Auto` takes it where it pays ([`gram_pays`]) on every backend but
/// the reference loops, which stay the standard iteration unless asked (they are the
/// oracle); `Auto` never resolves to them, so the answer is the same before and after
/// resolving the backend.
fn takes_gram(cfg: &NsConfig, backend: NsBackend, s: usize, l: usize) -> bool {
    match cfg.method {
        NsMethod::Gram => true,
        NsMethod::Standard => false,
        NsMethod::Auto => backend != NsBackend::Reference && gram_pays(s, l, cfg),
    }
}

/// Multiply-adds of Newton–Schulz's products on a `rows × cols` matrix with `cfg`, by the
/// method `Auto` takes there, decided from `cfg` alone (no library is probed: the method
/// does not depend on which backend `Auto` resolves to), so every rank of a group gets the
/// same number: Muon's root plan weighs matrices by it.
pub fn ns_macs(rows: usize, cols: usize, cfg: &NsConfig) -> u128 {
    let (s, l) = (rows.min(cols), rows.max(cols));
    let (standard, gram) = step_macs(s, l, cfg);
    if takes_gram(cfg, cfg.backend, s, l) {
        gram
    } else {
        standard
    }
}

/// `batch` row-major `rows × cols` matrices stored back to back: one Newton–Schulz call of
/// the device, or `batch` independent ones of the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NsShape {
    pub batch: usize,
    pub rows: usize,
    pub cols: usize,
}

impl NsShape {
    pub fn new(batch: usize, rows: usize, cols: usize) -> Self {
        NsShape { batch, rows, cols }
    }
}

/// `cfg`'s backend: [`resolve_backend`] of its precision and backend, what every entry point
/// checks before it changes anything.
pub fn resolve_config(cfg: &NsConfig) -> Result<NsBackend> {
    resolve_backend(cfg.precision, cfg.backend)
}

thread_local! {
    /// The AMX iterations' bf16 matrices (two `s × l`, four `s × s`; the standard iteration
    /// uses the first four), kept between calls on each thread, up to
    /// [`RETAIN_BYTES`](crate::kernels::RETAIN_BYTES) each: fresh buffers of a few MiB cost
    /// more in page faults than the packing. Taken out for a call, so that a call nested in it
    /// (this thread running another task while it waits for rayon) gets fresh ones.
    static AMX_WORK: std::cell::Cell<[AlignedBf16; 6]> = std::cell::Cell::new(Default::default());
}

/// The AMX products on Newton–Schulz's bf16 matrices, stored with rows
/// [`amx_bf16::padded_ld`] apart (`ldx` for `X`, `ldp` for the `s × s` ones): aligned, so
/// that the products read the left operands in place, and padded so that those reads spread
/// over L1's sets. `tall`: `X` is the `l × s` matrix itself, not its transpose: `P = Xᵀ·X`
/// and `X ← X·Q` (`+ a·X`), each output element the same pairs summed in the same order as
/// on the transpose (`Q` is exactly symmetric), so the same bits without transposing twice.
struct AmxSteps<'a> {
    amx: &'a Amx,
    s: usize,
    l: usize,
    tall: bool,
    par: Parallelism,
    ldx: usize,
    ldp: usize,
}

impl AmxSteps<'_> {
    fn square(&self) -> Strides {
        let ld = self.ldp;
        Strides {
            a: ld,
            b: ld,
            out: ld,
            add: ld,
        }
    }

    /// `p ← X·Xᵀ` (`Xᵀ·X` when tall).
    fn gram_into(&self, x: &[bf16], p: &mut [bf16]) {
        let ld = Strides {
            a: self.ldx,
            b: self.ldx,
            ..self.square()
        };
        let (s, l) = (self.s, self.l);
        self.amx
            .sym_strided(s, l, x, p, Epilogue::PLAIN, self.par, self.tall, ld);
    }

    /// `q ← c·p·p + b·p` (`p·p` as `p·pᵀ`: the AMX `p` is exactly symmetric).
    fn poly_into(&self, p: &[bf16], b: f32, c: f32, q: &mut [bf16]) {
        let poly = Epilogue {
            alpha: c,
            add: Some((b, p)),
        };
        let s = self.s;
        self.amx
            .sym_strided(s, s, p, q, poly, self.par, false, self.square());
    }

    /// `out ← epi(m·X)` (`X·m` when tall; an addend is `X`'s shape, rows `ldx` apart), `out`'s
    /// rows `out_ld` apart.
    fn apply_to(&self, m: &[bf16], x: &[bf16], out: &mut [bf16], out_ld: usize, epi: Epilogue) {
        let (s, l) = (self.s, self.l);
        let (ldx, ldp) = (self.ldx, self.ldp);
        let ld = Strides {
            a: if self.tall { ldx } else { ldp },
            b: if self.tall { ldp } else { ldx },
            out: out_ld,
            add: ldx,
        };
        if self.tall {
            self.amx
                .matmul_strided(l, s, s, x, Rhs::Plain(m), out, epi, self.par, ld);
        } else {
            self.amx
                .matmul_strided(s, l, s, m, Rhs::Plain(x), out, epi, self.par, ld);
        }
    }
}

/// Gram Newton–Schulz's products ([`gram_steps`]) on the AMX: every product rounds once to
/// bf16; `Q`'s diagonal a second time when `a` is added to it.
impl NsOps for AmxSteps<'_> {
    type Buf = [bf16];
    fn gram(&self, x: &[bf16], p: &mut [bf16]) -> Result<()> {
        self.gram_into(x, p);
        Ok(())
    }
    fn poly(&self, p: &[bf16], b: f32, c: f32, q: &mut [bf16]) -> Result<()> {
        self.poly_into(p, b, c, q);
        Ok(())
    }
    fn add_diagonal(&self, q: &mut [bf16], a: f32) -> Result<()> {
        for d in q.iter_mut().step_by(self.ldp + 1).take(self.s) {
            *d = bf16::from_f32(d.to_f32() + a);
        }
        Ok(())
    }
    fn sym_product(&self, u: &[bf16], v: &[bf16], out: &mut [bf16]) -> Result<()> {
        self.amx
            .sym_product_strided(self.s, u, v, out, Epilogue::PLAIN, self.par, self.square());
        Ok(())
    }
    fn apply(&self, m: &[bf16], x: &[bf16], a: Option<f32>, y: &mut [bf16]) -> Result<()> {
        self.apply_to(m, x, y, self.ldx, plus(a, x));
        Ok(())
    }
}

/// `out ← acc + a·x` (`Some(a)`), or `acc`.
fn plus(a: Option<f32>, x: &[bf16]) -> Epilogue<'_> {
    Epilogue {
        alpha: 1.0,
        add: a.map(|a| (a, x)),
    }
}

/// Step 3 in bf16 on the AMX products ([`AmxSteps`]), on `load(v)` of every element of `xw`
/// (the result goes back into `xw`: widened into an `f32` one, written by the last product
/// into a bf16 one), by `cfg`'s method for this shape ([`resolve_method`]):
/// - standard: the same three roundings per step as [`iterate_onednn`], with `P·P` as
///   `P·Pᵀ` and the addends read from `P` and `X` directly;
/// - Gram ([`gram_steps`]): as the other backends' Gram iterations.
#[allow(clippy::too_many_arguments)]
fn iterate_amx<S: AmxElement>(
    amx: &Amx,
    xw: &mut [S],
    s: usize,
    l: usize,
    tall: bool,
    cfg: &NsConfig,
    par: Parallelism,
    load: impl Fn(S) -> bf16 + Sync,
) -> Result<()> {
    let mut work = AMX_WORK.take();
    // Each buffer only grows (every element used is written before it is read; the padding
    // never is), so a larger matrix after a smaller one zero-fills nothing it already had.
    let [xv, pv, qv, yv, mv, tv] = &mut work;
    // `X` as stored: `s × l`, or `l × s` when tall.
    let (x_rows, x_cols) = if tall { (l, s) } else { (s, l) };
    let (ldx, ldp) = (amx_bf16::padded_ld(x_cols), amx_bf16::padded_ld(s));
    let (mut x, mut y) = (xv.get(x_rows * ldx), yv.get(x_rows * ldx));
    map_rows_amx(amx, (x_rows, x_cols), xw, x_cols, x, ldx, par, load);
    let ops = AmxSteps {
        amx,
        s,
        l,
        tall,
        par,
        ldx,
        ldp,
    };
    let (p, q) = (pv.get(s * ldp), qv.get(s * ldp));
    // Every product but the last, which multiplies `X` by `m` and adds `a·X` (standard)
    // or nothing (Gram).
    let (m, a): (&[bf16], _) = if resolve_method(cfg, NsBackend::Amx, s, l) == NsMethod::Gram {
        let (mut r, mut q, mut m, mut t) = (p, q, mv.get(s * ldp), tv.get(s * ldp));
        gram_steps(&ops, cfg, &mut x, &mut y, [&mut r, &mut q, &mut m, &mut t])?;
        (m, None)
    } else {
        let (mut p, mut q) = (p, q);
        let a = standard_steps(&ops, cfg, &mut x, &mut y, [&mut p, &mut q])?;
        (q, Some(a))
    };
    let last = plus(a, x);
    // The last product of a bf16 result goes straight into it (dense rows), saving the copy
    // out of `Y`.
    if let Some(result) = S::as_bf16(xw) {
        ops.apply_to(m, x, result, x_cols, last);
    } else {
        ops.apply_to(m, x, y, ldx, last);
        map_rows_amx(amx, (x_rows, x_cols), y, ldx, xw, x_cols, par, S::from_bf16);
    }
    AMX_WORK.set(work.map(AlignedBf16::retained));
    Ok(())
}

/// [`NsOps`] on oneDNN's matmul primitive in `T` (rows dense): `X·Xᵀ`, `c·P·P + b·P` and
/// Gram's products of commuting symmetric matrices by halves ([`onednn::OneDnn::sym_nt`],
/// [`onednn::OneDnn::sym_product`]; `P·P` as `P·Pᵀ`, `U·V` as `U·Vᵀ`, the right operand
/// symmetric to rounding inside its leaves), the products with `X` whole.
struct OneDnnOps<T> {
    d: &'static onednn::OneDnn,
    s: usize,
    l: usize,
    element: std::marker::PhantomData<T>,
}

impl<T: Element> NsOps for OneDnnOps<T> {
    type Buf = [T];
    fn gram(&self, x: &[T], p: &mut [T]) -> Result<()> {
        // The weights Xᵀ (l×s) are X read transposed.
        self.d.sym_nt(self.s, self.l, x, p, self.s, 1.0, None)?;
        Ok(())
    }
    fn poly(&self, p: &[T], b: f32, c: f32, q: &mut [T]) -> Result<()> {
        let s = self.s;
        q.copy_from_slice(p);
        self.d.sym_nt(s, s, p, q, s, c, Some(b))?;
        Ok(())
    }
    fn add_diagonal(&self, q: &mut [T], a: f32) -> Result<()> {
        for d in q.iter_mut().step_by(self.s + 1) {
            *d = T::from_f32(d.to_f32() + a);
        }
        Ok(())
    }
    fn sym_product(&self, u: &[T], v: &[T], out: &mut [T]) -> Result<()> {
        self.d.sym_product(self.s, u, v, out)?;
        Ok(())
    }
    fn apply(&self, m: &[T], x: &[T], a: Option<f32>, y: &mut [T]) -> Result<()> {
        let (s, l) = (self.s, self.l);
        if a.is_some() {
            y.copy_from_slice(x);
        }
        self.d.matmul(s, l, s, m, x, false, y, 1.0, a)?;
        Ok(())
    }
}

/// Step 3 on oneDNN's matmul primitive in `T` (bf16: `xw` holds bf16 values on entry), as
/// Gram Newton–Schulz when `gram`.
fn iterate_onednn<T: Element>(
    xw: &mut [f32],
    (s, l): (usize, usize),
    cfg: &NsConfig,
    gram: bool,
    par: Parallelism,
) -> Result<()> {
    let zero = T::from_f32(0.0);
    let mut x = vec![zero; s * l];
    map_into(xw, &mut x, par, T::from_f32);
    let mut y = vec![zero; s * l];
    let ops = OneDnnOps {
        d: onednn::onednn()?,
        s,
        l,
        element: std::marker::PhantomData,
    };
    iterate_with(&ops, cfg, gram, &mut x, &mut y, || Ok(vec![zero; s * s]))?;
    map_into(&y, xw, par, |v| v.to_f32());
    Ok(())
}

thread_local! {
    /// [`ns_one`]'s working copy, kept between calls on each thread up to
    /// [`RETAIN_BYTES`](crate::kernels::RETAIN_BYTES) (taken out for a call, as
    /// `iterate_amx`'s buffers).
    static XW: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// `Σ f(v)²` in `f64`: element `i` into lane `i mod 8`, the lanes added in order at the end. The
/// order is fixed (the bits do not depend on threads or the CPU), and eight independent sums
/// run at the adder's throughput rather than its latency (one chain took ~6 ms on a 1024 ×
/// 3584 matrix).
#[inline(always)]
fn sum_of_squares_f64<S: Copy>(v: &[S], f: impl Fn(S) -> f32) -> f64 {
    let mut lanes = [0.0f64; 8];
    let chunks = v.chunks_exact(8);
    let tail = chunks.remainder();
    let sq = |x: S| f64::from(f(x)) * f64::from(f(x));
    for c in chunks {
        for (s, &x) in lanes.iter_mut().zip(c) {
            *s += sq(x);
        }
    }
    for (s, &x) in lanes.iter_mut().zip(tail) {
        *s += sq(x);
    }
    lanes.iter().sum()
}

/// Newton–Schulz of one `rows × cols` matrix with a resolved backend (not `Auto`).
fn ns_one(
    x: &mut [f32],
    rows: usize,
    cols: usize,
    cfg: &NsConfig,
    backend: NsBackend,
    par: Parallelism,
) -> Result<()> {
    if x.is_empty() {
        return Ok(());
    }
    let bf16 = cfg.precision == NsPrecision::Bf16;
    // Step 1: work on a `short × long` matrix.
    let transposed = rows > cols;
    let (s, l) = if transposed {
        (cols, rows)
    } else {
        (rows, cols)
    };
    let method = resolve_method(cfg, backend, s, l);
    if backend == NsBackend::Amx {
        return ns_amx(x, rows, cols, cfg, par);
    }
    // oneDNN's OpenMP threads spin for a while after each product; rayon tasks between its
    // products would fight them for the cores, so on that backend the passes around the
    // products stay on the calling thread.
    let par = match backend {
        NsBackend::OneDnn => Parallelism::None,
        _ => par,
    };
    let mut xw = XW.take();
    // Every element is written below: only a grown part needs filling.
    xw.truncate(s * l);
    xw.resize(s * l, 0.0);
    let round = |v: f32| if bf16 { bf16::from_f32(v).to_f32() } else { v };
    // Step 1: a tall matrix is transposed into `xw`; bf16 rounds the input as it goes into
    // `xw` (the norm is that of the rounded values); a wide f32 one is read where it is.
    let src = if transposed {
        transpose(x, rows, cols, &mut xw, par);
        if bf16 {
            map_in_place(&mut xw, par, round);
        }
        None
    } else if bf16 {
        map_into(x, &mut xw, par, round);
        None
    } else {
        Some(&*x)
    };
    // Step 2: Frobenius norm (f64 sum in eight lanes over the elements as given, rounded
    // once), scaled, clamped.
    let Some(denom) = Denom::of(sum_of_squares_f64(x, round), cfg) else {
        x.fill(f32::NAN); // a non-finite element
        return Ok(());
    };
    // `xw ← round(v / denom)`, `v` from `src` or `xw` itself; one loop per kind of divisor
    // ([`Denom::divide`]).
    match denom {
        Denom::F32(d) => map_from(src, &mut xw, par, |v| round(Denom::F32(d).divide(v))),
        Denom::F64(d) => map_from(src, &mut xw, par, |v| round(Denom::F64(d).divide(v))),
    }
    // Step 3.
    let gram = method == NsMethod::Gram;
    match backend {
        NsBackend::Reference => {
            iterate_f32(&mut xw, (s, l), cfg, (gram, bf16), &ReferenceOps, par)?
        }
        NsBackend::Gemm => iterate_f32(&mut xw, (s, l), cfg, (gram, bf16), &GemmOps(par), par)?,
        NsBackend::OneDnn if bf16 => iterate_onednn::<bf16>(&mut xw, (s, l), cfg, gram, par)?,
        NsBackend::OneDnn => iterate_onednn::<f32>(&mut xw, (s, l), cfg, gram, par)?,
        NsBackend::Amx | NsBackend::Auto => unreachable!("ns_one takes AMX apart, Auto resolved"),
    }
    // Step 4.
    if transposed {
        transpose(&xw, s, l, x, par);
    } else {
        map_into(&xw, x, par, |v| v);
    }
    XW.set(retained(xw));
    Ok(())
}

/// Step 2's divisor, from the `f64` sum of squares: `max(scale·norm, eps)` in `f32`, or, for
/// finite elements whose norm exceeds `f32` (≳ 1.8e19 each on a 64×64 matrix), the `f64`
/// norm (dividing in `f64`, where it is finite, rather than by an infinite `f32` norm: all
/// NaN).
#[derive(Clone, Copy)]
enum Denom {
    F32(f32),
    F64(f64),
}

impl Denom {
    /// `None` for a non-finite sum (a non-finite element).
    fn of(sum_of_squares: f64, cfg: &NsConfig) -> Option<Denom> {
        let norm64 = sum_of_squares.sqrt();
        let norm = norm64 as f32;
        if !norm64.is_finite() {
            None
        } else if norm.is_finite() {
            Some(Denom::F32((cfg.norm_scale * norm).max(cfg.eps)))
        } else {
            Some(Denom::F64(f64::from(cfg.norm_scale) * norm64))
        }
    }

    /// `v / self`. Loops over elements call it on a variant fixed outside the loop (`match`
    /// first, then one loop per arm): with the `match` inside, a build for AVX-512 CPUs
    /// (`-C target-cpu=native` on a Xeon) computed both divisions in every lane and
    /// blended them, the `f64` one four lanes at a time, which made a bf16 Muon step 1.5×
    /// slower.
    #[inline(always)]
    fn divide(self, v: f32) -> f32 {
        match self {
            Denom::F32(d) => v / d,
            Denom::F64(d) => (f64::from(v) / d) as f32,
        }
    }
}

/// An element Newton–Schulz's AMX path reads its input from and writes its result to: `f32`
/// (rounded to bf16 as it is read, the result widened), or bf16 (Muon's `U` on the AMX
/// backend: the same values in half the bytes, so the same bits).
pub(crate) trait AmxElement: Copy + Send + Sync {
    /// What a non-finite input turns the matrix into.
    const NAN: Self;
    /// The bf16 value this element rounds to (nearest, ties to even), widened.
    fn rounded(self) -> f32;
    /// A result element.
    fn from_bf16(v: bf16) -> Self;
    /// The matrix as bf16 when it is (Newton–Schulz's last product then writes it).
    fn as_bf16(v: &mut [Self]) -> Option<&mut [bf16]>;
}

impl AmxElement for f32 {
    const NAN: f32 = f32::NAN;
    #[inline(always)]
    fn rounded(self) -> f32 {
        bf16::from_f32(self).to_f32()
    }
    #[inline(always)]
    fn from_bf16(v: bf16) -> f32 {
        v.to_f32()
    }
    fn as_bf16(_: &mut [f32]) -> Option<&mut [bf16]> {
        None
    }
}

impl AmxElement for bf16 {
    const NAN: bf16 = bf16::NAN;
    /// The bits shifted into place: exact for every value but a NaN, which this keeps a NaN
    /// (only its payload can differ from `to_f32`'s, which no result reads: a NaN input makes
    /// the norm NaN and the matrix [`Self::NAN`]). Unlike `to_f32`, it vectorizes.
    #[inline(always)]
    fn rounded(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    #[inline(always)]
    fn from_bf16(v: bf16) -> bf16 {
        v
    }
    fn as_bf16(v: &mut [bf16]) -> Option<&mut [bf16]> {
        Some(v)
    }
}

/// [`ns_one`] on the AMX products, in three passes over the matrix where the other backends
/// take six or seven: the norm of the bf16-rounded input, the scaled input straight into the
/// bf16 working matrix, the result straight back into `x`. A tall matrix is taken as it is
/// (`Xᵀ·X` and `X·Q`, the same bits as on its transpose; [`iterate_amx`]), so nothing is
/// transposed. The bits are those of the module table's steps (`round(round(v) / d)` is what
/// the bf16 matrix would hold after step 2 either way).
fn ns_amx<S: AmxElement>(
    x: &mut [S],
    rows: usize,
    cols: usize,
    cfg: &NsConfig,
    par: Parallelism,
) -> Result<()> {
    let amx = amx_bf16::amx()?;
    let tall = rows > cols;
    let (s, l) = if tall { (cols, rows) } else { (rows, cols) };
    let Some(denom) = Denom::of(wide::sum_of_squares(amx, x, &S::rounded), cfg) else {
        x.fill(S::NAN); // a non-finite element
        return Ok(());
    };
    // One loop per kind of divisor ([`Denom::divide`]).
    let load = move |d: Denom, v: S| bf16::from_f32(d.divide(v.rounded()));
    match denom {
        Denom::F32(d) => iterate_amx(amx, x, s, l, tall, cfg, par, |v| load(Denom::F32(d), v)),
        Denom::F64(d) => iterate_amx(amx, x, s, l, tall, cfg, par, |v| load(Denom::F64(d), v)),
    }
}

/// Orthogonalizes the `rows × cols` row-major matrix `x` in place by Newton–Schulz (module
/// table) with `cfg`'s precision and backend. Products use every thread of the current rayon
/// pool (the result does not depend on how many). A zero matrix stays zero; a matrix with a
/// non-finite element becomes all NaN (`Ok`); a finite one whose norm overflows f32 is
/// normalized in f64.
///
/// # Errors
/// `BadInput` if `x.len() != rows·cols` or [`NsConfig::validate`] fails; the backend errors of
/// [`resolve_backend`]; a oneDNN call failing. `x` is unchanged on error, except after a
/// oneDNN call fails mid-way (then it is too).
pub fn orthogonalize(x: &mut [f32], rows: usize, cols: usize, cfg: &NsConfig) -> Result<()> {
    cfg.validate()?;
    check_matrix("orthogonalize", x.len(), rows, cols)?;
    let backend = resolve_config(cfg)?;
    let par = Parallelism::Rayon(rayon::current_num_threads());
    ns_one(x, rows, cols, cfg, backend, par)
}

/// `Err(BadInput)` unless `len` is the element count of a `rows × cols` matrix (a product
/// that overflows `usize` never is).
fn check_matrix(op: &'static str, len: usize, rows: usize, cols: usize) -> Result<()> {
    match rows.checked_mul(cols) {
        Some(n) if n == len => Ok(()),
        n => Err(Error::BadInput {
            op,
            what: format!("{len} elements"),
            reason: match n {
                Some(n) => format!("a {rows}×{cols} matrix has {n}"),
                None => format!("a {rows}×{cols} matrix has more elements than usize holds"),
            },
        }),
    }
}

/// [`orthogonalize`] on each of the whole `rows × cols` matrices stacked in `x` (the
/// experts of `[E, rows, cols]`); see [`orthogonalize_many`] for the threading.
pub fn orthogonalize_batch(x: &mut [f32], rows: usize, cols: usize, cfg: &NsConfig) -> Result<()> {
    let mn = rows.saturating_mul(cols);
    if (mn == 0 && !x.is_empty()) || (mn != 0 && !x.len().is_multiple_of(mn)) {
        return Err(Error::BadInput {
            op: "orthogonalize_batch",
            what: format!("{} elements", x.len()),
            reason: format!("not a whole number of {rows}×{cols} matrices"),
        });
    }
    if x.is_empty() {
        return Ok(());
    }
    orthogonalize_many(x.chunks_mut(mn).map(|m| (m, rows, cols)).collect(), cfg)
}

/// [`orthogonalize`] on independent matrices of any shapes, `(data, rows, cols)`, in one of
/// two ways (each matrix's bits are the same either way):
/// - **across threads**, each matrix on one thread with single-threaded products, claimed
///   largest first from one queue by the calling thread and rayon's workers: every matrix on
///   the reference backend; on the gemm backend, matrices whose working buffers
///   ([`ns_working_bytes`]) fit in [`RETAIN_BYTES`] (so that no thread holds more than
///   that), when their short side is under [`BATCH_INNER_MIN_SIDE`] or there are at least
///   [`ACROSS_MIN_PER_THREAD`] per thread of them;
/// - **one after another**, each product using every thread: the rest.
pub fn orthogonalize_many(tasks: Vec<(&mut [f32], usize, usize)>, cfg: &NsConfig) -> Result<()> {
    cfg.validate()?;
    for (x, rows, cols) in &tasks {
        check_matrix("orthogonalize_many", x.len(), *rows, *cols)?;
    }
    let backend = resolve_config(cfg)?;
    schedule(tasks, cfg, backend, |x, rows, cols, par| {
        ns_one(x, rows, cols, cfg, backend, par)
    })
}

/// [`orthogonalize_many`] on matrices held in bf16 (already rounded: the values the `f32`
/// path rounds its input to), the results left in bf16: the same bits as widening them
/// first and running the `f32` form, without the widened copies. AMX only: `Err` unless
/// `cfg` asks for bf16 and resolves to [`NsBackend::Amx`] here.
pub(crate) fn orthogonalize_many_bf16(
    tasks: Vec<(&mut [bf16], usize, usize)>,
    cfg: &NsConfig,
) -> Result<()> {
    cfg.validate()?;
    for (x, rows, cols) in &tasks {
        check_matrix("orthogonalize_many_bf16", x.len(), *rows, *cols)?;
    }
    let backend = resolve_config(cfg)?;
    if !takes_bf16_input(cfg, backend) {
        return Err(Error::BadInput {
            op: "orthogonalize_many_bf16",
            what: format!("{:?} Newton–Schulz on {backend:?}", cfg.precision),
            reason: "bf16 input is taken by the AMX bf16 backend only".into(),
        });
    }
    schedule(tasks, cfg, backend, |x, rows, cols, par| {
        ns_amx(x, rows, cols, cfg, par)
    })
}

/// Whether Newton–Schulz under `cfg`, whose backend resolved to `backend`
/// ([`resolve_config`]), takes its input in bf16 ([`orthogonalize_many_bf16`]): bf16
/// precision on the AMX products.
pub(crate) fn takes_bf16_input(cfg: &NsConfig, backend: NsBackend) -> bool {
    cfg.precision == NsPrecision::Bf16 && backend == NsBackend::Amx
}

/// Runs `one(x, rows, cols, par)` on every task: across threads or one after another
/// ([`orthogonalize_many`]), the first error returned.
fn schedule<S: Send>(
    tasks: Vec<(&mut [S], usize, usize)>,
    cfg: &NsConfig,
    backend: NsBackend,
    one: impl Fn(&mut [S], usize, usize, Parallelism) -> Result<()> + Sync,
) -> Result<()> {
    let threads = rayon::current_num_threads();
    let across = across_threads(&tasks, backend, threads);
    let (mut spread, large): (Vec<_>, Vec<_>) = tasks.into_iter().partition(|t| across(t.1, t.2));
    // Largest first, so that the last matrix claimed is a small one (list scheduling); each
    // cost once (it walks the restart schedule and the symmetric recursion).
    spread.sort_by_cached_key(|t| std::cmp::Reverse(ns_macs(t.1, t.2, cfg)));
    let failed = std::sync::Mutex::new(None);
    share(spread, threads - 1, |(x, rows, cols)| {
        if let Err(e) = one(x, rows, cols, Parallelism::None) {
            failed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(e);
        }
    });
    if let Some(e) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    let all = Parallelism::Rayon(threads);
    large
        .into_iter()
        .try_for_each(|(x, rows, cols)| one(x, rows, cols, all))
}

/// Bytes of Newton–Schulz's working buffers for a `rows × cols` matrix (`s ≤ l` its sides):
/// the `s × l` working copy and the next `X`, and four `s × s` matrices (Gram's `R`, `Q`, `M`
/// and a product; the standard iteration needs two).
pub fn ns_working_bytes(rows: usize, cols: usize) -> usize {
    let (s, l) = (rows.min(cols), rows.max(cols));
    let elems = (s.saturating_mul(l).saturating_mul(2))
        .saturating_add(s.saturating_mul(s).saturating_mul(4));
    elems.saturating_mul(std::mem::size_of::<f32>())
}

/// How many matrices whose working buffers fit in [`RETAIN_BYTES`] per rayon thread make
/// [`orthogonalize_many`] run them one per thread. Below this the largest-first queue leaves
/// threads idle at its end; above it each single-threaded product runs without gemm's
/// per-block thread joins: Muon on the 28 matrices of the d = 1024 Llama stack on 2 threads
/// took 0.78× the time of threaded products (median; 0.73–0.81 over five alternating steps,
/// AVX2 Zen 2; 0.82× without the largest-first order). On the AMX products (bf16) likewise:
/// medians of six alternating runs (both orders, 10–12 steps each) 0.83–0.98× the time, best
/// step 1.07–1.32 s against 1.12–1.55 (AMX Xeon, session 27).
pub const ACROSS_MIN_PER_THREAD: usize = 2;

/// Whether a `rows × cols` matrix of `tasks` runs on one thread ([`orthogonalize_many`]).
fn across_threads<S>(
    tasks: &[(&mut [S], usize, usize)],
    backend: NsBackend,
    threads: usize,
) -> impl Fn(usize, usize) -> bool {
    let fits = |rows: usize, cols: usize| ns_working_bytes(rows, cols) <= RETAIN_BYTES;
    let fitting = tasks.iter().filter(|t| fits(t.1, t.2)).count();
    let many = fitting >= ACROSS_MIN_PER_THREAD * threads;
    move |rows, cols| match backend {
        NsBackend::Reference => true,
        NsBackend::Gemm => fits(rows, cols) && (rows.min(cols) < BATCH_INNER_MIN_SIDE || many),
        NsBackend::Amx => fits(rows, cols) && many,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_matrix_per_thread_only_for_many_matrices_with_bounded_buffers() {
        // The d = 1024 Llama stack's matrices (46 MB at most for 1024×3584) go one per thread
        // when there are two per thread (gemm and AMX); a 4096² one (403 MB of buffers) never
        // does, nor does anything on the oneDNN backend; on gemm a short side under 256 does
        // while its buffers fit (255 × 4096: 8.6 MB, not 255 × 131 072: 268 MB).
        // `across_threads` reads only the shapes, so the matrices can be empty slices.
        let tasks = |shapes: &[(usize, usize)]| -> Vec<(&mut [f32], usize, usize)> {
            shapes.iter().map(|&(r, c)| (&mut [][..], r, c)).collect()
        };
        let stack = [(1024, 1024), (256, 1024), (3584, 1024), (1024, 3584)];
        let across = across_threads(&tasks(&stack), NsBackend::Gemm, 2);
        assert!(stack.iter().all(|&(r, c)| across(r, c)));
        let across = across_threads(&tasks(&stack), NsBackend::Gemm, 3);
        assert!(!across(1024, 3584) && across(255, 4096) && !across(255, 1 << 17));
        assert!(!across_threads(
            &tasks(&[(4096, 4096); 8]),
            NsBackend::Gemm,
            2
        )(4096, 4096));
        assert!(!across_threads(&tasks(&stack), NsBackend::OneDnn, 2)(
            256, 1024
        ));
        // AMX: the stack one per thread; a short side under 256 only when there are many.
        let across = across_threads(&tasks(&stack), NsBackend::Amx, 2);
        assert!(stack.iter().all(|&(r, c)| across(r, c)));
        assert!(!across_threads(&tasks(&stack), NsBackend::Amx, 3)(
            255, 4096
        ));
    }

    /// bf16 input gives the bits of the `f32` input it rounds from, the result left in bf16:
    /// wide, tall and edge shapes (one per thread and threaded products), a zero matrix, one
    /// holding a NaN; and bf16 input is refused where it is not taken.
    #[test]
    fn bf16_input_gives_the_bits_of_the_f32_input() {
        let cfg = NsConfig {
            precision: NsPrecision::Bf16,
            ..NsConfig::default()
        };
        if let Err(e) = amx_bf16::amx() {
            eprintln!("bf16_input_gives_the_bits_of_the_f32_input: skipped ({e})");
            assert!(orthogonalize_many_bf16(vec![(&mut [bf16::ONE][..], 1, 1)], &cfg).is_err());
            return;
        }
        let shapes = [
            (64, 96),
            (96, 64),
            (33, 47),
            (100, 70),
            (3, 3),
            (8, 8),
            (40, 160),
        ];
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut f32s: Vec<Vec<f32>> = shapes
            .iter()
            .map(|&(r, c)| {
                (0..r * c)
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        (seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
                    })
                    .collect()
            })
            .collect();
        f32s[5].fill(0.0);
        f32s[4][4] = f32::NAN;
        let mut bf16s: Vec<Vec<bf16>> = f32s
            .iter()
            .map(|v| v.iter().map(|&x| bf16::from_f32(x)).collect())
            .collect();
        let tasks32: Vec<(&mut [f32], usize, usize)> = f32s
            .iter_mut()
            .zip(shapes)
            .map(|(x, (r, c))| (&mut x[..], r, c))
            .collect();
        orthogonalize_many(tasks32, &cfg).unwrap();
        let tasks16: Vec<(&mut [bf16], usize, usize)> = bf16s
            .iter_mut()
            .zip(shapes)
            .map(|(x, (r, c))| (&mut x[..], r, c))
            .collect();
        orthogonalize_many_bf16(tasks16, &cfg).unwrap();
        for ((want, got), shape) in f32s.iter().zip(&bf16s).zip(shapes) {
            let widened: Vec<u32> = got.iter().map(|v| v.to_f32().to_bits()).collect();
            let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
            assert_eq!(widened, want, "{shape:?}");
        }
        assert!(bf16s[4].iter().all(|v| v.is_nan()) && bf16s[5].iter().all(|v| v.to_f32() == 0.0));
        // One matrix alone: its products threaded.
        let (mut x32, mut x16) = (f32s[3].clone(), bf16s[3].clone());
        orthogonalize_many(vec![(&mut x32[..], 100, 70)], &cfg).unwrap();
        orthogonalize_many_bf16(vec![(&mut x16[..], 100, 70)], &cfg).unwrap();
        assert!(x16
            .iter()
            .zip(&x32)
            .all(|(a, b)| a.to_f32().to_bits() == b.to_bits()));
        // Not taken: f32 precision, or a backend other than AMX.
        let mut one = [bf16::ONE];
        for other in [
            NsConfig::default(),
            NsConfig {
                backend: NsBackend::Gemm,
                ..cfg.clone()
            },
        ] {
            assert!(orthogonalize_many_bf16(vec![(&mut one[..], 1, 1)], &other).is_err());
        }
    }

    /// Bytes of the working copy this thread keeps.
    fn kept_bytes() -> usize {
        let v = XW.take();
        let bytes = v.capacity() * std::mem::size_of::<f32>();
        XW.set(v);
        bytes
    }

    #[test]
    fn working_copies_are_kept_for_small_matrices_and_freed_for_large_ones() {
        let cfg = NsConfig {
            steps: 1,
            backend: NsBackend::Gemm,
            ..NsConfig::default()
        };
        let run = |rows: usize, cols: usize| {
            let mut x: Vec<f32> = (0..rows * cols).map(|i| (i % 7) as f32 - 3.0).collect();
            ns_one(&mut x, rows, cols, &cfg, NsBackend::Gemm, Parallelism::None).unwrap();
            assert!(x.iter().all(|v| v.is_finite()));
        };
        run(64, 96);
        assert!(kept_bytes() >= 64 * 96 * 4, "a small working copy is kept");
        // One row: the products are 1×1, the working copy just over the budget.
        run(1, RETAIN_BYTES / 4 + 64);
        assert_eq!(kept_bytes(), 0, "a working copy over RETAIN_BYTES is freed");
        run(64, 96);
        assert!(kept_bytes() >= 64 * 96 * 4);
    }
}
