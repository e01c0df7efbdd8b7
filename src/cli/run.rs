//! `optimusc run`: executes a plan on a backend for a number of steps and reports every step.

use super::simulate::PlacementArg;
use super::{Failure, TargetArgs, plan_from};
use clap::ValueEnum;
use optimus::io::checkpoint::save_checkpoint;
use optimus::io::data::{TokenData, TokenDtype, check_inputs};
use optimus::io::mapped::MappedWeights;
use optimus::io::metrics::{MetricsLog, check_appendable};
use optimus::io::pretrained::{map_weights, pretrained_file};
use optimus::io::shards::load_weights;
use optimus::io::sources::{Objective, Sources};
use optimus::plan::stores::{CheckpointSource, WeightSource};
use optimus::plan::tensor::Tensor;
use optimus::plan::{Mode, Plan};
use optimus::runtime::exec::{Evaluation, RunConfig, RunOutput, StepRecord};
use optimus::runtime::schedule::{Schedule, ScheduleKind};
use optimus::runtime::settings::{OptimizerKind, OptimizerSettings};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// A plan (.json) from `optimusc compile`, or a model (.opt) to compile with the target flags.
    pub input: PathBuf,
    #[command(flatten)]
    pub target: TargetArgs,
    /// Where kernels run: cpu, or cuda (GPUs; needs a build with --features cuda and an NVIDIA driver).
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    pub backend: Backend,
    /// Number of steps (at least 1).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: u64,
    /// Token file (nanoGPT style: flat little-endian integers). Without it, tokens are drawn from the seed.
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// Read --data's windows (seq + 1 tokens, seq apart) in an order drawn from --seed anew each epoch,
    /// every whole window once per epoch, instead of one after another. The order depends only on the
    /// seed, the epoch and the step, so --resume continues it exactly. `--shuffle false` (the default)
    /// reads in order. Either way a note says when a step starts a new pass over the file.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", default_value_t = false,
          action = clap::ArgAction::Set)]
    pub shuffle: bool,
    /// Element type of --data, and of --segments, --labels and the validation files.
    #[arg(long, value_enum, default_value_t = DataDtype::U16)]
    pub data_dtype: DataDtype,
    #[command(flatten)]
    pub inputs: InputArgs,
    /// Start from these weights: a safetensors file (checkpoint names; Hugging Face GPT-2 files load into
    /// gpt2.opt); a `save_pretrained` folder (`model.safetensors`, or shards and their
    /// `model.safetensors.index.json`) or that index; or a sharded checkpoint directory (or a directory of
    /// them: the latest), whose parameters load onto any mesh and strategy (optimizer state and training
    /// position are not restored).
    #[arg(long, value_name = "FILE.safetensors|INDEX.json|DIR")]
    pub weights: Option<PathBuf>,
    /// Load `--weights` even if some are NaN or infinite (by default that is an error naming the tensor).
    #[arg(long)]
    pub allow_non_finite_weights: bool,
    /// Write the final weights here (safetensors, gathered logical tensors, Hugging Face names). A
    /// directory (an existing one, or a path ending in `/`) gets the `save_pretrained` layout:
    /// `model.safetensors`, or shards of at most --max-shard-size and `model.safetensors.index.json`.
    #[arg(long, value_name = "FILE.safetensors|DIR/")]
    pub save_weights: Option<PathBuf>,
    /// The tokenizer the data was made with (`gpt2`, or a Hugging Face tokenizer.json): `--save-weights
    /// DIR/` then also writes `tokenizer.json` and `tokenizer_config.json`, so that
    /// `AutoTokenizer.from_pretrained(DIR)` opens the folder too.
    #[arg(long, value_name = "gpt2|PATH/tokenizer.json")]
    pub tokenizer: Option<String>,
    /// The largest shard `--save-weights DIR/` writes, as `save_pretrained(max_shard_size=...)`: a size
    /// such as 5GB (decimal units; the default, as Hugging Face's) or 512MiB. A larger tensor gets a shard of
    /// its own.
    #[arg(long, value_name = "SIZE", value_parser = super::flags::memory_size)]
    pub max_shard_size: Option<u64>,
    /// Seed for initial weights, random tokens and dropout masks.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub optimizer: OptimizerArgs,
    /// The learning rate after the warm-up, as Hugging Face's schedules: constant (--lr throughout),
    /// cosine (half a cosine from --lr down to --min-lr at the last step) or linear (a straight line
    /// down to --min-lr). The rate of each update is in the --json records as `lr`.
    #[arg(long, value_enum, default_value_t = ScheduleArg::Constant)]
    pub lr_schedule: ScheduleArg,
    /// Updates over which the rate rises linearly from 0 (at the first update) to --lr; at most --steps.
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: u64,
    /// The rate cosine and linear schedules end at (finite, >= 0, at most --lr; default 0).
    #[arg(long, value_parser = super::flags::non_negative)]
    pub min_lr: Option<f32>,
    /// Micro-batches per update (gradient accumulation; at least 1): micro-batch m of step k reads the
    /// sequences at ((k * N + m) * batch + r) * seq, the update uses the mean of their gradients (one
    /// batch of N * batch sequences), the step's loss is their mean, and memory stays one micro-batch's.
    /// At most 1000000, as for --pipeline's micro-batches (an interrupt ends the run at a step's end).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub accum: u64,
    /// Clip the gradients to this global L2 norm before each update (finite, > 0), as
    /// torch.nn.utils.clip_grad_norm_: every gradient is scaled by min(1, X / (norm + 1e-6)), where norm is
    /// taken over all parameters with each replicated shard counted once (one all-reduce of one number per
    /// step, shown by `optimusc inspect`). The norm before clipping is in every --json record as `grad_norm`,
    /// with or without this flag.
    #[arg(long, value_name = "X", value_parser = super::flags::positive)]
    pub clip_grad_norm: Option<f32>,
    #[command(flatten)]
    pub pipeline: super::pipeline::RunPipelineArgs,
    #[command(flatten)]
    pub checkpoint: super::resume::CheckpointArgs,
    /// Validation token file (same format as --data): after every --eval-every-th update, the mean loss
    /// of --eval-batches batches of it, with dropout off and no update; batch v reads the sequences at
    /// (v * batch + r) * seq. Records `{"step": k, "val_loss": x}` with --json, a line otherwise.
    #[arg(long, value_name = "FILE")]
    pub val_data: Option<PathBuf>,
    /// Token types of --val-data, as --segments is of --data (needed when the model has a token-type input).
    #[arg(long, value_name = "FILE")]
    pub val_segments: Option<PathBuf>,
    /// MLM labels of --val-data, as --labels is of --data (needed with --objective mlm).
    #[arg(long, value_name = "FILE")]
    pub val_labels: Option<PathBuf>,
    /// Validate after every E-th update (at least 1; default: after the last update only). Needs --val-data.
    #[arg(long, value_name = "E", value_parser = clap::value_parser!(u64).range(1..))]
    pub eval_every: Option<u64>,
    /// Validation batches per evaluation (1 to 1000000; default 1). Needs --val-data.
    #[arg(long, value_name = "V", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub eval_batches: Option<u64>,
    /// Print one JSON object per step on standard output.
    #[arg(long)]
    pub json: bool,
    /// Append every record --json prints to this file, one JSON object per line, flushed as it is
    /// written, with or without --json. The file is never truncated: a resumed run continues it.
    /// `optimusc plot FILE` draws its curves. Under mpirun, rank 0 writes it.
    #[arg(long, value_name = "FILE.jsonl")]
    pub log: Option<PathBuf>,
    /// After the run, print on standard error where the time went, as torch.profiler's table does: by kernel
    /// kind and by collective kind and group, summed over devices (count, total ms, share, average µs,
    /// achieved GFLOP/s of products and their % of this CPU's peak, GB/s of collectives), then the matrix
    /// products by block shape and form (with each one's median call, which a shared machine's slow spells
    /// move less), then compute, communication and other time per device. The first step is left out as warm-up when there are more;
    /// the peak is measured before and after the run (about 0.15 s each; a note says where the two are over
    /// 10% apart: the machine's speed changed under the run). The header also names the library of the CPU
    /// products (optimus's own AVX2 kernel where the CPU's widest vectors are AVX2, with OpenBLAS where
    /// the machine has it for products under 6 rows; else OpenBLAS; else faer; OPTIMUS_BLAS=faer,
    /// optimus or a path chooses) and how many product calls
    /// each ran. On a GPU (--backend cuda) each kernel is timed on the GPU, alone, and no peak is named. With --json, a last `{"profile": ...}` record.
    #[arg(long)]
    pub profile: bool,
    /// Seconds a collective waits for its peers before the run fails (and, under MPI, aborts the job).
    #[arg(long, default_value_t = 120.0, value_parser = super::flags::seconds)]
    pub timeout: f64,
    /// Under mpirun or srun: which rank runs which device. row-major gives rank r device (r / cols, r % cols);
    /// blocks gives each node a block of the mesh as square as possible (2x2 for 4 ranks per node), which
    /// splits inter-node traffic between rows and columns; `optimusc simulate --placement` predicts which is
    /// faster for a model. Ignored when running on threads.
    #[arg(long, value_enum, default_value_t = PlacementArg::RowMajor)]
    pub placement: PlacementArg,
    /// The recorded kinds of flags given on the command line, as typed (see `recorded`); what a
    /// checkpoint stores so that `--resume` can restore them.
    #[arg(skip)]
    pub given: super::recorded::GivenFlags,
}

