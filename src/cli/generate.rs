//! `optimusc generate`: text (or token ids) continued by a causal language model on any mesh, greedy or
//! sampled with a seed. The model is compiled with its logits as an output, as a prefill program over
//! the prompts and a decode program of one token per step that keeps the keys and values of every
//! position in caches sharded like the attention (`optimus::decode`); a model the cache cannot serve
//! reruns its forward pass over the whole sequence for each new token.

use super::run::Backend;
use super::{Failure, ModeArg, TargetArgs};
use optimus::elab::Override;
use optimus::plan::tensor::Tensor;
use optimus::plan::{IGNORE_INDEX, Plan};
use optimus::runtime::exec::{RunConfig, StepOutputs};
use optimus::runtime::settings::{OptimizerKind, OptimizerSettings};
use optimus::text::Tokenizer;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    /// The model (.opt): a causal language model whose loss is `cross_entropy(logits, targets)`; or a
    /// plan (.json) compiled from one, whose model file, config values, mesh, strategy and precision
    /// generate then uses (it compiles its own prefill and decode programs from them).
    #[arg(value_name = "MODEL.opt|PLAN.json")]
    pub model: PathBuf,
    #[command(flatten)]
    pub target: TargetArgs,
    /// The weights, as `run --weights` reads them (a safetensors file, a `save_pretrained` folder, a
    /// training checkpoint) [default: none: the weights drawn from --seed].
    #[arg(long, value_name = "FILE.safetensors|DIR", conflicts_with = "resume")]
    pub weights: Option<PathBuf>,
    /// Generate with the parameters of a training checkpoint (`run --checkpoint-dir`): a checkpoint, or
    /// a folder of them, of which the latest complete one.
    #[arg(long, value_name = "CHECKPOINT")]
    pub resume: Option<PathBuf>,
    /// A prompt, as text (tokenized by --tokenizer). Repeatable: the prompts are generated together, one
    /// batch row each.
    #[arg(long = "prompt", value_name = "TEXT")]
    pub prompts: Vec<String>,
    /// A prompt as token ids, comma-separated (`--prompt-ids 464,2068,7586`). Repeatable. Prompts are
    /// numbered (`[k]`, and `prompt` in --json) and take their batch rows (which sampling's draws depend
    /// on) --prompt texts first, then --prompt-ids, each in the order given.
    #[arg(long = "prompt-ids", value_name = "ID,ID,...", value_parser = parse_ids)]
    pub prompt_ids: Vec<Vec<u32>>,
    /// `gpt2` (built in) or a Hugging Face tokenizer.json: encodes --prompt, decodes the output [default:
    /// gpt2 with --prompt; with --prompt-ids only, ids are printed and no text].
    #[arg(long, value_name = "gpt2|PATH/tokenizer.json")]
    pub tokenizer: Option<String>,
    /// Tokens to generate after each prompt, at most (fewer when the end-of-text token comes first).
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub max_new_tokens: u64,
    /// Sample with this temperature (> 0) instead of taking the most likely token.
    #[arg(long, value_name = "T")]
    pub temperature: Option<f64>,
    /// Sample among the K most likely tokens only.
    #[arg(long, value_name = "K")]
    pub top_k: Option<u64>,
    /// Sample among the most likely tokens whose probabilities add up to P (0 < P <= 1).
    #[arg(long, value_name = "P")]
    pub top_p: Option<f64>,
    /// Seed of the sampling (and of the weights when no --weights is given): the same seed gives the
    /// same tokens on every mesh.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The token id that ends a prompt's generation [default: the tokenizer's end-of-text token; none
    /// without a tokenizer].
    #[arg(long, value_name = "ID")]
    pub eos: Option<u32>,
    /// Print one JSON record per prompt: `ids` (prompt and generated), `generated`, `logits` (the
    /// logit of each generated token), `text` (with a tokenizer), `finish` (`eos` or `length`), and
    /// timings (`seconds` in all, `decode_seconds` after the weights were loaded, `tokens_per_s` of
    /// those).
    #[arg(long)]
    pub json: bool,
    /// Positions each key/value cache holds [default: the longest prompt's tokens plus
    /// --max-new-tokens minus one: the last new token is never run through the model]; at most the
    /// model's `context`. The caches' memory grows with it (`inspect` of `compile --max-context` shows
    /// it).
    #[arg(long, value_name = "N")]
    pub max_context: Option<u64>,
    /// Recompute the whole sequence at every step instead of keeping a key/value cache (what a model
    /// whose attention is not the `self_attention` operator does anyway).
    #[arg(long)]
    pub no_cache: bool,
    /// Where kernels run: cpu (threads) or cuda (which recomputes the whole sequence at every step: it
    /// has no key/value cache kernels yet).
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    pub backend: Backend,
    /// Seconds a collective waits for its peers before generation fails.
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS")]
    pub timeout: f64,
}

