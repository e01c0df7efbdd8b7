//! `optimusc simulate --pipeline P`: the flags of a pipeline over the mesh (stages, schedule, virtual
//! stages, micro-batches) and the rendering of its simulated update, stage by stage.

use clap::ValueEnum;
use optimus::cost::planner::seconds;
use optimus::cost::staged::{Pipeline, PipelineSimulation};
use optimus::plan::pipeline::{Pass, Schedule};
use optimus::plan::pipeline_cut::{PipelineProgram, cut};
use optimus::plan::report::human_bytes;
use optimus::plan::text::group_digits;
use std::fmt::Write;

/// The pipeline flags of `optimusc simulate`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct PipelineArgs {
    /// Pipeline stages: the model's repeated layers cut into P contiguous stages balanced by their
    /// simulated time (the embedding with the first, the head with the last), each stage on its own
    /// copy of the --mesh grid and replicas, so P times the mesh's devices in all. Activations go from
    /// each device to its peer in the next stage; a tied weight's gradient is summed between the two
    /// stages that hold it [default: 1, no pipeline].
    #[arg(long, value_name = "P", value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub pipeline: Option<u64>,
    /// gpipe (every forward, then every backward: all micro-batches' activations alive at once), 1f1b
    /// (after P - s - 1 forwards, one forward and one backward in turn: stage s keeps at most P - s
    /// micro-batches of activations) or interleaved (1F1B over --virtual-stages chunks a stage, as
    /// Megatron-LM: the bubble shrinks V times, the transfers grow V times) [default: 1f1b].
    #[arg(long, value_enum, value_name = "SCHEDULE")]
    pub pipeline_schedule: Option<PipelineScheduleArg>,
    /// Model chunks on each stage for the interleaved schedule (2 or more) [default: 2].
    #[arg(long, value_name = "V", value_parser = clap::value_parser!(u64).range(2..=1024))]
    pub virtual_stages: Option<u64>,
    /// Micro-batches per update (gradient accumulation): the model's `batch` is one micro-batch of the
    /// whole mesh, and an update runs ACCUM of them (through the pipeline's schedule) before the
    /// gradients are summed over the replicas and the optimizer steps [default: 1].
    #[arg(long, value_name = "ACCUM", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub accum: Option<u64>,
    /// With --pipeline: also draw the schedule, one row per stage over the pipeline's time: a digit
    /// is the forward of micro-batch k (k mod 10), a letter a-j its backward, a dot idle.
    #[arg(long, requires = "pipeline")]
    pub timeline: bool,
}

/// `--pipeline-schedule`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PipelineScheduleArg {
    Gpipe,
    #[value(name = "1f1b")]
    OneFOneB,
    Interleaved,
}

impl PipelineArgs {
    /// Whether any pipeline flag was given.
    pub fn requested(&self) -> bool {
        self.pipeline.is_some()
            || self.pipeline_schedule.is_some()
            || self.virtual_stages.is_some()
            || self.accum.is_some()
    }

    /// The pipeline the flags describe, or why they contradict each other.
    pub fn pipeline(&self) -> Result<Pipeline, String> {
        let stages = self.pipeline.unwrap_or(1);
        let schedule = match (self.pipeline_schedule.unwrap_or(PipelineScheduleArg::OneFOneB), self.virtual_stages) {
            (PipelineScheduleArg::Interleaved, v) => Schedule::Interleaved { chunks: v.unwrap_or(2) },
            (_, Some(v)) => {
                return Err(format!(
                    "--virtual-stages {v} is for --pipeline-schedule interleaved (gpipe and 1f1b hold one chunk a stage)"
                ));
            }
            (PipelineScheduleArg::Gpipe, None) => Schedule::GPipe,
            (PipelineScheduleArg::OneFOneB, None) => Schedule::OneFOneB,
        };
        if stages == 1 && matches!(schedule, Schedule::Interleaved { .. }) {
            return Err("the interleaved schedule needs --pipeline 2 or more".to_string());
        }
        Ok(Pipeline { stages, schedule, micro_batches: self.accum.unwrap_or(1) })
    }
}

