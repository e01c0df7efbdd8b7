//! Kernel parameters against the buffers they touch: every offset, dimension, index, head count and
//! normalised size a kernel uses must stay inside its buffers and follow from their layouts, so that a
//! hand-edited plan is refused before it can read out of bounds or compute a wrong answer.

use crate::layout::{Layout, MESH_AXES, Placement};
use crate::shapes::{AttentionLayout, reshape_runs, select_grad_runs, select_runs, slice_shard_runs, transpose_swap};
use crate::{Buffer, BufferId, Coords, Kernel, Mesh, Offset, Plan};

/// [`crate::shapes::ensure`] with the message as the error, as the verifier reports it.
fn ensure(ok: bool, message: impl FnOnce() -> String) -> Result<(), String> {
    crate::shapes::ensure(ok, message).map_err(String::from)
}

/// [`crate::shapes::same_shape`] with the message as the error, as the verifier reports it.
fn same_shape(what: &str, got: &[u64], want: &[u64]) -> Result<(), String> {
    crate::shapes::same_shape(what, got, want).map_err(String::from)
}

/// The buffers one kernel instruction reads and writes (all known to exist).
struct Operands<'p> {
    plan: &'p Plan,
    inputs: Vec<&'p Buffer>,
    output: &'p Buffer,
}

impl<'p> Operands<'p> {
    /// Input `k`, or an error naming how many the kernel got.
    fn input(&self, k: usize) -> Result<&'p Buffer, String> {
        self.inputs.get(k).copied().ok_or_else(|| format!("has {} inputs, too few for this kernel", self.inputs.len()))
    }

    fn mesh(&self) -> Mesh {
        self.plan.mesh
    }
}

