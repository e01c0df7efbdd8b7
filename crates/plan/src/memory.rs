//! Liveness-based memory planning: inserts frees after each buffer's last use and finds the peak.

use super::{Buffer, BufferId, Instr, Role};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// Bytes per device by category, and where the peak occurs. Every device of an SPMD plan holds blocks
/// of the same shapes, so one figure holds for all devices.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPlan {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    pub inputs: u64,
    /// The key/value caches of a decoding plan.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache: u64,
    /// Forward activations still alive when the backward pass starts.
    pub activations_kept_for_backward: u64,
    /// The largest total of workspace buffers (communication blocks, partial products, statistics and
    /// backward values) alive at once.
    pub workspace_peak: u64,
    pub peak_bytes: u64,
    /// Index of the instruction (after frees are inserted) at which the peak is reached.
    pub peak_instruction: usize,
    /// Index of the first backward instruction (the program length in inference plans).
    pub forward_end: usize,
    /// What the peak is made of: the bytes of each category alive at the peak instruction (they add
    /// up to `peak_bytes`).
    #[serde(default)]
    pub at_peak: PeakBreakdown,
}

/// The bytes alive at the peak, by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeakBreakdown {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    pub inputs: u64,
    /// Key/value caches.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache: u64,
    /// Forward activations (kept for the backward pass, or not yet dead).
    pub activations: u64,
    /// Buffers that a collective sends or receives.
    pub communication: u64,
    /// Every other temporary: partial products, statistics, backward values, recomputed activations.
    pub workspace: u64,
}

impl PeakBreakdown {
    /// The category of a buffer, as a mutable counter.
    fn slot(&mut self, b: &Buffer, communicates: bool) -> &mut u64 {
        match b.role {
            Role::Parameter => &mut self.parameters,
            Role::Gradient => &mut self.gradients,
            Role::OptimizerState => &mut self.optimizer_state,
            Role::Input => &mut self.inputs,
            Role::Cache => &mut self.cache,
            Role::Activation => &mut self.activations,
            Role::Workspace if communicates => &mut self.communication,
            Role::Workspace => &mut self.workspace,
        }
    }
}

/// Which buffers a collective of the program sends or receives.
fn communicating(program: &[Instr], buffers: &[Buffer]) -> Vec<bool> {
    let mut out = vec![false; buffers.len()];
    for instr in program {
        if let Instr::Collective { collective, .. } = instr {
            for b in [collective.send, collective.recv] {
                if let Some(slot) = out.get_mut(b.0 as usize) {
                    *slot = true;
                }
            }
        }
    }
    out
}