fn parse_ids(text: &str) -> Result<Vec<u32>, String> {
    let not_a_list = || format!("`{text}` is not a comma-separated list of token ids");
    let id = |id: &str| {
        let id = id.trim();
        id.parse::<u32>().map_err(|_| {
            // A number, but past any token id: say so rather than that the list is malformed.
            if super::flags::digits_only(id) {
                format!("token id {id} is more than the largest, {}", u32::MAX)
            } else {
                not_a_list()
            }
        })
    };
    let ids = text.split(',').map(id).collect::<Result<Vec<u32>, String>>()?;
    if ids.is_empty() { Err(not_a_list()) } else { Ok(ids) }
}

/// Runs `optimusc generate`.
pub fn generate(args: &GenerateArgs) -> ExitCode {
    let from_plan;
    let args = if super::names_a_plan(&args.model) {
        from_plan = match args_of_plan(args) {
            Ok(a) => a,
            Err(e) => return e.exit(),
        };
        &from_plan
    } else {
        args
    };
    match generate_text(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => e.exit(),
    }
}

/// The arguments a plan stands for: its model file and config values (but `batch` and `seq`, which
/// generate sets), its mesh, strategy and precision; flags given beside it must agree with it.
fn args_of_plan(args: &GenerateArgs) -> Result<GenerateArgs, Failure> {
    use super::{PrecisionArg, StrategyArg};
    let plan = optimus::io::plan_file::read_plan(&args.model).map_err(|e| Failure::usage(e.to_string()))?;
    let conflicts = args.target.conflicts_with(&plan);
    if !conflicts.is_empty() {
        return Err(Failure::usage(format!(
            "`{}` fixes what these flags would change: {}",
            args.model.display(),
            conflicts.join(", ")
        )));
    }
    let model = PathBuf::from(&plan.source);
    if !model.is_file() {
        return Err(Failure::usage(format!(
            "`{}` was compiled from `{}`, which is not here: generate compiles its own programs from the model \
             (run it where the plan was compiled, or give the .opt file)",
            args.model.display(),
            plan.source
        )));
    }
    let text = super::read_model_text(&model, "generate compiles the plan's model").map_err(|_| Failure::reported())?;
    let mut sets = super::plan_overrides(&plan, &text, &["batch", "seq"]).map_err(Failure::usage)?;
    sets.extend(args.target.set.iter().cloned());
    let mut given = args.clone();
    given.model = model;
    given.target.set = sets;
    given.target.mesh_flag = Some(super::MeshArg::of(plan.mesh));
    given.target.strategy_flag = Some(StrategyArg::of(plan.strategy));
    given.target.precision = Some(match plan.precision {
        optimus::plan::Precision::Bf16 => PrecisionArg::Bf16,
        _ => PrecisionArg::F32,
    });
    given.target.layouts = Some(super::LayoutsArg::of(plan.layouts));
    given.target.mode_flag = None;
    Ok(given)
}

/// How the next token is chosen.
#[derive(Clone, Copy, Debug)]
struct Sampling {
    temperature: f64,
    top_k: Option<u64>,
    top_p: Option<f64>,
    seed: u64,
    greedy: bool,
}

