//! Parses `.opt` source into the owned AST with pest; no pest type leaves this module.

use super::ast::*;
use crate::diag::Diagnostic;
use crate::span::Span;
use pest::Parser as _;
use pest::iterators::Pair;
use pest::pratt_parser::{Assoc, Op, PrattParser};

#[derive(pest_derive::Parser)]
#[grammar = "../grammar/optimus.pest"]
struct OptParser;

/// Deepest bracket nesting accepted; deeper input is rejected before pest sees it.
pub const MAX_NESTING: usize = 64;
/// Most operators accepted in one expression.
pub const MAX_OPERATORS: usize = 1000;
/// Largest source accepted, in bytes.
pub const MAX_SOURCE_BYTES: usize = 16 * 1024 * 1024;

/// Parses a source file, returning the AST and any non-fatal diagnostics, or the fatal ones.
pub fn parse(source: &str) -> Result<(File, Vec<Diagnostic>), Vec<Diagnostic>> {
    if source.len() > MAX_SOURCE_BYTES {
        return Err(vec![Diagnostic::error(
            "E0002",
            format!("the file is {} bytes; the largest model file accepted is {MAX_SOURCE_BYTES} bytes", source.len()),
        )]);
    }
    check_nesting(source)?;
    pest::set_call_limit(std::num::NonZeroUsize::new(50_000_000));
    let mut pairs = OptParser::parse(Rule::file, source).map_err(|e| vec![syntax_error(e)])?;
    let file_pair = pairs.next().ok_or_else(|| vec![Diagnostic::error("E0001", "empty parse")])?;
    let mut builder = Builder::default();
    let file = builder.file(file_pair);
    Ok((file, builder.diagnostics))
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
    Diagnostic::error("E0002", format!("{what} more than {limit} deep"))
        .primary(Span::new(offset, offset + c.len_utf8()), "too deep here")
        .help("split the expression into named steps")
}

/// Turns a pest error into a diagnostic that says in words what was expected.
fn syntax_error(e: pest::error::Error<Rule>) -> Diagnostic {
    use pest::error::{ErrorVariant, InputLocation};
    let (start, end) = match e.location {
        InputLocation::Pos(p) => (p, p),
        InputLocation::Span((s, t)) => (s, t),
    };
    let found = found_text(e.line(), &e.line_col);
    let expected = match &e.variant {
        ErrorVariant::ParsingError { positives, .. } => describe_rules(positives),
        ErrorVariant::CustomError { message } => message.clone(),
    };
    let message =
        if expected.is_empty() { format!("unexpected {found}") } else { format!("expected {expected}, found {found}") };
    let label_end = if end > start { end } else { start + 1 };
    Diagnostic::error("E0001", format!("syntax error: {message}"))
        .primary(Span::new(start, label_end), format!("expected {}", or_default(&expected)))
}

fn or_default(expected: &str) -> &str {
    if expected.is_empty() { "something else" } else { expected }
}

/// Describes the token found at the error position, e.g. "`}`" or "the end of the file".
fn found_text(line: &str, line_col: &pest::error::LineColLocation) -> String {
    let col = match line_col {
        pest::error::LineColLocation::Pos((_, c)) | pest::error::LineColLocation::Span((_, c), _) => *c,
    };
    let rest: String = line.chars().skip(col.saturating_sub(1)).collect();
    let rest = rest.trim_end_matches(['\n', '\r']);
    match rest.chars().next() {
        None => "the end of the line or file".to_string(),
        Some(c) if c.is_alphanumeric() || c == '_' => {
            let word: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            format!("`{word}`")
        }
        Some(c) => format!("`{c}`"),
    }
}

