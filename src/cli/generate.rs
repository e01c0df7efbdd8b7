//! `optimusc generate`: text (or token ids) continued by a causal language model on any mesh, greedy or
//! sampled with a seed. Each new token reruns the forward pass over the whole sequence so far (there is
//! no key/value cache yet); the model is compiled with its logits as an output.

use super::run::Backend;
use super::{Failure, ModeArg, TargetArgs};
use optimus::elab::Override;
use optimus::plan::tensor::Tensor;
use optimus::plan::{IGNORE_INDEX, Plan};
use optimus::runtime::exec::{RunConfig, StepOutputs};
use optimus::runtime::settings::{OptimizerKind, OptimizerSettings};
use optimus::text::Tokenizer;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    /// The model (.opt): a causal language model whose loss is `cross_entropy(logits, targets)`.
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
    /// A prompt as token ids, comma-separated (`--prompt-ids 464,2068,7586`). Repeatable.
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
    /// Where kernels run: cpu (threads) or cuda.
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    pub backend: Backend,
    /// Seconds a collective waits for its peers before generation fails.
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS")]
    pub timeout: f64,
}

fn parse_ids(text: &str) -> Result<Vec<u32>, String> {
    let ids: Result<Vec<u32>, _> = text.split(',').map(|id| id.trim().parse::<u32>()).collect();
    match ids {
        Ok(ids) if !ids.is_empty() => Ok(ids),
        _ => Err(format!("`{text}` is not a comma-separated list of token ids")),
    }
}

