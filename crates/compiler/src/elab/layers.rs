//! Layers: instantiating declarations (creating parameters, blocks and repeats) and applying them to tensors.

use super::args::Signature;
use super::{Elab, Fail, Frame, Layer, MAX_INSTANCES, MAX_NODES, MAX_REPEAT, Module, Place, R, Value};
use crate::diag::{Code, Diagnostic};
use crate::ir::{DType, Dim, Factor, Init, Op, Param, ParamId, ParamRole, TensorType};
use crate::syntax::ast::{Call, ExprKind, LayerDecl, LayerExpr};
use optimus_plan::span::Span;
use optimus_plan::text::group_digits;
use petgraph::graph::NodeIndex;
use std::collections::HashMap;

/// Built-in layer kinds: operators that own parameters.
pub const LAYER_KINDS: [&str; 5] = ["linear", "layernorm", "rms_norm", "embedding", "position_embedding"];

/// A built-in layer kind (one that owns parameters); matches on it are exhaustive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LayerKind {
    Linear,
    LayerNorm,
    RmsNorm,
    Embedding,
    PositionEmbedding,
}

impl LayerKind {
    /// The kind of this name: the names of [`LAYER_KINDS`], in order.
    fn named(name: &str) -> Option<LayerKind> {
        const KINDS: [LayerKind; 5] = [
            LayerKind::Linear,
            LayerKind::LayerNorm,
            LayerKind::RmsNorm,
            LayerKind::Embedding,
            LayerKind::PositionEmbedding,
        ];
        LAYER_KINDS.iter().position(|k| *k == name).map(|i| KINDS[i])
    }
}

/// Deepest nesting of block instances.
const MAX_BLOCK_DEPTH: usize = 256;

pub fn is_layer_kind(name: &str) -> bool {
    LAYER_KINDS.contains(&name)
}

/// Default epsilon of `rms_norm` (Hugging Face's `LlamaRMSNorm`).
const DEFAULT_RMS_NORM_EPS: f64 = 1e-6;

/// Default standard deviation of normally initialised weights (GPT-2, BERT).
const DEFAULT_STD: f64 = 0.02;

/// A layer's path: its module's path and its name.
pub(super) fn join(path: &str, name: &str) -> String {
    if path.is_empty() { name.to_string() } else { format!("{path}.{name}") }
}

impl<'f> Elab<'f> {
    fn module_frame(&self, module: usize) -> Frame {
        Frame { module: Some(module), locals: HashMap::new(), place: Place::Declaration }
    }

    pub(crate) fn instantiate_layer(&mut self, module: usize, decl: &'f LayerDecl) -> R<Layer> {
        let path = join(&self.modules[module].path, &decl.name.name);
        match &decl.value {
            LayerExpr::Call(call) => {
                if let Some(&block) = self.blocks.get(&call.callee.name) {
                    if decl.checkpoint {
                        self.mark_checkpointed(&path);
                    }
                    return self.instantiate_block(block, call, module, path).map(Layer::Block);
                }
                if decl.checkpoint && is_layer_kind(&call.callee.name) {
                    return self.fail(
                        Diagnostic::error(
                            Code::E0102,
                            format!(
                                "`checkpoint` marks block instances, and `{}` is a built-in layer",
                                call.callee.name
                            ),
                        )
                        .primary(call.callee.span, "a built-in layer")
                        .help("put the layer in a block and mark the block, or its layer declaration, `checkpoint`"),
                    );
                }
                self.instantiate_builtin(module, call, &path, decl.span)
            }
            LayerExpr::Repeat { count, body, .. } => {
                let mut frame = self.module_frame(module);
                let n = self.expect_int(count, &mut frame)?;
                if !(1..=MAX_REPEAT).contains(&n) {
                    return self.fail(
                        Diagnostic::error(
                            Code::E0202,
                            format!("`repeat` needs a count from 1 to {MAX_REPEAT}, but this is {n}"),
                        )
                        .primary(count.span, format!("this is {n}")),
                    );
                }
                let Some(&block) = self.blocks.get(&body.callee.name) else {
                    if self.resolved_errors.contains(&body.callee.span) {
                        return Err(Fail::Reported);
                    }
                    return self.fail(self.not_a_block(body));
                };
                let mut modules = Vec::new();
                for k in 0..n {
                    let before = self.instances;
                    if decl.checkpoint {
                        self.mark_checkpointed(&format!("{path}.{k}"));
                    }
                    modules.push(self.instantiate_block(block, body, module, format!("{path}.{k}"))?);
                    if k == 0 {
                        self.check_repeat_cost(n, self.instances - before, count.span)?;
                    }
                }
                Ok(Layer::Repeat(modules))
            }
        }
    }

