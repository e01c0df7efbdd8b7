//! Broadcasts read in place: where the devices are threads of one process, a SUMMA step's broadcasts
//! and the product that reads them run as one group. Every member reads the root's block where it is,
//! inside the broadcast's round (which the root leaves only once every member has finished), instead of
//! copying it into its receive buffer first: a 2x2 mesh spent about half its extra CPU time over one
//! device on those copies.

use super::Device;
use crate::backend::Backend;
use crate::comm::{CollectiveSpec, Communicator, InPlaceBroadcasts, RawBlock};
use crate::error::RuntimeError;
use optimus_plan::memory::persistent;
use optimus_plan::phases::{Phase, StepPhases};
use optimus_plan::{BufferId, CollectiveKind, Group, Instr, Plan};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A group the executor runs at once: broadcasts (at most one a mesh axis), releases, and the kernel
/// that reads every broadcast's result, which nothing reads afterwards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InPlaceGroup {
    pub broadcasts: Vec<usize>,
    pub frees: Vec<usize>,
    pub kernel: usize,
}

/// The group starting at each instruction, where one does. `may_overlap(a, b)`: whether buffers `a`
/// and `b` may share storage (the kernel must not write where a broadcast's root block is).
pub fn in_place_groups(
    plan: &Plan,
    phases: &StepPhases,
    may_overlap: &dyn Fn(BufferId, BufferId) -> bool,
) -> Vec<Option<InPlaceGroup>> {
    (0..plan.program.len()).map(|t| group_at(plan, phases, t, may_overlap)).collect()
}

/// A non-overlapped broadcast of the forward or backward arithmetic: its send and receive buffers.
fn broadcast_at(plan: &Plan, phases: &StepPhases, index: usize) -> Option<(BufferId, BufferId, Group)> {
    match plan.program.get(index)? {
        Instr::Collective { collective: c, .. }
            if c.kind == CollectiveKind::Broadcast && !c.overlapped && phases.phase(index) == Phase::Compute =>
        {
            let (send, recv) = (plan.buffer(c.send), plan.buffer(c.recv));
            let same = send.dtype == recv.dtype && send.shape == recv.shape;
            (same && c.send != c.recv && !persistent(recv.role)).then_some((c.send, c.recv, c.group))
        }
        _ => None,
    }
}

fn group_at(
    plan: &Plan,
    phases: &StepPhases,
    t: usize,
    may_overlap: &dyn Fn(BufferId, BufferId) -> bool,
) -> Option<InPlaceGroup> {
    let first = broadcast_at(plan, phases, t)?;
    let mut moved = vec![first];
    let (mut broadcasts, mut frees) = (vec![t], Vec::new());
    let mut k = t + 1;
    loop {
        match plan.program.get(k)? {
            Instr::Free { buffer } if moved.iter().all(|&(_, recv, _)| recv != *buffer) => frees.push(k),
            Instr::Collective { .. } => {
                let next = broadcast_at(plan, phases, k)?;
                // One round a group at a time: a second broadcast in the same group would wait on the first.
                if moved.iter().any(|&(_, _, group)| group == next.2) || moved.len() == 2 {
                    return None;
                }
                moved.push(next);
                broadcasts.push(k);
            }
            Instr::Kernel { inputs, output, .. } => {
                if phases.phase(k) != Phase::Compute || moved.iter().any(|&(_, recv, _)| !inputs.contains(&recv)) {
                    return None;
                }
                let writes_a_root_block =
                    moved.iter().any(|&(send, recv, _)| *output == recv || may_overlap(*output, send));
                if writes_a_root_block || moved.iter().any(|&(_, recv, _)| read_later(plan, recv, k)) {
                    return None;
                }
                return Some(InPlaceGroup { broadcasts, frees, kernel: k });
            }
            Instr::Free { .. } | Instr::Wait { .. } => return None,
        }
        k += 1;
    }
}

/// Whether an instruction after `kernel` reads `buffer` before it is written again or released.
fn read_later(plan: &Plan, buffer: BufferId, kernel: usize) -> bool {
    for instr in &plan.program[kernel + 1..] {
        match instr {
            Instr::Kernel { inputs, output, .. } => {
                if inputs.contains(&buffer) {
                    return true;
                }
                if *output == buffer {
                    return false;
                }
            }
            Instr::Collective { collective: c, .. } => {
                if c.send == buffer {
                    return true;
                }
                if c.recv == buffer {
                    return false;
                }
            }
            Instr::Free { buffer: b } if *b == buffer => return false,
            Instr::Free { .. } => {}
            Instr::Wait { recv, .. } if *recv == buffer => return true,
            Instr::Wait { .. } => {}
        }
    }
    false
}

