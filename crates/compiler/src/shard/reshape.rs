//! Layouts through a reshape: which splits of the input survive (and as which splits of the output),
//! and which must be gathered first.
//!
//! A reshape keeps every element's linear index, so a split survives when the elements it selects
//! are, in the output, those of one split of one dimension. A split of a dimension of `n` elements
//! into `p` parts selects one value of a "digit" of the index: its radix is `p` and its stride `g`
//! (the chunk a device holds runs `g` elements, then skips `(p - 1) g`). Where several mesh axes
//! split one dimension, each splits the block the axes before it in [`MAJOR_ORDER`] left (see
//! `optimus_plan::logical`): its placement describes a digit of that block's index, not of the
//! dimension's. Mapping such a placement as if it were the dimension's gave a block of other
//! elements than the buffer said it held, and plans that computed wrong gradients (a batch split by
//! the rows and a sequence split by the columns merged into one dimension). So where axes share a
//! dimension, on either side, each split is taken to a digit of the whole dimension, through the
//! reshape, and back into a placement relative to the block the axes before it leave; a split that
//! cannot be so expressed is gathered instead.

use optimus_plan::layout::{Layout, MAJOR_ORDER, MESH_AXES, Placement};

/// One mesh axis's split of a dimension, as a digit of its (whole) index: `parts` values, `stride`
/// elements apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Digit {
    axis: usize,
    parts: u64,
    stride: u64,
}

/// The layout to read a reshape's input in (`input` with the splits that cannot survive gathered),
/// and the layout of its output then. `from` and `to` are the logical shapes, `sizes` the mesh axes'.
pub(super) fn reshape_layouts(input: Layout, from: &[u64], to: &[u64], sizes: [u64; MESH_AXES]) -> (Layout, Layout) {
    let mut input = input;
    loop {
        match output_layout(&input, from, to, sizes) {
            Ok(output) => return (input, output),
            Err(axis) => input.0[axis] = Placement::Replicate,
        }
    }
}

/// The output layout of `input` through the reshape, or the mesh axis whose split cannot survive it.
fn output_layout(input: &Layout, from: &[u64], to: &[u64], sizes: [u64; MESH_AXES]) -> Result<Layout, usize> {
    let mut output = *input;
    let shared = (0..from.len()).any(|d| splits_of(input, d).len() > 1);
    if !shared {
        for axis in 0..MESH_AXES {
            if let Placement::Shard { dim, outer, inner } = input.0[axis] {
                output.0[axis] = map_shard(from, to, usize::from(dim), outer, inner).ok_or(axis)?;
            }
        }
        if (0..to.len()).all(|e| splits_of(&output, e).len() <= 1) {
            // One axis per dimension on both sides: each placement is its dimension's own.
            return Ok(output);
        }
    }
    let mut by_output_dim: Vec<Vec<Digit>> = vec![Vec::new(); to.len()];
    for (d, &size) in from.iter().enumerate() {
        for digit in whole_digits(input, d, size, sizes)? {
            let (e, stride) = through_reshape(from, to, d, digit)?;
            by_output_dim[e].push(Digit { stride, ..digit });
        }
    }
    for (e, digits) in by_output_dim.iter_mut().enumerate() {
        digits.sort_by_key(|d| MAJOR_ORDER.iter().position(|&a| a == d.axis));
        for (axis, placement) in relative_placements(e, to[e], digits)? {
            output.0[axis] = placement;
        }
    }
    Ok(output)
}

/// The mesh axes that split dimension `dim` of `layout`, most significant first.
fn splits_of(layout: &Layout, dim: usize) -> Vec<usize> {
    MAJOR_ORDER.into_iter().filter(|&a| layout.0[a].dim() == Some(dim)).collect()
}

/// The splits of dimension `d` (of `size` elements) as digits of its whole index, most significant
/// axis first; an axis whose split is not one digit of it is the error.
fn whole_digits(layout: &Layout, d: usize, size: u64, sizes: [u64; MESH_AXES]) -> Result<Vec<Digit>, usize> {
    // Each split's stride in the block before it, and its parts.
    let mut before: Vec<(u64, u64)> = Vec::new();
    let mut digits = Vec::new();
    let mut extent = size;
    for axis in splits_of(layout, d) {
        let Placement::Shard { outer, inner, .. } = layout.0[axis] else { continue };
        let parts = sizes[axis].max(1);
        let (outer, inner) = (outer.max(1), inner.max(1));
        let mid = extent / (outer * inner);
        if mid * outer * inner != extent || !mid.is_multiple_of(parts) {
            return Err(axis);
        }
        let local_stride = mid / parts * inner;
        // From this block's index to the whole dimension's, undoing the earlier splits last to first.
        let mut stride = local_stride;
        for &(earlier, earlier_parts) in before.iter().rev() {
            stride = widened(stride, parts, earlier, earlier_parts).ok_or(axis)?;
        }
        before.push((local_stride, parts));
        digits.push(Digit { axis, parts, stride });
        extent /= parts;
    }
    Ok(digits)
}

