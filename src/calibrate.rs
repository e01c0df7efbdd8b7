//! What `optimusc calibrate` measures: kernel costs from profiled one-device training runs of built-in
//! models at several sizes, and the collectives of the thread communicator on meshes of threads, each
//! fitted into the profile's `[measured]` section (see [`crate::cost::calibration`]).

use crate::cost::calibration::{
    CollectiveFit, DEFAULT_KERNEL, KernelFit, Sample, fit_key, fit_non_negative, inference_key, weighted_error,
};
use crate::cost::hardware::is_rate;
use crate::io::sources::{Objective, Sources};
use crate::plan::layout::Placement;
use crate::plan::report::kernel_flops;
use crate::plan::{Buffer, CollectiveKind, Group, Instr, Kernel, Mesh, Plan, ReduceOp};
use crate::runtime::backend::BackendKind;
use crate::runtime::comm::{CollectiveSpec, Communicator};
use crate::runtime::cpu::threads::{Fabric, ThreadComm};
use crate::runtime::exec::{RunConfig, RunOutput};
use crate::runtime::settings::{OptimizerKind, OptimizerSettings};
use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// One kernel instruction of a profiled run: its kind, what it moves and computes, and its time (the
/// median of its steps).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct KernelSample {
    /// The fits it belongs to: its flavor's and (when that differs) its kind's, `@bf16` for bf16 calls.
    pub fits: Vec<String>,
    /// The `default` fit of its precision.
    pub default: String,
    pub bytes: f64,
    pub flops: f64,
    pub seconds: f64,
}

/// Kinds whose cost is mostly FLOPs: fitted on FLOPs as well as bytes.
fn is_product(kernel: &Kernel) -> bool {
    matches!(
        kernel,
        Kernel::MatMul { .. } | Kernel::BatchedMatMul | Kernel::Attention { .. } | Kernel::AttentionGrad { .. }
    )
}

/// The fits a call of `kernel` is a sample of.
fn fits_of(kernel: &Kernel, bf16: bool) -> Vec<String> {
    let (flavor, kind) = (kernel.flavor(), kernel.name().to_string());
    let mut fits = vec![fit_key(&flavor, bf16)];
    if flavor != kind {
        fits.push(fit_key(&kind, bf16));
    }
    fits
}

/// Runs a one-device plan (training, or inference whose samples go to the `@infer` fits) for `steps`
/// steps (the first is left out as warm-up) on `backend` with every instruction timed (on the CPU,
/// its kernels split over the pool or, with `single_thread`, run on the device's own thread; on a GPU,
/// each timed alone on the GPU); returns a sample per kernel instruction, and whether it is a product.
pub fn profile_kernels(
    plan: &Plan,
    (steps, seed): (u64, u64),
    backend: BackendKind,
    single_thread: bool,
) -> Result<Vec<(KernelSample, bool)>, String> {
    if plan.mesh.devices() != 1 {
        return Err("kernel calibration runs one-device plans".into());
    }
    let output = run_profiled(plan, (steps.max(2), seed), backend, single_thread)?;
    let infer = plan.mode == crate::plan::Mode::Infer;
    let key = |k: String| if infer { inference_key(&k) } else { k };
    let profile = output.profiles.first().ok_or("the calibration run returned no profile")?;
    let mut samples = Vec::new();
    let mut positions = Vec::new();
    for (index, instr) in plan.program.iter().enumerate() {
        let Instr::Kernel { kernel, inputs, output, .. } = instr else { continue };
        let Some(typical) = profile.median(index) else { continue };
        positions.push(index);
        let ins: Vec<&Buffer> = inputs.iter().map(|&b| plan.buffer(b)).collect();
        let out = plan.buffer(*output);
        let bf16 = crate::cost::step::touches_bf16(&ins, out);
        let sample = KernelSample {
            fits: fits_of(kernel, bf16).into_iter().map(key).collect(),
            default: key(fit_key(DEFAULT_KERNEL, bf16)),
            bytes: crate::cost::step::kernel_bytes(&ins, out) as f64,
            flops: kernel_flops(kernel, &ins, out) as f64,
            seconds: typical.as_secs_f64(),
        };
        samples.push((sample, is_product(kernel)));
    }
    share_gradient_groups(plan, &positions, &mut samples);
    Ok(samples)
}

