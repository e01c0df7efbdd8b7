//! Property tests: no input makes the checker panic, hang or label text outside the source.
//!
//! The inputs: random bytes and text, soups of the language's tokens, mutations of examples/*.opt, and
//! programs generated from a small grammar (so that elaboration, not only parsing, runs deep).
//!
//! Every case runs the same path as `optimusc check`: [`decode`], then [`check_source`], then rendering, on a
//! thread with the binary's 256 MiB stack. A case fails if any stage panics, if it does not finish within its
//! time limit, if a label lies outside the source, if rendering drops a diagnostic, or if the checker fails
//! without saying why (no model and no error). `PROPTEST_CASES` overrides the number of cases per property.

use optimus::diag::{Diagnostic, render_plain};
use optimus::elab::Override;
use optimus::front::{check_source, decode};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestCaseError;
use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

/// The stack the binary gives its checker thread (`STACK_BYTES` in src/main.rs).
const STACK_BYTES: usize = 256 * 1024 * 1024;
/// Longest one small fuzz case may take; they take milliseconds, so reaching this means a hang.
const CASE_LIMIT: Duration = Duration::from_secs(10);
/// Largest graph whose IR a case prints (as `--emit ir` would).
const PRINT_NODES: usize = 100_000;
/// Longest one extreme input (100,000-deep nesting, 10,000 blocks, ...) may take.
const EXTREME_LIMIT: Duration = Duration::from_secs(10);

// ---- running one case -------------------------------------------------------------------------

/// What one run of the checker produced, as seen from outside.
#[derive(Debug)]
struct Report {
    /// The codes of the error diagnostics, in order.
    errors: Vec<&'static str>,
    /// The checked model's parameter count, when the model checked.
    parameters: Option<u128>,
    elapsed: Duration,
}

impl Report {
    fn has_error(&self, code: &str) -> bool {
        self.errors.contains(&code)
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_string()
    }
}

/// Checks `bytes` as `optimusc check` would, on a thread with the binary's stack, and validates the result.
/// Returns why the case failed: a panic, a hang (no answer within `limit`), or a broken diagnostic.
fn check_bytes(bytes: Vec<u8>, overrides: Vec<Override>, limit: Duration) -> Result<Report, String> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("fuzz-check".to_string())
        .stack_size(STACK_BYTES)
        .spawn(move || {
            // The receiver may have given up on a hang; nothing is left to tell then.
            let _ = tx.send(run_and_validate(bytes, &overrides));
        })
        .map_err(|e| format!("cannot spawn the checker thread: {e}"))?;
    match rx.recv_timeout(limit) {
        Ok(result) => result,
        // The thread is left running: a hung checker cannot be stopped from outside.
        Err(RecvTimeoutError::Timeout) => Err(format!("hang: the checker gave no answer within {limit:?}")),
        Err(RecvTimeoutError::Disconnected) => Err("the checker thread ended without an answer".to_string()),
    }
}

fn run_and_validate(bytes: Vec<u8>, overrides: &[Override]) -> Result<Report, String> {
    let start = Instant::now();
    let checked = catch_unwind(AssertUnwindSafe(|| {
        let (source, bad_utf8) = decode("fuzz.opt", bytes);
        if let Some(d) = bad_utf8 {
            // The binary stops at a decoding error.
            return (source, vec![d], None);
        }
        let checked = check_source(&source.text, overrides);
        // What `optimusc check` prints for a model that checks: its parameter count and, with --emit ir, its IR.
        let parameters = checked.model.as_ref().map(|m| {
            // Printing is linear in the graph; skip it for the largest legal graphs to keep cases quick.
            if m.graph.node_count() <= PRINT_NODES {
                let ir = optimus::ir::print::print_model(m, &source.text);
                assert!(ir.contains("output "), "the IR of a checked model lists no output:\n{ir}");
            }
            m.parameter_count()
        });
        (source, checked.diagnostics, parameters)
    }));
    let (source, diagnostics, parameters) =
        checked.map_err(|p| format!("the checker panicked: {}", panic_message(p.as_ref())))?;
    let elapsed = start.elapsed();

    validate_diagnostics(&source.text, &diagnostics)?;
    let errors: Vec<&'static str> = diagnostics.iter().filter(|d| d.is_error()).map(|d| d.code.as_str()).collect();
    if parameters.is_none() && errors.is_empty() {
        return Err(format!("the model did not check, but no error says why: {diagnostics:#?}"));
    }
    if parameters.is_some() && !errors.is_empty() {
        return Err(format!("the model checked despite errors {errors:?}"));
    }

    let rendered = catch_unwind(AssertUnwindSafe(|| render_plain(&source.name, &source.text, &diagnostics)))
        .map_err(|p| format!("rendering panicked: {}", panic_message(p.as_ref())))?;
    for d in &diagnostics {
        // The rendering escapes control characters (a NUL in a quoted name shows as `\u{0}`).
        let first_line = d.message.lines().next().unwrap_or_default();
        let header = format!("[{}]: {}", d.code, optimus::plan::text::printable_text(first_line));
        if !rendered.contains(&header) {
            return Err(format!("the rendering lacks `{header}`:\n{rendered}"));
        }
    }

    Ok(Report { errors, parameters, elapsed })
}

/// Every diagnostic has a code and a message, and every label lies within the source, on character boundaries.
fn validate_diagnostics(text: &str, diagnostics: &[Diagnostic]) -> Result<(), String> {
    for d in diagnostics {
        let code_ok = !d.code.as_str().is_empty() && d.code.as_str().chars().all(|c| c.is_ascii_alphanumeric());
        if !code_ok || d.message.trim().is_empty() {
            return Err(format!("diagnostic without a code or message: {d:?}"));
        }
        for label in &d.labels {
            let (start, end) = (label.span.start as usize, label.span.end as usize);
            if start > end || end > text.len() || !text.is_char_boundary(start) || !text.is_char_boundary(end) {
                return Err(format!(
                    "label {start}..{end} of {} `{}` lies outside the {}-byte source or inside a character",
                    d.code,
                    d.message,
                    text.len()
                ));
            }
        }
    }
    Ok(())
}

