//! Parses `.opt` source into the owned AST with pest; no pest type leaves this module.

use super::ast::*;
use super::expect;
use crate::diag::{Code, Diagnostic};
use optimus_plan::span::Span;
use pest::Parser as _;
use pest::iterators::Pair;
use pest::pratt_parser::{Assoc, Op, PrattParser};

#[derive(pest_derive::Parser)]
#[grammar = "../../../grammar/optimus.pest"]
struct OptParser;

/// Deepest bracket nesting accepted; deeper input is rejected before pest sees it.
pub const MAX_NESTING: usize = 64;
/// Most operators accepted in one expression.
pub const MAX_OPERATORS: usize = 1000;
/// Largest source accepted, in bytes.
pub const MAX_SOURCE_BYTES: usize = 16 * 1024 * 1024;

/// Most syntax errors reported from one file; after each, parsing resumes at the next top-level declaration.
pub const MAX_SYNTAX_ERRORS: usize = 10;

/// Grammar-rule calls allowed per byte of source. The grammar never backtracks over more than one bracket level,
/// so parsing is linear: the costliest text measured (a list of one-letter names, a run of `;`) takes about 42
/// calls a byte. The limit is a safety net against a grammar change that would make parsing superlinear.
pub const CALLS_PER_BYTE: usize = 64;
/// Grammar-rule calls allowed on top of [`CALLS_PER_BYTE`], so that tiny files are never short of them.
pub const BASE_CALLS: usize = 1_000_000;

/// The grammar-rule calls one parse of `len` bytes may make.
pub fn call_limit(len: usize) -> usize {
    BASE_CALLS.saturating_add(len.saturating_mul(CALLS_PER_BYTE))
}

/// pest reads its call limit from a process-wide setting when a parse starts; parses hold this lock from setting
/// it to finishing, so that parses on other threads (tests, a server) never start under another file's limit.
static PARSE_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Parses a source file, returning the AST and any non-fatal diagnostics, or the fatal ones.
pub fn parse(source: &str) -> Result<(File, Vec<Diagnostic>), Vec<Diagnostic>> {
    parse_with_limit(source, call_limit(source.len()))
}

/// [`parse`] with an explicit limit on grammar-rule calls.
fn parse_with_limit(source: &str, calls: usize) -> Result<(File, Vec<Diagnostic>), Vec<Diagnostic>> {
    if source.len() > MAX_SOURCE_BYTES {
        // No label: the line it would show may itself be megabytes long.
        return Err(vec![Diagnostic::error(
            Code::E0002,
            format!("the file is {} bytes; the largest model file accepted is {MAX_SOURCE_BYTES} bytes", source.len()),
        )]);
    }
    check_nesting(source)?;
    // A parse that panicked while holding the lock left nothing behind that needs repair.
    let _lock = PARSE_LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    pest::set_call_limit(std::num::NonZeroUsize::new(calls));
    let mut pairs = OptParser::parse(Rule::file, source).map_err(|e| syntax_errors(source, e))?;
    let file_pair = pairs.next().ok_or_else(|| vec![Diagnostic::error(Code::E0001, "empty parse")])?;
    let mut builder = Builder::default();
    let file = builder.file(file_pair);
    Ok((file, builder.diagnostics))
}

/// Whether pest stopped because a resource limit (calls or stack) was reached, not at a syntax error.
fn limit_reached(e: &pest::error::Error<Rule>) -> bool {
    matches!(e.variant, pest::error::ErrorVariant::CustomError { .. })
}

/// Where pest stopped, as a byte offset into the text it was given.
fn stop_offset(e: &pest::error::Error<Rule>) -> usize {
    use pest::error::InputLocation;
    match e.location {
        InputLocation::Pos(p) | InputLocation::Span((p, _)) => p,
    }
}

/// The error for a file whose parse ran out of grammar-rule calls or stack, `at` bytes into the file. No label:
/// the line it would show may be megabytes long.
fn too_complex(source: &str, at: usize) -> Diagnostic {
    let (line, column) = optimus_plan::span::line_col(source, at);
    Diagnostic::error(Code::E0002, "the file is too complex to parse")
        .note(format!("parsing gave up at line {line}, column {column}"))
        .help("split long expressions and deeply nested blocks into smaller named pieces")
}

