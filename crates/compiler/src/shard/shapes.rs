//! Vocabulary padding: the shard count must divide every split dimension, and the vocabulary is the one
//! dimension we pad (as Megatron does) rather than reject. Computes every node's padded logical shape.

use super::Target;
use super::layout::{COLUMN_AXIS, ROW_AXIS};
use super::table::{self, Facts, Operator, Sym};
use crate::diag::Diagnostic;
use crate::ir::{Model, Node, Op, ParamId, ParamRole};
use optimus_plan::Padding;
use petgraph::graph::{DiGraph, NodeIndex};
use std::collections::HashSet;

/// Embedding tables this large are split on their rows (vocabulary-parallel) even when not tied.
const VOCAB_PARALLEL_ROWS: u64 = 1024;

/// How many ways the vocabulary is split: over the mesh axes along which the strategy's row of the
/// table splits a vocabulary-parallel embedding table's rows.
pub fn vocab_shards(target: Target) -> u64 {
    let facts = Facts { vocab_parallel: true, ..Facts::default() };
    let Some(case) = table::rule(Operator::Embedding, target.strategy).and_then(|r| r.case(&facts)) else {
        return 1;
    };
    let axes = target.mesh.axes();
    let table = case.operands.get(1).copied();
    [ROW_AXIS, COLUMN_AXIS]
        .into_iter()
        .filter(|&axis| table.and_then(|t| t.along(axis)) == Some(Sym::Dim0))
        .map(|axis| axes[axis])
        .product()
}

/// Parameters that a tied linear reuses.
fn tied_tables(graph: &DiGraph<Node, u8>, operands: impl Fn(NodeIndex) -> Vec<NodeIndex>) -> HashSet<ParamId> {
    let mut tied = HashSet::new();
    for n in graph.node_indices() {
        let tied_linear = matches!(graph[n].op, Op::Linear { transpose_weight: true, .. });
        if let (true, Some(Op::Param { id })) = (tied_linear, operands(n).get(1).map(|&w| graph[w].op.clone())) {
            tied.insert(id);
        }
    }
    tied
}

/// Whether an embedding table is split on its rows: tied to a linear, or large.
pub fn vocab_parallel(model: &Model, id: ParamId) -> bool {
    vocab_parallel_in(model, id, &tied_tables(&model.graph, |n| model.operands(n)))
}

fn vocab_parallel_in(model: &Model, id: ParamId, tied: &HashSet<ParamId>) -> bool {
    let p = &model.params[id.0 as usize];
    p.role == ParamRole::Embedding
        && (tied.contains(&id) || p.ty.shape.first().is_some_and(|d| d.size >= VOCAB_PARALLEL_ROWS))
}

/// Parameters of linears whose output is fed straight into a cross-entropy (an LM head): the weight
/// and bias of an untied head, the bias of a tied one (whose weight is a padded embedding table).
fn head_params(model: &Model) -> HashSet<ParamId> {
    let mut params = HashSet::new();
    for n in model.graph.node_indices() {
        if model.graph[n].op != Op::CrossEntropy {
            continue;
        }
        let Some(&logits) = model.operands(n).first() else { continue };
        if let Op::Linear { transpose_weight, .. } = model.graph[logits].op {
            let skip = if transpose_weight { 2 } else { 1 };
            for &operand in model.operands(logits).iter().skip(skip) {
                if let Op::Param { id } = model.graph[operand].op {
                    params.insert(id);
                }
            }
        }
    }
    params
}

fn round_up(v: u64, k: u64) -> u64 {
    v.div_ceil(k.max(1)) * k.max(1)
}

/// What decides parameter padding, computed once per model.
struct PaddingRules {
    tied: HashSet<ParamId>,
    heads: HashSet<ParamId>,
    shards: u64,
}

impl PaddingRules {
    fn new(model: &Model, target: Target) -> PaddingRules {
        PaddingRules {
            tied: tied_tables(&model.graph, |n| model.operands(n)),
            heads: head_params(model),
            shards: vocab_shards(target),
        }
    }

    /// The padded shape of one parameter.
    fn padded_param(&self, model: &Model, id: ParamId) -> Vec<u64> {
        let mut shape = model.params[id.0 as usize].ty.sizes();
        if vocab_parallel_in(model, id, &self.tied) {
            shape[0] = round_up(shape[0], self.shards);
        } else if let (true, Some(last)) = (self.heads.contains(&id), shape.last_mut()) {
            *last = round_up(*last, self.shards);
        }
        shape
    }
}