/// Runs one proptest case; every broken rule is a test failure.
fn fuzz_case(bytes: Vec<u8>, overrides: Vec<Override>) -> Result<Report, TestCaseError> {
    check_bytes(bytes, overrides, CASE_LIMIT).map_err(TestCaseError::fail)
}

/// Checks one extreme input; panics (failing the test) on any broken rule.
fn check_extreme(text: &str) -> Report {
    check_with(text, Vec::new())
}

fn check_with(text: &str, overrides: Vec<Override>) -> Report {
    let shown: String = text.chars().take(120).collect();
    match check_bytes(text.as_bytes().to_vec(), overrides, EXTREME_LIMIT) {
        Ok(report) => report,
        Err(why) => panic!("{why}\ninput ({} bytes) starts: {shown:?}", text.len()),
    }
}

/// Asserts that checking `text` fails with error `code` within the time limit.
#[track_caller]
fn assert_rejected(text: &str, code: &str) -> Report {
    let report = check_extreme(text);
    assert!(report.parameters.is_none(), "an invalid model checked");
    assert!(report.has_error(code), "expected error {code}, got {:?}", report.errors);
    report
}

// ---- inputs: the language's vocabulary ----------------------------------------------------------

const KEYWORDS: &[&str] =
    &["model", "config", "input", "block", "layer", "repeat", "forward", "output", "return", "true", "false"];

/// Names used in the examples: config values, inputs, blocks, layers, operators, keyword arguments, dtypes.
const NAMES: &[&str] = &[
    "vocab",
    "context",
    "seq",
    "batch",
    "layers",
    "heads",
    "hidden",
    "head",
    "ffn",
    "eps",
    "pdrop",
    "types",
    "tokens",
    "targets",
    "segments",
    "x",
    "y",
    "a",
    "logits",
    "loss",
    "qkv",
    "q",
    "k",
    "v",
    "scores",
    "probs",
    "ids",
    "kinds",
    "residual",
    "width",
    "Attention",
    "Mlp",
    "Layer",
    "Embeddings",
    "SelfAttention",
    "Output",
    "Encoder",
    "wte",
    "wpe",
    "h",
    "ln_f",
    "lm_head",
    "c_attn",
    "c_proj",
    "c_fc",
    "ln_1",
    "ln_2",
    "attn",
    "mlp",
    "dense",
    "LayerNorm",
    "linear",
    "layernorm",
    "rms_norm",
    "embedding",
    "position_embedding",
    "gelu",
    "silu",
    "mul",
    "softmax",
    "dropout",
    "self_attention",
    "rotary",
    "kv_heads",
    "theta",
    "cross_entropy",
    "matmul",
    "reshape",
    "transpose",
    "scale",
    "causal_mask",
    "select",
    "add",
    "sqrt",
    "min",
    "max",
    "p",
    "causal",
    "approx",
    "bias",
    "tied",
    "std",
    "checkpoint_prefix",
    "i32",
    "i64",
    "f32",
    "f16",
    "bf16",
];

const PUNCTUATION: &[&str] = &["+", "-", "*", "/", "=", ":", ",", "(", ")", "[", "]", "{", "}", ";"];

const NUMBERS: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "4",
    "8",
    "16",
    "101",
    "1_000",
    "0.5",
    "0.0",
    "1e-12",
    "0.000000000001",
    "1e999",
    "1.7976931348623157e308",
    "4294967296",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551616",
    "1000000000000000000000000000000",
    "340282366920938463463374607431768211456",
    "00",
    "1__",
    "3.",
    "1e",
    ".5",
];

const STRINGS: &[&str] =
    &["\"tanh\"", "\"none\"", "\"\"", "\"transformer.\"", "\"bert.embeddings.word_embeddings\"", "\"open", "\"ü€😀\""];

const TRIVIA: &[&str] = &[" ", "\n", "\t", "\r\n", "# a comment\n", "#", "\u{feff}", "\u{a0}", "é", "\0"];

/// Replacements for a number in a mutated example.
const NUMBER_SWAPS: &[&str] = &[
    "0",
    "-1",
    "1",
    "3",
    // Large enough to multiply the work, small enough that a legal model stays quick: `layers = 65536`
    // elaborates tiny.opt to 1.3 million operators, which takes seconds.
    "1000",
    "4294967296",
    "9223372036854775807",
    "9223372036854775808",
    "1000000000000000000000000000000",
    "0.0",
    "1e999",
];

const EXAMPLES: &[(&str, &str)] = &[
    ("bert", include_str!("../examples/bert.opt")),
    ("gpt2", include_str!("../examples/gpt2.opt")),
    ("gpt2_manual_attention", include_str!("../examples/gpt2_manual_attention.opt")),
    ("gpt3", include_str!("../examples/gpt3.opt")),
    ("tiny", include_str!("../examples/tiny.opt")),
];

fn token() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => prop::sample::select(KEYWORDS).prop_map(str::to_string),
        3 => prop::sample::select(NAMES).prop_map(str::to_string),
        4 => prop::sample::select(PUNCTUATION).prop_map(str::to_string),
        2 => prop::sample::select(NUMBERS).prop_map(str::to_string),
        1 => any::<u64>().prop_map(|n| n.to_string()),
        1 => prop::sample::select(STRINGS).prop_map(str::to_string),
        1 => prop::sample::select(TRIVIA).prop_map(str::to_string),
        1 => "[a-zA-Z_][a-zA-Z0-9_]{0,12}",
    ]
}

