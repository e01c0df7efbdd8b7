//! `optimusc plan`: the automatic planner's command line: flags, the ranked table or JSON, and the
//! winning plan written with `-o`.

use super::ModeArg;
use clap::ValueEnum;
use optimus::cost::planner::{self, Config, NoPlan, Outcome, Request, Scored, seconds};
use optimus::cost::search::Source;
use optimus::cost::{Hardware, Options};
use optimus::elab::Override;
use optimus::plan::report::human_bytes;
use optimus::plan::text::group_digits;
use optimus::plan::{Mode, Precision};
use serde_json::json;
use std::fmt::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// Flags of `optimusc plan`.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    /// The model file (.opt); its `batch` config value is the global batch.
    pub model: PathBuf,
    /// How many devices to plan for.
    #[arg(long, value_name = "N", value_parser = devices)]
    pub devices: u64,
    /// A built-in hardware profile (frontera-rtx5000, dgx-a100, dgx-h100) or the path of a .toml profile.
    #[arg(long, value_name = "NAME|FILE")]
    pub hardware: String,
    /// Memory per device (e.g. 40GB, 24GiB) [default: the profile's].
    #[arg(long, value_name = "SIZE", value_parser = super::flags::memory_size)]
    pub memory: Option<u64>,
    /// Override a config value, e.g. `--set batch=1536`. Repeatable.
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub set: Vec<Override>,
    /// train (forward, backward, optimizer) or infer (forward only).
    #[arg(long, value_enum, default_value_t = ModeArg::Train)]
    pub mode: ModeArg,
    /// Precisions to consider: f32, bf16, or any (both).
    #[arg(long, value_enum, default_value_t = PrecisionChoice::F32)]
    pub precision: PrecisionChoice,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Write the winning configuration's plan here (JSON), ready for `optimusc run`.
    #[arg(short = 'o', long = "output", value_name = "PLAN.json")]
    pub output: Option<PathBuf>,
    /// Also show what the search did with each group (layout, precision, recompute, ZeRO): the
    /// micro-batches it searched, how many compilations, and the result.
    #[arg(long)]
    pub trace: bool,
    /// Rows of the table (configurations in the JSON list).
    #[arg(long, value_name = "K", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub top: u64,
    /// Also search pipelines of up to P stages (training only; refused with --mode infer): layouts that cut the model's repeated layers into P
    /// contiguous stages (every P that divides the devices and is at most the layer count; 1F1B, and
    /// interleaved with 2 chunks a stage where the layers split into 2 P equal runs), each stage a
    /// copy of the tensor mesh and its replicas, simulated as `simulate --pipeline` does, with the
    /// micro-batches of an update as the pipeline's. Each stage grid compiles the whole model, so the
    /// search takes several times longer. With -o, a pipelined winner's plan is one stage grid's (the
    /// whole model, as `run --pipeline` cuts it), and the hint printed runs it as that pipeline
    /// [default: 1, no pipelines].
    #[arg(long, value_name = "P", value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub max_pipeline: Option<u64>,
}

/// The precisions the planner may choose from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PrecisionChoice {
    F32,
    Bf16,
    Any,
}

impl PrecisionChoice {
    /// Searched in this order (bf16 first: its faster products let the bound prune float32 groups).
    fn precisions(self) -> &'static [Precision] {
        match self {
            PrecisionChoice::F32 => &[Precision::F32],
            PrecisionChoice::Bf16 => &[Precision::Bf16],
            PrecisionChoice::Any => &[Precision::Bf16, Precision::F32],
        }
    }
}

/// `--devices`: 1 to [`planner::MAX_DEVICES`].
fn devices(text: &str) -> Result<u64, String> {
    match text.trim().parse::<u64>() {
        Ok(n) if (1..=planner::MAX_DEVICES).contains(&n) => Ok(n),
        _ => Err(format!("must be a device count from 1 to {}, not `{text}`", planner::MAX_DEVICES)),
    }
}

