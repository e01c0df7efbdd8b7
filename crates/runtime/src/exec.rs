//! The backend-neutral executor: a [`Device`] runs the SPMD program of a plan on its own buffers,
//! through any [`Backend`] for kernels and any [`Communicator`] for collectives; [`run_device`] runs
//! the step loop of one device and [`assemble`] joins every device's blocks into logical tensors.

use super::arena;

mod in_place;
mod stage;
mod untouched;
use super::backend::{Backend, BackendKind, UpdateBuffers};
use super::comm::{CollectiveSpec, Communicator};
use super::cpu::CpuBackend;
use super::error::RuntimeError;
use super::fault::Fault;
use super::profile::Profile;
use super::schedule::Schedule;
use super::settings::{KernelContext, OptimizerSettings};
pub use in_place::{InPlaceGroup, in_place_groups};
use optimus_plan::init::{self, gather_blocks};
use optimus_plan::memory::persistent;
use optimus_plan::phases::{Phase, StepPhases};
use optimus_plan::stores::{CheckpointSink, CheckpointSource, DeviceParamBlocks, WeightSource};
use optimus_plan::tensor::Tensor;
use optimus_plan::{Buffer, BufferId, CollectiveKind, Coords, Group, Instr, Kernel, Plan, ReduceOp, Role};
pub use stage::Stash;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};
pub use untouched::untouched_result_may_be_read;

/// How to run a plan.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub seed: u64,
    pub steps: u64,
    pub optimizer: OptimizerSettings,
    /// How long a collective waits for its peers before the run fails.
    pub timeout: Duration,
    /// A failure to inject, for testing how runs fail (see [`crate::fault`]).
    pub fault: Option<Fault>,
    /// Where kernels run.
    pub backend: BackendKind,
    /// Time every instruction of every device into [`RunOutput::profiles`] (the first
    /// `profile_warm_up` steps are left out as warm-up when there are more).
    pub profile: bool,
    /// Steps a profile leaves out as warm-up (at least one; never the last step).
    pub profile_warm_up: u64,
    /// The learning rate of each update (`optimizer.lr` is replaced by its rate, step by step);
    /// `None` keeps `optimizer.lr` throughout.
    pub schedule: Option<Schedule>,
    /// Validation losses during training, if asked for.
    pub evaluation: Option<Evaluation>,
    /// Micro-batches per update (`--accum`; 1 for none): micro-batch m of step k is batch k * N + m of
    /// the data, the update uses the mean of their gradients, and the step's loss is their mean loss.
    pub accumulation: u64,
    /// `--clip-grad-norm`: scale every gradient by min(1, X / (norm + 1e-6)) before the update, as
    /// `torch.nn.utils.clip_grad_norm_` does, where norm is the global L2 norm of all gradients.
    pub clip_grad_norm: Option<f32>,
    /// The first step to run: 0, or the updates a resumed checkpoint had done. Steps keep their numbers,
    /// so a resumed run reads the same batches, draws the same masks and follows the same schedule.
    pub start_step: u64,
    /// The checkpoint every device loads its parameter and optimizer-state blocks from (`--resume`).
    pub resume: Option<std::sync::Arc<dyn CheckpointSource>>,
    /// Hugging Face weights (`--weights`), mapped: every device reads only its blocks of each parameter.
    pub weights: Option<std::sync::Arc<dyn WeightSource>>,
    /// Periodic checkpoints (`--checkpoint-dir`).
    pub checkpoints: Option<Checkpointing>,
    /// Asked after every step; when it says yes on any device, every device stops after that step (and
    /// writes a checkpoint, if checkpointing): the interrupt of `optimusc run`.
    pub stop: Option<fn() -> bool>,
    /// Receives every device's output blocks after each step, for runs whose next inputs depend on
    /// this step's outputs (generation).
    pub step_outputs: Option<std::sync::Arc<dyn StepOutputs>>,
    /// A plan that runs step 0 instead of the run's plan (generation's prefill program): each device
    /// then passes its storage, parameters and key/value caches in place, to the run's plan, which
    /// runs the later steps. Both plans must place those buffers alike (`arena::places_alike`).
    pub prefill: Option<std::sync::Arc<Plan>>,
    /// Whether the run hands back its final parameters, gradients and outputs, assembled into logical
    /// tensors (every device's copied out and gathered: a model's size of copies). Generation, which
    /// reads its outputs step by step, does without.
    pub final_state: bool,
    /// On the CPU backend: whether each device thread runs its own kernels (`Some(true)`), hands them
    /// to the kernel pool (`Some(false)`), or `None`: as [`crate::cpu::par::devices_run_kernels_inline`]
    /// decides (calibration measures both).
    pub kernels_inline: Option<bool>,
}

/// Takes the output blocks (plan order) of device `rank` after batch `index`. Every device deposits
/// after every batch, before it asks for the next one.
pub trait StepOutputs: Send + Sync + std::fmt::Debug {
    fn deposit(&self, index: u64, rank: u64, blocks: Vec<Tensor>);
}

/// Where and how often a run writes checkpoints.
#[derive(Clone, Debug)]
pub struct Checkpointing {
    /// After every `every`-th update (and always after the last one, and when the run is stopped).
    pub every: Option<u64>,
    /// Where they are committed (a checkpoint folder).
    pub sink: std::sync::Arc<dyn CheckpointSink>,
}

/// Validation batch v of a run, as logical tensors by input name.
pub type ValidationBatches = dyn Fn(u64) -> Result<BTreeMap<String, Tensor>, String> + Send + Sync;

/// Validation during training: after every `every`-th update, the mean loss of validation batches
/// 0..`batches`, computed with the current weights, dropout off and no update.
#[derive(Clone)]
pub struct Evaluation {
    pub every: u64,
    pub batches: u64,
    /// Validation batch v, as logical tensors by input name.
    pub data: std::sync::Arc<ValidationBatches>,
}

impl std::fmt::Debug for Evaluation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Evaluation").field("every", &self.every).field("batches", &self.batches).finish_non_exhaustive()
    }
}

impl RunConfig {
    /// A plain run: `steps` updates from the seed on the CPU, with a collective timeout of two minutes,
    /// no schedule, validation, accumulation, clipping, checkpoints, profile or injected fault.
    pub fn new(seed: u64, steps: u64, optimizer: OptimizerSettings) -> RunConfig {
        RunConfig {
            seed,
            steps,
            optimizer,
            timeout: Duration::from_secs(120),
            fault: None,
            backend: BackendKind::Cpu,
            profile: false,
            profile_warm_up: 1,
            schedule: None,
            evaluation: None,
            accumulation: 1,
            clip_grad_norm: None,
            start_step: 0,
            resume: None,
            weights: None,
            checkpoints: None,
            stop: None,
            step_outputs: None,
            kernels_inline: None,
            prefill: None,
            final_state: true,
        }
    }

    /// The optimizer settings of update `step` (0-based): the schedule's rate, if there is one.
    pub fn optimizer_at(&self, step: u64) -> OptimizerSettings {
        match &self.schedule {
            Some(s) => OptimizerSettings { lr: s.rate(step) as f32, ..self.optimizer },
            None => self.optimizer,
        }
    }
}

/// What one step produced, as seen by device (0, 0).
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    pub step: u64,
    /// The loss of the step's forward pass (before the update), if the model has one.
    pub loss: Option<f32>,
    pub elapsed: Duration,
    /// The learning rate of this step's update.
    pub lr: f32,
    /// The validation loss after this step's update, when one was computed.
    pub val_loss: Option<f32>,
    /// The global L2 norm of the gradients of this step's update, before clipping (train plans).
    pub grad_norm: Option<f32>,
    /// The checkpoint written after this step, if one was (as seen by device (0, 0)).
    pub checkpoint: Option<std::path::PathBuf>,
}

