//! A pipeline run in one process: every stage's grid of devices on threads, each stage's devices
//! exchanging their collectives through a fabric of their own, and the stages passing activations,
//! their gradients and tied gradients point to point through mailboxes, under a schedule (GPipe, 1F1B,
//! interleaved 1F1B) over the update's micro-batches.
//!
//! Each device runs its stage's program ([`optimus_plan::pipeline_cut`]) one pass at a time, in the
//! order [`optimus_plan::pipeline::stage_order`] gives its stage; a forward pass's activations are kept
//! aside (host copies) until the micro-batch's backward pass, so the activations in flight are the
//! schedule's. Once every micro-batch is done: the gradients' means, the tied gradients sent to the
//! stages holding a copy, the gradient norm summed over the stages, the optimizer steps. The arithmetic
//! of every pass is the unpipelined plan's, so losses and weights equal an unpipelined run with as many
//! accumulated micro-batches (to the rounding of the gradient norm's sum, which the stages split).

use super::comm::Communicator;
use super::cpu::CpuBackend;
use super::cpu::threads::{Fabric, ThreadComm};
use super::exec::{Batches, Device, DeviceBlocks, RunConfig, RunOutput, StepRecord, Update, assemble};
use super::profile::{Category, Profile};
use super::settings::OptimizerSettings;
use optimus_plan::Plan;
use optimus_plan::pipeline::{Pass, Schedule, stage_order};
use optimus_plan::pipeline_cut::{Action, PipelineProgram, StageProgram};
use optimus_plan::tensor::Tensor;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The micro-batch number of what is sent once an update (the summed tied gradients).
const UPDATE: u64 = u64::MAX;
/// The micro-batch number of the gradient norm's shares.
const NORM: u64 = u64::MAX - 1;
/// Validation after step k exchanges its messages as step `VALIDATION + k`, apart from training's.
const VALIDATION: u64 = 1 << 62;
/// The micro-batch number of the parameter blocks sent to the first stage for a checkpoint.
const CHECKPOINT: u64 = u64::MAX - 2;

/// Who sends what to whom: the stages, the devices' rank in their stage's grid, the step, the micro-batch
/// and the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub from: u64,
    pub to: u64,
    pub rank: u64,
    pub step: u64,
    pub micro_batch: u64,
    pub buffer: u32,
}

/// How the devices of different stages reach each other: mailboxes in one process, MPI messages
/// between processes.
pub(crate) trait StageLink: Sync {
    /// Sends `block` to the device the key names; never waits for it to be received.
    fn send(&self, key: Key, block: Tensor) -> Result<(), String>;
    /// The block sent under `key`, waiting for it until it comes, the run fails or the timeout passes.
    fn receive(&self, key: Key, what: &dyn Fn() -> String) -> Result<Tensor, String>;
}

/// The point-to-point transfers between stages on threads: a queue per key, a receiver waiting until
/// its block is there, the run's failure, or the timeout.
pub struct Mailboxes {
    state: Mutex<MailState>,
    arrived: Condvar,
    timeout: Duration,
}

#[derive(Default)]
struct MailState {
    boxes: HashMap<Key, VecDeque<Tensor>>,
    failure: Option<String>,
    /// Bytes sent, for the report.
    bytes: u64,
}

