//! Measured costs of one machine's runtime, as `optimusc calibrate` writes them into a hardware
//! profile's `[measured]` section, and the predictions the simulator makes from them.
//!
//! A kernel of kind K costs `launch_us + bytes / gb_s + flops / gflop_s`, fitted by least squares over
//! every instruction of profiled one-device runs (kinds never seen use the `default` fit); a kind whose
//! small calls run markedly faster per byte (their blocks stay in cache) has its first `cached_bytes`
//! at `cached_gb_s`. A collective
//! costs `alpha_us + bytes * ns_per_byte`, fitted per kind, group size and devices running at once
//! (the whole mesh, as in a step). When the node's devices share one engine (threads of one process on
//! the same cores, or meshes sharing one GPU), their kernels queue one after another: a step's compute
//! is the sum over the devices sharing it, with a dispatch cost per instruction and device in place of
//! the launch cost, fitted by the number of devices sharing.

use optimus_plan::CollectiveKind;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The runtimes `optimusc calibrate` measures: CPU threads, MPI processes, CUDA devices.
pub const RUNTIMES: [&str; 3] = ["cpu", "mpi", "cuda"];

/// The `[measured]` section of a hardware profile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measured {
    /// The runtime measured: `cpu` (threads), `mpi` or `cuda` (see [`RUNTIMES`]).
    pub runtime: String,
    /// Kernel workers of the process that was measured.
    pub threads: u64,
    /// Whether the devices of a node share one compute engine, so that their kernels run one after
    /// another (CPU threads of one process; devices sharing a GPU).
    pub shared_engine: bool,
    /// Whether the runtime overlaps communication with compute (SUMMA double buffering, gradient sums
    /// beside the backward pass).
    pub overlap: bool,
    /// On a shared engine with several devices: the engine's cost of each instruction of each device
    /// beyond its kernel's work (handing it over, waking the device thread), in place of the
    /// one-device launch cost, by the number of devices sharing it. Fitted on runs of that many. In a
    /// profile with `rendezvous` fits, this is each kernel's cost, and collectives cost theirs.
    #[serde(default)]
    pub dispatch: Vec<DispatchFit>,
    /// On a shared engine with several devices: what each collective costs each device beyond moving
    /// its bytes (its members meet, so threads that wait sleep and wake while the others take the
    /// cores), by the number of devices sharing the engine. Fitted with `dispatch` on runs of that many
    /// devices in both modes. Absent in profiles measured before: collectives then cost `dispatch`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rendezvous: Vec<DispatchFit>,
    /// Per kernel kind (as `run --profile` names them), and `default` for the others.
    pub kernels: BTreeMap<String, KernelFit>,
    /// The same fits for a kernel run on one thread: how each device thread runs its own kernels when
    /// a mesh has at least `threads` devices. Empty in profiles measured before the runtime did so.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub single_thread_kernels: BTreeMap<String, KernelFit>,
    /// Per collective kind, group size and devices of the mesh.
    #[serde(default)]
    pub collectives: Vec<CollectiveFit>,
    /// The host copies of a run that accumulates micro-batches or runs as a pipeline, as one device
    /// thread makes them. Absent in profiles measured before `calibrate` timed them: such copies
    /// then cost nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_copies: Option<HostCopies>,
}

/// What the CPU runtime's host copies cost one device thread, as rates over the bytes copied: a
/// pipeline stage copies every activation a forward pass keeps out to the host and back in before its
/// backward pass, and every micro-batch's gradients out into the update's sums (as a run with
/// `--accum` does).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostCopies {
    /// A buffer copied out into a new host tensor, GB/s.
    pub copy_out_gb_s: f64,
    /// A host tensor copied back into its buffer, GB/s.
    pub copy_in_gb_s: f64,
    /// A host copy of a gradient added into its sum, GB/s of the copy.
    pub add_gb_s: f64,
}

impl HostCopies {
    /// Seconds to keep `bytes` of activations aside after a forward pass.
    pub fn stash_s(&self, bytes: u64) -> f64 {
        bytes as f64 / (self.copy_out_gb_s * 1e9)
    }

