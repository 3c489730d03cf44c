//! Numerics shared by the optimizers of this crate: the pieces AdamW is composed of, which
//! Muon (momentum, decoupled decay), 8-bit Adam (moments, bias corrections, the Adam update)
//! and Shampoo (grafting) reuse.
//!
//! Every piece is a small function over plain `f32` slices, with an element-wise twin
//! (`*_elem`) that the fused kernels call, so a fused loop and the chain of slice functions
//! compute the same operations in the same order and agree bitwise.
//!
//! # Where the scalars are computed
//! PyTorch keeps hyperparameters as Python floats (`f64`), does all scalar arithmetic
//! (`1 − lr·wd`, `1 − β₁`, `1 − β^t`, `lr / bc₁`, `√bc₂`) in `f64`, and rounds each scalar to
//! `f32` once, where it meets an `f32` tensor. The constructors here ([`decay_factor`],
//! [`MomentCoeffs::new`], [`AdamScale::new`]) do the same: `f64` in, one `f32` rounding out.
//! Everything that touches a tensor element is `f32`, one IEEE operation at a time (no fused
//! multiply-add), so results do not depend on the machine, on vector width or on threading.
//!
//! # Slice preconditions
//! The slice functions are numerics kernels: all slices of one call must have the same length;
//! a mismatch is a bug in the caller and panics (`# Panics`). Optimizers validate user input
//! ([`check_len`], [`LocalShard::check`](ragged::optim::LocalShard::check)) and return `Err` before calling them.

use ragged::optim::LocalShard;
use ragged::{Error, Result};

// ---------------------------------------------------------------------------------------------
// Bias corrections and learning-rate scale (f64 scalars)
// ---------------------------------------------------------------------------------------------

/// Bias correction of an exponential moving average after `step` updates:
/// `bc = 1 − β^t`, in `f64` (`f64::powf`, the C `pow` Python's `beta ** step` calls).
///
/// With `m₀ = 0`, `E[m_t] = (1 − β^t)·E[g]`, so `m_t / bc` is unbiased (Adam paper, §3).
/// `step` is the count *after* the increment (`t ≥ 1`); `t = 0` gives `0`.
pub fn bias_correction(beta: f64, step: u64) -> f64 {
    1.0 - beta.powf(step as f64)
}

/// Adam's learning-rate scale: `step_size = lr / bc₁`, in `f64` (torch: `lr / bias_correction1`).
///
/// It folds the first-moment bias correction into the learning rate, so `m` itself is never
/// divided by `bc₁`.
pub fn adam_step_size(lr: f64, bc1: f64) -> f64 {
    lr / bc1
}

// ---------------------------------------------------------------------------------------------
// Decoupled weight decay
// ---------------------------------------------------------------------------------------------

/// The decoupled weight-decay factor `1 − lr·wd`: computed in `f64`, rounded once to `f32`
/// (torch: `param.mul_(1 - lr * weight_decay)`). It uses the optimizer's *unadjusted* `lr`.
pub fn decay_factor(lr: f64, weight_decay: f64) -> f32 {
    (1.0 - lr * weight_decay) as f32
}

/// One element of [`decay`]: `p · factor`.
#[inline(always)]
pub fn decay_elem(p: f32, factor: f32) -> f32 {
    p * factor
}

/// Decoupled weight decay (Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
/// ICLR 2019): `p ← p · factor`, with `factor` from [`decay_factor`]. Applied to the
/// parameters, never folded into the gradient (that would be L2 regularisation, which Adam's
/// denominator rescales).
pub fn decay(params: &mut [f32], factor: f32) {
    for p in params.iter_mut() {
        *p = decay_elem(*p, factor);
    }
}

// ---------------------------------------------------------------------------------------------
// Moments
// ---------------------------------------------------------------------------------------------

/// Whether torch's `lerp` takes its small-weight branch: `|w| < 0.5`.
#[inline(always)]
pub fn lerp_weight_is_small(weight: f32) -> bool {
    weight.abs() < 0.5
}

/// torch's `lerp` for `|w| < 0.5`: `start + w·(end − start)`, three roundings, no FMA.
#[inline(always)]
pub fn lerp_small_elem(start: f32, end: f32, weight: f32) -> f32 {
    start + weight * (end - start)
}

/// torch's `lerp` for `|w| ≥ 0.5`: `end − (end − start)·(1 − w)`, four roundings, no FMA
/// (exact at `w = 1`).
#[inline(always)]
pub fn lerp_large_elem(start: f32, end: f32, weight: f32) -> f32 {
    end - (end - start) * (1.0 - weight)
}