impl Sampling {
    fn of(args: &GenerateArgs) -> Result<Sampling, Failure> {
        let greedy = args.temperature.is_none() && args.top_k.is_none() && args.top_p.is_none();
        let temperature = args.temperature.unwrap_or(1.0);
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(Failure::usage(format!("--temperature {temperature} must be a positive number")));
        }
        if args.top_k == Some(0) {
            return Err(Failure::usage("--top-k 0 leaves no token to sample".into()));
        }
        if let Some(p) = args.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(Failure::usage(format!("--top-p {p} must be in (0, 1]")));
        }
        Ok(Sampling { temperature, top_k: args.top_k, top_p: args.top_p, seed: args.seed, greedy })
    }

    /// The token chosen from one position's logits, for `row` at generation `step`.
    fn choose(&self, logits: &[f32], row: u64, step: u64) -> u32 {
        if self.greedy {
            return argmax(logits);
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if let Some(k) = self.top_k {
            order.truncate(k.min(logits.len() as u64) as usize);
        }
        let top = f64::from(logits[order[0]]);
        let weights: Vec<f64> =
            order.iter().map(|&i| ((f64::from(logits[i]) - top) / self.temperature).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut kept = order.len();
        if let Some(p) = self.top_p {
            let mut sum = 0.0;
            let last = weights.iter().position(|w| {
                sum += w / total;
                sum >= p
            });
            kept = last.map_or(order.len(), |k| k + 1);
        }
        let kept_total: f64 = weights[..kept].iter().sum();
        let mut u = uniform(self.seed, row, step) * kept_total;
        for (k, w) in weights[..kept].iter().enumerate() {
            if u < *w {
                return order[k] as u32;
            }
            u -= w;
        }
        order[kept - 1] as u32
    }
}

/// The first index of the largest value (as torch.argmax).
fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// A uniform draw in [0, 1) from the seed, the row and the step alone (so every mesh draws the same).
fn uniform(seed: u64, row: u64, step: u64) -> f64 {
    let mixed = optimus::plan::init::mix64(seed ^ optimus::plan::init::mix64(row.wrapping_mul(0x9E37) ^ (step << 32)));
    (mixed >> 11) as f64 / (1u64 << 53) as f64
}

/// Set once every prompt has ended, so that the devices stop after the current step.
static ALL_ENDED: AtomicBool = AtomicBool::new(false);

fn all_ended() -> bool {
    ALL_ENDED.load(Ordering::Relaxed)
}

fn generate_text(args: &GenerateArgs) -> Result<(), Failure> {
    super::check_threads_only("generate", args.timeout)?;
    if args.max_new_tokens == 0 {
        return Err(Failure::usage("--max-new-tokens 0 generates nothing".into()));
    }
    let sampling = Sampling::of(args)?;
    // Before the model compiles and its weights load: a backend this machine lacks fails first.
    args.backend.kind().check_available()?;
    let tokenizer = match (&args.tokenizer, args.prompts.is_empty()) {
        (Some(name), _) => Some(Tokenizer::load(name).map_err(|e| Failure::usage(e.to_string()))?),
        (None, false) => Some(Tokenizer::gpt2().map_err(|e| e.to_string())?),
        (None, true) => None,
    };
    let mut prompts = Vec::new();
    for text in &args.prompts {
        let ids = tokenizer.as_ref().map(|t| t.encode(text)).transpose().map_err(|e| e.to_string())?;
        prompts.push(ids.unwrap_or_default());
    }
    prompts.extend(args.prompt_ids.iter().cloned());
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(Failure::usage("give at least one non-empty --prompt TEXT or --prompt-ids ID,ID,...".into()));
    }
    let eos = args.eos.or_else(|| tokenizer.as_ref().and_then(|t| t.end_of_text().map(|(_, id)| id)));
    let asked = prompts.len();
    // Rows the mesh splits the batch over (replicas, depth layers, and the grid rows of optimus and
    // tesseract) must divide it: the prompts are padded with copies of the first, generated and left out.
    let split = args.target.target().batch_multiple();
    let batch = (asked as u64).div_ceil(split.max(1)) * split.max(1);
    while (prompts.len() as u64) < batch {
        prompts.push(prompts[0].clone());
    }
    let programs = Programs::compile(args, &prompts)?;
    let vocab = programs.vocab;
    if let Some(id) = prompts.iter().flatten().find(|&&id| u64::from(id) >= vocab) {
        return Err(Failure::usage(format!("prompt token {id} is not below the model's vocabulary size {vocab}")));
    }
    if let Some(id) = args.eos.filter(|&id| u64::from(id) >= vocab) {
        return Err(Failure::usage(format!(
            "--eos {id} is not below the model's vocabulary size {vocab}: no token generated could end a row"
        )));
    }
    if let Some(checkpoint) = args.resume.as_ref().filter(|c| !c.is_dir()) {
        return Err(Failure::usage(format!("--resume `{}` is not a checkpoint folder", checkpoint.display())));
    }
    let source = args.weights.as_ref().or(args.resume.as_ref());
    let (initial, weights) = super::run::weights_for(source, false, programs.first())?;
    if source.is_none() {
        eprintln_safe!("note: no --weights: generating with the weights drawn from seed {}", args.seed);
    }
    let tokenizer = tokenizer.map(Arc::new);
    let stream =
        tokenizer.as_ref().filter(|_| asked == 1 && !args.json).map(|t| Streamer::start(Arc::clone(t), &prompts[0]));
    let steps = programs.schedule.steps();
    let generation = Arc::new(Generation::new(&programs, (prompts, asked), (sampling, eos), stream)?);
    let config = RunConfig {
        timeout: Duration::from_secs_f64(args.timeout),
        backend: args.backend.kind(),
        weights: weights.map(|w| w as Arc<dyn optimus::plan::stores::WeightSource>),
        stop: Some(all_ended),
        step_outputs: Some(Arc::clone(&generation) as Arc<dyn StepOutputs>),
        prefill: programs.prefill.clone().map(Arc::new),
        final_state: false,
        ..RunConfig::new(args.seed, steps, no_optimizer())
    };
    ALL_ENDED.store(false, Ordering::Relaxed);
    let started = Instant::now();
    let batches = |step: u64| generation.inputs(&programs, step, config.timeout);
    optimus::runtime::local::run(&programs.main, &config, &batches, &initial, &|_| {})?;
    let took = started.elapsed();
    generation.report(args, tokenizer.as_deref(), took)
}

