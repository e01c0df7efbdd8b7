//! `optimusc calibrate`: measures this machine's CPU runtime (kernels by profiling short one-device
//! training runs of built-in models, collectives of the thread communicator on meshes of threads) and
//! writes a hardware profile with a `[measured]` section for `simulate --hardware FILE`.

use optimus::calibrate::{self as measure, COLLECTIVE_KINDS, COLLECTIVE_PAYLOADS, COLLECTIVE_SHAPES};
use optimus::cost::calibration::{DEFAULT_KERNEL, DispatchFit, Measured};
use optimus::cost::hardware::{Collectives, Device, Hardware, InterNode, IntraNode, PeakTflops};
use optimus::elab::Override;
use optimus::front::check_source;
use optimus::plan::{CollectiveKind, Mesh, Mode, Plan, Precision, Strategy};
use optimus::runtime::backend::BackendKind;
use optimus::runtime::peak::Steadiness;
use optimus::shard::{Target, compile};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

mod gpu;

/// Flags of `optimusc calibrate`.
#[derive(clap::Args, Debug, Clone)]
pub struct CalibrateArgs {
    /// Where to write the profile (TOML); `-` or nothing: standard output.
    #[arg(short = 'o', long = "output", value_name = "PROFILE.toml")]
    pub output: Option<PathBuf>,
    /// The profile's name (default: `calibrated-` and this machine's host name).
    #[arg(long)]
    pub name: Option<String>,
    /// Measure less (two model sizes, two collective shapes): a profile in a few seconds, for tests.
    #[arg(long)]
    pub quick: bool,
    /// Also write the raw measurements behind the fits here, as JSON lines: every timed kernel
    /// instruction (its fits, bytes, FLOPs and median seconds) and every shared-engine run (its
    /// devices, measured step and the step its kernels alone predict).
    #[arg(long, value_name = "FILE.jsonl")]
    pub samples: Option<PathBuf>,
    /// What to measure: `cpu`, this machine's thread runtime; `cuda`, the first GPU (its kernels, each
    /// timed on the GPU, and meshes whose devices share it), for a build with `--features cuda`.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: super::run::Backend,
}

/// A built-in model the kernels are profiled on, at one size.
struct Workload {
    model: &'static str,
    source: &'static str,
    set: &'static [&'static str],
    /// Steps to run (the first is warm-up and left out): more for small sizes, whose times are noisier.
    steps: u64,
}

const GPT2: &str = include_str!("../../examples/gpt2.opt");
const LLAMA: &str = include_str!("../../examples/llama.opt");
const BERT: &str = include_str!("../../examples/bert.opt");

/// Steps of each calibration run but the largest.
const STEPS: u64 = 6;

/// The precisions every kernel workload runs in: bf16 kernels widen to float32 on the CPU and have
/// their own costs.
const PRECISIONS: [Precision; 2] = [Precision::F32, Precision::Bf16];

/// Passes over the kernel workloads (each instruction keeps the median of its passes).
const KERNEL_PASSES: u64 = 3;

/// The sizes profiled: products from the shards of a 4x4 mesh up to a whole hidden-512 layer.
const WORKLOADS: [Workload; 7] = [
    Workload {
        model: "gpt2",
        source: GPT2,
        set: &["layers=1", "hidden=32", "heads=2", "seq=32", "batch=4", "vocab=256"],
        steps: STEPS,
    },
    Workload {
        model: "gpt2",
        source: GPT2,
        set: &["layers=1", "hidden=64", "heads=2", "seq=64", "batch=4", "vocab=512"],
        steps: STEPS,
    },
    Workload {
        model: "gpt2",
        source: GPT2,
        set: &["layers=1", "hidden=128", "heads=2", "seq=128", "batch=4", "vocab=1024"],
        steps: STEPS,
    },
    Workload {
        model: "gpt2",
        source: GPT2,
        set: &["layers=1", "hidden=256", "heads=4", "seq=128", "batch=8", "vocab=2048"],
        steps: STEPS,
    },
    Workload {
        model: "gpt2",
        source: GPT2,
        set: &["layers=1", "hidden=512", "heads=8", "seq=256", "batch=8", "vocab=4096"],
        steps: 4,
    },
    Workload {
        model: "llama",
        source: LLAMA,
        set: &[
            "layers=1",
            "hidden=256",
            "heads=4",
            "kv_heads=2",
            "ffn=688",
            "seq=128",
            "batch=4",
            "vocab=2048",
            "context=256",
        ],
        steps: STEPS,
    },
    Workload {
        model: "bert",
        source: BERT,
        set: &["layers=1", "hidden=128", "heads=2", "seq=128", "batch=8", "vocab=2048", "context=128"],
        steps: STEPS,
    },
];