    /// Seconds to put `bytes` of kept activations (or of gradient means) back before they are read.
    pub fn restore_s(&self, bytes: u64) -> f64 {
        bytes as f64 / (self.copy_in_gb_s * 1e9)
    }

    /// Seconds to add `bytes` of one micro-batch's gradients into the update's sums.
    pub fn gradient_sum_s(&self, bytes: u64) -> f64 {
        bytes as f64 / (self.copy_out_gb_s * 1e9) + bytes as f64 / (self.add_gb_s * 1e9)
    }

    /// Seconds to keep one micro-batch's `bytes` of terms of the sums over data-parallel replicas
    /// aside (copied out, added to the host's sum, the sum's buffer zeroed), as a run with `--accum`
    /// does until the update's last micro-batch sums them over the replicas at once.
    pub fn deferred_sum_s(&self, bytes: u64) -> f64 {
        self.gradient_sum_s(bytes) + self.restore_s(bytes)
    }

    /// Seconds an update of `micro_batches` micro-batches spends on the host sums of `gradient_bytes`:
    /// each micro-batch's gradients added, and their means written back once (none with one).
    pub fn accumulation_s(&self, gradient_bytes: u64, micro_batches: u64) -> f64 {
        if micro_batches <= 1 {
            return 0.0;
        }
        micro_batches as f64 * self.gradient_sum_s(gradient_bytes) + self.restore_s(gradient_bytes)
    }
}

/// Seconds by the most specific of `fits` (see [`Measured::kernel_seconds`]).
fn fit_seconds(
    fits: &BTreeMap<String, KernelFit>,
    [flavor, kind]: [&str; 2],
    (bf16, infer): (bool, bool),
    (bytes, flops): (f64, f64),
) -> f64 {
    let names = [flavor, kind, DEFAULT_KERNEL];
    // Most specific first; a key is only built where its kind of fit is wanted.
    let keys =
        || names.iter().filter(move |_| bf16).map(|n| fit_key(n, true)).chain(names.iter().map(|n| n.to_string()));
    let inference = keys().filter(|_| infer).map(|k| inference_key(&k));
    inference.chain(keys()).find_map(|k| fits.get(&k)).map_or(0.0, |f| f.seconds(bytes, flops))
}

/// The name of a fit measured in inference plans: `Kind@infer`, `Kind@bf16@infer`. An inference
/// plan frees its activations as it goes, so its kernels reuse memory that is still in cache, where a
/// training plan's write fresh memory: on a CPU the same kernel runs up to twice as fast.
pub fn inference_key(key: &str) -> String {
    format!("{key}@infer")
}

/// The cost of one kernel call: a fixed part plus its bytes and FLOPs at the fitted rates.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelFit {
    pub launch_us: f64,
    /// Bytes read and written per second (1e9); absent: bytes cost nothing beyond the FLOPs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gb_s: Option<f64>,
    /// FLOPs per second (1e9); absent: FLOPs cost nothing beyond the bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gflop_s: Option<f64>,
    /// Calls the fit was made from.
    #[serde(default)]
    pub samples: u64,
    /// Bytes a call moves at `cached_gb_s` before the rest move at `gb_s`: a kernel whose blocks stay
    /// in a core's cache runs at the cache's rate (absent: every byte at `gb_s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_bytes: Option<f64>,
    /// The rate of a call's first `cached_bytes` bytes (1e9 bytes a second).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_gb_s: Option<f64>,
}

/// The seconds of the fit in `fits` measured with the number of devices nearest `devices` (on a log
/// scale), if any.
fn nearest_fit(fits: &[DispatchFit], devices: u64) -> Option<f64> {
    let log = |x: u64| (x.max(1) as f64).log2();
    let distance = |f: &&DispatchFit| (log(f.devices) - log(devices)).abs();
    fits.iter().min_by(|a, b| distance(a).total_cmp(&distance(b))).map(|f| f.us * 1e-6)
}

/// The shared engine's cost per instruction (or per kernel, or per collective) of each device when
/// `devices` share it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DispatchFit {
    pub devices: u64,
    pub us: f64,
}