    /// Stops before making `count` copies of a block when, at `per_copy` instances each (measured on the first),
    /// they would pass [`MAX_INSTANCES`]: the limit is reported at once instead of after minutes of work.
    fn check_repeat_cost(&mut self, count: i64, per_copy: usize, at: Span) -> R<()> {
        let copies = usize::try_from(count).unwrap_or(usize::MAX);
        let total = self.instances.saturating_add(per_copy.saturating_mul(copies.saturating_sub(1)));
        if total <= MAX_INSTANCES {
            return Ok(());
        }
        self.report(
            Diagnostic::error(
                Code::E0402,
                format!(
                    "`repeat({count})` would make more than {} block and layer instances",
                    group_digits(MAX_INSTANCES as u128)
                ),
            )
            .primary(at, format!("{count} copies of {per_copy} instances each"))
            .note(format!(
                "the model would have at least {} instances; the most one model may have is {}",
                group_digits(total as u128),
                group_digits(MAX_INSTANCES as u128)
            ))
            .help("reduce `repeat` counts, or the number of copies blocks make of each other"),
        );
        Err(Fail::Abort)
    }

    /// Stops before running `copies` copies of a block's forward when, at `per_copy` operators each (measured on
    /// the first), they would pass [`MAX_NODES`].
    fn check_repeat_nodes(&mut self, copies: usize, per_copy: usize, at: Span) -> R<()> {
        let total = self.graph.node_count().saturating_add(per_copy.saturating_mul(copies.saturating_sub(1)));
        if total <= MAX_NODES {
            return Ok(());
        }
        self.report(
            Diagnostic::error(
                Code::E0402,
                format!("the model elaborates to more than {} operators", group_digits(MAX_NODES as u128)),
            )
            .primary(at, format!("{copies} copies of {per_copy} operators each"))
            .note(format!("the model would have at least {} operators", group_digits(total as u128)))
            .help("reduce `repeat` counts"),
        );
        Err(Fail::Abort)
    }

    pub(crate) fn not_a_block(&self, call: &Call) -> Diagnostic {
        let name = &call.callee.name;
        let mut d = Diagnostic::error(Code::E0102, format!("`repeat` needs a block, but `{name}` is not one"))
            .primary(call.callee.span, "not a block");
        if let Some(s) = super::suggest(name, self.blocks.keys().map(String::as_str)) {
            d = d.help(format!("did you mean `{s}`?"));
        }
        d
    }

    /// Instantiates a user block: binds its parameters from the call, then its layers.
    /// Records that the block instance at `path` is recomputed in the backward pass.
    fn mark_checkpointed(&mut self, path: &str) {
        self.checkpointed_blocks.push(path.to_string());
    }

    fn instantiate_block(&mut self, block: usize, call: &'f Call, parent: usize, path: String) -> R<usize> {
        if self.recursive.contains(&block) || self.blocks_with_repeated_params.contains(&block) {
            return Err(Fail::Reported);
        }
        if self.file.blocks.get(block).is_some_and(|b| b.checkpoint) {
            self.mark_checkpointed(&path);
        }
        self.count_instance(call.span)?;
        if path.matches('.').count() > MAX_BLOCK_DEPTH {
            return self.fail(
                Diagnostic::error(Code::E0402, format!("blocks are nested more than {MAX_BLOCK_DEPTH} deep"))
                    .primary(call.span, "too deep here"),
            );
        }
        let def = &self.file.blocks[block];
        let names: Vec<&str> = def.params.iter().map(|p| p.name.name.as_str()).collect();
        let sig = Signature { name: &def.name.name, params: &names, required: 0 };
        let bound = self.bind(call, &sig)?;
        let mut env = HashMap::new();
        // Parameters whose value is missing or failed (each reported once): later defaults see invalid values.
        let mut failed: Vec<&str> = Vec::new();
        let mut parent_frame = self.module_frame(parent);
        let mut ok = true;
        for (i, param) in def.params.iter().enumerate() {
            let value = match (bound.get(i), &param.default) {
                (Some(arg), _) => self.eval(arg, &mut parent_frame),
                (None, Some(default)) => {
                    let mut frame = Frame::scalars(Place::Default);
                    frame.locals = env
                        .iter()
                        .map(|(k, (v, label)): (&String, &(crate::ir::Scalar, Option<String>))| {
                            (k.clone(), Value::Scalar(v.clone(), label.clone().or_else(|| Some(k.clone()))))
                        })
                        .chain(failed.iter().map(|name| (name.to_string(), Value::Poison)))
                        .collect();
                    self.eval(default, &mut frame)
                }
                (None, None) => {
                    self.report(
                        Diagnostic::error(
                            Code::E0103,
                            format!("block `{}` is missing argument `{}`", def.name.name, param.name.name),
                        )
                        .primary(call.span, format!("missing `{}`", param.name.name))
                        .secondary(param.name.span, "parameter declared here"),
                    );
                    failed.push(&param.name.name);
                    ok = false;
                    continue;
                }
            };
            match value {
                Ok(Value::Scalar(s, label)) => {
                    env.insert(param.name.name.clone(), (s, label));
                }
                Ok(Value::Poison) | Err(Fail::Reported) => {
                    failed.push(&param.name.name);
                    ok = false;
                }
                Err(Fail::Abort) => return Err(Fail::Abort),
                Ok(other) => {
                    let found = self.describe(&other);
                    let span = bound.get(i).map_or(call.span, |e| e.span);
                    self.report(
                        Diagnostic::error(
                            Code::E0107,
                            format!("block parameters are numbers, booleans or strings; found {found}"),
                        )
                        .primary(span, "not a scalar")
                        .help("pass tensors to the block's forward instead"),
                    );
                    failed.push(&param.name.name);
                    ok = false;
                }
            }
        }
        if !ok {
            return Err(Fail::Reported);
        }
        let id = self.modules.len();
        self.modules.push(Module::new(Some(block), path, env));
        let file = self.file;
        self.instantiate_layers(id, &file.blocks[block].layers)?;
        Ok(id)
    }

