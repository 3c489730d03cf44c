//! 8-bit Adam's row-block step in AVX-512 lanes (F, BW, VBMI): the same operations as the
//! portable [`crate::adam8bit`] kernel, 16 elements per vector, bit for bit.
//!
//! # Where the time went, and this kernel's answer
//! Profiled with `perf` (`examples/adam8bit_steps.rs`, one thread, AVX-512 EPYC): the step's
//! IEEE divisions and square roots are cheap next to **table gathers**. A 16-lane
//! `vpgatherdd` costs ~7 ns here even from L1, while a 64-lane lookup in a 256-byte table held
//! in registers (two `vpermi2b` and a blend) costs ~1 ns; replacing every division and square
//! root of the step by a multiplication saves only ~10 %. So this kernel has no gathers:
//!
//! 1. **dequantizes with byte permutes**: a 256-entry `f32` map is four 256-byte planes (byte
//!    `k` of every entry), each four 64-byte registers. `vpermi2b` looks up 64 codes in two
//!    registers (7 index bits) and a blend on the code's top bit picks the half: six
//!    instructions per plane for 64 codes. The codes are first permuted once (`vpermb`) so
//!    that interleaving the four planes (`vpunpck{l,h}bw`, `vpunpck{l,h}wd`, which work within
//!    128-bit lanes) leaves the `f32`s in element order;
//! 2. steps the moments and the parameters in 16 `f32` lanes, each lane the scalar operations
//!    of [`crate::common`] in the scalar order (intrinsics are never contracted into FMAs);
//! 3. folds `|m|` and `v` into 16-lane running maxima (`vmaxps` is the scalar `>` select);
//! 4. **requantizes with byte permutes** (`quantize_64`, 64 lanes): the nearest-code index
//!    of [`crate::kernels::octave_index`] has at most 512 buckets, one threshold at most in
//!    each, so a bucket's base code is one 512-byte lookup and its threshold one lookup in the
//!    thresholds' byte planes; then the second-moment floor in lanes.
//!
//! Single-threaded on `square 1024`, the gathers' replacement took the step from 1.84–1.95
//! to 1.39–1.40 ns per element (interleaved runs of the two builds).
//!
//! On an AVX-512 Xeon (Emerald Rapids, 2.7 GHz under AVX-512) the same build took 2.03 ns
//! per element: there a 16-lane `vdivps` occupies the divider ~9.5 cycles and `vsqrtps`
//! ~11, so the two divisions of the torch-form update and the two of the requantization
//! cost ~1 ns per element alone. The update is now bitsandbytes' folded form (one square
//! root, one division: [`crate::common::apply_folded_adam_elem`]), the requantization
//! multiplies by the block scale's reciprocal ([`Unscale`]), and the block maxima fold in a
//! `vmaxps` tree: 1.62–1.66 ns per element there (3 interleaved pairs,
//! `RAYON_NUM_THREADS=1 adam8bit_steps 1024 400 avx512`). What remains is port 5: the byte
//! permutes, unpacks, mask compares and half of the `f32` arithmetic all issue there
//! (`llvm-mca -mcpu=icelake-server` on the loop: ~150 of ~210 cycles per 64 elements).

use std::arch::x86_64::*;

use crate::adam8bit::{RowBlock, StepConsts, SCALE_BLOCK};
use crate::kernels::octave_index::{OctaveIndex, BUCKETS};
use crate::quant::{
    decode_scale, encode_scale, Unscale, MAP_LEN, SIGNED_ZERO_CODE, UNSIGNED_ZERO_CODE,
};

/// A 256-entry `f32` map as four byte planes: `planes[k][c]` is byte `k` (little-endian) of
/// `map[c]`, the layout the byte-permute lookups read 64 bytes at a time.
#[derive(Clone, PartialEq)]
pub(crate) struct BytePlanes {
    planes: [[u8; MAP_LEN]; 4],
}

impl std::fmt::Debug for BytePlanes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BytePlanes")
    }
}