/// Gives each attention gradient of a group its share of the group's time. The gradients of one
/// attention with respect to q, k and v are separate instructions with the same operands; where they
/// follow one another (nothing but frees between), a backend may compute all three at the first and
/// serve the others from what it kept (the CUDA backend does), so one instruction's time says nothing
/// of its own cost, while the group's total is what a step pays. `positions[i]` is the program position
/// of `samples[i]`.
fn share_gradient_groups(plan: &Plan, positions: &[usize], samples: &mut [(KernelSample, bool)]) {
    let operands = |index: usize| match &plan.program[index] {
        Instr::Kernel { kernel: Kernel::AttentionGrad { .. }, inputs, .. } => Some(inputs),
        _ => None,
    };
    let mut start = 0;
    while start < positions.len() {
        let mut end = start + 1;
        if let Some(first) = operands(positions[start]) {
            while end < positions.len()
                && operands(positions[end]) == Some(first)
                && plan.program[positions[end - 1] + 1..positions[end]].iter().all(|i| matches!(i, Instr::Free { .. }))
            {
                end += 1;
            }
        }
        let group = &mut samples[start..end];
        let mean = group.iter().map(|(s, _)| s.seconds).sum::<f64>() / group.len() as f64;
        group.iter_mut().for_each(|(s, _)| s.seconds = mean);
        start = end;
    }
}

/// Seconds of steps a CPU calibration run leaves out before it measures. A run's first steps are slower
/// than the rest: on the 2-core development VM, a small GPT-2 on 2x2 ran 11.5 ms steps for its first
/// 150 ms and 9.5 ms after (inference: 4.3 ms for 70 ms, then 2.8 ms), while a user's run repeats its
/// step for minutes, and `simulate` predicts that steady step.
const WARM_UP_S: f64 = 0.3;

/// Seconds of steps [`median_step`] measures at least (more than `steps` where steps are small), so
/// that a brief slow spell does not set the median.
const MEASURED_S: f64 = 0.2;

/// At most this many warm-up or measured steps.
const MAX_TIMED_STEPS: u64 = 100;

/// Runs `plan` under `config` on random tokens drawn from its seed, calling `on_step` after each step.
fn run_plan(
    plan: &Plan,
    config: &RunConfig,
    on_step: &(dyn Fn(&crate::runtime::exec::StepRecord) + Sync),
) -> Result<RunOutput, String> {
    let sources = Sources::new(None, None, None, Objective::Causal, config.seed, "").map_err(|e| e.to_string())?;
    let batches = |step| sources.batch(plan, step).map_err(|e| e.to_string());
    crate::runtime::local::run(plan, config, &batches, &BTreeMap::new(), on_step)
}

/// The wall time of each step of an unprofiled run of `plan` under `config`.
fn step_times(plan: &Plan, config: &RunConfig) -> Result<Vec<f64>, String> {
    let times = std::sync::Mutex::new(Vec::new());
    let record = |r: &crate::runtime::exec::StepRecord| {
        if let Ok(mut t) = times.lock() {
            t.push(r.elapsed.as_secs_f64());
        }
    };
    run_plan(plan, &RunConfig { profile: false, ..config.clone() }, &record)?;
    // One record per step (every device reports the same step once).
    times.into_inner().map_err(|_| "a step record was lost".to_string())
}

/// Steps that take about `seconds` at `step` seconds a step, at least `least`, at most
/// [`MAX_TIMED_STEPS`].
fn steps_for(seconds: f64, step: f64, least: u64) -> u64 {
    let wanted = if step > 0.0 { (seconds / step).ceil() as u64 } else { 0 };
    wanted.clamp(least, MAX_TIMED_STEPS.max(least))
}

