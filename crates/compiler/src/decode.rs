//! Decoding with a key/value cache: a causal language model rewritten into one step of generation.
//!
//! The step reads a `position` input (i32 [1]: the position of the step's first token) besides its
//! tokens. Every causal `self_attention` becomes a [`Op::CachedAttention`] that appends the step's
//! keys and values to caches of `context` positions and attends over them; position tables and
//! rotary embeddings count from the step's position. Compiled with `seq` = the prompt's length it is
//! the prefill program; with `seq` = 1, the decode program. The sharding rules keep each device's
//! cache in the attention's own layout (its batch rows and heads), so a step communicates what a
//! forward pass of its tokens does and nothing more.

use crate::ir::{DType, Dim, Model, Node, Op, Origin, TensorType};
use petgraph::graph::{DiGraph, NodeIndex};

/// The name of the step's position input.
pub const POSITION_INPUT: &str = "position";

/// Why a model cannot decode with a cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotCacheable {
    /// The layer path (or operator) at fault.
    pub scope: String,
    pub why: String,
}

impl std::fmt::Display for NotCacheable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.scope.is_empty() {
            true => f.write_str(&self.why),
            false => write!(f, "`{}`: {}", self.scope, self.why),
        }
    }
}

impl std::error::Error for NotCacheable {}

/// The model rewritten for a decoding step with caches of `context` positions: the graph gains the
/// `position` input (first) and every position-dependent operator reads it.
pub fn with_cache(model: &Model, context: u64) -> Result<Model, NotCacheable> {
    check_cacheable(model)?;
    let mut graph: DiGraph<Node, u8> = DiGraph::with_capacity(model.graph.node_count() + 1, 0);
    let origin = first_input_origin(model);
    let position = graph.add_node(Node {
        op: Op::Input { name: POSITION_INPUT.to_string() },
        ty: TensorType { dtype: DType::I32, shape: vec![Dim::new(1, None)] },
        origin,
    });
    let mut map: Vec<NodeIndex> = Vec::with_capacity(model.graph.node_count());
    for old in model.graph.node_indices() {
        let node = &model.graph[old];
        let (op, reads_position) = cached_op(&node.op, context);
        let new = graph.add_node(Node { op, ty: node.ty.clone(), origin: node.origin.clone() });
        let operands = model.operands(old);
        for (k, operand) in operands.iter().enumerate() {
            graph.add_edge(map[operand.index()], new, u8::try_from(k).unwrap_or(u8::MAX));
        }
        if reads_position {
            graph.add_edge(position, new, u8::try_from(operands.len()).unwrap_or(u8::MAX));
        }
        map.push(new);
    }
    let mut cached = model.clone();
    cached.graph = graph;
    for output in &mut cached.outputs {
        output.node = map[output.node.index()];
    }
    cached.loss = model.loss.map(|l| map[l.index()]);
    Ok(cached)
}

/// The step's operator for `op`, and whether it reads the position (its last operand).
fn cached_op(op: &Op, context: u64) -> (Op, bool) {
    match *op {
        Op::Attention { heads, kv_heads, fused, .. } => (Op::CachedAttention { heads, kv_heads, fused, context }, true),
        Op::PositionEmbedding => (Op::PositionEmbeddingAt, true),
        Op::Rotary { heads, theta } => (Op::RotaryAt { heads, theta }, true),
        ref other => (other.clone(), false),
    }
}

/// Refuses models whose steps a cache cannot reproduce: attention that is not causal (every token
/// would see later ones), attention written out of products and masks (no operator to cache), and
/// a model with a position input of its own.
fn check_cacheable(model: &Model) -> Result<(), NotCacheable> {
    let mut attention = false;
    for n in model.graph.node_indices() {
        let node = &model.graph[n];
        let fail = |why: &str| Err(NotCacheable { scope: node.origin.scope.clone(), why: why.to_string() });
        match &node.op {
            Op::Attention { causal: false, .. } => {
                return fail("its self_attention is not causal, so a token's keys and values change with later tokens");
            }
            Op::Attention { .. } => attention = true,
            Op::CausalMask => {
                return fail(
                    "its attention is written with causal_mask and softmax; the key/value cache needs the \
                     self_attention operator",
                );
            }
            Op::Input { name } if name == POSITION_INPUT => {
                return fail("the model has an input named `position`, which a decoding step uses for its own");
            }
            _ => {}
        }
    }
    if !attention {
        return Err(NotCacheable { scope: String::new(), why: "the model has no self_attention to cache".into() });
    }
    Ok(())
}

fn first_input_origin(model: &Model) -> Origin {
    model
        .graph
        .node_indices()
        .map(|n| &model.graph[n])
        .find(|n| matches!(n.op, Op::Input { .. }))
        .map_or_else(|| Origin { span: Default::default(), scope: String::new() }, |n| n.origin.clone())
}