/// `--set` overrides: config names (real or not) with values of every type and size.
fn overrides() -> impl Strategy<Value = Vec<Override>> {
    let name = prop::sample::select(&["hidden", "heads", "layers", "vocab", "seq", "eps", "pdrop", "nope", "x"][..]);
    let value = prop::sample::select(
        &["2", "0", "-1", "1.5", "true", "abc", "", "1_0", "99999999999999999999", "1e999", "NaN", "inf"][..],
    );
    prop::collection::vec((name, value).prop_map(|(n, v)| Override { name: n.to_string(), value: v.to_string() }), 0..3)
}

// ---- inputs: mutations of the examples ----------------------------------------------------------

/// One edit of a file's bytes; positions are taken modulo the length at the time of the edit.
#[derive(Clone, Debug)]
enum Mutation {
    Delete {
        at: usize,
        len: usize,
    },
    Duplicate {
        from: usize,
        len: usize,
        to: usize,
    },
    Insert {
        at: usize,
        token: String,
    },
    Swap {
        a: usize,
        b: usize,
        len: usize,
    },
    /// Replaces the `nth` run of digits.
    Number {
        nth: usize,
        with: &'static str,
    },
    /// Replaces the `nth` name with another one.
    Rename {
        nth: usize,
        with: &'static str,
    },
    Truncate {
        at: usize,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let at = any::<usize>();
    prop_oneof![
        1 => (at, 1..64usize).prop_map(|(at, len)| Mutation::Delete { at, len }),
        1 => (at, 1..64usize, any::<usize>()).prop_map(|(from, len, to)| Mutation::Duplicate { from, len, to }),
        1 => (at, token()).prop_map(|(at, token)| Mutation::Insert { at, token }),
        1 => (at, any::<usize>(), 1..32usize).prop_map(|(a, b, len)| Mutation::Swap { a, b, len }),
        2 => (any::<usize>(), prop::sample::select(NUMBER_SWAPS)).prop_map(|(nth, with)| Mutation::Number { nth, with }),
        2 => (any::<usize>(), prop::sample::select(NAMES)).prop_map(|(nth, with)| Mutation::Rename { nth, with }),
        1 => at.prop_map(|at| Mutation::Truncate { at }),
    ]
}

/// The byte ranges of the maximal runs of bytes satisfying `first` then `rest`.
fn runs(bytes: &[u8], first: impl Fn(u8) -> bool, rest: impl Fn(u8) -> bool) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let preceded = i > 0 && rest(bytes[i - 1]);
        if first(bytes[i]) && !preceded {
            let start = i;
            i += 1;
            while i < bytes.len() && rest(bytes[i]) {
                i += 1;
            }
            out.push((start, i));
        } else {
            i += 1;
        }
    }
    out
}

fn replace_nth(bytes: &mut Vec<u8>, found: &[(usize, usize)], nth: usize, with: &str) {
    if let Some(&(start, end)) = found.get(nth % found.len().max(1)) {
        bytes.splice(start..end, with.bytes());
    }
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let len = bytes.len();
    let pos = |p: usize| p % (len + 1);
    match m {
        Mutation::Delete { at, len: n } => {
            let start = pos(*at);
            bytes.drain(start..(start + n).min(len));
        }
        Mutation::Duplicate { from, len: n, to } => {
            let start = pos(*from);
            let piece = bytes[start..(start + n).min(len)].to_vec();
            let to = pos(*to);
            bytes.splice(to..to, piece);
        }
        Mutation::Insert { at, token } => {
            let at = pos(*at);
            bytes.splice(at..at, format!(" {token} ").into_bytes());
        }
        Mutation::Swap { a, b, len: n } => {
            let (mut a, mut b) = (pos(*a), pos(*b));
            if a > b {
                std::mem::swap(&mut a, &mut b);
            }
            // Two non-overlapping ranges a..a+n and b..b+m.
            let n1 = (*n).min(b - a);
            let n2 = (*n).min(len - b);
            let first = bytes[a..a + n1].to_vec();
            let second = bytes[b..b + n2].to_vec();
            bytes.splice(b..b + n2, first);
            bytes.splice(a..a + n1, second);
        }
        Mutation::Number { nth, with } => {
            let found = runs(bytes, |c| c.is_ascii_digit(), |c| c.is_ascii_digit() || c == b'_');
            replace_nth(bytes, &found, *nth, with);
        }
        Mutation::Rename { nth, with } => {
            let found =
                runs(bytes, |c| c.is_ascii_alphabetic() || c == b'_', |c| c.is_ascii_alphanumeric() || c == b'_');
            replace_nth(bytes, &found, *nth, with);
        }
        Mutation::Truncate { at } => bytes.truncate(pos(*at)),
    }
}

// ---- inputs: generated programs -----------------------------------------------------------------

/// Draws choices from a list of random numbers; past its end every choice is 0. Choice 0 is always the
/// simplest, well-formed option, so proptest's shrinking (towards 0) walks towards a valid program.
struct Choices<'a> {
    draws: &'a [u32],
    next: usize,
}

impl Choices<'_> {
    /// A number in `0..n`.
    fn pick(&mut self, n: usize) -> usize {
        let draw = self.draws.get(self.next).copied().unwrap_or(0);
        self.next += 1;
        draw as usize % n.max(1)
    }

    /// One of `options`; the first is the default.
    fn one<'s>(&mut self, options: &[&'s str]) -> &'s str {
        options[self.pick(options.len())]
    }

    /// True `percent` times in 100 (never for choice 0).
    fn rarely(&mut self, percent: usize) -> bool {
        self.pick(100) >= 100 - percent
    }

    /// The default most of the time, otherwise one of `odd`.
    fn usually<'s>(&mut self, default: &'s str, percent: usize, odd: &[&'s str]) -> &'s str {
        if self.rarely(percent) { self.one(odd) } else { default }
    }
}

