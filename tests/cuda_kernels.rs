//! The CUDA kernels: the NVRTC source compiles and defines every kernel (f32 and bf16), every plan kernel
//! has a launcher, and (where a GPU is present) every kernel agrees with the CPU reference on random
//! inputs, in f32 and on bf16 buffers (against the CPU backend's bf16 result).
//!
//! Without libnvrtc the PTX test prints why and passes, unless `OPTIMUS_REQUIRE_NVRTC=1`; without a CUDA
//! driver or GPU the GPU tests print why and pass, unless `OPTIMUS_REQUIRE_CUDA=1`.
#![cfg(feature = "cuda")]

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nvrtc::Ptx;
use optimus::plan::layout::{Layout, Placement};
use optimus::plan::tensor::{Data, Tensor};
use optimus::plan::types::DType;
use optimus::plan::{Buffer, BufferId, Coords, IGNORE_INDEX, Kernel, Mesh, Offset, Role};
use optimus::runtime::bf16;
use optimus::runtime::cpu::kernels as cpu;
use optimus::runtime::cuda::kernels::{
    BF16_KERNEL_NAMES, COLLECTIVE_KERNEL_NAMES, CudaKernels, DeviceTensor, FLASH_KERNEL_NAMES, KERNEL_NAMES, SOURCE,
    bf16_launcher, compile_ptx, launcher,
};
use optimus::runtime::settings::{KernelContext, OptimizerKind, OptimizerSettings};
use optimus::runtime::view::{Shape, View, ViewData, ViewMut, ViewMutData};
use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};

type R = Result<(), String>;

fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1")
}

/// Whether libnvrtc can be loaded (printing why not, or failing when it is required).
fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library.
    let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if !present {
        assert!(!required("OPTIMUS_REQUIRE_NVRTC"), "OPTIMUS_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded");
        eprintln!(
            "skipped: libnvrtc cannot be loaded (put it on LD_LIBRARY_PATH; OPTIMUS_REQUIRE_NVRTC=1 fails instead)"
        );
    }
    present
}

// ---- without a GPU --------------------------------------------------------------------------------

#[test]
fn every_kernel_compiles_to_ptx() -> R {
    if !nvrtc_present() {
        return Ok(());
    }
    let ptx = compile_ptx()?.to_src();
    for name in KERNEL_NAMES.iter().chain(BF16_KERNEL_NAMES).chain(FLASH_KERNEL_NAMES).chain(COLLECTIVE_KERNEL_NAMES) {
        assert!(ptx.contains(&format!(".entry {name}(")), "the PTX has no entry `{name}`");
    }
    let listed =
        KERNEL_NAMES.len() + BF16_KERNEL_NAMES.len() + FLASH_KERNEL_NAMES.len() + COLLECTIVE_KERNEL_NAMES.len();
    assert_eq!(ptx.matches(".entry ").count(), listed, "the PTX has entries the name lists do not list");
    println!("{listed} kernels ({} on bf16 storage) compiled to {} bytes of PTX", BF16_KERNEL_NAMES.len(), ptx.len());
    Ok(())
}

/// The kernels also assemble to machine code (NVRTC runs ptxas for a real architecture) for the GPUs
/// bf16 products and the flash attention's tensor-core instructions target: Ampere (sm_80) and Hopper
/// (sm_90).
#[test]
fn every_kernel_assembles_for_ampere_and_hopper() -> R {
    if !nvrtc_present() {
        return Ok(());
    }
    for arch in ["sm_80", "sm_90"] {
        let opts = cudarc::nvrtc::CompileOptions {
            arch: Some(arch),
            fmad: Some(false),
            name: Some("kernels.cu".into()),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| format!("{arch}: {e:?}"))?;
        let entries = ptx.to_src().matches(".entry ").count();
        let listed =
            KERNEL_NAMES.len() + BF16_KERNEL_NAMES.len() + FLASH_KERNEL_NAMES.len() + COLLECTIVE_KERNEL_NAMES.len();
        assert_eq!(entries, listed, "{arch}: entries");
        let mma = ptx.to_src().matches("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32").count();
        assert!(mma > 0, "{arch}: the flash attention has no bf16 tensor-core products");
    }
    Ok(())
}

/// A run's PTX is kept on disk: the second compile reads the entry, a damaged entry is compiled again
/// and replaced, and a folder that others may write is never used.
#[test]
fn compiled_ptx_is_cached_and_a_damaged_entry_is_compiled_again() -> R {
    use optimus::runtime::cuda::ptx_cache::{compile_cubin_cached_in, compile_ptx_cached_in};
    use std::os::unix::fs::PermissionsExt;
    if !nvrtc_present() {
        return Ok(());
    }
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let entries = |d: &std::path::Path| -> Result<Vec<std::path::PathBuf>, String> {
        let list = std::fs::read_dir(d).map_err(|e| e.to_string())?;
        Ok(list.filter_map(|e| e.ok().map(|e| e.path())).collect())
    };
    let start = std::time::Instant::now();
    let first = compile_ptx_cached_in(Some(dir.path()), "compute_80")?.to_src();
    let compiled = start.elapsed();
    let stored = entries(dir.path())?;
    assert_eq!(stored.len(), 1, "one entry: {stored:?}");
    let start = std::time::Instant::now();
    assert!(compile_ptx_cached_in(Some(dir.path()), "compute_80")?.to_src() == first, "read from the cache");
    println!("compiled in {compiled:?}, read from the cache in {:?}", start.elapsed());
    let text = std::fs::read_to_string(&stored[0]).map_err(|e| e.to_string())?;
    std::fs::write(&stored[0], &text[..text.len() / 2]).map_err(|e| e.to_string())?;
    // NVRTC numbers its call sequences per process, so a recompile is not byte-identical: the damaged
    // entry gives PTX with the same entry points, and is replaced by that PTX.
    let third = compile_ptx_cached_in(Some(dir.path()), "compute_80")?.to_src();
    let entries_of = |ptx: &str| ptx.lines().filter(|l| l.contains(".entry ")).map(str::to_string).collect::<Vec<_>>();
    assert_eq!(entries_of(&third), entries_of(&first), "a truncated entry is compiled again");
    let rewritten = std::fs::read_to_string(&stored[0]).map_err(|e| e.to_string())?;
    assert!(rewritten.starts_with(&third) && rewritten.len() > third.len(), "the entry is replaced");
    assert!(compile_ptx_cached_in(Some(dir.path()), "compute_80")?.to_src() == third, "and read again");
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).map_err(|e| e.to_string())?;
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).map_err(|e| e.to_string())?;
    let unshared = compile_ptx_cached_in(Some(&shared), "compute_80")?.to_src();
    assert_eq!(entries_of(&unshared), entries_of(&first));
    assert!(entries(&shared)?.is_empty(), "nothing is written to a folder others may write");

    // Machine code for a real architecture, cached the same way beside the PTX.
    let cubin = compile_cubin_cached_in(Some(dir.path()), 80)?;
    assert!(cubin.starts_with(b"\x7fELF"), "NVRTC gives an ELF image for sm_80");
    let binary: Vec<_> =
        entries(dir.path())?.into_iter().filter(|p| p.extension().is_some_and(|e| e == "cubin")).collect();
    assert_eq!(binary.len(), 1, "one machine-code entry");
    assert!(compile_cubin_cached_in(Some(dir.path()), 80)? == cubin, "machine code read from the cache");
    let stored = std::fs::read(&binary[0]).map_err(|e| e.to_string())?;
    let mut flipped = stored.clone();
    flipped[100] ^= 1;
    std::fs::write(&binary[0], &flipped).map_err(|e| e.to_string())?;
    let again = compile_cubin_cached_in(Some(dir.path()), 80)?;
    assert!(again.starts_with(b"\x7fELF"), "a damaged image is compiled again");
    assert!(std::fs::read(&binary[0]).map_err(|e| e.to_string())? != flipped, "and replaced");
    Ok(())
}

/// One of each [`Kernel`] variant (and both GELU forms).
fn samples() -> Vec<Kernel> {
    let offset = Offset::ZERO;
    vec![
        Kernel::MatMul { transpose_a: false, transpose_b: true, accumulate: false },
        Kernel::BatchedMatMul,
        Kernel::BiasAdd,
        Kernel::Add,
        Kernel::Scale { factor: 2.0 },
        Kernel::Gelu { approximate: true },
        Kernel::Gelu { approximate: false },
        Kernel::GeluGrad { approximate: true },
        Kernel::GeluGrad { approximate: false },
        Kernel::Silu,
        Kernel::SiluGrad,
        Kernel::Rotary { heads: 2, theta: 10000.0 },
        Kernel::RotaryGrad { heads: 2, theta: 10000.0 },
        Kernel::Softmax,
        Kernel::SoftmaxGrad,
        Kernel::CausalMask,
        Kernel::CausalMaskGrad,
        Kernel::Dropout { p: 0.1, key: 1 },
        Kernel::DropoutGrad { p: 0.1, key: 1 },
        Kernel::Reshape,
        Kernel::Transpose { dim0: 0, dim1: 1 },
        Kernel::Select { dim: 0, index: 0 },
        Kernel::SelectGrad { dim: 0, index: 0 },
        Kernel::Attention { heads: 2, kv_heads: 2, causal: true, fused: true },
        Kernel::AttentionGrad { heads: 2, kv_heads: 2, causal: true, fused: false, wrt: 1 },
        Kernel::EmbeddingLookup { offset, masked: true },
        Kernel::EmbeddingGrad { offset, masked: true, padding: None },
        Kernel::PositionLookup,
        Kernel::PositionGrad,
        Kernel::RowSum,
        Kernel::RowCenteredSquareSum { n: 4 },
        Kernel::LayerNormApply { n: 4, eps: 1e-5 },
        Kernel::LayerNormGradSums { n: 4, eps: 1e-5 },
        Kernel::LayerNormGradInput { n: 4, eps: 1e-5 },
        Kernel::LayerNormGradWeight { n: 4, eps: 1e-5 },
        Kernel::Mul,
        Kernel::RowSquareSum,
        Kernel::RmsNormApply { n: 4, eps: 1e-6 },
        Kernel::RmsNormGradSum,
        Kernel::RmsNormGradInput { n: 4, eps: 1e-6 },
        Kernel::RmsNormGradWeight { n: 4, eps: 1e-6 },
        Kernel::SumToLast,
        Kernel::CrossEntropyMax { offset, valid: 4 },
        Kernel::CrossEntropyStats { offset, valid: 4 },
        Kernel::CrossEntropyCount,
        Kernel::CrossEntropyLoss,
        Kernel::CrossEntropyGrad { offset, valid: 4 },
        Kernel::Fill { value: 0.0 },
        Kernel::SliceShard { axis: 0, placement: Placement::shard(0) },
        Kernel::GradSquareSum,
        Kernel::OptimizerStep,
        Kernel::Cast,
        Kernel::RotaryAt { heads: 2, theta: 10000.0 },
        Kernel::PositionLookupAt,
        Kernel::CacheWrite { part: 1, parts: 3 },
        Kernel::CachedAttention { heads: 2, kv_heads: 2, fused: true },
    ]
}