impl Mailboxes {
    pub fn new(timeout: Duration) -> Mailboxes {
        Mailboxes { state: Mutex::new(MailState::default()), arrived: Condvar::new(), timeout }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MailState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn deliver(&self, key: Key, block: Tensor) {
        let mut state = self.lock();
        state.bytes += 4 * block.len() as u64;
        state.boxes.entry(key).or_default().push_back(block);
        self.arrived.notify_all();
    }

    pub(crate) fn wait_for(&self, key: Key, what: &dyn Fn() -> String) -> Result<Tensor, String> {
        let deadline = Instant::now() + self.timeout;
        let mut state = self.lock();
        loop {
            if let Some(failure) = &state.failure {
                return Err(format!("stopped waiting for {}: {failure}", what()));
            }
            if let Some(block) = state.boxes.get_mut(&key).and_then(VecDeque::pop_front) {
                return Ok(block);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!(
                    "timed out after {} waiting for {} from stage {} (a stage stopped or hung)",
                    optimus_plan::text::duration_text(self.timeout.as_secs_f64()),
                    what(),
                    key.from
                ));
            }
            state =
                self.arrived.wait_timeout(state, deadline - now).map(|(s, _)| s).unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Marks the run failed: every receiver stops waiting.
    pub fn fail(&self, why: &str) {
        let mut state = self.lock();
        state.failure.get_or_insert_with(|| why.to_string());
        self.arrived.notify_all();
    }

    pub fn failure(&self) -> Option<String> {
        self.lock().failure.clone()
    }

    /// Bytes sent between stages so far.
    pub fn bytes_sent(&self) -> u64 {
        self.lock().bytes
    }
}

impl StageLink for Mailboxes {
    fn send(&self, key: Key, block: Tensor) -> Result<(), String> {
        self.deliver(key, block);
        Ok(())
    }

    fn receive(&self, key: Key, what: &dyn Fn() -> String) -> Result<Tensor, String> {
        self.wait_for(key, what)
    }
}

/// What the schedule asks of a pipelined run.
#[derive(Clone, Copy, Debug)]
pub struct PipelineRun<'a> {
    pub program: &'a PipelineProgram,
    pub schedule: Schedule,
}

/// `--profile`'s rows for a stage device's own work: waiting for and taking a message from another
/// stage, sending one, and the host copies around its passes.
const RECEIVE: &str = "receive (stage)";
const SEND: &str = "send (stage)";
const KEPT_OUT: &str = "kept activations out (host)";
const KEPT_BACK: &str = "kept activations back (host)";
const GRADIENT_SUMS: &str = "gradient sums (host)";

/// One stage device's measured memory: its storage, its gradient sums over the micro-batches, and the
/// most bytes of activations it kept aside at once for backward passes to come, in how many forward
/// passes (micro-batches; with interleaving, micro-batch and chunk pairs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageMemory {
    pub storage_bytes: u64,
    pub gradient_sum_bytes: u64,
    pub peak_kept_bytes: u64,
    pub peak_in_flight: u64,
}

impl StageMemory {
    /// The most the device held at once: storage, gradient sums and kept activations.
    pub fn peak_bytes(&self) -> u64 {
        self.storage_bytes + self.gradient_sum_bytes + self.peak_kept_bytes
    }
}

/// A pipelined run's output: the whole model's (as an unpipelined run's) and each stage's memory (its
/// device of rank 0).
#[derive(Debug)]
pub struct PipelineOutput {
    pub run: RunOutput,
    pub stages: Vec<StageMemory>,
    pub bytes_between_stages: u64,
    /// With `RunConfig::profile`: every stage device's profile of its stage program (on threads), or
    /// rank 0's (under MPI).
    pub profiles: Vec<Profile>,
}

/// What one stage device hands back: its step records, its final blocks and its memory.
pub(crate) struct StageResult {
    pub records: Vec<StepRecord>,
    pub blocks: DeviceBlocks,
    pub memory: StageMemory,
    pub profile: Option<Profile>,
}

