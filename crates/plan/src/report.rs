//! Reports on a plan for `optimusc inspect`: memory by category, communication per collective with its
//! source line, FLOPs, and a Graphviz rendering of the sharded program.

use super::{Buffer, CollectiveKind, Instr, Kernel, Plan};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Formats a byte count for people: 1.50 GiB, 12.00 MiB, 512 B.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.2} {}", UNITS[unit]) }
}

/// Where a collective or the memory peak comes from, as `inspect --json` reports it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OriginRef {
    /// `file:line:col` of the model line responsible.
    pub location: String,
    pub line: u32,
    pub col: u32,
    pub scope: String,
    pub reason: String,
}

/// One collective that every device takes part in during one step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CommEntry {
    pub instruction: usize,
    pub kind: String,
    pub group: String,
    /// Size of the buffer being broadcast or reduced on one device (for all-gather, the gathered
    /// buffer; for reduce-scatter, the buffer before scattering). Payload, not wire traffic.
    pub elements: u64,
    pub bytes: u64,
    pub origin: OriginRef,
    /// Where an overlapped collective (`--overlap`) is waited for: it runs beside the instructions
    /// from `instruction` to this one. Absent for a collective that completes where it starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waited_at: Option<usize>,
}

/// Totals per (kind, group).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CommTotal {
    pub kind: String,
    pub group: String,
    pub count: u64,
    pub elements: u64,
    pub bytes: u64,
    /// How many of them are overlapped with computation (`--overlap`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub overlapped: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Per-device memory by category (the plan's memory figures) and the source of the peak.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryReport {
    #[serde(flatten)]
    pub plan: super::memory::MemoryPlan,
    pub peak_origin: Option<OriginRef>,
}

/// The whole `inspect --json` document.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    pub model: String,
    pub mesh: String,
    pub devices: u64,
    pub strategy: String,
    pub mode: String,
    /// The plan's precision; left out for float32 plans (as in the plan file).
    #[serde(skip_serializing_if = "is_f32")]
    pub precision: super::Precision,
    /// How its SUMMA products were laid out; left out for `auto` (as in the plan file).
    #[serde(skip_serializing_if = "is_auto")]
    pub layouts: super::Layouts,
    /// Floating-point operations per step: on one device, and on all devices together.
    pub flops: Flops,
    pub memory: MemoryReport,
    pub communication: Vec<CommEntry>,
    pub communication_totals: Vec<CommTotal>,
    pub padding: Vec<super::Padding>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Flops {
    pub per_device: u64,
    pub total: u64,
}

fn origin_ref(plan: &Plan, origin: u32, reason: u32) -> OriginRef {
    let o = plan.origins.get(origin as usize);
    OriginRef {
        location: format!("{}:{}:{}", plan.source, o.map_or(0, |o| o.line), o.map_or(0, |o| o.col)),
        line: o.map_or(0, |o| o.line),
        col: o.map_or(0, |o| o.col),
        scope: o.map_or_else(String::new, |o| o.scope.clone()),
        reason: plan.reasons.get(reason as usize).map(|r| r.text.clone()).unwrap_or_default(),
    }
}

/// The payload of a collective on one device.
pub(crate) fn payload(kind: CollectiveKind, send: &Buffer, recv: &Buffer) -> u64 {
    match kind {
        CollectiveKind::AllGather => recv.elements(),
        _ => send.elements(),
    }
}

/// The bytes one device sends in a collective (an all-gather's: its gathered result).
pub fn collective_bytes(plan: &Plan, c: &super::Collective) -> u64 {
    let send = plan.buffer(c.send);
    payload(c.kind, send, plan.buffer(c.recv)) * send.dtype.bytes()
}