/// Strange but syntactically fine stand-ins for a size.
const ODD_SIZES: &[&str] = &[
    "0",
    "-1",
    "3",
    "2.5",
    "true",
    "\"s\"",
    "nope",
    "hidden * hidden * hidden * hidden * hidden",
    "9223372036854775807",
    "4294967296",
    "vocab",
    "[2, 2]",
    "[]",
    "sqrt(16)",
    "min(4, hidden)",
    "max(heads, 0)",
];

/// A layer of a generated block, and how the forward applies it to `{}` (a `[batch, seq, d]` tensor).
struct GenLayer {
    decls: Vec<String>,
    apply: String,
}

fn gen_layer(c: &mut Choices, name: &str, d: &str, blocks_after: &[usize]) -> GenLayer {
    let size = |c: &mut Choices| c.usually(d, 5, ODD_SIZES).to_string();
    let kinds = if blocks_after.is_empty() { 4 } else { 6 };
    match c.pick(kinds) {
        0 => {
            GenLayer { decls: vec![format!("layer {name} = linear({d}, {})", size(c))], apply: format!("{name}({{}})") }
        }
        1 => {
            let eps = c.usually("eps", 5, &["-1.0", "0", "\"e\"", "1e999"]);
            let norm = c.one(&["layernorm", "rms_norm"]);
            GenLayer {
                decls: vec![format!("layer {name} = {norm}({}, eps: {eps})", size(c))],
                apply: format!("{name}({{}})"),
            }
        }
        2 => {
            let (up, down) = (format!("{name}_fc"), format!("{name}_proj"));
            let ffn = c.usually("ffn", 5, ODD_SIZES);
            let act = c.one(&[
                "gelu({})",
                "gelu({}, approx: \"tanh\")",
                "softmax({})",
                "dropout({}, p: pdrop)",
                "silu({}) * {}",
                "mul(silu({}), {})",
            ]);
            let std = c.usually("0.02", 10, &["-1.0", "0.02 / sqrt(2 * layers)", "\"x\""]);
            GenLayer {
                decls: vec![
                    format!("layer {up} = linear({d}, {ffn})"),
                    format!("layer {down} = linear({ffn}, {}, std: {std})", size(c)),
                ],
                apply: format!("{down}({})", act.replace("{}", &format!("{up}({{}})"))),
            }
        }
        3 => {
            let (qkv, proj) = (format!("{name}_qkv"), format!("{name}_out"));
            let heads = c.usually("heads", 5, ODD_SIZES);
            let causal = c.usually("", 20, &[", causal: true", ", causal: false", ", causal: 1"]);
            GenLayer {
                decls: vec![
                    format!("layer {qkv} = linear({d}, [3, {heads}, head])"),
                    format!("layer {proj} = linear({d}, {d})"),
                ],
                apply: format!("{proj}(self_attention({qkv}({{}}), heads: {heads}{causal}))"),
            }
        }
        4 => {
            let b = blocks_after[c.pick(blocks_after.len())];
            let args = c.usually("", 20, &["hidden", "d: hidden", "1, 2", "x: 1"]);
            GenLayer { decls: vec![format!("layer {name} = B{b}({args})")], apply: format!("{name}({{}})") }
        }
        _ => {
            let b = blocks_after[c.pick(blocks_after.len())];
            let count = c.one(&["2", "1", "3", "layers"]);
            let count = c.usually(count, 10, &["0", "-1", "100001", "1000000000000", "2.0", "\"2\""]);
            GenLayer { decls: vec![format!("layer {name} = repeat({count}) B{b}()")], apply: format!("{name}({{}})") }
        }
    }
}

/// The statements of a forward that maps `x` through `layers`, ending with `x` transformed.
fn gen_body(c: &mut Choices, layers: &[GenLayer], out: &mut String) {
    for layer in layers {
        let residual = c.pick(2) == 1;
        let applied = layer.apply.replace("{}", "x");
        if residual {
            out.push_str(&format!("    x = x + {applied}\n"));
        } else {
            out.push_str(&format!("    x = {applied}\n"));
        }
        if c.rarely(10) {
            let stmt = c.one(&[
                "x = scale(x, 0.5)",
                "x = dropout(x, p: 1.5)",
                "x = add(x, x)",
                "y = transpose(x, 1, 2)",
                "y = matmul(x, transpose(x, 1, 2))",
                "y = causal_mask(matmul(x, transpose(x, -1, -2)))",
                "y = select(x, 0, 0)",
                "y = select(x, 5, 0)",
                "x = rotary(x, heads: 2)",
                "x = rotary(x, heads: heads, theta: 0.0)",
                "y = rotary(select(x, 0, 0), heads: 1, theta: 500000.0)",
                "y = self_attention(x, x, x, heads: 2, kv_heads: 1)",
                "y = self_attention(x, select(x, 0, 0), x, heads: 4, kv_heads: 3)",
                "y = reshape(x, [batch, seq, hidden])",
                "y = reshape(x, [batch * seq * hidden])",
                "x = reshape(x, [0])",
                "x = x * 2",
                "x = x * x",
                "x = mul(x, x)",
                "y = x * transpose(x, 1, 2)",
                "x = mul(x, 2)",
                "x = -x",
                "x = x / x",
                "x = undefined(x)",
                "x = gelu(x, approx: \"fast\")",
                "x = cross_entropy(x, x)",
                "x = hidden",
                "output z = x",
            ]);
            out.push_str(&format!("    {stmt}\n"));
        }
    }
}

