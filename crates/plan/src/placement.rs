//! Rank placement: which node each device (i, j) of the mesh sits on, and so which link each
//! communication group's collectives cross.
//!
//! - Row-major: rank i * cols + j, and consecutive ranks share a node (node = rank / g).
//! - Blocks: each node holds an a x b block of the mesh with a * b = g, as square as the mesh allows
//!   (2 x 2 for 4 GPUs per node, as the Optimus code's rank rearrangement does). When no block shape
//!   divides the mesh, placement falls back to row-major and says so. A mesh with depth layers
//!   (tesseract, 3d) placed for a plan ([`NodeMap::of_plan`]) may hold several depth layers of a
//!   smaller block per node, whichever leaves the fewest of the plan's bytes crossing nodes.

use crate::{Coords, Group, Mesh};
use serde::{Deserialize, Serialize};

/// How ranks are placed on nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RankPlacement {
    #[default]
    RowMajor,
    Blocks,
}

impl RankPlacement {
    pub fn name(self) -> &'static str {
        match self {
            RankPlacement::RowMajor => "row-major",
            RankPlacement::Blocks => "blocks",
        }
    }
}

/// Which link a group's collectives cross.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkKind {
    IntraNode,
    InterNode,
}

impl LinkKind {
    pub fn name(self) -> &'static str {
        match self {
            LinkKind::IntraNode => "intra-node",
            LinkKind::InterNode => "inter-node",
        }
    }
}

/// The node of every device of a mesh.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeMap {
    pub mesh: Mesh,
    pub gpus_per_node: u64,
    /// The block (rows, cols) each node holds, when placing by blocks.
    pub block: Option<(u64, u64)>,
    /// How many depth layers of that block a node holds (1 but for [`NodeMap::of_plan`] on a mesh
    /// whose depth groups carry more than its rows or columns).
    pub depth_block: u64,
    /// Why the requested placement was not used, if it was not.
    pub note: Option<String>,
}

impl NodeMap {
    pub fn new(mesh: Mesh, gpus_per_node: u64, placement: RankPlacement) -> NodeMap {
        let g = gpus_per_node.max(1);
        let mut map = NodeMap { mesh, gpus_per_node: g, block: None, depth_block: 1, note: None };
        if placement == RankPlacement::Blocks && mesh.rows * mesh.cols > g {
            map.block = block_shape(mesh, g);
            if map.block.is_none() {
                map.note = Some(format!("no block of {g} devices tiles a {mesh} mesh; placed row-major"));
            }
        }
        map
    }

    /// The node map of a plan's mesh: as [`NodeMap::new`], except that placing by blocks a mesh with
    /// depth layers (tesseract, 3d), each node holds the block of rows x columns x depth layers whose
    /// groups that cross nodes carry the fewest of the plan's bytes (3d's depth groups carry most of
    /// its traffic; tesseract's only the gradient sums).
    pub fn of_plan(plan: &crate::Plan, gpus_per_node: u64, placement: RankPlacement) -> NodeMap {
        let mut map = NodeMap::new(plan.mesh, gpus_per_node, placement);
        let mesh = plan.mesh;
        if placement != RankPlacement::Blocks || mesh.depth <= 1 || mesh.replica_devices() <= map.gpus_per_node {
            return map;
        }
        let bytes = group_bytes(plan);
        let crossing = |(a, b, c): (u64, u64, u64)| -> u64 {
            [(Group::Column, a < mesh.rows), (Group::Row, b < mesh.cols), (Group::Depth, c < mesh.depth)]
                .iter()
                .filter(|(_, crosses)| *crosses)
                .map(|(group, _)| bytes.get(group).copied().unwrap_or(0))
                .sum()
        };
        let g = map.gpus_per_node;
        let best = (1..=g.min(mesh.depth))
            .filter(|&c| g.is_multiple_of(c) && mesh.depth.is_multiple_of(c))
            .filter_map(|c| block_shape(mesh, g / c).map(|(a, b)| (a, b, c)))
            .min_by_key(|&(a, b, c)| (crossing((a, b, c)), c, a.abs_diff(b), a));
        if let Some((a, b, c)) = best {
            (map.block, map.depth_block, map.note) = (Some((a, b)), c, None);
        }
        map
    }

