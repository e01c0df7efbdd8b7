//! A pipeline simulated from the plan of one stage's grid: the whole model compiled for one stage's
//! mesh (its data-parallel replicas included) is cut into pieces (what runs before the first repeated
//! layer, each repeated layer, what runs after the last), the pieces are grouped into contiguous stages
//! balanced by their simulated time, and the schedule is timed over the stages with the point-to-point
//! transfers between them ([`crate::pipeline::time_schedule`]).
//!
//! Every figure is read off the plan: each instruction's share of the simulated step (its kernel, or
//! the exposed part of its collective), the bytes of the activations that cross each cut, the
//! parameters, gradients and optimizer state each stage holds, and the activations each piece keeps
//! for its backward pass, times the micro-batches the schedule keeps alive on that stage.
//!
//! An update is the schedule's forwards and backwards of every micro-batch, then on each stage the
//! sums of its gradients over the data-parallel replicas, the gradient norm and the optimizer steps of
//! its parameters (after the pipeline drains, as Megatron-LM does), and the sum of a tied parameter's
//! gradient between the stages that hold a copy (GPT-2's embedding and LM head).

use crate::calibration::HostCopies;
use crate::hardware::Hardware;
use crate::pipeline::{
    SharedCores, StageCost, TimedPass, Timeline, TimelineError, time_schedule, time_shared_schedule,
};
use crate::step::{InstrCost, Options, Simulation, accumulate, device_peak_flops, optimizer_seconds, simulate_costed};
use optimus_plan::memory::for_each_touched;
use optimus_plan::phases::{Phase, StepPhases};
use optimus_plan::pipeline::Schedule;
use optimus_plan::pipeline_cut::{self, StageMemoryPlan};
pub use optimus_plan::stages::layer_of;
use optimus_plan::stages::{InstructionPieces, ParameterOwners, describe_pieces, instruction_pieces, ranges_of_starts};
use optimus_plan::{BufferId, Instr, Mode, Plan, Role};
use serde::Serialize;
use std::collections::{BTreeSet, HashMap};
use std::ops::Add;

/// A pipeline: stages, schedule and the micro-batches of an update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pipeline {
    pub stages: u64,
    pub schedule: Schedule,
    pub micro_batches: u64,
}

/// Why a plan cannot be simulated as a pipeline.
#[derive(Clone, Debug, PartialEq)]
pub enum PipelineError {
    /// Pipelines are simulated for training plans.
    NotTraining,
    /// Every virtual stage needs a repeated layer of its own.
    TooFewLayers {
        layers: usize,
        virtual_stages: u64,
    },
    Timeline(TimelineError),
    /// A split of the layers with another number of runs than virtual stages.
    SplitMismatch {
        given: usize,
        virtual_stages: u64,
    },
    /// The plan could not be cut into the stage programs whose memory a CPU stage holds.
    Cut(String),
}

impl std::fmt::Display for PipelineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PipelineError::NotTraining => write!(f, "a pipeline is simulated for training plans (`--mode train`)"),
            PipelineError::TooFewLayers { layers, virtual_stages } => {
                let (layers, virtual_stages) = (*layers, *virtual_stages);
                write!(f, "{}", optimus_plan::pipeline_cut::CutError::TooFewLayers { layers, virtual_stages })
            }
            PipelineError::Timeline(e) => write!(f, "{e}"),
            PipelineError::SplitMismatch { given, virtual_stages } => {
                write!(f, "a split into {given} runs of layers for {virtual_stages} virtual stages")
            }
            PipelineError::Cut(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for PipelineError {}

/// One stage of a simulated pipeline.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StageReport {
    pub stage: u64,
    /// The repeated layers it holds, per chunk (`h.0..11`), the first stage with what runs before
    /// them and the last with what runs after.
    pub layers: Vec<String>,
    /// One micro-batch's forward and backward through all its chunks.
    pub forward_s: f64,
    pub backward_s: f64,
    /// The exposed communication inside `forward_s + backward_s` (the rest is kernels).
    pub communication_s: f64,
    /// After the last micro-batch: its gradients summed over the replicas, the gradient norm and the
    /// optimizer steps of its parameters.
    pub update_s: f64,
    /// The gradient sums over the replicas in `update_s`.
    pub sums_s: f64,
    /// Elements of the parameters it holds (a tied parameter counts on each stage that holds it).
    pub parameters: u64,
    /// Their blocks, gradients and optimizer state, per device.
    pub held_bytes: u64,
    /// Micro-batch chunks of activations it keeps at most (the schedule's), and their bytes each (the
    /// largest chunk's).
    pub in_flight: u64,
    pub kept_bytes_per_micro_batch: u64,
    /// What a device of the stage holds at most. In place (an accelerator's profile): parameters,
    /// gradients, optimizer state and inputs, plus `in_flight` times the kept activations, plus the
    /// plan's largest workspace. On our CPU runtime's profile: `program_memory`'s peak.
    pub peak_bytes: u64,
    /// On a profile of our CPU runtime (`calibrate` on threads or under MPI), the stage program's own
    /// memory plan under the schedule, the figure `run --pipeline` measures: its arena, its gradient
    /// sums over the micro-batches and the host copies of the activations in flight. `None` elsewhere.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub program_memory: Option<StageMemoryPlan>,
}