/// Everything a run leaves behind, assembled into logical tensors.
#[derive(Clone, Debug)]
pub struct RunOutput {
    pub steps: Vec<StepRecord>,
    /// Final parameters, by parameter name (padding removed).
    pub params: BTreeMap<String, Tensor>,
    /// Gradients of the last step, by parameter name (train plans).
    pub grads: BTreeMap<String, Tensor>,
    /// Outputs of the last step, by output name.
    pub outputs: BTreeMap<String, Tensor>,
    /// Each device's instruction times, when the run was profiled (device order; under MPI only
    /// this rank's device).
    pub profiles: Vec<Profile>,
}

/// Inputs of step k, as logical tensors by input name.
pub type Batches<'a> = dyn Fn(u64) -> Result<BTreeMap<String, Tensor>, String> + Sync + 'a;

/// Blocks one device hands back at the end of a run: parameters, gradients, outputs (plan order).
pub type DeviceBlocks = (Vec<Tensor>, Vec<Option<Tensor>>, Vec<Tensor>);

/// What one device's run hands back: its step records, final blocks and profile (when profiled).
pub type DeviceResult = (Vec<StepRecord>, DeviceBlocks, Option<Profile>);

/// One device's state: its storage (allocated once from the plan's arena layout), the backend that
/// runs its kernels, and its endpoint to the others.
pub struct Device<'p, B: Backend, C: Communicator> {
    pub plan: &'p Plan,
    pub backend: B,
    /// Declared before `storage`, so that it is dropped first: a communicator with a thread of its own
    /// joins it when dropped, and that thread may still hold blocks of the storage.
    pub comm: C,
    pub seed: u64,
    /// The seed kernels see during the current step: the run's seed mixed with the step, so that
    /// dropout draws a new mask every step (and the same one when a step is replayed).
    step_seed: u64,
    storage: B::Storage,
    /// Which buffers hold a value: a buffer comes alive (zero-filled) when first written and dies at its
    /// `Free`, as if it had its own allocation; its region is shared with buffers of other lifetimes.
    alive: Vec<bool>,
    /// When set, [`Device::step`] times every instruction into it (`optimusc run --profile`).
    pub profile: Option<Profile>,
    /// Gradient sums of the micro-batches of the current update, by gradient buffer (`--accum`).
    grad_sums: BTreeMap<BufferId, Vec<f32>>,
    /// This replica's own gradient terms of the update's earlier micro-batches, by the buffer a sum
    /// over the replicas sends: with `--accum`, gradients cross the replicas once per update.
    deferred_sums: BTreeMap<BufferId, Vec<f32>>,
    /// What each instruction is for in the step (the plan's policy, read once).
    phases: StepPhases,
    /// Clip the gradients to this global norm before updating (`--clip-grad-norm`).
    pub clip_grad_norm: Option<f32>,
    /// The global gradient norm of the last update (before clipping) and the factor it scaled the
    /// gradients by.
    grad_norm: Option<(f32, f32)>,
    /// Overlapped collectives started and not yet waited for, in the order started.
    in_flight: Vec<InFlight>,
    /// The program position being executed (what an overlapped collective's profile row is).
    position: usize,
    /// The collective the last `Wait` finished, for the profile.
    last_wait: Option<Waited>,
    /// Host copies the micro-batches have finished with, by buffer, for the next copy of the same
    /// buffer to go into (see [`Device::reused_host_copy`]).
    spare: HashMap<BufferId, Vec<Tensor>>,
    /// The groups of broadcasts read in place that start at each instruction (found on the first step).
    in_place: Option<std::sync::Arc<[Option<in_place::InPlaceGroup>]>>,
}

/// An overlapped collective in flight on the communicator's own thread.
#[derive(Debug)]
struct InFlight {
    /// Its program position.
    index: usize,
    recv: BufferId,
    started: super::comm::Started,
    /// Time the start itself took on this device's thread.
    issued: Duration,
}

/// What waiting for an overlapped collective found: where it started, how long this device's thread
/// waited for it, and how much of its run went on beside this thread's work (its run time less the
/// time this thread spent starting and waiting for it).
#[derive(Clone, Copy, Debug)]
struct Waited {
    index: usize,
    blocked: Duration,
    hidden: Duration,
}