/// The warm-up steps and the timed steps (at least `least`, and about `timed_s` of them) of a
/// calibration run like `config`'s. On the CPU they follow the time of a one-step run's step (a first
/// step, the slowest, so if anything fewer than asked): about [`WARM_UP_S`] of warm-up. On a GPU one
/// warm-up step and `least`, as its calibration was measured and checked with.
fn timed_steps(plan: &Plan, config: &RunConfig, least: u64, timed_s: f64) -> Result<(u64, u64), String> {
    if config.backend != BackendKind::Cpu {
        return Ok((1, least));
    }
    let first = step_times(plan, &RunConfig { steps: 1, ..config.clone() })?.first().copied().unwrap_or(0.0);
    Ok((steps_for(WARM_UP_S, first, 1), steps_for(timed_s, first, least)))
}

/// The median wall time of a plan's steps (unprofiled), a thread per device on `backend`: at least
/// `steps` - 1 of them (and on the CPU about [`MEASURED_S`]) after the warm-up of [`timed_steps`].
pub fn median_step(plan: &Plan, (steps, seed): (u64, u64), backend: BackendKind) -> Result<f64, String> {
    let config = RunConfig { backend, ..RunConfig::new(seed, 1, optimizer()) };
    let (warm_up, measured) = timed_steps(plan, &config, steps.max(2) - 1, MEASURED_S)?;
    let config = RunConfig { steps: warm_up + measured, ..config };
    let mut steady: Vec<f64> = step_times(plan, &config)?.into_iter().skip(warm_up as usize).collect();
    steady.sort_by(f64::total_cmp);
    steady.get(steady.len() / 2).copied().ok_or_else(|| "no step was timed".to_string())
}

fn optimizer() -> OptimizerSettings {
    OptimizerSettings {
        kind: OptimizerKind::AdamW,
        lr: 1e-3,
        weight_decay: 0.01,
        momentum: 0.0,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    }
}

/// Passes over the same plans merged: each instruction (same position in every pass) keeps the
/// median of its times, which one slow pass does not move.
pub fn median_of(passes: Vec<Vec<(KernelSample, bool)>>) -> Vec<(KernelSample, bool)> {
    let mut passes = passes.into_iter();
    let Some(mut merged) = passes.next() else { return Vec::new() };
    let mut times: Vec<Vec<f64>> = merged.iter().map(|(s, _)| vec![s.seconds]).collect();
    for pass in passes {
        for (((kept, _), times), (other, _)) in merged.iter().zip(&mut times).zip(pass) {
            if other.fits == kept.fits && other.bytes == kept.bytes {
                times.push(other.seconds);
            }
        }
    }
    for ((kept, _), mut times) in merged.iter_mut().zip(times) {
        times.sort_by(f64::total_cmp);
        kept.seconds = times[times.len() / 2];
    }
    merged
}

fn run_profiled(
    plan: &Plan,
    (steps, seed): (u64, u64),
    backend: BackendKind,
    single_thread: bool,
) -> Result<RunOutput, String> {
    // The pool's runs go as `run` runs one device (its whole program on a worker of the pool, no
    // kernel handed over), so that the fits carry no hand-over such a run does not pay.
    let inline = single_thread.then_some(true);
    let config =
        RunConfig { profile: true, kernels_inline: inline, backend, ..RunConfig::new(seed, steps, optimizer()) };
    let (warm_up, timed) = timed_steps(plan, &config, steps.max(2) - 1, 0.0)?;
    let config = RunConfig { steps: warm_up + timed, profile_warm_up: warm_up, ..config };
    run_plan(plan, &config, &|_| {})
}

