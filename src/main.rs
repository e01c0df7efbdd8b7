//! The `optimusc` command line: the only place that prints.

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use optimus::elab::Override;
use optimus::plan::text::group_digits;
use std::path::PathBuf;
use std::process::ExitCode;

/// `eprintln!` for everything the command line reports on standard error: control characters in names
/// that come from files, plans or flags are escaped, so nothing printed can drive the terminal.
macro_rules! eprintln_safe {
    ($($arg:tt)*) => {
        optimus::plan::text::write_stderr(&format!("{}\n", format_args!($($arg)*)))
    };
}

mod cli;

/// mimalloc instead of the system allocator: compiling a large plan allocates and frees hundreds of
/// thousands of small buffers, names and shapes, where glibc's allocator (and the page faults of its
/// growing heap) took about a tenth of `compile`'s time.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// optimusc: compile transformer models described in .opt files into 2D-parallel (Optimus) programs.
#[derive(Parser, Debug)]
#[command(name = "optimusc", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Parse, elaborate and shape-check a model; print its parameter count or precise errors.
    ///
    /// Exit status: 0 if the model is valid, 1 if it has errors, 2 on usage errors.
    Check {
        /// The model file (.opt).
        model: PathBuf,
        /// Override a config value, e.g. `--set layers=2`. Repeatable.
        #[arg(long = "set", value_name = "NAME=VALUE")]
        set: Vec<Override>,
        /// Also print an intermediate form to standard output.
        #[arg(long, value_enum)]
        emit: Option<Emit>,
    },
    /// Shard a model over a device mesh and write the verified per-device plan as JSON.
    ///
    /// Runs shape inference, autodiff (train mode), 2D or 1D layouts, inserts collectives, plans
    /// memory, and verifies the plan. Nothing is written unless every step succeeds.
    /// Exit status: 0 on success, 1 on model or sharding errors, 2 on usage errors.
    Compile(CompileArgs),
    /// Run a plan (or a model, compiled on the fly) on a device mesh: train for some steps, or infer.
    ///
    /// On the CPU backend every device of the mesh is a thread with its own buffers. Prints the loss
    /// and throughput of every step. Exit status: 0 on success, 1 on errors, 2 on usage errors.
    Run(Box<cli::run::RunArgs>),
    /// Prove a plan right: run the model on the mesh and on one device from the same seed, and compare
    /// the loss, every output, and every parameter's gradient and updated value.
    ///
    /// Exit status: 0 if every difference is within the tolerance, 1 if one is not (or the model has
    /// errors, or a run fails), 2 on usage errors (flags, or data that does not fit the model).
    Verify(cli::verify::VerifyArgs),
    /// Predict the step time, memory, throughput and MFU of a plan on a cluster (a hardware profile);
    /// optionally the largest batch that fits, optimus against megatron, or a scaling sweep.
    ///
    /// Exit status: 0 on success, 1 on model or compile errors, 2 on usage errors (bad profiles).
    Simulate(cli::simulate::SimulateArgs),
    /// Measure this machine's CPU runtime (or, with `--backend cuda`, its first GPU) and write a
    /// hardware profile for `simulate --hardware FILE`.
    ///
    /// Profiles short one-device training runs of built-in models (every kernel kind, products from
    /// small shards to whole layers) and times the thread communicator's collectives on meshes of up
    /// to 16 threads; fits a cost per kernel kind and per collective. Takes one to two minutes on 2
    /// cores (`--quick`: less). On a GPU each kernel is timed on the GPU, and meshes whose devices
    /// share it are measured as one engine (about a minute on an H100).
    /// Example: `optimusc calibrate -o here.toml && optimusc simulate examples/gpt2.opt --hardware
    /// here.toml --mesh 2x2`. Exit status: 0 on success, 1 on errors, 2 on usage errors.
    Calibrate(cli::calibrate::CalibrateArgs),
    /// Choose how to run a model on N devices: enumerate strategies, tensor meshes, data-parallel
    /// degrees, micro-batches with accumulation, recompute, precision and ZeRO; compile, fit against
    /// device memory and simulate the promising ones; print them ranked, fastest first.
    ///
    /// Example: `optimusc plan examples/gpt3.opt --devices 64 --hardware dgx-a100 -o plan.json`.
    /// Exit status: 0 on success, 1 if no configuration compiles and fits, 2 on usage errors.
    Plan(cli::plan::PlanArgs),
    /// Draw the curves of a metrics log (`optimusc run --log FILE.jsonl`) as an SVG: training and
    /// validation loss against step, above throughput (tokens/s) against step.
    ///
    /// Example: `optimusc plot run.jsonl -o curves.svg`. A line that is not a JSON object is an error
    /// naming it; a log with nothing to plot is an error. Exit status: 0 on success, 1 on errors, 2 on
    /// usage errors.
    Plot(cli::plot::PlotArgs),
    /// Write a sharded training checkpoint (any mesh) as Hugging Face files: one safetensors file, or
    /// with `-o DIR/` a folder that `from_pretrained` opens.
    ///
    /// Reads the checkpoint's manifest and every device file (checking their sizes and SHA-256),
    /// assembles each parameter's logical tensor without padding, and writes it as F32 under its
    /// checkpoint name; a folder also gets `config.json` (GPT-2, Llama and BERT models) and, with
    /// `--tokenizer`, the tokenizer's files. Exit status: 0 on success, 1 on errors, 2 on usage errors.
    Export(cli::export::ExportArgs),
    /// Continue prompts with a causal language model on any mesh and strategy: greedy, or sampled
    /// (temperature, top-k, top-p) with a seed.
    ///
    /// Prompts are text (tokenized by --tokenizer, GPT-2's by default) or token ids; several prompts
    /// are generated together. Each new token runs one decoding step over a key/value cache of the
    /// sequence so far (the whole sequence again with --no-cache, on cuda, or for a model whose attention
    /// is not `self_attention`). Example: `optimusc generate examples/gpt2.opt --weights model/ --prompt
    /// "The mesh" --max-new-tokens 20 --mesh 2x2`. Exit status: 0 on success, 1 on errors, 2 on usage
    /// errors.
    Generate(cli::generate::GenerateArgs),
    /// The loss and perplexity of a model over a whole token file, on any mesh and strategy.
    ///
    /// Reads the file in windows of the model's seq tokens, `--stride` apart (seq by default), every
    /// token after the first predicted once, batch windows per forward pass; prints the mean loss over
    /// every predicted token and its exponential. Example: `optimusc eval examples/gpt2.opt --weights
    /// model/ --data book.val.u16 --mesh 2x2`. Exit status: 0 on success, 1 on errors, 2 on usage errors.
    Eval(cli::eval::EvalArgs),
    /// Turn text into the token files `run --data` reads: GPT-2's BPE built in, or any Hugging Face
    /// tokenizer.json.
    ///
    /// Reads the corpus in pieces of about 1 MB, cut only where the tokenizer would split the text
    /// anyway, so a corpus of any size takes bounded memory and gives the ids of the whole text;
    /// documents (files, or the lines of a .jsonl file) are joined with the end-of-text token.
    /// Example: `optimusc tokenize book.txt -o data/book --val-fraction 0.1`, then `optimusc run
    /// examples/gpt2.opt --data data/book.u16 --val-data data/book.val.u16 --eval-every 50`.
    /// Exit status: 0 on success, 1 on errors, 2 on usage errors.
    Tokenize(cli::tokenize::TokenizeArgs),
    /// Mask a token file for BERT's masked language modelling: write OUT_PREFIX.tokens.bin (15% of
    /// positions chosen; of those 80% become --mask-id, 10% a random token, 10% stay) and
    /// OUT_PREFIX.labels.bin (the original token at chosen positions, the ignore id elsewhere), for
    /// `run --objective mlm --data OUT_PREFIX.tokens.bin --labels OUT_PREFIX.labels.bin`.
    MaskData(cli::mask::MaskDataArgs),
    /// Show what each device holds and sends: memory by category and its peak, communication per
    /// collective with the model line responsible, and FLOPs per step.
    Inspect {
        /// A plan written by `optimusc compile`.
        plan: PathBuf,
        /// Print the report as JSON (format documented in docs/plan-format.md).
        #[arg(long)]
        json: bool,
        /// Also write the sharded program as a Graphviz graph to this file.
        #[arg(long, value_name = "FILE.dot")]
        dot: Option<PathBuf>,
        /// Also find the largest batch whose plan fits in this much memory per device (e.g. 24GiB, 80GB),
        /// with the plan's mesh, strategy, recomputation and precision, by recompiling the plan's model
        /// (its `source`, which must still be there) at other batch sizes.
        #[arg(long, value_name = "SIZE", value_parser = cli::flags::memory_size)]
        memory: Option<u64>,
        /// With --pipeline P: also the plan cut into P stages as `run --pipeline` cuts it (balanced by
        /// --pipeline-hardware's simulated time, or --pipeline-split), what each stage device holds
        /// under the schedule over --accum micro-batches and sends to its neighbours, and the schedule
        /// drawn over the step simulated on that profile.
        #[command(flatten)]
        pipeline: cli::inspect_pipeline::InspectPipelineArgs,
    },
}

