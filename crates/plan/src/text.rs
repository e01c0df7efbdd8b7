//! Text made safe to print and numbers made easy to read: what every layer that reports to a user shares.

/// A count and its noun, singular for one: "1 window", "3 windows", "2 batches".
pub fn plural(n: u64, noun: &str) -> String {
    let ending = if ["ch", "sh", "s", "x"].iter().any(|e| noun.ends_with(e)) { "es" } else { "s" };
    if n == 1 { format!("1 {noun}") } else { format!("{n} {noun}{ending}") }
}

/// Seconds as a person reads a wait or a limit: "0.25 s", "0.001 s" (two significant digits below a
/// second, so that `--timeout 0.001` is not "0.0 s"), "3.3 s", "38 s", "3 min 20 s", "2 h 05 min".
pub fn duration_text(seconds: f64) -> String {
    let seconds = if seconds.is_finite() { seconds.max(0.0) } else { 0.0 };
    let whole = seconds.round() as u64;
    if seconds > 0.0 && seconds < 0.95 {
        let decimals = ((-seconds.log10()).floor() as usize + 2).min(9);
        let text = format!("{seconds:.decimals$}");
        return format!("{} s", text.trim_end_matches('0'));
    }
    match whole {
        0..10 => format!("{seconds:.1} s"),
        10..60 => format!("{whole} s"),
        60..3600 => format!("{} min {:02} s", whole / 60, whole % 60),
        _ => format!("{} h {:02} min", whole / 3600, whole % 3600 / 60),
    }
}

/// `x` as it should be printed with `decimals` decimals: a value that would round to zero is zero, so
/// that no figure reads `-0.0` (f64's sum of nothing is -0.0, and a difference of equal sums can be
/// -1e-17).
pub fn without_negative_zero(x: f64, decimals: i32) -> f64 {
    if x.abs() < 0.5 * 10f64.powi(-decimals) { 0.0 } else { x }
}

/// Formats a count with thousands separators: 124439808 -> "124,439,808".
pub fn group_digits(n: u128) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A name from outside (a file's tensor key, say) made safe to print: control characters and the invisible
/// characters that reorder text are written as escapes (`\u{1b}`), so no key can drive the terminal.
pub fn printable(name: &str) -> std::borrow::Cow<'_, str> {
    escape_where(name, needs_escape)
}

/// Writes `text` to standard error through [`printable_text`]. A failed write (standard error a pipe
/// that was closed, as by `optimusc ... 2>&1 | head -1`) is ignored: there is nowhere left to report it,
/// and it must not end the command as a panic.
pub fn write_stderr(text: &str) {
    use std::io::Write;
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(printable_text(text).as_bytes()).and_then(|()| err.flush());
}

/// [`printable`] for whole messages and reports: line breaks and tabs are kept, every other control or
/// reordering character is escaped. Everything the command line prints goes through it.
pub fn printable_text(text: &str) -> std::borrow::Cow<'_, str> {
    escape_where(text, |c| c != '\n' && c != '\t' && needs_escape(c))
}

fn escape_where(text: &str, escape: impl Fn(char) -> bool) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(&escape) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if escape(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Control characters, and the characters that reorder text.
pub fn needs_escape(c: char) -> bool {
    c.is_control() || reorders_text(c)
}

/// The bidirectional marks, embeddings, overrides and isolates: invisible, they change how a terminal
/// orders the text around them.
pub fn reorders_text(c: char) -> bool {
    matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// A shape as `[a, b, c]`.
pub fn shape_text<T: std::fmt::Display>(shape: &[T]) -> String {
    let dims: Vec<String> = shape.iter().map(ToString::to_string).collect();
    format!("[{}]", dims.join(", "))
}

#[cfg(test)]
mod plural_tests {
    use super::plural;

    #[test]
    fn one_is_singular_and_others_take_their_ending() {
        assert_eq!(plural(1, "window"), "1 window");
        assert_eq!(plural(0, "window"), "0 windows");
        assert_eq!(plural(2, "batch"), "2 batches");
        assert_eq!(plural(1, "batch"), "1 batch");
        assert_eq!(plural(3, "token"), "3 tokens");
    }

    #[test]
    fn durations_read_as_a_person_says_them() {
        use super::duration_text;
        assert_eq!(duration_text(0.04), "0.04 s");
        assert_eq!(duration_text(0.001), "0.001 s");
        assert_eq!(duration_text(0.0015), "0.0015 s");
        assert_eq!(duration_text(0.25), "0.25 s");
        assert_eq!(duration_text(0.5), "0.5 s");
        assert_eq!(duration_text(0.96), "1.0 s");
        assert_eq!(duration_text(3.26), "3.3 s");
        assert_eq!(duration_text(38.4), "38 s");
        assert_eq!(duration_text(200.0), "3 min 20 s");
        assert_eq!(duration_text(7500.0), "2 h 05 min");
        assert_eq!(duration_text(0.0), "0.0 s");
        assert_eq!(duration_text(f64::NAN), "0.0 s");
    }
}

#[cfg(test)]
mod tests {
    use super::without_negative_zero;

    #[test]
    fn what_rounds_to_zero_prints_as_zero_never_minus_zero() {
        let empty: f64 = std::iter::empty::<f64>().sum();
        for (x, decimals) in [(empty, 1), (-1e-17, 3), (-0.04, 1), (0.04, 1)] {
            assert_eq!(
                format!("{:.*}", decimals as usize, without_negative_zero(x, decimals)),
                format!("{:.*}", decimals as usize, 0.0)
            );
        }
        assert_eq!(without_negative_zero(-0.06, 1), -0.06);
        assert_eq!(without_negative_zero(2.5, 0), 2.5);
    }
}
