//! Communication beside computation (`--overlap`): a pass over a compiled plan that starts each run
//! of consecutive collectives as early as its operands allow, no earlier than just after the run
//! before it, and waits for each collective just before its result (or its send buffer) is next
//! needed.
//!
//! In a SUMMA product this is double buffering: the broadcasts of step t+1 start before the product of
//! step t and are waited for before the product of step t+1, so two steps' blocks are alive at once
//! (the memory plan counts them, since a buffer lives from its collective's start to its wait). A
//! data-parallel gradient sum, issued as soon as its gradient is complete, is waited for only at the
//! update, so it runs beside the rest of the backward pass; a ZeRO-1 weight gather starts right after
//! the collectives before it, ahead of the computation that precedes its use.
//!
//! Starts never cross the step's phase boundaries (the end of the forward pass, the start of the
//! updates, the first optimizer step; backward collectives that start early may cross a late end of
//! the forward pass), and waits never move past them, so everything an executor reads between phases
//! (the loss, the gradient norm, the gradients) is complete where it reads it. Runs of collectives
//! keep their order; a backward collective whose result only later collectives and the updates need
//! (a gradient sum) moves ahead of the runs between. Every device runs the same program, so the
//! members of every group still meet in one order, and a device's collectives run one after another
//! in the order started, so a collective may send the result of one still in flight.

use crate::memory::{plan_memory, touched, written};
use crate::phases::{Phase, StepPhases};
use crate::{BufferId, Collective, CollectiveKind, Instr, Plan, Role};

/// Marks the collectives of `plan` that can run beside computation as overlapped, moves their starts
/// earlier, inserts their waits and recomputes the memory plan. A plan already overlapped is left as
/// it is.
pub fn overlap_collectives(plan: &mut Plan) {
    if plan.overlap {
        return;
    }
    let forward_end = double_buffer(plan);
    plan.memory.forward_end = forward_end;
    let (boundaries, update_boundaries) = phase_boundaries(plan);
    let program = std::mem::take(&mut plan.program);
    let limits = Limits {
        boundaries: &boundaries,
        update_boundaries: &update_boundaries,
        backward_start: plan.memory.forward_end,
    };
    let schedule = Schedule::of(&program, &limits);
    let (program, positions) = schedule.rebuild(program);
    let forward_end = positions.get(plan.memory.forward_end).copied().unwrap_or(program.len());
    plan.program = program;
    plan.memory = plan_memory(&plan.program, &plan.buffers, forward_end);
    plan.overlap = true;
}

/// Gives a second buffer to every workspace buffer that the program fills again and again (the blocks
/// a SUMMA product's steps broadcast, the partial products its steps reduce): the fills alternate
/// between the two, so that step t+1's broadcast need not wait for step t's product to have read its
/// block, nor step t+1's product for step t's reduce to have sent its partial. Only buffers that every
/// writer fills whole on every member (kernels that do not accumulate, and collectives other than a
/// reduce, which leaves the other members' blocks as they were), and that the program frees after
/// their last use, are split; the second buffer is freed beside the first.
/// Returns the memory plan's `forward_end` in the new program.
fn double_buffer(plan: &mut Plan) -> usize {
    let mut writers: Vec<Vec<usize>> = vec![Vec::new(); plan.buffers.len()];
    let mut fills_whole = vec![true; plan.buffers.len()];
    let mut freed_at: Vec<Option<usize>> = vec![None; plan.buffers.len()];
    for (k, instr) in plan.program.iter().enumerate() {
        for b in written(instr) {
            let Some(slot) = writers.get_mut(b.0 as usize) else { continue };
            match instr {
                Instr::Free { .. } => freed_at[b.0 as usize] = Some(k),
                Instr::Collective { collective, .. } => {
                    slot.push(k);
                    fills_whole[b.0 as usize] &= collective.kind != CollectiveKind::Reduce;
                }
                Instr::Kernel { kernel, .. } => {
                    slot.push(k);
                    fills_whole[b.0 as usize] &= !kernel.reads_its_output();
                }
                Instr::Wait { .. } => {}
            }
        }
    }
    let mut extra_frees: Vec<(usize, BufferId)> = Vec::new();
    for id in 0..plan.buffers.len() {
        let fills = &writers[id];
        let Some(free) = freed_at[id] else { continue };
        let eligible = fills.len() >= 2
            && fills_whole[id]
            && plan.buffers[id].role == Role::Workspace
            && fills.last().is_some_and(|&last| last < free);
        if !eligible {
            continue;
        }
        let first = BufferId(id as u32);
        let second = BufferId(plan.buffers.len() as u32);
        let mut copy = plan.buffers[id].clone();
        copy.id = second;
        copy.name = format!("{} (second buffer)", copy.name);
        plan.buffers.push(copy);
        let fills = fills.clone();
        for (j, &fill) in fills.iter().enumerate().filter(|(j, _)| j % 2 == 1) {
            let end = fills.get(j + 1).copied().unwrap_or(free + 1);
            for instr in &mut plan.program[fill..end] {
                rename(instr, first, second);
            }
        }
        // The free after the last fill now names that fill's buffer; the other one goes with it.
        let other = if fills.len().is_multiple_of(2) { first } else { second };
        extra_frees.push((free, other));
    }
    let forward_end = plan.memory.forward_end;
    extra_frees.sort_unstable_by_key(|&(at, id)| (std::cmp::Reverse(at), id));
    let moved = extra_frees.iter().filter(|&&(at, _)| at < forward_end).count();
    for (at, id) in extra_frees {
        plan.program.insert(at + 1, Instr::Free { buffer: id });
    }
    forward_end + moved
}

