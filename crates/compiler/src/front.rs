//! The front-end driver: source bytes to a checked model, or diagnostics.

use crate::diag::{Code, Diagnostic};
use crate::elab::{Override, elaborate};
use crate::ir::Model;
use optimus_plan::span::Span;

/// A model file's text as it will be shown in diagnostics.
pub struct Source {
    pub name: String,
    pub text: String,
}

/// What checking produced: the model (if there were no errors) and every diagnostic, warnings included.
pub struct Checked {
    pub model: Option<Model>,
    pub diagnostics: Vec<Diagnostic>,
}

/// Decodes a file's bytes; invalid UTF-8 is an error located at the first bad byte. A leading
/// byte-order mark (which editors on Windows write, and which no one sees) is dropped. A binary file
/// (a NUL byte, or bytes that are not UTF-8 beside control characters) is an error without a
/// snippet: its "first line" would be noise, or escape sequences for the terminal.
pub fn decode(name: &str, bytes: Vec<u8>) -> (Source, Option<Diagnostic>) {
    let bytes = match bytes.strip_prefix(UTF8_BOM) {
        Some(rest) => rest.to_vec(),
        None => bytes,
    };
    let binary = |at: usize, byte: u8| {
        let message = format!("the file is binary, not a model: byte 0x{byte:02x} at offset {at}");
        let d = Diagnostic::error(Code::E0003, message).help("model files are UTF-8 text, as those in examples/ are");
        (Source { name: name.to_string(), text: String::new() }, Some(d))
    };
    match String::from_utf8(bytes) {
        Ok(text) => match first_in_head(text.as_bytes(), |b| b == 0) {
            Some((at, byte)) => binary(at, byte),
            None => (Source { name: name.to_string(), text }, None),
        },
        Err(e) => {
            let is_text_control = |b: u8| matches!(b, b'\t' | b'\n' | b'\x0c' | b'\r');
            let control = |b: u8| (b < 0x20 && !is_text_control(b)) || b == 0x7f;
            if let Some((at, byte)) = first_in_head(e.as_bytes(), control) {
                return binary(at, byte);
            }
            let at = e.utf8_error().valid_up_to();
            let text = String::from_utf8_lossy(e.as_bytes()).into_owned();
            let d = Diagnostic::error(Code::E0003, "the file is not valid UTF-8")
                // The lossy text shows the bad bytes as one U+FFFD, which the label covers whole.
                .primary(
                    Span::new(at, at + char::REPLACEMENT_CHARACTER.len_utf8()),
                    format!("invalid byte at offset {at}"),
                )
                .help("model files must be UTF-8 text");
            (Source { name: name.to_string(), text }, Some(d))
        }
    }
}

/// How much of a file is looked at for signs that it is binary: a NUL byte, or, in a file that is not
/// UTF-8, a control character other than tab, line feed, form feed and carriage return.
const BINARY_PROBE_BYTES: usize = 8192;

/// The first of the first [`BINARY_PROBE_BYTES`] bytes that `wanted` picks, with its offset.
fn first_in_head(bytes: &[u8], wanted: impl Fn(u8) -> bool) -> Option<(usize, u8)> {
    bytes.iter().take(BINARY_PROBE_BYTES).copied().enumerate().find(|&(_, b)| wanted(b))
}

/// UTF-8's byte-order mark, U+FEFF.
const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// An internal error for an IR graph that fails [`crate::ir::validate::validate_graph`] after `stage`.
pub fn ir_problems(graph: &petgraph::graph::DiGraph<crate::ir::Node, u8>, stage: &str) -> Option<Diagnostic> {
    let problems = crate::ir::validate::validate_graph(graph);
    let first = problems.first()?;
    let more = problems.len() - 1;
    let tail = if more > 0 { format!(" (and {more} more)") } else { String::new() };
    Some(Diagnostic::error(Code::E0699, format!("internal error: the IR after {stage} is malformed: {first}{tail}")))
}

/// Parses and elaborates a model source with `--set` overrides.
pub fn check_source(text: &str, overrides: &[Override]) -> Checked {
    let (file, mut diagnostics) = match crate::syntax::parse(text) {
        Ok(v) => v,
        Err(diagnostics) => return Checked { model: None, diagnostics },
    };
    let fatal_parse = diagnostics.iter().any(Diagnostic::is_error);
    match elaborate(&file, overrides) {
        Ok((model, warnings)) => {
            diagnostics.extend(warnings);
            if let Some(d) = ir_problems(&model.graph, "elaboration") {
                diagnostics.push(d);
                return Checked { model: None, diagnostics };
            }
            let model = (!fatal_parse).then_some(model);
            Checked { model, diagnostics }
        }
        Err(more) => {
            diagnostics.extend(more);
            crate::diag::dedup(&mut diagnostics);
            Checked { model: None, diagnostics }
        }
    }
}