/// Runs `optimusc calibrate`.
pub fn calibrate(args: &CalibrateArgs) -> ExitCode {
    if optimus::runtime::launch::detect().is_some_and(|l| l.is_multi_process()) {
        eprintln_safe!(
            "error: calibrate measures the thread runtime of one process; run it without mpirun or srun (MPI collectives are not calibrated yet)"
        );
        return ExitCode::from(2);
    }
    let destination = args.output.as_deref().filter(|p| !optimus::io::output::is_standard_output(p));
    let samples = args.samples.as_deref().filter(|p| !optimus::io::output::is_standard_output(p));
    for (path, flag) in [(destination, "-o"), (samples, "--samples")] {
        if let Some(Err(e)) = path.map(|path| super::check_output(path, flag)) {
            return e.exit();
        }
    }
    if args.backend == super::run::Backend::Cuda {
        if let Some(warning) = BackendKind::Cuda.find_libraries() {
            eprintln_safe!("warning: {}", optimus::plan::text::printable_text(&warning));
        }
        if let Err(e) = BackendKind::Cuda.check_available() {
            eprintln_safe!("error: calibrate --backend cuda: {}", optimus::plan::text::printable_text(&e));
            return ExitCode::from(1);
        }
    }
    let started = Instant::now();
    let mut steadiness = Steadiness::default();
    let measured = match args.backend {
        super::run::Backend::Cpu => measure_machine(args, &mut steadiness),
        super::run::Backend::Cuda => gpu::measure_gpu(args),
    };
    let hw = match measured {
        Ok(hw) => hw,
        Err(e) => {
            eprintln_safe!("error: calibrate: {e}");
            return ExitCode::from(1);
        }
    };
    let text = match toml::to_string(&hw) {
        Ok(body) => format!("{}{body}", header(&hw, started.elapsed(), &steadiness)),
        Err(e) => {
            eprintln_safe!("error: calibrate: cannot write the profile as TOML: {e}");
            return ExitCode::from(1);
        }
    };
    if steadiness.is_unsteady() {
        eprintln_safe!(
            "warning: calibrate: this machine's speed changed while it was measured ({}); the costs it fitted, and what `simulate` predicts from them, are no closer than that. Calibrate again when the machine is quiet (no other load on it or, for a virtual machine, on its host)",
            steadiness.describe()
        );
    }
    let path = args.output.clone().unwrap_or_else(|| PathBuf::from("-"));
    if let Err(e) = optimus::io::write_file(&path, text.as_bytes()) {
        eprintln_safe!("error: {e}");
        return ExitCode::from(1);
    }
    if !optimus::io::output::is_standard_output(&path) {
        eprintln_safe!(
            "calibrate: wrote `{}` in {:.1} s; use it with `optimusc simulate --hardware {}`",
            path.display(),
            started.elapsed().as_secs_f64(),
            path.display()
        );
    }
    ExitCode::SUCCESS
}

/// The comment atop the written profile, with how steady the CPU's speed was where it was measured.
fn header(hw: &Hardware, took: Duration, steadiness: &Steadiness) -> String {
    let speed = match steadiness.variation() {
        Some(_) if steadiness.is_unsteady() => {
            format!(
                "# The CPU's speed changed while it was measured ({}): trust these costs no closer.\n",
                steadiness.describe()
            )
        }
        Some(_) => format!("# The CPU kept its speed while it was measured ({}).\n", steadiness.describe()),
        None => String::new(),
    };
    format!(
        "# Measured by `optimusc calibrate` ({} {}) in {:.1} s on {}.\n{speed}# Kernel and collective costs are in [measured]; see docs/calibration.md.\n\n",
        env!("CARGO_PKG_NAME"),
        env!("CARGO_PKG_VERSION"),
        took.as_secs_f64(),
        hw.device.name
    )
}

