//! A quantization map's nearest-code index small enough for byte-permute lookups: at most 512
//! buckets, each holding at most one threshold, so that the AVX-512 kernel finds a code with
//! `vpermi2b` lookups in registers instead of gathers.
//!
//! # Why
//! [`crate::quant::CodeBook`]'s index gives the nearest code in one table lookup, but its
//! table has one bucket per `2⁻ᵇ` of every octave (thousands of entries), which a vector
//! kernel can only read with gathers. On an AVX-512 EPYC a 16-lane `vpgatherdd` costs ~7 ns
//! even from L1 (`ragged bench optim`'s profile put ~40 % of the 8-bit step there), while a
//! 64-lane lookup in a 256-byte table held in four registers (two `vpermi2b` and a blend)
//! costs ~1 ns.
//!
//! # The index
//! A threshold `T_c` (`c = 0..255`) is the smallest `f32` from which code `c + 1` is nearer
//! than code `c` ([`crate::quant::CodeBook`] derives them), so the nearest code of `x` is the
//! number of thresholds `≤ x`. Here the top 16 bits of `|x|` (exponent and 7 mantissa bits,
//! `h = (|x|_bits >> 16)`) pick a bucket by octave with a resolution of its own per octave:
//! `bucket = (h >> shift[o]) + add[o]`, `o` the octave's slot (slot 0 holds everything below
//! the octave under the smallest threshold, zero and subnormals included; slot 31 everything
//! from 30 octaves above that, infinities and NaN included; neither holds a threshold). Each
//! octave gets the fewest mantissa bits (at most 7) that put at most one threshold in each
//! bucket. Depending on 16 bits only, the bucket is computed in 16-bit lanes, 32 to a vector.
//! A negative `x` of a signed map uses a second half of buckets (`256 + bucket`); for a map
//! whose thresholds are all positive, every negative `x` goes to bucket 0 (below every
//! threshold), and the positive buckets may use all 512.
//!
//! Each bucket stores `base`, the number of thresholds below the bucket (in `x` order), so
//! the one threshold that can lie inside the bucket is `T_base`, and
//!
//! `code(x) = base + [x ≥ T_base]` (`T_255 = NaN`, never reached), `0` for NaN `x`.
//!
//! A bucket with no threshold inside has `T_base` beyond its values, so the comparison is
//! false there. The code is the same function of `x` as [`crate::quant::quantize`], bit for
//! bit (checked on every `f32` by `cargo test -p ragged-optimizers --lib octave_index --
//! --ignored`, and on a sample of bit patterns in CI).
//!
//! For bitsandbytes' dynamic maps: the signed map uses 226 buckets per sign (its 128
//! positive thresholds span octaves 2⁻²² to 2⁻¹, 64 buckets in the top one), the unsigned
//! map 448 (255 thresholds over 2⁻²³ to 2⁻¹, 128 buckets in the top octave); the counts
//! include the two end slots and one bucket per octave without a threshold.

use crate::quant::MAP_LEN;

/// Octave slots of the per-octave tables (two 16-lane registers).
pub(crate) const SLOTS: usize = 32;

/// Buckets of the bucket table (eight 64-byte registers).
pub(crate) const BUCKETS: usize = 512;

/// Buckets per sign half of a signed map.
const HALF: usize = BUCKETS / 2;

/// A shift of 16 or more: `vpsrlvw` (and [`shr`]) give 0, so the slot's bucket is `add`.
const WHOLE: u16 = 16;

/// Mantissa bits of the top 16 bits of an `f32` (below its sign and 8 exponent bits).
const TOP_MANTISSA: u32 = 7;

/// The index of one map (see the module doc).
#[derive(Clone, PartialEq)]
pub(crate) struct OctaveIndex {
    /// Per slot: added to `h >> shift` (two's complement, 16 bits).
    pub add: [i16; SLOTS],
    /// Per slot: right shift of `h` (`7 − mantissa bits`, or [`WHOLE`]).
    pub shift: [u16; SLOTS],
    /// Biased exponent of slot 0's top octave: `slot = min(e − e_base, 31)`, 0 below.
    pub e_base: u16,
    /// Whether negative `x` have their own buckets (`256 + bucket`); otherwise they go to 0.
    pub signed: bool,
    /// Per bucket, the number of thresholds below it.
    pub base: [u8; BUCKETS],
    /// `T_c` for `c = 0..255`, then NaN.
    pub thresholds: [f32; MAP_LEN],
}