/// A simulated pipeline update.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PipelineSimulation {
    pub stages: u64,
    pub schedule: String,
    pub virtual_stages: u64,
    pub micro_batches: u64,
    /// Devices of one stage (its grid and replicas) and of the whole pipeline.
    pub stage_devices: u64,
    pub devices: u64,
    pub per_stage: Vec<StageReport>,
    /// What each device sends to its peer in the next stage per micro-batch (the activations' block;
    /// their gradients come back the same size), and the time of one transfer.
    pub p2p_bytes: u64,
    pub p2p_s: f64,
    /// The sum of tied parameters' gradients between the stages that hold a copy, once per update.
    pub tied_sync_s: f64,
    /// The schedule's forwards and backwards, from the first forward to the last backward.
    pub pipeline_s: f64,
    pub bubble_fraction: f64,
    /// The busiest stage's idle share of `pipeline_s` (see [`Timeline::bottleneck_bubble_fraction`]).
    pub bottleneck_bubble_fraction: f64,
    /// The whole update: `pipeline_s`, then the slowest stage's update, then the tied sums.
    pub step_time_s: f64,
    /// The update of the busiest stage (the most work), split: its kernels, its exposed communication
    /// (with its gradient sums over the replicas, `data_parallel_s`, and the tied sums), and the rest of
    /// the update, in which it waits (the bubble and the transfers).
    pub compute_s: f64,
    pub exposed_communication_s: f64,
    pub data_parallel_s: f64,
    pub bubble_s: f64,
    pub tokens_per_step: u64,
    pub tokens_per_second: f64,
    pub mfu: f64,
    pub peak_bytes_per_device: u64,
    pub capacity_bytes: u64,
    pub fits: bool,
    /// One micro step of the whole model on one stage's grid, as `simulate` gives it without a pipeline.
    pub unpipelined: Simulation,
    /// Each stage's passes placed in time (`simulate --timeline` draws them).
    #[serde(skip)]
    pub passes: Vec<Vec<TimedPass>>,
}

/// The plan cut into pieces (0: before the first repeated layer; 1..=L: the layers; L + 1: after the
/// last), with what each costs and holds per micro-batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Pieces {
    /// The repeated layers' names (`h.3`), in forward order.
    pub layers: Vec<String>,
    pub forward_s: Vec<f64>,
    pub backward_s: Vec<f64>,
    /// The part of `forward_s + backward_s` that is exposed communication (the rest is kernels).
    pub communication_s: Vec<f64>,
    /// Activation bytes each piece keeps for its backward pass.
    pub kept_bytes: Vec<u64>,
    /// Bytes (per device) that a cut after piece c sends forward: activations written at or before it
    /// and read after it.
    pub crossing_bytes: Vec<u64>,
    pub params: Vec<ParamShare>,
    /// Update work tied to no parameter (the gradient norm's sum over the mesh): on every stage.
    pub shared_update_s: f64,
    pub input_bytes: u64,
    pub workspace_bytes: u64,
    /// The optimizer steps' kernels, as the planner costs them.
    pub optimizer_s: f64,
    /// Devices of one stage (the plan's mesh with its replicas), and the FLOP/s each device's model
    /// FLOP utilisation is measured against.
    pub stage_devices: u64,
    pub device_peak_flops: f64,
    /// Where every stage's devices share one calibrated engine (threads of one process on a CPU): the
    /// devices the costs above were made for and the kernels the engine runs at once.
    pub shared_engine: Option<SharedEngine>,
    /// Whether the gradients are summed over data-parallel replicas: with several micro-batches the
    /// runtime keeps each device's own terms on the host until the update's last micro-batch.
    pub data_parallel: bool,
}

/// A calibrated engine that a pipeline's stages share: `devices` device threads running `lanes`
/// kernels at once. Costs made for it are the engine's seconds for every one of the devices running
/// the instruction; one device's work is `seconds * lanes / devices` core-seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SharedEngine {
    pub devices: u64,
    pub lanes: u64,
}

impl SharedEngine {
    /// Core-seconds of a stage of `stage_devices` devices for what costs `seconds` on the engine.
    fn core_seconds(self, seconds: f64, stage_devices: u64) -> f64 {
        seconds * (self.lanes * stage_devices) as f64 / self.devices.max(1) as f64
    }
}

impl Pieces {
    /// The pieces with every time as its stage takes it alone on `engine` (its devices' core-seconds
    /// over the cores they can use), from the engine's seconds for all its devices.
    fn alone_on(&self, engine: SharedEngine) -> Pieces {
        let width = self.stage_devices.min(engine.lanes).max(1) as f64;
        let factor = engine.core_seconds(1.0, self.stage_devices) / width;
        let scale = |values: &[f64]| values.iter().map(|t| t * factor).collect();
        Pieces {
            forward_s: scale(&self.forward_s),
            backward_s: scale(&self.backward_s),
            communication_s: scale(&self.communication_s),
            params: self
                .params
                .iter()
                .map(|p| ParamShare { update_s: p.update_s * factor, sums_s: p.sums_s * factor, ..p.clone() })
                .collect(),
            shared_update_s: self.shared_update_s * factor,
            optimizer_s: self.optimizer_s * factor,
            ..self.clone()
        }
    }
}

