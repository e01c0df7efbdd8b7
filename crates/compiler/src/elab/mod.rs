//! Elaboration: binds the config, instantiates layers and blocks, and runs every forward symbolically
//! to build the typed logical graph ([`crate::ir::Model`]), inferring and checking shapes on the way.

mod args;
mod eval;
mod layers;
mod ops;
mod resolve;
mod size;
mod unused;

pub use ops::show_type;
pub use size::{MAX_TENSOR_ELEMENTS, fitting_elements, max_elements, too_large};

use crate::diag::{Code, Diagnostic, dedup};
use crate::ir::{ConfigValue, Model, Node, Origin, Param, ParamId, Scalar, TensorType};
use crate::syntax::ast::{self, File, LayerDecl, Stmt};
use optimus_plan::span::Span;
use optimus_plan::text::group_digits;
use petgraph::graph::{DiGraph, NodeIndex};
use std::collections::{HashMap, HashSet};

/// Most graph nodes one model may elaborate to.
pub const MAX_NODES: usize = 2_000_000;
/// Most copies one `repeat` may make.
pub const MAX_REPEAT: i64 = 100_000;
/// Most block and layer instances one model may have (nested `repeat`s multiply). A layer makes about four
/// graph nodes (its parameters and its operator), so this matches [`MAX_NODES`].
pub const MAX_INSTANCES: usize = MAX_NODES / 4;
/// Most unknown names given a "did you mean" suggestion in one run.
pub const MAX_NAME_SEARCHES: usize = 100;
/// Most expressions one model may evaluate while it elaborates, counting every sub-expression each time it is
/// evaluated: in config values, in each block instance's declarations and in each call of a block's forward. A
/// forward that calls a layer several times, nested, runs that block's forward that many times again, so without
/// this bound blocks calling each other could take exponential time while making no operators (a forward that
/// returns its input). One pass over the largest file evaluates fewer than 17 million expressions (at most about
/// one a byte), a model at [`MAX_NODES`] about 2 per node, and the largest example, `gpt3.opt`, 4,939.
pub const MAX_EVALUATIONS: usize = 20_000_000;
/// Most dimensions a tensor has, and so most items a list (a shape) holds: PyTorch's own bound.
pub const MAX_RANK: usize = 64;

/// Why an elaboration step produced no value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fail {
    /// A diagnostic has been recorded; carry on with the next statement.
    Reported,
    /// A limit was hit; stop elaborating.
    Abort,
}

pub type R<T> = Result<T, Fail>;

/// A `--set name=value` override from the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Override {
    pub name: String,
    pub value: String,
}

impl std::str::FromStr for Override {
    type Err = String;
    fn from_str(s: &str) -> Result<Override, String> {
        match s.split_once('=') {
            Some((name, value)) if !name.trim().is_empty() => {
                Ok(Override { name: name.trim().to_string(), value: value.trim().to_string() })
            }
            _ => Err(format!("expected NAME=VALUE, found `{s}`")),
        }
    }
}

/// A value during elaboration.
#[derive(Clone, Debug)]
pub(crate) enum Value {
    /// A scalar, with the config or block parameter name it was read from.
    Scalar(Scalar, Option<String>),
    List(Vec<Value>),
    Tensor(NodeIndex),
    /// Stands for a value whose computation already failed, so no error cascades from it.
    Poison,
}

/// An instantiated layer.
#[derive(Clone, Debug)]
pub(crate) enum Layer {
    Linear {
        weight: ParamId,
        bias: Option<ParamId>,
        in_dim: crate::ir::Dim,
        out_dim: crate::ir::Dim,
        transpose: bool,
        span: Span,
    },
    Norm {
        weight: ParamId,
        bias: ParamId,
        dim: u64,
        eps: f64,
        span: Span,
    },
    RmsNorm {
        weight: ParamId,
        dim: u64,
        eps: f64,
        span: Span,
    },
    Embedding {
        table: ParamId,
        /// The row of the padding id, which gets no gradient.
        padding: Option<u64>,
    },
    PositionEmbedding {
        table: ParamId,
        span: Span,
    },
    Block(usize),
    Repeat(Vec<usize>),
    Poison,
}

/// An instantiated block (or the root model): its path, parameter values and layers.
#[derive(Clone, Debug)]
pub(crate) struct Module {
    /// Index into the file's blocks; `None` for the root.
    block: Option<usize>,
    path: String,
    /// Block parameters, each with the config name it was passed from (a size keeps its origin).
    env: HashMap<String, (Scalar, Option<String>)>,
    /// Layers in declaration order, and where each name is in that list.
    layers: Vec<(String, Layer)>,
    layer_index: HashMap<String, usize>,
}

impl Module {
    fn new(block: Option<usize>, path: String, env: HashMap<String, (Scalar, Option<String>)>) -> Module {
        Module { block, path, env, layers: Vec::new(), layer_index: HashMap::new() }
    }

    /// The layer of this name, found in constant time.
    pub(crate) fn layer(&self, name: &str) -> Option<&Layer> {
        self.layer_index.get(name).map(|&i| &self.layers[i].1)
    }

    fn push_layer(&mut self, name: &str, layer: Layer) {
        self.layer_index.insert(name.to_string(), self.layers.len());
        self.layers.push((name.to_string(), layer));
    }
}