/// The cost of one collective: alpha + payload * beta, for a group of `members` while `devices`
/// devices run the same collective in their own groups.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectiveFit {
    /// all_reduce, all_gather, reduce_scatter, broadcast or reduce.
    pub kind: CollectiveKindName,
    pub members: u64,
    pub devices: u64,
    pub alpha_us: f64,
    pub ns_per_byte: f64,
}

/// A collective kind as profiles spell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKindName {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
}

impl From<CollectiveKind> for CollectiveKindName {
    fn from(kind: CollectiveKind) -> CollectiveKindName {
        match kind {
            CollectiveKind::AllReduce => CollectiveKindName::AllReduce,
            CollectiveKind::AllGather => CollectiveKindName::AllGather,
            CollectiveKind::ReduceScatter => CollectiveKindName::ReduceScatter,
            CollectiveKind::Broadcast => CollectiveKindName::Broadcast,
            CollectiveKind::Reduce => CollectiveKindName::Reduce,
            // A transpose moves one block between two devices, as a two-member broadcast does (each
            // way at once): calibrate times broadcasts, and a transpose is costed as one.
            CollectiveKind::Transpose => CollectiveKindName::Broadcast,
        }
    }
}

/// What is wrong with one kernel fit's numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelFitProblem {
    /// A rate or size (`gb_s`, `gflop_s`, `cached_gb_s`, `cached_bytes`) is not a positive number.
    Rate(&'static str),
    /// The launch time is negative or not a number.
    Launch,
    /// `cached_bytes` without `cached_gb_s`, or the other way round.
    CachedPair,
}

impl KernelFit {
    /// Checks the numbers: rates positive, the launch cost zero or more, a cached rate and its bytes
    /// both given or neither.
    pub fn validate(&self) -> Result<(), KernelFitProblem> {
        let rates = [
            ("gb_s", self.gb_s),
            ("gflop_s", self.gflop_s),
            ("cached_gb_s", self.cached_gb_s),
            ("cached_bytes", self.cached_bytes),
        ];
        let invalid = |field: &str, value: Option<f64>| match field {
            "cached_bytes" => value.is_some_and(|v| !(v.is_finite() && v > 0.0)),
            _ => value.is_some_and(|v| !super::hardware::is_rate(v)),
        };
        if let Some((field, _)) = rates.iter().find(|(field, value)| invalid(field, *value)) {
            return Err(KernelFitProblem::Rate(field));
        }
        if self.cached_bytes.is_some() != self.cached_gb_s.is_some() {
            return Err(KernelFitProblem::CachedPair);
        }
        if !super::hardware::is_fixed_cost(self.launch_us) {
            return Err(KernelFitProblem::Launch);
        }
        Ok(())
    }

    /// Seconds for one call.
    pub fn seconds(&self, bytes: f64, flops: f64) -> f64 {
        let (cached, rest) = match (self.cached_bytes, self.cached_gb_s) {
            (Some(limit), Some(rate)) => (bytes.min(limit) / (rate * 1e9), (bytes - limit).max(0.0)),
            _ => (0.0, bytes),
        };
        let by_bytes = cached + self.gb_s.map_or(0.0, |rate| rest / (rate * 1e9));
        let by_flops = self.gflop_s.map_or(0.0, |rate| flops / (rate * 1e9));
        self.launch_us * 1e-6 + by_bytes + by_flops
    }
}

impl Measured {
    /// Seconds for one kernel of kind `kind` (its profile name) moving `bytes` and doing `flops`.
    /// The fit used is the most specific there is: its flavor (`Gelu(approximate=false)`), then its
    /// kind (`Gelu`), then `default`; a kernel that reads or writes bf16 tries the `@bf16` fits of
    /// each first, where the calibration ran bf16 plans.
    /// `infer`: the kernel is an inference plan's, and the `@infer` fits come first where there are.
    pub fn kernel_seconds(&self, flavor: &str, kind: &str, (bf16, infer): (bool, bool), bytes: f64, flops: f64) -> f64 {
        fit_seconds(&self.kernels, [flavor, kind], (bf16, infer), (bytes, flops))
    }

