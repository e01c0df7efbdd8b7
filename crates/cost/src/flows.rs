//! Collectives at the flow level: every group of a kind runs a collective at once (SPMD), and the
//! bytes their algorithms send through each node's NIC add up, so a collective takes as long as its
//! slowest group given what the others put on the same NICs.
//!
//! For a group of p members on N nodes, payload n bytes per member (as `inspect` counts it), two
//! algorithms, as NCCL has:
//!
//! - **Ring** ordered by node: every member sends f n over its own link (f = 2(p-1)/p for an
//!   all-reduce, (p-1)/p for an all-gather or reduce-scatter, 1 for a pipelined broadcast or reduce),
//!   and where the group spans nodes one ring edge leaves each node, carrying the same f n through
//!   that node's NIC. Steps: 2(p-1) for an all-reduce, else p-1, at the slowest link's latency.
//! - **Hierarchical** (intra-node, then inter-node, then intra-node): with k members per node, an
//!   all-reduce reduce-scatters inside the node (f = (k-1)/k), all-reduces its share between nodes
//!   (2(N-1)/N n through each NIC in all), and all-gathers inside the node; an all-gather or
//!   reduce-scatter moves (N-1)/N n through each NIC; a broadcast or reduce n. Latency: the intra
//!   steps plus 2 ceil(log2 N) (all-reduce) or ceil(log2 N) inter-node rounds, as a tree.
//!
//! A NIC's time is the bytes of every group through it over its bandwidth; no member sends faster than
//! its own link, and a group's flows leaving a node use at most one NIC per member there (nodes with
//! one NIC per GPU, as DGX, give a lone member 1/g of the node's bandwidth; nodes with one NIC give it
//! all of it). `auto` takes the faster algorithm for each collective, as NCCL chooses by size.
//! Groups inside one node use the alpha-beta formulas of [`super::collective`] on the intra-node link.

use super::collective::{Algorithm, ceil_log2, collective_time};
use super::hardware::Hardware;
use optimus_plan::placement::{LinkKind, NodeMap};
use optimus_plan::{CollectiveKind, Group};
use std::collections::BTreeMap;

/// Where the groups of one kind sit: for each group, its members on each node it spans.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupLayout {
    /// Members per group.
    pub size: u64,
    /// Per group: node -> members there.
    pub groups: Vec<BTreeMap<u64, u64>>,
}

impl GroupLayout {
    /// The groups of `group` on the nodes of `nodes`.
    pub fn of(nodes: &NodeMap, group: Group) -> GroupLayout {
        let mesh = nodes.mesh;
        let mut groups: BTreeMap<Vec<u64>, BTreeMap<u64, u64>> = BTreeMap::new();
        // The groups of a kind split the mesh: a device already in a group found is not asked again
        // (asking each device listed the world's every member once per device, N^2 steps: a plan for
        // 65536 devices ran for minutes).
        let mut grouped = vec![false; usize::try_from(mesh.devices()).unwrap_or(0)];
        for c in mesh.all_coords() {
            let rank = mesh.rank_of(c);
            if grouped.get(rank as usize).copied().unwrap_or(false) {
                continue;
            }
            let members =
                if group == Group::World { (0..mesh.devices()).collect() } else { group.member_ranks(c, mesh) };
            for &member in &members {
                if let Some(seen) = grouped.get_mut(member as usize) {
                    *seen = true;
                }
            }
            groups.entry(members).or_insert_with_key(|members| {
                let mut by_node = BTreeMap::new();
                for &rank in members {
                    *by_node.entry(nodes.node_of(mesh.coords_of(rank))).or_insert(0) += 1;
                }
                by_node
            });
        }
        GroupLayout { size: mesh.group_size(group), groups: groups.into_values().collect() }
    }

    /// Whether some group has members on more than one node.
    pub fn spans_nodes(&self) -> bool {
        self.groups.iter().any(|g| g.len() > 1)
    }

    /// The most groups with members on one node (the flows a ring sends through its NIC).
    pub fn groups_per_node(&self) -> u64 {
        let mut per_node: BTreeMap<u64, u64> = BTreeMap::new();
        for g in &self.groups {
            for &node in g.keys() {
                *per_node.entry(node).or_default() += 1;
            }
        }
        per_node.into_values().max().unwrap_or(1)
    }
}

