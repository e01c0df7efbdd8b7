//! Rank placement: which node each device (i, j) of the mesh sits on, and so which link each
//! communication group's collectives cross.
//!
//! - Row-major: rank i * cols + j, and consecutive ranks share a node (node = rank / g).
//! - Blocks: each node holds an a x b block of the mesh with a * b = g, as square as the mesh allows
//!   (2 x 2 for 4 GPUs per node, as the Optimus code's rank rearrangement does). When no block shape
//!   divides the mesh, placement falls back to row-major and says so.

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
    /// Why the requested placement was not used, if it was not.
    pub note: Option<String>,
}

impl NodeMap {
    pub fn new(mesh: Mesh, gpus_per_node: u64, placement: RankPlacement) -> NodeMap {
        let g = gpus_per_node.max(1);
        let mut map = NodeMap { mesh, gpus_per_node: g, block: None, note: None };
        if placement == RankPlacement::Blocks && mesh.rows * mesh.cols > g {
            map.block = block_shape(mesh, g);
            if map.block.is_none() {
                map.note = Some(format!("no block of {g} devices tiles a {mesh} mesh; placed row-major"));
            }
        }
        map
    }

    /// The node holding the device at `c`. Replicas, and the depth layers of each, fill nodes one after
    /// another; within a layer's grid, nodes hold blocks of it when placing by blocks, else consecutive
    /// ranks.
    pub fn node_of(&self, c: Coords) -> u64 {
        match self.block {
            Some((a, b)) => {
                let per_layer = (self.mesh.rows / a) * (self.mesh.cols / b);
                let layer = c.d() * self.mesh.depth.max(1) + c.k();
                layer * per_layer + (c.i() / a) * (self.mesh.cols / b) + c.j() / b
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