/// A digit (`parts` values, `stride` apart) of a block's index as a digit of the index of the block it
/// was cut from, by a split of `split_parts` values `split_stride` apart: unchanged below the split's
/// digit, `split_parts` times farther apart above it; `None` where it straddles it.
fn widened(stride: u64, parts: u64, split_stride: u64, split_parts: u64) -> Option<u64> {
    if stride * parts <= split_stride {
        Some(stride)
    } else if stride.is_multiple_of(split_stride) {
        Some(stride * split_parts)
    } else {
        None
    }
}

/// The inverse of [`widened`]: a digit of a dimension's index as one of the block a split leaves.
fn narrowed(stride: u64, parts: u64, split_stride: u64, split_parts: u64) -> Option<u64> {
    let above = split_stride * split_parts;
    if stride * parts <= split_stride {
        Some(stride)
    } else if stride.is_multiple_of(above) {
        Some(stride / split_parts)
    } else {
        None
    }
}

/// The output dimension a digit of input dimension `d` lands in, and its stride there; the digit's
/// axis where it spans two output dimensions.
fn through_reshape(from: &[u64], to: &[u64], d: usize, digit: Digit) -> Result<(usize, u64), usize> {
    let flat = digit.stride * from[d + 1..].iter().product::<u64>();
    for (e, &size) in to.iter().enumerate() {
        let after: u64 = to[e + 1..].iter().product();
        if after == 0 || flat == 0 {
            // An empty dimension: no split of it means anything.
            break;
        }
        // The digit's values must cycle within the dimension: its run (parts x stride) divides it.
        if flat.is_multiple_of(after) && flat >= after && size.is_multiple_of(flat / after * digit.parts) {
            return Ok((e, flat / after));
        }
    }
    Err(digit.axis)
}

/// The placements of the digits of output dimension `e` (of `size` elements), most significant axis
/// first, each relative to the block the axes before it leave; the first axis that cannot be so
/// expressed is the error.
fn relative_placements(e: usize, size: u64, digits: &[Digit]) -> Result<Vec<(usize, Placement)>, usize> {
    let mut placements = Vec::new();
    let mut before: Vec<(u64, u64)> = Vec::new();
    let mut extent = size;
    for digit in digits {
        let mut stride = digit.stride;
        for &(earlier, earlier_parts) in &before {
            stride = narrowed(stride, digit.parts, earlier, earlier_parts).ok_or(digit.axis)?;
        }
        let run = digit.parts * stride;
        if run == 0 || !extent.is_multiple_of(run) {
            return Err(digit.axis);
        }
        placements.push((digit.axis, Placement::shard_factor(e, extent / run, 1)));
        before.push((stride, digit.parts));
        extent /= digit.parts;
    }
    Ok(placements)
}

