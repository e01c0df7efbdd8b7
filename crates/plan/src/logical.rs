//! Mesh-independent element identities shared by every backend: the logical index of each local
//! element of a buffer (from its layout), and the dropout mask drawn over those logical indices.

use super::init::mix64;
use super::shapes::numel;
use crate::layout::{MAJOR_ORDER, Placement};
use crate::{Buffer, Coords, Mesh};

/// The keep decisions of one tensor: element `index` is the `index`-th output of a SplitMix64 stream
/// whose start depends on (seed, key); it is kept when its top 53 bits, as a fraction, are >= p.
pub struct DropoutMask {
    pub base: u64,
    pub threshold: f64,
}

impl DropoutMask {
    pub fn new(seed: u64, key: u32, p: f64) -> DropoutMask {
        let base = mix64(seed ^ mix64(u64::from(key) ^ 0xD1B5_4A32_D192_ED03));
        DropoutMask { base, threshold: p * (1u64 << 53) as f64 }
    }

    #[inline]
    pub fn keep(&self, index: u64) -> bool {
        let h = mix64(self.base.wrapping_add(index.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        (h >> 11) as f64 >= self.threshold
    }
}

/// Counter-based dropout decision (mesh-independent): keep element `index` (its linear index in the
/// tensor's *logical* shape) of the tensor identified by `key` under `seed`.
pub fn dropout_keep(seed: u64, key: u32, index: u64, p: f64) -> bool {
    DropoutMask::new(seed, key, p).keep(index)
}

/// For each local dimension, the logical coordinate of each local coordinate; and the logical strides.
pub struct IndexMap {
    maps: Vec<Vec<u64>>,
    strides: Vec<u64>,
}

impl IndexMap {
    pub fn new(meta: &Buffer, coords: Coords, mesh: Mesh) -> Result<IndexMap, BlockError> {
        let logical = &meta.logical_shape;
        let rank = logical.len();
        if meta.shape.len() != rank {
            return Err(BlockError::Rank { local: meta.shape.len(), logical: rank });
        }
        if let Some(dim) = meta.layout.0.iter().filter_map(|p| p.dim()).find(|&d| d >= rank) {
            return Err(BlockError::NoDimension { layout: meta.layout.to_string(), dim, rank });
        }
        let mut maps = Vec::with_capacity(rank);
        for (d, &size) in logical.iter().enumerate() {
            let splits = Split::of_dim(meta, d, coords, mesh);
            // The extent after each split, checked before anything is allocated.
            let mut extents = vec![size];
            for split in &splits {
                let parent = extents.last().copied().unwrap_or(size);
                extents.push(split.local(parent)?);
            }
            let local = extents.last().copied().unwrap_or(size);
            if local != meta.shape[d] {
                let layout = meta.layout.to_string();
                return Err(BlockError::LocalSize { layout, dim: d, local, shape: meta.shape[d] });
            }
            let logical_coordinate =
                |x: u64| splits.iter().zip(&extents).rev().fold(x, |x, (split, &parent)| split.coordinate(parent, x));
            let map = (0..local).map(logical_coordinate).collect();
            maps.push(map);
        }
        let mut strides = vec![1u64; rank];
        for d in (0..rank.saturating_sub(1)).rev() {
            strides[d] = strides[d + 1].saturating_mul(logical[d + 1]);
        }
        Ok(IndexMap { maps, strides })
    }

    /// For each dimension, the logical coordinate of each local coordinate (increasing).
    pub fn dimensions(&self) -> &[Vec<u64>] {
        &self.maps
    }

    /// The logical coordinates of the local last dimension and its logical stride (none for a scalar).
    pub fn last_dimension(&self) -> Option<(&[u64], u64)> {
        Some((self.maps.last()?.as_slice(), *self.strides.last()?))
    }

    /// The logical linear index of the first element of local row `row` (rows run over every
    /// dimension but the last), without the last dimension's part.
    #[inline]
    pub fn row_base(&self, row: usize) -> u64 {
        let leading = self.maps.len().saturating_sub(1);
        let mut rest = row;
        let mut base = 0u64;
        for d in (0..leading).rev() {
            let map = &self.maps[d];
            let extent = map.len().max(1);
            base += map.get(rest % extent).copied().unwrap_or(0) * self.strides[d];
            rest /= extent;
        }
        base
    }

    /// Calls `f(local linear index, logical linear index)` for every local element, in local order.
    pub fn for_each(&self, mut f: impl FnMut(usize, u64)) {
        let mut local = 0usize;
        self.visit(0, 0, &mut local, &mut f);
    }

    fn visit(&self, d: usize, base: u64, local: &mut usize, f: &mut impl FnMut(usize, u64)) {
        let Some(map) = self.maps.get(d) else {
            f(*local, base);
            *local += 1;
            return;
        };
        let stride = self.strides[d];
        if d + 1 == self.maps.len() {
            for &m in map {
                f(*local, base + m * stride);
                *local += 1;
            }
        } else {
            for &m in map {
                self.visit(d + 1, base + m * stride, local, f);
            }
        }
    }
}

/// One split of a dimension over a mesh axis: the dimension is viewed as `[outer, mid, inner]` and
/// `mid` is cut into `parts` equal chunks, of which this device holds chunk `coord`.
#[derive(Clone, Copy, Debug)]
struct Split {
    outer: u64,
    inner: u64,
    parts: u64,
    coord: u64,
}

impl Split {
    /// The splits of dimension `d` of a buffer on the device at `coords`, most significant first (see
    /// [`MAJOR_ORDER`]: a dimension split over several axes is split by each within the chunk of the one
    /// before).
    fn of_dim(meta: &Buffer, d: usize, coords: Coords, mesh: Mesh) -> Vec<Split> {
        let (coords, parts) = (coords.0, mesh.axes());
        MAJOR_ORDER
            .into_iter()
            .filter_map(|axis| match meta.layout.0[axis] {
                Placement::Shard { dim, outer, inner } if usize::from(dim) == d => {
                    Some(Split { outer: outer.max(1), inner: inner.max(1), parts: parts[axis], coord: coords[axis] })
                }
                _ => None,
            })
            .collect()
    }

    /// The extent of this device's chunk of an extent of `size`, or why there is none.
    fn local(&self, size: u64) -> Result<u64, BlockError> {
        let Split { outer, inner, parts, coord } = *self;
        let mid = size / outer.saturating_mul(inner);
        if parts == 0 || coord >= parts {
            return Err(BlockError::Coordinate { coord, parts });
        }
        if mid.saturating_mul(outer).saturating_mul(inner) != size || !mid.is_multiple_of(parts) {
            return Err(BlockError::Indivisible { size, outer, inner, parts });
        }
        Ok(outer * (mid / parts) * inner)
    }

    /// The coordinate within an extent of `size` of local coordinate `x` (`local(size)` succeeded).
    fn coordinate(&self, size: u64, x: u64) -> u64 {
        let mid = size / (self.outer * self.inner);
        let run = mid / self.parts * self.inner;
        (x / run) * mid * self.inner + self.coord * run + x % run
    }
}

/// The logical linear index of each local element of a buffer on the device at `coords`, from its
/// layout, or an error when the layout, the local shape and the logical shape disagree.
pub fn try_logical_indices(meta: &Buffer, coords: Coords, mesh: Mesh) -> Result<Vec<u64>, BlockError> {
    let map = IndexMap::new(meta, coords, mesh)?;
    let mut out = Vec::with_capacity(numel(&meta.shape));
    map.for_each(|_, logical| out.push(logical));
    Ok(out)
}

/// The logical linear index of each local element of a buffer on the device at `coords`, from its
/// layout. Empty when the buffer's layout and shapes disagree (see [`try_logical_indices`]).
pub fn logical_indices(meta: &Buffer, coords: Coords, mesh: Mesh) -> Vec<u64> {
    try_logical_indices(meta, coords, mesh).unwrap_or_default()
}

/// Why a device's block of a buffer cannot be laid out, cut or joined: the buffer's layout, its local
/// shape and its logical shape disagree, or a tensor does not match the buffer.
#[derive(Clone, Debug, PartialEq)]
pub enum BlockError {
    /// The local shape's rank is not the logical shape's.
    Rank { local: usize, logical: usize },
    /// The layout splits a dimension the tensor does not have.
    NoDimension { layout: String, dim: usize, rank: usize },
    /// The layout gives another local size of dimension `dim` than the buffer's local shape.
    LocalSize { layout: String, dim: usize, local: u64, shape: u64 },
    /// A mesh coordinate outside its axis of `parts` devices.
    Coordinate { coord: u64, parts: u64 },
    /// A dimension of `size`, viewed as [outer, _, inner], does not split in `parts`.
    Indivisible { size: u64, outer: u64, inner: u64, parts: u64 },
    /// A logical tensor for buffer `name` has another shape than its logical shape.
    LogicalShape { name: String, want: Vec<u64>, got: Vec<u64> },
    /// A tensor for buffer `name` is larger than its (padded) logical shape in some dimension.
    DoesNotFit { name: String, shape: Vec<u64>, logical: Vec<u64> },
    /// Integers where floating-point values are needed.
    Integers,
}

impl std::fmt::Display for BlockError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BlockError::Rank { local, logical } => {
                write!(f, "the local shape's rank is {:?}, expected {:?}", [local], [logical])
            }
            BlockError::NoDimension { layout, dim, rank } => {
                write!(f, "layout {layout} splits dimension {dim} of a rank-{rank} tensor")
            }
            BlockError::LocalSize { layout, dim, local, shape } => {
                write!(f, "layout {layout} gives {local} local elements in dimension {dim}, not {shape}")
            }
            BlockError::Coordinate { coord, parts } => {
                write!(f, "mesh coordinate {coord} is outside an axis of {parts}")
            }
            BlockError::Indivisible { size, outer, inner, parts } => {
                write!(f, "a dimension of {size} viewed as [{outer}, _, {inner}] cannot be split in {parts}")
            }
            BlockError::LogicalShape { name, want, got } => write!(f, "`{name}` must be {want:?}, not {got:?}"),
            BlockError::DoesNotFit { name, shape, logical } => {
                write!(f, "`{name}` is {shape:?}, which does not fit {logical:?}")
            }
            BlockError::Integers => f.write_str("expected a floating-point tensor, found integers"),
        }
    }
}