    /// Instantiates a built-in layer kind, creating its parameters.
    fn instantiate_builtin(&mut self, module: usize, call: &'f Call, path: &str, span: Span) -> R<Layer> {
        self.count_instance(call.span)?;
        let mut frame = self.module_frame(module);
        let Some(kind) = LayerKind::named(call.callee.name.as_str()) else {
            if self.resolved_errors.contains(&call.callee.span) {
                return Err(Fail::Reported);
            }
            let d = self.unknown_layer_kind(call);
            return self.fail(d);
        };
        match kind {
            LayerKind::Linear => self.instantiate_linear(module, call, path, span, &mut frame),
            LayerKind::LayerNorm => {
                let sig = Signature { name: "layernorm", params: &["dim", "eps"], required: 1 };
                let b = self.bind(call, &sig)?;
                let dim = self.eval_dim(b.get(0).ok_or(Fail::Reported)?, &mut frame);
                let eps = match b.get(1) {
                    Some(e) => self.positive_eps(
                        e,
                        &mut frame,
                        "layernorm divides by sqrt(variance + eps); the usual value is 1e-5",
                    ),
                    None => Ok(1e-5),
                };
                let (dim, eps) = (dim?, eps?);
                let size = dim.size;
                let weight =
                    self.new_param(path, "weight", vec![dim.clone()], Init::Ones, ParamRole::NormWeight, span)?;
                let bias = self.new_param(path, "bias", vec![dim], Init::Zeros, ParamRole::NormBias, span)?;
                Ok(Layer::Norm { weight, bias, dim: size, eps, span })
            }
            LayerKind::RmsNorm => self.instantiate_rms_norm(call, path, span, &mut frame),
            LayerKind::Embedding | LayerKind::PositionEmbedding => {
                let name = if kind == LayerKind::Embedding { "embedding" } else { "position_embedding" };
                let sig = Signature { name, params: &["rows", "width", "std", "padding_idx"], required: 2 };
                let b = self.bind(call, &sig)?;
                let rows = self.eval_dim(b.get(0).ok_or(Fail::Reported)?, &mut frame);
                let width = self.eval_dim(b.get(1).ok_or(Fail::Reported)?, &mut frame);
                let std = self.optional_std(b.get(2), &mut frame);
                let (rows, width) = (rows?, width?);
                let padding = self.padding_index(b.get(3), kind, rows.size, &mut frame);
                let shape = vec![rows, width];
                let (std, padding) = (std?, padding?);
                if kind == LayerKind::Embedding {
                    let table =
                        self.new_param(path, "weight", shape, Init::Normal { std }, ParamRole::Embedding, span)?;
                    Ok(Layer::Embedding { table, padding })
                } else {
                    let table = self.new_param(
                        path,
                        "weight",
                        shape,
                        Init::Normal { std },
                        ParamRole::PositionEmbedding,
                        span,
                    )?;
                    Ok(Layer::PositionEmbedding { table, span })
                }
            }
        }
    }

