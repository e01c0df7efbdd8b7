//! The `Communicator` trait, one endpoint per device, and the collective semantics shared by backends.

use optimus_plan::layout::Placement;
use optimus_plan::{CollectiveKind, Coords, Group, Mesh, ReduceOp};

/// A failed collective, with what a user needs to find the cause.
#[derive(Clone, Debug, PartialEq)]
pub enum CommError {
    /// Another device failed first; its report.
    PeerFailed(String),
    /// Not every member of the group arrived within `--timeout`: the devices still missing.
    TimedOut { seconds: f64, missing: Vec<String>, members: usize },
    /// A member's block does not have the size the collective needs.
    SizeMismatch { sent: usize, expected: usize },
    /// An all-gather or reduce-scatter whose collective says nothing of how the tensor is split.
    NoPlacement(CollectiveKind),
    /// A broadcast or reduce from a member the group does not have.
    NoSuchRoot(u64),
    /// The members (or a member's two buffers) hold different element types.
    MixedElements,
    /// The transport failed: MPI, NCCL or the GPU driver, in its own words.
    Transport(String),
}

impl std::fmt::Display for CommError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CommError::PeerFailed(report) => f.write_str(report),
            CommError::TimedOut { seconds, missing, members } => write!(
                f,
                "collective timed out after {} waiting for {} of {members} members: device {}",
                optimus_plan::text::duration_text(*seconds),
                missing.len(),
                missing.join(", ")
            ),
            CommError::SizeMismatch { sent, expected } => {
                write!(f, "collective size mismatch: {sent} elements sent, {expected} expected")
            }
            CommError::NoPlacement(kind) => write!(f, "{} without a placement", kind.name()),
            CommError::NoSuchRoot(root) => write!(f, "a collective from member {root}, which the group does not have"),
            CommError::MixedElements => f.write_str("the blocks of a collective have different element types"),
            CommError::Transport(what) => f.write_str(what),
        }
    }
}

impl std::error::Error for CommError {}

/// What one collective of the plan does, for a communicator that works on a backend's own buffers
/// (device pointers) rather than on host slices.
#[derive(Clone, Copy, Debug)]
pub struct CollectiveSpec<'a> {
    pub kind: CollectiveKind,
    pub group: Group,
    pub root: Option<u64>,
    pub op: ReduceOp,
    /// How an all-gather or reduce-scatter splits the gathered tensor.
    pub shard: Option<Placement>,
    /// The gathered (or whole) tensor's shape.
    pub full: &'a [u64],
}