/// Builds the report of a plan.
pub fn report(plan: &Plan) -> Report {
    let mut communication = Vec::new();
    let mut totals: BTreeMap<(String, String), CommTotal> = BTreeMap::new();
    for (index, instr) in plan.program.iter().enumerate() {
        let Instr::Collective { collective: c, origin, reason } = instr else { continue };
        let (send, recv) = (plan.buffer(c.send), plan.buffer(c.recv));
        let elements = payload(c.kind, send, recv);
        let bytes = elements * send.dtype.bytes();
        let (kind, group) = (c.kind.name().to_string(), c.group.name().to_string());
        let t = totals.entry((kind.clone(), group.clone())).or_insert(CommTotal {
            kind: kind.clone(),
            group: group.clone(),
            count: 0,
            elements: 0,
            bytes: 0,
            overlapped: 0,
        });
        t.count += 1;
        t.elements += elements;
        t.bytes += bytes;
        let waited_at = c.overlapped.then(|| wait_of(plan, index, c.recv)).flatten();
        t.overlapped += u64::from(waited_at.is_some());
        communication.push(CommEntry {
            instruction: index,
            kind,
            group,
            elements,
            bytes,
            origin: origin_ref(plan, *origin, *reason),
            waited_at,
        });
    }
    let m = &plan.memory;
    let peak_origin = match plan.program.get(m.peak_instruction) {
        Some(Instr::Kernel { origin, reason, .. } | Instr::Collective { origin, reason, .. }) => {
            Some(origin_ref(plan, *origin, *reason))
        }
        _ => None,
    };
    let per_device = flops(plan);
    Report {
        model: plan.model.clone(),
        mesh: plan.mesh.to_string(),
        devices: plan.mesh.devices(),
        strategy: plan.strategy.name().to_string(),
        mode: if plan.mode == super::Mode::Train { "train" } else { "infer" }.to_string(),
        precision: plan.precision,
        layouts: plan.layouts,
        flops: Flops { per_device, total: per_device * plan.mesh.devices() },
        memory: MemoryReport { plan: m.clone(), peak_origin },
        communication,
        communication_totals: totals.into_values().collect(),
        padding: plan.padding.clone(),
    }
}

/// The position of the `Wait` for the overlapped collective at `start` that receives `recv`.
fn wait_of(plan: &Plan, start: usize, recv: super::BufferId) -> Option<usize> {
    let later = plan.program.iter().enumerate().skip(start + 1);
    later.filter_map(|(k, i)| matches!(i, Instr::Wait { recv: r, .. } if *r == recv).then_some(k)).next()
}

/// Floating-point operations of one kernel on one device (multiply-adds count as two).
pub fn kernel_flops(kernel: &Kernel, inputs: &[&Buffer], output: &Buffer) -> u64 {
    let out = output.elements();
    let dims = |b: &Buffer| (b.shape.iter().rev().skip(1).product::<u64>(), b.shape.last().copied().unwrap_or(1));
    match kernel {
        Kernel::MatMul { transpose_a, .. } => {
            let Some(a) = inputs.first() else { return 0 };
            let (rows, cols) = dims(a);
            let k = if *transpose_a { rows } else { cols };
            2 * k * out
        }
        Kernel::BatchedMatMul => inputs.first().map_or(0, |a| 2 * a.shape.last().copied().unwrap_or(1) * out),
        Kernel::Attention { .. } | Kernel::AttentionGrad { .. } => {
            // Q K^T and P V: 4 s^2 d per head and sequence; the gradient costs twice that per operand.
            // Counted per query head: the gradient of a grouped k or v (fewer columns than dy) still
            // runs the products of every query head, so it counts dy's elements.
            let Some(x) = inputs.first() else { return 0 };
            let rank = x.shape.len();
            let seq = if rank >= 2 { x.shape[rank - 2] } else { 1 };
            let scale = if matches!(kernel, Kernel::AttentionGrad { .. }) { 2 } else { 1 };
            let counted = if matches!(kernel, Kernel::AttentionGrad { fused: false, .. }) { x.elements() } else { out };
            4 * counted * seq * scale
        }
        // At a full cache (a step at position p attends over p + 1 rows: at most `context`).
        Kernel::CachedAttention { .. } => {
            let context = inputs.get(1).and_then(|k| k.shape.iter().rev().nth(1).copied()).unwrap_or(1);
            4 * out * context
        }
        // A copy of one chunk of the step's rows.
        Kernel::CacheWrite { parts, .. } => inputs.first().map_or(0, |x| x.elements() / u64::from((*parts).max(1))),
        // Two multiplies and an add per element (the angles are a [seq, head / 2] table).
        Kernel::Rotary { .. } | Kernel::RotaryGrad { .. } | Kernel::RotaryAt { .. } => 3 * out,
        Kernel::Gelu { .. } | Kernel::GeluGrad { .. } => 8 * out,
        Kernel::Silu => 4 * out,
        Kernel::Mul => out,
        // x r w; r w dy - c x; squares summed; dy w x and dy x r summed (over the row, over rows).
        Kernel::RmsNormApply { .. } => 2 * out,
        Kernel::RmsNormGradInput { .. } => 4 * out,
        Kernel::RowSquareSum => 2 * inputs.first().map_or(out, |b| b.elements()),
        Kernel::RmsNormGradSum | Kernel::RmsNormGradWeight { .. } => 3 * inputs.first().map_or(out, |b| b.elements()),
        Kernel::SiluGrad => 7 * out,
        Kernel::Softmax | Kernel::SoftmaxGrad | Kernel::LayerNormApply { .. } | Kernel::LayerNormGradInput { .. } => {
            5 * out
        }
        Kernel::OptimizerStep => 10 * out,
        Kernel::CrossEntropyStats { .. } | Kernel::CrossEntropyGrad { .. } => {
            4 * inputs.first().map_or(out, |b| b.elements())
        }
        _ => inputs.iter().map(|b| b.elements()).max().unwrap_or(0).max(out),
    }
}

