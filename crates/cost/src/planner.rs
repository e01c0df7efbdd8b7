//! The automatic planner behind `optimusc plan`: enumerates the configurations of a model on N devices
//! (strategy, tensor mesh, data-parallel degree, micro-batch and accumulation, recompute, precision,
//! ZeRO stage), compiles the promising ones, checks each against device memory with the plan's own
//! memory plan, scores it with the step simulator, and ranks them. Nothing here prints.
//!
//! A configuration is compiled as the plan of the whole mesh (`Mesh.data` replicas, its ZeRO stage) at
//! the micro-batch: the data-parallel reductions are in the plan, and the simulator costs them.
//!
//! Pruning, all of it counted in [`Counts`]:
//! - a layout (strategy, tensor mesh, data-parallel degree) whose batch does not split, or whose
//!   first compilation fails, is illegal as a whole;
//! - memory is monotone in the micro-batch, so each (layout, precision, recompute, ZeRO) group needs
//!   only its largest fitting micro-batch, found by compiling a few guesses (a line through the peaks
//!   already compiled) until it is bracketed between a fitting one and the next one that does not fit;
//! - a recompute level is only tried at micro-batches where the cheaper levels do not fit;
//! - a group whose compute lower bound (its matrix-product FLOPs at the peak rate) already loses to
//!   the best step found is skipped;
//! - a layout whose parameters and optimizer state alone overflow the memory is not compiled again.
//!
//! Pipelines ([`Request::max_pipeline`] above 1): a layout may also cut the model into P stages (1F1B,
//! or interleaved with 2 chunks a stage where the layers split that way), each stage a copy of the
//! tensor mesh and its replicas. Its memory and step come from the plan of one stage's grid for the
//! whole model, cut into stages by [`crate::staged`]; that plan is compiled once for every pipeline
//! depth that uses the same grid. A pipelined layout whose compute lower bound (the stage grid's
//! matrix products, known from any plan of the same tensor mesh, divided by P) already loses to the
//! best step is skipped without compiling.

use super::hardware::Hardware;
use super::search::{SearchError, Source, batch_override, integer_cbrt, integer_sqrt};
use super::staged::{self, Pieces, Pipeline, PipelineSimulation};
use super::step::{Accumulated, Options, Simulation, accumulate, optimizer_seconds, simulate, simulate_costed};
use optimus_compiler::shard::Target;
use optimus_plan::pipeline::Schedule;
use optimus_plan::report::kernel_flops;
use optimus_plan::{Buffer, Instr, Kernel, MemoryOptions, Mesh, Mode, Plan, Precision, Recompute, Strategy};
use serde::{Serialize, Serializer};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Instant;

/// The most devices the planner takes.
pub const MAX_DEVICES: u64 = 1 << 20;

/// How a model is split over the devices: a tensor-parallel mesh, replicated `data` times, in each of
/// `pipeline` stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Parallelism {
    pub strategy: Strategy,
    #[serde(serialize_with = "mesh_text")]
    pub mesh: Mesh,
    /// The data-parallel degree: how many replicas of the tensor mesh.
    pub data: u64,
    /// Pipeline stages (1: no pipeline), each with its own tensor mesh and replicas.
    pub pipeline: u64,
    /// Model chunks on each stage: 1 for the 1F1B schedule, 2 or more for the interleaved one.
    pub chunks: u64,
}

fn mesh_text<S: Serializer>(mesh: &Mesh, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(mesh)
}

impl Parallelism {
    /// A tensor mesh replicated `data` times, without a pipeline.
    pub fn tensor(strategy: Strategy, mesh: Mesh, data: u64) -> Parallelism {
        Parallelism { strategy, mesh, data, pipeline: 1, chunks: 1 }
    }

    /// Devices of one replica.
    pub fn tensor_devices(&self) -> u64 {
        self.mesh.devices()
    }

    /// Every device: stages x replicas x the tensor mesh.
    pub fn devices(&self) -> u64 {
        self.pipeline * self.data * self.mesh.devices()
    }

    /// The pipeline's schedule.
    pub fn schedule(&self) -> Schedule {
        if self.chunks > 1 { Schedule::Interleaved { chunks: self.chunks } } else { Schedule::OneFOneB }
    }

    /// "1", "16" or "8x2" (8 stages of 2 interleaved chunks).
    pub fn pipeline_text(&self) -> String {
        if self.chunks > 1 { format!("{}x{}", self.pipeline, self.chunks) } else { self.pipeline.to_string() }
    }

    /// "optimus 8x8 DP 2", "megatron 1x8 DP 8 PP 16", "optimus 4x4 DP 4 PP 8x2 interleaved".
    pub fn label(&self) -> String {
        let mut text = format!("{} {} DP {}", self.strategy.name(), self.mesh, self.data);
        if self.pipeline > 1 {
            text.push_str(&format!(" PP {}", self.pipeline_text()));
            if self.chunks > 1 {
                text.push_str(" interleaved");
            }
        }
        text
    }
}

/// One configuration: a layout, how the global batch is cut, and the memory options.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Config {
    #[serde(flatten)]
    pub parallelism: Parallelism,
    /// Sequences per replica per micro step.
    pub micro_batch: u64,
    /// Micro steps per update: data * micro_batch * accumulation is the global batch.
    pub accumulation: u64,
    pub recompute: Recompute,
    pub precision: Precision,
    /// ZeRO stage: 1 shards the optimizer state (and bf16's float32 master weights) over the replicas.
    pub zero: u8,
}

impl Config {
    /// What the compiler is asked for: the tensor mesh replicated `data` times, with the ZeRO stage.
    pub fn target(&self, mode: Mode) -> Target {
        Target {
            memory: MemoryOptions { recompute: Some(self.recompute), precision: self.precision, zero: self.zero },
            ..Target::plain(self.parallelism.mesh.with_data(self.parallelism.data), self.parallelism.strategy, mode)
        }
    }

    /// The `batch` a micro step of the whole mesh reads: the micro-batch of every replica.
    pub fn step_batch(&self) -> u64 {
        self.parallelism.data * self.micro_batch
    }

    /// "optimus 8x8 DP 1, micro-batch 8 x 1, recompute none, f32, zero 0".
    pub fn label(&self) -> String {
        format!(
            "{}, micro-batch {} x {}, recompute {}, {}, zero {}",
            self.parallelism.label(),
            self.micro_batch,
            self.accumulation,
            self.recompute.name(),
            self.precision.name(),
            self.zero
        )
    }

    /// The configuration whose compiled plan this one's memory and timing come from.
    fn compile_key(&self) -> Config {
        Config { accumulation: 0, ..*self }
    }

    /// The configuration of one stage's grid: the plan every pipeline depth over it cuts into stages.
    fn stage_key(&self) -> Config {
        let parallelism = Parallelism { pipeline: 1, chunks: 1, ..self.parallelism };
        Config { accumulation: 0, parallelism, ..*self }
    }

    /// The pipeline of a pipelined configuration: its micro-batches are the accumulation steps.
    fn pipeline(&self) -> Option<Pipeline> {
        let p = &self.parallelism;
        (p.pipeline > 1).then(|| Pipeline {
            stages: p.pipeline,
            schedule: p.schedule(),
            micro_batches: self.accumulation,
        })
    }
}