impl<'a> CollectiveSpec<'a> {
    /// A collective of the plan, with the shape `full` of its gathered (or whole) tensor.
    pub fn of(c: &optimus_plan::Collective, full: &'a [u64]) -> CollectiveSpec<'a> {
        let op = c.op.unwrap_or(ReduceOp::Sum);
        CollectiveSpec { kind: c.kind, group: c.group, root: c.root, op, shard: c.shard, full }
    }

    /// An all-reduce of `full`-shaped buffers over `group` (no placement, no root).
    pub fn all_reduce(group: Group, op: ReduceOp, full: &'a [u64]) -> CollectiveSpec<'a> {
        CollectiveSpec { kind: CollectiveKind::AllReduce, group, root: None, op, shard: None, full }
    }
}

/// One device's view of the mesh's communication. Collectives are issued in the same order by every
/// member of a group (the plan verifier guarantees it); `send` and `recv` are local blocks.
pub trait Communicator {
    /// This device's mesh coordinates.
    fn coords(&self) -> Coords;
    fn mesh(&self) -> Mesh;
    /// Runs one collective on elements of type `T`: f32, or bf16 as its bit patterns (`u16`), which
    /// travel as bf16 (2 bytes an element) with sums and maxima taken in f32 and rounded once, at the
    /// end. For all-gather and reduce-scatter, `spec.shard` says how the gathered tensor of shape
    /// `spec.full` is split.
    fn collective<T: Payload>(
        &mut self,
        spec: &CollectiveSpec<'_>,
        send: &[T],
        recv: &mut [T],
    ) -> Result<(), CommError>;
    /// Starts a collective that may run beside what the caller does next (an overlapped collective of
    /// the plan); [`Communicator::finish`] waits for it. Collectives run in the order they are started
    /// or called. This default runs it to the end at once, so a communicator without a thread of its
    /// own (MPI, NCCL through the backend) still follows a plan that overlaps.
    ///
    /// # Safety
    /// `send` and `recv` must stay allocated, with `send` unwritten and `recv` neither read nor written
    /// by anyone else, until [`Communicator::finish`] returns for it or the communicator is dropped.
    unsafe fn start<T: Payload>(
        &mut self,
        spec: &CollectiveSpec<'_>,
        send: &[T],
        recv: &mut [T],
    ) -> Result<Started, CommError> {
        let began = std::time::Instant::now();
        self.collective(spec, send, recv)?;
        Ok(Started::Done(began.elapsed()))
    }
    /// Waits for a started collective to finish; returns how long it ran where it ran (on the
    /// communicator's own thread, or inside [`Communicator::start`]).
    fn finish(&mut self, started: Started) -> Result<std::time::Duration, CommError> {
        match started {
            Started::Done(took) => Ok(took),
            Started::Queued(n) => Err(CommError::Transport(format!("collective {n} was never queued here"))),
        }
    }
    /// Tells every peer that this device failed, so that none waits for it.
    fn abort(&self, reason: &str);
    /// Broadcasts whose members read the root's block in place, where the devices share one process;
    /// `None` where every broadcast copies.
    fn in_place_broadcasts(&self) -> Option<Box<dyn InPlaceBroadcasts>> {
        None
    }
}

/// A device's broadcasts read in place (see [`Communicator::in_place_broadcasts`]): an owned handle,
/// so that whoever reads may use the device meanwhile.
pub trait InPlaceBroadcasts {
    /// A broadcast whose members run `read` on the root's block where it is instead of copying it
    /// (`root_block` is the root's; what other members pass is ignored). The block stays alive and
    /// unwritten until this returns, since the root returns only once every member's `read` has.
    /// Two of these must not be nested in the same group.
    fn broadcast_in_place(
        &self,
        spec: &CollectiveSpec<'_>,
        root_block: Option<RawBlock>,
        read: &mut dyn FnMut(RawBlock),
    ) -> Result<(), CommError>;
}

/// Where a block of another device of this process is, for reading it in place while its owner
/// waits (see [`Communicator::broadcast_in_place`]): its first byte and its length in bytes.
#[derive(Clone, Copy, Debug)]
pub struct RawBlock {
    pub ptr: *const u8,
    pub bytes: usize,
}

// SAFETY: a `RawBlock` is an address handed between the threads of one process; whoever dereferences
// it must know the block alive and unwritten (see `Communicator::broadcast_in_place`).
unsafe impl Send for RawBlock {}
unsafe impl Sync for RawBlock {}

/// A collective [`Communicator::start`] has started.
#[derive(Debug)]
#[must_use = "a started collective must be finished before its buffers are used"]
pub enum Started {
    /// It ran to the end inside `start`, taking this long.
    Done(std::time::Duration),
    /// Queued on the communicator's own thread as its n-th collective.
    Queued(u64),
}

/// A payload's elements as their concrete type.
pub enum Elements<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

/// A payload's elements as their concrete type, writable.
pub enum ElementsMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
}

/// An element type collectives carry: f32, or bf16 as its bit pattern (`u16`). Reductions widen
/// every element to f32, combine in f32 and narrow the result once.
pub trait Payload: Copy + Default + Send + Sync + 'static {
    /// Bytes an element takes on the wire.
    const BYTES: usize;
    fn widen(self) -> f32;
    fn narrow(x: f32) -> Self;
    /// The elements as their concrete type (for communicators whose wire types are concrete: MPI).
    fn elements(data: &[Self]) -> Elements<'_>;
    fn elements_mut(data: &mut [Self]) -> ElementsMut<'_>;
}