/// Where an expression is written, which decides what its names may refer to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// The model's top-level forward: the only place that sees the model's inputs.
    ModelForward,
    /// A block's forward.
    BlockForward,
    /// The arguments of a `layer` declaration: a layer kind's, a block's or a `repeat` count.
    Declaration,
    /// A block parameter's default.
    Default,
    /// Config entries and input dimensions.
    Config,
}

/// Local bindings while evaluating: a module's forward, a config block, or block arguments.
pub(crate) struct Frame {
    module: Option<usize>,
    locals: HashMap<String, Value>,
    place: Place,
}

impl Frame {
    /// A frame that sees only config values (and the given locals).
    fn scalars(place: Place) -> Frame {
        Frame { module: None, locals: HashMap::new(), place }
    }
}

/// The elaborator's state.
pub struct Elab<'f> {
    file: &'f File,
    diags: Vec<Diagnostic>,
    graph: DiGraph<Node, u8>,
    params: Vec<Param>,
    config: Vec<ConfigValue>,
    /// Where each bound config value is in `config`.
    config_index: HashMap<String, usize>,
    config_env: HashMap<String, Scalar>,
    /// Every config entry's name, at its first definition: looked up once per name, never scanned.
    config_decls: HashMap<&'f str, &'f ast::Ident>,
    inputs: HashMap<String, (NodeIndex, Span)>,
    blocks: HashMap<String, usize>,
    recursive: HashSet<usize>,
    modules: Vec<Module>,
    /// Layer paths of the instances of repeated blocks, in order.
    repeated_blocks: Vec<String>,
    /// Layer paths of the block instances marked `checkpoint`, in order.
    checkpointed_blocks: Vec<String>,
    param_nodes: HashMap<ParamId, NodeIndex>,
    /// Config values and inputs whose definition failed (and was reported): their uses evaluate to poison.
    poisoned: HashSet<String>,
    /// Config values already reported as a non-positive size; their other uses as sizes stay silent.
    bad_sizes: HashSet<String>,
    /// Blocks and layers instantiated so far, against [`MAX_INSTANCES`].
    instances: usize,
    /// Expressions evaluated so far, against [`MAX_EVALUATIONS`].
    evaluations: usize,
    /// How many times each block's forward has been run, by block index: named when evaluation stops.
    forward_runs: Vec<usize>,
    /// Unknown names searched for a suggestion so far, against [`MAX_NAME_SEARCHES`].
    name_searches: usize,
    /// Names and callees that name resolution has already reported: elaboration stays silent about them.
    resolved_errors: HashSet<Span>,
    /// Inputs named like a config value (reported): in the model's forward their name is an invalid value.
    clashing_inputs: HashSet<String>,
    /// Layers named like a config value or input (reported), by the block that declares them (`None` for the
    /// root): as values in that module, their name is an invalid value.
    clashing_layers: HashSet<(Option<usize>, String)>,
    /// For each config value computed from a `--set` override to a size that is not positive (the override
    /// included), that override's name: only one error is reported for the override and everything computed
    /// from it.
    override_roots: HashMap<String, String>,
    /// The paths of layers whose declaration failed (and was reported): a `tied` path naming one stays
    /// silent rather than call it undeclared.
    poisoned_layers: HashSet<String>,
    /// Blocks with a parameter named twice (reported): their instances fail silently, as no argument can be
    /// bound to the right one.
    blocks_with_repeated_params: HashSet<usize>,
    /// Block forwards, by their head, with a parameter named twice (reported): their calls fail silently.
    forwards_with_repeated_params: HashSet<Span>,
    /// Parameter declarations reported too large (their layer's span, leaf name and sizes): the other instances
    /// of the declaration fail silently rather than repeat the error for every copy of a repeated block.
    params_reported_too_large: HashSet<(Span, String, Vec<u64>)>,
}

/// Elaborates a parsed file with command-line overrides into a model; errors if any diagnostic is an error.
/// On success, also returns warnings.
pub fn elaborate(file: &File, overrides: &[Override]) -> Result<(Model, Vec<Diagnostic>), Vec<Diagnostic>> {
    let mut elab = Elab {
        file,
        diags: Vec::new(),
        graph: DiGraph::new(),
        params: Vec::new(),
        config: Vec::new(),
        config_index: HashMap::new(),
        config_env: HashMap::new(),
        config_decls: first_definitions(&file.config),
        inputs: HashMap::new(),
        blocks: HashMap::new(),
        recursive: HashSet::new(),
        modules: Vec::new(),
        repeated_blocks: Vec::new(),
        checkpointed_blocks: Vec::new(),
        param_nodes: HashMap::new(),
        poisoned: HashSet::new(),
        bad_sizes: HashSet::new(),
        instances: 0,
        evaluations: 0,
        forward_runs: vec![0; file.blocks.len()],
        name_searches: 0,
        resolved_errors: HashSet::new(),
        clashing_inputs: HashSet::new(),
        clashing_layers: HashSet::new(),
        override_roots: HashMap::new(),
        poisoned_layers: HashSet::new(),
        blocks_with_repeated_params: HashSet::new(),
        forwards_with_repeated_params: HashSet::new(),
        params_reported_too_large: HashSet::new(),
    };
    let result = elab.run(overrides);
    let mut diags = std::mem::take(&mut elab.diags);
    dedup(&mut diags);
    if result == Err(Fail::Abort) || diags.iter().any(Diagnostic::is_error) {
        return Err(diags);
    }
    diags.extend(unused::unused_declarations(file));
    let (outputs, loss) = match result {
        Ok(v) => v,
        Err(_) => return Err(diags),
    };
    let model = Model {
        name: file.model.as_ref().map_or_else(|| "model".to_string(), |m| m.name.name.clone()),
        checkpoint_prefix: elab.checkpoint_prefix(),
        config: elab.config,
        params: elab.params,
        graph: elab.graph,
        outputs,
        loss,
        repeated_blocks: first_occurrences(elab.repeated_blocks),
        checkpointed_blocks: first_occurrences(elab.checkpointed_blocks),
    };
    Ok((model, diags))
}

