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
/// byte-order mark (which editors on Windows write, and which no one sees) is dropped.
pub fn decode(name: &str, bytes: Vec<u8>) -> (Source, Option<Diagnostic>) {
    let bytes = match bytes.strip_prefix(UTF8_BOM) {
        Some(rest) => rest.to_vec(),
        None => bytes,
    };
    match String::from_utf8(bytes) {
        Ok(text) => (Source { name: name.to_string(), text }, None),
        Err(e) => {
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