/// Fits every kind seen at two sizes or more: products on (1, bytes, FLOPs), the others on (1, bytes);
/// `default` is the fit of every non-product sample of the same precision together (`default`,
/// `default@bf16`). A kind or flavor seen at one size only gets no fit of its own (one size says
/// nothing of how its time grows, and such a fit would price it the same at any size): the next more
/// general fit costs it.
pub fn fit_kernels(samples: &[(KernelSample, bool)]) -> BTreeMap<String, KernelFit> {
    let mut by_kind: BTreeMap<&str, Vec<Sample>> = BTreeMap::new();
    let mut others: BTreeMap<String, Vec<Sample>> = BTreeMap::new();
    for (s, product) in samples {
        let features = if *product { vec![1.0, s.bytes, s.flops] } else { vec![1.0, s.bytes] };
        let sample = Sample { features, seconds: s.seconds };
        if !product {
            others.entry(s.default.clone()).or_default().push(sample.clone());
        }
        for fit in &s.fits {
            by_kind.entry(fit).or_default().push(sample.clone());
        }
    }
    let sized = |samples: &Vec<Sample>| spans_sizes(samples);
    let mut fits: BTreeMap<String, KernelFit> = by_kind
        .into_iter()
        .filter(|(_, samples)| sized(samples))
        .map(|(kind, samples)| (kind.to_string(), kernel_fit(&samples)))
        .collect();
    fits.extend(others.into_iter().filter(|(_, samples)| sized(samples)).map(|(key, s)| (key, kernel_fit(&s))));
    fits
}

/// Whether samples come from at least two sizes (their bytes or FLOPs differ by more than 1%).
fn spans_sizes(samples: &[Sample]) -> bool {
    let size = |s: &Sample| s.features.iter().skip(1).copied().fold(0.0f64, f64::max);
    let (low, high) = samples.iter().map(size).fold((f64::INFINITY, 0.0f64), |(lo, hi), x| (lo.min(x), hi.max(x)));
    high > low * 1.01
}

/// A fit of (launch, seconds per byte[, seconds per FLOP]) as a [`KernelFit`]; for a kind without
/// FLOPs, with a faster rate for a call's first bytes where that fits its calls much better
/// ([`cached_fit`]).
fn kernel_fit(samples: &[Sample]) -> KernelFit {
    let c = fit_non_negative(samples);
    // A coefficient so small that its rate passes what a profile may hold costs nothing: no rate.
    let rate = |k: usize| c.get(k).copied().filter(|&x| x > 0.0).map(|seconds| 1e-9 / seconds).filter(|&r| is_rate(r));
    let plain = KernelFit {
        launch_us: c.first().copied().unwrap_or(0.0) * 1e6,
        gb_s: rate(1),
        gflop_s: rate(2),
        samples: samples.len() as u64,
        cached_bytes: None,
        cached_gb_s: None,
    };
    let bytes_only = samples.iter().all(|s| s.features.len() == 2);
    bytes_only.then(|| cached_fit(samples, weighted_error(samples, &c))).flatten().unwrap_or(plain)
}

/// Where a call's first bytes may run at a cache's rate: the sizes tried as [`KernelFit::cached_bytes`].
const CACHED_BYTES: [f64; 6] = [256e3, 512e3, 1e6, 2e6, 4e6, 8e6];

