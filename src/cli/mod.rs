//! Pieces of the command line shared by several commands: target flags, loading and compiling models,
//! and writing to standard output.

pub mod calibrate;
pub mod eval;
pub mod export;
pub mod fit;
pub mod flags;
pub mod generate;
pub mod inspect_pipeline;
pub mod mask;
pub mod pipeline;
pub mod pipeline_run;
pub mod plan;
pub mod plot;
pub mod recorded;
pub mod resume;
pub mod run;
pub mod simulate;
pub mod tokenize;
pub mod verify;
pub mod weights_config;

use clap::ValueEnum;
use optimus::diag;
use optimus::elab::Override;
use optimus::front::{Checked, Source, check_source, decode};
use optimus::plan::{Layouts, Mesh, Mode, Plan, Strategy};
use std::path::Path;

/// Flags that say what to compile a model for. Each is optional so that a plan given with a flag
/// that disagrees with it can be refused (see [`TargetArgs::conflicts_with`]); the defaults are applied
/// by the accessors.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TargetArgs {
    /// The device mesh, ROWSxCOLS or REPLICASxROWSxCOLS: QxQ for optimus, 1xP for megatron, 1x1 for
    /// none; a leading REPLICAS runs that many data-parallel copies of the mesh, each on its share of
    /// the batch (e.g. 4x2x2: 16 devices). Tesseract takes DEPTHxQxQ (DEPTH layers of a QxQ grid, e.g.
    /// 2x2x2) or REPLICASxDEPTHxQxQ; 3d takes a cube QxQxQ or REPLICASxQxQxQ [default: 1x1].
    #[arg(long = "mesh", value_name = "[REPLICASx][DEPTHx]ROWSxCOLS", value_parser = parse_mesh)]
    pub mesh_flag: Option<MeshArg>,
    /// How to split the model: optimus (2D, SUMMA), megatron (1D tensor parallel), tesseract (2.5D:
    /// depth layers of a SUMMA grid, the batch split over them), 3d (a q x q x q cube: products gather
    /// their operands and reduce-scatter their results) or none (one device) [default: optimus].
    #[arg(long = "strategy", value_enum, value_name = "STRATEGY")]
    pub strategy_flag: Option<StrategyArg>,
    /// train: forward, backward and optimizer step; infer: forward only [default: train; `eval` and
    /// `generate` run infer only, `verify` train only].
    #[arg(long = "mode", value_enum, value_name = "MODE")]
    pub mode_flag: Option<ModeArg>,
    /// Override a config value, e.g. `--set batch=16`. Repeatable.
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub set: Vec<Override>,
    /// Activations the backward pass recomputes instead of keeping: none; layers (keep only each
    /// repeated block's input and recompute the block before its backward); selective (recompute only
    /// attention scores and probabilities, activation (GELU, SiLU) outputs, RMSNorm outputs and gating
    /// products) [default: what the model marks `checkpoint`].
    #[arg(long = "recompute", value_enum, value_name = "WHAT")]
    pub recompute: Option<RecomputeArg>,
    /// Number format of activations, products and communication: f32, or bf16 (float32 master weights,
    /// optimizer state, normalisation statistics, softmax and loss) [default: f32].
    #[arg(long = "precision", value_enum, value_name = "FORMAT")]
    pub precision: Option<PrecisionArg>,
    /// ZeRO stage over the data-parallel replicas: 0 keeps every replica's optimizer state whole; 1
    /// shards the optimizer state (and the master weights) over the replicas: gradients are
    /// reduce-scattered, each replica updates its slice, and the weights are all-gathered where first
    /// used [default: 0].
    #[arg(long = "zero", value_name = "STAGE", value_parser = clap::value_parser!(u8).range(0..=1))]
    pub zero: Option<u8>,
    /// Run collectives beside computation: each starts as early as its operands allow (SUMMA's next
    /// broadcasts during the current product, double-buffered; data-parallel gradient sums during the
    /// rest of the backward pass; ZeRO-1 weight gathers ahead of their layer) and is waited for just
    /// before its result is needed. The plan records every start and wait (`inspect` lists them, the
    /// memory plan counts the second buffers, `simulate` follows them); on threads each device gets a
    /// communication thread, elsewhere collectives still run where they start. Results are
    /// bit-identical to a run without it. Also applies to a plan file.
    #[arg(long = "overlap")]
    pub overlap: bool,
    /// How optimus and tesseract lay out the weights of their SUMMA products: auto (per linear, what
    /// moves least: a weight that narrows its input, such as an MLP's second, stored across the mesh;
    /// a tied head's table across the mesh or in place by its token count; weights kept in place over
    /// few tokens, as in decoding; linears of one input, such as Llama's gate and up, sharing its
    /// broadcasts) or paper (every weight and table in place, each product moving both operands'
    /// blocks on its own, as in the Optimus paper and its code; for reproducing its figures or
    /// comparing). Recorded in the plan [default: auto].
    #[arg(long = "layouts", value_enum, value_name = "CHOICE")]
    pub layouts: Option<LayoutsArg>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LayoutsArg {
    Auto,
    Paper,
}

