//! Quiet compilation for the simulator's searches: the largest batch that fits in device memory, and
//! the weak and strong scaling sweep. Failures are values (an infeasible point and its reason), never
//! printed diagnostics.

use super::hardware::Hardware;
use super::step::{Options, Simulation, simulate};
use optimus_compiler::diag::Diagnostic;
use optimus_compiler::elab::Override;
use optimus_compiler::front::check_source;
use optimus_compiler::ir::Model;
use optimus_compiler::shard::{Target, compile, compile_quietly};
use optimus_plan::types::Scalar;
use optimus_plan::{Layouts, MemoryOptions, Mesh, Mode, Plan, Strategy};
use serde::Serialize;

/// A compiler entry point: [`compile`] or [`compile_quietly`].
type Compiler = fn(&Model, &str, &str, Target) -> Result<Plan, Vec<Diagnostic>>;

/// The largest batch tried: 2^24 sequences.
const BATCH_LIMIT: u64 = 1 << 24;

/// A model's source, compiled on demand with extra overrides.
pub struct Source<'a> {
    pub name: &'a str,
    pub text: &'a str,
    pub overrides: &'a [Override],
}

impl Source<'_> {
    /// Compiles with `extra` overrides after the user's; the first error on failure. The plan is not
    /// verified (see [`compile_quietly`]): [`Source::compile_verified`] gives one to write or run.
    pub fn compile(&self, target: Target, extra: &[Override]) -> Result<Plan, SearchError> {
        self.compile_with(target, extra, compile_quietly)
    }

    /// [`Source::compile`], verified, for a plan that is written or run.
    pub fn compile_verified(&self, target: Target, extra: &[Override]) -> Result<Plan, SearchError> {
        self.compile_with(target, extra, compile)
    }

    fn compile_with(&self, target: Target, extra: &[Override], compiler: Compiler) -> Result<Plan, SearchError> {
        let mut overrides = self.overrides.to_vec();
        overrides.extend_from_slice(extra);
        let checked = check_source(self.text, &overrides);
        let first_error =
            |ds: &[Diagnostic]| SearchError::NotCompiled(ds.iter().find(|d| d.is_error()).cloned().map(Box::new));
        let model = match checked.model {
            Some(m) if !checked.diagnostics.iter().any(|d| d.is_error()) => m,
            _ => return Err(first_error(&checked.diagnostics)),
        };
        compiler(&model, self.name, self.text, target).map_err(|ds| first_error(&ds))
    }

    /// A config value of the model (after the user's overrides), if it is an integer.
    pub fn config_int(&self, name: &str) -> Option<u64> {
        let model = check_source(self.text, self.overrides).model?;
        match model.config_value(name)? {
            Scalar::Int(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }
}

/// Why a search point, or a planner candidate, has no plan.
#[derive(Clone, Debug, PartialEq)]
pub enum SearchError {
    /// The model does not compile for it: its first error, if the front end gave one.
    NotCompiled(Option<Box<Diagnostic>>),
    /// Optimus needs a square q x q mesh, and the device count is not a square.
    NotSquare { devices: u64 },
    /// Tesseract needs d q x q grids with d >= 2, and the device count is not such a product.
    NoDepth { devices: u64 },
    /// 3D needs a q x q x q cube, and the device count is not a cube.
    NotCube { devices: u64 },
    /// The plan of `batch` sequences needs `needs` bytes per device, more than there are.
    BatchTooLarge { batch: u64, needs: u64 },
    /// The plan needs `needs` bytes per device, more than `capacity`.
    TooLarge { needs: u64, capacity: u64 },
    /// A scaling sweep needs the model's `batch` as an integer config value.
    NoBatchToScale,
    /// The plan cannot be cut into the pipeline asked for: why.
    Pipeline(String),
}

impl std::fmt::Display for SearchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SearchError::NotCompiled(Some(first)) => f.write_str(&first.message),
            SearchError::NotCompiled(None) => f.write_str("the model has errors"),
            SearchError::NotSquare { devices } => write!(f, "{devices} devices are not a square q x q mesh"),
            SearchError::NotCube { devices } => write!(f, "{devices} devices are not a q x q x q cube"),
            SearchError::NoDepth { devices } => {
                write!(f, "{devices} devices are not two or more depth layers of a q x q grid (d x q x q)")
            }
            SearchError::BatchTooLarge { batch, needs } => write!(f, "batch {batch} needs {needs} bytes per device"),
            SearchError::TooLarge { needs, capacity } => {
                write!(f, "needs {needs} bytes per device, more than {capacity}")
            }
            SearchError::NoBatchToScale => f.write_str("the model has no integer `batch` config value to scale"),
            SearchError::Pipeline(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for SearchError {}

/// `batch=N` as an override.
pub fn batch_override(batch: u64) -> Override {
    Override { name: "batch".to_string(), value: batch.to_string() }
}

/// The result of a max-batch search.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MaxBatch {
    /// The largest batch that compiles and fits; 0 if none does.
    pub max_batch: u64,
    /// Batches tried are multiples of this.
    pub multiple: u64,
    pub compilations: u64,
    /// Why the smallest batch does not fit, when it does not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The largest batch (a multiple of the target's granularity) whose plan fits in `capacity` bytes
/// per device: doubling, then bisection.
pub fn max_batch(source: &Source, target: Target, capacity: u64) -> MaxBatch {
    let multiple = target.batch_multiple();
    let mut compilations = 0;
    let mut fits = |k: u64| -> Result<(), SearchError> {
        compilations += 1;
        let plan = source.compile(target, &[batch_override(k * multiple)])?;
        if plan.memory.peak_bytes <= capacity {
            Ok(())
        } else {
            Err(SearchError::BatchTooLarge { batch: k * multiple, needs: plan.memory.peak_bytes })
        }
    };
    if let Err(reason) = fits(1) {
        return MaxBatch { max_batch: 0, multiple, compilations: 1, reason: Some(reason.to_string()) };
    }
    let (mut lo, mut hi) = (1u64, 2u64);
    while hi * multiple <= BATCH_LIMIT && fits(hi).is_ok() {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if mid * multiple <= BATCH_LIMIT && fits(mid).is_ok() { lo = mid } else { hi = mid }
    }
    MaxBatch { max_batch: lo * multiple, multiple, compilations, reason: None }
}

/// The target of a strategy at a device count: q x q for optimus, 1 x p for megatron, and for
/// tesseract the largest q x q grid of which the devices make two or more depth layers; its products
/// laid out as `layouts` says.
pub fn target_for(
    strategy: Strategy,
    devices: u64,
    (mode, memory, layouts): (Mode, MemoryOptions, Layouts),
) -> Result<Target, SearchError> {
    let mesh = match strategy {
        Strategy::Optimus => {
            let q = integer_sqrt(devices).ok_or(SearchError::NotSquare { devices })?;
            Mesh::new(q, q)
        }
        Strategy::Tesseract => {
            let q = (1..=devices / 2)
                .take_while(|q| 2 * q * q <= devices)
                .filter(|q| devices.is_multiple_of(q * q))
                .last()
                .ok_or(SearchError::NoDepth { devices })?;
            Mesh::new(q, q).with_depth(devices / (q * q))
        }
        Strategy::ThreeD => {
            let q = integer_cbrt(devices).ok_or(SearchError::NotCube { devices })?;
            Mesh::new(q, q).with_depth(q)
        }
        Strategy::Megatron => Mesh::new(1, devices),
        Strategy::None => Mesh::new(1, 1),
    };
    Ok(Target { mesh, strategy, mode, memory, layouts })
}

/// q with q * q * q = n, if there is one.
pub fn integer_cbrt(n: u64) -> Option<u64> {
    let q = (n as f64).cbrt().round() as u64;
    (q * q * q == n).then_some(q)
}

/// q with q * q = n, if there is one.
pub fn integer_sqrt(n: u64) -> Option<u64> {
    let q = (n as f64).sqrt().round() as u64;
    (q * q == n).then_some(q)
}

/// Weak or strong scaling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scaling {
    /// The same batch at every device count.
    Strong,
    /// The batch grows with the device count (batch x devices / first devices).
    Weak,
}

/// One point of a sweep.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SweepPoint {
    pub scaling: Scaling,
    pub strategy: String,
    pub devices: u64,
    pub mesh: String,
    pub batch: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub simulation: Option<Simulation>,
    /// Parallel efficiency against the first feasible point of the same strategy and scaling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub efficiency: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub infeasible: Option<String>,
}