/// What to plan.
pub struct Request<'a> {
    pub source: &'a Source<'a>,
    pub devices: u64,
    pub hardware: &'a Hardware,
    /// Bytes per device.
    pub capacity: u64,
    pub mode: Mode,
    /// The precisions allowed, in the order they are searched.
    pub precisions: &'a [Precision],
    pub options: Options,
    /// The most pipeline stages searched (1: none).
    pub max_pipeline: u64,
}

/// A configuration that fits, with its predicted step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Scored {
    #[serde(flatten)]
    pub config: Config,
    pub devices: u64,
    /// The whole update: `accumulation` micro steps of the whole mesh, with the optimizer step once.
    pub step_time_s: f64,
    /// One simulated micro step of the whole mesh (with its optimizer step).
    pub micro_step_s: f64,
    /// Kernels of the update: accumulation x (micro-step kernels - optimizer) + optimizer.
    pub compute_s: f64,
    /// Exposed communication of the update: accumulation x the micro step's, but the gradient sums
    /// over the replicas once.
    pub exposed_communication_s: f64,
    /// Exposed time of the gradient sums over the replicas (all-reduces, or ZeRO-1's reduce-scatters),
    /// once per update as `run --accum` issues them.
    pub data_parallel_s: f64,
    pub optimizer_s: f64,
    pub tokens_per_step: u64,
    pub tokens_per_second: f64,
    pub mfu: f64,
    pub peak_bytes_per_device: u64,
    pub capacity_bytes: u64,
    /// How its ranks sit on nodes in the simulation (with `auto_placement`, the faster of the two).
    pub placement: String,
    /// A pipeline's bubble: the time its busiest stage waits (for the pipeline to fill and drain, and
    /// for transfers), and that as a share of all stages' time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bubble_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bubble_fraction: Option<f64>,
}

/// How many configurations went where. Every enumerated configuration is counted in exactly one of
/// `illegal`, `too_large`, `dominated_recompute`, `dominated_micro_batch`, `bounded` and `scored`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Counts {
    pub enumerated: u64,
    /// The batch does not split into this layout, or the model does not compile on it.
    pub illegal: u64,
    /// Known not to fit: compiled and over capacity, or above a micro-batch that is.
    pub too_large: u64,
    /// A cheaper recompute level fits at the same micro-batch.
    pub dominated_recompute: u64,
    /// Fits, but a larger micro-batch of the same group fits too (not simulated).
    pub dominated_micro_batch: u64,
    /// Skipped: its compute lower bound already loses to the best step found.
    pub bounded: u64,
    /// Compiled, fitting and simulated: the ranked list.
    pub scored: u64,
    /// Compilations run (failed ones included).
    pub compiled: u64,
    pub compile_failures: u64,
    /// Simulations run.
    pub simulated: u64,
    pub elapsed_s: f64,
}

/// Why the best configuration beats the runner-up.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Explanation {
    pub runner_up: Config,
    pub margin_s: f64,
    pub compute_difference_s: f64,
    pub communication_difference_s: f64,
    /// "compute", "communication" or "memory".
    pub dominant: String,
    pub text: String,
}

/// What the search did with one group (a layout, precision, recompute level and ZeRO stage).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GroupTrace {
    pub group: String,
    /// The micro-batches searched (those a cheaper recompute level does not already fit).
    pub micro_batches: Vec<u64>,
    pub result: String,
    pub compilations: u64,
}

/// The answer: configurations best first.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Outcome {
    pub global_batch: u64,
    pub devices: u64,
    pub capacity_bytes: u64,
    pub ranked: Vec<Scored>,
    pub counts: Counts,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<Explanation>,
    /// Each group's search, in the order searched.
    pub groups: Vec<GroupTrace>,
}

/// Why a configuration was rejected, closest first: it compiled but did not fit, it did not compile, or
/// its batch does not split over its replicas and rows (it never reached the compiler).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rejection {
    Memory,
    Compile,
    Batch,
}

/// A configuration that was rejected, and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Rejected {
    pub what: String,
    pub reason: String,
    /// Peak over capacity, for memory failures (how close it came).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub over_capacity: Option<f64>,
    /// What kind of failure it was.
    #[serde(skip)]
    pub kind: Rejection,
}

impl Rejected {
    fn memory(what: String, reason: String, over: f64) -> Rejected {
        Rejected { what, reason, over_capacity: Some(over), kind: Rejection::Memory }
    }

    fn compile(what: String, reason: String) -> Rejected {
        Rejected { what, reason, over_capacity: None, kind: Rejection::Compile }
    }

    fn batch(what: String, reason: String) -> Rejected {
        Rejected { what, reason, over_capacity: None, kind: Rejection::Batch }
    }
}

/// No configuration fits or compiles.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NoPlan {
    pub message: String,
    /// The closest candidates and why each fails.
    pub closest: Vec<Rejected>,
    pub counts: Counts,
}

/// Compiles one configuration: the plan of the whole mesh (every replica) for one micro step.
pub fn compile_candidate(source: &Source, config: &Config, mode: Mode) -> Result<Plan, SearchError> {
    source.compile(config.target(mode), &[batch_override(config.step_batch())])
}

/// [`compile_candidate`], verified: the plan to write (`plan -o`).
pub fn compile_winner(source: &Source, config: &Config, mode: Mode) -> Result<Plan, SearchError> {
    source.compile_verified(config.target(mode), &[batch_override(config.step_batch())])
}

/// What the search keeps of a compiled plan (plans are large; they are not kept).
#[derive(Clone, Debug)]
struct Compiled {
    peak_bytes: u64,
    /// Parameters and optimizer state: alive at every instruction, whatever the micro-batch.
    persistent_bytes: u64,
    /// Non-persistent bytes that do not grow with the micro-batch (the local gradients).
    gradient_bytes: u64,
    /// Matrix-product time at the peak rate, per micro-batch sequence (a lower bound on compute).
    matrix_s_per_sequence: f64,
    optimizer_s: f64,
    simulation: Option<Simulation>,
    /// A pipelined configuration's simulated update (its memory figures are the stages' largest).
    pipeline: Option<PipelineSimulation>,
}

/// The plan of one stage's grid cut into pieces, with what the search keeps of it: the plan itself on
/// a calibrated profile, whose pipelines are simulated from it as `simulate --pipeline` does (their
/// pieces are costed for every stage's devices on the shared engine, so the balance depends on the
/// depth, and their stages' memory is their programs').
struct StagePlan {
    summary: Compiled,
    pieces: Pieces,
    unpipelined: Simulation,
    plan: Option<Plan>,
}