/// Checks the parameters of the kernel at instruction `index`; returns the problem, if any.
pub(super) fn check_parameters(
    plan: &Plan,
    kernel: &Kernel,
    inputs: &[BufferId],
    output: BufferId,
) -> Result<(), String> {
    let ops = Operands { plan, inputs: inputs.iter().map(|&b| plan.buffer(b)).collect(), output: plan.buffer(output) };
    check_arity(kernel, ops.inputs.len())?;
    match *kernel {
        Kernel::EmbeddingLookup { offset, masked } => check_row_offset(ops.mesh(), offset, masked, ops.input(1)?),
        Kernel::EmbeddingGrad { offset, masked, .. } => check_row_offset(ops.mesh(), offset, masked, ops.output),
        Kernel::CrossEntropyMax { offset, valid } => check_vocabulary(plan, offset, valid, ops.input(0)?),
        Kernel::CrossEntropyStats { offset, valid } => {
            check_vocabulary(plan, offset, valid, ops.input(0)?)?;
            check_rows_alike(ops.input(0)?, ops.input(1)?)
        }
        Kernel::CrossEntropyGrad { offset, valid } => {
            check_vocabulary(plan, offset, valid, ops.input(0)?)?;
            check_rows_alike(ops.input(0)?, ops.input(1)?)?;
            check_one_number(ops.input(5)?)
        }
        Kernel::CrossEntropyLoss => check_one_number(ops.input(3)?),
        Kernel::CrossEntropyCount => check_one_number(ops.output),
        Kernel::RowCenteredSquareSum { n } => check_normalised(n, 0.0, ops.input(0)?),
        Kernel::LayerNormApply { n, eps } => check_normalised(n, eps, ops.input(0)?),
        Kernel::LayerNormGradSums { n, eps }
        | Kernel::LayerNormGradInput { n, eps }
        | Kernel::LayerNormGradWeight { n, eps } => check_normalised(n, eps, ops.input(1)?),
        Kernel::RmsNormApply { n, eps } => check_normalised(n, eps, ops.input(0)?),
        Kernel::RmsNormGradInput { n, eps } | Kernel::RmsNormGradWeight { n, eps } => {
            check_alike(ops.input(0)?, ops.input(1)?)?;
            check_normalised(n, eps, ops.input(1)?)
        }
        Kernel::RmsNormGradSum => check_alike(ops.input(0)?, ops.input(1)?),
        Kernel::Dropout { p, .. } | Kernel::DropoutGrad { p, .. } => {
            ensure((0.0..=1.0).contains(&p), || format!("the drop probability {p} is not between 0 and 1"))?;
            check_same_layouts(&ops)
        }
        Kernel::Scale { factor } => {
            ensure(factor.is_finite(), || format!("the scale factor {factor} is not a finite number"))?;
            check_scale_layouts(&ops, factor)
        }
        Kernel::Add
        | Kernel::Mul
        | Kernel::Gelu { .. }
        | Kernel::GeluGrad { .. }
        | Kernel::Silu
        | Kernel::SiluGrad
        | Kernel::Softmax
        | Kernel::SoftmaxGrad
        | Kernel::CausalMask
        | Kernel::CausalMaskGrad => check_same_layouts(&ops),
        Kernel::Cast => check_cast(&ops),
        Kernel::Fill { value } => ensure(value.is_finite(), || format!("the fill value {value} is not finite")),
        Kernel::Reshape => check_reshape(&ops),
        Kernel::Transpose { dim0, dim1 } => check_transpose(&ops, dim0.into(), dim1.into()),
        Kernel::Select { dim, index } => check_select(ops.input(0)?, ops.output, dim.into(), index, false),
        Kernel::SelectGrad { dim, index } => check_select(ops.output, ops.input(0)?, dim.into(), index, true),
        Kernel::SliceShard { axis, placement } => check_slice_shard(&ops, axis.into(), placement),
        Kernel::Attention { heads, kv_heads, fused, .. } => check_attention(&ops, (heads, kv_heads), fused, None),
        Kernel::AttentionGrad { heads, kv_heads, fused, wrt, .. } => {
            check_attention(&ops, (heads, kv_heads), fused, Some(wrt.into()))
        }
        Kernel::Rotary { heads, theta } | Kernel::RotaryGrad { heads, theta } => check_rotary(&ops, heads, theta),
        Kernel::PositionLookup => check_positions(ops.input(0)?, ops.output),
        Kernel::PositionLookupAt => {
            check_position_input(ops.input(1)?)?;
            check_positions(ops.input(0)?, ops.output)
        }
        Kernel::RotaryAt { heads, theta } => {
            check_position_input(ops.input(1)?)?;
            let x_only = Operands { plan, inputs: vec![ops.input(0)?], output: ops.output };
            check_rotary(&x_only, heads, theta)
        }
        Kernel::CacheWrite { part, parts } => check_cache_write(&ops, part, parts),
        Kernel::CachedAttention { heads, kv_heads, fused } => check_cached_attention(&ops, (heads, kv_heads), fused),
        Kernel::PositionGrad => check_positions(ops.output, ops.input(0)?),
        Kernel::MatMul { .. }
        | Kernel::BatchedMatMul
        | Kernel::BiasAdd
        | Kernel::RowSum
        | Kernel::RowSquareSum
        | Kernel::SumToLast
        | Kernel::OptimizerStep => Ok(()),
        Kernel::GradSquareSum => check_square_sum(&ops),
    }
}