/// A random model in the shape of the examples: config, inputs, blocks (that may use later blocks), root
/// layers and a forward. Mostly well-formed, so that elaboration runs deep; sometimes not, in every place.
fn gen_program(draws: &[u32]) -> String {
    let mut c = Choices { draws, next: 0 };
    let mut out = String::new();
    if c.pick(2) == 1 {
        let opts = c.usually("", 20, &["(checkpoint_prefix: \"t.\")", "(checkpoint_prefix: 1)", "(other: 1)", "(1)"]);
        out.push_str(&format!("model gen{opts}\n"));
    }

    // Every hidden size here divides by every head count.
    let hidden = c.one(&["8", "4", "16", "12"]);
    let heads = c.one(&["2", "1", "4"]);
    out.push_str("config {\n");
    out.push_str(&format!("  vocab = {}\n", c.usually("11", 5, ODD_SIZES)));
    out.push_str(&format!("  context = {}\n", c.usually("8", 5, ODD_SIZES)));
    let seq = c.one(&["4", "8", "2", "1"]);
    out.push_str(&format!("  seq = {}\n", c.usually(seq, 5, &["9", "0"])));
    out.push_str(&format!("  batch = {}\n", c.usually("2", 5, ODD_SIZES)));
    out.push_str(&format!("  layers = {}\n", c.one(&["2", "1", "3"])));
    out.push_str(&format!("  heads = {}\n", c.usually(heads, 5, ODD_SIZES)));
    out.push_str(&format!("  hidden = {}\n", c.usually(hidden, 5, ODD_SIZES)));
    out.push_str(&format!("  head = {}\n", c.usually("hidden / heads", 5, &["hidden / 0", "hidden / 3", "heads"])));
    out.push_str(&format!("  ffn = {}\n", c.usually("4 * hidden", 5, ODD_SIZES)));
    out.push_str(&format!("  eps = {}\n", c.usually("0.00001", 5, &["1e-12", "0", "-0.5", "true"])));
    out.push_str(&format!("  pdrop = {}\n", c.usually("0.1", 5, &["0.0", "1.0", "-0.1", "\"p\""])));
    if c.rarely(5) {
        out.push_str(&format!("  {} = 1\n", c.one(&["hidden", "later", "tokens", "x"])));
    }
    out.push_str("}\n");

    let ids = c.usually("i32", 5, &["i64", "f32", "bf16", "u8"]);
    out.push_str(&format!("input tokens: {ids}[batch, seq]\n"));
    let targets = c.usually("i32[batch, seq]", 5, &["f32[batch, seq]", "i32[seq]", "i32[batch, seq, 1]", "i32[]"]);
    out.push_str(&format!("input targets: {targets}\n"));

    // Blocks B0..Bn; block i may use the blocks after it (rarely, any block: recursion).
    let blocks = c.pick(4);
    for i in 0..blocks {
        let after: Vec<usize> = if c.rarely(3) { (0..blocks).collect() } else { (i + 1..blocks).collect() };
        let params = c.one(&["", "(d = hidden)", "(d = hidden, e = 1)"]);
        let params = c.usually(params, 5, &["(d)", "(d = hidden, d = 2)", "(d = e, e = 1)"]);
        let d = if params.is_empty() { "hidden" } else { "d" };
        out.push_str(&format!("block B{i}{params} {{\n"));
        let mut layers = Vec::new();
        for j in 0..1 + c.pick(3) {
            let name = if c.rarely(3) { "l0".to_string() } else { format!("l{j}") };
            let layer = gen_layer(&mut c, &name, d, &after);
            for decl in &layer.decls {
                out.push_str(&format!("  {decl}\n"));
            }
            layers.push(layer);
        }
        let fparams = c.usually("(x)", 5, &["()", "(x, y)", "(x, x)"]);
        out.push_str(&format!("  forward{fparams} {{\n"));
        gen_body(&mut c, &layers, &mut out);
        out.push_str(&format!(
            "    {}\n  }}\n}}\n",
            c.usually("return x", 5, &["output x = x", "x = x", "return hidden"])
        ));
    }

    // The root: embeddings, some layers, the LM head and the loss.
    let root_blocks: Vec<usize> = (0..blocks).collect();
    out.push_str(&format!("layer wte = embedding(vocab, {})\n", c.usually("hidden", 5, ODD_SIZES)));
    let positions = c.pick(2) == 0;
    if positions {
        out.push_str("layer wpe = position_embedding(context, hidden)\n");
    }
    let mut layers = Vec::new();
    for j in 0..c.pick(4) {
        let layer = gen_layer(&mut c, &format!("r{j}"), "hidden", &root_blocks);
        for decl in &layer.decls {
            out.push_str(&format!("{decl}\n"));
        }
        layers.push(layer);
    }
    let head = c.usually(
        "linear(hidden, vocab, bias: false, tied: wte)",
        10,
        &[
            "linear(hidden, vocab)",
            "linear(vocab, hidden, tied: wte)",
            "linear(hidden, vocab, tied: \"wte\")",
            "linear(hidden, vocab, tied: r0)",
            "linear(hidden, vocab, bias: 1)",
        ],
    );
    out.push_str(&format!("layer lm_head = {head}\n"));

    out.push_str("forward {\n");
    let embed = if positions { "wte(tokens) + wpe(tokens)" } else { "wte(tokens)" };
    out.push_str(&format!("    x = dropout({embed}, p: pdrop)\n"));
    gen_body(&mut c, &layers, &mut out);
    out.push_str("    logits = lm_head(x)\n");
    let loss = c.usually("cross_entropy(logits, targets)", 5, &["cross_entropy(targets, logits)", "logits", "1", "x"]);
    out.push_str(&format!("    output loss = {loss}\n"));
    if c.rarely(5) {
        out.push_str(&format!(
            "    {}\n",
            c.one(&["output loss = x", "output logits = logits", "return x", "output n = hidden"])
        ));
    }
    out.push_str("}\n");
    if c.rarely(3) {
        out.push_str(c.one(&["forward { output y = tokens }\n", "layer wte = embedding(1, 1)\n", "block B0 { }\n"]));
    }
    out
}

// ---- the properties -----------------------------------------------------------------------------

/// A property's configuration with `cases` cases (`PROPTEST_CASES` overrides it). The counts below are set so
/// that the whole file takes about half a minute on two cores with `opt-level = 1`; the cheaper inputs get more.
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        // A hang costs CASE_LIMIT per shrinking step; stop shrinking after a while.
        max_shrink_time: 120_000,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(8000))]

    #[test]
    fn arbitrary_bytes_never_break_the_checker(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        fuzz_case(bytes, Vec::new())?;
    }
}

