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
}
