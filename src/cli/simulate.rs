//! `optimusc simulate`: predicted step time, memory, throughput and MFU of a plan on a named cluster;
//! the largest batch that fits; optimus against megatron at the same device count; scaling sweeps.

use super::{ModeArg, StrategyArg, TargetArgs};
use clap::ValueEnum;
use optimus::cost::planner::seconds;
use optimus::cost::search::{self, MaxBatch, Source, SweepPoint};
use optimus::cost::staged::simulate_pipeline;
use optimus::cost::step::{InstrCost, simulate_costed};
use optimus::cost::{Algorithm, Hardware, Options, RankPlacement, Simulation, simulate};
use optimus::plan::report::human_bytes;
use optimus::plan::text::group_digits;
use optimus::plan::{Instr, Mode, Plan, Strategy};
use serde_json::{Value, json};
use std::fmt::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// Flags of `optimusc simulate`.
#[derive(clap::Args, Debug, Clone)]
pub struct SimulateArgs {
    /// The model file (.opt), or a plan (.json) for a plain simulation.
    pub model: PathBuf,
    #[command(flatten)]
    pub target: TargetArgs,
    /// A built-in hardware profile (frontera-rtx5000, dgx-a100, dgx-h100) or the path of a .toml profile.
    #[arg(long, value_name = "NAME|FILE")]
    pub hardware: String,
    /// How ranks sit on nodes: row-major (consecutive ranks share a node), blocks (each node holds a
    /// near-square block of the mesh, as the Optimus code arranges ranks; meshes with depth layers may
    /// hold several layers of a smaller block), or auto (both simulated, the faster kept and named).
    #[arg(long, value_enum, default_value_t = SimulatedPlacement::Auto)]
    pub placement: SimulatedPlacement,
    /// Collective algorithm for groups that span nodes: ring (ordered by node: one flow per group
    /// leaves each node), tree (hierarchical: inside each node, then a tree between nodes, then inside
    /// each node again), or auto (the faster for each collective, as NCCL picks by size). Default: the
    /// profile's (auto unless it says otherwise). Every group's flows through a node's NIC share it.
    #[arg(long, value_enum)]
    pub algorithm: Option<AlgorithmArg>,
    /// Do not overlap communication with computation: SUMMA broadcasts do not hide behind the
    /// previous step's product (no double buffering), and data-parallel gradient sums are exposed where
    /// they are issued instead of running beside the rest of the backward pass. Every collective's
    /// whole time is then in the step.
    #[arg(long, conflicts_with = "overlap")]
    pub no_overlap: bool,
    /// Also find the largest batch that fits in device memory (re-compiling with --set batch=N).
    #[arg(long)]
    pub max_batch: bool,
    /// Compare strategies at the mesh's device count: `--compare` sets optimus on q x q against
    /// megatron on 1 x q^2; `--compare=optimus,megatron,tesseract,3d` takes any of the four (tesseract
    /// on the largest q x q grid with two or more depth layers, 3d on a q x q x q cube). A strategy the
    /// device count does not fit is shown as infeasible, with the reason.
    #[arg(
        long,
        conflicts_with = "sweep",
        value_parser = compared_strategy(),
        value_name = "STRATEGY,...",
        num_args = 0..=1,
        require_equals = true,
        value_delimiter = ',',
        default_missing_value = "optimus,megatron"
    )]
    pub compare: Option<Vec<StrategyArg>>,
    /// Weak and strong scaling of both strategies over 4, 16, 64 and 256 devices.
    #[arg(long)]
    pub sweep: bool,
    /// With --sweep: also write an SVG plot of efficiency against devices to this file.
    #[arg(long, value_name = "FILE.svg", requires = "sweep")]
    pub plot: Option<PathBuf>,
    #[command(flatten)]
    pub pipeline: super::pipeline::PipelineArgs,
    /// Also give the step's compute by kernel kind: for each kind (named as `run --profile` names
    /// them), its kernels per device and the time they add to the step. `run --profile` sums its rows
    /// over the devices and the timed steps; divide by both to compare. (JSON: `by_kind`.)
    #[arg(long, conflicts_with_all = ["compare", "sweep"])]
    pub by_kind: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `simulate --placement`: either placement, or the faster of the two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SimulatedPlacement {
    RowMajor,
    Blocks,
    Auto,
}

