//! Layouts as data: one placement per mesh axis (`Shard`, `Replicate`, `Partial`), and the local block
//! shape and offsets they imply. The vocabulary of PyTorch DTensor and JAX PartitionSpecs.

use serde::{Deserialize, Serialize};

/// How a tensor is placed along one mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Placement {
    /// Every member of the axis holds the whole extent.
    Replicate,
    /// Dimension `dim` is split into equal chunks over the axis. The dimension is viewed as
    /// `[outer, mid, inner]` (row-major) and `mid` is what is split: `outer = inner = 1` is an ordinary
    /// contiguous split; `outer = 3, inner = head` splits the heads of a fused (q|k|v, heads, head) axis.
    Shard { dim: u8, outer: u64, inner: u64 },
    /// Each member holds a term of a pending sum.
    Partial,
}

impl Placement {
    /// A contiguous split of `dim`.
    pub fn shard(dim: usize) -> Placement {
        Placement::Shard { dim: u8::try_from(dim).unwrap_or(u8::MAX), outer: 1, inner: 1 }
    }

    /// A split of the middle factor of `dim` viewed as `[outer, mid, inner]`; contiguous when `outer == 1`.
    pub fn shard_factor(dim: usize, outer: u64, inner: u64) -> Placement {
        if outer == 1 {
            Placement::shard(dim)
        } else {
            Placement::Shard { dim: u8::try_from(dim).unwrap_or(u8::MAX), outer, inner }
        }
    }

    pub fn dim(self) -> Option<usize> {
        match self {
            Placement::Shard { dim, .. } => Some(dim as usize),
            _ => None,
        }
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Replicate => write!(f, "R"),
            Placement::Partial => write!(f, "P"),
            Placement::Shard { dim, outer: 1, .. } => write!(f, "S({dim})"),
            Placement::Shard { dim, outer, inner } => write!(f, "S({dim}:{outer}x_x{inner})"),
        }
    }
}

/// How many mesh axes a layout describes: axis 0 splits over the rows of a tensor-parallel grid (the
/// row index i), axis 1 over its columns (the column index j), axis 2 over data-parallel replicas (the
/// replica index d), axis 3 over the depth layers of a 2.5D (Tesseract) mesh (the depth index k), each
/// layer a q x q grid. A mesh of fewer axes has size 1 along the others.
pub const MESH_AXES: usize = 4;

/// The mesh axis of the row index i.
pub const ROW_AXIS: usize = 0;
/// The mesh axis of the column index j.
pub const COLUMN_AXIS: usize = 1;
/// The mesh axis of the data-parallel replica index d.
pub const DATA_AXIS: usize = 2;
/// The mesh axis of the depth index k (Tesseract's depth layers).
pub const DEPTH_AXIS: usize = 3;

/// The order in which mesh axes that split one tensor dimension nest, most significant first: a
/// replica holds a contiguous range of the batch, which its depth layers split further, then its
/// rows, then its columns (Tesseract: device (k, i, j) holds row block k q + i).
pub const MAJOR_ORDER: [usize; MESH_AXES] = [DATA_AXIS, DEPTH_AXIS, ROW_AXIS, COLUMN_AXIS];

/// The mesh axes that split the batch and hold whole weights (whose gradients are summed over them):
/// data-parallel replicas and Tesseract's depth layers.
pub const BATCH_AXES: [usize; 2] = [DATA_AXIS, DEPTH_AXIS];

/// One placement per mesh axis (see [`MESH_AXES`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Layout(pub [Placement; MESH_AXES]);

impl Layout {
    pub const REPLICATED: Layout = Layout([Placement::Replicate; MESH_AXES]);

    /// A layout over the tensor-parallel axes, replicated over data-parallel replicas.
    pub fn new(axis0: Placement, axis1: Placement) -> Layout {
        Layout([axis0, axis1, Placement::Replicate, Placement::Replicate])
    }

    /// The local block shape on any device of a mesh with the given axis sizes.
    pub fn local_shape(&self, logical: &[u64], mesh: [u64; MESH_AXES]) -> Vec<u64> {
        let mut shape = logical.to_vec();
        for (axis, p) in self.0.iter().enumerate() {
            if let Some(d) = p.dim().and_then(|dim| shape.get_mut(dim)) {
                *d /= mesh[axis].max(1);
            }
        }
        shape
    }