/// Replaces buffer `from` by `to` wherever `instr` names it.
fn rename(instr: &mut Instr, from: BufferId, to: BufferId) {
    let swap = |b: &mut BufferId| {
        if *b == from {
            *b = to;
        }
    };
    match instr {
        Instr::Kernel { inputs, output, .. } => {
            inputs.iter_mut().for_each(swap);
            swap(output);
        }
        Instr::Collective { collective, .. } => {
            swap(&mut collective.send);
            swap(&mut collective.recv);
        }
        Instr::Free { buffer } => swap(buffer),
        Instr::Wait { send, recv } => {
            swap(send);
            swap(recv);
        }
    }
}

/// Program positions that no start is moved above and no wait below: where the forward pass ends (for
/// the memory plan and for the executors), where the updates begin, the first optimizer step, and
/// the end.
/// Also returns the boundaries of the update phase alone (and the end), which bound the early starts
/// of backward collectives (see [`early_start`]).
fn phase_boundaries(plan: &Plan) -> (Vec<usize>, Vec<usize>) {
    let phases = StepPhases::of(plan);
    let first_update = (0..plan.program.len()).find(|&k| phases.phase(k) == Phase::Update);
    let mut updates = vec![phases.updates_begin(), plan.program.len()];
    updates.extend(first_update);
    updates.sort_unstable();
    updates.dedup();
    let mut bounds = updates.clone();
    bounds.extend([plan.memory.forward_end, phases.forward_end()]);
    bounds.sort_unstable();
    bounds.dedup();
    (bounds, updates)
}

/// Whether `instr` must not run while `c` is in flight: it writes or frees what `c` sends, or touches
/// what `c` receives.
fn conflicts(instr: &Instr, c: &Collective) -> bool {
    written(instr).contains(&c.send) || touched(instr).contains(&c.recv)
}

/// Whether `instr` is a collective that sends what `c` receives, and touches nothing else of `c`:
/// collectives run one after another in the order started, so it may start while `c` is in flight.
pub(crate) fn streams_from(instr: &Instr, c: &Collective) -> bool {
    collective(instr).is_some_and(|d| d.send == c.recv && d.recv != c.recv && d.recv != c.send)
}

fn collective(instr: &Instr) -> Option<&Collective> {
    match instr {
        Instr::Collective { collective, .. } => Some(collective),
        _ => None,
    }
}

/// A run of consecutive collectives, `first..=last` in the original program, started together at
/// `slot` (just before original instruction `slot`) when it moves; a run whose members touch each
/// other's buffers stays where it is.
#[derive(Clone, Copy, Debug)]
struct Run {
    first: usize,
    last: usize,
    slot: usize,
    moves: bool,
}

/// Where every collective starts and where it is waited for, in original program positions.
struct Schedule {
    runs: Vec<Run>,
    /// Collectives of the backward pass whose result only other collectives (or the updates) need,
    /// such as gradient sums: each starts right after what it sends is complete (its slot), ahead of
    /// the collectives between.
    early: Vec<Option<usize>>,
    /// For each original instruction, where its collective is waited for (before that original
    /// instruction; the program's length for the end), when it is overlapped.
    wait_at: Vec<Option<usize>>,
}