/// A pipelined configuration from the plan of its stage's grid.
fn pipelined(
    stage: &StagePlan,
    (hw, options): (&Hardware, &Options),
    pipeline: Pipeline,
) -> Result<Compiled, SearchError> {
    let sim = match &stage.plan {
        Some(plan) => staged::simulate_pipeline(plan, hw, options, pipeline),
        None => staged::pipeline_of_pieces(hw, &stage.pieces, stage.unpipelined.clone(), pipeline),
    }
    .map_err(|e| SearchError::Pipeline(e.to_string()))?;
    let held = sim.per_stage.iter().map(|s| s.held_bytes).max().unwrap_or(0);
    Ok(Compiled {
        peak_bytes: sim.peak_bytes_per_device,
        persistent_bytes: held,
        gradient_bytes: 0,
        matrix_s_per_sequence: stage.summary.matrix_s_per_sequence / pipeline.stages as f64,
        optimizer_s: stage.summary.optimizer_s / pipeline.stages as f64,
        simulation: Some(stage.unpipelined.clone()),
        pipeline: Some(sim),
    })
}

/// Compiles one stage's grid for a pipelined configuration and cuts it into pieces.
fn stage_plan(request: &Request, config: &Config) -> Result<StagePlan, SearchError> {
    let plan = compile_candidate(request.source, config, request.mode)?;
    let (unpipelined, costs) = simulate_costed(&plan, request.hardware, &request.options);
    let pieces = staged::pieces(&plan, request.hardware, &costs);
    let summary = summarise(&plan, request.hardware, (config.micro_batch, pieces.optimizer_s));
    let plan = request.hardware.measured.is_some().then_some(plan);
    Ok(StagePlan { summary, pieces, unpipelined, plan })
}

/// What the search keeps of a plan compiled at `micro_batch`, whose optimizer steps take `optimizer_s`
/// ([`optimizer_seconds`]).
fn summarise(plan: &Plan, hw: &Hardware, (micro_batch, optimizer_s): (u64, f64)) -> Compiled {
    let m = &plan.memory;
    let mut matrix_s = 0.0;
    for instr in &plan.program {
        let Instr::Kernel { kernel, inputs, output, .. } = instr else { continue };
        let ins: Vec<&Buffer> = inputs.iter().map(|&b| plan.buffer(b)).collect();
        let out = plan.buffer(*output);
        if matches!(
            kernel,
            Kernel::MatMul { .. } | Kernel::BatchedMatMul | Kernel::Attention { .. } | Kernel::AttentionGrad { .. }
        ) {
            // At the operands' peak, as the simulator costs it: bf16 SUMMA steps summed in float32
            // still run on the tensor cores (the output's float32 would overstate the bound and
            // prune bf16 optimus layouts that win).
            let rate = hw.peak_flops(crate::step::product_dtype(&ins, out)) * hw.device.achievable_compute;
            matrix_s += kernel_flops(kernel, &ins, out) as f64 / rate;
        }
    }
    Compiled {
        peak_bytes: m.peak_bytes,
        persistent_bytes: m.parameters + m.optimizer_state,
        gradient_bytes: m.gradients,
        matrix_s_per_sequence: matrix_s / micro_batch.max(1) as f64,
        optimizer_s,
        simulation: None,
        pipeline: None,
    }
}

/// Scores a configuration from its compiled plan's simulation: `accumulation` micro steps of the whole
/// mesh, with the gradient sums over the replicas and the optimizer step once.
fn score(compiled: &Compiled, sim: &Simulation, config: &Config, request: &Request) -> Scored {
    if let Some(pipe) = &compiled.pipeline {
        return score_pipeline(pipe, compiled, config, request);
    }
    let a = config.accumulation as f64;
    let optimizer_s = compiled.optimizer_s;
    // Gradients cross the replicas once per update (`run` defers the sums of earlier micro-batches to
    // the last one); the rest of the communication happens in every micro step.
    let Accumulated { step_s: step_time_s, compute_s, exposed_communication_s, data_parallel_s } =
        accumulate(sim, optimizer_s, config.accumulation);
    let tokens_per_step = sim.tokens_per_step * config.accumulation;
    let micro_flops = sim.mfu * sim.step_time_s;
    Scored {
        config: *config,
        devices: sim.devices,
        step_time_s,
        micro_step_s: sim.step_time_s,
        compute_s,
        exposed_communication_s,
        data_parallel_s,
        optimizer_s,
        tokens_per_step,
        tokens_per_second: if step_time_s > 0.0 { tokens_per_step as f64 / step_time_s } else { 0.0 },
        // Model FLOPs scale with the tokens (x accumulation), capacity with the time.
        mfu: if step_time_s > 0.0 { micro_flops * a / step_time_s } else { 0.0 },
        peak_bytes_per_device: compiled.peak_bytes,
        capacity_bytes: request.capacity,
        placement: sim.placement.clone(),
        bubble_s: None,
        bubble_fraction: None,
    }
}

/// Scores a pipelined configuration from its simulated update.
fn score_pipeline(pipe: &PipelineSimulation, compiled: &Compiled, config: &Config, request: &Request) -> Scored {
    let busiest = pipe.per_stage.iter().map(|s| s.forward_s + s.backward_s).fold(0.0, f64::max);
    Scored {
        config: *config,
        devices: pipe.devices,
        step_time_s: pipe.step_time_s,
        micro_step_s: busiest,
        compute_s: pipe.compute_s,
        exposed_communication_s: pipe.exposed_communication_s,
        data_parallel_s: pipe.data_parallel_s,
        optimizer_s: compiled.optimizer_s,
        tokens_per_step: pipe.tokens_per_step,
        tokens_per_second: pipe.tokens_per_second,
        mfu: pipe.mfu,
        peak_bytes_per_device: pipe.peak_bytes_per_device,
        capacity_bytes: request.capacity,
        placement: pipe.unpipelined.placement.clone(),
        bubble_s: Some(pipe.bubble_s),
        bubble_fraction: Some(pipe.bubble_fraction),
    }
}

/// A lower bound on a configuration's step: its matrix products at the peak rate for the whole
/// per-replica batch. Products scale with the micro-batch, and the recomputation of heavier levels
/// only adds to them. (Communication is left out: how much of it the backward pass hides depends on
/// the micro-batch.)
fn lower_bound_s(compiled: &Compiled, config: &Config) -> f64 {
    let p = &config.parallelism;
    compiled.matrix_s_per_sequence
        * (config.micro_batch * config.accumulation) as f64
        * fill_and_drain(p.pipeline, p.chunks, config.accumulation)
}

/// The least a pipeline of `stages` stages of `chunks` chunks takes over m micro-batches, in units
/// of one stage's work for all of them: 1 + (P - 1) / (V m). A stage runs its m micro-batches after
/// the first one's forward has passed the stages before it, and the last one's backward still has the
/// stages before it to pass: (m V + P - 1) chunk passes at least on the critical path, each at least
/// the average chunk's time (balanced stages meet it).
fn fill_and_drain(stages: u64, chunks: u64, micro_batches: u64) -> f64 {
    1.0 + stages.saturating_sub(1) as f64 / (chunks.max(1) * micro_batches.max(1)) as f64
}

