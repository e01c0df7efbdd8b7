//! Sharding and lowering: turns the logical graph (forward, plus backward in train mode) into a
//! per-device Plan for a strategy and mesh. Values carry layouts; each operator's rule asks for its
//! operands in the layouts it needs, and the engine inserts the collectives that get them there.

mod data;
use optimus_plan::layout;
mod recompute;
mod reshape;
mod rules;
mod shapes;
pub mod table;

use crate::autodiff::differentiate;
use crate::diag::{Code, Diagnostic};
use crate::ir::{DType, Model, Node, Op, ParamId};
use layout::{COLUMN_AXIS, Layout, MAJOR_ORDER, MESH_AXES, Placement, ROW_AXIS};
use optimus_plan::memory::{insert_frees, plan_memory};
use optimus_plan::span::{LineIndex, Span};
use optimus_plan::{
    Buffer, BufferId, Collective, CollectiveKind, FORMAT_VERSION, Group, Instr, Kernel, Layouts, MemoryOptions, Mesh,
    Mode, OriginInfo, Plan, PlanInput, PlanOutput, PlanParam, Precision, Recompute, ReduceOp, Role, Strategy,
};
use optimus_plan::{Reason, ReasonKind, SummaPart, SummaProduct};
use petgraph::graph::{DiGraph, NodeIndex};
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// What to compile for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    pub mesh: Mesh,
    pub strategy: Strategy,
    pub mode: Mode,
    /// Recomputation and precision.
    pub memory: MemoryOptions,
    /// Whether SUMMA products take the layouts that move least or the paper's.
    pub layouts: Layouts,
}

impl Target {
    /// The batch granularity of the target: every data-parallel replica takes its own share, which
    /// tesseract splits again over its depth layers, and optimus and tesseract over the grid rows (3d
    /// over the rows and one of the other two axes). Above 1 where the mesh splits the batch.
    pub fn batch_multiple(self) -> u64 {
        let rows = match self.strategy {
            Strategy::Optimus | Strategy::Tesseract => self.mesh.rows.max(1),
            Strategy::ThreeD => self.mesh.rows.max(1) * self.mesh.cols.max(1),
            Strategy::Megatron | Strategy::None => 1,
        };
        let depth = if self.strategy == Strategy::Tesseract { self.mesh.depth.max(1) } else { 1 };
        rows * self.mesh.data.max(1) * depth
    }

    /// `strategy` on `mesh` in `mode`, with the default memory options (what the model marks
    /// `checkpoint` recomputed, float32, no ZeRO) and the layouts chosen per product.
    pub const fn plain(mesh: Mesh, strategy: Strategy, mode: Mode) -> Target {
        Target { mesh, strategy, mode, memory: MemoryOptions::DEFAULT, layouts: Layouts::Auto }
    }
}

/// The largest mesh (in devices) that E0602's help considers when it lists meshes that compile.
pub const SUGGESTED_MESH_DEVICES: u64 = 64;

/// Compiles a checked model into a verified plan, or explains why it cannot be sharded so.
pub fn compile(model: &Model, source_name: &str, source: &str, target: Target) -> Result<Plan, Vec<Diagnostic>> {
    compile_with(model, (source_name, source), target, true)
}

/// [`compile`], for searches that compile many targets to cost them and read only the first error:
/// without the meshes that would compile where a dimension does not split (finding them compiles
/// other meshes), and without verifying the plan (a search does not run its plans; the plan it
/// writes is compiled again with [`compile`]).
pub fn compile_quietly(
    model: &Model,
    source_name: &str,
    source: &str,
    target: Target,
) -> Result<Plan, Vec<Diagnostic>> {
    compile_with(model, (source_name, source), target, false)
}

/// `checked`: suggest meshes on a dimension that does not split, and verify the plan.
fn compile_with(
    model: &Model,
    (source_name, source): (&str, &str),
    target: Target,
    checked: bool,
) -> Result<Plan, Vec<Diagnostic>> {
    check_mesh(target)?;
    check_integer_outputs(model)?;
    check_batch_dimensions(model, target)?;
    let graph = LoweringGraph::new(model, target.mode)?;
    let shapes = shapes::padded_shapes(model, &graph.graph, &graph.like, target);
    shapes::check_padded_sizes(model, &graph.graph, &shapes)?;
    let mut lower = Lowerer::new(model, &graph.graph, graph.like.clone(), source, target, shapes);
    lower.run(graph.forward_len, &graph.grads);
    if checked && lower.diagnostics.iter().any(|d| d.code == Code::E0602) {
        let meshes = meshes_that_compile(model, &graph, (source_name, source), target, target.mesh.data);
        // With no mesh of these replicas, the meshes of one replica show what does compile.
        let unreplicated = (meshes.is_empty() && target.mesh.data > 1)
            .then(|| meshes_that_compile(model, &graph, (source_name, source), target, 1));
        let suggested =
            MeshSuggestions { data: target.mesh.data, meshes: &meshes, unreplicated: unreplicated.as_deref() };
        add_mesh_suggestions(&mut lower.diagnostics, target.strategy, suggested);
    }
    lower.finish(source_name, checked)
}

/// The graph the lowering walks: the forward graph (infer), or forward and backward (train).
struct LoweringGraph {
    graph: DiGraph<Node, u8>,
    forward_len: usize,
    /// For each node, the forward node whose shape (and, for parameters, identity) it has.
    like: Vec<Option<NodeIndex>>,
    /// Gradient node of each parameter (train mode).
    grads: Vec<Option<NodeIndex>>,
}

impl LoweringGraph {
    fn new(model: &Model, mode: Mode) -> Result<LoweringGraph, Vec<Diagnostic>> {
        Ok(match mode {
            Mode::Train => {
                let d = differentiate(model).map_err(|e| vec![e])?;
                if let Some(problem) = crate::front::ir_problems(&d.graph, "autodiff") {
                    return Err(vec![problem]);
                }
                LoweringGraph { graph: d.graph, forward_len: d.forward_len, like: d.like, grads: d.param_grads }
            }
            Mode::Infer => {
                let n = model.graph.node_count();
                let like = (0..n).map(|i| Some(NodeIndex::new(i))).collect();
                LoweringGraph { graph: model.graph.clone(), forward_len: n, like, grads: Vec::new() }
            }
        })
    }

    /// A lowerer for `target`, with every node's shape padded for that target.
    fn lowerer<'a>(&'a self, model: &'a Model, source: &'a str, target: Target) -> Lowerer<'a> {
        let shapes = shapes::padded_shapes(model, &self.graph, &self.like, target);
        Lowerer::new(model, &self.graph, self.like.clone(), source, target, shapes)
    }
}

/// The meshes of the strategy with `replicas` data-parallel replicas, up to `SUGGESTED_MESH_DEVICES`
/// devices (but the failing one), on which the model compiles:
/// each candidate goes through the same sharding pass and plan verification as a real compile, so the
/// list needs no second copy of the padding and divisibility rules. Candidates are tried on every core.
fn meshes_that_compile(
    model: &Model,
    graph: &LoweringGraph,
    (source_name, source): (&str, &str),
    failing: Target,
    replicas: u64,
) -> Vec<Mesh> {
    let candidates: Vec<Mesh> = candidate_meshes(failing.strategy)
        .into_iter()
        .map(|m| m.with_data(replicas))
        .filter(|&m| m != failing.mesh)
        .collect();
    let compiles: Vec<AtomicBool> = candidates.iter().map(|_| AtomicBool::new(false)).collect();
    let next = AtomicUsize::new(0);
    let try_candidates = || {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let (Some(&mesh), Some(flag)) = (candidates.get(i), compiles.get(i)) else { break };
            flag.store(compiles_on(model, graph, source_name, source, Target { mesh, ..failing }), Ordering::Relaxed);
        }
    };
    let helpers = std::thread::available_parallelism().map_or(1, usize::from).min(candidates.len()).saturating_sub(1);
    std::thread::scope(|scope| {
        for _ in 0..helpers {
            // A helper that cannot start leaves its candidates to the others and to this thread.
            let _ = std::thread::Builder::new().stack_size(PROBE_STACK_BYTES).spawn_scoped(scope, try_candidates);
        }
        try_candidates();
    });
    candidates.into_iter().zip(compiles).filter(|(_, ok)| ok.load(Ordering::Relaxed)).map(|(m, _)| m).collect()
}

