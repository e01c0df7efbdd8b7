//! A reduce leaves its result untouched on the members that are not its root. A SUMMA product reduces
//! its partial blocks q times into one buffer, each member the root once: the buffer's contents before
//! its own round are never read, so clearing it first (as a fresh allocation would be) is wasted work.
//! This finds whether anything may read the untouched contents before a write fills them.

use optimus_plan::{CollectiveKind, Coords, Instr, Plan};

/// Whether `buffer`, left untouched on the device at `coords` by the reduce at `index` (which that
/// device is not the root of), may be read before an instruction writes all of it. Unsure cases
/// (an overlapped collective, a wait, the step's end) count as read.
pub fn untouched_result_may_be_read(plan: &Plan, buffer: optimus_plan::BufferId, index: usize, coords: Coords) -> bool {
    for instr in plan.program.iter().skip(index + 1) {
        match instr {
            Instr::Kernel { kernel, inputs, output, .. } => {
                if inputs.contains(&buffer) {
                    return true;
                }
                if *output == buffer {
                    return kernel.reads_its_output();
                }
            }
            Instr::Collective { collective: c, .. } => {
                if c.send == buffer || (c.recv == buffer && c.overlapped) {
                    return true;
                }
                // A write of all of it, unless it is another reduce that this device is not the root of.
                let fills_it = c.kind != CollectiveKind::Reduce || is_root(plan, c, coords);
                if c.recv == buffer && fills_it {
                    return false;
                }
            }
            Instr::Wait { recv, .. } if *recv == buffer => return true,
            Instr::Free { buffer: freed } if *freed == buffer => return false,
            Instr::Wait { .. } | Instr::Free { .. } => {}
        }
    }
    true
}

/// Whether the device at `coords` is the root of collective `c` (member 0 of its group when it names none).
pub fn is_root(plan: &Plan, c: &optimus_plan::Collective, coords: Coords) -> bool {
    c.group.member_index(coords, plan.mesh) == c.root.unwrap_or(0)
}
