//! Overlapped collectives are safe: each is waited for exactly once, and between its start and its
//! wait nothing touches what it receives (but a later collective that sends it, since collectives run
//! in the order started) or writes or frees what it sends.

use crate::memory::{touched, written};
use crate::overlap::streams_from;
use crate::{BufferId, Collective, Instr, Plan};

/// An overlapped collective in flight: where it started, and the collective.
struct InFlight<'p> {
    start: usize,
    collective: &'p Collective,
}

pub(super) fn check_overlap(plan: &Plan, errors: &mut Vec<String>) {
    let name = |id: BufferId| plan.buffers.get(id.0 as usize).map_or_else(|| format!("{}", id.0), |b| b.name.clone());
    let mut in_flight: Vec<InFlight> = Vec::new();
    for (index, instr) in plan.program.iter().enumerate() {
        if let Instr::Wait { send, recv } = instr {
            match in_flight.iter().position(|f| f.collective.recv == *recv && f.collective.send == *send) {
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
            let reads_result = touched(instr).contains(&f.collective.recv) && !streams_from(instr, f.collective);
            let overwrites_source = written(instr).contains(&f.collective.send);
            if reads_result || overwrites_source {
                let (what, buffer) =
                    if reads_result { ("uses", f.collective.recv) } else { ("writes or frees", f.collective.send) };
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
            in_flight.push(InFlight { start: index, collective: c });
        }
    }
    for f in in_flight {
        errors.push(format!(
            "the collective started at instruction {} (into `{}`) is never waited for",
            f.start,
            name(f.collective.recv)
        ));
    }
}