/// How many inputs a kernel takes (attention: one fused or three; its gradient: dy first).
fn expected_inputs(kernel: &Kernel) -> usize {
    match kernel {
        Kernel::Fill { .. } => 0,
        Kernel::Attention { fused, .. } => {
            if *fused {
                1
            } else {
                3
            }
        }
        Kernel::AttentionGrad { fused, .. } => {
            if *fused {
                2
            } else {
                4
            }
        }
        Kernel::MatMul { .. }
        | Kernel::BatchedMatMul
        | Kernel::BiasAdd
        | Kernel::Add
        | Kernel::Mul
        | Kernel::GeluGrad { .. }
        | Kernel::SiluGrad
        | Kernel::SoftmaxGrad
        | Kernel::EmbeddingLookup { .. }
        | Kernel::EmbeddingGrad { .. }
        | Kernel::RowCenteredSquareSum { .. } => 2,
        Kernel::CrossEntropyStats { .. }
        | Kernel::RmsNormApply { .. }
        | Kernel::RmsNormGradSum
        | Kernel::RmsNormGradWeight { .. } => 3,
        Kernel::PositionLookupAt | Kernel::RotaryAt { .. } | Kernel::CacheWrite { .. } => 2,
        Kernel::LayerNormGradWeight { .. }
        | Kernel::OptimizerStep
        | Kernel::CrossEntropyLoss
        | Kernel::CachedAttention { .. } => 4,
        Kernel::LayerNormApply { .. } | Kernel::LayerNormGradSums { .. } | Kernel::RmsNormGradInput { .. } => 5,
        Kernel::LayerNormGradInput { .. } | Kernel::CrossEntropyGrad { .. } => 6,
        _ => 1,
    }
}

fn check_arity(kernel: &Kernel, got: usize) -> Result<(), String> {
    if *kernel == Kernel::GradSquareSum {
        return ensure(got >= 1, || "takes at least one gradient".to_string());
    }
    let want = expected_inputs(kernel);
    ensure(got == want, || format!("takes {want} inputs, not {got}"))
}

/// The gradient norm's partial sum: gradients in, one element out.
fn check_square_sum(ops: &Operands) -> Result<(), String> {
    ensure(ops.output.elements() == 1, || {
        format!("writes one number, not `{}` {:?}", ops.output.name, ops.output.shape)
    })?;
    match ops.inputs.iter().find(|b| b.role != crate::Role::Gradient) {
        Some(b) => Err(format!("sums the squares of gradients, and `{}` is not one", b.name)),
        None => Ok(()),
    }
}

/// The mesh axis that splits dimension `dim` of a buffer contiguously (outer = inner = 1), if one does.
fn contiguous_split(b: &Buffer, dim: usize, what: &str) -> Result<Option<usize>, String> {
    let axes: Vec<(usize, Placement)> =
        b.layout.0.iter().copied().enumerate().filter(|(_, p)| p.dim() == Some(dim)).collect();
    match axes[..] {
        [] => Ok(None),
        [(axis, Placement::Shard { outer, inner, .. })] if outer.max(1) == 1 && inner.max(1) == 1 => Ok(Some(axis)),
        _ => Err(format!("{what} `{}` is laid out {}, which a device offset cannot describe", b.name, b.layout)),
    }
}

/// The offset as it acts on the mesh: `Some((axis, block))` when it differs between devices.
fn acting(offset: Offset, mesh: Mesh) -> Option<(usize, u64)> {
    let axis = usize::from(offset.axis?);
    (mesh.axes().get(axis).is_some_and(|&n| n > 1) && offset.block > 0).then_some((axis, offset.block))
}

fn show(offset: Offset) -> String {
    match offset.axis {
        Some(a) => format!("mesh axis {a} x block {}", offset.block),
        None => "none".to_string(),
    }
}

/// `coordinate * block + extent` stays within `logical` for every device of the mesh.
fn check_offset_range(
    mesh: Mesh,
    offset: Offset,
    b: &Buffer,
    extent: u64,
    logical: u64,
    what: &str,
) -> Result<(), String> {
    let Some(axis) = offset.axis else { return Ok(()) };
    let last = mesh.axes().get(usize::from(axis)).map(|&n| n - 1).ok_or_else(|| {
        format!("the offset names mesh axis {axis}, but a mesh has axes 0 (rows) and 1 (columns) only")
    })?;
    let end = last.checked_mul(offset.block).and_then(|start| start.checked_add(extent));
    ensure(end.is_some_and(|end| end <= logical), || {
        format!(
            "offset.block {} times mesh coordinate {last}, plus the {extent} {what} each device holds, exceeds the {logical} {what} of `{}`",
            offset.block, b.name
        )
    })
}