/// `--lr-schedule` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScheduleArg {
    Constant,
    Cosine,
    Linear,
}

/// The learning-rate schedule the flags ask for, checked: a usage error for a floor with a constant
/// schedule, a floor above the peak, or a warm-up longer than the run.
fn schedule(args: &RunArgs) -> Result<Schedule, Failure> {
    let kind = match args.lr_schedule {
        ScheduleArg::Constant => ScheduleKind::Constant,
        ScheduleArg::Cosine => ScheduleKind::Cosine,
        ScheduleArg::Linear => ScheduleKind::Linear,
    };
    let (peak, floor) = (args.optimizer.lr, args.min_lr.unwrap_or(0.0));
    if kind == ScheduleKind::Constant && args.min_lr.is_some() {
        return Err(Failure::usage(
            "--min-lr is the end of a decay: give it with --lr-schedule cosine or linear".into(),
        ));
    }
    if floor > peak {
        return Err(Failure::usage(format!(
            "--min-lr {floor} is above --lr {peak}; the schedule decays from --lr down"
        )));
    }
    if args.warmup_steps > args.steps {
        let (w, s) = (args.warmup_steps, args.steps);
        return Err(Failure::usage(format!("--warmup-steps {w} is longer than the run (--steps {s})")));
    }
    // The rates as written (0.003, not the f32 nearest it), as torch holds them in Python floats.
    let written = |x: f32| x.to_string().parse::<f64>().unwrap_or(f64::from(x));
    Ok(Schedule { kind, peak: written(peak), warmup: args.warmup_steps, floor: written(floor), total: args.steps })
}

/// The validation the flags ask for, with its data: a usage error for --eval-every, --eval-batches,
/// --val-segments or --val-labels without --val-data, validation of a model without a loss, or
/// validation files that do not feed every input of the model.
fn evaluation(args: &RunArgs, plan: &Plan) -> Result<Option<Evaluation>, Failure> {
    let Some(path) = &args.val_data else {
        if args.eval_every.is_some() || args.eval_batches.is_some() {
            return Err(Failure::usage("--eval-every and --eval-batches need --val-data FILE".into()));
        }
        if args.val_segments.is_some() || args.val_labels.is_some() {
            return Err(Failure::usage("--val-segments and --val-labels go with --val-data FILE".into()));
        }
        return Ok(None);
    };
    if !plan.outputs.iter().any(|o| o.is_loss) {
        return Err(Failure::usage("--val-data needs a model with a loss output to validate".into()));
    }
    let files = DataFiles {
        data: Some(path),
        segments: args.val_segments.as_ref(),
        labels: args.val_labels.as_ref(),
        dtype: args.data_dtype,
    };
    let sources = open_sources(&files, args.inputs.objective, args.seed, "val-")?;
    sources.check(plan, "val-").map_err(|e| Failure::usage(e.to_string()))?;
    // Every evaluation reads batches 0..N: read them now, so that an id above the vocabulary is a usage
    // error before step 0, not a failure after the training.
    let batches = args.eval_batches.unwrap_or(1);
    for v in 0..batches {
        sources.batch(plan, v).map_err(|e| Failure::usage(format!("--val-data: validation batch {v}: {e}")))?;
    }
    let plan = plan.clone();
    Ok(Some(Evaluation {
        every: args.eval_every.unwrap_or(args.steps),
        batches,
        data: std::sync::Arc::new(move |v| sources.batch(&plan, v).map_err(|e| e.to_string())),
    }))
}

/// The files that feed a model's inputs besides the token file, and the objective (shared by `run` and
/// `verify`).
#[derive(clap::Args, Debug, Clone)]
pub struct InputArgs {
    /// Token type ids aligned with --data (same dtype and length; position o + t feeds column t of the
    /// sequence at offset o): needed with --data when the model has an input named `segments` or
    /// `token_type_ids`. Without --data, sequences are sentence A then B (or all 0 when the model's
    /// `types` is below 2).
    #[arg(long, value_name = "FILE")]
    pub segments: Option<PathBuf>,
    /// MLM labels aligned with --data (same dtype and length), not shifted: the target of position t is
    /// the label at o + t; the dtype's largest value (65535 in u16 files, 0xFFFFFFFF in u32) marks a
    /// position left out of the loss. Needed with --data and --objective mlm; `optimusc mask-data`
    /// writes it.
    #[arg(long, value_name = "FILE")]
    pub labels: Option<PathBuf>,
    /// What the input named `targets` (or `labels`) holds: causal, the next token of --data; mlm, the
    /// --labels file, with the loss the mean over the positions not ignored (as BertForMaskedLM).
    /// Without --data, mlm labels are drawn from the seed, half of them ignored.
    #[arg(long, value_enum, default_value_t = ObjectiveArg::Causal)]
    pub objective: ObjectiveArg,
}