/// The variant of a kernel (exhaustive: a new variant does not compile until it is listed here).
fn variant(kernel: &Kernel) -> usize {
    match kernel {
        Kernel::MatMul { .. } => 0,
        Kernel::BatchedMatMul => 1,
        Kernel::BiasAdd => 2,
        Kernel::Add => 3,
        Kernel::Scale { .. } => 4,
        Kernel::Gelu { .. } => 5,
        Kernel::GeluGrad { .. } => 6,
        Kernel::Softmax => 7,
        Kernel::SoftmaxGrad => 8,
        Kernel::CausalMask => 9,
        Kernel::CausalMaskGrad => 10,
        Kernel::Dropout { .. } => 11,
        Kernel::DropoutGrad { .. } => 12,
        Kernel::Reshape => 13,
        Kernel::Transpose { .. } => 14,
        Kernel::Select { .. } => 15,
        Kernel::SelectGrad { .. } => 16,
        Kernel::Attention { .. } => 17,
        Kernel::AttentionGrad { .. } => 18,
        Kernel::EmbeddingLookup { .. } => 19,
        Kernel::EmbeddingGrad { .. } => 20,
        Kernel::PositionLookup => 21,
        Kernel::PositionGrad => 22,
        Kernel::RowSum => 23,
        Kernel::RowCenteredSquareSum { .. } => 24,
        Kernel::LayerNormApply { .. } => 25,
        Kernel::LayerNormGradSums { .. } => 26,
        Kernel::LayerNormGradInput { .. } => 27,
        Kernel::LayerNormGradWeight { .. } => 28,
        Kernel::SumToLast => 29,
        Kernel::CrossEntropyMax { .. } => 30,
        Kernel::CrossEntropyStats { .. } => 31,
        Kernel::CrossEntropyLoss => 32,
        Kernel::CrossEntropyGrad { .. } => 33,
        Kernel::Fill { .. } => 34,
        Kernel::SliceShard { .. } => 35,
        Kernel::OptimizerStep => 36,
        Kernel::GradSquareSum => 37,
        Kernel::Silu => 39,
        Kernel::SiluGrad => 40,
        Kernel::Cast => 38,
        Kernel::Mul => 41,
        Kernel::RowSquareSum => 42,
        Kernel::RmsNormApply { .. } => 43,
        Kernel::RmsNormGradSum => 44,
        Kernel::RmsNormGradInput { .. } => 45,
        Kernel::RmsNormGradWeight { .. } => 46,
        Kernel::Rotary { .. } => 47,
        Kernel::RotaryGrad { .. } => 48,
        Kernel::CrossEntropyCount => 49,
        Kernel::RotaryAt { .. } => 50,
        Kernel::PositionLookupAt => 51,
        Kernel::CacheWrite { .. } => 52,
        Kernel::CachedAttention { .. } => 53,
    }
}

const VARIANTS: usize = 54;

#[test]
fn every_plan_kernel_has_a_launcher_and_every_function_a_user() {
    let samples = samples();
    let covered: BTreeSet<usize> = samples.iter().map(variant).collect();
    assert_eq!(covered, (0..VARIANTS).collect(), "the samples miss a kernel variant");
    // `hold_stream` is the GPU profile's, launched before each timed instruction, not for a plan kernel.
    let mut used = BTreeSet::from(["hold_stream"]);
    for kernel in &samples {
        let l = launcher(kernel);
        // The key/value cache's kernels run on the CPU only: they have no launcher, and say so.
        if optimus::runtime::cuda::kernels::cpu_only(kernel) {
            assert!(l.functions.is_empty() && !l.cublas, "{kernel:?} is CPU-only but launches");
            continue;
        }
        assert!(l.cublas || !l.functions.is_empty(), "{kernel:?} has no launcher");
        for f in l.functions {
            assert!(KERNEL_NAMES.contains(f), "{kernel:?} uses `{f}`, which KERNEL_NAMES does not list");
            used.insert(*f);
        }
    }
    assert_eq!(used, KERNEL_NAMES.iter().copied().collect(), "some kernels are never launched");
    for name in KERNEL_NAMES.iter().chain(BF16_KERNEL_NAMES) {
        assert!(SOURCE.contains(&format!("__global__ void {name}(")), "kernels.cu does not define `{name}`");
    }
    for name in FLASH_KERNEL_NAMES {
        assert!(SOURCE.contains(&format!(" {name}(FLASH_")) || SOURCE.contains(&format!("__global__ void {name}(")));
    }
}

#[test]
fn every_bf16_function_has_a_user_and_the_bf16_plans_kernels_run_natively() {
    let all: BTreeSet<&str> = KERNEL_NAMES.iter().chain(BF16_KERNEL_NAMES).chain(FLASH_KERNEL_NAMES).copied().collect();
    let mut used = BTreeSet::new();
    for kernel in &samples() {
        let Some(l) = bf16_launcher(kernel) else { continue };
        for f in l.functions {
            assert!(all.contains(f), "{kernel:?} on bf16 uses `{f}`, which no name list lists");
            used.insert(*f);
        }
    }
    for name in BF16_KERNEL_NAMES.iter().chain(FLASH_KERNEL_NAMES) {
        assert!(used.contains(name), "`{name}` is never launched");
    }
    // Every kernel a bf16 plan gives bf16 operands has bf16 kernels; those it never does (and kernels
    // added later, until they get bf16 entry points) run widened on the GPU.
    for kernel in &samples() {
        let kind = format!("{kernel:?}");
        let kind = kind.split([' ', '{']).next().unwrap_or_default();
        if WIDENED_IN_BF16_PLANS.contains(&kind) {
            assert!(bf16_launcher(kernel).is_none(), "{kernel:?} has bf16 kernels but bf16 plans run it in f32");
        } else if NATIVE_IN_BF16_PLANS.contains(&kind) {
            assert!(bf16_launcher(kernel).is_some(), "{kernel:?} on bf16 buffers has no bf16 kernel");
        }
    }
}

/// The kernels bf16 plans run on f32 operands only (fills, the loss, the gradient norm, the optimizer).
const WIDENED_IN_BF16_PLANS: [&str; 4] = ["CrossEntropyLoss", "Fill", "GradSquareSum", "OptimizerStep"];

/// The kernels bf16 plans give bf16 operands (from compiling the examples with `--precision bf16`).
const NATIVE_IN_BF16_PLANS: [&str; 44] = [
    "MatMul",
    "BatchedMatMul",
    "BiasAdd",
    "Add",
    "Scale",
    "Gelu",
    "GeluGrad",
    "Silu",
    "SiluGrad",
    "Softmax",
    "SoftmaxGrad",
    "CausalMask",
    "CausalMaskGrad",
    "Dropout",
    "DropoutGrad",
    "Reshape",
    "Transpose",
    "Select",
    "SelectGrad",
    "Attention",
    "AttentionGrad",
    "EmbeddingLookup",
    "EmbeddingGrad",
    "PositionLookup",
    "PositionGrad",
    "RowSum",
    "RowCenteredSquareSum",
    "LayerNormApply",
    "LayerNormGradSums",
    "LayerNormGradInput",
    "LayerNormGradWeight",
    "SumToLast",
    "CrossEntropyMax",
    "CrossEntropyStats",
    "CrossEntropyGrad",
    "SliceShard",
    "Cast",
    "Rotary",
    "RotaryGrad",
    "RowSquareSum",
    "RmsNormApply",
    "RmsNormGradSum",
    "RmsNormGradInput",
    "RmsNormGradWeight",
];

// ---- GPU harness ----------------------------------------------------------------------------------

/// The PTX, compiled once for all tests.
fn ptx() -> Result<Ptx, String> {
    static PTX: OnceLock<Result<Ptx, String>> = OnceLock::new();
    PTX.get_or_init(|| compile_ptx().map_err(String::from)).clone()
}

struct Gpu {
    stream: Arc<CudaStream>,
    kernels: CudaKernels,
}

/// A GPU to test on, or `None` (after printing that `what` did not run, and why) when this machine
/// cannot run CUDA kernels.
fn gpu(what: &str) -> Result<Option<Gpu>, String> {
    gpu_with(what, false)
}

/// As [`gpu`], with the kernels compiled for the GPU's own architecture when `native` (as `optimusc run`
/// compiles them: the flash attention runs only there) instead of the portable PTX.
fn gpu_with(what: &str, native: bool) -> Result<Option<Gpu>, String> {
    let skip = |why: String| {
        if required("OPTIMUS_REQUIRE_CUDA") {
            Err(format!("OPTIMUS_REQUIRE_CUDA=1 but {why}"))
        } else {
            eprintln!("skipped (not run on a GPU): {what}, because {why}");
            Ok(None)
        }
    };
    // SAFETY: only tries to open the shared library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return skip("the CUDA driver (libcuda) cannot be loaded".into());
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => return skip("there is no GPU".into()),
        Err(e) => return skip(format!("there is no usable GPU ({e})")),
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return skip("libnvrtc cannot be loaded".into());
    }
    let ctx = CudaContext::new(0).map_err(|e| format!("opening GPU 0: {e}"))?;
    let stream = ctx.new_stream().map_err(|e| format!("creating a stream: {e}"))?;
    let kernels = if native {
        CudaKernels::new(&ctx, stream.clone())?
    } else {
        CudaKernels::with_ptx(&ctx, stream.clone(), ptx()?)?
    };
    Ok(Some(Gpu { stream, kernels }))
}

