//! `optimusc calibrate --backend cuda`: the first GPU's kernels, each timed on the GPU in profiled
//! one-device runs of built-in models at GPU sizes, and the cost of meshes whose devices share that GPU.

use super::{
    BERT, CalibrateArgs, GPT2, LLAMA, Progress, RawSamples, SharedSetup, Workload, finish_with_shared_engine,
    one_device_plan,
};
use optimus::calibrate as measure;
use optimus::cost::calibration::{DEFAULT_KERNEL, KernelFit, Measured};
use optimus::cost::hardware::{Collectives, Device, Hardware, InterNode, IntraNode, PeakTflops};
use optimus::plan::{Mesh, Mode, Precision, Strategy};
use optimus::runtime::backend::BackendKind;

/// Steps of each GPU run: the first is warm-up, the others' median is kept.
const STEPS: u64 = 4;

/// Passes over the GPU workloads (each instruction keeps the larger of its two times): a GPU's kernel
/// times vary far less than a shared CPU's.
const GPU_PASSES: u64 = 2;

/// The sizes profiled on the GPU: products from a few hundred to a few thousand wide, head sizes 64 and
/// 128, vocabularies whose rows are 16-byte aligned and one (50,257) whose are not, grouped-query
/// attention, and BERT's encoder; every model at two sizes at least, so that each kind's fit sees how
/// its time grows, and sequences of 2,048 beside narrow layers, so that attention's FLOPs (which grow
/// with the square of the sequence) and its bytes (which grow with the sequence) vary apart.
const WORKLOADS: [Workload; 10] = [
    gpt2(&["layers=1", "hidden=256", "heads=4", "seq=256", "batch=8", "vocab=8192"]),
    gpt2(&["layers=1", "hidden=512", "heads=8", "seq=512", "batch=8", "vocab=16384"]),
    gpt2(&["layers=1", "hidden=1024", "heads=16", "seq=1024", "batch=4", "vocab=50257"]),
    gpt2(&["layers=1", "hidden=1536", "heads=12", "seq=1024", "batch=8", "vocab=32000"]),
    llama(&[
        "layers=1",
        "hidden=1024",
        "heads=16",
        "kv_heads=4",
        "ffn=2816",
        "seq=1024",
        "batch=4",
        "vocab=32000",
        "context=1024",
    ]),
    llama(&[
        "layers=1",
        "hidden=512",
        "heads=8",
        "kv_heads=2",
        "ffn=1408",
        "seq=512",
        "batch=8",
        "vocab=16384",
        "context=512",
    ]),
    llama(&[
        "layers=1",
        "hidden=512",
        "heads=8",
        "kv_heads=2",
        "ffn=1408",
        "seq=2048",
        "batch=2",
        "vocab=16384",
        "context=2048",
    ]),
    gpt2(&["layers=1", "hidden=512", "heads=8", "seq=2048", "batch=2", "vocab=16384", "context=2048"]),
    bert(&["layers=1", "hidden=512", "heads=8", "seq=256", "batch=16", "vocab=16384", "context=256"]),
    bert(&["layers=1", "hidden=768", "heads=12", "seq=512", "batch=8", "vocab=30522", "context=512"]),
];

/// A GPT-2 workload of [`STEPS`] steps with overrides `set`.
const fn gpt2(set: &'static [&'static str]) -> Workload {
    Workload { model: "gpt2", source: GPT2, set, steps: STEPS }
}

/// A Llama workload of [`STEPS`] steps with overrides `set`.
const fn llama(set: &'static [&'static str]) -> Workload {
    Workload { model: "llama", source: LLAMA, set, steps: STEPS }
}

/// A BERT workload of [`STEPS`] steps with overrides `set`.
const fn bert(set: &'static [&'static str]) -> Workload {
    Workload { model: "bert", source: BERT, set, steps: STEPS }
}

/// The model whose meshes on the one GPU fit the cost each device's kernels and collectives add when
/// several devices share it.
const SHARED_WORKLOAD: Workload = Workload {
    model: "gpt2",
    source: GPT2,
    set: &["layers=2", "hidden=1024", "heads=16", "seq=512", "batch=8", "vocab=8192"],
    steps: 5,
};

/// Devices sharing one GPU run bf16, as a GPU mesh trains; one pass, as device time is scarce.
const GPU_SHARED: SharedSetup =
    SharedSetup { workload: &SHARED_WORKLOAD, precision: Precision::Bf16, backend: BackendKind::Cuda, passes: 1 };

/// The meshes of devices sharing the GPU: 2, 4 and 8 devices, each count with two kinds of
/// collectives (tensor-parallel ones alone, and with data-parallel replicas' gradient sums).
const SHARED_MESHES: [(Mesh, Strategy); 6] = [
    (Mesh::new(1, 2), Strategy::Megatron),
    (Mesh::new(1, 1).with_data(2), Strategy::None),
    (Mesh::new(2, 2), Strategy::Optimus),
    (Mesh::new(1, 4), Strategy::Megatron),
    (Mesh::new(1, 8), Strategy::Megatron),
    (Mesh::new(2, 2).with_data(2), Strategy::Optimus),
];

