//! The `Communicator` trait, one endpoint per device, and the collective semantics shared by backends.

use crate::plan::{CollectiveKind, Group, Mesh, ReduceOp};
use crate::shard::layout::Placement;

/// A failed collective: a peer failed, or the group did not assemble in time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommError(pub String);

impl std::fmt::Display for CommError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// One device's view of the mesh's communication. Collectives are issued in the same order by every
/// member of a group (the plan verifier guarantees it); `send` and `recv` are local blocks.
pub trait Communicator {
    /// This device's mesh coordinates.
    fn coords(&self) -> (u64, u64);
    fn mesh(&self) -> Mesh;
    /// Runs one collective of the plan. For all-gather and reduce-scatter, `shard` says how the
    /// gathered tensor of shape `full` is split; `block` is the local block shape.
    #[allow(clippy::too_many_arguments)]
    fn collective(
        &mut self,
        kind: CollectiveKind,
        group: Group,
        root: Option<u64>,
        op: ReduceOp,
        shard: Option<Placement>,
        full: &[u64],
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), CommError>;
    /// Tells every peer that this device failed, so that none waits for it.
    fn abort(&self, reason: &str);
}

/// The member index of device (i, j) within its group.
pub fn member_index(group: Group, i: u64, j: u64, mesh: Mesh) -> u64 {
    match group {
        Group::Row => j,
        Group::Column => i,
        Group::World => i * mesh.cols + j,
    }
}

/// Element ranges of member `m`'s block within a gathered buffer: the gathered dimension `dim` of `full`
/// is viewed as [outer, mid, inner] and `mid` is split over `parts` members.
/// Returns (offset in the full buffer, offset in the block, length) runs.
pub fn block_runs(full: &[u64], shard: Placement, parts: u64, member: u64) -> Vec<(usize, usize, usize)> {
    let Placement::Shard { dim, outer, inner } = shard else { return Vec::new() };
    let dim = dim as usize;
    let size = full.get(dim).copied().unwrap_or(1);
    let (outer, inner) = (outer.max(1), inner.max(1));
    let mid = size / outer / inner;
    let chunk = mid / parts.max(1);
    let before: u64 = full[..dim].iter().product();
    let after: u64 = full[dim + 1..].iter().product();
    let run = (chunk * inner * after) as usize;
    let mut runs = Vec::new();
    let mut block_offset = 0usize;
    for b in 0..before {
        for o in 0..outer {
            let start = ((b * size + o * mid * inner + member * chunk * inner) * after) as usize;
            runs.push((start, block_offset, run));
            block_offset += run;
        }
    }
    runs
}

/// Scatters the member-major blocks of an all-gather (`blocks` = member 0's block, member 1's, ...)
/// into the gathered tensor `recv` of shape `full`.
pub fn unpack_gathered(full: &[u64], shard: Placement, parts: u64, blocks: &[f32], recv: &mut [f32]) {
    let block_len = blocks.len() / parts.max(1) as usize;
    for (member, block) in blocks.chunks_exact(block_len.max(1)).enumerate() {
        for (full_at, block_at, len) in block_runs(full, shard, parts, member as u64) {
            recv[full_at..full_at + len].copy_from_slice(&block[block_at..block_at + len]);
        }
    }
}

/// Orders a tensor of shape `full` member-major for a reduce-scatter: member m's block of `block_len`
/// elements comes m-th, as MPI and NCCL scatter equal consecutive blocks.
pub fn pack_for_scatter(full: &[u64], shard: Placement, parts: u64, send: &[f32], block_len: usize) -> Vec<f32> {
    let mut packed = vec![0.0f32; send.len()];
    for (member, block) in packed.chunks_exact_mut(block_len.max(1)).enumerate() {
        for (full_at, block_at, len) in block_runs(full, shard, parts, member as u64) {
            block[block_at..block_at + len].copy_from_slice(&send[full_at..full_at + len]);
        }
    }
    packed
}

/// Combines every member's contribution into this member's result, per the collective's semantics.
#[allow(clippy::too_many_arguments)]
pub fn combine(
    kind: CollectiveKind,
    root: Option<u64>,
    op: ReduceOp,
    shard: Option<Placement>,
    full: &[u64],
    me: u64,
    parts: &[&[f32]],
    recv: &mut [f32],
) -> Result<(), CommError> {
    // out = parts[..][at..at + out.len()] combined, in member order.
    let reduce_into = |out: &mut [f32], at: usize| {
        out.copy_from_slice(&parts[0][at..at + out.len()]);
        for p in &parts[1..] {
            for (o, v) in out.iter_mut().zip(&p[at..]) {
                *o = match op {
                    ReduceOp::Sum => *o + v,
                    ReduceOp::Max => o.max(*v),
                };
            }
        }
    };
    let n = parts.len() as u64;
    let check = |a: usize, b: usize| {
        if a == b {
            Ok(())
        } else {
            Err(CommError(format!("collective size mismatch: {a} elements sent, {b} expected")))
        }
    };
    match kind {
        CollectiveKind::Broadcast => {
            let src = &parts[root.unwrap_or(0) as usize];
            check(src.len(), recv.len())?;
            recv.copy_from_slice(src);
        }
        CollectiveKind::Reduce => {
            if root.unwrap_or(0) == me {
                check(parts[0].len(), recv.len())?;
                reduce_into(recv, 0);
            }
        }
        CollectiveKind::AllReduce => {
            check(parts[0].len(), recv.len())?;
            reduce_into(recv, 0);
        }
        CollectiveKind::AllGather => {
            let shard = shard.ok_or_else(|| CommError("all-gather without a placement".into()))?;
            check(full.iter().product::<u64>() as usize, recv.len())?;
            for (m, part) in parts.iter().enumerate() {
                for (full_at, block_at, len) in block_runs(full, shard, n, m as u64) {
                    recv[full_at..full_at + len].copy_from_slice(&part[block_at..block_at + len]);
                }
            }
        }
        CollectiveKind::ReduceScatter => {
            let shard = shard.ok_or_else(|| CommError("reduce-scatter without a placement".into()))?;
            for (full_at, block_at, len) in block_runs(full, shard, n, me) {
                if parts.iter().any(|p| full_at + len > p.len()) || block_at + len > recv.len() {
                    return Err(CommError(format!("collective size mismatch: a block of {len} at {full_at}")));
                }
                reduce_into(&mut recv[block_at..block_at + len], full_at);
            }
        }
    }
    Ok(())
}