/// Deterministic uniforms in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn tensor(&mut self, shape: &[u64]) -> Tensor {
        let n = shape.iter().product::<u64>() as usize;
        Tensor::from_f32(shape, (0..n).map(|_| self.next()).collect())
    }

    fn scaled(&mut self, shape: &[u64], scale: f32) -> Tensor {
        let mut t = self.tensor(shape);
        if let Data::F32(v) = &mut t.data {
            v.iter_mut().for_each(|x| *x *= scale);
        }
        t
    }

    /// Integers in [lo, hi).
    fn ints(&mut self, shape: &[u64], lo: i32, hi: i32) -> Tensor {
        let n = shape.iter().product::<u64>() as usize;
        let span = (hi - lo) as f32;
        let v = (0..n).map(|_| lo + (((self.next() + 1.0) * 0.5 * span) as i32).min(hi - lo - 1)).collect();
        Tensor::from_i32(shape, v)
    }
}

fn meta_with(shape: &[u64], logical: &[u64], layout: Layout, dtype: DType) -> Buffer {
    Buffer {
        id: BufferId(0),
        name: "out".into(),
        dtype,
        logical_shape: logical.to_vec(),
        layout,
        shape: shape.to_vec(),
        role: Role::Workspace,
    }
}

fn meta(shape: &[u64]) -> Buffer {
    meta_with(shape, shape, Layout::REPLICATED, DType::F32)
}

/// One kernel run on both backends.
struct Case {
    kernel: Kernel,
    inputs: Vec<Tensor>,
    out: Buffer,
    /// The output's contents before the kernel (zeros when `None`).
    init: Option<Tensor>,
    at: (u64, u64, Mesh),
    tol: f64,
    /// The CPU rejects this case (the GPU must reject it with the same message).
    fails: bool,
}

const ONE: Mesh = Mesh::new(1, 1);

impl Case {
    fn new(kernel: Kernel, inputs: Vec<Tensor>, out: &[u64]) -> Case {
        Case { kernel, inputs, out: meta(out), init: None, at: (0, 0, ONE), tol: 1e-5, fails: false }
    }

    fn tol(mut self, tol: f64) -> Case {
        self.tol = tol;
        self
    }

    fn on(mut self, i: u64, j: u64, mesh: Mesh) -> Case {
        self.at = (i, j, mesh);
        self
    }

    fn output(mut self, out: Buffer) -> Case {
        self.out = out;
        self
    }

    fn init(mut self, t: Tensor) -> Case {
        self.init = Some(t);
        self
    }

    fn fails(mut self) -> Case {
        self.fails = true;
        self
    }

    fn describe(&self) -> String {
        format!("{:?} on {:?}", self.kernel, self.inputs.iter().map(|t| &t.shape).collect::<Vec<_>>())
    }

    /// The output's initial contents.
    fn initial(&self) -> Tensor {
        self.init.clone().unwrap_or_else(|| Tensor::zeros(self.out.dtype, &self.out.shape))
    }

    /// The CPU's output, checked against whether the case should fail.
    fn on_cpu(&self) -> Result<Result<Tensor, String>, String> {
        let (i, j, mesh) = self.at;
        let ctx = KernelContext { coords: Coords::new(i, j, 0), mesh, seed: 1234, inputs: &[], output: &self.out };
        let mut want = self.initial();
        let refs: Vec<&Tensor> = self.inputs.iter().collect();
        let result = cpu::run(&self.kernel, &refs, &mut want, &ctx).map(|()| want).map_err(String::from);
        match (&result, self.fails) {
            (Ok(_), true) => Err(format!("{}: the CPU accepts a case meant to fail", self.describe())),
            (Err(e), false) => Err(format!("{}: the CPU fails: {e}", self.describe())),
            _ => Ok(result),
        }
    }
}

/// Every |got - want| <= tol * max(1, |want|) (infinities and NaNs must match); integers exactly.
fn close(got: &Tensor, want: &Tensor, tol: f64) -> R {
    if got.shape != want.shape {
        return Err(format!("shape {:?}, expected {:?}", got.shape, want.shape));
    }
    match (&got.data, &want.data) {
        (Data::I32(g), Data::I32(w)) if g == w => Ok(()),
        (Data::F32(g), Data::F32(w)) if g.len() == w.len() => {
            for (k, (&g, &w)) in g.iter().zip(w).enumerate() {
                let (g64, w64) = (f64::from(g), f64::from(w));
                let ok = (g64 - w64).abs() <= tol * w64.abs().max(1.0) || g == w || (g.is_nan() && w.is_nan());
                if !ok {
                    return Err(format!("element {k}: got {g}, want {w}"));
                }
            }
            Ok(())
        }
        _ => Err(format!("contents differ: got {:?}, want {:?}", got.data, want.data)),
    }
}

impl Gpu {
    fn upload(&self, t: &Tensor) -> Result<DeviceTensor, String> {
        DeviceTensor::upload(&self.stream, t).map_err(String::from)
    }

    /// Runs a case on the CPU and the GPU: both succeed with close outputs, or both fail with the same error.
    fn check(&mut self, case: &Case) -> R {
        let (i, j, mesh) = case.at;
        let ctx = KernelContext { coords: Coords::new(i, j, 0), mesh, seed: 1234, inputs: &[], output: &case.out };
        let cpu_result = case.on_cpu()?;
        let dev: Vec<DeviceTensor> = case.inputs.iter().map(|t| self.upload(t)).collect::<Result<_, _>>()?;
        let dev_refs: Vec<&DeviceTensor> = dev.iter().collect();
        let mut got = self.upload(&case.initial())?;
        let gpu_result = self.kernels.run(&case.kernel, &dev_refs, &mut got, &ctx).map_err(String::from);
        match (cpu_result, gpu_result) {
            (Ok(want), Ok(())) => {
                close(&got.download(&self.stream)?, &want, case.tol).map_err(|e| format!("{}: {e}", case.describe()))
            }
            (Err(a), Err(b)) if a == b => Ok(()),
            (a, b) => Err(format!("{}: the CPU gives {:?}, the GPU {b:?}", case.describe(), a.map(|_| ()))),
        }
    }

    fn check_all(&mut self, cases: &[Case]) -> R {
        cases.iter().try_for_each(|c| self.check(c))
    }
}

/// Checks a list of cases (named `what`) on a GPU, or skips.
fn on_gpu(what: &str, cases: impl FnOnce(&mut Rng) -> Result<Vec<Case>, String>) -> R {
    with_gpu(&format!("the f32 {what} kernels against the CPU"), |g, rng| g.check_all(&cases(rng)?))
}

/// Runs `body` (which checks `what`) on a GPU, or skips.
fn with_gpu(what: &str, body: impl FnOnce(&mut Gpu, &mut Rng) -> R) -> R {
    match gpu(what)? {
        Some(mut g) => body(&mut g, &mut Rng(7)),
        None => Ok(()),
    }
}

/// The CPU's output of a kernel (to make consistent inputs for later kernels).
fn cpu_eval(kernel: Kernel, inputs: &[&Tensor], shape: &[u64], at: (u64, u64, Mesh)) -> Result<Tensor, String> {
    let out = meta(shape);
    let mut t = Tensor::zeros(DType::F32, shape);
    let ctx = KernelContext { coords: Coords::new(at.0, at.1, 0), mesh: at.2, seed: 1234, inputs: &[], output: &out };
    cpu::run(&kernel, inputs, &mut t, &ctx)?;
    Ok(t)
}

// ---- the cases ------------------------------------------------------------------------------------

fn product_cases(rng: &mut Rng) -> Result<Vec<Case>, String> {
    let mut cases = Vec::new();
    for (ta, tb, accumulate) in (0..8).map(|k| (k & 1 == 1, k & 2 == 2, k & 4 == 4)) {
        let a = if ta { rng.tensor(&[5, 6]) } else { rng.tensor(&[2, 3, 5]) };
        let b = if tb { rng.tensor(&[7, 5]) } else { rng.tensor(&[5, 7]) };
        let kernel = Kernel::MatMul { transpose_a: ta, transpose_b: tb, accumulate };
        cases.push(Case::new(kernel, vec![a, b], &[2, 3, 7]).init(rng.tensor(&[2, 3, 7])));
    }
    let plain = Kernel::MatMul { transpose_a: false, transpose_b: false, accumulate: false };
    let batched = vec![rng.tensor(&[2, 3, 4, 5]), rng.tensor(&[2, 3, 5, 6])];
    cases.extend([
        Case::new(plain.clone(), vec![rng.tensor(&[130, 300]), rng.tensor(&[300, 70])], &[130, 70]),
        Case::new(plain.clone(), vec![rng.tensor(&[6, 0]), rng.tensor(&[0, 7])], &[6, 7]).init(rng.tensor(&[6, 7])),
        Case::new(plain, vec![rng.tensor(&[6, 4]), rng.tensor(&[5, 7])], &[6, 7]).fails(),
        Case::new(Kernel::BatchedMatMul, batched, &[2, 3, 4, 6]),
        Case::new(Kernel::BatchedMatMul, vec![rng.tensor(&[2, 4, 5]), rng.tensor(&[3, 5, 6])], &[2, 4, 6]).fails(),
    ]);
    // The output layer's three products at an odd vocabulary, whose rows are not 16-byte aligned (bf16
    // products realign them): logits, the input gradient, the accumulated weight gradient.
    let (x, w, dl) = (rng.tensor(&[96, 64]), rng.tensor(&[517, 64]), rng.tensor(&[96, 517]));
    let mm = |ta, tb, accumulate| Kernel::MatMul { transpose_a: ta, transpose_b: tb, accumulate };
    cases.push(Case::new(mm(false, true, false), vec![x.clone(), w.clone()], &[96, 517]));
    // Sums of 517 products: two summation orders differ by up to k ulp of the largest partial sum, which
    // here reaches ~10 while outputs can be near 0.5, so the tolerance is 1e-4 (1e-5 failed on the GPU
    // once the CPU's products changed order).
    cases.push(Case::new(mm(false, false, false), vec![dl.clone(), w], &[96, 64]).tol(1e-4));
    cases.push(Case::new(mm(true, false, true), vec![dl, x], &[517, 64]).init(rng.tensor(&[517, 64])));
    Ok(cases)
}