/// Measures kernels and collectives and assembles the profile; measures the CPU's peak into
/// `steadiness` at the start, after each phase and at the end.
fn measure_machine(args: &CalibrateArgs, steadiness: &mut Steadiness) -> Result<Hardware, String> {
    steadiness.probe();
    let workloads: Vec<&Workload> =
        if args.quick { WORKLOADS.iter().take(2).collect() } else { WORKLOADS.iter().collect() };
    let shapes: Vec<(u64, u64)> = if args.quick { COLLECTIVE_SHAPES[..2].to_vec() } else { COLLECTIVE_SHAPES.to_vec() };
    let timings = (shapes.len() * COLLECTIVE_KINDS.len()) as u64;
    let meshes: &[(Mesh, Strategy)] = if args.quick { &SHARED_MESHES[..1] } else { &SHARED_MESHES };
    // Every workload in each precision, trained and (under the `@infer` fits) run for inference.
    let mut runs: Vec<(&Workload, Precision, Mode)> = Vec::new();
    for mode in [Mode::Train, Mode::Infer] {
        for precision in PRECISIONS {
            runs.extend(workloads.iter().map(|&w| (w, precision, mode)));
        }
    }
    let shared_runs = 2 * meshes.len() as u64 * CPU_SHARED.passes;
    let progress = Progress::new((KERNEL_PASSES + 1) * runs.len() as u64 + timings + shared_runs);
    let plans: Vec<Plan> = runs.iter().map(|&(w, p, m)| one_device_plan(w, p, m)).collect::<Result<_, _>>()?;
    let what = |w: &Workload, precision: Precision, mode: Mode| {
        let mode = if mode == Mode::Infer { " infer" } else { "" };
        format!("{} {}{mode} {}", w.model, precision.name(), w.set.join(" "))
    };
    // Passes over the workloads, seconds apart: an instruction keeps the median of its times, so
    // that a slow spell of a shared machine during one run does not set the fit.
    let mut passes = Vec::new();
    for pass in 1..=KERNEL_PASSES {
        let mut samples = Vec::new();
        for (&(w, precision, mode), plan) in runs.iter().zip(&plans) {
            progress.phase(&format!("kernels (pass {pass} of {KERNEL_PASSES}): {}", what(w, precision, mode)));
            samples.extend(measure::profile_kernels(plan, (w.steps, 1), BackendKind::Cpu, false)?);
            progress.advance();
        }
        passes.push(samples);
        steadiness.probe();
    }
    let samples = measure::median_of(passes);
    let mut raw = RawSamples::kernels("pool", &samples);
    let kernels = measure::fit_kernels(&samples);
    // The same kernels on one thread, as a device thread runs its own on a mesh of at least as many
    // devices as the pool has workers (one pass: the shared engine's runs below check the sum).
    let mut single = Vec::new();
    for (&(w, precision, mode), plan) in runs.iter().zip(&plans) {
        progress.phase(&format!("kernels on one thread: {}", what(w, precision, mode)));
        single.extend(measure::profile_kernels(plan, (w.steps, 1), BackendKind::Cpu, true)?);
        progress.advance();
    }
    steadiness.probe();
    raw.extend(RawSamples::kernels("single thread", &single));
    let single_thread_kernels = measure::fit_kernels(&single);
    let mut collectives = Vec::new();
    for &(members, devices) in &shapes {
        for kind in COLLECTIVE_KINDS {
            progress.phase(&format!("collectives: {} of {members} on {devices} threads", kind.name()));
            collectives.push(collective_fit(kind, members, devices)?);
            progress.advance();
        }
    }
    let measured = Measured {
        runtime: "cpu".into(),
        threads: optimus::runtime::cpu::par::threads() as u64,
        shared_engine: true,
        overlap: false,
        dispatch: Vec::new(),
        rendezvous: Vec::new(),
        kernels,
        single_thread_kernels,
        collectives,
        host_copies: Some(measure::host_copies(5)),
    };
    steadiness.probe();
    let hw = assemble(args, measured);
    let hw = finish_with_shared_engine(args, hw, (meshes, &CPU_SHARED, "shared engine"), &progress, raw)?;
    steadiness.probe();
    Ok(hw)
}