    /// [`Measured::kernel_seconds`] on one thread, from [`Measured::single_thread_kernels`] (the pool's
    /// fits when there are none).
    pub fn single_thread_kernel_seconds(
        &self,
        flavor: &str,
        kind: &str,
        (bf16, infer): (bool, bool),
        bytes: f64,
        flops: f64,
    ) -> f64 {
        if self.single_thread_kernels.is_empty() {
            return self.kernel_seconds(flavor, kind, (bf16, infer), bytes, flops);
        }
        fit_seconds(&self.single_thread_kernels, [flavor, kind], (bf16, infer), (bytes, flops))
    }

    /// Seconds for one collective of `members` with `bytes` of payload per member on a mesh of
    /// `devices`: the fit of that kind and group size measured with the nearest number of devices (on
    /// a log scale), else of the nearest group size. On a `shared` engine the latency (threads waiting
    /// for each other) overlaps the other devices' kernels, so only the copying counts. `None` when no
    /// collective of that kind was measured.
    pub fn collective_seconds(
        &self,
        kind: CollectiveKind,
        members: u64,
        devices: u64,
        bytes: f64,
        shared: bool,
    ) -> Option<f64> {
        if members <= 1 {
            return Some(0.0);
        }
        let name = CollectiveKindName::from(kind);
        let distance = |fit: &CollectiveFit| {
            let log = |x: u64| (x.max(1) as f64).log2();
            ((log(fit.members) - log(members)).abs() * 4.0 + (log(fit.devices) - log(devices)).abs(), fit.members)
        };
        let best = self
            .collectives
            .iter()
            .filter(|f| f.kind == name)
            .min_by(|a, b| distance(a).partial_cmp(&distance(b)).unwrap_or(std::cmp::Ordering::Equal));
        best.map(|f| if shared { 0.0 } else { f.alpha_us * 1e-6 } + bytes * f.ns_per_byte * 1e-9)
    }

    /// Seconds the shared engine spends on each instruction of each of `devices` devices (on each
    /// kernel, where the profile has rendezvous fits): the fit measured with the nearest number of
    /// devices (on a log scale; 0 when none was measured).
    pub fn dispatch_seconds(&self, devices: u64) -> f64 {
        nearest_fit(&self.dispatch, devices).unwrap_or(0.0)
    }

    /// Seconds each collective of each of `devices` devices costs the shared engine beyond its bytes:
    /// the rendezvous fit of the nearest number of devices, or the dispatch cost in a profile without
    /// rendezvous fits.
    pub fn rendezvous_seconds(&self, devices: u64) -> f64 {
        nearest_fit(&self.rendezvous, devices).unwrap_or_else(|| self.dispatch_seconds(devices))
    }

    /// Checks the numbers: rates positive, fixed costs zero or more, a `default` kernel fit present.
    pub fn validate(&self) -> Result<(), MeasuredProblem> {
        if !RUNTIMES.contains(&self.runtime.as_str()) {
            return Err(MeasuredProblem::Runtime { runtime: self.runtime.clone() });
        }
        if !self.kernels.contains_key(DEFAULT_KERNEL) {
            return Err(MeasuredProblem::NoDefaultKernel);
        }
        let sections = [("kernels", &self.kernels), ("single_thread_kernels", &self.single_thread_kernels)];
        for (section, fits) in sections {
            for (kind, fit) in fits {
                fit.validate().map_err(|problem| MeasuredProblem::Kernel { section, kind: kind.clone(), problem })?;
            }
        }
        if let Some(h) = &self.host_copies {
            let rates =
                [("copy_out_gb_s", h.copy_out_gb_s), ("copy_in_gb_s", h.copy_in_gb_s), ("add_gb_s", h.add_gb_s)];
            if let Some((field, _)) = rates.iter().find(|(_, v)| !super::hardware::is_rate(*v)) {
                return Err(MeasuredProblem::HostCopyRate { field });
            }
        }
        if self.threads == 0 {
            return Err(MeasuredProblem::NoThreads);
        }
        for (field, fits) in [("dispatch", &self.dispatch), ("rendezvous", &self.rendezvous)] {
            if let Some(f) = fits.iter().find(|f| f.devices < 2) {
                return Err(MeasuredProblem::Dispatch { field, devices: f.devices, us: None });
            }
            if let Some(f) = fits.iter().find(|f| !super::hardware::is_fixed_cost(f.us)) {
                return Err(MeasuredProblem::Dispatch { field, devices: f.devices, us: Some(f.us) });
            }
        }
        for fit in &self.collectives {
            let ok = super::hardware::is_fixed_cost(fit.alpha_us) && super::hardware::is_fixed_cost(fit.ns_per_byte);
            if !ok || fit.members < 2 || fit.devices < fit.members {
                let what = format!("{:?}", fit.kind);
                return Err(MeasuredProblem::Collective { kind: what, members: fit.members, devices: fit.devices });
            }
        }
        Ok(())
    }
}