/// Runs `optimusc plan`.
pub fn plan_command(args: &PlanArgs) -> ExitCode {
    if args.mode != ModeArg::Train && args.max_pipeline.is_some_and(|p| p > 1) {
        eprintln_safe!(
            "error: --max-pipeline searches pipelines of training steps; drop it with --mode infer (a pipeline \
             of inference steps is not searched)"
        );
        return ExitCode::from(2);
    }
    let hw = match Hardware::load(&args.hardware) {
        Ok(hw) => hw,
        Err(e) => {
            eprintln_safe!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(output) = &args.output {
        let checked =
            super::refuse_overwriting_input(output, &args.model, "-o").and_then(|()| super::check_output(output, "-o"));
        if let Err(e) = checked {
            return e.exit();
        }
    }
    let text = match read_source(&args.model) {
        Ok(text) => text,
        Err(status) => return status,
    };
    let name = args.model.display().to_string();
    let source = Source { name: &name, text: &text, overrides: &args.set };
    if let Some(code) = check_model(&source, &args.set) {
        return code;
    }
    let mode = if args.mode == ModeArg::Train { Mode::Train } else { Mode::Infer };
    let max_pipeline = args.max_pipeline.unwrap_or(1);
    let request = Request {
        source: &source,
        devices: args.devices,
        hardware: &hw,
        capacity: args.memory.unwrap_or_else(|| hw.memory_bytes()),
        mode,
        precisions: args.precision.precisions(),
        // Each candidate at its faster placement, as `simulate` (default --placement auto) shows it.
        options: Options { auto_placement: true, ..Options::default() },
        max_pipeline,
    };
    let bar = search_bar(args.json);
    let show = |p: planner::SearchProgress| {
        if let Some(bar) = &bar {
            bar.set_length(p.total as u64);
            bar.set_position(p.done as u64);
            bar.set_message(p.next.to_string());
        }
    };
    let outcome = planner::plan_with_progress(&request, &show);
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(no_plan) => return report_no_plan(args, &no_plan),
    };
    if let Some(output) = &args.output {
        match write_winner(&source, &outcome, mode, output) {
            Ok(Some(plan)) => warn_of_stage_memory(args, &outcome, &plan, output),
            Ok(None) => {}
            Err(code) => return code,
        }
    }
    if args.json {
        return super::print_json(&outcome_json(args, &hw, &outcome));
    }
    super::stdout(&render(args, &hw, &outcome));
    ExitCode::SUCCESS
}

/// A progress bar on standard error while the search runs, when that is a terminal and the output is
/// not JSON: layouts searched of all, the one being searched, and the time left.
fn search_bar(json: bool) -> Option<indicatif::ProgressBar> {
    super::terminal_bar(0, "{bar:30} {pos}/{len} layouts  {msg}  ETA {eta}", json)
}

/// The model must check before the search: its errors (or warnings) are printed once, with their spans.
fn check_model(source: &Source, overrides: &[Override]) -> Option<ExitCode> {
    let checked = optimus::front::check_source(source.text, overrides);
    let errors = checked.diagnostics.iter().filter(|d| d.is_error()).count();
    optimus::diag::render_stderr(source.name, source.text, &checked.diagnostics);
    if checked.model.is_some() && errors == 0 {
        return None;
    }
    eprintln_safe!("error: {}: {errors} error{} found", source.name, if errors == 1 { "" } else { "s" });
    Some(ExitCode::from(1))
}

/// The text of a model file (plans are refused: the planner recompiles).
fn read_source(path: &std::path::Path) -> Result<String, ExitCode> {
    super::read_model_text(path, "plan compiles the model for many configurations")
}

/// Compiles the winning configuration and writes its plan (atomically, as `compile -o`); returns the
/// plan written, if any.
fn write_winner(
    source: &Source,
    outcome: &Outcome,
    mode: Mode,
    output: &std::path::Path,
) -> Result<Option<optimus::plan::Plan>, ExitCode> {
    let Some(best) = outcome.ranked.first() else { return Ok(None) };
    let plan = planner::compile_winner(source, &best.config, mode).map_err(|e| {
        eprintln_safe!("error: cannot compile the winning configuration: {e}");
        ExitCode::from(1)
    })?;
    optimus::io::plan_file::write_plan(&plan, output).map_err(|e| {
        eprintln_safe!("error: {e}");
        ExitCode::from(1)
    })?;
    Ok(Some(plan))
}

/// For a pipelined winner: where its stage programs, cut as the hint's `run --pipeline` cuts them,
/// plan more memory a device than the search's estimate of the pipeline, a warning with both. On an
/// accelerator's profile the search counts a stage's memory kept in place; the CPU runtime plans each
/// stage program's own storage, gradient sums and host copies of kept activations, which can be more.
/// On a profile of the CPU runtime the search counts those, so this warns only if the cuts differ.
fn warn_of_stage_memory(args: &PlanArgs, outcome: &Outcome, plan: &optimus::plan::Plan, output: &std::path::Path) {
    use super::pipeline::{PipelineScheduleArg, RunPipelineArgs};
    let Some(best) = outcome.ranked.first() else { return };
    let p = &best.config.parallelism;
    if p.pipeline <= 1 {
        return;
    }
    let flags = RunPipelineArgs {
        pipeline: Some(p.pipeline),
        pipeline_schedule: Some(if p.chunks > 1 {
            PipelineScheduleArg::Interleaved
        } else {
            PipelineScheduleArg::OneFOneB
        }),
        virtual_stages: (p.chunks > 1).then_some(p.chunks),
        pipeline_split: None,
        pipeline_hardware: Some(args.hardware.clone()),
    };
    let accum = best.config.accumulation;
    let planned = flags
        .balancing_hardware()
        .and_then(|hw| flags.program(plan, accum, &hw))
        .and_then(|(program, schedule)| program.memory_plan(schedule, accum).map_err(|e| e.to_string()));
    let Ok(stages) = planned else { return };
    let most = stages.iter().map(|s| s.peak_bytes).max().unwrap_or(0);
    let estimate = best.peak_bytes_per_device;
    if most <= estimate {
        return;
    }
    let over = if most > outcome.capacity_bytes {
        format!(", over the {} a device the search planned for", human_bytes(outcome.capacity_bytes))
    } else {
        String::new()
    };
    eprintln_safe!(
        "warning: the stage programs of `{}` plan up to {} a device under its schedule{over}, more than the search's \
         estimate of {} (`optimusc inspect {} --accum {accum}{}` breaks it down by stage)",
        output.display(),
        human_bytes(most),
        human_bytes(estimate),
        super::shell_path(output),
        pipeline_flags(&best.config, &args.hardware)
    );
}

fn outcome_json(args: &PlanArgs, hw: &Hardware, outcome: &Outcome) -> serde_json::Value {
    let top = usize::try_from(args.top).unwrap_or(usize::MAX);
    json!({
        "model": args.model.display().to_string(),
        "hardware": hw.name,
        "devices": outcome.devices,
        "global_batch": outcome.global_batch,
        "capacity_bytes": outcome.capacity_bytes,
        "configurations": outcome.ranked.iter().take(top).collect::<Vec<_>>(),
        "counts": outcome.counts,
        "why": outcome.why,
        "output": args.output.as_ref().map(|p| p.display().to_string()),
        "groups": if args.trace { json!(outcome.groups) } else { serde_json::Value::Null },
    })
}

fn report_no_plan(args: &PlanArgs, no_plan: &NoPlan) -> ExitCode {
    if args.json {
        let _ = super::print_json(
            &json!({ "error": no_plan.message, "closest": no_plan.closest, "counts": no_plan.counts }),
        );
        return ExitCode::from(1);
    }
    let mut out = format!("error: {}\n", no_plan.message);
    if !no_plan.closest.is_empty() {
        out.push_str("the closest candidates, and why each fails:\n");
    }
    for r in &no_plan.closest {
        let _ = writeln!(out, "  {}: {}", r.what, r.reason);
    }
    optimus::plan::text::write_stderr(&out);
    ExitCode::from(1)
}

/// The human-readable answer: the ranked table, the counts, why the best wins.
fn render(args: &PlanArgs, hw: &Hardware, outcome: &Outcome) -> String {
    let c = &outcome.counts;
    let mut out = format!(
        "plan: {} on {} x {} ({} per device), global batch {}\n",
        args.model.display(),
        outcome.devices,
        hw.name,
        human_bytes(outcome.capacity_bytes),
        outcome.global_batch
    );
    let _ = writeln!(
        out,
        "searched {} configurations in {:.2} s: {} illegal, {} too large, {} dominated by a cheaper recompute, {} by a \
         larger micro-batch, {} bounded by compute; {} ({} failed), {}, {} ranked\n",
        c.enumerated,
        c.elapsed_s,
        c.illegal,
        c.too_large,
        c.dominated_recompute,
        c.dominated_micro_batch,
        c.bounded,
        optimus::plan::text::plural(c.compiled, "compilation"),
        c.compile_failures,
        optimus::plan::text::plural(c.simulated, "simulation"),
        c.scored
    );
    let _ = writeln!(out, "{}\n", optimus::cost::planner::TESSERACT_COVERED);
    if args.trace {
        render_trace(&mut out, outcome);
    }
    render_table(&mut out, outcome, args.top);
    if let Some(best) = outcome.ranked.first() {
        let _ = writeln!(out, "\nbest: {}, placement {}", best.config.label(), best.placement);
    }
    if let Some(why) = &outcome.why {
        let _ = writeln!(out, "why: {}", why.text);
    }
    if let (Some(path), Some(best)) = (&args.output, outcome.ranked.first()) {
        let _ = writeln!(out, "wrote {}: {}", path.display(), run_hint(path, &best.config, &args.hardware));
    }
    out
}

fn render_trace(out: &mut String, outcome: &Outcome) {
    let _ = writeln!(out, "search, group by group (groups that a cheaper recompute level fits entirely left out):");
    for g in outcome.groups.iter().filter(|g| !g.micro_batches.is_empty()) {
        let ms: Vec<String> = g.micro_batches.iter().map(u64::to_string).collect();
        let _ = writeln!(
            out,
            "  {} [micro-batches {}]: {} ({})",
            g.group,
            ms.join(" "),
            g.result,
            optimus::plan::text::plural(g.compilations, "compilation")
        );
    }
    out.push('\n');
}

/// The `run` of the written plan as the winner runs: its micro-batches as --accum and, for a pipeline,
/// its stages and schedule, balanced by the profile the search used (as the search cut them).
fn run_hint(path: &std::path::Path, best: &Config, hardware: &str) -> String {
    let accum = if best.accumulation > 1 { format!(" --accum {}", best.accumulation) } else { String::new() };
    format!("run it with `optimusc run {}{accum}{}`", super::shell_path(path), pipeline_flags(best, hardware))
}

/// The flags of `run --pipeline` and `inspect --pipeline` that cut a written plan into `best`'s stages
/// under its schedule, balanced by the search's profile (as the search cut them); none without a pipeline.
fn pipeline_flags(best: &Config, hardware: &str) -> String {
    let p = &best.parallelism;
    let hardware = super::shell_word(hardware);
    match (p.pipeline, p.chunks) {
        (1, _) => String::new(),
        (stages, 1) => format!(" --pipeline {stages} --pipeline-schedule 1f1b --pipeline-hardware {hardware}"),
        (stages, chunks) => format!(
            " --pipeline {stages} --pipeline-schedule interleaved --virtual-stages {chunks} --pipeline-hardware {hardware}"
        ),
    }
}

/// The ranking table's columns: header, and whether the column is left-aligned (text) rather than
/// right-aligned (numbers).
const COLUMNS: [(&str, bool); 17] = [
    ("rank", false),
    ("strategy", true),
    ("mesh", true),
    ("DP", false),
    ("PP", false),
    ("micro x acc", false),
    ("recompute", true),
    ("prec", true),
    ("zero", false),
    ("step time", false),
    ("compute", false),
    ("exposed comm", false),
    ("of it DP", false),
    ("bubble", false),
    ("tokens/s", false),
    ("MFU", false),
    ("peak/device", false),
];

/// The ranking as a table whose columns are as wide as their widest cell (a DP degree of 16384 or a
/// 32x32x32 mesh keeps its column).
fn render_table(out: &mut String, outcome: &Outcome, top: u64) {
    let mut rows = vec![COLUMNS.map(|(header, _)| header.to_string())];
    let shown = outcome.ranked.iter().take(usize::try_from(top).unwrap_or(usize::MAX));
    rows.extend(shown.enumerate().map(|(rank, s)| row(rank + 1, s)));
    let widths: Vec<usize> =
        (0..COLUMNS.len()).map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0)).collect();
    for cells in &rows {
        let line: Vec<String> = cells
            .iter()
            .zip(&widths)
            .zip(COLUMNS)
            .map(|((cell, &width), (_, left))| if left { format!("{cell:<width$}") } else { format!("{cell:>width$}") })
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
}

fn row(rank: usize, s: &Scored) -> [String; 17] {
    let c = &s.config;
    [
        rank.to_string(),
        c.parallelism.strategy.name().to_string(),
        c.parallelism.mesh.to_string(),
        c.parallelism.data.to_string(),
        c.parallelism.pipeline_text(),
        format!("{} x {}", c.micro_batch, c.accumulation),
        c.recompute.name().to_string(),
        c.precision.name().to_string(),
        c.zero.to_string(),
        seconds(s.step_time_s),
        seconds(s.compute_s),
        seconds(s.exposed_communication_s),
        seconds(s.data_parallel_s),
        s.bubble_s.map_or_else(|| "-".to_string(), seconds),
        group_digits(s.tokens_per_second.round() as u128),
        format!("{:.1}%", 100.0 * s.mfu),
        human_bytes(s.peak_bytes_per_device),
    ]
}
