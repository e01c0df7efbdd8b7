//! Reverse-mode autodiff on the logical graph: appends the backward of every operator and returns
//! each parameter's gradient node. Sharding happens afterwards, on the forward and backward together.

use crate::diag::{Code, Diagnostic};
use crate::ir::{DType, Model, Node, Op, Origin, TensorType};
use petgraph::graph::{DiGraph, NodeIndex};
use std::collections::HashMap;

/// The forward graph extended with its backward, and where each parameter's gradient ends up.
#[derive(Clone, Debug)]
pub struct Differentiated {
    pub graph: DiGraph<Node, u8>,
    /// Number of forward nodes: indices below this are the forward pass.
    pub forward_len: usize,
    /// The loss node being differentiated.
    pub loss: NodeIndex,
    /// Gradient node of each parameter (indexed like `Model::params`); `None` if the loss does not depend on it.
    pub param_grads: Vec<Option<NodeIndex>>,
    /// For each node, the forward node whose shape it has (itself for forward nodes); `None` for the
    /// few backward nodes with shapes of their own (transposes in matmul gradients, the seed).
    pub like: Vec<Option<NodeIndex>>,
}

/// Builds the backward pass of `model` for its loss.
pub fn differentiate(model: &Model) -> Result<Differentiated, Diagnostic> {
    let Some(loss) = model.loss else {
        return Err(Diagnostic::error(Code::E0501, "training needs a scalar loss, but the model has none")
            .help("name a scalar output `loss`, e.g. `output loss = cross_entropy(logits, targets)`, or compile with `--mode infer`"));
    };
    let forward_len = model.graph.node_count();
    let like = (0..forward_len).map(|i| Some(NodeIndex::new(i))).collect();
    let mut ad = Autodiff { graph: model.graph.clone(), adjoint: HashMap::new(), like };
    let origin = ad.graph[loss].origin.clone();
    let seed = ad.node(Op::Fill { value: 1.0 }, scalar(), origin, &[]);
    ad.adjoint.insert(loss, seed);
    for index in (0..forward_len).rev() {
        let n = NodeIndex::new(index);
        if let Some(&g) = ad.adjoint.get(&n) {
            ad.backward(n, g);
        }
    }
    let mut param_grads = vec![None; model.params.len()];
    for index in 0..forward_len {
        let n = NodeIndex::new(index);
        if let Op::Param { id } = ad.graph[n].op {
            param_grads[id.0 as usize] = ad.adjoint.get(&n).copied();
        }
    }
    Ok(Differentiated { graph: ad.graph, forward_len, loss, param_grads, like: ad.like })
}

fn scalar() -> TensorType {
    TensorType { dtype: DType::F32, shape: Vec::new() }
}

struct Autodiff {
    graph: DiGraph<Node, u8>,
    /// The accumulated gradient of each forward node.
    adjoint: HashMap<NodeIndex, NodeIndex>,
    like: Vec<Option<NodeIndex>>,
}

impl Autodiff {
    fn node(&mut self, op: Op, ty: TensorType, origin: Origin, operands: &[NodeIndex]) -> NodeIndex {
        self.node_like(op, ty, origin, operands, None)
    }

    fn node_like(
        &mut self,
        op: Op,
        ty: TensorType,
        origin: Origin,
        operands: &[NodeIndex],
        like: Option<NodeIndex>,
    ) -> NodeIndex {
        let n = self.graph.add_node(Node { op, ty, origin });
        self.like.push(like);
        for (i, &o) in operands.iter().enumerate() {
            self.graph.add_edge(o, n, u8::try_from(i).unwrap_or(u8::MAX));
        }
        n
    }

    fn operands(&self, n: NodeIndex) -> Vec<NodeIndex> {
        use petgraph::visit::EdgeRef;
        let mut edges: Vec<(u8, NodeIndex)> =
            self.graph.edges_directed(n, petgraph::Direction::Incoming).map(|e| (*e.weight(), e.source())).collect();
        edges.sort_unstable();
        edges.into_iter().map(|(_, s)| s).collect()
    }

    /// Adds `contribution` to the gradient of `target`.
    fn accumulate(&mut self, target: NodeIndex, contribution: NodeIndex) {
        if self.graph[target].ty.dtype.is_integer() {
            return;
        }
        let sum = match self.adjoint.get(&target) {
            Some(&existing) => {
                let ty = self.graph[target].ty.clone();
                let origin = self.graph[contribution].origin.clone();
                self.node_like(Op::Add, ty, origin, &[existing, contribution], Some(target))
            }
            None => contribution,
        };
        self.adjoint.insert(target, sum);
    }

    /// A backward node typed like forward node `like`, with `n`'s origin.
    fn grad_node(&mut self, op: Op, like: NodeIndex, n: NodeIndex, operands: &[NodeIndex]) -> NodeIndex {
        let ty = self.graph[like].ty.clone();
        let origin = self.graph[n].origin.clone();
        self.node_like(op, ty, origin, operands, Some(like))
    }

    fn transpose_last(&mut self, x: NodeIndex, n: NodeIndex) -> NodeIndex {
        let mut ty = self.graph[x].ty.clone();
        let r = ty.rank();
        ty.shape.swap(r - 2, r - 1);
        let origin = self.graph[n].origin.clone();
        self.node(Op::Transpose { dim0: r - 2, dim1: r - 1 }, ty, origin, &[x])
    }