/// Embedding tables: the offset of each device's rows is its coordinate times the rows it holds.
fn check_row_offset(mesh: Mesh, offset: Offset, masked: bool, table: &Buffer) -> Result<(), String> {
    ensure(table.shape.len() == 2 && table.logical_shape.len() == 2, || {
        format!("the table `{}` is {:?}, not [rows, width]", table.name, table.shape)
    })?;
    let (rows, logical_rows) = (table.shape[0], table.logical_shape[0]);
    check_offset_range(mesh, offset, table, rows, logical_rows, "rows")?;
    let split = contiguous_split(table, 0, "the table")?;
    let expected = split.map(|axis| (axis, rows)).filter(|&(axis, _)| mesh.axes()[axis] > 1);
    ensure(acting(offset, mesh) == expected, || {
        let want = expected.map_or("none".into(), |(a, b)| show(Offset { axis: u8::try_from(a).ok(), block: b }));
        format!(
            "offset {} does not follow from `{}` laid out {} ({rows} of its {logical_rows} rows per device): expected {want}",
            show(offset),
            table.name,
            table.layout
        )
    })?;
    ensure(masked == expected.is_some(), || {
        format!("`masked` must be {} for the table `{}` laid out {}", expected.is_some(), table.name, table.layout)
    })
}

/// Cross-entropy: the vocabulary (the logits' last dimension) offset, and the unpadded vocabulary size.
fn check_vocabulary(plan: &Plan, offset: Offset, valid: u64, logits: &Buffer) -> Result<(), String> {
    let (Some(&width), Some(&padded)) = (logits.shape.last(), logits.logical_shape.last()) else {
        return Err(format!("the logits `{}` have no vocabulary dimension", logits.name));
    };
    let mesh = plan.mesh;
    check_offset_range(mesh, offset, logits, width, padded, "vocabulary columns")?;
    let split = contiguous_split(logits, logits.shape.len() - 1, "the logits")?;
    let expected = split.map(|axis| (axis, width)).filter(|&(axis, _)| mesh.axes()[axis] > 1);
    ensure(acting(offset, mesh) == expected, || {
        let want = expected.map_or("none".into(), |(a, b)| show(Offset { axis: u8::try_from(a).ok(), block: b }));
        format!(
            "offset {} does not follow from the logits `{}` laid out {} ({width} of {padded} columns per device): expected {want}",
            show(offset),
            logits.name,
            logits.layout
        )
    })?;
    // Padding of the vocabulary is recorded: then `valid` is the unpadded size, else the whole width.
    let unpadded: Vec<u64> =
        plan.padding.iter().filter(|p| p.padded == padded && p.logical < padded).map(|p| p.logical).collect();
    let expected = if unpadded.is_empty() { vec![padded] } else { unpadded };
    ensure(expected.contains(&valid), || {
        format!(
            "valid = {valid}, but the logits `{}` have {padded} columns of which {} are vocabulary (the padding records)",
            logits.name,
            expected.iter().map(u64::to_string).collect::<Vec<_>>().join(" or ")
        )
    })
}

/// Per mesh axis, the placement that splits one of the logits' rows (its leading dimensions).
fn row_splits(b: &Buffer, rows_rank: usize) -> [Option<Placement>; MESH_AXES] {
    b.layout.0.map(|p| Some(p).filter(|p| p.dim().is_some_and(|d| d < rows_rank)))
}

/// The targets (one per row of the logits) are split over the mesh exactly as the logits' rows are,
/// so that each device pairs a row with its own target.
fn check_rows_alike(logits: &Buffer, targets: &Buffer) -> Result<(), String> {
    let rows_rank = logits.logical_shape.len().saturating_sub(1);
    ensure(targets.logical_shape.as_slice() == &logits.logical_shape[..rows_rank], || {
        format!(
            "the targets `{}` {:?} are not one per row of `{}` {:?}",
            targets.name, targets.logical_shape, logits.name, logits.logical_shape
        )
    })?;
    ensure(row_splits(logits, rows_rank) == row_splits(targets, rows_rank), || {
        format!(
            "the targets `{}` laid out {} are not split like the rows of `{}` laid out {}",
            targets.name, targets.layout, logits.name, logits.layout
        )
    })
}

