//! `optimusc verify`: the user's proof that a plan is right. Runs the model sharded on the mesh and
//! unsharded on one device from the same seed and data, and compares everything they compute.

use super::run::{DataDtype, DataFiles, InputArgs, OptimizerArg, OptimizerArgs, open_sources, shortfall_warning};
use super::{StrategyArg, TargetArgs, compile_for};
use optimus::plan::tensor::Tensor;
use optimus::plan::{Mesh, Mode, Plan, Strategy};
use optimus::runtime::exec::{RunConfig, RunOutput};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(clap::Args, Debug, Clone)]
pub struct VerifyArgs {
    /// The model file (.opt).
    pub model: PathBuf,
    #[command(flatten)]
    pub target: TargetArgs,
    /// Steps to run on both (at least 1).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: u64,
    /// Largest relative difference accepted: max |sharded - single| / max |single| per tensor; a tensor
    /// that is numerically zero (below 1/1000 of the largest of its kind, such as attention's key-bias
    /// gradient, which is exactly zero in exact arithmetic) is measured against 1/1000 of the largest
    /// [default: 1e-4; 2e-2 with --precision bf16, which rounds every product's inputs to 8 bits of
    /// mantissa where the single-device reference keeps float32].
    #[arg(long, value_parser = super::flags::tolerance)]
    pub tolerance: Option<f64>,
    /// Seed for weights, tokens and dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Token file; without it, tokens are drawn from the seed.
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = DataDtype::U16)]
    pub data_dtype: DataDtype,
    #[command(flatten)]
    pub inputs: InputArgs,
    /// Optimizer used between steps. SGD with momentum is the default because AdamW divides each
    /// gradient by its own magnitude: a gradient that is zero in exact arithmetic (attention's key bias)
    /// becomes float noise that AdamW turns into a full step, on one device as on many.
    #[arg(long, value_enum, default_value_t = OptimizerArg::Sgd)]
    pub optimizer: OptimizerArg,
    /// Learning rate (finite, >= 0).
    #[arg(long, default_value_t = 1e-2, value_parser = super::flags::non_negative)]
    pub lr: f32,
    /// SGD momentum (finite, >= 0).
    #[arg(long, default_value_t = 0.9, value_parser = super::flags::non_negative)]
    pub momentum: f32,
    /// Weight decay (finite, >= 0). Default: 0.01 for AdamW, 0 for SGD.
    #[arg(long, value_parser = super::flags::non_negative)]
    pub weight_decay: Option<f32>,
    /// AdamW epsilon (finite, >= 0; raise it, e.g. to 1e-4, to verify AdamW runs).
    #[arg(long, default_value_t = 1e-8, value_parser = super::flags::non_negative)]
    pub eps: f32,
    /// Print every tensor's difference, not only the worst of each kind.
    #[arg(long)]
    pub verbose: bool,
}

pub fn verify(args: &VerifyArgs) -> ExitCode {
    match verify_inner(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln_safe!("error: {e}");
            ExitCode::from(1)
        }
    }
}

fn verify_inner(args: &VerifyArgs) -> Result<bool, String> {
    if args.model.extension().is_some_and(|e| e.eq_ignore_ascii_case("json")) {
        return Err(
            "verify compiles the model twice (for the mesh and for one device): give the .opt file, not a plan".into(),
        );
    }
    if args.target.mode() != super::ModeArg::Train {
        return Err("verify compares training steps; drop --mode infer".into());
    }
    let sharded =
        compile_for(&args.model, &args.target.set, args.target.target()).ok_or("cannot compile for the mesh")?;
    let single_target = optimus::shard::Target::plain(Mesh::new(1, 1), Strategy::None, Mode::Train);
    let single = compile_for(&args.model, &args.target.set, single_target).ok_or("cannot compile for one device")?;
    let strategy = if args.target.strategy() == StrategyArg::None { "none" } else { sharded.strategy.name() };
    let tolerance = tolerance(args, sharded.precision);
    eprintln_safe!(
        "verifying {} on a {} mesh ({strategy}) against one device, {} steps, tolerance {tolerance:e}",
        sharded.model,
        sharded.mesh,
        args.steps
    );
    let sources = open_sources(&files(args), args.inputs.objective, args.seed, "").map_err(|f| f.message)?;
    sources.check(&sharded, "").map_err(|e| e.to_string())?;
    if let Some(warning) = shortfall_warning(&sources, &sharded) {
        eprintln_safe!("warning: {warning}");
    }
    let a = execute(&sharded, args)?;
    let b = execute(&single, args)?;
    Ok(report(args, tolerance, &a, &b))
}