/// The items of `items` in order, each once (a block applied twice is recorded twice).
fn first_occurrences(items: Vec<String>) -> Vec<String> {
    let mut seen = HashSet::new();
    items.into_iter().filter(|item| seen.insert(item.clone())).collect()
}

/// Longest name for which a close match is looked for; longer ones are not typos worth correcting, and
/// comparing them costs time quadratic in their length.
const MAX_SUGGESTED_NAME: usize = 64;

/// The nearest of `candidates` to `name`, if it is close enough to be a likely typo. Ties go to the
/// alphabetically first candidate, so the suggestion never depends on hash order.
pub fn suggest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let length = name.chars().count();
    if length > MAX_SUGGESTED_NAME {
        return None;
    }
    // The edit distance is at least the difference in length: far longer or shorter names are never close.
    let max_distance = (length / 3).max(2);
    let mut best: Option<(f64, &str)> = None;
    for c in candidates {
        if c == name || c.is_empty() || c.len().abs_diff(name.len()) > max_distance || c.len() > 4 * MAX_SUGGESTED_NAME
        {
            continue;
        }
        let score = strsim::jaro_winkler(name, c);
        let distance = strsim::levenshtein(name, c);
        // A one-letter name is "close" to every other one-letter name: never suggest a full replacement.
        let close = distance < length && (distance <= (length / 3).max(1) || score > 0.85);
        let better = best.is_none_or(|(b, n)| score > b || (score == b && c < n));
        if close && better {
            best = Some((score, c));
        }
    }
    best.map(|(_, c)| c)
}

impl<'f> Elab<'f> {
    pub(crate) fn report(&mut self, d: Diagnostic) {
        self.diags.push(d);
    }

    /// Records an error and fails the current step.
    pub(crate) fn fail<T>(&mut self, d: Diagnostic) -> R<T> {
        self.diags.push(d);
        Err(Fail::Reported)
    }

    fn run(&mut self, overrides: &[Override]) -> R<(Vec<crate::ir::Output>, Option<NodeIndex>)> {
        self.bind_config(overrides);
        self.check_model_options();
        self.index_blocks();
        self.find_recursion();
        self.declare_inputs();
        self.resolve_names();
        let root = self.instantiate_root()?;
        self.run_root_forward(root)
    }

    fn checkpoint_prefix(&self) -> Option<String> {
        let model = self.file.model.as_ref()?;
        model.options.iter().find_map(|o| match (&o.name, &o.value.kind) {
            (Some(n), ast::ExprKind::Str(s)) if n.name == "checkpoint_prefix" => Some(s.clone()),
            _ => None,
        })
    }

    /// Whether the model's `linear_orientation` is "out_in" (checked by `check_model_options`).
    pub(crate) fn model_out_in(&self) -> bool {
        let Some(model) = self.file.model.as_ref() else { return false };
        model.options.iter().any(|o| match (&o.name, &o.value.kind) {
            (Some(n), ast::ExprKind::Str(s)) => n.name == "linear_orientation" && s == "out_in",
            _ => false,
        })
    }

    fn check_model_options(&mut self) {
        let Some(model) = &self.file.model else { return };
        for opt in &model.options {
            match &opt.name {
                Some(n) if n.name == "checkpoint_prefix" => {
                    if !matches!(opt.value.kind, ast::ExprKind::Str(_)) {
                        self.report(
                            Diagnostic::error(Code::E0107, "`checkpoint_prefix` must be a string")
                                .primary(opt.value.span, "expected a string such as \"transformer.\""),
                        );
                    }
                }
                Some(n) if n.name == "linear_orientation" => match &opt.value.kind {
                    ast::ExprKind::Str(s) if s == "in_out" || s == "out_in" => {}
                    ast::ExprKind::Str(s) => self.report(layers::bad_orientation(s, opt.value.span)),
                    _ => self.report(
                        Diagnostic::error(Code::E0107, "`linear_orientation` must be a string")
                            .primary(opt.value.span, "expected \"in_out\" or \"out_in\""),
                    ),
                },
                Some(n) => {
                    let mut d = Diagnostic::error(Code::E0104, format!("`model` has no option named `{}`", n.name))
                        .primary(n.span, "unknown option")
                        .note("`model` takes (checkpoint_prefix, linear_orientation)");
                    if let Some(s) = suggest(&n.name, ["checkpoint_prefix", "linear_orientation"]) {
                        d = d.help(format!("did you mean `{s}`?"));
                    }
                    self.report(d);
                }
                None => self.report(
                    Diagnostic::error(Code::E0103, "`model` options must be named")
                        .primary(opt.span, "write `checkpoint_prefix: \"...\"`"),
                ),
            }
        }
    }