/// Stack for each thread that tries candidate meshes (as deep as the compiler's own worker's needs).
const PROBE_STACK_BYTES: usize = 64 * 1024 * 1024;

/// Every mesh shape the strategy accepts with at most `SUGGESTED_MESH_DEVICES` devices, smallest first
/// (by devices, then grid side).
fn candidate_meshes(strategy: Strategy) -> Vec<Mesh> {
    let bound = SUGGESTED_MESH_DEVICES;
    match strategy {
        Strategy::Optimus => (1..=bound).take_while(|q| q * q <= bound).map(|q| Mesh::new(q, q)).collect(),
        Strategy::Megatron => (1..=bound).map(|p| Mesh::new(1, p)).collect(),
        Strategy::Tesseract => {
            let mut meshes: Vec<Mesh> = (1..=bound)
                .take_while(|q| q * q <= bound)
                .flat_map(|q| (1..=bound / (q * q)).map(move |d| Mesh::new(q, q).with_depth(d)))
                .collect();
            meshes.sort_by_key(|m| (m.devices(), m.rows));
            meshes
        }
        Strategy::ThreeD => {
            (1..=bound).take_while(|q| q * q * q <= bound).map(|q| Mesh::new(q, q).with_depth(q)).collect()
        }
        Strategy::None => vec![Mesh::new(1, 1)],
    }
}

/// Whether the model compiles for `target`: lowering stops at its first error, and a clean lowering
/// must also give a plan that verifies.
fn compiles_on(model: &Model, graph: &LoweringGraph, source_name: &str, source: &str, target: Target) -> bool {
    if check_mesh(target).is_err() {
        return false;
    }
    let mut lower = graph.lowerer(model, source, target);
    lower.stop_at_first_error = true;
    lower.run(graph.forward_len, &graph.grads);
    lower.diagnostics.is_empty() && lower.finish(source_name, true).is_ok()
}

/// The meshes that compile with the failing target's replicas (`data`), and, where none does, those of
/// one replica.
struct MeshSuggestions<'a> {
    data: u64,
    meshes: &'a [Mesh],
    unreplicated: Option<&'a [Mesh]>,
}

/// Lists the meshes that compile in the help of every divisibility error, with the bound searched.
fn add_mesh_suggestions(diagnostics: &mut [Diagnostic], strategy: Strategy, suggested: MeshSuggestions) {
    let listed = |meshes: &[Mesh]| {
        if meshes.is_empty() {
            "none".to_string()
        } else {
            meshes.iter().map(Mesh::to_string).collect::<Vec<_>>().join(", ")
        }
    };
    let replicas = match suggested.data {
        1 => String::new(),
        data => format!(" and {data} data-parallel replicas"),
    };
    let mut help = format!(
        "meshes up to {SUGGESTED_MESH_DEVICES} devices on which this model compiles with the {} strategy{replicas}: {}",
        strategy.name(),
        listed(suggested.meshes)
    );
    if let Some(one) = suggested.unreplicated {
        help.push_str(&format!("; with one replica: {}", listed(one)));
    }
    for d in diagnostics.iter_mut().filter(|d| d.code == Code::E0602) {
        d.help = Some(help.clone());
    }
}

/// On a mesh that splits the batch (over replicas, depth layers, or the grid rows of optimus, tesseract
/// and 3d), the layouts split each input's first dimension as the batch and operators' last dimension
/// as features, classes or the sequence: an input with no dimension, or an operator whose last
/// dimension is an input's only one, has nothing to split as both. And on any mesh of several devices
/// `cross_entropy` takes logits with a dimension besides their classes. Refused here by name, rather
/// than left to a plan that cannot verify.
fn check_batch_dimensions(model: &Model, target: Target) -> Result<(), Vec<Diagnostic>> {
    if target.mesh.devices() == 1 {
        return Ok(());
    }
    let splits_batch = target.batch_multiple() > 1;
    let graph = &model.graph;
    let roles = data::data_roles(graph);
    let mut problems = Vec::new();
    for n in graph.node_indices() {
        let node = &graph[n];
        if let Op::Input { name } = &node.op {
            if splits_batch && node.ty.rank() == 0 && name != crate::decode::POSITION_INPUT {
                problems.push(scalar_input(name, node.origin.span, target.mesh));
            }
            continue;
        }
        let Some(reads) = last_dimension_read_as(&node.op) else { continue };
        let Some(&x) = operands_of(graph, n).first() else { continue };
        let operand = &graph[x].ty;
        let batch_is_last = splits_batch && roles.get(x.index()) == Some(&data::DataRole::Batch(0));
        let logits_alone = node.op == Op::CrossEntropy;
        if operand.rank() == 1 && (batch_is_last || logits_alone) {
            problems.push(one_dimension_read_twice(operand, (reads, node.origin.span), target.mesh));
        }
    }
    if replicas_split_the_batch(target) {
        problems.extend(batch_mixing(model, &roles, target.mesh));
    }
    if problems.is_empty() { Ok(()) } else { Err(problems) }
}

/// Outputs of integers (token ids, or a reshape of them): the runtimes return floating-point outputs
/// only, so such a plan could not run. Refused by name, as E0107 (a value of the wrong kind).
fn check_integer_outputs(model: &Model) -> Result<(), Vec<Diagnostic>> {
    let problems: Vec<Diagnostic> = model
        .outputs
        .iter()
        .filter(|o| model.graph[o.node].ty.dtype.is_integer())
        .map(|o| {
            Diagnostic::error(Code::E0107, format!("output `{}` is an integer tensor", o.name))
                .primary(o.span, format!("this is {}", crate::elab::show_type(&model.graph[o.node].ty)))
                .help("outputs are floating-point tensors computed from the inputs; token ids are data, not a result")
        })
        .collect();
    if problems.is_empty() { Ok(()) } else { Err(problems) }
}

/// Whether mesh axes that hold whole weights split the batch: data-parallel replicas, or Tesseract's
/// depth layers. Each such device computes its own sequences alone, so no operator may mix them.
fn replicas_split_the_batch(target: Target) -> bool {
    target.mesh.data > 1 || (target.strategy == Strategy::Tesseract && target.mesh.depth > 1)
}

/// Operators that would mix the sequences of a batch the replicas split: one that reads the batch
/// dimension as its features, classes or sequence (a linear over the batch, attention over it), or
/// whose operands carry the batch in different dimensions (logits transposed against their targets).
/// Each replica holds its own sequences: such an operator needs the others'. Refused by name, where the
/// plan would otherwise fail its own verification.
fn batch_mixing(model: &Model, roles: &[data::DataRole], mesh: Mesh) -> Vec<Diagnostic> {
    let graph = &model.graph;
    let mut problems = Vec::new();
    for n in graph.node_indices() {
        let node = &graph[n];
        let mut batch_dims = Vec::new();
        for (k, x) in operands_of(graph, n).into_iter().enumerate() {
            let Some(&data::DataRole::Batch(d)) = roles.get(x.index()) else { continue };
            batch_dims.push(d);
            let rank = graph[x].ty.rank();
            if read_whole(&node.op, k, rank).contains(&d) {
                problems.push(
                    Diagnostic::error(
                        Code::E0602,
                        format!(
                            "on a {mesh} mesh, `{}` {} the batch dimension (dimension {d} of {}), and each replica \
                             holds only its own sequences",
                            node.op.name(),
                            if matches!(node.op, Op::Select { .. }) { "picks one index of" } else { "reads whole" },
                            crate::elab::show_type(&graph[x].ty)
                        ),
                    )
                    .primary(node.origin.span, "mixes the sequences of the batch")
                    .help("transpose the batch back to the first dimension first, or use a mesh without replicas"),
                );
                break;
            }
        }
        if let Some((&first, rest)) = batch_dims.split_first()
            && let Some(&other) = rest.iter().find(|&&d| d != first)
        {
            problems.push(
                Diagnostic::error(
                    Code::E0602,
                    format!(
                        "on a {mesh} mesh, the operands of `{}` carry the batch in different dimensions ({first} and \
                         {other}), and each replica holds only its own sequences",
                        node.op.name()
                    ),
                )
                .primary(node.origin.span, "pairs sequences of the batch with positions of another dimension")
                .help("transpose the operands so that the batch is the same dimension of each, or use a mesh without replicas"),
            );
        }
    }
    problems.dedup_by(|a, b| a.message == b.message && a.labels == b.labels);
    problems
}