/// The human-readable pipelined update (or accumulated update, on one stage).
pub fn render_pipeline(s: &PipelineSimulation) -> String {
    if s.stages == 1 {
        return render_accumulated(s);
    }
    let u = &s.unpipelined;
    let mut out = String::new();
    let chunks = if s.virtual_stages > 1 { format!(", {} chunks a stage", s.virtual_stages) } else { String::new() };
    let _ = writeln!(
        out,
        "simulate: model {} on {}: pipeline of {} stages ({} schedule{chunks}), each a {} {} mesh ({} devices), {} \
         devices in all; {} an update",
        u.model,
        u.hardware,
        s.stages,
        s.schedule,
        u.strategy,
        u.mesh,
        s.stage_devices,
        s.devices,
        optimus::plan::text::plural(s.micro_batches, "micro-batch")
    );
    let _ = writeln!(out, "  placement {}, collectives {}", u.placement, u.algorithm);
    let _ = writeln!(
        out,
        "\n  {:>5}  {:<28} {:>11} {:>11} {:>11} {:>15} {:>9} {:>11}",
        "stage", "layers", "forward", "backward", "update", "parameters", "in flight", "peak"
    );
    for st in &s.per_stage {
        let _ = writeln!(
            out,
            "  {:>5}  {:<28} {:>11} {:>11} {:>11} {:>15} {:>9} {:>11}",
            st.stage,
            st.layers.join(", "),
            seconds(st.forward_s),
            seconds(st.backward_s),
            seconds(st.update_s),
            group_digits(u128::from(st.parameters)),
            st.in_flight,
            human_bytes(st.peak_bytes)
        );
    }
    let _ = writeln!(out, "  (forward and backward: one micro-batch through the stage's chunks)");
    let _ = writeln!(out, "  {}", peak_meaning(s));
    let (p, m) = (s.stages as f64, s.micro_batches as f64);
    let _ = writeln!(out, "\nupdate time             {:>12}", seconds(s.step_time_s));
    let _ = writeln!(out, "  pipeline              {:>12}  (first forward to last backward)", seconds(s.pipeline_s));
    let _ = writeln!(
        out,
        "  slowest stage update  {:>12}  (gradient sums over replicas, norm, optimizer)",
        seconds(s.per_stage.iter().map(|st| st.update_s).fold(0.0, f64::max))
    );
    if s.tied_sync_s > 0.0 {
        let _ = writeln!(
            out,
            "  tied gradients        {:>12}  (summed between the stages that hold them)",
            seconds(s.tied_sync_s)
        );
    }
    let ideal = (p - 1.0) / (s.virtual_stages as f64 * m + p - 1.0);
    let _ = writeln!(
        out,
        "bubble                  {:.1}% of the stages' time; the busiest stage idles {:.1}% of the pipeline's \
         ((P-1)/(V m+P-1) = {:.1}%, both, with equal stages)",
        100.0 * s.bubble_fraction,
        100.0 * s.bottleneck_bubble_fraction,
        100.0 * ideal
    );
    let _ = writeln!(
        out,
        "point-to-point          {} a device per transfer, {} each; a micro-batch crosses {} cuts each way",
        human_bytes(s.p2p_bytes),
        seconds(s.p2p_s),
        s.virtual_stages * s.stages - 1
    );
    let worst = s.per_stage.iter().max_by_key(|st| st.peak_bytes).map_or(0, |st| st.stage);
    render_fit_and_rate(&mut out, s, (s.peak_bytes_per_device, &format!(", stage {worst}")));
    out
}

/// What a stage's peak counts, as a note under the stages' table.
fn peak_meaning(s: &PipelineSimulation) -> &'static str {
    if s.per_stage.iter().any(|st| st.program_memory.is_some()) {
        "(peak: the stage program's arena, its gradient sums and the host copies of the activations in flight, \
         as run --pipeline holds them)"
    } else {
        "(peak: parameters, gradients, optimizer state, inputs, the largest workspace and the activations in \
         flight, kept in place)"
    }
}

/// The memory line (peak per device, with `where` it is reached), then throughput and MFU.
fn render_fit_and_rate(out: &mut String, s: &PipelineSimulation, (peak, place): (u64, &str)) {
    let _ = writeln!(
        out,
        "\nmemory per device       {} of {} ({:.1}%{place}): {}",
        human_bytes(peak),
        human_bytes(s.capacity_bytes),
        100.0 * peak as f64 / s.capacity_bytes.max(1) as f64,
        if peak <= s.capacity_bytes { "fits" } else { "DOES NOT FIT" }
    );
    let _ = writeln!(
        out,
        "throughput              {} tokens/s ({} tokens per update)",
        group_digits(s.tokens_per_second.round() as u128),
        group_digits(u128::from(s.tokens_per_step))
    );
    let _ = writeln!(out, "model FLOP utilisation  {:.1}%", 100.0 * s.mfu);
}

/// Columns of `--timeline`'s chart.
const CHART_COLUMNS: usize = 100;

