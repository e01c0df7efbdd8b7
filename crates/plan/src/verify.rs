//! The plan verifier, run before any plan is written: buffer shapes per kernel and collective, buffer
//! lifetimes (defined before use, never used after a free), and that the members of every group issue
//! the same collectives in the same order (a plan that could deadlock never runs).

mod declarations;
mod kernels;
mod overlap;

pub use declarations::checked_bytes;

use super::memory::persistent;
use super::{BufferId, Collective, CollectiveKind, Group, Instr, Kernel, Mesh, Plan};
use crate::layout::Placement;

/// The most elements one device's block may have: 2^40, a 4 TiB f32 block, far beyond any device, and
/// small enough that index arithmetic never overflows. (A logical tensor only has to fit in memory.)
const MAX_BLOCK_ELEMENTS: u64 = 1 << 40;

/// Checks a plan; returns every problem found.
pub fn verify(plan: &Plan) -> Result<(), Vec<String>> {
    let mut errors = Vec::new();
    // A plan read from a file may be anything: check its structure before anything indexes into it.
    check_structure(plan, &mut errors);
    if !errors.is_empty() {
        return Err(errors);
    }
    declarations::check_declarations(plan, &mut errors);
    if !errors.is_empty() {
        return Err(errors);
    }
    check_lifetimes(plan, &mut errors);
    for (index, instr) in plan.program.iter().enumerate() {
        match instr {
            Instr::Kernel { kernel, inputs, output, .. } => {
                check_kernel(plan, index, kernel, inputs, *output, &mut errors)
            }
            Instr::Collective { collective, .. } => check_collective(plan, index, collective, &mut errors),
            Instr::Free { .. } | Instr::Wait { .. } => {}
        }
    }
    overlap::check_overlap(plan, &mut errors);
    check_group_order(plan, &mut errors);
    check_memory_summary(plan, &mut errors);
    check_recorded_target(plan, &mut errors);
    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

/// What the plan says it was compiled for (which `inspect` and `simulate` print and cost) agrees with
/// what it holds: the strategy can use the mesh, a training plan of several replicas sums something
/// over them and one of a single replica has no replicas to sum over, and a bf16 plan holds bf16
/// buffers where a float32 one holds none.
fn check_recorded_target(plan: &Plan, errors: &mut Vec<String>) {
    if let Some(problem) = plan.strategy.mesh_problem(plan.mesh) {
        errors.push(format!("the plan says it is a {} plan for a {} mesh: {problem}", plan.strategy.name(), plan.mesh));
    }
    let over_replicas = plan
        .program
        .iter()
        .any(|i| matches!(i, Instr::Collective { collective, .. } if collective.group == crate::Group::Data));
    let data = plan.mesh.data;
    if plan.mode == crate::Mode::Train && data > 1 && !over_replicas {
        errors.push(format!("the mesh has {data} data-parallel replicas, and nothing in the program sums over them"));
    }
    if data == 1 && over_replicas {
        errors.push("the program communicates over data-parallel replicas, and the mesh has one".to_string());
    }
    let holds_bf16 = plan.buffers.iter().any(|b| b.dtype == crate::types::DType::Bf16);
    match (plan.precision, holds_bf16) {
        (crate::Precision::F32, true) => errors.push("the plan says f32, and it holds bf16 buffers".to_string()),
        (crate::Precision::Bf16, false) => errors.push("the plan says bf16, and it holds no bf16 buffer".to_string()),
        _ => {}
    }
}

/// The memory summary (what `inspect` and `simulate` show) is what the buffers and program give, so an
/// edited summary cannot mislead; the buffers' sizes are summed with overflow checks first.
fn check_memory_summary(plan: &Plan, errors: &mut Vec<String>) {
    let total =
        plan.buffers.iter().try_fold(0u64, |sum, b| sum.checked_add(b.elements().checked_mul(b.dtype.bytes())?));
    if total.is_none() {
        return errors.push("the buffers together hold more bytes than any machine has".into());
    }
    if plan.memory.forward_end > plan.program.len() {
        return errors.push(format!(
            "memory.forward_end {} is past the end of the {}-instruction program",
            plan.memory.forward_end,
            plan.program.len()
        ));
    }
    let recomputed = super::memory::plan_memory(&plan.program, &plan.buffers, plan.memory.forward_end);
    if recomputed != plan.memory {
        errors.push(format!(
            "the memory summary does not match the plan's buffers and program ({}); recompile the model",
            differing_fields(&plan.memory, &recomputed).join(", ")
        ));
    }
}

/// The fields in which a recorded memory summary differs from the recomputed one, as `memory.NAME
/// recorded (recomputed VALUE)`, nested fields by their dotted path.
fn differing_fields(recorded: &crate::memory::MemoryPlan, recomputed: &crate::memory::MemoryPlan) -> Vec<String> {
    fn walk(path: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
        match (a, b) {
            (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
                for (key, value) in a {
                    walk(&format!("{path}.{key}"), value, b.get(key).unwrap_or(&serde_json::Value::Null), out);
                }
            }
            _ if a != b => out.push(format!("{path} {a} (recomputed {b})")),
            _ => {}
        }
    }
    let (a, b) = (serde_json::to_value(recorded), serde_json::to_value(recomputed));
    let mut out = Vec::new();
    if let (Ok(a), Ok(b)) = (a, b) {
        walk("memory", &a, &b, &mut out);
    }
    out
}

fn valid(plan: &Plan, id: BufferId) -> bool {
    (id.0 as usize) < plan.buffers.len()
}

/// Every reference is in range, every buffer's block shape follows from its layout, and the mesh is sane.
fn check_structure(plan: &Plan, errors: &mut Vec<String>) {
    let Mesh { rows, cols, .. } = plan.mesh;
    if rows == 0 || cols == 0 || rows > 1024 || cols > 1024 {
        errors.push(format!("mesh {rows}x{cols} is not between 1x1 and 1024x1024"));
        return;
    }
    for (k, b) in plan.buffers.iter().enumerate() {
        if b.id.0 as usize != k {
            errors.push(format!("buffer {k} says it is buffer {}", b.id.0));
        }
        let sharded_dims_exist = b.layout.0.iter().all(|p| p.dim().is_none_or(|d| d < b.logical_shape.len()));
        if !sharded_dims_exist || b.layout.local_shape(&b.logical_shape, plan.mesh.axes()) != b.shape {
            errors.push(format!(
                "buffer `{}`: block {:?} does not follow from {:?} laid out {}",
                b.name, b.shape, b.logical_shape, b.layout
            ));
        }
        for (what, shape, cap) in
            [("logical shape", &b.logical_shape, u64::MAX), ("block", &b.shape, MAX_BLOCK_ELEMENTS)]
        {
            if checked_bytes(shape, b.dtype.bytes()).is_none_or(|(elements, _)| elements > cap) {
                errors.push(format!(
                    "buffer `{}`: its {what} {shape:?} has more elements than any machine can hold",
                    b.name
                ));
            }
        }
    }
    let mut referenced: Vec<BufferId> = Vec::new();
    for instr in &plan.program {
        match instr {
            Instr::Kernel { inputs, output, origin, reason, .. } => {
                referenced.extend(inputs.iter().copied().chain([*output]));
                check_origin(plan, *origin, *reason, errors);
            }
            Instr::Collective { collective: c, origin, reason } => {
                referenced.extend([c.send, c.recv]);
                check_origin(plan, *origin, *reason, errors);
            }
            Instr::Free { buffer } => referenced.push(*buffer),
            Instr::Wait { send, recv } => referenced.extend([*send, *recv]),
        }
    }
    for p in &plan.params {
        referenced.extend(p.grad.iter().chain(&p.state).copied().chain([p.buffer]));
    }
    referenced.extend(plan.inputs.iter().map(|i| i.buffer).chain(plan.outputs.iter().map(|o| o.buffer)));
    referenced.extend(plan.grad_norm);
    if let Some(bad) = referenced.iter().find(|id| !valid(plan, **id)) {
        errors.push(format!("buffer {} is referenced but does not exist", bad.0));
    } else if let Some(norm) = plan.grad_norm {
        check_grad_norm(plan, plan.buffer(norm), errors);
    }
}

/// The gradient norm's buffer is the one float32 value the optimizer steps read their clipping from.
fn check_grad_norm(plan: &Plan, norm: &crate::Buffer, errors: &mut Vec<String>) {
    let elements = norm.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
    if plan.mode != crate::Mode::Train || norm.dtype != crate::types::DType::F32 || elements != Some(1) {
        errors.push(format!(
            "the gradient norm's buffer `{}` is not one float32 value of a training plan ({:?} {:?}, {:?} plan)",
            norm.name, norm.dtype, norm.shape, plan.mode
        ));
    }
}

fn check_origin(plan: &Plan, origin: u32, reason: u32, errors: &mut Vec<String>) {
    if origin as usize >= plan.origins.len() || reason as usize >= plan.reasons.len() {
        errors.push(format!("origin {origin} or reason {reason} does not exist"));
    }
}

fn check_lifetimes(plan: &Plan, errors: &mut Vec<String>) {
    let n = plan.buffers.len();
    let mut defined = vec![false; n];
    for b in plan.buffers.iter().filter(|b| persistent(b.role)) {
        defined[b.id.0 as usize] = true;
    }
    let mut freed = vec![false; n];
    for (index, instr) in plan.program.iter().enumerate() {
        let (reads, writes): (Vec<BufferId>, Vec<BufferId>) = match instr {
            Instr::Kernel { kernel, inputs, output, .. } => {
                let mut reads = inputs.clone();
                if matches!(kernel, Kernel::MatMul { accumulate: true, .. }) {
                    reads.push(*output);
                }
                (reads, vec![*output])
            }
            Instr::Collective { collective: c, .. } => (vec![c.send], vec![c.recv]),
            // Its collective wrote `recv` at its start; the wait keeps both buffers in use until here.
            Instr::Wait { send, recv } => (vec![*send, *recv], Vec::new()),
            Instr::Free { buffer } => {
                match freed.get_mut(buffer.0 as usize) {
                    Some(f) if *f => errors.push(format!("instruction {index}: buffer {} is freed twice", buffer.0)),
                    Some(f) => *f = true,
                    None => errors.push(format!("instruction {index}: buffer {} does not exist", buffer.0)),
                }
                continue;
            }
        };
        for b in reads.iter().chain(&writes) {
            if !valid(plan, *b) {
                errors.push(format!("instruction {index}: buffer {} does not exist", b.0));
            } else if freed[b.0 as usize] {
                errors
                    .push(format!("instruction {index}: buffer `{}` is used after it was freed", plan.buffer(*b).name));
            }
        }
        for b in &reads {
            if valid(plan, *b) && !defined[b.0 as usize] {
                errors.push(format!(
                    "instruction {index}: buffer `{}` is read before it is written",
                    plan.buffer(*b).name
                ));
            }
        }
        for w in writes.iter().filter(|w| valid(plan, **w)) {
            defined[w.0 as usize] = true;
        }
    }
}

fn shape(plan: &Plan, id: BufferId) -> &[u64] {
    if valid(plan, id) { &plan.buffer(id).shape } else { &[] }
}

/// (rows, cols) of a buffer viewed as a matrix: leading dimensions flattened.
fn matrix(s: &[u64]) -> (u64, u64) {
    let cols = s.last().copied().unwrap_or(1);
    let rows = s.iter().rev().skip(1).product();
    (rows, cols)
}

/// "instruction 12 (layer norm apply, tiny.opt:47:12 `h.0.ln_1`)": where a problem is, in the user's terms.
fn describe(plan: &Plan, index: usize, kernel: &Kernel) -> String {
    locate(plan, index, &kernel_words(kernel))
}

/// "instruction 12 (what, tiny.opt:47:12 `scope`)", with the source position when the plan has one.
fn locate(plan: &Plan, index: usize, what: &str) -> String {
    let mut text = format!("instruction {index} ({what}");
    let origin = match plan.program.get(index) {
        Some(Instr::Kernel { origin, .. } | Instr::Collective { origin, .. }) => plan.origins.get(*origin as usize),
        _ => None,
    };
    if let Some(o) = origin.filter(|o| o.line > 0) {
        text.push_str(&format!(", {}:{}:{}", plan.source, o.line, o.col));
        if !o.scope.is_empty() {
            text.push_str(&format!(" `{}`", o.scope));
        }
    }
    text.push(')');
    text
}

/// A kernel's kind in words: `EmbeddingLookup { .. }` is "embedding lookup".
fn kernel_words(kernel: &Kernel) -> String {
    let debug = format!("{kernel:?}");
    let name = debug.split([' ', '{']).next().unwrap_or_default();
    let mut words = String::new();
    for c in name.chars() {
        if c.is_uppercase() && !words.is_empty() {
            words.push(' ');
        }
        words.push(c.to_ascii_lowercase());
    }
    words
}

fn check_kernel(
    plan: &Plan,
    index: usize,
    kernel: &Kernel,
    inputs: &[BufferId],
    output: BufferId,
    errors: &mut Vec<String>,
) {
    let out = shape(plan, output);
    let ins: Vec<&[u64]> = inputs.iter().map(|&b| shape(plan, b)).collect();
    let mut fail = |what: String| errors.push(format!("{}: {what}", describe(plan, index, kernel)));
    if let Err(what) = kernels::check_parameters(plan, kernel, inputs, output) {
        return fail(what);
    }
    match kernel {
        Kernel::MatMul { transpose_a, transpose_b, .. } => {
            let (Some(a), Some(b)) = (ins.first(), ins.get(1)) else { return fail("needs two inputs".into()) };
            let (ar, ac) = matrix(a);
            let (br, bc) = matrix(b);
            let (m, k) = if *transpose_a { (ac, ar) } else { (ar, ac) };
            let (k2, n) = if *transpose_b { (bc, br) } else { (br, bc) };
            let (or, oc) = matrix(out);
            if k != k2 || or * oc != m * n || oc != n {
                fail(format!("[{m}x{k}] x [{k2}x{n}] does not give {out:?}"));
            }
        }
        Kernel::Add
        | Kernel::Mul
        | Kernel::Scale { .. }
        | Kernel::Gelu { .. }
        | Kernel::GeluGrad { .. }
        | Kernel::Silu
        | Kernel::SiluGrad
        | Kernel::Rotary { .. }
        | Kernel::RotaryGrad { .. }
        | Kernel::Softmax
        | Kernel::SoftmaxGrad
        | Kernel::CausalMask
        | Kernel::CausalMaskGrad
        | Kernel::Dropout { .. }
        | Kernel::DropoutGrad { .. }
            if ins.iter().any(|s| *s != out) =>
        {
            fail(format!("operands {ins:?} do not all match the output {out:?}"));
        }
        Kernel::BiasAdd if ins.first() != Some(&out) || ins.get(1).copied() != out.last().map(std::slice::from_ref) => {
            fail(format!("bias add of {ins:?} into {out:?}"));
        }
        Kernel::Reshape => {
            let elements: u64 = ins.first().map_or(0, |s| s.iter().product());
            if elements != out.iter().product::<u64>() {
                fail(format!("reshape of {ins:?} into {out:?} changes the element count"));
            }
        }
        Kernel::OptimizerStep if ins.iter().any(|s| *s != out) || inputs.first() != Some(&output) => {
            fail("the optimizer updates a parameter in place with same-shaped gradient and state".into());
        }
        _ => {}
    }
}

fn check_collective(plan: &Plan, index: usize, c: &Collective, errors: &mut Vec<String>) {
    let size = plan.mesh.group_size(c.group);
    let (send, recv) = (shape(plan, c.send), shape(plan, c.recv));
    let mut fail = |what: String| {
        let what_kind = format!("{} over the {}", c.kind.name(), c.group.name());
        errors.push(format!("{}: {what}", locate(plan, index, &what_kind)))
    };
    if size < 2 {
        fail(format!("a group of {size} device needs no collective"));
    }
    if let Some(root) = c.root.filter(|&r| r >= size) {
        fail(format!("root {root} is outside a group of {size}"));
    }
    // The runtimes move floating-point buffers only: an integer one (token ids) is read from the data
    // in each layout it is used in, never communicated.
    if let Some(b) = [c.send, c.recv].into_iter().map(|id| plan.buffer(id)).find(|b| b.dtype.is_integer()) {
        fail(format!("`{}` holds {}, and only floating-point buffers are communicated", b.name, b.dtype.name()));
    }
    match c.kind {
        CollectiveKind::Broadcast | CollectiveKind::Reduce | CollectiveKind::AllReduce => {
            if send != recv {
                fail(format!("send {send:?} and receive {recv:?} differ"));
            }
        }
        CollectiveKind::AllGather | CollectiveKind::ReduceScatter => {
            let (small, large) = if c.kind == CollectiveKind::AllGather { (&send, &recv) } else { (&recv, &send) };
            if let Err(what) = check_gathered(c.shard, small, large, size) {
                fail(what);
            }
            let small_id = if c.kind == CollectiveKind::AllGather { c.send } else { c.recv };
            if let Err(what) = check_gather_layout(plan, c, small_id) {
                fail(what);
            }
        }
        CollectiveKind::Transpose => {
            if let Err(what) = check_transpose(plan, c) {
                fail(what);
            }
        }
    }
    if (c.kind == CollectiveKind::Transpose) != (c.group == Group::Mirror) {
        fail("a transpose runs over mirror groups, and only a transpose does".into());
    }
}

/// A transpose swaps its value's row and column placements on a square grid: what device (j, i) sends
/// is the block of (i, j) in the received layout. The blocks are of one shape.
fn check_transpose(plan: &Plan, c: &Collective) -> Result<(), String> {
    let (send, recv) = (plan.buffer(c.send), plan.buffer(c.recv));
    if plan.mesh.rows != plan.mesh.cols {
        return Err(format!("a {}x{} grid has no mirror across its diagonal", plan.mesh.rows, plan.mesh.cols));
    }
    if send.shape != recv.shape || send.logical_shape != recv.logical_shape {
        return Err(format!("send {:?} and receive {:?} differ", send.shape, recv.shape));
    }
    match send.layout.mirrored() {
        Some(mirrored) if mirrored == recv.layout => Ok(()),
        Some(mirrored) => Err(format!(
            "`{}`, laid out {}, arrives laid out {}, not {}",
            send.name, send.layout, recv.layout, mirrored
        )),
        None => Err(format!(
            "`{}`, laid out {}, is split along one dimension by both the rows and the columns: its mirror's \
             block is not a block of any layout",
            send.name, send.layout
        )),
    }
}

/// The block of a gather or scatter is laid out with the collective's placement on the group's mesh
/// axis, so the members' blocks land where their layout says.
fn check_gather_layout(plan: &Plan, c: &Collective, block: BufferId) -> Result<(), String> {
    let Some(axis) = c.group.axis() else { return Ok(()) };
    let b = plan.buffer(block);
    if let Some(inside) = b.layout.split_inside(axis, b.layout.0[axis]) {
        return Err(format!(
            "`{}`, laid out {}, is split along mesh axis {axis} around a split of the same dimension by \
             mesh axis {inside}: the blocks gathered or scattered would not be contiguous",
            b.name, b.layout
        ));
    }
    match c.shard {
        Some(shard) if b.layout.block_placement(axis, plan.mesh.axes()) != shard => {
            Err(format!("the placement {shard} does not match `{}`, laid out {} (mesh axis {axis})", b.name, b.layout))
        }
        _ => Ok(()),
    }
}

/// An all-gather or reduce-scatter: the gathered dimension exists, viewed as [outer, mid, inner] its
/// `mid` splits evenly over the group, and the small block is the large one with that split applied.
fn check_gathered(shard: Option<Placement>, small: &[u64], large: &[u64], size: u64) -> Result<(), String> {
    let Some(Placement::Shard { dim, outer, inner }) = shard else {
        return Err("needs the gathered dimension".into());
    };
    let dim = usize::from(dim);
    let Some(&whole) = large.get(dim) else {
        return Err(format!("the gathered dimension {dim} does not exist in {large:?}"));
    };
    let factor = outer.max(1).checked_mul(inner.max(1)).filter(|&f| whole.is_multiple_of(f));
    let mid = factor.map(|f| whole / f).filter(|m| m.is_multiple_of(size));
    let mut expected = large.to_vec();
    expected[dim] = mid.map_or(0, |mid| outer.max(1) * (mid / size) * inner.max(1));
    if mid.is_none() || expected != small {
        return Err(format!("{large:?} split over {size} devices along dimension {dim} does not give {small:?}"));
    }
    Ok(())
}

/// The sequence of collectives that device (i, j) issues in one group instance.
fn sequence(plan: &Plan, group: Group) -> Vec<(CollectiveKind, Option<u64>, u64)> {
    plan.program
        .iter()
        .filter_map(|instr| match instr {
            Instr::Collective { collective: c, .. } if c.group == group => {
                Some((c.kind, c.root, plan.buffer(c.send).bytes()))
            }
            _ => None,
        })
        .collect()
}

/// Every member of every row, column, data, depth and world group must issue the same collectives in the same order,
/// with the same payload sizes and valid roots. The program is SPMD without per-device branches, so
/// each member's sequence is the program's own; what can still differ is the size each member sends,
/// which the layouts fix to the same block shape on every device. This checks both facts.
fn check_group_order(plan: &Plan, errors: &mut Vec<String>) {
    for group in Group::ALL {
        let members = plan.mesh.group_size(group);
        for (kind, root, bytes) in sequence(plan, group) {
            if bytes == 0 {
                errors.push(format!("a {} over the {} group sends nothing", kind.name(), group.name()));
            }
            if root.is_some_and(|r| r >= members) {
                errors.push(format!("a {} over the {} group has a root outside the group", kind.name(), group.name()));
            }
        }
    }
}