/// Where a split survives a reshape: the split sub-axis of `dim` (viewed as [outer, mid, inner]) must
/// lie inside one output dimension, which is then viewed the same way.
pub(super) fn map_shard(from: &[u64], to: &[u64], dim: usize, outer: u64, inner: u64) -> Option<Placement> {
    let size = *from.get(dim)?;
    let mid = size / outer.max(1) / inner.max(1);
    let after: u64 = from[dim + 1..].iter().product();
    let stride = inner.max(1) * after;
    for e in 0..to.len() {
        let after_e: u64 = to[e + 1..].iter().product();
        let block = after_e * to[e];
        let run = stride * mid;
        if run == 0 || after_e == 0 {
            // An empty dimension: no split of it survives (or means anything).
            return None;
        }
        if after_e <= stride && stride.is_multiple_of(after_e) && block.is_multiple_of(run) {
            return Some(Placement::shard_factor(e, block / run, stride / after_e));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use optimus_plan::layout::{COLUMN_AXIS, DATA_AXIS, ROW_AXIS};
    use optimus_plan::{Buffer, BufferId, Coords, Mesh, Role, logical::logical_indices, types::DType};

    fn buffer(shape: &[u64], layout: Layout, mesh: Mesh) -> Buffer {
        Buffer {
            id: BufferId(0),
            name: "x".into(),
            dtype: DType::F32,
            logical_shape: shape.to_vec(),
            layout,
            shape: layout.local_shape(shape, mesh.axes()),
            role: Role::Workspace,
        }
    }

    /// Whether every device's block of the output holds, in order, the elements its block of the input
    /// held: what a local reshape (a view of the same memory) needs.
    fn same_elements(from: &[u64], input: Layout, to: &[u64], output: Layout, mesh: Mesh) -> bool {
        let (a, b) = (buffer(from, input, mesh), buffer(to, output, mesh));
        mesh.all_coords().all(|c: Coords| {
            let (x, y) = (logical_indices(&a, c, mesh), logical_indices(&b, c, mesh));
            !x.is_empty() && x == y
        })
    }

    fn layout(placements: &[(usize, Placement)]) -> Layout {
        let mut l = Layout::REPLICATED;
        for &(axis, p) in placements {
            l.0[axis] = p;
        }
        l
    }

    #[test]
    fn a_batch_split_by_rows_and_a_sequence_split_by_columns_merge_into_one_dimension() {
        // [batch 8, seq 4, hidden 8]: rows split the batch, columns the sequence; merged to [32, 8].
        let mesh = Mesh::new(2, 2);
        let input = layout(&[(ROW_AXIS, Placement::shard(0)), (COLUMN_AXIS, Placement::shard(1))]);
        let (read, output) = reshape_layouts(input, &[8, 4, 8], &[32, 8], mesh.axes());
        assert_eq!(read, input, "both splits survive");
        assert_eq!(output.0[ROW_AXIS], Placement::shard(0));
        // Within a row's block of 4 sequences, each column holds one half of every sequence.
        assert_eq!(output.0[COLUMN_AXIS], Placement::shard_factor(0, 4, 1));
        assert!(same_elements(&[8, 4, 8], read, &[32, 8], output, mesh));
        // And back: the merged dimension split twice becomes the batch and the sequence again.
        let (read_back, back) = reshape_layouts(output, &[32, 8], &[8, 4, 8], mesh.axes());
        assert_eq!((read_back, back), (output, input));
    }

    #[test]
    fn every_surviving_layout_holds_the_elements_its_input_held() {
        // Shapes and layouts of one and two axes per dimension, with replicas; each result, whatever
        // was gathered, must be a view of the same elements on every device.
        let mesh = Mesh::new(2, 2).with_data(2);
        let shapes: [(&[u64], &[u64]); 5] = [
            (&[8, 4, 8], &[32, 8]),
            (&[32, 8], &[8, 4, 8]),
            (&[8, 4, 8], &[8, 32]),
            (&[4, 8, 4], &[4, 2, 4, 4]),
            (&[16, 6], &[4, 4, 6]),
        ];
        let placements =
            [Placement::Replicate, Placement::shard(0), Placement::shard(1), Placement::shard_factor(0, 2, 1)];
        for (from, to) in shapes {
            for &data in &placements {
                for &row in &placements {
                    for &column in &placements {
                        let input = layout(&[(DATA_AXIS, data), (ROW_AXIS, row), (COLUMN_AXIS, column)]);
                        let valid = input.0.iter().all(|p| p.dim().is_none_or(|d| d < from.len()))
                            && same_elements(from, input, from, input, mesh);
                        if !valid {
                            continue;
                        }
                        let (read, output) = reshape_layouts(input, from, to, mesh.axes());
                        assert!(
                            same_elements(from, read, to, output, mesh),
                            "{from:?} {input} -> {to:?}: read {read}, output {output}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn an_empty_dimension_gathers_instead_of_dividing_by_zero() {
        let mesh = Mesh::new(2, 2).with_data(2);
        let input = layout(&[(DATA_AXIS, Placement::shard(0)), (ROW_AXIS, Placement::shard(0))]);
        for (from, to) in [(&[0u64, 4][..], &[4u64, 0][..]), (&[4, 0], &[0, 4]), (&[8, 0], &[2, 4, 0])] {
            let (read, output) = reshape_layouts(input, from, to, mesh.axes());
            assert!(read.0.iter().chain(&output.0).all(|p| p.dim().is_none_or(|d| d < to.len().max(from.len()))));
        }
    }

    #[test]
    fn a_heads_split_of_fused_qkv_survives_the_reshape_to_heads() {
        // [b, s, (3, heads, head)] split on heads becomes [b, s, 3, heads, head] split on dim 3.
        let (b, s, n, d) = (4, 8, 6, 5);
        let p = map_shard(&[b, s, 3 * n * d], &[b, s, 3, n, d], 2, 3, d);
        assert_eq!(p, Some(Placement::shard(3)));
    }

    #[test]
    fn a_split_survives_merging_dimensions_as_the_outer_factor() {
        // [b, s, heads, head] split on heads becomes [b, s, hidden] split contiguously (attention output).
        assert_eq!(map_shard(&[2, 3, 4, 3], &[2, 3, 12], 2, 1, 1), Some(Placement::shard(2)));
        // A batch split survives merging the sequence into the batch.
        assert_eq!(map_shard(&[4, 3, 5], &[12, 5], 0, 1, 1), Some(Placement::shard(0)));
    }

    #[test]
    fn a_split_of_a_dimension_that_is_cut_finer_falls_back_to_gathering() {
        // [b, s, 12] split contiguously, reshaped to [b, s, 4, 3]: the split axis spans two output
        // dimensions, which one placement cannot name; the rule gathers it instead (correct, slower).
        assert_eq!(map_shard(&[2, 3, 12], &[2, 3, 4, 3], 2, 1, 1), None);
    }

    #[test]
    fn a_split_that_straddles_output_dimensions_does_not_map() {
        // Splitting the middle dimension of [2, 6, 2] cannot be expressed on [4, 6]: its chunks are
        // not contiguous within either output dimension.
        assert_eq!(map_shard(&[2, 6, 2], &[4, 6], 1, 1, 1), None);
    }
}