/// The schedule as a chart: per stage, what runs at the middle of each of [`CHART_COLUMNS`] equal
/// slices of the pipeline's time.
pub fn render_timeline(s: &PipelineSimulation) -> String {
    let mut out = String::new();
    let slice = s.pipeline_s / CHART_COLUMNS as f64;
    let _ = writeln!(
        out,
        "\nschedule, {} a column (digit: forward of micro-batch k mod 10, letter a-j: its backward, dot: idle)",
        seconds(slice)
    );
    for (stage, passes) in s.passes.iter().enumerate() {
        let row: String = (0..CHART_COLUMNS)
            .map(|c| {
                let t = (c as f64 + 0.5) * slice;
                passes.iter().find(|p| p.start_s <= t && t < p.end_s).map_or('.', |p| {
                    let k = (p.op.micro_batch % 10) as u8;
                    match p.op.pass {
                        Pass::Forward => char::from(b'0' + k),
                        Pass::Backward => char::from(b'a' + k),
                    }
                })
            })
            .collect();
        let _ = writeln!(out, "  stage {stage:>3} |{row}|");
    }
    out
}

/// `--accum` without a pipeline: the update of several micro steps of the mesh.
fn render_accumulated(s: &PipelineSimulation) -> String {
    let u = &s.unpipelined;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "simulate: model {} on {}: {} strategy, {} mesh ({} devices), {} an update",
        u.model,
        u.hardware,
        u.strategy,
        u.mesh,
        s.devices,
        optimus::plan::text::plural(s.micro_batches, "micro-batch")
    );
    let _ = writeln!(out, "  placement {}, collectives {}", u.placement, u.algorithm);
    let _ = writeln!(
        out,
        "\nupdate time             {:>12}  ({} micro steps of {}; the optimizer steps once)",
        seconds(s.step_time_s),
        s.micro_batches,
        seconds(u.step_time_s)
    );
    let _ = writeln!(out, "  compute               {:>12}", seconds(s.compute_s));
    let _ = writeln!(out, "  exposed communication {:>12}", seconds(s.exposed_communication_s));
    let _ = writeln!(
        out,
        "    of it gradient sums {:>12}  (over the replicas, once an update, beside the last backward pass)",
        seconds(s.data_parallel_s)
    );
    render_fit_and_rate(&mut out, s, (u.memory.peak_bytes_per_device, ""));
    out
}

/// The pipeline flags of `optimusc run` (the micro-batches are `--accum`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RunPipelineArgs {
    /// The model as a pipeline of P stages, each on its own copy of the plan's grid (mesh and
    /// replicas; P times its devices in all, one thread each when run): the repeated layers are cut into P
    /// contiguous runs (the embedding with the first, the head with the last), each stage runs its
    /// layers' forward and backward passes for --accum micro-batches under --pipeline-schedule, passes
    /// activations forward and their gradients back to its neighbours point to point, and every stage
    /// updates its own parameters once the micro-batches are done (a tied embedding and LM head: the
    /// gradient summed between the two stages holding a copy). Losses and weights equal the run
    /// without --pipeline and the same --accum. [default: 1, no pipeline]
    #[arg(long, value_name = "P", value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub pipeline: Option<u64>,
    /// gpipe (every forward, then every backward: all micro-batches' activations kept at once), 1f1b
    /// (stage s keeps at most P - s micro-batches' activations) or interleaved (1F1B over
    /// --virtual-stages chunks a stage; --accum a multiple of P) [default: 1f1b].
    #[arg(long, value_enum, value_name = "SCHEDULE", requires = "pipeline")]
    pub pipeline_schedule: Option<PipelineScheduleArg>,
    /// Model chunks on each stage for the interleaved schedule (2 or more) [default: 2].
    #[arg(long, value_name = "V", value_parser = clap::value_parser!(u64).range(2..=64), requires = "pipeline")]
    pub virtual_stages: Option<u64>,
    /// Repeated layers of each virtual stage, in order (P x V counts, e.g. 3,3,2), instead of the
    /// split balanced by the cost model (see --pipeline-hardware).
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', requires = "pipeline")]
    pub pipeline_split: Option<Vec<u64>>,
    /// The hardware profile whose simulated time per layer balances the stages when --pipeline-split
    /// is not given, as `simulate --pipeline` cuts them: a built-in profile or a .toml, best this
    /// machine's from `optimusc calibrate`. Without it, a rough CPU (0.3 TFLOP/s, 20 GB/s) weighs each
    /// layer's FLOPs and bytes: the head of a large vocabulary makes the last stage's share of layers
    /// smaller.
    #[arg(long, value_name = "NAME|FILE", requires = "pipeline", conflicts_with = "pipeline_split")]
    pub pipeline_hardware: Option<String>,
}