    /// Appends the vector-Jacobian product of node `n` given its output gradient `g`.
    fn backward(&mut self, n: NodeIndex, g: NodeIndex) {
        let ops = self.operands(n);
        let op = self.graph[n].op.clone();
        match op {
            Op::Input { .. } | Op::Param { .. } | Op::Fill { .. } => {}
            Op::Embedding { padding } => {
                let d = self.grad_node(Op::EmbeddingGrad { padding }, ops[1], n, &[ops[0], g]);
                self.accumulate(ops[1], d);
            }
            Op::PositionEmbedding => {
                let d = self.grad_node(Op::PositionEmbeddingGrad, ops[1], n, &[g]);
                self.accumulate(ops[1], d);
            }
            Op::Linear { bias, transpose_weight } => {
                let dx = self.grad_node(Op::LinearGradInput { transpose_weight }, ops[0], n, &[g, ops[1]]);
                self.accumulate(ops[0], dx);
                let dw = self.grad_node(Op::LinearGradWeight { transpose_weight }, ops[1], n, &[ops[0], g]);
                self.accumulate(ops[1], dw);
                if bias {
                    let db = self.grad_node(Op::SumToLast, ops[2], n, &[g]);
                    self.accumulate(ops[2], db);
                }
            }
            Op::LayerNorm { eps } => {
                let dx = self.grad_node(Op::LayerNormGradInput { eps }, ops[0], n, &[g, ops[0], ops[1]]);
                self.accumulate(ops[0], dx);
                let dgamma = self.grad_node(Op::LayerNormGradWeight { eps }, ops[1], n, &[g, ops[0]]);
                self.accumulate(ops[1], dgamma);
                let dbeta = self.grad_node(Op::SumToLast, ops[2], n, &[g]);
                self.accumulate(ops[2], dbeta);
            }
            Op::RmsNorm { eps } => {
                let dx = self.grad_node(Op::RmsNormGradInput { eps }, ops[0], n, &[g, ops[0], ops[1]]);
                self.accumulate(ops[0], dx);
                let dw = self.grad_node(Op::RmsNormGradWeight { eps }, ops[1], n, &[g, ops[0]]);
                self.accumulate(ops[1], dw);
            }
            Op::Mul => {
                // d(a b) = g b da + g a db; with `x * x` both land on x and accumulate.
                let da = self.grad_node(Op::Mul, ops[0], n, &[g, ops[1]]);
                self.accumulate(ops[0], da);
                let db = self.grad_node(Op::Mul, ops[1], n, &[g, ops[0]]);
                self.accumulate(ops[1], db);
            }
            Op::Silu => {
                let d = self.grad_node(Op::SiluGrad, ops[0], n, &[g, ops[0]]);
                self.accumulate(ops[0], d);
            }
            Op::Gelu { approximate } => {
                let d = self.grad_node(Op::GeluGrad { approximate }, ops[0], n, &[g, ops[0]]);
                self.accumulate(ops[0], d);
            }
            Op::Softmax => {
                let d = self.grad_node(Op::SoftmaxGrad, ops[0], n, &[g, n]);
                self.accumulate(ops[0], d);
            }
            Op::Attention { heads, kv_heads, causal, fused } => {
                let mut operands = vec![g];
                operands.extend(&ops);
                for (k, &x) in ops.iter().enumerate() {
                    let wrt = u8::try_from(k).unwrap_or(u8::MAX);
                    let op = Op::AttentionGrad { heads, kv_heads, causal, fused, wrt };
                    let d = self.grad_node(op, x, n, &operands);
                    self.accumulate(x, d);
                }
            }
            Op::Rotary { heads, theta } => {
                let d = self.grad_node(Op::RotaryGrad { heads, theta }, ops[0], n, &[g]);
                self.accumulate(ops[0], d);
            }
            Op::Add => {
                self.accumulate(ops[0], g);
                self.accumulate(ops[1], g);
            }
            Op::Dropout { p } => {
                let forward = u32::try_from(n.index()).unwrap_or(u32::MAX);
                let d = self.grad_node(Op::DropoutGrad { p, forward }, ops[0], n, &[g]);
                self.accumulate(ops[0], d);
            }
            Op::CrossEntropy => {
                let d = self.grad_node(Op::CrossEntropyGrad, ops[0], n, &[ops[0], ops[1], g]);
                self.accumulate(ops[0], d);
            }
            Op::MatMul => {
                let bt = self.transpose_last(ops[1], n);
                let da = self.grad_node(Op::MatMul, ops[0], n, &[g, bt]);
                self.accumulate(ops[0], da);
                let at = self.transpose_last(ops[0], n);
                let db = self.grad_node(Op::MatMul, ops[1], n, &[at, g]);
                self.accumulate(ops[1], db);
            }
            Op::Reshape => {
                let d = self.grad_node(Op::Reshape, ops[0], n, &[g]);
                self.accumulate(ops[0], d);
            }
            Op::Transpose { dim0, dim1 } => {
                let d = self.grad_node(Op::Transpose { dim0, dim1 }, ops[0], n, &[g]);
                self.accumulate(ops[0], d);
            }
            Op::Scale { factor } => {
                let d = self.grad_node(Op::Scale { factor }, ops[0], n, &[g]);
                self.accumulate(ops[0], d);
            }
            Op::CausalMask => {
                let d = self.grad_node(Op::CausalMaskGrad, ops[0], n, &[g]);
                self.accumulate(ops[0], d);
            }
            Op::Select { dim, index } => {
                let d = self.grad_node(Op::SelectGrad { dim, index }, ops[0], n, &[g]);
                self.accumulate(ops[0], d);
            }
            // Backward operators are never differentiated again.
            _ => {}
        }
    }
}