impl LayoutsArg {
    pub fn layouts(self) -> Layouts {
        match self {
            LayoutsArg::Auto => Layouts::Auto,
            LayoutsArg::Paper => Layouts::Paper,
        }
    }

    pub fn of(layouts: Layouts) -> LayoutsArg {
        match layouts {
            Layouts::Auto => LayoutsArg::Auto,
            Layouts::Paper => LayoutsArg::Paper,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RecomputeArg {
    None,
    Layers,
    Selective,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PrecisionArg {
    F32,
    Bf16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StrategyArg {
    Optimus,
    Megatron,
    Tesseract,
    #[value(name = "3d")]
    ThreeD,
    None,
}

impl StrategyArg {
    pub fn strategy(self) -> Strategy {
        match self {
            StrategyArg::Optimus => Strategy::Optimus,
            StrategyArg::Megatron => Strategy::Megatron,
            StrategyArg::Tesseract => Strategy::Tesseract,
            StrategyArg::ThreeD => Strategy::ThreeD,
            StrategyArg::None => Strategy::None,
        }
    }

    pub fn of(strategy: Strategy) -> StrategyArg {
        match strategy {
            Strategy::Optimus => StrategyArg::Optimus,
            Strategy::Megatron => StrategyArg::Megatron,
            Strategy::Tesseract => StrategyArg::Tesseract,
            Strategy::ThreeD => StrategyArg::ThreeD,
            Strategy::None => StrategyArg::None,
        }
    }
}

/// `--mesh` as written, read once the strategy is known: three sizes are REPLICASxROWSxCOLS, except
/// under tesseract, whose three sizes are DEPTHxROWSxCOLS; four are REPLICASxDEPTHxROWSxCOLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MeshArg {
    /// Replicas, depth, rows and columns, with the three-size form's first size as replicas.
    mesh: Mesh,
    three_sizes: bool,
}

impl MeshArg {
    /// A mesh given whole (all four sizes).
    pub fn of(mesh: Mesh) -> MeshArg {
        MeshArg { mesh, three_sizes: false }
    }

    /// The mesh under `strategy`.
    pub fn mesh(self, strategy: Strategy) -> Mesh {
        match (self.three_sizes, strategy) {
            (true, Strategy::Tesseract | Strategy::ThreeD) => self.mesh.with_depth(self.mesh.data).with_data(1),
            _ => self.mesh,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    Train,
    Infer,
}

impl TargetArgs {
    /// The mesh asked for, read under the strategy asked for, 1x1 by default.
    pub fn mesh(&self) -> Mesh {
        self.mesh_flag.map_or(Mesh::new(1, 1), |m| m.mesh(self.strategy().strategy()))
    }

    /// The strategy asked for, optimus by default.
    pub fn strategy(&self) -> StrategyArg {
        self.strategy_flag.unwrap_or(StrategyArg::Optimus)
    }

    /// The mode asked for, train by default.
    pub fn mode(&self) -> ModeArg {
        self.mode_flag.unwrap_or(ModeArg::Train)
    }

    pub fn target(&self) -> optimus::shard::Target {
        optimus::shard::Target {
            mesh: self.mesh(),
            strategy: self.strategy().strategy(),
            mode: match self.mode() {
                ModeArg::Train => Mode::Train,
                ModeArg::Infer => Mode::Infer,
            },
            memory: self.memory(),
            layouts: self.layouts(),
        }
    }

    /// The layouts asked for, auto by default.
    pub fn layouts(&self) -> Layouts {
        self.layouts.map_or(Layouts::Auto, LayoutsArg::layouts)
    }

    /// The recomputation and precision asked for.
    pub fn memory(&self) -> optimus::plan::MemoryOptions {
        use optimus::plan::{Precision, Recompute};
        optimus::plan::MemoryOptions {
            recompute: self.recompute.map(|r| match r {
                RecomputeArg::None => Recompute::None,
                RecomputeArg::Layers => Recompute::Layers,
                RecomputeArg::Selective => Recompute::Selective,
            }),
            precision: match self.precision {
                Some(PrecisionArg::Bf16) => Precision::Bf16,
                _ => Precision::F32,
            },
            zero: self.zero.unwrap_or(0),
        }
    }

    /// The compile flags given on the command line that disagree with an already compiled plan, each
    /// as `--flag VALUE (the plan has ...)`; empty when every given flag agrees (or none was given).
    pub fn conflicts_with(&self, plan: &Plan) -> Vec<String> {
        let target = self.target();
        let mut conflicts = Vec::new();
        // A mesh given without a strategy is read as the plan's strategy reads it.
        let strategy = self.strategy_flag.map_or(plan.strategy, StrategyArg::strategy);
        if let Some(mesh) = self.mesh_flag.map(|m| m.mesh(strategy)).filter(|&m| m != plan.mesh) {
            // Sizes written alike can mean replicas or depth layers: then say which.
            conflicts.push(if mesh.to_string() == plan.mesh.to_string() {
                format!("--mesh {mesh} ({}; the plan is for {})", mesh.parts(), plan.mesh.parts())
            } else {
                format!("--mesh {mesh} (the plan is for a {} mesh)", plan.mesh)
            });
        }
        if self.strategy_flag.is_some() && target.strategy != plan.strategy {
            conflicts.push(format!(
                "--strategy {} (the plan's strategy is {})",
                target.strategy.name(),
                plan.strategy.name()
            ));
        }
        if self.mode_flag.is_some() && target.mode != plan.mode {
            conflicts.push(format!("--mode {} (the plan's mode is {})", mode_name(target.mode), mode_name(plan.mode)));
        }
        if let Some(r) = target.memory.recompute.filter(|&r| r != plan.recompute) {
            conflicts.push(format!("--recompute {} (the plan recomputes {})", r.name(), plan.recompute.name()));
        }
        if self.precision.is_some() && target.memory.precision != plan.precision {
            let (want, have) = (target.memory.precision.name(), plan.precision.name());
            conflicts.push(format!("--precision {want} (the plan's precision is {have})"));
        }
        if let Some(layouts) = self.layouts.map(LayoutsArg::layouts).filter(|&l| l != plan.layouts) {
            let (want, have) = (layouts.name(), plan.layouts.name());
            conflicts.push(format!("--layouts {want} (the plan's layouts are {have})"));
        }
        if let Some(zero) = self.zero.filter(|&z| z != plan.zero) {
            conflicts.push(format!("--zero {zero} (the plan's ZeRO stage is {})", plan.zero));
        }
        for o in &self.set {
            match plan.config.iter().find(|(name, _)| *name == o.name) {
                Some((_, value)) if same_value(value, &o.value) => {}
                Some((_, value)) => {
                    conflicts.push(format!("--set {}={} (the plan has {} = {value})", o.name, o.value, o.name))
                }
                None => {
                    conflicts.push(format!("--set {}={} (the plan has no config value `{}`)", o.name, o.value, o.name))
                }
            }
        }
        conflicts
    }
}

fn mode_name(mode: Mode) -> &'static str {
    if mode == Mode::Train { "train" } else { "infer" }
}

/// Whether a `--set` value's text denotes the plan's config value.
fn same_value(value: &optimus::plan::types::Scalar, text: &str) -> bool {
    use optimus::plan::types::Scalar;
    match value {
        Scalar::Int(v) => text.parse::<i64>().is_ok_and(|t| t == *v),
        Scalar::Float(v) => text.parse::<f64>().is_ok_and(|t| t == *v),
        Scalar::Bool(v) => text.parse::<bool>().is_ok_and(|t| t == *v),
        Scalar::Str(v) => text.trim_matches('"') == v,
    }
}

pub fn parse_mesh(s: &str) -> Result<MeshArg, String> {
    let bad = || {
        format!(
            "expected ROWSxCOLS, REPLICASxROWSxCOLS (DEPTHxQxQ for tesseract) or REPLICASxDEPTHxQxQ, such as 4x4, \
             1x8, 2x2x2 or 2x2x2x2, found `{s}`"
        )
    };
    let out_of_range = || format!("mesh sides must be between 1 and 1024, found `{s}`");
    let side = |n: &str| {
        let n = n.trim();
        n.parse::<u64>().map_err(|_| if flags::digits_only(n) { out_of_range() } else { bad() })
    };
    let sides: Vec<u64> = s.split(['x', 'X']).map(side).collect::<Result<_, _>>()?;
    let (data, depth, rows, cols) = match sides[..] {
        [rows, cols] => (1, 1, rows, cols),
        [data, rows, cols] => (data, 1, rows, cols),
        [data, depth, rows, cols] => (data, depth, rows, cols),
        _ => return Err(bad()),
    };
    if sides.iter().any(|&n| n == 0 || n > 1024) {
        return Err(out_of_range());
    }
    let devices: u64 = sides.iter().product();
    if devices > 65_536 {
        return Err(format!("a mesh has at most 65536 devices, found `{s}` ({devices})"));
    }
    Ok(MeshArg { mesh: Mesh::new(rows, cols).with_data(data).with_depth(depth), three_sizes: sides.len() == 3 })
}

/// The text of a model file for a command that compiles it again and again (`why`): a plan (.json) is
/// refused (exit status 2), and so is a file that cannot be read or is not UTF-8 text (1); the error is
/// printed, and the status returned.
pub fn read_model_text(path: &Path, why: &str) -> Result<String, std::process::ExitCode> {
    if names_a_plan(path) {
        eprintln_safe!("error: {why}: give the .opt file, not a plan");
        return Err(std::process::ExitCode::from(2));
    }
    let bytes = read_model(path).ok_or(std::process::ExitCode::from(1))?;
    let (source, bad) = optimus::front::decode(&path.display().to_string(), bytes);
    if let Some(d) = bad {
        diag::render_stderr(&source.name, &source.text, &[d]);
        return Err(std::process::ExitCode::from(1));
    }
    Ok(source.text)
}

/// Reads a model file (a regular file of at most 64 MiB); prints an error and returns `None` if it
/// cannot be read.
pub fn read_model(path: &Path) -> Option<Vec<u8>> {
    let limit = optimus::io::files::MODEL_SOURCE_LIMIT;
    match optimus::io::files::read_bounded(path, "", limit) {
        Ok(bytes) => Some(bytes),
        Err(e) => {
            eprintln_safe!("error: {e}");
            None
        }
    }
}

/// Reads and checks a model, printing diagnostics; returns the model and its source on success.
pub fn load_checked(path: &Path, overrides: &[Override]) -> Option<(optimus::ir::Model, Source)> {
    let bytes = read_model(path)?;
    let name = path.display().to_string();
    let (source, bad_utf8) = decode(&name, bytes);
    if let Some(d) = bad_utf8 {
        diag::render_stderr(&source.name, &source.text, &[d]);
        eprintln_safe!("error: {name}: 1 error found");
        return None;
    }
    let Checked { model, mut diagnostics } = check_source(&source.text, overrides);
    diagnostics.retain(|d| d.is_error() || first_time_warned(&source.name, d));
    diag::render_stderr(&source.name, &source.text, &diagnostics);
    let errors = diagnostics.iter().filter(|d| d.is_error()).count();
    match model {
        Some(model) if errors == 0 => Some((model, source)),
        _ => {
            eprintln_safe!("error: {name}: {errors} error{} found", if errors == 1 { "" } else { "s" });
            None
        }
    }
}

/// Whether warning `d` of file `name` has not been printed by this process yet: commands that check a
/// model several times (with other sizes, as `generate` does for its programs) print each warning once.
fn first_time_warned(name: &str, d: &optimus::diag::Diagnostic) -> bool {
    static PRINTED: std::sync::Mutex<Vec<(String, optimus::diag::Diagnostic)>> = std::sync::Mutex::new(Vec::new());
    let mut printed = PRINTED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let seen = printed.iter().any(|(file, earlier)| file == name && earlier == d);
    if !seen {
        printed.push((name.to_string(), d.clone()));
    }
    !seen
}

/// Checks and compiles a model for a target, printing diagnostics on failure.
pub fn compile_model(path: &Path, target: &TargetArgs) -> Option<Plan> {
    let (model, source) = load_checked(path, &target.set)?;
    compile_checked_model(&model, &source, target)
}

/// [`compile_model`] of a model checked already (its diagnostics printed once).
pub fn compile_checked_model(model: &optimus::ir::Model, source: &Source, target: &TargetArgs) -> Option<Plan> {
    let mut plan = compile_checked(model, source, target.target())?;
    if target.overlap && !overlapped(&mut plan) {
        return None;
    }
    Some(plan)
}

/// The `--set` overrides that make a plan's `source` file, as it reads now, the plan's model:
/// each config value the plan was compiled with that differs from the file's own, less those named in
/// `skip`. A value the file no longer has is an error: the file changed since the plan was compiled
/// (or the plan names another file), and applying it would be blamed on a `--set` nobody gave.
///
/// `text` is the file's text: it is checked with its own config values, quietly (the command compiles
/// it again with the overrides, and shows that compilation's diagnostics).
pub fn plan_overrides(plan: &Plan, text: &str, skip: &[&str]) -> Result<Vec<Override>, String> {
    let checked = check_source(text, &[]);
    let model = checked.model.ok_or_else(|| {
        format!(
            "the plan's model `{}` no longer checks with its own config values; compile the plan again",
            plan.source
        )
    })?;
    let mut overrides = Vec::new();
    for (name, value) in plan.config.iter().filter(|(name, _)| !skip.contains(&name.as_str())) {
        let Some(own) = model.config_value(name) else {
            return Err(format!(
                "the plan was compiled with config value `{name}`, which its model `{}` does not have: the file \
                 changed since, or is another model; compile the plan again",
                plan.source
            ));
        };
        if own != value {
            overrides.push(Override { name: name.clone(), value: value.to_string() });
        }
    }
    Ok(overrides)
}

/// Whether `plan` is one decoding step with key/value caches (`compile --max-context`), which only
/// `generate` runs: its position input and caches follow a generation.
pub fn is_decoding_step(plan: &Plan) -> bool {
    plan.buffers.iter().any(|b| b.role == optimus::plan::Role::Cache)
}

/// A model's config value `name` as a size: an integer of 0 or more; `None` where it has none.
pub fn size_config(model: &optimus::ir::Model, name: &str) -> Option<u64> {
    model.config_value(name).and_then(|v| match v {
        optimus::plan::types::Scalar::Int(v) => u64::try_from(*v).ok(),
        _ => None,
    })
}

/// Checks and compiles one decoding step of a model with key/value caches of `context` positions
/// (`compile --max-context`): inference only.
pub fn compile_decoding(path: &Path, target: &TargetArgs, context: u64) -> Option<Plan> {
    if target.mode_flag == Some(ModeArg::Train) {
        eprintln_safe!("error: --max-context compiles a decoding step, which does not train: drop --mode train");
        return None;
    }
    let mut target = target.clone();
    target.mode_flag = Some(ModeArg::Infer);
    let (model, source) = load_checked(path, &target.set)?;
    if let Some(longest) = size_config(&model, "context").filter(|&longest| context > longest) {
        // The positions past the model's own context have no position embedding or rotary angle.
        eprintln_safe!("error: --max-context {context} is more than the model's context {longest}");
        return None;
    }
    let model = match optimus::decode::with_cache(&model, context) {
        Ok(model) => model,
        Err(e) => {
            eprintln_safe!("error: {}: cannot keep a key/value cache: {e}", source.name);
            return None;
        }
    };
    if let Some(seq) = size_config(&model, "seq").filter(|&seq| seq > context) {
        eprintln_safe!("error: a step of seq = {seq} tokens does not fit caches of --max-context {context} positions");
        return None;
    }
    let mut plan = compile_checked(&model, &source, target.target())?;
    if target.overlap && !overlapped(&mut plan) {
        return None;
    }
    Some(plan)
}

/// Applies `--overlap` to a plan and verifies the result (an internal error, printed, if it fails).
fn overlapped(plan: &mut Plan) -> bool {
    optimus::plan::overlap::overlap_collectives(plan);
    match optimus::plan::verify::verify(plan) {
        Ok(()) => true,
        Err(errors) => {
            eprintln_safe!("error: internal error: the plan with --overlap failed verification (please report it):");
            for e in errors.iter().take(20) {
                eprintln_safe!("  {e}");
            }
            false
        }
    }
}

/// Compiles a checked model for a target, printing diagnostics on failure.
pub fn compile_checked(model: &optimus::ir::Model, source: &Source, target: optimus::shard::Target) -> Option<Plan> {
    match optimus::shard::compile(model, &source.name, &source.text, target) {
        Ok(plan) => Some(plan),
        Err(diagnostics) => {
            diag::render_stderr(&source.name, &source.text, &diagnostics);
            let mesh = mesh_as_strategy_reads_it(&target);
            eprintln_safe!("error: {}: cannot compile for a {mesh} mesh; no plan written", source.name);
            None
        }
    }
}

/// A target's mesh as its strategy reads it: a depth strategy's cube with its depth even where that is
/// 1 (`--strategy 3d --mesh 2x2` is a 1x2x2 cube), every other mesh as it prints.
pub fn mesh_as_strategy_reads_it(target: &optimus::shard::Target) -> String {
    let mesh = target.mesh;
    if !matches!(target.strategy, Strategy::ThreeD | Strategy::Tesseract) || mesh.depth != 1 {
        return mesh.to_string();
    }
    let replicas = if mesh.data != 1 { format!("{}x", mesh.data) } else { String::new() };
    format!("{replicas}1x{}x{}", mesh.rows, mesh.cols)
}

/// A progress bar of `len` units drawn with `template` on standard error, when that is a terminal and
/// the command was not asked to be `quiet` (JSON on standard output); `None` otherwise.
pub fn terminal_bar(len: u64, template: &str, quiet: bool) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    (!quiet && std::io::stderr().is_terminal()).then(|| {
        let bar = indicatif::ProgressBar::new(len);
        if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
            bar.set_style(style);
        }
        bar
    })
}

/// Refuses what a command that runs the whole mesh as threads of this process cannot do: a timeout
/// that is not a positive number of seconds, or a start under mpirun or srun (every rank would run
/// the whole mesh).
pub fn check_threads_only(command: &str, timeout: f64) -> Result<(), Failure> {
    if timeout.is_nan() || timeout <= 0.0 {
        return Err(Failure::usage(format!("--timeout {timeout} is not a positive number of seconds")));
    }
    if optimus::runtime::launch::detect().is_some_and(|launch| launch.is_multi_process()) {
        return Err(Failure::usage(format!(
            "{command} runs every device of the mesh as a thread of one process: start it without mpirun or srun"
        )));
    }
    Ok(())
}

/// Why a command failed: a message still to print (empty when it has been printed already) and the
/// exit status (1 for errors in the inputs, 2 for usage errors).
#[derive(Debug)]
pub struct Failure {
    pub message: String,
    pub status: u8,
}

impl Failure {
    /// A usage error (exit status 2).
    pub fn usage(message: String) -> Failure {
        Failure { message, status: 2 }
    }

    /// An error that has been printed already (exit status 1).
    pub fn reported() -> Failure {
        Failure { message: String::new(), status: 1 }
    }

    /// Prints the message, if any, and gives the exit status.
    pub fn exit(self) -> std::process::ExitCode {
        if !self.message.is_empty() {
            eprintln_safe!("error: {}", self.message);
        }
        std::process::ExitCode::from(self.status)
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure { message, status: 1 }
    }
}

/// A plan from a `.json` plan file, or compiled from a `.opt` model with the target flags. A plan file
/// given with compile flags that disagree with it is a usage error: the flags would silently do nothing.
pub fn plan_from(path: &Path, target: &TargetArgs) -> Result<Plan, Failure> {
    let is_plan = names_a_plan(path);
    if !is_plan {
        return compile_model(path, target).ok_or_else(Failure::reported);
    }
    let plan = optimus::io::plan_file::read_plan(path).map_err(|e| e.to_string())?;
    if let Err(errors) = optimus::plan::verify::verify(&plan) {
        eprintln_safe!("error: `{}` failed verification:", path.display());
        for e in errors.iter().take(20) {
            eprintln_safe!("  {e}");
        }
        return Err(Failure::reported());
    }
    let conflicts = target.conflicts_with(&plan);
    if !conflicts.is_empty() {
        return Err(Failure::usage(format!(
            "`{}` is a compiled plan, and these compile flags disagree with it: {}; recompile the model with them, \
             or drop them",
            path.display(),
            conflicts.join(", ")
        )));
    }
    let mut plan = plan;
    if target.overlap && !overlapped(&mut plan) {
        return Err(Failure::reported());
    }
    Ok(plan)
}

/// Whether a command's input names a compiled plan (`.json`) rather than a model file.
pub fn names_a_plan(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"))
}

/// An output that cannot be written (a folder that does not exist, a path that is a folder) is a
/// usage error found before any work, named by its flag: every command's outputs are checked this way.
pub fn check_output(path: &Path, flag: &str) -> Result<(), Failure> {
    optimus::io::output::check_writable(path).map_err(|e| Failure::usage(format!("{flag}: {e}")))
}

/// An output path that names the command's own input (`compile m.opt -o m.opt`) would destroy it: a
/// usage error naming the flag. Paths are compared as the files they resolve to, links followed.
pub fn refuse_overwriting_input(output: &Path, input: &Path, flag: &str) -> Result<(), Failure> {
    let same = match (std::fs::canonicalize(output), std::fs::canonicalize(input)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same {
        return Err(Failure::usage(format!(
            "{flag} `{}` is the input `{}` itself; writing it would destroy the input, so name another file",
            output.display(),
            input.display()
        )));
    }
    Ok(())
}

/// Writes text for people to standard output, with control characters in it escaped (names come from
/// files and plans); a closed pipe (`optimusc ... | head`) ends the output quietly.
pub fn stdout(text: &str) {
    stdout_exact(&optimus::plan::text::printable_text(text));
}

/// Prints `value` as pretty JSON on standard output (exit 0), or says why it cannot be serialised (exit 1).
pub fn print_json(value: &impl serde::Serialize) -> std::process::ExitCode {
    match serde_json::to_string_pretty(value) {
        Ok(text) => {
            stdout_json(&format!("{text}\n"));
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln_safe!("error: cannot serialise the result: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

/// Writes JSON to standard output. serde_json already escapes every control character; the characters
/// that reorder text, which it leaves raw, are written as JSON `\uXXXX` escapes (they can only occur
/// inside strings), so the output is still the same JSON value.
pub fn stdout_json(text: &str) {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if optimus::plan::text::reorders_text(c) {
            escaped.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            escaped.push(c);
        }
    }
    stdout_exact(&escaped);
}

fn stdout_exact(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let written = out.write_all(text.as_bytes()).and_then(|()| out.flush());
    if let Some(e) = written.err().filter(|e| e.kind() != std::io::ErrorKind::BrokenPipe) {
        eprintln_safe!("error: cannot write to standard output: {e}");
    }
}

/// `text` as one word of a POSIX shell command: as it is where it has only characters no shell reads
/// specially, else in single quotes (a quote inside written `'\''`).
pub(crate) fn shell_word(text: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_./:@%+=,-".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        return text.to_string();
    }
    format!("'{}'", text.replace('\'', "'\\''"))
}

/// A path as one word of a POSIX shell command (see [`shell_word`]).
pub(crate) fn shell_path(path: &Path) -> String {
    shell_word(&path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::shell_word;

    /// A path a shell would split or read specially is quoted, so that the advice pastes as it reads.
    #[test]
    fn a_path_is_one_shell_word() {
        assert_eq!(shell_word("runs/ck-1"), "runs/ck-1");
        assert_eq!(shell_word("sp dir/ck"), "'sp dir/ck'");
        assert_eq!(shell_word("it's"), "'it'\\''s'");
        assert_eq!(shell_word("a$b"), "'a$b'");
        assert_eq!(shell_word(""), "''");
    }
}