    /// Evaluates config entries in order, applying `--set` overrides.
    fn bind_config(&mut self, overrides: &[Override]) {
        let file = self.file;
        let mut seen: HashMap<&str, Span> = HashMap::new();
        for entry in &file.config {
            if let Some(prev) = seen.get(entry.name.name.as_str()) {
                self.report(duplicate("config value", &entry.name, *prev));
                continue;
            }
            seen.insert(&entry.name.name, entry.name.span);
            let mut frame = Frame::scalars(Place::Config);
            // The bad override this entry is computed from, if any (the first, in the order it is read).
            let mut root = None;
            config_names(&entry.value, &mut |name| {
                if root.is_none() {
                    root = self.override_roots.get(name).cloned();
                }
            });
            let value = match self.eval(&entry.value, &mut frame) {
                Ok(Value::Scalar(s, _)) => s,
                result @ (Ok(Value::Poison) | Err(_)) => {
                    // Later uses of a failed value stay silent: the error is reported once, here. If the error is
                    // due to a bad override, that override's other uses as a size stay silent too.
                    if let (Err(Fail::Reported), Some(root)) = (result, &root) {
                        self.bad_sizes.insert(root.clone());
                    }
                    self.poisoned.insert(entry.name.name.clone());
                    continue;
                }
                Ok(_) => {
                    self.report(
                        Diagnostic::error(Code::E0107, "a config value must be a number, boolean or string")
                            .primary(entry.value.span, "not a scalar"),
                    );
                    self.poisoned.insert(entry.name.name.clone());
                    continue;
                }
            };
            let overridden = overrides.iter().rev().find(|o| o.name == entry.name.name);
            let (value, overridden) = match overridden {
                Some(o) => match parse_override(&o.value, &value) {
                    Ok(v) => (v, true),
                    Err(reason) => {
                        self.report(bad_override(o, &reason, entry, &value));
                        (value, false)
                    }
                },
                None => (value, false),
            };
            if overridden {
                // An overridden value no longer depends on what its expression read.
                root = matches!(value, Scalar::Int(v) if v <= 0).then(|| entry.name.name.clone());
            }
            if let Some(root) = root {
                self.override_roots.insert(entry.name.name.clone(), root);
            }
            self.config_env.insert(entry.name.name.clone(), value.clone());
            self.config_index.insert(entry.name.name.clone(), self.config.len());
            self.config.push(ConfigValue { name: entry.name.name.clone(), value, span: entry.span, overridden });
        }
        self.check_unknown_overrides(overrides);
    }

    fn check_unknown_overrides(&mut self, overrides: &[Override]) {
        let names: Vec<&str> = self.file.config.iter().map(|c| c.name.name.as_str()).collect();
        for o in overrides {
            if self.config_decls.contains_key(o.name.as_str()) {
                continue;
            }
            let valid = if names.is_empty() {
                "this model has no config values".to_string()
            } else {
                format!("valid names: {}", first_few(&names))
            };
            let mut d = Diagnostic::error(
                Code::E0301,
                format!("`--set {}`: the model has no config value `{}`", o.name, o.name),
            );
            let blocks = &self.file.config_spans;
            if let Some(span) = blocks.first() {
                // Every config block is labelled: the name is in none of them.
                let keyword = |span: &Span| Span::new(span.start as usize, span.start as usize + "config".len());
                let where_ = if blocks.len() == 1 { "this config block" } else { "any config block" };
                d = d.primary(keyword(span), format!("`{}` is not defined in {where_}", o.name));
                for other in &blocks[1..] {
                    d = d.secondary(keyword(other), "nor here");
                }
            } else if let Some(model) = &self.file.model {
                d = d.primary(model.name.span, "this model has no `config` block");
            }
            d = d.note(valid);
            if let Some(s) = suggest(&o.name, names.iter().copied()) {
                d = d.help(format!("did you mean `{s}`?"));
            }
            self.report(d);
        }
    }

    fn index_blocks(&mut self) {
        let file = self.file;
        for (i, block) in file.blocks.iter().enumerate() {
            let name = &block.name;
            if let Some(&prev) = self.blocks.get(&name.name) {
                self.report(duplicate("block", name, file.blocks[prev].name.span));
                continue;
            }
            if layers::is_layer_kind(&name.name) || ops::is_function(&name.name) {
                self.report(
                    Diagnostic::error(
                        Code::E0105,
                        format!("block `{}` has the name of a built-in operator", name.name),
                    )
                    .primary(name.span, "built-in name")
                    .help("rename the block"),
                );
                continue;
            }
            self.blocks.insert(name.name.clone(), i);
        }
    }

    /// Finds cycles among blocks (a block that instantiates itself, directly or not) and reports each once.
    fn find_recursion(&mut self) {
        let file = self.file;
        let edges: Vec<Vec<(usize, Span)>> = file
            .blocks
            .iter()
            .map(|b| {
                b.layers
                    .iter()
                    .filter_map(|l| {
                        let call = layer_call(l);
                        self.blocks.get(&call.callee.name).map(|&t| (t, call.callee.span))
                    })
                    .collect()
            })
            .collect();
        // 0 = unvisited, 1 = on the stack, 2 = done. Iterative DFS: block graphs may be deep.
        let mut state = vec![0u8; file.blocks.len()];
        for start in 0..file.blocks.len() {
            if state[start] != 0 {
                continue;
            }
            let mut stack: Vec<(usize, usize)> = vec![(start, 0)];
            state[start] = 1;
            while let Some(&mut (node, ref mut next)) = stack.last_mut() {
                if let Some(&(target, span)) = edges[node].get(*next) {
                    *next += 1;
                    match state[target] {
                        0 => {
                            state[target] = 1;
                            stack.push((target, 0));
                        }
                        1 => self.report_cycle(&stack, target, span),
                        _ => {}
                    }
                } else {
                    state[node] = 2;
                    stack.pop();
                }
            }
        }
    }