/// torch's scalar `lerp(start, end, w)` (`aten/src/ATen/native/Lerp.h`): the small-weight
/// form when `|w| < 0.5`, the large-weight form otherwise.
///
/// torch's own AVX2/AVX-512 CPU kernel evaluates the same two forms with a fused
/// multiply-add (`vec::fmadd`), and nvcc contracts the CUDA kernel into an FMA; this function
/// does not fuse, so it can differ from those kernels by one rounding (≤ 1 ulp of `m`).
#[inline(always)]
pub fn lerp_elem(start: f32, end: f32, weight: f32) -> f32 {
    if lerp_weight_is_small(weight) {
        lerp_small_elem(start, end, weight)
    } else {
        lerp_large_elem(start, end, weight)
    }
}

/// First moment, torch's `exp_avg.lerp_(grad, 1 − β₁)`: `m ← lerp(m, g, w)` with
/// `w = 1 − β₁`, which for `β₁ > 0.5` is `m ← m + (g − m)·(1 − β₁)` (see [`lerp_elem`]).
/// Mathematically `β₁·m + (1 − β₁)·g`; the rounding differs, and this is torch's.
///
/// # Panics
/// If `m` and `g` differ in length.
#[track_caller]
pub fn ema_lerp(m: &mut [f32], g: &[f32], weight: f32) {
    assert_eq!(m.len(), g.len(), "ema_lerp: m and g differ in length");
    if lerp_weight_is_small(weight) {
        for (m, &g) in m.iter_mut().zip(g) {
            *m = lerp_small_elem(*m, g, weight);
        }
    } else {
        for (m, &g) in m.iter_mut().zip(g) {
            *m = lerp_large_elem(*m, g, weight);
        }
    }
}

/// One element of [`ema_sq`]: `v·β₂ + ((1 − β₂)·g)·g`.
#[inline(always)]
pub fn ema_sq_elem(v: f32, g: f32, beta2: f32, one_minus_beta2: f32) -> f32 {
    v * beta2 + one_minus_beta2 * g * g
}

/// Second moment, torch's `exp_avg_sq.mul_(β₂).addcmul_(grad, grad, value=1 − β₂)`:
/// `v ← v·β₂ + ((1 − β₂)·g)·g`. Four roundings in this order: `v·β₂` (the `mul_`), then
/// torch's CPU `addcmul` evaluates `self + value·t1·t2` left to right.
///
/// # Panics
/// If `v` and `g` differ in length.
#[track_caller]
pub fn ema_sq(v: &mut [f32], g: &[f32], beta2: f32, one_minus_beta2: f32) {
    assert_eq!(v.len(), g.len(), "ema_sq: v and g differ in length");
    for (v, &g) in v.iter_mut().zip(g) {
        *v = ema_sq_elem(*v, g, beta2, one_minus_beta2);
    }
}

/// The `f32` coefficients of Adam's moment updates, each computed in `f64` and rounded once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MomentCoeffs {
    /// `1 − β₁`: the `lerp` weight of the first moment.
    pub lerp_weight: f32,
    /// `β₂`: the decay of the second moment.
    pub beta2: f32,
    /// `1 − β₂`: the weight of `g²` in the second moment.
    pub one_minus_beta2: f32,
}

impl MomentCoeffs {
    /// Coefficients for `(β₁, β₂)`: `1 − β₁` and `1 − β₂` are taken in `f64`, then rounded.
    pub fn new(beta1: f64, beta2: f64) -> Self {
        MomentCoeffs {
            lerp_weight: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
        }
    }
}

/// Both Adam moments in one pass: [`ema_lerp`] on `m`, then [`ema_sq`] on `v`.
///
/// # Panics
/// If `m`, `v` and `g` differ in length.
#[track_caller]
pub fn update_moments(m: &mut [f32], v: &mut [f32], g: &[f32], c: &MomentCoeffs) {
    ema_lerp(m, g, c.lerp_weight);
    ema_sq(v, g, c.beta2, c.one_minus_beta2);
}

// ---------------------------------------------------------------------------------------------
// The Adam update
// ---------------------------------------------------------------------------------------------

/// The `f32` scalars of one Adam update at step `t`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamScale {
    /// `−lr / bc₁` ([`adam_step_size`], negated in `f64`, then rounded): torch's
    /// `addcdiv_` `value=-step_size`.
    pub neg_step_size: f32,
    /// `√bc₂ = √(1 − β₂^t)`, in `f64` (`bc₂ ** 0.5` in torch, here `powf(0.5)`), rounded.
    pub bc2_sqrt: f32,
    /// `ε`, added *outside* the square root, after the bias correction.
    pub eps: f32,
    /// `−lr·√bc₂ / bc₁` (in `f64`, rounded): the step size of the folded form
    /// ([`apply_folded_adam_elem`]).
    pub folded_neg_step_size: f32,
    /// `ε·√bc₂` (in `f64`, rounded): `ε` of the folded form.
    pub folded_eps: f32,
}