/// Describes the first syntax error, then resumes at each later top-level declaration to report more.
fn syntax_errors(source: &str, first: pest::error::Error<Rule>) -> Vec<Diagnostic> {
    if limit_reached(&first) {
        // Parsing again for details would only reach the same limit.
        return vec![too_complex(source, stop_offset(&first))];
    }
    // Detailed parse attempts cost time, so they are collected only once a file has failed. The switch is global
    // and is never turned off again, so parses running at the same time always produce the same messages.
    pest::set_error_detail(true);
    let mut error = OptParser::parse(Rule::file, source).err().unwrap_or(first);
    let mut diagnostics = Vec::new();
    let mut chunk = 0;
    loop {
        if limit_reached(&error) {
            diagnostics.push(too_complex(source, chunk + stop_offset(&error)));
            break;
        }
        let (diagnostic, at) = syntax_error(&source[chunk..], chunk, &error);
        diagnostics.push(diagnostic);
        if diagnostics.len() >= MAX_SYNTAX_ERRORS {
            break;
        }
        let Some(next) = resume_point(source, at.max(chunk + 1)) else { break };
        chunk = next;
        match OptParser::parse(Rule::file, &source[chunk..]) {
            Ok(_) => break,
            Err(e) => error = e,
        }
    }
    diagnostics
}

/// The first line start at or after `from` that begins a top-level declaration (`block`, `layer`, ...).
fn resume_point(source: &str, from: usize) -> Option<usize> {
    let mut line_start = source.get(..from)?.rfind('\n').map_or(0, |i| i + 1);
    while line_start < source.len() {
        if line_start >= from && starts_declaration(source, line_start) {
            return Some(line_start);
        }
        line_start += source[line_start..].find('\n')? + 1;
    }
    None
}

/// Whether `at` is the start of a line that begins with a top-level keyword such as `block`.
fn starts_declaration(source: &str, at: usize) -> bool {
    const STARTS: [&str; 6] = ["model", "config", "input", "block", "layer", "forward"];
    let line_start = at == 0 || source.as_bytes().get(at - 1) == Some(&b'\n');
    let line = source.get(at..).unwrap_or("");
    line_start
        && STARTS.iter().any(|k| {
            line.starts_with(k) && !line[k.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
        })
}

/// Rejects bracket nesting deeper than [`MAX_NESTING`] so parsing never exhausts the stack.
fn check_nesting(source: &str) -> Result<(), Vec<Diagnostic>> {
    let mut depth = 0usize;
    let mut in_comment = false;
    let mut in_string = false;
    let mut run_of_minus = 0usize;
    for (i, c) in source.char_indices() {
        if in_comment {
            in_comment = c != '\n';
            continue;
        }
        if in_string {
            in_string = c != '"' && c != '\n';
            continue;
        }
        match c {
            '#' => in_comment = true,
            '"' => in_string = true,
            '(' | '[' | '{' => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Err(vec![too_deep(i, c, "brackets are nested", MAX_NESTING)]);
                }
            }
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        if c == '-' {
            run_of_minus += 1;
            if run_of_minus > MAX_NESTING {
                return Err(vec![too_deep(i, c, "`-` signs are repeated", MAX_NESTING)]);
            }
        } else if !c.is_whitespace() {
            run_of_minus = 0;
        }
    }
    Ok(())
}

fn too_deep(offset: usize, c: char, what: &str, limit: usize) -> Diagnostic {
    Diagnostic::error(Code::E0002, format!("{what} more than {limit} deep"))
        .primary(Span::new(offset, offset + c.len_utf8()), "too deep here")
        .help("split the expression into named steps")
}

