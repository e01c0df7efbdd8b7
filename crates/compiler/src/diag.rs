//! Diagnostics: one type for every error the compiler reports, rendered through codespan-reporting.

use codespan_reporting::diagnostic as cs;
use codespan_reporting::files::SimpleFile;
use codespan_reporting::term;
use codespan_reporting::term::termcolor::{Buffer, ColorChoice, StandardStream, WriteColor};
use optimus_plan::span::Span;
use optimus_plan::text::{group_digits, needs_escape, printable, printable_text};

/// How bad a diagnostic is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Severity {
    Warning,
    Error,
}

/// A label under a piece of source text.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Label {
    pub span: Span,
    pub message: String,
    pub primary: bool,
}

/// Every diagnostic code, one variant each (docs/diagnostics.md documents them all): a code is a
/// variant, never a string literal, so a misspelt code does not compile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Code {
    E0001,
    E0002,
    E0003,
    E0004,
    E0101,
    E0102,
    E0103,
    E0104,
    E0105,
    E0106,
    E0107,
    E0201,
    E0202,
    E0203,
    E0301,
    E0302,
    E0401,
    E0402,
    E0501,
    E0601,
    E0602,
    E0699,
    W0001,
    W0002,
}

impl Code {
    /// Every code, in order.
    pub const ALL: [Code; 24] = [
        Code::E0001,
        Code::E0002,
        Code::E0003,
        Code::E0004,
        Code::E0101,
        Code::E0102,
        Code::E0103,
        Code::E0104,
        Code::E0105,
        Code::E0106,
        Code::E0107,
        Code::E0201,
        Code::E0202,
        Code::E0203,
        Code::E0301,
        Code::E0302,
        Code::E0401,
        Code::E0402,
        Code::E0501,
        Code::E0601,
        Code::E0602,
        Code::E0699,
        Code::W0001,
        Code::W0002,
    ];

    /// The code as written in messages and docs (`E0602`).
    pub fn as_str(self) -> &'static str {
        match self {
            Code::E0001 => "E0001",
            Code::E0002 => "E0002",
            Code::E0003 => "E0003",
            Code::E0004 => "E0004",
            Code::E0101 => "E0101",
            Code::E0102 => "E0102",
            Code::E0103 => "E0103",
            Code::E0104 => "E0104",
            Code::E0105 => "E0105",
            Code::E0106 => "E0106",
            Code::E0107 => "E0107",
            Code::E0201 => "E0201",
            Code::E0202 => "E0202",
            Code::E0203 => "E0203",
            Code::E0301 => "E0301",
            Code::E0302 => "E0302",
            Code::E0401 => "E0401",
            Code::E0402 => "E0402",
            Code::E0501 => "E0501",
            Code::E0601 => "E0601",
            Code::E0602 => "E0602",
            Code::E0699 => "E0699",
            Code::W0001 => "W0001",
            Code::W0002 => "W0002",
        }
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A code compares equal to its text (`E0602`), for readers and tests that name codes as text.
impl PartialEq<&str> for Code {
    fn eq(&self, text: &&str) -> bool {
        self.as_str() == *text
    }
}

/// One reported problem: a stable code, a message, labelled spans, notes and an optional fix.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Diagnostic {
    pub severity: Severity,
    pub code: Code,
    pub message: String,
    pub labels: Vec<Label>,
    pub notes: Vec<String>,
    pub help: Option<String>,
}

impl Diagnostic {
    pub fn error(code: Code, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            severity: Severity::Error,
            code,
            message: message.into(),
            labels: Vec::new(),
            notes: Vec::new(),
            help: None,
        }
    }

    pub fn warning(code: Code, message: impl Into<String>) -> Diagnostic {
        Diagnostic { severity: Severity::Warning, ..Diagnostic::error(code, message) }
    }

    /// Adds the primary label: the exact text at fault.
    pub fn primary(mut self, span: Span, message: impl Into<String>) -> Diagnostic {
        self.labels.push(Label { span, message: message.into(), primary: true });
        self
    }

    /// Adds a secondary label: related text, such as a definition.
    pub fn secondary(mut self, span: Span, message: impl Into<String>) -> Diagnostic {
        self.labels.push(Label { span, message: message.into(), primary: false });
        self
    }

    pub fn note(mut self, note: impl Into<String>) -> Diagnostic {
        self.notes.push(note.into());
        self
    }

    pub fn help(mut self, help: impl Into<String>) -> Diagnostic {
        self.help = Some(help.into());
        self
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }

    /// The span of the primary label, if there is one.
    pub fn primary_span(&self) -> Option<Span> {
        self.labels.iter().find(|l| l.primary).map(|l| l.span)
    }

    fn to_codespan(&self) -> cs::Diagnostic<()> {
        let severity = match self.severity {
            Severity::Warning => cs::Severity::Warning,
            Severity::Error => cs::Severity::Error,
        };
        let labels = self
            .labels
            .iter()
            .map(|l| {
                let style = if l.primary { cs::LabelStyle::Primary } else { cs::LabelStyle::Secondary };
                cs::Label::new(style, (), l.span.range()).with_message(printable_text(&l.message))
            })
            .collect();
        let mut notes: Vec<String> = self.notes.iter().map(|n| format!("note: {}", printable_text(n))).collect();
        if let Some(help) = &self.help {
            notes.push(format!("help: {}", printable_text(help)));
        }
        cs::Diagnostic::new(severity)
            .with_code(self.code.as_str())
            .with_message(printable_text(&self.message))
            .with_labels(labels)
            .with_notes(notes)
    }
}