/// `compile`: a model, the target, and where to write the plan.
#[derive(clap::Args, Debug, Clone)]
struct CompileArgs {
    /// The model file (.opt).
    model: PathBuf,
    #[command(flatten)]
    target: cli::TargetArgs,
    /// Where to write the plan (JSON).
    #[arg(short = 'o', long = "output", value_name = "PLAN.json")]
    output: PathBuf,
    /// Compile one decoding step of a causal language model with key/value caches of N positions
    /// (inference; `--set seq=1` for the decode program, the prompt's length for prefill). The caches
    /// live on each device as the attention's keys and values do; `inspect` counts them.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    max_context: Option<u64>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Emit {
    /// The typed logical graph, one operator per line.
    Ir,
}

/// Stack size for the worker thread: deep but legal inputs must never overflow it.
const STACK_BYTES: usize = 256 * 1024 * 1024;

fn main() -> ExitCode {
    optimus::runtime::startup::mark("process started");
    let checked = apply_cpu_isa_and_openblas_core()
        .and_then(|()| check_kernel_threads())
        .and_then(|()| check_cpu_run_variables())
        .and_then(|()| optimus::runtime::cpu::blas::named_library_problem().map_or(Ok(()), Err));
    if let Err(message) = checked {
        eprintln_safe!("error: {message}");
        return ExitCode::from(2);
    }
    let matches = negative_numbers_as_values(Cli::command()).try_get_matches().unwrap_or_else(|e| explain(e).exit());
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let (Command::Run(args), Some(run)) = (&mut cli.command, matches.subcommand_matches("run")) {
        args.given = cli::recorded::given_flags(run);
    }
    let (finished, done) = std::sync::mpsc::channel::<()>();
    let worker = std::thread::Builder::new().stack_size(STACK_BYTES).spawn(move || {
        let status = run(cli);
        let _ = finished.send(());
        status
    });
    let Ok(worker) = worker else { return internal_error() };
    // A run whose device thread hangs is given up by the runtime (runtime::watchdog): this thread
    // then ends the process rather than wait for the hung thread. It wakes as soon as the command
    // ends (or its thread panics, dropping the sender), and every 20 ms to look.
    while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = done.recv_timeout(std::time::Duration::from_millis(20))
    {
        if let Some(message) = optimus::runtime::watchdog::abandoned() {
            eprintln_safe!("error: {message}");
            return ExitCode::from(1);
        }
    }
    worker.join().unwrap_or_else(|_| internal_error())
}