/// Turns a pest error on `text` (which starts `offset` bytes into the file) into a diagnostic that says in
/// words what was expected; also returns the file offset where parsing stopped.
fn syntax_error(text: &str, offset: usize, e: &pest::error::Error<Rule>) -> (Diagnostic, usize) {
    use pest::error::ErrorVariant;
    let pest_pos = stop_offset(e);
    let positives = match &e.variant {
        ErrorVariant::ParsingError { positives, .. } => positives.as_slice(),
        // Resource limits are reported by `too_complex` before this is reached.
        ErrorVariant::CustomError { .. } => &[],
    };
    let (pos, phrases) = match e.parse_attempts() {
        Some(a) => {
            let tokens: Vec<String> = a.expected_tokens().iter().map(ToString::to_string).collect();
            let mut phrases = expect::expected_phrases(text, a.max_position, &tokens);
            if phrases.is_empty() {
                let rules: Vec<Rule> = a.call_stacks().iter().filter_map(|c| c.deepest.get_rule().copied()).collect();
                phrases = describe_rules(&rules);
            }
            (a.max_position, phrases)
        }
        None => (pest_pos, describe_rules(positives)),
    };
    let d = special_syntax_error(text, pos, &phrases).unwrap_or_else(|| expected_found(text, pos, &phrases));
    (shift(d, offset), offset + pos)
}

/// Moves every label of a diagnostic made for a piece of the file to its place in the whole file.
fn shift(mut d: Diagnostic, offset: usize) -> Diagnostic {
    for l in &mut d.labels {
        l.span = Span::new(offset + l.span.start as usize, offset + l.span.end as usize);
    }
    d
}

/// Errors better explained by their cause than by the expected tokens: an unterminated string, a malformed
/// number, or a reserved word used as a name.
fn special_syntax_error(text: &str, pos: usize, phrases: &[String]) -> Option<Diagnostic> {
    if let Some(quote) = expect::open_at(text, pos).string {
        let line_end = text[quote..].find('\n').map_or(text.len(), |i| quote + i);
        return Some(
            Diagnostic::error(Code::E0001, "syntax error: unterminated string")
                .primary(Span::new(quote, line_end), "this string is not closed")
                .help("a string ends with `\"` on the line where it starts"),
        );
    }
    if let Some(bad) = expect::malformed_number(text, pos) {
        return Some(
            Diagnostic::error(Code::E0001, format!("syntax error: malformed number `{}`", bad.text))
                .primary(bad.span, "not a valid number")
                .help("numbers are written like `12`, `1_024`, `0.5` or `1e-5`"),
        );
    }
    let before = text.get(..pos)?.trim_end();
    let word = ["true", "false"].into_iter().find(|w| {
        before.ends_with(w)
            && !before[..before.len() - w.len()].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
    })?;
    if !phrases.iter().any(|p| p == "a name") {
        return None;
    }
    let start = before.len() - word.len();
    Some(
        Diagnostic::error(Code::E0001, format!("syntax error: expected a name, found `{word}`"))
            .primary(Span::new(start, before.len()), "a reserved word")
            .help("`true` and `false` are values and cannot be used as names"),
    )
}

/// "expected `,`, `)` or an operator, found `}`", with the unclosed bracket that likely caused it.
fn expected_found(text: &str, pos: usize, phrases: &[String]) -> Diagnostic {
    let found = expect::found_at(text, pos);
    let expected = expect::join_phrases(phrases);
    let message = if expected.is_empty() {
        format!("syntax error: unexpected {}", found.text)
    } else {
        format!("syntax error: expected {expected}, found {}", found.text)
    };
    let innermost = expect::open_at(text, found.span.start as usize).brackets.last().copied();
    let closes = |c: char| matches!(c, ')' | ']' | '}');
    let stray = found.symbol.filter(|c| closes(*c) && innermost.is_none());
    let d = Diagnostic::error(Code::E0001, message);
    let d = match stray {
        Some(c) => d.primary(found.span, format!("this `{c}` closes nothing")),
        None if expected.is_empty() => d.primary(found.span, "unexpected here"),
        None => d.primary(found.span, format!("expected {expected}")),
    };
    let first = text.get(found.span.start as usize..).and_then(|rest| rest.chars().next());
    let d = match first.filter(|c| c.is_alphanumeric() && !c.is_ascii()) {
        Some(c) => d.help(format!("`{c}` is not ASCII: names are ASCII letters, digits and `_`")),
        None => d,
    };
    let Some((at, open)) = innermost else { return d };
    let close = expect::closer(open);
    let wanted = phrases.iter().any(|p| *p == format!("`{close}`"));
    // Inside a bracket the error is most likely its missing closer when the file ends, a different closer
    // comes, or (for `(` and `[`, which rarely span lines) the text goes on to another line. A `{` always
    // spans lines, so for it only a new top-level declaration counts.
    let between = &text[at..found.span.start as usize];
    let far = found.at_end
        || found.symbol.is_some_and(closes)
        || if open == '{' { starts_declaration(text, found.span.start as usize) } else { between.contains('\n') };
    if wanted && far {
        d.secondary(Span::new(at, at + 1), format!("this `{open}` is not closed"))
            .help(format!("add the missing `{close}`"))
    } else {
        d
    }
}

