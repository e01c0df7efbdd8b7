//! Parameter-free tensor operators: their signatures and shape rules.

use super::args::Signature;
use super::{Elab, Fail, Frame, R, Value};
use crate::diag::Diagnostic;
use crate::ir::{DType, Dim, Op, TensorType};
use crate::span::Span;
use crate::syntax::ast::{BinOp, Call, Expr};
use petgraph::graph::NodeIndex;

/// Operators callable in a forward.
pub const FUNCTIONS: [&str; 12] = [
    "gelu",
    "softmax",
    "dropout",
    "self_attention",
    "cross_entropy",
    "matmul",
    "reshape",
    "transpose",
    "scale",
    "causal_mask",
    "select",
    "add",
];

pub fn is_function(name: &str) -> bool {
    FUNCTIONS.contains(&name)
}

/// Shows a tensor type as in the language: `f32[4, 16, 64]`.
pub fn show_type(ty: &TensorType) -> String {
    let dims: Vec<String> = ty.shape.iter().map(|d| d.size.to_string()).collect();
    format!("{}[{}]", ty.dtype.name(), dims.join(", "))
}

/// Resolves a possibly negative dimension index against a rank.
fn axis(index: i64, rank: usize) -> Option<usize> {
    let rank = i64::try_from(rank).ok()?;
    let resolved = if index < 0 { index + rank } else { index };
    (0..rank).contains(&resolved).then(|| resolved.unsigned_abs() as usize)
}