impl AdamScale {
    /// Scalars for step `t` (the count after the increment, `t ≥ 1`).
    pub fn new(lr: f64, beta1: f64, beta2: f64, eps: f64, step: u64) -> Self {
        let bc1 = bias_correction(beta1, step);
        let bc2 = bias_correction(beta2, step);
        let bc2_sqrt = bc2.powf(0.5);
        AdamScale {
            neg_step_size: (-adam_step_size(lr, bc1)) as f32,
            bc2_sqrt: bc2_sqrt as f32,
            eps: eps as f32,
            folded_neg_step_size: (-adam_step_size(lr, bc1) * bc2_sqrt) as f32,
            folded_eps: (eps * bc2_sqrt) as f32,
        }
    }
}

/// Adam's denominator, torch's `(exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`:
/// `denom = √v / √bc₂ + ε`. `ε` sits outside the square root and after the bias correction
/// (Adam paper, Algorithm 1: `m̂ / (√v̂ + ε)`, with `√v̂` computed as `√v / √bc₂`).
#[inline(always)]
pub fn adam_denom_elem(v: f32, bc2_sqrt: f32, eps: f32) -> f32 {
    v.sqrt() / bc2_sqrt + eps
}

/// One element of [`apply_adam`]: `p + (−step_size·m) / denom`.
#[inline(always)]
pub fn apply_adam_elem(p: f32, m: f32, v: f32, s: &AdamScale) -> f32 {
    p + s.neg_step_size * m / adam_denom_elem(v, s.bc2_sqrt, s.eps)
}

/// One element of the Adam update with `√bc₂` folded into the step size and `ε`
/// (bitsandbytes' form): `p + (−lr·√bc₂/bc₁)·m / (√v + ε·√bc₂)`, the same quantity as
/// [`apply_adam_elem`] in exact arithmetic, with one IEEE division and one square root per
/// element instead of two divisions and a square root. 8-bit Adam uses it (its state is not
/// torch's, so there is no torch bit pattern to keep); on an AVX-512 Xeon the second division
/// was a tenth of its step.
#[inline(always)]
pub fn apply_folded_adam_elem(p: f32, m: f32, v: f32, s: &AdamScale) -> f32 {
    p + s.folded_neg_step_size * m / (v.sqrt() + s.folded_eps)
}

/// The Adam step, torch's `param.addcdiv_(exp_avg, denom, value=-step_size)`:
/// `p ← p + ((−lr/bc₁)·m) / (√v/√bc₂ + ε)`. torch's CPU `addcdiv` evaluates
/// `self + value·t1 / t2` left to right, and so does this (true division, not a reciprocal).
///
/// # Panics
/// If `p`, `m` and `v` differ in length.
#[track_caller]
pub fn apply_adam(p: &mut [f32], m: &[f32], v: &[f32], s: &AdamScale) {
    assert!(
        p.len() == m.len() && p.len() == v.len(),
        "apply_adam: p, m and v differ in length ({}, {}, {})",
        p.len(),
        m.len(),
        v.len()
    );
    for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
        *p = apply_adam_elem(*p, m, v, s);
    }
}

// ---------------------------------------------------------------------------------------------
// Input checks shared by optimizers
// ---------------------------------------------------------------------------------------------

/// The smallest `ε` an Adam denominator accepts: the least positive normal `f32`. A zero (or
/// an `ε` that rounds to zero in `f32`) divides `0` by `0` wherever a gradient has been zero
/// since the start (embedding rows of unseen tokens), a silent NaN in the parameters.
pub const MIN_EPS: f64 = f32::MIN_POSITIVE as f64;

/// `Err(BadInput)` naming `op`, the value and `rules` for the first `(name, value, ok)` whose
/// rule fails (`!ok`), that is not finite, or that overflows the `f32` the kernels compute
/// with. Learning rates and their products with the weight decays are checked by
/// [`ragged::optim::check_rates`] instead (bounds tighter than `f32`'s range).
pub fn check_hyperparameters(
    op: &'static str,
    rules: &str,
    checks: &[(&str, f64, bool)],
) -> Result<()> {
    for &(name, value, ok) in checks {
        if !ok || !value.is_finite() || !(value as f32).is_finite() {
            return Err(Error::BadInput {
                op,
                what: format!("{name} = {value:?}"),
                reason: format!("{rules}; every value finite as an f32"),
            });
        }
    }
    Ok(())
}