/// A fit of `launch + min(bytes, T) / cached rate + max(bytes - T, 0) / rate` for the `T` of
/// [`CACHED_BYTES`] that fits best, where it fits with at most [`CACHED_ERROR`] of the one-rate fit's
/// error (`plain_error`), from at least [`CACHED_SIDE`] calls on each side of `T`, with the first
/// bytes at least [`CACHED_SPEED_UP`] times faster. On the 2-core Xeon one-thread `BiasAdd@infer`
/// calls ran at 50-85 GB/s up to 1 MB and 16-28 GB/s from 4 MB: one rate (25 GB/s) priced a 400 KB
/// call at three times its time. `samples` are bytes-only (features `[1, bytes]`).
fn cached_fit(samples: &[Sample], plain_error: f64) -> Option<KernelFit> {
    let mut best: Option<(f64, f64, Vec<f64>)> = None;
    for limit in CACHED_BYTES {
        let below = samples.iter().filter(|s| s.features[1] <= limit).count();
        if below < CACHED_SIDE || samples.len() - below < CACHED_SIDE {
            continue;
        }
        let split: Vec<Sample> = samples
            .iter()
            .map(|s| {
                let bytes = s.features[1];
                Sample { features: vec![1.0, bytes.min(limit), (bytes - limit).max(0.0)], seconds: s.seconds }
            })
            .collect();
        let c = fit_non_negative(&split);
        let error = weighted_error(&split, &c);
        let rates = c[1] > 0.0 && c[2] > 0.0 && is_rate(1e-9 / c[1]) && is_rate(1e-9 / c[2]);
        let faster_first = rates && c[1] * CACHED_SPEED_UP < c[2];
        if faster_first && best.as_ref().is_none_or(|b| error < b.0) {
            best = Some((error, limit, c));
        }
    }
    let (error, limit, c) = best?;
    (error <= CACHED_ERROR * plain_error).then(|| KernelFit {
        launch_us: c[0] * 1e6,
        gb_s: Some(1e-9 / c[2]),
        gflop_s: None,
        samples: samples.len() as u64,
        cached_bytes: Some(limit),
        cached_gb_s: Some(1e-9 / c[1]),
    })
}

/// The share of the one-rate fit's error a cached fit must come within to be kept.
const CACHED_ERROR: f64 = 0.7;

/// How much faster the first bytes must run for a cached fit.
const CACHED_SPEED_UP: f64 = 1.25;

/// Calls a cached fit needs on each side of its size.
const CACHED_SIDE: usize = 3;

/// The collective configurations calibrated: (members, devices) with devices a multiple of members,
/// for meshes of up to 16 devices.
pub const COLLECTIVE_SHAPES: [(u64, u64); 10] =
    [(2, 2), (2, 4), (4, 4), (2, 8), (4, 8), (8, 8), (2, 16), (4, 16), (8, 16), (16, 16)];

/// Payloads per member, in bytes, that each collective is timed at.
pub const COLLECTIVE_PAYLOADS: [u64; 3] = [16 << 10, 256 << 10, 2 << 20];

/// A member's send and receive buffers up to this size are reused every round, in cache: in a step
/// such a block was just written by the kernel before the collective, and is still in the core's
/// cache.
const HOT_BYTES: u64 = 1 << 20;

/// Larger buffers are cycled so that the buffers of one timing span this much over all threads:
/// twice a large last-level cache, so that each round finds its buffers out of cache, as a step does.
const COLD_BYTES: u64 = 64 << 20;

/// The collective kinds, in the order they are calibrated.
pub const COLLECTIVE_KINDS: [CollectiveKind; 5] = [
    CollectiveKind::Broadcast,
    CollectiveKind::Reduce,
    CollectiveKind::AllReduce,
    CollectiveKind::AllGather,
    CollectiveKind::ReduceScatter,
];