/// The words for what the grammar would have accepted, from rule names (used when pest has no token detail).
fn describe_rules(rules: &[Rule]) -> Vec<String> {
    let mut words: Vec<String> = Vec::new();
    for r in rules {
        let w = describe(*r).to_string();
        if !words.contains(&w) {
            words.push(w);
        }
    }
    words
}

/// The words a user sees for a grammar rule.
fn describe(rule: Rule) -> &'static str {
    match rule {
        Rule::EOI => "the end of the file",
        Rule::model_decl | Rule::kw_model => "`model`",
        Rule::config_block | Rule::kw_config => "`config`",
        Rule::config_entry => "a config entry (`name = value`)",
        Rule::input_decl | Rule::kw_input => "`input`",
        Rule::dim_list => "a list of dimensions",
        Rule::block_def | Rule::kw_block => "`block`",
        Rule::block_params => "block parameters",
        Rule::block_param => "a block parameter",
        Rule::layer_decl | Rule::kw_layer => "`layer`",
        Rule::repeat_expr | Rule::kw_repeat => "`repeat`",
        Rule::kw_checkpoint => "`checkpoint`",
        Rule::forward_def | Rule::kw_forward => "`forward`",
        Rule::forward_params => "forward parameters",
        Rule::output_stmt | Rule::kw_output => "`output`",
        Rule::return_stmt | Rule::kw_return => "`return`",
        Rule::assign_stmt => "a statement",
        Rule::expr | Rule::paren | Rule::list | Rule::neg => "an expression",
        Rule::add | Rule::sub | Rule::mul | Rule::div => "an operator",
        Rule::call => "a call",
        Rule::call_args => "`(`",
        Rule::kwarg => "a keyword argument",
        Rule::float | Rule::int => "a number",
        Rule::string => "a string",
        Rule::boolean => "`true` or `false`",
        Rule::ident => "a name",
        Rule::keyword => "a keyword",
        Rule::item | Rule::file | Rule::WHITESPACE | Rule::COMMENT => "a declaration",
        Rule::semi => "`;`",
        Rule::stmt => "a statement",
        Rule::infix => "an operator",
        Rule::primary | Rule::arg | Rule::literal => "an expression",
        Rule::exponent => "an exponent",
        Rule::ident_char => "a name",
    }
}

/// Converts pest pairs into AST nodes, collecting non-fatal diagnostics (e.g. oversized literals).
#[derive(Default)]
struct Builder {
    diagnostics: Vec<Diagnostic>,
}

/// The children of a pair, without keyword tokens.
fn children(pair: Pair<Rule>) -> impl Iterator<Item = Pair<Rule>> {
    pair.into_inner().filter(|p| {
        !matches!(
            p.as_rule(),
            Rule::kw_model
                | Rule::kw_config
                | Rule::kw_input
                | Rule::kw_block
                | Rule::kw_layer
                | Rule::kw_repeat
                | Rule::kw_forward
                | Rule::kw_output
                | Rule::kw_return
        )
    })
}

/// The span of a pair, without the whitespace and comments pest includes after a rule ending in a repetition.
fn span_of(pair: &Pair<Rule>) -> Span {
    let s = pair.as_span();
    Span::new(s.start(), s.start() + expect::trimmed_len(s.as_str()))
}