/// Lets every subcommand take `-1` as a value (`--steps -1`), so that clap does not call it an unknown
/// flag and suggest `-- -1`; the flag's parser or the command then says what is wrong with it.
fn negative_numbers_as_values(command: clap::Command) -> clap::Command {
    command.allow_negative_numbers(true).mut_subcommands(negative_numbers_as_values)
}

/// A flag's integer parser's own words ("invalid digit found in string", for `-1` or `1.5` given to a
/// count or a seed) said as what the flag takes, and so is a count's lower bound (clap prints `range(1..)`
/// as "0 is not in 1..18446744073709551615"); every other parse error (a range with both bounds among
/// them) as clap words it.
fn explain(error: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let text = |kind| match error.get(kind) {
        Some(ContextValue::String(text)) => Some(text.clone()),
        _ => None,
    };
    let (Some(value), Some(flag)) = (text(ContextKind::InvalidValue), text(ContextKind::InvalidArg)) else {
        return error;
    };
    let reason = std::error::Error::source(&error).map(|e| e.to_string()).unwrap_or_default();
    let takes = match reason.as_str() {
        "invalid digit found in string" | "cannot parse integer from empty string" => {
            "a whole number, in digits only (no sign, no decimal point)".to_string()
        }
        "number too large to fit in target type" => "a smaller whole number".to_string(),
        _ => match least_of_open_range(&reason) {
            Some(least) => format!("at least {least}"),
            None => return error,
        },
    };
    if error.kind() != ErrorKind::ValueValidation {
        return error;
    }
    let message =
        format!("invalid value '{value}' for '{flag}': give {takes}\n\nFor more information, try '--help'.\n");
    clap::Error::raw(ErrorKind::ValueValidation, message)
}

