//! Global-norm gradient clipping whose norm does not depend on the sharding.
//!
//! The norm is `√Σ g²` over every reduced gradient element of every unit. Each rank holds a
//! different part of that sum, and a floating-point sum depends on its order, so the squares
//! are summed **exactly**: the square of an f32 is exact in f64 (a 24-bit mantissa squared fits
//! 53 bits), and [`ExactSquares`] adds those mantissas as integers in one bin per binary
//! exponent. One all-gather of the bins, an integer sum and one rounding to f64 give every rank
//! (and an unsharded run) the same norm to the last bit; the clip factor `max_norm / (norm +
//! 1e-6)` (torch's) then scales each element alike wherever it lives.
//!
//! Gradients in device memory are summed on the device into the same bins
//! (`cuda::ops::add_exact_squares`, integer additions only), one accumulator for every unit,
//! read with one download by [`ExactSquares::total`]: the same total to the bit as the host's.

use crate::comm::{Buf, BufMut, Communicator};
use crate::storage::Storage;
use crate::Result;

/// Lowest and highest exponent `k` of an f32 square written as `m·2^k` with a 53-bit `m`:
/// squares lie in `[2^-298, 2^256)`, so `k ∈ [-350, 203]`.
const K_MIN: i32 = -352;
/// Bins of the exact sum (`kernels/group_ops.cu` has the same `SQ_BINS` and `SQ_K_MIN`).
pub(crate) const BINS: usize = 560;

/// An exact sum of f32 squares (module doc).
pub(crate) struct ExactSquares {
    /// `bins[k − K_MIN]` sums the 53-bit mantissas of the squares `m·2^k` (room for 2^75 terms).
    bins: Vec<u128>,
    /// Non-finite inputs seen.
    non_finite: u128,
    /// The device's bins of [`Self::add`] on device memory, not yet read into `bins`.
    #[cfg(feature = "cuda")]
    device: Option<crate::storage::DeviceVec<u64>>,
}

impl ExactSquares {
    pub(crate) fn new() -> Self {
        ExactSquares {
            bins: vec![0; BINS],
            non_finite: 0,
            #[cfg(feature = "cuda")]
            device: None,
        }
    }