    /// Whether any axis holds a pending sum.
    pub fn has_partial(&self) -> bool {
        self.0.contains(&Placement::Partial)
    }

    /// Whether the device at mesh coordinates `coords` is the one that counts its block when summing
    /// over every device's elements: the first member of each axis along which the tensor is not split
    /// (replicated, or a pending sum), so that each logical element is counted exactly once.
    pub fn counts_block_at(&self, coords: [u64; MESH_AXES]) -> bool {
        self.0.iter().zip(coords).all(|(p, c)| p.dim().is_some() || c == 0)
    }

    /// A mesh axis that splits `dim`, if any (the first in axis order when several do).
    pub fn axis_of(&self, dim: usize) -> Option<usize> {
        self.0.iter().position(|p| p.dim() == Some(dim))
    }

    /// The placement along `axis` as a collective or a slice along that axis sees it: relative to the
    /// block a device holds before that axis splits it. A split whose factor view skips over the
    /// splits of less significant axes of the same dimension (see [`MAJOR_ORDER`]; ZeRO's data-axis
    /// split of a tensor-parallel block is `[parts, mid, 1]`) is a plain split of that block.
    pub fn block_placement(&self, axis: usize, sizes: [u64; MESH_AXES]) -> Placement {
        let p = self.0[axis];
        let Placement::Shard { dim, outer, inner } = p else { return p };
        let position = MAJOR_ORDER.iter().position(|&a| a == axis).unwrap_or(MESH_AXES);
        let minor: u64 = MAJOR_ORDER
            .iter()
            .skip(position + 1)
            .filter(|&&a| self.0[a].dim() == Some(usize::from(dim)))
            .map(|&a| sizes[a].max(1))
            .product();
        if minor > 1 && outer.is_multiple_of(minor) {
            Placement::shard_factor(usize::from(dim), outer / minor, inner)
        } else {
            p
        }
    }

    /// A mesh axis less significant than `axis` (see [`MAJOR_ORDER`]) that splits the dimension that
    /// `placement` splits plainly along `axis`: that split then lies inside `axis`'s (it splits the
    /// block `axis` leaves), and gathering `axis`'s blocks or cutting new ones would not give contiguous
    /// blocks of the dimension, nor the blocks this layout says; a factor split inside (`[outer, mid,
    /// inner]` of that block, as a reshape of a split sequence into the features leaves) would mean
    /// other elements once `axis` no longer splits the block. A factor split along `axis` itself
    /// (ZeRO's of a tensor-parallel block) states its own nesting and never counts.
    pub fn split_inside(&self, axis: usize, placement: Placement) -> Option<usize> {
        let Placement::Shard { dim, outer: 1, inner: 1 } = placement else { return None };
        let position = |a: usize| MAJOR_ORDER.iter().position(|&m| m == a).unwrap_or(MESH_AXES);
        (0..MESH_AXES).find(|&other| {
            other != axis && position(other) > position(axis) && self.0[other].dim() == Some(usize::from(dim))
        })
    }

    /// This layout as a [`crate::CollectiveKind::Transpose`] leaves it: device (i, j) then holds what
    /// (j, i) held, so the row and column placements swap. `None` where both split the same dimension:
    /// the block a device receives is then not one of the swapped layout's.
    pub fn mirrored(&self) -> Option<Layout> {
        let (rows, cols) = (self.0[ROW_AXIS], self.0[COLUMN_AXIS]);
        if rows.dim().is_some() && rows.dim() == cols.dim() {
            return None;
        }
        Some(self.with(ROW_AXIS, cols).with(COLUMN_AXIS, rows))
    }

    /// This layout with `axis` set to `p`.
    pub fn with(mut self, axis: usize, p: Placement) -> Layout {
        self.0[axis] = p;
        self
    }

    /// The placements written out: the data and depth axes only when one of them is not replicated
    /// (the depth axis only when it is not), so that a plan without them reads as it did before meshes
    /// had those axes.
    fn written(&self) -> &[Placement] {
        let end = if self.0[DEPTH_AXIS] != Placement::Replicate {
            MESH_AXES
        } else if self.0[DATA_AXIS] != Placement::Replicate {
            DATA_AXIS + 1
        } else {
            DATA_AXIS
        };
        &self.0[..end]
    }
}