/// The passes and the updates of a pipeline whose stages share one engine: the passes timed with the
/// stages' device threads sharing its cores ([`time_shared_schedule`]), and every stage's update at
/// once, their work over the cores all the devices can use. `costs` are seconds alone.
fn shared_engine_step(
    engine: SharedEngine,
    stage_devices: u64,
    (pipeline, costs, p2p_s): (Pipeline, &[StageCost], f64),
    per_stage: &[StageReport],
) -> Result<(f64, f64), PipelineError> {
    let width = stage_devices.min(engine.lanes).max(1) as f64;
    let core = |times: &[f64]| times.iter().map(|t| t * width).collect();
    let work: Vec<StageCost> =
        costs.iter().map(|c| StageCost { forward_s: core(&c.forward_s), backward_s: core(&c.backward_s) }).collect();
    let cores = SharedCores { stage_devices, cores: engine.lanes };
    let passes = time_shared_schedule(pipeline.schedule, pipeline.micro_batches, &work, p2p_s, cores)
        .map_err(PipelineError::Timeline)?;
    let all = (pipeline.stages * stage_devices).min(engine.lanes).max(1) as f64;
    Ok((passes, per_stage.iter().map(|s| s.update_s).sum::<f64>() * width / all))
}

/// One parameter: the pieces that read it, and what it costs and holds.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamShare {
    pub pieces: BTreeSet<usize>,
    pub elements: u64,
    /// Its block, gradient and optimizer state, per device.
    pub bytes: u64,
    pub gradient_bytes: u64,
    /// Its gradient sums over the replicas, its share of the gradient norm and its optimizer step.
    pub update_s: f64,
    /// The part of `update_s` that is its gradient sums over the replicas.
    pub sums_s: f64,
}

/// Cuts a plan into pieces, with each instruction's share of the simulated step (`costs`, one per
/// instruction).
pub fn pieces(plan: &Plan, hw: &Hardware, costs: &[InstrCost]) -> Pieces {
    let phases = StepPhases::of(plan);
    let cut = instruction_pieces(plan);
    let (forward_end, updates_begin, tail) = (cut.forward_end, cut.updates_begin, cut.tail());
    let InstructionPieces { layers, piece_of, .. } = cut;
    let layer_index: HashMap<String, usize> = layers.iter().enumerate().map(|(k, l)| (l.clone(), k)).collect();
    let n = tail + 1;
    let owner = ParameterOwners::of_plan(plan, forward_end);
    let mut out = Pieces {
        layers,
        forward_s: vec![0.0; n],
        backward_s: vec![0.0; n],
        communication_s: vec![0.0; n],
        kept_bytes: vec![0; n],
        crossing_bytes: vec![0; n],
        params: plan
            .params
            .iter()
            .map(|p| ParamShare {
                pieces: BTreeSet::new(),
                elements: p.shape.iter().product(),
                bytes: plan.buffer(p.buffer).bytes() + p.state.iter().map(|&s| plan.buffer(s).bytes()).sum::<u64>(),
                gradient_bytes: p.grad.map_or(0, |g| plan.buffer(g).bytes()),
                update_s: 0.0,
                sums_s: 0.0,
            })
            .collect(),
        shared_update_s: 0.0,
        input_bytes: plan.memory.inputs,
        workspace_bytes: plan.memory.workspace_peak,
        optimizer_s: optimizer_seconds(plan, hw),
        stage_devices: plan.mesh.devices(),
        device_peak_flops: device_peak_flops(plan, hw),
        shared_engine: None,
        data_parallel: plan.mesh.data > 1,
    };
    let gradient_sums = gradient_sum_receivers(plan, &phases);
    let mut first_piece: Vec<Option<usize>> = vec![None; plan.buffers.len()];
    let mut last_forward_piece: Vec<usize> = vec![0; plan.buffers.len()];
    let mut kept = vec![false; plan.buffers.len()];
    let from_inputs = input_dependent(plan, forward_end);
    for (i, instr) in plan.program.iter().enumerate() {
        let (piece, cost) = (piece_of[i], costs.get(i).copied().unwrap_or_default());
        let real = matches!(instr, Instr::Kernel { .. } | Instr::Collective { .. });
        let communicates = matches!(instr, Instr::Collective { .. } | Instr::Wait { .. });
        if i < forward_end {
            out.forward_s[piece] += cost.step_s;
            if communicates {
                out.communication_s[piece] += cost.step_s;
            }
            if real {
                for_each_touched(instr, |b| {
                    let k = b.0 as usize;
                    first_piece[k].get_or_insert(piece);
                    last_forward_piece[k] = last_forward_piece[k].max(piece);
                    if let Some(p) = owner.of(b) {
                        out.params[p].pieces.insert(piece);
                    }
                });
            }
        } else {
            if real {
                for_each_touched(instr, |b| kept[b.0 as usize] = true);
            }
            let params = touched_params(instr, &owner);
            let sum = phases.phase(i) == Phase::GradientSum;
            if i >= updates_begin || sum {
                charge_update(&mut out, &params, cost.busy_s, sum);
            } else if !matches!(instr, Instr::Wait { recv, .. } if gradient_sums.contains(recv)) {
                out.backward_s[piece] += cost.step_s;
                if communicates {
                    out.communication_s[piece] += cost.step_s;
                }
            }
        }
    }
    for (k, buffer) in plan.buffers.iter().enumerate() {
        let Some(first) = first_piece[k] else { continue };
        if buffer.role == Role::Activation && kept[k] {
            out.kept_bytes[first] += buffer.bytes();
        }
        if matches!(buffer.role, Role::Activation | Role::Workspace) && from_inputs[k] {
            for cut in first..last_forward_piece[k] {
                out.crossing_bytes[cut] += buffer.bytes();
            }
        }
    }
    home_pieces(plan, &layer_index, &mut out);
    out
}