/// The dimensions of operand `k` (of rank `rank`) that operator `op` reads whole, computing each
/// element of its result from all of them: a linear's, a norm's or a softmax's features, logits'
/// classes, attention's and rotary's positions and features, a product's inner dimension; and the
/// dimension a `select` picks one index of.
fn read_whole(op: &Op, k: usize, rank: usize) -> Vec<usize> {
    let last = rank.saturating_sub(1);
    let before_last = rank.saturating_sub(2);
    match op {
        Op::Linear { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::Softmax | Op::CrossEntropy if k == 0 => {
            vec![last]
        }
        Op::Attention { .. } | Op::Rotary { .. } | Op::CausalMask if rank >= 2 => vec![before_last, last],
        // Selecting one index of the batch picks sequences other replicas hold.
        Op::Select { dim, .. } if k == 0 => vec![*dim],
        Op::MatMul if k == 0 => vec![last],
        Op::MatMul if k == 1 && rank >= 2 => vec![before_last],
        _ => Vec::new(),
    }
}

/// An input with no dimension, on a mesh that splits the batch.
fn scalar_input(name: &str, span: Span, mesh: Mesh) -> Diagnostic {
    Diagnostic::error(Code::E0602, format!("input `{name}` has no dimension for a {mesh} mesh to split as the batch"))
        .primary(span, "a scalar")
        .help("give it a batch dimension, e.g. `i32[batch]`, or compile for one device (--mesh 1x1)")
}

/// An operator reading as `reads` the only dimension of `operand`, which the mesh also splits as the
/// batch (or, for logits, splits as the classes with nothing left for the rows).
fn one_dimension_read_twice(operand: &crate::ir::TensorType, (reads, span): (&str, Span), mesh: Mesh) -> Diagnostic {
    Diagnostic::error(
        Code::E0602,
        format!(
            "on a {mesh} mesh, {} needs a batch dimension besides the {reads} this operator reads",
            crate::elab::show_type(operand)
        ),
    )
    .primary(span, format!("reads its only dimension as the {reads}"))
    .help("give the model's inputs a leading batch dimension (`f32[batch, 8]`), or compile for one device (--mesh 1x1)")
}

/// What an operator reads its first operand's last dimension as, for those that read it as one thing
/// across the whole dimension.
fn last_dimension_read_as(op: &Op) -> Option<&'static str> {
    match op {
        Op::Linear { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } => Some("features"),
        Op::CrossEntropy | Op::Softmax => Some("classes"),
        Op::PositionEmbedding | Op::PositionEmbeddingAt => Some("sequence"),
        _ => None,
    }
}

/// Rejects meshes the strategy cannot use.
fn check_mesh(target: Target) -> Result<(), Vec<Diagnostic>> {
    let problem = target.strategy.mesh_problem(target.mesh).or_else(|| {
        (target.memory.zero > 1).then(|| format!("ZeRO stage {} is not supported (0 or 1)", target.memory.zero))
    });
    match problem {
        Some(p) => Err(vec![Diagnostic::error(Code::E0601, p).help(match target.strategy {
            Strategy::Optimus => "use --mesh QxQ, e.g. --mesh 4x4, or DxQxQ for D data-parallel replicas",
            Strategy::Megatron => "use --mesh 1xP, e.g. --mesh 1x8, or Dx1xP for D data-parallel replicas",
            Strategy::Tesseract => {
                "use --mesh DxQxQ (D depth layers of a q x q grid), e.g. --mesh 2x2x2, or RxDxQxQ for R data-parallel replicas"
            }
            Strategy::ThreeD => "use --mesh QxQxQ, e.g. --mesh 2x2x2, or RxQxQxQ for R data-parallel replicas",
            Strategy::None => "use --mesh 1x1, Dx1x1 for D data-parallel replicas, or another strategy",
        })]),
        None => Ok(()),
    }
}

/// A sharded version of a logical value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Version {
    pub layout: Layout,
    pub buffer: BufferId,
}

/// The lowering state.
pub(crate) struct Lowerer<'a> {
    pub model: &'a Model,
    pub graph: &'a DiGraph<Node, u8>,
    /// For each backward node, the forward node whose shape (and, for parameters, identity) it has.
    pub like: Vec<Option<NodeIndex>>,
    lines: LineIndex<'a>,
    pub target: Target,
    /// Padded logical shape of every node.
    pub shapes: Vec<Vec<u64>>,
    pub buffers: Vec<Buffer>,
    pub program: Vec<Instr>,
    pub origins: Vec<OriginInfo>,
    /// Origins already recorded, by node.
    origin_ids: HashMap<NodeIndex, u32>,
    pub reasons: Vec<Reason>,
    reason_ids: HashMap<Reason, u32>,
    /// SUMMA step reasons by what the product computes, then by step.
    summa_reasons: HashMap<String, HashMap<SummaStepKey, u32>>,
    /// Every sharded version made of each node, in the order they were made.
    pub versions: HashMap<NodeIndex, Vec<Version>>,
    pub param_buffers: HashMap<ParamId, Version>,
    /// Statistics saved by a forward operator for its backward, keyed by the forward operand.
    pub layernorm_stats: HashMap<NodeIndex, (BufferId, BufferId)>,
    /// RMSNorm's all-reduced row sums of squares, keyed by the forward operand.
    pub rms_norm_stats: HashMap<NodeIndex, BufferId>,
    pub cross_entropy_stats: HashMap<NodeIndex, (BufferId, BufferId, BufferId)>,
    /// The node being lowered, for origins.
    pub current: NodeIndex,
    pub forward_end: Option<usize>,
    /// The buffer holding the squared global gradient norm (train plans).
    grad_norm: Option<BufferId>,
    /// The block instances `--recompute layers` recomputes (see `recompute`).
    recompute_units: Vec<String>,
    pub diagnostics: Vec<Diagnostic>,
    reported_dims: HashSet<String>,
    /// (size, label) of every dimension split across a mesh axis.
    pub split_dims: BTreeSet<(u64, Option<String>)>,
    /// Stop at the first error of any kind (when only whether the target compiles matters).
    stop_at_first_error: bool,
    pub inputs: Vec<PlanInput>,
    pub plan_params: Vec<PlanParam>,
    pub outputs: Vec<PlanOutput>,
    /// Every node's relation to the data-parallel axis (see `data.rs`).
    data_roles: Vec<data::DataRole>,
    /// Whether layouts asked for get their data-axis placement from the node's role (while the rules
    /// run; not for outputs and the optimizer, which ask for exactly what they want).
    filling_data: bool,
    /// Nodes lowered ahead of their turn, with a sibling that shares their SUMMA broadcasts.
    lowered_early: HashSet<NodeIndex>,
    /// Gradients left for a later node's turn: weight gradients waiting for a sibling's, to share its
    /// input's broadcasts; input gradients waiting for the sum that alone reads them, to share a reduce.
    deferred: HashSet<NodeIndex>,
    /// The parameter whose complete gradient each gradient node is.
    gradient_of: HashMap<NodeIndex, ParamId>,
    /// Gradients complete but not yet reduced over the replicas, and their bytes.
    open_bucket: Vec<(NodeIndex, ParamId)>,
    open_bucket_bytes: u64,
    /// The bucket whose reductions are being issued, for their reasons.
    bucket: Option<u32>,
    buckets_issued: u32,
}

