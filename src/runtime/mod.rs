//! Running plans. A [`Device`] executes the SPMD program on its own buffers and talks to its peers
//! through a [`comm::Communicator`]; backends differ only in where kernels run and how peers talk.
//! The CPU backend (threads in one process) is the reference every other backend is checked against.

pub mod backend;
pub mod comm;
pub mod compare;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fault;
pub mod init;
pub mod launch;
pub mod limits;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod peak;
pub mod profile;
pub mod shapes;
pub mod tensor;
pub mod watchdog;

use crate::plan::{Buffer, BufferId, CollectiveKind, Group, Instr, Kernel, Plan, ReduceOp, Role};
use backend::Backend;
use comm::Communicator;
use cpu::kernels::{KernelContext, OptimizerSettings};
use tensor::{Data, Tensor};

/// One device's state: its buffers, the backend that runs its kernels, and its endpoint to the others.
pub struct Device<'p, B: Backend, C: Communicator> {
    pub plan: &'p Plan,
    pub backend: B,
    pub comm: C,
    pub seed: u64,
    /// The seed kernels see during the current step: the run's seed mixed with the step, so that
    /// dropout draws a new mask every step (and the same one when a step is replayed).
    step_seed: u64,
    buffers: Vec<Option<Tensor>>,
    /// When set, [`Device::step`] times every instruction into it (`optimusc run --profile`).
    pub profile: Option<profile::Profile>,
}