    /// `rms_norm(dim, eps: e)`: one weight (ones), no bias; eps defaults to Llama's 1e-6.
    fn instantiate_rms_norm(&mut self, call: &'f Call, path: &str, span: Span, frame: &mut Frame) -> R<Layer> {
        let sig = Signature { name: "rms_norm", params: &["dim", "eps"], required: 1 };
        let b = self.bind(call, &sig)?;
        let dim = self.eval_dim(b.get(0).ok_or(Fail::Reported)?, frame);
        let eps = match b.get(1) {
            Some(e) => {
                self.positive_eps(e, frame, "rms_norm divides by sqrt(mean(x^2) + eps); Llama uses 1e-5 or 1e-6")
            }
            None => Ok(DEFAULT_RMS_NORM_EPS),
        };
        let (dim, eps) = (dim?, eps?);
        let size = dim.size;
        let weight = self.new_param(path, "weight", vec![dim], Init::Ones, ParamRole::NormWeight, span)?;
        Ok(Layer::RmsNorm { weight, dim: size, eps, span })
    }

    /// `layer x = k(...)` where `k` is neither a layer kind nor a block.
    pub(crate) fn unknown_layer_kind(&self, call: &Call) -> Diagnostic {
        let name = call.callee.name.as_str();
        let mut candidates: Vec<&str> = LAYER_KINDS.to_vec();
        candidates.extend(self.blocks.keys().map(String::as_str));
        let mut d = Diagnostic::error(Code::E0102, format!("unknown layer kind `{name}`"))
            .primary(call.callee.span, "not a layer kind or block")
            .note(format!("layer kinds: {}", LAYER_KINDS.join(", ")));
        if name == "repeat" {
            d = d.help("write `repeat(n) Block()` to stack n copies of a block");
        } else if let Some(s) = super::suggest(name, candidates) {
            d = d.help(format!("did you mean `{s}`?"));
        } else if super::ops::is_function(name) {
            d = d.help(format!("`{name}` has no parameters: call it directly in a forward"));
        }
        d
    }

    /// `padding_idx: p` of an embedding (torch's `padding_idx`): a row in 0..rows whose gradient is
    /// always zero. Position tables take none.
    fn padding_index(
        &mut self,
        expr: Option<&crate::syntax::ast::Expr>,
        kind: LayerKind,
        rows: u64,
        frame: &mut Frame,
    ) -> R<Option<u64>> {
        let Some(e) = expr else { return Ok(None) };
        if kind != LayerKind::Embedding {
            return self.fail(
                Diagnostic::error(Code::E0202, "a position table has no padding row")
                    .primary(e.span, "`padding_idx` belongs to `embedding`"),
            );
        }
        let index = self.expect_int(e, frame)?;
        match u64::try_from(index) {
            Ok(p) if p < rows => Ok(Some(p)),
            _ => self.fail(
                Diagnostic::error(Code::E0202, format!("`padding_idx` must name one of the {rows} rows, not {index}"))
                    .primary(e.span, format!("this is {index}"))
                    .help(format!("a row index in 0..{rows}, such as the tokenizer's pad id")),
            ),
        }
    }

    fn optional_std(&mut self, expr: Option<&crate::syntax::ast::Expr>, frame: &mut Frame) -> R<f64> {
        let Some(e) = expr else { return Ok(DEFAULT_STD) };
        let std = self.expect_float(e, frame)?;
        if std < 0.0 {
            return self.fail(
                Diagnostic::error(Code::E0202, "`std` must not be negative").primary(e.span, format!("this is {std}")),
            );
        }
        Ok(std)
    }

    fn instantiate_linear(
        &mut self,
        module: usize,
        call: &'f Call,
        path: &str,
        span: Span,
        frame: &mut Frame,
    ) -> R<Layer> {
        let sig =
            Signature { name: "linear", params: &["in", "out", "bias", "std", "tied", "orientation"], required: 2 };
        let b = self.bind(call, &sig)?;
        let in_dim = self.eval_dim(b.get(0).ok_or(Fail::Reported)?, frame);
        let out_dim = self.eval_out_dim(b.get(1).ok_or(Fail::Reported)?, frame);
        let bias = match b.get(2) {
            Some(e) => self.expect_bool(e, frame),
            None => Ok(true),
        };
        let std = self.optional_std(b.get(3), frame);
        let stored_out_in = self.linear_orientation(b.get(5), b.get(4).is_some(), frame);
        let (in_dim, out_dim, bias, std, stored_out_in) = (in_dim?, out_dim?, bias?, std?, stored_out_in?);
        let (weight, transpose) = match b.get(4) {
            Some(tied) => (self.tied_table(module, tied, &in_dim, &out_dim)?, true),
            None => {
                let shape = vec![in_dim.clone(), out_dim.clone()];
                let id = self.new_param(path, "weight", shape, Init::Normal { std }, ParamRole::LinearWeight, span)?;
                self.params[id.0 as usize].checkpoint_transposed = stored_out_in;
                (id, false)
            }
        };
        let bias = match bias {
            true => {
                Some(self.new_param(path, "bias", vec![out_dim.clone()], Init::Zeros, ParamRole::LinearBias, span)?)
            }
            false => None,
        };
        Ok(Layer::Linear { weight, bias, in_dim, out_dim, transpose, span })
    }