fn ident(pair: Pair<Rule>) -> Ident {
    Ident { name: pair.as_str().to_string(), span: span_of(&pair) }
}

fn pratt() -> PrattParser<Rule> {
    PrattParser::new()
        .op(Op::infix(Rule::add, Assoc::Left) | Op::infix(Rule::sub, Assoc::Left))
        .op(Op::infix(Rule::mul, Assoc::Left) | Op::infix(Rule::div, Assoc::Left))
        .op(Op::prefix(Rule::neg))
}

impl Builder {
    fn file(&mut self, pair: Pair<Rule>) -> File {
        let mut file = File::default();
        for item in children(pair) {
            match item.as_rule() {
                Rule::model_decl => {
                    let span = span_of(&item);
                    let mut inner = children(item);
                    let name = inner.next().map(ident);
                    let options = inner.next().map(|a| self.call_args(a)).unwrap_or_default();
                    if let Some(name) = name {
                        if let Some(prev) = &file.model {
                            self.diagnostics.push(
                                Diagnostic::error(Code::E0105, "the model is named twice")
                                    .primary(span, "second `model` line")
                                    .secondary(prev.span, "first named here"),
                            );
                        } else {
                            file.model = Some(ModelDecl { name, options, span });
                        }
                    }
                }
                Rule::config_block => {
                    file.config_spans.push(span_of(&item));
                    for entry in children(item) {
                        let span = span_of(&entry);
                        let mut inner = children(entry);
                        if let (Some(n), Some(v)) = (inner.next(), inner.next()) {
                            file.config.push(ConfigEntry { name: ident(n), value: self.expr(v), span });
                        }
                    }
                }
                Rule::input_decl => file.inputs.push(self.input(item)),
                Rule::block_def => file.blocks.push(self.block(item)),
                Rule::layer_decl => file.layers.push(self.layer(item)),
                Rule::forward_def => file.forwards.push(self.forward(item)),
                _ => {}
            }
        }
        file
    }

    fn input(&mut self, pair: Pair<Rule>) -> InputDecl {
        let span = span_of(&pair);
        let mut inner = children(pair);
        let mut next_ident = || inner.next().map(ident);
        let name = next_ident();
        let dtype = next_ident();
        let dims = inner.next().map(|d| children(d).map(|e| self.expr(e)).collect()).unwrap_or_default();
        let missing = || Ident { name: String::new(), span };
        InputDecl { name: name.unwrap_or_else(missing), dtype: dtype.unwrap_or_else(missing), dims, span }
    }

    fn block(&mut self, pair: Pair<Rule>) -> BlockDef {
        let span = span_of(&pair);
        let mut inner = children(pair).peekable();
        let checkpoint = inner.next_if(|p| p.as_rule() == Rule::kw_checkpoint).is_some();
        let name = inner.next().map(ident).unwrap_or(Ident { name: String::new(), span });
        let mut block =
            BlockDef { name, checkpoint, params: Vec::new(), layers: Vec::new(), forwards: Vec::new(), span };
        for part in inner {
            match part.as_rule() {
                Rule::block_params => {
                    for p in children(part) {
                        let mut pi = children(p);
                        if let Some(n) = pi.next() {
                            let default = pi.next().map(|e| self.expr(e));
                            block.params.push(BlockParam { name: ident(n), default });
                        }
                    }
                }
                Rule::layer_decl => block.layers.push(self.layer(part)),
                Rule::forward_def => block.forwards.push(self.forward(part)),
                _ => {}
            }
        }
        block
    }