/// The number of rows a mean is taken over: the product of the leading logical dimensions.
/// The count of targets not ignored: one number.
fn check_one_number(count: &Buffer) -> Result<(), String> {
    let elements: u64 = count.logical_shape.iter().product();
    ensure(elements == 1, || format!("the count `{}` is {:?}, not one number", count.name, count.logical_shape))
}

/// Two operands read element by element (dy and x): the same logical tensor shape, laid out alike.
fn check_alike(a: &Buffer, b: &Buffer) -> Result<(), String> {
    ensure(a.shape == b.shape && a.logical_shape == b.logical_shape && a.layout == b.layout, || {
        format!(
            "`{}` ({:?} laid out {}) and `{}` ({:?} laid out {}) differ",
            a.name, a.logical_shape, a.layout, b.name, b.logical_shape, b.layout
        )
    })
}

/// LayerNorm and RMSNorm: `n` is the full (logical) normalised size, and eps a non-negative number.
fn check_normalised(n: u64, eps: f64, x: &Buffer) -> Result<(), String> {
    let full = x.logical_shape.last().copied().unwrap_or(1);
    ensure(n == full, || format!("n = {n}, but `{}` normalises over {full} elements ({:?})", x.name, x.logical_shape))?;
    ensure(eps.is_finite() && eps >= 0.0, || format!("eps = {eps} is not a non-negative number"))
}

/// Element-wise kernels: every operand is the same logical tensor laid out the same way as the output
/// (elements are matched by position, and dropout masks follow the output's logical indices).
fn check_same_layouts(ops: &Operands) -> Result<(), String> {
    let out = ops.output;
    for b in &ops.inputs {
        ensure(b.shape == out.shape && b.logical_shape == out.logical_shape && b.layout == out.layout, || {
            format!(
                "`{}` ({:?} laid out {}) and the output `{}` ({:?} laid out {}) differ",
                b.name, b.logical_shape, b.layout, out.name, out.logical_shape, out.layout
            )
        })?;
    }
    Ok(())
}

/// A scale keeps its operand's layout, or shares a whole value out as a pending sum: where the output
/// is partial along axes the input is whole along, each member holds 1/p of it (p the product of those
/// axes' sizes), so that the members' blocks sum to the value.
fn check_scale_layouts(ops: &Operands, factor: f64) -> Result<(), String> {
    let (x, out) = (ops.input(0)?, ops.output);
    let shared: Vec<usize> = (0..MESH_AXES)
        .filter(|&a| out.layout.0[a] == Placement::Partial && x.layout.0[a] == Placement::Replicate)
        .collect();
    if shared.is_empty() {
        return check_same_layouts(ops);
    }
    let mut whole = out.layout;
    for &a in &shared {
        whole.0[a] = Placement::Replicate;
    }
    ensure(x.shape == out.shape && x.logical_shape == out.logical_shape && x.layout == whole, || {
        format!("`{}` laid out {} is not `{}` laid out {} with pending sums", x.name, x.layout, out.name, out.layout)
    })?;
    let parts: u64 = shared.iter().map(|&a| ops.mesh().axes()[a].max(1)).product();
    ensure((factor * parts as f64 - 1.0).abs() < 1e-12, || {
        format!("sharing `{}` out over {parts} members scales it by {factor}, not 1/{parts}", x.name)
    })
}

/// A cast changes only the element type, between floating-point types.
fn check_cast(ops: &Operands) -> Result<(), String> {
    check_same_layouts(ops)?;
    for b in ops.inputs.iter().chain([&ops.output]) {
        ensure(!b.dtype.is_integer(), || {
            format!("casts only floating-point buffers, not `{}` ({})", b.name, b.dtype.name())
        })?;
    }
    Ok(())
}