/// Runs `optimusc generate`.
pub fn generate(args: &GenerateArgs) -> ExitCode {
    match generate_text(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => e.exit(),
    }
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
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(1) as u64;
    let seq = longest + args.max_new_tokens - 1;
    let asked = prompts.len();
    // Rows the mesh splits the batch over (replicas, and optimus's grid rows) must divide it: the
    // prompts are padded with copies of the first, generated and left out.
    let mesh = args.target.target().mesh;
    let split =
        mesh.data * if args.target.target().strategy == optimus::plan::Strategy::Optimus { mesh.rows } else { 1 };
    let batch = (asked as u64).div_ceil(split.max(1)) * split.max(1);
    while (prompts.len() as u64) < batch {
        prompts.push(prompts[0].clone());
    }
    let (plan, vocab) = logits_plan(args, batch, seq)?;
    if let Some(id) = prompts.iter().flatten().find(|&&id| u64::from(id) >= vocab) {
        return Err(Failure::usage(format!("prompt token {id} is not below the model's vocabulary size {vocab}")));
    }
    if let Some(checkpoint) = args.resume.as_ref().filter(|c| !c.is_dir()) {
        return Err(Failure::usage(format!("--resume `{}` is not a checkpoint folder", checkpoint.display())));
    }
    let source = args.weights.as_ref().or(args.resume.as_ref());
    let (initial, weights) = super::run::weights_for(source, false, &plan)?;
    if source.is_none() {
        eprintln_safe!("note: no --weights: generating with the weights drawn from seed {}", args.seed);
    }
    let tokenizer = tokenizer.map(Arc::new);
    let stream = tokenizer
        .as_ref()
        .filter(|_| prompts.len() == 1 && !args.json)
        .map(|t| Streamer::start(Arc::clone(t), &prompts[0]));
    let limits = (vocab, seq, args.max_new_tokens);
    let generation = Arc::new(Generation::new(&plan, (prompts, asked), limits, (sampling, eos), stream)?);
    let config = RunConfig {
        timeout: Duration::from_secs_f64(args.timeout),
        backend: args.backend.kind(),
        weights: weights.map(|w| w as Arc<dyn optimus::plan::stores::WeightSource>),
        stop: Some(all_ended),
        step_outputs: Some(Arc::clone(&generation) as Arc<dyn StepOutputs>),
        ..RunConfig::new(args.seed, args.max_new_tokens, no_optimizer())
    };
    args.backend.kind().check_available()?;
    ALL_ENDED.store(false, Ordering::Relaxed);
    let started = Instant::now();
    let batches = |step: u64| generation.inputs(&plan, step, config.timeout);
    optimus::runtime::local::run(&plan, &config, &batches, &initial, &|_| {})?;
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

/// The model compiled for inference over `batch` rows of `seq` tokens, with its logits (the first
/// operand of its cross-entropy loss) as an output named `logits`; and its vocabulary size.
fn logits_plan(args: &GenerateArgs, batch: u64, seq: u64) -> Result<(Plan, u64), Failure> {
    if args.model.extension().is_some_and(|e| e.eq_ignore_ascii_case("json")) {
        return Err(Failure::usage(
            "generate compiles the model itself (with its logits as an output): give the .opt file".into(),
        ));
    }
    if args.target.mode_flag == Some(ModeArg::Train) {
        return Err(Failure::usage("generate runs the forward pass only: drop --mode train".into()));
    }
    check_context(args, seq)?;
    let mut overrides = args.target.set.clone();
    for (name, value) in [("batch", batch), ("seq", seq)] {
        let given = format!("{name}={value}").parse::<Override>().map_err(|e| format!("{e:?}"))?;
        overrides.push(given);
    }
    let (mut model, source) = super::load_checked(&args.model, &overrides).ok_or_else(Failure::reported)?;
    let cross_entropy = model.loss.filter(|&l| matches!(model.graph[l].op, optimus::ir::Op::CrossEntropy));
    let Some(logits) = cross_entropy.and_then(|l| model.operands(l).first().copied()) else {
        return Err(Failure::usage(format!(
            "`{}` has no loss `cross_entropy(logits, targets)` whose logits generate could sample from",
            args.model.display()
        )));
    };
    let sizes = model.graph[logits].ty.sizes();
    let vocab = match sizes.as_slice() {
        [b, s, v] if *b == batch && *s == seq => *v,
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
    let inputs: Vec<&str> = plan.inputs.iter().map(|i| i.name.as_str()).collect();
    if inputs.len() != 2 || !inputs.contains(&"tokens") {
        return Err(Failure::usage(format!(
            "generate feeds causal language models (inputs `tokens` and `targets`); this model has {inputs:?}"
        )));
    }
    Ok((plan, vocab))
}

/// Refuses, with what to change, prompts and new tokens that need more positions than the model's
/// `context` config value (its position table, or the rotary table's length) has.
fn check_context(args: &GenerateArgs, seq: u64) -> Result<(), Failure> {
    // One position fits any table: this pass only reads the config.
    let mut overrides = args.target.set.clone();
    overrides.push("seq=1".parse::<Override>().map_err(|e| format!("{e:?}"))?);
    let (model, _) = super::load_checked(&args.model, &overrides).ok_or_else(Failure::reported)?;
    let context = model.config.iter().find(|c| c.name == "context").and_then(|c| match c.value {
        optimus::plan::types::Scalar::Int(v) => u64::try_from(v).ok(),
        _ => None,
    });
    match context {
        Some(context) if seq > context => Err(Failure::usage(format!(
            "the longest prompt and --max-new-tokens {} need {seq} positions, and the model's context is {context}: \
             generate at most {} new tokens, or shorten the prompt",
            args.max_new_tokens,
            (context + args.max_new_tokens).saturating_sub(seq)
        ))),
        _ => Ok(()),
    }
}

/// The sequences being generated, shared by the device threads: each device deposits its logits block
/// after a step; the last one to do so assembles them and chooses every prompt's next token, and the
/// next step's inputs wait for that.
#[derive(Debug)]
struct Generation {
    logits: usize,
    buffer: optimus::plan::Buffer,
    mesh: optimus::plan::Mesh,
    shape: [u64; 3],
    max_new_tokens: u64,
    /// Prompts asked for (the rows after them pad the batch).
    asked: usize,
    sampling: Sampling,
    eos: Option<u32>,
    state: Mutex<State>,
    decided: Condvar,
    /// When the first step asked for its inputs: the weights were loaded by then.
    first_step: Mutex<Option<Instant>>,
    stream: Option<Streamer>,
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
        plan: &Plan,
        (prompts, asked): (Vec<Vec<u32>>, usize),
        (vocab, seq, max_new_tokens): (u64, u64, u64),
        (sampling, eos): (Sampling, Option<u32>),
        stream: Option<Streamer>,
    ) -> Result<Generation, Failure> {
        let logits = plan
            .outputs
            .iter()
            .position(|o| o.name == "logits")
            .ok_or_else(|| "the plan has no logits output".to_string())?;
        let batch = prompts.len() as u64;
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
            buffer: plan.buffer(plan.outputs[logits].buffer).clone(),
            mesh: plan.mesh,
            shape: [batch, seq, vocab],
            max_new_tokens,
            asked,
            sampling,
            eos,
            state: Mutex::new(state),
            decided: Condvar::new(),
            first_step: Mutex::new(None),
            stream,
        })
    }

    /// The inputs of step `step`: every sequence so far, padded with token 0, targets ignored. Waits
    /// until the tokens of the step before have been chosen.
    fn inputs(&self, plan: &Plan, step: u64, timeout: Duration) -> Result<BTreeMap<String, Tensor>, String> {
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
        let [batch, seq, _] = self.shape;
        let mut tokens = vec![0i32; (batch * seq) as usize];
        for (r, row) in state.rows.iter().enumerate() {
            for (t, &id) in row.iter().take(seq as usize).enumerate() {
                tokens[r * seq as usize + t] = id as i32;
            }
        }
        let targets = vec![IGNORE_INDEX; (batch * seq) as usize];
        let (tokens, targets) = (Tensor::from_i32(&[batch, seq], tokens), Tensor::from_i32(&[batch, seq], targets));
        Ok(super::eval::causal_inputs(plan, tokens, targets))
    }

    /// Chooses the next token of every prompt that has not ended, from the assembled logits.
    fn decide(&self, state: &mut State, step: u64, blocks: &[Option<Tensor>]) -> Result<(), String> {
        let blocks: Vec<&Tensor> = blocks.iter().flatten().collect();
        // Only the last position of each sequence matters: its row of the (padded) logits.
        let padded_seq = self.buffer.logical_shape.get(1).copied().unwrap_or(1);
        let wanted: Vec<u64> =
            state.rows.iter().enumerate().map(|(r, row)| r as u64 * padded_seq + row.len() as u64 - 1).collect();
        let rows =
            optimus::plan::init::gather_rows(&blocks, &self.buffer, self.mesh, &wanted).map_err(|e| e.to_string())?;
        let vocab = self.shape[2] as usize;
        for (r, logits) in rows.iter().enumerate() {
            if state.ended[r] {
                continue;
            }
            let values = &logits[..vocab];
            let token = self.sampling.choose(values, r as u64, step);
            state.rows[r].push(token);
            state.logits[r].push(values[token as usize]);
            let new = state.rows[r].len() - state.prompt_lens[r];
            state.ended[r] = Some(token) == self.eos || new as u64 >= self.max_new_tokens;
        }
        if state.ended.iter().all(|&e| e) {
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
                "generated {generated} tokens in {:.2} s after {:.2} s of loading ({rate:.1} tokens/s, no key/value cache)",
                decoding.as_secs_f64(),
                (took - decoding).as_secs_f64()
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
