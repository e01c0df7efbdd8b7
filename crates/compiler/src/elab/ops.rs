//! Parameter-free tensor operators: their signatures and shape rules.

use super::args::{Evaluated, Signature};
use super::eval::BinarySite;
use super::{Elab, Fail, Frame, R, Value};
use crate::diag::{Code, Diagnostic};
use crate::ir::{DType, Dim, Op, TensorType};
use crate::syntax::ast::{BinOp, Call, Expr};
use optimus_plan::span::Span;
use petgraph::graph::NodeIndex;

/// An operator callable in a forward, grouped by how it is elaborated: every match on one is
/// exhaustive, so a new operator does not compile until each place that must handle it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Function {
    Unary(Unary),
    Binary(Binary),
    Shape(ShapeFn),
    SelfAttention,
    Rotary,
}

/// Element-wise operators on one floating-point tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unary {
    Gelu,
    Silu,
    Softmax,
    CausalMask,
    Dropout,
    Scale,
}

/// Operators on two tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binary {
    Add,
    Mul,
    CrossEntropy,
    MatMul,
}

/// Operators that rearrange one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShapeFn {
    Transpose,
    Select,
    Reshape,
}

/// One built-in operator: its name in the language, what it is, its parameters (in order) and how
/// many of them are required.
pub struct Builtin {
    pub name: &'static str,
    pub function: Function,
    pub params: &'static [&'static str],
    pub required: usize,
}

/// Every operator callable in a forward, the one table the elaborator reads.
pub const BUILTINS: [Builtin; 15] = [
    Builtin { name: "gelu", function: Function::Unary(Unary::Gelu), params: &["x", "approx"], required: 1 },
    Builtin { name: "silu", function: Function::Unary(Unary::Silu), params: &["x"], required: 1 },
    Builtin { name: "softmax", function: Function::Unary(Unary::Softmax), params: &["x"], required: 1 },
    Builtin { name: "dropout", function: Function::Unary(Unary::Dropout), params: &["x", "p"], required: 2 },
    Builtin {
        name: "self_attention",
        function: Function::SelfAttention,
        params: &["q", "k", "v", "heads", "causal", "kv_heads"],
        required: 1,
    },
    Builtin { name: "rotary", function: Function::Rotary, params: &["x", "heads", "theta"], required: 2 },
    Builtin {
        name: "cross_entropy",
        function: Function::Binary(Binary::CrossEntropy),
        params: &["logits", "targets"],
        required: 2,
    },
    Builtin { name: "matmul", function: Function::Binary(Binary::MatMul), params: &["a", "b"], required: 2 },
    Builtin { name: "reshape", function: Function::Shape(ShapeFn::Reshape), params: &["x", "shape"], required: 2 },
    Builtin {
        name: "transpose",
        function: Function::Shape(ShapeFn::Transpose),
        params: &["x", "dim0", "dim1"],
        required: 3,
    },
    Builtin { name: "scale", function: Function::Unary(Unary::Scale), params: &["x", "factor"], required: 2 },
    Builtin { name: "causal_mask", function: Function::Unary(Unary::CausalMask), params: &["x"], required: 1 },
    Builtin { name: "select", function: Function::Shape(ShapeFn::Select), params: &["x", "dim", "index"], required: 3 },
    Builtin { name: "add", function: Function::Binary(Binary::Add), params: &["a", "b"], required: 2 },
    Builtin { name: "mul", function: Function::Binary(Binary::Mul), params: &["a", "b"], required: 2 },
];

/// The rotary base when `rotary` is given none: Hugging Face Llama's default `rope_theta`.
pub const DEFAULT_ROPE_THETA: f64 = 10000.0;

/// The names of the operators callable in a forward.
pub fn function_names() -> impl Iterator<Item = &'static str> {
    BUILTINS.iter().map(|b| b.name)
}

/// The built-in operator of this name, if there is one.
pub fn builtin(name: &str) -> Option<&'static Builtin> {
    BUILTINS.iter().find(|b| b.name == name)
}