/// `--objective` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ObjectiveArg {
    Causal,
    Mlm,
}

impl ObjectiveArg {
    pub fn objective(self) -> Objective {
        match self {
            ObjectiveArg::Causal => Objective::Causal,
            ObjectiveArg::Mlm => Objective::Mlm,
        }
    }
}

/// The data files of a run or of its validation.
pub struct DataFiles<'a> {
    pub data: Option<&'a PathBuf>,
    pub segments: Option<&'a PathBuf>,
    pub labels: Option<&'a PathBuf>,
    pub dtype: DataDtype,
}

/// Opens the files and checks them against each other; `flag` is "" for training, "val-" for validation.
pub fn open_sources(files: &DataFiles<'_>, objective: ObjectiveArg, seed: u64, flag: &str) -> Result<Sources, Failure> {
    let dtype = if files.dtype == DataDtype::U32 { TokenDtype::U32 } else { TokenDtype::U16 };
    let open = |path: Option<&PathBuf>, name: &str| {
        path.map(|p| {
            TokenData::open(p, dtype).map_err(|e| {
                if flag.is_empty() && name == "data" { e.to_string() } else { format!("--{flag}{name}: {e}") }
            })
        })
        .transpose()
    };
    for (path, name) in [(files.data, "data"), (files.segments, "segments"), (files.labels, "labels")] {
        if let Some(path) = path {
            check_named_dtype(path, files.dtype, &format!("--{flag}{name}"))?;
        }
    }
    let tokens = open(files.data, "data")?;
    let segments = open(files.segments, "segments")?;
    let labels = open(files.labels, "labels")?;
    Sources::new(tokens, segments, labels, objective.objective(), seed, flag).map_err(|e| Failure::usage(e.to_string()))
}

/// Refuses a file whose name ends in the other dtype (`.u32` read as u16, `.u16` as u32), as
/// `optimusc tokenize` names them: read with the wrong width, every id would be garbage.
pub(super) fn check_named_dtype(path: &std::path::Path, dtype: DataDtype, flag: &str) -> Result<(), Failure> {
    let named = match path.extension().and_then(|e| e.to_str()) {
        Some("u16") => DataDtype::U16,
        Some("u32") => DataDtype::U32,
        _ => return Ok(()),
    };
    if named == dtype {
        return Ok(());
    }
    let (said, given) = if named == DataDtype::U32 { ("u32", "u16") } else { ("u16", "u32") };
    Err(Failure::usage(format!(
        "{flag} `{}` is named a {said} file, but --data-dtype is {given}: give --data-dtype {said}",
        path.display()
    )))
}

/// A warning when the token file is shorter than one step of `plan` reads (see
/// [`TokenData::shortfall_warning`]).
pub fn shortfall_warning(sources: &Sources, plan: &Plan) -> Option<String> {
    let data = sources.tokens.as_ref()?;
    let (batch, seq) = check_inputs(plan).ok()?;
    data.shortfall_warning(batch, seq)
}

/// Why `--shuffle` changes nothing, for a token file shorter than one window (seq + 1 tokens): it is
/// read in order, wrapping, as without the flag.
fn nothing_to_shuffle(sources: &Sources, plan: &Plan) -> Option<String> {
    let data = sources.tokens.as_ref()?;
    let (_, seq) = check_inputs(plan).ok()?;
    (data.windows(seq) == 0).then(|| {
        format!(
            "--shuffle: `{}` holds {} tokens, fewer than one window of {} (seq + 1): there is nothing to shuffle, \
             and it is read in order",
            data.path(),
            data.len(),
            seq + 1
        )
    })
}

/// Optimizer flags; the defaults are PyTorch's.
#[derive(clap::Args, Debug, Clone)]
pub struct OptimizerArgs {
    /// sgd (with momentum, as torch.optim.SGD) or adamw (as torch.optim.AdamW).
    #[arg(long, value_enum, default_value_t = OptimizerArg::Adamw)]
    pub optimizer: OptimizerArg,
    /// Learning rate (finite, >= 0).
    #[arg(long, default_value_t = 1e-3, value_parser = super::flags::non_negative)]
    pub lr: f32,
    /// Weight decay (decoupled for AdamW, added to the gradient for SGD; finite, >= 0). Default: 0.01 for
    /// AdamW, 0 for SGD.
    #[arg(long, value_parser = super::flags::non_negative)]
    pub weight_decay: Option<f32>,
    /// SGD momentum (finite, >= 0).
    #[arg(long, default_value_t = 0.0, value_parser = super::flags::non_negative)]
    pub momentum: f32,
    /// AdamW beta1, in [0, 1).
    #[arg(long, default_value_t = 0.9, value_parser = super::flags::beta)]
    pub beta1: f32,
    /// AdamW beta2, in [0, 1).
    #[arg(long, default_value_t = 0.999, value_parser = super::flags::beta)]
    pub beta2: f32,
    /// AdamW epsilon (finite, >= 0).
    #[arg(long, default_value_t = 1e-8, value_parser = super::flags::non_negative)]
    pub eps: f32,
}