/// Where each parameter lives: a repeated layer's parameter (`h.3.ln_1.weight`) in that layer's piece,
/// though a fused kernel of the layer before may read it; any other in the first and last pieces that
/// read it (both, for a tied embedding and LM head), or the first piece when none does.
/// `layer_index`: each repeated layer's position in `out.layers`.
fn home_pieces(plan: &Plan, layer_index: &HashMap<String, usize>, out: &mut Pieces) {
    let tail = out.layers.len() + 1;
    for (param, share) in plan.params.iter().zip(&mut out.params) {
        if let Some(&k) = layer_of(&param.name).and_then(|l| layer_index.get(l)) {
            share.pieces = BTreeSet::from([k + 1]);
            continue;
        }
        let ends: BTreeSet<usize> = share.pieces.iter().copied().filter(|&k| k == 0 || k == tail).collect();
        share.pieces = if ends.is_empty() { BTreeSet::from([0]) } else { ends };
    }
}

/// Which buffers the forward pass computes from the model's inputs: only those cross a cut between
/// stages (a stage makes its own copies of what it computes from parameters alone, such as a tied
/// weight's bf16 copy).
fn input_dependent(plan: &Plan, forward_end: usize) -> Vec<bool> {
    let mut depends: Vec<bool> = plan.buffers.iter().map(|b| b.role == Role::Input).collect();
    for instr in &plan.program[..forward_end.min(plan.program.len())] {
        match instr {
            Instr::Kernel { inputs, output, .. } => {
                if inputs.iter().any(|b| depends[b.0 as usize]) {
                    depends[output.0 as usize] = true;
                }
            }
            Instr::Collective { collective, .. } => {
                if depends[collective.send.0 as usize] {
                    depends[collective.recv.0 as usize] = true;
                }
            }
            Instr::Free { .. } | Instr::Wait { .. } => {}
        }
    }
    depends
}

fn touched_params(instr: &Instr, owner: &ParameterOwners) -> Vec<usize> {
    let mut params = Vec::new();
    if matches!(instr, Instr::Kernel { .. } | Instr::Collective { .. }) {
        for_each_touched(instr, |b| {
            if let Some(p) = owner.of(b)
                && !params.contains(&p)
            {
                params.push(p);
            }
        });
    }
    params
}

/// Charges update work to the parameters it touches (split evenly), or to every stage; `sum`: it is a
/// gradient sum over the replicas.
fn charge_update(out: &mut Pieces, params: &[usize], seconds: f64, sum: bool) {
    if params.is_empty() {
        out.shared_update_s += seconds;
        return;
    }
    for &p in params {
        let share = &mut out.params[p];
        share.update_s += seconds / params.len() as f64;
        if sum {
            share.sums_s += seconds / params.len() as f64;
        }
    }
}

/// The receive buffers of the gradient sums over the replicas (their waits are update work).
fn gradient_sum_receivers(plan: &Plan, phases: &StepPhases) -> BTreeSet<BufferId> {
    plan.program
        .iter()
        .enumerate()
        .filter(|(i, _)| phases.phase(*i) == Phase::GradientSum)
        .filter_map(|(_, instr)| match instr {
            Instr::Collective { collective, .. } => Some(collective.recv),
            _ => None,
        })
        .collect()
}