impl<'p, B: Backend, C: Communicator> Device<'p, B, C> {
    /// A device with its parameter shards initialised from the seed and zeroed optimizer state.
    pub fn new(plan: &'p Plan, backend: B, comm: C, seed: u64) -> Device<'p, B, C> {
        let (i, j) = comm.coords();
        let mut buffers: Vec<Option<Tensor>> = vec![None; plan.buffers.len()];
        for p in &plan.params {
            let meta = plan.buffer(p.buffer);
            buffers[p.buffer.0 as usize] = Some(init::param_block(p, meta, i, j, plan.mesh, seed));
            for s in &p.state {
                let m = plan.buffer(*s);
                buffers[s.0 as usize] = Some(Tensor::zeros(m.dtype, &m.shape));
            }
        }
        Device { plan, backend, comm, seed, step_seed: seed, buffers, profile: None }
    }

    pub fn coords(&self) -> (u64, u64) {
        self.comm.coords()
    }

    /// The current contents of a buffer, if it is alive.
    pub fn read(&self, id: BufferId) -> Option<&Tensor> {
        self.buffers.get(id.0 as usize).and_then(Option::as_ref)
    }

    /// Replaces a buffer's contents (loading inputs or checkpoint shards).
    pub fn write(&mut self, id: BufferId, tensor: Tensor) -> Result<(), String> {
        let meta = self.plan.buffer(id);
        if tensor.shape != meta.shape {
            return Err(format!("buffer `{}` is {:?} on each device, not {:?}", meta.name, meta.shape, tensor.shape));
        }
        self.buffers[id.0 as usize] = Some(tensor);
        Ok(())
    }

    /// Loads each input's block from the logical input tensors (by input name).
    pub fn load_inputs(&mut self, inputs: &std::collections::BTreeMap<String, Tensor>) -> Result<(), String> {
        let (i, j) = self.coords();
        for input in &self.plan.inputs {
            let logical = inputs.get(&input.name).ok_or_else(|| format!("no data for input `{}`", input.name))?;
            let meta = self.plan.buffer(input.buffer);
            let block = init::block_of(logical, meta, i, j, self.plan.mesh)?;
            self.write(input.buffer, block)?;
        }
        Ok(())
    }

    /// Runs the whole program once (one training or inference step). The loss is checked before the
    /// first parameter update and every gradient before its own update, so that a non-finite value
    /// stops the step before it reaches the weights it can.
    pub fn step(&mut self, optimizer: &OptimizerSettings, step: u64) -> Result<(), StepError> {
        let plan = self.plan;
        self.step_seed = init::mix64(self.seed ^ init::mix64(step));
        let first_update = first_update(plan);
        for (index, instr) in plan.program.iter().enumerate() {
            if index == first_update {
                self.check_loss()?;
            }
            let started = self.profile.is_some().then(std::time::Instant::now);
            self.execute(instr, Some((optimizer, step)))
                .map_err(|e| StepError::Failed(in_instruction(plan, index, &e)))?;
            if let (Some(profile), Some(started)) = (self.profile.as_mut(), started) {
                profile.record(index, started.elapsed());
            }
        }
        if first_update == plan.program.len() {
            self.check_loss()?;
        }
        Ok(())
    }

    /// Runs one instruction; `update` is `None` when optimizer steps must not run (a diagnosis replay).
    fn execute(&mut self, instr: &Instr, update: Option<(&OptimizerSettings, u64)>) -> Result<(), String> {
        match instr {
            Instr::Kernel { kernel: Kernel::OptimizerStep, inputs, .. } => match update {
                Some((settings, step)) => self.optimizer(inputs, settings, step),
                None => Ok(()),
            },
            Instr::Kernel { kernel, inputs, output, .. } => self.kernel(kernel, inputs, *output),
            Instr::Collective { collective: c, .. } => self.collective(c),
            Instr::Free { buffer } => {
                if self.plan.buffer(*buffer).role != Role::Parameter {
                    self.buffers[buffer.0 as usize] = None;
                }
                Ok(())
            }
        }
    }

    /// A non-finite loss (on this device's copy of it) stops the step.
    fn check_loss(&self) -> Result<(), StepError> {
        let loss = self.plan.outputs.iter().find(|o| o.is_loss).and_then(|o| self.read(o.buffer));
        match loss.and_then(|t| t.f32().ok()).and_then(|v| v.iter().copied().find(|x| !x.is_finite())) {
            Some(value) => Err(StepError::NonFiniteLoss(value)),
            None => Ok(()),
        }
    }

    /// After a non-finite loss, before any update: replays the step's forward and backward pass (the
    /// inputs must have been loaded again) and finds, over the whole mesh, the first tensor that holds a
    /// NaN or an infinity: a parameter (in plan order), else the output of the earliest instruction.
    /// Every device must call it at the same point, since the replay and the agreement communicate.
    pub fn first_non_finite(&mut self) -> Result<String, String> {
        let plan = self.plan;
        let mut local = plan.params.iter().position(|p| self.read(p.buffer).is_some_and(has_non_finite));
        for (index, instr) in plan.program.iter().enumerate().take(first_update(plan)) {
            self.execute(instr, None).map_err(|e| in_instruction(plan, index, &e))?;
            let written = match instr {
                Instr::Kernel { output, .. } => Some(*output),
                Instr::Collective { collective, .. } => Some(collective.recv),
                Instr::Free { .. } => None,
            };
            if local.is_none() && written.and_then(|b| self.read(b)).is_some_and(has_non_finite) {
                local = Some(plan.params.len() + index);
            }
        }
        // The mesh-wide first is the smallest index; an all-reduce of the negated index finds it.
        let mine = local.map_or(f32::MIN, |k| -(k as f32));
        let mut first = [0f32];
        self.comm
            .collective(CollectiveKind::AllReduce, Group::World, None, ReduceOp::Max, None, &[1], &[mine], &mut first)
            .map_err(|e| e.0)?;
        Ok(describe_culprit(plan, first[0]))
    }

    fn take_output(&mut self, id: BufferId) -> Tensor {
        let meta = self.plan.buffer(id);
        self.buffers[id.0 as usize].take().unwrap_or_else(|| Tensor::zeros(meta.dtype, &meta.shape))
    }

    fn kernel(&mut self, kernel: &Kernel, inputs: &[BufferId], output: BufferId) -> Result<(), String> {
        let plan = self.plan;
        let mut out = self.take_output(output);
        let result = {
            let mut refs = Vec::with_capacity(inputs.len());
            for id in inputs {
                let t = self.buffers[id.0 as usize]
                    .as_ref()
                    .ok_or_else(|| format!("buffer `{}` is not alive", plan.buffer(*id).name))?;
                refs.push(t);
            }
            let metas: Vec<&Buffer> = inputs.iter().map(|&b| plan.buffer(b)).collect();
            let (i, j) = self.comm.coords();
            let ctx = KernelContext {
                i,
                j,
                mesh: plan.mesh,
                seed: self.step_seed,
                inputs: &metas,
                output: plan.buffer(output),
            };
            self.backend.kernel(kernel, &refs, &mut out, &ctx)
        };
        self.buffers[output.0 as usize] = Some(out);
        result
    }

    fn optimizer(&mut self, inputs: &[BufferId], settings: &OptimizerSettings, step: u64) -> Result<(), String> {
        let [p, g, s1, s2] = inputs else { return Err("optimizer step needs (param, grad, state, state)".into()) };
        let missing = || "optimizer buffers are not alive".to_string();
        let mut param = self.buffers[p.0 as usize].take().ok_or_else(missing)?;
        let mut state1 = self.buffers[s1.0 as usize].take().ok_or_else(missing)?;
        let mut state2 = self.buffers[s2.0 as usize].take().ok_or_else(missing)?;
        let result = match self.buffers[g.0 as usize].as_ref() {
            Some(grad) => match first_non_finite_element(grad) {
                Some((at, value)) => Err(format!(
                    "the gradient `{}` holds {value} at element {at} of this device's block; the update stops here",
                    self.plan.buffer(*g).name
                )),
                None => self.backend.optimizer_step(&mut param, grad, &mut state1, &mut state2, settings, step),
            },
            None => Err(missing()),
        };
        self.buffers[p.0 as usize] = Some(param);
        self.buffers[s1.0 as usize] = Some(state1);
        self.buffers[s2.0 as usize] = Some(state2);
        result
    }

    fn collective(&mut self, c: &crate::plan::Collective) -> Result<(), String> {
        let plan = self.plan;
        let (send_meta, recv_meta) = (plan.buffer(c.send), plan.buffer(c.recv));
        let full = if send_meta.elements() >= recv_meta.elements() { &send_meta.shape } else { &recv_meta.shape };
        let mut recv = self.take_output(c.recv);
        let result = match (self.buffers[c.send.0 as usize].as_ref().map(|t| &t.data), &mut recv.data) {
            (Some(Data::F32(send)), Data::F32(out)) => self
                .comm
                .collective(c.kind, c.group, c.root, c.op.unwrap_or(ReduceOp::Sum), c.shard, full, send, out)
                .map_err(|e| e.0),
            (None, _) => Err(format!("buffer `{}` is not alive", send_meta.name)),
            _ => Err(format!("only floating-point buffers are communicated, not `{}`", send_meta.name)),
        };
        self.buffers[c.recv.0 as usize] = Some(recv);
        result
    }
}

/// Why a step did not complete.
#[derive(Clone, Debug, PartialEq)]
pub enum StepError {
    /// The loss came out NaN or infinite; no parameter has been updated in this step.
    NonFiniteLoss(f32),
    /// Anything else, in the user's terms.
    Failed(String),
}

/// The index of the first optimizer step of the program (its length if it has none).
fn first_update(plan: &Plan) -> usize {
    plan.program
        .iter()
        .position(|i| matches!(i, Instr::Kernel { kernel: Kernel::OptimizerStep, .. }))
        .unwrap_or(plan.program.len())
}

/// The first NaN or infinity of a floating-point tensor, with its element index.
fn first_non_finite_element(t: &Tensor) -> Option<(usize, f32)> {
    t.f32().ok()?.iter().copied().enumerate().find(|(_, x)| !x.is_finite())
}

fn has_non_finite(t: &Tensor) -> bool {
    first_non_finite_element(t).is_some()
}

/// An error of instruction `index`, in the user's terms: the tensor it computes and the source line.
pub fn in_instruction(plan: &Plan, index: usize, error: &str) -> String {
    format!("computing {}: {error}", describe_instruction(plan, index))
}

/// What instruction `index` computes: its output tensor, the source line and layer it comes from.
pub fn describe_instruction(plan: &Plan, index: usize) -> String {
    let Some(instr) = plan.program.get(index) else { return format!("instruction {index}") };
    let (what, origin) = match instr {
        Instr::Kernel { output, origin, .. } => (format!("`{}`", plan.buffer(*output).name), Some(*origin)),
        Instr::Collective { collective, origin, .. } => (
            format!(
                "`{}` by {} in a mesh {}",
                plan.buffer(collective.recv).name,
                collective.kind.name(),
                collective.group.name()
            ),
            Some(*origin),
        ),
        Instr::Free { buffer } => (format!("the release of `{}`", plan.buffer(*buffer).name), None),
    };
    match origin.and_then(|o| plan.origins.get(o as usize)) {
        Some(o) if o.scope.is_empty() => format!("{what} ({}:{})", plan.source, o.line),
        Some(o) => format!("{what} ({}:{}, in `{}`)", plan.source, o.line, o.scope),
        None => what,
    }
}

/// Names the culprit that [`Device::first_non_finite`] agreed on (a negated index, or `f32::MIN`).
fn describe_culprit(plan: &Plan, negated: f32) -> String {
    if negated == f32::MIN || !negated.is_finite() {
        return "no tensor of the replayed step holds one (the non-finite value did not recur)".into();
    }
    let index = (-negated) as usize;
    match plan.params.get(index) {
        Some(p) => format!("the parameter `{}` already held a NaN or an infinity before the step", p.name),
        None => format!(
            "the first tensor to hold a NaN or an infinity is {}",
            describe_instruction(plan, index - plan.params.len())
        ),
    }
}