    fn report_cycle(&mut self, stack: &[(usize, usize)], target: usize, span: Span) {
        let file = self.file;
        let from = stack.iter().position(|(n, _)| *n == target).unwrap_or(0);
        let members: Vec<usize> = stack[from..].iter().map(|(n, _)| *n).collect();
        let mut path: Vec<&str> = members.iter().map(|&m| file.blocks[m].name.name.as_str()).collect();
        path.push(&file.blocks[target].name.name);
        self.recursive.extend(members.iter().copied());
        let last = members.last().copied().unwrap_or(target);
        self.report(
            Diagnostic::error(
                Code::E0106,
                format!("block `{}` contains itself: {}", file.blocks[target].name.name, path.join(" -> ")),
            )
            .primary(
                span,
                format!("`{}` is instantiated inside `{}`", file.blocks[target].name.name, file.blocks[last].name.name),
            )
            .secondary(file.blocks[target].name.span, "defined here")
            .help("a block cannot contain itself; use `repeat(n)` to stack copies of a block"),
        );
    }

    fn declare_inputs(&mut self) {
        let file = self.file;
        for input in &file.inputs {
            let name = &input.name;
            if let Some((_, prev)) = self.inputs.get(&name.name) {
                let prev = *prev;
                self.report(duplicate("input", name, prev));
                continue;
            }
            if let Some(&config_name) = self.config_decls.get(name.name.as_str()) {
                self.report(clash(("config value", config_name), ("input", name)));
                // Neither is meant where the name is used in the model's forward: it stands for an invalid value.
                self.clashing_inputs.insert(name.name.clone());
                continue;
            }
            match self.declare_input(input) {
                Ok(node) => {
                    self.inputs.insert(name.name.clone(), (node, name.span));
                }
                Err(Fail::Abort) => return,
                Err(Fail::Reported) => {
                    self.poisoned.insert(name.name.clone());
                }
            }
        }
    }

    /// Checks one input's element type and dimensions (reporting every problem) and adds its graph node.
    fn declare_input(&mut self, input: &ast::InputDecl) -> R<NodeIndex> {
        let dtype = crate::ir::DType::from_name(&input.dtype.name);
        if dtype.is_none() {
            let names = crate::ir::DType::ALL.map(|d| d.name());
            let mut d = Diagnostic::error(Code::E0101, format!("unknown element type `{}`", input.dtype.name))
                .primary(input.dtype.span, "not an element type")
                .note(format!("element types: {}", names.join(", ")));
            if let Some(s) = suggest(&input.dtype.name, names) {
                d = d.help(format!("did you mean `{s}`?"));
            }
            self.report(d);
        }
        if input.dims.len() > MAX_RANK {
            return self.fail(too_many_dimensions(input.dims.len(), input.span));
        }
        let mut frame = Frame::scalars(Place::Config);
        let mut shape = Vec::new();
        let mut failed = false;
        for dim in &input.dims {
            match self.eval_dim(dim, &mut frame) {
                Ok(d) => shape.push(d),
                Err(Fail::Abort) => return Err(Fail::Abort),
                Err(Fail::Reported) => failed = true,
            }
        }
        let Some(dtype) = dtype.filter(|_| !failed) else { return Err(Fail::Reported) };
        let ty = TensorType { dtype, shape };
        self.add_node(crate::ir::Op::Input { name: input.name.name.clone() }, ty, input.span, "", &[])
    }

    fn instantiate_root(&mut self) -> R<usize> {
        let file = self.file;
        let id = self.modules.len();
        self.modules.push(Module::new(None, String::new(), HashMap::new()));
        self.instantiate_layers(id, &file.layers)?;
        Ok(id)
    }

    /// Instantiates a module's layer declarations in order, reporting duplicates.
    fn instantiate_layers(&mut self, module: usize, decls: &'f [LayerDecl]) -> R<()> {
        let mut seen: HashMap<&str, Span> = HashMap::new();
        for decl in decls {
            if let Some(prev) = seen.get(decl.name.name.as_str()) {
                self.report(duplicate("layer", &decl.name, *prev));
                continue;
            }
            seen.insert(&decl.name.name, decl.name.span);
            let layer = match self.instantiate_layer(module, decl) {
                Ok(l) => l,
                Err(Fail::Abort) => return Err(Fail::Abort),
                Err(Fail::Reported) => {
                    let path = layers::join(&self.modules[module].path, &decl.name.name);
                    self.poisoned_layers.insert(path);
                    Layer::Poison
                }
            };
            self.modules[module].push_layer(&decl.name.name, layer);
        }
        Ok(())
    }