impl std::fmt::Debug for OctaveIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OctaveIndex")
            .field("e_base", &self.e_base)
            .field("signed", &self.signed)
            .finish_non_exhaustive()
    }
}

/// `h >> s`, 0 for `s ≥ 16` (`vpsrlvw`'s rule).
#[inline(always)]
fn shr(h: u16, s: u16) -> u16 {
    h.checked_shr(u32::from(s)).unwrap_or(0)
}

/// The fewest mantissa bits that give the mantissas `ms` (one octave's thresholds) distinct
/// buckets, `None` above [`TOP_MANTISSA`].
fn bits_for(ms: &[u32]) -> Option<u32> {
    (0..=TOP_MANTISSA).find(|&r| {
        let mut b: Vec<u32> = ms.iter().map(|m| m >> (23 - r)).collect();
        b.dedup();
        b.len() == ms.len()
    })
}

impl OctaveIndex {
    /// The index of the thresholds `t` (strictly increasing, 255 of them); `None` when a
    /// threshold is zero, subnormal or spans more than 30 octaves from the smallest, or when
    /// the buckets do not fit (an octave needing more than 7 mantissa bits, more than 256
    /// buckets per sign, or 512).
    pub(crate) fn new(t: &[f32; MAP_LEN - 1]) -> Option<Self> {
        let ok = t.windows(2).all(|w| w[0] < w[1]) && t.iter().all(|x| x.is_normal());
        let exp = |x: f32| (x.to_bits() >> 23) & 0xff;
        let e_lo = t.iter().map(|&x| exp(x)).min()?;
        let e_hi = t.iter().map(|&x| exp(x)).max()?;
        if !ok || e_lo < 2 || e_hi > e_lo + 29 {
            return None;
        }
        let e_base = e_lo - 1;
        let signed = t[0] < 0.0;
        // One resolution per octave for both signs: the finer of the two.
        let mut shift = [WHOLE; SLOTS];
        for (slot, s) in shift.iter_mut().enumerate().take(SLOTS - 1).skip(1) {
            let e = e_base + slot as u32;
            let side = |neg: bool| -> Vec<u32> {
                t.iter()
                    .filter(|&&x| (x < 0.0) == neg && exp(x) == e)
                    .map(|x| x.to_bits() & 0x7f_ffff)
                    .collect()
            };
            let bits = bits_for(&side(false))?.max(bits_for(&side(true))?);
            *s = (TOP_MANTISSA - bits) as u16;
        }
        let mut add = [0i16; SLOTS];
        let mut next = 0usize;
        for slot in 0..SLOTS {
            let first = shr(
                ((e_base as usize + slot) << TOP_MANTISSA) as u16,
                shift[slot],
            );
            add[slot] = i16::try_from(next as i32 - i32::from(first)).ok()?;
            next += match shift[slot] {
                WHOLE => 1,
                sh => 1 << (TOP_MANTISSA - u32::from(sh)),
            };
        }
        if next > if signed { HALF } else { BUCKETS } {
            return None;
        }
        let mut thresholds = [f32::NAN; MAP_LEN];
        thresholds[..MAP_LEN - 1].copy_from_slice(t);
        let mut index = OctaveIndex {
            add,
            shift,
            e_base: e_base as u16,
            signed,
            base: [0; BUCKETS],
            thresholds,
        };
        index.base = index.bases(t)?;
        Some(index)
    }

    /// Per bucket, the thresholds below it; `None` when a bucket holds two.
    fn bases(&self, t: &[f32; MAP_LEN - 1]) -> Option<[u8; BUCKETS]> {
        let mut inside = [0u8; BUCKETS];
        for &x in t {
            inside[self.bucket(x)] += 1;
        }
        if inside.iter().any(|&n| n > 1) {
            return None;
        }
        let negatives = t.iter().filter(|&&x| x < 0.0).count();
        let mut base = [0u8; BUCKETS];
        for (b, out) in base.iter_mut().enumerate() {
            let below = if b < HALF || !self.signed {
                // Positive buckets: every negative threshold, and the positive ones in
                // lower buckets.
                negatives + t.iter().filter(|&&x| x > 0.0 && self.bucket(x) < b).count()
            } else {
                // Negative buckets (by |x|): the negative thresholds of larger magnitude.
                t.iter().filter(|&&x| x < 0.0 && self.bucket(x) > b).count()
            };
            *out = u8::try_from(below).ok()?;
        }
        Some(base)
    }

