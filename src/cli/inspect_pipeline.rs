//! `optimusc inspect plan.json --pipeline P`: the plan cut into stages as `run --pipeline` cuts it,
//! what each stage device holds under the schedule and sends to its neighbours per micro-batch, and the
//! schedule drawn over a step simulated on the profile that balanced the stages.

use super::pipeline::RunPipelineArgs;
use optimus::cost::staged::{Pipeline, PipelineSimulation, simulate_pipeline_split};
use optimus::plan::Plan;
use optimus::plan::pipeline::{Pass, Schedule};
use optimus::plan::pipeline_cut::{Action, StageMemoryPlan, StageProgram};
use optimus::plan::report::human_bytes;
use serde_json::{Value, json};
use std::fmt::Write;

/// The pipeline flags of `optimusc inspect`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct InspectPipelineArgs {
    #[command(flatten)]
    pub pipeline: RunPipelineArgs,
    /// With --pipeline: micro-batches an update, as `run --accum` (the schedule runs this many).
    #[arg(long, value_name = "M", default_value_t = 1, requires = "pipeline",
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub accum: u64,
}

/// One stage of the inspected pipeline.
struct StageView {
    layers: String,
    memory: StageMemoryPlan,
    /// Bytes a device of the stage sends a micro-batch: forward (activations), back (their gradients).
    sends: (u64, u64),
}

/// The whole pipeline section: stages, and the simulated step with its passes.
pub struct PipelineView {
    schedule: Schedule,
    micro_batches: u64,
    balanced_by: String,
    given_split: bool,
    stages: Vec<StageView>,
    simulated: PipelineSimulation,
}

/// Cuts `plan` as the flags say and simulates it, or says why it cannot.
pub fn view(plan: &Plan, args: &InspectPipelineArgs) -> Result<PipelineView, String> {
    let m = args.accum;
    let hw = args.pipeline.balancing_hardware()?;
    let (program, schedule) = args.pipeline.program(plan, m, &hw)?;
    let memory = program.memory_plan(schedule, m).map_err(|e| e.to_string())?;
    let pipeline = Pipeline { stages: program.stages.len() as u64, schedule, micro_batches: m };
    let options = super::pipeline::balancing_options();
    let simulated =
        simulate_pipeline_split(plan, &hw, &options, pipeline, Some(&program.pieces)).map_err(|e| e.to_string())?;
    let views = program
        .stages
        .iter()
        .zip(memory)
        .map(|(stage, memory)| StageView { layers: program.describe_stage(stage.stage), memory, sends: sends(stage) })
        .collect();
    Ok(PipelineView {
        schedule,
        micro_batches: m,
        balanced_by: hw.name.clone(),
        given_split: args.pipeline.pipeline_split.is_some(),
        stages: views,
        simulated,
    })
}

/// Bytes a stage device sends in one micro-batch's forward passes and in its backward passes.
fn sends(stage: &StageProgram) -> (u64, u64) {
    let sent = |passes: &[Vec<Action>]| -> u64 {
        passes
            .iter()
            .flatten()
            .filter_map(|a| match a {
                Action::Send { buffer, .. } => Some(stage.plan.buffer(*buffer).bytes()),
                _ => None,
            })
            .sum()
    };
    (sent(&stage.forward), sent(&stage.backward))
}

/// The pipeline section of `inspect`'s text.
pub fn render(v: &PipelineView) -> String {
    let mut out = String::new();
    let how = if v.given_split {
        "layers as --pipeline-split gives them".to_string()
    } else {
        format!("layers balanced by their simulated time on {}, as run --pipeline cuts them", v.balanced_by)
    };
    let _ = writeln!(
        out,
        "\npipeline: {} under {}, {} an update ({how})",
        optimus::plan::text::plural(v.stages.len() as u64, "stage"),
        v.schedule.name(),
        optimus::plan::text::plural(v.micro_batches, "micro-batch")
    );
    let pass = if v.simulated.virtual_stages > 1 { "chunk pass" } else { "micro-batch" };
    for (s, stage) in v.stages.iter().enumerate() {
        let m = &stage.memory;
        let _ = writeln!(
            out,
            "  stage {s} ({}): {} a device at most: storage {}, gradient sums {}, activations kept {} ({} \
             in flight); sends {} forward and {} back a micro-batch",
            stage.layers,
            human_bytes(m.peak_bytes),
            human_bytes(m.storage_bytes),
            human_bytes(m.gradient_sum_bytes),
            human_bytes(m.kept_bytes),
            optimus::plan::text::plural(m.in_flight, pass),
            human_bytes(stage.sends.0),
            human_bytes(stage.sends.1),
        );
    }
    let sim = &v.simulated;
    let _ = writeln!(
        out,
        "simulated on {}: a step of {}, the pipeline idle {:.1}% of it (bubble; its busiest stage {:.1}%)",
        v.balanced_by,
        optimus::cost::planner::seconds(sim.step_time_s),
        100.0 * sim.bubble_fraction,
        100.0 * sim.bottleneck_bubble_fraction
    );
    out.push_str(&super::pipeline::render_timeline(sim));
    out
}

/// The pipeline section of `inspect --json`.
pub fn to_json(v: &PipelineView) -> Value {
    let stages: Vec<Value> = v
        .stages
        .iter()
        .enumerate()
        .map(|(s, stage)| {
            json!({
                "stage": s,
                "layers": stage.layers,
                "memory": stage.memory,
                "sends_forward_bytes": stage.sends.0,
                "sends_back_bytes": stage.sends.1,
            })
        })
        .collect();
    let passes: Vec<Vec<Value>> = v
        .simulated
        .passes
        .iter()
        .map(|stage| {
            stage
                .iter()
                .map(|p| {
                    let pass = if p.op.pass == Pass::Forward { "forward" } else { "backward" };
                    json!({"micro_batch": p.op.micro_batch, "chunk": p.op.chunk, "pass": pass,
                           "start_s": p.start_s, "end_s": p.end_s})
                })
                .collect()
        })
        .collect();
    json!({
        "schedule": v.schedule.name(),
        "micro_batches": v.micro_batches,
        "split_given": v.given_split,
        "balanced_by": v.balanced_by,
        "stages": stages,
        "simulated": {
            "step_time_s": v.simulated.step_time_s,
            "bubble_fraction": v.simulated.bubble_fraction,
            "bottleneck_bubble_fraction": v.simulated.bottleneck_bubble_fraction,
            "passes": passes,
        },
    })
}