/// Runs `plan` (the whole model for one stage's grid) as the pipeline `run`, on the CPU, one thread
/// per device of every stage. `on_step` is called by the first stage's first device after every update.
pub fn run_on_threads(
    plan: &Plan,
    pipe: PipelineRun<'_>,
    config: &RunConfig,
    batches: &Batches<'_>,
    initial: &BTreeMap<String, Tensor>,
    on_step: &(dyn Fn(&StepRecord) + Sync),
) -> Result<PipelineOutput, String> {
    let stages = pipe.program.stages.len() as u64;
    let devices = plan.mesh.devices();
    let run = (pipe.program, pipe.schedule, config.accumulation.max(1));
    super::limits::check_pipeline_host_can_run(plan, run, devices * stages).map_err(|e| e.to_string())?;
    let mail = Mailboxes::new(config.timeout);
    let fabrics: Vec<Arc<Fabric>> = (0..stages).map(|_| Fabric::new(plan.mesh, config.timeout)).collect();
    let inline = config
        .kernels_inline
        .unwrap_or_else(|| super::cpu::par::devices_run_kernels_inline((devices * stages) as usize));
    let results: Vec<Vec<Result<StageResult, String>>> = std::thread::scope(|scope| {
        let handles: Vec<Vec<_>> = pipe
            .program
            .stages
            .iter()
            .zip(&fabrics)
            .map(|(stage, fabric)| {
                (0..devices)
                    .map(|rank| {
                        let (fabric, mail) = (Arc::clone(fabric), &mail);
                        scope.spawn(move || {
                            let coords = plan.mesh.coords_of(rank);
                            let comm = ThreadComm::new(Arc::clone(&fabric), coords);
                            let worker =
                                StageWorker { whole: plan, pipe, stage, rank, mail, config, batches, initial, on_step };
                            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                let device = || worker.run(comm);
                                if inline { super::cpu::par::run_inline(device) } else { device() }
                            }));
                            let result =
                                outcome.unwrap_or_else(|_| Err("a kernel panicked (an internal error)".into()));
                            result.map_err(|e| {
                                let message =
                                    format!("stage {} {}", stage.stage, super::exec::failure_report(coords, &e));
                                mail.fail(&message);
                                ThreadComm::new(fabric, coords).abort(&message);
                                message
                            })
                        })
                    })
                    .collect()
            })
            .collect();
        handles
            .into_iter()
            .map(|stage| {
                stage.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a device thread panicked".into()))).collect()
            })
            .collect()
    });
    if let Some(first) = mail.failure() {
        return Err(first);
    }
    let mut per_stage = Vec::with_capacity(results.len());
    for stage in results {
        per_stage.push(stage.into_iter().collect::<Result<Vec<_>, String>>()?);
    }
    let memory: Vec<StageMemory> = per_stage.iter().map(|s| s.first().map(|d| d.memory).unwrap_or_default()).collect();
    let profiles: Vec<Profile> = per_stage.iter_mut().flatten().filter_map(|d| d.profile.take()).collect();
    let steps = per_stage.first().and_then(|s| s.first()).map(|d| d.records.clone()).unwrap_or_default();
    let run = if config.final_state {
        let blocks: Vec<Vec<DeviceBlocks>> =
            per_stage.into_iter().map(|s| s.into_iter().map(|d| d.blocks).collect()).collect();
        merged_output(plan, pipe.program, &blocks, steps)?
    } else {
        RunOutput::of_steps(steps, Vec::new())
    };
    Ok(PipelineOutput { run, stages: memory, bytes_between_stages: mail.bytes_sent(), profiles })
}

/// The whole model's output of a pipelined run, from every stage device's final blocks (by stage, then
/// rank in the stage's grid) and the step records.
pub(crate) fn merged_output(
    plan: &Plan,
    program: &PipelineProgram,
    per_stage: &[Vec<DeviceBlocks>],
    steps: Vec<StepRecord>,
) -> Result<RunOutput, String> {
    let merged = merge_blocks(plan, program, per_stage)?;
    let output = assemble(plan, merged.into_iter().map(|b| (Vec::new(), b)).collect()).map_err(|e| e.to_string())?;
    Ok(RunOutput { steps, ..output })
}

