//! What a device of one pipeline stage does beyond a whole-program step: run one pass of one
//! micro-batch (a list of its program's instructions), keep a forward pass's activations aside until
//! the micro-batch's backward pass (other micro-batches run in between), sum its gradients over the
//! micro-batches, and take the gradient norm summed over the stages.

use super::{Device, Update, final_blocks};
use crate::backend::Backend;
use crate::comm::Communicator;
use crate::error::RuntimeError;
use crate::profile::Category;
use optimus_plan::init;
use optimus_plan::phases::Phase;
use optimus_plan::tensor::Tensor;
use optimus_plan::{BufferId, Instr, Kernel, Role};

/// A forward pass's buffers kept for its backward pass (host copies), and their bytes.
#[derive(Debug, Default)]
pub struct Stash {
    buffers: Vec<(BufferId, Tensor)>,
    pub bytes: u64,
}

impl<'p, B: Backend, C: Communicator> Device<'p, B, C> {
    /// Starts a pass of micro-batch `draw` (counted from 1 over the run): dropout draws its masks.
    pub(crate) fn begin_pass(&mut self, draw: u64) {
        self.step_seed = init::mix64(self.seed ^ init::mix64(draw));
    }

    /// Starts an update: no gradient norm yet, and nothing of the last update alive but the
    /// persistent buffers (its gradients would otherwise be kept aside with the first forward pass).
    pub(crate) fn begin_update(&mut self) {
        self.grad_norm = None;
        self.begin_step();
    }

    /// Runs instruction `index` of the device's program, with `update` deciding the sums over the
    /// replicas (deferred to an update's last micro-batch) and the optimizer steps.
    pub(crate) fn run_instruction(&mut self, index: usize, update: Update<'_>) -> Result<(), RuntimeError> {
        let instr = self.stage_instruction(index)?;
        self.position = index;
        let started = self.profile_start();
        let deferred = self.phases.phase(index) == Phase::GradientSum && self.defer_gradient_sum(instr, update)?;
        if !deferred {
            self.execute_with(instr, update)?;
        }
        self.note_profiled(index, instr, started);
        Ok(())
    }

    /// Runs `work`, a pipeline stage's own (a message, a host copy), adding its time to the profile
    /// under `name` when profiling.
    pub(crate) fn profiled<R>(
        &mut self,
        name: &'static str,
        category: Category,
        work: impl FnOnce(&mut Self) -> R,
    ) -> R {
        let started = self.profile.is_some().then(std::time::Instant::now);
        let result = work(self);
        if let (Some(profile), Some(started)) = (self.profile.as_mut(), started) {
            profile.record_extra(name, category, started.elapsed());
        }
        result
    }

    /// Runs instruction `index` of a forward pass of validation (dropout off; not profiled).
    pub(crate) fn run_validation_instruction(&mut self, index: usize) -> Result<(), RuntimeError> {
        let instr = self.stage_instruction(index)?;
        self.position = index;
        self.execute_for_validation(instr)
    }

