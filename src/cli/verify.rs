//! `optimusc verify`: the user's proof that a plan is right. Runs the model sharded on the mesh and
//! unsharded on one device from the same seed and data, and compares everything they compute.

use super::run::{DataDtype, DataFiles, InputArgs, OptimizerArg, OptimizerArgs, open_sources, shortfall_warning};
use super::{Failure, StrategyArg, TargetArgs, compile_checked, load_checked};
use optimus::plan::tensor::Tensor;
use optimus::plan::{MemoryOptions, Mesh, Mode, Plan, Precision, Strategy};
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
    /// Largest relative difference accepted: max |sharded - single| / (max |single| + 1/10 of the largest
    /// of its kind) per tensor, so that a tensor that is zero in exact arithmetic (attention's key-bias
    /// gradient; a bias before a norm over the positions) and holds float noise on both sides is not
    /// measured against its own noise [default: 1e-4; with --precision bf16, which rounds every product's inputs and outputs to 8 bits
    /// of mantissa where the single-device reference keeps float32, the larger of 2e-2 and 3 times the
    /// difference the same model in bf16 on one device makes on that tensor (that at most 5e-2; a third run,
    /// made only when no tolerance is given)].
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
        Err(failure) => failure.exit(),
    }
}

/// A failure of the model (its errors printed already) or of a run: exit status 1.
fn failed(message: &str) -> Failure {
    Failure::from(message.to_string())
}

fn verify_inner(args: &VerifyArgs) -> Result<bool, Failure> {
    if super::names_a_plan(&args.model) {
        return Err(Failure::usage(
            "verify compiles the model twice (for the mesh and for one device): give the .opt file, not a plan".into(),
        ));
    }
    if args.target.mode() != super::ModeArg::Train {
        return Err(Failure::usage("verify compares training steps; drop --mode infer".into()));
    }
    // The model is checked once (its warnings printed once) and compiled for each target; the errors
    // have been printed, and the mesh a failed compile's trailer names.
    let (model, source) = load_checked(&args.model, &args.target.set).ok_or_else(|| failed("nothing verified"))?;
    let sharded = compile_checked(&model, &source, args.target.target()).ok_or_else(|| failed("nothing verified"))?;
    let single_target = optimus::shard::Target::plain(Mesh::new(1, 1), Strategy::None, Mode::Train);
    let single = compile_checked(&model, &source, single_target).ok_or_else(|| failed("nothing verified"))?;
    let strategy = if args.target.strategy() == StrategyArg::None { "none" } else { sharded.strategy.name() };
    let tolerance = tolerance(args, sharded.precision);
    let against_bf16 = sharded.precision == Precision::Bf16 && args.tolerance.is_none();
    eprintln_safe!(
        "verifying {} on a {} mesh ({strategy}) against one device, {}, tolerance {tolerance:e}",
        sharded.model,
        sharded.mesh,
        optimus::plan::text::plural(args.steps, "step")
    );
    let sources = open_sources(&files(args), args.inputs.objective, args.seed, "")?;
    sources.check(&sharded, "").map_err(|e| Failure::usage(e.to_string()))?;
    if sources.drawn_from_seed() {
        // Drawn tokens need the model's vocabulary: a usage error now, as in `run`.
        sources.batch(&sharded, 0).map_err(|e| Failure::usage(format!("tokens drawn from the seed: {e}")))?;
    } else {
        // Every batch the steps read, read now: a token past the vocabulary is a usage error, as in `run`.
        for step in 0..args.steps.max(1) {
            sources.batch(&sharded, step).map_err(|e| Failure::usage(format!("batch {step} of the data: {e}")))?;
        }
    }
    if let Some(warning) = shortfall_warning(&sources, &sharded) {
        eprintln_safe!("warning: {warning}");
    }
    let a = execute(&sharded, args).map_err(Failure::from)?;
    let b = execute(&single, args).map_err(Failure::from)?;
    let bf16_single = if against_bf16 {
        eprintln_safe!(
            "and one device in bf16: a difference also passes within {BF16_MARGIN} times that run's own difference"
        );
        let memory = MemoryOptions { precision: Precision::Bf16, zero: 0, ..args.target.target().memory };
        let target = optimus::shard::Target { memory, ..single_target };
        let plan =
            compile_checked(&model, &source, target).ok_or_else(|| failed("cannot compile for one device in bf16"))?;
        Some(execute(&plan, args).map_err(Failure::from)?)
    } else {
        None
    };
    Ok(report(args, &Allowance { tolerance, bf16_single }, &a, &b))
}