impl BytePlanes {
    /// The planes of `map`.
    pub(crate) fn of(map: &[f32; MAP_LEN]) -> Self {
        let mut planes = [[0u8; MAP_LEN]; 4];
        for (c, x) in map.iter().enumerate() {
            for (k, byte) in x.to_le_bytes().into_iter().enumerate() {
                planes[k][c] = byte;
            }
        }
        BytePlanes { planes }
    }
}

/// Whether this CPU runs `row_block`: AVX-512 F and BW, and VBMI's byte permutes.
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vbmi")
}

/// A map's [`OctaveIndex`], with its thresholds as byte planes for [`quantize_64`].
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct LaneIndex {
    index: OctaveIndex,
    thresholds: BytePlanes,
}

impl LaneIndex {
    /// `index` (a map's [`OctaveIndex`]) with its thresholds as byte planes.
    pub(crate) fn of(index: OctaveIndex) -> Self {
        let thresholds = BytePlanes::of(&index.thresholds);
        LaneIndex { index, thresholds }
    }
}

/// Both moments' lookup tables for one kernel call.
pub(crate) struct Tables<'a> {
    pub planes: [&'a BytePlanes; 2],
    pub index: [&'a LaneIndex; 2],
}

/// The `vpermb` index that puts code `16q + 4L + i` at byte `16L + 4q + i` (`q`, `L`, `i` in
/// `0..4`): after the in-lane interleaving of [`dequantize_64`], output vector `q` then holds
/// elements `16q..16q + 16` in order.
#[inline(always)]
unsafe fn plane_order() -> __m512i {
    let mut idx = [0u8; 64];
    for q in 0..4 {
        for lane in 0..4 {
            for i in 0..4 {
                idx[16 * lane + 4 * q + i] = (16 * q + 4 * lane + i) as u8;
            }
        }
    }
    // SAFETY: 64 bytes are read from a 64-byte array.
    unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
}

/// Byte `k` of the map entry of each of 64 (permuted) codes: two `vpermi2b` over the plane's
/// lower and upper 128 entries, the code's top bit choosing.
#[inline(always)]
unsafe fn plane_lookup(plane: &[u8; MAP_LEN], codes: __m512i, upper: __mmask64) -> __m512i {
    // SAFETY: four 64-byte loads inside the 256-byte plane.
    unsafe {
        let t = |j: usize| _mm512_loadu_si512(plane.as_ptr().add(64 * j).cast());
        let lo = _mm512_permutex2var_epi8(t(0), codes, t(1));
        let hi = _mm512_permutex2var_epi8(t(2), codes, t(3));
        _mm512_mask_blend_epi8(upper, lo, hi)
    }
}

/// `map[codes[j]]` for 64 codes (a code vector in element order), as four vectors of 16
/// `f32`s in element order.
#[inline(always)]
unsafe fn map_64(codes: __m512i, planes: &BytePlanes, order: __m512i) -> [__m512; 4] {
    // SAFETY: register operations and in-bounds plane loads ([`plane_lookup`]).
    unsafe {
        let c = _mm512_permutexvar_epi8(order, codes);
        let upper = _mm512_movepi8_mask(c);
        let b = |k: usize| plane_lookup(&planes.planes[k], c, upper);
        let (b0, b1, b2, b3) = (b(0), b(1), b(2), b(3));
        let lo01 = _mm512_unpacklo_epi8(b0, b1);
        let hi01 = _mm512_unpackhi_epi8(b0, b1);
        let lo23 = _mm512_unpacklo_epi8(b2, b3);
        let hi23 = _mm512_unpackhi_epi8(b2, b3);
        let f = _mm512_castsi512_ps;
        [
            f(_mm512_unpacklo_epi16(lo01, lo23)),
            f(_mm512_unpackhi_epi16(lo01, lo23)),
            f(_mm512_unpacklo_epi16(hi01, hi23)),
            f(_mm512_unpackhi_epi16(hi01, hi23)),
        ]
    }
}

/// `map[codes[j]] · absmax` for 64 codes (a code vector in element order), as four vectors
/// of 16 `f32`s in element order: the same `f32` multiplication as
/// [`crate::quant::dequantize`].
#[inline(always)]
unsafe fn dequantize_64(
    codes: __m512i,
    planes: &BytePlanes,
    order: __m512i,
    absmax: __m512,
) -> [__m512; 4] {
    // SAFETY: as [`map_64`].
    unsafe {
        let [a, b, c, d] = map_64(codes, planes, order);
        let mul = |x| _mm512_mul_ps(x, absmax);
        [mul(a), mul(b), mul(c), mul(d)]
    }
}

/// Byte `table[i]` of a 512-entry table for 64 bucket indices `i`: bits 0–7 in the bytes of
/// `idx`, bit 8 in `high`. Four `vpermi2b` (bits 0–6 within a 128-entry quarter) and three
/// blends (bit 7, then bit 8).
#[inline(always)]
unsafe fn lookup_512(table: &[u8; BUCKETS], idx: __m512i, high: __mmask64) -> __m512i {
    // SAFETY: eight 64-byte loads inside the 512-byte table.
    unsafe {
        let t = |j: usize| _mm512_loadu_si512(table.as_ptr().add(64 * j).cast());
        let bit7 = _mm512_movepi8_mask(idx);
        let q0 = _mm512_permutex2var_epi8(t(0), idx, t(1));
        let q1 = _mm512_permutex2var_epi8(t(2), idx, t(3));
        let q2 = _mm512_permutex2var_epi8(t(4), idx, t(5));
        let q3 = _mm512_permutex2var_epi8(t(6), idx, t(7));
        let low = _mm512_mask_blend_epi8(bit7, q0, q1);
        let up = _mm512_mask_blend_epi8(bit7, q2, q3);
        _mm512_mask_blend_epi8(high, low, up)
    }
}

/// The word index that picks the high 16 bits of each of 32 `f32` lanes (16 from each of two
/// vectors) in lane order, for `vpermt2w`.
const HIGH_WORDS: [u16; 32] = {
    let mut idx = [0u16; 32];
    let mut k = 0;
    while k < 32 {
        idx[k] = 2 * k as u16 + 1;
        k += 1;
    }
    idx
};

/// The byte index that picks the low byte of each of 64 words (32 from each of two vectors)
/// in lane order, for `vpermt2b`: the 64 bucket indices in one permute, where two
/// word-to-byte narrowings (`vpmovwb`, two operations each) and an insert took 2 % longer per
/// step (1.5–2.0 %, three in-process alternations of 300 step pairs on `square 512`).
const LOW_BYTES: [u8; 64] = {
    let mut idx = [0u8; 64];
    let mut k = 0;
    while k < 64 {
        idx[k] = 2 * k as u8;
        k += 1;
    }
    idx
};

/// [`OctaveIndex::code`] of 64 lanes `x` (four vectors in element order), as 64 code bytes
/// in element order. The bucket depends on the top 16 bits of each lane only, so those are
/// packed into two vectors of 32 words, where the octave slot, its shift and offset (two
/// `vpermw` from the 32-word slot tables) and the bucket take one instruction per 32 lanes;
/// the buckets' low bytes gather into one vector ([`LOW_BYTES`]), bit 8 into a mask; then the
/// bucket's `base` comes from the 512-byte table ([`lookup_512`]), `T_base` from the
/// thresholds' byte planes ([`map_64`]), and the code is `base + [x ≥ T_base]`, 0 for NaN.
/// The same integer and comparison steps as the scalar code, so the same codes.
///
/// `SIGNED`: `ix` is a signed map's (negative `x` have their own buckets).
#[inline(always)]
unsafe fn quantize_64<const SIGNED: bool>(
    x: &[__m512; 4],
    ix: &LaneIndex,
    order: __m512i,
) -> __m512i {
    let o = &ix.index;
    debug_assert_eq!(o.signed, SIGNED);
    // SAFETY: 64-byte loads of the 32-word tables; [`lookup_512`] and [`map_64`] read inside
    // their tables; the rest are register operations.
    unsafe {
        let ld = |p: *const u16| _mm512_loadu_si512(p.cast());
        let (shift, add) = (ld(o.shift.as_ptr()), ld(o.add.as_ptr().cast()));
        let high_words = ld(HIGH_WORDS.as_ptr());
        let e_base = _mm512_set1_epi16(o.e_base as i16);
        let last_slot = _mm512_set1_epi16(31);
        let abs_mask = _mm512_set1_epi16(0x7fff);
        let half = _mm512_set1_epi16(BUCKETS as i16 / 2);
        let mut buckets = [_mm512_setzero_si512(); 2];
        let mut high = 0u64;
        for (p, pair) in x.chunks_exact(2).enumerate() {
            let (a, b) = (_mm512_castps_si512(pair[0]), _mm512_castps_si512(pair[1]));
            let w = _mm512_permutex2var_epi16(a, high_words, b);
            let h = _mm512_and_si512(w, abs_mask);
            let slot = _mm512_min_epu16(
                _mm512_subs_epu16(_mm512_srli_epi16::<7>(h), e_base),
                last_slot,
            );
            let bucket = _mm512_add_epi16(
                _mm512_srlv_epi16(h, _mm512_permutexvar_epi16(slot, shift)),
                _mm512_permutexvar_epi16(slot, add),
            );
            let negative = _mm512_cmplt_epi16_mask(w, _mm512_setzero_si512());
            let bucket = if SIGNED {
                _mm512_mask_add_epi16(bucket, negative, bucket, half)
            } else {
                _mm512_maskz_mov_epi16(!negative, bucket)
            };
            buckets[p] = bucket;
            high |= u64::from(_mm512_test_epi16_mask(bucket, half)) << (32 * p);
        }
        let low_bytes = _mm512_loadu_si512(LOW_BYTES.as_ptr().cast());
        let idx = _mm512_permutex2var_epi8(buckets[0], low_bytes, buckets[1]);
        let base = lookup_512(&o.base, idx, high);
        let t = map_64(base, &ix.thresholds, order);
        let (mut at_or_above, mut ordered) = (0u64, 0u64);
        for (j, (&xj, &tj)) in x.iter().zip(&t).enumerate() {
            at_or_above |= u64::from(_mm512_cmp_ps_mask::<_CMP_GE_OQ>(xj, tj)) << (16 * j);
            ordered |= u64::from(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(xj, xj)) << (16 * j);
        }
        let code = _mm512_mask_sub_epi8(base, at_or_above, base, _mm512_set1_epi8(-1));
        _mm512_maskz_mov_epi8(ordered, code)
    }
}

/// The new moments of one scale block (at most [`SCALE_BLOCK`] elements), on the stack.
struct Fresh {
    m: [f32; SCALE_BLOCK],
    v: [f32; SCALE_BLOCK],
}

/// One row block (steps 1–7 of [`crate::adam8bit`]'s table), scale block by scale block.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VBMI ([`available`]). The row block's slices must be
/// as [`crate::adam8bit`] builds them: `p`, `g`, `mc`, `vc` of one length, a multiple of 32,
/// and one scale per started 256 elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
pub(crate) unsafe fn row_block<const DECAY: bool, const SMALL: bool>(
    mut b: RowBlock,
    k: StepConsts,
    t: &Tables,
) {
    let order = plane_order();
    let mut fresh = Fresh {
        m: [0.0; SCALE_BLOCK],
        v: [0.0; SCALE_BLOCK],
    };
    for (blk, start) in (0..b.p.len()).step_by(SCALE_BLOCK).enumerate() {
        let len = SCALE_BLOCK.min(b.p.len() - start);
        let old = [decode_scale(b.scale_m[blk]), decode_scale(b.scale_v[blk])];
        // SAFETY: `start + len ≤ p.len()` and the caller's length contract.
        let [max_m, max_v] =
            unsafe { step_block::<DECAY, SMALL>(&mut b, start, len, old, k, t, order, &mut fresh) };
        b.scale_m[blk] = encode_scale(max_m);
        b.scale_v[blk] = encode_scale(max_v);
        let scales = [decode_scale(b.scale_m[blk]), decode_scale(b.scale_v[blk])];
        // SAFETY: as above.
        unsafe { requantize_block(&mut b, start, len, scales, t, order, &fresh) };
    }
}

/// Steps 1–5 on the scale block `start..start + len` of `b`: dequantize with the `old` scales,
/// decay, moments, update; the fresh moments go to `fresh`; returns `max |m|` and `max v`.
///
/// # Safety
/// AVX-512 F/BW/VBMI; `start + len ≤ b.p.len()`, `len ≤ 256` a multiple of 32.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn step_block<const DECAY: bool, const SMALL: bool>(
    b: &mut RowBlock,
    start: usize,
    len: usize,
    [sm, sv]: [f32; 2],
    k: StepConsts,
    t: &Tables,
    order: __m512i,
    fresh: &mut Fresh,
) -> [f32; 2] {
    // SAFETY: every load and store is 16 or 64 lanes (masked to `n`) inside
    // `start..start + len` of the row block's slices, or inside `fresh` (256 lanes).
    unsafe {
        let s = |x: f32| _mm512_set1_ps(x);
        let (w, one_minus_w) = (s(k.mo.lerp_weight), s(1.0 - k.mo.lerp_weight));
        let (b2, c2) = (s(k.mo.beta2), s(k.mo.one_minus_beta2));
        let (neg_step, eps) = (s(k.s.folded_neg_step_size), s(k.s.folded_eps));
        let decay = s(k.decay);
        let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
        let (mut max_m, mut max_v) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let p = b.p.as_mut_ptr();
        for o in (0..len).step_by(64) {
            let e = start + o;
            let n = 64.min(len - o);
            let lanes: __mmask64 = if n == 64 { !0 } else { (1 << n) - 1 };
            let cm = _mm512_maskz_loadu_epi8(lanes, b.mc.as_ptr().add(e).cast());
            let cv = _mm512_maskz_loadu_epi8(lanes, b.vc.as_ptr().add(e).cast());
            let mq = dequantize_64(cm, t.planes[0], order, s(sm));
            let vq = dequantize_64(cv, t.planes[1], order, s(sv));
            for q in 0..n / 16 {
                let at = e + 16 * q;
                let g = _mm512_loadu_ps(b.g.as_ptr().add(at));
                let p0 = _mm512_loadu_ps(p.add(at));
                let p0 = if DECAY { _mm512_mul_ps(p0, decay) } else { p0 };
                let m = if SMALL {
                    _mm512_add_ps(mq[q], _mm512_mul_ps(w, _mm512_sub_ps(g, mq[q])))
                } else {
                    _mm512_sub_ps(g, _mm512_mul_ps(_mm512_sub_ps(g, mq[q]), one_minus_w))
                };
                let v = _mm512_add_ps(
                    _mm512_mul_ps(vq[q], b2),
                    _mm512_mul_ps(_mm512_mul_ps(c2, g), g),
                );
                // `apply_folded_adam_elem`: one square root and one division.
                let denom = _mm512_add_ps(_mm512_sqrt_ps(v), eps);
                let p1 = _mm512_add_ps(p0, _mm512_div_ps(_mm512_mul_ps(neg_step, m), denom));
                _mm512_storeu_ps(p.add(at), p1);
                _mm512_storeu_ps(fresh.m.as_mut_ptr().add(o + 16 * q), m);
                _mm512_storeu_ps(fresh.v.as_mut_ptr().add(o + 16 * q), v);
                // `vmaxps a, b` is `a > b ? a : b`, the portable fold's select: a NaN moment
                // never enters, and the maxima start at +0.0.
                let abs_m = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(m), abs_mask));
                max_m = _mm512_max_ps(abs_m, max_m);
                max_v = _mm512_max_ps(v, max_v);
            }
        }
        [fold_max(max_m), fold_max(max_v)]
    }
}