/// An `f32` state as bytes: the `header` words (u64), then every array's `f32`s, all
/// little-endian (AdamW's and Muon's `to_le_bytes`).
pub(crate) fn f32_state_to_le_bytes(header: &[u64], arrays: &[&[f32]]) -> Vec<u8> {
    let floats: usize = arrays.iter().map(|a| a.len()).sum();
    let mut out = Vec::with_capacity(8 * header.len() + 4 * floats);
    for word in header {
        out.extend_from_slice(&word.to_le_bytes());
    }
    for x in arrays.iter().flat_map(|a| a.iter()) {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// The inverse of [`f32_state_to_le_bytes`] for `N` header words, whose `f32` count
/// `floats(header)` gives (`None` when it overflows): the header and the `f32`s, or
/// `Err(BadInput)` from `op` when the bytes are shorter than the header or not exactly that
/// many.
pub(crate) fn f32_state_from_le_bytes<const N: usize>(
    op: &'static str,
    bytes: &[u8],
    floats: impl Fn(&[u64; N]) -> Option<u64>,
) -> Result<([u64; N], Vec<f32>)> {
    let bad = |reason: String| Error::BadInput {
        op,
        what: format!("{} bytes", bytes.len()),
        reason,
    };
    if bytes.len() < 8 * N {
        return Err(bad(format!("shorter than the {}-byte header", 8 * N)));
    }
    let header: [u64; N] =
        std::array::from_fn(|k| u64::from_le_bytes(bytes[8 * k..8 * k + 8].try_into().unwrap()));
    let want = floats(&header)
        .and_then(|n| n.checked_mul(4))
        .and_then(|n| n.checked_add(8 * N as u64));
    if want != u64::try_from(bytes.len()).ok() {
        return Err(bad(format!(
            "the header {:?} announces another length",
            &header[1..]
        )));
    }
    let floats = bytes[8 * N..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    Ok((header, floats))
}

/// `Err(BadInput)` unless buffer `what` has the shard's `want` elements.
pub fn check_len(op: &'static str, what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::BadInput {
            op,
            what: what.to_string(),
            reason: format!("{got} elements, the local shard has {want}"),
        })
    }
}

/// The checks every optimizer's `step` opens with: params, grads and the two per-element
/// moment buffers cover the local shard exactly, and the shard's pieces are well formed.
pub fn check_step_inputs(
    op: &'static str,
    shard: &LocalShard,
    params: usize,
    grads: usize,
    m: usize,
    v: usize,
) -> Result<()> {
    check_step_inputs_with_v(op, shard, [params, grads, m], v, shard.len)
}

/// [`check_step_inputs`] for a state whose `v` holds `v_want` elements rather than one per
/// shard element (Muon's: only its AdamW fallback's pieces).
pub fn check_step_inputs_with_v(
    op: &'static str,
    shard: &LocalShard,
    [params, grads, m]: [usize; 3],
    v: usize,
    v_want: usize,
) -> Result<()> {
    check_len(op, "params", params, shard.len)?;
    check_len(op, "grads", grads, shard.len)?;
    check_len(op, "state.m", m, shard.len)?;
    check_len(op, "state.v", v, v_want)?;
    shard.check(op)
}

/// The next step number after `step` (1-based), or an error if the counter would overflow.
pub fn next_step(op: &'static str, step: u64) -> Result<u64> {
    step.checked_add(1).ok_or_else(|| Error::BadInput {
        op,
        what: "state.step".into(),
        reason: "step counter overflows u64".into(),
    })
}

/// The next state of the 64-bit linear congruential sequence (Knuth's MMIX constants) the
/// kernels' tests draw their inputs from.
#[cfg(test)]
pub(crate) fn lcg(x: &mut u64) -> u64 {
    *x = x
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *x
}

/// Scratch an optimizer keeps between its steps (which take `&self`): taken out for a step and
/// put back after it, so a step running at the same time on the same optimizer finds it
/// empty and makes its own. Each clone starts empty (thread ranks step clones at once), and
/// it takes no part in equality.
#[derive(Default)]
pub(crate) struct BetweenSteps<T>(std::sync::Mutex<T>);

impl<T: Default> BetweenSteps<T> {
    /// What was kept (the default when nothing was), leaving nothing.
    pub(crate) fn take(&self) -> T {
        // Taken whole and put back whole: a panic that poisoned the lock left nothing half
        // written.
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Keeps `value` for the next step.
    pub(crate) fn put(&self, value: T) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = value;
    }
}

impl<T: Default> Clone for BetweenSteps<T> {
    fn clone(&self) -> Self {
        BetweenSteps::default()
    }
}

impl<T> PartialEq for BetweenSteps<T> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl<T> std::fmt::Debug for BetweenSteps<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BetweenSteps")
    }
}