/// SGD with a zero rate: an inference plan has no update, but a run wants settings.
pub(super) fn no_optimizer() -> OptimizerSettings {
    OptimizerSettings {
        kind: OptimizerKind::Sgd,
        lr: 0.0,
        weight_decay: 0.0,
        momentum: 0.0,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    }
}

/// The compiled programs of a generation. With a key/value cache: the prefill program runs the
/// shortest prompt's positions at once (step 0), then the decode program one position per step,
/// rows still inside their prompt taking their prompt's next token. Without: one program over the
/// whole padded sequence, run again for every new token.
#[derive(Debug)]
struct Programs {
    /// What every step after the first runs (every step without a cache).
    main: Plan,
    prefill: Option<Plan>,
    schedule: Schedule,
    vocab: u64,
}

/// Which positions each step of a generation runs.
#[derive(Clone, Copy, Debug)]
struct Schedule {
    /// Whether the steps after the first decode one position each with a key/value cache.
    cached: bool,
    /// Positions the first step processes: the shortest prompt's (cache), the padded sequence (none).
    first_len: u64,
    /// Positions the whole generation needs: the longest prompt and the new tokens but the last.
    positions: u64,
    max_new_tokens: u64,
}

impl Schedule {
    /// Steps that generate `max_new_tokens` after every prompt (fewer when all end early).
    fn steps(self) -> u64 {
        if self.cached { 1 + self.positions - self.first_len } else { self.max_new_tokens }
    }

    /// The first position and the number of positions step `step` processes.
    fn positions_of(self, step: u64) -> (u64, u64) {
        match (self.cached, step) {
            (true, 0) => (0, self.first_len),
            (true, s) => (self.first_len + s - 1, 1),
            (false, _) => (0, self.positions),
        }
    }
}

impl Programs {
    fn compile(args: &GenerateArgs, prompts: &[Vec<u32>]) -> Result<Programs, Failure> {
        if args.target.mode_flag == Some(ModeArg::Train) {
            return Err(Failure::usage("generate runs the forward pass only: drop --mode train".into()));
        }
        let batch = prompts.len() as u64;
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(1) as u64;
        let shortest = prompts.iter().map(Vec::len).min().unwrap_or(1) as u64;
        // Saturating: --max-new-tokens may be any u64; a sum past the context is refused just below.
        let positions = longest.saturating_add(args.max_new_tokens.saturating_sub(1));
        let probe = probe_model(args)?;
        check_context(args, &probe, longest, positions)?;
        let context = args.max_context.unwrap_or(positions);
        if context < positions {
            return Err(Failure::usage(format!(
                "--max-context {context} holds fewer positions than the longest prompt and --max-new-tokens {} \
                 need ({positions})",
                args.max_new_tokens
            )));
        }
        // One position to run in all (one new token after prompts of one length): one forward pass.
        let one_pass = positions == shortest;
        let refused = if one_pass { None } else { cache_refused(args, &probe) };
        if let Some(why) = &refused {
            eprintln_safe!("note: {why}; generating without a key/value cache (each step recomputes the sequence)");
        }
        if one_pass || refused.is_some() {
            let (main, vocab) = logits_plan(args, (batch, positions), None)?;
            let schedule =
                Schedule { cached: false, first_len: positions, positions, max_new_tokens: args.max_new_tokens };
            return Ok(Programs { main, prefill: None, schedule, vocab });
        }
        let (prefill, vocab) = logits_plan(args, (batch, shortest), Some(context))?;
        let (main, _) = logits_plan(args, (batch, 1), Some(context))?;
        let schedule = Schedule { cached: true, first_len: shortest, positions, max_new_tokens: args.max_new_tokens };
        Ok(Programs { main, prefill: Some(prefill), schedule, vocab })
    }

    /// The plan step 0 runs.
    fn first(&self) -> &Plan {
        self.prefill.as_ref().unwrap_or(&self.main)
    }

    fn plan_of(&self, step: u64) -> &Plan {
        if step == 0 { self.first() } else { &self.main }
    }
}

