//! The owned abstract syntax tree of a `.opt` file; every node carries its byte span.

use optimus_plan::span::Span;

/// A name as written, with where it was written.
#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

/// A whole model file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct File {
    pub model: Option<ModelDecl>,
    pub config: Vec<ConfigEntry>,
    pub inputs: Vec<InputDecl>,
    pub blocks: Vec<BlockDef>,
    /// Layers declared at top level: the root block's layers.
    pub layers: Vec<LayerDecl>,
    /// The top-level forward computation(s); more than one is reported as a duplicate.
    pub forwards: Vec<ForwardDef>,
    /// Spans of every `config { ... }` block, for diagnostics.
    pub config_spans: Vec<Span>,
}

/// `model gpt2(checkpoint_prefix: "transformer.")`
#[derive(Clone, Debug, PartialEq)]
pub struct ModelDecl {
    pub name: Ident,
    pub options: Vec<Arg>,
    pub span: Span,
}

/// `hidden = 768` inside `config { ... }`.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigEntry {
    pub name: Ident,
    pub value: Expr,
    pub span: Span,
}

/// `input tokens: i32[batch, seq]`
#[derive(Clone, Debug, PartialEq)]
pub struct InputDecl {
    pub name: Ident,
    pub dtype: Ident,
    pub dims: Vec<Expr>,
    pub span: Span,
}

/// `block Mlp(dim, width = 4 * dim) { layer ...; forward(x) { ... } }`
#[derive(Clone, Debug, PartialEq)]
pub struct BlockDef {
    pub name: Ident,
    /// `checkpoint block ...`: every instance is recomputed in the backward pass.
    pub checkpoint: bool,
    pub params: Vec<BlockParam>,
    pub layers: Vec<LayerDecl>,
    pub forwards: Vec<ForwardDef>,
    pub span: Span,
}

/// A block parameter, with an optional default value.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockParam {
    pub name: Ident,
    pub default: Option<Expr>,
}

/// `layer c_fc = linear(hidden, ffn)` or `layer h = repeat(layers) Layer()`.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerDecl {
    pub name: Ident,
    /// `layer x = checkpoint Block()`: the block instances it makes are recomputed in the backward pass.
    pub checkpoint: bool,
    pub value: LayerExpr,
    pub span: Span,
}

/// What a layer declaration instantiates.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerExpr {
    Call(Call),
    Repeat { count: Expr, body: Call, span: Span },
}

/// `forward(x) { ... }`; the root forward has no parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardDef {
    pub params: Vec<Ident>,
    pub body: Vec<Stmt>,
    pub span: Span,
    /// Span of the `forward` keyword and its parameter list.
    pub head_span: Span,
}

/// One statement of a forward body.
#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    Assign { name: Ident, value: Expr, span: Span },
    Output { name: Ident, value: Expr, span: Span },
    Return { value: Expr, span: Span },
}

impl Stmt {
    /// The whole statement, keyword included.
    pub fn span(&self) -> Span {
        match self {
            Stmt::Assign { span, .. } | Stmt::Output { span, .. } | Stmt::Return { span, .. } => *span,
        }
    }
}

/// An expression with its span.
#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
}

/// Binary operators, in the usual precedence (`*` `/` above `+` `-`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
}

impl BinOp {
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    Int(i64),
    Float(f64),
    Str(String),
    Bool(bool),
    Name(String),
    Call(Call),
    List(Vec<Expr>),
    Neg(Box<Expr>),
    /// `lhs op rhs`; `op_span` is the operator symbol itself.
    Binary {
        op: BinOp,
        op_span: Span,
        lhs: Box<Expr>,
        rhs: Box<Expr>,
    },
    /// Stands for text the parser has already reported as an error (a literal out of range, an
    /// over-long expression), so that no further error cascades from it.
    Invalid,
}

/// `name(arg, ..., key: value, ...)`
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub callee: Ident,
    pub args: Vec<Arg>,
    pub span: Span,
    /// Span of the parenthesised argument list.
    pub args_span: Span,
}

/// A positional (`name` is `None`) or keyword argument.
#[derive(Clone, Debug, PartialEq)]
pub struct Arg {
    pub name: Option<Ident>,
    pub value: Expr,
    pub span: Span,
}