impl Schedule {
    /// The schedule of `program` within `limits`.
    fn of(program: &[Instr], limits: &Limits<'_>) -> Schedule {
        let boundaries = limits.boundaries;
        let waits: Vec<usize> = (0..program.len())
            .map(|i| collective(&program[i]).map_or(i, |c| wait_position(program, boundaries, i, c)))
            .collect();
        let collectives: Vec<usize> = (0..program.len()).filter(|&k| collective(&program[k]).is_some()).collect();
        let placed = Placed { waits: &waits, collectives: &collectives };
        let mut early: Vec<Option<usize>> = vec![None; program.len()];
        for &i in &collectives {
            early[i] = collective(&program[i]).and_then(|c| early_start(program, limits, &placed, &early, i, c));
        }
        let runs = runs_of(program, boundaries, &waits, &early);
        let mut wait_at = vec![None; program.len()];
        let starts = runs
            .iter()
            .flat_map(|run| (run.first..=run.last).map(move |i| (i, if run.moves { run.slot } else { i })))
            .chain(early.iter().enumerate().filter_map(|(i, slot)| Some((i, (*slot)?))));
        for (i, start) in starts {
            let wait = waits[i];
            // Worth overlapping only when some computation runs between the start and the wait.
            let computes_between = (start..wait).any(|k| k != i && matches!(program[k], Instr::Kernel { .. }));
            wait_at[i] = computes_between.then_some(wait);
        }
        Schedule { runs, early, wait_at }
    }

    /// The new program, and for each original position (and the end) where it begins in the new one
    /// (after the waits placed before it).
    fn rebuild(&self, program: Vec<Instr>) -> (Vec<Instr>, Vec<usize>) {
        let n = program.len();
        let mut starts_at: Vec<Vec<usize>> = vec![Vec::new(); n + 1];
        let mut moved = vec![false; n];
        for run in self.runs.iter().filter(|r| r.moves) {
            starts_at[run.slot].extend(run.first..=run.last);
            moved[run.first..=run.last].fill(true);
        }
        for (i, slot) in self.early.iter().enumerate() {
            if let Some(slot) = slot {
                starts_at[*slot].push(i);
                moved[i] = true;
            }
        }
        starts_at.iter_mut().for_each(|starts| starts.sort_unstable());
        let mut waits_at: Vec<Vec<usize>> = vec![Vec::new(); n + 1];
        for (i, wait) in self.wait_at.iter().enumerate() {
            if let Some(w) = wait {
                waits_at[*w].push(i);
            }
        }
        let buffers: Vec<Option<(BufferId, BufferId)>> =
            program.iter().map(|instr| collective(instr).map(|c| (c.send, c.recv))).collect();
        let mut slots: Vec<Option<Instr>> = program.into_iter().map(Some).collect();
        let mut out = Vec::with_capacity(n + self.wait_at.iter().flatten().count());
        let mut positions = Vec::with_capacity(n + 1);
        for k in 0..=n {
            for &i in &waits_at[k] {
                if let Some((send, recv)) = buffers[i] {
                    out.push(Instr::Wait { send, recv });
                }
            }
            positions.push(out.len());
            for &i in &starts_at[k] {
                out.extend(self.take(&mut slots, i));
            }
            if k < n && !moved[k] {
                out.extend(self.take(&mut slots, k));
            }
        }
        (out, positions)
    }

    /// Original instruction `i`, marked overlapped when it is.
    fn take(&self, slots: &mut [Option<Instr>], i: usize) -> Option<Instr> {
        let mut instr = slots.get_mut(i)?.take()?;
        if let Instr::Collective { collective, .. } = &mut instr {
            collective.overlapped = self.wait_at[i].is_some();
        }
        Some(instr)
    }
}