    /// Adds the squares of `x`'s elements where they live: on the host, or queued on the
    /// device into its bins (every device `x` on one device).
    pub(crate) fn add(&mut self, x: &Storage<f32>) -> Result<()> {
        match x {
            Storage::Cpu(v) => {
                self.add_all(v);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => {
                use crate::cuda::ops::{add_exact_squares, EXACT_SQUARES_WORDS};
                let acc = match &mut self.device {
                    Some(acc) if std::sync::Arc::ptr_eq(&acc.dev, &d.dev) => acc,
                    Some(_) => {
                        return Err(crate::storage::mixed(
                            "clip_grad_norm",
                            "gradients on two devices",
                        ))
                    }
                    None => self.device.insert(crate::storage::DeviceVec {
                        data: d.dev.zeros(EXACT_SQUARES_WORDS)?,
                        dev: std::sync::Arc::clone(&d.dev),
                    }),
                };
                add_exact_squares(&d.dev, &d.data.slice(..), &mut acc.data.slice_mut(..))
            }
            #[allow(unreachable_patterns)]
            _ => Err(crate::storage::no_backend("clip_grad_norm")),
        }
    }

    /// Reads the device's bins into the host's (one download, which waits for the device).
    #[cfg(feature = "cuda")]
    fn read_device(&mut self) -> Result<()> {
        let Some(acc) = self.device.take() else {
            return Ok(());
        };
        let words = acc.dev.download(&acc.data)?;
        self.non_finite += u128::from(words[0]);
        for (bin, pair) in self.bins.iter_mut().zip(words[1..].chunks_exact(2)) {
            *bin += u128::from(pair[1]) << 64 | u128::from(pair[0]);
        }
        Ok(())
    }

    pub(crate) fn add_all(&mut self, xs: &[f32]) {
        for &x in xs {
            if !x.is_finite() {
                self.non_finite += 1;
            } else if x != 0.0 {
                let sq = f64::from(x) * f64::from(x);
                let bits = sq.to_bits();
                let exp = ((bits >> 52) & 0x7ff) as i32;
                let mantissa = (bits & ((1 << 52) - 1)) | (1 << 52);
                self.bins[(exp - 1075 - K_MIN) as usize] += u128::from(mantissa);
            }
        }
    }

    /// The sum over every rank of `comm` (one all-gather of the bins), rounded once to f64;
    /// `NaN` if any rank saw a non-finite value.
    pub(crate) fn total(&mut self, comm: &dyn Communicator) -> Result<f64> {
        #[cfg(feature = "cuda")]
        self.read_device()?;
        let mine: Vec<u8> = std::iter::once(self.non_finite)
            .chain(self.bins.iter().copied())
            .flat_map(u128::to_le_bytes)
            .collect();
        let mut all = vec![0u8; mine.len() * comm.world_size()];
        comm.all_gather(Buf::U8(&mine), BufMut::U8(&mut all))?;
        let mut sum = ExactSquares::new();
        for rank in all.chunks_exact(mine.len()) {
            let words: Vec<u128> = rank
                .chunks_exact(16)
                .map(|w| u128::from_le_bytes(w.try_into().expect("16 bytes")))
                .collect();
            sum.non_finite += words[0];
            sum.bins
                .iter_mut()
                .zip(&words[1..])
                .for_each(|(a, b)| *a += b);
        }
        Ok(if sum.non_finite > 0 {
            f64::NAN
        } else {
            sum.to_f64()
        })
    }

    /// `Σ bins[i]·2^i` as one big integer (little-endian 64-bit limbs).
    fn limbs(&self) -> Vec<u64> {
        let mut limbs = vec![0u64; BINS / 64 + 4];
        for (i, &b) in self.bins.iter().enumerate() {
            add_shifted(&mut limbs, b, i);
        }
        limbs
    }

    /// `Σ bins[i]·2^(i + K_MIN)`, correctly rounded: the bins become one big integer, whose top
    /// 64 bits (with a sticky bit for the rest) convert with round-to-nearest-even.
    fn to_f64(&self) -> f64 {
        let limbs = self.limbs();
        let Some(top) = limbs.iter().rposition(|&l| l != 0) else {
            return 0.0;
        };
        let high = 64 * top + 63 - limbs[top].leading_zeros() as usize;
        let (word, low, sticky) = top_bits(&limbs, high);
        let value = (word | u64::from(sticky)) as f64;
        value * 2f64.powi(low as i32 + K_MIN)
    }
}

/// `limbs += b << shift` (little-endian 64-bit limbs, room checked by the caller's sizing).
fn add_shifted(limbs: &mut [u64], b: u128, shift: usize) {
    let (word, bit) = (shift / 64, shift % 64);
    let parts = [
        (b << bit) as u64,
        ((b << bit) >> 64) as u64,
        if bit == 0 {
            0
        } else {
            (b >> (128 - bit)) as u64
        },
    ];
    let mut carry = 0u128;
    for (j, limb) in limbs.iter_mut().enumerate().skip(word) {
        let add = parts.get(j - word).copied().unwrap_or(0);
        let s = u128::from(*limb) + u128::from(add) + carry;
        *limb = s as u64;
        carry = s >> 64;
        if j - word >= 2 && carry == 0 {
            break;
        }
    }
}

/// Bits `low ..= high` of the big integer (at most 64, `low = high − 63` or 0), `low`, and
/// whether any bit below `low` is set.
fn top_bits(limbs: &[u64], high: usize) -> (u64, usize, bool) {
    let bit = |i: usize| (limbs[i / 64] >> (i % 64)) & 1;
    let low = high.saturating_sub(63);
    let word = (low..=high).rev().fold(0u64, |w, i| (w << 1) | bit(i));
    let sticky = (0..low).any(|i| bit(i) == 1);
    (word, low, sticky)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::SingleRank;

    #[test]
    fn the_exact_sum_is_the_correctly_rounded_sum() {
        // Values whose f64 sum depends on the order: the exact sum of their squares is known.
        let xs = [1.0f32, 3.0e-20, 1.0, 2.0f32.powi(-30), 65536.0, 1e-38];
        let mut e = ExactSquares::new();
        e.add_all(&xs);
        let total = e.total(&SingleRank).unwrap();
        let mut exact = 0f64;
        // The squares sorted ascending and summed in f64 differ from the exact value by less
        // than one ulp of the result here (few terms, wide gaps): check both bounds.
        let mut sq: Vec<f64> = xs.iter().map(|&x| f64::from(x) * f64::from(x)).collect();
        sq.sort_by(f64::total_cmp);
        sq.iter().for_each(|s| exact += s);
        assert!(
            (total - exact).abs() <= exact * f64::EPSILON,
            "{total} vs {exact}"
        );
        // Order does not matter, and splitting the input does not either.
        let mut rev = ExactSquares::new();
        rev.add_all(&xs.iter().rev().copied().collect::<Vec<_>>());
        assert_eq!(rev.total(&SingleRank).unwrap().to_bits(), total.to_bits());
        let mut split = ExactSquares::new();
        split.add_all(&xs[..3]);
        split.add_all(&xs[3..]);
        assert_eq!(split.total(&SingleRank).unwrap().to_bits(), total.to_bits());
    }

    #[test]
    fn many_small_squares_are_not_lost_next_to_a_large_one() {
        // 1 + 4096·(2^-27)² = 1 + 2^-42 exactly; summed left to right in f64 every small square
        // (a quarter ulp of 1) rounds away and the sum stays 1.
        let mut xs = vec![1.0f32];
        xs.extend(std::iter::repeat_n(2f32.powi(-27), 4096));
        let naive = xs
            .iter()
            .fold(0f64, |a, &x| a + f64::from(x) * f64::from(x));
        assert_eq!(naive, 1.0);
        let mut e = ExactSquares::new();
        e.add_all(&xs);
        assert_eq!(e.total(&SingleRank).unwrap(), 1.0 + 2f64.powi(-42));
    }

    #[test]
    fn extremes_and_non_finite_values() {
        let mut e = ExactSquares::new();
        e.add_all(&[f32::MAX, f32::MIN_POSITIVE, f32::from_bits(1)]);
        let t = e.total(&SingleRank).unwrap();
        assert_eq!(t, f64::from(f32::MAX) * f64::from(f32::MAX));
        let mut tiny = ExactSquares::new();
        tiny.add_all(&[f32::from_bits(1)]);
        assert_eq!(tiny.total(&SingleRank).unwrap(), 2f64.powi(-298));
        let mut bad = ExactSquares::new();
        bad.add_all(&[1.0, f32::NAN]);
        assert!(bad.total(&SingleRank).unwrap().is_nan());
        assert_eq!(ExactSquares::new().total(&SingleRank).unwrap(), 0.0);
    }
}

/// The device sum (`cuda::ops::add_exact_squares`) against the host's, on a device or
/// tools/cuda-emu (`.ci/run`); without one, skipped with the reason printed.
#[cfg(all(test, feature = "cuda"))]
mod device_tests {
    use super::*;
    use crate::comm::SingleRank;
    use crate::storage::Placement;