    /// Whether a linear's weight is stored `[out, in]` in checkpoints: its `orientation` argument, else the
    /// model's `linear_orientation`, else `[in, out]` (GPT-2's Conv1D). A tied linear has no weight of its own.
    fn linear_orientation(
        &mut self,
        expr: Option<&'f crate::syntax::ast::Expr>,
        tied: bool,
        frame: &mut Frame,
    ) -> R<bool> {
        let Some(e) = expr else { return Ok(self.model_out_in()) };
        let v = self.eval(e, frame)?;
        let out_in = match self.as_str(&v, e)?.as_str() {
            "out_in" => true,
            "in_out" => false,
            other => return self.fail(bad_orientation(other, e.span)),
        };
        if tied {
            return self.fail(
                Diagnostic::error(Code::E0103, "a tied linear has no weight of its own to orient")
                    .primary(e.span, "`orientation` cannot be given with `tied`")
                    .note("the tied table keeps the embedding's [rows, width] layout"),
            );
        }
        Ok(out_in)
    }

    /// A linear's output size: an integer, or a list of factors such as `[3, heads, head]`.
    fn eval_out_dim(&mut self, expr: &crate::syntax::ast::Expr, frame: &mut Frame) -> R<Dim> {
        let ExprKind::List(items) = &expr.kind else {
            return self.eval_dim(expr, frame);
        };
        if items.is_empty() {
            return self.fail(
                Diagnostic::error(Code::E0202, "a factored size needs at least one factor").primary(expr.span, "empty"),
            );
        }
        let mut factors = Vec::new();
        let mut failed = false;
        for item in items {
            match self.eval_dim(item, frame) {
                Ok(d) => factors.push(Factor { size: d.size, label: d.label }),
                Err(Fail::Abort) => return Err(Fail::Abort),
                Err(Fail::Reported) => failed = true,
            }
        }
        if failed {
            return Err(Fail::Reported);
        }
        let size = factors.iter().try_fold(1u64, |acc, f| acc.checked_mul(f.size));
        let Some(size) = size else {
            return self.fail(
                Diagnostic::error(Code::E0203, "integer overflow")
                    .primary(expr.span, "the product of these factors is too large"),
            );
        };
        Ok(Dim { size, label: None, factors })
    }

    /// Resolves `tied: wte`: the embedding table to reuse, which must be [out, in].
    fn tied_table(
        &mut self,
        module: usize,
        expr: &crate::syntax::ast::Expr,
        in_dim: &Dim,
        out_dim: &Dim,
    ) -> R<ParamId> {
        let name = match &expr.kind {
            ExprKind::Name(name) => name,
            ExprKind::Str(path) => return self.tied_by_path(path, expr.span, in_dim, out_dim),
            _ => {
                return self.fail(
                    Diagnostic::error(
                        Code::E0107,
                        "`tied` takes an embedding layer: its name, or its path as a string",
                    )
                    .primary(expr.span, "not a layer name")
                    .help("write `tied: wte`, or `tied: \"bert.embeddings.word_embeddings\"` for a nested layer"),
                );
            }
        };
        let found = [module, 0].iter().find_map(|&m| self.modules.get(m)?.layer(name).cloned());
        let table = match found {
            Some(Layer::Embedding { table, .. }) => table,
            Some(Layer::Poison) => return Err(Fail::Reported),
            Some(_) => {
                return self.fail(
                    Diagnostic::error(
                        Code::E0107,
                        format!("`tied` needs an embedding layer, but `{name}` is another kind of layer"),
                    )
                    .primary(expr.span, "not an embedding"),
                );
            }
            None => {
                let embeddings: Vec<String> = [module, 0]
                    .iter()
                    .filter_map(|&m| self.modules.get(m))
                    .flat_map(|m| m.layers.iter().filter(|(_, l)| matches!(l, Layer::Embedding { .. })))
                    .map(|(n, _)| n.clone())
                    .collect();
                let mut d = Diagnostic::error(Code::E0101, format!("unknown layer `{name}`"))
                    .primary(expr.span, "no embedding layer of this name is declared before this line");
                if let Some(s) = super::suggest(name, embeddings.iter().map(String::as_str)) {
                    d = d.help(format!("did you mean `{s}`?"));
                }
                return self.fail(d);
            }
        };
        self.check_tied_shape(table, name, in_dim, out_dim, expr.span)
    }

