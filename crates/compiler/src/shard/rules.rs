//! Per-operator sharding rules for the optimus (2D, SUMMA) and megatron (1D) strategies.
//! Each rule asks for its operands in the layouts it needs and defines its result's layout. Where
//! those layouts depend on the strategy, the rule reads its row of the table in `table.rs` and
//! instantiates it for the node; the rule itself never branches on the strategy.

use super::layout::{COLUMN_AXIS, DATA_AXIS, DEPTH_AXIS, Layout, MAJOR_ORDER, MESH_AXES, Placement, ROW_AXIS};
use super::table::{self, Case, Dims, Facts, Operator, Pattern, Product, ProductKind, When, on_dim};
use super::{Lowerer, Version, shapes};
use crate::diag::{Code, Diagnostic};
use crate::ir::Op;
use optimus_plan::{BufferId, CollectiveKind, Group, Kernel, Layouts, Offset, ReduceOp, Role};
use optimus_plan::{Reason, ReasonKind, Statistic, SummaPart, SummaProduct};
use petgraph::graph::NodeIndex;

const R: Placement = Placement::Replicate;

/// An attention's query heads and key/value heads (equal unless grouped-query).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Heads {
    query: u64,
    kv: u64,
}

/// A SUMMA product that reduces partial output blocks: each step broadcasts one operand's block along
/// `along` (root: the step), multiplies it with the other's local block, and reduces the partial
/// product along `reduce_along` to the step's root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ReducedSumma {
    product: SummaProduct,
    moves_a: bool,
    along: Group,
    reduce_along: Group,
    transpose_a: bool,
    transpose_b: bool,
}

impl ReducedSumma {
    /// C = A B^T: B(t,j) broadcast along column j, the partial reduced along row i to (i,t).
    const ABT: ReducedSumma = ReducedSumma::new(SummaProduct::Abt, false, Group::Column, Group::Row, (false, true));
    /// C = A^T B: A(i,t) broadcast along row i, the partial reduced along column j to (t,j).
    const ATB: ReducedSumma = ReducedSumma::new(SummaProduct::Atb, true, Group::Row, Group::Column, (true, false));
    /// C = A B^T keeping B in place: A(t,j) broadcast along column j, the partial A(t,j) B(i,j)^T
    /// reduced along row i to (i,t), which holds C's block (t,i).
    const ABT_KEEPING_B: ReducedSumma =
        ReducedSumma::new(SummaProduct::AbtKeepingB, true, Group::Column, Group::Row, (false, true));
    /// C = A B keeping B in place, A's block (k,i) holding A's rows i and columns k: A's block (k,t)
    /// broadcast along row k, the partial A(k,t) B(k,j) reduced along column j to (t,j).
    const AB_KEEPING_B: ReducedSumma =
        ReducedSumma::new(SummaProduct::AbKeepingB, true, Group::Row, Group::Column, (false, false));
    /// C = A B for a B laid across the mesh, B's block (t,j) holding B's rows j and columns t: B(t,j)
    /// broadcast along column j, the partial A(i,j) B(t,j) reduced along row i to (i,t).
    const AB_REDUCED: ReducedSumma =
        ReducedSumma::new(SummaProduct::AbReduced, false, Group::Column, Group::Row, (false, false));
    /// C = A^T B moving B: B(i,t) broadcast along row i, the partial A(i,j)^T B(i,t) reduced along
    /// column j to (t,j), which holds C's block of rows j and columns t (C laid across the mesh).
    const ATB_MOVING_B: ReducedSumma =
        ReducedSumma::new(SummaProduct::AtbMovingB, false, Group::Row, Group::Column, (true, false));

    /// C = A B keeping a B laid across the mesh in place, B's block (t,j) holding B's rows j and columns
    /// t: A(i,j) broadcast along column j, the partial A(i,j) B(t,j) reduced along row t to (t,i), which
    /// holds C's block of rows i and columns t (C laid with B's columns over the mesh rows).
    const AB_KEEPING_B_ACROSS: ReducedSumma =
        ReducedSumma::new(SummaProduct::AbKeepingBAcross, true, Group::Column, Group::Row, (false, false));

    /// C = A B^T keeping a B laid across the mesh in place, A's block (t,i) holding A's rows i and
    /// columns t (an output gradient transposed across the diagonal): A(t,i) broadcast along row t, the
    /// partial A(t,i) B(t,j)^T reduced along column j to (i,j), which holds C's block of rows i and
    /// columns j (C laid as A's transpose would be).
    const ABT_KEEPING_B_ACROSS: ReducedSumma =
        ReducedSumma::new(SummaProduct::AbtKeepingBAcross, true, Group::Row, Group::Column, (false, true));

    const fn new(product: SummaProduct, moves_a: bool, along: Group, reduce_along: Group, t: (bool, bool)) -> Self {
        ReducedSumma { product, moves_a, along, reduce_along, transpose_a: t.0, transpose_b: t.1 }
    }
}

/// One term of a SUMMA product whose output is reduced, as node `node`'s: the operand each step
/// broadcasts, the local one, and the output.
#[derive(Clone, Copy)]
struct SummaTerm {
    node: NodeIndex,
    moved: BufferId,
    other: BufferId,
    out: BufferId,
}

/// The reduced SUMMA product (partial products reduced to the output's owner) of a product kind.
fn reduced_summa(kind: ProductKind) -> Option<ReducedSumma> {
    Some(match kind {
        ProductKind::SummaAbReduced => ReducedSumma::AB_REDUCED,
        ProductKind::SummaAtbMovingB => ReducedSumma::ATB_MOVING_B,
        ProductKind::SummaAbt => ReducedSumma::ABT,
        ProductKind::SummaAtb => ReducedSumma::ATB,
        ProductKind::SummaAbtKeepingB => ReducedSumma::ABT_KEEPING_B,
        ProductKind::SummaAbKeepingB => ReducedSumma::AB_KEEPING_B,
        ProductKind::SummaAbKeepingBAcross => ReducedSumma::AB_KEEPING_B_ACROSS,
        ProductKind::SummaAbtKeepingBAcross => ReducedSumma::ABT_KEEPING_B_ACROSS,
        _ => return None,
    })
}

/// The accumulated SUMMA product (both operands broadcast, summed where the output lies) of a kind.
fn accumulated_summa(kind: ProductKind) -> Option<SummaProduct> {
    Some(match kind {
        ProductKind::SummaAb => SummaProduct::Ab,
        ProductKind::SummaAtbAccumulated => SummaProduct::AtbAccumulated,
        ProductKind::SummaAbtAccumulated => SummaProduct::AbtAccumulated,
        ProductKind::SummaAtbAccumulatedAcross => SummaProduct::AtbAccumulatedAcross,
        _ => return None,
    })
}

/// Whether linears of one input whose product is `kind` can broadcast that input's block (their A) once
/// a step for all of them: the accumulated A B, or a product keeping each weight in place.
fn shares_forward(kind: ProductKind) -> bool {
    matches!(kind, ProductKind::SummaAb | ProductKind::SummaAbKeepingB | ProductKind::SummaAbKeepingBAcross)
}

/// Whether weight gradients of one input whose product is `kind` can broadcast X (their A) once a step.
fn shares_weight_gradients(kind: ProductKind) -> bool {
    matches!(kind, ProductKind::SummaAtb | ProductKind::SummaAtbAccumulated | ProductKind::SummaAtbAccumulatedAcross)
}

/// Whether input gradients of product `kind` into one output can be summed before their reduction:
/// each SUMMA step's partials before its one reduce, or in 3D the local products before the one
/// reduce-scatter.
fn sums_input_gradients(kind: ProductKind) -> bool {
    matches!(
        kind,
        ProductKind::SummaAbt
            | ProductKind::SummaAbtKeepingB
            | ProductKind::SummaAbtKeepingBAcross
            | ProductKind::Scattered { .. }
    )
}

/// Input gradients that only a tree of additions reads (a layer input's from its q, k and v products,
/// and from its residual path), computed at the tree's top in one product with one reduction: a reduce
/// a SUMMA step, or in 3D one reduce-scatter.
struct GradientSum {
    /// The addition at the tree's top, which computes the sum.
    root: NodeIndex,
    /// The product every term takes and the layout it leaves them in.
    term: (ProductKind, Layout),
    /// The input gradients, in the tree's order.
    terms: Vec<NodeIndex>,
    /// The additions below the top, which wait for it.
    inner: Vec<NodeIndex>,
    /// The tree's other operands, added once the terms' sum is reduced.
    others: Vec<NodeIndex>,
}

/// What one collective more costs, in elements a device moves: a collective's start-up (some
/// microseconds on NVLink or InfiniBand) takes as long as moving about this many float32 elements.
const ONE_COLLECTIVE: u64 = 1 << 16;

/// Whether a weight stored as `stored` (as the rules asked for it) is laid across the mesh: its output
/// features (dimension 1) over the mesh rows, its input features over the columns.
fn stored_across(stored: Layout) -> bool {
    stored.0[ROW_AXIS].dim() == Some(1) && stored.0[COLUMN_AXIS].dim() == Some(0)
}

/// The reason of a kernel that works on this device's blocks alone.
fn compute(text: impl Into<String>) -> Reason {
    Reason::new(ReasonKind::Compute, text)
}

fn s(dim: usize) -> Placement {
    Placement::shard(dim)
}

/// A pattern of the table laid out for a node: its tensor-parallel layout (`stored` for a parameter
/// taken as stored). A derived pattern has no layout of its own; the rules never ask for one.
fn laid(pattern: Pattern, dims: &Dims, stored: Layout) -> Layout {
    pattern.layout(dims, stored).unwrap_or(Layout::REPLICATED)
}

