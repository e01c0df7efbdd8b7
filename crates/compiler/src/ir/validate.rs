//! The IR checker, run after elaboration and after autodiff as the plan verifier runs after
//! lowering: every node has the operand count its operator takes, and operands of the element types
//! it reads (floating point where it computes, integers where it indexes). A failure is an internal
//! error of the compiler, reported before anything is built on the graph.

use super::{DType, Node, Op};
use petgraph::Direction;
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;

/// What an operand must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Float,
    Integer,
    /// Any element type (operators that only move elements).
    Any,
}

use Kind::{Any, Float, Integer};

/// The operands an operator takes, in order.
fn operands(op: &Op) -> Vec<Kind> {
    match op {
        Op::Input { .. } | Op::Param { .. } | Op::Fill { .. } => vec![],
        Op::Embedding { .. } | Op::PositionEmbedding => vec![Integer, Float],
        Op::PositionEmbeddingAt => vec![Integer, Float, Integer],
        Op::RotaryAt { .. } => vec![Float, Integer],
        Op::CachedAttention { fused, .. } => {
            let mut kinds = vec![Float; if *fused { 1 } else { 3 }];
            kinds.push(Integer);
            kinds
        }
        Op::Linear { bias, .. } => {
            if *bias {
                vec![Float; 3]
            } else {
                vec![Float; 2]
            }
        }
        Op::LayerNorm { .. } | Op::LayerNormGradInput { .. } => vec![Float; 3],
        Op::RmsNorm { .. } | Op::RmsNormGradWeight { .. } | Op::Mul => vec![Float; 2],
        Op::RmsNormGradInput { .. } => vec![Float; 3],
        Op::Gelu { .. } | Op::Silu | Op::Softmax | Op::Dropout { .. } | Op::Scale { .. } | Op::CausalMask => {
            vec![Float]
        }
        Op::Reshape | Op::Transpose { .. } | Op::Select { .. } => vec![Any],
        Op::Attention { fused, .. } => vec![Float; if *fused { 1 } else { 3 }],
        Op::Rotary { .. } | Op::RotaryGrad { .. } => vec![Float],
        Op::Add | Op::MatMul => vec![Float; 2],
        Op::CrossEntropy => vec![Float, Integer],
        Op::LinearGradInput { .. }
        | Op::LinearGradWeight { .. }
        | Op::LayerNormGradWeight { .. }
        | Op::GeluGrad { .. }
        | Op::SiluGrad
        | Op::SoftmaxGrad => vec![Float; 2],
        Op::SumToLast
        | Op::DropoutGrad { .. }
        | Op::PositionEmbeddingGrad
        | Op::CausalMaskGrad
        | Op::SelectGrad { .. } => vec![Float],
        Op::AttentionGrad { fused, .. } => vec![Float; if *fused { 2 } else { 4 }],
        Op::EmbeddingGrad { .. } => vec![Integer, Float],
        Op::CrossEntropyGrad => vec![Float, Integer, Float],
    }
}

fn fits(kind: Kind, dtype: DType) -> bool {
    match kind {
        Float => !dtype.is_integer(),
        Integer => dtype.is_integer(),
        Any => true,
    }
}

/// The problems of a graph's nodes (none when it is well-formed), each naming the node.
pub fn validate_graph(graph: &DiGraph<Node, u8>) -> Vec<String> {
    let mut problems = Vec::new();
    for n in graph.node_indices() {
        let node = &graph[n];
        let mut edges: Vec<(u8, NodeIndex)> =
            graph.edges_directed(n, Direction::Incoming).map(|e| (*e.weight(), e.source())).collect();
        edges.sort_unstable();
        let want = operands(&node.op);
        let what = || format!("node {} ({} in `{}`)", n.index(), node.op.name(), node.origin.scope);
        if edges.len() != want.len() {
            problems.push(format!("{} has {} operands, not {}", what(), edges.len(), want.len()));
            continue;
        }
        for (k, ((position, source), kind)) in edges.iter().zip(&want).enumerate() {
            if usize::from(*position) != k {
                problems.push(format!("{} has no operand {k} (its operands are numbered {position}..)", what()));
                break;
            }
            let dtype = graph[*source].ty.dtype;
            if !fits(*kind, dtype) {
                problems.push(format!("{}: operand {k} is {}, not {kind:?}", what(), dtype.name()));
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Origin, TensorType};
    use optimus_plan::span::Span;

    fn node(op: Op, dtype: DType) -> Node {
        Node {
            op,
            ty: TensorType { dtype, shape: Vec::new() },
            origin: Origin { span: Span::new(0, 0), scope: "m".into() },
        }
    }

    #[test]
    fn a_well_formed_graph_passes() {
        let mut g = DiGraph::new();
        let logits = g.add_node(node(Op::Input { name: "x".into() }, DType::F32));
        let targets = g.add_node(node(Op::Input { name: "t".into() }, DType::I32));
        let loss = g.add_node(node(Op::CrossEntropy, DType::F32));
        g.add_edge(logits, loss, 0);
        g.add_edge(targets, loss, 1);
        assert!(validate_graph(&g).is_empty(), "{:?}", validate_graph(&g));
    }

    #[test]
    fn wrong_operand_counts_and_types_are_named() {
        let mut g = DiGraph::new();
        let x = g.add_node(node(Op::Input { name: "x".into() }, DType::F32));
        let add = g.add_node(node(Op::Add, DType::F32));
        g.add_edge(x, add, 0);
        let loss = g.add_node(node(Op::CrossEntropy, DType::F32));
        g.add_edge(x, loss, 0);
        g.add_edge(x, loss, 1);
        let problems = validate_graph(&g);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("add") && problems[0].contains("1 operands, not 2"), "{problems:?}");
        assert!(problems[1].contains("cross_entropy") && problems[1].contains("operand 1 is f32"), "{problems:?}");
    }
}