impl<'a> Lowerer<'a> {
    fn new(
        model: &'a Model,
        graph: &'a DiGraph<Node, u8>,
        like: Vec<Option<NodeIndex>>,
        source: &'a str,
        target: Target,
        shapes: Vec<Vec<u64>>,
    ) -> Self {
        Lowerer {
            model,
            graph,
            like,
            lines: LineIndex::new(source),
            target,
            shapes,
            buffers: Vec::new(),
            program: Vec::new(),
            origins: Vec::new(),
            origin_ids: HashMap::default(),
            reasons: Vec::new(),
            reason_ids: HashMap::default(),
            summa_reasons: HashMap::default(),
            versions: HashMap::default(),
            param_buffers: HashMap::default(),
            layernorm_stats: HashMap::default(),
            rms_norm_stats: HashMap::default(),
            cross_entropy_stats: HashMap::default(),
            current: NodeIndex::new(0),
            forward_end: None,
            grad_norm: None,
            recompute_units: Vec::new(),
            diagnostics: Vec::new(),
            reported_dims: HashSet::default(),
            split_dims: BTreeSet::new(),
            stop_at_first_error: false,
            data_roles: data::data_roles(graph),
            filling_data: false,
            lowered_early: HashSet::default(),
            deferred: HashSet::default(),
            gradient_of: HashMap::default(),
            open_bucket: Vec::new(),
            open_bucket_bytes: 0,
            bucket: None,
            buckets_issued: 0,
            inputs: Vec::new(),
            plan_params: Vec::new(),
            outputs: Vec::new(),
        }
    }

    pub fn axes(&self) -> [u64; MESH_AXES] {
        self.target.mesh.axes()
    }

    /// Canonicalises a layout for this mesh: on an axis of size 1 everything is replicated.
    pub fn norm(&self, layout: Layout) -> Layout {
        let axes = self.axes();
        let mut l = layout;
        for (p, size) in l.0.iter_mut().zip(axes) {
            if size == 1 {
                *p = Placement::Replicate;
            }
        }
        l
    }

    fn run(&mut self, forward_len: usize, grads: &[Option<NodeIndex>]) {
        self.gradient_of = grads
            .iter()
            .enumerate()
            .filter_map(|(index, g)| g.map(|g| (g, ParamId(u32::try_from(index).unwrap_or(u32::MAX)))))
            .collect();
        self.filling_data = true;
        for index in 0..self.graph.node_count() {
            let n = NodeIndex::new(index);
            if index == forward_len && self.forward_end.is_none() {
                self.forward_end = Some(self.program.len());
            }
            self.current = n;
            // Keep going past dimensions that do not divide, to report them all and learn every split
            // size; stop at anything else.
            let stop = self.stop_at_first_error && !self.diagnostics.is_empty();
            if stop || self.diagnostics.iter().any(|d| d.code != Code::E0602) {
                return;
            }
            if !self.lowered_early.contains(&n) {
                self.lower_node(n);
            }
            if !self.deferred.contains(&n) {
                self.gradient_done(n);
            }
        }
        self.filling_data = false;
        if self.stop_at_first_error && !self.diagnostics.is_empty() {
            return;
        }
        if self.target.mode == Mode::Train {
            self.forward_end.get_or_insert(self.program.len());
        }
        // Outputs before the updates: the runtime checks the loss before any weight changes.
        self.collect_outputs();
        if self.target.mode == Mode::Train {
            self.optimizer(grads);
        }
    }

    /// Records the model outputs, replicated where they were still pending sums.
    fn collect_outputs(&mut self) {
        for output in &self.model.outputs {
            let first = self.versions.get(&output.node).and_then(|v| v.first()).map(|v| v.layout);
            // An input output unchanged (`output y = x`) has no version until something reads it: it is
            // read here, in the layout its data takes.
            let is_input = matches!(self.graph[output.node].op, Op::Input { .. });
            let Some(mut wanted) = first.or(is_input.then_some(Layout::REPLICATED)) else { continue };
            for p in &mut wanted.0 {
                if *p == Placement::Partial {
                    *p = Placement::Replicate;
                }
            }
            self.current = output.node;
            let buffer = self.value(output.node, wanted);
            let model_shape = self.graph[output.node].ty.sizes();
            let padded = self.buffers[buffer.0 as usize].logical_shape != model_shape;
            self.outputs.push(PlanOutput {
                name: output.name.clone(),
                buffer,
                is_loss: self.model.loss == Some(output.node),
                unpadded: padded.then_some(model_shape),
            });
        }
    }

    /// Gradients in the parameters' layouts (summed over the devices that share them), then the squared
    /// global gradient norm (for clipping and the records), then one optimizer step per parameter. The
    /// updates come after every gradient is complete, since clipping scales all of them by one factor.
    fn optimizer(&mut self, grads: &[Option<NodeIndex>]) {
        self.reduce_open_bucket();
        let mut updates = Vec::new();
        for (index, grad) in grads.iter().enumerate() {
            let id = ParamId(u32::try_from(index).unwrap_or(u32::MAX));
            let (Some(grad), Some(param)) = (grad, self.param_buffers.get(&id).copied()) else { continue };
            self.current = *grad;
            let g = self.value(*grad, param.layout);
            let name = format!("{}.grad", self.model.params[index].name);
            let g = self.gradient_buffer(g, param.buffer, name);
            updates.push((param.buffer, g));
        }
        if let Some(loss) = self.model.loss {
            self.current = loss;
        }
        let grad_buffers: Vec<BufferId> = updates.iter().map(|&(_, g)| g).collect();
        self.grad_norm = self.grad_norm_squared(&grad_buffers);
        for (param, g) in updates {
            let m = self.state_buffer(param, "exp_avg");
            let v = self.state_buffer(param, "exp_avg_sq");
            let reason = Reason::new(ReasonKind::Optimizer, "optimizer step on this device's shard");
            self.kernel(Kernel::OptimizerStep, &[param, g, m, v], param, reason);
            if let Some(p) = self.plan_params.iter_mut().find(|p| p.buffer == param) {
                p.grad = Some(g);
                p.state = vec![m, v];
            }
        }
    }

    /// The squared L2 norm of all gradients over the whole mesh: each device sums the squares of the
    /// elements it alone is responsible for (a block replicated along a mesh axis counts only on that
    /// axis's first member), then one all-reduce over every device adds the partial sums. Returns the
    /// buffer that holds the total on every device.
    fn grad_norm_squared(&mut self, grads: &[BufferId]) -> Option<BufferId> {
        if grads.is_empty() {
            return None;
        }
        let partial = Layout([Placement::Partial; MESH_AXES]);
        let name = "grad_norm_sq".to_string();
        let local = self.new_buffer(format!("{name}.partial"), DType::F32, vec![1], partial, Role::Workspace);
        self.kernel(
            Kernel::GradSquareSum,
            grads,
            local,
            Reason::new(
                ReasonKind::GradientNorm,
                "gradient norm: sum of squares of the gradient elements this device owns (replicas counted once)",
            ),
        );
        if self.target.mesh.devices() < 2 {
            return Some(local);
        }
        let total = self.new_buffer(name, DType::F32, vec![1], Layout::REPLICATED, Role::Workspace);
        self.collective(
            CollectiveKind::AllReduce,
            Group::World,
            None,
            Some(ReduceOp::Sum),
            None,
            local,
            total,
            Reason::new(ReasonKind::GradientNorm, "gradient norm: one all-reduce of every device's sum of squares"),
        );
        Some(total)
    }

