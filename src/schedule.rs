//! Learning-rate schedules as pure functions of the step (as optax's are, not stateful
//! schedulers): a factor that multiplies the optimizer's configured rate, applied by
//! [`crate::fsdp::ShardedModel::step`]. The decays are optax's and Hugging Face's; the warmup
//! is `(step + 1) / warmup`, so the first step trains (theirs start at 0 and reach 1 one step
//! later), and the factor stays at `min_factor` after `total` (HF's cosine rises again).

use crate::{Error, Result};

/// A learning-rate factor as a function of the step (0 for the first step).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Schedule {
    /// Always 1.
    Constant,
    /// Linear warmup over `warmup` steps (`(step + 1) / warmup`, never 0), then a cosine from 1
    /// down to `min_factor` at step `total`, and `min_factor` after.
    WarmupCosine {
        warmup: usize,
        total: usize,
        min_factor: f64,
    },
    /// Linear warmup as above, then a straight line from 1 down to `min_factor` at `total`.
    WarmupLinear {
        warmup: usize,
        total: usize,
        min_factor: f64,
    },
}

impl Schedule {
    /// `Err` unless `warmup ≤ total` and `min_factor` is in `[0, 1]`.
    pub fn validate(&self) -> Result<()> {
        let (warmup, total, min) = match *self {
            Schedule::Constant => return Ok(()),
            Schedule::WarmupCosine {
                warmup,
                total,
                min_factor,
            }
            | Schedule::WarmupLinear {
                warmup,
                total,
                min_factor,
            } => (warmup, total, min_factor),
        };
        if warmup > total || !(0.0..=1.0).contains(&min) {
            return Err(Error::BadInput {
                op: "Schedule",
                what: format!("{self:?}"),
                reason: "needs warmup ≤ total and min_factor in [0, 1]".into(),
            });
        }
        Ok(())
    }

    /// The steps of the smallest factors above the floor, and of the floor: the first warmup
    /// step, the last step before `total` and `total` itself. The factor rises through the
    /// warmup and falls through the decay, so a rate checked at these steps (and at 1) is
    /// checked at every step.
    pub(crate) fn lowest_steps(&self) -> Vec<usize> {
        match *self {
            Schedule::Constant => vec![0],
            Schedule::WarmupCosine { total, .. } | Schedule::WarmupLinear { total, .. } => {
                vec![0, total.saturating_sub(1), total]
            }
        }
    }

    /// The factor at `step`.
    pub fn factor(&self, step: usize) -> f64 {
        let (warmup, total, min, cosine) = match *self {
            Schedule::Constant => return 1.0,
            Schedule::WarmupCosine {
                warmup,
                total,
                min_factor,
            } => (warmup, total, min_factor, true),
            Schedule::WarmupLinear {
                warmup,
                total,
                min_factor,
            } => (warmup, total, min_factor, false),
        };
        if step < warmup {
            return (step + 1) as f64 / warmup as f64;
        }
        if step >= total {
            return min; // also when warmup = total: no decay steps, the floor at `total`
        }
        let progress = (step - warmup) as f64 / (total - warmup) as f64;
        let shape = if cosine {
            0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        } else {
            1.0 - progress
        };
        min + (1.0 - min) * shape
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_decay_reaches_the_floor_at_total() {
        let cos = Schedule::WarmupCosine {
            warmup: 4,
            total: 14,
            min_factor: 0.1,
        };
        let lin = Schedule::WarmupLinear {
            warmup: 4,
            total: 14,
            min_factor: 0.1,
        };
        for s in [cos, lin] {
            s.validate().unwrap();
            assert_eq!(s.factor(0), 0.25);
            assert_eq!(s.factor(3), 1.0);
            assert_eq!(s.factor(4), 1.0);
            assert!((s.factor(14) - 0.1).abs() < 1e-15);
            assert_eq!(s.factor(1000), s.factor(14));
            assert!((1..14).all(|t| s.factor(t + 1) <= s.factor(t) || t < 3));
        }
        // Half way: the cosine is at the midpoint too, the line as well.
        assert!((cos.factor(9) - 0.55).abs() < 1e-12);
        assert!((lin.factor(9) - 0.55).abs() < 1e-12);
        assert!(cos.factor(6) > lin.factor(6), "the cosine starts slower");
        assert_eq!(Schedule::Constant.factor(7), 1.0);
    }

    /// No decay steps (`warmup = total`, or both 0): the floor from step `total` on, as
    /// documented (the factor was 1 at `total`, one step late).
    #[test]
    fn a_schedule_without_decay_steps_is_at_the_floor_from_total() {
        for (warmup, total) in [(5, 5), (0, 0)] {
            for cosine in [true, false] {
                let s = if cosine {
                    Schedule::WarmupCosine {
                        warmup,
                        total,
                        min_factor: 0.25,
                    }
                } else {
                    Schedule::WarmupLinear {
                        warmup,
                        total,
                        min_factor: 0.25,
                    }
                };
                let factors: Vec<f64> = (0..total + 3).map(|t| s.factor(t)).collect();
                let warm: Vec<f64> = (1..=warmup).map(|t| t as f64 / warmup as f64).collect();
                assert_eq!(factors[..warmup], warm[..], "{s:?}");
                assert!(
                    factors[total..].iter().all(|&f| f == 0.25),
                    "{s:?}: {factors:?}"
                );
            }
        }
    }

    #[test]
    fn bad_schedules_are_refused() {
        let bad = Schedule::WarmupLinear {
            warmup: 5,
            total: 4,
            min_factor: 0.0,
        };
        assert!(bad.validate().is_err());
        let bad = Schedule::WarmupCosine {
            warmup: 0,
            total: 4,
            min_factor: 1.5,
        };
        assert!(bad.validate().is_err());
    }
}