/// The tolerance given, or the default for the plan's precision (the one `--help` states).
fn tolerance(args: &VerifyArgs, precision: Precision) -> f64 {
    let default = if precision == Precision::Bf16 { BF16_TOLERANCE } else { F32_TOLERANCE };
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

/// Prints the comparison; returns whether every quantity is within its allowance.
fn report(args: &VerifyArgs, allowance: &Allowance, sharded: &RunOutput, single: &RunOutput) -> bool {
    // The bf16 one-device run's own differences from the float32 run, by key (none without it).
    let own = |differences: Option<Vec<Difference>>| -> BTreeMap<String, f64> {
        differences.into_iter().flatten().map(|d| (d.key, d.value)).collect()
    };
    let reference = allowance.bf16_single.as_ref();
    let losses = own(reference.map(|r| loss_differences(r, single)));
    let mut ok = judge("loss", &loss_differences(sharded, single), &losses, allowance.tolerance, false);
    for (what, pick) in QUANTITIES {
        let differences = tensor_differences(pick(sharded), pick(single));
        let tensors = own(reference.map(|r| tensor_differences(pick(r), pick(single))));
        ok &= judge(what, &differences, &tensors, allowance.tolerance, args.verbose);
    }
    super::stdout(&format!(
        "{}\n",
        if ok { "verified: the plan computes what one device computes" } else { "verification FAILED" }
    ));
    ok
}

/// The tensors compared besides the loss, by the name each line gives them.
type Quantity = (&'static str, fn(&RunOutput) -> &BTreeMap<String, Tensor>);
const QUANTITIES: [Quantity; 3] =
    [("outputs", |r| &r.outputs), ("gradients", |r| &r.grads), ("updated values", |r| &r.params)];

/// How far the sharded run may be from the float32 one-device run.
struct Allowance {
    /// Any difference up to this passes.
    tolerance: f64,
    /// For a bf16 plan verified at the default tolerance, the same model on one device in bf16: a
    /// difference also passes within [`BF16_MARGIN`] times this run's own difference on the same
    /// quantity (bf16's rounding on a tiny batch can exceed a fixed tolerance, on one device too).
    bf16_single: Option<RunOutput>,
}

/// How much farther than one device in bf16 a bf16 plan may be from the float32 run. A sharded product
/// rounds each device's partial sum to bf16 before the reduce adds them, one more rounding than one
/// device makes: over 18 runs (Llama 2x2, GPT-2 4x4 and BERT 3D 2x2x2, six seeds each, 8-32 tokens),
/// the tensor farthest from one device in bf16 was 1.5-2.5 times as far from the float32 run.
const BF16_MARGIN: f64 = 3.0;
/// The most that one device in bf16's difference can allow: a bf16 lowering wrong on one device and on
/// the mesh alike would otherwise pass however far both were from float32.
const BF16_CEILING: f64 = 5e-2;

/// One compared quantity: its key (a tensor's name, or a step), its relative difference, and how a
/// line names it.
struct Difference {
    key: String,
    value: f64,
    label: String,
}

/// The relative difference of each step's loss.
fn loss_differences(candidate: &RunOutput, single: &RunOutput) -> Vec<Difference> {
    let mut out = Vec::new();
    for (a, b) in candidate.steps.iter().zip(&single.steps) {
        if let (Some(x), Some(y)) = (a.loss, b.loss) {
            let finite = x.is_finite() && y.is_finite();
            let value = if finite {
                f64::from((x - y).abs()) / f64::from(y.abs()).max(f64::MIN_POSITIVE)
            } else {
                f64::INFINITY
            };
            out.push(Difference {
                key: format!("step {}", a.step),
                value,
                label: format!("step {}: {x} vs {y}", a.step),
            });
        }
    }
    out
}

fn tensor_differences(candidate: &BTreeMap<String, Tensor>, single: &BTreeMap<String, Tensor>) -> Vec<Difference> {
    optimus::runtime::compare::relative_differences(candidate, single)
        .into_iter()
        .map(|(name, value)| Difference { key: name.clone(), value, label: name })
        .collect()
}

/// Prints one quantity's line (and, `verbose`, each of its tensors); returns whether each difference
/// is within its allowance: `tolerance`, or, where `reference` holds the bf16 one-device run's own
/// difference under the same key, [`BF16_MARGIN`] times that up to [`BF16_CEILING`], whichever is more.
fn judge(
    what: &str,
    differences: &[Difference],
    reference: &BTreeMap<String, f64>,
    tolerance: f64,
    verbose: bool,
) -> bool {
    let allowed = |d: &Difference| match reference.get(&d.key) {
        Some(own) => tolerance.max((BF16_MARGIN * own).min(BF16_CEILING)),
        None => tolerance,
    };
    if verbose {
        for d in differences {
            let own = reference.get(&d.key).map_or(String::new(), |own| format!(" (one device in bf16: {own:.2e})"));
            super::stdout(&format!("  {what}: {:<40} {:.2e}{own}\n", d.label, d.value));
        }
    }
    let worst = worst_of(differences, allowed);
    let pass = worst.is_none_or(|(_, share)| share <= 1.0);
    let verdict = if pass { "ok" } else { "FAILED" };
    let (value, label) = worst.map_or((0.0, "-".to_string()), |(d, _)| (d.value, d.label.clone()));
    let own = worst
        .and_then(|(d, _)| reference.get(&d.key))
        .map_or(String::new(), |own| format!("; one device in bf16: {own:.2e}"));
    super::stdout(&format!("{what:<16} {value:>10.2e}  {verdict:<6} (worst of {}: {label}{own})\n", differences.len()));
    pass
}

/// The difference closest to (or farthest past) its allowance, with the share of it it takes; of those
/// past an allowance of 0 (`--tolerance 0`: each takes an infinite share) the largest.
fn worst_of(differences: &[Difference], allowed: impl Fn(&Difference) -> f64) -> Option<(&Difference, f64)> {
    let mut worst: Option<(&Difference, f64)> = None;
    for d in differences {
        let share = share_of(d.value, allowed(d));
        let worse = |(w, s): (&Difference, f64)| share > s || (share == s && d.value >= w.value) || share.is_nan();
        if worst.is_none_or(worse) {
            worst = Some((d, share));
        }
    }
    worst
}

/// How much of its allowance a difference takes (1: all of it; NaN for a NaN difference, which fails).
/// An allowance of 0 (`--tolerance 0`) is taken by nothing (0) or overrun (infinity), not 0 / 0.
fn share_of(difference: f64, allowed: f64) -> f64 {
    match allowed > 0.0 {
        true => difference / allowed,
        false if difference == 0.0 => 0.0,
        false if difference.is_nan() => f64::NAN,
        false => f64::INFINITY,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn difference(key: &str, value: f64) -> Difference {
        Difference { key: key.into(), value, label: key.into() }
    }

    fn passes(value: f64, own: Option<f64>) -> bool {
        let reference: BTreeMap<String, f64> = own.map(|own| ("w".to_string(), own)).into_iter().collect();
        judge("gradients", &[difference("w", value)], &reference, BF16_TOLERANCE, false)
    }

    /// `--tolerance 0` passes bit-identical results, and nothing else.
    #[test]
    fn a_zero_tolerance_passes_no_difference_and_fails_any() {
        assert_eq!(share_of(0.0, 0.0), 0.0);
        assert_eq!(share_of(1e-30, 0.0), f64::INFINITY);
        assert!(share_of(f64::NAN, 0.0).is_nan() && share_of(f64::NAN, 1e-4).is_nan());
        assert_eq!(share_of(5e-5, 1e-4), 0.5);
    }

    #[test]
    fn a_bf16_difference_passes_within_the_tolerance_or_three_times_one_device_in_bf16_up_to_the_ceiling() {
        // Without a bf16 one-device run, the tolerance alone.
        assert!(passes(0.019, None) && !passes(0.021, None));
        // One device in bf16 1e-2 away: up to 3e-2.
        assert!(passes(0.029, Some(0.01)) && !passes(0.031, Some(0.01)));
        // One device in bf16 closer than a third of the tolerance: the tolerance still holds.
        assert!(passes(0.019, Some(0.001)) && !passes(0.021, Some(0.001)));
        // One device in bf16 far off (a bf16 lowering wrong on both): never past the ceiling.
        assert!(passes(0.049, Some(0.5)) && !passes(0.051, Some(0.5)));
        // Not a number or infinite never passes.
        assert!(!passes(f64::NAN, Some(0.01)) && !passes(f64::INFINITY, Some(0.01)));
    }

    #[test]
    fn the_worst_is_the_tensor_nearest_its_allowance_and_any_one_past_it_fails() {
        let reference: BTreeMap<String, f64> = [("a".to_string(), 0.015), ("b".to_string(), 0.001)].into();
        // a is farther from float32 (0.03) but within 3 x 0.015; b (0.025) is past the 2e-2 tolerance.
        let differences = [difference("a", 0.03), difference("b", 0.025)];
        assert!(!judge("gradients", &differences, &reference, BF16_TOLERANCE, false));
        assert!(judge("gradients", &differences[..1], &reference, BF16_TOLERANCE, false));
        assert!(judge("gradients", &[], &reference, BF16_TOLERANCE, false));
    }

    #[test]
    fn with_a_tolerance_of_zero_the_worst_is_the_largest_difference() {
        let differences = [difference("a", 2e-7), difference("b", 5e-7), difference("c", 1e-7), difference("d", 0.0)];
        let worst = worst_of(&differences, |_| 0.0).map(|(d, share)| (d.key.clone(), share));
        assert_eq!(worst, Some(("b".to_string(), f64::INFINITY)));
        let worst = worst_of(&differences, |_| 1e-4).map(|(d, _)| d.key.clone());
        assert_eq!(worst.as_deref(), Some("b"));
    }
}