/// The end of both backends' calibrations: the shared engine's runs on `meshes` (trained, then run
/// for inference), its dispatch and rendezvous costs fitted into `hw`, and the raw measurements
/// written (`--samples`). `what` names the runs in the progress lines.
fn finish_with_shared_engine(
    args: &CalibrateArgs,
    mut hw: Hardware,
    (meshes, setup, what): (&[(Mesh, Strategy)], &SharedSetup, &str),
    progress: &Progress,
    mut raw: RawSamples,
) -> Result<Hardware, String> {
    let mut passes = Vec::new();
    for pass in 1..=setup.passes {
        let of = if setup.passes > 1 { format!(" (pass {pass} of {})", setup.passes) } else { String::new() };
        let mut runs = Vec::new();
        for mode in [Mode::Train, Mode::Infer] {
            for &(mesh, strategy) in meshes {
                let infer = if mode == Mode::Infer { " infer" } else { "" };
                let name = format!("{what}{of}: {} on {mesh}{infer}", strategy.name());
                progress.phase(&name);
                let run = shared_run(&hw, (mesh, strategy), mode, setup)?;
                let (step, alone) = (run.measured * 1e3, run.predicted * 1e3);
                progress.phase(&format!("{name}: {step:.2} ms a step, {alone:.2} ms from the kernels alone"));
                runs.push(run);
                progress.advance();
            }
        }
        passes.push(runs);
    }
    progress.finish();
    let runs = fastest_runs(passes);
    if let Some(m) = hw.measured.as_mut() {
        (m.dispatch, m.rendezvous) = fit_shared_engine(&runs);
    }
    raw.extend(RawSamples::shared(&runs));
    raw.write(args)?;
    Ok(rounded(hw))
}

/// The raw measurements behind a profile's fits, as JSON lines (`calibrate --samples`).
struct RawSamples {
    lines: Vec<String>,
}

impl RawSamples {
    /// A line per timed kernel instruction, marked with how its kernels ran (`what`).
    fn kernels(what: &str, samples: &[(measure::KernelSample, bool)]) -> RawSamples {
        let line = |(s, product): &(measure::KernelSample, bool)| {
            serde_json::json!({"kind": "kernel", "ran": what, "product": product, "sample": s}).to_string()
        };
        RawSamples { lines: samples.iter().map(line).collect() }
    }

    /// A line per shared-engine run.
    fn shared(runs: &[SharedRun]) -> RawSamples {
        let line = |r: &SharedRun| {
            serde_json::json!({"kind": "shared", "devices": r.devices, "measured_s": r.measured,
                "kernels_alone_s": r.predicted, "kernels": r.kernels, "collectives": r.collectives})
            .to_string()
        };
        RawSamples { lines: runs.iter().map(line).collect() }
    }

    fn extend(&mut self, more: RawSamples) {
        self.lines.extend(more.lines);
    }

    /// Writes the lines where `--samples` says (nothing without it).
    fn write(&self, args: &CalibrateArgs) -> Result<(), String> {
        let Some(path) = &args.samples else { return Ok(()) };
        let text: String = self.lines.iter().map(|l| format!("{l}\n")).collect();
        optimus::io::write_file(path, text.as_bytes()).map_err(|e| e.to_string())
    }
}