    /// Instruction `index` of the stage's program (an internal error where there is none).
    fn stage_instruction(&self, index: usize) -> Result<&'p Instr, RuntimeError> {
        self.plan.program.get(index).ok_or_else(|| {
            RuntimeError::Kernel(crate::error::KernelError::Internal(format!(
                "a pipeline stage has no instruction {index}"
            )))
        })
    }

    /// Of `later` (instruction indices in program order, a backward pass's), those the loss needs: a
    /// plan may sum the loss over the grid and the replicas late, among the backward pass's
    /// instructions. Walks back from the loss through what each instruction reads.
    pub(crate) fn loss_completion(&self, later: &[usize]) -> Vec<usize> {
        let Some(loss) = self.plan.outputs.iter().find(|o| o.is_loss).map(|o| o.buffer) else { return Vec::new() };
        let mut needed: std::collections::BTreeSet<BufferId> = std::iter::once(loss).collect();
        let mut chosen = Vec::new();
        for &k in later.iter().rev() {
            let (writes, reads): (Option<BufferId>, Vec<BufferId>) = match self.plan.program.get(k) {
                Some(Instr::Kernel { output, inputs, .. }) => (Some(*output), inputs.clone()),
                Some(Instr::Collective { collective, .. }) => (Some(collective.recv), vec![collective.send]),
                Some(Instr::Wait { recv, .. }) => (Some(*recv), Vec::new()),
                _ => (None, Vec::new()),
            };
            if writes.is_some_and(|w| needed.contains(&w)) {
                chosen.push(k);
                needed.extend(reads);
            }
        }
        chosen.reverse();
        chosen
    }

    /// Ends a pass of validation: everything but the persistent buffers dies.
    pub(crate) fn end_validation_pass(&mut self) -> Result<(), RuntimeError> {
        self.finish_in_flight()?;
        self.begin_step();
        Ok(())
    }

    /// Whether instruction `index` is an optimizer step.
    pub(crate) fn is_optimizer_step(&self, index: usize) -> bool {
        matches!(self.plan.program.get(index), Some(Instr::Kernel { kernel: Kernel::OptimizerStep, .. }))
    }

    /// Copies out every buffer of the micro-batch that is alive (activations, workspace, inputs), then
    /// lets every non-persistent buffer die: the next pass may reuse their storage.
    pub(crate) fn stash(&mut self) -> Result<Stash, RuntimeError> {
        self.finish_in_flight()?;
        let mut stash = Stash::default();
        let plan = self.plan;
        for b in &plan.buffers {
            let kept = !matches!(b.role, Role::Parameter | Role::OptimizerState | Role::Cache);
            if kept && let Some(tensor) = self.reused_host_copy(b.id)? {
                stash.bytes += b.bytes();
                stash.buffers.push((b.id, tensor));
            }
        }
        self.begin_step();
        Ok(stash)
    }

    /// Writes back what [`Device::stash`] kept, and keeps its host tensors for later stashes (so that
    /// a run's copies after its first few go into memory already paged in).
    pub(crate) fn restore(&mut self, stash: Stash) -> Result<(), RuntimeError> {
        for (id, tensor) in stash.buffers {
            self.write_from(id, &tensor)?;
            self.give_back(id, tensor);
        }
        Ok(())
    }

    /// Adds each of `gradients` that this pass wrote to the update's sums, then lets every
    /// non-persistent buffer die.
    pub(crate) fn add_gradients(&mut self, gradients: &[BufferId]) -> Result<(), RuntimeError> {
        self.finish_in_flight()?;
        for &g in gradients {
            self.add_to_gradient_sum(g)?;
        }
        self.begin_step();
        Ok(())
    }

    /// Writes each gradient's mean over `count` micro-batches (in micro-batch order, as a whole-program
    /// accumulation does) and clears the sums. A gradient no pass wrote is an error.
    pub(crate) fn write_mean_gradients(&mut self, gradients: &[BufferId], count: u64) -> Result<(), RuntimeError> {
        let inv = count.max(1) as f32;
        for &g in gradients {
            let total = self.grad_sums.remove(&g).ok_or(RuntimeError::OptimizerNotAlive)?;
            let mean: Vec<f32> = total.iter().map(|&s| s / inv).collect();
            let shape = self.plan.buffer(g).shape.clone();
            self.write(g, Tensor::from_f32(&shape, mean))?;
        }
        Ok(())
    }

    /// This stage's share of the squared gradient norm (summed over its mesh already).
    pub(crate) fn norm_share(&mut self) -> Result<f32, RuntimeError> {
        self.finish_in_flight()?;
        let id = self.plan.grad_norm.ok_or(RuntimeError::NoLoss)?;
        let value = self.read(id)?.and_then(|t| t.f32().ok()?.first().copied());
        value.ok_or(RuntimeError::NotAlive { buffer: self.plan.buffer(id).name.clone() })
    }

    /// Sets the squared gradient norm to the stages' total and takes the clip factor from it.
    pub(crate) fn set_norm(&mut self, squares: f32) -> Result<(), RuntimeError> {
        let id = self.plan.grad_norm.ok_or(RuntimeError::NoLoss)?;
        let meta = self.plan.buffer(id);
        self.write(id, Tensor::from_f32(&meta.shape, vec![squares; meta.elements() as usize]))?;
        self.grad_norm = Some(self.clip_factor(id)?);
        Ok(())
    }

    /// The loss of the pass just run, if this device computes it.
    pub(crate) fn loss_value(&mut self) -> Result<Option<f32>, RuntimeError> {
        let Some(loss) = self.plan.outputs.iter().find(|o| o.is_loss).map(|o| o.buffer) else { return Ok(None) };
        self.finish_in_flight()?;
        Ok(self.read(loss)?.and_then(|t| t.f32().ok()?.first().copied()))
    }

    /// The outputs the pass just run computed (alive now), to be handed back at the end.
    pub(crate) fn computed_outputs(&mut self) -> Result<Vec<(BufferId, Tensor)>, RuntimeError> {
        self.finish_in_flight()?;
        let mut outputs = Vec::new();
        for o in &self.plan.outputs {
            if let Some(t) = self.read(o.buffer)? {
                outputs.push((o.buffer, t));
            }
        }
        Ok(outputs)
    }

    /// The blocks the device hands back at the end: parameters, last gradients, and `outputs` (those
    /// of the last micro-batch, which its later passes let die).
    pub(crate) fn into_blocks(mut self, outputs: Vec<(BufferId, Tensor)>) -> Result<super::DeviceBlocks, RuntimeError> {
        for (id, tensor) in outputs {
            self.write(id, tensor)?;
        }
        final_blocks(self)
    }

    /// Loads this stage device's parameters and optimizer states from a checkpoint of the whole model
    /// `whole` (written on any mesh, with or without a pipeline): the blocks of `params` (indices into
    /// the whole plan's parameters, those its plan holds, in its order).
    pub(crate) fn load_stage_checkpoint(
        &mut self,
        checkpoint: &dyn optimus_plan::stores::CheckpointSource,
        whole: &optimus_plan::Plan,
        params: &[usize],
    ) -> Result<(), RuntimeError> {
        let blocks = checkpoint.device_blocks_of(whole, self.coords(), true, params).map_err(super::store_error)?;
        let plan = self.plan;
        for (p, (param, states)) in plan.params.iter().zip(blocks) {
            self.write(p.buffer, param)?;
            for (&id, state) in p.state.iter().zip(states) {
                self.write(id, state)?;
            }
        }
        Ok(())
    }

    /// The bytes of the update's gradient sums so far.
    pub(crate) fn gradient_sum_bytes(&self) -> u64 {
        self.grad_sums.values().map(|sum| 4 * sum.len() as u64).sum()
    }

    /// The bytes of storage the device's arena holds.
    pub(crate) fn storage_bytes(&self) -> u64 {
        super::arena::layout(self.plan).total as u64 * 4
    }
}