/// What a step does at its optimizer instructions.
#[derive(Clone, Copy, Debug)]
pub enum Update<'a> {
    /// Update the parameters with these settings; the update's number counts from 1.
    Apply(&'a OptimizerSettings, u64),
    /// Add each gradient to the sum of this update's micro-batches, and update nothing.
    Accumulate,
    /// The last of `count` micro-batches: each gradient becomes the mean of the micro-batches', then
    /// the parameters are updated.
    ApplyMean(&'a OptimizerSettings, u64, u64),
}

impl<'p, B: Backend, C: Communicator> Device<'p, B, C> {
    /// A device with its parameter shards initialised from the seed, and zeroed optimizer state and
    /// key/value caches; all of its storage is allocated here, once.
    pub fn new(plan: &'p Plan, backend: B, comm: C, seed: u64) -> Result<Device<'p, B, C>, RuntimeError> {
        Device::with_parameters(plan, backend, comm, seed, &|_| true)
    }

    /// [`Device::new`], drawing from the seed only the parameters `drawn` says (the others are written
    /// before the first step: from `--weights`, say, where drawing them first would only cost time).
    pub fn with_parameters(
        plan: &'p Plan,
        mut backend: B,
        comm: C,
        seed: u64,
        drawn: &dyn Fn(&optimus_plan::PlanParam) -> bool,
    ) -> Result<Device<'p, B, C>, RuntimeError> {
        let storage = backend.allocate(plan, &arena::layout(plan))?;
        let mut device = Device::on_storage(plan, backend, comm, seed, storage);
        let coords = device.coords();
        for p in &plan.params {
            let meta = plan.buffer(p.buffer);
            if drawn(p) {
                device.write(p.buffer, super::draw::param_block(p, meta, coords, plan.mesh, seed))?;
            }
            for s in &p.state {
                device.backend.zero(&mut device.storage, *s)?;
                device.alive[s.0 as usize] = true;
            }
        }
        // Key/value caches hold zeros until a step writes their rows, and live from one step to the next.
        for b in plan.buffers.iter().filter(|b| b.role == Role::Cache) {
            device.backend.zero(&mut device.storage, b.id)?;
            device.alive[b.id.0 as usize] = true;
        }
        Ok(device)
    }

    /// A device of `plan` on storage already laid out for it, with no buffer alive.
    fn on_storage(plan: &'p Plan, backend: B, comm: C, seed: u64, storage: B::Storage) -> Device<'p, B, C> {
        Device {
            plan,
            backend,
            comm,
            seed,
            step_seed: seed,
            storage,
            alive: vec![false; plan.buffers.len()],
            profile: None,
            grad_sums: BTreeMap::new(),
            deferred_sums: BTreeMap::new(),
            phases: StepPhases::of(plan),
            clip_grad_norm: None,
            grad_norm: None,
            in_flight: Vec::new(),
            position: 0,
            last_wait: None,
            spare: HashMap::new(),
            in_place: None,
        }
    }

    /// This device's storage passed whole to `next`, a plan that places every parameter and key/value
    /// cache as this one does (a generation's decode program after its prefill): those buffers keep
    /// their contents and stay alive, nothing is copied. An internal error where the plans place them
    /// differently, a collective is still in flight, or the backend cannot lay its storage out again.
    pub fn succeeded_by<'q>(mut self, next: &'q Plan) -> Result<Device<'q, B, C>, RuntimeError> {
        let layout = arena::layout(next);
        let alike = arena::places_alike((self.plan, &arena::layout(self.plan)), (next, &layout));
        if !alike || !self.in_flight.is_empty() || !self.backend.relayout(&mut self.storage, next, &layout)? {
            let why = "the decode program cannot take over the prefill program's storage: they place the \
                       parameters and caches differently, or the backend cannot lay its storage out again";
            return Err(RuntimeError::Kernel(super::error::KernelError::Internal(why.into())));
        }
        let Device { backend, comm, seed, storage, .. } = self;
        let mut device = Device::on_storage(next, backend, comm, seed, storage);
        let caches = next.buffers.iter().filter(|b| b.role == Role::Cache).map(|b| b.id);
        for id in next.params.iter().map(|p| p.buffer).chain(caches) {
            device.alive[id.0 as usize] = true;
        }
        Ok(device)
    }

    pub fn coords(&self) -> Coords {
        self.comm.coords()
    }

    /// A host copy of a buffer's contents, if it is alive (after the overlapped collective writing it,
    /// if one is in flight).
    pub fn read(&mut self, id: BufferId) -> Result<Option<Tensor>, RuntimeError> {
        self.wait(id)?;
        if !self.is_alive(id) {
            return Ok(None);
        }
        self.backend.download(&self.storage, id).map(Some)
    }

    fn is_alive(&self, id: BufferId) -> bool {
        self.alive.get(id.0 as usize).copied().unwrap_or(false)
    }

    /// Replaces a buffer's contents (loading inputs or checkpoint shards).
    pub fn write(&mut self, id: BufferId, tensor: Tensor) -> Result<(), RuntimeError> {
        self.write_from(id, &tensor)
    }

    /// [`Device::write`] from a borrowed tensor.
    pub(crate) fn write_from(&mut self, id: BufferId, tensor: &Tensor) -> Result<(), RuntimeError> {
        self.wait(id)?;
        let meta = self.plan.buffer(id);
        if tensor.shape != meta.shape {
            let (buffer, want, got) = (meta.name.clone(), meta.shape.clone(), tensor.shape.clone());
            return Err(RuntimeError::Shape { buffer, want, got });
        }
        self.backend.upload(&mut self.storage, id, tensor)?;
        self.alive[id.0 as usize] = true;
        Ok(())
    }

    /// Loads each input's block from the logical input tensors (by input name).
    pub fn load_inputs(&mut self, inputs: &std::collections::BTreeMap<String, Tensor>) -> Result<(), RuntimeError> {
        let coords = self.coords();
        for input in &self.plan.inputs {
            let logical = inputs.get(&input.name).ok_or_else(|| RuntimeError::NoInput { name: input.name.clone() })?;
            let meta = self.plan.buffer(input.buffer);
            let block = init::block_of(logical, meta, coords, self.plan.mesh).map_err(blocks_error)?;
            self.write(input.buffer, block)?;
        }
        Ok(())
    }

    /// Runs the whole program once (one training or inference step). The loss is checked before the
    /// first parameter update and every gradient before its own update, so that a non-finite value
    /// stops the step before it reaches the weights it can.
    pub fn step(&mut self, optimizer: &OptimizerSettings, step: u64) -> Result<(), StepError> {
        self.step_with(Update::Apply(optimizer, step), step)
    }

    /// Runs the whole program once with `update` at its optimizer instructions; dropout draws the masks
    /// of `draw` (the micro-batch's number, counted from 1, which is the update's without --accum).
    pub fn step_with(&mut self, update: Update<'_>, draw: u64) -> Result<(), StepError> {
        let plan = self.plan;
        self.step_seed = init::mix64(self.seed ^ init::mix64(draw));
        self.begin_step();
        self.grad_norm = None;
        let updates_begin = self.phases.updates_begin();
        let failed = |index: usize| move |e: RuntimeError| StepError::Failed(at_instruction(plan, index)(e));
        let groups = self.in_place_groups();
        let mut grouped_until = 0;
        for (index, instr) in plan.program.iter().enumerate() {
            if index < grouped_until {
                continue;
            }
            if let Some(group) = groups.get(index).and_then(Option::as_ref)
                && self.run_in_place(group).map_err(failed(index))?
            {
                grouped_until = group.kernel + 1;
                continue;
            }
            self.position = index;
            if index == updates_begin {
                self.finish_in_flight().map_err(failed(index))?;
                self.check_loss()?;
            }
            let phase = self.phases.phase(index);
            if phase == Phase::GradientNorm && !matches!(update, Update::Apply(..)) {
                // With --accum the norm is that of the mean gradient, which the last micro-batch forms here.
                let mean_of = match update {
                    Update::ApplyMean(_, _, count) => Some(count),
                    _ => None,
                };
                self.finish_in_flight().map_err(failed(index))?;
                self.accumulate_all(mean_of).map_err(failed(index))?;
                if mean_of.is_none() {
                    return Ok(());
                }
            }
            if let Some(norm_buffer) = plan.grad_norm.filter(|_| self.grad_norm.is_none())
                && phase == Phase::Update
            {
                self.finish_in_flight().map_err(failed(index))?;
                self.grad_norm = Some(self.clip_factor(norm_buffer).map_err(failed(index))?);
            }
            let started = self.profile_start();
            let deferred =
                phase == Phase::GradientSum && self.defer_gradient_sum(instr, update).map_err(failed(index))?;
            if !deferred {
                self.execute_with(instr, update).map_err(failed(index))?;
            }
            self.note_profiled(index, instr, started);
        }
        self.finish_in_flight().map_err(failed(plan.program.len()))?;
        if updates_begin == plan.program.len() {
            self.check_loss()?;
        }
        Ok(())
    }

    /// When profiling, where an instruction's run begins: the host's clock now, with no device time
    /// left over from work outside the plan's instructions (the clipping's scaling, say).
    pub(crate) fn profile_start(&mut self) -> Option<Instant> {
        self.profile.as_ref()?;
        let _ = self.backend.take_device_time();
        Some(Instant::now())
    }

    /// Adds instruction `index`'s run (begun at `started`, `None` when not profiling) to the profile: a
    /// `Wait` as the time blocked on the overlapped collective it waited for.
    fn note_profiled(&mut self, index: usize, instr: &Instr, started: Option<Instant>) {
        if let (Some(profile), Some(started)) = (self.profile.as_mut(), started) {
            match (instr, self.last_wait.take()) {
                (Instr::Wait { .. }, Some(w)) => profile.record_wait(w.index, w.blocked, w.hidden),
                _ => profile.record(index, self.backend.take_device_time().unwrap_or_else(|| started.elapsed())),
            }
        }
    }

    /// Waits for every overlapped collective still in flight (where a partial pass of the program
    /// ends, or before the executor reads what one may be writing).
    fn finish_in_flight(&mut self) -> Result<(), RuntimeError> {
        while let Some(f) = self.in_flight.first() {
            let recv = f.recv;
            self.wait(recv)?;
        }
        self.last_wait = None;
        Ok(())
    }

    /// Waits for the overlapped collective into `recv`, if one is in flight (it is not when the
    /// collective ran where it started, or a micro-batch deferred it); notes it for the profile.
    fn wait(&mut self, recv: BufferId) -> Result<(), RuntimeError> {
        let Some(k) = self.in_flight.iter().position(|f| f.recv == recv) else { return Ok(()) };
        let f = self.in_flight.remove(k);
        let began = Instant::now();
        let ran = self.comm.finish(f.started)?;
        let blocked = began.elapsed();
        let hidden = ran.saturating_sub(f.issued + blocked);
        self.last_wait = Some(Waited { index: f.index, blocked, hidden });
        Ok(())
    }

    /// Sums of gradients over the data-parallel replicas happen once per update, on the last
    /// micro-batch: an earlier micro-batch keeps this replica's term of each sum (and gives zero where
    /// the sum would land, so its accumulated gradient adds nothing), and the last adds the kept terms
    /// to its own before the sum. The result is the same sum over micro-batches and replicas, with a
    /// micro-batch's worth of traffic per update. Returns whether the instruction was handled here.
    /// `instr` is a [`Phase::GradientSum`].
    fn defer_gradient_sum(&mut self, instr: &Instr, update: Update<'_>) -> Result<bool, RuntimeError> {
        let Instr::Collective { collective: c, .. } = instr else { return Ok(false) };
        match update {
            Update::Accumulate => {
                let term = self.reused_host_copy(c.send)?.ok_or(RuntimeError::OptimizerNotAlive)?;
                let added = add_into(&mut self.deferred_sums, c.send, &term);
                self.give_back(c.send, term);
                added?;
                self.wait(c.recv)?;
                self.backend.zero(&mut self.storage, c.recv)?;
                self.alive[c.recv.0 as usize] = true;
                Ok(true)
            }
            Update::ApplyMean(..) => {
                if let Some(kept) = self.deferred_sums.remove(&c.send) {
                    let term = self.read(c.send)?.ok_or(RuntimeError::OptimizerNotAlive)?;
                    let mut values = term.f32()?.to_vec();
                    values.iter_mut().zip(&kept).for_each(|(v, k)| *v += k);
                    self.write(c.send, Tensor::from_f32(&term.shape, values))?;
                }
                Ok(false)
            }
            Update::Apply(..) => Ok(false),
        }
    }

    /// The global gradient norm of this step (before clipping), and the factor the gradients are scaled by:
    /// min(1, X / (norm + 1e-6)) with `--clip-grad-norm X`, else 1.
    fn clip_factor(&mut self, id: BufferId) -> Result<(f32, f32), RuntimeError> {
        let squares = self
            .read(id)?
            .and_then(|t| t.f32().ok()?.first().copied())
            .ok_or(RuntimeError::NotAlive { buffer: self.plan.buffer(id).name.clone() })?;
        let norm = f64::from(squares).sqrt() as f32;
        let factor = match self.clip_grad_norm {
            Some(max) => (max / (norm + 1e-6)).min(1.0),
            None => 1.0,
        };
        Ok((norm, factor))
    }

    /// The global gradient norm of the last update, before clipping (train plans that compute it).
    pub fn grad_norm(&self) -> Option<f32> {
        self.grad_norm.map(|(norm, _)| norm)
    }

    /// The mean loss of the validation batches of `evaluation` with the current weights: the program up
    /// to the first update, with dropout off and no update, once per batch. Every device must call it at
    /// the same point, since the program communicates.
    pub fn evaluate(&mut self, evaluation: &Evaluation) -> Result<f32, RuntimeError> {
        let plan = self.plan;
        let loss = plan.outputs.iter().find(|o| o.is_loss).ok_or(RuntimeError::NoLoss)?;
        let mut total = 0.0f64;
        for v in 0..evaluation.batches {
            self.load_inputs(&(evaluation.data)(v).map_err(RuntimeError::Data)?)?;
            self.begin_step();
            for (index, instr) in plan.program.iter().enumerate().take(self.phases.forward_end()) {
                self.position = index;
                self.execute_for_validation(instr).map_err(at_instruction(plan, index))?;
            }
            self.finish_in_flight()?;
            let value = self.read(loss.buffer)?.and_then(|t| t.f32().ok()?.first().copied());
            total += f64::from(value.ok_or(RuntimeError::LossNotComputed)?);
        }
        Ok((total / evaluation.batches.max(1) as f64) as f32)
    }

    /// Runs a forward instruction as validation does: dropout off, no optimizer step.
    fn execute_for_validation(&mut self, instr: &Instr) -> Result<(), RuntimeError> {
        match instr {
            Instr::Kernel { kernel: Kernel::Dropout { key, .. }, inputs, output, .. } => {
                self.kernel(&Kernel::Dropout { p: 0.0, key: *key }, inputs, *output)
            }
            _ => self.execute(instr, None),
        }
    }

    /// Buffers kept from the previous step (never freed) die as a step starts: their regions may be
    /// shared with buffers alive earlier in the step, and they come alive again, zeroed, when written.
    fn begin_step(&mut self) {
        for b in &self.plan.buffers {
            if !persistent(b.role) {
                self.alive[b.id.0 as usize] = false;
            }
        }
    }

    /// Runs one instruction, with `update` at an optimizer step.
    fn execute_with(&mut self, instr: &Instr, update: Update<'_>) -> Result<(), RuntimeError> {
        let Instr::Kernel { kernel: Kernel::OptimizerStep, inputs, .. } = instr else {
            return self.execute(instr, None);
        };
        // A plan that computes the gradient norm accumulates every gradient before it (see `step_with`).
        let accumulated = self.plan.grad_norm.is_some();
        match update {
            Update::Apply(settings, step) => self.optimizer(inputs, settings, step),
            Update::Accumulate if accumulated => Ok(()),
            Update::Accumulate => self.accumulate(inputs, None),
            Update::ApplyMean(settings, step, count) => {
                if !accumulated {
                    self.accumulate(inputs, Some(count))?;
                }
                self.optimizer(inputs, settings, step)
            }
        }
    }

    /// [`Device::accumulate`] for the gradient of every parameter, in plan order.
    fn accumulate_all(&mut self, mean_of: Option<u64>) -> Result<(), RuntimeError> {
        let plan = self.plan;
        for p in &plan.params {
            if let Some(grad) = p.grad {
                self.accumulate(&[p.buffer, grad, grad, grad], mean_of)?;
            }
        }
        Ok(())
    }

    /// Adds an optimizer step's gradient to this update's sum; with `mean_of`, replaces the gradient
    /// by the mean of the sum (in micro-batch order) over that many micro-batches, and clears the sum.
    fn accumulate(&mut self, inputs: &[BufferId], mean_of: Option<u64>) -> Result<(), RuntimeError> {
        let [_, grad, _, _] = *inputs else { return Err(RuntimeError::OptimizerOperands) };
        if !self.add_to_gradient_sum(grad)? {
            return Err(RuntimeError::OptimizerNotAlive);
        }
        let Some(count) = mean_of else { return Ok(()) };
        let total = self.grad_sums.remove(&grad).unwrap_or_default();
        let inv = count.max(1) as f32;
        let mean: Vec<f32> = total.iter().map(|&s| s / inv).collect();
        self.write(grad, Tensor::from_f32(&self.plan.buffer(grad).shape, mean))
    }

    /// Adds gradient `grad` to this update's sum of it; `false` (nothing added) when it holds no value.
    pub(crate) fn add_to_gradient_sum(&mut self, grad: BufferId) -> Result<bool, RuntimeError> {
        let Some(copy) = self.reused_host_copy(grad)? else { return Ok(false) };
        let added = add_into(&mut self.grad_sums, grad, &copy);
        self.give_back(grad, copy);
        added.map(|()| true)
    }

    /// A host copy of buffer `id` (`None` when it holds no value), in a tensor an earlier copy of it
    /// gave back ([`Device::give_back`]) where there is one: copies made every micro-batch then reuse
    /// memory already paged in.
    pub(crate) fn reused_host_copy(&mut self, id: BufferId) -> Result<Option<Tensor>, RuntimeError> {
        self.wait(id)?;
        if !self.is_alive(id) {
            return Ok(None);
        }
        let spare = self.spare.get_mut(&id).and_then(Vec::pop);
        let mut copy = spare.unwrap_or_else(|| Tensor::from_f32(&[0], Vec::new()));
        self.backend.download_into(&self.storage, id, &mut copy)?;
        Ok(Some(copy))
    }

    /// Keeps a host copy of buffer `id` that is no longer needed for the next [`Device::reused_host_copy`].
    pub(crate) fn give_back(&mut self, id: BufferId, copy: Tensor) {
        self.spare.entry(id).or_default().push(copy);
    }

    /// Runs one instruction; `update` is `None` when optimizer steps must not run (a diagnosis replay).
    fn execute(&mut self, instr: &Instr, update: Option<(&OptimizerSettings, u64)>) -> Result<(), RuntimeError> {
        match instr {
            Instr::Kernel { kernel: Kernel::OptimizerStep, inputs, .. } => match update {
                Some((settings, step)) => self.optimizer(inputs, settings, step),
                None => Ok(()),
            },
            Instr::Kernel { kernel, inputs, output, .. } => self.kernel(kernel, inputs, *output),
            Instr::Collective { collective: c, .. } => self.collective(c),
            Instr::Wait { recv, .. } => self.wait(*recv),
            // Parameters and key/value caches outlive any release (a plan never releases them).
            Instr::Free { buffer } => {
                if !matches!(self.plan.buffer(*buffer).role, Role::Parameter | Role::Cache) {
                    self.alive[buffer.0 as usize] = false;
                }
                Ok(())
            }
        }
    }

    /// A non-finite loss (on this device's copy of it) stops the step.
    fn check_loss(&mut self) -> Result<(), StepError> {
        let Some(loss) = self.plan.outputs.iter().find(|o| o.is_loss).map(|o| o.buffer) else { return Ok(()) };
        match self.non_finite_in(loss).map_err(StepError::Failed)? {
            Some((_, value)) => Err(StepError::NonFiniteLoss(value)),
            None => Ok(()),
        }
    }

    /// The first NaN or infinity of a buffer, if it is alive and holds one.
    fn non_finite_in(&mut self, id: BufferId) -> Result<Option<(usize, f32)>, RuntimeError> {
        if !self.is_alive(id) {
            return Ok(None);
        }
        self.backend.first_non_finite(&self.storage, id)
    }

    /// After a non-finite loss, before any update: replays the step's forward and backward pass (the
    /// inputs must have been loaded again) and finds, over the whole mesh, the first tensor that holds a
    /// NaN or an infinity: a parameter (in plan order), else the output of the earliest instruction.
    /// Every device must call it at the same point, since the replay and the agreement communicate.
    pub fn first_non_finite(&mut self) -> Result<String, RuntimeError> {
        let plan = self.plan;
        let mut local = None;
        for (k, p) in plan.params.iter().enumerate() {
            if local.is_none() && self.non_finite_in(p.buffer)?.is_some() {
                local = Some(k);
            }
        }
        self.begin_step();
        for (index, instr) in plan.program.iter().enumerate().take(self.phases.updates_begin()) {
            self.position = index;
            self.execute(instr, None).map_err(at_instruction(plan, index))?;
            let written = match instr {
                Instr::Kernel { output, .. } => Some(*output),
                // An overlapped collective's result is complete (and checked) at its wait.
                Instr::Collective { collective, .. } if !collective.overlapped => Some(collective.recv),
                Instr::Wait { recv, .. } => Some(*recv),
                Instr::Collective { .. } | Instr::Free { .. } => None,
            };
            if let Some(b) = written.filter(|_| local.is_none())
                && self.non_finite_in(b)?.is_some()
            {
                local = Some(plan.params.len() + index);
            }
        }
        self.finish_in_flight()?;
        // The mesh-wide first is the smallest index; an all-reduce of the negated index finds it.
        let mine = local.map_or(f32::MIN, |k| -(k as f32));
        let mut first = [0f32];
        self.comm.collective(&CollectiveSpec::all_reduce(Group::World, ReduceOp::Max, &[1]), &[mine], &mut first)?;
        Ok(describe_culprit(plan, first[0]))
    }

    /// Makes a buffer that is about to be written alive: zero-filled if it was not and the writer
    /// reads it (an accumulating kernel sees zeros, as in a fresh allocation), its contents kept if it
    /// was. Writers that set every element (every other kernel) skip the clearing.
    fn prepare_output(&mut self, id: BufferId, writer_reads_it: bool) -> Result<(), RuntimeError> {
        if !self.is_alive(id) {
            if writer_reads_it {
                self.backend.zero(&mut self.storage, id)?;
            }
            self.alive[id.0 as usize] = true;
        }
        Ok(())
    }

    fn require_alive(&self, ids: &[BufferId]) -> Result<(), RuntimeError> {
        match ids.iter().find(|id| !self.is_alive(**id)) {
            Some(id) => Err(RuntimeError::NotAlive { buffer: self.plan.buffer(*id).name.clone() }),
            None => Ok(()),
        }
    }

    fn kernel(&mut self, kernel: &Kernel, inputs: &[BufferId], output: BufferId) -> Result<(), RuntimeError> {
        let plan = self.plan;
        if inputs.contains(&output) {
            return Err(RuntimeError::ReadAndWritten { buffer: plan.buffer(output).name.clone() });
        }
        self.require_alive(inputs)?;
        self.prepare_output(output, kernel.reads_its_output())?;
        let metas: Vec<&Buffer> = inputs.iter().map(|&b| plan.buffer(b)).collect();
        let coords = self.comm.coords();
        let ctx = KernelContext {
            coords,
            mesh: plan.mesh,
            seed: self.step_seed,
            inputs: &metas,
            output: plan.buffer(output),
        };
        self.backend.kernel(&mut self.storage, kernel, inputs, output, &ctx)
    }

    fn optimizer(&mut self, inputs: &[BufferId], settings: &OptimizerSettings, step: u64) -> Result<(), RuntimeError> {
        let [param, grad, state1, state2] = *inputs else { return Err(RuntimeError::OptimizerOperands) };
        self.require_alive(inputs).map_err(|_| RuntimeError::OptimizerNotAlive)?;
        // A finite global norm means every gradient is finite (each block is counted on some device, and the
        // norm is summed over all of them): only without one are the gradients searched, to name the culprit.
        let norm_is_finite = self.grad_norm.is_some_and(|(norm, _)| norm.is_finite());
        if !norm_is_finite && let Some((at, value)) = self.backend.first_non_finite(&self.storage, grad)? {
            return Err(RuntimeError::NonFiniteGradient { grad: self.plan.buffer(grad).name.clone(), at, value });
        }
        if let Some((_, factor)) = self.grad_norm.filter(|&(_, factor)| factor != 1.0) {
            self.scale_gradient(grad, factor)?;
        }
        let buffers = UpdateBuffers { param, grad, state1, state2 };
        self.backend.optimizer_step(&mut self.storage, buffers, settings, step)
    }

    /// Multiplies a gradient by the clipping factor, in place, as `clip_grad_norm_` does.
    fn scale_gradient(&mut self, grad: BufferId, factor: f32) -> Result<(), RuntimeError> {
        if !self.is_alive(grad) {
            return Err(RuntimeError::OptimizerNotAlive);
        }
        self.backend.scale_in_place(&mut self.storage, grad, factor)
    }

    fn collective(&mut self, c: &optimus_plan::Collective) -> Result<(), RuntimeError> {
        let plan = self.plan;
        let (send_meta, recv_meta) = (plan.buffer(c.send), plan.buffer(c.recv));
        let full = if send_meta.elements() >= recv_meta.elements() { &send_meta.shape } else { &recv_meta.shape };
        if c.send == c.recv {
            return Err(RuntimeError::ReadAndWritten { buffer: send_meta.name.clone() });
        }
        self.require_alive(&[c.send])?;
        // Every kind writes its whole result but a reduce, which leaves the non-roots' untouched: only
        // there may zeros be needed (zeroing the others cost 2% of a 2x2 step's cycles), and only where
        // something may read them before the buffer is written whole. Otherwise an untouched result
        // stays as it was, dead if it was, so that nothing (a diagnosis replay) reads stale contents.
        // (The forward scan runs only for a result that holds no value yet: an alive one keeps its
        // contents whatever is read later.)
        let coords = self.comm.coords();
        if c.kind != CollectiveKind::Reduce || untouched::is_root(plan, c, coords) {
            self.prepare_output(c.recv, false)?;
        } else if !self.is_alive(c.recv) && untouched::untouched_result_may_be_read(plan, c.recv, self.position, coords)
        {
            self.prepare_output(c.recv, true)?;
        }
        let start = c.overlapped && self.backend.lends_in_place(&self.storage, c.send, c.recv);
        let began = Instant::now();
        let mut exchange = PlanCollective { comm: &mut self.comm, c, full, start, started: None };
        let elementwise = matches!(
            c.kind,
            CollectiveKind::Broadcast | CollectiveKind::Reduce | CollectiveKind::AllReduce | CollectiveKind::Transpose
        );
        self.backend.collective(&mut self.storage, c.send, c.recv, elementwise, &mut exchange)?;
        if let Some(started) = exchange.started.take() {
            self.in_flight.push(InFlight { index: self.position, recv: c.recv, started, issued: began.elapsed() });
        }
        Ok(())
    }
}