/// Why the cache cannot serve this generation, if it cannot: asked off, a backend without its
/// kernels, or a model whose attention it cannot reproduce.
fn cache_refused(args: &GenerateArgs, probe: &optimus::ir::Model) -> Option<String> {
    if args.no_cache {
        return Some("--no-cache".into());
    }
    if args.backend == Backend::Cuda {
        return Some("the key/value cache runs on the CPU backend only".into());
    }
    let refusal = optimus::decode::with_cache(probe, 1).err();
    refusal.map(|e| format!("`{}` cannot keep a key/value cache: {e}", args.model.display()))
}

/// The model with a sequence of one position (which any position table fits), read before the
/// programs are compiled for its `context` and for whether its attention can keep a cache.
fn probe_model(args: &GenerateArgs) -> Result<optimus::ir::Model, Failure> {
    let mut overrides = args.target.set.clone();
    overrides.push("seq=1".parse::<Override>().map_err(|e| format!("{e:?}"))?);
    Ok(super::load_checked(&args.model, &overrides).ok_or_else(Failure::reported)?.0)
}

/// The model compiled for inference over `batch` rows of `seq` tokens (as a decoding step with
/// caches of `cache` positions, when given), with its logits (the first operand of its
/// cross-entropy loss) as an output named `logits`; and its vocabulary size.
fn logits_plan(args: &GenerateArgs, (batch, seq): (u64, u64), cache: Option<u64>) -> Result<(Plan, u64), Failure> {
    let mut overrides = args.target.set.clone();
    for (name, value) in [("batch", batch), ("seq", seq)] {
        let given = format!("{name}={value}").parse::<Override>().map_err(|e| format!("{e:?}"))?;
        overrides.push(given);
    }
    let (model, source) = super::load_checked(&args.model, &overrides).ok_or_else(Failure::reported)?;
    let mut model = match cache {
        Some(context) => {
            let step = optimus::decode::with_cache(&model, context).map_err(|e| Failure::usage(e.to_string()))?;
            // The prefill chooses from its last position alone: the head runs on that one.
            optimus::decode::last_position_head(&step).unwrap_or(step)
        }
        None => model,
    };
    let cross_entropy = model.loss.filter(|&l| matches!(model.graph[l].op, optimus::ir::Op::CrossEntropy));
    let Some(logits) = cross_entropy.and_then(|l| model.operands(l).first().copied()) else {
        return Err(Failure::usage(format!(
            "`{}` has no loss `cross_entropy(logits, targets)` whose logits generate could sample from",
            args.model.display()
        )));
    };
    let sizes = model.graph[logits].ty.sizes();
    let vocab = match sizes.as_slice() {
        [b, s, v] if *b == batch && (*s == seq || (*s == 1 && cache.is_some())) => *v,
        _ => return Err(Failure::usage(format!("the logits have shape {sizes:?}, not [batch, seq, vocabulary]"))),
    };
    let span = model.outputs.first().map(|o| o.span).unwrap_or_default();
    model.outputs.push(optimus::ir::Output { name: "logits".into(), node: logits, span });
    let mut target = args.target.clone();
    target.mode_flag = Some(ModeArg::Infer);
    let plan = optimus::shard::compile(&model, &source.name, &source.text, target.target()).map_err(|diagnostics| {
        optimus::diag::render_stderr(&source.name, &source.text, &diagnostics);
        Failure::from(format!("{}: cannot compile for a {} mesh", source.name, target.mesh()))
    })?;
    let inputs: BTreeSet<&str> = plan.inputs.iter().map(|i| i.name.as_str()).collect();
    let wanted: BTreeSet<&str> = match cache {
        Some(_) => ["tokens", "targets", optimus::decode::POSITION_INPUT].into(),
        None => ["tokens", "targets"].into(),
    };
    if inputs != wanted {
        let listed: Vec<String> = inputs.iter().map(|name| format!("`{name}`")).collect();
        return Err(Failure::usage(format!(
            "generate feeds causal language models (inputs `tokens` and `targets`); this model's inputs are {}",
            listed.join(", ")
        )));
    }
    Ok((plan, vocab))
}

/// Refuses, with what to change, prompts and new tokens that need more positions than the model's
/// `context` config value (its position table, or the rotary table's length) has: `positions` for the
/// `longest` prompt and --max-new-tokens.
fn check_context(args: &GenerateArgs, model: &optimus::ir::Model, longest: u64, positions: u64) -> Result<(), Failure> {
    let Some(context) = super::size_config(model, "context") else { return Ok(()) };
    if let Some(asked) = args.max_context.filter(|&m| m > context) {
        return Err(Failure::usage(format!("--max-context {asked} is more than the model's context {context}")));
    }
    if longest > context {
        return Err(Failure::usage(format!(
            "the longest prompt has {longest} tokens, more than the model's context {context}: shorten it"
        )));
    }
    if positions > context {
        let tokens = if longest == 1 { "1 token".to_string() } else { format!("{longest} tokens") };
        return Err(Failure::usage(format!(
            "the longest prompt ({tokens}) and --max-new-tokens {} need {positions} positions, and the \
             model's context is {context}: generate at most {} new tokens, or shorten the prompt",
            args.max_new_tokens,
            context - longest + 1
        )));
    }
    Ok(())
}

