//! Text made safe to print and numbers made easy to read: what every layer that reports to a user shares.

/// A count and its noun, singular for one: "1 window", "3 windows", "2 batches".
pub fn plural(n: u64, noun: &str) -> String {
    let ending = if ["ch", "sh", "s", "x"].iter().any(|e| noun.ends_with(e)) { "es" } else { "s" };
    if n == 1 { format!("1 {noun}") } else { format!("{n} {noun}{ending}") }
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
}