/// FLOPs per device per step.
pub fn flops(plan: &Plan) -> u64 {
    plan.program
        .iter()
        .map(|instr| match instr {
            Instr::Kernel { kernel, inputs, output, .. } => {
                let ins: Vec<&Buffer> = inputs.iter().map(|&b| plan.buffer(b)).collect();
                kernel_flops(kernel, &ins, plan.buffer(*output))
            }
            _ => 0,
        })
        .sum()
}

fn is_f32(precision: &super::Precision) -> bool {
    *precision == super::Precision::F32
}

fn is_auto(layouts: &super::Layouts) -> bool {
    *layouts == super::Layouts::Auto
}

/// The human-readable report.
/// What the plan recomputes in the backward pass: the mode, and how many instructions recompute which
/// blocks (reasons that name the block they recompute); `None` when it recomputes nothing.
fn recompute_line(plan: &Plan) -> Option<String> {
    let mut blocks = std::collections::BTreeSet::new();
    let mut count = 0;
    for instr in &plan.program {
        let (Instr::Kernel { reason, .. } | Instr::Collective { reason, .. }) = instr else { continue };
        let Some(unit) = plan.reasons.get(*reason as usize).and_then(|r| r.recompute.as_ref()) else { continue };
        count += 1;
        blocks.insert(unit.clone());
    }
    (count > 0).then(|| {
        format!(
            "recompute: {} ({count} instructions recompute {} block{} in the backward pass; their forward values are not kept)",
            plan.recompute.name(),
            blocks.len(),
            if blocks.len() == 1 { "" } else { "s" }
        )
    })
}

/// What the replicas do: each trains on its share of the batch; under ZeRO-1 the optimizer state and
/// master weights are split over them (with the bytes that saves per device).
fn data_parallel_line(plan: &Plan) -> String {
    let replicas = plan.mesh.data;
    let head = format!(
        "data parallelism: {replicas} replicas of the {} mesh, each on 1/{replicas} of the batch; gradients summed over the replicas",
        plan.mesh.with_data(1)
    );
    if plan.zero == 0 {
        return head;
    }
    let is_split =
        |id: super::BufferId| plan.buffer(id).layout.0[crate::layout::DATA_AXIS] != crate::layout::Placement::Replicate;
    let split: Vec<&super::PlanParam> = plan.params.iter().filter(|p| is_split(p.buffer)).collect();
    let saved: u64 = split
        .iter()
        .flat_map(|p| std::iter::once(p.buffer).chain(p.state.iter().copied()))
        .map(|id| plan.buffer(id).bytes() * (replicas - 1))
        .sum();
    format!(
        "{head}\nZeRO-1: optimizer state and master weights of {} of {} parameters split over the replicas, saving {} per device",
        split.len(),
        plan.params.len(),
        human_bytes(saved)
    )
}