    /// The bucket of `x` (see the module doc).
    #[inline(always)]
    pub(crate) fn bucket(&self, x: f32) -> usize {
        let h = (x.to_bits() >> 16) as u16 & 0x7fff;
        let slot = ((h >> TOP_MANTISSA).saturating_sub(self.e_base)).min(SLOTS as u16 - 1);
        let slot = slot as usize;
        let b = shr(h, self.shift[slot]).wrapping_add(self.add[slot] as u16) as usize;
        match (x.is_sign_negative(), self.signed) {
            (false, _) => b,
            (true, true) => HALF + b,
            (true, false) => 0,
        }
    }

    /// The nearest code of `x`: `base + [x ≥ T_base]`, 0 for NaN (the scalar definition
    /// that the tests hold the lanes of `crate::kernels::adam8bit_avx512` to).
    #[cfg(test)]
    pub(crate) fn code(&self, x: f32) -> u8 {
        if x.is_nan() {
            return 0;
        }
        let base = self.base[self.bucket(x)];
        base + u8::from(x >= self.thresholds[base as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dynamic_map, quantize, CodeBook};
    use rayon::prelude::*;

    fn indexes() -> Vec<([f32; MAP_LEN], OctaveIndex)> {
        [true, false]
            .map(|signed| {
                let book = CodeBook::new(dynamic_map(signed)).unwrap();
                let index = OctaveIndex::new(&book.thresholds()).expect("the map fits");
                (*book.map(), index)
            })
            .into()
    }

    /// The first `f32` bit-pattern block (top 16 bits) on which the index and bisection
    /// disagree, for either map.
    fn first_mismatch(his: impl ParallelIterator<Item = u32>) -> Option<u32> {
        let maps = indexes();
        his.find_any(|&hi| {
            maps.iter().any(|(map, index)| {
                (0..=0xffffu32).any(|lo| {
                    let x = f32::from_bits(hi << 16 | lo);
                    index.code(x) != quantize(x, map)
                })
            })
        })
    }

    #[test]
    fn dynamic_maps_fit_with_the_bucket_counts_of_the_module_doc() {
        let maps = indexes();
        let used = |ix: &OctaveIndex| {
            (0..SLOTS)
                .map(|s| match ix.shift[s] {
                    WHOLE => 1,
                    sh => 1usize << (TOP_MANTISSA - u32::from(sh)),
                })
                .sum::<usize>()
        };
        assert!(maps[0].1.signed && !maps[1].1.signed);
        assert_eq!(used(&maps[0].1), 226);
        assert_eq!(used(&maps[1].1), 448);
    }

    #[test]
    fn a_map_whose_thresholds_crowd_one_octave_has_no_index() {
        // 255 adjacent `f32`s in [1, 2): 2^23 buckets in one octave.
        let mut t = [0f32; MAP_LEN - 1];
        for (k, x) in t.iter_mut().enumerate() {
            *x = f32::from_bits(1f32.to_bits() + k as u32);
        }
        assert!(
            OctaveIndex::new(&t).is_none(),
            "adjacent f32s need 23 mantissa bits"
        );
        t[0] = 0.0;
        assert!(OctaveIndex::new(&t).is_none(), "a zero threshold");
    }

    /// A sample of bit patterns in CI: every 97th block of 65 536 and the blocks of zeros,
    /// ±1, infinities and NaN.
    #[test]
    fn index_equals_bisection_on_a_sample_of_f32_bit_patterns() {
        let his: Vec<u32> = (0..=0xffffu32)
            .step_by(97)
            .chain([0x0000, 0x8000, 0x3f80, 0xbf80, 0x7f80, 0xff80, 0x7fc0])
            .collect();
        assert_eq!(first_mismatch(his.into_par_iter()), None);
    }

    /// Every one of the 2^32 bit patterns; by hand after an index change:
    /// `cargo test -p ragged-optimizers --lib octave_index -- --ignored`.
    #[test]
    #[ignore = "2^32 inputs × 2 maps: run by hand after changing the index"]
    fn index_equals_bisection_on_every_f32() {
        assert_eq!(first_mismatch((0..=0xffffu32).into_par_iter()), None);
    }
}