/// One collective of the plan on a communicator, for the backend to run on its buffers in their
/// element type.
struct PlanCollective<'a, C> {
    comm: &'a mut C,
    c: &'a optimus_plan::Collective,
    full: &'a [u64],
    /// Start the collective and leave it in flight (an overlapped collective whose buffers the backend
    /// lends in place) instead of running it to the end.
    start: bool,
    /// What the start returned.
    started: Option<super::comm::Started>,
}

impl<C: Communicator> PlanCollective<'_, C> {
    fn run<T: super::comm::Payload>(&mut self, send: &[T], recv: &mut [T]) -> Result<(), super::comm::CommError> {
        let spec = CollectiveSpec::of(self.c, self.full);
        if !self.start {
            return self.comm.collective(&spec, send, recv);
        }
        // SAFETY: `start` is set only when the backend lends the buffers themselves, which stay where
        // they are while the device lives (`Backend::lends_in_place`); the verified plan neither
        // touches `recv` nor writes or frees `send` before the collective's `Wait`, and the executor
        // waits for every collective still in flight before it returns from a pass of the program. The
        // communicator, dropped before the storage, joins its thread first.
        self.started = Some(unsafe { self.comm.start(&spec, send, recv)? });
        Ok(())
    }
}

impl<C: Communicator> super::backend::Exchanges for PlanCollective<'_, C> {
    fn f32(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), super::comm::CommError> {
        self.run(send, recv)
    }

    fn bf16(&mut self, send: &[u16], recv: &mut [u16]) -> Result<(), super::comm::CommError> {
        self.run(send, recv)
    }

    fn spec(&self) -> Option<CollectiveSpec<'_>> {
        Some(CollectiveSpec::of(self.c, self.full))
    }
}