proptest! {
    #![proptest_config(config(5000))]

    #[test]
    fn arbitrary_text_never_breaks_the_checker(text in any::<String>()) {
        fuzz_case(text.into_bytes(), Vec::new())?;
    }
}

proptest! {
    #![proptest_config(config(8000))]

    #[test]
    fn token_soups_never_break_the_checker(
        tokens in prop::collection::vec((token(), prop::sample::select(&["", " ", "\n"][..])), 0..160),
    ) {
        let text: String = tokens.iter().flat_map(|(t, sep)| [t.as_str(), sep]).collect();
        fuzz_case(text.into_bytes(), Vec::new())?;
    }
}

proptest! {
    #![proptest_config(config(12_000))]

    #[test]
    fn mutated_examples_never_break_the_checker(
        example in prop::sample::select(EXAMPLES),
        mutations in prop::collection::vec(mutation(), 1..5),
        overrides in overrides(),
    ) {
        let mut bytes = example.1.as_bytes().to_vec();
        for m in &mutations {
            apply(&mut bytes, m);
        }
        fuzz_case(bytes, overrides)?;
    }
}

proptest! {
    #![proptest_config(config(16_000))]

    #[test]
    fn generated_programs_never_break_the_checker(
        draws in prop::collection::vec(any::<u32>(), 0..200),
        overrides in overrides(),
    ) {
        fuzz_case(gen_program(&draws).into_bytes(), overrides)?;
    }
}

// ---- the generators themselves ------------------------------------------------------------------

#[test]
fn every_example_checks_unmutated() {
    for (name, text) in EXAMPLES {
        let report = check_extreme(text);
        assert!(report.parameters.is_some_and(|p| p > 0), "{name}.opt does not check: {:?}", report.errors);
    }
}

#[test]
fn the_simplest_generated_program_checks() {
    // All choices 0: the generator's baseline must be a valid model, or most generated cases stop early.
    let text = gen_program(&[]);
    let report = check_extreme(&text);
    assert!(report.parameters.is_some(), "the baseline program does not check: {:?}\n{text}", report.errors);
}

#[test]
fn generated_programs_often_check() {
    // Deep elaboration paths are only reached if many generated programs are valid.
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let draws = prop::collection::vec(any::<u32>(), 0..200);
    let mut valid = 0;
    for _ in 0..200 {
        let tree = draws.new_tree(&mut runner).expect("a draw");
        let text = gen_program(&tree.current());
        if check_extreme(&text).parameters.is_some() {
            valid += 1;
        }
    }
    // About 90 of these 200 check today.
    assert!(valid >= 60, "only {valid} of 200 generated programs check");
}

#[test]
fn mutations_edit_what_they_say() {
    let mut bytes = b"a = 12 + 3_4".to_vec();
    apply(&mut bytes, &Mutation::Number { nth: 1, with: "-1" });
    assert_eq!(bytes, b"a = 12 + -1");
    apply(&mut bytes, &Mutation::Rename { nth: 0, with: "hidden" });
    assert_eq!(bytes, b"hidden = 12 + -1");
    apply(&mut bytes, &Mutation::Swap { a: 0, b: 9, len: 2 });
    assert_eq!(bytes, b"12dden = hi + -1");
    apply(&mut bytes, &Mutation::Delete { at: 0, len: 2 });
    assert_eq!(bytes, b"dden = hi + -1");
    apply(&mut bytes, &Mutation::Duplicate { from: 0, len: 4, to: 14 });
    assert_eq!(bytes, b"dden = hi + -1dden");
    apply(&mut bytes, &Mutation::Truncate { at: 4 });
    assert_eq!(bytes, b"dden");
}

// ---- extreme inputs -----------------------------------------------------------------------------

/// A valid model around one extra config entry `extra` (which may be anything).
fn with_config(extra: &str) -> String {
    format!("config {{\n  hidden = 4\n  {extra}\n}}\ninput x: f32[2, hidden]\nforward {{ output y = x }}\n")
}

/// A valid model that declares `layers` (one per line) at the root.
fn with_layers(blocks: &str, layers: &str) -> String {
    format!("config {{ hidden = 4 }}\ninput x: f32[2, hidden]\n{blocks}\n{layers}\nforward {{ output y = x }}\n")
}

const DEEP: usize = 100_000;

#[test]
fn the_minimal_model_checks() {
    let report = check_extreme(&with_config("a = 1"));
    assert_eq!(report.errors, Vec::<&str>::new());
    assert_eq!(report.parameters, Some(0));
}

#[test]
fn empty_and_blank_files_are_errors() {
    for text in ["", " ", "\n\n", "# only a comment", ";;;"] {
        assert_rejected(text, "E0401");
    }
}

#[test]
fn non_utf8_bytes_are_an_error() {
    for bytes in [&b"\xff"[..], b"model m\n\xc3\x28", b"config { a = 1 }\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"] {
        let report = check_bytes(bytes.to_vec(), Vec::new(), EXTREME_LIMIT).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(report.errors, vec!["E0003"], "{bytes:?}");
    }
}

#[test]
fn brackets_nested_100_000_deep_are_rejected() {
    for (open, close) in [("(", ")"), ("[", "]"), ("{", "}")] {
        // Bare, and inside a config value where brackets are legal.
        assert_rejected(&open.repeat(DEEP), "E0002");
        let value = format!("a = {}1{}", open.repeat(DEEP), close.repeat(DEEP));
        let report = assert_rejected(&with_config(&value), "E0002");
        assert!(report.elapsed < EXTREME_LIMIT);
    }
    // Nested calls and lists, mixed.
    let value = format!("a = {}1{}", "f([".repeat(DEEP / 2), "])".repeat(DEEP / 2));
    assert_rejected(&with_config(&value), "E0002");
}