/// What is wrong with a profile's `[measured]` numbers.
#[derive(Clone, Debug, PartialEq)]
pub enum MeasuredProblem {
    /// `measured.runtime` is none of [`RUNTIMES`].
    Runtime {
        runtime: String,
    },
    NoDefaultKernel,
    /// A kernel fit of `measured.{section}` has invalid numbers.
    Kernel {
        section: &'static str,
        kind: String,
        problem: KernelFitProblem,
    },
    /// A host copy rate is not a positive number.
    HostCopyRate {
        field: &'static str,
    },
    /// A dispatch or rendezvous entry (`field`) has fewer than 2 devices (`us`: `None`), or a time
    /// that is not a fixed cost (`us`: that time).
    Dispatch {
        field: &'static str,
        devices: u64,
        us: Option<f64>,
    },
    /// `measured.threads` is 0.
    NoThreads,
    /// A collective fit has invalid numbers.
    Collective {
        kind: String,
        members: u64,
        devices: u64,
    },
}

impl std::fmt::Display for MeasuredProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MeasuredProblem::Runtime { runtime } => {
                write!(f, "`measured.runtime` is `{runtime}`: calibrate measures one of {}", RUNTIMES.join(", "))
            }
            MeasuredProblem::NoDefaultKernel => {
                write!(f, "`measured.kernels` needs a `{DEFAULT_KERNEL}` entry for kernels not measured")
            }
            MeasuredProblem::Kernel { section, kind, problem } => match problem {
                KernelFitProblem::Rate(field) => {
                    write!(f, "`measured.{section}.{kind}.{field}` must be a positive number (rates at most 1e9)")
                }
                KernelFitProblem::Launch => write!(
                    f,
                    "`measured.{section}.{kind}.launch_us` must be from 0 to {:e} microseconds",
                    super::hardware::MAX_FIXED_COST_US
                ),
                KernelFitProblem::CachedPair => write!(
                    f,
                    "`measured.{section}.{kind}`: `cached_bytes` and `cached_gb_s` go together (give both or neither)"
                ),
            },
            MeasuredProblem::HostCopyRate { field } => {
                write!(
                    f,
                    "`measured.host_copies.{field}` must be a positive number from {:e} to {:e} GB/s",
                    super::hardware::RATE_RANGE.0,
                    super::hardware::RATE_RANGE.1
                )
            }
            MeasuredProblem::Dispatch { field, devices, us: None } => write!(
                f,
                "`measured.{field}`: an entry is for {devices} device(s); a cost of sharing the engine needs at least 2"
            ),
            MeasuredProblem::Dispatch { field, devices, us: Some(us) } => write!(
                f,
                "`measured.{field}`: the entry for {devices} devices has `us` = {}; give 0 to {:e} microseconds",
                super::hardware::shown(*us),
                super::hardware::MAX_FIXED_COST_US
            ),
            MeasuredProblem::NoThreads => f.write_str("`measured.threads` must be at least 1"),
            MeasuredProblem::Collective { kind, members, devices } => write!(
                f,
                "`measured.collectives`: an entry for {kind} of {members} members on {devices} devices has invalid numbers"
            ),
        }
    }
}

/// The kernel fit used for kinds the calibration never ran.
pub const DEFAULT_KERNEL: &str = "default";