impl<B: Backend, C: Communicator> Device<'_, B, C> {
    /// Whether `mine` holds on any device (every device must call it at the same point).
    pub fn any_device(&mut self, mine: bool) -> Result<bool, RuntimeError> {
        let mut any = [0f32];
        let flag = [if mine { 1.0 } else { 0.0 }];
        self.comm.collective(&CollectiveSpec::all_reduce(Group::World, ReduceOp::Max, &[1]), &flag, &mut any)?;
        Ok(any[0] > 0.0)
    }

    /// Replaces this device's parameter blocks, and its optimizer state in a train plan, by those of a
    /// checkpoint (written on any mesh).
    pub fn load_checkpoint(&mut self, checkpoint: &dyn CheckpointSource) -> Result<(), RuntimeError> {
        let plan = self.plan;
        let train = plan.mode == optimus_plan::Mode::Train;
        let blocks = checkpoint.device_blocks(plan, self.coords(), train).map_err(store_error)?;
        for (p, (param, states)) in plan.params.iter().zip(blocks) {
            self.write(p.buffer, param)?;
            if train {
                for (&id, state) in p.state.iter().zip(states) {
                    self.write(id, state)?;
                }
            }
        }
        Ok(())
    }

    /// Every device writes its shards of checkpoint `step` (the updates done); once all have, device
    /// (0, 0) writes the manifest and moves the checkpoint into place, and returns its path.
    fn write_checkpoint(
        &mut self,
        checkpoints: &Checkpointing,
        step: u64,
        micro_batches: u64,
    ) -> Result<Option<std::path::PathBuf>, RuntimeError> {
        let plan = self.plan;
        let tensors = self.checkpoint_tensors((0..plan.params.len()).collect::<Vec<_>>().as_slice())?;
        self.commit_checkpoint(checkpoints, (plan, step, micro_batches), &tensors)
    }

    /// This device's blocks of parameters `params` (indices into its plan's) and their optimizer states.
    pub(crate) fn checkpoint_tensors(&mut self, params: &[usize]) -> Result<Vec<(Tensor, Vec<Tensor>)>, RuntimeError> {
        let plan = self.plan;
        let not_alive = |name: &str, state: bool| RuntimeError::CheckpointNotAlive { name: name.to_string(), state };
        let mut tensors = Vec::with_capacity(params.len());
        for p in params.iter().filter_map(|&k| plan.params.get(k)) {
            let param = self.read(p.buffer)?.ok_or_else(|| not_alive(&p.name, false))?;
            let mut states = Vec::with_capacity(p.state.len());
            for &id in &p.state {
                states.push(self.read(id)?.ok_or_else(|| not_alive(&p.name, true))?);
            }
            tensors.push((param, states));
        }
        Ok(tensors)
    }

    /// Writes checkpoint `step` of `plan` (this device's, or the whole model a pipeline stage belongs
    /// to) from `tensors` (every parameter of `plan` with its states, in order), with the devices of this
    /// device's mesh: device (0, 0) prepares and commits it.
    pub(crate) fn commit_checkpoint(
        &mut self,
        checkpoints: &Checkpointing,
        (plan, step, micro_batches): (&Plan, u64, u64),
        tensors: &[(Tensor, Vec<Tensor>)],
    ) -> Result<Option<std::path::PathBuf>, RuntimeError> {
        // Device (0, 0) makes a fresh staging directory; every device writes into it once it exists. One
        // that cannot be made fails device (0, 0) at once, before the others hear of it: the first
        // failure is the one the run reports, and it is the one that says why.
        if self.coords().is_origin() {
            checkpoints.sink.prepare(step).map_err(store_error)?;
        }
        self.any_device(false)?;
        let blocks: Vec<DeviceParamBlocks> = tensors
            .iter()
            .map(|(param, states)| DeviceParamBlocks { param, states: states.iter().collect() })
            .collect();
        checkpoints.sink.write_device(plan, step, self.coords(), &blocks).map_err(store_error)?;
        // Every device's file is complete before the manifest is written; every device waits for the
        // commit, so that no device races ahead into the next checkpoint while this one is moved.
        self.any_device(false)?;
        let committed = if self.coords().is_origin() {
            Some(checkpoints.sink.commit(plan, step, step * micro_batches).map_err(store_error)?)
        } else {
            None
        };
        self.any_device(false)?;
        Ok(committed)
    }
}