/// The layouts of `devices`: every tensor-device count t dividing it, as optimus q x q (q >= 2),
/// 3d q x q x q (q >= 2), megatron 1 x t (t >= 2) and none (t = 1), replicated devices / t times.
///
/// Tesseract's d x q x q with r replicas is not enumerated apart: depth layers hold the same weights
/// and split the batch as replicas do, on the same ranks, so with one replica its plan is optimus
/// q x q's with d replicas, instruction for instruction. With r replicas tesseract sums each gradient
/// over the depth and then over the replicas where optimus with d r replicas sums it once, and ZeRO-1
/// splits over d r replicas where tesseract's splits over r: the optimus layout matches or beats it
/// (see [`TESSERACT_COVERED`]; tests/tesseract.rs checks both).
pub fn layouts(devices: u64) -> Vec<Parallelism> {
    let mut out = Vec::new();
    for t in divisors(devices).into_iter().rev() {
        let data = devices / t;
        if let Some(q) = integer_sqrt(t).filter(|&q| q >= 2) {
            out.push(Parallelism::tensor(Strategy::Optimus, Mesh::new(q, q), data));
        }
        if let Some(q) = integer_cbrt(t).filter(|&q| q >= 2) {
            out.push(Parallelism::tensor(Strategy::ThreeD, Mesh::new(q, q).with_depth(q), data));
        }
        if t >= 2 {
            out.push(Parallelism::tensor(Strategy::Megatron, Mesh::new(1, t), data));
        }
        if t == 1 {
            out.push(Parallelism::tensor(Strategy::None, Mesh::new(1, 1), data));
        }
    }
    out
}

/// The pipelined layouts of `devices` for a model of `layers` repeated layers: every stage count P
/// from 2 to `max_pipeline` that divides both the devices and the layers (stages of equal layer
/// counts, as Megatron-LM requires), over each layout of devices / P ([`layouts`]), with the 1F1B
/// schedule and, where the layers split into 2 P runs of equal count, the interleaved schedule with 2
/// chunks a stage. Fewest stages first.
pub fn pipelined_layouts(devices: u64, layers: u64, max_pipeline: u64) -> Vec<Parallelism> {
    let mut out = Vec::new();
    let stage_counts = divisors(devices).into_iter().filter(|&p| p >= 2 && p <= max_pipeline);
    for p in stage_counts.filter(|&p| layers.is_multiple_of(p)) {
        for base in layouts(devices / p) {
            out.push(Parallelism { pipeline: p, chunks: 1, ..base });
            if layers.is_multiple_of(2 * p) {
                out.push(Parallelism { pipeline: p, chunks: 2, ..base });
            }
        }
    }
    out
}

/// The repeated layers of the model (the most pipeline stages it can have): counted in a one-device
/// inference plan of one sequence.
pub fn repeated_layers(source: &Source) -> Result<u64, SearchError> {
    let target = Target::plain(Mesh::new(1, 1), Strategy::None, Mode::Infer);
    let plan = source.compile(target, &[batch_override(1)])?;
    let layers: std::collections::BTreeSet<&str> = plan
        .program
        .iter()
        .filter_map(|instr| match instr {
            Instr::Kernel { origin, .. } | Instr::Collective { origin, .. } => plan.origins.get(*origin as usize),
            _ => None,
        })
        .filter_map(|o| staged::layer_of(&o.scope))
        .collect();
    Ok(layers.len() as u64)
}

/// What the planner says of 2.5D (see [`layouts`]).
pub const TESSERACT_COVERED: &str = "2.5D (tesseract d x q x q with r replicas) is searched as optimus q x q with d r \
     replicas: the same plan with its depth layers as replicas, each gradient summed once over all of them";

/// The divisors of n, ascending (trial division up to the square root).
fn divisors(n: u64) -> Vec<u64> {
    let mut low = Vec::new();
    let mut high = Vec::new();
    let mut d = 1;
    while d <= n / d {
        if n.is_multiple_of(d) {
            low.push(d);
            if d != n / d {
                high.push(n / d);
            }
        }
        d += 1;
    }
    low.extend(high.into_iter().rev());
    low
}

/// The micro-batches of a layout: divisors of the per-replica batch that the strategy can split;
/// or why there are none.
fn micro_batches(p: &Parallelism, global_batch: u64, mode: Mode) -> Result<Vec<u64>, BatchSplit> {
    if !global_batch.is_multiple_of(p.data) {
        return Err(BatchSplit::OverReplicas { global_batch, replicas: p.data });
    }
    let per_replica = global_batch / p.data;
    let target = Target::plain(p.mesh, p.strategy, mode);
    let multiple = target.batch_multiple();
    // The interleaved schedule takes the micro-batches P at a time.
    let steps_multiple = if p.chunks > 1 { p.pipeline } else { 1 };
    let ms: Vec<u64> = divisors(per_replica)
        .into_iter()
        .filter(|m| m.is_multiple_of(multiple) && (per_replica / m).is_multiple_of(steps_multiple))
        .collect();
    if ms.is_empty() {
        return Err(BatchSplit::OverRows { per_replica, multiple, mesh: p.mesh });
    }
    Ok(ms)
}

/// Why a layout has no micro-batch: the global batch does not split over it.
#[derive(Clone, Copy, Debug, PartialEq)]
enum BatchSplit {
    /// Not over the data-parallel replicas.
    OverReplicas { global_batch: u64, replicas: u64 },
    /// A replica's share not over the mesh rows that split it again.
    OverRows { per_replica: u64, multiple: u64, mesh: optimus_plan::Mesh },
}

impl std::fmt::Display for BatchSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BatchSplit::OverReplicas { global_batch, replicas } => {
                write!(f, "the global batch {global_batch} does not split over {replicas} replicas")
            }
            BatchSplit::OverRows { per_replica, multiple, mesh } => write!(
                f,
                "the per-replica batch {per_replica} is not a multiple of {multiple} (the {mesh} mesh splits the batch \
                 over its rows)"
            ),
        }
    }
}

/// Every configuration the planner enumerates whose batch splits (the search's space before pruning),
/// with pipelines of up to `max_pipeline` stages for a model of `layers` repeated layers: the reference
/// a brute-force check walks.
pub fn configurations(
    devices: u64,
    global_batch: u64,
    mode: Mode,
    precisions: &[Precision],
    (layers, max_pipeline): (u64, u64),
) -> Vec<Config> {
    let mut out = Vec::new();
    let pipelines = if mode == Mode::Train { pipelined_layouts(devices, layers, max_pipeline) } else { Vec::new() };
    for parallelism in layouts(devices).into_iter().chain(pipelines) {
        let Ok(ms) = micro_batches(&parallelism, global_batch, mode) else { continue };
        let per_replica = global_batch / parallelism.data;
        for &precision in precisions {
            for &recompute in recompute_levels(mode) {
                for &zero in zero_stages(&parallelism, mode) {
                    for &m in &ms {
                        let accumulation = per_replica / m;
                        out.push(Config { parallelism, micro_batch: m, accumulation, recompute, precision, zero });
                    }
                }
            }
        }
    }
    out
}

