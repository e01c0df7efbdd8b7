//! `optimusc eval`: the loss and perplexity of a model over a whole token file, on any mesh.

use super::run::{Backend, DataDtype};
use super::{Failure, ModeArg, TargetArgs};
use optimus::io::data::{TokenData, TokenDtype, check_inputs};
use optimus::io::windows::{Window, counted, window_batch, windows};
use optimus::plan::text::plural;
use optimus::plan::{Mode, Plan};
use optimus::runtime::exec::{RunConfig, StepRecord};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct EvalArgs {
    /// A model (.opt), compiled for inference with the flags below, or a plan compiled with `--mode infer`.
    pub input: PathBuf,
    #[command(flatten)]
    pub target: TargetArgs,
    /// The weights to evaluate, as `run --weights` reads them (a safetensors file, a `save_pretrained`
    /// folder, or a training checkpoint) [default: none: the weights drawn from --seed].
    #[arg(long, value_name = "FILE.safetensors|DIR")]
    pub weights: Option<PathBuf>,
    /// The token file to evaluate: every token after the first is predicted once.
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// Element type of --data.
    #[arg(long, value_enum, default_value_t = DataDtype::U16)]
    pub data_dtype: DataDtype,
    /// Tokens between the starts of consecutive windows of seq tokens (1 <= S <= seq). Each window counts
    /// only the targets the windows before it did not, so a stride below seq gives every prediction more
    /// context, as Hugging Face's sliding-window perplexity does [default: seq, windows side by side].
    #[arg(long, value_name = "S")]
    pub stride: Option<u64>,
    /// Print one JSON record (loss, perplexity, tokens, windows, seq, stride, batches, seconds).
    #[arg(long)]
    pub json: bool,
    /// Seed of the initial weights when no --weights is given.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where kernels run: cpu (threads) or cuda.
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    pub backend: Backend,
    /// Seconds a collective waits for its peers before the evaluation fails.
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS")]
    pub timeout: f64,
}

/// Runs `optimusc eval`.
pub fn eval(args: &EvalArgs) -> ExitCode {
    match evaluate(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => e.exit(),
    }
}

/// The inference plan to evaluate: a model compiled with `--mode infer` (the default here), or a plan
/// file that is one.
fn infer_plan(args: &EvalArgs) -> Result<Plan, Failure> {
    let is_plan = super::names_a_plan(&args.input);
    let mut target = args.target.clone();
    if !is_plan {
        match target.mode_flag {
            Some(ModeArg::Train) => {
                return Err(Failure::usage("eval runs the forward pass only: drop --mode train".into()));
            }
            _ => target.mode_flag = Some(ModeArg::Infer),
        }
    }
    let plan = super::plan_from(&args.input, &target)?;
    if plan.mode != Mode::Infer {
        return Err(Failure::usage(format!(
            "`{}` is a training plan; eval runs an inference plan: compile the model with --mode infer, or give the \
             model itself",
            args.input.display()
        )));
    }
    if super::is_decoding_step(&plan) {
        return Err(Failure::usage(format!(
            "`{}` is a decoding step with key/value caches (compile --max-context), which reads one position at a \
             time; eval scores whole sequences: give it the model, or a plan compiled without --max-context",
            args.input.display()
        )));
    }
    if !plan.outputs.iter().any(|o| o.is_loss) {
        return Err(Failure::usage("eval needs a model with a loss output".into()));
    }
    Ok(plan)
}

