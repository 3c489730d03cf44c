//! Dynamic 8-bit quantization maps (bitsandbytes' `create_dynamic_map`) and the nearest-code
//! quantizer: the numerics that 8-bit optimizer states share.
//!
//! Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022
//! (arXiv:2110.02861), §2; reference text: `/work/shared/reference/optimizers.md` §3.1.
//!
//! # The dynamic (tree) map, `max_exponent_bits = 7`, `total_bits = 8`
//! For each decade `i = 0..=6` (scale `10^(i−6)`) take `k` evenly spaced boundaries on
//! `[0.1, 1]` (`k = 2^i + 1` signed, `2^(i+1) + 1` unsigned) and keep the midpoints of adjacent
//! boundaries times the scale (and their negatives, if signed). Append `0` and `1.0` and sort.
//!
//! | map | entries | index 0 | zero | smallest positive | largest below 1 | index 255 |
//! |---|---|---|---|---|---|---|
//! | signed (`m`) | 127 negative, 0, 127 positive, 1 | −0.99296875 | 127 | 5.5e-7 (128) | 0.99296875 (254) | 1.0 |
//! | unsigned (`v`) | 0, 254 positive, 1 | 0 | 0 | 3.25e-7 (1) | 0.996484375 (254) | 1.0 |
//!
//! The arithmetic is torch's on the CPU, in `f32`: `torch.linspace(0.1, 1, k)` computes
//! `step = (1 − 0.1)/(k − 1)`, then `0.1 + step·j` for the first half of the points and
//! `1 − step·(k − 1 − j)` for the rest; midpoints are `(b_j + b_{j+1}) / 2`; the scale is the
//! Python float `10^(i−6)` rounded to `f32` and multiplied in `f32`. Every entry is an `f32`.
//! This is torch's *scalar* `linspace` loop; its vectorized CPU loop (`Vectorized::arange`)
//! rounds some interior boundaries differently, so bnb's map can differ from this one by an
//! ulp in some entries depending on the machine's vector width. The landmarks above agree.
//!
//! # Quantizing
//! [`quantize`] returns the code whose map value is nearest to `x` (the caller has divided by
//! the block's absmax, so `x ∈ [−1, 1]`; values outside clamp to the end codes). It finds the
//! bracketing pair `map[c] ≤ x < map[c + 1]` by bisection, then compares the two `f32`
//! distances `x − map[c]` and `map[c + 1] − x`: **a tie goes to the upper code** (as
//! torchao's bisection, "ties up"). No sign fix-up (bnb's CUDA kernel nudges a code whose sign
//! differs from `x`'s; its CPU backend, and this crate, do not). A NaN `x` gives code 0.

/// Entries of a map (8-bit codes).
pub const MAP_LEN: usize = 256;

/// Exponent bits of the dynamic map (bnb's `max_exponent_bits`): decades `10^-6 … 10^0`.
pub const MAX_EXPONENT_BITS: u32 = 7;

/// The code of `0.0` in the signed map.
pub const SIGNED_ZERO_CODE: u8 = 127;

/// The code of `0.0` in the unsigned map.
pub const UNSIGNED_ZERO_CODE: u8 = 0;

/// torch's CPU `linspace(start, end, steps)` in `f32` (symmetric halves, see the module doc).
fn linspace_f32(start: f32, end: f32, steps: usize) -> Vec<f32> {
    if steps == 1 {
        return vec![start];
    }
    let step = (end - start) / (steps - 1) as f32;
    let halfway = steps / 2;
    (0..steps)
        .map(|j| {
            if j < halfway {
                start + step * j as f32
            } else {
                end - step * (steps - j - 1) as f32
            }
        })
        .collect()
}