/// Seconds per collective of `kind` over groups of `members` on a mesh of `devices` threads, every
/// group running it at once, with `bytes` of payload per member (as `inspect` counts it: the gathered
/// buffer of an all-gather, the unscattered one of a reduce-scatter): the slowest thread's mean over
/// `repeats` after two warm-up rounds.
pub fn time_collective(
    kind: CollectiveKind,
    members: u64,
    devices: u64,
    bytes: u64,
    repeats: u64,
) -> Result<f64, String> {
    if members < 2 || !devices.is_multiple_of(members) {
        return Err(format!("cannot time {members}-member groups on {devices} devices"));
    }
    let mesh = Mesh::new(devices / members, members);
    let fabric = Fabric::new(mesh, Duration::from_secs(60));
    let barrier = Arc::new(Barrier::new(devices as usize));
    let elements = (bytes / 4).max(members) / members * members;
    let copies =
        if 8 * elements <= HOT_BYTES { 1 } else { (COLD_BYTES / (devices * 8 * elements).max(1)).clamp(1, 64) };
    let times: Vec<Result<f64, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..devices)
            .map(|rank| {
                let (fabric, barrier) = (Arc::clone(&fabric), Arc::clone(&barrier));
                scope.spawn(move || {
                    let mut comm = ThreadComm::new(fabric, mesh.coords_of(rank));
                    // Buffers live across rounds, as a plan's arena does, so no allocation is timed; and
                    // rounds cycle through enough of them that, as in a step, they are not in cache.
                    let mut pairs: Vec<(Vec<f32>, Vec<f32>)> =
                        (0..copies).map(|_| buffers(kind, members, elements)).collect();
                    let mut next = 0;
                    let mut round = || {
                        next = (next + 1) % pairs.len();
                        let (send, recv) = &mut pairs[next];
                        one_collective(&mut comm, kind, members, elements, send, recv)
                    };
                    for _ in 0..2 {
                        round()?;
                    }
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..repeats {
                        round()?;
                    }
                    Ok(start.elapsed().as_secs_f64() / repeats.max(1) as f64)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a calibration thread panicked".into()))).collect()
    });
    times.into_iter().try_fold(0.0f64, |worst, t| Ok(worst.max(t?)))
}

/// A member's send and receive buffers for one collective of `elements` f32 of payload.
fn buffers(kind: CollectiveKind, members: u64, elements: u64) -> (Vec<f32>, Vec<f32>) {
    let (n, block) = (elements as usize, (elements / members) as usize);
    // Filled with non-zeros so that every page is written now (zeros would be mapped lazily, and the
    // first collective to write them would time page faults).
    match kind {
        CollectiveKind::AllGather => (vec![1.0; block], vec![0.5; n]),
        CollectiveKind::ReduceScatter => (vec![1.0; n], vec![0.5; block]),
        _ => (vec![1.0; n], vec![0.5; n]),
    }
}

/// One collective of `kind` over this thread's row group.
fn one_collective(
    comm: &mut ThreadComm,
    kind: CollectiveKind,
    members: u64,
    elements: u64,
    send: &[f32],
    recv: &mut [f32],
) -> Result<(), String> {
    let full = [members, elements / members];
    let root = matches!(kind, CollectiveKind::Broadcast | CollectiveKind::Reduce).then_some(0);
    let spec = CollectiveSpec {
        kind,
        root,
        shard: Some(Placement::shard(0)),
        ..CollectiveSpec::all_reduce(Group::Row, ReduceOp::Sum, &full)
    };
    comm.collective(&spec, send, recv).map_err(|e| e.to_string())
}

/// Fits alpha and beta of one configuration from (payload bytes, seconds) pairs.
pub fn fit_collective(kind: CollectiveKind, members: u64, devices: u64, points: &[(u64, f64)]) -> CollectiveFit {
    let samples: Vec<Sample> =
        points.iter().map(|&(bytes, seconds)| Sample { features: vec![1.0, bytes as f64], seconds }).collect();
    let c = fit_non_negative(&samples);
    CollectiveFit {
        kind: kind.into(),
        members,
        devices,
        alpha_us: c.first().copied().unwrap_or(0.0) * 1e6,
        ns_per_byte: c.get(1).copied().unwrap_or(0.0) * 1e9,
    }
}

/// Repeats that make one timing take about `budget` given a first guess of one collective's time.
pub fn repeats_for(guess: Duration, budget: Duration) -> u64 {
    (budget.as_secs_f64() / guess.as_secs_f64().max(1e-6)).clamp(3.0, 200.0) as u64
}

/// Sizes of the buffers [`host_copies`] copies, in f32 elements: a mix like a pipeline stage's kept
/// activations (many of a few MiB, a few as large as the logits).
const HOST_COPY_ELEMENTS: [usize; 3] = [8 << 20, 1 << 20, 256 << 10];
/// How many buffers of each size in [`HOST_COPY_ELEMENTS`].
const HOST_COPY_COUNTS: [usize; 3] = [1, 8, 16];

/// The host copies of the CPU runtime, on one thread as a device thread makes them: buffers copied out
/// into new host vectors (a stash, or a gradient to be summed), the vectors added into sums, and copied
/// back into the buffers (a restore); each rate the median of `rounds` rounds after one to warm up.
pub fn host_copies(rounds: usize) -> crate::cost::calibration::HostCopies {
    let sizes: Vec<usize> =
        HOST_COPY_ELEMENTS.iter().zip(HOST_COPY_COUNTS).flat_map(|(&n, count)| std::iter::repeat_n(n, count)).collect();
    let total: usize = sizes.iter().sum();
    // The buffers, filled so that every page is present (as an arena's are after its first step).
    let mut arena: Vec<f32> = (0..total).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let mut sums: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.0; n]).collect();
    let bytes = (total * size_of::<f32>()) as f64;
    let (mut out, mut add, mut back) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..=rounds.max(1) {
        let start = Instant::now();
        let mut copies = Vec::with_capacity(sizes.len());
        let mut at = 0;
        for &n in &sizes {
            copies.push(arena[at..at + n].to_vec());
            at += n;
        }
        let copied = start.elapsed().as_secs_f64();
        let start = Instant::now();
        for (sum, copy) in sums.iter_mut().zip(&copies) {
            sum.iter_mut().zip(copy).for_each(|(s, &v)| *s += v);
        }
        let added = start.elapsed().as_secs_f64();
        let start = Instant::now();
        let mut at = 0;
        for copy in &copies {
            arena[at..at + copy.len()].copy_from_slice(copy);
            at += copy.len();
        }
        let restored = start.elapsed().as_secs_f64();
        drop(std::hint::black_box(copies));
        if round > 0 {
            out.push(bytes / copied.max(1e-9) / 1e9);
            add.push(bytes / added.max(1e-9) / 1e9);
            back.push(bytes / restored.max(1e-9) / 1e9);
        }
    }
    std::hint::black_box(&sums);
    crate::cost::calibration::HostCopies {
        copy_out_gb_s: median_rate(out),
        copy_in_gb_s: median_rate(back),
        add_gb_s: median_rate(add),
    }
}