/// Compiles, fits and scores one configuration on its own, without the search: what the search
/// reports for it, or why it does not compile or fit.
pub fn evaluate(request: &Request, config: &Config) -> Result<Scored, SearchError> {
    if let Some(pipeline) = config.pipeline() {
        let stage = stage_plan(request, config)?;
        let compiled = pipelined(&stage, (request.hardware, &request.options), pipeline)?;
        if compiled.peak_bytes > request.capacity {
            return Err(SearchError::TooLarge { needs: compiled.peak_bytes, capacity: request.capacity });
        }
        return Ok(score(&compiled, &stage.unpipelined, config, request));
    }
    let plan = compile_candidate(request.source, config, request.mode)?;
    let compiled = summarise(&plan, request.hardware, (config.micro_batch, optimizer_seconds(&plan, request.hardware)));
    let peak = compiled.peak_bytes;
    if peak > request.capacity {
        return Err(SearchError::TooLarge { needs: peak, capacity: request.capacity });
    }
    let sim = simulate(&plan, request.hardware, &request.options);
    Ok(score(&compiled, &sim, config, request))
}

/// The recompute levels searched, cheapest first.
fn recompute_levels(mode: Mode) -> &'static [Recompute] {
    match mode {
        Mode::Train => &[Recompute::None, Recompute::Selective, Recompute::Layers],
        Mode::Infer => &[Recompute::None],
    }
}

/// The ZeRO stages of a layout.
fn zero_stages(p: &Parallelism, mode: Mode) -> &'static [u8] {
    if p.data > 1 && mode == Mode::Train { &[0, 1] } else { &[0] }
}

/// The search state.
struct Search<'a> {
    request: &'a Request<'a>,
    global_batch: u64,
    cache: HashMap<Config, Result<Compiled, SearchError>>,
    /// Plans of stage grids, cut into pieces, shared by every pipeline depth over the same grid.
    stages: HashMap<Config, Result<Rc<StagePlan>, SearchError>>,
    /// Matrix-product seconds per sequence of a replica on one device, by strategy, tensor mesh,
    /// precision and recompute level (whatever the replicas and the pipeline), for bounds on groups
    /// before they compile.
    matrix_rates: HashMap<(Strategy, Mesh, Precision, Recompute), f64>,
    scored: HashMap<Config, Scored>,
    best_s: f64,
    counts: Counts,
    rejected: Vec<Rejected>,
    groups: Vec<GroupTrace>,
}

/// One group: a layout, precision, recompute level and ZeRO stage, over its micro-batches.
struct SearchGroup<'m> {
    base: Config,
    ms: &'m [u64],
    /// Sequences of a replica per update: `micro_batch x accumulation`.
    per_replica: u64,
}

impl SearchGroup<'_> {
    fn label(&self) -> String {
        let b = &self.base;
        format!("{}, recompute {}, {}, zero {}", b.parallelism.label(), b.recompute.name(), b.precision.name(), b.zero)
    }

    fn at(&self, index: usize) -> Config {
        let m = self.ms[index];
        Config { micro_batch: m, accumulation: self.per_replica / m.max(1), ..self.base }
    }
}

/// How a group's search ended.
enum GroupEnd {
    /// The largest fitting micro-batch's index, if any fits.
    Fits(Option<usize>),
    /// The lower bound lost to the best found; nothing above `from` was decided.
    Bounded,
    /// The layout does not compile.
    Illegal(SearchError),
}