    fn device() -> Option<Placement> {
        match crate::cuda::Device::open(0) {
            Ok(d) => Some(Placement::Cuda(std::sync::Arc::new(d))),
            Err(e) => {
                println!("skipped: {e}");
                None
            }
        }
    }

    /// Host and device sums of `parts` (each part one `add`): the exact integers and totals.
    fn both(place: &Placement, parts: &[Vec<f32>]) -> [(Vec<u64>, u64, u128); 2] {
        let mut host = ExactSquares::new();
        let mut dev = ExactSquares::new();
        for p in parts {
            host.add(&Storage::Cpu(p.clone())).unwrap();
            dev.add(&place.put(p.clone()).unwrap()).unwrap();
        }
        [host, dev].map(|mut e| {
            let total = e.total(&SingleRank).unwrap().to_bits();
            (e.limbs(), total, e.non_finite)
        })
    }

    #[test]
    fn device_sums_of_squares_are_the_hosts_exact_integers() {
        let Some(place) = device() else { return };
        // Every kind of finite f32 (subnormals, the extremes, zeros of both signs) and bit
        // patterns from a stream, in parts of several lengths.
        let mut stream = 0x2545_f491_4f6c_dd1du64;
        let mut bits = || {
            stream ^= stream << 13;
            stream ^= stream >> 7;
            stream ^= stream << 17;
            stream as u32
        };
        let special = [
            0.0,
            -0.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
        ];
        let mut parts = vec![special.to_vec()];
        for len in [1, 255, 256, 257, 10_000] {
            parts.push(
                (0..len)
                    .map(|_| f32::from_bits(bits()))
                    .filter(|x| x.is_finite())
                    .collect(),
            );
        }
        let [host, dev] = both(&place, &parts);
        assert_eq!(dev, host);
        assert_ne!(host.0.iter().filter(|&&l| l != 0).count(), 0);
        // Many equal large squares: the device's low words carry into the high ones.
        let big = vec![vec![f32::MAX; 1 << 17], vec![-3.0e38; 3 << 16]];
        let [host, dev] = both(&place, &big);
        assert_eq!(dev, host);
        // A NaN or an infinity anywhere: counted, and the total is NaN.
        let bad = vec![
            vec![1.0, f32::NAN],
            vec![f32::NEG_INFINITY, 2.0, f32::INFINITY],
        ];
        let [host, dev] = both(&place, &bad);
        assert_eq!((dev.2, host.2), (3, 3));
        assert!(f64::from_bits(dev.1).is_nan());
    }
}
