//! Checks on flags shared by the subcommands, beside `ragged::limits`' checks on counts and
//! paths: a number within a stated range.

use ragged::{Error, Result};

/// `x` if it is finite and within `min..=max`, else `Err` naming `flag`, the value typed and
/// the range (in `unit`). A value past the range is a typo or a unit mistake, and would
/// otherwise overflow to infinity or print nonsense once scaled (`1e300` GB/s in B/s).
pub fn finite_within(
    op: &'static str,
    flag: &str,
    x: f64,
    (min, max): (f64, f64),
    unit: &str,
) -> Result<f64> {
    if x.is_finite() && (min..=max).contains(&x) {
        return Ok(x);
    }
    Err(Error::BadInput {
        op,
        what: format!("{flag} {}", short(x)),
        reason: format!("must be a finite number from {min} to {max} {unit}"),
    })
}

/// `x` as typed, near enough: `1e300`, not its 301 digits (`Display` never writes an exponent).
fn short(x: f64) -> String {
    let plain = (1e-4..1e16).contains(&x.abs()) || x == 0.0 || !x.is_finite();
    if plain {
        x.to_string()
    } else {
        format!("{x:e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finite_within_names_the_flag_and_the_range() {
        assert_eq!(
            finite_within("t", "--x", 2.0, (1.0, 3.0), "s").unwrap(),
            2.0
        );
        let cases = [
            (0.5, "--x 0.5"),
            (-4.0, "--x -4"),
            (f64::NAN, "--x NaN"),
            (f64::INFINITY, "--x inf"),
            (1e300, "--x 1e300"),
            (1e-300, "--x 1e-300"),
        ];
        for (bad, typed) in cases {
            let err = finite_within("t", "--x", bad, (1.0, 3.0), "s").unwrap_err();
            let text = err.to_string();
            assert!(text.contains(&format!("{typed}: ")), "{text}");
            assert!(text.contains("from 1 to 3 s"), "{text}");
        }
    }
}
