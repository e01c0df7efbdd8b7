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

/// The model with its language-model head applied to the last of the step's positions only: the
/// loss `cross_entropy(head(x), targets)` becomes `cross_entropy(head(x[.., last, :]), targets[..,
/// last])`, each kept as a sequence of one position. What a prefill step needs: only the last
/// position's logits choose the next token, and the head over every position (vocabulary x hidden
/// per position) would cost more than the rest of a short model. `None` when the loss is not a
/// cross-entropy of a linear's output that nothing else reads, or the step has one position.
pub fn last_position_head(model: &Model) -> Option<Model> {
    let loss = model.loss.filter(|&l| model.graph[l].op == Op::CrossEntropy)?;
    let [logits, targets] = model.operands(loss)[..] else { return None };
    let Op::Linear { .. } = model.graph[logits].op else { return None };
    let readers = |n: NodeIndex| model.graph.neighbors_directed(n, petgraph::Direction::Outgoing).count();
    let outputs_read = |n: NodeIndex| model.outputs.iter().any(|o| o.node == n);
    if readers(logits) != 1 || readers(loss) != 0 || outputs_read(logits) {
        return None;
    }
    let head_operands = model.operands(logits);
    let x = *head_operands.first()?;
    let x_shape = &model.graph[x].ty.shape;
    let rank = x_shape.len();
    let seq = x_shape.get(rank.checked_sub(2)?)?.size;
    if seq <= 1 || model.graph[targets].ty.shape.len() != rank - 1 {
        return None;
    }
    let mut graph: DiGraph<Node, u8> = DiGraph::with_capacity(model.graph.node_count() + 4, 0);
    let mut map: Vec<Option<NodeIndex>> = vec![None; model.graph.node_count()];
    for old in model.graph.node_indices().filter(|&n| n != logits && n != loss) {
        let new = graph.add_node(model.graph[old].clone());
        for (k, operand) in model.operands(old).iter().enumerate() {
            graph.add_edge(map[operand.index()]?, new, u8::try_from(k).ok()?);
        }
        map[old.index()] = Some(new);
    }
    let last = |graph: &mut DiGraph<Node, u8>, of: NodeIndex| -> Option<NodeIndex> {
        let node = &model.graph[of];
        let dim = node.ty.shape.len() - if node.ty.shape.len() == rank { 2 } else { 1 };
        let mut selected = node.ty.clone();
        selected.shape.remove(dim);
        let select = Op::Select { dim, index: seq - 1 };
        let s = graph.add_node(Node { op: select, ty: selected, origin: model.graph[logits].origin.clone() });
        graph.add_edge(map[of.index()]?, s, 0);
        let mut kept = node.ty.clone();
        kept.shape[dim] = Dim::new(1, None);
        let r = graph.add_node(Node { op: Op::Reshape, ty: kept, origin: model.graph[logits].origin.clone() });
        graph.add_edge(s, r, 0);
        Some(r)
    };
    let x_last = last(&mut graph, x)?;
    let targets_last = last(&mut graph, targets)?;
    let mut head = model.graph[logits].clone();
    head.ty.shape[rank - 2] = Dim::new(1, None);
    let new_logits = graph.add_node(head);
    graph.add_edge(x_last, new_logits, 0);
    for (k, operand) in head_operands.iter().enumerate().skip(1) {
        graph.add_edge(map[operand.index()]?, new_logits, u8::try_from(k).ok()?);
    }
    let new_loss = graph.add_node(model.graph[loss].clone());
    graph.add_edge(new_logits, new_loss, 0);
    graph.add_edge(targets_last, new_loss, 1);
    map[loss.index()] = Some(new_loss);
    let mut step = model.clone();
    step.graph = graph;
    for output in &mut step.outputs {
        output.node = map[output.node.index()]?;
    }
    step.loss = Some(new_loss);
    Some(step)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::elab::Override;
    use crate::ir::validate::validate_graph;

    fn model(source: &str, seq: u64) -> Model {
        let sets = [("layers", "2".to_string()), ("seq", seq.to_string()), ("context", "32".to_string())];
        let overrides: Vec<Override> =
            sets.into_iter().map(|(name, value)| Override { name: name.into(), value }).collect();
        crate::front::check_source(source, &overrides).model.expect("the example checks")
    }

    const GPT2: &str = include_str!("../../../examples/gpt2.opt");
    const LLAMA: &str = include_str!("../../../examples/llama.opt");

    /// Every causal attention reads the position and caches `context` positions; position tables and
    /// rotary embeddings read it too; the graph stays well formed and topologically ordered.
    #[test]
    fn a_step_reads_its_position_wherever_positions_matter() {
        for source in [GPT2, LLAMA] {
            let step = with_cache(&model(source, 4), 24).expect("a causal model");
            assert!(validate_graph(&step.graph).is_empty(), "{:?}", validate_graph(&step.graph));
            let position =
                step.graph.node_indices().find(|&n| step.graph[n].op == Op::Input { name: POSITION_INPUT.into() });
            let position = position.expect("a position input");
            let mut cached = 0;
            for n in step.graph.node_indices() {
                let reads = step.operands(n).contains(&position);
                match step.graph[n].op {
                    Op::CachedAttention { context, .. } => {
                        assert!(reads && context == 24);
                        cached += 1;
                    }
                    Op::PositionEmbeddingAt | Op::RotaryAt { .. } => assert!(reads),
                    Op::Attention { .. } | Op::PositionEmbedding | Op::Rotary { .. } => panic!("left uncached"),
                    _ => assert!(!reads),
                }
                assert!(step.operands(n).iter().all(|o| o.index() < n.index()), "not in topological order");
            }
            assert_eq!(cached, 2);
        }
    }

    /// The prefill's head reads the last position only, and so does its loss; a one-position step is
    /// left as it is.
    #[test]
    fn the_prefill_head_reads_the_last_position() {
        let step = with_cache(&model(GPT2, 5), 16).expect("a causal model");
        let last = last_position_head(&step).expect("an LM head");
        assert!(validate_graph(&last.graph).is_empty());
        let loss = last.loss.expect("a loss");
        let logits = last.operands(loss)[0];
        assert_eq!(last.graph[logits].ty.sizes()[1], 1);
        let selects: Vec<_> =
            last.graph.node_indices().filter(|&n| last.graph[n].op == Op::Select { dim: 1, index: 4 }).collect();
        assert_eq!(selects.len(), 2, "the head's input and the targets");
        assert!(last_position_head(&with_cache(&model(GPT2, 1), 16).expect("a causal model")).is_none());
    }

    #[test]
    fn models_a_cache_cannot_serve_are_refused_with_the_reason() {
        let bert = include_str!("../../../examples/bert.opt");
        let refusal = with_cache(&model(bert, 4), 8).expect_err("BERT is not causal");
        assert!(refusal.to_string().contains("is not causal"), "{refusal}");
        let manual = include_str!("../../../examples/gpt2_manual_attention.opt");
        let refusal = with_cache(&model(manual, 4), 8).expect_err("no self_attention");
        assert!(refusal.to_string().contains("causal_mask"), "{refusal}");
    }
}
