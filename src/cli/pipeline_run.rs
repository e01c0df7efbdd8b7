//! `optimusc run --pipeline P`: the plan (the whole model for one stage's grid) cut into stages and run
//! on threads under the chosen schedule, with each stage's measured memory reported at the end.

use super::Failure;
use super::run::{Prepared, Progress, RunArgs, finish, progress_of};
use optimus::plan::Plan;
use optimus::plan::pipeline::Schedule;
use optimus::plan::pipeline_cut::PipelineProgram;
use optimus::plan::report::human_bytes;
use optimus::runtime::pipeline::{PipelineOutput, PipelineRun, run_on_threads};
use serde_json::json;

/// Cuts the plan as the flags say and runs it; what `run` does after, as without a pipeline.
pub(super) fn run_pipelined(
    args: &RunArgs,
    job: &Prepared,
    (program, schedule): (PipelineProgram, Schedule),
) -> Result<(), String> {
    let (progress, epochs) = progress_of(args, job)?;
    super::run::stop_gracefully(job);
    let batches = |index| epochs.batch(job, index);
    let pipe = PipelineRun { program: &program, schedule };
    let output = run_on_threads(&job.plan, pipe, &job.config, &batches, &job.initial, &|r| progress.step(r))?;
    finish(args, job, &progress, &output.run)?;
    report_stages(args, (&program, schedule), &output, &progress);
    Ok(())
}

/// The stage programs the flags ask for, or a usage error naming what does not fit.
pub(super) fn program_of(args: &RunArgs, plan: &Plan) -> Result<(PipelineProgram, Schedule), Failure> {
    let hw = args.pipeline.balancing_hardware().map_err(Failure::usage)?;
    args.pipeline.program(plan, args.accum, &hw).map_err(Failure::usage)
}

/// What a pipelined run does not do yet, refused before anything is read or written.
pub(super) fn refuse_unsupported(args: &RunArgs) -> Result<(), Failure> {
    if args.backend != super::run::Backend::Cpu {
        return Err(Failure::usage(
            "--pipeline does not go with --backend cuda yet: pipelines run on the CPU (threads, or one process per \
             device of every stage under mpirun)"
                .into(),
        ));
    }
    Ok(())
}

/// One line per stage on standard error (a `{"pipeline": ...}` record with --json or --log): its layers,
/// the most memory it held (measured) beside its stage program's plan under the schedule, and what that
/// was made of: storage, gradient sums, the activations kept for backward passes to come and how many
/// micro-batches'.
pub(super) fn report_stages(
    args: &RunArgs,
    (program, schedule): (&PipelineProgram, Schedule),
    output: &PipelineOutput,
    progress: &Progress,
) {
    let planned = program.memory_plan(schedule, args.accum).unwrap_or_default();
    let mut stages = Vec::new();
    for (s, memory) in output.stages.iter().enumerate() {
        let layers = program.describe_stage(s as u64);
        let plan = planned.get(s).copied().unwrap_or_default();
        if !args.json {
            let pass = if program.chunks > 1 { "chunk pass" } else { "micro-batch" };
            let in_flight = optimus::plan::text::plural(memory.peak_in_flight, pass);
            eprintln_safe!(
                "pipeline stage {s} ({layers}): memory {} at most (planned {}): storage {}, gradient sums {}, \
                 activations kept {} ({in_flight} in flight)",
                human_bytes(memory.peak_bytes()),
                human_bytes(plan.peak_bytes),
                human_bytes(memory.storage_bytes),
                human_bytes(memory.gradient_sum_bytes),
                human_bytes(memory.peak_kept_bytes),
            );
        }
        stages.push(json!({
            "stage": s,
            "layers": layers,
            "peak_bytes": memory.peak_bytes(),
            "storage_bytes": memory.storage_bytes,
            "gradient_sum_bytes": memory.gradient_sum_bytes,
            "peak_kept_bytes": memory.peak_kept_bytes,
            "peak_in_flight": memory.peak_in_flight,
            "planned": plan,
        }));
    }
    progress.emit(&json!({"pipeline": {
        "schedule": schedule.name(),
        "stages": stages,
        "micro_batches": args.accum,
        "bytes_between_stages": output.bytes_between_stages,
    }}));
    if args.profile {
        print_stage_profiles(program, output, progress);
    }
}

/// `--profile` of a pipeline: one table over every stage device, each device's times those of its
/// stage's program, with the stages' own work (messages between stages, the host copies around the
/// passes) in rows of their own, and one line per device.
fn print_stage_profiles(program: &PipelineProgram, output: &PipelineOutput, progress: &Progress) {
    use optimus::runtime::{peak, profile};
    let runs: Vec<(&Plan, &profile::Profile)> =
        output.profiles.iter().filter_map(|p| Some((&program.stages.get(p.stage? as usize)?.plan, p))).collect();
    if runs.is_empty() {
        eprintln_safe!("note: --profile: no device profiled");
        return;
    }
    let devices = program.stages.first().map_or(0, |s| s.plan.mesh.devices()) * program.stages.len() as u64;
    if (runs.len() as u64) < devices {
        eprintln_safe!("note: --profile reports stage 0's device (0, 0) only: under mpirun profiles are not gathered");
    }
    // Pipelines run on the CPU only (see `refuse_unsupported`).
    let peak = peak::of_backend(optimus::runtime::backend::BackendKind::Cpu);
    super::run::emit_profile(&profile::report_of_programs(&runs, &peak), progress);
}
