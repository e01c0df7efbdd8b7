//! The data-parallel mesh axis: which values each replica holds its own share of (the batch), which
//! are the same on every replica (weights), and which are one replica's term of a sum over the batch
//! (weight gradients, the loss); the bucketed gradient reduction over the replicas; ZeRO-1's shard of
//! each parameter.
//!
//! The rules in `rules.rs` describe the tensor-parallel axes. The data axis follows one rule for every
//! operator, applied where the lowering creates or asks for a value: a value that carries the batch is
//! split along it over the replicas (replica d holds sequences d * batch / D .. (d + 1) * batch / D),
//! a value computed from weights alone is replicated, and a value that sums over the batch is a
//! pending sum until the optimizer (or the output) asks for it whole.

use super::Lowerer;
use super::layout::{BATCH_AXES, COLUMN_AXIS, DATA_AXIS, DEPTH_AXIS, Layout, MAJOR_ORDER, Placement, ROW_AXIS};
use crate::ir::{Node, Op};
use petgraph::graph::{DiGraph, NodeIndex};

/// Gradient bytes per device gathered into one bucket before its reductions over the replicas are
/// issued (PyTorch DDP's default bucket size).
pub const BUCKET_BYTES: u64 = 25 << 20;

/// How a value relates to the data-parallel axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DataRole {
    /// Carries the batch in dimension `.0`: each replica holds its own sequences.
    Batch(usize),
    /// The same on every replica.
    Shared,
    /// One replica's term of a sum over the whole batch.
    Summed,
}

/// The data role of every node, in node order (operands come before their users).
pub(crate) fn data_roles(graph: &DiGraph<Node, u8>) -> Vec<DataRole> {
    let mut roles: Vec<DataRole> = Vec::with_capacity(graph.node_count());
    for index in 0..graph.node_count() {
        let n = NodeIndex::new(index);
        let operands = super::operands_of(graph, n);
        let of = |m: &NodeIndex| roles.get(m.index()).copied().unwrap_or(DataRole::Shared);
        let batch = operands.iter().find_map(|m| match of(m) {
            DataRole::Batch(d) => Some(d),
            _ => None,
        });
        let summed = operands.iter().any(|m| of(m) == DataRole::Summed);
        let role = match (&graph[n].op, batch) {
            // A decoding step's position is the same for every row.
            (Op::Input { name }, _) if name == crate::decode::POSITION_INPUT => DataRole::Shared,
            (Op::Input { .. }, _) => DataRole::Batch(0),
            (Op::Param { .. } | Op::Fill { .. }, _) => DataRole::Shared,
            (op, Some(_)) if sums_over_the_batch(op) => DataRole::Summed,
            (op, Some(d)) => DataRole::Batch(batch_dim_after(op, d)),
            (_, None) if summed => DataRole::Summed,
            (_, None) => DataRole::Shared,
        };
        roles.push(role);
    }
    roles
}

/// Operators whose result no longer has the batch: it is summed away.
fn sums_over_the_batch(op: &Op) -> bool {
    matches!(
        op,
        Op::LinearGradWeight { .. }
            | Op::SumToLast
            | Op::LayerNormGradWeight { .. }
            | Op::RmsNormGradWeight { .. }
            | Op::EmbeddingGrad { .. }
            | Op::PositionEmbeddingGrad
            | Op::CrossEntropy
    )
}

/// Where the batch dimension `d` of an operand lands in the result.
fn batch_dim_after(op: &Op, d: usize) -> usize {
    match *op {
        Op::Transpose { dim0, dim1 } => super::table::swapped(d, dim0, dim1),
        Op::Select { dim, .. } if dim < d => d - 1,
        Op::SelectGrad { dim, .. } if dim <= d => d + 1,
        _ => d,
    }
}