impl Payload for f32 {
    const BYTES: usize = 4;
    fn widen(self) -> f32 {
        self
    }
    fn narrow(x: f32) -> f32 {
        x
    }
    fn elements(data: &[f32]) -> Elements<'_> {
        Elements::F32(data)
    }
    fn elements_mut(data: &mut [f32]) -> ElementsMut<'_> {
        ElementsMut::F32(data)
    }
}

/// bf16 bit patterns.
impl Payload for u16 {
    const BYTES: usize = 2;
    fn widen(self) -> f32 {
        crate::bf16::widen_one(self)
    }
    fn narrow(x: f32) -> u16 {
        crate::bf16::round(x)
    }
    fn elements(data: &[u16]) -> Elements<'_> {
        Elements::Bf16(data)
    }
    fn elements_mut(data: &mut [u16]) -> ElementsMut<'_> {
        ElementsMut::Bf16(data)
    }
}

/// Elements combined per pass of [`reduce_into`]: its f32 accumulator is this small, fixed size.
const REDUCE_CHUNK: usize = 1024;

/// `out` = `parts[..][at..at + out.len()]` combined by `op` in member order, in f32 (each element
/// widened, summed or maxed in f32 from member 0 on, and narrowed once), through a fixed-size f32
/// accumulator. For f32 elements this is the plain f32 reduction in member order. Every part must hold
/// at least `at` elements (and, to fill `out`, `at + out.len()`).
pub fn reduce_into<T: Payload>(parts: &[&[T]], at: usize, out: &mut [T], op: ReduceOp) {
    match op {
        ReduceOp::Sum => reduce_with(parts, at, out, |a, b| a + b),
        ReduceOp::Max => reduce_with(parts, at, out, f32::max),
    }
}

/// [`reduce_into`] with `combine(accumulated, next)`. Two parts take one pass (no accumulator), more
/// take a pass per part over an accumulator chunk, the first two and the last fused into their
/// neighbours' passes; the order of the operations per element is the same either way.
fn reduce_with<T: Payload>(parts: &[&[T]], at: usize, out: &mut [T], combine: impl Fn(f32, f32) -> f32) {
    match parts {
        [] => {}
        [only] => {
            for (o, v) in out.iter_mut().zip(&only[at..]) {
                *o = T::narrow(v.widen());
            }
        }
        [first, second] => {
            for ((o, a), b) in out.iter_mut().zip(&first[at..]).zip(&second[at..]) {
                *o = T::narrow(combine(a.widen(), b.widen()));
            }
        }
        [first, second, middle @ .., last] => {
            let mut acc = [0.0f32; REDUCE_CHUNK];
            for (c, out) in out.chunks_mut(REDUCE_CHUNK).enumerate() {
                let (start, acc) = (at + c * REDUCE_CHUNK, &mut acc[..out.len()]);
                for ((s, a), b) in acc.iter_mut().zip(&first[start..]).zip(&second[start..]) {
                    *s = combine(a.widen(), b.widen());
                }
                for p in middle {
                    for (s, v) in acc.iter_mut().zip(&p[start..]) {
                        *s = combine(*s, v.widen());
                    }
                }
                for ((o, s), v) in out.iter_mut().zip(acc.iter()).zip(&last[start..]) {
                    *o = T::narrow(combine(*s, v.widen()));
                }
            }
        }
    }
}

/// Where each member's block lies in a gathered tensor: the gathered dimension `dim` of `full` is viewed
/// as [outer, mid, inner] and `mid` is split over the members, so a block is `before * outer` runs of
/// `run` contiguous elements, run (b, o) of member m starting at `b stride_b + o stride_o + m
/// member_stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockGeometry {
    pub before: u64,
    pub outer: u64,
    pub run: u64,
    pub stride_b: u64,
    pub stride_o: u64,
    pub member_stride: u64,
}