    /// Resolves `tied: "path.to.layer"` against the embedding tables declared so far.
    fn tied_by_path(&mut self, path: &str, at: Span, in_dim: &Dim, out_dim: &Dim) -> R<ParamId> {
        let weight = format!("{path}.weight");
        let found = self.params.iter().position(|p| p.name == weight && p.role == ParamRole::Embedding);
        let Some(index) = found else {
            if self.poisoned_layers.contains(path) {
                return Err(Fail::Reported);
            }
            let tables: Vec<&str> = self
                .params
                .iter()
                .filter(|p| p.role == ParamRole::Embedding)
                .filter_map(|p| p.name.strip_suffix(".weight"))
                .collect();
            let mut d =
                Diagnostic::error(Code::E0101, format!("no embedding layer `{path}` is declared before this line"))
                    .primary(at, "unknown embedding layer");
            if let Some(s) = super::suggest(path, tables.iter().copied()) {
                d = d.help(format!("did you mean \"{s}\"?"));
            }
            return self.fail(d);
        };
        let table = ParamId(u32::try_from(index).unwrap_or(u32::MAX));
        self.check_tied_shape(table, path, in_dim, out_dim, at)
    }

    /// A tied linear(in, out) needs the table to be [out, in].
    fn check_tied_shape(&mut self, table: ParamId, name: &str, in_dim: &Dim, out_dim: &Dim, span: Span) -> R<ParamId> {
        let table_ty = self.params[table.0 as usize].ty.clone();
        let rows = table_ty.shape[0].size;
        let width = table_ty.shape[1].size;
        if rows != out_dim.size || width != in_dim.size {
            let table_span = self.params[table.0 as usize].span;
            return self.fail(
                Diagnostic::error(Code::E0201,
                    format!("shape mismatch: a tied linear({}, {}) needs a [{}, {}] table, but `{name}` is [{rows}, {width}]", in_dim.size, out_dim.size, out_dim.size, in_dim.size),
                )
                .primary(span, format!("this table is [{rows}, {width}], not [{}, {}]", out_dim.size, in_dim.size))
                .secondary(table_span, format!("`{name}` is declared here")),
            );
        }
        Ok(table)
    }

    fn new_param(
        &mut self,
        path: &str,
        leaf: &str,
        shape: Vec<Dim>,
        init: Init,
        role: ParamRole,
        span: Span,
    ) -> R<ParamId> {
        let ty = TensorType { dtype: DType::F32, shape };
        let name = join(path, leaf);
        self.check_param_size(&name, leaf, &ty, span)?;
        let id = ParamId(u32::try_from(self.params.len()).unwrap_or(u32::MAX));
        let checkpoint_transposed = false;
        self.params.push(Param { checkpoint: name.clone(), name, ty, init, role, span, checkpoint_transposed });
        Ok(id)
    }

    /// Checks that a parameter fits [`super::max_elements`], naming it by its full name (§17). Each declaration
    /// is reported once for each shape too large, at its first instance: the other copies of a repeated block fail
    /// silently.
    fn check_param_size(&mut self, name: &str, leaf: &str, ty: &TensorType, span: Span) -> R<()> {
        if super::fitting_elements(ty).is_some() {
            return Ok(());
        }
        let declaration = (span, leaf.to_string(), ty.sizes());
        if !self.params_reported_too_large.insert(declaration) {
            return Err(Fail::Reported);
        }
        self.check_tensor_size(&format!("parameter `{name}`"), ty, span)
    }

    /// The graph node that reads a parameter (one per parameter, made on first use).
    fn param_node(&mut self, id: ParamId) -> R<NodeIndex> {
        if let Some(&n) = self.param_nodes.get(&id) {
            return Ok(n);
        }
        let p = &self.params[id.0 as usize];
        let (ty, span, scope) = (p.ty.clone(), p.span, p.name.rsplit_once('.').map_or("", |(s, _)| s).to_string());
        let n = self.add_node(Op::Param { id }, ty, span, &scope, &[])?;
        self.param_nodes.insert(id, n);
        Ok(n)
    }

