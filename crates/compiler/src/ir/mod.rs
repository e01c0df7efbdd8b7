//! The logical graph IR: a typed dataflow graph (petgraph) of operators over tensors with concrete shapes.
//!
//! Node indices are in topological order: the elaborator only ever adds a node after its operands.

pub mod print;
pub mod validate;

use optimus_plan::span::Span;
pub use optimus_plan::types::{DType, Init, ParamRole, Scalar};
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;
use serde::{Deserialize, Serialize};

/// One factor of a factored dimension, e.g. `heads` in c_attn's output (3, heads, head size).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Factor {
    pub size: u64,
    /// The config or block parameter the size came from, if it was written as a plain name.
    pub label: Option<String>,
}

/// One dimension of a tensor: its size, where it came from, and an optional factorisation.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Dim {
    pub size: u64,
    pub label: Option<String>,
    /// Non-empty when the dimension is a product of named factors (row-major); sharding may split a factor.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub factors: Vec<Factor>,
}

impl Dim {
    pub fn new(size: u64, label: Option<String>) -> Dim {
        Dim { size, label, factors: Vec::new() }
    }
}

/// A tensor's element type and shape; a scalar has no dimensions.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Vec<Dim>,
}

impl TensorType {
    pub fn sizes(&self) -> Vec<u64> {
        self.shape.iter().map(|d| d.size).collect()
    }

    /// Number of elements; `None` if it does not fit in 64 bits.
    pub fn elements(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |acc, d| acc.checked_mul(d.size))
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }
}

/// A trainable tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Param {
    /// Structured name, e.g. `h.3.attn.c_attn.weight`.
    pub name: String,
    /// Name in checkpoints (safetensors); by default the structured name.
    pub checkpoint: String,
    pub ty: TensorType,
    pub init: Init,
    pub role: ParamRole,
    /// The layer declaration that created it.
    pub span: Span,
    /// Stored transposed in checkpoints: a linear weight declared `[out, in]` (nn.Linear) while the model
    /// holds it `[in, out]`. Loading and saving transpose it; nothing else sees the difference.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub checkpoint_transposed: bool,
}

/// Index of a parameter in [`Model::params`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ParamId(pub u32);