fn elementwise_cases(rng: &mut Rng) -> Result<Vec<Case>, String> {
    let (x, s) = (rng.scaled(&[7, 45], 4.0), [7, 45]);
    let int4 = meta_with(&[4], &[4], Layout::REPLICATED, DType::I32);
    let mut cases = pointwise_cases(rng, &x);
    cases.extend([
        Case::new(Kernel::Mul, vec![x.clone(), rng.tensor(&[7, 44])], &s).fails(),
        Case::new(Kernel::CausalMask, vec![rng.tensor(&[2, 5, 5])], &[2, 5, 5]),
        Case::new(Kernel::CausalMask, vec![rng.tensor(&[3, 4, 6])], &[3, 4, 6]),
        Case::new(Kernel::CausalMaskGrad, vec![rng.tensor(&[2, 6, 4])], &[2, 6, 4]),
        Case::new(Kernel::Fill { value: -2.5 }, vec![], &[3, 5]),
        Case::new(Kernel::Fill { value: 7.9 }, vec![], &[4]).output(int4),
        Case::new(Kernel::Add, vec![x.clone(), rng.tensor(&[7, 44])], &s).fails(),
        Case::new(Kernel::BiasAdd, vec![x, rng.tensor(&[44])], &s).fails(),
        // More elements than one grid-stride pass covers.
        Case::new(Kernel::Scale { factor: -1.5 }, vec![rng.tensor(&[5_000_001])], &[5_000_001]),
    ]);
    // Counts and widths that are multiples of 8: on bf16 buffers (fresh allocations, 16-byte aligned)
    // these run the eight-at-a-time kernels (`_bf16x8`).
    let aligned = rng.scaled(&[16, 48], 4.0);
    cases.extend(pointwise_cases(rng, &aligned));
    cases.extend([
        Case::new(Kernel::BiasAdd, vec![rng.tensor(&[9, 40]), rng.tensor(&[40])], &[9, 40]),
        // More eight-element words than one grid-stride pass covers (16384 blocks of 256 threads).
        Case::new(Kernel::Scale { factor: -1.5 }, vec![rng.tensor(&[34_000_000])], &[34_000_000]),
    ]);
    Ok(cases)
}

/// Every one-element-in, one-element-out kernel on `x` (a [rows, width] matrix): bias add, add, multiply,
/// scale, cast, the activations and their gradients.
fn pointwise_cases(rng: &mut Rng, x: &Tensor) -> Vec<Case> {
    let s = x.shape.clone();
    let (y, width) = (rng.tensor(&s), s[s.len() - 1]);
    vec![
        Case::new(Kernel::BiasAdd, vec![x.clone(), rng.tensor(&[width])], &s),
        Case::new(Kernel::Add, vec![x.clone(), y.clone()], &s),
        Case::new(Kernel::Mul, vec![x.clone(), y.clone()], &s),
        Case::new(Kernel::Scale { factor: 0.3 }, vec![x.clone()], &s),
        Case::new(Kernel::Cast, vec![x.clone()], &s),
        Case::new(Kernel::Gelu { approximate: true }, vec![x.clone()], &s).tol(1e-4),
        Case::new(Kernel::Gelu { approximate: false }, vec![x.clone()], &s).tol(1e-4),
        Case::new(Kernel::GeluGrad { approximate: true }, vec![y.clone(), x.clone()], &s).tol(1e-4),
        Case::new(Kernel::GeluGrad { approximate: false }, vec![y.clone(), x.clone()], &s).tol(1e-4),
        Case::new(Kernel::Silu, vec![x.clone()], &s).tol(1e-4),
        Case::new(Kernel::SiluGrad, vec![y, x.clone()], &s).tol(1e-4),
    ]
}

fn softmax_cases(rng: &mut Rng) -> Result<Vec<Case>, String> {
    let mut cases = Vec::new();
    for (rows, width) in [(37, 1000), (5, 3), (300, 33), (2, 5000)] {
        let s = [rows, width];
        let x = rng.scaled(&s, 20.0);
        let y = cpu_eval(Kernel::Softmax, &[&x], &s, (0, 0, ONE))?;
        cases.push(Case::new(Kernel::Softmax, vec![x], &s).tol(1e-4));
        cases.push(Case::new(Kernel::SoftmaxGrad, vec![rng.tensor(&s), y], &s).tol(1e-4));
    }
    Ok(cases)
}

fn dropout_cases(rng: &mut Rng) -> Result<Vec<Case>, String> {
    let (two, halves) = (Mesh::new(2, 2), Mesh::new(1, 2));
    let layout = Layout::new(Placement::shard(0), Placement::shard(1));
    let sharded = meta_with(&[4, 3], &[8, 6], layout, DType::F32);
    let factored_layout = Layout::new(Placement::Replicate, Placement::shard_factor(1, 3, 2));
    let factored = meta_with(&[4, 6], &[4, 12], factored_layout, DType::F32);
    let x = rng.tensor(&[4, 3]);
    let drop = |p: f64| Case::new(Kernel::Dropout { p, key: 5 }, vec![x.clone()], &[4, 3]).output(sharded.clone());
    Ok(vec![
        drop(0.3).on(1, 0, two),
        Case::new(Kernel::DropoutGrad { p: 0.3, key: 5 }, vec![x.clone()], &[4, 3])
            .output(sharded.clone())
            .on(0, 1, two),
        drop(0.0).on(1, 1, two),
        drop(1.0).on(1, 1, two),
        drop(1.5).on(1, 1, two).fails(),
        Case::new(Kernel::Dropout { p: 0.5, key: 9 }, vec![rng.tensor(&[4, 6])], &[4, 6])
            .output(factored)
            .on(0, 1, halves),
        Case::new(Kernel::Dropout { p: 0.1, key: 2 }, vec![rng.tensor(&[300, 257])], &[300, 257]),
    ])
}

fn data_movement_cases(rng: &mut Rng) -> Result<Vec<Case>, String> {
    let x = rng.tensor(&[3, 4, 5]);
    let ids = rng.ints(&[3, 4, 5], -50, 50);
    let int = |shape: &[u64]| meta_with(shape, shape, Layout::REPLICATED, DType::I32);
    let shard = Placement::Shard { dim: 1, outer: 3, inner: 2 };
    let slice = |axis: u8, placement: Placement| Kernel::SliceShard { axis, placement };
    Ok(vec![
        Case::new(Kernel::Reshape, vec![x.clone()], &[12, 5]),
        Case::new(Kernel::Reshape, vec![ids.clone()], &[60]).output(int(&[60])),
        Case::new(Kernel::Reshape, vec![ids.clone()], &[60]).fails(),
        Case::new(Kernel::Transpose { dim0: 0, dim1: 2 }, vec![x.clone()], &[5, 4, 3]),
        Case::new(Kernel::Transpose { dim0: 2, dim1: 1 }, vec![x.clone()], &[3, 5, 4]),
        Case::new(Kernel::Transpose { dim0: 1, dim1: 1 }, vec![x.clone()], &[3, 4, 5]),
        Case::new(Kernel::Transpose { dim0: 0, dim1: 1 }, vec![ids.clone()], &[4, 3, 5]).output(int(&[4, 3, 5])),
        Case::new(Kernel::Select { dim: 1, index: 2 }, vec![x.clone()], &[3, 5]),
        Case::new(Kernel::Select { dim: 2, index: 4 }, vec![ids], &[3, 4]).output(int(&[3, 4])),
        Case::new(Kernel::Select { dim: 1, index: 9 }, vec![x.clone()], &[3, 5]).fails(),
        Case::new(Kernel::SelectGrad { dim: 0, index: 1 }, vec![rng.tensor(&[4, 5])], &[3, 4, 5]).init(x.clone()),
        Case::new(slice(1, shard), vec![rng.tensor(&[4, 24])], &[4, 12]).on(0, 1, Mesh::new(1, 2)),
        Case::new(slice(0, Placement::shard(0)), vec![rng.tensor(&[6, 5])], &[2, 5]).on(2, 0, Mesh::new(3, 1)),
        Case::new(slice(0, Placement::Replicate), vec![x.clone()], &[3, 4, 5]),
        Case::new(slice(0, Placement::Partial), vec![x], &[3, 4, 5]).fails(),
    ])
}

fn attention_cases(rng: &mut Rng) -> Result<Vec<Case>, String> {
    let (heads, d) = (3u64, 4u64);
    let w = heads * d;
    let mut cases = Vec::new();
    for causal in [false, true] {
        let fused = rng.tensor(&[2, 5, 3 * w]);
        let dy = rng.tensor(&[2, 5, w]);
        let attention = Kernel::Attention { heads, kv_heads: heads, causal, fused: true };
        cases.push(Case::new(attention, vec![fused.clone()], &[2, 5, w]).tol(1e-4));
        let grad = Kernel::AttentionGrad { heads, kv_heads: heads, causal, fused: true, wrt: 0 };
        cases.push(Case::new(grad, vec![dy.clone(), fused], &[2, 5, 3 * w]).tol(1e-4));
        let (q, k, v) = (rng.tensor(&[2, 5, w]), rng.tensor(&[2, 7, w]), rng.tensor(&[2, 7, w]));
        let attention = Kernel::Attention { heads, kv_heads: heads, causal, fused: false };
        cases.push(Case::new(attention, vec![q.clone(), k.clone(), v.clone()], &[2, 5, w]).tol(1e-4));
        for (wrt, shape) in [(0u8, [2, 5, w]), (1, [2, 7, w]), (2, [2, 7, w])] {
            let grad = Kernel::AttentionGrad { heads, kv_heads: heads, causal, fused: false, wrt };
            let inputs = vec![dy.clone(), q.clone(), k.clone(), v.clone()];
            cases.push(Case::new(grad, inputs, &shape).tol(1e-4));
        }
    }
    let long = Kernel::Attention { heads: 2, kv_heads: 2, causal: true, fused: true };
    cases.push(Case::new(long, vec![rng.tensor(&[1, 300, 3 * 2 * 32])], &[1, 300, 64]).tol(1e-4));
    let long_grad = Kernel::AttentionGrad { heads: 2, kv_heads: 2, causal: true, fused: true, wrt: 0 };
    let inputs = vec![rng.tensor(&[1, 300, 64]), rng.tensor(&[1, 300, 3 * 2 * 32])];
    cases.push(Case::new(long_grad, inputs, &[1, 300, 192]).tol(1e-4));
    let wrong = Kernel::Attention { heads: 5, kv_heads: 5, causal: false, fused: false };
    cases.push(Case::new(wrong, vec![rng.tensor(&[2, 5, 12]); 3], &[2, 5, 12]).fails());
    cases.extend(grouped_query_cases(rng));
    Ok(cases)
}

