//! Expression evaluation: scalar arithmetic on config values and dispatch of tensor operations.

use super::{Elab, Fail, Frame, Layer, Place, R, Value};
use crate::diag::{Code, Diagnostic};
use crate::ir::{Dim, Scalar};
use crate::syntax::ast::{BinOp, Call, Expr, ExprKind};
use optimus_plan::span::Span;

/// Scalar functions usable anywhere.
pub const SCALAR_FUNCTIONS: [&str; 3] = ["sqrt", "min", "max"];

impl Elab<'_> {
    /// Evaluates an expression in a frame.
    pub(crate) fn eval(&mut self, expr: &Expr, frame: &mut Frame) -> R<Value> {
        self.count_evaluation(expr.span)?;
        match &expr.kind {
            ExprKind::Int(v) => Ok(Value::Scalar(Scalar::Int(*v), None)),
            ExprKind::Float(v) => Ok(Value::Scalar(Scalar::Float(*v), None)),
            ExprKind::Bool(v) => Ok(Value::Scalar(Scalar::Bool(*v), None)),
            ExprKind::Str(v) => Ok(Value::Scalar(Scalar::Str(v.clone()), None)),
            ExprKind::Name(name) => self.lookup(name, expr.span, frame),
            ExprKind::List(items) => {
                // A list is a shape (reshape's, or linear's factored size).
                if items.len() > super::MAX_RANK {
                    return self.fail(super::too_many_dimensions(items.len(), expr.span));
                }
                let mut values = Vec::with_capacity(items.len());
                let mut failed = None;
                for item in items {
                    match self.eval(item, frame) {
                        Ok(v) => values.push(v),
                        Err(f) => failed = Some(failed.map_or(f, |g: Fail| if g == Fail::Abort { g } else { f })),
                    }
                }
                match failed {
                    Some(f) => Err(f),
                    None => Ok(Value::List(values)),
                }
            }
            ExprKind::Neg(inner) => {
                let v = self.eval(inner, frame)?;
                self.negate(v, expr.span)
            }
            ExprKind::Binary { op, op_span, lhs, rhs } => {
                let l = self.eval(lhs, frame);
                let r = self.eval(rhs, frame);
                let (l, r) = (l?, r?);
                self.binary(BinarySite { op: *op, op_span: *op_span, lhs, rhs }, l, r, frame)
            }
            ExprKind::Call(call) => self.eval_call(call, frame),
            ExprKind::Invalid => Ok(Value::Poison),
        }
    }

    fn lookup(&mut self, name: &str, span: Span, frame: &Frame) -> R<Value> {
        if let Some(v) = frame.locals.get(name) {
            return Ok(v.clone());
        }
        if let Some(m) = frame.module {
            if let Some((v, label)) = self.modules[m].env.get(name) {
                let label = label.clone().unwrap_or_else(|| name.to_string());
                return Ok(Value::Scalar(v.clone(), Some(label)));
            }
            if self.modules[m].layer(name).is_some() && !self.config_env.contains_key(name) {
                if self.clashing_layers.contains(&(self.modules[m].block, name.to_string())) {
                    return Ok(Value::Poison);
                }
                return self.fail(
                    Diagnostic::error(Code::E0107, format!("`{name}` is a layer, not a value"))
                        .primary(span, "a layer")
                        .help(format!("call it on a tensor: `{name}(x)`")),
                );
            }
        }
        if frame.place == Place::ModelForward && self.clashing_inputs.contains(name) {
            return Ok(Value::Poison);
        }
        if self.poisoned.contains(name) {
            return Ok(Value::Poison);
        }
        if let Some(v) = self.config_env.get(name) {
            return Ok(Value::Scalar(v.clone(), Some(name.to_string())));
        }
        // Name resolution has reported every name it could not resolve; elaboration does not report them again.
        if self.resolved_errors.contains(&span) {
            return Err(Fail::Reported);
        }
        if let Some((node, _)) = self.inputs.get(name) {
            if frame.place == Place::ModelForward {
                return Ok(Value::Tensor(*node));
            }
            return self.fail(super::resolve::input_misuse(name, span, frame.place));
        }
        let mut d = self.unknown_name(name, span, |this| this.names_in_scope(frame));
        if self.config_decls.contains_key(name) {
            d = d.note("config values can only use values defined above them");
        }
        self.fail(d)
    }

    fn names_in_scope(&self, frame: &Frame) -> Vec<String> {
        let mut names: Vec<String> = frame.locals.keys().cloned().collect();
        if let Some(m) = frame.module {
            names.extend(self.modules[m].env.keys().cloned());
        }
        names.extend(self.config_env.keys().cloned());
        if frame.place == Place::ModelForward {
            names.extend(self.inputs.keys().cloned());
        }
        names.sort();
        names
    }

    fn negate(&mut self, v: Value, span: Span) -> R<Value> {
        match v {
            Value::Scalar(Scalar::Int(i), _) => match i.checked_neg() {
                Some(n) => Ok(Value::Scalar(Scalar::Int(n), None)),
                None => self.fail(overflow(span)),
            },
            Value::Scalar(Scalar::Float(f), _) => Ok(Value::Scalar(Scalar::Float(-f), None)),
            Value::Poison => Ok(Value::Poison),
            other => self.fail(
                Diagnostic::error(Code::E0107, format!("cannot negate {}", self.describe(&other)))
                    .primary(span, "`-` needs a number"),
            ),
        }
    }

    fn binary(&mut self, site: BinarySite<'_>, l: Value, r: Value, frame: &Frame) -> R<Value> {
        match (&l, &r) {
            (Value::Poison, _) | (_, Value::Poison) => Ok(Value::Poison),
            (Value::Scalar(a, _), Value::Scalar(b, _)) => {
                let (a, b) = (a.clone(), b.clone());
                self.scalar_binary(site, &a, &b)
            }
            (Value::Tensor(_), _) | (_, Value::Tensor(_)) => self.tensor_binary(site, &l, &r, frame),
            _ => {
                let (dl, dr) = (self.describe(&l), self.describe(&r));
                self.fail(
                    Diagnostic::error(Code::E0107, format!("cannot apply `{}` to {dl} and {dr}", site.op.symbol()))
                        .primary(site.op_span, "arithmetic needs numbers or tensors")
                        .secondary(site.lhs.span, format!("this is {dl}"))
                        .secondary(site.rhs.span, format!("this is {dr}")),
                )
            }
        }
    }

    fn scalar_binary(&mut self, site: BinarySite<'_>, a: &Scalar, b: &Scalar) -> R<Value> {
        let result = match (a, b) {
            (Scalar::Int(x), Scalar::Int(y)) => Scalar::Int(self.int_binary(site, *x, *y)?),
            (Scalar::Int(_) | Scalar::Float(_), Scalar::Int(_) | Scalar::Float(_)) => {
                let (x, y) = (as_f64(a), as_f64(b));
                let v = match site.op {
                    BinOp::Add => x + y,
                    BinOp::Sub => x - y,
                    BinOp::Mul => x * y,
                    BinOp::Div if y == 0.0 => return self.fail(division_by_zero(site.rhs.span)),
                    BinOp::Div => x / y,
                };
                if !v.is_finite() {
                    return self.fail(with_operands(
                        Diagnostic::error(Code::E0203, "arithmetic result is too large")
                            .primary(site.op_span, "the result is not a finite number"),
                        site,
                        a,
                        b,
                    ));
                }
                Scalar::Float(v)
            }
            _ => {
                return self.fail(with_operands(
                    Diagnostic::error(Code::E0107, format!("cannot apply `{}` to {a} and {b}", site.op.symbol()))
                        .primary(site.op_span, "arithmetic needs numbers"),
                    site,
                    a,
                    b,
                ));
            }
        };
        Ok(Value::Scalar(result, None))
    }

    /// Integer arithmetic: checked for overflow; division must be exact.
    fn int_binary(&mut self, site: BinarySite<'_>, x: i64, y: i64) -> R<i64> {
        let (a, b) = (Scalar::Int(x), Scalar::Int(y));
        let v = match site.op {
            BinOp::Add => x.checked_add(y),
            BinOp::Sub => x.checked_sub(y),
            BinOp::Mul => x.checked_mul(y),
            BinOp::Div if y == 0 => return self.fail(division_by_zero(site.rhs.span)),
            BinOp::Div if x.checked_rem(y).is_some_and(|r| r != 0) => {
                return self.fail(with_operands(
                    Diagnostic::error(Code::E0203, format!("{x} / {y} is not a whole number"))
                        .primary(site.op_span, format!("{y} does not divide {x}"))
                        .help("integer sizes must divide exactly; change the values, or write a float literal such as 2.0 for a real quotient"),
                    site,
                    &a,
                    &b,
                ));
            }
            BinOp::Div => x.checked_div(y),
        };
        match v {
            Some(v) => Ok(v),
            None => self.fail(with_operands(overflow(site.op_span), site, &a, &b)),
        }
    }

    /// Dispatches a call: a layer of the current module, a scalar function, or a tensor operator.
    fn eval_call(&mut self, call: &Call, frame: &mut Frame) -> R<Value> {
        let name = call.callee.name.as_str();
        if let Some(m) = frame.module {
            let found = self.modules[m].layer(name).cloned();
            if let Some(layer) = found {
                return self.apply_layer(&layer, call, frame);
            }
        }
        if SCALAR_FUNCTIONS.contains(&name) {
            return self.scalar_call(call, frame);
        }
        if super::ops::is_function(name) {
            return self.apply_op(call, frame);
        }
        if self.resolved_errors.contains(&call.callee.span) {
            return Err(Fail::Reported);
        }
        let layer_names: Vec<String> =
            frame.module.map(|m| self.modules[m].layers.iter().map(|(n, _)| n.clone()).collect()).unwrap_or_default();
        let d = self.bad_callee(call, layer_names.iter().map(String::as_str));
        self.fail(d)
    }

    fn scalar_call(&mut self, call: &Call, frame: &mut Frame) -> R<Value> {
        let name = call.callee.name.as_str();
        let sig = match name {
            "sqrt" => super::args::Signature { name: "sqrt", params: &["x"], required: 1 },
            "min" => super::args::Signature { name: "min", params: &["a", "b"], required: 2 },
            _ => super::args::Signature { name: "max", params: &["a", "b"], required: 2 },
        };
        let a = self.bind_eval(call, &sig, frame)?;
        let mut values = Vec::new();
        for i in 0..sig.params.len() {
            if let Some((e, v)) = a.get(i) {
                values.push(self.as_number(v, e)?);
            }
        }
        let result = match (name, values.as_slice()) {
            ("sqrt", [x]) => {
                let v = as_f64(x);
                if v < 0.0 {
                    return self.fail(
                        Diagnostic::error(Code::E0203, "square root of a negative number")
                            .primary(call.span, format!("sqrt({v})")),
                    );
                }
                Scalar::Float(v.sqrt())
            }
            ("min", [Scalar::Int(a), Scalar::Int(b)]) => Scalar::Int(*a.min(b)),
            ("max", [Scalar::Int(a), Scalar::Int(b)]) => Scalar::Int(*a.max(b)),
            ("min", [a, b]) => Scalar::Float(as_f64(a).min(as_f64(b))),
            ("max", [a, b]) => Scalar::Float(as_f64(a).max(as_f64(b))),
            _ => return Err(Fail::Reported),
        };
        Ok(Value::Scalar(result, None))
    }

    /// Evaluates an expression that must be a number.
    pub(crate) fn expect_number(&mut self, expr: &Expr, frame: &mut Frame) -> R<Scalar> {
        let v = self.eval(expr, frame)?;
        self.as_number(&v, expr)
    }

    pub(crate) fn expect_float(&mut self, expr: &Expr, frame: &mut Frame) -> R<f64> {
        self.expect_number(expr, frame).map(|s| as_f64(&s))
    }

    pub(crate) fn expect_int(&mut self, expr: &Expr, frame: &mut Frame) -> R<i64> {
        let v = self.eval(expr, frame)?;
        self.as_int(&v, expr)
    }

    pub(crate) fn expect_bool(&mut self, expr: &Expr, frame: &mut Frame) -> R<bool> {
        let v = self.eval(expr, frame)?;
        self.as_bool(&v, expr)
    }

    /// Evaluates a size: a positive integer, labelled with the name it was read from.
    pub(crate) fn eval_dim(&mut self, expr: &Expr, frame: &mut Frame) -> R<Dim> {
        let v = self.eval(expr, frame)?;
        self.as_dim(&v, expr)
    }

    /// An evaluated value that must be a number; `expr` is where it was written.
    pub(crate) fn as_number(&mut self, v: &Value, expr: &Expr) -> R<Scalar> {
        match v {
            Value::Scalar(s @ (Scalar::Int(_) | Scalar::Float(_)), _) => Ok(s.clone()),
            Value::Poison => Err(Fail::Reported),
            other => self.type_error(expr, "a number", other),
        }
    }

    pub(crate) fn as_float(&mut self, v: &Value, expr: &Expr) -> R<f64> {
        self.as_number(v, expr).map(|s| as_f64(&s))
    }

    pub(crate) fn as_int(&mut self, v: &Value, expr: &Expr) -> R<i64> {
        match v {
            Value::Scalar(Scalar::Int(i), _) => Ok(*i),
            Value::Poison => Err(Fail::Reported),
            other => self.type_error(expr, "an integer", other),
        }
    }

    pub(crate) fn as_bool(&mut self, v: &Value, expr: &Expr) -> R<bool> {
        match v {
            Value::Scalar(Scalar::Bool(b), _) => Ok(*b),
            Value::Poison => Err(Fail::Reported),
            other => self.type_error(expr, "`true` or `false`", other),
        }
    }

    pub(crate) fn as_str(&mut self, v: &Value, expr: &Expr) -> R<String> {
        match v {
            Value::Scalar(Scalar::Str(s), _) => Ok(s.clone()),
            Value::Poison => Err(Fail::Reported),
            other => self.type_error(expr, "a string", other),
        }
    }

    pub(crate) fn as_tensor(&mut self, v: &Value, expr: &Expr) -> R<petgraph::graph::NodeIndex> {
        match v {
            Value::Tensor(n) => Ok(*n),
            Value::Poison => Err(Fail::Reported),
            other => self.type_error(expr, "a tensor", other),
        }
    }

    /// A size: a positive integer, labelled with the name it was read from.
    pub(crate) fn as_dim(&mut self, v: &Value, expr: &Expr) -> R<Dim> {
        match v {
            Value::Scalar(Scalar::Int(i), label) => self.positive_dim(*i, label.clone(), expr.span),
            Value::Poison => Err(Fail::Reported),
            other => self.type_error(expr, "a size (a positive integer)", other),
        }
    }

    /// A normalisation's `eps` argument, which must be positive; `help` says why. A config value that is
    /// not (`--set eps=0`) is reported at its first use only, naming where it was set.
    pub(crate) fn positive_eps(&mut self, expr: &Expr, frame: &mut Frame, help: &str) -> R<f64> {
        let v = self.eval(expr, frame)?;
        let eps = self.as_float(&v, expr)?;
        if eps > 0.0 {
            return Ok(eps);
        }
        let mut d = Diagnostic::error(Code::E0202, format!("`eps` must be positive, but this is {eps}"))
            .primary(expr.span, format!("this is {eps}"))
            .help(help);
        let label = match &v {
            Value::Scalar(_, label) => label.as_deref(),
            _ => None,
        };
        if let Some(c) = label.and_then(|l| self.config_value(l)).cloned() {
            // Keyed apart from the sizes' roots: a value can be a bad size and a bad eps at once.
            if !self.bad_sizes.insert(format!("eps {}", c.name)) {
                return Err(Fail::Reported);
            }
            d = d
                .secondary(c.span, format!("`{}` is {}", c.name, where_set(&c)))
                .note(format!("other `eps` arguments read from `{}` are not reported again", c.name));
        }
        self.fail(d)
    }

    /// A size that must be positive. A config value that is not is reported at its first use as a size only; so
    /// is a `--set` override to a size that is not positive, together with every value computed from it.
    pub(crate) fn positive_dim(&mut self, value: i64, label: Option<String>, span: Span) -> R<Dim> {
        if value > 0 {
            return Ok(Dim::new(value.unsigned_abs(), label));
        }
        let mut d = Diagnostic::error(Code::E0202, format!("a size must be positive, but this is {value}"))
            .primary(span, format!("this is {value}"));
        let config = label.as_deref().and_then(|l| self.config_value(l)).cloned();
        if let Some(c) = config {
            let root = self.override_roots.get(&c.name).cloned().unwrap_or_else(|| c.name.clone());
            if !self.bad_sizes.insert(root.clone()) {
                return Err(Fail::Reported);
            }
            d = d.secondary(c.span, format!("`{}` is {}", c.name, where_set(&c)));
            match self.config_value(&root).filter(|_| root != c.name).cloned() {
                Some(r) => {
                    d = d.secondary(r.span, format!("`{}` is {}", r.name, where_set(&r))).note(format!(
                        "`{}` is computed from `{}`; other sizes computed from `{}` are not reported again",
                        c.name, r.name, r.name
                    ));
                }
                None if c.overridden => {
                    d = d.note(format!(
                        "other uses of `{}` as a size, and of sizes computed from it, are not reported again",
                        c.name
                    ));
                }
                None => d = d.note(format!("other uses of `{}` as a size are not reported again", c.name)),
            }
        }
        self.fail(d)
    }

    pub(crate) fn type_error<T>(&mut self, expr: &Expr, expected: &str, found: &Value) -> R<T> {
        let found = self.describe(found);
        self.fail(
            Diagnostic::error(Code::E0107, format!("expected {expected}, found {found}"))
                .primary(expr.span, format!("this is {found}")),
        )
    }

    /// Describes a value for messages: "the integer 3", "a tensor f32[4, 16]".
    pub(crate) fn describe(&self, v: &Value) -> String {
        match v {
            Value::Scalar(Scalar::Int(i), _) => format!("the integer {i}"),
            Value::Scalar(Scalar::Float(f), _) => format!("the number {f:?}"),
            Value::Scalar(Scalar::Bool(b), _) => format!("`{b}`"),
            Value::Scalar(Scalar::Str(s), _) => format!("the string {s:?}"),
            Value::List(items) => format!("a list of {} items", items.len()),
            Value::Tensor(n) => format!("a tensor {}", super::ops::show_type(self.ty(*n))),
            Value::Poison => "an invalid value".to_string(),
        }
    }

    /// Used by layer application: whether a layer value is still usable.
    pub(crate) fn is_poison(layer: &Layer) -> bool {
        matches!(layer, Layer::Poison)
    }
}