/// The link a kind's groups cross and the seconds of one collective of `bytes` per member that all
/// of them run at once.
pub fn collective_seconds(
    kind: CollectiveKind,
    layout: &GroupLayout,
    bytes: f64,
    hw: &Hardware,
    algorithm: Algorithm,
) -> (LinkKind, f64) {
    let (p, groups) = (layout.size, &layout.groups);
    if p <= 1 {
        return (LinkKind::IntraNode, 0.0);
    }
    if !layout.spans_nodes() {
        return (LinkKind::IntraNode, collective_time(kind, p, bytes, hw.intra_link(), algorithm));
    }
    let ring = || Flows::ring(kind, p, bytes, groups).seconds(hw, groups);
    let hierarchical = || Flows::hierarchical(kind, bytes, groups).seconds(hw, groups);
    let seconds = match algorithm {
        Algorithm::Ring => ring(),
        Algorithm::Tree => hierarchical(),
        Algorithm::Auto => ring().min(hierarchical()),
    };
    (LinkKind::InterNode, seconds)
}

/// What one algorithm costs one group.
#[derive(Clone, Copy, Debug, PartialEq)]
struct GroupCost {
    /// Bytes each member sends over its own link.
    link_bytes: f64,
    /// Bytes the group sends through the NIC of each node it spans.
    nic_bytes: f64,
    /// Latency steps on the intra-node link (on the inter-node one for a ring that spans nodes).
    steps: f64,
    /// Inter-node rounds of a hierarchical algorithm.
    inter_rounds: f64,
    /// Whether the intra- and inter-node parts run one after the other (hierarchical) rather than
    /// at once, pipelined (ring).
    phased: bool,
}

/// What one algorithm costs every group, and the NIC load of all groups together.
struct Flows {
    per_group: Vec<GroupCost>,
    /// Bytes through each node's NIC, by node (a vector: a plan for 65536 devices costs each of its
    /// collectives over 8192 nodes, for every configuration the planner tries).
    nic_load: Vec<f64>,
}

impl Flows {
    fn ring(kind: CollectiveKind, p: u64, bytes: f64, groups: &[BTreeMap<u64, u64>]) -> Flows {
        let (fraction, steps) = match kind {
            CollectiveKind::AllReduce => (2.0 * (p - 1) as f64 / p as f64, 2 * (p - 1)),
            CollectiveKind::AllGather | CollectiveKind::ReduceScatter => ((p - 1) as f64 / p as f64, p - 1),
            CollectiveKind::Broadcast | CollectiveKind::Reduce | CollectiveKind::Transpose => (1.0, p - 1),
        };
        let link_bytes = fraction * bytes;
        let cost = |g: &BTreeMap<u64, u64>| GroupCost {
            link_bytes,
            nic_bytes: if g.len() > 1 { link_bytes } else { 0.0 },
            steps: steps as f64,
            inter_rounds: 0.0,
            phased: false,
        };
        Flows::with_load(groups.iter().map(cost).collect(), groups)
    }

    fn hierarchical(kind: CollectiveKind, bytes: f64, groups: &[BTreeMap<u64, u64>]) -> Flows {
        let cost = |g: &BTreeMap<u64, u64>| {
            let k = g.values().copied().max().unwrap_or(1);
            let n = g.len() as u64;
            let intra = (k - 1) as f64 / k as f64 * bytes;
            let inter = (n - 1) as f64 / n as f64 * bytes;
            let rounds = f64::from(ceil_log2(n));
            let (link_bytes, nic_bytes, steps, inter_rounds) = match kind {
                CollectiveKind::AllReduce => (2.0 * intra, 2.0 * inter, 2 * (k - 1), 2.0 * rounds),
                CollectiveKind::AllGather | CollectiveKind::ReduceScatter => (intra, inter, k - 1, rounds),
                CollectiveKind::Broadcast | CollectiveKind::Reduce | CollectiveKind::Transpose => {
                    (if k > 1 { bytes } else { 0.0 }, if n > 1 { bytes } else { 0.0 }, k - 1, rounds)
                }
            };
            GroupCost { link_bytes, nic_bytes, steps: steps as f64, inter_rounds, phased: true }
        };
        Flows::with_load(groups.iter().map(cost).collect(), groups)
    }