/// The lower bound of a range without an upper one, from clap's words for a value outside it: "0 is
/// not in 1..18446744073709551615" (clap prints the missing bound as the type's largest value).
fn least_of_open_range(reason: &str) -> Option<&str> {
    let (_, bounds) = reason.split_once(" is not in ")?;
    let (least, most) = bounds.split_once("..")?;
    (most == u64::MAX.to_string() || most == i64::MAX.to_string()).then_some(least)
}

/// The most kernel threads `RAYON_NUM_THREADS` may ask for: far more than any machine's cores, far
/// fewer than the tens of thousands that took minutes to start (and could not be interrupted meanwhile).
const MAX_KERNEL_THREADS: usize = 1024;

/// Refuses a `RAYON_NUM_THREADS` above [`MAX_KERNEL_THREADS`] (a value that is not a number is left
/// to rayon, which ignores it).
fn check_kernel_threads() -> Result<(), String> {
    let asked = std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.trim().parse::<u128>().ok());
    match asked {
        Some(threads) if threads > MAX_KERNEL_THREADS as u128 => {
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            Err(format!(
                "RAYON_NUM_THREADS={threads} asks for more than {MAX_KERNEL_THREADS} kernel threads (this machine \
                 has {cores} cores): give at most {MAX_KERNEL_THREADS}, or unset it for one a core"
            ))
        }
        _ => Ok(()),
    }
}