    /// The node holding the device at `c`. Replicas fill nodes one after another; within a replica,
    /// nodes hold blocks of `depth_block` layers of an a x b block of the grid when placing by blocks,
    /// else consecutive ranks.
    pub fn node_of(&self, c: Coords) -> u64 {
        match self.block {
            Some((a, b)) => {
                let per_layers = (self.mesh.rows / a) * (self.mesh.cols / b);
                let layers = c.d() * (self.mesh.depth.max(1) / self.depth_block) + c.k() / self.depth_block;
                layers * per_layers + (c.i() / a) * (self.mesh.cols / b) + c.j() / b
            }
            None => self.mesh.rank_of(c) / self.gpus_per_node,
        }
    }

    /// The device of each rank when the launcher fills nodes with consecutive ranks: devices in order
    /// of their node, then of their own rank. Row-major placement gives rank r the device of rank r.
    pub fn devices_by_rank(&self) -> Vec<Coords> {
        let mut devices: Vec<Coords> = self.mesh.all_coords().collect();
        devices.sort_by_key(|&c| (self.node_of(c), self.mesh.rank_of(c)));
        devices
    }

    /// Whether some group of this kind has members on more than one node.
    pub fn spans_nodes(&self, group: Group) -> bool {
        if group == Group::World {
            return self.mesh.devices() > self.gpus_per_node;
        }
        self.mesh.all_coords().any(|c| {
            let node = self.node_of(c);
            group.member_ranks(c, self.mesh).into_iter().any(|r| self.node_of(self.mesh.coords_of(r)) != node)
        })
    }

    /// The link a group's collectives are bounded by: the slowest one they cross.
    pub fn link_kind(&self, group: Group) -> LinkKind {
        if self.spans_nodes(group) { LinkKind::InterNode } else { LinkKind::IntraNode }
    }
}

/// Bytes of each group's collectives per device per step (their payloads, as `inspect` counts them).
fn group_bytes(plan: &crate::Plan) -> std::collections::BTreeMap<Group, u64> {
    let mut bytes = std::collections::BTreeMap::new();
    for instr in &plan.program {
        if let crate::Instr::Collective { collective: c, .. } = instr {
            let (send, recv) = (plan.buffer(c.send), plan.buffer(c.recv));
            *bytes.entry(c.group).or_default() += crate::report::payload(c.kind, send, recv) * send.dtype.bytes();
        }
    }
    bytes
}

/// The most nearly square a x b = g block that tiles the mesh.
fn block_shape(mesh: Mesh, g: u64) -> Option<(u64, u64)> {
    (1..=g)
        .filter(|&a| g.is_multiple_of(a))
        .map(|a| (a, g / a))
        .filter(|&(a, b)| mesh.rows.is_multiple_of(a) && mesh.cols.is_multiple_of(b))
        .min_by_key(|&(a, b)| (a.abs_diff(b), a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_fill_2x2_blocks_node_by_node() {
        let map = NodeMap::new(Mesh::new(4, 4), 4, RankPlacement::Blocks);
        let devices: Vec<(u64, u64)> = map.devices_by_rank().iter().map(|c| (c.i(), c.j())).collect();
        assert_eq!(&devices[..8], &[(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]);
        for (rank, &(i, j)) in devices.iter().enumerate() {
            assert_eq!(map.node_of(Coords::new(i, j, 0)), rank as u64 / 4, "rank {rank} is on node rank / 4");
        }
    }

    #[test]
    fn row_major_ranks_are_row_major_devices() {
        let map = NodeMap::new(Mesh::new(3, 3), 4, RankPlacement::Blocks);
        assert!(map.note.is_some(), "no 4-device block tiles 3x3");
        let expected: Vec<Coords> = (0..9).map(|r| Coords::new(r / 3, r % 3, 0)).collect();
        assert_eq!(map.devices_by_rank(), expected);
    }
}