/// bnb's `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`, sorted ascending and
/// strictly increasing (no padding zeros are needed at these settings). See the module doc
/// for the construction and the landmarks.
pub fn dynamic_map(signed: bool) -> [f32; MAP_LEN] {
    let mut data: Vec<f32> = Vec::with_capacity(MAP_LEN);
    for i in 0..MAX_EXPONENT_BITS {
        let k = if signed {
            (1usize << i) + 1
        } else {
            (1usize << (i + 1)) + 1
        };
        let b = linspace_f32(0.1, 1.0, k);
        let scale = 10f64.powi(i as i32 - (MAX_EXPONENT_BITS as i32 - 1)) as f32;
        for w in b.windows(2) {
            let mean = (w[0] + w[1]) / 2.0;
            data.push(scale * mean);
            if signed {
                data.push(-scale * mean);
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    data.resize(MAP_LEN, 0.0);
    data.sort_by(f32::total_cmp);
    let mut out = [0.0; MAP_LEN];
    out.copy_from_slice(&data);
    out
}

/// The nearest code of `x` in `map` (sorted ascending): bisection to the bracketing pair, then
/// the nearer of the two, ties to the upper code. `x` at or beyond an end gives that end's code.
#[inline]
pub fn quantize(x: f32, map: &[f32; MAP_LEN]) -> u8 {
    if x <= map[0] {
        return 0;
    }
    if x >= map[MAP_LEN - 1] {
        return (MAP_LEN - 1) as u8;
    }
    // Invariant: map[lo] ≤ x < map[hi] (a NaN x fails every comparison and ends at lo = 0).
    let (mut lo, mut hi) = (0usize, MAP_LEN - 1);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if map[mid] <= x {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    if map[hi] - x <= x - map[lo] {
        hi as u8
    } else {
        lo as u8
    }
}

/// Mantissa bits of `|x|` that pick a bucket of [`CodeBook`]'s index (64 buckets per octave).
const BUCKET_BITS: u32 = 6;

/// The smallest biased exponent with its own buckets (2^-32); smaller `|x|` share bucket 0.
const BUCKET_MIN_EXP: u32 = 127 - 32;

/// Buckets: octaves 2^-32 … 2^0 (1.0 and above clamp before the index is used).
const BUCKETS: usize = ((128 - BUCKET_MIN_EXP) << BUCKET_BITS) as usize;

/// A map with an index that finds [`quantize`]'s code in a few steps instead of eight
/// dependent bisection steps. The result is the same function of `x`, bit for bit: the index
/// only gives a starting code `lo` with `map[lo] ≤ x` (by the bucket of `|x|`'s exponent and
/// top mantissa bits), a short scan moves `lo` up to the largest code with `map[lo] ≤ x` —
/// the `lo` bisection ends at, since the map is strictly increasing — and the final choice
/// between `lo` and `lo + 1` is [`quantize`]'s comparison.
#[derive(Clone, PartialEq)]
pub struct CodeBook {
    map: [f32; MAP_LEN],
    /// Per bucket of `|x|`: the largest code whose value is ≤ the bucket's smallest `x`
    /// (positive `x`), or ≤ minus the next bucket's smallest `|x|` (negative `x`); 0 if none.
    start_pos: Box<[u8]>,
    start_neg: Box<[u8]>,
    /// `start_pos` then `start_neg`, and 3 bytes of padding (the vector path gathers 4 bytes
    /// at each index and keeps the low one).
    starts: Box<[u8]>,
    /// The most codes any bucket's range holds: the scan from the start takes at most this
    /// many steps (2 for the dynamic maps).
    scan: usize,
}

impl std::fmt::Debug for CodeBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CodeBook")
            .field("map", &self.map)
            .finish_non_exhaustive()
    }
}

impl CodeBook {
    /// The index of `map` (sorted ascending, strictly increasing, as [`dynamic_map`]).
    pub fn new(map: [f32; MAP_LEN]) -> Self {
        // The smallest |x| of bucket b (bucket 0 also holds everything below 2^-32).
        let bucket_min = |b: usize| {
            if b == 0 {
                0.0
            } else {
                f32::from_bits(((b as u32) + (BUCKET_MIN_EXP << BUCKET_BITS)) << (23 - BUCKET_BITS))
            }
        };
        let last_at_most = |y: f32| map.iter().rposition(|&v| v <= y).unwrap_or(0) as u8;
        let start_pos: Box<[u8]> = (0..BUCKETS).map(|b| last_at_most(bucket_min(b))).collect();
        let start_neg: Box<[u8]> = (0..BUCKETS)
            .map(|b| last_at_most(-bucket_min(b + 1)))
            .collect();
        // From the start, the scan passes the codes in (min, x] (positive x) or
        // (−next min, x] (negative x): at most the codes of the bucket's closed range.
        let count = |lo: f32, hi: f32| map.iter().filter(|&&v| lo < v && v <= hi).count();
        let scan = (0..BUCKETS)
            .map(|b| {
                let (lo, hi) = (bucket_min(b), bucket_min(b + 1));
                count(lo, hi).max(count(-hi, -lo))
            })
            .max()
            .unwrap_or(0);
        let starts = start_pos
            .iter()
            .chain(start_neg.iter())
            .copied()
            .chain([0; 3])
            .collect();
        CodeBook {
            map,
            start_pos,
            start_neg,
            starts,
            scan,
        }
    }

    /// The map.
    pub fn map(&self) -> &[f32; MAP_LEN] {
        &self.map
    }

    /// [`quantize`]`(x, map)`, bit for bit, without data-dependent branches (the choices are
    /// selects, and the scan always takes `scan` steps; once `map[lo + 1] > x` it stays so).
    #[inline(always)]
    pub fn quantize(&self, x: f32) -> u8 {
        let map = &self.map;
        let inside = (x > map[0]) & (x < map[MAP_LEN - 1]);
        let top = x >= map[MAP_LEN - 1];
        // Outside the open range (or NaN) the search runs on map[0] and its result is dropped.
        let xs = if inside { x } else { map[0] };
        let bits = xs.to_bits();
        let b = ((bits & 0x7fff_ffff) >> (23 - BUCKET_BITS))
            .saturating_sub(BUCKET_MIN_EXP << BUCKET_BITS) as usize;
        let starts = if bits >> 31 == 0 {
            &self.start_pos
        } else {
            &self.start_neg
        };
        // map[lo] ≤ xs, or lo = 0; xs < map[255] keeps lo + 1 in bounds.
        let mut lo = starts[b.min(BUCKETS - 1)] as usize;
        for _ in 0..self.scan {
            lo += usize::from(map[(lo + 1).min(MAP_LEN - 1)] <= xs);
        }
        let hi = (lo + 1).min(MAP_LEN - 1);
        let code = lo + usize::from(map[hi] - xs <= xs - map[lo]);
        // `top` and `inside` exclude each other; NaN and x ≤ map[0] give 0.
        (u8::from(inside) * code as u8) | (u8::from(top) * 255)
    }

    /// [`quantize_scaled`]`(x, absmax, map, zero_code)`, bit for bit.
    #[inline(always)]
    pub fn quantize_scaled(&self, x: f32, absmax: f32, zero_code: u8) -> u8 {
        if absmax == 0.0 {
            zero_code
        } else {
            self.quantize(x / absmax)
        }
    }

    /// `out[i] = self.quantize_scaled(xs[i], absmax, zero_code)` for every `i`, bit for bit;
    /// eight at a time with AVX2 gathers where the CPU has them (the same IEEE division and
    /// comparisons per lane, so the codes are the same).
    ///
    /// # Panics
    /// If `xs` and `out` differ in length.
    #[track_caller]
    pub fn quantize_scaled_slice(&self, xs: &[f32], absmax: f32, zero_code: u8, out: &mut [u8]) {
        assert_eq!(xs.len(), out.len(), "quantize_scaled_slice: lengths differ");
        if absmax == 0.0 {
            out.fill(zero_code);
            return;
        }
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present; the function reads `xs` and writes `out` in bounds.
            done = unsafe { self.quantize_div_avx2(xs, absmax, out) };
        }
        for (c, &x) in out[done..].iter_mut().zip(&xs[done..]) {
            *c = self.quantize(x / absmax);
        }
    }

    /// The AVX2 body of [`CodeBook::quantize_scaled_slice`] for the first `8·⌊n/8⌋`
    /// elements; returns how many it did. Lane by lane it is [`CodeBook::quantize`] of
    /// `x / absmax`: ordered comparisons (false on NaN) and the same subtractions.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn quantize_div_avx2(&self, xs: &[f32], absmax: f32, out: &mut [u8]) -> usize {
        use std::arch::x86_64::*;
        let n8 = xs.len() / 8 * 8;
        let map = self.map.as_ptr();
        let starts = self.starts.as_ptr() as *const i32;
        let first = _mm256_set1_ps(self.map[0]);
        let last = _mm256_set1_ps(self.map[MAP_LEN - 1]);
        let am = _mm256_set1_ps(absmax);
        let one = _mm256_set1_epi32(1);
        let top_code = _mm256_set1_epi32((MAP_LEN - 1) as i32);
        let base = _mm256_set1_epi32((BUCKET_MIN_EXP << BUCKET_BITS) as i32);
        let max_bucket = _mm256_set1_epi32(BUCKETS as i32 - 1);
        let neg_offset = _mm256_set1_epi32(BUCKETS as i32);
        let abs_mask = _mm256_set1_epi32(0x7fff_ffff);
        let byte = _mm256_set1_epi32(0xff);
        let mut codes = [0i32; 8];
        for i in (0..n8).step_by(8) {
            let x = _mm256_div_ps(_mm256_loadu_ps(xs.as_ptr().add(i)), am);
            let inside = _mm256_and_ps(
                _mm256_cmp_ps::<_CMP_GT_OQ>(x, first),
                _mm256_cmp_ps::<_CMP_LT_OQ>(x, last),
            );
            let top = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(x, last));
            let xs8 = _mm256_blendv_ps(first, x, inside);
            let bits = _mm256_castps_si256(xs8);
            let mag =
                _mm256_srli_epi32::<{ 23 - BUCKET_BITS as i32 }>(_mm256_and_si256(bits, abs_mask));
            let b = _mm256_min_epi32(
                _mm256_max_epi32(_mm256_sub_epi32(mag, base), _mm256_setzero_si256()),
                max_bucket,
            );
            let idx = _mm256_add_epi32(
                b,
                _mm256_and_si256(_mm256_srai_epi32::<31>(bits), neg_offset),
            );
            let mut lo = _mm256_and_si256(_mm256_i32gather_epi32::<1>(starts, idx), byte);
            for _ in 0..self.scan {
                let next = _mm256_min_epi32(_mm256_add_epi32(lo, one), top_code);
                let le = _mm256_cmp_ps::<_CMP_LE_OQ>(_mm256_i32gather_ps::<4>(map, next), xs8);
                lo = _mm256_sub_epi32(lo, _mm256_castps_si256(le));
            }
            let hi = _mm256_min_epi32(_mm256_add_epi32(lo, one), top_code);
            let m_lo = _mm256_i32gather_ps::<4>(map, lo);
            let m_hi = _mm256_i32gather_ps::<4>(map, hi);
            let up =
                _mm256_cmp_ps::<_CMP_LE_OQ>(_mm256_sub_ps(m_hi, xs8), _mm256_sub_ps(xs8, m_lo));
            let code = _mm256_sub_epi32(lo, _mm256_castps_si256(up));
            let code = _mm256_or_si256(
                _mm256_and_si256(code, _mm256_castps_si256(inside)),
                _mm256_and_si256(top, top_code),
            );
            _mm256_storeu_si256(codes.as_mut_ptr() as *mut __m256i, code);
            for (o, &c) in out[i..i + 8].iter_mut().zip(&codes) {
                *o = c as u8;
            }
        }
        n8
    }
}