impl OptimizerArgs {
    pub fn settings(&self) -> OptimizerSettings {
        let (kind, decay) = match self.optimizer {
            OptimizerArg::Sgd => (OptimizerKind::Sgd, 0.0),
            OptimizerArg::Adamw => (OptimizerKind::AdamW, 0.01),
        };
        OptimizerSettings {
            kind,
            lr: self.lr,
            weight_decay: self.weight_decay.unwrap_or(decay),
            momentum: self.momentum,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OptimizerArg {
    Sgd,
    Adamw,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// Host kernels: one thread per device in this process, or one process per device under mpirun/srun.
    Cpu,
    /// One NVIDIA GPU per device (a build with `--features cuda`): cuBLAS and NVRTC kernels, NCCL collectives.
    Cuda,
}

impl Backend {
    pub fn kind(self) -> optimus::runtime::backend::BackendKind {
        match self {
            Backend::Cpu => optimus::runtime::backend::BackendKind::Cpu,
            Backend::Cuda => optimus::runtime::backend::BackendKind::Cuda,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DataDtype {
    U16,
    U32,
}

pub fn run(args: &RunArgs) -> ExitCode {
    let args = &match super::recorded::with_recorded_flags(args) {
        Ok(args) => args,
        Err(failure) => return failure.exit(),
    };
    if args.pipeline.requested()
        && let Err(failure) = super::pipeline_run::refuse_unsupported(args)
    {
        return failure.exit();
    }
    if let Some(launch) = optimus::runtime::launch::detect().filter(|l| l.is_multi_process()) {
        return multi_process::run(args, &launch);
    }
    let job = match prepare(args) {
        Ok(job) => job,
        Err(failure) => return failure.exit(),
    };
    let ran = if args.pipeline.requested() {
        let cut = match super::pipeline_run::program_of(args, &job.plan) {
            Ok(cut) => cut,
            Err(failure) => return failure.exit(),
        };
        super::pipeline_run::run_pipelined(args, &job, cut)
    } else {
        run_on_threads(args, &job)
    };
    match ran {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => failure_status(&e),
    }
}

/// Prints an error; an empty message means the problem has been reported already.
fn report(e: &str) {
    if !e.is_empty() {
        eprintln_safe!("error: {e}");
    }
}

/// Everything a run needs, read and checked before any device starts.
pub(super) struct Prepared {
    pub(super) plan: Plan,
    /// `--tokenizer`, loaded and checked against the model's vocabulary.
    pub(super) tokenizer: Option<optimus::text::Tokenizer>,
    pub(super) sources: Sources,
    pub(super) initial: BTreeMap<String, optimus::plan::tensor::Tensor>,
    pub(super) config: RunConfig,
}

fn prepare(args: &RunArgs) -> Result<Prepared, Failure> {
    refuse_outputs_onto_inputs(args)?;
    let schedule = schedule(args)?;
    args.backend.kind().check_available()?;
    // A path that cannot be written is found now, not after the whole run.
    if let Some(path) = &args.save_weights {
        check_weights_destination(path, args.tokenizer.is_some()).map_err(Failure::usage)?;
    }
    // Under mpirun every rank prepares; rank 0 alone warns and writes the log.
    let leader = optimus::runtime::launch::detect().is_none_or(|launch| launch.rank == 0);
    if let Some(path) = args.log.as_ref().filter(|_| leader) {
        check_appendable(path).map_err(|e| Failure::usage(format!("--log: {e}")))?;
    }
    let plan = plan_from(&args.input, &args.target)?;
    if super::is_decoding_step(&plan) {
        return Err(Failure::usage(format!(
            "`{}` is a decoding step with key/value caches (compile --max-context), whose `{}` input and caches \
             follow a generation: run it with `optimusc generate {}`",
            args.input.display(),
            optimus::decode::POSITION_INPUT,
            args.input.display()
        )));
    }
    // Flags that cannot apply to this plan are refused before its data and weights are read.
    if plan.mode != Mode::Train {
        refuse_training_flags(args)?;
    }
    if args.max_shard_size.is_some() && !args.save_weights.as_deref().is_some_and(saves_a_directory) {
        return Err(Failure::usage(
            "--max-shard-size sizes the shards of --save-weights DIR/ (a folder, as save_pretrained writes); \
             without it there are no shards: drop the flag, or give a folder"
                .into(),
        ));
    }
    let files = DataFiles {
        data: args.data.as_ref(),
        segments: args.inputs.segments.as_ref(),
        labels: args.inputs.labels.as_ref(),
        dtype: args.data_dtype,
    };
    let mut sources = open_sources(&files, args.inputs.objective, args.seed, "")?;
    sources.check(&plan, "").map_err(|e| Failure::usage(e.to_string()))?;
    if args.shuffle {
        if sources.drawn_from_seed() {
            return Err(Failure::usage(
                "--shuffle orders the windows of --data; without --data every token is drawn from the seed already"
                    .into(),
            ));
        }
        sources.order = optimus::io::Order::Shuffled { seed: args.seed };
        if let Some(note) = nothing_to_shuffle(&sources, &plan).filter(|_| leader) {
            eprintln_safe!("warning: {note}");
        }
    }
    if sources.drawn_from_seed() {
        // Drawn tokens need the model's vocabulary: a model without one is a usage error now, not a
        // device's failure at step 0.
        sources.batch(&plan, 0).map_err(|e| Failure::usage(format!("tokens drawn from the seed: {e}")))?;
    } else if args.checkpoint.resume.is_none() {
        // The first batch read now, as --val-data's are: an id at or past the vocabulary is then a usage
        // error before step 0, not a device's failure once the run has started. (A resumed run reads
        // the batch it starts from, below, once its step is known.)
        sources.batch(&plan, 0).map_err(|e| Failure::usage(format!("batch 0 of the data: {e}")))?;
    }
    if sources.drawn_from_seed() && leader {
        let what = if plan.mode == Mode::Train { "training on" } else { "running" };
        eprintln_safe!(
            "note: no --data: {what} tokens drawn from seed {} (random; for checking a plan and measuring speed); \
             give --data FILE to use a corpus (docs/training.md)",
            args.seed
        );
    }
    if let Some(warning) = shortfall_warning(&sources, &plan).filter(|_| leader) {
        eprintln_safe!("warning: {warning}");
    }
    optimus::runtime::startup::mark("plan ready and data opened");
    let (initial, weights) = initial_weights(args, &plan)?;
    optimus::runtime::startup::mark("initial weights drawn");
    let config = RunConfig {
        seed: args.seed,
        steps: args.steps,
        optimizer: args.optimizer.settings(),
        timeout: Duration::from_secs_f64(args.timeout),
        fault: injected_fault(&plan)?,
        backend: args.backend.kind(),
        profile: args.profile,
        profile_warm_up: 1,
        schedule: (schedule.kind != ScheduleKind::Constant || schedule.warmup > 0).then_some(schedule),
        evaluation: evaluation(args, &plan)?,
        accumulation: args.accum,
        clip_grad_norm: args.clip_grad_norm,
        start_step: 0,
        resume: None,
        weights: weights.map(|w| w as Arc<dyn WeightSource>),
        checkpoints: None,
        stop: (plan.mode == Mode::Train).then_some(optimus::io::output::stop_requested as fn() -> bool),
        step_outputs: None,
        kernels_inline: None,
        prefill: None,
        final_state: true,
    };
    let resumption = super::resume::resumption(args, &plan)?;
    let config = RunConfig {
        start_step: resumption.start_step,
        resume: resumption.resume.map(|c| c as Arc<dyn CheckpointSource>),
        checkpoints: resumption.checkpoints,
        ..config
    };
    let first = config.start_step.saturating_mul(args.accum);
    if args.checkpoint.resume.is_some() && !sources.drawn_from_seed() {
        // A resumed run reads the batch it starts from first, as a fresh run reads batch 0 above.
        sources.batch(&plan, first).map_err(|e| Failure::usage(format!("batch {first} of the data: {e}")))?;
    }
    if config.clip_grad_norm.is_some() && plan.grad_norm.is_none() {
        return Err(Failure::usage(
            "--clip-grad-norm: this plan was compiled before optimusc computed gradient norms; compile it again".into(),
        ));
    }
    let tokenizer = args.tokenizer.as_deref().map(|name| checked_tokenizer(name, args, &plan)).transpose()?;
    if args.profile && args.backend == Backend::Cpu {
        // Beside the peak measured after the run, to tell whether the machine kept its speed.
        optimus::runtime::peak::measure_before_run();
    }
    Ok(Prepared { plan, tokenizer, sources, initial, config })
}

/// Refuses, for a plan that infers, every training-only flag the command line gave: they would do
/// nothing, and its records would show a learning rate nothing used.
fn refuse_training_flags(args: &RunArgs) -> Result<(), Failure> {
    let given = super::recorded::training_only_given(args);
    if given.is_empty() {
        return Ok(());
    }
    Err(Failure::usage(format!(
        "{} {} up training, and this plan infers (no gradients, no updates): drop {}, or compile with --mode train",
        given.join(", "),
        if given.len() == 1 { "sets" } else { "set" },
        if given.len() == 1 { "it" } else { "them" }
    )))
}

/// `--tokenizer`, refused unless it goes with `--save-weights DIR/` and the model's vocabulary holds its ids.
pub(super) fn checked_tokenizer(name: &str, args: &RunArgs, plan: &Plan) -> Result<optimus::text::Tokenizer, Failure> {
    if !args.save_weights.as_deref().is_some_and(saves_a_directory) {
        return Err(Failure::usage(
            "--tokenizer writes the tokenizer's files beside --save-weights DIR/: give a folder".into(),
        ));
    }
    let tokenizer = optimus::text::Tokenizer::load(name).map_err(|e| Failure::usage(format!("--tokenizer: {e}")))?;
    let vocab = optimus::io::sources::vocab(plan).map_err(|e| Failure::usage(e.to_string()))?;
    if u64::from(tokenizer.vocab_size()) > vocab {
        return Err(Failure::usage(format!(
            "--tokenizer {} makes ids up to {}, and the model's vocab is {vocab}: give --set vocab={} or more",
            tokenizer.name(),
            tokenizer.vocab_size() - 1,
            tokenizer.vocab_size()
        )));
    }
    Ok(tokenizer)
}

/// Writes the tokenizer's files into the `--save-weights` folder.
fn save_tokenizer(dir: &Path, tokenizer: &optimus::text::Tokenizer, plan: &Plan) -> Result<(), String> {
    let files = tokenizer.hub_files(plan.positive_config("context")).map_err(|e| e.to_string())?;
    for (name, text) in &files {
        optimus::io::write_file(&dir.join(name), text.as_bytes()).map_err(|e| e.to_string())?;
    }
    eprintln_safe!(
        "saved the tokenizer {} to {} (tokenizer.json, tokenizer_config.json)",
        tokenizer.name(),
        dir.display()
    );
    Ok(())
}

/// An output of the run (--save-weights, --log) that is one of its inputs (the model, a data file,
/// --weights) would destroy it, or be read back as data: a usage error naming both.
fn refuse_outputs_onto_inputs(args: &RunArgs) -> Result<(), Failure> {
    let inputs = [
        Some(&args.input),
        args.data.as_ref(),
        args.inputs.segments.as_ref(),
        args.inputs.labels.as_ref(),
        args.val_data.as_ref(),
        args.val_segments.as_ref(),
        args.val_labels.as_ref(),
        args.weights.as_ref(),
    ];
    let outputs = [("--save-weights", args.save_weights.as_ref()), ("--log", args.log.as_ref())];
    for (flag, output) in outputs.into_iter().filter_map(|(f, o)| o.map(|o| (f, o))) {
        for input in inputs.iter().flatten() {
            super::refuse_overwriting_input(output, input, flag)?;
        }
        refuse_output_into_checkpoints(args, flag, output)?;
    }
    if let (Some(weights), Some(log)) = (&args.save_weights, &args.log)
        && resolved(weights) == resolved(log)
    {
        return Err(Failure::usage(format!(
            "--save-weights and --log both name `{}`: the weights would replace the log; name two files",
            weights.display()
        )));
    }
    Ok(())
}

/// An output inside a checkpoint the run resumes from or writes (the step folder --resume names, or a
/// `step-*` folder of --resume's or --checkpoint-dir's folder) would corrupt it, and `--save-weights`
/// into such a folder itself would put a Hugging Face save beside the checkpoints, which `--weights
/// DIR` could not tell apart: a usage error naming the folder.
fn refuse_output_into_checkpoints(args: &RunArgs, flag: &str, output: &Path) -> Result<(), Failure> {
    let folders = [args.checkpoint.resume.as_deref(), args.checkpoint.checkpoint_dir.as_deref()];
    let output_at = resolved(output);
    for folder in folders.into_iter().flatten() {
        let folder_at = resolved(folder);
        let Ok(inside) = output_at.strip_prefix(&folder_at) else { continue };
        let step_folder = folder.join(optimus::io::shards::MANIFEST).is_file();
        let in_a_step =
            inside.components().next().is_some_and(|c| c.as_os_str().to_string_lossy().starts_with("step-"));
        let beside = inside.as_os_str().is_empty() && flag == "--save-weights";
        if step_folder || in_a_step || beside {
            return Err(Failure::usage(format!(
                "{flag} `{}` lies in the checkpoint folder `{}`, which this run {}: name a path outside its \
                 checkpoints",
                output.display(),
                folder.display(),
                if Some(folder) == args.checkpoint.resume.as_deref() { "resumes from" } else { "writes" }
            )));
        }
    }
    Ok(())
}

/// `path` made absolute through its nearest existing ancestor (links and `..` resolved there), the rest
/// appended as written: two names of one destination compare equal even before it exists.
fn resolved(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut rest = Vec::new();
    let mut existing = absolute.as_path();
    loop {
        if let Ok(real) = std::fs::canonicalize(existing) {
            return rest.iter().rev().fold(real, |at, part| at.join(part));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                existing = parent;
            }
            _ => return absolute,
        }
    }
}

fn run_on_threads(args: &RunArgs, job: &Prepared) -> Result<(), String> {
    let (progress, epochs) = progress_of(args, job)?;
    let batches = |index| epochs.batch(job, index);
    stop_gracefully(job);
    let output = optimus::runtime::local::run(&job.plan, &job.config, &batches, &job.initial, &|r| progress.step(r))?;
    finish(args, job, &progress, &output)
}

/// The progress lines (and log) of a run on threads, and its epoch notes.
pub(super) fn progress_of(args: &RunArgs, job: &Prepared) -> Result<(Progress, EpochNotes), String> {
    let progress = Progress::new(&job.plan, args.steps, args.json)
        .with_micro_batches(args.accum)
        .with_log(open_log(args)?)
        .starting_at(job.config.start_step);
    let epochs = EpochNotes::new(&job.sources, &job.plan, job.config.start_step * args.accum, args.accum);
    Ok((progress, epochs))
}

/// The note a run prints when a step starts a new pass over --data, once whichever device loads it.
pub struct EpochNotes {
    /// The epoch of the last batch announced (or of the first batch of the run).
    announced: std::sync::atomic::AtomicU64,
    accum: u64,
}

impl EpochNotes {
    /// Starting at batch `first` (the first of the run, or of the resumed part), `accum` batches a step.
    pub fn new(sources: &optimus::io::sources::Sources, plan: &Plan, first: u64, accum: u64) -> EpochNotes {
        let epoch = sources.epoch(plan, first).unwrap_or(0);
        EpochNotes { announced: std::sync::atomic::AtomicU64::new(epoch), accum: accum.max(1) }
    }

    /// Prints the note if batch `index` is the first of an epoch not announced yet.
    /// Batch `index` of the job's data, with the note when it starts an epoch.
    pub(super) fn batch(
        &self,
        job: &Prepared,
        index: u64,
    ) -> Result<BTreeMap<String, optimus::plan::tensor::Tensor>, String> {
        self.note(&job.sources, &job.plan, index);
        job.sources.batch(&job.plan, index).map_err(|e| e.to_string())
    }

    pub fn note(&self, sources: &optimus::io::sources::Sources, plan: &Plan, index: u64) {
        let Some(epoch) = sources.epoch(plan, index) else { return };
        if self.announced.fetch_max(epoch, std::sync::atomic::Ordering::Relaxed) >= epoch {
            return;
        }
        if let Some(text) = sources.epoch_text(plan, epoch) {
            eprintln_safe!("note: step {} starts epoch {} of {text}", index / self.accum, epoch + 1);
        }
    }
}

pub(super) use optimus::plan::text::duration_text;

/// `OPTIMUS_INJECT_FAULT`, checked: a malformed value, or a device past the mesh (a fault that would
/// never fire, and a rehearsal that would pass for the wrong reason), is a usage error.
fn injected_fault(plan: &Plan) -> Result<Option<optimus::runtime::fault::Fault>, Failure> {
    let fault = optimus::runtime::fault::from_env().map_err(|e| Failure::usage(e.to_string()))?;
    let devices = plan.mesh.devices();
    if let Some(f) = fault.filter(|f| f.device >= devices) {
        return Err(Failure::usage(format!(
            "OPTIMUS_INJECT_FAULT names device {}, and the {} mesh has {devices} (numbered from 0, row-major)",
            f.device, plan.mesh
        )));
    }
    Ok(fault)
}

/// Makes the first Ctrl-C or SIGTERM of a training run finish the current step (and write a checkpoint)
/// rather than kill it; a second one stops at once.
pub(super) fn stop_gracefully(job: &Prepared) {
    if job.config.stop.is_none() {
        return;
    }
    let then = if job.config.checkpoints.is_some() { ", writing a checkpoint," } else { "" };
    // Under a launcher every rank gets the signal (mpirun forwards it, or sends it when another rank
    // failed): rank 0 says what happens, once.
    let leader = optimus::runtime::launch::detect().is_none_or(|launch| launch.rank == 0);
    let message = if leader {
        format!(
            "interrupt: finishing the current step{then} then stopping, once every device has finished it \
             (interrupt again to stop at once)"
        )
    } else {
        String::new()
    };
    optimus::io::output::graceful_stop(&message);
}

/// The `--log` file opened for appending, on the one process that reports.
pub(super) fn open_log(args: &RunArgs) -> Result<Option<MetricsLog>, String> {
    args.log.as_deref().map(|path| MetricsLog::append_to(path).map_err(|e| format!("--log: {e}"))).transpose()
}

/// Reports the run and saves the weights (on the one process that prints); a record `--log` could not
/// append fails the run after the weights are saved.
pub(super) fn finish(args: &RunArgs, job: &Prepared, progress: &Progress, output: &RunOutput) -> Result<(), String> {
    progress.finish(output);
    let last = output.steps.last();
    let interrupted = last.is_some_and(|r| r.step + 1 < args.steps);
    if let Some(path) = &args.save_weights {
        if saves_a_directory(path) && job.tokenizer.is_some() {
            // Checked again (the folder may have changed during the run) before any weight is written.
            let names = optimus::text::HUB_FILES.map(String::from);
            optimus::io::pretrained::check_all_writable(path, &names).map_err(|e| format!("--save-weights: {e}"))?;
        }
        save_weights(path, args.max_shard_size.unwrap_or(DEFAULT_MAX_SHARD_BYTES), job, output)?;
        if let Some(tokenizer) = &job.tokenizer {
            save_tokenizer(path, tokenizer, &job.plan)?;
        }
    }
    // A pipeline's devices run their stages' programs: pipeline_run reports those.
    if args.profile && !args.pipeline.requested() {
        print_profile((&job.plan, job.config.backend), output, progress);
    }
    progress.log_failure()?;
    if interrupted {
        let steps_done = last.map_or(0, |r| r.step + 1);
        let checkpoint = last.and_then(|r| r.checkpoint.as_deref());
        let folder = job.config.checkpoints.as_ref().map(|c| c.sink.location());
        eprintln_safe!("{}", super::resume::interrupted_message(args, steps_done, checkpoint, folder));
        return Err(INTERRUPTED.into());
    }
    Ok(())
}

/// The shard size of `--save-weights DIR/` without `--max-shard-size`: 5GB, as `save_pretrained`'s.
const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The error [`finish`] returns for a run stopped by a signal: reported already, exit status 130.
const INTERRUPTED: &str = "\u{0}interrupted";

/// The exit status of a failed run: 130 after an interrupt, else 1.
fn failure_status(e: &str) -> ExitCode {
    if e == INTERRUPTED {
        ExitCode::from(optimus::io::output::interrupted_status())
    } else {
        report(e);
        ExitCode::from(1)
    }
}

/// The `--profile` tables on standard error, and the profile record (with `--json` or `--log`).
fn print_profile(
    (plan, backend): (&Plan, optimus::runtime::backend::BackendKind),
    output: &RunOutput,
    progress: &Progress,
) {
    use optimus::runtime::{peak, profile};
    if output.profiles.is_empty() {
        eprintln_safe!("note: --profile: no device profiled");
        return;
    }
    let peak = peak::of_backend(backend);
    let report = profile::report(plan, &output.profiles, &peak);
    if (output.profiles.len() as u64) < plan.mesh.devices() {
        eprintln_safe!("note: --profile reports device (0, 0) only: under mpirun profiles are not gathered");
    }
    emit_profile(&report, progress);
}

/// The profile's tables on standard error, and its record (with `--json` or `--log`).
pub(super) fn emit_profile(report: &optimus::runtime::profile::ProfileReport, progress: &Progress) {
    optimus::plan::text::write_stderr(&report.to_text());
    progress.emit(&serde_json::json!({ "profile": report }));
}

/// Runs under mpirun or srun: one device per process.
#[cfg(feature = "mpi")]
mod multi_process {
    use super::*;
    use optimus::plan::pipeline::Schedule;
    use optimus::plan::pipeline_cut::PipelineProgram;
    use optimus::runtime::launch::Launch;
    use optimus::runtime::mpi::{JobOptions, MpiJob};
    use optimus::runtime::pipeline::PipelineRun;

    /// The stage programs and schedule of a pipelined job.
    type Cut = (PipelineProgram, Schedule);

    pub fn run(args: &RunArgs, _launch: &Launch) -> ExitCode {
        // A restart to find the CUDA libraries must come before MPI_Init.
        if let Some(warning) = args.backend.kind().find_libraries() {
            optimus::plan::text::write_stderr(&format!("warning: {warning}\n"));
        }
        let mpi = match MpiJob::init() {
            Ok(mpi) => mpi,
            Err(e) => {
                report(&e);
                return ExitCode::from(1);
            }
        };
        // Rank 0 reads and checks the inputs first, so that a bad input is reported once; the others
        // follow only if it succeeded, and report what fails for them alone with their rank.
        let first = (mpi.rank() == 0).then(|| prepare_ranks(args, &mpi));
        if !mpi.leader_agrees(first.as_ref().is_some_and(Result::is_ok)) {
            return match first {
                Some(Err(failure)) => failure.exit(),
                _ => ExitCode::from(1),
            };
        }
        let prepared = first.unwrap_or_else(|| prepare_ranks(args, &mpi));
        let failures = mpi.failures(prepared.is_err());
        let (job, cut) = match prepared {
            Ok(job) if failures == 0 => job,
            Ok(_) => return ExitCode::from(1),
            Err(failure) => {
                let status = failure.status;
                report(&format!("rank {}: {}", mpi.rank(), failure.message));
                return ExitCode::from(status);
            }
        };
        let leader = mpi.rank() == 0;
        let log = if leader { open_log(args).unwrap_or_else(|e| mpi.abort(&e)) } else { None };
        let progress = Progress::new(&job.plan, if leader { args.steps } else { 0 }, args.json || !leader)
            .with_micro_batches(args.accum)
            .with_log(log)
            .starting_at(job.config.start_step);
        let epochs = EpochNotes::new(&job.sources, &job.plan, job.config.start_step * args.accum, args.accum);
        let batches = |index| {
            if leader {
                epochs.note(&job.sources, &job.plan, index);
            }
            job.sources.batch(&job.plan, index).map_err(|e| e.to_string())
        };
        let on_step = |r: &StepRecord| progress.step(r);
        stop_gracefully(&job);
        let result = match &cut {
            Some((program, schedule)) => {
                let pipe = PipelineRun { program, schedule: *schedule };
                let gather = args.save_weights.is_some();
                mpi.run_pipeline(&job.plan, pipe, &job.config, &batches, &job.initial, gather, &on_step).and_then(
                    |output| match output {
                        Some(output) => {
                            finish(args, &job, &progress, &output.run)?;
                            super::super::pipeline_run::report_stages(args, (program, *schedule), &output, &progress);
                            Ok(())
                        }
                        None => Ok(()),
                    },
                )
            }
            None => {
                let options = JobOptions { placement: args.placement.placement(), gather: args.save_weights.is_some() };
                let result = mpi.run(&job.plan, &job.config, &batches, &job.initial, options, &on_step);
                result.and_then(|output| output.map_or(Ok(()), |output| finish(args, &job, &progress, &output)))
            }
        };
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) if e == INTERRUPTED => failure_status(&e),
            Err(e) => mpi.abort(&e),
        }
    }

    /// [`prepare`], a plan whose mesh has one device per process (of every stage, with --pipeline), and
    /// the stage programs --pipeline asks for.
    fn prepare_ranks(args: &RunArgs, mpi: &MpiJob) -> Result<(Prepared, Option<Cut>), Failure> {
        // A model compiled on the fly has the flags' mesh: a job of the wrong size is refused before the
        // compile, the data and the weights.
        if !super::super::names_a_plan(&args.input) {
            let stages = args.pipeline.stages_and_schedule().map_or(1, |(stages, _)| stages);
            check_job_size(args.target.mesh(), stages, mpi.size())?;
        }
        let job = prepare(args)?;
        let cut = if args.pipeline.requested() {
            Some(super::super::pipeline_run::program_of(args, &job.plan)?)
        } else {
            None
        };
        let stages = cut.as_ref().map_or(1, |(program, _)| program.stages.len() as u64);
        check_job_size(job.plan.mesh, stages, mpi.size())?;
        Ok((job, cut))
    }

    /// One process per device of every stage, or an error saying how many to start.
    fn check_job_size(mesh: optimus::plan::Mesh, stages: u64, processes: u64) -> Result<(), Failure> {
        let devices = mesh.devices();
        if devices * stages == processes {
            return Ok(());
        }
        let per_stage = if stages > 1 { format!(" in each of {stages} stages") } else { String::new() };
        Err(Failure::from(format!(
            "the plan's {mesh} mesh has {devices} devices{per_stage} but the job has {processes} processes; start one \
             process per device (-np {})",
            devices * stages
        )))
    }
}

/// Without the `mpi` feature a multi-process launch cannot work: say how to build one that does.
#[cfg(not(feature = "mpi"))]
mod multi_process {
    use super::*;
    use optimus::runtime::launch::Launch;

    pub fn run(_args: &RunArgs, launch: &Launch) -> ExitCode {
        if launch.rank == 0 {
            eprintln_safe!(
                "error: {} started {} processes, but this optimusc was built without MPI support; \
                 build it with `cargo build --release --features mpi` (see docs/clusters.md)",
                launch.launcher,
                launch.size
            );
        }
        ExitCode::from(1)
    }
}

/// The JSON records of one step, built here alone: `--json` prints them and `--log` appends them. An
/// inference step updates nothing: its `lr`, like its `grad_norm`, is null.
fn step_records(r: &StepRecord, tokens_per_s: f64, elapsed_s: f64, train: bool) -> Vec<serde_json::Value> {
    let train = serde_json::json!({
        "step": r.step,
        "loss": r.loss,
        "lr": train.then_some(r.lr),
        "grad_norm": r.grad_norm,
        "tokens_per_s": tokens_per_s,
        "elapsed_s": elapsed_s,
    });
    let val = r.val_loss.map(|val| serde_json::json!({"step": r.step, "val_loss": val}));
    let checkpoint = r.checkpoint.as_ref().map(|path| serde_json::json!({"step": r.step, "checkpoint": path}));
    std::iter::once(train).chain(val).chain(checkpoint).collect()
}

/// Per-step reporting: JSON lines, a progress bar on a terminal, or plain lines; and the `--log` file.
pub(super) struct Progress {
    tokens_per_step: u64,
    json: bool,
    bar: Option<indicatif::ProgressBar>,
    start: Instant,
    /// The run's last step (`--steps`) and the step it started at (later when resumed), for the ETA.
    steps: u64,
    first_step: u64,
    train: bool,
    log: Option<MetricsLog>,
    /// The first record `--log` could not append; no more are tried after it.
    log_failed: std::sync::OnceLock<String>,
}

impl Progress {
    /// Appends every record to `log` as well.
    pub(super) fn with_log(mut self, log: Option<MetricsLog>) -> Progress {
        self.log = log;
        self
    }

    /// Prints a record with `--json` and appends it to the `--log` file: every record goes through here.
    pub(super) fn emit(&self, record: &serde_json::Value) {
        if self.json {
            super::stdout_json(&format!("{record}\n"));
        }
        let Some(log) = self.log.as_ref().filter(|_| self.log_failed.get().is_none()) else { return };
        if let Err(e) = log.append(record) {
            eprintln_safe!("warning: --log: {e}; no further records are logged");
            let _ = self.log_failed.set(e.to_string());
        }
    }

    /// An error when a record could not be appended to the `--log` file.
    fn log_failure(&self) -> Result<(), String> {
        self.log_failed
            .get()
            .map_or(Ok(()), |e| Err(format!("--log: {e}; the records from then on are not in the log")))
    }

    /// A resumed run: the bar starts at the checkpoint's step.
    pub(super) fn starting_at(mut self, step: u64) -> Progress {
        if let Some(bar) = &self.bar {
            bar.set_position(step);
            bar.reset_eta();
        }
        self.first_step = step;
        self
    }

    /// The time the steps after `step` should take at the pace of the steps this process has run so
    /// far; `None` after the last step.
    fn eta(&self, step: u64) -> Option<String> {
        let done = (step + 1).saturating_sub(self.first_step);
        let left = self.steps.saturating_sub(step + 1);
        (done > 0 && left > 0).then(|| duration_text(self.start.elapsed().as_secs_f64() / done as f64 * left as f64))
    }

    /// Counts the tokens of `n` micro-batches in each step's throughput.
    pub(super) fn with_micro_batches(mut self, n: u64) -> Progress {
        self.tokens_per_step = self.tokens_per_step.saturating_mul(n);
        self
    }

    pub(super) fn new(plan: &Plan, steps: u64, json: bool) -> Progress {
        let tokens_per_step = check_inputs(plan).map_or(0, |(b, s)| b * s);
        let bar = super::terminal_bar(steps, "{bar:30} {pos}/{len} steps  {msg}  ETA {eta}", json);
        Progress {
            tokens_per_step,
            json,
            bar,
            start: Instant::now(),
            steps,
            first_step: 0,
            train: plan.mode == Mode::Train,
            log: None,
            log_failed: std::sync::OnceLock::new(),
        }
    }

    pub(super) fn step(&self, r: &StepRecord) {
        let tokens_per_s = self.tokens_per_step as f64 / r.elapsed.as_secs_f64().max(1e-9);
        let elapsed = self.start.elapsed().as_secs_f64();
        for record in step_records(r, tokens_per_s, elapsed, self.train) {
            self.emit(&record);
        }
        if self.json {
            return;
        }
        let loss = r.loss.map_or_else(|| "-".to_string(), |l| format!("{l:.4}"));
        match &self.bar {
            Some(bar) => {
                bar.set_message(format!("loss {loss}  {tokens_per_s:.0} tokens/s"));
                bar.inc(1);
            }
            None => {
                let eta = self.eta(r.step).map_or_else(String::new, |left| format!("  ETA {left}"));
                super::stdout(&format!(
                    "step {}: loss {loss}  {tokens_per_s:.0} tokens/s  {elapsed:.2} s{eta}\n",
                    r.step
                ))
            }
        }
        if let Some(val) = r.val_loss {
            self.note(format!("step {}: validation loss {val:.4}", r.step));
        }
        if let Some(path) = &r.checkpoint {
            self.note(format!("step {}: checkpoint {}", r.step, path.display()));
        }
    }

    /// A line of its own under the progress bar, or on standard output without one.
    pub(super) fn note(&self, line: String) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => super::stdout(&format!("{line}\n")),
        }
    }

    fn finish(&self, output: &RunOutput) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
        if self.json {
            return;
        }
        let losses: Vec<f32> = output.steps.iter().filter_map(|s| s.loss).collect();
        if let (Some(first), Some(last)) = (losses.first(), losses.last()) {
            let what = if self.train { "trained" } else { "ran" };
            let steps = optimus::plan::text::plural(output.steps.len() as u64, "step");
            eprintln_safe!("{what} {steps}: loss {first:.4} -> {last:.4}");
        }
    }
}