/// Joins the words for what the grammar would have accepted: "a name, `=` or `(`".
fn describe_rules(rules: &[Rule]) -> String {
    let mut words: Vec<&str> = Vec::new();
    for r in rules {
        let w = describe(*r);
        if !words.contains(&w) {
            words.push(w);
        }
    }
    match words.len() {
        0 => String::new(),
        1 => words[0].to_string(),
        n => format!("{} or {}", words[..n - 1].join(", "), words[n - 1]),
    }
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

fn span_of(pair: &Pair<Rule>) -> Span {
    let s = pair.as_span();
    Span::new(s.start(), s.end())
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
                                Diagnostic::error("E0105", "the model is named twice")
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
        let mut inner = children(pair);
        let name = inner.next().map(ident).unwrap_or(Ident { name: String::new(), span });
        let mut block = BlockDef { name, params: Vec::new(), layers: Vec::new(), forwards: Vec::new(), span };
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
        LayerDecl { name, value, span }
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
                    let mut si = children(part).filter(|p| p.as_rule() != Rule::kw_output);
                    if let (Some(n), Some(v)) = (si.next(), si.next()) {
                        let (name, value) = (ident(n), self.expr(v));
                        def.body.push(if is_output {
                            Stmt::Output { name, value }
                        } else {
                            Stmt::Assign { name, value }
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
                    let value = ki.next().map(|e| self.expr(e)).unwrap_or(Expr { kind: ExprKind::Bool(false), span });
                    Arg { name, value, span }
                } else {
                    Arg { name: None, value: self.expr(a), span }
                }
            })
            .collect()
    }

    fn expr(&mut self, pair: Pair<Rule>) -> Expr {
        let span = span_of(&pair);
        let operators = pair
            .clone()
            .into_inner()
            .filter(|p| matches!(p.as_rule(), Rule::add | Rule::sub | Rule::mul | Rule::div | Rule::neg))
            .count();
        if operators > MAX_OPERATORS {
            self.diagnostics.push(
                Diagnostic::error(
                    "E0002",
                    format!("expression has {operators} operators; at most {MAX_OPERATORS} are allowed"),
                )
                .primary(span, "too long")
                .help("split the expression into named steps"),
            );
            return Expr { kind: ExprKind::Int(0), span };
        }
        let parser = pratt();
        // The Pratt closures each need the builder; they run one at a time, so a RefCell is enough.
        let this = std::cell::RefCell::new(self);
        parser
            .map_primary(|p| this.borrow_mut().primary(p))
            .map_prefix(|op, rhs| Expr { span: span_of(&op).to(rhs.span), kind: ExprKind::Neg(Box::new(rhs)) })
            .map_infix(|lhs, op, rhs| {
                let op = match op.as_rule() {
                    Rule::add => BinOp::Add,
                    Rule::sub => BinOp::Sub,
                    Rule::mul => BinOp::Mul,
                    _ => BinOp::Div,
                };
                Expr {
                    span: lhs.span.to(rhs.span),
                    kind: ExprKind::Binary { op, lhs: Box::new(lhs), rhs: Box::new(rhs) },
                }
            })
            .parse(children(pair))
    }

    fn primary(&mut self, pair: Pair<Rule>) -> Expr {
        let span = span_of(&pair);
        let kind = match pair.as_rule() {
            Rule::int => {
                let digits: String = pair.as_str().chars().filter(|c| *c != '_').collect();
                match digits.parse::<i64>() {
                    Ok(v) => ExprKind::Int(v),
                    Err(_) => {
                        self.diagnostics.push(
                            Diagnostic::error("E0004", "integer literal is too large")
                                .primary(span, format!("larger than the largest integer, {}", i64::MAX)),
                        );
                        ExprKind::Int(0)
                    }
                }
            }
            Rule::float => match pair.as_str().parse::<f64>() {
                Ok(v) if v.is_finite() => ExprKind::Float(v),
                _ => {
                    self.diagnostics.push(
                        Diagnostic::error("E0004", "number literal is out of range")
                            .primary(span, "not a finite number"),
                    );
                    ExprKind::Float(0.0)
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
                    None => Expr { kind: ExprKind::Int(0), span },
                };
            }
            _ => ExprKind::Int(0),
        };
        Expr { kind, span }
    }
}