/// A CPU runtime switch: its variable, the values it takes, and how the runtime reads a value.
type CpuSwitch = (&'static str, &'static [&'static str], fn(&str) -> String);

/// The CPU runtime's switches take the values docs/clusters.md lists: a misspelt one (which the runtime
/// would read as unset) is a usage error, as a bad `OPTIMUS_CPU_ISA` is. An empty one is unset.
fn check_cpu_run_variables() -> Result<(), String> {
    // Read as the runtime reads them: the kernels' switch exactly, pinning's trimmed and in any case.
    let switches: [CpuSwitch; 2] = [
        ("OPTIMUS_DEVICE_KERNELS", &["pool", "inline"], |v| v.to_string()),
        ("OPTIMUS_PIN_DEVICES", &["off", "0", "false", "no", "on", "1", "true", "yes"], |v| {
            v.trim().to_ascii_lowercase()
        }),
    ];
    for (variable, values, as_read) in switches {
        let Some(value) = std::env::var_os(variable) else { continue };
        let text = as_read(&value.to_string_lossy());
        if !text.is_empty() && !values.contains(&text.as_str()) {
            return Err(format!("{variable}={value:?}: expected {}", values.join(", ")));
        }
    }
    Ok(())
}

/// `OPTIMUS_CPU_ISA` narrows the instructions of the CPU kernels and of the measured peak (to measure
/// on a wide CPU what a narrower one does): a value other than avx512, avx2 or baseline is a usage
/// error. Unless `OPENBLAS_CORETYPE` is set, it also picks OpenBLAS's kernels of the kernels' width: under
/// a cap, those of the cap; on an AVX-512 CPU, SkylakeX's. An OpenBLAS older than its CPU does not know
/// it and falls back to its SSE3 kernels (0.3.21 on an Emerald Rapids Xeon: Prescott, a quarter of the
/// speed), which the variable, read when the library loads, prevents. faer's products, which detect the
/// CPU themselves, are not narrowed.
fn apply_cpu_isa_and_openblas_core() -> Result<(), String> {
    use optimus::runtime::cpu::vmath;
    let variable = vmath::ISA_CAP_VARIABLE;
    let capped = match vmath::isa_cap() {
        Some(cap) => {
            cap.map_err(|value| format!("{variable}={value:?}: expected avx512, avx2 or baseline"))?;
            true
        }
        None => false,
    };
    let isa = vmath::isa();
    if (capped || isa == vmath::Isa::Avx512) && std::env::var_os("OPENBLAS_CORETYPE").is_none() {
        // SAFETY: the first thing `main` does: no other thread exists yet to read the environment.
        unsafe { std::env::set_var("OPENBLAS_CORETYPE", isa.openblas_core()) };
    }
    Ok(())
}

fn internal_error() -> ExitCode {
    eprintln_safe!("error: internal compiler error (please report it with the input that caused it)");
    ExitCode::from(101)
}

fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Check { model, set, emit } => check(&model, &set, emit),
        Command::Compile(args) => compile(&args),
        Command::Run(args) => cli::run::run(&args),
        Command::Verify(args) => cli::verify::verify(&args),
        Command::Simulate(args) => cli::simulate::simulate_command(&args),
        Command::Plan(args) => cli::plan::plan_command(&args),
        Command::Calibrate(args) => cli::calibrate::calibrate(&args),
        Command::Plot(args) => cli::plot::plot(&args),
        Command::Export(args) => cli::export::export(&args),
        Command::MaskData(args) => cli::mask::mask_data(&args),
        Command::Tokenize(args) => cli::tokenize::tokenize(&args),
        Command::Eval(args) => cli::eval::eval(&args),
        Command::Generate(args) => cli::generate::generate(&args),
        Command::Inspect { plan, json, dot, memory, pipeline } => {
            inspect(&plan, (json, dot.as_deref()), memory, &pipeline)
        }
    }
}

fn check(path: &std::path::Path, overrides: &[Override], emit: Option<Emit>) -> ExitCode {
    let Some((model, source)) = cli::load_checked(path, overrides) else { return ExitCode::from(1) };
    let name = &source.name;
    if let Some(Emit::Ir) = emit {
        cli::stdout(&optimus::ir::print::print_model(&model, &source.text));
    }
    cli::stdout(&format!(
        "{name}: model {} checks: {} parameters in {} tensors, {} operators\n",
        model.name,
        group_digits(model.parameter_count()),
        model.params.len(),
        model.graph.node_count()
    ));
    ExitCode::SUCCESS
}

fn compile(args: &CompileArgs) -> ExitCode {
    let checked = cli::refuse_overwriting_input(&args.output, &args.model, "-o")
        .and_then(|()| cli::check_output(&args.output, "-o"));
    if let Err(e) = checked {
        return e.exit();
    }
    let compiled = match args.max_context {
        Some(context) => cli::compile_decoding(&args.model, &args.target, context),
        None => cli::compile_model(&args.model, &args.target),
    };
    let Some(plan) = compiled else { return ExitCode::from(1) };
    if let Err(e) = optimus::io::plan_file::write_plan(&plan, &args.output) {
        eprintln_safe!("error: {e}");
        return ExitCode::from(1);
    }
    for p in &plan.padding {
        eprintln_safe!(
            "note: `{}` dimension {} padded from {} to {} to divide the shards; padding never affects the loss",
            p.tensor,
            p.dim,
            p.logical,
            p.padded
        );
    }
    let summary = format!(
        "{}: {} plan for a {} mesh ({}): {} instructions, peak {} per device -> {}\n",
        plan.source,
        plan.strategy.name(),
        plan.mesh,
        match (plan.mode, args.max_context) {
            (optimus::plan::Mode::Train, _) => "train".to_string(),
            (_, Some(context)) => format!("decoding step, key/value caches of {context} positions"),
            _ => "infer".to_string(),
        } + if plan.layouts == optimus::plan::Layouts::Paper { ", the paper's layouts" } else { "" },
        plan.program.len(),
        optimus::plan::report::human_bytes(plan.memory.peak_bytes),
        args.output.display()
    );
    // With the plan on standard output, the summary goes to standard error so the JSON stays whole.
    if optimus::io::output::is_standard_output(&args.output) {
        optimus::plan::text::write_stderr(&summary);
    } else {
        cli::stdout(&summary);
    }
    // The process ends here: its memory goes back whole, faster than the plan's many small buffers
    // one by one (a tenth of a large model's compile time).
    std::mem::forget(plan);
    ExitCode::SUCCESS
}