impl Lowerer<'_> {
    /// Whether the mesh has more than one replica.
    pub(crate) fn data_parallel(&self) -> bool {
        self.target.mesh.data > 1
    }

    /// Whether some mesh axis splits the batch with the weights whole: more than one replica, or more
    /// than one depth layer (Tesseract). The depth axis follows the data axis's rule: each layer holds
    /// its own share of the replica's batch, and weight gradients are summed over the layers.
    pub(crate) fn batch_split(&self) -> bool {
        self.batch_axes().iter().any(|&axis| self.axes()[axis] > 1)
    }

    /// The mesh axes that split the batch with the weights whole under this target's strategy: the
    /// data axis, and the depth axis for tesseract (3D splits tensors over its depth axis instead).
    pub(crate) fn batch_axes(&self) -> &'static [usize] {
        match self.target.strategy {
            optimus_plan::Strategy::Tesseract => &BATCH_AXES,
            _ => &[DATA_AXIS],
        }
    }

    /// `layout` (as the tensor-parallel rules give it) with node `n`'s placement on each axis that
    /// splits the batch (see [`BATCH_AXES`]), unless that axis is already set. Outside the rules
    /// (outputs, the optimizer) a replicated batch axis is what the caller asks for and is kept.
    pub(crate) fn with_data(&self, n: NodeIndex, layout: Layout) -> Layout {
        if !self.filling_data {
            return layout;
        }
        let placement = match self.data_roles.get(n.index()) {
            Some(DataRole::Batch(d)) => Placement::shard(*d),
            Some(DataRole::Summed) => Placement::Partial,
            _ => return layout,
        };
        let axes = self.axes();
        self.batch_axes()
            .iter()
            .filter(|&&axis| axes[axis] > 1 && layout.0[axis] == Placement::Replicate)
            .fold(layout, |l, &axis| l.with(axis, placement))
    }

    /// Called after node `n` is lowered: when it completes a parameter's gradient, the gradient joins
    /// the open bucket, and a bucket that has reached [`BUCKET_BYTES`] is reduced over the replicas at
    /// once, so that its communication can overlap the rest of the backward pass.
    pub(crate) fn gradient_done(&mut self, n: NodeIndex) {
        if !self.batch_split() {
            return;
        }
        let Some(&param) = self.gradient_of.get(&n) else { return };
        let bytes =
            self.versions.get(&n).and_then(|v| v.first()).map_or(0, |v| self.buffers[v.buffer.0 as usize].bytes());
        self.open_bucket.push((n, param));
        self.open_bucket_bytes += bytes;
        if self.open_bucket_bytes >= BUCKET_BYTES {
            self.reduce_open_bucket();
        }
    }

    /// Issues the reductions of every gradient in the open bucket: each gradient is brought to its
    /// parameter's layout (summed over the tensor-parallel axes where pending, then all-reduced over
    /// the replicas, or reduce-scattered to this replica's slice under ZeRO-1).
    pub(crate) fn reduce_open_bucket(&mut self) {
        if self.open_bucket.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.open_bucket);
        self.open_bucket_bytes = 0;
        let (current, filling) = (self.current, self.filling_data);
        self.bucket = Some(self.buckets_issued);
        // The parameter's layout is what is wanted, its data axis included: no rule fills it.
        self.filling_data = false;
        for (grad, param) in pending {
            let Some(target) = self.param_buffers.get(&param).map(|v| v.layout) else { continue };
            self.current = grad;
            self.value(grad, target);
        }
        self.filling_data = filling;
        self.bucket = None;
        self.buckets_issued += 1;
        self.current = current;
    }

    /// The layout of a parameter's persistent buffer: its tensor-parallel layout, and under ZeRO-1 on
    /// more than one replica, split over the replicas along the first dimension whose block divides
    /// among them (a parameter with no such dimension stays whole on every replica).
    pub(crate) fn parameter_layout(&self, n: NodeIndex, layout: Layout) -> Layout {
        let layout = self.rows_split_3d(n, layout);
        if !self.data_parallel() || self.target.memory.zero == 0 {
            return layout;
        }
        let shape = &self.shapes[n.index()];
        let axes = self.axes();
        let replicas = self.target.mesh.data;
        for (dim, &size) in shape.iter().enumerate() {
            let mut tensor_parts = 1;
            let mut plain = true;
            for &axis in &MAJOR_ORDER[1..] {
                if let Placement::Shard { dim: d, outer, inner } = layout.0[axis]
                    && usize::from(d) == dim
                {
                    tensor_parts *= axes[axis].max(1);
                    plain &= outer == 1 && inner == 1;
                }
            }
            if plain && size % tensor_parts == 0 && (size / tensor_parts) % replicas == 0 {
                // Viewed as [tensor_parts, mid, 1], the replicas split each tensor-parallel block.
                return layout.with(DATA_AXIS, Placement::shard_factor(dim, tensor_parts, 1));
            }
        }
        layout
    }

    /// The layout the rules asked a parameter for, from the layout it is stored in: without ZeRO-1's
    /// split over the replicas and 3D's over the rows (see [`Lowerer::parameter_layout`]), which the
    /// optimizer and the gathers before each use take care of.
    pub(crate) fn rules_layout(&self, stored: Layout) -> Layout {
        let layout = stored.with(DATA_AXIS, Placement::Replicate);
        if self.target.strategy == optimus_plan::Strategy::ThreeD {
            layout.with(ROW_AXIS, Placement::Replicate)
        } else {
            layout
        }
    }

    /// 3D stores a matrix (a weight, a table) split once more over the rows, along dimension 0 within
    /// the columns' or the depth's split of it, so that no two devices hold the same elements; the
    /// rules ask for it gathered over the rows, which costs an all-gather before each product (and its
    /// gradient a reduce-scatter back). A matrix whose dimension 0 does not divide stays whole over
    /// the rows.
    fn rows_split_3d(&self, n: NodeIndex, layout: Layout) -> Layout {
        let shape = &self.shapes[n.index()];
        if self.target.strategy != optimus_plan::Strategy::ThreeD || shape.len() != 2 {
            return layout;
        }
        let axes = self.axes();
        let position = |axis: usize| MAJOR_ORDER.iter().position(|&a| a == axis);
        let (mut parts, mut within) = (1, 1);
        for axis in [COLUMN_AXIS, DEPTH_AXIS] {
            match layout.0[axis] {
                Placement::Shard { dim: 0, outer: 1, inner: 1 } => {
                    parts *= axes[axis];
                    // The rows' split nests inside the splits of less significant axes.
                    if position(axis) > position(ROW_AXIS) {
                        within *= axes[axis];
                    }
                }
                Placement::Shard { dim: 0, .. } => return layout,
                _ => {}
            }
        }
        let rows = axes[ROW_AXIS];
        if rows <= 1 || layout.0[ROW_AXIS] != Placement::Replicate || !shape[0].is_multiple_of(parts * rows) {
            return layout;
        }
        layout.with(ROW_AXIS, Placement::shard_factor(0, within, 1))
    }
}