/// Grouped-query attention (6 query heads over 2 or 3 kv heads, and over 1), forward and every
/// gradient, the keys longer than the queries.
fn grouped_query_cases(rng: &mut Rng) -> Vec<Case> {
    let (heads, d) = (6u64, 4u64);
    let mut cases = Vec::new();
    for (kv_heads, causal) in [(2u64, true), (3, false), (1, true)] {
        let (q, dy) = (rng.tensor(&[2, 5, heads * d]), rng.tensor(&[2, 5, heads * d]));
        let kv = [2, 7, kv_heads * d];
        let (k, v) = (rng.tensor(&kv), rng.tensor(&kv));
        let attention = Kernel::Attention { heads, kv_heads, causal, fused: false };
        cases.push(Case::new(attention, vec![q.clone(), k.clone(), v.clone()], &[2, 5, heads * d]).tol(1e-4));
        for (wrt, shape) in [(0u8, [2, 5, heads * d]), (1, kv), (2, kv)] {
            let grad = Kernel::AttentionGrad { heads, kv_heads, causal, fused: false, wrt };
            let inputs = vec![dy.clone(), q.clone(), k.clone(), v.clone()];
            cases.push(Case::new(grad, inputs, &shape).tol(1e-4));
        }
    }
    let wrong = Kernel::Attention { heads, kv_heads: 4, causal: true, fused: false };
    let inputs = vec![rng.tensor(&[2, 5, heads * d]), rng.tensor(&[2, 5, 16]), rng.tensor(&[2, 5, 16])];
    cases.push(Case::new(wrong, inputs, &[2, 5, heads * d]).fails());
    cases
}

/// Rotary embeddings and their backward, on short and long sequences (positions into the
/// thousands, where the float32 rounding of the angles matters) and with leading dimensions.
fn rotary_cases(rng: &mut Rng) -> Result<Vec<Case>, String> {
    let mut cases = Vec::new();
    for (shape, heads, theta) in [
        (vec![2u64, 5, 12], 3u64, 10000.0),
        (vec![1, 3000, 64], 1, 10000.0),
        (vec![2, 3, 4, 16], 2, 500000.0),
        (vec![7, 8], 4, 10.0),
    ] {
        let x = rng.tensor(&shape);
        cases.push(Case::new(Kernel::Rotary { heads, theta }, vec![x.clone()], &shape).tol(1e-5));
        cases.push(Case::new(Kernel::RotaryGrad { heads, theta }, vec![x], &shape).tol(1e-5));
    }
    let odd = rng.tensor(&[2, 6]);
    cases.push(Case::new(Kernel::Rotary { heads: 2, theta: 10.0 }, vec![odd], &[2, 6]).fails());
    Ok(cases)
}

fn embedding_cases(rng: &mut Rng) -> Result<Vec<Case>, String> {
    let offset = Offset { axis: Some(1), block: 5 };
    let on = |c: Case| c.on(0, 1, Mesh::new(1, 2));
    let lookup = |masked: bool| Kernel::EmbeddingLookup { offset, masked };
    let grad = |masked: bool| Kernel::EmbeddingGrad { offset, masked, padding: None };
    let padded = |id: u64| Kernel::EmbeddingGrad { offset, masked: true, padding: Some(id) };
    let ids = rng.ints(&[2, 6], 0, 10);
    let local = rng.ints(&[2, 6], 5, 10);
    let bad = Tensor::from_i32(&[3], vec![6, 12, 4]);
    Ok(vec![
        on(Case::new(lookup(true), vec![ids.clone(), rng.tensor(&[5, 4])], &[2, 6, 4])),
        on(Case::new(lookup(false), vec![local.clone(), rng.tensor(&[5, 4])], &[2, 6, 4])),
        on(Case::new(lookup(false), vec![bad.clone(), rng.tensor(&[5, 4])], &[3, 4]).fails()),
        on(Case::new(grad(true), vec![ids.clone(), rng.tensor(&[2, 6, 4])], &[5, 4])),
        // The padding id's row (global id 7, local row 2 of device (0, 1)) gets nothing.
        on(Case::new(padded(7), vec![ids, rng.tensor(&[2, 6, 4])], &[5, 4])),
        on(Case::new(grad(false), vec![local, rng.tensor(&[2, 6, 4])], &[5, 4])),
        on(Case::new(grad(false), vec![bad, rng.tensor(&[3, 4])], &[5, 4]).fails()),
        Case::new(Kernel::PositionLookup, vec![rng.tensor(&[8, 4])], &[2, 5, 4]),
        Case::new(Kernel::PositionLookup, vec![rng.tensor(&[4, 4])], &[2, 5, 4]).fails(),
        Case::new(Kernel::PositionGrad, vec![rng.tensor(&[2, 5, 4])], &[8, 4]).init(rng.tensor(&[8, 4])),
        Case::new(Kernel::PositionGrad, vec![rng.tensor(&[600, 3, 70])], &[4, 70]).tol(5e-4),
    ])
}

/// (sum, square sum) inputs of LayerNorm kernels: any sums, positive square sums.
fn ln_stats(rng: &mut Rng, rows: u64, n: u64) -> (Tensor, Tensor) {
    let sum = rng.scaled(&[rows, 1], n as f32 * 0.3);
    let mut sq = rng.tensor(&[rows, 1]);
    if let Data::F32(v) = &mut sq.data {
        v.iter_mut().for_each(|x| *x = n as f32 * (0.6 + 0.5 * *x));
    }
    (sum, sq)
}

fn layer_norm_cases(rng: &mut Rng) -> Result<Vec<Case>, String> {
    let mut cases = Vec::new();
    // (2048, 264): column sums of bf16 buffers in two passes (a width of whole 16-byte words, two blocks
    // of 256 columns across, many row chunks).
    for (rows, width) in [(6u64, 33u64), (3000, 70), (4, 1000), (2048, 264)] {
        // Long reductions: the CPU's own f32 sums drift (sequentially over rows by ~1e-4), so the inputs
        // stay small and the tolerance grows with the reductions' length.
        let long = rows > 1000 || width > 100;
        let (tol, column_tol) = if long { (1e-4, 1e-3) } else { (1e-5, 1e-5) };
        let (n, eps, s) = (2 * width, 1e-5, [rows, width]);
        let x = if long { rng.tensor(&s) } else { rng.scaled(&s, 3.0) };
        let (dy, gamma, beta) = (rng.tensor(&s), rng.tensor(&[width]), rng.tensor(&[width]));
        let (sum, sq) = ln_stats(rng, rows, n);
        let sums_kernel = Kernel::LayerNormGradSums { n, eps };
        let sums = cpu_eval(sums_kernel.clone(), &[&dy, &x, &gamma, &sum, &sq], &[rows, 2], (0, 0, ONE))?;
        let apply = vec![x.clone(), sum.clone(), sq.clone(), gamma.clone(), beta];
        let grad_sums = vec![dy.clone(), x.clone(), gamma.clone(), sum.clone(), sq.clone()];
        let grad_input = vec![dy.clone(), x.clone(), gamma, sum.clone(), sq.clone(), sums];
        cases.extend([
            Case::new(Kernel::RowSum, vec![x.clone()], &[rows, 1]).tol(tol),
            Case::new(Kernel::RowCenteredSquareSum { n }, vec![x.clone(), sum.clone()], &[rows, 1]).tol(tol),
            Case::new(Kernel::LayerNormApply { n, eps }, apply, &s).tol(tol),
            Case::new(sums_kernel, grad_sums, &[rows, 2]).tol(tol),
            Case::new(Kernel::LayerNormGradInput { n, eps }, grad_input, &s).tol(tol),
            Case::new(Kernel::LayerNormGradWeight { n, eps }, vec![dy, x.clone(), sum, sq], &[width]).tol(column_tol),
            Case::new(Kernel::SumToLast, vec![x], &[width]).tol(column_tol),
        ]);
    }
    let no_size = vec![rng.tensor(&[2, 3]), rng.tensor(&[2, 1])];
    cases.push(Case::new(Kernel::RowCenteredSquareSum { n: 0 }, no_size, &[2, 1]).fails());
    Ok(cases)
}

/// Positive square sums of rows of `n` elements (RMSNorm statistics).
fn square_sums(rng: &mut Rng, rows: u64, n: u64) -> Tensor {
    let mut sq = rng.tensor(&[rows, 1]);
    if let Data::F32(v) = &mut sq.data {
        v.iter_mut().for_each(|x| *x = n as f32 * (0.6 + 0.5 * *x));
    }
    sq
}