/// The runs of consecutive collectives and where each may start: moved back over the instructions
/// before it that do not conflict with any member, but not above the previous run, a phase boundary,
/// or the wait (at `waits`) of an earlier collective that a member conflicts with.
fn runs_of(program: &[Instr], boundaries: &[usize], waits: &[usize], early: &[Option<usize>]) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    // Earlier collectives (in runs or started early) whose wait may come after the current run's
    // earliest start, and how far the program has been scanned for them.
    let mut pending: Vec<usize> = Vec::new();
    let mut scanned = 0;
    let in_run = |k: usize| collective(&program[k]).is_some() && early[k].is_none();
    let mut i = 0;
    while i < program.len() {
        if !in_run(i) {
            i += 1;
            continue;
        }
        let first = i;
        while i + 1 < program.len() && in_run(i + 1) {
            i += 1;
        }
        let last = i;
        let members: Vec<&Collective> = program[first..=last].iter().filter_map(collective).collect();
        // A member in flight while a later one starts must not conflict with it.
        let independent =
            (0..members.len()).all(|k| (k + 1..members.len()).all(|l| !conflicts(&program[first + l], members[k])));
        let after_previous = runs.last().map_or(0, |r| r.last + 1);
        let boundary = boundaries.iter().copied().filter(|&b| b <= first).max().unwrap_or(0);
        pending.extend((scanned..first).filter(|&k| collective(&program[k]).is_some()));
        scanned = first;
        pending.retain(|&d| waits[d] > after_previous.max(boundary));
        let member_conflicts = |d: usize| {
            collective(&program[d]).is_some_and(|earlier| (first..=last).any(|m| conflicts(&program[m], earlier)))
        };
        let after_waits = pending.iter().filter(|&&d| member_conflicts(d)).map(|&d| waits[d]).max().unwrap_or(0);
        let lowest = after_previous.max(boundary).max(after_waits);
        let mut slot = first;
        while independent && slot > lowest && !members.iter().any(|c| conflicts(&program[slot - 1], c)) {
            slot -= 1;
        }
        runs.push(Run { first, last, slot, moves: independent && slot < first });
        i += 1;
    }
    runs
}

/// Where collective `c` (original position `i`) must be finished: before the first later instruction
/// that conflicts with it (a collective that only sends its result runs after it anyway), the next
/// phase boundary, or the end.
fn wait_position(program: &[Instr], boundaries: &[usize], i: usize, c: &Collective) -> usize {
    let boundary = boundaries.iter().copied().filter(|&b| b > i).min().unwrap_or(program.len());
    (i + 1..boundary).find(|&j| conflicts(&program[j], c) && !streams_from(&program[j], c)).unwrap_or(boundary)
}

/// Where a backward collective whose result nothing but later collectives and frees touch before the
/// next phase boundary may start: right after the last instruction before it that conflicts with it
/// (what writes its send buffer), ahead of other collectives, within the backward pass and the same
/// update phase; `None` when it stays in its run. (It may cross the end of the forward pass that
/// validation runs to when that comes late, as it does when the loss is summed over the replicas
/// after the backward pass: a validation pass runs whatever starts before its end, and waits for it.)
fn early_start(
    program: &[Instr],
    limits: &Limits<'_>,
    placed: &Placed<'_>,
    early: &[Option<usize>],
    i: usize,
    c: &Collective,
) -> Option<usize> {
    let Limits { boundaries, update_boundaries, backward_start } = *limits;
    let Placed { waits, collectives } = *placed;
    if i < backward_start {
        return None;
    }
    let after = boundaries.iter().copied().filter(|&b| b > i).min().unwrap_or(program.len());
    let result_waits = (i + 1..after).all(|j| {
        let instr = &program[j];
        !touched(instr).contains(&c.recv) || streams_from(instr, c) || matches!(instr, Instr::Free { .. })
    });
    if !result_waits {
        return None;
    }
    let mut lowest = update_boundaries.iter().copied().filter(|&b| b <= i).max().unwrap_or(0).max(backward_start);
    let mut slot = i;
    while slot > lowest {
        let before = &program[slot - 1];
        if conflicts(before, c) {
            // A collective started early whose result this one sends: it may follow it there.
            match early[slot - 1] {
                Some(start) if collective(before).is_some_and(|d| streams_from(&program[i], d)) => {
                    lowest = lowest.max(start)
                }
                _ => break,
            }
        }
        slot -= 1;
    }
    // Not before the wait of an earlier collective whose buffers it touches.
    let from = collectives.partition_point(|&k| k < lowest);
    let to = collectives.partition_point(|&k| k < i);
    for &d in &collectives[from..to] {
        let earlier = collective(&program[d]);
        if earlier.is_some_and(|e| conflicts(&program[i], e) && !streams_from(&program[i], e)) {
            slot = slot.max(waits[d]);
        }
    }
    (slot < i).then_some(slot)
}

/// The phase boundaries that starts and waits do not cross, those of the update phase alone, and
/// where the backward pass starts.
#[derive(Clone, Copy)]
struct Limits<'a> {
    boundaries: &'a [usize],
    update_boundaries: &'a [usize],
    backward_start: usize,
}

/// Every collective's wait position (by instruction), and the positions of the collectives (ascending).
#[derive(Clone, Copy)]
struct Placed<'a> {
    waits: &'a [usize],
    collectives: &'a [usize],
}