    /// The buffer the optimizer reads a parameter's gradient from: the gradient value itself when it
    /// has the parameter's element type, else a cast of it into a new buffer of that type (a bf16
    /// gradient into the float32 buffer beside its float32 master weight).
    fn gradient_buffer(&mut self, g: BufferId, param: BufferId, name: String) -> BufferId {
        let (have, want) = (self.buffers[g.0 as usize].dtype, self.buffers[param.0 as usize].dtype);
        if have == want {
            self.buffers[g.0 as usize].role = Role::Gradient;
            self.buffers[g.0 as usize].name = name;
            return g;
        }
        let b = self.buffers[g.0 as usize].clone();
        let out = self.new_buffer(name, want, b.logical_shape, b.layout, Role::Gradient);
        let reason = Reason::new(ReasonKind::Cast, "gradient from bf16 into the float32 gradient buffer");
        self.kernel(Kernel::Cast, &[g], out, reason);
        out
    }

    fn state_buffer(&mut self, like: BufferId, what: &str) -> BufferId {
        let b = self.buffers[like.0 as usize].clone();
        let name = format!("{}.{what}", b.name);
        self.new_buffer(name, b.dtype, b.logical_shape, b.layout, Role::OptimizerState)
    }

    /// The plan, verified when `verify` says so.
    fn finish(mut self, source_name: &str, verify: bool) -> Result<Plan, Vec<Diagnostic>> {
        if !self.diagnostics.is_empty() {
            return Err(self.diagnostics);
        }
        let forward_end = self.forward_end.unwrap_or(self.program.len());
        let recompute = if self.target.mode == Mode::Train { self.recompute_mode() } else { Recompute::None };
        self.recompute_for_backward(recompute, forward_end);
        let keep: std::collections::HashSet<BufferId> = self
            .outputs
            .iter()
            .map(|o| o.buffer)
            .chain(self.plan_params.iter().filter_map(|p| p.grad))
            .chain(self.grad_norm)
            .collect();
        let program = std::mem::take(&mut self.program);
        let (program, forward_end) = insert_frees(program, &self.buffers, &keep, forward_end);
        let memory = plan_memory(&program, &self.buffers, forward_end);
        let plan = Plan {
            format_version: FORMAT_VERSION,
            model: self.model.name.clone(),
            source: source_name.to_string(),
            mesh: self.target.mesh,
            strategy: self.target.strategy,
            mode: self.target.mode,
            config: self.model.config.iter().map(|c| (c.name.clone(), c.value.clone())).collect(),
            padding: shapes::paddings(self.model, &self.shapes, self.graph),
            params: self.plan_params,
            inputs: self.inputs,
            outputs: self.outputs,
            buffers: self.buffers,
            program,
            origins: self.origins,
            reasons: self.reasons,
            memory,
            checkpoint_prefix: self.model.checkpoint_prefix.clone(),
            grad_norm: self.grad_norm,
            recompute,
            precision: self.target.memory.precision,
            zero: self.target.memory.zero,
            overlap: false,
            layouts: self.target.layouts,
        };
        if !verify {
            return Ok(plan);
        }
        optimus_plan::verify::verify(&plan).map_err(|mut errors| {
            // One problem found twice (by two checks of one instruction) is reported once.
            errors.dedup();
            errors
                .into_iter()
                .map(|e| Diagnostic::error(Code::E0699, format!("internal error: the plan failed verification: {e}")))
                .collect::<Vec<_>>()
        })?;
        Ok(plan)
    }

    // ---- buffers, instructions and origins --------------------------------------------------

    pub fn new_buffer(
        &mut self,
        name: String,
        dtype: DType,
        logical: Vec<u64>,
        layout: Layout,
        role: Role,
    ) -> BufferId {
        let layout = self.norm(layout);
        let shape = layout.local_shape(&logical, self.axes());
        let id = BufferId(u32::try_from(self.buffers.len()).unwrap_or(u32::MAX));
        self.buffers.push(Buffer { id, name, dtype, logical_shape: logical, layout, shape, role });
        id
    }

    /// A buffer for node `n` (or a statistic of it) in `layout`; checks that every split dimension divides.
    pub fn node_buffer(&mut self, n: NodeIndex, layout: Layout, role: Role) -> BufferId {
        let layout = self.norm(self.with_data(n, layout));
        self.check_divisible(n, layout);
        let node = &self.graph[n];
        let name = describe_node(self.model, node, n);
        let dtype = self.compute_dtype(n);
        let role = if role == Role::Workspace && self.forward_end.is_none() { Role::Activation } else { role };
        self.new_buffer(name, dtype, self.shapes[n.index()].clone(), layout, role)
    }

    /// The element type node `n` is computed in. In bf16 plans every floating-point value is bf16 but
    /// the float32 master weights, the inputs, the loss and the loss's seed gradient (the statistics of
    /// LayerNorm and cross-entropy get float32 buffers of their own in the rules).
    fn compute_dtype(&self, n: NodeIndex) -> DType {
        let node = &self.graph[n];
        let stays_f32 = matches!(node.op, Op::Param { .. } | Op::Input { .. } | Op::CrossEntropy | Op::Fill { .. });
        if self.target.memory.precision == Precision::Bf16 && node.ty.dtype == DType::F32 && !stays_f32 {
            DType::Bf16
        } else {
            node.ty.dtype
        }
    }

    /// A buffer for node `n` in `layout` with the element type of `like` (a value moved between
    /// layouts keeps its type: a bf16 weight copy is communicated in bf16).
    fn moved_buffer(&mut self, n: NodeIndex, layout: Layout, like: BufferId) -> BufferId {
        let id = self.node_buffer(n, layout, Role::Workspace);
        self.buffers[id.0 as usize].dtype = self.buffers[like.0 as usize].dtype;
        id
    }

    /// Reports a split dimension that does not divide its mesh axis, at the config line that sized it.
    fn check_divisible(&mut self, n: NodeIndex, layout: Layout) {
        let axes = self.axes();
        for (axis, p) in layout.0.iter().enumerate() {
            let Placement::Shard { dim, outer, inner } = *p else { continue };
            let dim = dim as usize;
            let Some(&size) = self.shapes[n.index()].get(dim) else { continue };
            let logical_dim = self.graph[n].ty.shape.get(dim);
            let (split_size, label) = split_factor(logical_dim, size, outer, inner);
            self.split_dims.insert((split_size, label.clone()));
            // Plain splits of the same dimension by other axes nest: the parts multiply.
            let parts: u64 = layout
                .0
                .iter()
                .enumerate()
                .filter(|&(a, q)| a == axis || (outer == 1 && inner == 1 && *q == Placement::shard(dim)))
                .map(|(a, _)| axes[a].max(1))
                .product();
            if split_size % parts == 0 {
                continue;
            }
            // A size already reported under its config name is not reported again unnamed.
            let unnamed = self.first_report(&format!("size/{split_size}/{parts}"));
            let named = self.first_report(&format!("{:?}/{split_size}/{parts}", label.as_deref()));
            if named && (unnamed || label.is_some()) {
                let d = self.divisibility_error(n, split_size, label, parts);
                self.diagnostics.push(d);
            }
        }
    }

    /// Whether a divisibility problem (keyed by name, size and parts) is reported for the first time.
    pub fn first_report(&mut self, key: &str) -> bool {
        self.reported_dims.insert(key.to_string())
    }

    pub(crate) fn divisibility_error(&self, n: NodeIndex, size: u64, label: Option<String>, parts: u64) -> Diagnostic {
        let what = label.clone().map_or_else(|| format!("a dimension of size {size}"), |l| format!("`{l}` ({size})"));
        let mesh = self.target.mesh;
        let mut d = Diagnostic::error(
            Code::E0602,
            format!(
                "{what} cannot be split {parts} ways on a {mesh} mesh with the {} strategy",
                self.target.strategy.name()
            ),
        );
        let config = label.as_ref().and_then(|l| self.model.config.iter().find(|c| &c.name == l));
        match config {
            Some(c) => {
                d = d.primary(c.span, format!("{size} is not a multiple of {parts}"));
                d = d.secondary(self.graph[n].origin.span, "split here");
                if c.overridden {
                    d = d.note(format!("`{}` is {} from `--set {}={}`", c.name, c.value, c.name, c.value));
                }
            }
            None => d = d.primary(self.graph[n].origin.span, format!("{size} is not a multiple of {parts}")),
        }
        d
    }