/// Operators of the logical graph. Operand order is given by the edge weights.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub enum Op {
    /// A model input (token ids, targets).
    Input {
        name: String,
    },
    /// A parameter read.
    Param {
        id: ParamId,
    },
    /// Row lookup: operands (ids, table [rows, width]). `padding`: the row of the padding id, which
    /// never gets a gradient (torch's `padding_idx`).
    Embedding {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        padding: Option<u64>,
    },
    /// Rows 0..seq of a position table: operands (ids [.., seq], table [context, width]).
    PositionEmbedding,
    /// Rows position..position + seq of a position table, for a decoding step: operands (ids [.., seq],
    /// table [context, width], position i32 [1]).
    PositionEmbeddingAt,
    /// x W (+ b): operands (x, weight, bias?). With `transpose_weight`, W is stored [out, in] (a tied embedding).
    Linear {
        bias: bool,
        transpose_weight: bool,
    },
    /// LayerNorm over the last dimension: operands (x, gamma, beta).
    LayerNorm {
        eps: f64,
    },
    /// RMSNorm over the last dimension (Llama): operands (x, weight); y = w x / sqrt(mean(x^2) + eps).
    RmsNorm {
        eps: f64,
    },
    Gelu {
        approximate: bool,
    },
    /// x * sigmoid(x) (SiLU, Swish): the gate of SwiGLU.
    Silu,
    /// Softmax over the last dimension.
    Softmax,
    /// Multi-head self-attention. Operands: one fused qkv [.., seq, (3, heads, head)] or (q, k, v).
    /// With `kv_heads < heads` (grouped-query attention) k and v have kv_heads * head columns and query
    /// head h reads key/value head h / (heads / kv_heads); a fused qkv has kv_heads == heads.
    Attention {
        heads: u64,
        kv_heads: u64,
        causal: bool,
        fused: bool,
    },
    /// Rotary position embedding (Llama's `rotate_half` convention) over [.., seq, heads * head]:
    /// each head's halves are rotated by the angle pos * theta^(-2i/head), pos the sequence index.
    Rotary {
        heads: u64,
        theta: f64,
    },
    /// [`Op::Rotary`] with the positions counted from a decoding step's first: operands (x, position
    /// i32 [1]).
    RotaryAt {
        heads: u64,
        theta: f64,
    },
    /// Causal self-attention of a decoding step over a key/value cache of `context` positions, which
    /// this step's keys and values are written into first: operands (qkv or q, k, v; then position
    /// i32 [1]). Made from [`Op::Attention`] by `decode::with_cache`.
    CachedAttention {
        heads: u64,
        kv_heads: u64,
        fused: bool,
        context: u64,
    },
    Add,
    /// Element-wise product of two same-shaped tensors (the SwiGLU gate).
    Mul,
    Dropout {
        p: f64,
    },
    /// Mean cross-entropy over all positions: operands (logits [.., classes], targets [..]).
    CrossEntropy,
    /// Batched matrix product over the last two dimensions.
    MatMul,
    Reshape,
    Transpose {
        dim0: usize,
        dim1: usize,
    },
    Scale {
        factor: f64,
    },
    /// Sets entries above the diagonal of the last two dimensions to minus infinity.
    CausalMask,
    /// Removes a dimension by picking one index of it.
    Select {
        dim: usize,
        index: u64,
    },

    // ---- operators made by autodiff (`crate::autodiff`); never written by users ----
    /// A scalar constant (the seed gradient of the loss).
    Fill {
        value: f64,
    },
    /// dX of a linear: operands (dY, weight) -> dY W^T (dY E for a tied weight).
    LinearGradInput {
        transpose_weight: bool,
    },
    /// dW of a linear: operands (X, dY) -> X^T dY over all leading dimensions ([out, in] when tied).
    LinearGradWeight {
        transpose_weight: bool,
    },
    /// Sums every dimension but the last: bias and LayerNorm beta gradients.
    SumToLast,
    /// dX of LayerNorm: operands (dY, X, gamma).
    LayerNormGradInput {
        eps: f64,
    },
    /// dgamma of LayerNorm: operands (dY, X).
    LayerNormGradWeight {
        eps: f64,
    },
    /// dX of RMSNorm: operands (dY, X, weight).
    RmsNormGradInput {
        eps: f64,
    },
    /// dweight of RMSNorm: operands (dY, X).
    RmsNormGradWeight {
        eps: f64,
    },
    /// operands (dY, X).
    GeluGrad {
        approximate: bool,
    },
    /// operands (dY, X).
    SiluGrad,
    /// operands (dY, Y) where Y is the softmax output.
    SoftmaxGrad,
    /// Applies the mask of the forward dropout node `forward` to dY.
    DropoutGrad {
        p: f64,
        forward: u32,
    },
    /// Gradient of attention with respect to operand `wrt`: operands (dY, then the forward operands).
    AttentionGrad {
        heads: u64,
        kv_heads: u64,
        causal: bool,
        fused: bool,
        wrt: u8,
    },
    /// dX of a rotary embedding: dY rotated back by the same angles (the transpose). Operands: (dY).
    RotaryGrad {
        heads: u64,
        theta: f64,
    },
    /// Scatter-add of dY rows into a table: operands (ids, dY); the result has the table's shape. Rows
    /// of the padding id (`padding`) get nothing.
    EmbeddingGrad {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        padding: Option<u64>,
    },
    /// Sum of dY over leading dimensions into the first seq rows of a table: operands (dY).
    PositionEmbeddingGrad,
    /// d(loss)/d(logits): operands (logits, targets, dLoss).
    CrossEntropyGrad,
    /// Zeroes entries above the diagonal: operands (dY).
    CausalMaskGrad,
    /// Places dY at `index` of a new dimension `dim`, zeros elsewhere: operands (dY).
    SelectGrad {
        dim: usize,
        index: u64,
    },
}