impl<B: Backend, C: Communicator> Device<'_, B, C> {
    /// The groups of this device's program by the instruction each starts at, found once; empty where
    /// broadcasts cannot be read in place (another communicator or backend,
    /// `OPTIMUS_BROADCAST_IN_PLACE=off`).
    pub(super) fn in_place_groups(&mut self) -> Arc<[Option<InPlaceGroup>]> {
        if self.in_place.is_none() {
            let plan = self.plan;
            let usable = std::env::var("OPTIMUS_BROADCAST_IN_PLACE").as_deref() != Ok("off")
                && self.comm.in_place_broadcasts().is_some()
                && self.backend.reads_blocks_in_place();
            let groups = if usable {
                let (backend, storage) = (&self.backend, &self.storage);
                in_place_groups(plan, &self.phases, &|a, b| backend.may_overlap(storage, a, b))
            } else {
                Vec::new()
            };
            self.in_place = Some(groups.into());
        }
        self.in_place.clone().unwrap_or_else(|| Arc::new([]))
    }

    /// Runs `group`; with a profile, each broadcast's own time (its rounds, outside what it contains)
    /// and the kernel's are recorded under their instructions. `false` (nothing run) while the
    /// communicator has overlapped collectives in flight: those must meet their peers first, in order.
    pub(super) fn run_in_place(&mut self, group: &InPlaceGroup) -> Result<bool, RuntimeError> {
        let Some(reader) = self.comm.in_place_broadcasts() else { return Ok(false) };
        let mut times = vec![Duration::ZERO; group.broadcasts.len() + 1];
        self.run_level(reader.as_ref(), group, 0, &mut times)?;
        if let Some(profile) = self.profile.as_mut() {
            for (level, &index) in group.broadcasts.iter().enumerate() {
                profile.record(index, times[level].saturating_sub(times[level + 1]));
            }
            profile.record(group.kernel, times[group.broadcasts.len()]);
        }
        Ok(true)
    }

    /// Broadcast `level` of the group, and inside its round the rest; `times[level]` gets how long.
    fn run_level(
        &mut self,
        reader: &dyn InPlaceBroadcasts,
        group: &InPlaceGroup,
        level: usize,
        times: &mut [Duration],
    ) -> Result<(), RuntimeError> {
        let began = Instant::now();
        let plan = self.plan;
        let Some(&index) = group.broadcasts.get(level) else {
            for &k in &group.frees {
                if let Some(Instr::Free { buffer }) = plan.program.get(k) {
                    self.alive[buffer.0 as usize] = false;
                }
            }
            self.position = group.kernel;
            let result = match plan.program.get(group.kernel) {
                Some(Instr::Kernel { kernel, inputs, output, .. }) => self.kernel(kernel, inputs, *output),
                _ => Err(crate::error::unreachable("a kernel ends a group of broadcasts read in place")),
            };
            times[level] = began.elapsed();
            return result;
        };
        let Some(Instr::Collective { collective: c, .. }) = plan.program.get(index) else {
            return Err(crate::error::unreachable("a broadcast starts each level of the group"));
        };
        self.position = index;
        self.require_alive(&[c.send])?;
        let shape = &plan.buffer(c.send).shape;
        let spec = CollectiveSpec::of(c, shape);
        let is_root = c.group.member_index(self.comm.coords(), plan.mesh) == c.root.unwrap_or(0);
        let root_block = if is_root { self.backend.raw_block(&self.storage, c.send) } else { None };
        let mut inner: Result<(), RuntimeError> = Ok(());
        let mut read = |block: RawBlock| {
            inner = self.read_borrowed(reader, group, (level, c.recv, block), times);
        };
        reader.broadcast_in_place(&spec, root_block, &mut read)?;
        times[level] = began.elapsed();
        inner
    }

    /// Inside broadcast `level`'s round: its receive buffer reads the root's `block` while the rest of
    /// the group runs.
    fn read_borrowed(
        &mut self,
        reader: &dyn InPlaceBroadcasts,
        group: &InPlaceGroup,
        (level, recv, block): (usize, BufferId, RawBlock),
        times: &mut [Duration],
    ) -> Result<(), RuntimeError> {
        // SAFETY: the root's block stays alive and unwritten until the round ends, after this returns
        // (the root waits in it, and the group's kernel writes nowhere near it: `group_at`); the
        // borrow ends before then.
        if !unsafe { self.backend.borrow_block(&mut self.storage, recv, block)? } {
            return Err(crate::error::unreachable("a backend that reads blocks in place"));
        }
        self.alive[recv.0 as usize] = true;
        let result = self.run_level(reader, group, level + 1, times);
        self.backend.end_borrow(&mut self.storage, recv);
        result
    }
}