    /// The origin of the node being lowered, recorded once per node.
    fn origin(&mut self) -> u32 {
        if let Some(&id) = self.origin_ids.get(&self.current) {
            return id;
        }
        let node = &self.graph[self.current];
        let span: Span = node.origin.span;
        let (line, col) = self.lines.line_col(span.start as usize);
        let info = OriginInfo {
            span,
            line: u32::try_from(line).unwrap_or(u32::MAX),
            col: u32::try_from(col).unwrap_or(u32::MAX),
            scope: node.origin.scope.clone(),
        };
        let id = u32::try_from(self.origins.len()).unwrap_or(u32::MAX);
        self.origins.push(info);
        self.origin_ids.insert(self.current, id);
        id
    }

    /// The index of a reason in the interned table.
    fn reason(&mut self, reason: Reason) -> u32 {
        if let Some(&id) = self.reason_ids.get(&reason) {
            return id;
        }
        let id = u32::try_from(self.reasons.len()).unwrap_or(u32::MAX);
        self.reasons.push(reason.clone());
        self.reason_ids.insert(reason, id);
        id
    }

    /// The interned reason of SUMMA step `step` of `steps`, part `part`, of a `product` computing
    /// `what`: formatted once per distinct step (a large model repeats the same steps layer after layer).
    pub fn summa_reason(&mut self, what: &str, product: SummaProduct, step: u64, steps: u64, part: SummaPart) -> u32 {
        let key = (product, step, steps, part);
        if let Some(&id) = self.summa_reasons.get(what).and_then(|ids| ids.get(&key)) {
            return id;
        }
        let id = self.reason(Reason::summa_step(what, product, step, steps, part));
        self.summa_reasons.entry(what.to_string()).or_default().insert(key, id);
        id
    }

    /// The id of a reason given whole or already interned.
    fn reason_id(&mut self, reason: impl Into<Because>) -> u32 {
        match reason.into() {
            Because::Reason(reason) => self.reason(reason),
            Because::Interned(id) => id,
        }
    }

    pub fn kernel(&mut self, kernel: Kernel, inputs: &[BufferId], output: BufferId, reason: impl Into<Because>) {
        let (origin, reason) = (self.origin(), self.reason_id(reason));
        self.program.push(Instr::Kernel { kernel, inputs: inputs.to_vec(), output, origin, reason });
    }

    #[allow(clippy::too_many_arguments)]
    pub fn collective(
        &mut self,
        kind: CollectiveKind,
        group: Group,
        root: Option<u64>,
        op: Option<ReduceOp>,
        shard: Option<Placement>,
        send: BufferId,
        recv: BufferId,
        reason: impl Into<Because>,
    ) {
        let (origin, reason) = (self.origin(), self.reason_id(reason));
        let collective = Collective { kind, group, root, op, shard, send, recv, overlapped: false };
        self.program.push(Instr::Collective { collective, origin, reason });
    }

    // ---- values and redistribution ----------------------------------------------------------

    /// Records that node `n` is available in `layout` in `buffer`.
    pub fn define(&mut self, n: NodeIndex, layout: Layout, buffer: BufferId) {
        let layout = self.norm(self.with_data(n, layout));
        self.versions.entry(n).or_default().push(Version { layout, buffer });
    }

    /// The layout node `n` was first produced in (its natural layout).
    pub fn natural(&mut self, n: NodeIndex) -> Layout {
        if let Some(v) = self.versions.get(&n).and_then(|v| v.first()) {
            return v.layout;
        }
        Layout::REPLICATED
    }

    /// A version of `n` without pending sums if one exists already, else its natural layout: an operator
    /// that accepts any layout then reuses a sum another consumer has paid for.
    pub fn settled(&mut self, n: NodeIndex) -> Layout {
        let complete = self.versions.get(&n).and_then(|vs| vs.iter().find(|v| !v.layout.has_partial()));
        match complete {
            Some(v) => v.layout,
            None => self.natural(n),
        }
    }

    /// Node `n` in `layout`, redistributing (and caching) if it is not there yet.
    pub fn value(&mut self, n: NodeIndex, layout: Layout) -> BufferId {
        let layout = self.norm(self.with_data(n, layout));
        if let Some(v) = self.versions.get(&n).and_then(|vs| vs.iter().find(|v| v.layout == layout)) {
            return v.buffer;
        }
        let source = self.versions.get(&n).and_then(|vs| vs.first()).copied();
        let Some(source) = source.filter(|_| !self.is_integer_input(n)) else {
            // An integer input (token ids) is read from the data again in each layout it is used in: the
            // runtimes communicate floating-point buffers only, and a second read costs no communication.
            return self.materialise_leaf(n, layout);
        };
        // Collectives that move a value are traced to the line that produced it.
        let consumer = std::mem::replace(&mut self.current, n);
        if let Some(buffer) = self.rederived_integers(n, layout) {
            self.current = consumer;
            return buffer;
        }
        let buffer = self.redistribute(n, source, layout);
        self.current = consumer;
        self.define(n, layout, buffer);
        buffer
    }

    /// Node `n` (a parameter the forward pass already read in `layout`) made in `layout` again from the
    /// version it was first made in, without keeping the result for later uses: a tied table laid
    /// across the mesh is transposed again for the backward pass (one block each way), rather than
    /// held twice from the forward pass to the backward.
    pub fn value_afresh(&mut self, n: NodeIndex, layout: Layout) -> BufferId {
        let layout = self.norm(self.with_data(n, layout));
        let Some(source) = self.versions.get(&n).and_then(|vs| vs.first()).copied() else {
            return self.value(n, layout);
        };
        if source.layout == layout {
            return source.buffer;
        }
        // Traced to the consumer, whose pipeline stage needs it (the head's, not the lookup's).
        self.redistribute(n, source, layout)
    }

    /// Node `n`, an integer value that an input's ids were transposed, selected or reshaped into, made
    /// in `layout` anew from its operand in the layout that gives it (the input read again in that one):
    /// the runtimes communicate floating-point buffers only, and the operation is local. `None` where
    /// `n` is no such value, or no operand layout gives `layout` (then it is moved as any value is).
    fn rederived_integers(&mut self, n: NodeIndex, layout: Layout) -> Option<BufferId> {
        if !self.graph[n].ty.dtype.is_integer() {
            return None;
        }
        let [operand] = self.operands(n)[..] else { return None };
        let (kernel, wanted) = match self.graph[n].op {
            Op::Transpose { dim0, dim1 } => {
                let kernel = Kernel::Transpose { dim0: u8::try_from(dim0).ok()?, dim1: u8::try_from(dim1).ok()? };
                (kernel, table::layout_on_dims(layout, |d| table::swapped(d, dim0, dim1)))
            }
            Op::Select { dim, index } => {
                let shift = |d: usize| if d >= dim { d + 1 } else { d };
                (Kernel::Select { dim: u8::try_from(dim).ok()?, index }, table::layout_on_dims(layout, shift))
            }
            Op::Reshape => {
                let (from, to) = (&self.shapes[n.index()], &self.shapes[operand.index()]);
                let (kept, back) = reshape::reshape_layouts(layout, from, to, self.axes());
                let forth = reshape::reshape_layouts(back, to, from, self.axes());
                if kept != layout || forth != (back, layout) {
                    return None;
                }
                (Kernel::Reshape, back)
            }
            _ => return None,
        };
        let from = self.value(operand, wanted);
        let buffer = self.node_buffer(n, layout, Role::Workspace);
        let reason = Reason::new(
            ReasonKind::Compute,
            format!("{} of token ids, again in another layout", self.graph[n].op.name()),
        );
        self.kernel(kernel, &[from], buffer, reason);
        self.define(n, layout, buffer);
        Some(buffer)
    }

