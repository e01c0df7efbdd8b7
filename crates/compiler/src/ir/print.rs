//! The readable text dump of a model's IR (`optimusc check --emit ir`).

use super::{Dim, Init, Model, Op, TensorType};
use optimus_plan::span::LineIndex;
use optimus_plan::text::group_digits;
use std::fmt::Write;

/// Shows one dimension: `batch=8`, `2304`, or a factored `(3, heads=12, 64)`.
pub fn show_dim(d: &Dim) -> String {
    if !d.factors.is_empty() {
        let parts: Vec<String> = d
            .factors
            .iter()
            .map(|f| match &f.label {
                Some(l) => format!("{l}={}", f.size),
                None => f.size.to_string(),
            })
            .collect();
        return format!("({})", parts.join(", "));
    }
    match &d.label {
        Some(l) => format!("{l}={}", d.size),
        None => d.size.to_string(),
    }
}

/// Shows a type with dimension labels: `f32[batch=8, seq=1024, hidden=768]`.
pub fn show_type(ty: &TensorType) -> String {
    let dims: Vec<String> = ty.shape.iter().map(show_dim).collect();
    format!("{}[{}]", ty.dtype.name(), dims.join(", "))
}

fn show_init(init: &Init) -> String {
    match init {
        Init::Normal { std } => format!("normal(0, {std})"),
        Init::Zeros => "zeros".to_string(),
        Init::Ones => "ones".to_string(),
    }
}

fn show_attrs(op: &Op) -> String {
    match op {
        Op::Linear { bias, transpose_weight } => {
            let mut a = Vec::new();
            if !bias {
                a.push("no_bias");
            }
            if *transpose_weight {
                a.push("tied");
            }
            if a.is_empty() { String::new() } else { format!(" {{{}}}", a.join(", ")) }
        }
        Op::Embedding { padding: Some(p) } | Op::EmbeddingGrad { padding: Some(p) } => format!(" {{padding_idx={p}}}"),
        Op::LayerNorm { eps } => format!(" {{eps={eps:e}}}"),
        Op::RmsNorm { eps } | Op::RmsNormGradInput { eps } | Op::RmsNormGradWeight { eps } => {
            format!(" {{eps={eps:e}}}")
        }
        Op::Gelu { approximate } => format!(" {{approx={}}}", if *approximate { "tanh" } else { "none" }),
        Op::Attention { heads, kv_heads, causal, fused } => {
            format!(" {{heads={heads}{}, causal={causal}, fused={fused}}}", kv_heads_attr(*heads, *kv_heads))
        }
        Op::Rotary { heads, theta } | Op::RotaryGrad { heads, theta } | Op::RotaryAt { heads, theta } => {
            format!(" {{heads={heads}, theta={theta}}}")
        }
        Op::CachedAttention { heads, kv_heads, fused, context } => {
            format!(" {{heads={heads}{}, fused={fused}, context={context}}}", kv_heads_attr(*heads, *kv_heads))
        }
        Op::Dropout { p } => format!(" {{p={p}}}"),
        Op::Transpose { dim0, dim1 } => format!(" {{{dim0}, {dim1}}}"),
        Op::Scale { factor } => format!(" {{{factor}}}"),
        Op::Select { dim, index } | Op::SelectGrad { dim, index } => format!(" {{dim={dim}, index={index}}}"),
        Op::Fill { value } => format!(" {{{value}}}"),
        Op::LinearGradInput { transpose_weight } | Op::LinearGradWeight { transpose_weight } if *transpose_weight => {
            " {tied}".to_string()
        }
        Op::LayerNormGradInput { eps } | Op::LayerNormGradWeight { eps } => format!(" {{eps={eps:e}}}"),
        Op::GeluGrad { approximate } => format!(" {{approx={}}}", if *approximate { "tanh" } else { "none" }),
        Op::DropoutGrad { p, forward } => format!(" {{p={p}, mask=%{forward}}}"),
        Op::AttentionGrad { heads, kv_heads, causal, fused, wrt } => {
            let kv = kv_heads_attr(*heads, *kv_heads);
            format!(" {{heads={heads}{kv}, causal={causal}, fused={fused}, wrt={wrt}}}")
        }
        _ => String::new(),
    }
}

/// `, kv_heads=K` for grouped-query attention; nothing when every query head has its own kv head.
fn kv_heads_attr(heads: u64, kv_heads: u64) -> String {
    if kv_heads == heads { String::new() } else { format!(", kv_heads={kv_heads}") }
}

/// Renders the whole model as text; `source` lets origins print as line:col.
pub fn print_model(model: &Model, source: &str) -> String {
    let mut out = String::new();
    let lines = LineIndex::new(source);
    let _ = writeln!(
        out,
        "model {}  # {} parameters in {} tensors",
        model.name,
        group_digits(model.parameter_count()),
        model.params.len()
    );
    if let Some(p) = &model.checkpoint_prefix {
        let _ = writeln!(out, "checkpoint_prefix {p:?}");
    }
    out.push('\n');
    for c in &model.config {
        let set = if c.overridden { "  # --set" } else { "" };
        let _ = writeln!(out, "config {} = {}{set}", c.name, c.value);
    }
    out.push('\n');
    for p in &model.params {
        let ckpt = if p.checkpoint != p.name { format!(" checkpoint {:?}", p.checkpoint) } else { String::new() };
        let stored = if p.checkpoint_transposed { " stored [out, in]" } else { "" };
        let _ = writeln!(out, "param {}: {} = {}{ckpt}{stored}", p.name, show_type(&p.ty), show_init(&p.init));
    }
    out.push('\n');
    for idx in model.graph.node_indices() {
        let node = &model.graph[idx];
        let operands: Vec<String> = model.operands(idx).iter().map(|o| format!("%{}", o.index())).collect();
        let head = match &node.op {
            Op::Input { name } => format!("input {name}"),
            Op::Param { id } => format!("param {}", model.param(*id).name),
            op => format!("{}({}){}", op.name(), operands.join(", "), show_attrs(op)),
        };
        let (line, col) = lines.line_col(node.origin.span.start as usize);
        let scope = if node.origin.scope.is_empty() { String::new() } else { format!("{} ", node.origin.scope) };
        let _ = writeln!(out, "%{} = {head} : {}  # {scope}@{line}:{col}", idx.index(), show_type(&node.ty));
    }
    out.push('\n');
    for o in &model.outputs {
        let loss = if model.loss == Some(o.node) { "  # loss" } else { "" };
        let _ = writeln!(out, "output {} = %{}{loss}", o.name, o.node.index());
    }
    out
}