    /// Applies a layer to the tensors of a call in a forward.
    pub(crate) fn apply_layer(&mut self, layer: &Layer, call: &Call, frame: &mut Frame) -> R<Value> {
        if Self::is_poison(layer) {
            return self.check_args(call, frame).and(Err(Fail::Reported));
        }
        if let Layer::Block(module) = layer {
            let args = self.tensor_args(call, frame)?;
            return self.call_module(*module, args, call);
        }
        let name = call.callee.name.clone();
        let sig = Signature { name: &name, params: &["x"], required: 1 };
        let a = self.bind_eval(call, &sig, frame)?;
        let (arg, value) = a.required(0)?;
        let x = self.as_tensor(value, arg)?;
        let scope = self.scope_of(frame);
        let scope = join(&scope, &name);
        match layer {
            Layer::Linear { weight, bias, in_dim, out_dim, transpose, span } => {
                self.expect_float_tensor(x, arg.span)?;
                self.expect_last_dim(x, in_dim.size, arg.span, *span, &name)?;
                let mut ty = self.ty(x).clone();
                if let Some(last) = ty.shape.last_mut() {
                    *last = out_dim.clone();
                }
                let mut operands = vec![x, self.param_node(*weight)?];
                if let Some(bias) = bias {
                    operands.push(self.param_node(*bias)?);
                }
                let op = Op::Linear { bias: bias.is_some(), transpose_weight: *transpose };
                self.add_node(op, ty, call.span, &scope, &operands).map(Value::Tensor)
            }
            Layer::Norm { weight, bias, dim, eps, span } => {
                self.expect_float_tensor(x, arg.span)?;
                self.expect_last_dim(x, *dim, arg.span, *span, &name)?;
                let ty = self.ty(x).clone();
                let operands = [x, self.param_node(*weight)?, self.param_node(*bias)?];
                self.add_node(Op::LayerNorm { eps: *eps }, ty, call.span, &scope, &operands).map(Value::Tensor)
            }
            Layer::RmsNorm { weight, dim, eps, span } => {
                self.expect_float_tensor(x, arg.span)?;
                self.expect_last_dim(x, *dim, arg.span, *span, &name)?;
                let ty = self.ty(x).clone();
                let operands = [x, self.param_node(*weight)?];
                self.add_node(Op::RmsNorm { eps: *eps }, ty, call.span, &scope, &operands).map(Value::Tensor)
            }
            Layer::Embedding { table, padding } => {
                self.expect_int_tensor(x, arg.span)?;
                let mut ty = self.ty(x).clone();
                let width = self.params[table.0 as usize].ty.shape[1].clone();
                ty.dtype = DType::F32;
                ty.shape.push(width);
                let operands = [x, self.param_node(*table)?];
                let op = Op::Embedding { padding: *padding };
                self.add_node(op, ty, call.span, &scope, &operands).map(Value::Tensor)
            }
            Layer::PositionEmbedding { table, span } => {
                self.apply_position_embedding(x, *table, arg.span, *span, call, &scope)
            }
            Layer::Repeat(modules) => self.apply_repeat(modules, x, call),
            Layer::Block(_) | Layer::Poison => Err(Fail::Reported),
        }
    }

    fn apply_position_embedding(
        &mut self,
        ids: NodeIndex,
        table: ParamId,
        arg: Span,
        decl: Span,
        call: &Call,
        scope: &str,
    ) -> R<Value> {
        self.expect_int_tensor(ids, arg)?;
        let table_ty = self.params[table.0 as usize].ty.clone();
        let mut ty = self.ty(ids).clone();
        let Some(seq) = ty.shape.last().cloned() else {
            return self.fail(
                Diagnostic::error(Code::E0201, "position_embedding needs ids with a sequence dimension")
                    .primary(arg, "this is a scalar"),
            );
        };
        let rows = table_ty.shape[0].size;
        if seq.size > rows {
            return self.fail(
                Diagnostic::error(
                    Code::E0201,
                    format!("sequence length {} exceeds the position table's {rows} rows", seq.size),
                )
                .primary(arg, format!("sequences of {} positions", seq.size))
                .secondary(decl, format!("the table has {rows} rows"))
                .help("make the sequence length at most the table size (`seq <= context`)"),
            );
        }
        ty.dtype = DType::F32;
        ty.shape.push(table_ty.shape[1].clone());
        let operands = [ids, self.param_node(table)?];
        self.add_node(Op::PositionEmbedding, ty, call.span, scope, &operands).map(Value::Tensor)
    }