/// The largest of 16 lanes, none NaN and none below `+0.0` (the maxima start at `+0.0` and a
/// NaN never enters), as the portable fold `0.0f32.max(..)`: `max` is exact and the lanes
/// hold no `−0.0`, so a `vmaxps` tree gives the same bits in four steps instead of a serial
/// chain of sixteen NaN-aware scalar maxima in front of each block's requantization.
#[inline(always)]
unsafe fn fold_max(x: __m512) -> f32 {
    // SAFETY: register operations on AVX-512 F (the caller's contract).
    unsafe {
        let x = _mm512_max_ps(x, _mm512_shuffle_f32x4::<0b01_00_11_10>(x, x));
        let x = _mm512_max_ps(x, _mm512_shuffle_f32x4::<0b10_11_00_01>(x, x));
        let x = _mm512_max_ps(x, _mm512_permute_ps::<0b01_00_11_10>(x));
        let x = _mm512_max_ps(x, _mm512_permute_ps::<0b10_11_00_01>(x));
        _mm512_cvtss_f32(x)
    }
}

/// `x / s` for 64 lanes by [`Unscale`]'s rule, the portable quantizer's.
///
/// Written out lane vector by lane vector, as the rest of this kernel: a closure handed to
/// `array::map` is compiled without the kernel's target features unless `map` itself gets
/// inlined, and where it did not (one of two otherwise equal instances) every lane operation
/// became a call and the step took twice as long.
#[inline(always)]
unsafe fn unscale_64([a, b, c, d]: [__m512; 4], u: Unscale) -> [__m512; 4] {
    // SAFETY: register operations on AVX-512 F (the caller's contract).
    unsafe {
        match u {
            Unscale::Reciprocal(r) => {
                let mul = |x| _mm512_mul_ps(x, _mm512_set1_ps(r));
                [mul(a), mul(b), mul(c), mul(d)]
            }
            Unscale::Divide(s) => {
                let div = |x| _mm512_div_ps(x, _mm512_set1_ps(s));
                [div(a), div(b), div(c), div(d)]
            }
        }
    }
}