/// Every device's blocks of the whole plan, from the stages that hold them: a parameter from the first
/// stage holding it, a gradient from the stage that computes it, an output from the stage writing it.
fn merge_blocks(
    plan: &Plan,
    program: &PipelineProgram,
    per_stage: &[Vec<DeviceBlocks>],
) -> Result<Vec<DeviceBlocks>, String> {
    // Where each parameter's block and gradient come from: (stage, index in that stage's parameters).
    let mut sources = Vec::with_capacity(plan.params.len());
    for (k, p) in plan.params.iter().enumerate() {
        let first = program.first_holder(k).ok_or_else(|| format!("no stage holds the parameter `{}`", p.name))?;
        let computes = |(s, stage): (usize, &StageProgram)| {
            let j = stage.params.iter().position(|&q| q == k)?;
            p.grad.is_some_and(|g| stage.gradients.contains(&g)).then_some((s, j))
        };
        sources.push((first, program.stages.iter().enumerate().find_map(computes).unwrap_or(first)));
    }
    let mut outputs = Vec::with_capacity(plan.outputs.len());
    for o in &plan.outputs {
        let found = program
            .stages
            .iter()
            .enumerate()
            .find_map(|(s, stage)| Some((s, stage.plan.outputs.iter().position(|q| q.buffer == o.buffer)?)));
        outputs.push(found.ok_or_else(|| format!("no stage computes the output `{}`", o.name))?);
    }
    let mut merged = Vec::with_capacity(plan.mesh.devices() as usize);
    for rank in 0..plan.mesh.devices() as usize {
        let blocks: Vec<&DeviceBlocks> = per_stage
            .iter()
            .map(|stage| stage.get(rank))
            .collect::<Option<_>>()
            .ok_or("a stage device handed back no blocks")?;
        let params = sources.iter().map(|&((s, j), _)| blocks[s].0[j].clone()).collect();
        let grads = sources.iter().map(|&(_, (s, j))| blocks[s].1[j].clone()).collect();
        let outs = outputs.iter().map(|&(s, j)| blocks[s].2[j].clone()).collect();
        merged.push((params, grads, outs));
    }
    Ok(merged)
}

/// One device of one stage and what its run needs.
pub(crate) struct StageWorker<'r> {
    /// The whole model's plan (for one stage's grid), whose checkpoints the stages write together.
    pub whole: &'r Plan,
    pub pipe: PipelineRun<'r>,
    pub stage: &'r StageProgram,
    /// The device's rank in its stage's grid.
    pub rank: u64,
    pub mail: &'r dyn StageLink,
    pub config: &'r RunConfig,
    pub batches: &'r Batches<'r>,
    pub initial: &'r BTreeMap<String, Tensor>,
    /// Called by the first stage's first device after every update.
    pub on_step: &'r (dyn Fn(&StepRecord) + Sync),
}

/// What an update's passes computed: the micro-batches' losses (summed, in micro-batch order as they
/// complete), the first that was not finite, and the last micro-batch's outputs.
struct Results<'o> {
    losses: f64,
    bad_loss: Option<f32>,
    /// The micro-batches whose loss is counted.
    noted: Vec<u64>,
    outputs: &'o mut Vec<(optimus_plan::BufferId, Tensor)>,
}

impl Results<'_> {
    /// Takes micro-batch `micro_batch`'s loss and (for the last) outputs once they are computed: after
    /// its forward pass, or after its backward pass where the plan sums the loss over the mesh late.
    fn note<C: Communicator>(
        &mut self,
        device: &mut Device<'_, CpuBackend, C>,
        micro_batch: u64,
        last: bool,
    ) -> Result<(), String> {
        if self.noted.contains(&micro_batch) {
            return Ok(());
        }
        let Some(loss) = device.loss_value()? else { return Ok(()) };
        if !loss.is_finite() {
            self.bad_loss.get_or_insert(loss);
        }
        self.losses += f64::from(loss);
        self.noted.push(micro_batch);
        if last {
            self.outputs.extend(device.computed_outputs()?);
        }
        Ok(())
    }
}

/// An update's loss on the stage that computes it (the micro-batches' mean), and the first
/// micro-batch loss that was not finite.
#[derive(Clone, Copy)]
struct Losses {
    mean: Option<f32>,
    bad: Option<f32>,
}

/// What every stage learns with the gradient norm: the update's loss, and whether to stop after it.
#[derive(Clone, Copy)]
struct Shared {
    loss: Option<f32>,
    stop: bool,
}

/// Where a pass is: its step and micro-batch.
#[derive(Clone, Copy)]
struct At {
    step: u64,
    micro_batch: u64,
}