fn rms_norm_cases(rng: &mut Rng) -> Result<Vec<Case>, String> {
    let mut cases = Vec::new();
    // (2048, 264): column sums of bf16 buffers in two passes (a width of whole 16-byte words, two blocks
    // of 256 columns across, many row chunks).
    for (rows, width) in [(6u64, 33u64), (3000, 70), (4, 1000), (2048, 264)] {
        let long = rows > 1000 || width > 100;
        let (tol, column_tol) = if long { (1e-4, 1e-3) } else { (1e-5, 1e-5) };
        let (n, eps, s) = (2 * width, 1e-6, [rows, width]);
        let x = if long { rng.tensor(&s) } else { rng.scaled(&s, 3.0) };
        let (dy, weight) = (rng.tensor(&s), rng.tensor(&[width]));
        let sq = square_sums(rng, rows, n);
        let sums = cpu_eval(Kernel::RmsNormGradSum, &[&dy, &x, &weight], &[rows, 1], (0, 0, ONE))?;
        let grad_input = vec![dy.clone(), x.clone(), weight.clone(), sq.clone(), sums];
        cases.extend([
            Case::new(Kernel::RowSquareSum, vec![x.clone()], &[rows, 1]).tol(tol),
            Case::new(Kernel::RmsNormApply { n, eps }, vec![x.clone(), sq.clone(), weight.clone()], &s).tol(tol),
            Case::new(Kernel::RmsNormGradSum, vec![dy.clone(), x.clone(), weight], &[rows, 1]).tol(tol),
            Case::new(Kernel::RmsNormGradInput { n, eps }, grad_input, &s).tol(tol),
            Case::new(Kernel::RmsNormGradWeight { n, eps }, vec![dy, x, sq], &[width]).tol(column_tol),
        ]);
    }
    let no_size = vec![rng.tensor(&[2, 3]), rng.tensor(&[2, 1]), rng.tensor(&[3])];
    cases.push(Case::new(Kernel::RmsNormApply { n: 0, eps: 1e-6 }, no_size, &[2, 3]).fails());
    Ok(cases)
}

fn cross_entropy_cases(rng: &mut Rng) -> Result<Vec<Case>, String> {
    let mesh = Mesh::new(1, 2);
    let mut cases = Vec::new();
    // (33, 517): rows that start at every alignment (the bf16 kernels read eight logits at a time).
    for (rows, width, valid) in [(6u64, 10u64, 17u64), (40, 3000, 5500), (33, 517, 1000)] {
        let offset = Offset { axis: Some(1), block: width };
        let logits = rng.scaled(&[rows, width], 8.0);
        // Every third target is ignored (-100, PyTorch's ignore_index).
        let drawn = rng.ints(&[rows], 0, valid as i32);
        let ignored = drawn.i32()?.iter().enumerate().map(|(r, &t)| if r % 3 == 1 { IGNORE_INDEX } else { t });
        let targets = Tensor::from_i32(&[rows], ignored.collect());
        let (max_kernel, stats_kernel) =
            (Kernel::CrossEntropyMax { offset, valid }, Kernel::CrossEntropyStats { offset, valid });
        let max = cpu_eval(max_kernel.clone(), &[&logits], &[rows, 1], (0, 1, mesh))?;
        let stats = cpu_eval(stats_kernel.clone(), &[&logits, &targets, &max], &[rows, 2], (0, 1, mesh))?;
        let dloss = Tensor::from_f32(&[], vec![0.7]);
        let bad = Tensor::from_i32(&[rows], (0..rows as i32).map(|r| if r == 3 { valid as i32 } else { 1 }).collect());
        let count = cpu_eval(Kernel::CrossEntropyCount, &[&targets], &[1], (0, 1, mesh))?;
        let grad = Kernel::CrossEntropyGrad { offset, valid };
        let grad_inputs =
            vec![logits.clone(), targets.clone(), max.clone(), stats.clone(), dloss.clone(), count.clone()];
        let bad_grad_inputs = vec![logits.clone(), bad.clone(), max.clone(), stats.clone(), dloss, count.clone()];
        let batch = [
            Case::new(max_kernel, vec![logits.clone()], &[rows, 1]),
            Case::new(stats_kernel.clone(), vec![logits.clone(), targets.clone(), max.clone()], &[rows, 2]).tol(1e-4),
            Case::new(stats_kernel, vec![logits, bad, max.clone()], &[rows, 2]).fails(),
            Case::new(Kernel::CrossEntropyCount, vec![targets.clone()], &[1]),
            Case::new(Kernel::CrossEntropyLoss, vec![max, stats, targets, count], &[]),
            Case::new(grad.clone(), grad_inputs, &[rows, width]).tol(1e-4),
            Case::new(grad, bad_grad_inputs, &[rows, width]).fails(),
        ];
        cases.extend(batch.into_iter().map(|c| c.on(0, 1, mesh)));
    }
    Ok(cases)
}

type Cases = fn(&mut Rng) -> Result<Vec<Case>, String>;

/// Every list of cases, by name.
const ALL_CASES: [(&str, Cases); 11] = [
    ("products", product_cases),
    ("elementwise", elementwise_cases),
    ("softmax", softmax_cases),
    ("dropout", dropout_cases),
    ("data movement", data_movement_cases),
    ("attention", attention_cases),
    ("rotary", rotary_cases),
    ("embeddings", embedding_cases),
    ("layer norm", layer_norm_cases),
    ("rms norm", rms_norm_cases),
    ("cross-entropy", cross_entropy_cases),
];

/// The GPU tests' cases do what they claim on the CPU (so that "both fail alike" is never vacuous).
#[test]
fn every_gpu_case_behaves_as_declared_on_the_cpu() -> R {
    let mut rng = Rng(7);
    for (name, cases) in ALL_CASES {
        for case in cases(&mut rng)? {
            case.on_cpu().map(|_| ()).map_err(|e| format!("{name}: {e}"))?;
        }
    }
    Ok(())
}

// ---- GPU tests ------------------------------------------------------------------------------------

#[test]
fn gpu_products_match_the_cpu() -> R {
    on_gpu("products", product_cases)
}

#[test]
fn gpu_elementwise_kernels_match_the_cpu() -> R {
    on_gpu("elementwise", elementwise_cases)
}

#[test]
fn gpu_softmax_matches_the_cpu() -> R {
    on_gpu("softmax", softmax_cases)
}

#[test]
fn gpu_dropout_takes_the_cpus_mask() -> R {
    on_gpu("dropout", dropout_cases)
}

#[test]
fn gpu_data_movement_matches_the_cpu() -> R {
    on_gpu("data movement", data_movement_cases)
}

#[test]
fn gpu_attention_matches_the_cpu() -> R {
    on_gpu("attention", attention_cases)
}

#[test]
fn gpu_rotary_matches_the_cpu() -> R {
    on_gpu("rotary", rotary_cases)
}

#[test]
fn gpu_embeddings_match_the_cpu() -> R {
    on_gpu("embedding", embedding_cases)
}

#[test]
fn gpu_layer_norm_and_sums_match_the_cpu() -> R {
    on_gpu("layer norm", layer_norm_cases)
}

#[test]
fn gpu_rms_norm_matches_the_cpu() -> R {
    on_gpu("rms norm", rms_norm_cases)
}

#[test]
fn gpu_cross_entropy_matches_the_cpu() -> R {
    on_gpu("cross-entropy", cross_entropy_cases)
}