/// `run --placement` (how `mpirun` ranks map to devices).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlacementArg {
    RowMajor,
    Blocks,
}

impl PlacementArg {
    /// Only `mpirun` runs (feature `mpi`) place ranks.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub fn placement(self) -> RankPlacement {
        match self {
            PlacementArg::RowMajor => RankPlacement::RowMajor,
            PlacementArg::Blocks => RankPlacement::Blocks,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AlgorithmArg {
    Ring,
    Tree,
    Auto,
}

impl SimulateArgs {
    fn options(&self) -> Options {
        let placement = match self.placement {
            SimulatedPlacement::Blocks => RankPlacement::Blocks,
            SimulatedPlacement::RowMajor | SimulatedPlacement::Auto => RankPlacement::RowMajor,
        };
        Options {
            placement,
            auto_placement: self.placement == SimulatedPlacement::Auto,
            algorithm: self.algorithm.map(|a| match a {
                AlgorithmArg::Ring => Algorithm::Ring,
                AlgorithmArg::Tree => Algorithm::Tree,
                AlgorithmArg::Auto => Algorithm::Auto,
            }),
            overlap: !self.no_overlap,
            engine_devices: None,
        }
    }

    fn mode(&self) -> Mode {
        if self.target.mode() == ModeArg::Train { Mode::Train } else { Mode::Infer }
    }

    /// What every plan a search compiles is asked for besides its strategy and mesh.
    fn choices(&self) -> (Mode, optimus::plan::MemoryOptions, optimus::plan::Layouts) {
        (self.mode(), self.target.memory(), self.target.layouts())
    }
}

/// Runs `optimusc simulate`.
pub fn simulate_command(args: &SimulateArgs) -> ExitCode {
    if let Some(Err(e)) = args.plot.as_ref().map(|plot| super::check_output(plot, "--plot")) {
        return e.exit();
    }
    let hw = match Hardware::load(&args.hardware) {
        Ok(hw) => hw,
        Err(e) => {
            eprintln_safe!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let searching = args.max_batch || args.compare.is_some() || args.sweep;
    if args.pipeline.requested() && args.by_kind {
        eprintln_safe!(
            "error: --by-kind applies to a plain simulation, not with --pipeline, --pipeline-schedule, \
             --virtual-stages or --accum"
        );
        return ExitCode::from(2);
    }
    if args.pipeline.requested() {
        return pipelined(args, &hw, searching);
    }
    if !searching {
        let plan = match super::plan_from(&args.model, &args.target) {
            Ok(plan) => plan,
            Err(failure) => return failure.exit(),
        };
        return single(args, &hw, &plan, None);
    }
    let text = match read_source(&args.model) {
        Ok(text) => text,
        Err(status) => return status,
    };
    let name = args.model.display().to_string();
    let source = Source { name: &name, text: &text, overrides: &args.target.set };
    // The model's own errors first, with their spans: a sweep would only see that it has no batch.
    let Some((model, checked)) = super::load_checked(&args.model, &args.target.set) else {
        return ExitCode::from(1);
    };
    if args.sweep {
        return sweep(args, &hw, &source);
    }
    if let Some(strategies) = &args.compare {
        return compare(args, &hw, &source, strategies);
    }
    let Some(plan) = super::compile_checked_model(&model, &checked, &args.target) else { return ExitCode::from(1) };
    let found = search::max_batch(&source, args.target.target(), hw.memory_bytes());
    single(args, &hw, &plan, Some(found))
}

/// `simulate --pipeline`: the whole model compiled for one stage's grid, cut into stages and timed
/// under the schedule.
fn pipelined(args: &SimulateArgs, hw: &Hardware, searching: bool) -> ExitCode {
    if searching {
        eprintln_safe!(
            "error: --pipeline and --accum simulate one configuration: they do not go with --max-batch, --compare or --sweep"
        );
        return ExitCode::from(2);
    }
    let pipeline = match args.pipeline.pipeline() {
        Ok(p) => p,
        Err(e) => {
            eprintln_safe!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let plan = match super::plan_from(&args.model, &args.target) {
        Ok(plan) => plan,
        Err(failure) => return failure.exit(),
    };
    match simulate_pipeline(&plan, hw, &args.options(), pipeline) {
        Ok(sim) if args.json => super::print_json(&sim),
        Ok(sim) => {
            let mut text = super::pipeline::render_pipeline(&sim);
            if args.pipeline.timeline {
                text.push_str(&super::pipeline::render_timeline(&sim));
            }
            super::stdout(&text);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln_safe!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// A strategy `--compare` takes: any but `none`, which runs one device.
fn compared_strategy() -> impl clap::builder::TypedValueParser<Value = StrategyArg> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(["optimus", "megatron", "tesseract", "3d"])
        .try_map(|name| <StrategyArg as clap::ValueEnum>::from_str(&name, false))
}

/// The text of a model file; searches re-compile it, so plans (.json) are refused.
fn read_source(path: &std::path::Path) -> Result<String, ExitCode> {
    super::read_model_text(path, "--max-batch, --compare and --sweep re-compile the model")
}

fn single(args: &SimulateArgs, hw: &Hardware, plan: &Plan, found: Option<MaxBatch>) -> ExitCode {
    let (sim, costs) = simulate_costed(plan, hw, &args.options());
    let kinds = args.by_kind.then(|| by_kind(plan, &costs));
    if args.json {
        let mut value = serde_json::to_value(&sim).unwrap_or(Value::Null);
        if let Value::Object(map) = &mut value {
            if let Some(found) = &found {
                map.insert("max_batch".to_string(), serde_json::to_value(found).unwrap_or(Value::Null));
            }
            if let Some(kinds) = &kinds {
                let rows = kinds.iter().map(|k| json!({"kind": k.kind, "count": k.count, "step_s": k.step_s}));
                map.insert("by_kind".to_string(), Value::Array(rows.collect()));
            }
        }
        return super::print_json(&value);
    }
    let mut out = render_simulation(&sim);
    if let Some(kinds) = &kinds {
        out.push_str(&render_by_kind(kinds, sim.compute_s));
    }
    if let Some(found) = &found {
        let _ = writeln!(out, "{}", render_max_batch(found));
    }
    super::stdout(&out);
    ExitCode::SUCCESS
}

/// One kernel kind's part in a simulated step.
#[derive(Debug, Clone, PartialEq)]
struct KindPart {
    kind: &'static str,
    /// Kernels of the kind in one device's step.
    count: u64,
    /// What they add to the step.
    step_s: f64,
}

/// The kernels of `plan`'s program by kind, with what each kind adds to the step (`costs`: one per
/// instruction), the largest first.
fn by_kind(plan: &Plan, costs: &[InstrCost]) -> Vec<KindPart> {
    let mut parts: Vec<KindPart> = Vec::new();
    for (instr, cost) in plan.program.iter().zip(costs) {
        let Instr::Kernel { kernel, .. } = instr else { continue };
        match parts.iter_mut().find(|p| p.kind == kernel.name()) {
            Some(part) => {
                part.count += 1;
                part.step_s += cost.step_s;
            }
            None => parts.push(KindPart { kind: kernel.name(), count: 1, step_s: cost.step_s }),
        }
    }
    parts.sort_by(|a, b| b.step_s.total_cmp(&a.step_s).then(a.kind.cmp(b.kind)));
    parts
}

fn render_by_kind(parts: &[KindPart], compute_s: f64) -> String {
    let mut out = String::from("\ncompute by kernel kind (per device per step):\n");
    let _ = writeln!(out, "  {:<22} {:>7} {:>12} {:>8}", "kind", "count", "time", "share");
    for p in parts {
        let share = if compute_s > 0.0 { 100.0 * p.step_s / compute_s } else { 0.0 };
        let _ = writeln!(out, "  {:<22} {:>7} {:>12} {:>7.1}%", p.kind, p.count, seconds(p.step_s), share);
    }
    out
}

/// The human-readable simulation.
pub fn render_simulation(s: &Simulation) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "simulate: model {} on {}: {} strategy, {} mesh ({} devices), {} mode",
        s.model, s.hardware, s.strategy, s.mesh, s.devices, s.mode
    );
    let overlap = if s.overlap { "SUMMA broadcasts overlapped" } else { "no overlap" };
    let _ = writeln!(
        out,
        "  placement {}, collectives {} (flows through each NIC added up), {overlap}",
        s.placement, s.algorithm
    );
    if let Some(note) = &s.placement_note {
        let _ = writeln!(out, "  note: {note}");
    }
    let _ = writeln!(out, "\nstep time               {:>12}", seconds(s.step_time_s));
    let _ = writeln!(out, "  compute               {:>12}", seconds(s.compute_s));
    if s.overhead_s > 0.0 {
        let _ = writeln!(out, "    of which overhead   {:>12}  (kernel launch and dispatch)", seconds(s.overhead_s));
    }
    let _ = writeln!(out, "  exposed communication {:>12}", seconds(s.exposed_communication_s));
    let _ = writeln!(
        out,
        "  (all communication    {:>12}, of which hidden behind products {})",
        seconds(s.communication_s),
        seconds(s.hidden_communication_s)
    );
    render_comm(&mut out, s);
    let m = &s.memory;
    let _ = writeln!(
        out,
        "\nmemory per device       {} of {} ({:.1}%): {}",
        human_bytes(m.peak_bytes_per_device),
        human_bytes(m.capacity_bytes),
        100.0 * m.utilisation,
        if m.fits { "fits" } else { "DOES NOT FIT" }
    );
    let _ = writeln!(
        out,
        "throughput              {} tokens/s ({} tokens per step)",
        group_digits(s.tokens_per_second.round() as u128),
        group_digits(u128::from(s.tokens_per_step))
    );
    let _ = writeln!(
        out,
        "model FLOP utilisation  {:.1}% ({} parameters, {:.3e} model FLOPs per step)",
        100.0 * s.mfu,
        group_digits(u128::from(s.parameters)),
        s.model_flops_per_step
    );
    out
}

fn render_comm(out: &mut String, s: &Simulation) {
    let _ = writeln!(out, "\ncommunication per device per step, by group and link:");
    let _ = writeln!(
        out,
        "  {:<7} {:<11} {:<15} {:>6} {:>12} {:>12} {:>12}",
        "group", "link", "collective", "count", "bytes", "time", "exposed"
    );
    for c in &s.communication {
        let _ = writeln!(
            out,
            "  {:<7} {:<11} {:<15} {:>6} {:>12} {:>12} {:>12}",
            c.group,
            c.link,
            c.kind,
            c.count,
            human_bytes(c.bytes),
            seconds(c.time_s),
            seconds(c.exposed_s)
        );
    }
    if s.communication.is_empty() {
        let _ = writeln!(out, "  none");
    }
}

fn render_max_batch(found: &MaxBatch) -> String {
    match &found.reason {
        Some(reason) => format!("max batch               none fits: {reason}"),
        None => format!(
            "max batch               {} (multiples of {}; {})",
            found.max_batch,
            found.multiple,
            optimus::plan::text::plural(found.compilations, "compilation")
        ),
    }
}

/// One strategy's side of a comparison.
struct Side {
    strategy: Strategy,
    mesh: String,
    result: Result<Simulation, search::SearchError>,
    found: Option<MaxBatch>,
}

fn compare(args: &SimulateArgs, hw: &Hardware, source: &Source, asked: &[StrategyArg]) -> ExitCode {
    let devices = args.target.mesh().devices();
    let mut strategies: Vec<Strategy> = Vec::new();
    // The parser took every strategy but none (which runs one device).
    for strategy in asked.iter().map(|s| s.strategy()) {
        if !strategies.contains(&strategy) {
            strategies.push(strategy);
        }
    }
    if strategies.len() < 2 {
        eprintln_safe!("error: --compare needs two strategies or more, e.g. --compare=optimus,tesseract");
        return ExitCode::from(2);
    }
    let sides: Vec<Side> = strategies.into_iter().map(|s| side(args, hw, source, s, devices)).collect();
    if sides.iter().all(|s| s.result.is_err()) {
        let reasons: Vec<String> = sides
            .iter()
            .filter_map(|s| s.result.as_ref().err().map(|e| format!("{}: {e}", s.strategy.name())))
            .collect();
        eprintln_safe!("error: no strategy compared fits {devices} devices ({})", reasons.join("; "));
        return ExitCode::from(1);
    }
    if args.json {
        return super::print_json(&compare_json(hw, devices, args.mode(), &sides));
    }
    super::stdout(&render_compare(hw, devices, &sides));
    ExitCode::SUCCESS
}

fn side(args: &SimulateArgs, hw: &Hardware, source: &Source, strategy: Strategy, devices: u64) -> Side {
    let target = search::target_for(strategy, devices, args.choices());
    let mesh = target.as_ref().map_or_else(|_| "-".to_string(), |t| t.mesh.to_string());
    let result = target.and_then(|t| source.compile(t, &[])).map(|plan| simulate(&plan, hw, &args.options()));
    let found = match (args.max_batch, search::target_for(strategy, devices, args.choices())) {
        (true, Ok(t)) => Some(search::max_batch(source, t, hw.memory_bytes())),
        _ => None,
    };
    Side { strategy, mesh, result, found }
}

fn step_of(side: &Side) -> Option<f64> {
    side.result.as_ref().ok().map(|s| s.step_time_s)
}

/// Megatron's step time over optimus's, and optimus's largest batch over megatron's, when both were
/// compared.
fn ratios(sides: &[Side]) -> (Option<f64>, Option<f64>) {
    let of = |strategy: Strategy| sides.iter().find(|s| s.strategy == strategy);
    let (Some(o), Some(m)) = (of(Strategy::Optimus), of(Strategy::Megatron)) else { return (None, None) };
    let speedup = step_of(m).zip(step_of(o)).map(|(m, o)| m / o);
    let batch = |s: &Side| s.found.as_ref().map(|f| f.max_batch);
    let ratio = batch(o).zip(batch(m)).filter(|&(_, m)| m > 0).map(|(o, m)| o as f64 / m as f64);
    (speedup, ratio)
}

fn compare_json(hw: &Hardware, devices: u64, mode: Mode, sides: &[Side]) -> Value {
    let mut object = serde_json::Map::new();
    object.insert("hardware".to_string(), json!(hw.name));
    object.insert("devices".to_string(), json!(devices));
    object.insert("mode".to_string(), json!(if mode == Mode::Train { "train" } else { "infer" }));
    for s in sides {
        let mut entry = serde_json::Map::new();
        entry.insert("mesh".to_string(), json!(s.mesh));
        match &s.result {
            Ok(sim) => {
                entry.insert("step_time_s".to_string(), json!(sim.step_time_s));
                entry.insert("peak_bytes_per_device".to_string(), json!(sim.memory.peak_bytes_per_device));
                entry.insert("tokens_per_second".to_string(), json!(sim.tokens_per_second));
                entry.insert("mfu".to_string(), json!(sim.mfu));
                entry.insert("simulation".to_string(), serde_json::to_value(sim).unwrap_or(Value::Null));
            }
            Err(reason) => {
                entry.insert("infeasible".to_string(), json!(reason.to_string()));
            }
        }
        if let Some(found) = &s.found {
            entry.insert("max_batch".to_string(), json!(found.max_batch));
        }
        object.insert(s.strategy.name().to_string(), Value::Object(entry));
    }
    let (speedup, ratio) = ratios(sides);
    object.insert("speedup".to_string(), json!(speedup));
    if sides.iter().any(|s| s.found.is_some()) {
        object.insert("max_batch_ratio".to_string(), json!(ratio));
    }
    Value::Object(object)
}

fn render_compare(hw: &Hardware, devices: u64, sides: &[Side]) -> String {
    let mut out = format!("compare on {} with {devices} devices:\n", hw.name);
    let _ = writeln!(
        out,
        "  {:<9} {:<8} {:>12} {:>12} {:>14} {:>7} {:>10} {:>10}  placement",
        "strategy", "mesh", "step time", "peak/device", "tokens/s", "MFU", "max batch", "vs fastest"
    );
    let fastest = sides.iter().filter_map(step_of).fold(f64::INFINITY, f64::min);
    for s in sides {
        let batch = s.found.as_ref().map_or_else(|| "-".to_string(), |f| f.max_batch.to_string());
        match &s.result {
            Ok(sim) => {
                let _ = writeln!(
                    out,
                    "  {:<9} {:<8} {:>12} {:>12} {:>14} {:>6.1}% {:>10} {:>9.2}x  {}",
                    s.strategy.name(),
                    s.mesh,
                    seconds(sim.step_time_s),
                    human_bytes(sim.memory.peak_bytes_per_device),
                    group_digits(sim.tokens_per_second.round() as u128),
                    100.0 * sim.mfu,
                    batch,
                    sim.step_time_s / fastest,
                    sim.placement
                );
            }
            Err(reason) => {
                let _ = writeln!(out, "  {:<9} {:<8} infeasible: {reason}", s.strategy.name(), s.mesh);
            }
        }
    }
    let has = |strategy: Strategy| sides.iter().any(|s| s.strategy == strategy);
    if has(Strategy::Optimus) && has(Strategy::Megatron) {
        let (speedup, ratio) = ratios(sides);
        let show = |v: Option<f64>| v.map_or_else(|| "n/a".to_string(), |v| format!("{v:.2}x"));
        let _ = writeln!(out, "speedup (megatron step time / optimus step time): {}", show(speedup));
        if sides.iter().any(|s| s.found.is_some()) {
            let _ = writeln!(out, "max batch ratio (optimus / megatron): {}", show(ratio));
        }
    }
    out
}

fn sweep(args: &SimulateArgs, hw: &Hardware, source: &Source) -> ExitCode {
    let points = match search::sweep(source, args.choices(), hw, &args.options()) {
        Ok(points) => points,
        Err(e) => {
            eprintln_safe!("error: {e}");
            return ExitCode::from(1);
        }
    };
    if let Some(path) = &args.plot {
        let title = format!("{} on {}: scaling efficiency", args.model.display(), hw.name);
        let written = optimus::cost::plot::efficiency_svg(&points, &title)
            .map_err(|e| format!("cannot write `{}`: {e}", path.display()))
            .and_then(|svg| optimus::io::output::write_file(path, svg.as_bytes()).map_err(|e| e.to_string()));
        if let Err(e) = written {
            eprintln_safe!("error: {e}");
            return ExitCode::from(1);
        }
    }
    if args.json {
        return super::print_json(&points);
    }
    super::stdout(&render_sweep(hw, &points));
    ExitCode::SUCCESS
}

fn render_sweep(hw: &Hardware, points: &[SweepPoint]) -> String {
    let mut out = format!("scaling on {} (efficiency against the first feasible point of each row group):\n", hw.name);
    let _ = writeln!(
        out,
        "  {:<7} {:<9} {:>7} {:<6} {:>6} {:>12} {:>14} {:>12} {:>5} {:>10}",
        "scaling", "strategy", "devices", "mesh", "batch", "step time", "tokens/s", "peak/device", "fits", "efficiency"
    );
    for p in points {
        let scaling = if p.scaling == search::Scaling::Weak { "weak" } else { "strong" };
        let head = format!("  {scaling:<7} {:<9} {:>7} {:<6} {:>6}", p.strategy, p.devices, p.mesh, p.batch);
        match (&p.simulation, &p.infeasible) {
            (Some(s), _) => {
                let _ = writeln!(
                    out,
                    "{head} {:>12} {:>14} {:>12} {:>5} {:>9.1}%",
                    seconds(s.step_time_s),
                    group_digits(s.tokens_per_second.round() as u128),
                    human_bytes(s.memory.peak_bytes_per_device),
                    if s.memory.fits { "yes" } else { "no" },
                    100.0 * p.efficiency.unwrap_or(0.0)
                );
            }
            (None, reason) => {
                let _ = writeln!(out, "{head} infeasible: {}", reason.as_deref().unwrap_or("unknown"));
            }
        }
    }
    out
}