fn check_reshape(ops: &Operands) -> Result<(), String> {
    let x = ops.input(0)?;
    reshape_runs(&x.shape, &ops.output.shape).map_err(|e| format!("reshaping `{}`: {e}", x.name))?;
    let count = |s: &[u64]| s.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
    ensure(count(&x.logical_shape) == count(&ops.output.logical_shape), || {
        format!(
            "reshaping `{}` {:?} into {:?} changes the element count",
            x.name, x.logical_shape, ops.output.logical_shape
        )
    })
}

fn check_transpose(ops: &Operands, dim0: usize, dim1: usize) -> Result<(), String> {
    let x = ops.input(0)?;
    let rank = x.logical_shape.len();
    ensure(dim0 < rank && dim1 < rank, || {
        format!("dims {dim0} and {dim1} are not both dimensions of `{}` (rank {rank})", x.name)
    })?;
    transpose_swap(&x.shape, &ops.output.shape, dim0, dim1).map_err(|e| format!("transposing `{}`: {e}", x.name))?;
    let mut swapped = x.logical_shape.clone();
    swapped.swap(dim0, dim1);
    same_shape("the output's logical shape", &ops.output.logical_shape, &swapped)
}

/// Select (and its gradient, with the roles of `whole` and `part` swapped): `dim` exists, `index` lies
/// inside it, and no device splits `dim` (the index is logical).
fn check_select(whole: &Buffer, part: &Buffer, dim: usize, index: u64, grad: bool) -> Result<(), String> {
    let rank = whole.logical_shape.len();
    ensure(dim < rank, || format!("dim {dim} is not a dimension of `{}` (rank {rank})", whole.name))?;
    ensure(index < whole.logical_shape[dim], || {
        format!("index {index} is outside dimension {dim} of `{}` {:?}", whole.name, whole.logical_shape)
    })?;
    ensure(whole.layout.axis_of(dim).is_none(), || {
        format!("`{}` is laid out {}, which splits the selected dimension {dim}", whole.name, whole.layout)
    })?;
    let runs = if grad {
        select_grad_runs(&part.shape, &whole.shape, dim, index)
    } else {
        select_runs(&whole.shape, &part.shape, dim, index)
    };
    runs.map(|_| ()).map_err(|e| format!("selecting from `{}`: {e}", whole.name))
}

/// Slicing this device's block: the mesh axis exists, the output is laid out with the placement on
/// that axis, and the block shapes agree for every device (the runs' shape checks do not depend on
/// the device).
fn check_slice_shard(ops: &Operands, axis: usize, placement: Placement) -> Result<(), String> {
    let x = ops.input(0)?;
    let out = ops.output;
    ensure(axis < MESH_AXES, || format!("mesh axis {axis} does not exist (a mesh has axes 0 to {})", MESH_AXES - 1))?;
    ensure(placement.dim().is_none_or(|d| d < x.shape.len()), || {
        format!("the placement {placement} names a dimension `{}` {:?} does not have", x.name, x.shape)
    })?;
    let sizes = ops.mesh().axes();
    ensure(sizes[axis] == 1 || out.layout.block_placement(axis, sizes) == placement, || {
        format!("the output `{}` is laid out {}, not {placement} on mesh axis {axis}", out.name, out.layout)
    })?;
    let inside = (sizes[axis] > 1).then(|| x.layout.split_inside(axis, out.layout.0[axis])).flatten();
    ensure(inside.is_none(), || {
        format!(
            "`{}`, laid out {}, is cut along mesh axis {axis} where mesh axis {} already splits the same \
             dimension inside it: its blocks would not be the ones `{}` ({}) says",
            x.name,
            x.layout,
            inside.unwrap_or_default(),
            out.name,
            out.layout
        )
    })?;
    slice_shard_runs(&x.shape, &out.shape, ops.mesh(), Coords::default(), axis, placement)
        .map(|_| ())
        .map_err(|e| format!("slicing `{}`: {e}", x.name))
}