fn settings(kind: OptimizerKind, momentum: f32, weight_decay: f32) -> OptimizerSettings {
    OptimizerSettings { kind, lr: 0.01, weight_decay, momentum, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
}

impl Gpu {
    /// Three optimizer steps on the CPU and the GPU from the same state.
    fn check_optimizer(&mut self, rng: &mut Rng, s: &OptimizerSettings) -> R {
        let shape = [37, 29];
        let mut host = [rng.tensor(&shape), rng.scaled(&shape, 0.1), rng.scaled(&shape, 0.1)];
        if let Data::F32(v) = &mut host[2].data {
            v.iter_mut().for_each(|x| *x = x.abs());
        }
        let mut dev: Vec<DeviceTensor> = host.iter().map(|t| self.upload(t)).collect::<Result<_, _>>()?;
        for step in 1..=3 {
            let grad = rng.tensor(&shape);
            let [p, m, v] = &mut host;
            cpu::optimizer_step(p, &grad, m, v, s, step)?;
            let dgrad = self.upload(&grad)?;
            let [dp, dm, dv] = dev.as_mut_slice() else { return Err("three tensors".into()) };
            self.kernels.optimizer_step(dp, &dgrad, dm, dv, s, step)?;
        }
        for (k, (d, h)) in dev.iter().zip(&host).enumerate() {
            close(&d.download(&self.stream)?, h, 1e-5).map_err(|e| format!("{s:?}, tensor {k}: {e}"))?;
        }
        Ok(())
    }
}

#[test]
fn gpu_optimizer_steps_match_the_cpu() -> R {
    with_gpu("the optimizer steps against the CPU", |g, rng| {
        g.check_optimizer(rng, &settings(OptimizerKind::Sgd, 0.9, 0.01))?;
        g.check_optimizer(rng, &settings(OptimizerKind::Sgd, 0.0, 0.0))?;
        g.check_optimizer(rng, &settings(OptimizerKind::AdamW, 0.0, 0.01))?;
        g.check_optimizer(rng, &settings(OptimizerKind::AdamW, 0.0, 0.0))
    })
}

/// The gradient norm's sum of squares (two passes on the GPU: per-block partial sums, then their sum in
/// block order) on gradients smaller than a block, over several blocks, and past the first pass's grid;
/// and the in-place scaling that clips a gradient.
#[test]
fn gpu_gradient_square_sums_and_in_place_scaling_match_the_cpu() -> R {
    with_gpu("the gradient norm's sums of squares and in-place scaling against the CPU", |g, rng| {
        let grads = [rng.tensor(&[37, 29]), rng.tensor(&[5000]), rng.scaled(&[1 << 19, 3], 0.5)];
        let metas: Vec<Buffer> = grads.iter().map(|t| meta(&t.shape)).collect();
        let meta_refs: Vec<&Buffer> = metas.iter().collect();
        let out = meta(&[1]);
        let ctx = KernelContext { coords: Coords::new(0, 0, 0), mesh: ONE, seed: 1, inputs: &meta_refs, output: &out };
        let refs: Vec<&Tensor> = grads.iter().collect();
        let mut want = Tensor::zeros(DType::F32, &[1]);
        cpu::run(&Kernel::GradSquareSum, &refs, &mut want, &ctx)?;
        let dev = grads.iter().map(|t| g.upload(t)).collect::<Result<Vec<_>, _>>()?;
        let dev_refs: Vec<&DeviceTensor> = dev.iter().collect();
        let mut got = g.upload(&Tensor::zeros(DType::F32, &[1]))?;
        g.kernels.run(&Kernel::GradSquareSum, &dev_refs, &mut got, &ctx)?;
        close(&got.download(&g.stream)?, &want, 1e-6).map_err(|e| format!("GradSquareSum: {e}"))?;
        // Another set of gradients (a new span table), with an empty one among them.
        let other = [rng.tensor(&[0, 4]), rng.tensor(&[4097]), rng.tensor(&[9, 3])];
        let metas: Vec<Buffer> = other.iter().map(|t| meta(&t.shape)).collect();
        let meta_refs: Vec<&Buffer> = metas.iter().collect();
        let ctx = KernelContext { inputs: &meta_refs, ..ctx };
        let mut want = Tensor::zeros(DType::F32, &[1]);
        cpu::run(&Kernel::GradSquareSum, &other.iter().collect::<Vec<_>>(), &mut want, &ctx)?;
        let dev = other.iter().map(|t| g.upload(t)).collect::<Result<Vec<_>, _>>()?;
        let mut got = g.upload(&Tensor::zeros(DType::F32, &[1]))?;
        g.kernels.run(&Kernel::GradSquareSum, &dev.iter().collect::<Vec<_>>(), &mut got, &ctx)?;
        close(&got.download(&g.stream)?, &want, 1e-6).map_err(|e| format!("GradSquareSum, second set: {e}"))?;
        let mut clipped = g.upload(&grads[2])?;
        g.kernels.scale_in_place(&mut clipped, 0.37)?;
        let scaled: Vec<f32> = grads[2].f32()?.iter().map(|&x| x * 0.37).collect();
        let want = Tensor::from_f32(&grads[2].shape, scaled);
        close(&clipped.download(&g.stream)?, &want, 0.0).map_err(|e| format!("scale_in_place: {e}"))
    })
}

#[test]
fn gpu_tensors_round_trip() -> R {
    with_gpu("the upload and download of f32 and i32 tensors", |g, rng| {
        for t in [rng.tensor(&[3, 4]), rng.ints(&[5], -3, 3), Tensor::zeros(DType::F32, &[0, 4]), rng.tensor(&[])] {
            let back = g.upload(&t)?.download(&g.stream)?;
            if back != t {
                return Err(format!("{t:?} came back as {back:?}"));
            }
        }
        let bad = Tensor::from_f32(&[3], vec![1.0]);
        if g.upload(&bad).is_ok() {
            return Err("a tensor with the wrong element count was uploaded".into());
        }
        Ok(())
    })
}

// ---- bf16 buffers ---------------------------------------------------------------------------------

/// Which floating-point inputs, and whether the output, are bf16 when a bf16 plan runs `kernel`
/// (statistics stay f32), or `None` for kernels that bf16 plans never give a bf16 operand.
fn bf16_roles(kernel: &Kernel, inputs: usize) -> Option<(Vec<bool>, bool)> {
    let (t, f) = (true, false);
    Some(match kernel {
        Kernel::RowSum | Kernel::CrossEntropyMax { .. } => (vec![t], f),
        Kernel::RowCenteredSquareSum { .. } => (vec![t, f], f),
        Kernel::LayerNormApply { .. } => (vec![t, f, f, t, t], t),
        Kernel::LayerNormGradSums { .. } => (vec![t, t, t, f, f], f),
        Kernel::LayerNormGradInput { .. } => (vec![t, t, t, f, f, f], t),
        Kernel::LayerNormGradWeight { .. } => (vec![t, t, f, f], t),
        Kernel::CrossEntropyStats { .. } => (vec![t, f, f], f),
        Kernel::CrossEntropyGrad { .. } => (vec![t, f, f, f, f, f], t),
        Kernel::RowSquareSum => (vec![t], f),
        Kernel::RmsNormApply { .. } => (vec![t, f, t], t),
        Kernel::RmsNormGradSum => (vec![t, t, t], f),
        Kernel::RmsNormGradInput { .. } => (vec![t, t, t, f, f], t),
        Kernel::RmsNormGradWeight { .. } => (vec![t, t, f], t),
        Kernel::CrossEntropyLoss | Kernel::CrossEntropyCount | Kernel::GradSquareSum | Kernel::OptimizerStep => {
            return None;
        }
        _ => (vec![t; inputs], t),
    })
}

/// A host tensor as a bf16 plan stores it: f32 values rounded to bf16 bits where told.
#[derive(Clone)]
struct Stored {
    shape: Vec<u64>,
    data: StoredData,
}

#[derive(Clone)]
enum StoredData {
    F32(Vec<f32>),
    I32(Vec<i32>),
    Bf16(Vec<u16>),
}

impl Stored {
    fn of(t: &Tensor, as_bf16: bool) -> Stored {
        let data = match &t.data {
            Data::F32(v) if as_bf16 => StoredData::Bf16(v.iter().map(|&x| bf16::round(x)).collect()),
            Data::F32(v) => StoredData::F32(v.clone()),
            Data::I32(v) => StoredData::I32(v.clone()),
        };
        Stored { shape: t.shape.clone(), data }
    }

    fn view(&self) -> View<'_> {
        let data = match &self.data {
            StoredData::F32(v) => ViewData::F32(v),
            StoredData::I32(v) => ViewData::I32(v),
            StoredData::Bf16(v) => ViewData::Bf16(v),
        };
        View { shape: Shape(&self.shape), data }
    }

    fn view_mut(&mut self) -> ViewMut<'_> {
        let data = match &mut self.data {
            StoredData::F32(v) => ViewMutData::F32(v),
            StoredData::I32(v) => ViewMutData::I32(v),
            StoredData::Bf16(v) => ViewMutData::Bf16(v),
        };
        ViewMut { shape: Shape(&self.shape), data }
    }

    fn is_bf16(&self) -> bool {
        matches!(self.data, StoredData::Bf16(_))
    }
}

/// A case run on bf16 buffers: its inputs and output stored as a bf16 plan stores them.
struct Bf16Case<'c> {
    case: &'c Case,
    inputs: Vec<Stored>,
    init: Stored,
}

/// The relative tolerance of bf16 results (bf16 keeps 8 significant bits: 2^-8 = 0.4%).
const BF16_TOL: f64 = 2e-2;