/// The sequences being generated, shared by the device threads: each device deposits its logits block
/// after a step; the last one to do so assembles them and chooses every prompt's next token, and the
/// next step's inputs wait for that.
#[derive(Debug)]
struct Generation {
    logits: usize,
    /// The logits buffer of step 0's plan, and of the later steps'.
    buffers: [optimus::plan::Buffer; 2],
    mesh: optimus::plan::Mesh,
    vocab: u64,
    /// Prompts asked for (the rows after them pad the batch).
    asked: usize,
    sampling: Sampling,
    eos: Option<u32>,
    state: Mutex<State>,
    decided: Condvar,
    /// When the first step asked for its inputs: the weights were loaded by then.
    first_step: Mutex<Option<Instant>>,
    stream: Option<Streamer>,
    schedule: Schedule,
}

#[derive(Debug)]
struct State {
    rows: Vec<Vec<u32>>,
    /// The logit of each generated token, as the model computed it (before temperature).
    logits: Vec<Vec<f32>>,
    prompt_lens: Vec<usize>,
    ended: Vec<bool>,
    /// Blocks deposited per batch index, per device rank.
    deposits: BTreeMap<u64, Vec<Option<Tensor>>>,
    /// Steps whose tokens have been chosen.
    steps_done: u64,
    failure: Option<String>,
}

impl Generation {
    fn new(
        programs: &Programs,
        (prompts, asked): (Vec<Vec<u32>>, usize),
        (sampling, eos): (Sampling, Option<u32>),
        stream: Option<Streamer>,
    ) -> Result<Generation, Failure> {
        let logits_buffer = |plan: &Plan| {
            let index = plan.outputs.iter().position(|o| o.name == "logits");
            index.map(|k| (k, plan.buffer(plan.outputs[k].buffer).clone()))
        };
        let (Some((logits, first)), Some((_, later))) =
            (logits_buffer(programs.first()), logits_buffer(&programs.main))
        else {
            return Err("the plan has no logits output".to_string().into());
        };
        let state = State {
            prompt_lens: prompts.iter().map(Vec::len).collect(),
            logits: vec![Vec::new(); prompts.len()],
            ended: vec![false; prompts.len()],
            rows: prompts,
            deposits: BTreeMap::new(),
            steps_done: 0,
            failure: None,
        };
        Ok(Generation {
            logits,
            buffers: [first, later],
            mesh: programs.main.mesh,
            vocab: programs.vocab,
            asked,
            sampling,
            eos,
            state: Mutex::new(state),
            decided: Condvar::new(),
            first_step: Mutex::new(None),
            stream,
            schedule: programs.schedule,
        })
    }