/// The profile with every measured number to four significant digits (what the noise of a shared
/// machine allows), so that it reads well.
fn rounded(mut hw: Hardware) -> Hardware {
    let r = significant;
    let d = &mut hw.device;
    (d.memory_bandwidth_gb_s, d.kernel_launch_us, d.peak_tflops.f32) =
        (r(d.memory_bandwidth_gb_s), r(d.kernel_launch_us), r(d.peak_tflops.f32));
    (hw.intra_node.bandwidth_gb_s, hw.intra_node.latency_us) =
        (r(hw.intra_node.bandwidth_gb_s), r(hw.intra_node.latency_us));
    (hw.inter_node.nic_bandwidth_gb_s, hw.inter_node.latency_us) =
        (r(hw.inter_node.nic_bandwidth_gb_s), r(hw.inter_node.latency_us));
    if let Some(m) = hw.measured.as_mut() {
        for fit in m.dispatch.iter_mut().chain(m.rendezvous.iter_mut()) {
            fit.us = r(fit.us);
        }
        for fit in m.kernels.values_mut().chain(m.single_thread_kernels.values_mut()) {
            (fit.launch_us, fit.gb_s, fit.gflop_s) = (r(fit.launch_us), fit.gb_s.map(r), fit.gflop_s.map(r));
            fit.cached_gb_s = fit.cached_gb_s.map(r);
        }
        for fit in &mut m.collectives {
            (fit.alpha_us, fit.ns_per_byte) = (r(fit.alpha_us), r(fit.ns_per_byte));
        }
        if let Some(h) = m.host_copies.as_mut() {
            (h.copy_out_gb_s, h.copy_in_gb_s, h.add_gb_s) = (r(h.copy_out_gb_s), r(h.copy_in_gb_s), r(h.add_gb_s));
        }
    }
    hw
}