#[test]
fn nesting_at_the_limit_is_accepted() {
    let limit = optimus::syntax::parser::MAX_NESTING;
    // The config block's brace is one level, so the value may nest one less.
    let value = format!("a = {}1{}", "(".repeat(limit - 1), ")".repeat(limit - 1));
    let report = check_extreme(&with_config(&value));
    assert_eq!(report.errors, Vec::<&str>::new());
}

#[test]
fn minus_signs_repeated_100_000_times_are_rejected() {
    assert_rejected(&with_config(&format!("a = {}1", "-".repeat(DEEP))), "E0002");
    assert_rejected(&with_config(&format!("a = {}1", "- ".repeat(DEEP))), "E0002");
    assert_rejected(&with_config(&format!("a = 1{}", " - -1".repeat(DEEP))), "E0002");
    assert_rejected(&"-".repeat(DEEP), "E0002");
}

#[test]
fn an_expression_with_100_000_operators_is_rejected() {
    let sum = format!("a = 1{}", " + 1".repeat(DEEP));
    assert_rejected(&with_config(&sum), "E0002");
    let mixed = format!("a = 1{}", " * 1 - 1 / 1 + 1".repeat(DEEP / 4));
    assert_rejected(&with_config(&mixed), "E0002");
    // In a forward, on tensors.
    let text = format!("input x: f32[2]\nforward {{ output y = x{} }}\n", " + x".repeat(DEEP));
    assert_rejected(&text, "E0002");
}

#[test]
fn an_expression_at_the_operator_limit_is_accepted() {
    let limit = optimus::syntax::parser::MAX_OPERATORS;
    let report = check_extreme(&with_config(&format!("a = 1{}", " + 1".repeat(limit))));
    assert_eq!(report.errors, Vec::<&str>::new());
}

/// Blocks `B0` .. `B{n-1}`, each containing the next; the last holds a linear.
fn chain_of_blocks(n: usize) -> String {
    let mut blocks = String::new();
    for i in 0..n - 1 {
        blocks.push_str(&format!("block B{i} {{ layer l = B{}() forward(x) {{ return l(x) }} }}\n", i + 1));
    }
    blocks.push_str(&format!("block B{} {{ layer l = linear(hidden, hidden) forward(x) {{ return l(x) }} }}\n", n - 1));
    format!("config {{ hidden = 4 }}\ninput x: f32[2, hidden]\n{blocks}layer b = B0()\nforward {{ output y = b(x) }}\n")
}

#[test]
fn ten_thousand_chained_blocks_are_rejected() {
    assert_rejected(&chain_of_blocks(10_000), "E0402");
}

#[test]
fn two_hundred_chained_blocks_check() {
    let report = check_extreme(&chain_of_blocks(200));
    assert_eq!(report.errors, Vec::<&str>::new());
    assert_eq!(report.parameters, Some(4 * 4 + 4));
}

#[test]
fn a_block_cycle_10_000_long_is_rejected() {
    let mut blocks = String::new();
    for i in 0..10_000 {
        blocks.push_str(&format!("block B{i} {{ layer l = B{}() forward(x) {{ return l(x) }} }}\n", (i + 1) % 10_000));
    }
    assert_rejected(&with_layers(&blocks, "layer b = B0()"), "E0106");
}

#[test]
fn repeat_counts_out_of_range_are_rejected() {
    let block = "block B { layer l = linear(hidden, hidden) forward(x) { return l(x) } }";
    for count in ["0", "-1", "100001", "1000000000000", "9223372036854775807", "-9223372036854775807"] {
        let report = assert_rejected(&with_layers(block, &format!("layer r = repeat({count}) B()")), "E0202");
        assert_eq!(report.errors.len(), 1, "{count}: {:?}", report.errors);
    }
    // Too large for any integer type.
    assert_rejected(&with_layers(block, "layer r = repeat(99999999999999999999999) B()"), "E0004");
    assert_rejected(&with_layers(block, "layer r = repeat(9223372036854775807 + 1) B()"), "E0203");
}

#[test]
fn repeat_at_the_limit_finishes() {
    let max = optimus::elab::MAX_REPEAT;
    let block = "block B { layer l = layernorm(hidden) forward(x) { return l(x) } }";
    let text = format!(
        "config {{ hidden = 4 }}\ninput x: f32[2, hidden]\n{block}\nlayer r = repeat({max}) B()\nforward {{ output y = r(x) }}\n"
    );
    let report = check_extreme(&text);
    assert_eq!(report.errors, Vec::<&str>::new());
    assert_eq!(report.parameters, Some(u128::try_from(max).expect("positive") * 8));
}

#[test]
fn config_integers_too_large_for_any_type_are_rejected() {
    for literal in
        ["9223372036854775808", "18446744073709551616", "1000000000000000000000000000000", &"9".repeat(10_000)]
    {
        assert_rejected(&with_config(&format!("a = {literal}")), "E0004");
    }
    assert_rejected(&with_config("a = 1e999"), "E0004");
    for overflow in [
        "a = 9223372036854775807 + 1",
        "a = -9223372036854775807 - 2",
        "a = 9223372036854775807 * 2",
        "a = 4294967296 * 4294967296",
        "a = 1.7976931348623157e308 * 10",
        // The one quotient of 64-bit integers that overflows (its remainder overflows too).
        "a = (-9223372036854775807 - 1) / -1",
    ] {
        assert_rejected(&with_config(overflow), "E0203");
    }
    // The largest integer itself is fine.
    let report = check_extreme(&with_config("a = 9223372036854775807"));
    assert_eq!(report.errors, Vec::<&str>::new());
}