    /// Whether node `n` is a model input of an integer type (token ids, targets, segments).
    fn is_integer_input(&self, n: NodeIndex) -> bool {
        matches!(self.graph[n].op, Op::Input { .. }) && self.graph[n].ty.dtype.is_integer()
    }

    /// Creates the buffer of a parameter or input the first time it is asked for (an integer input:
    /// each time it is asked for in a new layout).
    fn materialise_leaf(&mut self, n: NodeIndex, layout: Layout) -> BufferId {
        match self.graph[n].op.clone() {
            Op::Param { id } => {
                let stored = self.norm(self.parameter_layout(n, layout));
                let buffer = self.node_buffer(n, stored, Role::Parameter);
                let p = &self.model.params[id.0 as usize];
                self.buffers[buffer.0 as usize].name = p.name.clone();
                self.param_buffers.insert(id, Version { layout: stored, buffer });
                self.plan_params.push(PlanParam {
                    name: p.name.clone(),
                    checkpoint: p.checkpoint.clone(),
                    shape: p.ty.sizes(),
                    init: p.init,
                    buffer,
                    grad: None,
                    state: Vec::new(),
                    role: p.role,
                    checkpoint_transposed: p.checkpoint_transposed,
                });
                let compute = self.compute_copy(buffer);
                self.define(n, stored, compute);
                if stored == layout { compute } else { self.value(n, layout) }
            }
            Op::Input { name } => {
                let buffer = self.node_buffer(n, layout, Role::Input);
                self.buffers[buffer.0 as usize].name = name.clone();
                self.inputs.push(PlanInput { name, shape: self.graph[n].ty.sizes(), buffer });
                self.define(n, layout, buffer);
                buffer
            }
            _ => {
                // Every other node defines itself when lowered; reaching here is a compiler bug.
                self.diagnostics.push(Diagnostic::error(
                    Code::E0699,
                    format!("internal error: node %{} was used before it was lowered", n.index()),
                ));
                self.node_buffer(n, layout, Role::Workspace)
            }
        }
    }

    /// What the products read of a float32 master weight: the weight itself in float32 plans; in bf16
    /// plans a bf16 copy made once per step where the weight is first used (freed after its last use,
    /// in the backward pass), from which every other layout of the weight is then made.
    fn compute_copy(&mut self, master: BufferId) -> BufferId {
        if self.target.memory.precision != Precision::Bf16 {
            return master;
        }
        let b = self.buffers[master.0 as usize].clone();
        let copy = self.new_buffer(format!("{}.bf16", b.name), DType::Bf16, b.logical_shape, b.layout, Role::Workspace);
        let reason = Reason::new(ReasonKind::Cast, "bf16 copy of the float32 master weight for this step");
        self.kernel(Kernel::Cast, &[master], copy, reason);
        copy
    }

    /// Moves a value between layouts one mesh axis at a time, in axis order. Under 3D, where two axes
    /// split one dimension, the order matters: every split that changes is first gathered, the less
    /// significant (see `MAJOR_ORDER`) first so that each gathered block is contiguous; then sums and
    /// new splits follow, the more significant first, so that each nests inside those already taken.
    /// The other strategies keep axis order, which is correct for them (no split they gather nests
    /// inside another) and cheaper: ZeRO-1's gradients are reduce-scattered over the rows before the
    /// replicas, so the data axis (often between nodes) carries a q times smaller block; the 3D order
    /// would do the replicas first (measured with scripts/plans_identical.sh: every ZeRO-1 plan moved).
    fn redistribute(&mut self, n: NodeIndex, from: Version, to: Layout) -> BufferId {
        let (from, nested) = if self.target.strategy == Strategy::ThreeD {
            (from, kept_splits_inside_moves(from.layout, to))
        } else {
            let from = self.mirror(n, from, to).unwrap_or(from);
            let nested = splits_inside_moves_in_axis_order(from.layout, to);
            if nested.is_empty() {
                return self.move_axes(n, from, to, &(0..MESH_AXES).collect::<Vec<_>>()).buffer;
            }
            (from, nested)
        };
        let gathered: Vec<usize> = MAJOR_ORDER
            .iter()
            .rev()
            .copied()
            .filter(|&a| (from.layout.0[a] != to.0[a] && from.layout.0[a].dim().is_some()) || nested.contains(&a))
            .collect();
        let whole = gathered.iter().fold(from.layout, |l, &a| l.with(a, Placement::Replicate));
        let mid = self.move_axes(n, from, whole, &gathered);
        self.move_axes(n, mid, to, &MAJOR_ORDER).buffer
    }

    /// A value whose row and column placements `to` asks for swapped (a table laid across a square
    /// mesh) is sent to the device across the grid's diagonal, one block each way: a gather and a
    /// slice per axis would move q - 1 blocks and keep a whole row or column of them. `None` when the
    /// grid's placements are not each other's, or are the same.
    fn mirror(&mut self, n: NodeIndex, from: Version, to: Layout) -> Option<Version> {
        let grid = |l: Layout| [l.0[ROW_AXIS], l.0[COLUMN_AXIS]];
        let next = from.layout.mirrored().filter(|m| grid(*m) == grid(to) && grid(*m) != grid(from.layout))?;
        if !self.square_grid() {
            return None;
        }
        let recv = self.moved_buffer(n, next, from.buffer);
        let what = describe_node(self.model, &self.graph[n], n);
        let text = format!("transpose {what} across the mesh's diagonal: its row and column splits swap");
        let reason = Reason::new(ReasonKind::Transpose, text);
        self.collective(CollectiveKind::Transpose, Group::Mirror, None, None, None, from.buffer, recv, reason);
        Some(Version { layout: next, buffer: recv })
    }

    /// Whether the tensor-parallel grid is square and more than one device wide: the grids on which a
    /// value can be sent across the diagonal, and so the only ones on which the layouts laid across it
    /// (and the products that keep a weight in place) are considered.
    pub(crate) fn square_grid(&self) -> bool {
        let mesh = self.target.mesh;
        mesh.rows == mesh.cols && mesh.rows > 1
    }

    /// [`Lowerer::redistribute`]'s steps, one mesh axis at a time in `order`.
    fn move_axes(&mut self, n: NodeIndex, from: Version, to: Layout, order: &[usize]) -> Version {
        let mut current = from;
        let axes = self.axes();
        for &axis in order {
            let (f, t) = (current.layout.0[axis], to.0[axis]);
            if f == t {
                continue;
            }
            let group = Group::along(axis);
            let next = current.layout.with(axis, t);
            let what = describe_node(self.model, &self.graph[n], n);
            current = match (f, t) {
                (Placement::Partial, Placement::Replicate) => {
                    let recv = self.moved_buffer(n, next, current.buffer);
                    let text = format!("sum the partial {what} over the {}", group.name());
                    let reason = self.bucketed(group, ReasonKind::PartialSum { scatter: false }, text);
                    self.collective(
                        CollectiveKind::AllReduce,
                        group,
                        None,
                        Some(ReduceOp::Sum),
                        None,
                        current.buffer,
                        recv,
                        reason,
                    );
                    Version { layout: next, buffer: recv }
                }
                (Placement::Partial, Placement::Shard { .. }) => {
                    let recv = self.moved_buffer(n, next, current.buffer);
                    let text = format!("sum the partial {what} and scatter its blocks over the {}", group.name());
                    let reason = self.bucketed(group, ReasonKind::PartialSum { scatter: true }, text);
                    self.collective(
                        CollectiveKind::ReduceScatter,
                        group,
                        None,
                        Some(ReduceOp::Sum),
                        Some(next.block_placement(axis, axes)),
                        current.buffer,
                        recv,
                        reason,
                    );
                    Version { layout: next, buffer: recv }
                }
                (Placement::Shard { .. }, _) => {
                    let gathered = current.layout.with(axis, Placement::Replicate);
                    let recv = self.moved_buffer(n, gathered, current.buffer);
                    let reason = Reason::new(ReasonKind::Gather, format!("gather {what} over the {}", group.name()));
                    self.collective(
                        CollectiveKind::AllGather,
                        group,
                        None,
                        None,
                        Some(current.layout.block_placement(axis, axes)),
                        current.buffer,
                        recv,
                        reason,
                    );
                    let v = Version { layout: gathered, buffer: recv };
                    match t {
                        Placement::Replicate => v,
                        // To join another pending sum (an add of two): the whole value, shared out.
                        Placement::Partial => self.share_out(n, v, axis),
                        Placement::Shard { .. } => self.slice(n, v, axis, t),
                    }
                }
                (Placement::Replicate, Placement::Shard { .. }) => self.slice(n, current, axis, t),
                (Placement::Replicate, Placement::Partial) => self.share_out(n, current, axis),
                (_, Placement::Partial) | (Placement::Replicate, Placement::Replicate) => {
                    self.diagnostics.push(Diagnostic::error(
                        Code::E0699,
                        format!("internal error: cannot make {what} a partial sum from {}", current.layout),
                    ));
                    current
                }
            };
        }
        current
    }