/// Why a step did not complete.
#[derive(Clone, Debug, PartialEq)]
pub enum StepError {
    /// The loss came out NaN or infinite; no parameter has been updated in this step.
    NonFiniteLoss(f32),
    /// Anything else, in the user's terms.
    Failed(RuntimeError),
}

/// A parameter store's error (a checkpoint's or a weight file's), in its own words.
fn store_error(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Checkpoint(e.to_string())
}

/// An error of the plan's block arithmetic (cutting a logical tensor into a device's block, or joining
/// the blocks), in its words.
fn blocks_error(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Blocks(e.to_string())
}

/// Wraps an error of instruction `index` in what the instruction computes (see [`in_instruction`]).
fn at_instruction(plan: &Plan, index: usize) -> impl Fn(RuntimeError) -> RuntimeError + '_ {
    move |error| RuntimeError::Instruction { instruction: describe_instruction(plan, index), error: Box::new(error) }
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
        Instr::Wait { recv, .. } => (format!("`{}` (the wait for its collective)", plan.buffer(*recv).name), None),
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

/// Runs one device of the mesh for the configured steps and returns its records and final blocks.
/// `on_step` is called on device (0, 0) only; `slot` picks the GPU of a GPU backend.
pub fn run_device<C: Communicator>(
    plan: &Plan,
    comm: C,
    slot: super::backend::DeviceSlot,
    config: &RunConfig,
    batches: &Batches<'_>,
    initial: &BTreeMap<String, Tensor>,
    on_step: &(dyn Fn(&StepRecord) + Sync),
) -> Result<DeviceResult, String> {
    let run = DeviceRun { plan, config, batches, initial, on_step };
    match config.backend {
        BackendKind::Cpu => run.on(CpuBackend, comm),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let gpus = super::cuda::probe()? as u64;
            let (mesh, coords) = (plan.mesh, comm.coords());
            let ordinal = (slot.index % gpus) as usize;
            let timing = (config.timeout, config.profile);
            let backend = super::cuda::CudaBackend::new(ordinal, slot.link, (mesh, coords), timing)?;
            run.on(backend, comm)
        }
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => {
            let _ = slot;
            config.backend.check_available().and_then(|()| run.on(CpuBackend, comm))
        }
    }
}