    /// The inputs of step `step`: each row's tokens at the step's positions (padded with token 0),
    /// targets ignored, and the step's first position when the plan reads it. Waits until the
    /// tokens of the step before have been chosen.
    fn inputs(&self, programs: &Programs, step: u64, timeout: Duration) -> Result<BTreeMap<String, Tensor>, String> {
        if let Ok(mut first) = self.first_step.lock() {
            first.get_or_insert_with(Instant::now);
        }
        let deadline = Instant::now() + timeout;
        let mut state = self.state.lock().map_err(|_| "a device thread failed while generating".to_string())?;
        while state.steps_done < step && state.failure.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("the tokens of step {} were not chosen within {} s", step - 1, timeout.as_secs()));
            }
            state = self.decided.wait_timeout(state, left).map_err(|_| "a device thread failed".to_string())?.0;
        }
        if let Some(failure) = &state.failure {
            return Err(failure.clone());
        }
        let (start, count) = self.schedule.positions_of(step);
        let batch = state.rows.len() as u64;
        let mut tokens = vec![0i32; (batch * count) as usize];
        for (r, row) in state.rows.iter().enumerate() {
            let known = row.iter().skip(start as usize).take(count as usize);
            for (t, &id) in known.enumerate() {
                tokens[r * count as usize + t] = id as i32;
            }
        }
        let targets = vec![IGNORE_INDEX; (batch * count) as usize];
        let (tokens, targets) = (Tensor::from_i32(&[batch, count], tokens), Tensor::from_i32(&[batch, count], targets));
        let plan = programs.plan_of(step);
        let mut inputs = super::eval::causal_inputs(plan, tokens, targets);
        if plan.inputs.iter().any(|i| i.name == optimus::decode::POSITION_INPUT) {
            let position = Tensor::from_i32(&[1], vec![i32::try_from(start).map_err(|e| e.to_string())?]);
            inputs.insert(optimus::decode::POSITION_INPUT.to_string(), position);
        }
        Ok(inputs)
    }

    /// Chooses the next token of every prompt that has not ended and whose next token is not its
    /// prompt's, from the logits of the last position step `step` processed.
    fn decide(&self, state: &mut State, step: u64, blocks: &[Option<Tensor>]) -> Result<(), String> {
        let blocks: Vec<&Tensor> = blocks.iter().flatten().collect();
        let (start, count) = self.schedule.positions_of(step);
        let buffer = &self.buffers[usize::from(step > 0)];
        let padded_count = buffer.logical_shape.get(1).copied().unwrap_or(1);
        // A row chooses when its last known token is at the step's last position (or, recomputing
        // the whole sequence, at any position).
        let choosing: Vec<usize> = (0..state.rows.len())
            .filter(|&r| !state.ended[r])
            .filter(|&r| !self.schedule.cached || state.rows[r].len() as u64 == start + count)
            .collect();
        // The logits hold the step's last `padded_count` positions (all of them, or the last one).
        let first_held = start + count - padded_count.min(count);
        let wanted: Vec<u64> =
            choosing.iter().map(|&r| r as u64 * padded_count + state.rows[r].len() as u64 - 1 - first_held).collect();
        let rows = optimus::plan::init::gather_rows(&blocks, buffer, self.mesh, &wanted).map_err(|e| e.to_string())?;
        let vocab = self.vocab as usize;
        for (&r, logits) in choosing.iter().zip(&rows) {
            let values = &logits[..vocab];
            let new = (state.rows[r].len() - state.prompt_lens[r]) as u64;
            let token = self.sampling.choose(values, r as u64, new);
            state.rows[r].push(token);
            state.logits[r].push(values[token as usize]);
            state.ended[r] = Some(token) == self.eos || new + 1 >= self.schedule.max_new_tokens;
        }
        // The prefill step never ends the run: its device hands over to the decode program, which
        // runs at least once (a step whose rows have all ended chooses nothing).
        if state.ended.iter().all(|&e| e) && (step > 0 || !self.schedule.cached) {
            ALL_ENDED.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Prints the summary, or the JSON records.
    fn report(&self, args: &GenerateArgs, tokenizer: Option<&Tokenizer>, took: Duration) -> Result<(), Failure> {
        let state = self.state.lock().map_err(|_| "a device thread failed while generating".to_string())?;
        if let Some(failure) = &state.failure {
            return Err(failure.clone().into());
        }
        if let (Some(stream), Some(row)) = (&self.stream, state.rows.first()) {
            stream.finish(&row[state.prompt_lens[0]..]);
        }
        let rows = &state.rows[..self.asked];
        let generated: usize = rows.iter().zip(&state.prompt_lens).map(|(r, p)| r.len() - p).sum();
        // Tokens per second of the steps themselves, after the model was compiled and its weights loaded.
        let decoding = self.first_step.lock().ok().and_then(|f| *f).map_or(took, |f| f.elapsed().min(took));
        let rate = generated as f64 / decoding.as_secs_f64().max(1e-9);
        for (k, row) in rows.iter().enumerate() {
            let new = &row[state.prompt_lens[k]..];
            let finish = if new.last().copied() == self.eos && self.eos.is_some() { "eos" } else { "length" };
            let text = tokenizer.map(|t| t.decode(row)).transpose().map_err(|e| e.to_string())?;
            if args.json {
                let record = serde_json::json!({
                    "prompt": k, "ids": row, "generated": new, "text": text, "finish": finish,
                    "new_tokens": new.len(), "logits": state.logits[k], "seconds": took.as_secs_f64(),
                    "decode_seconds": decoding.as_secs_f64(), "tokens_per_s": rate,
                });
                super::stdout_json(&format!("{record}\n"));
            } else if self.stream.is_none() {
                match &text {
                    Some(text) => super::stdout(&format!("[{k}] {text}\n")),
                    None => super::stdout(&format!("[{k}] {}\n", ids_text(row))),
                }
            }
        }
        if !args.json {
            eprintln_safe!(
                "generated {generated} tokens in {:.2} s after {:.2} s of loading ({rate:.1} tokens/s, {})",
                decoding.as_secs_f64(),
                (took - decoding).as_secs_f64(),
                if self.schedule.cached { "key/value cache" } else { "no key/value cache" }
            );
        }
        Ok(())
    }
}

fn ids_text(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}

impl StepOutputs for Generation {
    fn deposit(&self, index: u64, rank: u64, mut blocks: Vec<Tensor>) {
        let Ok(mut state) = self.state.lock() else { return };
        let devices = self.mesh.devices() as usize;
        let slot = state.deposits.entry(index).or_insert_with(|| vec![None; devices]);
        if let Some(place) = slot.get_mut(rank as usize) {
            *place = (self.logits < blocks.len()).then(|| blocks.swap_remove(self.logits));
        }
        if slot.iter().any(Option::is_none) {
            return;
        }
        let Some(all) = state.deposits.remove(&index) else { return };
        if let Err(e) = self.decide(&mut state, index, &all) {
            state.failure = Some(format!("choosing the tokens of step {index}: {e}"));
        }
        state.steps_done = index + 1;
        if let (Some(stream), Some(row)) = (&self.stream, state.rows.first()) {
            stream.show(&row[state.prompt_lens[0]..]);
        }
        self.decided.notify_all();
    }
}

/// Prints a single prompt's text as its tokens come: the prompt first, then each new piece once it
/// decodes to whole characters.
#[derive(Debug)]
struct Streamer {
    tokenizer: Arc<Tokenizer>,
    /// Bytes of the generated text printed so far.
    printed: Mutex<usize>,
}

impl Streamer {
    fn start(tokenizer: Arc<Tokenizer>, prompt: &[u32]) -> Streamer {
        if let Ok(text) = tokenizer.decode(prompt) {
            super::stdout(&text);
            let _ = std::io::stdout().flush();
        }
        Streamer { tokenizer, printed: Mutex::new(0) }
    }

    fn show(&self, generated: &[u32]) {
        let (Ok(text), Ok(mut printed)) = (self.tokenizer.decode(generated), self.printed.lock()) else { return };
        // A token that ends inside a character decodes to U+FFFD until the rest of it comes.
        if text.ends_with('\u{FFFD}') || text.len() <= *printed || !text.is_char_boundary(*printed) {
            return;
        }
        super::stdout(&text[*printed..]);
        let _ = std::io::stdout().flush();
        *printed = text.len();
    }

    fn finish(&self, generated: &[u32]) {
        self.show(generated);
        super::stdout("\n");
    }
}

#[cfg(test)]
mod tests {
    use super::{GenerateArgs, args_of_plan};
    use crate::cli::LayoutsArg;
    use clap::Parser;
    use optimus::front::check_source;
    use optimus::plan::{Layouts, Mesh, Mode, Strategy};
    use optimus::shard::{Target, compile};

    #[derive(Parser)]
    struct Generate {
        #[command(flatten)]
        args: GenerateArgs,
    }

    /// A plan of examples/tiny.opt on 2x2 with `layouts`, written where `name` says; its path.
    fn plan_with(layouts: Layouts, name: &str) -> std::path::PathBuf {
        let text = std::fs::read_to_string("examples/tiny.opt").expect("examples/tiny.opt");
        let model = check_source(&text, &[]).model.expect("tiny checks");
        let target = Target { layouts, ..Target::plain(Mesh::new(2, 2), Strategy::Optimus, Mode::Train) };
        let plan = compile(&model, "examples/tiny.opt", &text, target).expect("tiny compiles on 2x2");
        let dir = std::env::temp_dir().join(format!("optimus-generate-args-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch folder");
        let path = dir.join(name);
        optimus::io::plan_file::write_plan(&plan, &path).expect("the plan is written");
        path
    }

    /// Generating from a plan compiles its prefill and decode programs with the plan's layouts: a
    /// plan compiled with `--layouts paper` decodes with the paper's layouts too, not the default.
    #[test]
    fn a_plan_passes_its_layouts_to_the_programs_generate_compiles() {
        for (layouts, expected) in [(Layouts::Paper, LayoutsArg::Paper), (Layouts::Auto, LayoutsArg::Auto)] {
            let path = plan_with(layouts, &format!("{layouts:?}.json"));
            let given = Generate::try_parse_from(["generate", path.to_str().expect("a UTF-8 path")])
                .expect("the arguments parse")
                .args;
            let derived = args_of_plan(&given).unwrap_or_else(|e| panic!("{layouts:?}: {}", e.message));
            assert_eq!(derived.target.layouts, Some(expected), "{layouts:?}");
            assert_eq!(derived.target.target().layouts, layouts, "{layouts:?}: the target compiled");
        }
    }
}