impl<'a> Search<'a> {
    fn new(request: &'a Request<'a>, global_batch: u64) -> Search<'a> {
        Search {
            request,
            global_batch,
            cache: HashMap::new(),
            stages: HashMap::new(),
            matrix_rates: HashMap::new(),
            scored: HashMap::new(),
            best_s: f64::INFINITY,
            counts: Counts::default(),
            rejected: Vec::new(),
            groups: Vec::new(),
        }
    }

    /// Compiles (once per compile key) and, when it may fit, simulates.
    fn compiled(&mut self, config: &Config) -> Result<Compiled, SearchError> {
        let key = config.compile_key();
        if let Some(done) = self.cache.get(&key) {
            return done.clone();
        }
        let request = self.request;
        let result = match config.pipeline() {
            Some(pipeline) => {
                self.stage(config).and_then(|stage| pipelined(&stage, (request.hardware, &request.options), pipeline))
            }
            None => {
                self.counts.compiled += 1;
                let result = compile_candidate(request.source, config, request.mode).map(|plan| {
                    let mut c = summarise(
                        &plan,
                        request.hardware,
                        (config.micro_batch, optimizer_seconds(&plan, request.hardware)),
                    );
                    if c.peak_bytes <= request.capacity {
                        self.counts.simulated += 1;
                        c.simulation = Some(simulate(&plan, request.hardware, &request.options));
                    }
                    c
                });
                if result.is_err() {
                    self.counts.compile_failures += 1;
                }
                result
            }
        };
        if let Ok(c) = &result {
            let p = &config.parallelism;
            let rate = c.matrix_s_per_sequence * p.pipeline as f64;
            let key = (p.strategy, p.mesh, config.precision, config.recompute);
            let known = self.matrix_rates.entry(key).or_insert(rate);
            *known = known.min(rate);
        }
        self.cache.insert(key, result.clone());
        result
    }

    /// The plan of a pipelined configuration's stage grid, cut into pieces (compiled and simulated once).
    fn stage(&mut self, config: &Config) -> Result<Rc<StagePlan>, SearchError> {
        let key = config.stage_key();
        if let Some(done) = self.stages.get(&key) {
            return done.clone();
        }
        self.counts.compiled += 1;
        let result = stage_plan(self.request, config).map(Rc::new);
        match &result {
            Ok(_) => self.counts.simulated += 1,
            Err(_) => self.counts.compile_failures += 1,
        }
        self.stages.insert(key, result.clone());
        result
    }

    /// The matrix-product rate of a tensor mesh at a recompute level, or at a cheaper one (recompute only
    /// adds products).
    fn group_rate(&self, p: &Parallelism, precision: Precision, recompute: Recompute) -> Option<f64> {
        recompute_levels(self.request.mode)
            .iter()
            .filter(|&&r| recompute_rank(r) <= recompute_rank(recompute))
            .filter_map(|&r| self.matrix_rates.get(&(p.strategy, p.mesh, precision, r)).copied())
            .reduce(f64::max)
    }

    /// A lower bound on every configuration of a layout at a recompute level (and heavier ones) from
    /// micro-batch `smallest` up, before it compiles: its tensor mesh's matrix products (known from any
    /// plan of that mesh) for a replica's sequences, a stage's share of them, filling and draining the
    /// pipeline (see [`lower_bound_s`]).
    fn group_bound_s(
        &self,
        p: &Parallelism,
        (precision, recompute): (Precision, Recompute),
        smallest: u64,
    ) -> Option<f64> {
        let rate = self.group_rate(p, precision, recompute)?;
        let per_replica = self.global_batch / p.data.max(1);
        let fill = fill_and_drain(p.pipeline, p.chunks, per_replica / smallest.max(1));
        Some(rate * per_replica as f64 / p.pipeline as f64 * fill)
    }

    /// The first micro-batch index (from `from`) whose lower bound already loses to the best step: a
    /// pipeline's bound grows with the micro-batch (fewer micro-batches fill and drain it less
    /// well), so none from there on can win. The group's length when none is known to lose.
    fn pipeline_cap(&self, base: &Config, ms: &[u64], from: usize) -> usize {
        if base.parallelism.pipeline == 1 {
            return ms.len();
        }
        (from..ms.len())
            .find(|&i| {
                let bound = self.group_bound_s(&base.parallelism, (base.precision, base.recompute), ms[i]);
                bound.is_some_and(|b| b >= self.best_s)
            })
            .unwrap_or(ms.len())
    }

    /// Whether a configuration fits; records a fitting one's score, and a failing one's reason.
    fn fits(&mut self, config: &Config) -> Result<bool, SearchError> {
        let compiled = self.compiled(config)?;
        let peak = compiled.peak_bytes;
        if peak > self.request.capacity {
            let reason = format!(
                "needs {} per device, more than {}",
                optimus_plan::report::human_bytes(peak),
                optimus_plan::report::human_bytes(self.request.capacity)
            );
            self.rejected.push(Rejected::memory(config.label(), reason, peak as f64 / self.request.capacity as f64));
            return Ok(false);
        }
        if let Some(sim) = &compiled.simulation {
            let s = score(&compiled, sim, config, self.request);
            self.best_s = self.best_s.min(s.step_time_s);
            self.scored.insert(*config, s);
        }
        Ok(true)
    }

    /// The next micro-batch index to compile in (lo, hi) (lo: the largest known to fit; the bottom of the
    /// range when none is): the largest that a line through the group's compiled peaks says fits, or
    /// lo's successor when the line says none does (to confirm lo is the largest).
    fn guess(&self, group: &SearchGroup, from: usize, lo: Option<usize>, hi: usize) -> usize {
        let Some(lo) = lo else { return from };
        let first = lo + 1;
        let Some((fixed, per_sequence)) = self.peak_line(group, lo, hi) else { return first };
        let capacity = self.request.capacity as f64;
        (first..hi).rev().find(|&i| fixed + per_sequence * group.ms[i] as f64 <= capacity).unwrap_or(first)
    }

    fn cached(&self, config: &Config) -> Option<&Compiled> {
        self.cache.get(&config.compile_key()).and_then(|r| r.as_ref().ok())
    }

    /// Peak = fixed + per_sequence * m, through the group's compiled points: the chord between the
    /// fitting point `lo` and the failing point `hi` when both were compiled (a chord over-estimates a
    /// convex peak), else through the one nearest below `hi`, assuming that all but the persistent bytes
    /// and the gradients grow with the micro-batch.
    fn peak_line(&self, group: &SearchGroup, lo: usize, hi: usize) -> Option<(f64, f64)> {
        let point = |i: usize| group.ms.get(i).and_then(|_| self.cached(&group.at(i))).map(|c| (group.ms[i] as f64, c));
        if let (Some((m0, low)), Some((m1, high))) = (point(lo), point(hi)) {
            let slope = (high.peak_bytes as f64 - low.peak_bytes as f64) / (m1 - m0);
            return Some((low.peak_bytes as f64 - slope * m0, slope));
        }
        let (m0, anchor) = (0..=hi.min(group.ms.len() - 1)).rev().find_map(point)?;
        let p0 = anchor.peak_bytes as f64;
        let fixed = (anchor.persistent_bytes + anchor.gradient_bytes) as f64;
        let slope = ((p0 - fixed) / m0).max(0.0);
        Some((p0 - slope * m0, slope))
    }

    /// The largest fitting micro-batch of a group among indices `from..` (`known_fit`: one that fits
    /// already, without compiling it), with the lower-bound check after the first compilation.
    fn search_group(
        &mut self,
        group: &SearchGroup,
        (from, cap): (usize, usize),
        known_fit: Option<usize>,
        first_of_layout: bool,
    ) -> GroupEnd {
        let mut lo: Option<usize> = known_fit.filter(|&k| k >= from);
        let mut hi = cap;
        let mut first = true;
        while lo.map_or(from, |l| l + 1) < hi {
            let index = self.guess(group, from, lo, hi);
            let config = group.at(index);
            match self.fits(&config) {
                Ok(true) => lo = Some(index),
                Ok(false) => hi = index,
                Err(reason) if first && first_of_layout => return GroupEnd::Illegal(reason),
                Err(reason) => {
                    self.rejected.push(Rejected::compile(config.label(), reason.to_string()));
                    hi = index;
                }
            }
            if first {
                first = false;
                let bound = self.cached(&config).map(|c| lower_bound_s(c, &config));
                let undecided = lo.map_or(from, |l| l + 1) < hi;
                if undecided && bound.is_some_and(|b| b >= self.best_s) {
                    return GroupEnd::Bounded;
                }
            }
        }
        GroupEnd::Fits(lo)
    }

    /// Compiles and scores the group's largest fitting micro-batch when the search took it as known
    /// (from a ZeRO-0 search) without compiling it; if it does not fit after all, the largest below.
    fn confirm_top(&mut self, group: &SearchGroup, top: usize) -> GroupEnd {
        let mut index = top;
        loop {
            let config = group.at(index);
            if self.scored.contains_key(&config) {
                return GroupEnd::Fits(Some(index));
            }
            if let Ok(true) = self.fits(&config) {
                return GroupEnd::Fits(Some(index));
            }
            match index.checked_sub(1) {
                Some(below) => index = below,
                None => return GroupEnd::Fits(None),
            }
        }
    }

    fn trace(&mut self, group: &SearchGroup, from: usize, result: String, compilations: u64) {
        let micro_batches = group.ms.get(from..).unwrap_or_default().to_vec();
        self.groups.push(GroupTrace { group: group.label(), micro_batches, result, compilations });
    }

    /// Why a group cannot fit at any micro-batch or recompute level: its parameters and optimizer state
    /// alone (known from any plan of its layout and precision) exceed the capacity.
    fn persistent_too_large(&self, base: &Config) -> Option<String> {
        let compiled = self.cache.iter().find_map(|(k, c)| {
            let same = k.parallelism == base.parallelism && k.precision == base.precision;
            (same && k.zero == base.zero).then_some(c.as_ref().ok()).flatten()
        })?;
        let persistent = compiled.persistent_bytes;
        (persistent > self.request.capacity).then(|| {
            format!(
                "too large: parameters and optimizer state alone take {} per device",
                optimus_plan::report::human_bytes(persistent)
            )
        })
    }

    /// Searches one layout in one precision, unless an earlier precision found it illegal; counts it done.
    fn search_one(
        &mut self,
        p: &Parallelism,
        ms: &[u64],
        precision: Precision,
        (illegal, done, total): (&mut Vec<Parallelism>, &mut usize, usize),
        on_progress: &dyn Fn(SearchProgress),
    ) {
        let label = p.label();
        on_progress(SearchProgress { done: *done, total, next: &label });
        *done += 1;
        let precisions = self.request.precisions.len() as u64;
        if illegal.contains(p) {
            self.counts.illegal += layout_size(self.request, p, ms.len() as u64) / precisions;
            return;
        }
        if let Err(reason) = self.search_layout(p, ms, precision) {
            self.rejected.push(Rejected::compile(p.label(), reason.to_string()));
            illegal.push(*p);
        }
    }

    /// Searches every group of a layout in one precision.
    fn search_layout(&mut self, p: &Parallelism, ms: &[u64], precision: Precision) -> Result<(), SearchError> {
        let mode = self.request.mode;
        let zeros = zero_stages(p, mode);
        let levels = recompute_levels(mode);
        let n = ms.len() as u64;
        // Per ZeRO stage: how many micro-batches (from the bottom) a cheaper level already fits.
        let mut fitted: Vec<usize> = vec![0; zeros.len()];
        // A bounded group's heavier recompute levels are bounded too: they only add products.
        let mut bounded: Vec<bool> = vec![false; zeros.len()];
        let mut first_of_layout = !self.cache.keys().any(|k| k.parallelism == *p);
        for (li, &recompute) in levels.iter().enumerate() {
            // Per ZeRO stage: the largest micro-batch index this level fits.
            let mut level_fit: Vec<Option<usize>> = vec![None; zeros.len()];
            for (zi, &zero) in zeros.iter().enumerate() {
                let base = Config { parallelism: *p, micro_batch: 0, accumulation: 0, recompute, precision, zero };
                let group = SearchGroup { base, ms, per_replica: self.global_batch / p.data.max(1) };
                let from = fitted[zi];
                self.counts.dominated_recompute += from as u64;
                let left = n - from as u64;
                let skipped = if left == 0 {
                    Some("none left: a cheaper recompute level fits every micro-batch".to_string())
                } else if bounded[zi] {
                    self.counts.bounded += left;
                    Some("bounded: a cheaper recompute level's lower bound already lost".to_string())
                } else if let Some(reason) = self.persistent_too_large(&base) {
                    self.counts.too_large += left;
                    Some(reason)
                } else if let Some(bound) =
                    self.group_bound_s(p, (precision, recompute), ms[from]).filter(|&b| b >= self.best_s)
                {
                    self.counts.bounded += left;
                    bounded[zi] = true;
                    Some(format!(
                        "bounded before compiling: its tensor mesh's products take at least {}, no better than the \
                         best step, {:.3} s",
                        seconds(bound),
                        self.best_s
                    ))
                } else {
                    None
                };
                if let Some(result) = skipped {
                    self.trace(&group, from, result, 0);
                    continue;
                }
                // ZeRO-1 needs no more memory than ZeRO-0: what ZeRO-0 fits at this level, it fits.
                let cap = self.pipeline_cap(&base, ms, from);
                let known_fit = if zi > 0 { level_fit[zi - 1].filter(|&k| k < cap) } else { None };
                let compiled_before = self.counts.compiled;
                let end = match self.search_group(&group, (from, cap), known_fit, first_of_layout) {
                    GroupEnd::Fits(Some(top)) => self.confirm_top(&group, top),
                    other => other,
                };
                let compilations = self.counts.compiled - compiled_before;
                first_of_layout = false;
                let scored = (from..ms.len()).filter(|&i| self.scored.contains_key(&group.at(i))).count() as u64;
                self.counts.scored += scored;
                let result = match end {
                    GroupEnd::Illegal(reason) => {
                        let all = (levels.len() - li) as u64 * zeros.len() as u64 * n;
                        self.counts.illegal += all - from as u64 - scored;
                        self.trace(&group, from, format!("illegal: {reason}"), compilations);
                        return Err(reason);
                    }
                    GroupEnd::Bounded => {
                        self.counts.bounded += left - scored;
                        bounded[zi] = true;
                        format!(
                            "bounded: its compute lower bound is no better than the best step, {:.3} s",
                            self.best_s
                        )
                    }
                    GroupEnd::Fits(None) => {
                        self.counts.too_large += (cap - from) as u64 - scored;
                        self.counts.bounded += n - cap as u64;
                        "none fits".to_string()
                    }
                    GroupEnd::Fits(Some(top)) => {
                        let fitting = (top + 1 - from) as u64;
                        self.counts.dominated_micro_batch += fitting - scored;
                        self.counts.too_large += (cap - 1 - top) as u64;
                        self.counts.bounded += n - cap as u64;
                        fitted[zi] = top + 1;
                        level_fit[zi] = Some(top);
                        format!("largest fitting micro-batch {} ({scored} simulated)", ms[top])
                    }
                };
                self.trace(&group, from, result, compilations);
            }
        }
        Ok(())
    }
}