impl Lowerer<'_> {
    fn q(&self) -> u64 {
        self.target.mesh.rows
    }

    fn rank(&self, n: NodeIndex) -> usize {
        self.shapes[n.index()].len()
    }

    /// The case of `operator`'s row under this target's strategy that applies given `facts`.
    fn rule_case(&mut self, operator: Operator, facts: &Facts) -> Option<&'static Case> {
        let case = table::rule(operator, self.target.strategy).and_then(|r| r.case(facts));
        if case.is_none() {
            self.diagnostics.push(Diagnostic::error(
                Code::E0699,
                format!("internal error: no sharding rule for {operator:?} under {}", self.target.strategy.name()),
            ));
        }
        case
    }

    /// Computes a row's product into `out`: its operands A and B are picked from `operands` (laid out
    /// as the row's operand patterns say).
    fn multiply(&mut self, product: Option<Product>, operands: &[BufferId], out: BufferId) {
        let picked = product.and_then(|p| Some((p, *operands.get(p.a)?, *operands.get(p.b)?)));
        let Some((p, a, b)) = picked else {
            self.diagnostics.push(Diagnostic::error(Code::E0699, "internal error: a product rule without a product"));
            return;
        };
        if let Some(summa) = reduced_summa(p.kind) {
            return self.summa_reduced(summa, a, b, out, p.what);
        }
        if let Some(product) = accumulated_summa(p.kind) {
            return self.summa_ab(product, a, b, out, p.what);
        }
        match p.kind {
            ProductKind::Local { transpose_a, transpose_b } => {
                self.local_matmul(a, b, out, transpose_a, transpose_b, p.what)
            }
            ProductKind::Scattered { transpose_a, transpose_b, axis } => {
                self.scattered_matmul((a, b), out, (transpose_a, transpose_b), axis, p.what)
            }
            _ => self.diagnostics.push(Diagnostic::error(Code::E0699, "internal error: a SUMMA product without steps")),
        }
    }

    /// 3D: the local product of gathered blocks as a pending sum over `axis`, reduce-scattered over
    /// that axis into `out` (which `axis` splits as the output's layout says).
    fn scattered_matmul(
        &mut self,
        (a, b): (BufferId, BufferId),
        out: BufferId,
        t: (bool, bool),
        axis: usize,
        what: &str,
    ) {
        let current = self.current;
        self.scattered_matmul_many(&[(current, a, b)], out, t, axis, what);
    }

    /// [`Lowerer::scattered_matmul`] of several products into one output, each as its node's: all
    /// added into one pending sum, reduce-scattered once (input gradients of one input, added).
    fn scattered_matmul_many(
        &mut self,
        products: &[(NodeIndex, BufferId, BufferId)],
        out: BufferId,
        t: (bool, bool),
        axis: usize,
        what: &str,
    ) {
        let first = self.current;
        let o = self.buffers[out.0 as usize].clone();
        let layout = o.layout.with(axis, Placement::Partial);
        let name = format!("{}.partial", o.name);
        let part = self.new_buffer(name, o.dtype, o.logical_shape.clone(), layout, Role::Workspace);
        for (i, &(node, a, b)) in products.iter().enumerate() {
            self.current = node;
            let reason = Reason::new(ReasonKind::LocalProduct, what);
            let k = Kernel::MatMul { transpose_a: t.0, transpose_b: t.1, accumulate: i > 0 };
            self.kernel(k, &[a, b], part, reason);
        }
        self.current = first;
        let shard = o.layout.block_placement(axis, self.axes());
        let group = Group::along(axis);
        let text = format!("{what}: sum the partial products and scatter their blocks over the {}", group.name());
        let reason = Reason::new(ReasonKind::PartialSum { scatter: true }, text);
        self.collective(
            CollectiveKind::ReduceScatter,
            group,
            None,
            Some(ReduceOp::Sum),
            Some(shard),
            part,
            out,
            reason,
        );
    }

    /// Dimensions of a node whose activations' last dimension is `last`, on this mesh.
    fn dims(&self, last: usize) -> Dims {
        Dims { rows: self.q(), ..Dims::new(last) }
    }

    /// Where the linear weight's output dimension is split: the heads factor of (3, heads, head).
    fn out_split(&self, w: NodeIndex, dim: usize) -> Placement {
        let ty = &self.graph[w].ty;
        let out = if dim == 0 { ty.shape.first() } else { ty.shape.last() };
        match out {
            Some(d) if d.factors.len() == 3 => Placement::shard_factor(dim, d.factors[0].size, d.factors[2].size),
            _ => s(dim),
        }
    }

    fn param_layout(&mut self, w: NodeIndex) -> Option<Layout> {
        match self.graph[w].op {
            // The layout the rules asked for: what `parameter_layout` added is not theirs to see.
            Op::Param { id } => self.param_buffers.get(&id).map(|v| self.rules_layout(v.layout)),
            _ => None,
        }
    }

    fn workspace_like(&mut self, like: BufferId, what: &str) -> BufferId {
        let b = self.buffers[like.0 as usize].clone();
        self.new_buffer(format!("{}.{what}", b.name), b.dtype, b.logical_shape, b.layout, Role::Workspace)
    }

    /// A statistics buffer ([rows.., k]) for node `n`, kept for backward when made in the forward pass.
    fn stat_buffer(&mut self, n: NodeIndex, rows_of: NodeIndex, k: u64, layout: Layout, what: &str) -> BufferId {
        let mut shape = self.shapes[rows_of.index()].clone();
        if let Some(last) = shape.last_mut() {
            *last = k;
        }
        let role = if self.forward_end.is_none() { Role::Activation } else { Role::Workspace };
        let name = format!("{}.{what}", super::describe_node(self.model, &self.graph[n], n));
        let layout = self.with_data(rows_of, layout);
        self.new_buffer(name, crate::ir::DType::F32, shape, layout, role)
    }

    /// Sums a buffer over the mesh axes where `layout` is partial; returns the summed buffer.
    fn all_reduce_partials(
        &mut self,
        mut buffer: BufferId,
        layout: Layout,
        op: ReduceOp,
        reason: Reason,
    ) -> (BufferId, Layout) {
        debug_assert_eq!(self.norm(layout).0[..DATA_AXIS], self.buffers[buffer.0 as usize].layout.0[..DATA_AXIS]);
        // The buffer's own layout: the rules' layout with the data axis the lowering gave it.
        let mut layout = self.buffers[buffer.0 as usize].layout;
        for axis in 0..MESH_AXES {
            if layout.0[axis] != Placement::Partial {
                continue;
            }
            layout = layout.with(axis, R);
            let b = self.buffers[buffer.0 as usize].clone();
            let recv = self.new_buffer(format!("{}.reduced", b.name), b.dtype, b.logical_shape, layout, b.role);
            let group = Group::along(axis);
            self.collective(CollectiveKind::AllReduce, group, None, Some(op), None, buffer, recv, reason.clone());
            buffer = recv;
        }
        (buffer, layout)
    }

    /// `layout` with the shards of the last dimension turned into pending sums (a row statistic).
    fn rows_partial(&self, layout: Layout, rank: usize) -> Layout {
        let mut l = layout;
        for p in &mut l.0 {
            if p.dim() == Some(rank - 1) {
                *p = Placement::Partial;
            }
        }
        self.norm(l)
    }

    pub(super) fn lower_node(&mut self, n: NodeIndex) {
        let ops = self.operands(n);
        match self.graph[n].op.clone() {
            Op::Input { .. } | Op::Param { .. } => {}
            Op::Embedding { .. } => self.embedding(n, ops[0], ops[1]),
            Op::PositionEmbedding => self.position_embedding(n, ops[1], None),
            Op::PositionEmbeddingAt => self.position_embedding(n, ops[1], Some(ops[2])),
            Op::Linear { bias, transpose_weight } => self.linear(n, &ops, bias, transpose_weight),
            Op::LayerNorm { eps } => self.layernorm(n, &ops, eps),
            Op::RmsNorm { eps } => self.rms_norm(n, &ops, eps),
            Op::Gelu { approximate } => self.elementwise(n, &ops, Kernel::Gelu { approximate }, 0, false),
            Op::Silu => self.elementwise(n, &ops, Kernel::Silu, 0, false),
            Op::Softmax => self.elementwise(n, &ops, Kernel::Softmax, 1, false),
            Op::CausalMask => self.elementwise(n, &ops, Kernel::CausalMask, 2, false),
            // Inference is evaluation: dropout passes its input through, as in torch's eval mode.
            Op::Dropout { .. } if self.target.mode == optimus_plan::Mode::Infer => self.pass_through(n, ops[0]),
            Op::Dropout { p } => {
                let key = u32::try_from(n.index()).unwrap_or(u32::MAX);
                self.elementwise(n, &ops, Kernel::Dropout { p, key }, 0, false);
            }
            Op::Scale { factor } => self.elementwise(n, &ops, Kernel::Scale { factor }, 0, true),
            Op::Add => self.add(n, ops[0], ops[1]),
            Op::Mul => self.mul(n, ops[0], ops[1]),
            Op::Attention { heads, kv_heads, causal, fused } => {
                self.attention(n, &ops, Heads { query: heads, kv: kv_heads }, causal, fused)
            }
            Op::Rotary { heads, theta } => self.rotary(n, ops[0], heads, |heads| Kernel::Rotary { heads, theta }),
            Op::RotaryAt { heads, theta } => self.rotary_at(n, (ops[0], ops[1]), heads, theta),
            Op::CachedAttention { heads, kv_heads, fused, context } => {
                self.cached_attention(n, &ops, Heads { query: heads, kv: kv_heads }, fused, context)
            }
            Op::RotaryGrad { heads, theta } => {
                self.rotary(n, ops[0], heads, |heads| Kernel::RotaryGrad { heads, theta })
            }
            Op::CrossEntropy => self.cross_entropy(n, ops[0], ops[1]),
            Op::MatMul => self.batched_matmul(n, ops[0], ops[1]),
            Op::Reshape => self.reshape(n, ops[0]),
            Op::Transpose { dim0, dim1 } => self.transpose(n, ops[0], dim0, dim1),
            Op::Select { dim, index } => self.select(n, ops[0], dim, index),
            Op::SelectGrad { dim, index } => self.select_grad(n, ops[0], dim, index),
            Op::Fill { value } => {
                let out = self.node_buffer(n, Layout::REPLICATED, Role::Workspace);
                self.kernel(Kernel::Fill { value }, &[], out, compute("seed gradient of the loss"));
                self.define(n, Layout::REPLICATED, out);
            }
            Op::LinearGradInput { transpose_weight } => self.linear_grad_input(n, ops[0], ops[1], transpose_weight),
            Op::LinearGradWeight { transpose_weight } => self.linear_grad_weight(n, ops[0], ops[1], transpose_weight),
            Op::SumToLast => self.sum_to_last(n, ops[0]),
            Op::LayerNormGradInput { eps } => self.layernorm_grad_input(n, &ops, eps),
            Op::LayerNormGradWeight { eps } => self.layernorm_grad_weight(n, &ops, eps),
            Op::RmsNormGradInput { eps } => self.rms_norm_grad_input(n, &ops, eps),
            Op::RmsNormGradWeight { eps } => self.rms_norm_grad_weight(n, &ops, eps),
            Op::GeluGrad { approximate } => self.elementwise_grad(n, &ops, Kernel::GeluGrad { approximate }, 0),
            Op::SiluGrad => self.elementwise_grad(n, &ops, Kernel::SiluGrad, 0),
            Op::SoftmaxGrad => self.elementwise_grad(n, &ops, Kernel::SoftmaxGrad, 1),
            Op::DropoutGrad { p, forward } => {
                self.elementwise(n, &ops, Kernel::DropoutGrad { p, key: forward }, 0, true)
            }
            Op::CausalMaskGrad => self.elementwise(n, &ops, Kernel::CausalMaskGrad, 2, true),
            Op::AttentionGrad { heads, kv_heads, causal, fused, wrt } => {
                self.attention_grad(n, &ops, Heads { query: heads, kv: kv_heads }, causal, fused, wrt)
            }
            Op::EmbeddingGrad { padding } => self.embedding_grad(n, (ops[0], ops[1]), padding),
            Op::PositionEmbeddingGrad => self.position_embedding_grad(n, ops[0]),
            Op::CrossEntropyGrad => self.cross_entropy_grad(n, &ops),
        }
    }

    // ---- SUMMA -------------------------------------------------------------------------------

    /// C = A B on q x q blocks: broadcast A(i,t) along row i and B(t,j) along column j, accumulate; or,
    /// as `SummaProduct::AtbAccumulated`, C = A^T B the same way for an A whose rows lie over the mesh
    /// columns (A's block (i,t) holds its columns i and rows t); or, as `SummaProduct::AbtAccumulated`,
    /// C = A B^T for a B laid across the mesh (B's block (t,j) holds its rows j and columns t); or, as
    /// `SummaProduct::AtbAccumulatedAcross`, C = A^T B for a C laid across the mesh (C's block (t,j)
    /// holds its rows j and columns t) and a B whose columns lie over the mesh rows (B's block (t,i)
    /// holds its columns t and rows i): A(i,j) broadcast along column j and B(t,i) along row t.
    fn summa_ab(&mut self, product: SummaProduct, a: BufferId, b: BufferId, out: BufferId, what: &str) {
        let current = self.current;
        self.summa_ab_sharing_a(product, a, &[(current, b, out)], what);
    }

    /// [`Lowerer::summa_ab`] of one A with several (B, C), for the nodes given beside them: each step
    /// broadcasts A's block once, then each B's block and multiplies it in, as that node's.
    fn summa_ab_sharing_a(
        &mut self,
        product: SummaProduct,
        a: BufferId,
        products: &[(NodeIndex, BufferId, BufferId)],
        what: &str,
    ) {
        let q = self.q();
        let first = self.current;
        let transpose_a = matches!(product, SummaProduct::AtbAccumulated | SummaProduct::AtbAccumulatedAcross);
        let (a_along, b_along) = if product == SummaProduct::AtbAccumulatedAcross {
            (Group::Column, Group::Row)
        } else {
            (Group::Row, Group::Column)
        };
        let transpose_b = product == SummaProduct::AbtAccumulated;
        if q == 1 {
            for &(node, b, out) in products {
                self.current = node;
                let reason = Reason::new(ReasonKind::LocalProduct, what);
                self.kernel(Kernel::MatMul { transpose_a, transpose_b, accumulate: false }, &[a, b], out, reason);
            }
            self.current = first;
            return;
        }
        let wa = self.workspace_like(a, "summa_a");
        let moving: Vec<(NodeIndex, BufferId, BufferId, BufferId)> = products
            .iter()
            .map(|&(node, b, out)| (node, b, self.workspace_like(b, "summa_b"), self.summa_accumulator(out)))
            .collect();
        for t in 0..q {
            let step = |this: &mut Self, part| this.summa_reason(what, product, t + 1, q, part);
            let reasons = [SummaPart::BroadcastA, SummaPart::BroadcastB, SummaPart::MultiplyAccumulate];
            let [broadcast_a, broadcast_b, multiply] = reasons.map(|part| step(self, part));
            self.current = first;
            self.collective(CollectiveKind::Broadcast, a_along, Some(t), None, None, a, wa, broadcast_a);
            for &(node, b, wb, sum) in &moving {
                self.current = node;
                self.collective(CollectiveKind::Broadcast, b_along, Some(t), None, None, b, wb, broadcast_b);
                let k = Kernel::MatMul { transpose_a, transpose_b, accumulate: t > 0 };
                self.kernel(k, &[wa, wb], sum, multiply);
            }
        }
        for (&(node, _, out), &(_, _, _, sum)) in products.iter().zip(&moving) {
            if sum != out {
                self.current = node;
                let reason = Reason::new(ReasonKind::Cast, format!("{what}: round the float32 SUMMA sum to bf16 once"));
                self.kernel(Kernel::Cast, &[sum], out, reason);
            }
        }
        self.current = first;
    }

    /// Where the q steps of a SUMMA C += A_t B_t accumulate: the output itself, or for a bf16 output a
    /// float32 workspace of its shape (rounded into the output once, after the last step), so that the
    /// sum is not rounded to bf16 at every step.
    fn summa_accumulator(&mut self, out: BufferId) -> BufferId {
        let b = self.buffers[out.0 as usize].clone();
        if b.dtype != crate::ir::DType::Bf16 {
            return out;
        }
        let name = format!("{}.summa_sum", b.name);
        self.new_buffer(name, crate::ir::DType::F32, b.logical_shape, b.layout, Role::Workspace)
    }

    /// A SUMMA product whose output blocks are reduced: each step broadcasts one operand's block,
    /// multiplies it with the local block of the other, and reduces the partial product to step t's root.
    fn summa_reduced(&mut self, summa: ReducedSumma, a: BufferId, b: BufferId, out: BufferId, what: &str) {
        let (moved, other) = if summa.moves_a { (a, b) } else { (b, a) };
        let current = self.current;
        self.summa_reduced_many(summa, &[SummaTerm { node: current, moved, other, out }], what);
    }

    /// [`Lowerer::summa_reduced`] of several terms, each as its node's: terms that move the same operand
    /// broadcast it once a step (weight gradients of one input), and terms into the same output sum
    /// their partial products before one reduce a step (input gradients of one input, added).
    fn summa_reduced_many(&mut self, summa: ReducedSumma, terms: &[SummaTerm], what: &str) {
        let (ta, tb) = (summa.transpose_a, summa.transpose_b);
        let q = self.q();
        let first = self.current;
        let operands = |moved: BufferId, other: BufferId| if summa.moves_a { [moved, other] } else { [other, moved] };
        if q == 1 {
            for (i, term) in terms.iter().enumerate() {
                self.current = term.node;
                let reason = Reason::new(ReasonKind::LocalProduct, what);
                let accumulate = terms[..i].iter().any(|t| t.out == term.out);
                let k = Kernel::MatMul { transpose_a: ta, transpose_b: tb, accumulate };
                self.kernel(k, &operands(term.moved, term.other), term.out, reason);
            }
            self.current = first;
            return;
        }
        let (name, broadcast) =
            if summa.moves_a { ("summa_a", SummaPart::BroadcastA) } else { ("summa_b", SummaPart::BroadcastB) };
        let mut copies: Vec<(BufferId, BufferId)> = Vec::new();
        let mut parts: Vec<(BufferId, BufferId)> = Vec::new();
        for term in terms {
            if !copies.iter().any(|&(moved, _)| moved == term.moved) {
                copies.push((term.moved, self.workspace_like(term.moved, name)));
            }
            if !parts.iter().any(|&(out, _)| out == term.out) {
                parts.push((term.out, self.workspace_like(term.out, "summa_partial")));
            }
        }
        let find = |pairs: &[(BufferId, BufferId)], key: BufferId| pairs.iter().find(|p| p.0 == key).map(|p| p.1);
        for t in 0..q {
            let step = |this: &mut Self, part| this.summa_reason(what, summa.product, t + 1, q, part);
            let [sent, multiply, reduced] = [broadcast, SummaPart::Multiply, SummaPart::ReduceC].map(|p| step(self, p));
            let summed = terms.len() > 1;
            let multiply_summed = if summed { step(self, SummaPart::MultiplyAccumulate) } else { multiply };
            for (i, term) in terms.iter().enumerate() {
                self.current = term.node;
                let (Some(copy), Some(part)) = (find(&copies, term.moved), find(&parts, term.out)) else { continue };
                if !terms[..i].iter().any(|earlier| earlier.moved == term.moved) {
                    self.collective(
                        CollectiveKind::Broadcast,
                        summa.along,
                        Some(t),
                        None,
                        None,
                        term.moved,
                        copy,
                        sent,
                    );
                }
                let accumulate = terms[..i].iter().any(|earlier| earlier.out == term.out);
                let k = Kernel::MatMul { transpose_a: ta, transpose_b: tb, accumulate };
                self.kernel(k, &operands(copy, term.other), part, if accumulate { multiply_summed } else { multiply });
                if !terms[i + 1..].iter().any(|later| later.out == term.out) {
                    let sum = Some(ReduceOp::Sum);
                    self.collective(
                        CollectiveKind::Reduce,
                        summa.reduce_along,
                        Some(t),
                        sum,
                        None,
                        part,
                        term.out,
                        reduced,
                    );
                }
            }
        }
        self.current = first;
    }

    fn local_matmul(&mut self, a: BufferId, b: BufferId, out: BufferId, ta: bool, tb: bool, what: &str) {
        let reason = Reason::new(ReasonKind::LocalProduct, what);
        self.kernel(Kernel::MatMul { transpose_a: ta, transpose_b: tb, accumulate: false }, &[a, b], out, reason);
    }

    // ---- embeddings ----------------------------------------------------------------------------

    /// The case of the embedding row for `table`: split on its rows (vocabulary-parallel) or not.
    fn table_case(&mut self, table: NodeIndex) -> Option<&'static Case> {
        let vocab_parallel = match self.graph[table].op {
            Op::Param { id } => shapes::vocab_parallel(self.model, id),
            _ => false,
        };
        self.rule_case(Operator::Embedding, &Facts { vocab_parallel, ..Facts::default() })
    }

    /// The layout a lookup asks for its table in (operand 1 of the embedding row).
    fn table_layout(&mut self, table: NodeIndex) -> Layout {
        let dims = self.dims(self.rank(table).saturating_sub(1));
        self.table_case(table).map_or(Layout::REPLICATED, |case| laid(case.operands[1], &dims, Layout::REPLICATED))
    }

    /// The device offset of a table's rows, and whether lookups must be masked to them.
    fn row_offset(&self, table_layout: Layout, local_rows: u64) -> (Offset, bool) {
        match table_layout.axis_of(0) {
            Some(axis) => (Offset { axis: Some(u8::try_from(axis).unwrap_or(0)), block: local_rows }, true),
            None => (Offset::ZERO, false),
        }
    }

    /// A lookup: where the table's rows are split each device looks up the ids it holds rows for (a
    /// masked lookup, the result a pending sum); where its width is split, so is the result's.
    fn embedding(&mut self, n: NodeIndex, ids: NodeIndex, table: NodeIndex) {
        let Some(case) = self.table_case(table) else { return };
        let dims = self.dims(self.rank(n) - 1);
        let tl = self.norm(laid(case.operands[1], &dims, Layout::REPLICATED));
        let ids_layout = laid(case.operands[0], &dims, Layout::REPLICATED);
        let out = laid(case.output, &dims, Layout::REPLICATED);
        let tb = self.value(table, tl);
        let ib = self.value(ids, ids_layout);
        let (offset, masked) = self.row_offset(tl, self.buffers[tb.0 as usize].shape[0]);
        let y = self.node_buffer(n, out, Role::Workspace);
        let reason = if masked { "vocab-parallel embedding: masked local lookup" } else { "embedding lookup" };
        self.kernel(Kernel::EmbeddingLookup { offset, masked }, &[ib, tb], y, compute(reason));
        self.define(n, out, y);
    }

    fn embedding_grad(&mut self, n: NodeIndex, (ids, dy): (NodeIndex, NodeIndex), padding: Option<u64>) {
        let Some(table) = self.like_of(n) else { return };
        let tl = match self.param_layout(table) {
            Some(layout) => layout,
            None => self.table_layout(table),
        };
        let (dy_layout, out) = self.table_grad_layouts(tl, dy);
        let mut ids_layout = Layout::REPLICATED;
        for (ids, d) in ids_layout.0.iter_mut().zip(dy_layout.0) {
            *ids = if d == s(0) { s(0) } else { R };
        }
        let dyb = self.value(dy, dy_layout);
        let ib = self.value(ids, ids_layout);
        let local_rows = tl.local_shape(&self.shapes[table.index()], self.axes())[0];
        let (offset, masked) = self.row_offset(self.norm(tl), local_rows);
        let g = self.node_buffer(n, out, Role::Workspace);
        self.kernel(
            Kernel::EmbeddingGrad { offset, masked, padding },
            &[ib, dyb],
            g,
            compute("backward of embedding: scatter-add into this device's rows"),
        );
        self.define(n, out, g);
    }

    /// Layouts for a lookup table's gradient [rows, width] from dY [.., width], per mesh axis: where the
    /// table's rows are split, dY is gathered whole and each device sums into its own rows; where its
    /// width is split, dY's last dimension is split the same way; elsewhere dY keeps its batch split and
    /// the table's gradient is a partial sum over the devices that share the table.
    fn table_grad_layouts(&mut self, table: Layout, dy: NodeIndex) -> (Layout, Layout) {
        let natural = self.natural(dy);
        let last = self.rank(dy) - 1;
        let (mut dy_layout, mut out) = (Layout::REPLICATED, Layout::REPLICATED);
        for axis in 0..MESH_AXES {
            (dy_layout.0[axis], out.0[axis]) = match table.0[axis] {
                Placement::Shard { dim: 0, .. } => (R, s(0)),
                Placement::Shard { .. } => (s(last), s(1)),
                _ => match natural.0[axis] {
                    Placement::Shard { dim: 0, .. } => (s(0), Placement::Partial),
                    Placement::Partial => (Placement::Partial, Placement::Partial),
                    _ => (R, R),
                },
            };
        }
        (dy_layout, out)
    }

    /// Node `n` is its operand `x`, in the layout `x` has: no instruction.
    fn pass_through(&mut self, n: NodeIndex, x: NodeIndex) {
        let layout = self.natural(x);
        let buffer = self.value(x, layout);
        self.define(n, layout, buffer);
    }

    /// Rows of the position table: from row 0, or from a decoding step's `position` (a whole i32
    /// on every device) when given.
    fn position_embedding(&mut self, n: NodeIndex, table: NodeIndex, position: Option<NodeIndex>) {
        let Some(case) = self.rule_case(Operator::PositionEmbedding, &Facts::default()) else { return };
        let dims = self.dims(self.rank(n) - 1);
        let (tl, out) =
            (laid(case.operands[0], &dims, Layout::REPLICATED), laid(case.output, &dims, Layout::REPLICATED));
        let mut inputs = vec![self.value(table, tl)];
        let y = self.node_buffer(n, out, Role::Workspace);
        let (kernel, what) = match position {
            Some(position) => {
                inputs.push(self.value(position, Layout::REPLICATED));
                (Kernel::PositionLookupAt, "position embedding lookup from the step's position")
            }
            None => (Kernel::PositionLookup, "position embedding lookup"),
        };
        self.kernel(kernel, &inputs, y, compute(what));
        self.define(n, out, y);
    }

    fn position_embedding_grad(&mut self, n: NodeIndex, dy: NodeIndex) {
        let Some(table) = self.like_of(n) else { return };
        let tl = self.param_layout(table).unwrap_or(Layout::REPLICATED);
        let (dy_layout, out) = self.table_grad_layouts(tl, dy);
        let dyb = self.value(dy, dy_layout);
        let g = self.node_buffer(n, out, Role::Workspace);
        self.kernel(Kernel::PositionGrad, &[dyb], g, compute("backward of position embedding: sum over the batch"));
        self.define(n, out, g);
    }

    fn like_of(&mut self, n: NodeIndex) -> Option<NodeIndex> {
        let like = self.like.get(n.index()).copied().flatten();
        if like.is_none() {
            self.diagnostics.push(Diagnostic::error(
                Code::E0699,
                format!("internal error: backward node %{} has no forward", n.index()),
            ));
        }
        like
    }

    // ---- linear layers -------------------------------------------------------------------------

    /// y = x W (+ b), or x E^T for a tied table: the row's product, then the bias once the result is
    /// whole along every axis that splits its rows (a row-parallel result is summed first). Later
    /// linears of the same input that take the same SUMMA product (Llama's gate and up projections)
    /// are computed with it, each step's input block broadcast once for all of them.
    fn linear(&mut self, n: NodeIndex, ops: &[NodeIndex], bias: bool, tied: bool) {
        let (x, w) = (ops[0], ops[1]);
        let Some((case, dims)) = self.linear_case(n, (x, w), tied) else { return };
        let xb = self.value(x, laid(case.operands[0], &dims, Layout::REPLICATED));
        let siblings = self.siblings_sharing_input(n, x, (case, &dims));
        let wb = self.value(w, laid(case.operands[1], &dims, Layout::REPLICATED));
        let layout = self.norm(laid(case.output, &dims, Layout::REPLICATED));
        let y = self.node_buffer(n, layout, Role::Workspace);
        if siblings.is_empty() {
            self.multiply(case.product, &[xb, wb], y);
            self.linear_output(n, (y, layout), case, bias.then(|| ops[2]));
            return;
        }
        let mut products = vec![(n, wb, y)];
        let mut outputs = Vec::new();
        for (m, m_ops, m_bias, m_dims) in siblings {
            self.current = m;
            let m_wb = self.value(m_ops[1], laid(case.operands[1], &m_dims, Layout::REPLICATED));
            let m_layout = self.norm(laid(case.output, &m_dims, Layout::REPLICATED));
            let m_y = self.node_buffer(m, m_layout, Role::Workspace);
            products.push((m, m_wb, m_y));
            outputs.push((m, m_layout, m_bias.then(|| m_ops[2])));
        }
        self.current = n;
        let what = format!(
            "{}, one of {} linears sharing the input's broadcasts",
            case.product.map_or("linear", |p| p.what),
            products.len()
        );
        match case.product.and_then(|p| reduced_summa(p.kind)) {
            // A few tokens' products keeping each weight in place: the input's block broadcast once a
            // step, each partial output reduced on its own.
            Some(summa) => {
                let terms: Vec<SummaTerm> =
                    products.iter().map(|&(node, wb, y)| SummaTerm { node, moved: xb, other: wb, out: y }).collect();
                self.summa_reduced_many(summa, &terms, &what);
            }
            None => self.summa_ab_sharing_a(SummaProduct::Ab, xb, &products, &what),
        }
        self.linear_output(n, (y, layout), case, bias.then(|| ops[2]));
        for ((m, m_layout, m_bias), &(_, _, m_y)) in outputs.into_iter().zip(&products[1..]) {
            self.current = m;
            self.linear_output(m, (m_y, m_layout), case, m_bias);
            self.lowered_early.insert(m);
        }
        self.current = n;
    }

    /// The case of the row of linear `n` of input `x` and weight `w`, and the dimensions its patterns
    /// are read with.
    fn linear_case(
        &mut self,
        n: NodeIndex,
        (x, w): (NodeIndex, NodeIndex),
        tied: bool,
    ) -> Option<(&'static Case, Dims)> {
        let last = self.rank(n) - 1;
        let operator = if tied { Operator::LinearTied } else { Operator::Linear };
        let input_split = self.natural(x).0[COLUMN_AXIS].dim() == Some(last);
        let few_tokens = tied && self.fewer_tokens_than_rows(x, w);
        let table_across = tied && self.table_across_moves_less(x, w);
        let weight_across = !tied && self.weight_across(w);
        let weight_stays = !tied && self.weight_stays(x, w, weight_across);
        let facts = Facts { input_split, few_tokens, table_across, weight_across, weight_stays, ..Facts::default() };
        let case = self.rule_case(operator, &facts)?;
        Some((case, Dims { out: self.out_split(w, 1), ..self.dims(last) }))
    }

    /// The later untied linears of input `x` (their nodes, operands, whether they add a bias, and their
    /// dimensions) that take the same SUMMA product as node `n` (one [`shares_forward`] accepts), with
    /// `x` laid out alike: on a mesh of more than one row, their steps can share `x`'s broadcasts (not under `--layouts paper`, whose plans move
    /// what the paper's code moves). Their operands are `x` and parameters, so they can be computed as
    /// early as `n`.
    fn siblings_sharing_input(
        &mut self,
        n: NodeIndex,
        x: NodeIndex,
        (case, dims): (&'static Case, &Dims),
    ) -> Vec<(NodeIndex, Vec<NodeIndex>, bool, Dims)> {
        if !self.shares_products(case, shares_forward) {
            return Vec::new();
        }
        let x_layout = laid(case.operands[0], dims, Layout::REPLICATED);
        let mut siblings = Vec::new();
        for m in self.readers_of(x).into_iter().filter(|&m| m > n) {
            let Op::Linear { bias, transpose_weight: false } = self.graph[m].op else { continue };
            let m_ops = self.operands(m);
            if m_ops.first() != Some(&x) || self.lowered_early.contains(&m) {
                continue;
            }
            let Some((m_case, m_dims)) = self.linear_case(m, (x, m_ops[1]), false) else { continue };
            if std::ptr::eq(m_case, case) && laid(m_case.operands[0], &m_dims, Layout::REPLICATED) == x_layout {
                siblings.push((m, m_ops, bias, m_dims));
            }
        }
        siblings
    }

    /// The nodes that read `x`, in the order of the walk.
    fn readers_of(&self, x: NodeIndex) -> Vec<NodeIndex> {
        let mut readers: Vec<NodeIndex> = self.graph.neighbors_directed(x, petgraph::Direction::Outgoing).collect();
        readers.sort_unstable();
        readers.dedup();
        readers
    }

    /// A linear's product `y` (laid as `layout`) made its output: laid back where the case keeps a
    /// weight across the mesh, then summed and given its bias where it has one (`bias`).
    fn linear_output(&mut self, n: NodeIndex, (y, layout): (BufferId, Layout), case: &Case, bias: Option<NodeIndex>) {
        let (y, layout) = if case.when == When::WeightStaysAcross { self.laid_back(n, y, layout) } else { (y, layout) };
        let Some(bias) = bias else {
            self.define(n, layout, y);
            return;
        };
        let last = self.rank(n) - 1;
        let reason =
            Reason::new(ReasonKind::PartialSum { scatter: false }, "sum the row-parallel linear's partial outputs");
        let (y, layout) = self.all_reduce_partials(y, layout, ReduceOp::Sum, reason);
        let mut bias_layout = Layout::REPLICATED;
        for axis in 0..MESH_AXES {
            if layout.0[axis].dim() == Some(last) {
                bias_layout.0[axis] = on_dim(layout.0[axis], 0);
            }
        }
        let bb = self.value(bias, bias_layout);
        let out = self.node_buffer(n, layout, Role::Workspace);
        self.kernel(Kernel::BiasAdd, &[y, bb], out, compute("add bias"));
        self.define(n, layout, out);
    }

    /// Whether a tied head's input `x` has fewer tokens, per replica of the axes that split the batch,
    /// than `table` has rows, on a mesh with more than one row. Its SUMMA products then move less by
    /// keeping the table in place: 3 token x width blocks instead of 3 vocabulary x width ones a step
    /// (the logits' blocks move either way).
    fn fewer_tokens_than_rows(&self, x: NodeIndex, table: NodeIndex) -> bool {
        let rows = self.shapes[table.index()].first().copied().unwrap_or(0);
        self.target.layouts == Layouts::Auto && self.q() > 1 && self.tokens_per_replica(x) < rows
    }

    /// Whether this compilation lays each product's weight out as moves least (`--layouts auto`) and
    /// the grid is one on which the layouts laid across the diagonal exist (square, more than one row);
    /// `--layouts paper` keeps every weight and table in place, as §3 of the design has them.
    fn chooses_layouts(&self) -> bool {
        self.target.layouts == Layouts::Auto && self.square_grid()
    }

    /// Tokens of `x` (every dimension but the last) per replica of the axes that split the batch.
    fn tokens_per_replica(&self, x: NodeIndex) -> u64 {
        let shape = &self.shapes[x.index()];
        let tokens: u64 = shape[..shape.len().saturating_sub(1)].iter().product();
        let replicas: u64 = self.batch_axes().iter().map(|&axis| self.axes()[axis].max(1)).product();
        tokens / replicas.max(1)
    }

    /// Whether a tied head over `x` (tokens T per replica, or the logits' gradient, which has as many)
    /// and `table` ([V, H]) moves fewer elements a device with the table laid across a square q x q
    /// mesh: per pass, T x H and V x H over q (the token and table blocks its SUMMA steps move), plus a
    /// V x H / q^2 transpose of the table's block (in training three: the table's for the forward and
    /// again for dX, and its gradient's back); against T x V over q (the logits' blocks) plus T x H over
    /// q (table in place, fewer tokens than rows) or V x H over q. Three passes in training (forward,
    /// dX, dE), one in inference. In training this holds once T passes about H (1 + 1/q). Only rows of
    /// the table that have a case for it read it (optimus's, which tesseract's layers share).
    fn table_across_moves_less(&self, x: NodeIndex, table: NodeIndex) -> bool {
        if !self.chooses_layouts() {
            return false;
        }
        let (tokens, q) = (self.tokens_per_replica(x), self.q());
        let table_shape = &self.shapes[table.index()];
        let (Some(&rows), Some(&width)) = (table_shape.first(), table_shape.get(1)) else { return false };
        let train = self.target.mode == optimus_plan::Mode::Train;
        let (passes, transposes) = if train { (3, 3) } else { (1, 1) };
        let other = if self.fewer_tokens_than_rows(x, table) { tokens } else { rows };
        let in_place = passes * (tokens * rows + other * width) * q;
        let across = passes * (tokens + rows) * width * q + transposes * rows * width;
        across < in_place
    }

    /// Whether the untied weight `w` is stored laid across the mesh (see [`When::WeightAcross`]): as it
    /// is stored once a first use made it, else where it has more input features than output ones, on a
    /// square mesh of more than one row. Its three products then move the output's blocks (T x out over
    /// q a device) instead of the input's (T x in over q); the weight's blocks move either way, and it
    /// needs no transpose, being stored so. Only rows of the table with a case for it read it
    /// (optimus's, which tesseract's layers share).
    fn weight_across(&mut self, w: NodeIndex) -> bool {
        if let Some(stored) = self.param_layout(w) {
            return stored_across(stored);
        }
        self.chooses_layouts() && self.fans(w).is_some_and(|(fan_in, fan_out)| fan_in > fan_out)
    }

    /// A weight's input features (dimension 0) and output features (the rest), if it is a matrix.
    fn fans(&self, w: NodeIndex) -> Option<(u64, u64)> {
        let shape = &self.shapes[w.index()];
        let (&fan_in, out) = shape.split_first().filter(|(_, out)| !out.is_empty())?;
        Some((fan_in, out.iter().product()))
    }

    /// Whether a linear over `x` keeps its weight `w` in place and moves the tokens' blocks instead (a
    /// decoding step's few tokens, or a small training batch of a wide model): on a square q x q mesh,
    /// per device, what the tokens' way moves against what the weight's way moves ([`ONE_COLLECTIVE`]
    /// stands for each transpose's start-up). In inference, one pass: T x side over q^2 (the input's
    /// block transposed, or the output's for a weight across the mesh) plus T x (in + out) over q (the
    /// input's blocks broadcast, the partial outputs reduced), against T x side plus in x out over q.
    /// In training, three passes (forward; dX = dY W^T keeping W, dX transposed back; dW = X^T dY
    /// accumulated in place from the forward's transposed input): 3 T (in + out) over q plus two
    /// transposes of T x in over q^2, against 3 (T x in + in x out) over q. A weight across the mesh
    /// does the same with its output's side: the forward's output transposed back, dY transposed for dX
    /// = dY W^T (which comes out as the input lies) and for dW = X^T dY accumulated across.
    fn weight_stays(&self, x: NodeIndex, w: NodeIndex, across: bool) -> bool {
        let train = self.target.mode == optimus_plan::Mode::Train;
        let Some((fan_in, fan_out)) = self.fans(w).filter(|_| self.chooses_layouts()) else {
            return false;
        };
        let (tokens, q) = (self.tokens_per_replica(x), self.q());
        // The activation each way moves beside the weight or the other activation: the input, or for a
        // weight across the mesh the output (transposed when the weight stays, moved when it moves).
        let side = if across { fan_out } else { fan_in };
        let (passes, transposes) = if train { (3, 2) } else { (1, 1) };
        let stays = transposes * (tokens * side + ONE_COLLECTIVE * q * q) + passes * tokens * (fan_in + fan_out) * q;
        let moves = passes * (tokens * side + fan_in * fan_out) * q;
        stays < moves
    }

    /// `y`, laid across the mesh as `layout`, transposed across the grid's diagonal into the layout the
    /// rest of the model takes (a weight kept in place across the mesh leaves its output so).
    fn laid_back(&mut self, n: NodeIndex, y: BufferId, layout: Layout) -> (BufferId, Layout) {
        let from = self.norm(self.with_data(n, layout));
        let Some(to) = from.mirrored() else { return (y, layout) };
        let to = self.norm(to);
        (self.redistribute(n, Version { layout: from, buffer: y }, to), to)
    }

    /// Whether `n` (logits or their gradient) lies with its last dimension over the mesh rows.
    fn vocab_on_rows(&mut self, n: NodeIndex) -> bool {
        let last = self.rank(n).saturating_sub(1);
        last > 0 && self.natural(n).0[ROW_AXIS].dim() == Some(last)
    }

    /// The case of a linear backward row for a weight stored as `wl`, and the dimensions its patterns
    /// are read with: the weight's output split is the one it is stored with. `dy`: the output's
    /// gradient, whose layout and token count pick a tied head's case with the weight `w`.
    fn weight_case(
        &mut self,
        operator: Operator,
        wl: Layout,
        last: usize,
        (dy, w): (NodeIndex, NodeIndex),
    ) -> Option<(&'static Case, Dims)> {
        let tied = matches!(operator, Operator::LinearGradInputTied | Operator::LinearGradWeightTied);
        let vocab_on_rows = tied && self.vocab_on_rows(dy);
        let table_across = tied && self.table_across_moves_less(dy, w);
        let weight_across = !tied && stored_across(wl);
        let weight_stays = !tied && self.weight_stays(dy, w, weight_across);
        let weight_cols = Some(wl.0[COLUMN_AXIS]);
        let facts = Facts { weight_cols, vocab_on_rows, table_across, weight_across, weight_stays, ..Facts::default() };
        let case = self.rule_case(operator, &facts)?;
        // The output features' split: the columns', (a 3D weight on L2 inputs) the depth's or (a weight
        // laid across the mesh) the rows' split of dimension 1, else the columns' placement as the rows
        // that do not read it take it.
        let splits_out = [wl.0[COLUMN_AXIS], wl.0[DEPTH_AXIS], wl.0[ROW_AXIS]].into_iter().find(|p| p.dim() == Some(1));
        Some((case, Dims { out: splits_out.unwrap_or(wl.0[COLUMN_AXIS]), ..self.dims(last) }))
    }

    /// dX = dY W^T (dY E when tied), with W as stored. Input gradients that only a tree of additions
    /// reads (a layer input's from its q, k and v, say) wait for its top, which computes them in one
    /// product with one reduction ([`Lowerer::summed_input_gradients`]).
    fn linear_grad_input(&mut self, n: NodeIndex, dy: NodeIndex, w: NodeIndex, tied: bool) {
        let last = self.rank(n) - 1;
        let Some(wl) = self.param_layout(w) else { return self.missing_param(n) };
        let operator = if tied { Operator::LinearGradInputTied } else { Operator::LinearGradInput };
        let Some((case, dims)) = self.weight_case(operator, wl, last, (dy, w)) else { return };
        if !tied && self.gradient_sum_of(n).is_some() {
            self.deferred.insert(n);
            return;
        }
        let wl_asked = laid(case.operands[1], &dims, wl);
        let wb = if case.when == When::TableAcross { self.value_afresh(w, wl_asked) } else { self.value(w, wl_asked) };
        let dyb = self.value(dy, laid(case.operands[0], &dims, wl));
        let out = self.norm(laid(case.output, &dims, wl));
        let g = self.node_buffer(n, out, Role::Workspace);
        self.multiply(case.product, &[dyb, wb], g);
        self.define(n, out, g);
    }

    /// dW = X^T dY (dE = dY^T X when tied), in the weight's stored layout. Weight gradients of one
    /// input that take the same SUMMA product (the gradients of linears that shared the input's
    /// broadcasts forward) are lowered together at the last of them, each step broadcasting the
    /// input's block once: the earlier ones wait for it ([`Lowerer::deferred`]).
    fn linear_grad_weight(&mut self, n: NodeIndex, x: NodeIndex, dy: NodeIndex, tied: bool) {
        let Some((case, dims, wl)) = self.weight_grad_case(n, x, dy, tied) else { return };
        let x_layout = laid(case.operands[0], &dims, wl);
        let shares = !tied && self.shares_products(case, shares_weight_gradients) && self.readers_of(n).is_empty();
        if shares && !self.weight_gradients_sharing(x, (case, x_layout), |m| m > n).is_empty() {
            self.deferred.insert(n);
            return;
        }
        let mut earlier =
            if shares { self.weight_gradients_sharing(x, (case, x_layout), |m| m < n) } else { Vec::new() };
        earlier.retain(|m| self.deferred.contains(m));
        let mut gradients = Vec::new();
        for m in earlier {
            let ops = self.operands(m);
            let Some((m_case, m_dims, m_wl)) = self.weight_grad_case(m, ops[0], ops[1], tied) else { return };
            gradients.push((m, ops[1], (m_case, m_dims, m_wl)));
        }
        gradients.push((n, dy, (case, dims, wl)));
        let xb = self.value(x, x_layout);
        let mut products = Vec::new();
        let mut outputs = Vec::new();
        for (m, m_dy, (m_case, m_dims, m_wl)) in gradients {
            self.current = m;
            let out = laid(m_case.output, &m_dims, m_wl);
            let g = self.node_buffer(m, out, Role::Workspace);
            let dyb = self.value(m_dy, laid(m_case.operands[1], &m_dims, m_wl));
            products.push((m, dyb, g));
            outputs.push((m, out, g));
        }
        self.current = n;
        if let [(_, dyb, g)] = products[..] {
            self.multiply(case.product, &[xb, dyb], g);
        } else {
            let what = format!(
                "{}, one of {} sharing X's broadcasts",
                case.product.map_or("backward of linear (dW = X^T dY)", |p| p.what),
                products.len()
            );
            let kind = case.product.map(|p| p.kind);
            if let Some(product) = kind.and_then(accumulated_summa) {
                // X's block broadcast once a step, each dY's beside it, summed where each dW lies.
                self.summa_ab_sharing_a(product, xb, &products, &what);
            } else {
                let terms: Vec<SummaTerm> =
                    products.iter().map(|&(node, dyb, g)| SummaTerm { node, moved: xb, other: dyb, out: g }).collect();
                self.summa_reduced_many(ReducedSumma::ATB, &terms, &what);
            }
        }
        for (m, out, g) in outputs {
            self.current = m;
            self.define(m, out, g);
            if m != n {
                self.deferred.remove(&m);
                self.gradient_done(m);
            }
        }
        self.current = n;
    }

    /// The case of the weight gradient `n` = X^T dY, the dimensions its patterns are read with and its
    /// weight's stored layout.
    fn weight_grad_case(
        &mut self,
        n: NodeIndex,
        x: NodeIndex,
        dy: NodeIndex,
        tied: bool,
    ) -> Option<(&'static Case, Dims, Layout)> {
        let w = self.like_of(n)?;
        let Some(wl) = self.param_layout(w) else {
            self.missing_param(n);
            return None;
        };
        let last = self.rank(x) - 1;
        let operator = if tied { Operator::LinearGradWeightTied } else { Operator::LinearGradWeight };
        let (case, dims) = self.weight_case(operator, wl, last, (dy, w))?;
        Some((case, dims, wl))
    }

    /// Whether `case` computes a product that `kinds` accepts (A its operand 0, B its operand 1) in a
    /// compilation where siblings share such products' collectives: on a mesh of more than one row,
    /// with the layouts chosen per product (`--layouts paper` moves what the paper's code moves).
    fn shares_products(&self, case: &Case, kinds: fn(ProductKind) -> bool) -> bool {
        let plain = case.product.is_some_and(|p| kinds(p.kind) && p.a == 0 && p.b == 1);
        plain && self.q() > 1 && self.target.layouts == Layouts::Auto
    }

    /// The untied weight gradients among the nodes `picked` selects whose input is `x`, laid out as
    /// `x_layout`, with the same case, and which no node reads, in the walk's order: each a parameter's
    /// whole gradient, read only by the optimizer after the walk, so that one can wait for a later one.
    /// (The terms of a weight used twice are added by a node, which may come before the last of them.)
    fn weight_gradients_sharing(
        &mut self,
        x: NodeIndex,
        (case, x_layout): (&'static Case, Layout),
        picked: impl Fn(NodeIndex) -> bool,
    ) -> Vec<NodeIndex> {
        let mut found = Vec::new();
        for m in self.readers_of(x) {
            if !picked(m)
                || !matches!(self.graph[m].op, Op::LinearGradWeight { transpose_weight: false })
                || !self.readers_of(m).is_empty()
            {
                continue;
            }
            let ops = self.operands(m);
            if ops.first() != Some(&x) {
                continue;
            }
            let Some(w) = self.like_of(m) else { continue };
            let Some(wl) = self.param_layout(w) else { continue };
            let last = self.rank(x) - 1;
            let Some((m_case, m_dims)) = self.weight_case(Operator::LinearGradWeight, wl, last, (ops[1], w)) else {
                continue;
            };
            if std::ptr::eq(m_case, case) && laid(m_case.operands[0], &m_dims, wl) == x_layout {
                found.push(m);
            }
        }
        found
    }

    /// The product and output layout of `n` where it is an input gradient that can join a sum of input
    /// gradients: untied, of a SUMMA A B^T case whose partials are reduced, on a mesh of more than one
    /// row with the layouts chosen per product. Terms of one sum take the same product into one layout.
    fn summable_input_gradient(&mut self, n: NodeIndex) -> Option<(ProductKind, Layout)> {
        let (case, dims, wl) = self.input_grad_case(n)?;
        let kind = case.product?.kind;
        self.shares_products(case, sums_input_gradients).then(|| (kind, self.norm(laid(case.output, &dims, wl))))
    }

    /// The case of the untied input gradient `n` = dY W^T, the dimensions its patterns are read with
    /// and its weight's stored layout; `None` for any other node.
    fn input_grad_case(&mut self, n: NodeIndex) -> Option<(&'static Case, Dims, Layout)> {
        let Op::LinearGradInput { transpose_weight: false } = self.graph[n].op else { return None };
        let ops = self.operands(n);
        let wl = self.param_layout(*ops.get(1)?)?;
        let last = self.rank(n) - 1;
        let (case, dims) = self.weight_case(Operator::LinearGradInput, wl, last, (ops[0], ops[1]))?;
        Some((case, dims, wl))
    }

    /// The sum of input gradients that the input gradient `n` joins, where it has at least one other
    /// term: `n`'s only reader is an addition, and the additions above it (each read by the next alone)
    /// add further input gradients laid out as `n`, read by them alone. The tree's other operands must
    /// be lowered before its first term and laid out as the terms, without pending sums: they are
    /// added to the sum once it is reduced.
    fn gradient_sum_of(&mut self, n: NodeIndex) -> Option<GradientSum> {
        let term = self.summable_input_gradient(n)?;
        let layout = term.1;
        let [mut top] = self.readers_of(n)[..] else { return None };
        let mut best: Option<GradientSum> = None;
        while matches!(self.graph[top].op, Op::Add) {
            let tree = self.addition_tree(top, term);
            if tree.terms.len() > best.as_ref().map_or(1, |b| b.terms.len()) {
                best = Some(tree);
            }
            let [reader] = self.readers_of(top)[..] else { break };
            top = reader;
        }
        let sum = best?;
        let first = sum.terms.iter().min().copied()?;
        let mut distinct = sum.terms.clone();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() != sum.terms.len() || !distinct.contains(&n) {
            return None;
        }
        for &other in &sum.others {
            if other >= first || self.natural(other) != layout {
                return None;
            }
        }
        Some(sum)
    }

    /// The input gradients of product and layout `term` that the addition `t` sums with the additions
    /// below it read by nothing else, those additions, and the tree's other operands, in walk order.
    fn addition_tree(&mut self, t: NodeIndex, term: (ProductKind, Layout)) -> GradientSum {
        let mut tree = GradientSum { root: t, term, terms: Vec::new(), inner: Vec::new(), others: Vec::new() };
        for o in self.operands(t) {
            let read_here_alone = self.readers_of(o) == [t];
            if read_here_alone && self.summable_input_gradient(o) == Some(term) {
                tree.terms.push(o);
                continue;
            }
            if read_here_alone && matches!(self.graph[o].op, Op::Add) {
                let below = self.addition_tree(o, term);
                if !below.terms.is_empty() {
                    tree.inner.push(o);
                    tree.terms.extend(below.terms);
                    tree.inner.extend(below.inner);
                    tree.others.extend(below.others);
                    continue;
                }
            }
            tree.others.push(o);
        }
        tree
    }

    /// The addition `n` of a tree of additions with input gradients waiting below it: the sum's top
    /// computes it ([`Lowerer::summed_input_gradients`]); an addition below the top waits too.
    fn add_to_waiting_gradients(&mut self, n: NodeIndex, waiting: NodeIndex) {
        let mut term = waiting;
        while matches!(self.graph[term].op, Op::Add) {
            let Some(&below) = self.operands(term).iter().find(|&&o| self.deferred.contains(&o)) else { break };
            term = below;
        }
        match self.gradient_sum_of(term) {
            Some(sum) if sum.root == n => self.summed_input_gradients(&sum),
            Some(_) => {
                self.deferred.insert(n);
            }
            None => self.diagnostics.push(Diagnostic::error(
                Code::E0699,
                format!("internal error: the input gradient %{} waits for a sum that is not found", term.index()),
            )),
        }
    }

    /// The sum of input gradients that waited for it, in one product of their kind: each SUMMA step
    /// adds the terms' partial products before its one reduce (or, in 3D, the local products before the
    /// one reduce-scatter); the tree's other operands are then added.
    fn summed_input_gradients(&mut self, sum: &GradientSum) {
        let (kind, layout) = sum.term;
        let mut parts = Vec::new();
        for &term in &sum.terms {
            self.current = term;
            let Some((case, dims, wl)) = self.input_grad_case(term) else { return self.missing_param(term) };
            let ops = self.operands(term);
            let wb = self.value(ops[1], laid(case.operands[1], &dims, wl));
            let dyb = self.value(ops[0], laid(case.operands[0], &dims, wl));
            parts.push((term, dyb, wb, case.product.map_or("backward of linear (dX = dY W^T)", |p| p.what)));
            self.deferred.remove(&term);
        }
        for inner in &sum.inner {
            self.deferred.remove(inner);
        }
        let s = sum.root;
        self.current = s;
        let mut y = self.node_buffer(s, layout, Role::Workspace);
        let base = parts.first().map_or("backward of linear (dX = dY W^T)", |p| p.3);
        let products: Vec<_> = parts.iter().map(|&(node, dyb, wb, _)| (node, dyb, wb)).collect();
        if let ProductKind::Scattered { transpose_a, transpose_b, axis } = kind {
            let what = format!("{base}, one of {} summed before the reduce-scatter", parts.len());
            self.scattered_matmul_many(&products, y, (transpose_a, transpose_b), axis, &what);
        } else if let Some(summa) = reduced_summa(kind) {
            // A B^T moves B (the weight's blocks); the products keeping the weight in place move A (dY's).
            let term = |&(node, dyb, wb): &(NodeIndex, BufferId, BufferId)| match summa.moves_a {
                true => SummaTerm { node, moved: dyb, other: wb, out: y },
                false => SummaTerm { node, moved: wb, other: dyb, out: y },
            };
            let terms: Vec<SummaTerm> = products.iter().map(term).collect();
            let what = format!("{base}, one of {} summed before each reduce", parts.len());
            self.summa_reduced_many(summa, &terms, &what);
        } else {
            let text = "internal error: input gradients summed by a product that does not reduce";
            return self.diagnostics.push(Diagnostic::error(Code::E0699, text));
        }
        for &other in &sum.others {
            let ob = self.value(other, layout);
            let total = self.node_buffer(s, layout, Role::Workspace);
            self.kernel(Kernel::Add, &[ob, y], total, compute("add (local)"));
            y = total;
        }
        self.define(s, layout, y);
    }

    fn missing_param(&mut self, n: NodeIndex) {
        self.diagnostics.push(Diagnostic::error(
            Code::E0699,
            format!("internal error: the weight of %{} has no layout", n.index()),
        ));
    }

    /// Sum over every dimension but the last (bias and beta gradients). Where `dy` came out with its
    /// last dimension over the mesh rows (the dX of a weight kept in place) and a version with it over
    /// the columns was made too (for the norm's backward), the sum reads that one: it is then split
    /// over the columns, as the vectors are stored, instead of over the rows.
    fn sum_to_last(&mut self, n: NodeIndex, dy: NodeIndex) {
        let rank = self.rank(dy);
        let settled = self.settled(dy);
        let last_on_columns = |v: &&Version| !v.layout.has_partial() && v.layout.0[COLUMN_AXIS].dim() == Some(rank - 1);
        let standard = self.versions.get(&dy).and_then(|vs| vs.iter().find(last_on_columns)).map(|v| v.layout);
        let l = match standard {
            Some(standard) if settled.0[ROW_AXIS].dim() == Some(rank - 1) => standard,
            _ => settled,
        };
        let out = self.summed_layout(l, rank);
        let dyb = self.value(dy, l);
        let g = self.node_buffer(n, out, Role::Workspace);
        self.kernel(Kernel::SumToLast, &[dyb], g, compute("backward: sum over rows (bias gradient)"));
        self.define(n, out, g);
    }

    /// The layout of a [last] vector summed from a tensor laid out as `l`.
    fn summed_layout(&self, l: Layout, rank: usize) -> Layout {
        let mut out = Layout::REPLICATED;
        for axis in 0..MESH_AXES {
            out.0[axis] = match l.0[axis] {
                p @ Placement::Shard { dim, .. } if dim as usize == rank - 1 => on_dim(p, 0),
                Placement::Shard { .. } | Placement::Partial => Placement::Partial,
                Placement::Replicate => R,
            };
        }
        self.norm(out)
    }

    // ---- LayerNorm -------------------------------------------------------------------------------

    /// The layouts a normalisation works in (the norm row): its activations (and result) and its
    /// weights (gamma, beta), split as the activations' last dimension is.
    fn layernorm_layouts(&mut self, x: NodeIndex) -> Option<(Layout, Layout)> {
        let rank = self.rank(x);
        // 3D normalises either activation layout: its features on the depth, or on the columns.
        let input_split = self.natural(x).0[COLUMN_AXIS].dim() == Some(rank - 1);
        let case = self.rule_case(Operator::Norm, &Facts { input_split, ..Facts::default() })?;
        let dims = self.dims(rank - 1);
        let x = self.norm(laid(case.operands[0], &dims, Layout::REPLICATED));
        Some((x, self.norm(laid(case.operands[1], &dims, Layout::REPLICATED))))
    }

    fn layernorm(&mut self, n: NodeIndex, ops: &[NodeIndex], eps: f64) {
        let stat = |text: &str| Reason::new(ReasonKind::Statistics { of: Statistic::LayerNorm }, text);
        let x = ops[0];
        let rank = self.rank(x);
        let Some((xl, gl)) = self.layernorm_layouts(x) else { return };
        let full = self.shapes[x.index()][rank - 1];
        let xb = self.value(x, xl);
        let gb = self.value(ops[1], gl);
        let bb = self.value(ops[2], gl);
        let partial = self.rows_partial(xl, rank);
        let s1 = self.stat_buffer(n, x, 1, partial, "sum");
        self.kernel(Kernel::RowSum, &[xb], s1, stat("LayerNorm statistics: local sum"));
        let (s1, _) =
            self.all_reduce_partials(s1, partial, ReduceOp::Sum, stat("LayerNorm statistics: sum over the row"));
        let s2 = self.stat_buffer(n, x, 1, partial, "sqsum");
        self.kernel(
            Kernel::RowCenteredSquareSum { n: full },
            &[xb, s1],
            s2,
            stat("LayerNorm statistics: local centred squares"),
        );
        let (s2, _) =
            self.all_reduce_partials(s2, partial, ReduceOp::Sum, stat("LayerNorm statistics: variance over the row"));
        let y = self.node_buffer(n, xl, Role::Workspace);
        self.kernel(Kernel::LayerNormApply { n: full, eps }, &[xb, s1, s2, gb, bb], y, compute("LayerNorm: normalise"));
        self.layernorm_stats.insert(x, (s1, s2));
        self.define(n, xl, y);
    }

    fn layernorm_grad_input(&mut self, n: NodeIndex, ops: &[NodeIndex], eps: f64) {
        let stat = |text: &str| Reason::new(ReasonKind::Statistics { of: Statistic::LayerNormGrad }, text);
        let (dy, x, gamma) = (ops[0], ops[1], ops[2]);
        let rank = self.rank(x);
        let Some((xl, gl)) = self.layernorm_layouts(x) else { return };
        let full = self.shapes[x.index()][rank - 1];
        let Some(&(s1, s2)) = self.layernorm_stats.get(&x) else { return self.missing_param(n) };
        let dyb = self.value(dy, xl);
        let xb = self.value(x, xl);
        let gb = self.value(gamma, gl);
        let partial = self.rows_partial(xl, rank);
        let sums = self.stat_buffer(n, x, 2, partial, "grad_sums");
        self.kernel(
            Kernel::LayerNormGradSums { n: full, eps },
            &[dyb, xb, gb, s1, s2],
            sums,
            stat("backward of LayerNorm: local sums"),
        );
        let (sums, _) =
            self.all_reduce_partials(sums, partial, ReduceOp::Sum, stat("backward of LayerNorm: sums over the row"));
        let dx = self.node_buffer(n, xl, Role::Workspace);
        self.kernel(
            Kernel::LayerNormGradInput { n: full, eps },
            &[dyb, xb, gb, s1, s2, sums],
            dx,
            compute("backward of LayerNorm (dX)"),
        );
        self.define(n, xl, dx);
    }

    fn layernorm_grad_weight(&mut self, n: NodeIndex, ops: &[NodeIndex], eps: f64) {
        let (dy, x) = (ops[0], ops[1]);
        let rank = self.rank(x);
        let Some((xl, _)) = self.layernorm_layouts(x) else { return };
        let full = self.shapes[x.index()][rank - 1];
        let Some(&(s1, s2)) = self.layernorm_stats.get(&x) else { return self.missing_param(n) };
        let dyb = self.value(dy, xl);
        let xb = self.value(x, xl);
        let out = self.summed_layout(xl, rank);
        let g = self.node_buffer(n, out, Role::Workspace);
        self.kernel(
            Kernel::LayerNormGradWeight { n: full, eps },
            &[dyb, xb, s1, s2],
            g,
            compute("backward of LayerNorm (dgamma)"),
        );
        self.define(n, out, g);
    }

    // ---- RMSNorm ---------------------------------------------------------------------------------
    // Laid out as LayerNorm (its layouts, weight split as gamma); one row statistic, the sum of squares,
    // partial where the last dimension is split and all-reduced along that mesh axis.

    fn rms_norm(&mut self, n: NodeIndex, ops: &[NodeIndex], eps: f64) {
        let stat = |text: &str| Reason::new(ReasonKind::Statistics { of: Statistic::RmsNorm }, text);
        let x = ops[0];
        let rank = self.rank(x);
        let Some((xl, wl)) = self.layernorm_layouts(x) else { return };
        let full = self.shapes[x.index()][rank - 1];
        let xb = self.value(x, xl);
        let wb = self.value(ops[1], wl);
        let partial = self.rows_partial(xl, rank);
        let sq = self.stat_buffer(n, x, 1, partial, "sqsum");
        self.kernel(Kernel::RowSquareSum, &[xb], sq, stat("RMSNorm statistics: local sum of squares"));
        let (sq, _) = self.all_reduce_partials(
            sq,
            partial,
            ReduceOp::Sum,
            stat("RMSNorm statistics: sum of squares over the row"),
        );
        let y = self.node_buffer(n, xl, Role::Workspace);
        self.kernel(Kernel::RmsNormApply { n: full, eps }, &[xb, sq, wb], y, compute("RMSNorm: normalise"));
        self.rms_norm_stats.insert(x, sq);
        self.define(n, xl, y);
    }

    fn rms_norm_grad_input(&mut self, n: NodeIndex, ops: &[NodeIndex], eps: f64) {
        let stat = |text: &str| Reason::new(ReasonKind::Statistics { of: Statistic::RmsNormGrad }, text);
        let (dy, x, w) = (ops[0], ops[1], ops[2]);
        let rank = self.rank(x);
        let Some((xl, wl)) = self.layernorm_layouts(x) else { return };
        let full = self.shapes[x.index()][rank - 1];
        let Some(&sq) = self.rms_norm_stats.get(&x) else { return self.missing_param(n) };
        let dyb = self.value(dy, xl);
        let xb = self.value(x, xl);
        let wb = self.value(w, wl);
        let partial = self.rows_partial(xl, rank);
        let dot = self.stat_buffer(n, x, 1, partial, "grad_sum");
        self.kernel(Kernel::RmsNormGradSum, &[dyb, xb, wb], dot, stat("backward of RMSNorm: local sum of dy w x"));
        let (dot, _) =
            self.all_reduce_partials(dot, partial, ReduceOp::Sum, stat("backward of RMSNorm: sum over the row"));
        let dx = self.node_buffer(n, xl, Role::Workspace);
        self.kernel(
            Kernel::RmsNormGradInput { n: full, eps },
            &[dyb, xb, wb, sq, dot],
            dx,
            compute("backward of RMSNorm (dX)"),
        );
        self.define(n, xl, dx);
    }

    fn rms_norm_grad_weight(&mut self, n: NodeIndex, ops: &[NodeIndex], eps: f64) {
        let (dy, x) = (ops[0], ops[1]);
        let rank = self.rank(x);
        let Some((xl, _)) = self.layernorm_layouts(x) else { return };
        let full = self.shapes[x.index()][rank - 1];
        let Some(&sq) = self.rms_norm_stats.get(&x) else { return self.missing_param(n) };
        let dyb = self.value(dy, xl);
        let xb = self.value(x, xl);
        let out = self.summed_layout(xl, rank);
        let g = self.node_buffer(n, out, Role::Workspace);
        self.kernel(
            Kernel::RmsNormGradWeight { n: full, eps },
            &[dyb, xb, sq],
            g,
            compute("backward of RMSNorm (dweight)"),
        );
        self.define(n, out, g);
    }

    // ---- element-wise and shape operators -------------------------------------------------------

    /// A layout with no pending sums (unless `partial_ok`) and the last `whole` dimensions unsplit.
    fn local_layout(&mut self, x: NodeIndex, whole: usize, partial_ok: bool) -> Layout {
        let rank = self.rank(x);
        let mut l = self.natural(x);
        for p in &mut l.0 {
            let tail = p.dim().is_some_and(|d| d + whole >= rank);
            if tail || (!partial_ok && *p == Placement::Partial) {
                *p = R;
            }
        }
        self.norm(l)
    }

    fn elementwise(&mut self, n: NodeIndex, ops: &[NodeIndex], kernel: Kernel, whole: usize, partial_ok: bool) {
        let l = self.local_layout(ops[0], whole, partial_ok);
        let xb = self.value(ops[0], l);
        let y = self.node_buffer(n, l, Role::Workspace);
        let reason = format!("{} (local)", self.graph[n].op.name());
        self.kernel(kernel, &[xb], y, compute(reason));
        self.define(n, l, y);
    }

    /// (dy, forward value) kernels: dy is brought to the forward value's layout.
    fn elementwise_grad(&mut self, n: NodeIndex, ops: &[NodeIndex], kernel: Kernel, whole: usize) {
        let l = self.local_layout(ops[1], whole, false);
        let dyb = self.value(ops[0], l);
        let xb = self.value(ops[1], l);
        let y = self.node_buffer(n, l, Role::Workspace);
        let reason = format!("{} (local)", self.graph[n].op.name());
        self.kernel(kernel, &[dyb, xb], y, compute(reason));
        self.define(n, l, y);
    }

    /// a + b in one layout. In the backward pass, pending sums that meet are added locally and reduced
    /// once, later: where one operand is a pending sum and the other is whole along those axes (and laid
    /// out alike elsewhere), the whole one joins the sum as 1/p shares, so that a chain of gradient
    /// additions (a layer input's gradient from its residual path and its q, k and v products) costs
    /// one reduction, not one per term. (In the forward pass a partial output is summed where its
    /// product is, which costs the same and keeps the reduction with the layer that causes it.)
    fn add(&mut self, n: NodeIndex, a: NodeIndex, b: NodeIndex) {
        let waiting = |node: NodeIndex| {
            self.deferred.contains(&node) && matches!(self.graph[node].op, Op::LinearGradInput { .. } | Op::Add)
        };
        if let Some(w) = [a, b].into_iter().find(|&o| waiting(o)) {
            return self.add_to_waiting_gradients(n, w);
        }
        let (la, lb) = (self.natural(a), self.natural(b));
        let backward = self.forward_end.is_some();
        let joins = |partial: Layout, whole: Layout| {
            backward
                && partial.has_partial()
                && !whole.has_partial()
                && partial.0.iter().zip(whole.0).all(|(p, w)| *p == w || (*p == Placement::Partial && w == R))
        };
        let l = if let Some(stored) = self.term_laid_as_stored(n, la, lb) {
            stored
        } else if joins(la, lb) || joins(lb, la) {
            if la.has_partial() { la } else { lb }
        } else if la.has_partial() && !lb.has_partial() {
            lb
        } else {
            la
        };
        let ab = self.value(a, l);
        let bb = self.value(b, l);
        let y = self.node_buffer(n, l, Role::Workspace);
        self.kernel(Kernel::Add, &[ab, bb], y, compute("add (local)"));
        self.define(n, l, y);
    }

    /// Where `n` is a parameter's whole gradient summed from two terms laid out `la` and `lb` over the
    /// grid (a tied table's, from its lookup and from its head laid across the mesh), neither a pending
    /// sum over it, and one laid out over the grid as the parameter is stored: that term's layout. The
    /// sum is then taken where the parameter is stored: only the other term moves, and the sum not again.
    fn term_laid_as_stored(&self, n: NodeIndex, la: Layout, lb: Layout) -> Option<Layout> {
        let stored = self.param_buffers.get(self.gradient_of.get(&n)?)?.layout;
        let grid = |l: Layout| [l.0[ROW_AXIS], l.0[COLUMN_AXIS]];
        if grid(la).contains(&Placement::Partial) || grid(lb).contains(&Placement::Partial) {
            return None;
        }
        [la, lb].into_iter().find(|&l| grid(l) == grid(stored))
    }

    /// a * b element-wise, both in one layout. A product is not linear in the pair, so pending sums are
    /// completed first: the layout is that of an operand without any (reduce-scattering the other into
    /// it), or, when both have them, the first's with its partial axes all-reduced.
    fn mul(&mut self, n: NodeIndex, a: NodeIndex, b: NodeIndex) {
        let (la, lb) = (self.settled(a), self.settled(b));
        let chosen = if la.has_partial() && !lb.has_partial() { lb } else { la };
        let mut l = chosen;
        for p in &mut l.0 {
            if *p == Placement::Partial {
                *p = R;
            }
        }
        let l = self.norm(l);
        let ab = self.value(a, l);
        let bb = self.value(b, l);
        let y = self.node_buffer(n, l, Role::Workspace);
        self.kernel(Kernel::Mul, &[ab, bb], y, compute("multiply (local)"));
        self.define(n, l, y);
    }

    // ---- attention ---------------------------------------------------------------------------------

    /// Layouts of attention's inputs and output (the attention row): whole heads on each device. A
    /// rank-2 input [seq, width] has no batch dimension: its dimension 0 is the sequence, which stays
    /// whole. A fused input is split on the heads factor of its (3, heads, head) last dimension.
    fn attention_layouts(&mut self, width: u64, heads: u64, fused: bool, rank: usize) -> Option<(Layout, Layout)> {
        let case = self.rule_case(Operator::Attention, &Facts::default())?;
        let groups = if fused { (3, width / 3 / heads.max(1)) } else { (1, 1) };
        let dims = Dims { batch: rank > 2, heads: groups, ..self.dims(rank - 1) };
        let input = self.norm(laid(case.operands[0], &dims, Layout::REPLICATED));
        Some((input, self.norm(laid(case.output, &dims, Layout::REPLICATED))))
    }

    /// How many of `heads` (sized by the config value `label`) each device holds when `input` splits
    /// them on mesh axis 1; a count that does not divide is reported (the meshes that work are added).
    fn local_heads(&mut self, n: NodeIndex, heads: u64, label: &str, input: Layout) -> u64 {
        let split = input.0[1].dim().is_some();
        let parts = if split { self.axes()[1] } else { 1 };
        self.split_dims.insert((heads, Some(label.to_string())));
        if heads.is_multiple_of(parts) {
            return heads / parts;
        }
        if self.first_report(&format!("{:?}/{heads}/{parts}", Some(label))) {
            let mut d = self.divisibility_error(n, heads, Some(label.to_string()), parts);
            d.notes.push(match label {
                "kv_heads" => "grouped-query attention keeps whole key/value heads on each device, with the query \
                               heads that read them"
                    .to_string(),
                _ => "attention keeps whole heads on each device".to_string(),
            });
            self.diagnostics.push(d);
        }
        heads
    }

    /// The query and key/value heads each device holds: query heads [p H/P, (p+1) H/P) and kv heads
    /// [p K/P, (p+1) K/P) on member p of axis 1, which are exactly the kv heads its query heads read.
    fn local_attention_heads(&mut self, n: NodeIndex, heads: Heads, input: Layout) -> Heads {
        let query = self.local_heads(n, heads.query, "heads", input);
        let kv = if heads.kv == heads.query { query } else { self.local_heads(n, heads.kv, "kv_heads", input) };
        Heads { query, kv }
    }

    fn attention(&mut self, n: NodeIndex, ops: &[NodeIndex], heads: Heads, causal: bool, fused: bool) {
        let rank = self.rank(n);
        let width = *self.shapes[ops[0].index()].last().unwrap_or(&0);
        let Some((il, ol)) = self.attention_layouts(width, heads.query, fused, rank) else { return };
        let local = self.local_attention_heads(n, heads, il);
        let inputs: Vec<BufferId> = ops.iter().map(|&o| self.value(o, il)).collect();
        let y = self.node_buffer(n, ol, Role::Workspace);
        self.kernel(
            Kernel::Attention { heads: local.query, kv_heads: local.kv, causal, fused },
            &inputs,
            y,
            compute("attention for this device's batch chunk and head group (no communication)"),
        );
        self.define(n, ol, y);
    }

    fn attention_grad(&mut self, n: NodeIndex, ops: &[NodeIndex], heads: Heads, causal: bool, fused: bool, wrt: u8) {
        let rank = self.rank(ops[0]);
        let width = *self.shapes[ops[1].index()].last().unwrap_or(&0);
        let Some((il, ol)) = self.attention_layouts(width, heads.query, fused, rank) else { return };
        let local = self.local_attention_heads(n, heads, il);
        let mut inputs = vec![self.value(ops[0], ol)];
        for &o in &ops[1..] {
            inputs.push(self.value(o, il));
        }
        let g = self.node_buffer(n, il, Role::Workspace);
        self.kernel(
            Kernel::AttentionGrad { heads: local.query, kv_heads: local.kv, causal, fused, wrt },
            &inputs,
            g,
            compute("backward of attention (local; dk and dv summed over the query heads of each kv head)"),
        );
        self.define(n, il, g);
    }

    /// Attention of a decoding step over its key/value caches, which live on each device in the
    /// attention output's layout with `context` positions: this device's batch rows and kv heads,
    /// every position. The step's keys and values are written into them, then its queries attend
    /// over them; nothing is communicated.
    fn cached_attention(&mut self, n: NodeIndex, ops: &[NodeIndex], heads: Heads, fused: bool, context: u64) {
        let Some((&position, sources)) = ops.split_last() else { return };
        let rank = self.rank(n);
        let width = *self.shapes[sources[0].index()].last().unwrap_or(&0);
        let Some((il, ol)) = self.attention_layouts(width, heads.query, fused, rank) else { return };
        let local = self.local_attention_heads(n, heads, il);
        let inputs: Vec<BufferId> = sources.iter().map(|&o| self.value(o, il)).collect();
        let pos = self.value(position, Layout::REPLICATED);
        let out_shape = self.shapes[n.index()].clone();
        let head = out_shape[rank - 1] / heads.query.max(1);
        let mut cache_shape = out_shape;
        cache_shape[rank - 2] = context;
        cache_shape[rank - 1] = heads.kv * head;
        let (layout, dtype) = (self.with_data(n, ol), self.buffers[inputs[0].0 as usize].dtype);
        let scope = self.graph[n].origin.scope.clone();
        let scope = if scope.is_empty() { format!("%{}", n.index()) } else { scope };
        let mut caches = Vec::new();
        for (k, what, name) in [(1u8, "keys", "k_cache"), (2, "values", "v_cache")] {
            let cache = self.new_buffer(format!("{scope}.{name}"), dtype, cache_shape.clone(), layout, Role::Cache);
            let (source, part, parts) = if fused { (inputs[0], k, 3) } else { (inputs[usize::from(k)], 0, 1) };
            let reason = format!("append this step's {what} to the {what} cache (this device's batch rows and heads)");
            self.kernel(Kernel::CacheWrite { part, parts }, &[source, pos], cache, compute(reason));
            caches.push(cache);
        }
        let y = self.node_buffer(n, ol, Role::Workspace);
        self.kernel(
            Kernel::CachedAttention { heads: local.query, kv_heads: local.kv, fused },
            &[inputs[0], caches[0], caches[1], pos],
            y,
            compute("attention of this step's queries over the cached keys and values (local)"),
        );
        self.define(n, ol, y);
    }

    // ---- rotary position embedding ---------------------------------------------------------------

    /// The layout rotary works in, from x's own: the sequence dimension (second to last) whole, so
    /// that a row's local index along it is its global position, and the last dimension either whole
    /// or split contiguously into whole heads. Anything else is gathered (never a wrong position).
    /// Pending sums pass through: the rotation is linear.
    fn rotary_layout(&mut self, x: NodeIndex, heads: u64) -> Layout {
        let rank = self.rank(x);
        let (seq, last) = (rank - 2, rank - 1);
        let axes = self.axes();
        let mut l = self.natural(x);
        // Splits of the features keep whole heads while all of them together divide the heads (two
        // axes splitting 2 heads 4 ways left each device 0 heads), most significant first.
        let mut parts = 1;
        for axis in MAJOR_ORDER {
            let p = &mut l.0[axis];
            let whole_heads =
                matches!(*p, Placement::Shard { outer: 1, .. }) && heads.is_multiple_of(parts * axes[axis]);
            match p.dim() {
                Some(d) if d == seq => *p = R,
                Some(d) if d == last && !whole_heads => *p = R,
                Some(d) if d == last => parts *= axes[axis],
                _ => {}
            }
        }
        self.norm(l)
    }

    /// Rotary embedding or its backward (`kernel` of the local head count) on one operand: local, no
    /// communication, since every device holds whole sequences and whole heads.
    fn rotary(&mut self, n: NodeIndex, x: NodeIndex, heads: u64, kernel: impl Fn(u64) -> Kernel) {
        let l = self.rotary_layout(x, heads);
        let last = self.rank(x) - 1;
        let parts: u64 = l.0.iter().zip(self.axes()).filter(|(p, _)| p.dim() == Some(last)).map(|(_, a)| a).product();
        let xb = self.value(x, l);
        let y = self.node_buffer(n, l, Role::Workspace);
        let reason = format!("{} of this device's whole sequences and heads (local)", self.graph[n].op.name());
        self.kernel(kernel(heads / parts.max(1)), &[xb], y, compute(reason));
        self.define(n, l, y);
    }

    /// Rotary embedding of a decoding step: positions counted from the step's `position`.
    fn rotary_at(&mut self, n: NodeIndex, (x, position): (NodeIndex, NodeIndex), heads: u64, theta: f64) {
        let l = self.rotary_layout(x, heads);
        let last = self.rank(x) - 1;
        let parts: u64 = l.0.iter().zip(self.axes()).filter(|(p, _)| p.dim() == Some(last)).map(|(_, a)| a).product();
        let xb = self.value(x, l);
        let pos = self.value(position, Layout::REPLICATED);
        let y = self.node_buffer(n, l, Role::Workspace);
        let kernel = Kernel::RotaryAt { heads: heads / parts.max(1), theta };
        self.kernel(
            kernel,
            &[xb, pos],
            y,
            compute("rotary from the step's position, of this device's whole heads (local)"),
        );
        self.define(n, l, y);
    }

    // ---- cross-entropy ---------------------------------------------------------------------------

    /// Layouts of logits and targets (the cross-entropy row): the vocabulary split where the logits'
    /// last dimension is, the batch where it is.
    fn cross_entropy_layouts(&mut self, logits: NodeIndex) -> Option<(Layout, Layout)> {
        let rank = self.rank(logits);
        let facts = Facts { vocab_on_rows: self.vocab_on_rows(logits), ..Facts::default() };
        let case = self.rule_case(Operator::CrossEntropy, &facts)?;
        let dims = self.dims(rank - 1);
        let logits = self.norm(laid(case.operands[0], &dims, Layout::REPLICATED));
        Some((logits, self.norm(laid(case.operands[1], &dims, Layout::REPLICATED))))
    }

    fn vocab_offset(&self, logits: Layout, local_vocab: u64) -> Offset {
        // The vocabulary is the last dimension; whichever axis splits it gives the offset.
        let axis = logits.0.iter().position(|p| matches!(p, Placement::Shard { dim, .. } if *dim != 0));
        match axis {
            Some(a) => Offset { axis: Some(u8::try_from(a).unwrap_or(0)), block: local_vocab },
            None => Offset::ZERO,
        }
    }

    fn cross_entropy(&mut self, n: NodeIndex, logits: NodeIndex, targets: NodeIndex) {
        let stat = |text: &str| Reason::new(ReasonKind::Statistics { of: Statistic::CrossEntropy }, text);
        let rank = self.rank(logits);
        let Some((ll, tl)) = self.cross_entropy_layouts(logits) else { return };
        // With the replicas' batch split, so that the loss and the count are pending sums over them.
        let ll = self.with_data(logits, ll);
        let lb = self.value(logits, ll);
        let tb = self.value(targets, tl);
        let valid = self.graph[logits].ty.shape.last().map_or(0, |d| d.size);
        let local_vocab = *self.buffers[lb.0 as usize].shape.last().unwrap_or(&0);
        let offset = self.vocab_offset(ll, local_vocab);
        let partial = self.rows_partial(ll, rank);
        let max = self.stat_buffer(n, logits, 1, partial, "max");
        self.kernel(
            Kernel::CrossEntropyMax { offset, valid },
            &[lb],
            max,
            stat("cross-entropy: local max over the vocabulary"),
        );
        let (max, _) = self.all_reduce_partials(max, partial, ReduceOp::Max, stat("cross-entropy: max over the row"));
        let stats = self.stat_buffer(n, logits, 2, partial, "stats");
        self.kernel(
            Kernel::CrossEntropyStats { offset, valid },
            &[lb, tb, max],
            stats,
            stat("cross-entropy: target logit and sum of exponentials"),
        );
        let (stats, _) = self.all_reduce_partials(
            stats,
            partial,
            ReduceOp::Sum,
            stat("cross-entropy: target logit and sum of exponentials over the row"),
        );
        let mut loss_layout = Layout::REPLICATED;
        for axis in 0..MESH_AXES {
            if ll.0[axis].dim().is_some_and(|d| d < rank - 1) {
                loss_layout.0[axis] = Placement::Partial;
            }
        }
        let counted = self.count_not_ignored(n, tb, loss_layout);
        let loss = self.node_buffer(n, loss_layout, Role::Workspace);
        self.kernel(
            Kernel::CrossEntropyLoss,
            &[max, stats, tb, counted],
            loss,
            compute("cross-entropy: this batch chunk's share of the mean"),
        );
        self.cross_entropy_stats.insert(logits, (max, stats, counted));
        self.define(n, loss_layout, loss);
    }

    /// The number of targets that are not ignored, over the whole batch: counted locally, then summed
    /// over the mesh axes that hold different batch rows (where the loss is `partial`), so that every
    /// device divides by the same global count.
    fn count_not_ignored(&mut self, n: NodeIndex, targets: BufferId, partial: Layout) -> BufferId {
        let stat = |text: &str| Reason::new(ReasonKind::Statistics { of: Statistic::CrossEntropy }, text);
        let role = if self.forward_end.is_none() { Role::Activation } else { Role::Workspace };
        let name = format!("{}.count", super::describe_node(self.model, &self.graph[n], n));
        let local = self.new_buffer(name, crate::ir::DType::F32, vec![1], partial, role);
        self.kernel(Kernel::CrossEntropyCount, &[targets], local, stat("cross-entropy: targets not ignored (local)"));
        let reason = stat("cross-entropy: targets not ignored over the batch");
        self.all_reduce_partials(local, partial, ReduceOp::Sum, reason).0
    }

    fn cross_entropy_grad(&mut self, n: NodeIndex, ops: &[NodeIndex]) {
        let (logits, targets, dl) = (ops[0], ops[1], ops[2]);
        let Some((ll, tl)) = self.cross_entropy_layouts(logits) else { return };
        let Some(&(max, stats, counted)) = self.cross_entropy_stats.get(&logits) else {
            return self.missing_param(n);
        };
        let lb = self.value(logits, ll);
        let tb = self.value(targets, tl);
        let db = self.value(dl, Layout::REPLICATED);
        let valid = self.graph[logits].ty.shape.last().map_or(0, |d| d.size);
        let local_vocab = *self.buffers[lb.0 as usize].shape.last().unwrap_or(&0);
        let offset = self.vocab_offset(ll, local_vocab);
        let g = self.node_buffer(n, ll, Role::Workspace);
        self.kernel(
            Kernel::CrossEntropyGrad { offset, valid },
            &[lb, tb, max, stats, db, counted],
            g,
            compute("backward of cross-entropy (local)"),
        );
        self.define(n, ll, g);
    }

    // ---- batched matmul, reshape, transpose, select --------------------------------------------

    fn batched_matmul(&mut self, n: NodeIndex, a: NodeIndex, b: NodeIndex) {
        let la = self.local_layout(a, 2, false);
        let lb = la;
        let ab = self.value(a, la);
        let bb = self.value(b, lb);
        let y = self.node_buffer(n, la, Role::Workspace);
        let reason = Reason::new(ReasonKind::LocalProduct, "batched matmul (local)");
        self.kernel(Kernel::BatchedMatMul, &[ab, bb], y, reason);
        self.define(n, la, y);
    }

    fn transpose(&mut self, n: NodeIndex, x: NodeIndex, d0: usize, d1: usize) {
        let l = self.natural(x);
        let out = table::layout_on_dims(l, |d| table::swapped(d, d0, d1));
        let xb = self.value(x, l);
        let y = self.node_buffer(n, out, Role::Workspace);
        let k = Kernel::Transpose { dim0: u8::try_from(d0).unwrap_or(0), dim1: u8::try_from(d1).unwrap_or(0) };
        self.kernel(k, &[xb], y, compute("transpose (local)"));
        self.define(n, out, y);
    }

    fn reshape(&mut self, n: NodeIndex, x: NodeIndex) {
        let natural = self.natural(x);
        let (from, to) = (&self.shapes[x.index()], &self.shapes[n.index()]);
        let (l, out) = super::reshape::reshape_layouts(natural, from, to, self.axes());
        let xb = self.value(x, l);
        let y = self.node_buffer(n, out, Role::Workspace);
        self.kernel(Kernel::Reshape, &[xb], y, compute("reshape (local)"));
        self.define(n, out, y);
    }

    fn select(&mut self, n: NodeIndex, x: NodeIndex, dim: usize, index: u64) {
        let mut l = self.natural(x);
        let mut out = l;
        for axis in 0..MESH_AXES {
            match l.0[axis].dim() {
                Some(d) if d == dim => {
                    l.0[axis] = R;
                    out.0[axis] = R;
                }
                Some(d) if d > dim => out.0[axis] = on_dim(l.0[axis], d - 1),
                _ => {}
            }
        }
        let xb = self.value(x, l);
        let y = self.node_buffer(n, out, Role::Workspace);
        self.kernel(Kernel::Select { dim: u8::try_from(dim).unwrap_or(0), index }, &[xb], y, compute("select (local)"));
        self.define(n, out, y);
    }

    fn select_grad(&mut self, n: NodeIndex, dy: NodeIndex, dim: usize, index: u64) {
        let l = self.natural(dy);
        let mut out = l;
        for axis in 0..MESH_AXES {
            if let Some(d) = l.0[axis].dim().filter(|&d| d >= dim) {
                out.0[axis] = on_dim(l.0[axis], d + 1);
            }
        }
        let dyb = self.value(dy, l);
        let y = self.node_buffer(n, out, Role::Workspace);
        self.kernel(
            Kernel::SelectGrad { dim: u8::try_from(dim).unwrap_or(0), index },
            &[dyb],
            y,
            compute("backward of select (local)"),
        );
        self.define(n, out, y);
    }
}