    fn apply_repeat(&mut self, modules: &[usize], x: NodeIndex, call: &Call) -> R<Value> {
        let mut current = Value::Tensor(x);
        for (k, &m) in modules.iter().enumerate() {
            let before = match &current {
                Value::Tensor(n) => self.ty(*n).clone(),
                _ => return Err(Fail::Reported),
            };
            let nodes_before = self.graph.node_count();
            if let Some(module) = self.modules.get(m) {
                self.repeated_blocks.push(module.path.clone());
            }
            current = self.call_module(m, vec![current], call)?;
            if k == 0 {
                self.check_repeat_nodes(modules.len(), self.graph.node_count() - nodes_before, call.span)?;
                let after = match &current {
                    Value::Tensor(n) => self.ty(*n).clone(),
                    Value::Poison => return Err(Fail::Reported),
                    other => {
                        let found = self.describe(other);
                        return self.fail(
                            Diagnostic::error(
                                Code::E0107,
                                format!("a repeated block must return a tensor, but it returned {found}"),
                            )
                            .primary(call.span, "repeated here"),
                        );
                    }
                };
                // Sizes and dtype only: labels and factors record where a size came from, not what it is.
                if after.sizes() != before.sizes() || after.dtype != before.dtype {
                    return self.fail(
                        Diagnostic::error(
                            Code::E0201,
                            format!(
                                "shape mismatch: a repeated block must return its input's shape {}, but returns {}",
                                super::ops::show_type(&before),
                                super::ops::show_type(&after)
                            ),
                        )
                        .primary(
                            call.args.first().map_or(call.span, |a| a.span),
                            format!("this is {}", super::ops::show_type(&before)),
                        )
                        .secondary(
                            self.return_span(m).unwrap_or(call.span),
                            format!("the block returns {}", super::ops::show_type(&after)),
                        ),
                    );
                }
            }
        }
        Ok(current)
    }

    /// Where a block instance's forward returns its value.
    fn return_span(&self, module: usize) -> Option<Span> {
        let block = &self.file.blocks[self.modules.get(module)?.block?];
        block.forwards.first()?.body.iter().find_map(|s| match s {
            crate::syntax::ast::Stmt::Return { value, .. } => Some(value.span),
            _ => None,
        })
    }

    fn tensor_args(&mut self, call: &Call, frame: &mut Frame) -> R<Vec<Value>> {
        let mut args = Vec::new();
        let mut failed = false;
        for arg in &call.args {
            if let Some(name) = &arg.name {
                self.report(
                    Diagnostic::error(
                        Code::E0104,
                        format!("`{}` takes tensors by position, not by keyword", call.callee.name),
                    )
                    .primary(name.span, "keyword not allowed here"),
                );
                failed = true;
                continue;
            }
            match self.eval(&arg.value, frame) {
                Ok(v) => args.push(v),
                Err(Fail::Abort) => return Err(Fail::Abort),
                Err(Fail::Reported) => failed = true,
            }
        }
        if failed { Err(Fail::Reported) } else { Ok(args) }
    }

    fn expect_last_dim(&mut self, x: NodeIndex, expected: u64, arg: Span, decl: Span, layer: &str) -> R<()> {
        let ty = self.ty(x).clone();
        match ty.shape.last() {
            Some(d) if d.size == expected => Ok(()),
            _ => self.fail(
                Diagnostic::error(
                    Code::E0201,
                    format!(
                        "shape mismatch: `{layer}` expects a last dimension of {expected}, but its input is {}",
                        super::ops::show_type(&ty)
                    ),
                )
                .primary(arg, format!("this is {}", super::ops::show_type(&ty)))
                .secondary(decl, format!("`{layer}` is declared here with input size {expected}"))
                .help(match ty.shape.last() {
                    Some(d) => {
                        format!("declare `{layer}` with input size {}, or pass it a tensor of width {expected}", d.size)
                    }
                    None => format!("pass `{layer}` a tensor of width {expected}"),
                }),
            ),
        }
    }

    pub(crate) fn expect_int_tensor(&mut self, x: NodeIndex, span: Span) -> R<()> {
        let ty = self.ty(x).clone();
        if ty.dtype.is_integer() {
            return Ok(());
        }
        self.fail(
            Diagnostic::error(Code::E0107, format!("expected integer ids, found {}", super::ops::show_type(&ty)))
                .primary(span, "not i32 or i64"),
        )
    }

    pub(crate) fn expect_float_tensor(&mut self, x: NodeIndex, span: Span) -> R<()> {
        let ty = self.ty(x).clone();
        if !ty.dtype.is_integer() {
            return Ok(());
        }
        self.fail(
            Diagnostic::error(
                Code::E0107,
                format!("expected a floating-point tensor, found {}", super::ops::show_type(&ty)),
            )
            .primary(span, "integer tensor")
            .help("token ids must go through an embedding first"),
        )
    }
}

/// The error for an orientation other than "in_out" and "out_in".
pub(crate) fn bad_orientation(found: &str, span: Span) -> Diagnostic {
    Diagnostic::error(Code::E0107, format!("unknown weight orientation {found:?}"))
        .primary(span, "expected \"in_out\" or \"out_in\"")
        .note("\"in_out\" stores a linear weight [in, out] in checkpoints (GPT-2's Conv1D); \"out_in\" stores it [out, in] (torch.nn.Linear: BERT, Llama)")
}