/// The name a kernel kind's fit is kept under: `Kind`, or `Kind@bf16` for calls that read or write
/// bf16 (on the CPU these widen to float32 and back, so they cost more, not less, than float32).
pub fn fit_key(kind: &str, bf16: bool) -> String {
    if bf16 { format!("{kind}@bf16") } else { kind.to_string() }
}

/// One observation for a fit: features (each multiplies a coefficient) and the measured seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub features: Vec<f64>,
    pub seconds: f64,
}

/// Non-negative least squares over few features, weighted by 1 / seconds (so that small kernels,
/// which are many, count as well as large ones): every subset of features is solved by its normal
/// equations and the best fit with no negative coefficient wins. Returns one coefficient per feature.
pub fn fit_non_negative(samples: &[Sample]) -> Vec<f64> {
    let width = samples.first().map_or(0, |s| s.features.len());
    let mut best: (f64, Vec<f64>) = (f64::INFINITY, vec![0.0; width]);
    for mask in 1u32..(1 << width) {
        let used: Vec<usize> = (0..width).filter(|&k| mask & (1 << k) != 0).collect();
        let Some(solution) = solve_subset(samples, &used) else { continue };
        if solution.iter().any(|&c| c < 0.0 || !c.is_finite()) {
            continue;
        }
        let mut coefficients = vec![0.0; width];
        for (&k, &c) in used.iter().zip(&solution) {
            coefficients[k] = c;
        }
        let error = weighted_error(samples, &coefficients);
        if error < best.0 {
            best = (error, coefficients);
        }
    }
    best.1
}

fn weight(sample: &Sample) -> f64 {
    1.0 / sample.seconds.max(1e-7)
}

/// The weighted squared error of `coefficients` over `samples`, as [`fit_non_negative`] weighs it.
pub fn weighted_error(samples: &[Sample], coefficients: &[f64]) -> f64 {
    samples
        .iter()
        .map(|s| {
            let predicted: f64 = s.features.iter().zip(coefficients).map(|(x, c)| x * c).sum();
            weight(s) * (predicted - s.seconds).powi(2)
        })
        .sum()
}

