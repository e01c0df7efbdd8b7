//! Parsers for numeric flags, so that a value out of range is a usage error (exit 2) naming the flag,
//! as torch.optim's constructors refuse them, instead of a run that trains on NaN.

/// The longest `--timeout` accepted: a year, far past any real collective, and far from the point
/// where a deadline would overflow the clock.
pub const MAX_TIMEOUT_S: f64 = 365.0 * 24.0 * 3600.0;

/// Parses a finite number that satisfies `ok`, described as `what` in the error.
fn finite_f32(text: &str, ok: impl Fn(f32) -> bool, what: &str) -> Result<f32, String> {
    match text.trim().parse::<f32>() {
        Ok(v) if v.is_finite() && ok(v) => Ok(v),
        Ok(v) if !v.is_finite() => Err(format!("must be {what}, and `{text}` is not finite (or overflows f32)")),
        _ => Err(format!("must be {what}, not `{text}`")),
    }
}

/// A learning rate, weight decay, momentum or epsilon: finite and >= 0.
pub fn non_negative(text: &str) -> Result<f32, String> {
    finite_f32(text, |v| v >= 0.0, "a finite number >= 0")
}

/// A maximum gradient norm: finite and > 0.
pub fn positive(text: &str) -> Result<f32, String> {
    finite_f32(text, |v| v > 0.0, "a finite number > 0")
}

/// An Adam beta: in [0, 1).
pub fn beta(text: &str) -> Result<f32, String> {
    finite_f32(text, |v| (0.0..1.0).contains(&v), "a number in [0, 1)")
}

/// Seconds to wait: positive, finite and at most [`MAX_TIMEOUT_S`].
pub fn seconds(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v <= MAX_TIMEOUT_S => Ok(v),
        _ => Err(format!("must be a number of seconds above 0 and at most {MAX_TIMEOUT_S} (a year), not `{text}`")),
    }
}

/// A tolerance: finite and >= 0.
pub fn tolerance(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("must be a finite number >= 0, not `{text}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_torch_optim_refuses() {
        for bad in ["nan", "NaN", "inf", "-inf", "-1", "1e39", "x", ""] {
            assert!(non_negative(bad).is_err(), "{bad}");
        }
        assert_eq!(non_negative("0"), Ok(0.0));
        assert_eq!(non_negative("3e-4"), Ok(3e-4));
        for bad in ["1", "1.5", "-0.1", "nan"] {
            assert!(beta(bad).is_err(), "{bad}");
        }
        assert_eq!(beta("0.999"), Ok(0.999));
        assert_eq!(beta("0"), Ok(0.0));
    }

    #[test]
    fn timeouts_stay_on_the_clock() {
        for bad in ["0", "-3", "nan", "inf", "1e300", "x"] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
        assert_eq!(seconds("2.5"), Ok(2.5));
        assert!(tolerance("nan").is_err() && tolerance("-1").is_err());
        assert_eq!(tolerance("1e-4"), Ok(1e-4));
    }
}