pub fn render_text(plan: &Plan, r: &Report) -> String {
    let mut out = String::new();
    let precision = match r.precision {
        super::Precision::F32 => String::new(),
        p => format!(", {} precision (float32 master weights)", p.name()),
    };
    let layouts = match r.layouts {
        super::Layouts::Auto => "",
        super::Layouts::Paper => ", the paper's layouts",
    };
    let _ = writeln!(
        out,
        "plan: model {}, {} strategy on a {} mesh ({} devices), {} mode{precision}{layouts}, {} instructions",
        r.model,
        r.strategy,
        r.mesh,
        r.devices,
        r.mode,
        plan.program.len()
    );
    if plan.strategy == super::Strategy::ThreeD {
        let q = plan.mesh.rows;
        let _ = writeln!(
            out,
            "3d: a {q}x{q}x{q} cube; activations split {} ways, matrices {} ways where their first dimension divides; each product gathers its operands and reduce-scatters its result",
            q * q,
            q * q * q
        );
    } else if plan.mesh.depth > 1 {
        let (depth, q) = (plan.mesh.depth, plan.mesh.rows);
        let _ = writeln!(
            out,
            "depth: {depth} layers of the {q}x{q} grid, each on 1/{depth} of each replica's batch with the same weights; weight gradients summed over the depth"
        );
    }
    if plan.mesh.data > 1 {
        let _ = writeln!(out, "{}", data_parallel_line(plan));
    }
    for p in &r.padding {
        let _ = writeln!(out, "padding: `{}` dimension {} padded from {} to {}", p.tensor, p.dim, p.logical, p.padded);
    }
    if let Some(line) = recompute_line(plan) {
        let _ = writeln!(out, "{line}");
    }
    let m = &r.memory.plan;
    let _ = writeln!(out, "\nmemory per device (every device holds blocks of the same shapes):");
    let caches = (m.cache > 0).then_some(("key/value caches (all positions)", m.cache));
    for (name, bytes) in [
        ("parameters", m.parameters),
        ("gradients", m.gradients),
        ("optimizer state (2 per parameter)", m.optimizer_state),
        ("inputs", m.inputs),
    ]
    .into_iter()
    .chain(caches)
    .chain([
        ("activations kept for backward", m.activations_kept_for_backward),
        ("workspace (largest at once)", m.workspace_peak),
        ("peak", m.peak_bytes),
    ]) {
        let _ = writeln!(out, "  {name:<36} {:>12}  ({bytes} B)", human_bytes(bytes));
    }
    if let Some(o) = &r.memory.peak_origin {
        let _ = writeln!(
            out,
            "  peak reached at instruction {}: {} {} ({})",
            m.peak_instruction, o.location, o.scope, o.reason
        );
    }
    let p = &m.at_peak;
    let _ = writeln!(
        out,
        "
peak by category (alive at the peak instruction; they add up to the peak):"
    );
    let caches = (p.cache > 0).then_some(("key/value caches", p.cache));
    for (name, bytes) in [
        ("parameters", p.parameters),
        ("gradients", p.gradients),
        ("optimizer state", p.optimizer_state),
        ("inputs", p.inputs),
    ]
    .into_iter()
    .chain(caches)
    .chain([
        ("activations", p.activations),
        ("communication buffers", p.communication),
        ("other workspace", p.workspace),
    ]) {
        let share = if m.peak_bytes > 0 { 100.0 * bytes as f64 / m.peak_bytes as f64 } else { 0.0 };
        let _ = writeln!(out, "  {name:<36} {:>12}  {share:5.1}%", human_bytes(bytes));
    }
    let _ = writeln!(out, "\ncommunication per device per step:");
    let _ = writeln!(out, "  {:<15} {:<7} {:>7} {:>15} {:>12}", "collective", "group", "count", "elements", "bytes");
    for t in &r.communication_totals {
        let _ = writeln!(
            out,
            "  {:<15} {:<7} {:>7} {:>15} {:>12}",
            t.kind,
            t.group,
            t.count,
            t.elements,
            human_bytes(t.bytes)
        );
    }
    if r.communication_totals.is_empty() {
        let _ = writeln!(out, "  none");
    }
    render_overlap(&mut out, plan, r);
    render_by_line(&mut out, r);
    let _ = writeln!(
        out,
        "\nflops per step: {:.3e} per device, {:.3e} on all devices",
        r.flops.per_device as f64, r.flops.total as f64
    );
    out
}