/// The `inspect --json` document: the report, with the `--memory` search's answer as `max_batch`.
fn report_json(
    report: &optimus::plan::report::Report,
    fit: Option<&cli::fit::Fit>,
    pipeline: Option<&cli::inspect_pipeline::PipelineView>,
) -> serde_json::Result<String> {
    let mut value = serde_json::to_value(report)?;
    if let (Some(fit), Some(object)) = (fit, value.as_object_mut()) {
        object.insert("max_batch".into(), serde_json::to_value(fit)?);
    }
    if let (Some(pipeline), Some(object)) = (pipeline, value.as_object_mut()) {
        object.insert("pipeline".into(), cli::inspect_pipeline::to_json(pipeline));
    }
    serde_json::to_string_pretty(&value)
}

fn inspect(
    path: &std::path::Path,
    (json, dot): (bool, Option<&std::path::Path>),
    memory: Option<u64>,
    pipeline: &cli::inspect_pipeline::InspectPipelineArgs,
) -> ExitCode {
    let checked =
        dot.map(|dot| cli::refuse_overwriting_input(dot, path, "--dot").and_then(|()| cli::check_output(dot, "--dot")));
    if let Some(Err(e)) = checked {
        return e.exit();
    }
    let plan = match optimus::io::plan_file::read_plan(path) {
        Ok(plan) => plan,
        Err(e) => {
            eprintln_safe!("error: {e}");
            return ExitCode::from(1);
        }
    };
    if let Err(errors) = optimus::plan::verify::verify(&plan) {
        eprintln_safe!("error: `{}` failed verification:", path.display());
        for e in errors.iter().take(20) {
            eprintln_safe!("  {e}");
        }
        return ExitCode::from(1);
    }
    if let Some(dot_path) = dot {
        let text = optimus::plan::report::render_dot(&plan);
        if let Err(e) = optimus::io::output::write_file(dot_path, text.as_bytes()) {
            eprintln_safe!("error: {e}");
            return ExitCode::from(1);
        }
    }
    let report = optimus::plan::report::report(&plan);
    let fit = match memory.map(|capacity| cli::fit::largest_batch(&plan, capacity)).transpose() {
        Ok(fit) => fit,
        Err(e) => {
            eprintln_safe!("error: --memory: {e}");
            return ExitCode::from(1);
        }
    };
    let piped = match pipeline.pipeline.requested().then(|| cli::inspect_pipeline::view(&plan, pipeline)).transpose() {
        Ok(piped) => piped,
        Err(e) => {
            eprintln_safe!("error: --pipeline: {e}");
            return ExitCode::from(2);
        }
    };
    if json {
        match report_json(&report, fit.as_ref(), piped.as_ref()) {
            Ok(text) => cli::stdout_json(&format!("{text}\n")),
            Err(e) => {
                eprintln_safe!("error: cannot serialise the report: {e}");
                return ExitCode::from(1);
            }
        }
    } else {
        cli::stdout(&optimus::plan::report::render_text(&plan, &report));
        if let Some(fit) = &fit {
            cli::stdout(&cli::fit::render(fit));
        }
        if let Some(piped) = &piped {
            cli::stdout(&cli::inspect_pipeline::render(piped));
        }
    }
    ExitCode::SUCCESS
}