pub fn is_function(name: &str) -> bool {
    builtin(name).is_some()
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
    /// Applies a built-in operator to its arguments, each evaluated once.
    pub(crate) fn apply_op(&mut self, call: &Call, frame: &mut Frame) -> R<Value> {
        let scope = self.scope_of(frame);
        let Some(builtin) = builtin(call.callee.name.as_str()) else {
            return self.fail(
                Diagnostic::error(
                    Code::E0699,
                    format!("internal error: `{}` is not a built-in operator", call.callee.name),
                )
                .primary(call.callee.span, "called here"),
            );
        };
        let sig = Signature { name: builtin.name, params: builtin.params, required: builtin.required };
        let a = self.bind_eval(call, &sig, frame)?;
        let (first, v) = a.required(0)?;
        let x = self.as_tensor(v, first)?;
        let (op, ty, operands) = match builtin.function {
            Function::SelfAttention => return self.attention(call, &a, x, &scope),
            Function::Rotary => self.rotary(&a, x)?,
            Function::Unary(f) => self.unary_op(f, &a, x)?,
            Function::Binary(f) => self.binary_op(call, f, &a, x)?,
            Function::Shape(f) => self.shape_op(f, &a, x)?,
        };
        self.add_node(op, ty, call.span, &scope, &operands).map(Value::Tensor)
    }

    /// Element-wise operators on one floating-point tensor.
    fn unary_op(&mut self, f: Unary, a: &Evaluated<'_>, x: NodeIndex) -> R<(Op, TensorType, Vec<NodeIndex>)> {
        let first = a.required(0)?.0;
        self.expect_float_tensor(x, first.span)?;
        let xt = self.ty(x).clone();
        let op = match f {
            Unary::Gelu => Op::Gelu { approximate: self.gelu_approximation(a.get(1))? },
            Unary::Silu => Op::Silu,
            Unary::Softmax => {
                self.expect_rank_at_least(x, 1, first.span)?;
                Op::Softmax
            }
            Unary::CausalMask => {
                self.expect_square_tail(x, first.span)?;
                Op::CausalMask
            }
            Unary::Dropout => {
                let (pe, pv) = a.required(1)?;
                let p = self.as_float(pv, pe)?;
                if !(0.0..1.0).contains(&p) {
                    return self.fail(
                        Diagnostic::error(
                            Code::E0202,
                            format!("dropout probability must be in [0, 1), but this is {p}"),
                        )
                        .primary(pe.span, format!("this is {p}")),
                    );
                }
                Op::Dropout { p }
            }
            Unary::Scale => {
                let (fe, fv) = a.required(1)?;
                Op::Scale { factor: self.as_float(fv, fe)? }
            }
        };
        Ok((op, xt, vec![x]))
    }

    fn gelu_approximation(&mut self, arg: Option<(&Expr, &Value)>) -> R<bool> {
        let Some((e, v)) = arg else { return Ok(false) };
        match self.as_str(v, e)?.as_str() {
            "tanh" => Ok(true),
            "none" => Ok(false),
            other => self.fail(
                Diagnostic::error(Code::E0107, format!("unknown gelu approximation {other:?}"))
                    .primary(e.span, "expected \"tanh\" or \"none\""),
            ),
        }
    }

    /// Operators on two tensors.
    fn binary_op(
        &mut self,
        call: &Call,
        f: Binary,
        a: &Evaluated<'_>,
        x: NodeIndex,
    ) -> R<(Op, TensorType, Vec<NodeIndex>)> {
        let first = a.required(0)?.0;
        let (second, yv) = a.required(1)?;
        let y = self.as_tensor(yv, second)?;
        let (op, ty) = match f {
            Binary::Add => (Op::Add, self.same_shape(x, y, first.span, second.span, call.callee.span, "add")?),
            Binary::Mul => (Op::Mul, self.product_type(x, y, first.span, second.span, call.callee.span, "mul")?),
            Binary::CrossEntropy => (Op::CrossEntropy, self.cross_entropy_type(x, y, first.span, second.span)?),
            Binary::MatMul => (Op::MatMul, self.matmul_type(x, y, first.span, second.span, call.callee.span)?),
        };
        Ok((op, ty, vec![x, y]))
    }

    /// Operators that rearrange one tensor: transpose, select and reshape.
    fn shape_op(&mut self, f: ShapeFn, a: &Evaluated<'_>, x: NodeIndex) -> R<(Op, TensorType, Vec<NodeIndex>)> {
        let xt = self.ty(x).clone();
        let (e1, v1) = a.required(1)?;
        match f {
            ShapeFn::Transpose => {
                let (e2, v2) = a.required(2)?;
                let d0 = self.axis_arg(v1, e1, xt.rank());
                let (d0, d1) = (d0?, self.axis_arg(v2, e2, xt.rank())?);
                let mut ty = xt;
                ty.shape.swap(d0, d1);
                Ok((Op::Transpose { dim0: d0, dim1: d1 }, ty, vec![x]))
            }
            ShapeFn::Select => {
                let (ie, iv) = a.required(2)?;
                let dim = self.axis_arg(v1, e1, xt.rank());
                let (dim, index) = (dim?, self.as_int(iv, ie)?);
                let size = xt.shape[dim].size;
                let Some(index) = u64::try_from(index).ok().filter(|i| *i < size) else {
                    return self.fail(
                        Diagnostic::error(
                            Code::E0202,
                            format!("index {index} is out of range for a dimension of size {size}"),
                        )
                        .primary(ie.span, format!("must be in 0..{size}")),
                    );
                };
                let mut ty = xt;
                ty.shape.remove(dim);
                Ok((Op::Select { dim, index }, ty, vec![x]))
            }
            ShapeFn::Reshape => {
                let first = a.required(0)?.0;
                let ty = self.reshape_type(&xt, e1, v1, first.span)?;
                Ok((Op::Reshape, ty, vec![x]))
            }
        }
    }

    /// `a + b`, `a * b`, `a * 0.5`, `0.5 * a`, `a / 2` on tensors.
    pub(crate) fn tensor_binary(&mut self, site: BinarySite<'_>, l: &Value, r: &Value, frame: &Frame) -> R<Value> {
        let scope = self.scope_of(frame);
        let span = site.span();
        match (site.op, l, r) {
            (BinOp::Add, Value::Tensor(a), Value::Tensor(b)) => {
                let ty = self.same_shape(*a, *b, site.lhs.span, site.rhs.span, site.op_span, "+")?;
                self.add_node(Op::Add, ty, span, &scope, &[*a, *b]).map(Value::Tensor)
            }
            (BinOp::Mul, Value::Tensor(a), Value::Tensor(b)) => {
                let ty = self.product_type(*a, *b, site.lhs.span, site.rhs.span, site.op_span, "*")?;
                self.add_node(Op::Mul, ty, span, &scope, &[*a, *b]).map(Value::Tensor)
            }
            (BinOp::Mul, Value::Tensor(t), Value::Scalar(s, _)) => {
                // Like `scale(t, n)`: only floating-point tensors can be scaled.
                self.expect_float_tensor(*t, site.lhs.span)?;
                self.scale_node(*t, super::eval::as_f64(s), span, &scope)
            }
            (BinOp::Mul, Value::Scalar(s, _), Value::Tensor(t)) => {
                self.expect_float_tensor(*t, site.rhs.span)?;
                self.scale_node(*t, super::eval::as_f64(s), span, &scope)
            }
            (BinOp::Div, Value::Tensor(t), Value::Scalar(s, _)) => {
                self.expect_float_tensor(*t, site.lhs.span)?;
                let d = super::eval::as_f64(s);
                if d == 0.0 || !d.is_finite() {
                    return self.fail(
                        Diagnostic::error(Code::E0203, "division of a tensor by zero")
                            .primary(site.rhs.span, format!("this is {s}")),
                    );
                }
                self.scale_node(*t, 1.0 / d, span, &scope)
            }
            _ => {
                let (dl, dr) = (self.describe(l), self.describe(r));
                self.fail(
                    Diagnostic::error(Code::E0107, format!("cannot apply `{}` to {dl} and {dr}", site.op.symbol()))
                        .primary(site.op_span, "not supported on these operands")
                        .secondary(site.lhs.span, format!("this is {dl}"))
                        .secondary(site.rhs.span, format!("this is {dr}"))
                        .note(
                            "tensors support `a + b` and `a * b` (same shapes) and scaling by a number (`x * 0.5`, `x / 8`)",
                        ),
                )
            }
        }
    }

    fn scale_node(&mut self, t: NodeIndex, factor: f64, span: Span, scope: &str) -> R<Value> {
        if !factor.is_finite() {
            return self.fail(
                Diagnostic::error(Code::E0107, "a tensor can only be scaled by a number")
                    .primary(span, "not a finite number"),
            );
        }
        let ty = self.ty(t).clone();
        self.add_node(Op::Scale { factor }, ty, span, scope, &[t]).map(Value::Tensor)
    }

    /// Checks that two operands have the same type; `at` is the operator (or the callee of `add`).
    fn same_shape(&mut self, a: NodeIndex, b: NodeIndex, sa: Span, sb: Span, at: Span, what: &str) -> R<TensorType> {
        let (ta, tb) = (self.ty(a).clone(), self.ty(b).clone());
        if ta.sizes() == tb.sizes() && ta.dtype == tb.dtype {
            return Ok(ta);
        }
        let (sta, stb) = (show_type(&ta), show_type(&tb));
        self.fail(
            Diagnostic::error(Code::E0201, format!("shape mismatch in `{what}`: {sta} and {stb}"))
                .primary(at, format!("`{what}` needs operands of the same shape and type"))
                .secondary(sa, format!("this is {sta}"))
                .secondary(sb, format!("this is {stb}")),
        )
    }

    /// The type of an element-wise product: floating-point operands of the same shape and type.
    fn product_type(&mut self, a: NodeIndex, b: NodeIndex, sa: Span, sb: Span, at: Span, what: &str) -> R<TensorType> {
        let ty = self.same_shape(a, b, sa, sb, at, what)?;
        // Same type, so one check covers both operands.
        self.expect_float_tensor(a, sa)?;
        Ok(ty)
    }

    fn expect_rank_at_least(&mut self, x: NodeIndex, rank: usize, span: Span) -> R<()> {
        let ty = self.ty(x).clone();
        if ty.rank() >= rank {
            return Ok(());
        }
        self.fail(
            Diagnostic::error(
                Code::E0201,
                format!(
                    "expected a tensor with at least {}, found {}",
                    super::args::plural(rank, "dimension"),
                    show_type(&ty)
                ),
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
            Diagnostic::error(
                Code::E0201,
                format!("causal_mask needs square [.., s, s] scores, found {}", show_type(&ty)),
            )
            .primary(span, "last two dimensions must be equal"),
        )
    }

    fn axis_arg(&mut self, v: &Value, e: &Expr, rank: usize) -> R<usize> {
        let i = self.as_int(v, e)?;
        match axis(i, rank) {
            Some(a) => Ok(a),
            None => self.fail(
                Diagnostic::error(Code::E0202, format!("dimension {i} is out of range for a tensor of rank {rank}"))
                    .primary(e.span, format!("must be in -{rank}..{rank}")),
            ),
        }
    }

    fn cross_entropy_type(&mut self, logits: NodeIndex, targets: NodeIndex, sl: Span, st: Span) -> R<TensorType> {
        self.expect_float_tensor(logits, sl)?;
        self.expect_int_tensor(targets, st)?;
        let (tl, tt) = (self.ty(logits).clone(), self.ty(targets).clone());
        if tl.rank() == 0 {
            return self.fail(
                Diagnostic::error(
                    Code::E0201,
                    format!("`cross_entropy` needs logits [.., C] with a class dimension, found {}", show_type(&tl)),
                )
                .primary(sl, "a scalar: no class dimension")
                .help("pass one score per class in the last dimension, e.g. `f32[batch, classes]`"),
            );
        }
        let leading: Vec<u64> = tl.sizes().iter().take(tl.rank() - 1).copied().collect();
        if leading != tt.sizes() {
            return self.fail(
                Diagnostic::error(
                    Code::E0201,
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
        if !fits || ta.dtype != tb.dtype {
            let (sta, stb) = (show_type(&ta), show_type(&tb));
            let (what, needs) = if fits {
                ("dtype", "needs operands of the same dtype")
            } else {
                ("shape", "needs [.., m, k] and [.., k, n] with equal leading dimensions")
            };
            return self.fail(
                Diagnostic::error(Code::E0201, format!("{what} mismatch in `matmul`: {sta} and {stb}"))
                    .primary(span, needs)
                    .secondary(sa, format!("this is {sta}"))
                    .secondary(sb, format!("this is {stb}")),
            );
        }
        let mut shape: Vec<Dim> = ta.shape[..ra - 1].to_vec();
        shape.push(tb.shape[rb - 1].clone());
        Ok(TensorType { dtype: ta.dtype, shape })
    }

    fn reshape_type(&mut self, xt: &TensorType, se: &Expr, sv: &Value, sx: Span) -> R<TensorType> {
        let (crate::syntax::ast::ExprKind::List(items), Value::List(values)) = (&se.kind, sv) else {
            return self.fail(
                Diagnostic::error(Code::E0107, "`reshape` takes a list of sizes")
                    .primary(se.span, "expected a list such as [batch, seq, hidden]"),
            );
        };
        let mut shape = Vec::new();
        let mut failed = false;
        for (item, value) in items.iter().zip(values) {
            match self.as_dim(value, item) {
                Ok(d) => shape.push(d),
                Err(_) => failed = true,
            }
        }
        if failed {
            return Err(Fail::Reported);
        }
        let ty = TensorType { dtype: xt.dtype, shape };
        if ty.elements() != xt.elements() {
            return self.fail(
                Diagnostic::error(
                    Code::E0201,
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
    fn attention(&mut self, call: &Call, a: &Evaluated<'_>, first: NodeIndex, scope: &str) -> R<Value> {
        let mut operands = vec![(first, a.required(0)?.0.span)];
        for i in 1..3 {
            if let Some((e, v)) = a.get(i) {
                operands.push((self.as_tensor(v, e)?, e.span));
            }
        }
        if operands.len() == 2 {
            return self.fail(
                Diagnostic::error(Code::E0103, "`self_attention` takes one fused qkv tensor or three tensors q, k, v")
                    .primary(call.args_span, "2 tensors given"),
            );
        }
        let Some((heads_expr, heads_value)) = a.get(3) else {
            return self.fail(
                Diagnostic::error(Code::E0103, "`self_attention` is missing argument `heads`")
                    .primary(call.span, "missing `heads`")
                    .help("give the number of attention heads, e.g. `heads: 12`"),
            );
        };
        let heads = self.as_dim(heads_value, heads_expr)?;
        let causal = match a.get(4) {
            Some((e, v)) => self.as_bool(v, e)?,
            None => true,
        };
        let fused = operands.len() == 1;
        let kv_heads = self.kv_heads(a, heads.size, fused, heads_expr.span)?;
        let ty = self.attention_type(&operands, (heads.size, heads_expr.span), kv_heads, fused)?;
        let op = Op::Attention { heads: heads.size, kv_heads: kv_heads.0, causal, fused };
        let nodes: Vec<NodeIndex> = operands.iter().map(|(n, _)| *n).collect();
        self.add_node(op, ty, call.span, scope, &nodes).map(Value::Tensor)
    }

    /// `kv_heads: K` of grouped-query attention (with its span): a size dividing `heads`, and `heads`
    /// itself when not given. A fused qkv tensor has as many key/value heads as query heads.
    fn kv_heads(&mut self, a: &Evaluated<'_>, heads: u64, fused: bool, heads_span: Span) -> R<(u64, Span)> {
        let Some((e, v)) = a.get(5) else { return Ok((heads, heads_span)) };
        let kv = self.as_dim(v, e)?.size;
        if fused && kv != heads {
            return self.fail(
                Diagnostic::error(
                    Code::E0201,
                    format!("a fused qkv tensor has {heads} key/value heads, one per query head, not {kv}"),
                )
                .primary(e.span, format!("{kv} key/value heads"))
                .secondary(heads_span, format!("{heads} query heads"))
                .help("for grouped-query attention pass q, k and v as three tensors"),
            );
        }
        if !heads.is_multiple_of(kv) {
            return self.fail(
                Diagnostic::error(
                    Code::E0201,
                    format!("{heads} query heads cannot be grouped over {kv} key/value heads"),
                )
                .primary(e.span, format!("{kv} key/value heads"))
                .secondary(heads_span, format!("{heads} query heads, not a multiple of {kv}"))
                .note("in grouped-query attention each key/value head serves heads / kv_heads query heads"),
            );
        }
        Ok((kv, e.span))
    }

    /// The result type of attention over `operands` (each with the span of its argument), with its
    /// query heads and key/value heads (each with the span that gave it).
    fn attention_type(
        &mut self,
        operands: &[(NodeIndex, Span)],
        (heads, heads_span): (u64, Span),
        (kv_heads, kv_span): (u64, Span),
        fused: bool,
    ) -> R<TensorType> {
        for &(o, span) in operands {
            self.expect_float_tensor(o, span)?;
            let ty = self.ty(o).clone();
            if ty.rank() < 2 {
                return self.fail(
                    Diagnostic::error(
                        Code::E0201,
                        format!("attention needs [.., seq, width] inputs, found {}", show_type(&ty)),
                    )
                    .primary(span, "too few dimensions"),
                );
            }
        }
        let (q, q_span) = operands[0];
        let t0 = self.ty(q).clone();
        let width = t0.shape[t0.rank() - 1].size;
        let model_width = if fused { width / 3 } else { width };
        if fused && !width.is_multiple_of(3) {
            return self.fail(
                Diagnostic::error(
                    Code::E0201,
                    format!(
                        "a fused qkv tensor's last dimension must be 3 x hidden, but {width} is not a multiple of 3"
                    ),
                )
                .primary(q_span, format!("this is {}", show_type(&t0))),
            );
        }
        if let (true, Some(last)) = (fused, t0.shape.last()) {
            // A fused qkv tensor factored as (3, h, d) has h heads of d: `heads` must say the same.
            if let [three, h, d] = last.factors.as_slice()
                && three.size == 3
                && h.size != heads
            {
                return self.fail(
                    Diagnostic::error(
                        Code::E0201,
                        format!(
                            "`heads: {heads}` does not match the fused qkv tensor, which is factored into {} heads",
                            h.size
                        ),
                    )
                    .primary(heads_span, format!("{heads} heads"))
                    .secondary(
                        q_span,
                        format!("factored as (3, {}, {}): {} heads of size {}", h.size, d.size, h.size, d.size),
                    )
                    .help(format!("pass `heads: {}`, or declare the qkv projection with {heads} heads", h.size)),
                );
            }
        }
        if model_width % heads != 0 {
            return self.fail(
                Diagnostic::error(
                    Code::E0201,
                    format!("{heads} heads do not divide the attention width {model_width}"),
                )
                .primary(heads_span, format!("{heads} heads"))
                .secondary(q_span, format!("width {model_width}")),
            );
        }
        let mut kv_sizes = t0.sizes();
        if let Some(last) = kv_sizes.last_mut() {
            *last = model_width / heads * kv_heads;
        }
        for &(o, span) in &operands[1..] {
            let ti = self.ty(o).clone();
            let (lead, kv_lead) = (&ti.sizes()[..ti.rank() - 1], &kv_sizes[..kv_sizes.len() - 1]);
            if kv_heads != heads && lead == kv_lead && ti.sizes() != kv_sizes {
                return self.kv_width_error(&ti, span, (heads, model_width / heads), (kv_heads, kv_span));
            }
            if ti.sizes() != kv_sizes || ti.dtype != t0.dtype {
                let what = if ti.sizes() == kv_sizes { "dtype" } else { "shape" };
                return self.fail(
                    Diagnostic::error(
                        Code::E0201,
                        format!(
                            "{what} mismatch in `self_attention`: q is {} but this is {}",
                            show_type(&t0),
                            show_type(&ti)
                        ),
                    )
                    .primary(span, format!("this is {}", show_type(&ti)))
                    .secondary(q_span, format!("q is {}", show_type(&t0))),
                );
            }
        }
        let mut shape = t0.shape.clone();
        if let (true, Some(last)) = (fused, shape.last_mut()) {
            // (3, heads, head) becomes (heads, head): the heads factor survives for sharding. Another
            // factoring (6, 2, 4) says nothing of the heads, and leaves none.
            let qkv_heads_head = last.factors.len() == 3 && last.factors[0].size == 3;
            let factors = if qkv_heads_head { last.factors[1..].to_vec() } else { Vec::new() };
            *last = Dim { size: model_width, label: None, factors };
        }
        Ok(TensorType { dtype: t0.dtype, shape })
    }
    /// k or v whose width is not kv_heads x the head size of q.
    fn kv_width_error(
        &mut self,
        ti: &TensorType,
        span: Span,
        (heads, head): (u64, u64),
        (kv_heads, kv_span): (u64, Span),
    ) -> R<TensorType> {
        let width = ti.shape.last().map_or(0, |d| d.size);
        self.fail(
            Diagnostic::error(
                Code::E0201,
                format!(
                    "k and v need {kv_heads} key/value heads of size {head} ({} columns), but this is {}",
                    kv_heads * head,
                    show_type(ti)
                ),
            )
            .primary(span, format!("width {width}"))
            .secondary(kv_span, format!("{kv_heads} key/value heads"))
            .note(format!("q has {heads} heads of size {head}; k and v have the same head size")),
        )
    }

    /// `rotary(x, heads: n, theta: t)`: x [.., seq, heads * head] with an even head size and t > 0.
    fn rotary(&mut self, a: &Evaluated<'_>, x: NodeIndex) -> R<(Op, TensorType, Vec<NodeIndex>)> {
        let first = a.required(0)?.0;
        self.expect_float_tensor(x, first.span)?;
        self.expect_rank_at_least(x, 2, first.span)?;
        let (he, hv) = a.required(1)?;
        let heads = self.as_dim(hv, he)?.size;
        let theta = match a.get(2) {
            Some((e, v)) => self.rotary_theta(v, e)?,
            None => DEFAULT_ROPE_THETA,
        };
        let xt = self.ty(x).clone();
        let width = xt.shape.last().map_or(0, |d| d.size);
        if !width.is_multiple_of(heads) {
            return self.fail(
                Diagnostic::error(Code::E0201, format!("{heads} heads do not divide the rotary width {width}"))
                    .primary(he.span, format!("{heads} heads"))
                    .secondary(first.span, format!("this is {}", show_type(&xt))),
            );
        }
        let head = width / heads;
        if !head.is_multiple_of(2) {
            return self.fail(
                Diagnostic::error(
                    Code::E0201,
                    format!("rotary embedding needs an even head size, but {width} / {heads} heads is {head}"),
                )
                .primary(he.span, format!("{heads} heads of size {head}"))
                .secondary(first.span, format!("this is {}", show_type(&xt)))
                .note("each head is rotated as two halves of head / 2 dimensions"),
            );
        }
        Ok((Op::Rotary { heads, theta }, xt, vec![x]))
    }

    /// The rotary base: a finite positive number.
    fn rotary_theta(&mut self, v: &Value, e: &Expr) -> R<f64> {
        let theta = self.as_float(v, e)?;
        if theta > 0.0 && theta.is_finite() {
            return Ok(theta);
        }
        self.fail(
            Diagnostic::error(
                Code::E0202,
                format!("the rotary base theta must be a positive number, but this is {theta}"),
            )
            .primary(e.span, format!("this is {theta}"))
            .help("Llama uses `theta: 10000.0` (Llama 3: 500000.0)"),
        )
    }
}