    fn layer(&mut self, pair: Pair<Rule>) -> LayerDecl {
        let span = span_of(&pair);
        let mut inner = children(pair).filter(|p| p.as_rule() != Rule::kw_layer);
        let name = inner.next().map(ident).unwrap_or(Ident { name: String::new(), span });
        let mut inner = inner.peekable();
        let checkpoint = inner.next_if(|p| p.as_rule() == Rule::kw_checkpoint).is_some();
        let value = match inner.next() {
            Some(v) if v.as_rule() == Rule::repeat_expr => {
                let rspan = span_of(&v);
                let mut ri = children(v).filter(|p| p.as_rule() != Rule::kw_repeat);
                let count = ri.next().map(|e| self.expr(e));
                let body = ri.next().map(|c| self.call(c));
                match (count, body) {
                    (Some(count), Some(body)) => LayerExpr::Repeat { count, body, span: rspan },
                    _ => LayerExpr::Call(self.empty_call(rspan)),
                }
            }
            Some(v) => LayerExpr::Call(self.call(v)),
            None => LayerExpr::Call(self.empty_call(span)),
        };
        LayerDecl { name, checkpoint, value, span }
    }

    fn empty_call(&self, span: Span) -> Call {
        Call { callee: Ident { name: String::new(), span }, args: Vec::new(), span, args_span: span }
    }

    fn forward(&mut self, pair: Pair<Rule>) -> ForwardDef {
        let span = span_of(&pair);
        let keyword_end = span.start as usize + "forward".len();
        let mut head_span = Span::new(span.start as usize, keyword_end);
        let mut def = ForwardDef { params: Vec::new(), body: Vec::new(), span, head_span };
        for part in children(pair) {
            match part.as_rule() {
                Rule::forward_params => {
                    head_span = head_span.to(span_of(&part));
                    def.params = children(part).map(ident).collect();
                }
                Rule::assign_stmt | Rule::output_stmt => {
                    let is_output = part.as_rule() == Rule::output_stmt;
                    let span = span_of(&part);
                    let mut si = children(part).filter(|p| p.as_rule() != Rule::kw_output);
                    if let (Some(n), Some(v)) = (si.next(), si.next()) {
                        let (name, value) = (ident(n), self.expr(v));
                        def.body.push(if is_output {
                            Stmt::Output { name, value, span }
                        } else {
                            Stmt::Assign { name, value, span }
                        });
                    }
                }
                Rule::return_stmt => {
                    let span = span_of(&part);
                    if let Some(v) = children(part).find(|p| p.as_rule() == Rule::expr) {
                        def.body.push(Stmt::Return { value: self.expr(v), span });
                    }
                }
                _ => {}
            }
        }
        def.head_span = head_span;
        def
    }

    fn call(&mut self, pair: Pair<Rule>) -> Call {
        let span = span_of(&pair);
        let mut inner = children(pair);
        let callee = inner.next().map(ident).unwrap_or(Ident { name: String::new(), span });
        let (args, args_span) = match inner.next() {
            Some(a) => {
                let s = span_of(&a);
                (self.call_args(a), s)
            }
            None => (Vec::new(), span),
        };
        Call { callee, args, span, args_span }
    }

    fn call_args(&mut self, pair: Pair<Rule>) -> Vec<Arg> {
        children(pair)
            .map(|a| {
                let span = span_of(&a);
                if a.as_rule() == Rule::kwarg {
                    let mut ki = children(a);
                    let name = ki.next().map(ident);
                    let value = ki.next().map(|e| self.expr(e)).unwrap_or(Expr { kind: ExprKind::Invalid, span });
                    Arg { name, value, span }
                } else {
                    Arg { name: None, value: self.expr(a), span }
                }
            })
            .collect()
    }