/// Plans: every legal configuration is enumerated and either pruned or compiled, checked and scored.
pub fn plan(request: &Request) -> Result<Outcome, Box<NoPlan>> {
    plan_with_progress(request, &|_| {})
}

/// Where a search stands, for a progress display: `done` of `total` layout searches (a layout in one
/// precision: its micro-batch cuts, recompute levels and ZeRO stages) have finished, and `next` is the
/// one starting (empty once all are done).
#[derive(Clone, Copy, Debug)]
pub struct SearchProgress<'a> {
    pub done: usize,
    pub total: usize,
    pub next: &'a str,
}

/// A layout whose batch splits, with its micro-batches.
type LegalLayout = (Parallelism, Vec<u64>);

/// The configurations of a layout with `n` micro-batches: over its recompute levels, ZeRO stages and
/// the precisions asked for.
fn layout_size(request: &Request, p: &Parallelism, n: u64) -> u64 {
    n * recompute_levels(request.mode).len() as u64
        * zero_stages(p, request.mode).len() as u64
        * request.precisions.len() as u64
}

/// [`plan`], calling `on_progress` before each layout search and once when all are done.
pub fn plan_with_progress(request: &Request, on_progress: &dyn Fn(SearchProgress)) -> Result<Outcome, Box<NoPlan>> {
    let started = Instant::now();
    let no_plan = |message: String, counts: Counts| Box::new(NoPlan { message, closest: Vec::new(), counts });
    if request.devices == 0 || request.devices > MAX_DEVICES {
        return Err(no_plan(format!("--devices must be between 1 and {MAX_DEVICES}"), Counts::default()));
    }
    let Some(global_batch) = request.source.config_int("batch").filter(|&b| b > 0) else {
        return Err(no_plan(
            "the model has no positive integer `batch` config value (the global batch) to split".to_string(),
            Counts::default(),
        ));
    };
    let mut search = Search::new(request, global_batch);
    let per_layout = |p: &Parallelism, n: u64| layout_size(request, p, n);
    let mut legal: Vec<LegalLayout> = Vec::new();
    let pipelines =
        match (request.max_pipeline > 1 && request.mode == Mode::Train).then(|| repeated_layers(request.source)) {
            Some(Ok(layers)) => pipelined_layouts(request.devices, layers, request.max_pipeline),
            Some(Err(reason)) => {
                search.rejected.push(Rejected::compile("pipelines".to_string(), reason.to_string()));
                Vec::new()
            }
            None => Vec::new(),
        };
    for p in layouts(request.devices).into_iter().chain(pipelines) {
        match micro_batches(&p, global_batch, request.mode) {
            Ok(ms) => {
                search.counts.enumerated += per_layout(&p, ms.len() as u64);
                legal.push((p, ms));
            }
            Err(reason) => {
                // One configuration per layout and option set stands for the batch cut that does not exist.
                let n = per_layout(&p, 1);
                search.counts.enumerated += n;
                search.counts.illegal += n;
                search.rejected.push(Rejected::batch(p.label(), reason.to_string()));
            }
        }
    }
    let mut illegal: Vec<Parallelism> = Vec::new();
    let total = legal.len() * request.precisions.len();
    let mut done = 0;
    for &precision in request.precisions {
        let (flat, mut piped): (Vec<&LegalLayout>, Vec<&LegalLayout>) =
            legal.iter().partition(|(p, _)| p.pipeline == 1);
        for (p, ms) in flat {
            search.search_one(p, ms, precision, (&mut illegal, &mut done, total), on_progress);
        }
        // Pipelines after the layouts without, the lowest bound first (from the tensor meshes' products
        // just seen), so that the best step found early bounds the rest before they compile.
        let bound = |search: &Search, (p, ms): &LegalLayout| {
            let smallest = ms.first().copied().unwrap_or(1);
            search.group_bound_s(p, (precision, Recompute::None), smallest).unwrap_or(f64::INFINITY)
        };
        piped.sort_by(|a, b| bound(&search, a).total_cmp(&bound(&search, b)));
        for (p, ms) in piped {
            search.search_one(p, ms, precision, (&mut illegal, &mut done, total), on_progress);
        }
    }
    on_progress(SearchProgress { done, total, next: "" });
    finish(search, started)
}