impl Serialize for Layout {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.written().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Layout {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Layout, D::Error> {
        let placements = Vec::<Placement>::deserialize(deserializer)?;
        if !(DATA_AXIS..=MESH_AXES).contains(&placements.len()) {
            return Err(serde::de::Error::custom(format!(
                "a layout has {DATA_AXIS} to {MESH_AXES} placements, found {}",
                placements.len()
            )));
        }
        let mut layout = Layout::REPLICATED;
        layout.0[..placements.len()].copy_from_slice(&placements);
        Ok(layout)
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({}, {}", self.0[ROW_AXIS], self.0[COLUMN_AXIS])?;
        if self.0[DATA_AXIS] != Placement::Replicate {
            write!(f, "; data {}", self.0[DATA_AXIS])?;
        }
        if self.0[DEPTH_AXIS] != Placement::Replicate {
            write!(f, "; depth {}", self.0[DEPTH_AXIS])?;
        }
        write!(f, ")")
    }
}

#[cfg(test)]
mod tests {
    use super::{COLUMN_AXIS, DATA_AXIS, Layout, Placement, ROW_AXIS};

    #[test]
    fn a_split_that_a_less_significant_axis_splits_inside_cannot_be_gathered_or_cut_in_axis_order() {
        let (rows, cols) = (Placement::shard(0), Placement::shard(1));
        // A tied table laid across the mesh in axis order: once the columns split its width, the rows
        // can neither gather nor cut the width (the columns' split lies inside theirs); the columns can.
        let width_on_columns = Layout::new(Placement::Replicate, cols);
        assert_eq!(width_on_columns.split_inside(ROW_AXIS, cols), Some(COLUMN_AXIS));
        assert_eq!(Layout::new(cols, cols).split_inside(ROW_AXIS, cols), Some(COLUMN_AXIS));
        assert_eq!(Layout::new(cols, cols).split_inside(COLUMN_AXIS, cols), None);
        // Other dimensions, replicated or summed axes, and the stored layout itself are free to move.
        assert_eq!(Layout::new(rows, cols).split_inside(ROW_AXIS, rows), None);
        assert_eq!(Layout::new(Placement::Partial, cols).split_inside(ROW_AXIS, Placement::Replicate), None);
        // The data axis is the most significant: rows and columns split inside its block, never it inside theirs.
        let zero = Layout::new(rows, cols).with(DATA_AXIS, Placement::shard(1));
        assert_eq!(zero.split_inside(DATA_AXIS, Placement::shard(1)), Some(COLUMN_AXIS));
        assert_eq!(zero.split_inside(COLUMN_AXIS, cols), None);
        // A factor split states its own nesting (ZeRO's of a tensor-parallel block).
        let factor = Placement::shard_factor(1, 2, 1);
        assert_eq!(Layout::new(rows, cols).with(DATA_AXIS, factor).split_inside(DATA_AXIS, factor), None);
    }

    #[test]
    fn a_transpose_swaps_the_row_and_column_placements_unless_both_split_one_dimension() {
        let (rows, cols) = (Placement::shard(0), Placement::shard(1));
        let stored = Layout::new(rows, cols).with(DATA_AXIS, Placement::shard_factor(1, 2, 1));
        let across = Layout::new(cols, rows).with(DATA_AXIS, Placement::shard_factor(1, 2, 1));
        assert_eq!(stored.mirrored(), Some(across));
        assert_eq!(across.mirrored(), Some(stored));
        assert_eq!(Layout::new(Placement::Partial, rows).mirrored(), Some(Layout::new(rows, Placement::Partial)));
        assert_eq!(Layout::REPLICATED.mirrored(), Some(Layout::REPLICATED));
        // Device (i, j) of a split of dimension 0 over both holds block i q + j; its mirror's, j q + i,
        // is no block of any layout.
        assert_eq!(Layout::new(rows, rows).mirrored(), None);
        assert_eq!(Layout::new(rows, Placement::shard_factor(0, 2, 1)).mirrored(), None);
    }
}