/// The weighted least-squares coefficients of the features `used`, by Gaussian elimination on the
/// normal equations; `None` when they are singular.
fn solve_subset(samples: &[Sample], used: &[usize]) -> Option<Vec<f64>> {
    let n = used.len();
    // Scale each feature to unit size so the normal equations are well conditioned.
    let scale: Vec<f64> =
        used.iter().map(|&k| samples.iter().map(|s| s.features[k].abs()).fold(0.0, f64::max).max(1e-30)).collect();
    let mut a = vec![vec![0.0; n + 1]; n];
    for s in samples {
        let w = weight(s);
        let x: Vec<f64> = used.iter().zip(&scale).map(|(&k, sc)| s.features[k] / sc).collect();
        for r in 0..n {
            for c in 0..n {
                a[r][c] += w * x[r] * x[c];
            }
            a[r][n] += w * x[r] * s.seconds;
        }
    }
    for col in 0..n {
        let pivot = (col..n).max_by(|&p, &q| a[p][col].abs().total_cmp(&a[q][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        let pivot_row = a[col].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != col {
                let factor = row[col] / pivot_row[col];
                for (x, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *x -= factor * p;
                }
            }
        }
    }
    Some((0..n).map(|r| a[r][n] / a[r][r] / scale[r]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_a_launch_cost_and_a_rate() {
        // seconds = 5 µs + bytes / 10 GB/s, exactly.
        let samples: Vec<Sample> = [1e3, 1e4, 1e5, 1e6, 1e7]
            .iter()
            .map(|&bytes| Sample { features: vec![1.0, bytes], seconds: 5e-6 + bytes / 1e10 })
            .collect();
        let c = fit_non_negative(&samples);
        assert!((c[0] - 5e-6).abs() < 1e-9, "launch {}", c[0]);
        assert!((c[1] - 1e-10).abs() < 1e-14, "seconds per byte {}", c[1]);
    }

    #[test]
    fn the_fit_never_gives_a_negative_coefficient() {
        // Time falls with the second feature: its best unconstrained coefficient is negative.
        let samples: Vec<Sample> =
            (1..6).map(|k| Sample { features: vec![1.0, k as f64], seconds: 1.0 / k as f64 }).collect();
        let c = fit_non_negative(&samples);
        assert!(c.iter().all(|&x| x >= 0.0), "{c:?}");
    }

    /// A CPU's measurements with these kernel fits and nothing else.
    fn cpu_measured(kernels: BTreeMap<String, KernelFit>) -> Measured {
        Measured {
            runtime: "cpu".into(),
            threads: 2,
            shared_engine: false,
            overlap: false,
            dispatch: Vec::new(),
            rendezvous: Vec::new(),
            kernels,
            single_thread_kernels: BTreeMap::new(),
            collectives: Vec::new(),
            host_copies: None,
        }
    }

    #[test]
    fn a_cached_rate_prices_a_calls_first_bytes_and_every_fit_is_checked() {
        let fit = KernelFit {
            launch_us: 1.0,
            gb_s: Some(10.0),
            gflop_s: None,
            samples: 9,
            cached_bytes: Some(1e6),
            cached_gb_s: Some(40.0),
        };
        let near = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(near(fit.seconds(5e5, 0.0), 1e-6 + 5e5 / 40e9));
        assert!(near(fit.seconds(3e6, 0.0), 1e-6 + 1e6 / 40e9 + 2e6 / 10e9));
        let plain = KernelFit { cached_bytes: None, cached_gb_s: None, ..fit };
        assert!(near(plain.seconds(3e6, 0.0), 1e-6 + 3e6 / 10e9));
        let mut m = cpu_measured(BTreeMap::from([(DEFAULT_KERNEL.to_string(), fit)]));
        assert!(m.validate().is_ok());
        m.kernels.insert("Add".into(), KernelFit { cached_gb_s: Some(-1.0), ..fit });
        let problem = m.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(problem, "`measured.kernels.Add.cached_gb_s` must be a positive number (rates at most 1e9)");
        m.kernels.insert("Add".into(), KernelFit { cached_gb_s: None, ..fit });
        let problem = m.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(problem.contains("`measured.kernels.Add`: `cached_bytes` and `cached_gb_s` go together"), "{problem}");
        // The one-thread fits are checked as the pool's are.
        m.kernels.remove("Add");
        m.single_thread_kernels.insert("Gelu".into(), KernelFit { launch_us: -1.0, ..fit });
        let problem = m.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(problem, "`measured.single_thread_kernels.Gelu.launch_us` must be from 0 to 1e9 microseconds");
        m.single_thread_kernels.clear();
        // A rate past any machine, no threads, and each way a dispatch entry can be wrong, named apart.
        m.kernels.insert("Add".into(), KernelFit { gflop_s: Some(1e300), ..fit });
        let problem = m.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(problem, "`measured.kernels.Add.gflop_s` must be a positive number (rates at most 1e9)");
        m.kernels.remove("Add");
        assert_eq!(Measured { threads: 0, ..m.clone() }.validate(), Err(MeasuredProblem::NoThreads));
        m.rendezvous = vec![DispatchFit { devices: 4, us: -6.7 }];
        let problem = m.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(
            problem,
            "`measured.rendezvous`: the entry for 4 devices has `us` = -6.7; give 0 to 1e9 microseconds"
        );
        m.rendezvous = vec![DispatchFit { devices: 1, us: 6.7 }];
        let problem = m.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            problem.contains("an entry is for 1 device(s); a cost of sharing the engine needs at least 2"),
            "{problem}"
        );
    }

    #[test]
    fn collectives_use_the_nearest_measured_configuration() {
        let fit = |members, devices, alpha_us| CollectiveFit {
            kind: CollectiveKindName::Broadcast,
            members,
            devices,
            alpha_us,
            ns_per_byte: 0.0,
        };
        let m = Measured {
            runtime: "cpu".into(),
            threads: 2,
            shared_engine: true,
            overlap: false,
            dispatch: Vec::new(),
            rendezvous: Vec::new(),
            kernels: BTreeMap::from([(
                DEFAULT_KERNEL.to_string(),
                KernelFit {
                    launch_us: 1.0,
                    gb_s: None,
                    gflop_s: None,
                    samples: 0,
                    cached_bytes: None,
                    cached_gb_s: None,
                },
            )]),
            single_thread_kernels: BTreeMap::new(),
            collectives: vec![fit(2, 2, 10.0), fit(2, 4, 20.0), fit(4, 16, 40.0)],
            host_copies: None,
        };
        let t = |members, devices| {
            m.collective_seconds(CollectiveKind::Broadcast, members, devices, 0.0, false).map_or(f64::NAN, |s| s * 1e6)
        };
        assert!((t(2, 4) - 20.0).abs() < 1e-9);
        assert!((t(2, 8) - 20.0).abs() < 1e-9, "2 members on 8 devices: nearest is 4 devices");
        assert!((t(4, 16) - 40.0).abs() < 1e-9);
        assert_eq!(t(1, 16), 0.0, "a group of one communicates nothing");
        assert_eq!(m.collective_seconds(CollectiveKind::AllReduce, 2, 2, 1e6, false), None, "no fit of that kind");
        // A transpose's pair is costed as the two-member broadcast measured nearest.
        let transpose = m.collective_seconds(CollectiveKind::Transpose, 2, 4, 0.0, false);
        assert!(transpose.is_some_and(|s| (s * 1e6 - 20.0).abs() < 1e-9), "{transpose:?}");
    }

    #[test]
    fn bf16_calls_use_bf16_fits_where_there_are_some() {
        let fit = |launch_us| KernelFit {
            launch_us,
            gb_s: None,
            gflop_s: None,
            samples: 1,
            cached_bytes: None,
            cached_gb_s: None,
        };
        let mut m =
            cpu_measured(BTreeMap::from([(DEFAULT_KERNEL.to_string(), fit(1.0)), ("Add".to_string(), fit(2.0))]));
        let us = |m: &Measured, kind, bf16| m.kernel_seconds(kind, kind, (bf16, false), 0.0, 0.0) * 1e6;
        assert!((us(&m, "Add", true) - 2.0).abs() < 1e-9, "no bf16 fits: the float32 one");
        m.kernels.insert(fit_key(DEFAULT_KERNEL, true), fit(3.0));
        assert!((us(&m, "Add", true) - 3.0).abs() < 1e-9, "bf16 default before the float32 kind");
        m.kernels.insert(fit_key("Add", true), fit(4.0));
        assert!((us(&m, "Add", true) - 4.0).abs() < 1e-9);
        assert!((us(&m, "Add", false) - 2.0).abs() < 1e-9, "float32 calls keep float32 fits");
        assert!((us(&m, "Gelu", false) - 1.0).abs() < 1e-9);
        m.kernels.insert("Add(x=y)".to_string(), fit(6.0));
        let flavored = |m: &Measured, flavor| m.kernel_seconds(flavor, "Add", (false, false), 0.0, 0.0) * 1e6;
        assert!((flavored(&m, "Add(x=y)") - 6.0).abs() < 1e-9, "the flavor's own fit");
        assert!((flavored(&m, "Add(x=z)") - 2.0).abs() < 1e-9, "an unseen flavor: its kind's fit");
        // Inference plans take the `@infer` fits first, any of them before a training fit.
        let infer = |m: &Measured, kind, bf16| m.kernel_seconds(kind, kind, (bf16, true), 0.0, 0.0) * 1e6;
        assert!((infer(&m, "Add", false) - 2.0).abs() < 1e-9, "no inference fits: the training one");
        m.kernels.insert(inference_key(DEFAULT_KERNEL), fit(7.0));
        assert!((infer(&m, "Add", false) - 7.0).abs() < 1e-9, "the inference default before a training kind");
        m.kernels.insert(inference_key("Add"), fit(8.0));
        assert!((infer(&m, "Add", false) - 8.0).abs() < 1e-9);
        assert!((infer(&m, "Add", true) - 8.0).abs() < 1e-9, "no bf16 inference fit: the float32 one");
        m.kernels.insert(inference_key(&fit_key("Add", true)), fit(9.0));
        assert!((infer(&m, "Add", true) - 9.0).abs() < 1e-9);
        assert!((us(&m, "Add", false) - 2.0).abs() < 1e-9, "training calls keep training fits");
    }
}