/// Steps 6–7 on the scale block `start..start + len`, 64 elements at a time: codes of
/// `fresh / scale` (the code of zero for a zero scale), then the second-moment floor. A
/// 32-element tail reads 32 more lanes of `fresh` (inside its 256) and stores only its own.
///
/// # Safety
/// AVX-512 F/BW/VBMI; `start + len ≤ b.p.len()`, `len ≤ 256` a multiple of 32.
#[inline(always)]
unsafe fn requantize_block(
    b: &mut RowBlock,
    start: usize,
    len: usize,
    [sm, sv]: [f32; 2],
    t: &Tables,
    order: __m512i,
    fresh: &Fresh,
) {
    // SAFETY: 16-lane loads from `fresh` at `q + 16j < q + 64 ≤ 256` (`q` a multiple of 64
    // below `len ≤ 256`), masked 64-byte stores inside `start..start + len` of the
    // exclusive code slices.
    unsafe {
        let (mc, vc) = (b.mc.as_mut_ptr(), b.vc.as_mut_ptr());
        for q in (0..len).step_by(64) {
            let n = 64.min(len - q);
            let lanes: __mmask64 = if n == 64 { !0 } else { (1 << n) - 1 };
            let load = |src: &[f32; SCALE_BLOCK]| -> [__m512; 4] {
                let ld = |j: usize| _mm512_loadu_ps(src.as_ptr().add(q + 16 * j));
                [ld(0), ld(1), ld(2), ld(3)]
            };
            let (m, v) = (load(&fresh.m), load(&fresh.v));
            let scaled = |x: [__m512; 4], s: f32| unscale_64(x, Unscale::of(s));
            let code_m = if sm == 0.0 {
                _mm512_set1_epi8(SIGNED_ZERO_CODE as i8)
            } else {
                quantize_64::<true>(&scaled(m, sm), t.index[0], order)
            };
            let code_v = if sv == 0.0 {
                _mm512_set1_epi8(UNSIGNED_ZERO_CODE as i8)
            } else {
                quantize_64::<false>(&scaled(v, sv), t.index[1], order)
            };
            let mut positive = 0u64;
            for (j, &vj) in v.iter().enumerate() {
                let p = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(vj, _mm512_setzero_ps());
                positive |= u64::from(p) << (16 * j);
            }
            let code_v = _mm512_mask_max_epu8(code_v, positive, code_v, _mm512_set1_epi8(1));
            _mm512_mask_storeu_epi8(mc.add(start + q).cast(), lanes, code_m);
            _mm512_mask_storeu_epi8(vc.add(start + q).cast(), lanes, code_v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dynamic_map, quantize, CodeBook};
    use rayon::prelude::*;

    /// [`quantize_64`] on `xs` (a multiple of 64 long).
    fn quantize_lanes(book: &CodeBook, xs: &[f32]) -> Vec<u8> {
        let ix = LaneIndex::of(OctaveIndex::new(&book.thresholds()).expect("the maps fit"));
        let mut out = vec![0u8; xs.len()];
        // SAFETY: callers run this only where `available()`.
        unsafe { quantize_all(&ix, xs, &mut out) };
        out
    }

    /// 64 lanes at a time, compiled for AVX-512 so that the lanes inline.
    ///
    /// # Safety
    /// AVX-512 F/BW/VBMI; `xs` and `out` of one length, a multiple of 64.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn quantize_all(ix: &LaneIndex, xs: &[f32], out: &mut [u8]) {
        let order = plane_order();
        for (x, o) in xs.chunks_exact(64).zip(out.chunks_exact_mut(64)) {
            // SAFETY: 64 lanes in, 64 bytes out.
            unsafe {
                let lanes = std::array::from_fn(|j| _mm512_loadu_ps(x.as_ptr().add(16 * j)));
                let codes = if ix.index.signed {
                    quantize_64::<true>(&lanes, ix, order)
                } else {
                    quantize_64::<false>(&lanes, ix, order)
                };
                _mm512_storeu_si512(o.as_mut_ptr().cast(), codes);
            }
        }
    }

    /// The 64-lane quantizer against bisection on every `f32` whose top 16 bits are in
    /// `his` (both maps).
    fn agrees_on(his: impl ParallelIterator<Item = u32>) -> Option<u32> {
        let books = [true, false].map(|s| CodeBook::new(dynamic_map(s)).unwrap());
        his.find_any(|&hi| {
            let xs: Vec<f32> = (0..=0xffffu32)
                .map(|lo| f32::from_bits(hi << 16 | lo))
                .collect();
            books.iter().any(|book| {
                let codes = quantize_lanes(book, &xs);
                xs.iter()
                    .zip(&codes)
                    .any(|(&x, &c)| c != quantize(x, book.map()))
            })
        })
    }

    /// A sample of bit patterns (every 251st block of 65 536, both signs: zeros, subnormals,
    /// the map's range, infinities and NaNs among them) in CI.
    #[test]
    fn lane_quantizer_equals_bisection_on_a_sample_of_f32_bit_patterns() {
        if !available() {
            println!("skipped: this CPU has no AVX-512 F/BW/VBMI");
            return;
        }
        let his: Vec<u32> = (0..=0xffffu32)
            .step_by(251)
            .chain([0x0000, 0x8000, 0x3f80, 0xbf80, 0x7f80, 0xff80, 0x7fc0])
            .collect();
        assert_eq!(agrees_on(his.into_par_iter()), None);
    }

    /// Every one of the 2^32 bit patterns; by hand after an index change:
    /// `cargo test -p ragged-optimizers --lib lane_quantizer -- --ignored`.
    #[test]
    #[ignore = "2^32 inputs × 2 maps: run by hand after changing the index"]
    fn lane_quantizer_equals_bisection_on_every_f32() {
        if !available() {
            println!("skipped: this CPU has no AVX-512 F/BW/VBMI");
            return;
        }
        assert_eq!(agrees_on((0..=0xffffu32).into_par_iter()), None);
    }
}