/// `x` to four significant digits.
fn significant(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let scale = 10f64.powi(3 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}

/// The meshes whose measured steps (trained, and run for inference) fit the shared engine's costs of
/// each kernel and each collective: 2, 4, 8 and 16 devices, both strategies at 4.
const SHARED_MESHES: [(Mesh, Strategy); 5] = [
    (Mesh::new(2, 2), Strategy::Optimus),
    (Mesh::new(1, 2), Strategy::Megatron),
    (Mesh::new(1, 4), Strategy::Megatron),
    (Mesh::new(1, 8), Strategy::Megatron),
    (Mesh::new(4, 4), Strategy::Optimus),
];

/// The model the shared engine is measured on.
const SHARED_WORKLOAD: Workload = Workload {
    model: "gpt2",
    source: GPT2,
    set: &["hidden=128", "heads=8", "seq=96", "batch=4", "vocab=1024", "layers=1"],
    steps: STEPS,
};

/// One multi-device run: its devices, measured step, predicted step without the shared engine's
/// costs, and the kernels and collectives run on the engine per step (summed over the devices).
struct SharedRun {
    devices: u64,
    measured: f64,
    predicted: f64,
    kernels: f64,
    collectives: f64,
}

/// What the shared engine's runs train: a model, in a precision, on a backend.
struct SharedSetup {
    workload: &'static Workload,
    precision: Precision,
    backend: BackendKind,
    /// Passes over the meshes, seconds apart; each run keeps the fastest of its passes' steps.
    passes: u64,
}

/// The CPU's shared engine: threads of this process. Three passes: the two costs fitted per number of
/// devices rest on two or four runs of a few milliseconds a step each, and one run of each moved the
/// predictions of small meshes by about 10% from one calibration to the next (see [`fastest_runs`]).
const CPU_SHARED: SharedSetup =
    SharedSetup { workload: &SHARED_WORKLOAD, precision: Precision::F32, backend: BackendKind::Cpu, passes: 3 };

/// Each run of the first pass with the fastest of its measured steps over `passes` (the runs of every
/// pass in the same order): a run's step is slower, never faster, while the threads of its devices
/// have not yet settled on the cores (a small 2x2 training step measured 9.6, 10.5 and 12.8 ms in three
/// passes of one calibration), and `simulate` predicts the settled step.
fn fastest_runs(passes: Vec<Vec<SharedRun>>) -> Vec<SharedRun> {
    let mut passes = passes.into_iter();
    let Some(mut runs) = passes.next() else { return Vec::new() };
    for pass in passes {
        for (run, again) in runs.iter_mut().zip(pass) {
            run.measured = run.measured.min(again.measured);
        }
    }
    runs
}

fn shared_run(
    hw: &Hardware,
    (mesh, strategy): (Mesh, Strategy),
    mode: Mode,
    setup: &SharedSetup,
) -> Result<SharedRun, String> {
    let plan = plan_for(setup.workload, (mesh, strategy), setup.precision, mode)?;
    let measured = measure::median_step(&plan, (setup.workload.steps, 1), setup.backend)?;
    let predicted = optimus::cost::simulate(&plan, hw, &optimus::cost::Options::default()).step_time_s;
    let count = |kernel: bool| {
        let per_device = plan
            .program
            .iter()
            .filter(|i| match i {
                optimus::plan::Instr::Kernel { .. } => kernel,
                optimus::plan::Instr::Collective { .. } => !kernel,
                _ => false,
            })
            .count();
        (per_device as u64 * mesh.devices()) as f64
    };
    Ok(SharedRun { devices: mesh.devices(), measured, predicted, kernels: count(true), collectives: count(false) })
}

/// Per number of devices, the seconds per kernel and per collective that best close the gap between
/// its runs' measured and predicted steps (least squares, neither negative: where the joint fit
/// would make one negative, it is 0 and the other is fitted alone).
fn fit_shared_engine(runs: &[SharedRun]) -> (Vec<DispatchFit>, Vec<DispatchFit>) {
    let mut by_devices: BTreeMap<u64, Vec<&SharedRun>> = BTreeMap::new();
    for r in runs {
        by_devices.entry(r.devices).or_default().push(r);
    }
    let (mut dispatch, mut rendezvous) = (Vec::new(), Vec::new());
    for (devices, runs) in by_devices {
        let points: Vec<Point> = runs.iter().map(|r| ([r.kernels, r.collectives], r.measured - r.predicted)).collect();
        let [per_kernel, per_collective] = nonnegative_least_squares(&points);
        dispatch.push(DispatchFit { devices, us: per_kernel * 1e6 });
        rendezvous.push(DispatchFit { devices, us: per_collective * 1e6 });
    }
    (dispatch, rendezvous)
}

/// A point of a two-variable fit: the variables and the value.
type Point = ([f64; 2], f64);

/// The `[a, b] >= 0` minimising the sum of `(y - a x0 - b x1)^2` over `points` (`(x, y)`).
fn nonnegative_least_squares(points: &[Point]) -> [f64; 2] {
    let sum = |f: &dyn Fn(&Point) -> f64| points.iter().map(f).sum::<f64>();
    let (s00, s01, s11) = (sum(&|(x, _)| x[0] * x[0]), sum(&|(x, _)| x[0] * x[1]), sum(&|(x, _)| x[1] * x[1]));
    let (s0y, s1y) = (sum(&|(x, y)| x[0] * y), sum(&|(x, y)| x[1] * y));
    let alone = |sxy: f64, sxx: f64| if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
    let determinant = s00 * s11 - s01 * s01;
    if determinant > 1e-9 * s00 * s11 {
        let (a, b) = ((s0y * s11 - s1y * s01) / determinant, (s1y * s00 - s0y * s01) / determinant);
        if a >= 0.0 && b >= 0.0 {
            return [a, b];
        }
    }
    // On the boundary: the better of the two one-variable fits.
    let residual = |a: f64, b: f64| sum(&|(x, y)| (y - a * x[0] - b * x[1]).powi(2));
    let (only_a, only_b) = (alone(s0y, s00), alone(s1y, s11));
    if residual(only_a, 0.0) <= residual(0.0, only_b) { [only_a, 0.0] } else { [0.0, only_b] }
}

/// A workload compiled for one device, training.
fn one_device_plan(w: &Workload, precision: Precision, mode: Mode) -> Result<Plan, String> {
    plan_for(w, (Mesh::new(1, 1), Strategy::None), precision, mode)
}

/// A workload compiled for a mesh and strategy.
fn plan_for(
    w: &Workload,
    (mesh, strategy): (Mesh, Strategy),
    precision: Precision,
    mode: Mode,
) -> Result<Plan, String> {
    let overrides: Vec<Override> = w.set.iter().map(|s| s.parse()).collect::<Result<_, _>>()?;
    let checked = check_source(w.source, &overrides);
    let model = checked.model.ok_or_else(|| format!("the built-in {} model does not check", w.model))?;
    let memory = optimus::plan::MemoryOptions { precision, ..optimus::plan::MemoryOptions::DEFAULT };
    let target = Target { memory, ..Target::plain(mesh, strategy, mode) };
    compile(&model, w.model, w.source, target)
        .map_err(|_| format!("the built-in {} model does not compile for {mesh} {}", w.model, strategy.name()))
}

/// Times one collective configuration at every payload and fits it.
fn collective_fit(
    kind: CollectiveKind,
    members: u64,
    devices: u64,
) -> Result<optimus::cost::calibration::CollectiveFit, String> {
    let mut points = Vec::new();
    for bytes in COLLECTIVE_PAYLOADS {
        let guess = measure::time_collective(kind, members, devices, bytes, 2)?;
        let repeats = measure::repeats_for(Duration::from_secs_f64(guess), Duration::from_millis(25));
        points.push((bytes, measure::time_collective(kind, members, devices, bytes, repeats)?));
    }
    Ok(measure::fit_collective(kind, members, devices, &points))
}

/// The profile: the measured section, and the classic fields filled from it (so that memory fit,
/// MFU and profiles without `[measured]` still read sensibly).
fn assemble(args: &CalibrateArgs, measured: Measured) -> Hardware {
    let default = measured.kernels.get(DEFAULT_KERNEL).copied();
    let product = measured.kernels.get("MatMul").copied();
    let broadcast = measured
        .collectives
        .iter()
        .find(|f| f.members == 2 && f.devices == 2 && f.kind == CollectiveKind::Broadcast.into());
    let link_gb_s = broadcast.map_or(10.0, |f| 1.0 / f.ns_per_byte.max(1e-3));
    let latency_us = broadcast.map_or(10.0, |f| f.alpha_us);
    let host = host_name();
    Hardware {
        name: args.name.clone().unwrap_or_else(|| format!("calibrated-{host}")),
        description: format!(
            "{} with {} kernel workers, {} kernels, products in {}, measured by optimusc calibrate",
            cpu_model(),
            measured.threads,
            optimus::runtime::cpu::vmath::isa().env_name(),
            optimus::runtime::cpu::blas::product_library()
        ),
        device: Device {
            name: cpu_model(),
            memory_gb: memory_gb(),
            memory_bandwidth_gb_s: default.and_then(|f| f.gb_s).unwrap_or(10.0),
            achievable_bandwidth: 1.0,
            achievable_compute: 1.0,
            kernel_launch_us: default.map_or(0.0, |f| f.launch_us),
            peak_tflops: PeakTflops {
                f32: product.and_then(|f| f.gflop_s).unwrap_or(100.0) / 1e3,
                f16: None,
                bf16: None,
            },
        },
        intra_node: IntraNode {
            gpus_per_node: optimus::runtime::limits::MAX_DEVICE_THREADS,
            bandwidth_gb_s: link_gb_s,
            latency_us,
        },
        inter_node: InterNode { nic_bandwidth_gb_s: link_gb_s, latency_us, nics_per_node: 1 },
        collectives: Collectives::default(),
        measured: Some(measured),
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').collect::<String>())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "host".into())
}

/// The CPU's model name, from /proc/cpuinfo where there is one.
fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let name =
        info.lines().find_map(|l| l.strip_prefix("model name")?.split_once(':').map(|(_, v)| v.trim().to_string()));
    name.filter(|n| !n.is_empty()).unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// This machine's memory in GB (1e9 bytes), from /proc/meminfo; 16 where it cannot be read.
fn memory_gb() -> f64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib =
        info.lines().find_map(|l| l.strip_prefix("MemTotal:")?.trim().strip_suffix("kB")?.trim().parse::<f64>().ok());
    kib.map_or(16.0, |k| (k * 1024.0 / 1e9 * 10.0).round() / 10.0)
}

/// A bar on a terminal; a line per phase otherwise.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    /// Runs in all, those finished, and when the first started: the ETA of the lines without a bar.
    total: u64,
    done: std::sync::atomic::AtomicU64,
    start: std::time::Instant,
}