impl StageWorker<'_> {
    /// Runs every step of the device's stage program.
    pub(crate) fn run<C: Communicator>(&self, comm: C) -> Result<StageResult, String> {
        let plan = &self.stage.plan;
        let config = self.config;
        let given = |p: &optimus_plan::PlanParam| self.initial.contains_key(&p.name) || config.weights.is_some();
        let mut device = Device::with_parameters(plan, CpuBackend, comm, config.seed, &|p| !given(p))?;
        device.profile = config.profile.then(|| Profile::of_stage(plan, device.coords(), self.stage.stage));
        self.load_parameters(&mut device)?;
        let mut memory = StageMemory { storage_bytes: device.storage_bytes(), ..StageMemory::default() };
        let (mut records, mut outputs) = (Vec::new(), Vec::new());
        for step in config.start_step..config.steps {
            let (mut record, stop) =
                self.update(&mut device, step, &mut memory, &mut outputs).map_err(|e| format!("step {step}: {e}"))?;
            if let Some(evaluation) = config.evaluation.as_ref().filter(|e| (step + 1) % e.every.max(1) == 0) {
                record.val_loss = self
                    .validate(&mut device, evaluation, step)
                    .map_err(|e| format!("validation after step {step}: {e}"))?;
            }
            if let Some(profile) = device.profile.as_mut() {
                let warm_up = step == config.start_step && config.steps > config.start_step + 1;
                profile.finish_step(record.elapsed, warm_up);
            }
            if let Some(checkpoints) = &config.checkpoints {
                let due = checkpoints.every.is_some_and(|c| (step + 1) % c.max(1) == 0);
                if due || stop || step + 1 == config.steps {
                    record.checkpoint = self
                        .checkpoint(&mut device, checkpoints, step + 1)
                        .map_err(|e| format!("checkpoint after step {step}: {e}"))?;
                }
            }
            if self.stage.stage == 0 && device.coords().is_origin() {
                (self.on_step)(&record);
            }
            records.push(record);
            if stop {
                break;
            }
        }
        let profile = device.profile.take();
        let blocks = if config.final_state { device.into_blocks(outputs)? } else { Default::default() };
        Ok(StageResult { records, blocks, memory, profile })
    }

    /// The checkpoint resumed (this stage's parameters and optimizer states of it), the parameters
    /// given whole or by `--weights`, and the clipping.
    fn load_parameters<C: Communicator>(&self, device: &mut Device<'_, CpuBackend, C>) -> Result<(), String> {
        device.clip_grad_norm = self.config.clip_grad_norm;
        if let Some(checkpoint) = &self.config.resume {
            device.load_stage_checkpoint(checkpoint.as_ref(), self.whole, &self.stage.params)?;
        }
        super::exec::write_given_parameters(device, self.initial, self.config.weights.as_deref())
    }

    /// Checkpoint `done` (the updates done) of the whole model: every stage sends the parameters it is
    /// the first to hold (with their optimizer states) to the device at its grid coordinates in the
    /// first stage, whose devices write the checkpoint the unpipelined plan would. Returns its path on
    /// the first stage's first device.
    fn checkpoint<C: Communicator>(
        &self,
        device: &mut Device<'_, CpuBackend, C>,
        checkpoints: &super::exec::Checkpointing,
        done: u64,
    ) -> Result<Option<std::path::PathBuf>, String> {
        let program = self.pipe.program;
        let me = self.stage.stage;
        let first_holder = |k: usize| program.first_holder(k).map(|(s, _)| s as u64);
        let at = At { step: done, micro_batch: CHECKPOINT };
        if me != 0 {
            for (j, &k) in self.stage.params.iter().enumerate() {
                if first_holder(k) != Some(me) {
                    continue;
                }
                let p = &device.plan.params[j];
                let ids: Vec<_> = std::iter::once(p.buffer).chain(p.state.iter().copied()).collect();
                let tensors = device.checkpoint_tensors(&[j])?;
                for (id, tensor) in ids.iter().zip(tensors.into_iter().flat_map(|(p, s)| std::iter::once(p).chain(s))) {
                    self.mail.send(self.key(me, 0, at, id.0), tensor)?;
                }
            }
            return Ok(None);
        }
        let whole = self.whole;
        let mut tensors = Vec::with_capacity(whole.params.len());
        for (k, p) in whole.params.iter().enumerate() {
            if let Some(j) = self.stage.params.iter().position(|&q| q == k) {
                tensors.extend(device.checkpoint_tensors(&[j])?);
                continue;
            }
            let from = first_holder(k).ok_or_else(|| format!("no stage holds the parameter `{}`", p.name))?;
            let what = || format!("`{}` for the checkpoint", p.name);
            let param = self.mail.receive(self.key(from, 0, at, p.buffer.0), &what)?;
            let states = p
                .state
                .iter()
                .map(|id| self.mail.receive(self.key(from, 0, at, id.0), &what))
                .collect::<Result<_, _>>()?;
            tensors.push((param, states));
        }
        let micro_batches = self.config.accumulation.max(1);
        Ok(device.commit_checkpoint(checkpoints, (whole, done, micro_batches), &tensors)?)
    }

    /// One update: the schedule's passes over the micro-batches, then the update itself. Returns its
    /// record and whether the run was asked to stop (agreed by every device of every stage).
    fn update<C: Communicator>(
        &self,
        device: &mut Device<'_, CpuBackend, C>,
        step: u64,
        memory: &mut StageMemory,
        outputs: &mut Vec<(optimus_plan::BufferId, Tensor)>,
    ) -> Result<(StepRecord, bool), String> {
        let started = Instant::now();
        let config = self.config;
        let optimizer = config.optimizer_at(step);
        let m = config.accumulation.max(1);
        let stages = self.pipe.program.stages.len() as u64;
        let order = stage_order(self.pipe.schedule, stages, m, self.stage.stage).map_err(|e| e.to_string())?;
        let last_chunk = self.pipe.program.chunks.saturating_sub(1);
        device.begin_update();
        let mut results = Results { losses: 0.0, bad_loss: None, noted: Vec::new(), outputs };
        results.outputs.clear();
        let mut kept: HashMap<(u64, u64), super::exec::Stash> = HashMap::new();
        let mut kept_bytes = 0u64;
        for op in order {
            let at = At { step, micro_batch: op.micro_batch };
            let index = step * m + op.micro_batch;
            let mode = match (m, op.micro_batch + 1 == m) {
                (1, _) => Update::Apply(&optimizer, step + 1),
                (_, false) => Update::Accumulate,
                (n, true) => Update::ApplyMean(&optimizer, step + 1, n),
            };
            let chunk = op.chunk as usize;
            match op.pass {
                Pass::Forward => {
                    if !device.plan.inputs.is_empty() {
                        // The caller names the step.
                        let batch = (self.batches)(index).map_err(|e| format!("batch {index}: {e}"))?;
                        device.load_inputs(&batch)?;
                    }
                    device.begin_pass(index + 1);
                    self.run_actions(device, &self.stage.forward[chunk], at, mode)?;
                    if op.chunk == last_chunk {
                        results.note(device, op.micro_batch, op.micro_batch + 1 == m)?;
                    }
                    let stash = device.profiled(KEPT_OUT, Category::Host, |d| d.stash())?;
                    kept_bytes += stash.bytes;
                    memory.peak_kept_bytes = memory.peak_kept_bytes.max(kept_bytes);
                    kept.insert((op.chunk, op.micro_batch), stash);
                    memory.peak_in_flight = memory.peak_in_flight.max(kept.len() as u64);
                }
                Pass::Backward => {
                    let stash = kept.remove(&(op.chunk, op.micro_batch)).ok_or("a backward pass before its forward")?;
                    kept_bytes -= stash.bytes;
                    device.profiled(KEPT_BACK, Category::Host, |d| d.restore(stash))?;
                    device.begin_pass(index + 1);
                    self.run_actions(device, &self.stage.backward[chunk], at, mode)?;
                    if op.chunk == last_chunk {
                        results.note(device, op.micro_batch, op.micro_batch + 1 == m)?;
                    }
                    device.profiled(GRADIENT_SUMS, Category::Host, |d| d.add_gradients(&self.stage.gradients))?;
                    memory.gradient_sum_bytes = memory.gradient_sum_bytes.max(device.gradient_sum_bytes());
                }
            }
        }
        if self.stage.computes_loss && results.noted.len() as u64 != m {
            return Err("the loss was not computed for every micro-batch".into());
        }
        let mine = Losses {
            mean: self.stage.computes_loss.then(|| (results.losses / m as f64) as f32),
            bad: results.bad_loss,
        };
        let shared = self.apply(device, step, &optimizer, mine)?;
        let record = StepRecord {
            step,
            loss: shared.loss,
            elapsed: started.elapsed(),
            lr: optimizer.lr,
            val_loss: None,
            grad_norm: device.grad_norm(),
            checkpoint: None,
        };
        Ok((record, shared.stop))
    }

    /// The update after the micro-batches: mean gradients, tied gradients to the stages holding a copy,
    /// the gradient norm over the stages, the optimizer steps. A non-finite loss on the loss stage stops
    /// every stage here, before any weight changes. Returns what every stage learns with the norm.
    fn apply<C: Communicator>(
        &self,
        device: &mut Device<'_, CpuBackend, C>,
        step: u64,
        optimizer: &OptimizerSettings,
        losses: Losses,
    ) -> Result<Shared, String> {
        let m = self.config.accumulation.max(1);
        device.write_mean_gradients(&self.stage.gradients, m)?;
        let at = At { step, micro_batch: UPDATE };
        for &(buffer, to) in &self.stage.gradient_sends {
            let block = device.read(buffer)?.ok_or("a summed gradient to send is not alive")?;
            self.mail.send(self.key(self.stage.stage, to, at, buffer.0), block)?;
        }
        let mut shared = None;
        for &action in &self.stage.update {
            if let Action::Run(k) = action
                && shared.is_none()
                && device.is_optimizer_step(k)
            {
                shared = Some(self.total_norm(device, step, losses)?);
            }
            self.run_action(device, action, at, Update::Apply(optimizer, step + 1))?;
        }
        match shared {
            Some(shared) => Ok(shared),
            None => self.total_norm(device, step, losses),
        }
    }

    /// The validation loss after step `step`: every stage runs its forward passes of each validation
    /// batch (dropout off), batch by batch and chunk by chunk, with the activations going from stage to
    /// stage as in training; the stage that computes the loss averages it over the batches and sends it
    /// to the first stage, whose devices return it (the others `None`).
    fn validate<C: Communicator>(
        &self,
        device: &mut Device<'_, CpuBackend, C>,
        evaluation: &super::exec::Evaluation,
        step: u64,
    ) -> Result<Option<f32>, String> {
        let me = self.stage.stage;
        let mut total = 0.0f64;
        for v in 0..evaluation.batches {
            let at = At { step: VALIDATION + step, micro_batch: v };
            if !device.plan.inputs.is_empty() {
                device.load_inputs(&(evaluation.data)(v).map_err(|e| e.to_string())?)?;
            }
            for (c, chunk) in self.stage.forward.iter().enumerate() {
                for &action in chunk {
                    match action {
                        Action::Run(k) => device
                            .run_validation_instruction(k)
                            .map_err(|e| super::exec::in_instruction(device.plan, k, &e.to_string()))?,
                        other => self.run_action(device, other, at, Update::Accumulate)?,
                    }
                }
                if self.stage.computes_loss && c + 1 == self.stage.forward.len() {
                    // The loss's sum over the grid may sit among the backward pass's instructions.
                    let later: Vec<usize> = self
                        .stage
                        .backward
                        .get(c)
                        .into_iter()
                        .flatten()
                        .filter_map(|action| match action {
                            Action::Run(k) => Some(*k),
                            _ => None,
                        })
                        .collect();
                    for k in device.loss_completion(&later) {
                        device
                            .run_validation_instruction(k)
                            .map_err(|e| super::exec::in_instruction(device.plan, k, &e.to_string()))?;
                    }
                    total += f64::from(device.loss_value()?.ok_or("the validation loss was not computed")?);
                }
                // As in training, a chunk's buffers die before the next chunk's pass (they share storage).
                device.end_validation_pass()?;
            }
        }
        let loss_stage = self.pipe.program.stages.iter().position(|s| s.computes_loss).unwrap_or(0) as u64;
        let at = At { step: VALIDATION + step, micro_batch: NORM };
        let mean = (total / evaluation.batches.max(1) as f64) as f32;
        if me == loss_stage && me != 0 {
            self.mail.send(self.key(me, 0, at, 0), Tensor::from_f32(&[1], vec![mean]))?;
        }
        match me {
            0 if loss_stage == 0 => Ok(Some(mean)),
            0 => {
                let block = self.mail.receive(self.key(loss_stage, 0, at, 0), &|| "the validation loss".to_string())?;
                Ok(block.f32().map_err(|e| e.to_string())?.first().copied())
            }
            _ => Ok(None),
        }
    }

    /// Sums the stages' shares of the squared gradient norm (in stage order, the same sum on every
    /// stage), learns whether any stage's loss was not finite, the update's loss from the stage that
    /// computes it, and whether any device was asked to stop (each stage's devices agree first).
    fn total_norm<C: Communicator>(
        &self,
        device: &mut Device<'_, CpuBackend, C>,
        step: u64,
        losses: Losses,
    ) -> Result<Shared, String> {
        let stages = self.pipe.program.stages.len() as u64;
        let me = self.stage.stage;
        let mean = losses.mean.unwrap_or(f32::NAN);
        let stop_asked = match self.config.stop {
            Some(asked) => device.any_device(asked()).map_err(|e| e.to_string())?,
            None => false,
        };
        let share = Tensor::from_f32(
            &[4],
            vec![device.norm_share()?, losses.bad.unwrap_or(0.0), mean, if stop_asked { 1.0 } else { 0.0 }],
        );
        let at = At { step, micro_batch: NORM };
        for to in (0..stages).filter(|&t| t != me) {
            self.mail.send(self.key(me, to, at, 0), share.clone())?;
        }
        let (mut squares, mut bad, mut loss, mut stop) = (0.0f32, None, None, false);
        for from in 0..stages {
            let block = if from == me {
                share.clone()
            } else {
                self.mail.receive(self.key(from, me, at, 0), &|| "the gradient norm's share".to_string())?
            };
            let values = block.f32().map_err(|e| e.to_string())?;
            squares += values.first().copied().unwrap_or(0.0);
            if let Some(&value) = values.get(1).filter(|v| **v != 0.0) {
                bad.get_or_insert(value);
            }
            if self.pipe.program.stages.get(from as usize).is_some_and(|s| s.computes_loss) {
                loss = values.get(2).copied();
            }
            stop |= values.get(3).is_some_and(|&v| v != 0.0);
        }
        if let Some(value) = bad {
            return Err(format!(
                "the loss is {value}, so the run stops before updating any weight (none are saved); run without \
                 --pipeline to find the first tensor that holds a NaN or an infinity"
            ));
        }
        device.set_norm(squares)?;
        Ok(Shared { loss, stop })
    }

    fn key(&self, from: u64, to: u64, at: At, buffer: u32) -> Key {
        Key { from, to, rank: self.rank, step: at.step, micro_batch: at.micro_batch, buffer }
    }

    fn run_actions<C: Communicator>(
        &self,
        device: &mut Device<'_, CpuBackend, C>,
        actions: &[Action],
        at: At,
        mode: Update<'_>,
    ) -> Result<(), String> {
        for &action in actions {
            self.run_action(device, action, at, mode)?;
        }
        Ok(())
    }

    fn run_action<C: Communicator>(
        &self,
        device: &mut Device<'_, CpuBackend, C>,
        action: Action,
        at: At,
        mode: Update<'_>,
    ) -> Result<(), String> {
        let me = self.stage.stage;
        match action {
            Action::Run(k) => {
                let plan = device.plan;
                device.run_instruction(k, mode).map_err(|e| super::exec::in_instruction(plan, k, &e.to_string()))
            }
            Action::Receive { buffer, from } => device.profiled(RECEIVE, Category::Communication, |device| {
                let plan = device.plan;
                let block = self
                    .mail
                    .receive(self.key(from, me, at, buffer.0), &|| format!("`{}`", plan.buffer(buffer).name))?;
                device.write(buffer, block).map_err(|e| e.to_string())
            }),
            Action::Send { buffer, to } => device.profiled(SEND, Category::Communication, |device| {
                let plan = device.plan;
                let block = device
                    .read(buffer)?
                    .ok_or_else(|| format!("`{}` is not alive when stage {me} sends it", plan.buffer(buffer).name))?;
                self.mail.send(self.key(me, to, at, buffer.0), block)
            }),
        }
    }
}