/// Attention and its gradient (`wrt` given): the operands pack whole heads and the output has the
/// operand's (or, for the gradient, the chosen operand's) shape.
fn check_attention(
    ops: &Operands,
    (heads, kv_heads): (u64, u64),
    fused: bool,
    wrt: Option<usize>,
) -> Result<(), String> {
    let (dy, operands) = match wrt {
        Some(_) => (Some(ops.input(0)?), &ops.inputs[1..]),
        None => (None, &ops.inputs[..]),
    };
    let shapes: Vec<&[u64]> = operands.iter().map(|b| b.shape.as_slice()).collect();
    let layout = AttentionLayout::new(&shapes, heads, kv_heads, fused)?;
    check_head_split(operands, &layout)?;
    check_whole_sequences(operands.iter().copied().chain(dy))?;
    let Some(wrt) = wrt else { return same_shape("the output", &ops.output.shape, &layout.out_shape()) };
    let count = if fused { 1 } else { 3 };
    ensure(wrt < count, || format!("wrt = {wrt}, but the attention has {count} operand(s)"))?;
    if let Some(dy) = dy {
        same_shape("dy", &dy.shape, &layout.out_shape())?;
    }
    same_shape("the output", &ops.output.shape, shapes[wrt])
}

/// Attention reads whole sequences: no operand may split its sequence dimension (second to last).
fn check_whole_sequences<'b>(buffers: impl Iterator<Item = &'b Buffer>) -> Result<(), String> {
    for b in buffers {
        let seq = b.shape.len().saturating_sub(2);
        ensure(b.layout.axis_of(seq).is_none(), || {
            format!("`{}` is laid out {}, which splits the sequence attention reads whole", b.name, b.layout)
        })?;
    }
    Ok(())
}

/// Where the operands' width is split by heads (viewed as [3, heads, head] or [heads, head]), the
/// split's inner factor is the head size, so `heads` is the number of whole heads each device holds.
fn check_head_split(operands: &[&Buffer], layout: &AttentionLayout) -> Result<(), String> {
    for b in operands {
        let last = b.shape.len().saturating_sub(1);
        for p in b.layout.0 {
            if let Placement::Shard { dim, inner, .. } = p
                && usize::from(dim) == last
                && inner > 1
            {
                ensure(inner == layout.d as u64, || {
                    format!(
                        "{} heads of {} on this device disagree with `{}` laid out {}, whose heads have {inner} elements",
                        layout.heads, layout.d, b.name, b.layout
                    )
                })?;
            }
        }
    }
    Ok(())
}

/// Rotary embedding and its backward: input and output alike, whole heads of an even size on the
/// device, and the sequence dimension (second to last) not split, so that a row's local index along
/// it is its position; the width is whole or split contiguously (into whole heads).
fn check_rotary(ops: &Operands, heads: u64, theta: f64) -> Result<(), String> {
    let x = ops.input(0)?;
    ensure(theta > 0.0 && theta.is_finite(), || format!("the rotary base {theta} is not a positive number"))?;
    check_same_layouts(ops)?;
    let (_, _, width) = crate::shapes::batch_matrix(&x.shape, "x")?;
    crate::rotary::head_size(width, heads)?;
    let rank = x.shape.len();
    ensure(x.layout.axis_of(rank - 2).is_none(), || {
        format!("`{}` is laid out {}, which splits the sequence (rotary positions would be wrong)", x.name, x.layout)
    })?;
    for p in x.layout.0 {
        if let Placement::Shard { dim, outer, .. } = p {
            ensure(usize::from(dim) != rank - 1 || outer == 1, || {
                format!("`{}` is laid out {}, which does not split its width into whole heads", x.name, x.layout)
            })?;
        }
    }
    Ok(())
}