    fn run_root_forward(&mut self, root: usize) -> R<(Vec<crate::ir::Output>, Option<NodeIndex>)> {
        let file = self.file;
        let Some(forward) = file.forwards.first() else {
            return self.fail(
                Diagnostic::error(Code::E0401, "the model has no `forward`")
                    .primary(Span::new(0, 0), "expected a top-level `forward { ... }`")
                    .help("add `forward { ... }` with at least one `output name = ...` statement"),
            );
        };
        for extra in &file.forwards[1..] {
            self.report(
                Diagnostic::error(Code::E0105, "the model has more than one top-level `forward`")
                    .primary(extra.head_span, "second `forward`")
                    .secondary(forward.head_span, "first defined here"),
            );
        }
        if let Some(p) = forward.params.first() {
            self.report(
                Diagnostic::error(Code::E0103, "the model's `forward` takes no parameters")
                    .primary(p.span, "unexpected parameter")
                    .help("declare model inputs with `input name: dtype[dims]`"),
            );
        }
        // Parameters (reported above) stand for invalid values, so that their uses are not reported again.
        let locals = forward.params.iter().map(|p| (p.name.clone(), Value::Poison)).collect();
        let mut frame = Frame { module: Some(root), locals, place: Place::ModelForward };
        let mut outputs = Vec::new();
        let mut seen: HashMap<&str, Span> = HashMap::new();
        for stmt in &forward.body {
            match stmt {
                Stmt::Assign { name, value, .. } => self.assign(&mut frame, name, value)?,
                Stmt::Output { name, value, .. } => {
                    if let Some(&prev) = seen.get(name.name.as_str()) {
                        self.report(duplicate("output", name, prev));
                        continue;
                    }
                    seen.insert(&name.name, name.span);
                    self.assign(&mut frame, name, value)?;
                    if let Some(Value::Tensor(node)) = frame.locals.get(&name.name) {
                        outputs.push(crate::ir::Output { name: name.name.clone(), node: *node, span: name.span });
                    } else if !matches!(frame.locals.get(&name.name), Some(Value::Poison) | None) {
                        self.report(
                            Diagnostic::error(Code::E0107, format!("output `{}` is not a tensor", name.name))
                                .primary(value.span, "a scalar")
                                .help("an output is a tensor computed from the model's inputs"),
                        );
                    }
                }
                Stmt::Return { span, .. } => self.report(
                    Diagnostic::error(Code::E0401, "the model's `forward` has no `return`; it names its outputs")
                        .primary(*span, "`return` is only for blocks")
                        .help("write `output loss = ...`"),
                ),
            }
        }
        let has_output = forward.body.iter().any(|s| matches!(s, Stmt::Output { .. }));
        if outputs.is_empty() && !has_output {
            return self.fail(
                Diagnostic::error(Code::E0401, "the model's `forward` has no outputs")
                    .primary(forward.head_span, "no `output` statement in here")
                    .help("add `output loss = cross_entropy(logits, targets)`"),
            );
        }
        let loss = self.pick_loss(&outputs);
        Ok((outputs, loss))
    }

    /// The training objective: the output named `loss`, else the only scalar output.
    fn pick_loss(&self, outputs: &[crate::ir::Output]) -> Option<NodeIndex> {
        let scalar =
            |o: &&crate::ir::Output| self.graph[o.node].ty.rank() == 0 && !self.graph[o.node].ty.dtype.is_integer();
        if let Some(o) = outputs.iter().find(|o| o.name == "loss").filter(scalar) {
            return Some(o.node);
        }
        let scalars: Vec<_> = outputs.iter().filter(scalar).collect();
        if scalars.len() == 1 { Some(scalars[0].node) } else { None }
    }

    fn assign(&mut self, frame: &mut Frame, name: &ast::Ident, value: &ast::Expr) -> R<()> {
        let v = match self.eval(value, frame) {
            Ok(v) => v,
            Err(Fail::Abort) => return Err(Fail::Abort),
            Err(Fail::Reported) => Value::Poison,
        };
        frame.locals.insert(name.name.clone(), v);
        Ok(())
    }

    /// Runs a block's forward on argument tensors; returns its result.
    fn call_module(&mut self, module: usize, args: Vec<Value>, call: &ast::Call) -> R<Value> {
        let file = self.file;
        let Some(block_index) = self.modules[module].block else {
            return Err(Fail::Reported);
        };
        let block = &file.blocks[block_index];
        let Some(forward) = block.forwards.first() else {
            return self.fail(
                Diagnostic::error(Code::E0401, format!("block `{}` has no `forward`", block.name.name))
                    .primary(block.name.span, "this block has no `forward`")
                    .secondary(call.callee.span, "called here")
                    .help("add `forward(x) { ... return ... }` to the block"),
            );
        };
        if self.forwards_with_repeated_params.contains(&forward.head_span) {
            return Err(Fail::Reported);
        }
        if forward.params.len() != args.len() {
            return self.fail(
                Diagnostic::error(
                    Code::E0103,
                    format!(
                        "`{}` takes {} but {} given",
                        call.callee.name,
                        args::plural(forward.params.len(), "tensor argument"),
                        args::were(args.len())
                    ),
                )
                .primary(call.args_span, format!("{} given", args.len()))
                .secondary(forward.head_span, "its forward is defined here"),
            );
        }
        self.forward_runs[block_index] += 1;
        let mut frame = Frame {
            module: Some(module),
            locals: forward.params.iter().map(|p| p.name.clone()).zip(args).collect(),
            place: Place::BlockForward,
        };
        for stmt in &forward.body {
            match stmt {
                // Name resolution has reported an `output` in a block; it binds its name like an assignment.
                Stmt::Assign { name, value, .. } | Stmt::Output { name, value, .. } => {
                    self.assign(&mut frame, name, value)?;
                }
                Stmt::Return { value, .. } => return self.eval(value, &mut frame),
            }
        }
        // Name resolution has reported the missing `return`.
        Err(Fail::Reported)
    }