/// Splits `layers` layers into `groups` contiguous non-empty runs minimising the slowest run's time,
/// where run g's time is the sum of `time[1 + layer]` over its layers, plus `time[0]` for the first run
/// and `time[layers + 1]` for the last: the first layer of each run, in order.
pub fn balance(time: &[f64], groups: usize) -> Vec<usize> {
    let layers = time.len().saturating_sub(2);
    if groups == 0 || layers < groups {
        return Vec::new();
    }
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(time[1..=layers].iter().scan(0.0, |sum, &t| {
            *sum += t;
            Some(*sum)
        }))
        .collect();
    let run = |from: usize, to: usize, g: usize| {
        let extra = if g == 0 { time[0] } else { 0.0 } + if g == groups - 1 { time[layers + 1] } else { 0.0 };
        prefix[to] - prefix[from] + extra
    };
    // best[g][j]: the slowest run when the first j layers make g + 1 runs; from[g][j]: where the last starts.
    let mut best = vec![vec![f64::INFINITY; layers + 1]; groups];
    let mut from = vec![vec![0usize; layers + 1]; groups];
    for (j, first_run) in best[0].iter_mut().enumerate().skip(1) {
        *first_run = run(0, j, 0);
    }
    for g in 1..groups {
        for j in (g + 1)..=layers {
            for i in g..j {
                let t = best[g - 1][i].max(run(i, j, g));
                if t < best[g][j] - 1e-15 {
                    best[g][j] = t;
                    from[g][j] = i;
                }
            }
        }
    }
    let mut starts = vec![0usize; groups];
    let mut j = layers;
    for g in (1..groups).rev() {
        starts[g] = from[g][j];
        j = starts[g];
    }
    starts
}

/// Seconds for each device of a stage of `stage_devices` devices to send `bytes` to its peer in the
/// next stage, all at once: over the node's links when both stages share a node, else through the
/// node's NICs, which the node's sending devices share.
pub fn p2p_seconds(bytes: u64, stage_devices: u64, hw: &Hardware) -> f64 {
    if bytes == 0 {
        return 0.0;
    }
    let per_node = hw.intra_node.gpus_per_node.max(1);
    if 2 * stage_devices <= per_node {
        let link = &hw.intra_node;
        return link.latency_us * 1e-6 + bytes as f64 / (link.bandwidth_gb_s * 1e9);
    }
    let net = &hw.inter_node;
    let senders = stage_devices.min(per_node);
    let nics = net.nics_per_node.max(1);
    let usable = net.nic_bandwidth_gb_s * 1e9 * senders.min(nics) as f64 / nics as f64;
    net.latency_us * 1e-6 + bytes as f64 * senders as f64 / usable
}

/// The host copies a CPU pipeline stage makes around its passes (see [`HostCopies`]), in seconds of
/// the stage alone on the engine: every device thread of the stage copies its own blocks, the threads
/// sharing the cores they may use. Nothing where the profile has no such rates or the stages do not
/// share a calibrated engine.
struct StageCopies<'a> {
    rates: Option<(&'a HostCopies, f64)>,
    pieces: &'a Pieces,
}

impl<'a> StageCopies<'a> {
    fn of(hw: &'a Hardware, pieces: &'a Pieces) -> StageCopies<'a> {
        let rates = host_copy_rates(hw, pieces.stage_devices, pieces.shared_engine.map(|e| e.lanes));
        StageCopies { rates, pieces }
    }

    /// Gradient bytes of the parameters a chunk reads (its backward pass writes their gradients).
    fn gradients(&self, chunk: &std::ops::Range<usize>) -> u64 {
        let reads = |share: &&ParamShare| share.pieces.iter().any(|k| chunk.contains(k));
        self.pieces.params.iter().filter(reads).map(|share| share.gradient_bytes).sum()
    }

    /// After a forward pass: the `kept` bytes it keeps copied out.
    fn forward_s(&self, kept: u64) -> f64 {
        self.rates.map_or(0.0, |(h, alone)| alone * h.stash_s(kept))
    }

    /// Around a backward pass: the `kept` activations copied back, the gradients added into the sums
    /// (and, with replicas, this device's terms of their sums over the replicas kept aside).
    fn backward_s(&self, chunk: &std::ops::Range<usize>, kept: u64) -> f64 {
        self.rates.map_or(0.0, |(h, alone)| {
            let gradients = self.gradients(chunk);
            let deferred = if self.pieces.data_parallel { h.deferred_sum_s(gradients) } else { 0.0 };
            alone * (h.restore_s(kept) + h.gradient_sum_s(gradients) + deferred)
        })
    }

    /// At the update: the gradients' means written back.
    fn means_s(&self, gradient_bytes: u64) -> f64 {
        self.rates.map_or(0.0, |(h, alone)| alone * h.restore_s(gradient_bytes))
    }
}

/// The profile's host copy rates, with the factor from one device thread's seconds to its stage's
/// seconds alone on a shared engine of `lanes` (its `devices` threads over at most that many cores).
fn host_copy_rates(hw: &Hardware, devices: u64, lanes: Option<u64>) -> Option<(&HostCopies, f64)> {
    let measured = hw.measured.as_ref()?;
    let rates = measured.host_copies.as_ref()?;
    // One device alone does not share the engine, but its thread still makes the copies.
    let lanes = lanes.or_else(|| (measured.shared_engine && devices == 1).then_some(1))?;
    Some((rates, devices as f64 / devices.min(lanes).max(1) as f64))
}

/// The host sums of an unpipelined run of `micro_batches` on a shared engine: every gradient added
/// per micro-batch and its mean written back (see [`HostCopies::accumulation_s`]).
fn accumulation_copies_s(hw: &Hardware, pieces: &Pieces, micro_batches: u64) -> f64 {
    let devices = pieces.stage_devices;
    let Some((h, alone)) = host_copy_rates(hw, devices, crate::step::shared_engine_lanes(devices, hw)) else {
        return 0.0;
    };
    let gradients: u64 = pieces.params.iter().map(|share| share.gradient_bytes).sum();
    let deferred = if pieces.data_parallel && micro_batches > 1 {
        micro_batches as f64 * h.deferred_sum_s(gradients)
    } else {
        0.0
    };
    alone * (h.accumulation_s(gradients, micro_batches) + deferred)
}