pub(crate) fn as_f64(s: &Scalar) -> f64 {
    match s {
        Scalar::Int(i) => *i as f64,
        Scalar::Float(f) => *f,
        _ => f64::NAN,
    }
}

/// A binary operation being evaluated: the operator, where it is written, and its operand expressions.
#[derive(Clone, Copy)]
pub(crate) struct BinarySite<'e> {
    pub op: BinOp,
    pub op_span: Span,
    pub lhs: &'e Expr,
    pub rhs: &'e Expr,
}

impl BinarySite<'_> {
    /// The whole `lhs op rhs` expression.
    pub fn span(&self) -> Span {
        self.lhs.span.to(self.rhs.span)
    }
}

/// Labels each operand that is not a literal with its value, so the user sees where a number came from.
fn with_operands(mut d: Diagnostic, site: BinarySite<'_>, a: &Scalar, b: &Scalar) -> Diagnostic {
    for (expr, value) in [(site.lhs, a), (site.rhs, b)] {
        if !matches!(expr.kind, ExprKind::Int(_) | ExprKind::Float(_) | ExprKind::Str(_) | ExprKind::Bool(_)) {
            d = d.secondary(expr.span, format!("this is {value}"));
        }
    }
    d
}

fn division_by_zero(divisor: Span) -> Diagnostic {
    Diagnostic::error(Code::E0203, "division by zero").primary(divisor, "this is 0")
}

fn overflow(span: Span) -> Diagnostic {
    Diagnostic::error(Code::E0203, "integer overflow")
        .primary(span, format!("the result does not fit in {} bits", i64::BITS))
}

/// Where a config value named in a diagnostic got its value: `set to 0 by `--set``, or `defined here`.
fn where_set(c: &crate::ir::ConfigValue) -> String {
    if c.overridden { format!("set to {} by `--set`", c.value) } else { "defined here".to_string() }
}