fn finish(search: Search, started: Instant) -> Result<Outcome, Box<NoPlan>> {
    let Search { request, global_batch, scored, mut counts, mut rejected, groups, .. } = search;
    counts.elapsed_s = started.elapsed().as_secs_f64();
    let mut ranked: Vec<Scored> = scored.into_values().collect();
    ranked.sort_by(|a, b| {
        a.step_time_s
            .total_cmp(&b.step_time_s)
            .then(a.peak_bytes_per_device.cmp(&b.peak_bytes_per_device))
            .then_with(|| a.config.label().cmp(&b.config.label()))
    });
    if ranked.is_empty() {
        rejected.sort_by(|a, b| {
            a.kind.cmp(&b.kind).then(a.over_capacity.unwrap_or(0.0).total_cmp(&b.over_capacity.unwrap_or(0.0)))
        });
        let mut seen = std::collections::HashSet::new();
        rejected.retain(|r| seen.insert(r.what.clone()));
        rejected.truncate(8);
        let message = format!(
            "no configuration of {} devices compiles and fits: of {} enumerated, {} are illegal (the batch does not \
             split, or the model does not compile) and {} too large for {} per device ({} compilations, {} failed)",
            request.devices,
            counts.enumerated,
            counts.illegal,
            counts.too_large,
            optimus_plan::report::human_bytes(request.capacity),
            counts.compiled,
            counts.compile_failures
        );
        let batch_cut = rejected.iter().any(|r| r.kind == Rejection::Batch);
        let message = if batch_cut && counts.too_large == 0 {
            format!(
                "{message}\nhelp: the model's `batch` ({global_batch} sequences) is the global batch of an update; every \
                 data-parallel replica, and every row of an optimus mesh, needs sequences of its own, so {} devices may \
                 need the batch of the real run: `--set batch=N`",
                request.devices
            )
        } else {
            message
        };
        return Err(Box::new(NoPlan { message, closest: rejected, counts }));
    }
    let why = explain(&ranked);
    Ok(Outcome {
        global_batch,
        devices: request.devices,
        capacity_bytes: request.capacity,
        ranked,
        counts,
        why,
        groups,
    })
}

/// Why the best beats the runner-up: the best configuration of another layout if there is one, else
/// the second in the ranking.
pub fn explain(ranked: &[Scored]) -> Option<Explanation> {
    let best = ranked.first()?;
    let other_layout = ranked.iter().skip(1).find(|s| s.config.parallelism != best.config.parallelism);
    let runner = other_layout.or(ranked.get(1))?;
    let margin_s = runner.step_time_s - best.step_time_s;
    let compute = runner.compute_s - best.compute_s;
    let communication = runner.exposed_communication_s - best.exposed_communication_s;
    let memory_bound = recompute_rank(runner.config.recompute) > recompute_rank(best.config.recompute)
        || runner.config.micro_batch < best.config.micro_batch;
    let dominant = if communication.abs() > compute.abs() {
        "communication"
    } else if memory_bound {
        "memory"
    } else {
        "compute"
    };
    let percent = if best.step_time_s > 0.0 { 100.0 * margin_s / best.step_time_s } else { 0.0 };
    let mut text = format!(
        "{} is {} ({percent:.1}%) faster per step than {}: compute {} by {}, exposed communication {} by {}",
        best.config.parallelism.label(),
        seconds(margin_s),
        runner.config.label(),
        if compute >= 0.0 { "less" } else { "more" },
        seconds(compute.abs()),
        if communication >= 0.0 { "less" } else { "more" },
        seconds(communication.abs()),
    );
    if dominant == "memory" {
        text.push_str(&format!(
            "; the runner-up needs recompute {} and micro-batch {} to fit, where the best runs recompute {} at \
             micro-batch {}",
            runner.config.recompute.name(),
            runner.config.micro_batch,
            best.config.recompute.name(),
            best.config.micro_batch
        ));
    }
    text.push_str(&format!(" ({dominant} dominates)"));
    Some(Explanation {
        runner_up: runner.config,
        margin_s,
        compute_difference_s: compute,
        communication_difference_s: communication,
        dominant: dominant.to_string(),
        text,
    })
}

/// Seconds for people: "1.234 s", "12.345 ms", "67.8 us".
pub fn seconds(s: f64) -> String {
    let s = optimus_plan::text::without_negative_zero(s, 7);
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.1} us", s * 1e6)
    }
}

fn recompute_rank(r: Recompute) -> u8 {
    match r {
        Recompute::None => 0,
        Recompute::Selective => 1,
        Recompute::Layers => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_are_all_and_in_order() {
        for n in [1u64, 2, 12, 36, 97, 1024, 1536] {
            let slow: Vec<u64> = (1..=n).filter(|d| n % d == 0).collect();
            assert_eq!(divisors(n), slow, "{n}");
        }
    }

    #[test]
    fn layouts_cover_every_tensor_device_count() {
        let names: Vec<String> = layouts(16).iter().map(Parallelism::label).collect();
        assert_eq!(
            names,
            [
                "optimus 4x4 DP 1",
                "megatron 1x16 DP 1",
                "3d 2x2x2 DP 2",
                "megatron 1x8 DP 2",
                "optimus 2x2 DP 4",
                "megatron 1x4 DP 4",
                "megatron 1x2 DP 8",
                "none 1x1 DP 16"
            ]
        );
    }

    #[test]
    fn micro_batches_respect_the_replicas_and_the_mesh_rows() {
        let optimus = |q, data| Parallelism::tensor(Strategy::Optimus, Mesh::new(q, q), data);
        assert_eq!(micro_batches(&optimus(2, 2), 24, Mode::Train), Ok(vec![2, 4, 6, 12]));
        assert!(micro_batches(&optimus(4, 4), 8, Mode::Train).is_err(), "a replica's 2 sequences do not split 4 ways");
        assert!(micro_batches(&optimus(2, 3), 8, Mode::Train).is_err(), "8 sequences do not split over 3 replicas");
    }
}