/// For an overlapped plan: how many collectives run beside computation, over how many instructions,
/// and the buffers doubled for it.
fn render_overlap(out: &mut String, plan: &Plan, r: &Report) {
    if !plan.overlap {
        return;
    }
    let overlapped: Vec<&CommEntry> = r.communication.iter().filter(|c| c.waited_at.is_some()).collect();
    let spans: usize = overlapped.iter().filter_map(|c| Some(c.waited_at? - c.instruction)).sum();
    let doubled = plan.buffers.iter().filter(|b| b.name.ends_with(" (second buffer)")).count();
    let _ = writeln!(
        out,
        "
overlap: {} of {} collectives run beside computation (each from its start to its wait, {:.1} \
         instructions on average); {doubled} buffers doubled so that SUMMA steps overlap",
        overlapped.len(),
        r.communication.len(),
        if overlapped.is_empty() { 0.0 } else { spans as f64 / overlapped.len() as f64 },
    );
    for t in r.communication_totals.iter().filter(|t| t.overlapped > 0) {
        let _ = writeln!(out, "  {:<15} {:<7} {:>5} of {:>5} overlapped", t.kind, t.group, t.overlapped, t.count);
    }
}

/// Communication grouped by responsible source line, largest first.
fn render_by_line(out: &mut String, r: &Report) {
    let mut by_line: BTreeMap<(u32, String), (u64, u64, String)> = BTreeMap::new();
    for c in &r.communication {
        let key = (c.origin.line, format!("{} {}", c.kind, c.group));
        let e = by_line.entry(key).or_insert((0, 0, c.origin.location.clone()));
        e.0 += 1;
        e.1 += c.bytes;
    }
    if by_line.is_empty() {
        return;
    }
    let mut rows: Vec<_> = by_line.into_iter().collect();
    rows.sort_by(|a, b| b.1.1.cmp(&a.1.1).then(a.0.cmp(&b.0)));
    let _ = writeln!(out, "\ncommunication by source line (bytes per device per step):");
    for ((_, what), (count, bytes, location)) in rows {
        let _ = writeln!(out, "  {location:<28} {what:<22} {count:>6} x  {:>12}", human_bytes(bytes));
    }
}

/// The sharded program as a Graphviz digraph: one node per kernel or collective, edges along buffers.
pub fn render_dot(plan: &Plan) -> String {
    let mut out =
        String::from("digraph plan {\n  rankdir=TB;\n  node [shape=box, fontname=\"monospace\", fontsize=10];\n");
    let mut writer: BTreeMap<u32, usize> = BTreeMap::new();
    for (index, instr) in plan.program.iter().enumerate() {
        let (label, style, inputs, output) = match instr {
            Instr::Kernel { kernel, inputs, output, .. } => {
                let name = format!("{kernel:?}").split([' ', '{']).next().unwrap_or("kernel").to_string();
                let shape = &plan.buffer(*output).shape;
                (format!("{name}\\n{shape:?}"), "", inputs.clone(), *output)
            }
            Instr::Collective { collective: c, .. } => {
                let shape = &plan.buffer(c.send).shape;
                let root = c.root.map_or(String::new(), |r| format!(" root {r}"));
                let started = if c.overlapped { " (overlapped)" } else { "" };
                let label = format!("{} {}{root}{started}\\n{shape:?}", c.kind.name(), c.group.name());
                (label, ", style=filled, fillcolor=lightblue", vec![c.send], c.recv)
            }
            Instr::Free { .. } | Instr::Wait { .. } => continue,
        };
        let _ = writeln!(out, "  i{index} [label=\"{label}\"{style}];");
        for b in inputs {
            if let Some(src) = writer.get(&b.0) {
                let _ = writeln!(out, "  i{src} -> i{index};");
            }
        }
        writer.insert(output.0, index);
    }
    out.push_str("}\n");
    out
}