/// Simulates `pipeline` over `plan`, the whole model compiled for one stage's grid at one micro-batch.
pub fn simulate_pipeline(
    plan: &Plan,
    hw: &Hardware,
    options: &Options,
    pipeline: Pipeline,
) -> Result<PipelineSimulation, PipelineError> {
    simulate_pipeline_split(plan, hw, options, pipeline, None)
}

/// [`simulate_pipeline`] with the repeated layers of each virtual stage given (`chunk * stages +
/// stage`, as [`balanced_split`] gives them) instead of balanced by the simulated time.
pub fn simulate_pipeline_split(
    plan: &Plan,
    hw: &Hardware,
    options: &Options,
    pipeline: Pipeline,
    split: Option<&[std::ops::Range<usize>]>,
) -> Result<PipelineSimulation, PipelineError> {
    if plan.mode != Mode::Train {
        return Err(PipelineError::NotTraining);
    }
    let (cut, simulated) = costed_pieces(plan, hw, options, pipeline.stages);
    // Costed for a shared engine, the simulation is of every stage's devices on it: the unpipelined
    // run has the plan's alone.
    let unpipelined = match cut.shared_engine {
        Some(_) => simulate_costed(plan, hw, options).0,
        None => simulated,
    };
    let runtime = stages_hold_host_copies(hw).then_some(plan);
    pipeline_of_split_pieces(hw, (&cut, runtime), unpipelined, pipeline, split)
}

/// Whether `hw` is a profile of our CPU runtime (`calibrate` on threads or under MPI), whose pipeline
/// stages keep host copies of what forward passes keep beside their program's arena: a stage's memory
/// is then its program's memory plan (what `run --pipeline` measures), where an accelerator keeping
/// activations in place holds less.
pub fn stages_hold_host_copies(hw: &Hardware) -> bool {
    hw.measured.as_ref().is_some_and(|m| matches!(m.runtime.as_str(), "cpu" | "mpi"))
}

/// What the stage programs of `plan` cut into `groups` (virtual stage `chunk * stages + stage`) hold
/// under `pipeline`: each stage's memory plan, and the bytes each of its chunks keeps a micro-batch.
fn program_memory(
    plan: &Plan,
    pipeline: Pipeline,
    groups: &[std::ops::Range<usize>],
) -> Result<(Vec<StageMemoryPlan>, Vec<Vec<u64>>), PipelineError> {
    let chunks = pipeline.schedule.chunks();
    let program = pipeline_cut::cut(plan, pipeline.stages.max(1), chunks, Some(groups))
        .map_err(|e| PipelineError::Cut(e.to_string()))?;
    let memory = program
        .memory_plan(pipeline.schedule, pipeline.micro_batches)
        .map_err(|e| PipelineError::Timeline(TimelineError::Schedule(e)))?;
    let kept = program.stages.iter().map(|stage| (0..chunks as usize).map(|c| stage.kept_bytes(c)).collect()).collect();
    Ok((memory, kept))
}

/// `plan` cut into pieces costed as `stages` stages of its grid run them: on a shared engine (a
/// calibrated CPU), every stage's devices on it. With the simulation the costs came from.
fn costed_pieces(plan: &Plan, hw: &Hardware, options: &Options, stages: u64) -> (Pieces, Simulation) {
    let devices = plan.mesh.devices() * stages.max(1);
    let lanes = crate::step::shared_engine_lanes(devices, hw).filter(|_| stages > 1);
    // On a shared engine the stages' devices all run on it: cost each instruction for that many.
    let engine_devices = lanes.map(|_| devices);
    let (simulated, costs) = simulate_costed(plan, hw, &Options { engine_devices, ..*options });
    let mut cut = pieces(plan, hw, &costs);
    cut.shared_engine = lanes.map(|lanes| SharedEngine { devices, lanes });
    (cut, simulated)
}

/// The repeated layers of each of `stages * virtual_stages` virtual stages (`chunk * stages + stage`)
/// balanced by their simulated time on `hw`, as [`simulate_pipeline`] cuts them: what `run --pipeline`
/// runs without a split of the user's.
pub fn balanced_split(
    plan: &Plan,
    hw: &Hardware,
    options: &Options,
    (stages, virtual_stages): (u64, u64),
) -> Result<Vec<std::ops::Range<usize>>, PipelineError> {
    if plan.mode != Mode::Train {
        return Err(PipelineError::NotTraining);
    }
    let (cut, _) = costed_pieces(plan, hw, options, stages);
    virtual_stage_pieces(&cut, stages.max(1) * virtual_stages.max(1))
}