    /// Counts one more block or layer instance; stops elaboration once there are too many.
    pub(crate) fn count_instance(&mut self, span: Span) -> R<()> {
        self.instances += 1;
        if self.instances <= MAX_INSTANCES {
            return Ok(());
        }
        self.report(
            Diagnostic::error(
                Code::E0402,
                format!("the model has more than {} block and layer instances", group_digits(MAX_INSTANCES as u128)),
            )
            .primary(span, "limit reached here")
            .help("reduce `repeat` counts, or the number of copies blocks make of each other"),
        );
        Err(Fail::Abort)
    }

    /// Counts one more expression evaluated; stops elaboration once there are too many. The limit is reported
    /// once, at the expression that reached it: evaluations attempted after it (a config value whose failure is
    /// not fatal) fail silently.
    pub(crate) fn count_evaluation(&mut self, span: Span) -> R<()> {
        self.evaluations = self.evaluations.saturating_add(1);
        if self.evaluations <= MAX_EVALUATIONS {
            return Ok(());
        }
        if self.evaluations == MAX_EVALUATIONS + 1 {
            let d = self.too_many_evaluations(span);
            self.report(d);
        }
        Err(Fail::Abort)
    }

    /// The error for [`MAX_EVALUATIONS`], labelled at `span` and at the forward run most often so far.
    fn too_many_evaluations(&self, span: Span) -> Diagnostic {
        let mut d = Diagnostic::error(
            Code::E0402,
            format!("elaborating the model evaluates more than {} expressions", group_digits(MAX_EVALUATIONS as u128)),
        )
        .primary(span, "limit reached here");
        let busiest = self.forward_runs.iter().enumerate().max_by_key(|&(_, runs)| *runs);
        if let Some((block, &runs)) = busiest.filter(|(_, runs)| **runs > 1) {
            let def = &self.file.blocks[block];
            if let Some(forward) = def.forwards.first() {
                d = d.secondary(
                    forward.head_span,
                    format!("the forward of `{}` has run {} times so far", def.name.name, group_digits(runs as u128)),
                );
            }
        }
        d.note("each call of a block runs its forward again: a forward that calls a layer several times, nested, multiplies the runs of every block inside that layer")
            .help("call layers fewer times in each forward, nest blocks less deeply, or reduce `repeat` counts")
    }

    /// Adds a node, with its operands as edges; enforces the size limits.
    pub(crate) fn add_node(
        &mut self,
        op: crate::ir::Op,
        ty: TensorType,
        span: Span,
        scope: &str,
        operands: &[NodeIndex],
    ) -> R<NodeIndex> {
        if self.graph.node_count() >= MAX_NODES {
            self.report(
                Diagnostic::error(
                    Code::E0402,
                    format!("the model elaborates to more than {} operators", group_digits(MAX_NODES as u128)),
                )
                .primary(span, "limit reached here")
                .help("reduce `repeat` counts"),
            );
            return Err(Fail::Abort);
        }
        let what = match &op {
            crate::ir::Op::Input { name } => format!("input `{name}`"),
            _ => "tensor".to_string(),
        };
        self.check_tensor_size(&what, &ty, span)?;
        let node = self.graph.add_node(Node { op, ty, origin: Origin { span, scope: scope.to_string() } });
        for (i, &operand) in operands.iter().enumerate() {
            self.graph.add_edge(operand, node, u8::try_from(i).unwrap_or(u8::MAX));
        }
        Ok(node)
    }

    /// The bound config value of this name, found in constant time.
    pub(crate) fn config_value(&self, name: &str) -> Option<&ConfigValue> {
        self.config_index.get(name).map(|&i| &self.config[i])
    }

    pub(crate) fn ty(&self, node: NodeIndex) -> &TensorType {
        &self.graph[node].ty
    }

    pub(crate) fn scope_of(&self, frame: &Frame) -> String {
        frame.module.map(|m| self.modules[m].path.clone()).unwrap_or_default()
    }
}

/// Most names a note lists before it says how many more there are.
const MAX_LISTED_NAMES: usize = 20;

/// `a, b, c`, or the first [`MAX_LISTED_NAMES`] of them and "... and N more".
fn first_few(names: &[&str]) -> String {
    if names.len() <= MAX_LISTED_NAMES {
        return names.join(", ");
    }
    format!("{}, ... and {} more", names[..MAX_LISTED_NAMES].join(", "), names.len() - MAX_LISTED_NAMES)
}

/// Each config name, mapped to its first definition.
fn first_definitions(config: &[ast::ConfigEntry]) -> HashMap<&str, &ast::Ident> {
    let mut names = HashMap::with_capacity(config.len());
    for entry in config {
        names.entry(entry.name.name.as_str()).or_insert(&entry.name);
    }
    names
}

/// The call a layer declaration makes (the repeated block, for `repeat`).
fn layer_call(decl: &LayerDecl) -> &ast::Call {
    match &decl.value {
        ast::LayerExpr::Call(c) => c,
        ast::LayerExpr::Repeat { body, .. } => body,
    }
}