/// Padded logical shapes of every node of `graph` (forward nodes first, then backward by `like`).
pub fn padded_shapes(
    model: &Model,
    graph: &DiGraph<Node, u8>,
    like: &[Option<NodeIndex>],
    target: Target,
) -> Vec<Vec<u64>> {
    let operands = |n: NodeIndex| {
        use petgraph::visit::EdgeRef;
        let mut e: Vec<(u8, NodeIndex)> =
            graph.edges_directed(n, petgraph::Direction::Incoming).map(|e| (*e.weight(), e.source())).collect();
        e.sort_unstable();
        e.into_iter().map(|(_, s)| s).collect::<Vec<_>>()
    };
    let rules = PaddingRules::new(model, target);
    let mut shapes: Vec<Vec<u64>> = Vec::with_capacity(graph.node_count());
    for n in graph.node_indices() {
        let node = &graph[n];
        let ops = operands(n);
        let logical = node.ty.sizes();
        let of = |i: usize, shapes: &Vec<Vec<u64>>| ops.get(i).map(|o| shapes[o.index()].clone());
        let shape = match (&node.op, like.get(n.index()).copied().flatten()) {
            (_, Some(l)) if l != n => shapes[l.index()].clone(),
            (Op::Param { id }, _) => rules.padded_param(model, *id),
            (Op::Linear { transpose_weight, .. }, _) => {
                let mut s = logical.clone();
                let w = of(1, &shapes).unwrap_or_default();
                let out = if *transpose_weight { w.first() } else { w.last() };
                if let (Some(last), Some(out)) = (s.last_mut(), out) {
                    *last = *out;
                }
                s
            }
            (Op::Transpose { dim0, dim1 }, _) => {
                let mut s = of(0, &shapes).unwrap_or(logical.clone());
                if *dim0 < s.len() && *dim1 < s.len() {
                    s.swap(*dim0, *dim1);
                }
                s
            }
            (
                Op::Gelu { .. }
                | Op::Silu
                | Op::Dropout { .. }
                | Op::Scale { .. }
                | Op::Add
                | Op::Mul
                | Op::Softmax
                | Op::CausalMask,
                _,
            ) => of(0, &shapes).unwrap_or(logical.clone()),
            _ => logical,
        };
        shapes.push(shape);
    }
    shapes
}

/// The paddings a plan reports: every parameter whose padded shape differs from the model's.
pub fn paddings(model: &Model, shapes: &[Vec<u64>], graph: &DiGraph<Node, u8>) -> Vec<Padding> {
    let mut out = Vec::new();
    for n in graph.node_indices() {
        let Op::Param { id } = graph[n].op else { continue };
        let p = &model.params[id.0 as usize];
        for (dim, (logical, padded)) in p.ty.sizes().iter().zip(&shapes[n.index()]).enumerate() {
            if logical != padded {
                out.push(Padding {
                    tensor: p.name.clone(),
                    dim: u8::try_from(dim).unwrap_or(u8::MAX),
                    logical: *logical,
                    padded: *padded,
                });
            }
        }
    }
    out
}

/// Every padded tensor must still fit the size limit of one tensor ([`crate::elab::max_elements`]); a tensor
/// that padding pushes past it is reported at its declaration and the config values behind its sizes.
pub fn check_padded_sizes(
    model: &Model,
    graph: &DiGraph<Node, u8>,
    shapes: &[Vec<u64>],
) -> Result<(), Vec<Diagnostic>> {
    let mut problems = Vec::new();
    let mut reported = HashSet::new();
    for n in graph.node_indices() {
        let node = &graph[n];
        let Some(padded) = shapes.get(n.index()).filter(|s| **s != node.ty.sizes()) else { continue };
        let mut ty = node.ty.clone();
        for (dim, &size) in ty.shape.iter_mut().zip(padded) {
            dim.size = size;
        }
        // A gradient or use of a padded parameter has its shape: each padded shape is reported once.
        if crate::elab::fitting_elements(&ty).is_some() || !reported.insert(ty.clone()) {
            continue;
        }
        let what = match node.op {
            Op::Param { id } => format!("parameter `{}` padded for the mesh", model.params[id.0 as usize].name),
            _ => "a tensor padded for the mesh".to_string(),
        };
        let config = |name: &str| model.config.iter().find(|c| c.name == name);
        let d = crate::elab::too_large(&what, &ty, node.origin.span, config).note(format!(
            "padding rounds the shape {} up to {} so that the shards divide it",
            optimus_plan::text::shape_text(&node.ty.sizes()),
            optimus_plan::text::shape_text(padded)
        ));
        problems.push(d);
    }
    crate::diag::dedup(&mut problems);
    if problems.is_empty() { Ok(()) } else { Err(problems) }
}