/// The stages of `pieces`: which pieces each virtual stage holds (`chunk * stages + stage`).
fn virtual_stage_pieces(pieces: &Pieces, virtual_stages: u64) -> Result<Vec<std::ops::Range<usize>>, PipelineError> {
    let layers = pieces.layers.len();
    let time: Vec<f64> = pieces.forward_s.iter().zip(&pieces.backward_s).map(|(f, b)| f + b).collect();
    let starts = balance(&time, virtual_stages as usize);
    if starts.is_empty() {
        return Err(PipelineError::TooFewLayers { layers, virtual_stages });
    }
    Ok(ranges_of_starts(&starts, layers))
}

/// [`simulate_pipeline`] from a plan already cut into pieces, for a profile that is not calibrated: its
/// stages are costed alike at every depth and keep their memory in place. A calibrated profile's
/// pipelines need the plan ([`simulate_pipeline`]): its pieces are costed for every stage's devices on
/// the shared engine, and our CPU runtime's stages hold what their programs plan.
pub fn pipeline_of_pieces(
    hw: &Hardware,
    pieces: &Pieces,
    unpipelined: Simulation,
    pipeline: Pipeline,
) -> Result<PipelineSimulation, PipelineError> {
    pipeline_of_split_pieces(hw, (pieces, None), unpipelined, pipeline, None)
}