/// Measures the GPU's kernels and shared meshes and assembles the profile.
pub fn measure_gpu(args: &CalibrateArgs) -> Result<Hardware, String> {
    let gpu = optimus::runtime::backend::first_gpu()?;
    if gpu.visible > 1 {
        return Err(format!(
            "--backend cuda measures one GPU and meshes whose devices share it, but this process sees {} GPUs \
             (a mesh would take one each); run it on one, e.g. with CUDA_VISIBLE_DEVICES=0",
            gpu.visible
        ));
    }
    let workloads: &[Workload] = if args.quick { &WORKLOADS[..2] } else { &WORKLOADS };
    let meshes: &[(Mesh, Strategy)] = if args.quick { &SHARED_MESHES[2..3] } else { &SHARED_MESHES };
    let passes = if args.quick { 1 } else { GPU_PASSES };
    let mut runs: Vec<(&Workload, Precision, Mode)> = Vec::new();
    for mode in [Mode::Train, Mode::Infer] {
        for precision in [Precision::F32, Precision::Bf16] {
            runs.extend(workloads.iter().map(|w| (w, precision, mode)));
        }
    }
    let progress = Progress::new(passes * runs.len() as u64 + 2 * meshes.len() as u64);
    let plans: Vec<_> = runs.iter().map(|&(w, p, m)| one_device_plan(w, p, m)).collect::<Result<_, _>>()?;
    let mut all = Vec::new();
    for pass in 1..=passes {
        let mut samples = Vec::new();
        for (&(w, precision, mode), plan) in runs.iter().zip(&plans) {
            let infer = if mode == Mode::Infer { " infer" } else { "" };
            let what = format!("{} {}{infer} {}", w.model, precision.name(), w.set.join(" "));
            progress.phase(&format!("GPU kernels (pass {pass} of {passes}): {what}"));
            samples.extend(measure::profile_kernels(plan, (w.steps, 1), BackendKind::Cuda, false)?);
            progress.advance();
        }
        all.push(samples);
    }
    let samples = measure::median_of(all);
    let raw = RawSamples::kernels("gpu", &samples);
    let kernels = measure::fit_kernels(&samples);
    let measured = Measured {
        runtime: "cuda".into(),
        threads: 1,
        shared_engine: true,
        overlap: false,
        dispatch: Vec::new(),
        rendezvous: Vec::new(),
        kernels,
        single_thread_kernels: Default::default(),
        collectives: Vec::new(),
        host_copies: None,
    };
    let hw = assemble(args, (gpu.name, gpu.memory_bytes), measured);
    finish_with_shared_engine(args, hw, (meshes, &GPU_SHARED, "devices sharing the GPU"), &progress, raw)
}

/// The profile of the GPU: the measured section, and the classic fields filled from it. The peaks are
/// the fitted product rates (what the GPU's products reached here, not its data sheet's), and the
/// devices of a mesh on this GPU exchange their blocks at the rate of its element-wise kernels, which
/// read one buffer and write another as a collective's copies do.
fn assemble(args: &CalibrateArgs, (gpu, memory_bytes): (String, u64), measured: Measured) -> Hardware {
    let fit = |key: &str| measured.kernels.get(key).copied();
    let default = fit(DEFAULT_KERNEL).or_else(|| fit("default@bf16"));
    let rate = |f: Option<KernelFit>| f.and_then(|f| f.gflop_s).map(|g| g / 1e3);
    let copy_gb_s = default.and_then(|f| f.gb_s).unwrap_or(1000.0);
    let launch_us = default.map_or(5.0, |f| f.launch_us);
    Hardware {
        name: args.name.clone().unwrap_or_else(|| format!("calibrated-{}", super::host_name())),
        description: format!("{gpu} (one GPU; meshes share it), measured by optimusc calibrate --backend cuda"),
        device: Device {
            name: gpu,
            memory_gb: memory_bytes as f64 / 1e9,
            memory_bandwidth_gb_s: copy_gb_s,
            achievable_bandwidth: 1.0,
            achievable_compute: 1.0,
            kernel_launch_us: launch_us,
            peak_tflops: PeakTflops {
                f32: rate(fit("MatMul")).unwrap_or(10.0),
                f16: None,
                bf16: rate(fit("MatMul@bf16")).map(super::significant),
            },
        },
        intra_node: IntraNode {
            gpus_per_node: optimus::runtime::limits::MAX_DEVICE_THREADS,
            bandwidth_gb_s: copy_gb_s,
            latency_us: launch_us,
        },
        inter_node: InterNode { nic_bandwidth_gb_s: copy_gb_s, latency_us: launch_us, nics_per_node: 1 },
        collectives: Collectives::default(),
        measured: Some(measured),
    }
}