impl BlockGeometry {
    /// The geometry of `parts` blocks of a tensor of shape `full` split as `shard` says (`None` for a
    /// placement that is not a split).
    pub fn of(full: &[u64], shard: Placement, parts: u64) -> Option<BlockGeometry> {
        let Placement::Shard { dim, outer, inner } = shard else { return None };
        let dim = dim as usize;
        let size = full.get(dim).copied().unwrap_or(1);
        let (outer, inner) = (outer.max(1), inner.max(1));
        let mid = size / outer / inner;
        let chunk = mid / parts.max(1);
        let before: u64 = full.iter().take(dim).product();
        let after: u64 = full.iter().skip(dim + 1).product();
        Some(BlockGeometry {
            before,
            outer,
            run: chunk * inner * after,
            stride_b: size * after,
            stride_o: mid * inner * after,
            member_stride: chunk * inner * after,
        })
    }

    /// Elements of one member's block.
    pub fn block_len(&self) -> u64 {
        self.before * self.outer * self.run
    }
}

/// Element ranges of member `m`'s block within a gathered buffer (see [`BlockGeometry`]).
/// Returns (offset in the full buffer, offset in the block, length) runs.
pub fn block_runs(full: &[u64], shard: Placement, parts: u64, member: u64) -> Vec<(usize, usize, usize)> {
    let Some(g) = BlockGeometry::of(full, shard, parts) else { return Vec::new() };
    let runs = (0..g.before).flat_map(|b| (0..g.outer).map(move |o| (b, o)));
    runs.enumerate()
        .map(|(t, (b, o))| {
            let start = b * g.stride_b + o * g.stride_o + member * g.member_stride;
            (start as usize, t * g.run as usize, g.run as usize)
        })
        .collect()
}

/// Scatters the member-major blocks of an all-gather (`blocks` = member 0's block, member 1's, ...)
/// into the gathered tensor `recv` of shape `full`.
pub fn unpack_gathered<T: Copy>(full: &[u64], shard: Placement, parts: u64, blocks: &[T], recv: &mut [T]) {
    let block_len = blocks.len() / parts.max(1) as usize;
    for (member, block) in blocks.chunks_exact(block_len.max(1)).enumerate() {
        for (full_at, block_at, len) in block_runs(full, shard, parts, member as u64) {
            recv[full_at..full_at + len].copy_from_slice(&block[block_at..block_at + len]);
        }
    }
}

/// Orders a tensor of shape `full` member-major for a reduce-scatter: member m's block of `block_len`
/// elements comes m-th, as MPI and NCCL scatter equal consecutive blocks.
pub fn pack_for_scatter<T: Payload>(
    full: &[u64],
    shard: Placement,
    parts: u64,
    send: &[T],
    block_len: usize,
) -> Vec<T> {
    let mut packed = vec![T::default(); send.len()];
    for (member, block) in packed.chunks_exact_mut(block_len.max(1)).enumerate() {
        for (full_at, block_at, len) in block_runs(full, shard, parts, member as u64) {
            block[block_at..block_at + len].copy_from_slice(&send[full_at..full_at + len]);
        }
    }
    packed
}