/// The device counts of a sweep.
pub const SWEEP_DEVICES: [u64; 4] = [4, 16, 64, 256];

/// Weak and strong scaling of optimus and megatron over [`SWEEP_DEVICES`].
pub fn sweep(
    source: &Source,
    (mode, memory, layouts): (Mode, MemoryOptions, Layouts),
    hw: &Hardware,
    options: &Options,
) -> Result<Vec<SweepPoint>, SearchError> {
    let base = source.config_int("batch").ok_or(SearchError::NoBatchToScale)?;
    let mut points = Vec::new();
    for scaling in [Scaling::Strong, Scaling::Weak] {
        for strategy in [Strategy::Optimus, Strategy::Megatron] {
            let mut first: Option<(u64, f64)> = None;
            for devices in SWEEP_DEVICES {
                let batch = if scaling == Scaling::Weak { base * devices / SWEEP_DEVICES[0] } else { base };
                let mut point = sweep_point(source, strategy, devices, batch, (mode, memory, layouts), hw, options);
                point.scaling = scaling;
                if let Some(sim) = &point.simulation {
                    let (d0, t0) = *first.get_or_insert((devices, sim.step_time_s));
                    point.efficiency = Some(efficiency(scaling, d0, t0, devices, sim.step_time_s));
                }
                points.push(point);
            }
        }
    }
    Ok(points)
}

/// Strong: t0 d0 / (t d); weak: t0 / t.
fn efficiency(scaling: Scaling, d0: u64, t0: f64, d: u64, t: f64) -> f64 {
    match scaling {
        Scaling::Strong => t0 * d0 as f64 / (t * d as f64),
        Scaling::Weak => t0 / t,
    }
}

fn sweep_point(
    source: &Source,
    strategy: Strategy,
    devices: u64,
    batch: u64,
    choices: (Mode, MemoryOptions, Layouts),
    hw: &Hardware,
    options: &Options,
) -> SweepPoint {
    let mut point = SweepPoint {
        scaling: Scaling::Strong,
        strategy: strategy.name().to_string(),
        devices,
        mesh: String::new(),
        batch,
        simulation: None,
        efficiency: None,
        infeasible: None,
    };
    let plan = target_for(strategy, devices, choices).and_then(|target| {
        point.mesh = target.mesh.to_string();
        source.compile(target, &[batch_override(batch)])
    });
    match plan {
        Ok(plan) => point.simulation = Some(simulate(&plan, hw, options)),
        Err(reason) => point.infeasible = Some(reason.to_string()),
    }
    point
}