fn evaluate(args: &EvalArgs) -> Result<(), Failure> {
    super::check_threads_only("eval", args.timeout)?;
    args.backend.kind().check_available()?;
    super::run::check_named_dtype(&args.data, args.data_dtype, "--data")?;
    let plan = infer_plan(args)?;
    let (batch, seq) = check_inputs(&plan).map_err(|e| Failure::usage(e.to_string()))?;
    // An input read in several layouts is listed once for each: count the names.
    let names: std::collections::BTreeSet<&str> = plan.inputs.iter().map(|i| i.name.as_str()).collect();
    if names.len() != 2 {
        return Err(Failure::usage(
            "eval reads causal language models (inputs `tokens` and `targets`); this model has other inputs".into(),
        ));
    }
    let vocab = optimus::io::sources::vocab(&plan).map_err(|e| Failure::usage(e.to_string()))?;
    let dtype = if args.data_dtype == DataDtype::U32 { TokenDtype::U32 } else { TokenDtype::U16 };
    let data = TokenData::open(&args.data, dtype).map_err(|e| e.to_string())?;
    let stride = args.stride.unwrap_or(seq);
    let all = windows(data.len(), seq, stride)
        .map_err(|e| Failure::usage(format!("--data `{}`: {e}", args.data.display())))?;
    let steps = (all.len() as u64).div_ceil(batch);
    // Every batch is read before the first step, so that an id outside the vocabulary is a usage error now.
    for step in 0..steps {
        window_batch(&data, &all, step, (batch, seq), vocab).map_err(|e| Failure::usage(e.to_string()))?;
    }
    let (initial, weights) = super::run::weights_for(args.weights.as_ref(), false, &plan)?;
    if args.weights.is_none() {
        eprintln_safe!("note: no --weights: evaluating the weights drawn from seed {}", args.seed);
    }
    let config = RunConfig {
        timeout: Duration::from_secs_f64(args.timeout),
        backend: args.backend.kind(),
        weights: weights.map(|w| w as std::sync::Arc<dyn optimus::plan::stores::WeightSource>),
        ..RunConfig::new(args.seed, steps, super::generate::no_optimizer())
    };
    let batches = |step: u64| {
        let (tokens, targets) = window_batch(&data, &all, step, (batch, seq), vocab).map_err(|e| e.to_string())?;
        Ok(causal_inputs(&plan, tokens, targets))
    };
    let losses = Mutex::new(BTreeMap::new());
    let progress = Progress::new(steps, args.json);
    let started = Instant::now();
    let on_step = |r: &StepRecord| {
        if let (Some(loss), Ok(mut losses)) = (r.loss, losses.lock()) {
            losses.insert(r.step, loss);
        }
        progress.step();
    };
    optimus::runtime::local::run(&plan, &config, &batches, &initial, &on_step)?;
    progress.finish();
    let losses = losses.into_inner().map_err(|_| "a device thread failed while reporting".to_string())?;
    let summary = summarize(&losses, &all, (batch, seq), steps)?;
    print_summary(args, &summary, (seq, stride), started.elapsed());
    Ok(())
}

/// A causal language model's inputs by name: `tokens`, and the targets under the plan's name for them
/// (`targets` or `labels`).
pub(super) fn causal_inputs(
    plan: &Plan,
    tokens: optimus::plan::tensor::Tensor,
    targets: optimus::plan::tensor::Tensor,
) -> BTreeMap<String, optimus::plan::tensor::Tensor> {
    plan.inputs
        .iter()
        .map(|input| {
            let tensor = if input.name == "tokens" { tokens.clone() } else { targets.clone() };
            (input.name.clone(), tensor)
        })
        .collect()
}

/// What the evaluation found: the mean loss over every counted target, and how many there were.
struct Summary {
    loss: f64,
    tokens: u64,
    windows: usize,
    batches: u64,
}

/// The mean of every counted target's loss: each batch's mean loss weighted by the targets it counted.
fn summarize(
    losses: &BTreeMap<u64, f32>,
    all: &[Window],
    (batch, seq): (u64, u64),
    steps: u64,
) -> Result<Summary, Failure> {
    let (mut total, mut tokens) = (0f64, 0u64);
    for step in 0..steps {
        let loss = losses.get(&step).ok_or_else(|| format!("batch {step} reported no loss"))?;
        let first = (step * batch) as usize;
        let count: u64 = all.iter().skip(first).take(batch as usize).map(|w| counted(w, seq)).sum();
        total += f64::from(*loss) * count as f64;
        tokens += count;
    }
    Ok(Summary { loss: total / tokens.max(1) as f64, tokens, windows: all.len(), batches: steps })
}

fn print_summary(args: &EvalArgs, s: &Summary, (seq, stride): (u64, u64), took: Duration) {
    let perplexity = s.loss.exp();
    if args.json {
        let record = serde_json::json!({
            "loss": s.loss, "perplexity": perplexity, "tokens": s.tokens, "windows": s.windows, "seq": seq,
            "stride": stride, "batches": s.batches, "seconds": took.as_secs_f64(),
        });
        super::stdout_json(&format!("{record}\n"));
    } else {
        super::stdout(&format!(
            "eval `{}`: {} predicted in {} of {seq} (stride {stride}), {}: loss {:.6}, perplexity {:.4} ({:.1} s)\n",
            args.data.display(),
            plural(s.tokens, "token"),
            plural(s.windows as u64, "window"),
            plural(s.batches, "batch"),
            s.loss,
            perplexity,
            took.as_secs_f64()
        ));
    }
}

/// A bar over the batches with an ETA, on a terminal and without --json.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    fn new(steps: u64, json: bool) -> Progress {
        let bar = super::terminal_bar(steps, "{bar:30} {pos}/{len} batches  ETA {eta}", json);
        Progress { bar }
    }

    fn step(&self) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