    fn with_load(per_group: Vec<GroupCost>, groups: &[BTreeMap<u64, u64>]) -> Flows {
        let nodes = groups.iter().filter_map(|g| g.keys().next_back()).max().map_or(0, |&last| last as usize + 1);
        let mut nic_load = vec![0.0; nodes];
        for (cost, g) in per_group.iter().zip(groups) {
            for &node in g.keys() {
                nic_load[node as usize] += cost.nic_bytes;
            }
        }
        Flows { per_group, nic_load }
    }

    /// The slowest group's seconds.
    fn seconds(&self, hw: &Hardware, groups: &[BTreeMap<u64, u64>]) -> f64 {
        self.per_group.iter().zip(groups).map(|(cost, g)| self.group_seconds(cost, g, hw)).fold(0.0, f64::max)
    }

    /// Seconds for a group's NIC traffic: on each node it spans, the NIC's bytes from every group
    /// over its bandwidth, and never faster than the NICs the group's own members there drive (one
    /// each, of the node's `nics_per_node`).
    fn nic_seconds(&self, nic_bytes: f64, g: &BTreeMap<u64, u64>, hw: &Hardware) -> f64 {
        let bandwidth = hw.inter_node.nic_bandwidth_gb_s * 1e9;
        let nics = hw.inter_node.nics_per_node.max(1) as f64;
        g.iter()
            .map(|(node, &members)| {
                let shared = self.nic_load.get(*node as usize).copied().unwrap_or(0.0) / bandwidth;
                let own = nic_bytes / (bandwidth * (members as f64).min(nics) / nics);
                shared.max(own)
            })
            .fold(0.0, f64::max)
    }

    fn group_seconds(&self, cost: &GroupCost, g: &BTreeMap<u64, u64>, hw: &Hardware) -> f64 {
        let intra = hw.intra_link();
        let inter_latency = hw.inter_node.latency_us * 1e-6;
        let nic = if cost.nic_bytes > 0.0 { self.nic_seconds(cost.nic_bytes, g, hw) } else { 0.0 };
        let link = cost.link_bytes / intra.bandwidth;
        if cost.phased {
            cost.steps * intra.latency + cost.inter_rounds * inter_latency + link + nic
        } else {
            let step_latency = if g.len() > 1 { inter_latency } else { intra.latency };
            cost.steps * step_latency + link.max(nic)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use optimus_plan::Mesh;
    use optimus_plan::placement::RankPlacement;
    use std::collections::BTreeSet;

    /// `GroupLayout::of` asks each group once, skipping devices already in one: the groups it finds are
    /// the distinct groups of every device, asked one by one (the kinds split the mesh).
    #[test]
    fn a_layout_holds_each_devices_group_once() {
        let meshes = [
            Mesh::new(2, 2),
            Mesh::new(3, 3),
            Mesh::new(1, 8),
            Mesh::new(4, 2).with_data(2),
            Mesh::new(2, 2).with_depth(2).with_data(2),
        ];
        for mesh in meshes {
            let nodes = NodeMap::new(mesh, 2, RankPlacement::RowMajor);
            for group in Group::ALL {
                let asked: BTreeSet<Vec<u64>> = mesh
                    .all_coords()
                    .map(|c| {
                        if group == Group::World { (0..mesh.devices()).collect() } else { group.member_ranks(c, mesh) }
                    })
                    .collect();
                let layout = GroupLayout::of(&nodes, group);
                let members = |g: &BTreeMap<u64, u64>| g.values().sum::<u64>();
                assert_eq!(layout.groups.len(), asked.len(), "{mesh} {group:?}");
                let mut found: Vec<u64> = layout.groups.iter().map(members).collect();
                found.sort_unstable();
                let mut expected: Vec<u64> = asked.iter().map(|g| g.len() as u64).collect();
                expected.sort_unstable();
                assert_eq!(found, expected, "{mesh} {group:?}");
            }
        }
    }
}