/// Whether rendered output should use colour: never under a non-empty `NO_COLOR` (an empty one is unset,
/// as no-color.org says), with `TERM` unset, empty or `dumb`, or when stderr is not a terminal. Decided
/// here, not by termcolor's `Auto` (which takes an empty `NO_COLOR` as set), with its rule for `TERM`.
pub fn color_choice() -> ColorChoice {
    use std::io::IsTerminal;
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let dumb = std::env::var_os("TERM").is_none_or(|t| t.is_empty() || t == "dumb");
    if no_color || dumb || !std::io::stderr().is_terminal() { ColorChoice::Never } else { ColorChoice::Always }
}

/// Renders diagnostics against one source file into any colour-aware writer.
pub fn render_to(
    writer: &mut dyn WriteColor,
    file_name: &str,
    source: &str,
    diagnostics: &[Diagnostic],
) -> std::io::Result<()> {
    // The source lines shown must not drive the terminal either; the stand-ins keep every byte offset.
    let shown_source = same_length_printable(source);
    let file = SimpleFile::new(printable(file_name), shown_source.as_ref());
    let config = term::Config::default();
    for d in diagnostics {
        let d = clamp_labels(d, source);
        term::emit_to_write_style(writer, &config, &file, &d.to_codespan()).map_err(std::io::Error::other)?;
    }
    Ok(())
}

/// Renders diagnostics to plain text (for tests and logs).
pub fn render_plain(file_name: &str, source: &str, diagnostics: &[Diagnostic]) -> String {
    let mut buffer = Buffer::no_color();
    // Writing into memory cannot fail.
    let _ = render_to(&mut buffer, file_name, source, diagnostics);
    String::from_utf8_lossy(buffer.as_slice()).into_owned()
}

/// Most diagnostics printed to the terminal for one file; the rest are only counted, like rustc does.
pub const MAX_SHOWN_DIAGNOSTICS: usize = 50;

/// Renders diagnostics to standard error, in colour only where that is wanted: the first
/// [`MAX_SHOWN_DIAGNOSTICS`], then one line counting the rest.
pub fn render_stderr(file_name: &str, source: &str, diagnostics: &[Diagnostic]) {
    let mut stream = StandardStream::stderr(color_choice());
    let _ = render_capped_to(&mut stream, file_name, source, diagnostics, MAX_SHOWN_DIAGNOSTICS);
}

/// Renders the first `limit` diagnostics, then says how many errors and warnings were left out.
pub fn render_capped_to(
    writer: &mut dyn WriteColor,
    file_name: &str,
    source: &str,
    diagnostics: &[Diagnostic],
    limit: usize,
) -> std::io::Result<()> {
    let shown = diagnostics.len().min(limit);
    render_to(writer, file_name, source, &diagnostics[..shown])?;
    match not_shown(&diagnostics[shown..]) {
        Some(line) => writeln!(writer, "{line}"),
        None => Ok(()),
    }
}

/// "error: 12 more errors and 1 more warning not shown", or nothing when every diagnostic was shown.
fn not_shown(rest: &[Diagnostic]) -> Option<String> {
    let errors = rest.iter().filter(|d| d.is_error()).count();
    let warnings = rest.len() - errors;
    let count =
        |n: usize, what: &str| format!("{} more {what}{}", group_digits(n as u128), if n == 1 { "" } else { "s" });
    let parts: Vec<String> = [(errors, "error"), (warnings, "warning")]
        .into_iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| count(n, what))
        .collect();
    let severity = if errors > 0 { "error" } else { "warning" };
    (!parts.is_empty()).then(|| format!("{severity}: {} not shown", parts.join(" and ")))
}

/// Keeps every label inside the source and on character boundaries so rendering never fails.
fn clamp_labels(d: &Diagnostic, source: &str) -> Diagnostic {
    let floor = |mut i: usize| {
        i = i.min(source.len());
        while !source.is_char_boundary(i) {
            i -= 1;
        }
        i
    };
    let mut d = d.clone();
    for l in &mut d.labels {
        let start = floor(l.span.start as usize);
        let end = floor(l.span.end as usize).max(start);
        l.span = Span::new(start, end);
    }
    d
}

/// Sorts diagnostics by position and drops exact repeats (a block instantiated many times reports once).
pub fn dedup(diagnostics: &mut Vec<Diagnostic>) {
    let mut seen = std::collections::HashSet::new();
    diagnostics.retain(|d| seen.insert(d.clone()));
    diagnostics.sort_by_key(|d| d.primary_span().map_or((u32::MAX, u32::MAX), |s| (s.start, s.end)));
}

/// Source text to show under a diagnostic: each character [`printable_text`] would escape becomes a
/// visible stand-in of the same UTF-8 length (`?`, `¿` or `\u{fffd}`), so that spans still point right.
fn same_length_printable(source: &str) -> std::borrow::Cow<'_, str> {
    let escape = |c: char| c != '\n' && c != '\t' && c != '\r' && needs_escape(c);
    if !source.chars().any(escape) {
        return std::borrow::Cow::Borrowed(source);
    }
    let stand_in = |c: char| match c.len_utf8() {
        1 => '?',
        2 => '\u{bf}',
        _ => '\u{fffd}',
    };
    std::borrow::Cow::Owned(source.chars().map(|c| if escape(c) { stand_in(c) } else { c }).collect())
}
