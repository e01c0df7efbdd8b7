//! Overlapped collectives are safe: each is waited for exactly once, and between its start and its
//! wait nothing touches what it receives (but a later collective that sends it, since collectives run
//! in the order started) or writes or frees what it sends.

use crate::memory::touched;
use crate::{BufferId, Instr, Plan};

/// An overlapped collective in flight: where it started and its buffers.
struct InFlight {
    start: usize,
    send: BufferId,
    recv: BufferId,
}

/// Buffers an instruction writes or gives up (a free, or an accumulating product's output).
fn written(instr: &Instr) -> Vec<BufferId> {
    match instr {
        Instr::Kernel { output, .. } => vec![*output],
        Instr::Collective { collective, .. } => vec![collective.recv],
        Instr::Free { buffer } => vec![*buffer],
        Instr::Wait { .. } => Vec::new(),
    }
}

pub(super) fn check_overlap(plan: &Plan, errors: &mut Vec<String>) {
    let name = |id: BufferId| plan.buffers.get(id.0 as usize).map_or_else(|| format!("{}", id.0), |b| b.name.clone());
    let mut in_flight: Vec<InFlight> = Vec::new();
    for (index, instr) in plan.program.iter().enumerate() {
        if let Instr::Wait { send, recv } = instr {
            match in_flight.iter().position(|f| f.recv == *recv && f.send == *send) {
                Some(k) => drop(in_flight.remove(k)),
                None => errors.push(format!(
                    "instruction {index}: waits for a collective from `{}` into `{}` that is not in flight",
                    name(*send),
                    name(*recv)
                )),
            }
            continue;
        }
        for f in &in_flight {
            // A collective may send an in-flight collective's result: collectives run in the order started.
            let streams = matches!(instr, Instr::Collective { collective: c, .. }
                if c.send == f.recv && c.recv != f.recv && c.recv != f.send);
            let reads_result = touched(instr).contains(&f.recv) && !streams;
            let overwrites_source = written(instr).contains(&f.send);
            if reads_result || overwrites_source {
                let (what, buffer) = if reads_result { ("uses", f.recv) } else { ("writes or frees", f.send) };
                errors.push(format!(
                    "instruction {index} {what} `{}` while the collective started at instruction {} is in flight \
                     (wait for it first)",
                    name(buffer),
                    f.start
                ));
            }
        }
        if let Instr::Collective { collective: c, .. } = instr
            && c.overlapped
        {
            in_flight.push(InFlight { start: index, send: c.send, recv: c.recv });
        }
    }
    for f in in_flight {
        errors.push(format!(
            "the collective started at instruction {} (into `{}`) is never waited for",
            f.start,
            name(f.recv)
        ));
    }
}