/// A step's position: one i32, the same on every device.
fn check_position_input(position: &Buffer) -> Result<(), String> {
    ensure(position.dtype == crate::types::DType::I32 && position.elements() == 1, || {
        format!("the position operand `{}` is not one i32 ({:?} {:?})", position.name, position.dtype, position.shape)
    })?;
    ensure(position.layout.0.iter().all(|p| *p == Placement::Replicate), || {
        format!("the position operand `{}` is laid out {}, not whole on every device", position.name, position.layout)
    })
}

/// A cache is a [`crate::Role::Cache`] buffer whose positions (second to last dimension) are whole on
/// every device, laid out along its other dimensions as `like` (this step's rows) is.
fn check_cache_buffer(cache: &Buffer, like: &Buffer) -> Result<(), String> {
    ensure(cache.role == crate::Role::Cache, || format!("`{}` is not a key/value cache", cache.name))?;
    let rank = cache.shape.len();
    ensure(rank >= 2 && cache.layout.axis_of(rank - 2).is_none(), || {
        format!("the cache `{}` is laid out {}, which splits its positions", cache.name, cache.layout)
    })?;
    ensure(like.shape.len() == rank && like.layout.axis_of(rank - 2).is_none(), || {
        format!("`{}` is laid out {}, which splits the sequence", like.name, like.layout)
    })?;
    for dim in 0..rank - 2 {
        ensure(cache.layout.axis_of(dim) == like.layout.axis_of(dim), || {
            format!(
                "the cache `{}` ({}) and `{}` ({}) split their rows differently",
                cache.name, cache.layout, like.name, like.layout
            )
        })?;
    }
    Ok(())
}

fn check_cache_write(ops: &Operands, part: u8, parts: u8) -> Result<(), String> {
    let (x, cache) = (ops.input(0)?, ops.output);
    check_position_input(ops.input(1)?)?;
    crate::shapes::CacheWriteLayout::new(&x.shape, &cache.shape, part, parts)?;
    check_cache_buffer(cache, x)
}

fn check_cached_attention(ops: &Operands, heads: (u64, u64), fused: bool) -> Result<(), String> {
    let (q, k, v) = (ops.input(0)?, ops.input(1)?, ops.input(2)?);
    check_position_input(ops.input(3)?)?;
    let layout = crate::shapes::CachedAttentionLayout::new(&q.shape, &k.shape, &v.shape, heads, fused)?;
    check_cache_buffer(k, q)?;
    check_cache_buffer(v, q)?;
    same_shape("the output", &ops.output.shape, &layout.out_shape(&q.shape))
}

/// Position tables: [context, width] rows 0..seq, never split by rows, width laid out like the sequence.
fn check_positions(table: &Buffer, sequence: &Buffer) -> Result<(), String> {
    let bad = || {
        format!(
            "a table `{}` {:?} cannot give the positions of `{}` {:?}",
            table.name, table.shape, sequence.name, sequence.shape
        )
    };
    let (&[ctx, width], [.., seq, last]) = (table.shape.as_slice(), sequence.shape.as_slice()) else {
        return Err(bad());
    };
    ensure(width == *last && *seq <= ctx, bad)?;
    ensure(table.layout.axis_of(0).is_none(), || {
        format!("the position table `{}` is laid out {}, which splits its rows", table.name, table.layout)
    })?;
    let seq_dim = sequence.shape.len() - 2;
    ensure(sequence.layout.axis_of(seq_dim).is_none(), || {
        format!("`{}` is laid out {}, which splits the sequence", sequence.name, sequence.layout)
    })?;
    let width_axis = |l: &Layout, dim: usize| l.0.iter().map(|p| p.dim() == Some(dim)).collect::<Vec<_>>();
    ensure(width_axis(&table.layout, 1) == width_axis(&sequence.layout, seq_dim + 1), || {
        format!(
            "the widths of `{}` ({}) and `{}` ({}) are split differently",
            table.name, table.layout, sequence.name, sequence.layout
        )
    })
}