/// The tolerance given, or the default for the plan's precision (the one `--help` states).
fn tolerance(args: &VerifyArgs, precision: optimus::plan::Precision) -> f64 {
    let default = if precision == optimus::plan::Precision::Bf16 { BF16_TOLERANCE } else { F32_TOLERANCE };
    args.tolerance.unwrap_or(default)
}

/// The default tolerance of a float32 plan.
const F32_TOLERANCE: f64 = 1e-4;
/// The default tolerance of a bf16 plan.
const BF16_TOLERANCE: f64 = 2e-2;

fn files(args: &VerifyArgs) -> DataFiles<'_> {
    DataFiles {
        data: args.data.as_ref(),
        segments: args.inputs.segments.as_ref(),
        labels: args.inputs.labels.as_ref(),
        dtype: args.data_dtype,
    }
}

fn execute(plan: &Plan, args: &VerifyArgs) -> Result<RunOutput, String> {
    let optimizer = OptimizerArgs {
        optimizer: args.optimizer,
        lr: args.lr,
        weight_decay: args.weight_decay,
        momentum: args.momentum,
        beta1: 0.9,
        beta2: 0.999,
        eps: args.eps,
    };
    let config = RunConfig {
        timeout: Duration::from_secs(300),
        ..RunConfig::new(args.seed, args.steps.max(1), optimizer.settings())
    };
    let sources = open_sources(&files(args), args.inputs.objective, args.seed, "").map_err(|f| f.message)?;
    let batches = |step| sources.batch(plan, step).map_err(|e| e.to_string());
    optimus::runtime::local::run(plan, &config, &batches, &BTreeMap::new(), &|_| {})
}

/// Prints the comparison; returns whether everything is within `tolerance`.
fn report(args: &VerifyArgs, tolerance: f64, sharded: &RunOutput, single: &RunOutput) -> bool {
    let mut ok = true;
    let mut line = |what: &str, worst: f64, name: &str, count: usize| {
        let pass = worst <= tolerance;
        ok &= pass;
        let verdict = if pass { "ok" } else { "FAILED" };
        super::stdout(&format!("{what:<16} {worst:>10.2e}  {verdict:<6} (worst of {count}: {name})\n"));
    };
    let mut worst_loss = (0f64, String::new());
    for (a, b) in sharded.steps.iter().zip(&single.steps) {
        if let (Some(x), Some(y)) = (a.loss, b.loss) {
            let finite = x.is_finite() && y.is_finite();
            let d = if finite {
                f64::from((x - y).abs()) / f64::from(y.abs()).max(f64::MIN_POSITIVE)
            } else {
                f64::INFINITY
            };
            if d >= worst_loss.0 {
                worst_loss = (d, format!("step {}: {x} vs {y}", a.step));
            }
        }
    }
    line("loss", worst_loss.0, &worst_loss.1, sharded.steps.len());
    for (what, a, b) in [
        ("outputs", &sharded.outputs, &single.outputs),
        ("gradients", &sharded.grads, &single.grads),
        ("updated values", &sharded.params, &single.params),
    ] {
        let (worst, name) = compare(what, a, b, args.verbose);
        line(what, worst, &name, b.len());
    }
    super::stdout(&format!(
        "{}\n",
        if ok { "verified: the plan computes what one device computes" } else { "verification FAILED" }
    ));
    ok
}

fn compare(what: &str, a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>, verbose: bool) -> (f64, String) {
    let mut worst = (0f64, String::from("-"));
    for (name, d) in optimus::runtime::compare::relative_differences(a, b) {
        if verbose {
            super::stdout(&format!("  {what}: {name:<40} {d:.2e}\n"));
        }
        if d >= worst.0 {
            worst = (d, name);
        }
    }
    worst
}