/// Whole logical tensors by parameter name, and mapped files to read device blocks from.
type InitialWeights = (BTreeMap<String, Tensor>, Option<Arc<MappedWeights>>);

/// The `--weights` a run starts from: a sharded training checkpoint's logical tensors, or Hugging Face files
/// kept mapped, from which every device reads only its blocks.
fn initial_weights(args: &RunArgs, plan: &Plan) -> Result<InitialWeights, String> {
    weights_for(args.weights.as_ref(), args.allow_non_finite_weights, plan)
}

/// The weights at `path` (as `--weights` reads them) for `plan`: see [`initial_weights`].
pub(super) fn weights_for(path: Option<&PathBuf>, allow: bool, plan: &Plan) -> Result<InitialWeights, String> {
    let leader = optimus::runtime::launch::detect().is_none_or(|launch| launch.rank == 0);
    if let Some(warning) = path.filter(|_| leader).and_then(|p| super::weights_config::warning(p, plan)) {
        eprintln_safe!("warning: {warning}");
    }
    if let Some(dir) = path.filter(|p| p.is_dir())
        && let Some(save) = pretrained_file(dir)
        && (dir.join(optimus::io::shards::MANIFEST).is_file()
            || !optimus::io::shards::complete_checkpoints(dir).is_empty())
    {
        return Err(format!(
            "`{}` holds both a Hugging Face save (`{}`) and training checkpoints: name the one to load, that file \
             or a checkpoint's folder (`step-NNNNNNNN`)",
            dir.display(),
            save.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned())
        ));
    }
    match path {
        None => Ok((BTreeMap::new(), None)),
        Some(path) if path.is_dir() && pretrained_file(path).is_none() => {
            Ok((load_weights(path, plan, allow).map_err(|e| e.to_string())?, None))
        }
        Some(path) => Ok((BTreeMap::new(), Some(Arc::new(map_weights(path, plan, allow).map_err(|e| e.to_string())?)))),
    }
}