/// [`pipeline_of_pieces`] with the virtual stages' pieces given, or balanced where `None`; `runtime`:
/// the plan whose stage programs give each stage's memory, `None` for memory kept in place.
fn pipeline_of_split_pieces(
    hw: &Hardware,
    (pieces, runtime): (&Pieces, Option<&Plan>),
    unpipelined: Simulation,
    pipeline: Pipeline,
    split: Option<&[std::ops::Range<usize>]>,
) -> Result<PipelineSimulation, PipelineError> {
    let alone;
    let pieces = match pieces.shared_engine {
        Some(engine) => {
            alone = pieces.alone_on(engine);
            &alone
        }
        None => pieces,
    };
    let (p, v) = (pipeline.stages.max(1), pipeline.schedule.chunks());
    let groups = match split {
        Some(given) if given.len() as u64 == p * v => given.to_vec(),
        Some(given) => return Err(PipelineError::SplitMismatch { given: given.len(), virtual_stages: p * v }),
        None => virtual_stage_pieces(pieces, p * v)?,
    };
    let stage_of_piece = |piece: usize| groups.iter().position(|r| r.contains(&piece)).unwrap_or(0) as u64 % p;
    let sum = |values: &[f64], range: &std::ops::Range<usize>| values[range.clone()].iter().sum::<f64>();
    // One stage is the plain run accumulating micro-batches (`run --accum`), whose memory is the plan's.
    let runtime = runtime.filter(|_| p * v > 1);
    let programs = runtime.map(|plan| program_memory(plan, pipeline, &groups)).transpose()?;
    // What chunk c of stage s keeps a micro-batch: its stage program's, else its pieces'.
    let kept_of = |s: u64, c: u64| match &programs {
        Some((_, kept)) => kept[s as usize][c as usize],
        None => pieces.kept_bytes[groups[(c * p + s) as usize].clone()].iter().sum(),
    };
    let copies = StageCopies::of(hw, pieces);
    let costs: Vec<StageCost> = (0..p)
        .map(|s| {
            let chunk = |c: u64| &groups[(c * p + s) as usize];
            StageCost {
                forward_s: (0..v).map(|c| sum(&pieces.forward_s, chunk(c)) + copies.forward_s(kept_of(s, c))).collect(),
                backward_s: (0..v)
                    .map(|c| sum(&pieces.backward_s, chunk(c)) + copies.backward_s(chunk(c), kept_of(s, c)))
                    .collect(),
            }
        })
        .collect();
    let stage_devices = pieces.stage_devices;
    let p2p_bytes = groups.iter().take(groups.len() - 1).map(|r| pieces.crossing_bytes[r.end - 1]).max().unwrap_or(0);
    let p2p_s = p2p_seconds(p2p_bytes, stage_devices, hw);
    let timeline: Timeline =
        time_schedule(pipeline.schedule, pipeline.micro_batches, &costs, p2p_s).map_err(PipelineError::Timeline)?;
    let holders: Vec<BTreeSet<u64>> =
        pieces.params.iter().map(|share| share.pieces.iter().map(|&k| stage_of_piece(k)).collect()).collect();
    let per_stage: Vec<StageReport> = (0..p)
        .map(|s| {
            let mine = || pieces.params.iter().zip(&holders).filter(move |(_, h)| h.contains(&s)).map(|(sh, _)| sh);
            let chunks: Vec<&std::ops::Range<usize>> = (0..v).map(|c| &groups[(c * p + s) as usize]).collect();
            let kept = (0..v).map(|c| kept_of(s, c)).max().unwrap_or(0);
            let held: u64 = mine().map(|sh| sh.bytes + sh.gradient_bytes).sum();
            let program_memory = programs.as_ref().map(|(memory, _)| memory[s as usize]);
            let in_flight = timeline.peak_in_flight[s as usize];
            let (in_flight, peak_bytes) = match program_memory {
                Some(m) => (m.in_flight, m.peak_bytes),
                None if p * v == 1 => (in_flight, unpipelined.memory.peak_bytes_per_device),
                None => (in_flight, held + pieces.input_bytes + in_flight * kept + pieces.workspace_bytes),
            };
            StageReport {
                stage: s,
                layers: chunks.iter().map(|r| describe_pieces(&pieces.layers, r)).collect(),
                forward_s: costs[s as usize].forward_s.iter().sum(),
                backward_s: costs[s as usize].backward_s.iter().sum(),
                communication_s: chunks.iter().map(|r| pieces.communication_s[(*r).clone()].iter().sum::<f64>()).sum(),
                update_s: mine().map(|sh| sh.update_s).sum::<f64>()
                    + pieces.shared_update_s
                    + copies.means_s(mine().map(|sh| sh.gradient_bytes).sum()),
                sums_s: mine().map(|sh| sh.sums_s).sum(),
                parameters: mine().map(|sh| sh.elements).sum(),
                held_bytes: held,
                in_flight,
                kept_bytes_per_micro_batch: kept,
                peak_bytes,
                program_memory,
            }
        })
        .collect();
    let tied_sync_s = pieces
        .params
        .iter()
        .zip(&holders)
        .filter(|(_, h)| h.len() > 1)
        .map(|(sh, _)| p2p_seconds(sh.gradient_bytes, stage_devices, hw))
        .fold(0.0, f64::add);
    let slowest_update = per_stage.iter().map(|s| s.update_s).fold(0.0, f64::max);
    let (pipeline_s, updates_s) = match pieces.shared_engine {
        Some(engine) => shared_engine_step(engine, pieces.stage_devices, (pipeline, &costs, p2p_s), &per_stage)?,
        None => (timeline.step_s, slowest_update),
    };
    let m = pipeline.micro_batches as f64;
    let work = |st: &StageReport| m * (st.forward_s + st.backward_s) + st.update_s;
    let busiest = per_stage.iter().max_by(|a, b| work(a).total_cmp(&work(b)));
    let (step_time_s, compute_s, exposed_communication_s, data_parallel_s) = match busiest {
        _ if p * v == 1 => {
            let a = accumulate(&unpipelined, pieces.optimizer_s, pipeline.micro_batches);
            let sums_s = accumulation_copies_s(hw, pieces, pipeline.micro_batches);
            (a.step_s + sums_s, a.compute_s + sums_s, a.exposed_communication_s, a.data_parallel_s)
        }
        Some(st) => {
            let kernels = m * (st.forward_s + st.backward_s - st.communication_s) + st.update_s - st.sums_s;
            let exposed = m * st.communication_s + st.sums_s + tied_sync_s;
            (pipeline_s + updates_s + tied_sync_s, kernels, exposed, st.sums_s)
        }
        None => (0.0, 0.0, 0.0, 0.0),
    };
    let tokens_per_step = unpipelined.tokens_per_step * pipeline.micro_batches;
    let devices = stage_devices * p;
    let capacity_flops = pieces.device_peak_flops * devices as f64 * step_time_s;
    let model_flops = unpipelined.model_flops_per_step * pipeline.micro_batches as f64;
    let peak = per_stage.iter().map(|s| s.peak_bytes).max().unwrap_or(0);
    let capacity = hw.memory_bytes();
    Ok(PipelineSimulation {
        stages: p,
        schedule: pipeline.schedule.name().to_string(),
        virtual_stages: v,
        micro_batches: pipeline.micro_batches,
        stage_devices,
        devices,
        per_stage,
        p2p_bytes,
        p2p_s,
        tied_sync_s,
        pipeline_s,
        bubble_fraction: timeline.bubble_fraction,
        bottleneck_bubble_fraction: timeline.bottleneck_bubble_fraction,
        passes: timeline.passes,
        step_time_s,
        compute_s,
        exposed_communication_s,
        data_parallel_s,
        bubble_s: (step_time_s - compute_s - exposed_communication_s).max(0.0),
        tokens_per_step,
        tokens_per_second: if step_time_s > 0.0 { tokens_per_step as f64 / step_time_s } else { 0.0 },
        mfu: if capacity_flops > 0.0 { model_flops / capacity_flops } else { 0.0 },
        peak_bytes_per_device: peak,
        capacity_bytes: capacity,
        fits: peak <= capacity,
        unpipelined,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balancing_puts_the_head_and_tail_costs_with_the_end_runs() {
        // Eight layers of 1 s, an embedding of 2 s and a head of 2 s, in four runs: the end runs get
        // fewer layers.
        let mut time = vec![2.0];
        time.extend([1.0; 8]);
        time.push(2.0);
        let starts = balance(&time, 4);
        assert_eq!(starts, vec![0, 1, 4, 7]);
        assert!(balance(&time, 9).is_empty(), "more runs than layers");
        assert_eq!(balance(&time, 1), vec![0]);
    }

    #[test]
    fn even_layers_split_evenly() {
        let mut time = vec![0.0];
        time.extend([1.0; 12]);
        time.push(0.0);
        assert_eq!(balance(&time, 4), vec![0, 3, 6, 9]);
        assert_eq!(balance(&time, 3), vec![0, 4, 8]);
    }
}
