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

/// Whether `text` is a number written in digits alone: one that fails to parse is then too large for
/// its type, an error of range rather than of form.
pub fn digits_only(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit())
}

/// Seconds to wait: positive, finite and at most [`MAX_TIMEOUT_S`].
pub fn seconds(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v <= MAX_TIMEOUT_S => Ok(v),
        _ => Err(format!("must be a number of seconds above 0 and at most {MAX_TIMEOUT_S} (a year), not `{text}`")),
    }
}

/// A memory size: a number with an optional unit, B, KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB
/// (powers of 1024), e.g. `24GiB`, `80GB`, `1.5TiB`, `4096`; above 0.
pub fn memory_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let lower = t.to_ascii_lowercase();
    // The unit is a known one the text ends with (so that `nanGB` is a bad number, not a bad unit, and
    // a number in exponent form, 1e3GB, keeps its `e`); letters after a number are an unknown unit.
    let (number, scale) = match MEMORY_UNITS.iter().find(|(unit, _)| lower.ends_with(unit)) {
        Some((unit, scale)) => (t[..t.len() - unit.len()].trim(), *scale),
        None => (t, 1.0),
    };
    // A whole number of bytes is read exactly: as a float, 2^63 - 1 would round up to 2^63.
    if scale == 1.0 && digits_only(number) {
        return match number.parse::<u64>() {
            Ok(0) => Err(format!("must be a size above 0 such as 24GiB or 80GB, not `{text}`")),
            Ok(bytes) if bytes < 1 << 63 => Ok(bytes),
            _ => Err(format!("`{text}` is 8 EiB (2^63 bytes) or more")),
        };
    }
    let parsed = number.parse::<f64>();
    let before_letters = t.trim_end_matches(|c: char| c.is_ascii_alphabetic()).trim();
    if parsed.is_err() && before_letters.len() < t.len() && before_letters.parse::<f64>().is_ok() {
        return Err(format!("`{text}`: the unit must be B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"));
    }
    match parsed {
        Ok(v) if v.is_finite() && v * scale >= 1.0 && v * scale < 2f64.powi(63) => Ok((v * scale) as u64),
        Ok(v) if v.is_finite() && v * scale >= 2f64.powi(63) => Err(format!("`{text}` is 8 EiB (2^63 bytes) or more")),
        Ok(v) if v.is_finite() && v > 0.0 => Err(format!("`{text}` is less than one byte")),
        _ => Err(format!("must be a size above 0 such as 24GiB or 80GB, not `{text}`")),
    }
}

/// The units of [`memory_size`], lower case, each before any unit that ends it (`kib` before `b`).
const MEMORY_UNITS: [(&str, f64); 9] = [
    ("kib", 1024.0),
    ("mib", 1048576.0),
    ("gib", 1073741824.0),
    ("tib", 1099511627776.0),
    ("kb", 1e3),
    ("mb", 1e6),
    ("gb", 1e9),
    ("tb", 1e12),
    ("b", 1.0),
];

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

    #[test]
    fn memory_sizes_take_decimal_and_binary_units() {
        assert_eq!(memory_size("24GiB"), Ok(24 << 30));
        assert_eq!(memory_size("80 GB"), Ok(80_000_000_000));
        assert_eq!(memory_size("1.5kib"), Ok(1536));
        assert_eq!(memory_size("4096"), Ok(4096));
        // A number in exponent form keeps its `e`.
        assert_eq!(memory_size("1e3GB"), Ok(1_000_000_000_000));
        assert_eq!(memory_size("2.5e1 MiB"), Ok(25 << 20));
        for bad in ["0", "-1GiB", "GiB", "24XB", "nan", "inf", "1e30TiB", "1GBB", "nanGB", "infGB", "0.1B"] {
            assert!(memory_size(bad).is_err(), "{bad}");
        }
        // The error names what is wrong: the unit, the number, or a size under one byte.
        assert!(memory_size("24XB").is_err_and(|e| e.contains("the unit must be")));
        assert!(memory_size("1GBB").is_err_and(|e| e.contains("the unit must be")));
        for bad_number in ["nanGB", "infGB", "xGB", "-2MiB"] {
            let error = memory_size(bad_number).expect_err("a bad number");
            assert!(error.contains("must be a size above 0"), "{bad_number}: {error}");
        }
        assert!(memory_size("0.1B").is_err_and(|e| e.contains("less than one byte")));
        assert_eq!(memory_size("1b"), Ok(1));
        // Too large says so, not that the size must be above 0.
        for huge in ["18446744073709551616", "99999999999TB", "1e30GB"] {
            let error = memory_size(huge).expect_err("too large");
            assert!(error.contains("8 EiB (2^63 bytes) or more"), "{huge}: {error}");
        }
        // The largest size below 2^63 bytes is read exactly, with or without its unit.
        assert_eq!(memory_size("9223372036854775807B"), Ok(i64::MAX as u64));
        assert_eq!(memory_size("9223372036854775807"), Ok(i64::MAX as u64));
        assert!(memory_size("9223372036854775808B").is_err_and(|e| e.contains("or more")));
    }
}