impl Progress {
    fn new(total: u64) -> Progress {
        let bar = super::terminal_bar(total, "{bar:30} {pos}/{len}  {msg}  ETA {eta}", false);
        Progress { bar, total, done: std::sync::atomic::AtomicU64::new(0), start: std::time::Instant::now() }
    }

    fn phase(&self, what: &str) {
        match &self.bar {
            Some(bar) => bar.set_message(what.to_string()),
            None => eprintln_safe!("calibrate: {what}{}", self.eta()),
        }
    }

    /// "  (ETA 40 s)" at the pace of the runs so far; empty before the first has finished.
    fn eta(&self) -> String {
        let done = self.done.load(std::sync::atomic::Ordering::Relaxed);
        if done == 0 || done >= self.total {
            return String::new();
        }
        let left = self.start.elapsed().as_secs_f64() / done as f64 * (self.total - done) as f64;
        format!("  (ETA {})", super::run::duration_text(left))
    }

    fn advance(&self) {
        self.done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn run(devices: u64, kernels: f64, collectives: f64, gap: f64) -> SharedRun {
        SharedRun { devices, measured: 0.01 + gap, predicted: 0.01, kernels, collectives }
    }

    #[test]
    fn the_shared_engine_fit_recovers_a_cost_per_kernel_and_per_collective() {
        // 4 devices: 2 us a kernel and 9 us a collective, from four runs of different mixes.
        let mixes = [(600.0, 80.0), (700.0, 600.0), (200.0, 30.0), (250.0, 200.0)];
        let mut runs: Vec<SharedRun> = mixes.iter().map(|&(k, c)| run(4, k, c, 2e-6 * k + 9e-6 * c)).collect();
        // 16 devices: collectives alone explain the gaps.
        runs.extend([(900.0, 400.0), (300.0, 150.0)].map(|(k, c)| run(16, k, c, 6e-6 * c)));
        let (dispatch, rendezvous) = fit_shared_engine(&runs);
        let us = |fits: &[DispatchFit], devices: u64| fits.iter().find(|f| f.devices == devices).map(|f| f.us);
        let near = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-6);
        assert!(near(us(&dispatch, 4), 2.0) && near(us(&rendezvous, 4), 9.0), "{dispatch:?} {rendezvous:?}");
        assert!(near(us(&dispatch, 16), 0.0) && near(us(&rendezvous, 16), 6.0), "{dispatch:?} {rendezvous:?}");
    }