fn median_rate(mut rates: Vec<f64>) -> f64 {
    rates.sort_by(f64::total_cmp);
    rates.get(rates.len() / 2).copied().unwrap_or(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_up_and_measured_steps_follow_the_time_asked_within_their_bounds() {
        // 0.3 s at 10 ms a step; at 1 s a step the least; an unmeasured step the least; at 1 µs the cap.
        assert_eq!(steps_for(0.3, 0.01, 1), 30);
        assert_eq!(steps_for(0.3, 1.0, 1), 1);
        assert_eq!(steps_for(0.2, 0.0, 5), 5);
        assert_eq!(steps_for(0.3, 1e-6, 1), MAX_TIMED_STEPS);
        assert_eq!(steps_for(0.2, 0.1, 5), 5);
    }

    /// Calls of a bytes-only kernel: 2 us launch, 80 GB/s for the first MB, 20 GB/s beyond.
    fn cached_calls(sizes: &[f64]) -> Vec<Sample> {
        let seconds = |b: f64| 2e-6 + b.min(1e6) / 80e9 + (b - 1e6).max(0.0) / 20e9;
        sizes.iter().map(|&b| Sample { features: vec![1.0, b], seconds: seconds(b) }).collect()
    }

    #[test]
    fn a_kind_whose_small_calls_run_from_cache_gets_a_cached_rate_for_its_first_bytes() {
        let sizes = [1e5, 2e5, 4e5, 8e5, 1e6, 3e6, 8e6, 16e6, 32e6];
        let fit = kernel_fit(&cached_calls(&sizes));
        assert_eq!(fit.cached_bytes, Some(1e6), "{fit:?}");
        let near = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-6 * b);
        assert!(near(fit.cached_gb_s, 80.0) && near(fit.gb_s, 20.0), "{fit:?}");
        assert!((fit.launch_us - 2.0).abs() < 1e-6, "{fit:?}");
        for &b in &sizes {
            let expected = 2e-6 + b.min(1e6) / 80e9 + (b - 1e6).max(0.0) / 20e9;
            assert!((fit.seconds(b, 0.0) - expected).abs() < 1e-6 * expected, "{b}: {fit:?}");
        }
        // One rate throughout, calls on one side only, or products: the plain fit.
        let linear: Vec<Sample> =
            sizes.iter().map(|&b| Sample { features: vec![1.0, b], seconds: 1e-6 + b / 30e9 }).collect();
        assert_eq!(kernel_fit(&linear).cached_bytes, None);
        assert_eq!(kernel_fit(&cached_calls(&sizes[..5])).cached_bytes, None);
        let products: Vec<Sample> =
            sizes.iter().map(|&b| Sample { features: vec![1.0, b, 2.0 * b], seconds: b / 50e9 }).collect();
        assert_eq!(kernel_fit(&products).cached_bytes, None);
    }

    #[test]
    fn a_profile_leaves_out_its_warm_up_steps_but_never_the_last() {
        let plan = llama_plan();
        let profiled = |steps, warm_up| {
            let config = RunConfig { profile: true, profile_warm_up: warm_up, ..RunConfig::new(1, steps, optimizer()) };
            let output = run_plan(&plan, &config, &|_| {}).expect("the run");
            output.profiles.first().map(|p| (p.steps, p.warm_up_excluded)).expect("a profile")
        };
        assert_eq!(profiled(5, 3), (2, true));
        assert_eq!(profiled(3, 1), (2, true));
        assert_eq!(profiled(3, 5), (1, true));
        assert_eq!(profiled(1, 1), (1, false));
    }

    /// A one-layer Llama (grouped-query attention, whose q, k and v gradients follow one another).
    fn llama_plan() -> Plan {
        let source = include_str!("../examples/llama.opt");
        let sets = ["layers=1", "hidden=64", "heads=4", "kv_heads=2", "ffn=96", "seq=16", "batch=2", "vocab=128"];
        let overrides: Vec<crate::elab::Override> = sets.iter().map(|s| s.parse().expect("an override")).collect();
        let model = crate::front::check_source(source, &overrides).model.expect("llama.opt checks");
        let target =
            crate::shard::Target::plain(Mesh::new(1, 1), crate::plan::Strategy::None, crate::plan::Mode::Train);
        match crate::shard::compile(&model, "llama", source, target) {
            Ok(plan) => plan,
            Err(_) => panic!("llama.opt does not compile"),
        }
    }

    #[test]
    fn attention_gradients_that_follow_one_another_share_their_time() {
        let plan = llama_plan();
        let mut positions = Vec::new();
        let mut samples = Vec::new();
        let mut first_gradient = true;
        for (index, instr) in plan.program.iter().enumerate() {
            let Instr::Kernel { kernel, .. } = instr else { continue };
            // As the CUDA backend times them: the first gradient 3 s (all three), the others nothing.
            let seconds = match kernel {
                Kernel::AttentionGrad { .. } if std::mem::take(&mut first_gradient) => 3.0,
                Kernel::AttentionGrad { .. } => 0.0,
                _ => 0.5,
            };
            let sample = KernelSample { fits: vec![], default: String::new(), bytes: 1.0, flops: 1.0, seconds };
            positions.push(index);
            samples.push((sample, false));
        }
        share_gradient_groups(&plan, &positions, &mut samples);
        let attention: Vec<f64> = positions
            .iter()
            .zip(&samples)
            .filter(|(i, _)| matches!(plan.program[**i], Instr::Kernel { kernel: Kernel::AttentionGrad { .. }, .. }))
            .map(|(_, (s, _))| s.seconds)
            .collect();
        assert_eq!(attention, vec![1.0; 3], "the three gradients share the 3 s");
        let others = samples.iter().filter(|(s, _)| s.seconds == 0.5).count();
        assert_eq!(others, samples.len() - 3, "every other kernel keeps its own time");
    }
}