#[test]
fn overrides_too_large_for_their_type_are_rejected() {
    let set = |value: &str| vec![Override { name: "hidden".to_string(), value: value.to_string() }];
    for value in ["99999999999999999999", "9223372036854775808", "1e999", "abc", ""] {
        let report = check_with(&with_config("a = 1"), set(value));
        assert!(report.has_error("E0302"), "--set hidden={value}: {:?}", report.errors);
    }
    // The largest integer is a valid override; only the tensor it sizes, past what a plan can address, is not.
    let report = check_with(&with_config("a = 1"), set("9223372036854775807"));
    assert_eq!(report.errors, ["E0202"]);
}

#[test]
fn tensors_too_large_to_address_are_rejected() {
    let text = "config { n = 9223372036854775807 }\ninput x: f32[n, n, n]\nforward { output y = x }\n";
    assert_rejected(text, "E0202");
    let text = "config { n = 4294967296 }\ninput x: f32[n, n]\nlayer l = linear(n, n)\nforward { output y = l(x) }\n";
    assert_rejected(text, "E0202");
}

#[test]
fn a_file_over_the_size_limit_is_rejected_quickly() {
    let text = " ".repeat(optimus::syntax::parser::MAX_SOURCE_BYTES + 1);
    assert_rejected(&text, "E0002");
}

// ---- bugs this file found --------------------------------------------------------------------------
//
// Each test below holds the minimal input of a bug found while writing this file, by the properties above or
// by probing the limits: a label past the end of the file or inside a character, a hang (exponential
// instantiation, or work quadratic in the input) or a wrong parameter count. All are fixed; these keep them so.

#[test]
fn a_syntax_error_at_the_end_of_the_file_is_labelled_inside_it() {
    for text in ["model", "config {", "forward { output y =", "input x: f32[2", "layer l = linear(1,"] {
        assert_rejected(text, "E0001");
    }
}

#[test]
fn syntax_error_labels_cover_whole_characters() {
    // The error is at a multi-byte character; a one-byte label would end inside it.
    for text in ["é", "model m\n€", "config { a = 😀 }"] {
        assert_rejected(text, "E0001");
    }
}

#[test]
fn invalid_utf8_labels_cover_whole_characters() {
    // The label must cover the whole U+FFFD (3 bytes) that stands for the bad byte in the shown text.
    for bytes in [&b"\xff"[..], b"model m\n\xc3\x28"] {
        let report = check_bytes(bytes.to_vec(), Vec::new(), EXTREME_LIMIT).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(report.errors, vec!["E0003"], "{bytes:?}");
    }
}

#[test]
fn a_block_fan_out_of_2_to_the_30_is_rejected() {
    // Each block holds two copies of the next: 31 short lines, 2^30 layer norms.
    let mut blocks = String::new();
    for i in 0..30 {
        let next = i + 1;
        blocks.push_str(&format!(
            "block B{i} {{ layer a = B{next}() layer b = B{next}() forward(x) {{ return b(a(x)) }} }}\n"
        ));
    }
    blocks.push_str("block B30 { layer l = layernorm(hidden) forward(x) { return l(x) } }\n");
    assert_rejected(&with_layers(&blocks, "layer b = B0()"), "E0402");
}

#[test]
fn nested_repeats_of_10_to_the_10_blocks_are_rejected() {
    let blocks = "block A { layer l = layernorm(hidden) forward(x) { return l(x) } }\n\
                  block B { layer r = repeat(100000) A() forward(x) { return r(x) } }";
    assert_rejected(&with_layers(blocks, "layer r = repeat(100000) B()"), "E0402");
}

#[test]
fn an_unknown_100_000_character_name_is_reported_quickly() {
    let known = "a".repeat(100_000);
    let typo = format!("{}b", "a".repeat(99_999));
    let text = format!("config {{ {known} = 1 }}\ninput x: f32[2]\nforward {{ output y = x * {typo} }}\n");
    assert_rejected(&text, "E0101");
}

#[test]
fn three_thousand_unknown_names_among_three_thousand_are_reported_quickly() {
    let config: String = (0..3000).map(|i| format!("  name{i} = 1\n")).collect();
    let uses: String = (0..3000).map(|i| format!("  y{i} = nome{i}\n")).collect();
    let text = format!("config {{\n{config}}}\ninput x: f32[2]\nforward {{\n{uses}  output y = x\n}}\n");
    assert_rejected(&text, "E0101");
}

#[test]
fn a_hundred_thousand_outputs_check_quickly() {
    let outputs: String = (0..100_000).map(|i| format!("  output y{i} = x\n")).collect();
    let report = check_extreme(&format!("input x: f32[2]\nforward {{\n{outputs}}}\n"));
    assert_eq!(report.errors, Vec::<&str>::new());
}

#[test]
fn fifty_thousand_layers_called_once_each_check_quickly() {
    let layers: String = (0..50_000).map(|i| format!("layer l{i} = layernorm(2)\n")).collect();
    let calls: String = (0..50_000).rev().map(|i| format!("  x = l{i}(x)\n")).collect();
    let report = check_extreme(&format!("input x: f32[2]\n{layers}forward {{\n{calls}  output y = x\n}}\n"));
    assert_eq!(report.errors, Vec::<&str>::new());
}

#[test]
fn a_model_of_fifty_thousand_operators_prints_quickly() {
    let calls = "  x = l(x)\n".repeat(50_000);
    let text = format!("input x: f32[2]\nlayer l = layernorm(2)\nforward {{\n{calls}  output y = x\n}}\n");
    let report = check_extreme(&text);
    assert_eq!(report.parameters, Some(4));
}

#[test]
fn a_parameter_too_large_to_count_is_rejected_or_counted() {
    let text = "config { n = 4294967296 }\ninput x: f32[2]\nlayer l = linear(n, n)\nforward { output y = x }\n";
    let report = check_extreme(text);
    // Weight n * n = 2^64 elements, bias n.
    let exact = (1u128 << 64) + (1u128 << 32);
    assert!(report.parameters.is_none_or(|p| p == exact), "{:?} parameters, not {exact}", report.parameters);
}