    fn expr(&mut self, pair: Pair<Rule>) -> Expr {
        let span = span_of(&pair);
        let mut operators = pair
            .clone()
            .into_inner()
            .filter(|p| matches!(p.as_rule(), Rule::add | Rule::sub | Rule::mul | Rule::div | Rule::neg));
        if let Some(first_too_many) = operators.nth(MAX_OPERATORS) {
            let count = MAX_OPERATORS + 1 + operators.count();
            self.diagnostics.push(
                Diagnostic::error(
                    Code::E0002,
                    format!("expression has {count} operators; at most {MAX_OPERATORS} are allowed"),
                )
                .primary(span_of(&first_too_many), format!("operator {} is one too many", MAX_OPERATORS + 1))
                .help("split the expression into named steps"),
            );
            return Expr { kind: ExprKind::Invalid, span };
        }
        let parser = pratt();
        // The Pratt closures each need the builder; they run one at a time, so a RefCell is enough.
        let this = std::cell::RefCell::new(self);
        parser
            .map_primary(|p| this.borrow_mut().primary(p))
            .map_prefix(|op, rhs| Expr { span: span_of(&op).to(rhs.span), kind: ExprKind::Neg(Box::new(rhs)) })
            .map_infix(|lhs, op, rhs| {
                let op_span = span_of(&op);
                let op = match op.as_rule() {
                    Rule::add => BinOp::Add,
                    Rule::sub => BinOp::Sub,
                    Rule::mul => BinOp::Mul,
                    _ => BinOp::Div,
                };
                Expr {
                    span: lhs.span.to(rhs.span),
                    kind: ExprKind::Binary { op, op_span, lhs: Box::new(lhs), rhs: Box::new(rhs) },
                }
            })
            .parse(children(pair))
    }

    fn primary(&mut self, pair: Pair<Rule>) -> Expr {
        let span = span_of(&pair);
        let kind = match pair.as_rule() {
            Rule::int => {
                let text = pair.as_str();
                if text.ends_with('_') {
                    // As `--set` reads numbers: `_` goes between digits.
                    self.diagnostics.push(
                        Diagnostic::error(Code::E0001, format!("syntax error: `{text}` is not a number"))
                            .primary(span, "`_` goes between digits (`50_257`)"),
                    );
                    return Expr { kind: ExprKind::Invalid, span };
                }
                let digits: String = text.chars().filter(|c| *c != '_').collect();
                match digits.parse::<i64>() {
                    Ok(v) => ExprKind::Int(v),
                    Err(_) => {
                        self.diagnostics.push(
                            Diagnostic::error(Code::E0004, "integer literal is too large")
                                .primary(span, format!("larger than the largest integer, {}", i64::MAX)),
                        );
                        ExprKind::Invalid
                    }
                }
            }
            Rule::float => match pair.as_str().parse::<f64>() {
                Ok(v) if v.is_finite() => ExprKind::Float(v),
                _ => {
                    self.diagnostics.push(
                        Diagnostic::error(Code::E0004, "number literal is out of range")
                            .primary(span, format!("larger than the largest number, {:e}", f64::MAX)),
                    );
                    ExprKind::Invalid
                }
            },
            Rule::string => {
                let s = pair.as_str();
                ExprKind::Str(s[1..s.len() - 1].to_string())
            }
            Rule::boolean => ExprKind::Bool(pair.as_str() == "true"),
            Rule::ident => ExprKind::Name(pair.as_str().to_string()),
            Rule::call => ExprKind::Call(self.call(pair)),
            Rule::list => ExprKind::List(children(pair).map(|e| self.expr(e)).collect()),
            Rule::paren => {
                return match children(pair).next() {
                    Some(inner) => {
                        let mut e = self.expr(inner);
                        e.span = span;
                        e
                    }
                    None => Expr { kind: ExprKind::Invalid, span },
                };
            }
            _ => ExprKind::Invalid,
        };
        Expr { kind, span }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_out_of_grammar_calls_is_a_clear_error() {
        let src = "input x: f32[2]\nforward { output y = x }\n";
        let errors = parse_with_limit(src, 40).expect_err("40 calls cannot parse this");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].code, "E0002");
        assert_eq!(errors[0].message, "the file is too complex to parse");
        let rendered = crate::diag::render_plain("model.opt", src, &errors);
        assert!(!rendered.contains("call limit"), "{rendered}");
        assert!(rendered.contains("parsing gave up at line 1"), "{rendered}");
    }

    #[test]
    fn the_call_limit_grows_with_the_file() {
        assert_eq!(call_limit(0), BASE_CALLS);
        // The costliest text measured takes 42 calls a byte.
        assert!(call_limit(MAX_SOURCE_BYTES) > 42 * MAX_SOURCE_BYTES);
        assert!(parse(&";".repeat(1 << 20)).is_ok());
    }
}
