//! Learning-rate schedules as functions of the step (optax's schedules): a factor that
//! multiplies the optimizer's configured rate, applied by [`crate::fsdp::ShardedModel::step`].

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
        let span = total.saturating_sub(warmup).max(1) as f64;
        let progress = ((step - warmup) as f64 / span).min(1.0);
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