/// Two different kinds of definition with one name (a config value and an input, a layer and an input, ...); the
/// later one in the file is the one labelled as the repeat.
fn clash(a: (&str, &ast::Ident), b: (&str, &ast::Ident)) -> Diagnostic {
    let (first, second) =
        if (a.1.span.start, a.1.span.end) <= (b.1.span.start, b.1.span.end) { (a, b) } else { (b, a) };
    Diagnostic::error(Code::E0105, format!("name `{}` is defined more than once", second.1.name))
        .primary(second.1.span, format!("defined again here, as {} {}", article(second.0), second.0))
        .secondary(first.1.span, format!("first defined here, as {} {}", article(first.0), first.0))
        .help(if first.0 == "layer" || second.0 == "layer" {
            "rename one of them: a layer named like a config value or input would hide it"
        } else {
            "rename one of them"
        })
}

/// "a" or "an" before a word.
fn article(word: &str) -> &'static str {
    if word.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { "a" }
}

fn duplicate(what: &str, name: &ast::Ident, previous: Span) -> Diagnostic {
    Diagnostic::error(Code::E0105, format!("{what} `{}` is defined more than once", name.name))
        .primary(name.span, "defined again here")
        .secondary(previous, "first defined here")
        .help("rename or remove one of them")
}

/// A `--set` value that does not fit its config value: the label sits on the value it would replace.
fn bad_override(o: &Override, reason: &str, entry: &ast::ConfigEntry, default: &Scalar) -> Diagnostic {
    let kind = match default {
        Scalar::Int(_) => "an integer",
        Scalar::Float(_) => "a number",
        Scalar::Bool(_) => "`true` or `false`",
        Scalar::Str(_) => "a string",
    };
    Diagnostic::error(Code::E0302, format!("bad value for `--set {}`: `{}` {reason}", o.name, o.value))
        .primary(entry.value.span, format!("`{}` is {kind} ({default} here)", entry.name.name))
        .help(format!("write `--set {}=` followed by {kind}", o.name))
}

/// The error for a shape of more than [`MAX_RANK`] dimensions (an input's type, or a list).
pub(crate) fn too_many_dimensions(dims: usize, span: Span) -> Diagnostic {
    Diagnostic::error(
        Code::E0402,
        format!("a shape of {} dimensions: tensors have at most {MAX_RANK}", group_digits(dims as u128)),
    )
    .primary(span, "too many dimensions")
}

/// Parses a `--set` value to the type of the config value's default; on failure, says why in words.
fn parse_override(raw: &str, default: &Scalar) -> Result<Scalar, String> {
    use std::num::IntErrorKind;
    let numeric = matches!(default, Scalar::Int(_) | Scalar::Float(_));
    if numeric && !underscores_between_digits(raw) {
        return Err("has a `_` that is not between two digits".to_string());
    }
    let clean: String = raw.chars().filter(|c| *c != '_').collect();
    match default {
        Scalar::Int(_) => clean.parse::<i64>().map(Scalar::Int).map_err(|e| match e.kind() {
            IntErrorKind::PosOverflow | IntErrorKind::NegOverflow => {
                format!("is too large: integers range from {} to {}", i64::MIN, i64::MAX)
            }
            _ => "is not an integer".to_string(),
        }),
        Scalar::Float(_) => match clean.parse::<f64>() {
            Ok(v) if v.is_finite() => Ok(Scalar::Float(v)),
            Ok(_) => Err("is not a finite number".to_string()),
            Err(_) => Err("is not a number".to_string()),
        },
        Scalar::Bool(_) => match raw {
            "true" => Ok(Scalar::Bool(true)),
            "false" => Ok(Scalar::Bool(false)),
            _ => Err("is not `true` or `false`".to_string()),
        },
        Scalar::Str(_) => Ok(Scalar::Str(raw.to_string())),
    }
}

/// Whether each run of `_` in a number stands between two digits (`1_024`, `1__000.5`), as in an integer literal's
/// `_` after its first digit; `_1`, `1_` and `1_.5` are not numbers.
fn underscores_between_digits(raw: &str) -> bool {
    let bytes = raw.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'_' {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && bytes[i] == b'_' {
            i += 1;
        }
        let digit_before = start > 0 && bytes[start - 1].is_ascii_digit();
        let digit_after = bytes.get(i).is_some_and(u8::is_ascii_digit);
        if !(digit_before && digit_after) {
            return false;
        }
    }
    true
}

/// Calls `f` with every name an expression reads, in order.
fn config_names<'e>(expr: &'e ast::Expr, f: &mut impl FnMut(&'e str)) {
    match &expr.kind {
        ast::ExprKind::Name(name) => f(name),
        ast::ExprKind::Call(call) => call.args.iter().for_each(|a| config_names(&a.value, f)),
        ast::ExprKind::List(items) => items.iter().for_each(|i| config_names(i, f)),
        ast::ExprKind::Neg(inner) => config_names(inner, f),
        ast::ExprKind::Binary { lhs, rhs, .. } => {
            config_names(lhs, f);
            config_names(rhs, f);
        }
        ast::ExprKind::Int(_) | ast::ExprKind::Float(_) | ast::ExprKind::Str(_) | ast::ExprKind::Bool(_) => {}
        ast::ExprKind::Invalid => {}
    }
}