/// What `run --pipeline` balances its stages by without --pipeline-hardware: a CPU by its roofline
/// (no calibrated kernel costs), only the ratio of its FLOP rate to its bandwidth mattering.
const ROUGH_CPU: &str = r#"
name = "rough-cpu"
description = "a CPU by its roofline: what run --pipeline balances stages by without --pipeline-hardware"
[device]
name = "CPU"
memory_gb = 16.0
memory_bandwidth_gb_s = 20.0
achievable_bandwidth = 1.0
achievable_compute = 1.0
kernel_launch_us = 10.0
[device.peak_tflops]
f32 = 0.3
bf16 = 0.15
[intra_node]
gpus_per_node = 1024
bandwidth_gb_s = 10.0
latency_us = 50.0
[inter_node]
nic_bandwidth_gb_s = 10.0
latency_us = 50.0
"#;

/// The simulation options stages are balanced with: `simulate`'s defaults (each placement tried where
/// a stage's grid spans nodes), as `simulate --pipeline` and `plan --max-pipeline` cut them.
pub fn balancing_options() -> optimus::cost::Options {
    optimus::cost::Options { auto_placement: true, ..optimus::cost::Options::default() }
}

impl RunPipelineArgs {
    /// Whether the run is a pipeline (of any number of stages).
    pub fn requested(&self) -> bool {
        self.pipeline.is_some()
    }

    /// The stages and schedule, or why the flags contradict each other.
    pub fn stages_and_schedule(&self) -> Result<(u64, Schedule), String> {
        let flags = PipelineArgs {
            pipeline: self.pipeline,
            pipeline_schedule: self.pipeline_schedule,
            virtual_stages: self.virtual_stages,
            ..PipelineArgs::default()
        };
        let p = flags.pipeline()?;
        Ok((p.stages, p.schedule))
    }

    /// The training plan `plan` cut into the stages the flags ask for, each update running `accum`
    /// micro-batches: the repeated layers as --pipeline-split gives them, else balanced by their
    /// simulated time on `hw` (see [`RunPipelineArgs::balancing_hardware`]).
    pub fn program(
        &self,
        plan: &optimus::plan::Plan,
        accum: u64,
        hw: &optimus::cost::Hardware,
    ) -> Result<(PipelineProgram, Schedule), String> {
        if plan.mode != optimus::plan::Mode::Train {
            return Err("--pipeline runs a training plan; this plan infers".into());
        }
        let (stages, schedule) = self.stages_and_schedule()?;
        optimus::plan::pipeline::stage_order(schedule, stages, accum, 0)
            .map_err(|e| format!("--pipeline {stages} with --accum {accum}: {e}"))?;
        let chunks = schedule.chunks();
        let layers = optimus::plan::stages::instruction_pieces(plan).layers.len();
        let split = match self.split(layers, stages * chunks)? {
            Some(given) => given,
            None => {
                let options = balancing_options();
                optimus::cost::staged::balanced_split(plan, hw, &options, (stages, chunks))
                    .map_err(|e| e.to_string())?
            }
        };
        let program = cut(plan, stages, chunks, Some(&split)).map_err(|e| e.to_string())?;
        Ok((program, schedule))
    }

    /// The profile whose simulated times balance the stages: --pipeline-hardware's, else [`ROUGH_CPU`].
    pub fn balancing_hardware(&self) -> Result<optimus::cost::Hardware, String> {
        match &self.pipeline_hardware {
            Some(name) => optimus::cost::Hardware::load(name).map_err(|e| format!("--pipeline-hardware: {e}")),
            None => optimus::cost::Hardware::parse(ROUGH_CPU, "rough-cpu").map_err(|e| e.to_string()),
        }
    }

    /// The pieces of each virtual stage that --pipeline-split gives, for a model of `layers` repeated
    /// layers cut into `virtual_stages` runs; `None` without the flag.
    pub fn split(&self, layers: usize, virtual_stages: u64) -> Result<Option<Vec<std::ops::Range<usize>>>, String> {
        let Some(counts) = &self.pipeline_split else { return Ok(None) };
        if counts.len() as u64 != virtual_stages {
            return Err(format!(
                "--pipeline-split gives {} runs of layers; the pipeline has {virtual_stages} (stages x virtual stages)",
                counts.len()
            ));
        }
        if let Some(empty) = counts.iter().position(|&n| n == 0) {
            return Err(format!(
                "--pipeline-split gives virtual stage {empty} no layers; every virtual stage needs at least one"
            ));
        }
        let total = counts.iter().try_fold(0u64, |sum, &n| sum.checked_add(n));
        if total != Some(layers as u64) {
            let given = total.map_or_else(|| "more than 2^64".to_string(), |t| t.to_string());
            return Err(format!(
                "--pipeline-split must give {layers} layers in all (the model's repeated layers); it gives {given}"
            ));
        }
        let mut starts = Vec::with_capacity(counts.len());
        let mut next = 0usize;
        for &n in counts {
            starts.push(next);
            next += n as usize;
        }
        Ok(Some(optimus::plan::stages::ranges_of_starts(&starts, layers)))
    }
}