impl<'c> Bf16Case<'c> {
    /// The case with the element types of a bf16 plan, or `None` for a kernel bf16 plans run in f32.
    fn plan(case: &'c Case) -> Option<Bf16Case<'c>> {
        let (ins, out) = bf16_roles(&case.kernel, case.inputs.len())?;
        Some(Bf16Case::mixed(case, &ins, out))
    }

    /// The case with the given inputs (and output) in bf16.
    fn mixed(case: &'c Case, ins: &[bool], out: bool) -> Bf16Case<'c> {
        let inputs = case.inputs.iter().zip(ins).map(|(t, &h)| Stored::of(t, h)).collect();
        Bf16Case { case, inputs, init: Stored::of(&case.initial(), out) }
    }

    fn describe(&self) -> String {
        let types: Vec<&str> = self.inputs.iter().map(|s| if s.is_bf16() { "bf16" } else { "-" }).collect();
        let out = if self.init.is_bf16() { "bf16" } else { "-" };
        format!("{} with bf16 operands {types:?} -> {out}", self.case.describe())
    }

    /// The CPU backend's result: bf16 operands widened, the f32 kernel, a bf16 output rounded once.
    fn on_cpu(&self) -> Result<Stored, String> {
        let (i, j, mesh) = self.case.at;
        let ctx = KernelContext { coords: Coords::new(i, j, 0), mesh, seed: 1234, inputs: &[], output: &self.case.out };
        let views: Vec<View> = self.inputs.iter().map(Stored::view).collect();
        let refs: Vec<&View> = views.iter().collect();
        let mut out = self.init.clone();
        let kernel = &self.case.kernel;
        bf16::with_widened(&refs, &mut out.view_mut(), kernel.reads_its_output(), |ins, o| {
            cpu::run_views(kernel, ins, o, &ctx)
        })?;
        Ok(out)
    }

    /// Both backends succeed with outputs within [`BF16_TOL`], or both fail.
    fn check(&self, gpu: &mut Gpu) -> R {
        let (i, j, mesh) = self.case.at;
        let ctx = KernelContext { coords: Coords::new(i, j, 0), mesh, seed: 1234, inputs: &[], output: &self.case.out };
        let dev: Vec<DeviceTensor> =
            self.inputs.iter().map(|s| DeviceTensor::upload_view(&gpu.stream, &s.view())).collect::<Result<_, _>>()?;
        let refs: Vec<&DeviceTensor> = dev.iter().collect();
        let mut got = DeviceTensor::upload_view(&gpu.stream, &self.init.view())?;
        let gpu_result = gpu.kernels.run(&self.case.kernel, &refs, &mut got, &ctx);
        match (self.on_cpu(), gpu_result) {
            (Ok(want), Ok(())) => {
                let mut back = self.init.clone();
                got.download_into(&gpu.stream, &mut back.view_mut())?;
                let (got, want) = (back.view().to_tensor(), want.view().to_tensor());
                close(&got, &want, BF16_TOL).map_err(|e| format!("{}: {e}", self.describe()))
            }
            (Err(_), Err(_)) => Ok(()),
            (a, b) => Err(format!("{}: the CPU gives {:?}, the GPU {b:?}", self.describe(), a.map(|_| ()))),
        }
    }
}

/// Cases whose operand types are not a bf16 plan's: they run widened on the GPU (a bf16 operand next to
/// an f32 one, an f32 output of bf16 products, casts both ways, a fill into bf16).
fn mixed_bf16_cases(rng: &mut Rng) -> Vec<(Case, Vec<bool>, bool)> {
    let s = [7, 45];
    let product = |acc| Kernel::MatMul { transpose_a: false, transpose_b: true, accumulate: acc };
    vec![
        (Case::new(Kernel::Add, vec![rng.tensor(&s), rng.tensor(&s)], &s), vec![true, false], true),
        (Case::new(Kernel::Add, vec![rng.tensor(&s), rng.tensor(&s)], &s), vec![true, true], false),
        (Case::new(product(false), vec![rng.tensor(&[9, 40]), rng.tensor(&[11, 40])], &[9, 11]), vec![true; 2], false),
        (
            Case::new(product(true), vec![rng.tensor(&[9, 40]), rng.tensor(&[11, 40])], &[9, 11])
                .init(rng.tensor(&[9, 11])),
            vec![true; 2],
            true,
        ),
        (
            Case::new(product(false), vec![rng.tensor(&[9, 40]), rng.tensor(&[11, 40])], &[9, 11]),
            vec![true, false],
            true,
        ),
        (Case::new(Kernel::Cast, vec![rng.scaled(&s, 100.0)], &s), vec![false], true),
        (Case::new(Kernel::Cast, vec![rng.scaled(&s, 100.0)], &s), vec![true], false),
        (Case::new(Kernel::Fill { value: -2.5 }, vec![], &[3, 5]), vec![], true),
        (Case::new(Kernel::BiasAdd, vec![rng.tensor(&s), rng.tensor(&[45])], &s), vec![true, false], true),
    ]
}

/// The bf16 cases are well-formed on the CPU backend's bf16 path (this runs without a GPU).
#[test]
fn every_bf16_case_runs_on_the_cpu_backends_bf16_path() -> R {
    let mut rng = Rng(7);
    let mut count = 0;
    for (name, cases) in ALL_CASES {
        for case in cases(&mut rng)? {
            let Some(b) = Bf16Case::plan(&case) else { continue };
            match (b.on_cpu(), case.fails) {
                (Ok(_), false) | (Err(_), true) => count += 1,
                (Ok(_), true) => return Err(format!("{name}: {} succeeds on bf16", b.describe())),
                (Err(e), false) => return Err(format!("{name}: {} fails on bf16: {e}", b.describe())),
            }
        }
    }
    for (case, ins, out) in mixed_bf16_cases(&mut rng) {
        Bf16Case::mixed(&case, &ins, out).on_cpu()?;
        count += 1;
    }
    assert!(count > 80, "only {count} bf16 cases");
    Ok(())
}

#[test]
fn gpu_bf16_kernels_match_the_cpu_backends_bf16() -> R {
    with_gpu("every kernel on bf16 buffers (and mixed bf16/f32 operands) against the CPU backend's bf16", |g, rng| {
        for (name, cases) in ALL_CASES {
            for case in cases(rng)? {
                if let Some(b) = Bf16Case::plan(&case) {
                    b.check(g).map_err(|e| format!("{name}: {e}"))?;
                }
            }
        }
        for (case, ins, out) in mixed_bf16_cases(rng) {
            Bf16Case::mixed(&case, &ins, out).check(g)?;
        }
        Ok(())
    })
}

/// Attention with head sizes the flash kernels take (64 and 128): fused and not, causal and not,
/// grouped-query, sequences that are not multiples of the 64-row tiles, more keys than queries, and every
/// gradient.
fn flash_cases(rng: &mut Rng) -> Vec<Case> {
    let mut cases = Vec::new();
    for (d, seq, causal) in [(64u64, 100u64, true), (64, 64, false), (128, 130, true), (128, 33, false)] {
        let heads = 2u64;
        let w = heads * d;
        let fused = rng.tensor(&[2, seq, 3 * w]);
        let attention = Kernel::Attention { heads, kv_heads: heads, causal, fused: true };
        cases.push(Case::new(attention, vec![fused.clone()], &[2, seq, w]));
        let grad = Kernel::AttentionGrad { heads, kv_heads: heads, causal, fused: true, wrt: 0 };
        cases.push(Case::new(grad, vec![rng.tensor(&[2, seq, w]), fused], &[2, seq, 3 * w]));
    }
    for (heads, kv_heads, d, sq, sk, causal) in [(4u64, 2u64, 64u64, 96u64, 96u64, true), (6, 2, 128, 70, 150, false)] {
        let (q, dy) = (rng.tensor(&[3, sq, heads * d]), rng.tensor(&[3, sq, heads * d]));
        let kv = [3, sk, kv_heads * d];
        let (k, v) = (rng.tensor(&kv), rng.tensor(&kv));
        let attention = Kernel::Attention { heads, kv_heads, causal, fused: false };
        cases.push(Case::new(attention, vec![q.clone(), k.clone(), v.clone()], &[3, sq, heads * d]));
        for (wrt, shape) in [(0u8, [3, sq, heads * d]), (1, kv), (2, kv)] {
            let grad = Kernel::AttentionGrad { heads, kv_heads, causal, fused: false, wrt };
            cases.push(Case::new(grad, vec![dy.clone(), q.clone(), k.clone(), v.clone()], &shape));
        }
    }
    cases
}

/// The flash attention (the kernels compiled for the GPU's own architecture, Ampere or newer) gives the
/// CPU backend's bf16 attention and gradients within bf16 rounding.
#[test]
fn gpu_flash_attention_matches_the_cpu_backends_bf16() -> R {
    let Some(mut g) = gpu_with("the flash attention against the CPU backend's bf16", true)? else { return Ok(()) };
    if !g.kernels.flash_attention() {
        let why = "the flash attention is off on this GPU (before Ampere, or OPTIMUS_CUDA_ATTENTION=reference)";
        assert!(!required("OPTIMUS_REQUIRE_FLASH"), "OPTIMUS_REQUIRE_FLASH=1 but {why}");
        eprintln!("skipped: {why}");
        return Ok(());
    }
    let mut rng = Rng(11);
    for case in flash_cases(&mut rng) {
        let b = Bf16Case::plan(&case).ok_or("attention has bf16 kernels")?;
        b.check(&mut g)?;
    }
    Ok(())
}

/// A non-fused attention's three gradients as a plan runs them (back to back, on the same device
/// tensors, in any order): the first computes all three and keeps two, each equal to the CPU's; a kernel
/// that writes an operand in between (here a fill of q) makes the next one compute afresh.
#[test]
fn gpu_flash_gradients_kept_for_the_next_attention_grad_are_the_cpus() -> R {
    let Some(mut g) = gpu_with("the kept flash attention gradients", true)? else { return Ok(()) };
    if !g.kernels.flash_attention() {
        eprintln!("skipped: the flash attention is off on this GPU");
        return Ok(());
    }
    let mut rng = Rng(13);
    let (heads, kv_heads, d, sq, sk) = (4u64, 2u64, 64u64, 80u64, 80u64);
    let q_shape = [2, sq, heads * d];
    let kv = [2, sk, kv_heads * d];
    let (dy, q, k, v) = (rng.tensor(&q_shape), rng.tensor(&q_shape), rng.tensor(&kv), rng.tensor(&kv));
    let filled = Tensor::from_f32(&q_shape, vec![0.5; (2 * sq * heads * d) as usize]);
    let case = |wrt: u8, q: &Tensor| {
        let grad = Kernel::AttentionGrad { heads, kv_heads, causal: true, fused: false, wrt };
        let shape = if wrt == 0 { q_shape } else { kv };
        Case::new(grad, vec![dy.clone(), q.clone(), k.clone(), v.clone()], &shape)
    };
    let cases: Vec<Case> = [1u8, 0, 2].iter().map(|&w| case(w, &q)).collect();
    let after_fill = [case(0, &filled), case(1, &filled)];
    let plans: Vec<Bf16Case> =
        cases.iter().chain(&after_fill).map(|c| Bf16Case::plan(c).ok_or("bf16")).collect::<Result<_, _>>()?;
    let mut dev: Vec<DeviceTensor> =
        plans[0].inputs.iter().map(|s| DeviceTensor::upload_view(&g.stream, &s.view())).collect::<Result<_, _>>()?;
    for (n, plan) in plans.iter().enumerate() {
        if n == 3 {
            // A kernel writes q in place: what was kept for the old q must not be served.
            let ctx = KernelContext {
                coords: Coords::new(0, 0, 0),
                mesh: Mesh::new(1, 1),
                seed: 1,
                inputs: &[],
                output: &plan.case.out,
            };
            g.kernels.run(&Kernel::Fill { value: 0.5 }, &[], &mut dev[1], &ctx)?;
        }
        let (i, j, mesh) = plan.case.at;
        let ctx = KernelContext { coords: Coords::new(i, j, 0), mesh, seed: 1234, inputs: &[], output: &plan.case.out };
        let refs: Vec<&DeviceTensor> = dev.iter().collect();
        let mut got = DeviceTensor::upload_view(&g.stream, &plan.init.view())?;
        g.kernels.run(&plan.case.kernel, &refs, &mut got, &ctx)?;
        let mut back = plan.init.clone();
        got.download_into(&g.stream, &mut back.view_mut())?;
        let want = plan.on_cpu()?;
        close(&back.view().to_tensor(), &want.view().to_tensor(), BF16_TOL)
            .map_err(|e| format!("{}: {e}", plan.describe()))?;
    }
    Ok(())
}

#[test]
fn every_flash_case_runs_on_the_cpu_backends_bf16_path() -> R {
    for case in flash_cases(&mut Rng(11)) {
        Bf16Case::plan(&case).ok_or("attention has bf16 kernels")?.on_cpu()?;
    }
    Ok(())
}

#[test]
fn gpu_bf16_tensors_round_trip_as_bf16() -> R {
    with_gpu("the upload and download of bf16 tensors", |g, rng| {
        let stored = Stored::of(&rng.scaled(&[5, 7], 50.0), true);
        let dev = DeviceTensor::upload_view(&g.stream, &stored.view())?;
        if dev.data.capacity() != 35 || !matches!(dev.data, optimus::runtime::cuda::kernels::DeviceData::Bf16(_)) {
            return Err(format!("a bf16 view was uploaded as {:?}", dev.data));
        }
        let mut back = Stored::of(&Tensor::zeros(DType::F32, &[5, 7]), true);
        dev.download_into(&g.stream, &mut back.view_mut())?;
        match (&back.data, &stored.data) {
            (StoredData::Bf16(a), StoredData::Bf16(b)) if a == b => Ok(()),
            _ => Err("bf16 bits changed on the way".into()),
        }
    })
}