impl Op {
    /// The operator's name as written in the language.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Param { .. } => "param",
            Op::Embedding { .. } => "embedding",
            Op::PositionEmbedding => "position_embedding",
            Op::PositionEmbeddingAt => "position_embedding_at",
            Op::RotaryAt { .. } => "rotary_at",
            Op::CachedAttention { .. } => "cached_self_attention",
            Op::Linear { .. } => "linear",
            Op::LayerNorm { .. } => "layernorm",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Gelu { .. } => "gelu",
            Op::Silu => "silu",
            Op::Softmax => "softmax",
            Op::Attention { .. } => "self_attention",
            Op::Rotary { .. } => "rotary",
            Op::Add => "add",
            Op::Mul => "mul",
            Op::Dropout { .. } => "dropout",
            Op::CrossEntropy => "cross_entropy",
            Op::MatMul => "matmul",
            Op::Reshape => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Scale { .. } => "scale",
            Op::CausalMask => "causal_mask",
            Op::Select { .. } => "select",
            Op::Fill { .. } => "fill",
            Op::LinearGradInput { .. } => "linear_grad_input",
            Op::LinearGradWeight { .. } => "linear_grad_weight",
            Op::SumToLast => "sum_to_last",
            Op::LayerNormGradInput { .. } => "layernorm_grad_input",
            Op::LayerNormGradWeight { .. } => "layernorm_grad_weight",
            Op::RmsNormGradInput { .. } => "rms_norm_grad_input",
            Op::RmsNormGradWeight { .. } => "rms_norm_grad_weight",
            Op::GeluGrad { .. } => "gelu_grad",
            Op::SiluGrad => "silu_grad",
            Op::SoftmaxGrad => "softmax_grad",
            Op::DropoutGrad { .. } => "dropout_grad",
            Op::AttentionGrad { .. } => "attention_grad",
            Op::RotaryGrad { .. } => "rotary_grad",
            Op::EmbeddingGrad { .. } => "embedding_grad",
            Op::PositionEmbeddingGrad => "position_embedding_grad",
            Op::CrossEntropyGrad => "cross_entropy_grad",
            Op::CausalMaskGrad => "causal_mask_grad",
            Op::SelectGrad { .. } => "select_grad",
        }
    }
}

/// Where an IR node came from: the source text and the layer path it was elaborated under.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Origin {
    pub span: Span,
    /// Dotted layer path, e.g. `h.3.attn`; empty at top level.
    pub scope: String,
}

/// One operator application and the tensor it produces.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub op: Op,
    pub ty: TensorType,
    pub origin: Origin,
}

/// A named model output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Output {
    pub name: String,
    pub node: NodeIndex,
    pub span: Span,
}

/// A configuration value after `--set` overrides and evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConfigValue {
    pub name: String,
    pub value: Scalar,
    pub span: Span,
    pub overridden: bool,
}

/// A checked, shape-inferred model: the input to every later stage.
#[derive(Clone, Debug)]
pub struct Model {
    pub name: String,
    /// Prefix that checkpoints may put before every parameter name (`transformer.` for Hugging Face GPT-2).
    pub checkpoint_prefix: Option<String>,
    pub config: Vec<ConfigValue>,
    pub params: Vec<Param>,
    pub graph: DiGraph<Node, u8>,
    pub outputs: Vec<Output>,
    /// The scalar training objective, if the model has one.
    pub loss: Option<NodeIndex>,
    /// The layer path of every instance of a repeated block (`h.0`, `h.1`, ...), in order: the units
    /// `compile --recompute layers` recomputes.
    pub repeated_blocks: Vec<String>,
    /// The layer path of every block instance the model marks `checkpoint` (on its block or its layer
    /// declaration): what is recomputed when `compile --recompute` is not given.
    pub checkpointed_blocks: Vec<String>,
}

impl Model {
    /// Operands of a node, in order.
    pub fn operands(&self, node: NodeIndex) -> Vec<NodeIndex> {
        let mut edges: Vec<(u8, NodeIndex)> =
            self.graph.edges_directed(node, petgraph::Direction::Incoming).map(|e| (*e.weight(), e.source())).collect();
        edges.sort_unstable();
        edges.into_iter().map(|(_, n)| n).collect()
    }

    /// Total number of trainable elements (tied weights counted once).
    pub fn parameter_count(&self) -> u128 {
        self.params.iter().map(|p| u128::from(p.ty.elements().unwrap_or(0))).sum()
    }

    pub fn param(&self, id: ParamId) -> &Param {
        &self.params[id.0 as usize]
    }

    pub fn config_value(&self, name: &str) -> Option<&Scalar> {
        self.config.iter().find(|c| c.name == name).map(|c| &c.value)
    }
}