/// The value of `code` in a block whose scale is `absmax`: `map[code]·absmax` (one `f32`
/// multiplication, bnb's `code[c] * absmax[block]`).
#[inline(always)]
pub fn dequantize(code: u8, absmax: f32, map: &[f32; MAP_LEN]) -> f32 {
    map[code as usize] * absmax
}

/// Quantizes `x` in a block of scale `absmax`: `quantize(x / absmax)` (true `f32` division),
/// or the code of zero when `absmax == 0` (then every `x` of the block is 0).
#[inline(always)]
pub fn quantize_scaled(x: f32, absmax: f32, map: &[f32; MAP_LEN], zero_code: u8) -> u8 {
    if absmax == 0.0 {
        zero_code
    } else {
        quantize(x / absmax, map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f64) -> bool {
        ((a as f64) - b).abs() <= b.abs() * 1e-6
    }

    #[test]
    fn signed_map_has_bnb_landmarks() {
        let m = dynamic_map(true);
        assert_eq!(m.iter().filter(|&&x| x < 0.0).count(), 127);
        assert_eq!(m[SIGNED_ZERO_CODE as usize].to_bits(), 0);
        assert_eq!(m[255], 1.0);
        assert!(close(m[0], -0.99296875), "min {}", m[0]);
        assert!(close(m[128], 5.5e-7), "smallest positive {}", m[128]);
        assert!(close(m[254], 0.99296875), "largest below 1 {}", m[254]);
        assert!(m.windows(2).all(|w| w[0] < w[1]), "strictly increasing");
        // Symmetric: the negatives are the positives negated, bit for bit.
        for c in 0..127 {
            assert_eq!(m[c], -m[254 - c]);
        }
    }

    #[test]
    fn unsigned_map_has_bnb_landmarks() {
        let m = dynamic_map(false);
        assert_eq!(m[UNSIGNED_ZERO_CODE as usize].to_bits(), 0);
        assert!(m.iter().all(|&x| x >= 0.0));
        assert_eq!(m[255], 1.0);
        assert!(close(m[1], 3.25e-7), "smallest positive {}", m[1]);
        assert!(close(m[254], 0.996484375), "largest below 1 {}", m[254]);
        assert!(m.windows(2).all(|w| w[0] < w[1]), "strictly increasing");
    }

    #[test]
    fn quantize_returns_each_code_for_its_own_value_and_the_nearest_otherwise() {
        for signed in [true, false] {
            let m = dynamic_map(signed);
            for c in 0..MAP_LEN {
                assert_eq!(quantize(m[c], &m) as usize, c);
                assert_eq!(dequantize(c as u8, 1.0, &m), m[c]);
            }
            // Brute force on a grid, including values between codes and beyond the ends.
            for k in -2100..=2100 {
                let x = k as f32 / 2000.0;
                let q = quantize(x, &m) as usize;
                let best = (0..MAP_LEN)
                    .map(|c| (m[c] - x).abs())
                    .fold(f32::INFINITY, f32::min);
                assert_eq!((m[q] - x).abs(), best, "x = {x}");
            }
        }
    }

    #[test]
    fn quantize_breaks_ties_upward_and_clamps() {
        // A toy map 0, 1, 2, ...: 0.5 is exactly halfway between codes 0 and 1.
        let mut toy = [0.0f32; MAP_LEN];
        for (c, x) in toy.iter_mut().enumerate() {
            *x = c as f32;
        }
        assert_eq!(quantize(0.5, &toy), 1);
        assert_eq!(quantize(100.5, &toy), 101);
        assert_eq!(quantize(100.49, &toy), 100);
        let m = dynamic_map(false);
        assert_eq!(quantize(2.0, &m), 255);
        assert_eq!(quantize(-1.0, &m), 0);
        assert_eq!(quantize(f32::NAN, &m), 0);
        assert_eq!(quantize_scaled(0.0, 0.0, &m, UNSIGNED_ZERO_CODE), 0);
        let s = dynamic_map(true);
        assert_eq!(quantize_scaled(0.0, 0.0, &s, SIGNED_ZERO_CODE), 127);
        assert_eq!(quantize(-2.0, &s), 0);
    }

    #[test]
    fn codebook_agrees_with_bisection_everywhere() {
        let mut xs: Vec<f32> = vec![
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            1.0,
            -1.0,
            2.0,
            -2.0,
        ];
        for signed in [true, false] {
            let m = dynamic_map(signed);
            for c in 0..MAP_LEN {
                // Each code, its neighbours in f32, and the midpoints to the next code.
                for x in [m[c], f32::from_bits(m[c].to_bits() + 1)] {
                    xs.extend([x, -x]);
                }
                if c + 1 < MAP_LEN {
                    let mid = (m[c] + m[c + 1]) / 2.0;
                    for x in [
                        mid,
                        f32::from_bits(mid.to_bits() + 1),
                        f32::from_bits(mid.to_bits().saturating_sub(1)),
                    ] {
                        xs.extend([x, -x]);
                    }
                }
            }
        }
        // A dense log-spaced sweep of both signs, and every bucket edge.
        for k in 0..200_000u32 {
            let x = f32::from_bits(0x2000_0000 + k * 0x1F00);
            xs.extend([x, -x]);
        }
        for signed in [true, false] {
            let m = dynamic_map(signed);
            let book = CodeBook::new(m);
            for &x in &xs {
                assert_eq!(
                    book.quantize(x),
                    quantize(x, &m),
                    "x = {x:e} ({:#x})",
                    x.to_bits()
                );
                for absmax in [0.0f32, 0.5, 1.0, 3.0e-3] {
                    assert_eq!(
                        book.quantize_scaled(x, absmax, 7),
                        quantize_scaled(x, absmax, &m, 7)
                    );
                }
            }
            // The slice path (vector lanes and the scalar tail) on every x, several scales.
            for absmax in [0.0f32, 1.0, 0.5, 3.0e-3, 7.0] {
                let mut out = vec![0u8; xs.len()];
                book.quantize_scaled_slice(&xs, absmax, 7, &mut out);
                for (k, (&x, &c)) in xs.iter().zip(&out).enumerate() {
                    assert_eq!(
                        c,
                        quantize_scaled(x, absmax, &m, 7),
                        "x[{k}] = {x:e}, absmax {absmax}"
                    );
                }
            }
        }
    }
}