impl Elab<'_> {
    /// Applies a built-in operator to its evaluated arguments.
    pub(crate) fn apply_op(&mut self, call: &Call, frame: &mut Frame) -> R<Value> {
        let name = call.callee.name.as_str();
        let scope = self.scope_of(frame);
        let sig = signature(name);
        let b = self.bind(call, &sig)?;
        let arg = |i: usize| b.get(i);
        let first = arg(0).ok_or(Fail::Reported)?;
        let x = self.expect_tensor(first, frame)?;
        let xt = self.ty(x).clone();
        let (op, ty, operands) = match name {
            "gelu" => {
                self.expect_float_tensor(x, first.span)?;
                let approximate = match arg(1) {
                    None => false,
                    Some(e) => match self.expect_str(e, frame)?.as_str() {
                        "tanh" => true,
                        "none" => false,
                        other => {
                            return self.fail(
                                Diagnostic::error("E0107", format!("unknown gelu approximation {other:?}"))
                                    .primary(e.span, "expected \"tanh\" or \"none\""),
                            );
                        }
                    },
                };
                (Op::Gelu { approximate }, xt, vec![x])
            }
            "softmax" => {
                self.expect_float_tensor(x, first.span)?;
                self.expect_rank_at_least(x, 1, first.span)?;
                (Op::Softmax, xt, vec![x])
            }
            "causal_mask" => {
                self.expect_float_tensor(x, first.span)?;
                self.expect_square_tail(x, first.span)?;
                (Op::CausalMask, xt, vec![x])
            }
            "dropout" => {
                self.expect_float_tensor(x, first.span)?;
                let pe = arg(1).ok_or(Fail::Reported)?;
                let p = self.expect_float(pe, frame)?;
                if !(0.0..1.0).contains(&p) {
                    return self.fail(
                        Diagnostic::error("E0202", format!("dropout probability must be in [0, 1), but this is {p}"))
                            .primary(pe.span, format!("this is {p}")),
                    );
                }
                (Op::Dropout { p }, xt, vec![x])
            }
            "scale" => {
                self.expect_float_tensor(x, first.span)?;
                let factor = self.expect_float(arg(1).ok_or(Fail::Reported)?, frame)?;
                (Op::Scale { factor }, xt, vec![x])
            }
            "add" => {
                let second = arg(1).ok_or(Fail::Reported)?;
                let y = self.expect_tensor(second, frame)?;
                let ty = self.same_shape(x, y, first.span, second.span, call.span, "add")?;
                (Op::Add, ty, vec![x, y])
            }
            "self_attention" => return self.attention(call, &b, x, frame, &scope),
            "cross_entropy" => {
                let second = arg(1).ok_or(Fail::Reported)?;
                let t = self.expect_tensor(second, frame)?;
                let ty = self.cross_entropy_type(x, t, first.span, second.span)?;
                (Op::CrossEntropy, ty, vec![x, t])
            }
            "matmul" => {
                let second = arg(1).ok_or(Fail::Reported)?;
                let y = self.expect_tensor(second, frame)?;
                let ty = self.matmul_type(x, y, first.span, second.span, call.span)?;
                (Op::MatMul, ty, vec![x, y])
            }
            "transpose" => {
                let d0 = self.axis_arg(arg(1).ok_or(Fail::Reported)?, xt.rank(), frame)?;
                let d1 = self.axis_arg(arg(2).ok_or(Fail::Reported)?, xt.rank(), frame)?;
                let mut ty = xt;
                ty.shape.swap(d0, d1);
                (Op::Transpose { dim0: d0, dim1: d1 }, ty, vec![x])
            }
            "select" => {
                let dim = self.axis_arg(arg(1).ok_or(Fail::Reported)?, xt.rank(), frame)?;
                let ie = arg(2).ok_or(Fail::Reported)?;
                let index = self.expect_int(ie, frame)?;
                let size = xt.shape[dim].size;
                let Some(index) = u64::try_from(index).ok().filter(|i| *i < size) else {
                    return self.fail(
                        Diagnostic::error(
                            "E0202",
                            format!("index {index} is out of range for a dimension of size {size}"),
                        )
                        .primary(ie.span, format!("must be in 0..{size}")),
                    );
                };
                let mut ty = xt;
                ty.shape.remove(dim);
                (Op::Select { dim, index }, ty, vec![x])
            }
            _ => {
                let se = arg(1).ok_or(Fail::Reported)?;
                let ty = self.reshape_type(&xt, se, frame, first.span)?;
                (Op::Reshape, ty, vec![x])
            }
        };
        self.add_node(op, ty, call.span, &scope, &operands).map(Value::Tensor)
    }

    /// `a + b`, `a * 0.5`, `0.5 * a`, `a / 2` on tensors.
    pub(crate) fn tensor_binary(
        &mut self,
        op: BinOp,
        lhs: (Value, &Expr),
        rhs: (Value, &Expr),
        span: Span,
        frame: &Frame,
    ) -> R<Value> {
        let scope = self.scope_of(frame);
        match (op, &lhs.0, &rhs.0) {
            (BinOp::Add, Value::Tensor(a), Value::Tensor(b)) => {
                let ty = self.same_shape(*a, *b, lhs.1.span, rhs.1.span, span, "+")?;
                self.add_node(Op::Add, ty, span, &scope, &[*a, *b]).map(Value::Tensor)
            }
            (BinOp::Mul, Value::Tensor(t), Value::Scalar(s, _))
            | (BinOp::Mul, Value::Scalar(s, _), Value::Tensor(t)) => {
                let factor = super::eval::as_f64(s);
                self.scale_node(*t, factor, span, &scope)
            }
            (BinOp::Div, Value::Tensor(t), Value::Scalar(s, _)) => {
                let d = super::eval::as_f64(s);
                if d == 0.0 || !d.is_finite() {
                    return self.fail(
                        Diagnostic::error("E0203", "division of a tensor by zero").primary(rhs.1.span, "this is 0"),
                    );
                }
                self.scale_node(*t, 1.0 / d, span, &scope)
            }
            _ => {
                let (l, r) = (self.describe(&lhs.0), self.describe(&rhs.0));
                self.fail(
                    Diagnostic::error("E0107", format!("cannot apply `{}` to {l} and {r}", op.symbol()))
                        .primary(span, "unsupported here")
                        .note("tensors support `a + b` (same shapes) and scaling by a number (`x * 0.5`, `x / 8`)"),
                )
            }
        }
    }

    fn scale_node(&mut self, t: NodeIndex, factor: f64, span: Span, scope: &str) -> R<Value> {
        if !factor.is_finite() {
            return self.fail(
                Diagnostic::error("E0107", "a tensor can only be scaled by a number")
                    .primary(span, "not a finite number"),
            );
        }
        let ty = self.ty(t).clone();
        self.add_node(Op::Scale { factor }, ty, span, scope, &[t]).map(Value::Tensor)
    }

    fn same_shape(&mut self, a: NodeIndex, b: NodeIndex, sa: Span, sb: Span, span: Span, what: &str) -> R<TensorType> {
        let (ta, tb) = (self.ty(a).clone(), self.ty(b).clone());
        if ta.sizes() == tb.sizes() && ta.dtype == tb.dtype {
            return Ok(ta);
        }
        let (sta, stb) = (show_type(&ta), show_type(&tb));
        self.fail(
            Diagnostic::error("E0201", format!("shape mismatch in `{what}`: {sta} and {stb}"))
                .primary(span, "operands must have the same shape and type")
                .secondary(sa, format!("this is {sta}"))
                .secondary(sb, format!("this is {stb}")),
        )
    }

    fn expect_rank_at_least(&mut self, x: NodeIndex, rank: usize, span: Span) -> R<()> {
        let ty = self.ty(x).clone();
        if ty.rank() >= rank {
            return Ok(());
        }
        self.fail(
            Diagnostic::error(
                "E0201",
                format!("expected a tensor with at least {rank} dimensions, found {}", show_type(&ty)),
            )
            .primary(span, "too few dimensions"),
        )
    }

    fn expect_square_tail(&mut self, x: NodeIndex, span: Span) -> R<()> {
        let ty = self.ty(x).clone();
        let n = ty.rank();
        if n >= 2 && ty.shape[n - 1].size == ty.shape[n - 2].size {
            return Ok(());
        }
        self.fail(
            Diagnostic::error("E0201", format!("causal_mask needs square [.., s, s] scores, found {}", show_type(&ty)))
                .primary(span, "last two dimensions must be equal"),
        )
    }

    fn axis_arg(&mut self, e: &Expr, rank: usize, frame: &mut Frame) -> R<usize> {
        let i = self.expect_int(e, frame)?;
        match axis(i, rank) {
            Some(a) => Ok(a),
            None => self.fail(
                Diagnostic::error("E0202", format!("dimension {i} is out of range for a tensor of rank {rank}"))
                    .primary(e.span, format!("must be in -{rank}..{rank}")),
            ),
        }
    }

    fn cross_entropy_type(&mut self, logits: NodeIndex, targets: NodeIndex, sl: Span, st: Span) -> R<TensorType> {
        self.expect_float_tensor(logits, sl)?;
        self.expect_int_tensor(targets, st)?;
        let (tl, tt) = (self.ty(logits).clone(), self.ty(targets).clone());
        let leading: Vec<u64> = tl.sizes().iter().take(tl.rank().saturating_sub(1)).copied().collect();
        if tl.rank() == 0 || leading != tt.sizes() {
            return self.fail(
                Diagnostic::error(
                    "E0201",
                    format!(
                        "shape mismatch in `cross_entropy`: logits {} need targets [{}], found {}",
                        show_type(&tl),
                        leading.iter().map(u64::to_string).collect::<Vec<_>>().join(", "),
                        show_type(&tt)
                    ),
                )
                .primary(st, format!("this is {}", show_type(&tt)))
                .secondary(sl, format!("logits are {}", show_type(&tl))),
            );
        }
        Ok(TensorType { dtype: DType::F32, shape: Vec::new() })
    }

    fn matmul_type(&mut self, a: NodeIndex, b: NodeIndex, sa: Span, sb: Span, span: Span) -> R<TensorType> {
        self.expect_float_tensor(a, sa)?;
        self.expect_float_tensor(b, sb)?;
        let (ta, tb) = (self.ty(a).clone(), self.ty(b).clone());
        let (ra, rb) = (ta.rank(), tb.rank());
        let fits = ra >= 2
            && ra == rb
            && ta.sizes()[..ra - 2] == tb.sizes()[..rb - 2]
            && ta.shape[ra - 1].size == tb.shape[rb - 2].size;
        if !fits {
            let (sta, stb) = (show_type(&ta), show_type(&tb));
            return self.fail(
                Diagnostic::error("E0201", format!("shape mismatch in `matmul`: {sta} and {stb}"))
                    .primary(span, "needs [.., m, k] and [.., k, n] with equal leading dimensions")
                    .secondary(sa, format!("this is {sta}"))
                    .secondary(sb, format!("this is {stb}")),
            );
        }
        let mut shape: Vec<Dim> = ta.shape[..ra - 1].to_vec();
        shape.push(tb.shape[rb - 1].clone());
        Ok(TensorType { dtype: ta.dtype, shape })
    }

    fn reshape_type(&mut self, xt: &TensorType, se: &Expr, frame: &mut Frame, sx: Span) -> R<TensorType> {
        let crate::syntax::ast::ExprKind::List(items) = &se.kind else {
            return self.fail(
                Diagnostic::error("E0107", "`reshape` takes a list of sizes")
                    .primary(se.span, "expected a list such as [batch, seq, hidden]"),
            );
        };
        let mut shape = Vec::new();
        for item in items {
            shape.push(self.eval_dim(item, frame)?);
        }
        let ty = TensorType { dtype: xt.dtype, shape };
        if ty.elements() != xt.elements() {
            return self.fail(
                Diagnostic::error(
                    "E0201",
                    format!("shape mismatch in `reshape`: {} cannot become {}", show_type(xt), show_type(&ty)),
                )
                .primary(
                    se.span,
                    format!("{} elements", ty.elements().map_or("too many".to_string(), |e| e.to_string())),
                )
                .secondary(sx, format!("{} elements", xt.elements().unwrap_or(0))),
            );
        }
        Ok(ty)
    }

    /// `self_attention(qkv, heads: n)` or `self_attention(q, k, v, heads: n, causal: false)`.
    fn attention(
        &mut self,
        call: &Call,
        b: &super::args::Bound<'_>,
        first: NodeIndex,
        frame: &mut Frame,
        scope: &str,
    ) -> R<Value> {
        let mut operands = vec![first];
        for i in 1..3 {
            if let Some(e) = b.get(i) {
                operands.push(self.expect_tensor(e, frame)?);
            }
        }
        if operands.len() == 2 {
            return self.fail(
                Diagnostic::error("E0103", "`self_attention` takes one fused qkv tensor or three tensors q, k, v")
                    .primary(call.args_span, "2 tensors given"),
            );
        }
        let heads_expr = b.get(3).ok_or(Fail::Reported)?;
        let heads = self.eval_dim(heads_expr, frame)?;
        let causal = match b.get(4) {
            Some(e) => self.expect_bool(e, frame)?,
            None => true,
        };
        let fused = operands.len() == 1;
        let ty = self.attention_type(&operands, heads.size, fused, call, heads_expr.span)?;
        let op = Op::Attention { heads: heads.size, causal, fused };
        self.add_node(op, ty, call.span, scope, &operands).map(Value::Tensor)
    }

    fn attention_type(
        &mut self,
        operands: &[NodeIndex],
        heads: u64,
        fused: bool,
        call: &Call,
        heads_span: Span,
    ) -> R<TensorType> {
        for (i, &o) in operands.iter().enumerate() {
            let span = call.args.get(i).map_or(call.span, |a| a.span);
            self.expect_float_tensor(o, span)?;
            let ty = self.ty(o).clone();
            if ty.rank() < 2 {
                return self.fail(
                    Diagnostic::error(
                        "E0201",
                        format!("attention needs [.., seq, width] inputs, found {}", show_type(&ty)),
                    )
                    .primary(span, "too few dimensions"),
                );
            }
        }
        let t0 = self.ty(operands[0]).clone();
        let width = t0.shape[t0.rank() - 1].size;
        let model_width = if fused { width / 3 } else { width };
        if fused && !width.is_multiple_of(3) {
            return self.fail(
                Diagnostic::error(
                    "E0201",
                    format!(
                        "a fused qkv tensor's last dimension must be 3 x hidden, but {width} is not a multiple of 3"
                    ),
                )
                .primary(call.args[0].span, format!("this is {}", show_type(&t0))),
            );
        }
        if model_width % heads != 0 {
            return self.fail(
                Diagnostic::error("E0201", format!("{heads} heads do not divide the attention width {model_width}"))
                    .primary(heads_span, format!("{heads} heads"))
                    .secondary(call.args[0].span, format!("width {model_width}")),
            );
        }
        for (i, &o) in operands.iter().enumerate().skip(1) {
            let ti = self.ty(o).clone();
            if ti.sizes() != t0.sizes() {
                return self.fail(
                    Diagnostic::error(
                        "E0201",
                        format!(
                            "shape mismatch in `self_attention`: q is {} but this is {}",
                            show_type(&t0),
                            show_type(&ti)
                        ),
                    )
                    .primary(call.args[i].span, format!("this is {}", show_type(&ti)))
                    .secondary(call.args[0].span, format!("q is {}", show_type(&t0))),
                );
            }
        }
        let mut shape = t0.shape.clone();
        if let (true, Some(last)) = (fused, shape.last_mut()) {
            // (3, heads, head) becomes (heads, head): the heads factor survives for sharding.
            let factors = if last.factors.len() == 3 { last.factors[1..].to_vec() } else { Vec::new() };
            *last = Dim { size: model_width, label: None, factors };
        }
        Ok(TensorType { dtype: t0.dtype, shape })
    }
}

/// The signature of a built-in operator.
fn signature(name: &str) -> Signature<'static> {
    let (params, required): (&'static [&'static str], usize) = match name {
        "gelu" => (&["x", "approx"], 1),
        "softmax" | "causal_mask" => (&["x"], 1),
        "dropout" => (&["x", "p"], 2),
        "scale" => (&["x", "factor"], 2),
        "add" | "matmul" => (&["a", "b"], 2),
        "cross_entropy" => (&["logits", "targets"], 2),
        "transpose" => (&["x", "dim0", "dim1"], 3),
        "select" => (&["x", "dim", "index"], 3),
        "reshape" => (&["x", "shape"], 2),
        "self_attention" => (&["q", "k", "v", "heads", "causal"], 1),
        _ => (&["x"], 1),
    };
    let name = FUNCTIONS.iter().copied().find(|f| *f == name).unwrap_or("operator");
    Signature { name, params, required }
}