/// Whether a buffer lives for the whole program.
pub fn persistent(role: Role) -> bool {
    matches!(role, Role::Parameter | Role::OptimizerState | Role::Input | Role::Cache)
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// Buffers an instruction reads or writes.
pub fn touched(instr: &Instr) -> Vec<BufferId> {
    let mut ids = Vec::new();
    for_each_touched(instr, |id| ids.push(id));
    ids
}

/// Buffers an instruction writes or gives up: a kernel's output, a collective's result, a freed buffer.
pub fn written(instr: &Instr) -> Vec<BufferId> {
    match instr {
        Instr::Kernel { output, .. } => vec![*output],
        Instr::Collective { collective, .. } => vec![collective.recv],
        Instr::Free { buffer } => vec![*buffer],
        Instr::Wait { .. } => Vec::new(),
    }
}

/// Calls `visit` with every buffer [`touched`] lists, in the same order, without allocating.
pub fn for_each_touched(instr: &Instr, mut visit: impl FnMut(BufferId)) {
    match instr {
        Instr::Kernel { inputs, output, .. } => {
            inputs.iter().for_each(|&id| visit(id));
            visit(*output);
        }
        Instr::Collective { collective, .. } => {
            visit(collective.send);
            visit(collective.recv);
        }
        Instr::Free { buffer } => visit(*buffer),
        // An overlapped collective's buffers stay alive (and in place) until it is waited for.
        Instr::Wait { send, recv } => {
            visit(*send);
            visit(*recv);
        }
    }
}

/// Inserts a `Free` after the last use of every buffer that is neither persistent nor kept.
/// Returns the new program and the new index of `forward_end`.
pub fn insert_frees(
    program: Vec<Instr>,
    buffers: &[Buffer],
    keep: &HashSet<BufferId>,
    forward_end: usize,
) -> (Vec<Instr>, usize) {
    let mut last_use: Vec<Option<usize>> = vec![None; buffers.len()];
    for (i, instr) in program.iter().enumerate() {
        for_each_touched(instr, |b| {
            if let Some(slot) = last_use.get_mut(b.0 as usize) {
                *slot = Some(i);
            }
        });
    }
    let mut frees_after: Vec<Vec<BufferId>> = vec![Vec::new(); program.len()];
    for (index, last) in last_use.iter().enumerate() {
        let b = BufferId(u32::try_from(index).unwrap_or(u32::MAX));
        if let Some(i) = last.filter(|_| !persistent(buffers[index].role) && !keep.contains(&b)) {
            frees_after[i].push(b);
        }
    }
    let mut out = Vec::with_capacity(program.len() + buffers.len());
    let mut new_forward_end = None;
    for (i, instr) in program.into_iter().enumerate() {
        if i == forward_end {
            new_forward_end = Some(out.len());
        }
        out.push(instr);
        for &b in &frees_after[i] {
            out.push(Instr::Free { buffer: b });
        }
    }
    let forward_end = new_forward_end.unwrap_or(out.len());
    (out, forward_end)
}

/// Sweeps the program (with frees) and accounts for every byte on one device.
pub fn plan_memory(program: &[Instr], buffers: &[Buffer], forward_end: usize) -> MemoryPlan {
    let mut plan = MemoryPlan { forward_end, ..MemoryPlan::default() };
    let communicates = communicating(program, buffers);
    let mut now = PeakBreakdown::default();
    let mut live = vec![false; buffers.len()];
    let mut current: u64 = 0;
    let mut temporaries: u64 = 0;
    for b in buffers.iter().filter(|b| persistent(b.role)) {
        live[b.id.0 as usize] = true;
        current += b.bytes();
        *now.slot(b, false) += b.bytes();
        match b.role {
            Role::Parameter => plan.parameters += b.bytes(),
            Role::OptimizerState => plan.optimizer_state += b.bytes(),
            Role::Cache => plan.cache += b.bytes(),
            _ => plan.inputs += b.bytes(),
        }
    }
    plan.gradients = buffers.iter().filter(|b| b.role == Role::Gradient).map(Buffer::bytes).sum();
    plan.peak_bytes = current;
    plan.at_peak = now;
    let mut kept_at_boundary = None;
    for (i, instr) in program.iter().enumerate() {
        if i == forward_end {
            kept_at_boundary = Some(live_activations(&live, buffers));
        }
        match instr {
            Instr::Free { buffer } => {
                if std::mem::take(&mut live[buffer.0 as usize]) {
                    let b = &buffers[buffer.0 as usize];
                    current -= b.bytes();
                    *now.slot(b, communicates[buffer.0 as usize]) -= b.bytes();
                    if is_temporary(b.role) {
                        temporaries -= b.bytes();
                    }
                }
            }
            _ => {
                for_each_touched(instr, |id| {
                    if !std::mem::replace(&mut live[id.0 as usize], true) {
                        let b = &buffers[id.0 as usize];
                        current += b.bytes();
                        *now.slot(b, communicates[id.0 as usize]) += b.bytes();
                        if is_temporary(b.role) {
                            temporaries += b.bytes();
                        }
                    }
                });
            }
        }
        if current > plan.peak_bytes {
            plan.peak_bytes = current;
            plan.peak_instruction = i;
            plan.at_peak = now;
        }
        plan.workspace_peak = plan.workspace_peak.max(temporaries);
    }
    plan.activations_kept_for_backward = kept_at_boundary.unwrap_or(0);
    plan
}

fn is_temporary(role: Role) -> bool {
    role == Role::Workspace
}

fn live_activations(live: &[bool], buffers: &[Buffer]) -> u64 {
    buffers.iter().zip(live).filter(|(b, l)| **l && b.role == Role::Activation).map(|(b, _)| b.bytes()).sum()
}