    /// A value whole along `axis` as a pending sum over it: each of the axis's p members holds 1/p of
    /// it, so that it can be added to another pending sum and both reduced once (no communication).
    fn share_out(&mut self, n: NodeIndex, from: Version, axis: usize) -> Version {
        let layout = from.layout.with(axis, Placement::Partial);
        let out = self.moved_buffer(n, layout, from.buffer);
        let parts = self.axes()[axis].max(1);
        let text = format!(
            "a 1/{parts} share of the whole value, to join a pending sum over the {}",
            Group::along(axis).name()
        );
        self.kernel(
            Kernel::Scale { factor: 1.0 / parts as f64 },
            &[from.buffer],
            out,
            Reason::new(ReasonKind::Compute, text),
        );
        Version { layout, buffer: out }
    }

    fn slice(&mut self, n: NodeIndex, from: Version, axis: usize, placement: Placement) -> Version {
        let layout = from.layout.with(axis, placement);
        let out = self.moved_buffer(n, layout, from.buffer);
        let axis_u8 = u8::try_from(axis).unwrap_or(0);
        let placement = layout.block_placement(axis, self.axes());
        let reason = Reason::new(ReasonKind::Slice, "take this device's block");
        self.kernel(Kernel::SliceShard { axis: axis_u8, placement }, &[from.buffer], out, reason);
        Version { layout, buffer: out }
    }

    /// The operands of node `n`, in order.
    pub fn operands(&self, n: NodeIndex) -> Vec<NodeIndex> {
        operands_of(self.graph, n)
    }

    /// The reason of a sum over `group`: of the kind given, or a data-parallel gradient reduction when
    /// it sums over the replicas while a bucket is being reduced.
    fn bucketed(&self, group: Group, kind: ReasonKind, text: String) -> Reason {
        match self.bucket.filter(|_| matches!(group, Group::Data | Group::Depth)) {
            Some(bucket) => Reason::new(
                ReasonKind::DataParallelGradient { bucket },
                match group {
                    Group::Depth => format!("gradient bucket {bucket} over the depth layers: {text}"),
                    _ => format!("data-parallel gradient bucket {bucket}: {text}"),
                },
            ),
            None => Reason::new(kind, text),
        }
    }
}

/// The operands of node `n` of `graph`, in order.
pub(crate) fn operands_of(graph: &DiGraph<Node, u8>, n: NodeIndex) -> Vec<NodeIndex> {
    use petgraph::visit::EdgeRef;
    let mut edges: Vec<(u8, NodeIndex)> =
        graph.edges_directed(n, petgraph::Direction::Incoming).map(|e| (*e.weight(), e.source())).collect();
    edges.sort_unstable();
    edges.into_iter().map(|(_, s)| s).collect()
}

/// The split factor of a dimension and its name: the whole dimension, or its middle factor.
fn split_factor(dim: Option<&crate::ir::Dim>, size: u64, outer: u64, inner: u64) -> (u64, Option<String>) {
    let whole = size / outer.max(1) / inner.max(1);
    let label = dim.and_then(|d| {
        if outer > 1 || inner > 1 {
            d.factors.iter().find(|f| f.size == whole).and_then(|f| f.label.clone())
        } else {
            d.label.clone()
        }
    });
    (whole, label)
}

/// A readable buffer name: the layer path and operator, e.g. `h.0.attn.c_attn/linear`.
/// The mesh axes whose splits would lie inside a split that the move from `from` to `to`, taken one
/// axis at a time in axis order, gathers or cuts (a less significant axis splitting, plainly, the same
/// dimension at that moment; see [`Layout::split_inside`]): the blocks gathered or cut would not be
/// contiguous. Where there are any, the move gathers them first and cuts them again after. A
/// sequence-mixing linear's output, its batch split by the columns, then wanted with the rows
/// splitting the batch, was cut along the rows around the columns' split (E0699).
fn splits_inside_moves_in_axis_order(from: Layout, to: Layout) -> Vec<usize> {
    let mut nested = Vec::new();
    let mut current = from;
    for axis in 0..MESH_AXES {
        let (f, t) = (current.0[axis], to.0[axis]);
        if f == t {
            continue;
        }
        for placement in [f, t] {
            if let Some(inside) = current.split_inside(axis, placement).filter(|b| !nested.contains(b)) {
                nested.push(inside);
            }
        }
        current = current.with(axis, t);
    }
    nested
}

/// For a 3D move, which gathers every split that changes before cutting any: the splits it keeps that
/// lie inside one it gathers or cuts (see [`splits_inside_moves_in_axis_order`]), gathered with them.
fn kept_splits_inside_moves(from: Layout, to: Layout) -> Vec<usize> {
    let mut nested = Vec::new();
    for axis in (0..MESH_AXES).filter(|&a| from.0[a] != to.0[a]) {
        for placement in [from.0[axis], to.0[axis]] {
            let kept = |b: &usize| from.0[*b] == to.0[*b] && !nested.contains(b);
            if let Some(inside) = from.split_inside(axis, placement).filter(kept) {
                nested.push(inside);
            }
        }
    }
    nested
}

pub(crate) fn describe_node(model: &Model, node: &Node, n: NodeIndex) -> String {
    match &node.op {
        Op::Param { id } => model.params[id.0 as usize].name.clone(),
        Op::Input { name } => name.clone(),
        op if node.origin.scope.is_empty() => format!("{}%{}", op.name(), n.index()),
        op => format!("{}/{}%{}", node.origin.scope, op.name(), n.index()),
    }
}

/// A SUMMA step's reason without its text: (product, step, steps, part).
type SummaStepKey = (SummaProduct, u64, u64, SummaPart);

/// Why an instruction exists: a reason to intern, or one interned already.
pub enum Because {
    Reason(Reason),
    Interned(u32),
}

impl From<Reason> for Because {
    fn from(reason: Reason) -> Because {
        Because::Reason(reason)
    }
}

impl From<u32> for Because {
    fn from(id: u32) -> Because {
        Because::Interned(id)
    }
}

#[cfg(test)]
mod tests {
    use super::{Mesh, SUGGESTED_MESH_DEVICES, Strategy, candidate_meshes};

    fn names(meshes: &[Mesh]) -> Vec<String> {
        meshes.iter().map(Mesh::to_string).collect()
    }

    #[test]
    fn candidates_are_every_mesh_of_the_strategy_within_the_bound() {
        assert_eq!(names(&candidate_meshes(Strategy::None)), ["1x1"]);
        let optimus = names(&candidate_meshes(Strategy::Optimus));
        assert_eq!(optimus, ["1x1", "2x2", "3x3", "4x4", "5x5", "6x6", "7x7", "8x8"]);
        let megatron = candidate_meshes(Strategy::Megatron);
        assert_eq!(megatron.len() as u64, SUGGESTED_MESH_DEVICES);
        assert!(megatron.iter().zip(1..).all(|(m, p)| *m == Mesh::new(1, p)), "{megatron:?}");
    }
}