/// Hands the device's output blocks after batch `index` to [`RunConfig::step_outputs`], if set.
fn deposit_outputs<B: Backend, C: Communicator>(
    config: &RunConfig,
    device: &mut Device<'_, B, C>,
    index: u64,
) -> Result<(), String> {
    let Some(sink) = &config.step_outputs else { return Ok(()) };
    let plan = device.plan;
    let mut blocks = Vec::with_capacity(plan.outputs.len());
    for o in &plan.outputs {
        let block = device.read(o.buffer)?.ok_or_else(|| format!("output `{}` was not computed", o.name))?;
        blocks.push(block);
    }
    sink.deposit(index, plan.mesh.rank_of(device.coords()), blocks);
    Ok(())
}

/// Writes the parameters given whole (`initial`, logical tensors by name) or by a weight file over
/// those the device drew from the seed.
pub(crate) fn write_given_parameters<B: Backend, C: Communicator>(
    device: &mut Device<'_, B, C>,
    initial: &BTreeMap<String, Tensor>,
    weights: Option<&dyn WeightSource>,
) -> Result<(), String> {
    let plan = device.plan;
    let coords = device.coords();
    for p in &plan.params {
        let meta = plan.buffer(p.buffer);
        if let Some(t) = initial.get(&p.name) {
            device.write(p.buffer, init::block_of(&init::pad_to(t, meta)?, meta, coords, plan.mesh)?)?;
        } else if let Some(weights) = weights {
            device.write(p.buffer, weights.block(p, meta, coords, plan.mesh).map_err(store_error)?)?;
        }
    }
    Ok(())
}

/// What one device's run needs besides its backend and communicator.
struct DeviceRun<'r> {
    plan: &'r Plan,
    config: &'r RunConfig,
    batches: &'r Batches<'r>,
    initial: &'r BTreeMap<String, Tensor>,
    on_step: &'r (dyn Fn(&StepRecord) + Sync),
}

impl DeviceRun<'_> {
    /// The step loop of one device on `backend` (after the prefill plan's step, when there is one).
    fn on<B: Backend, C: Communicator>(&self, backend: B, comm: C) -> Result<DeviceResult, String> {
        let DeviceRun { plan, config, .. } = *self;
        super::startup::mark("backend open");
        if let Some(prefill) = config.prefill.as_deref() {
            return self.on_after_prefill(prefill, backend, comm);
        }
        // Parameters given whole or by `--weights` are written before the first step (see `drive`).
        let mut device = Device::with_parameters(plan, backend, comm, config.seed, &|p| !self.given(p))?;
        device.profile = config.profile.then(|| Profile::new(plan, device.coords()));
        let outcome = self.load_parameters(&mut device).and_then(|()| self.steps(&mut device, config.start_step));
        self.finish(device, outcome.map(|(records, _)| records))
    }

    /// Whether a parameter's block is written before the first step rather than drawn from the seed.
    fn given(&self, p: &optimus_plan::PlanParam) -> bool {
        self.initial.contains_key(&p.name) || self.config.weights.is_some()
    }

    /// Step 0 on the prefill plan, then the run's plan from step 1 on the same storage: the two plans
    /// place the parameters and caches alike, so they pass on without a copy.
    fn on_after_prefill<B: Backend, C: Communicator>(
        &self,
        prefill: &Plan,
        backend: B,
        comm: C,
    ) -> Result<DeviceResult, String> {
        let DeviceRun { plan, config, .. } = *self;
        let mut first = Device::with_parameters(prefill, backend, comm, config.seed, &|p| !self.given(p))?;
        let outcome = self.load_parameters(&mut first).and_then(|()| {
            let sub = DeviceRun { plan: prefill, ..*self };
            sub.steps_upto(&mut first, 0, 1)
        });
        let (records, stopped) = match outcome {
            Ok(done) => done,
            Err(e) => return self.finish(first, Err(e)),
        };
        super::startup::mark("prefill step done");
        let mut device = first.succeeded_by(plan)?;
        super::startup::mark("storage passed to the decode program");
        let outcome = if stopped {
            Ok(records)
        } else {
            self.steps(&mut device, 1).map(|(later, _)| records.into_iter().chain(later).collect())
        };
        self.finish(device, outcome)
    }

    /// The device's result, or its failure told to its peers first: they may be waiting on collectives
    /// it has in flight, and would otherwise only learn that it stopped when its communicator drops.
    fn finish<B: Backend, C: Communicator>(
        &self,
        mut device: Device<'_, B, C>,
        outcome: Result<Vec<StepRecord>, String>,
    ) -> Result<DeviceResult, String> {
        match outcome {
            Ok(records) => {
                let profile = device.profile.take();
                // Without final state the run's output is its step records alone (`local::run`).
                let blocks = if self.config.final_state { final_blocks(device)? } else { Default::default() };
                Ok((records, blocks, profile))
            }
            Err(e) => {
                if !device.in_flight.is_empty() {
                    device.comm.abort(&failure_report(device.coords(), &e));
                }
                Err(e)
            }
        }
    }

    /// Loads the checkpoint being resumed, and the parameters given whole or by `--weights`.
    fn load_parameters<B: Backend, C: Communicator>(&self, device: &mut Device<'_, B, C>) -> Result<(), String> {
        let DeviceRun { config, initial, .. } = *self;
        device.clip_grad_norm = config.clip_grad_norm;
        if let Some(checkpoint) = &config.resume {
            device.load_checkpoint(checkpoint.as_ref())?;
        }
        write_given_parameters(device, initial, config.weights.as_deref())?;
        super::startup::mark("parameters written");
        Ok(())
    }

    /// Runs steps `from..` up to the configured count (or until asked to stop); the records and
    /// whether the run was asked to stop.
    fn steps<B: Backend, C: Communicator>(
        &self,
        device: &mut Device<'_, B, C>,
        from: u64,
    ) -> Result<(Vec<StepRecord>, bool), String> {
        self.steps_upto(device, from, self.config.steps)
    }

    /// Runs steps `from..to` (or until asked to stop); the records and whether the run was asked to stop.
    fn steps_upto<B: Backend, C: Communicator>(
        &self,
        device: &mut Device<'_, B, C>,
        from: u64,
        to: u64,
    ) -> Result<(Vec<StepRecord>, bool), String> {
        let DeviceRun { plan, config, batches, on_step, .. } = *self;
        let coords = device.coords();
        let mut records = Vec::new();
        let device_index = plan.mesh.rank_of(coords);
        for step in from..to {
            if let Some(fault) = &config.fault {
                fault.trigger(device_index, step).map_err(|e| e.to_string())?;
            }
            let start = Instant::now();
            let optimizer = config.optimizer_at(step);
            let micro_batches = config.accumulation.max(1);
            let mut losses = 0.0f64;
            let mut have_loss = false;
            for m in 0..micro_batches {
                let index = step * micro_batches + m;
                let update = match (micro_batches, m + 1 == micro_batches) {
                    (1, _) => Update::Apply(&optimizer, step + 1),
                    (_, false) => Update::Accumulate,
                    (n, true) => Update::ApplyMean(&optimizer, step + 1, n),
                };
                let batch = batches(index).map_err(|e| format!("step {step}: batch {index}: {e}"))?;
                device.load_inputs(&batch)?;
                match device.step_with(update, index + 1) {
                    Ok(()) => deposit_outputs(config, device, index)?,
                    Err(StepError::Failed(e)) => return Err(format!("step {step}: {e}")),
                    Err(StepError::NonFiniteLoss(value)) => {
                        device.load_inputs(&batches(index)?)?;
                        let culprit = device.first_non_finite().map_err(|e| format!("step {step}: {e}"))?;
                        return Err(format!(
                            "step {step}: the loss is {value}, so the run stops before updating any weight (none are saved); {culprit}"
                        ));
                    }
                }
                if let Some(o) = plan.outputs.iter().find(|o| o.is_loss)
                    && let Some(value) = device.read(o.buffer)?.and_then(|t| t.f32().ok()?.first().copied())
                {
                    losses += f64::from(value);
                    have_loss = true;
                }
            }
            let loss = have_loss.then(|| (losses / micro_batches as f64) as f32);
            let grad_norm = device.grad_norm();
            let mut record = StepRecord {
                step,
                loss,
                elapsed: start.elapsed(),
                lr: optimizer.lr,
                val_loss: None,
                grad_norm,
                checkpoint: None,
            };
            if let Some(evaluation) = config.evaluation.as_ref().filter(|e| (step + 1) % e.every.max(1) == 0) {
                let val = device.evaluate(evaluation).map_err(|e| format!("validation after step {step}: {e}"))?;
                record.val_loss = Some(val);
            }
            if let Some(profile) = device.profile.as_mut() {
                let warm_up = step < config.profile_warm_up.max(1) && step + 1 < config.steps;
                profile.finish_step(record.elapsed, warm_up);
            }
            let stop = match config.stop {
                Some(asked) => device.any_device(asked()).map_err(|e| format!("after step {step}: {e}"))?,
                None => false,
            };
            if let Some(checkpoints) = &config.checkpoints {
                let due = checkpoints.every.is_some_and(|c| (step + 1) % c.max(1) == 0);
                if due || stop || step + 1 == config.steps {
                    record.checkpoint = device
                        .write_checkpoint(checkpoints, step + 1, config.accumulation.max(1))
                        .map_err(|e| format!("checkpoint after step {step}: {e}"))?;
                }
            }
            if coords.is_origin() {
                on_step(&record);
            }
            records.push(record);
            if stop {
                return Ok((records, true));
            }
        }
        Ok((records, false))
    }
}