impl std::error::Error for BlockError {}

impl From<BlockError> for String {
    fn from(e: BlockError) -> String {
        e.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::{block_of, gather_blocks, pad_to};
    use crate::layout::Layout;
    use crate::tensor::Tensor;
    use crate::types::DType;
    use crate::{BufferId, Role};

    fn buffer(logical: &[u64], layout: Layout, shape: &[u64]) -> Buffer {
        let (id, name, dtype, role) = (BufferId(0), "w".to_string(), DType::F32, Role::Parameter);
        Buffer { id, name, dtype, logical_shape: logical.to_vec(), layout, shape: shape.to_vec(), role }
    }

    fn index_error(b: &Buffer, coords: Coords, mesh: Mesh) -> String {
        IndexMap::new(b, coords, mesh).err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn a_layout_that_cannot_place_a_block_says_what_disagrees() {
        let rows = Layout::new(Placement::shard(0), Placement::Replicate);
        let mesh = Mesh::new(2, 1);
        let origin = Coords::default();
        assert_eq!(
            index_error(&buffer(&[4, 3], rows, &[2]), origin, mesh),
            "the local shape's rank is [1], expected [2]"
        );
        assert_eq!(
            index_error(&buffer(&[4], Layout::new(Placement::shard(1), Placement::Replicate), &[2]), origin, mesh),
            "layout (S(1), R) splits dimension 1 of a rank-1 tensor"
        );
        assert_eq!(
            index_error(&buffer(&[4, 3], rows, &[3, 3]), origin, mesh),
            "layout (S(0), R) gives 2 local elements in dimension 0, not 3"
        );
        assert_eq!(
            index_error(&buffer(&[5, 3], rows, &[2, 3]), origin, mesh),
            "a dimension of 5 viewed as [1, _, 1] cannot be split in 2"
        );
        let outside = Coords::new(2, 0, 0);
        assert_eq!(
            index_error(&buffer(&[4, 3], rows, &[2, 3]), outside, mesh),
            "mesh coordinate 2 is outside an axis of 2"
        );
    }

    #[test]
    fn rows_gathered_alone_and_unpadded_equal_those_of_the_whole_tensor() {
        use crate::init::{gather_rows, unpad};
        // [2, 4, 6] split: dimension 1 over the rows of a 2x2 mesh, dimension 2 over its columns.
        let meta = buffer(&[2, 4, 6], Layout::new(Placement::shard(1), Placement::shard(2)), &[2, 2, 3]);
        let mesh = Mesh::new(2, 2);
        let whole = Tensor::from_f32(&[2, 4, 6], (0..48).map(|v| v as f32).collect());
        let blocks: Vec<Tensor> =
            (0..4).map(|rank| block_of(&whole, &meta, mesh.coords_of(rank), mesh).expect("a block")).collect();
        let refs: Vec<&Tensor> = blocks.iter().collect();
        assert_eq!(gather_blocks(&refs, &meta, mesh).expect("gathered"), whole);
        let rows = gather_rows(&refs, &meta, mesh, &[7, 0, 5]).expect("rows");
        let values = whole.f32().expect("floats");
        for (row, want) in rows.iter().zip([7usize, 0, 5]) {
            assert_eq!(row.as_slice(), &values[want * 6..want * 6 + 6], "row {want}");
        }
        // The leading [2, 3, 4] corner, row by row.
        let corner = unpad(&whole, &[2, 3, 4]);
        let expected: Vec<f32> =
            (0..2).flat_map(|b| (0..3).flat_map(move |s| (0..4).map(move |v| (b * 24 + s * 6 + v) as f32))).collect();
        assert_eq!(corner, Tensor::from_f32(&[2, 3, 4], expected));
    }

    #[test]
    fn a_tensor_that_does_not_match_its_buffer_is_refused_by_name() {
        let whole = buffer(&[2, 3], Layout::REPLICATED, &[2, 3]);
        let mesh = Mesh::new(1, 1);
        let wrong = Tensor::from_f32(&[3, 2], vec![0.0; 6]);
        let cut = block_of(&wrong, &whole, Coords::default(), mesh).err().map(|e| e.to_string());
        assert_eq!(cut.as_deref(), Some("`w` must be [2, 3], not [3, 2]"));
        let larger = Tensor::from_f32(&[3, 3], vec![0.0; 9]);
        let padded = pad_to(&larger, &whole).err().map(|e| e.to_string());
        assert_eq!(padded.as_deref(), Some("`w` is [3, 3], which does not fit [2, 3]"));
        let integers = Tensor::from_i32(&[2, 3], vec![0; 6]);
        let joined = gather_blocks(&[&integers], &whole, mesh).err().map(|e| e.to_string());
        assert_eq!(joined.as_deref(), Some("expected a floating-point tensor, found integers"));
    }
}