/// Checks before step 0 that `--save-weights` can be written: the file, or (for a directory, created now if
/// missing) the files it will hold, the tokenizer's too `with_tokenizer`.
fn check_weights_destination(path: &Path, with_tokenizer: bool) -> Result<(), String> {
    let fail = |e: String| format!("--save-weights: {e}");
    if !saves_a_directory(path) {
        return optimus::io::check_writable(path).map_err(|e| fail(e.to_string()));
    }
    if path.join(optimus::io::shards::MANIFEST).is_file() || !optimus::io::shards::complete_checkpoints(path).is_empty()
    {
        return Err(fail(format!(
            "`{}` holds training checkpoints: a Hugging Face save beside them would make `--weights {}` ambiguous; \
             name another folder",
            path.display(),
            path.display()
        )));
    }
    let tokenizer = if with_tokenizer { &optimus::text::HUB_FILES[..] } else { &[] };
    let names = optimus::io::pretrained::folder_files(tokenizer);
    optimus::io::pretrained::check_all_writable(path, &names).map_err(|e| fail(e.to_string()))
}

/// Whether `--save-weights` names a directory (the `save_pretrained` layout) rather than one file.
pub(super) fn saves_a_directory(path: &Path) -> bool {
    path.is_dir() || path.as_os_str().to_string_lossy().ends_with(['/', std::path::MAIN_SEPARATOR])
}

/// Writes the final weights to one file, or in the `save_pretrained` layout into a directory.
fn save_weights(path: &Path, max_shard: u64, job: &Prepared, output: &RunOutput) -> Result<(), String> {
    if !saves_a_directory(path) {
        save_checkpoint(path, &job.plan, &output.params).map_err(|e| e.to_string())?;
        eprintln_safe!("saved weights to {}", path.display());
        return Ok(());
    }
    let saved = optimus::io::pretrained::save_pretrained(path, &job.plan, &output.params, max_shard)
        .map_err(|e| e.to_string())?;
    let files = optimus::plan::text::plural(saved.files.len() as u64, "file");
    eprintln_safe!("saved weights to {} ({files}: {})", path.display(), saved.files.join(", "));
    if let Some(why) = saved.no_config {
        eprintln_safe!("note: {why}; from_pretrained needs one beside the weights");
    }
    Ok(())
}