/// Adds a host copy of buffer `id` into its sum in `sums` (zeros the first time).
fn add_into(sums: &mut BTreeMap<BufferId, Vec<f32>>, id: BufferId, copy: &Tensor) -> Result<(), RuntimeError> {
    let values = copy.f32()?;
    let sum = sums.entry(id).or_insert_with(|| vec![0.0; values.len()]);
    if sum.len() != values.len() {
        return Err(RuntimeError::GradientResized);
    }
    sum.iter_mut().zip(values).for_each(|(s, &v)| *s += v);
    Ok(())
}

/// What a device's failure tells its peers and the user: `device (i, j) failed: ...`.
pub fn failure_report(coords: Coords, error: &str) -> String {
    format!("device {coords} failed: {error}")
}

/// A device's blocks at the end of a run: parameters, last gradients and outputs (host copies). The
/// device's storage shrinks to those buffers first, so the copies do not come on top of the arena.
fn final_blocks<B: Backend, C: Communicator>(mut device: Device<'_, B, C>) -> Result<DeviceBlocks, RuntimeError> {
    let plan = device.plan;
    let lost = |what: &'static str, name: &str| RuntimeError::NotKept { what, name: name.to_string() };
    let wanted =
        plan.params.iter().flat_map(|p| [Some(p.buffer), p.grad]).chain(plan.outputs.iter().map(|o| Some(o.buffer)));
    let keep: Vec<BufferId> = wanted.flatten().filter(|&id| device.is_alive(id)).collect();
    device.backend.retain(&mut device.storage, &keep)?;
    let mut params = Vec::with_capacity(plan.params.len());
    let mut grads = Vec::with_capacity(plan.params.len());
    for p in &plan.params {
        params.push(device.read(p.buffer)?.ok_or_else(|| lost("parameter", &p.name))?);
        grads.push(match p.grad {
            Some(g) => device.read(g)?,
            None => None,
        });
    }
    let mut outputs = Vec::with_capacity(plan.outputs.len());
    for o in &plan.outputs {
        outputs.push(device.read(o.buffer)?.ok_or_else(|| lost("output", &o.name))?);
    }
    Ok((params, grads, outputs))
}

impl RunOutput {
    /// A run's step records (and profiles) without its final tensors.
    pub fn of_steps(steps: Vec<StepRecord>, profiles: Vec<Profile>) -> RunOutput {
        RunOutput { steps, params: BTreeMap::new(), grads: BTreeMap::new(), outputs: BTreeMap::new(), profiles }
    }
}

/// Assembles logical tensors from every device's blocks (in row-major device order).
pub fn assemble(plan: &Plan, per_device: Vec<(Vec<StepRecord>, DeviceBlocks)>) -> Result<RunOutput, RuntimeError> {
    let steps = per_device.first().map(|d| d.0.clone()).unwrap_or_default();
    let mut out = RunOutput::of_steps(steps, Vec::new());
    for (k, p) in plan.params.iter().enumerate() {
        let blocks: Vec<&Tensor> = per_device.iter().map(|d| &d.1.0[k]).collect();
        let full = gather_blocks(&blocks, plan.buffer(p.buffer), plan.mesh).map_err(blocks_error)?;
        out.params.insert(p.name.clone(), init::unpad(&full, &p.shape));
        if let Some(g) = p.grad {
            let blocks: Option<Vec<&Tensor>> = per_device.iter().map(|d| d.1.1[k].as_ref()).collect();
            if let Some(blocks) = blocks {
                let full = gather_blocks(&blocks, plan.buffer(g), plan.mesh).map_err(blocks_error)?;
                out.grads.insert(p.name.clone(), init::unpad(&full, &p.shape));
            }
        }
    }
    for (k, o) in plan.outputs.iter().enumerate() {
        let blocks: Vec<&Tensor> = per_device.iter().map(|d| &d.1.2[k]).collect();
        let full = gather_blocks(&blocks, plan.buffer(o.buffer), plan.mesh).map_err(blocks_error)?;
        // Padded columns (a vocabulary padded to divide the shards) are no part of the output.
        let full = match &o.unpadded {
            Some(shape) => init::unpad(&full, shape),
            None => full,
        };
        out.outputs.insert(o.name.clone(), full);
    }
    Ok(out)
}