    #[test]
    fn each_shared_run_keeps_its_fastest_pass_and_its_counts() {
        let pass = |steps: [f64; 2]| vec![run(4, 600.0, 80.0, steps[0]), run(16, 900.0, 400.0, steps[1])];
        let runs = fastest_runs(vec![pass([3e-3, 1e-3]), pass([1e-3, 4e-3]), pass([2e-3, 2e-3])]);
        let kept: Vec<(u64, f64, f64)> = runs.iter().map(|r| (r.devices, r.measured, r.kernels)).collect();
        assert_eq!(kept.iter().map(|k| (k.0, k.2)).collect::<Vec<_>>(), [(4, 600.0), (16, 900.0)]);
        assert!(kept.iter().all(|k| (k.1 - 0.011).abs() < 1e-12), "{kept:?}");
        assert!(fastest_runs(Vec::new()).is_empty());
    }

    #[test]
    fn a_fit_that_would_go_negative_stays_at_zero() {
        // The gaps fall as collectives grow: a negative cost per collective would fit best.
        let points = [([100.0, 10.0], 4e-4), ([100.0, 50.0], 3e-4), ([300.0, 20.0], 1e-3)];
        let [per_kernel, per_collective] = nonnegative_least_squares(&points);
        assert!(per_kernel > 0.0 && per_collective == 0.0, "{per_kernel} {per_collective}");
        // Measured faster than predicted everywhere: no cost at all.
        let faster = [([100.0, 10.0], -1e-4), ([50.0, 40.0], -2e-4)];
        assert_eq!(nonnegative_least_squares(&faster), [0.0, 0.0]);
    }
}