/// Combines every member's contribution into this member's result, per the collective's semantics.
/// Reductions are taken in f32 in member order and narrowed once (see [`reduce_into`]); broadcast and
/// all-gather move elements as they are.
pub fn combine<T: Payload>(
    spec: &CollectiveSpec<'_>,
    me: u64,
    parts: &[&[T]],
    recv: &mut [T],
) -> Result<(), CommError> {
    let CollectiveSpec { kind, root, op, shard, full, .. } = *spec;
    let n = parts.len() as u64;
    let check = |sent: usize, expected: usize| {
        if sent == expected { Ok(()) } else { Err(CommError::SizeMismatch { sent, expected }) }
    };
    let check_all = |len: usize| parts.iter().try_for_each(|p| check(p.len(), len));
    match kind {
        CollectiveKind::Broadcast => {
            let root = root.unwrap_or(0);
            let src = parts.get(root as usize).ok_or(CommError::NoSuchRoot(root))?;
            check(src.len(), recv.len())?;
            recv.copy_from_slice(src);
        }
        CollectiveKind::Reduce => {
            if root.unwrap_or(0) == me {
                check_all(recv.len())?;
                reduce_into(parts, 0, recv, op);
            }
        }
        CollectiveKind::AllReduce => {
            check_all(recv.len())?;
            reduce_into(parts, 0, recv, op);
        }
        CollectiveKind::AllGather => {
            let shard = shard.ok_or(CommError::NoPlacement(kind))?;
            check(full.iter().product::<u64>() as usize, recv.len())?;
            for (m, part) in parts.iter().enumerate() {
                for (full_at, block_at, len) in block_runs(full, shard, n, m as u64) {
                    recv[full_at..full_at + len].copy_from_slice(&part[block_at..block_at + len]);
                }
            }
        }
        CollectiveKind::Transpose => {
            // The other member's block: the mirror's, or this device's own on the diagonal.
            let src = parts.len().checked_sub(1 + me as usize).and_then(|m| parts.get(m));
            let src = src.ok_or(CommError::NoSuchRoot(me))?;
            check(src.len(), recv.len())?;
            recv.copy_from_slice(src);
        }
        CollectiveKind::ReduceScatter => {
            let shard = shard.ok_or(CommError::NoPlacement(kind))?;
            for (full_at, block_at, len) in block_runs(full, shard, n, me) {
                if parts.iter().any(|p| full_at + len > p.len()) || block_at + len > recv.len() {
                    let sent = parts.iter().map(|p| p.len()).min().unwrap_or(0);
                    return Err(CommError::SizeMismatch { sent, expected: full_at + len });
                }
                reduce_into(parts, full_at, &mut recv[block_at..block_at + len], op);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_timeout_is_reported_as_given() {
        let timed_out = CommError::TimedOut { seconds: 0.001, missing: vec!["(0, 1)".into()], members: 2 };
        assert_eq!(
            timed_out.to_string(),
            "collective timed out after 0.001 s waiting for 1 of 2 members: device (0, 1)"
        );
    }

    /// Values with a fractional part that rounding cares about, different for each member.
    fn member(m: usize, len: usize) -> Vec<f32> {
        (0..len).map(|i| ((i * 37 + m * 101) % 997) as f32 / 7.0 - 60.0 + m as f32 * 0.3).collect()
    }

    /// The reduction as its contract says: widened, combined in member order, narrowed once.
    fn folded<T: Payload>(parts: &[&[T]], at: usize, len: usize, op: ReduceOp) -> Vec<T> {
        (at..at + len)
            .map(|i| {
                let mut acc = parts[0][i].widen();
                for p in &parts[1..] {
                    acc = match op {
                        ReduceOp::Sum => acc + p[i].widen(),
                        ReduceOp::Max => acc.max(p[i].widen()),
                    };
                }
                T::narrow(acc)
            })
            .collect()
    }

    fn check<T: Payload + PartialEq + std::fmt::Debug>(of: impl Fn(f32) -> T) {
        // Lengths across the accumulator's chunk boundary, from an offset, for one to five members.
        let (len, at) = (2 * REDUCE_CHUNK + 37, 5);
        for members in 1..=5 {
            let owned: Vec<Vec<T>> = (0..members).map(|m| member(m, at + len).into_iter().map(&of).collect()).collect();
            let parts: Vec<&[T]> = owned.iter().map(Vec::as_slice).collect();
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let mut out = vec![T::default(); len];
                reduce_into(&parts, at, &mut out, op);
                assert_eq!(out, folded(&parts, at, len, op), "{members} members, {op:?}");
            }
        }
    }

    #[test]
    fn reductions_combine_members_in_order_and_round_once() {
        check(|x| x);
        check(crate::bf16::round);
    }
}
