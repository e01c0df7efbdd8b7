//! The step policy a plan implies, read from its instruction stream once: what each instruction is
//! for beyond its arithmetic. Executors follow it instead of classifying instructions themselves, so
//! every runtime (and the simulator) agrees on where a step's phases begin.
//!
//! A training step is: the forward and backward computation, then (when the plan clips or reports a
//! gradient norm) the gradient norm, then one optimizer update per parameter. Data-parallel gradient
//! sums are collectives whose sums may be deferred to the last micro-batch of an accumulated update.

use crate::{Instr, Kernel, Plan, ReasonKind};

/// What an instruction is for, in the step's policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Forward or backward arithmetic (or a free): run it as it is.
    Compute,
    /// A sum of gradients over the data-parallel replicas: under gradient accumulation it is deferred
    /// to the last micro-batch, with the earlier micro-batches' terms added to its input.
    GradientSum,
    /// The partial sum of squared gradients that starts the gradient norm: the accumulated gradients
    /// are complete here, and a micro-batch that does not update stops here.
    GradientNorm,
    /// An optimizer update of one parameter (applied with the step's optimizer settings, after the
    /// gradient norm's clip factor is known).
    Update,
}

/// Every instruction's phase, where the forward pass ends and where the update phase begins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepPhases {
    phases: Vec<Phase>,
    forward_end: usize,
    updates_begin: usize,
}

impl StepPhases {
    /// The phases of `plan`'s program.
    pub fn of(plan: &Plan) -> StepPhases {
        let phases: Vec<Phase> = plan.program.iter().map(|instr| phase_of(plan, instr)).collect();
        let updates_begin =
            phases.iter().position(|p| matches!(p, Phase::GradientNorm | Phase::Update)).unwrap_or(phases.len());
        StepPhases { phases, forward_end: forward_end(plan, updates_begin), updates_begin }
    }

    /// The phase of instruction `index` ([`Phase::Compute`] past the end).
    pub fn phase(&self, index: usize) -> Phase {
        self.phases.get(index).copied().unwrap_or(Phase::Compute)
    }

    /// The end of the forward pass: one past the last instruction before the updates that writes the
    /// loss (where the updates begin when there is no loss). Validation runs the program this far.
    pub fn forward_end(&self) -> usize {
        self.forward_end
    }

    /// The first instruction of the update phase (the gradient norm or the first update): the loss is
    /// complete before it. The program's length when the plan does not update (inference).
    pub fn updates_begin(&self) -> usize {
        self.updates_begin
    }
}

fn phase_of(plan: &Plan, instr: &Instr) -> Phase {
    match instr {
        Instr::Kernel { kernel: Kernel::GradSquareSum, .. } => Phase::GradientNorm,
        Instr::Kernel { kernel: Kernel::OptimizerStep, .. } => Phase::Update,
        Instr::Collective { reason, .. } => match plan.reasons.get(*reason as usize).map(|r| &r.kind) {
            Some(ReasonKind::DataParallelGradient { .. }) => Phase::GradientSum,
            _ => Phase::Compute,
        },
        _ => Phase::Compute,
    }
}

/// One past the last instruction before `updates_begin` that writes the loss; `updates_begin` when none does.
fn forward_end(plan: &Plan, updates_begin: usize) -> usize {
    let Some(loss) = plan.outputs.iter().find(|o| o.is_loss).map(|o| o.buffer) else { return updates_begin };
    let writes_loss = |instr: &Instr| match instr {
        Instr::Kernel { output, .. } => *output == loss,
        Instr::Collective { collective, .. } => collective.recv == loss,
        Instr::Free { .. } | Instr::Wait { .. } => false,
    };
    plan.program[..updates_begin].iter().rposition(writes_loss).map_or(updates_begin, |k| k + 1)
}
