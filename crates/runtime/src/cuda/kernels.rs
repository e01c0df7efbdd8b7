//! GPU versions of every plan [`Kernel`]: device tensors, the NVRTC-compiled kernels of `kernels.cu`,
//! cuBLAS products, and [`CudaKernels::run`] / [`CudaKernels::optimizer_step`] with exactly the semantics
//! of `cpu::kernels::run` / `cpu::kernels::optimizer_step` (same checks and messages, same arithmetic up to
//! summation order and the last bits of `expf`/`erff`).
//!
//! Everything runs asynchronously on one compute stream; only downloads and the few kernels whose CPU
//! version can fail on the *values* of its inputs (out-of-range token ids and targets) wait for it.
//!
//! bf16 buffers live on the GPU as bf16 (two bytes an element); the `bf16` submodule runs plan kernels on them:
//! bf16 entry points of the kernels (f32 arithmetic, one rounding on store) and cuBLAS `gemmEx` products
//! with bf16 operands and f32 accumulation.

use super::error::{DeviceError, driver};
use crate::error::{KernelError, batched_product, require};
use crate::settings::{KernelContext, OptimizerKind, OptimizerSettings};
use crate::view::{View, ViewData, ViewMut, ViewMutData};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use optimus_plan::layout::{Layout, Placement};
use optimus_plan::logical::try_logical_indices;
use optimus_plan::shapes::{
    Packing, Runs, ShapeError, Swap, batch_matrix, numel, reshape_runs, same_len, same_shape, select_grad_runs,
    select_runs, slice_shard_runs, split_last, transpose_swap,
};
use optimus_plan::tensor::{Data, Tensor};
use optimus_plan::types::DType;
use optimus_plan::{Coords, Kernel, Mesh};
use std::collections::HashMap;
use std::sync::Arc;

/// The CUDA C++ source of the kernels (compiled at run time by NVRTC): kernels.cu, then the flash
/// attention of flash.cu.
pub const SOURCE: &str = concat!(include_str!("kernels.cu"), include_str!("flash.cu"), include_str!("collectives.cu"));

/// The names of the `__global__` functions of [`SOURCE`].
mod names {
    pub const BIAS_ADD: &str = "bias_add";
    pub const ADD: &str = "add";
    pub const MULTIPLY: &str = "multiply";
    pub const SCALE: &str = "scale";
    pub const HOLD_STREAM: &str = "hold_stream";
    pub const GELU_TANH: &str = "gelu_tanh";
    pub const GELU_ERF: &str = "gelu_erf";
    pub const SILU: &str = "silu";
    pub const SILU_GRAD: &str = "silu_grad";
    pub const ROTARY: &str = "rotary";
    pub const GELU_TANH_GRAD: &str = "gelu_tanh_grad";
    pub const GELU_ERF_GRAD: &str = "gelu_erf_grad";
    pub const CAUSAL_MASK: &str = "causal_mask";
    pub const DROPOUT: &str = "dropout";
    pub const FILL_BITS: &str = "fill_bits";
    pub const ZERO_BLOCKS: &str = "zero_blocks";
    pub const COPY_RUNS: &str = "copy_runs";
    pub const TRANSPOSE: &str = "transpose";
    pub const SOFTMAX: &str = "softmax";
    pub const SOFTMAX_GRAD: &str = "softmax_grad";
    pub const ATTENTION_SOFTMAX: &str = "attention_softmax";
    pub const ATTENTION_SOFTMAX_GRAD: &str = "attention_softmax_grad";
    pub const EMBEDDING_LOOKUP: &str = "embedding_lookup";
    pub const EMBEDDING_GRAD: &str = "embedding_grad";
    pub const POSITION_LOOKUP: &str = "position_lookup";
    pub const POSITION_GRAD: &str = "position_grad";
    pub const ROW_SUM: &str = "row_sum";
    pub const ROW_CENTERED_SQUARE_SUM: &str = "row_centered_square_sum";
    pub const LAYER_NORM_APPLY: &str = "layer_norm_apply";
    pub const LAYER_NORM_GRAD_SUMS: &str = "layer_norm_grad_sums";
    pub const LAYER_NORM_GRAD_INPUT: &str = "layer_norm_grad_input";
    pub const LAYER_NORM_STATS: &str = "layer_norm_stats";
    pub const LAYER_NORM_GRAD_WEIGHT: &str = "layer_norm_grad_weight";
    pub const ROW_SQUARE_SUM: &str = "row_square_sum";
    pub const RMS_NORM_APPLY: &str = "rms_norm_apply";
    pub const RMS_NORM_GRAD_SUM: &str = "rms_norm_grad_sum";
    pub const RMS_NORM_GRAD_INPUT: &str = "rms_norm_grad_input";
    pub const RMS_NORM_STATS: &str = "rms_norm_stats";
    pub const RMS_NORM_GRAD_WEIGHT: &str = "rms_norm_grad_weight";
    pub const SUM_TO_LAST: &str = "sum_to_last";
    pub const CROSS_ENTROPY_MAX: &str = "cross_entropy_max";
    pub const CROSS_ENTROPY_STATS: &str = "cross_entropy_stats";
    pub const CROSS_ENTROPY_COUNT: &str = "cross_entropy_count";
    pub const CROSS_ENTROPY_LOSS: &str = "cross_entropy_loss";
    pub const SQUARE_SUM_SPANS: &str = "square_sum_spans";
    pub const SQUARE_SUM_TENSORS: &str = "square_sum_tensors";
    pub const SQUARE_SUM_FOLD: &str = "square_sum_fold";
    pub const CROSS_ENTROPY_GRAD: &str = "cross_entropy_grad";
    pub const SGD_STEP: &str = "sgd_step";
    pub const ADAMW_STEP: &str = "adamw_step";
    pub const ADAMW_SPANS: &str = "adamw_spans";
}

use names::*;

/// Every `__global__` function of [`SOURCE`].
pub const KERNEL_NAMES: &[&str] = &[
    BIAS_ADD,
    ADD,
    MULTIPLY,
    SCALE,
    GELU_TANH,
    GELU_ERF,
    SILU,
    SILU_GRAD,
    ROTARY,
    GELU_TANH_GRAD,
    GELU_ERF_GRAD,
    CAUSAL_MASK,
    DROPOUT,
    FILL_BITS,
    ZERO_BLOCKS,
    COPY_RUNS,
    TRANSPOSE,
    SOFTMAX,
    SOFTMAX_GRAD,
    ATTENTION_SOFTMAX,
    ATTENTION_SOFTMAX_GRAD,
    EMBEDDING_LOOKUP,
    EMBEDDING_GRAD,
    POSITION_LOOKUP,
    POSITION_GRAD,
    ROW_SUM,
    ROW_CENTERED_SQUARE_SUM,
    LAYER_NORM_APPLY,
    LAYER_NORM_GRAD_SUMS,
    LAYER_NORM_GRAD_INPUT,
    LAYER_NORM_STATS,
    LAYER_NORM_GRAD_WEIGHT,
    ROW_SQUARE_SUM,
    RMS_NORM_APPLY,
    RMS_NORM_GRAD_SUM,
    RMS_NORM_GRAD_INPUT,
    RMS_NORM_STATS,
    RMS_NORM_GRAD_WEIGHT,
    SUM_TO_LAST,
    CROSS_ENTROPY_MAX,
    CROSS_ENTROPY_STATS,
    CROSS_ENTROPY_COUNT,
    CROSS_ENTROPY_LOSS,
    SQUARE_SUM_SPANS,
    SQUARE_SUM_TENSORS,
    SQUARE_SUM_FOLD,
    CROSS_ENTROPY_GRAD,
    SGD_STEP,
    ADAMW_STEP,
    ADAMW_SPANS,
    HOLD_STREAM,
];

/// What runs a plan kernel on the GPU: the `__global__` functions it may launch, and whether it calls cuBLAS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launcher {
    pub functions: &'static [&'static str],
    pub cublas: bool,
}

impl Launcher {
    const fn kernels(functions: &'static [&'static str]) -> Launcher {
        Launcher { functions, cublas: false }
    }

    const fn product(functions: &'static [&'static str]) -> Launcher {
        Launcher { functions, cublas: true }
    }
}

/// Whether a plan kernel runs on the CPU backend only (the key/value cache kernels of text generation):
/// it has no launcher here, and [`CudaKernels::run`] refuses it.
pub fn cpu_only(kernel: &Kernel) -> bool {
    matches!(
        kernel,
        Kernel::RotaryAt { .. } | Kernel::PositionLookupAt | Kernel::CacheWrite { .. } | Kernel::CachedAttention { .. }
    )
}

/// The error of a [`cpu_only`] kernel.
pub fn cpu_only_error(kernel: &Kernel) -> KernelError {
    KernelError::Unsupported {
        kernel: kernel.name(),
        why: "has no CUDA kernel: the key/value cache of text generation runs on the CPU backend only (`--backend cpu`)",
    }
}

/// The launcher of each plan kernel (an exhaustive match: a new [`Kernel`] does not compile without one);
/// none for the [`cpu_only`] kernels.
pub fn launcher(kernel: &Kernel) -> Launcher {
    match kernel {
        Kernel::RotaryAt { .. }
        | Kernel::PositionLookupAt
        | Kernel::CacheWrite { .. }
        | Kernel::CachedAttention { .. } => Launcher::kernels(&[]),
        Kernel::MatMul { .. } | Kernel::BatchedMatMul => Launcher::product(&[ZERO_BLOCKS]),
        Kernel::BiasAdd => Launcher::kernels(&[BIAS_ADD]),
        Kernel::Add => Launcher::kernels(&[ADD]),
        Kernel::Mul => Launcher::kernels(&[MULTIPLY]),
        Kernel::Scale { .. } | Kernel::Cast => Launcher::kernels(&[SCALE]),
        Kernel::Gelu { approximate: true } => Launcher::kernels(&[GELU_TANH]),
        Kernel::Gelu { approximate: false } => Launcher::kernels(&[GELU_ERF]),
        Kernel::Silu => Launcher::kernels(&[SILU]),
        Kernel::SiluGrad => Launcher::kernels(&[SILU_GRAD]),
        Kernel::Rotary { .. } | Kernel::RotaryGrad { .. } => Launcher::kernels(&[ROTARY]),
        Kernel::GeluGrad { approximate: true } => Launcher::kernels(&[GELU_TANH_GRAD]),
        Kernel::GeluGrad { approximate: false } => Launcher::kernels(&[GELU_ERF_GRAD]),
        Kernel::Softmax => Launcher::kernels(&[SOFTMAX]),
        Kernel::SoftmaxGrad => Launcher::kernels(&[SOFTMAX_GRAD]),
        Kernel::CausalMask | Kernel::CausalMaskGrad => Launcher::kernels(&[CAUSAL_MASK]),
        Kernel::Dropout { .. } | Kernel::DropoutGrad { .. } => Launcher::kernels(&[DROPOUT, COPY_RUNS]),
        Kernel::Reshape | Kernel::Select { .. } | Kernel::SelectGrad { .. } | Kernel::SliceShard { .. } => {
            Launcher::kernels(&[COPY_RUNS])
        }
        Kernel::Transpose { .. } => Launcher::kernels(&[TRANSPOSE]),
        Kernel::Attention { .. } => Launcher::product(&[ATTENTION_SOFTMAX, ZERO_BLOCKS]),
        Kernel::AttentionGrad { .. } => Launcher::product(&[ATTENTION_SOFTMAX, ATTENTION_SOFTMAX_GRAD, ZERO_BLOCKS]),
        Kernel::EmbeddingLookup { .. } => Launcher::kernels(&[EMBEDDING_LOOKUP]),
        Kernel::EmbeddingGrad { .. } => Launcher::kernels(&[EMBEDDING_GRAD]),
        Kernel::PositionLookup => Launcher::kernels(&[POSITION_LOOKUP]),
        Kernel::PositionGrad => Launcher::kernels(&[POSITION_GRAD]),
        Kernel::RowSum => Launcher::kernels(&[ROW_SUM]),
        Kernel::RowCenteredSquareSum { .. } => Launcher::kernels(&[ROW_CENTERED_SQUARE_SUM]),
        Kernel::LayerNormApply { .. } => Launcher::kernels(&[LAYER_NORM_APPLY]),
        Kernel::LayerNormGradSums { .. } => Launcher::kernels(&[LAYER_NORM_GRAD_SUMS]),
        Kernel::LayerNormGradInput { .. } => Launcher::kernels(&[LAYER_NORM_GRAD_INPUT]),
        Kernel::LayerNormGradWeight { .. } => Launcher::kernels(&[LAYER_NORM_STATS, LAYER_NORM_GRAD_WEIGHT]),
        Kernel::RowSquareSum => Launcher::kernels(&[ROW_SQUARE_SUM]),
        Kernel::RmsNormApply { .. } => Launcher::kernels(&[RMS_NORM_APPLY]),
        Kernel::RmsNormGradSum => Launcher::kernels(&[RMS_NORM_GRAD_SUM]),
        Kernel::RmsNormGradInput { .. } => Launcher::kernels(&[RMS_NORM_GRAD_INPUT]),
        Kernel::RmsNormGradWeight { .. } => Launcher::kernels(&[RMS_NORM_STATS, RMS_NORM_GRAD_WEIGHT]),
        Kernel::SumToLast => Launcher::kernels(&[SUM_TO_LAST]),
        Kernel::CrossEntropyMax { .. } => Launcher::kernels(&[CROSS_ENTROPY_MAX]),
        Kernel::CrossEntropyStats { .. } => Launcher::kernels(&[CROSS_ENTROPY_STATS]),
        Kernel::CrossEntropyCount => Launcher::kernels(&[CROSS_ENTROPY_COUNT]),
        Kernel::CrossEntropyLoss => Launcher::kernels(&[CROSS_ENTROPY_LOSS]),
        Kernel::CrossEntropyGrad { .. } => Launcher::kernels(&[CROSS_ENTROPY_GRAD]),
        Kernel::Fill { .. } => Launcher::kernels(&[FILL_BITS]),
        Kernel::GradSquareSum => Launcher::kernels(&[SQUARE_SUM_SPANS, SQUARE_SUM_TENSORS, SQUARE_SUM_FOLD]),
        Kernel::OptimizerStep => Launcher::kernels(&[SGD_STEP, ADAMW_STEP, ADAMW_SPANS]),
    }
}

/// The oldest virtual architecture the kernels are compiled for when no GPU names its own: compute
/// capability 7.5, the oldest that both NVRTC 12 and NVRTC 13 accept (13 dropped 7.0), JIT-compiled by the
/// driver for any newer GPU.
pub const PORTABLE_ARCH: &str = "compute_75";

/// The NVRTC options for `arch`, with no fused multiply-adds, so that elementwise results round like the
/// CPU reference.
fn compile_options(arch: &'static str) -> CompileOptions {
    CompileOptions { arch: Some(arch), fmad: Some(false), name: Some("kernels.cu".into()), ..Default::default() }
}

/// The virtual architecture of a GPU of compute capability `major.minor`: its own where NVRTC knows it,
/// so that the driver need not translate, else [`PORTABLE_ARCH`].
pub fn arch_of(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        _ => PORTABLE_ARCH,
    }
}

/// Compiles [`SOURCE`] to PTX for [`PORTABLE_ARCH`], or says why not (no libnvrtc, or the compiler's log).
pub fn compile_ptx() -> Result<Ptx, DeviceError> {
    compile_ptx_for(PORTABLE_ARCH)
}

/// Compiles [`SOURCE`] to PTX for the virtual architecture `arch` (`compute_90`, say).
pub fn compile_ptx_for(arch: &'static str) -> Result<Ptx, DeviceError> {
    // SAFETY: only tries to open the shared library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(DeviceError::Unavailable(
            "NVRTC (libnvrtc.so) cannot be loaded: install the CUDA runtime compiler or put it on LD_LIBRARY_PATH",
        ));
    }
    compile_ptx_with_opts(SOURCE, compile_options(arch)).map_err(|e| match e {
        CompileError::CompileError { nvrtc, log, .. } => {
            DeviceError::Compile { target: arch.to_string(), code: nvrtc, log: log.to_string_lossy().into_owned() }
        }
        other => DeviceError::CompileFailed(other),
    })
}

/// The machine code of the kernels for `sm_{sm}` (a CUBIN from NVRTC, which runs ptxas itself), so that
/// the driver need not translate PTX when the module loads or a kernel first runs (about 3 s for these
/// kernels; the driver's own cache of such translations is not always kept between runs).
pub fn compile_cubin_for(sm: u32) -> Result<Vec<u8>, DeviceError> {
    use cudarc::nvrtc::{result, sys};
    // SAFETY: only tries to open the shared library.
    if !unsafe { sys::is_culib_present() } {
        return Err(DeviceError::Unavailable("NVRTC (libnvrtc.so) cannot be loaded"));
    }
    let source = std::ffi::CString::new(SOURCE).map_err(|_| DeviceError::NulInSource)?;
    let program = result::create_program(&source, Some(c"kernels.cu")).map_err(DeviceError::Nvrtc)?;
    let options = [format!("--gpu-architecture=sm_{sm}"), "--fmad=false".to_string()];
    // SAFETY: `program` was created above and is destroyed once, below; the CUBIN buffer has the size
    // NVRTC reports for it.
    let cubin = unsafe {
        let compiled = result::compile_program(program, &options).map_err(|e| {
            let log = result::get_program_log(program).unwrap_or_default();
            let text: Vec<u8> = log.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
            let log = String::from_utf8_lossy(&text).into_owned();
            DeviceError::Compile { target: format!("sm_{sm}"), code: e, log }
        });
        let image = compiled.and_then(|()| {
            let mut size = 0usize;
            sys::nvrtcGetCUBINSize(program, &mut size).result().map_err(DeviceError::Nvrtc)?;
            let mut image = vec![0u8; size];
            sys::nvrtcGetCUBIN(program, image.as_mut_ptr().cast()).result().map_err(DeviceError::Nvrtc)?;
            Ok(image)
        });
        let _ = result::destroy_program(program);
        image
    }?;
    require(cubin.starts_with(b"\x7fELF"), || DeviceError::NoMachineCode(sm))?;
    Ok(cubin)
}

/// The real architecture (`sm_90` is 90) of a GPU of compute capability `major.minor`, where
/// [`arch_of`] knows it.
fn real_arch(major: i32, minor: i32) -> Option<u32> {
    (arch_of(major, minor) != PORTABLE_ARCH).then(|| (major * 10 + minor).try_into().ok()).flatten()
}

// ---- device tensors -------------------------------------------------------------------------------

/// Element storage on the GPU, as on the host: f32 or bf16 for floating-point buffers (bf16 as its bit
/// patterns, two bytes an element), i32 for integer ones.
#[derive(Debug)]
pub enum DeviceData {
    F32(CudaSlice<f32>),
    I32(CudaSlice<i32>),
    Bf16(CudaSlice<u16>),
}

impl DeviceData {
    /// The allocation's length (at least one element: CUDA rejects empty allocations).
    pub fn capacity(&self) -> usize {
        match self {
            DeviceData::F32(s) => s.len(),
            DeviceData::I32(s) => s.len(),
            DeviceData::Bf16(s) => s.len(),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            DeviceData::F32(_) => DType::F32,
            DeviceData::I32(_) => DType::I32,
            DeviceData::Bf16(_) => DType::Bf16,
        }
    }
}

/// A floating-point storage type of the kernels: f32, or bf16 held as its bits (`u16`).
pub trait Elem: DeviceRepr + ValidAsZeroBits + Copy + 'static {
    /// The element type it stores.
    const DTYPE: DType;

    fn of(data: &DeviceData) -> Option<&CudaSlice<Self>>;

    fn of_mut(data: &mut DeviceData) -> Option<&mut CudaSlice<Self>>;
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;

    fn of(data: &DeviceData) -> Option<&CudaSlice<f32>> {
        if let DeviceData::F32(s) = data { Some(s) } else { None }
    }

    fn of_mut(data: &mut DeviceData) -> Option<&mut CudaSlice<f32>> {
        if let DeviceData::F32(s) = data { Some(s) } else { None }
    }
}

impl Elem for u16 {
    const DTYPE: DType = DType::Bf16;

    fn of(data: &DeviceData) -> Option<&CudaSlice<u16>> {
        if let DeviceData::Bf16(s) = data { Some(s) } else { None }
    }

    fn of_mut(data: &mut DeviceData) -> Option<&mut CudaSlice<u16>> {
        if let DeviceData::Bf16(s) = data { Some(s) } else { None }
    }
}

/// A dense row-major tensor in GPU memory; its elements are the first `numel(shape)` of the allocation.
#[derive(Debug)]
pub struct DeviceTensor {
    pub shape: Vec<u64>,
    pub data: DeviceData,
}

/// What an error calls a product block that starts past its buffer (a bug).
const BLOCK_PAST_BUFFER: &str = "a product block starts past its buffer";

/// A zeroed allocation of `n` elements (at least one).
fn alloc<T: DeviceRepr + ValidAsZeroBits>(stream: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<T>, KernelError> {
    Ok(stream.alloc_zeros::<T>(n.max(1)).map_err(driver("allocating GPU memory"))?)
}

/// A device copy of host values.
fn upload_slice<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    v: &[T],
) -> Result<CudaSlice<T>, KernelError> {
    let mut dst = alloc::<T>(stream, v.len())?;
    if !v.is_empty() {
        stream.memcpy_htod(v, &mut dst).map_err(driver("copying to the GPU"))?;
    }
    Ok(dst)
}

/// The first `dst.len()` elements of a device buffer into host memory (waits for the stream).
fn download_to<T: DeviceRepr>(stream: &Arc<CudaStream>, s: &CudaSlice<T>, dst: &mut [T]) -> Result<(), KernelError> {
    let n = dst.len();
    if n == 0 {
        return Ok(());
    }
    let view = s.try_slice(..n).ok_or(DeviceError::ShortBuffer { len: s.len(), want: n })?;
    stream.memcpy_dtoh(&view, dst).map_err(driver("copying from the GPU"))?;
    Ok(stream.synchronize().map_err(driver("waiting for the GPU"))?)
}

/// The first `n` elements of a device buffer (waits for the stream).
fn download_slice<T: DeviceRepr>(stream: &Arc<CudaStream>, s: &CudaSlice<T>, n: usize) -> Result<Vec<T>, KernelError> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let view = s.try_slice(..n).ok_or(DeviceError::ShortBuffer { len: s.len(), want: n })?;
    Ok(stream.clone_dtoh(&view).map_err(driver("copying from the GPU"))?)
}

impl DeviceTensor {
    /// A zero-filled tensor of the given element type and shape.
    pub fn zeros(stream: &Arc<CudaStream>, dtype: DType, shape: &[u64]) -> Result<DeviceTensor, KernelError> {
        let n = numel(shape);
        let data = match dtype {
            DType::Bf16 => DeviceData::Bf16(alloc(stream, n)?),
            _ if dtype.is_integer() => DeviceData::I32(alloc(stream, n)?),
            _ => DeviceData::F32(alloc(stream, n)?),
        };
        Ok(DeviceTensor { shape: shape.to_vec(), data })
    }

    /// A device copy of a host view in its own element type (bf16 stays bf16: two bytes an element).
    pub fn upload_view(stream: &Arc<CudaStream>, v: &View) -> Result<DeviceTensor, KernelError> {
        let n = numel(&v.shape);
        require(v.len() == n, || {
            KernelError::Invalid(format!("a view of shape {:?} holds {} elements", v.shape, v.len()))
        })?;
        let data = match v.data {
            ViewData::F32(x) => DeviceData::F32(upload_slice(stream, x)?),
            ViewData::I32(x) => DeviceData::I32(upload_slice(stream, x)?),
            ViewData::Bf16(x) => DeviceData::Bf16(upload_slice(stream, x)?),
        };
        Ok(DeviceTensor { shape: v.shape.to_vec(), data })
    }

    /// Copies this tensor into a host view of the same element type and length (waits for the stream).
    pub fn download_into(&self, stream: &Arc<CudaStream>, out: &mut ViewMut) -> Result<(), KernelError> {
        let n = numel(&self.shape);
        require(out.len() == n, || {
            KernelError::Invalid(format!("a host buffer of {} elements cannot take {:?}", out.len(), self.shape))
        })?;
        match (&self.data, &mut out.data) {
            (DeviceData::F32(s), ViewMutData::F32(d)) => download_to(stream, s, d),
            (DeviceData::I32(s), ViewMutData::I32(d)) => download_to(stream, s, d),
            (DeviceData::Bf16(s), ViewMutData::Bf16(d)) => download_to(stream, s, d),
            (s, _) => Err(KernelError::Invalid(format!(
                "a {:?} GPU tensor cannot be copied into a host buffer of another type",
                s.dtype()
            ))),
        }
    }

    /// A device copy of a host tensor.
    pub fn upload(stream: &Arc<CudaStream>, t: &Tensor) -> Result<DeviceTensor, KernelError> {
        let n = numel(&t.shape);
        require(t.len() == n, || {
            KernelError::Invalid(format!("a tensor of shape {:?} holds {} elements", t.shape, t.len()))
        })?;
        let data = match &t.data {
            Data::F32(v) => DeviceData::F32(upload_slice(stream, v)?),
            Data::I32(v) => DeviceData::I32(upload_slice(stream, v)?),
        };
        Ok(DeviceTensor { shape: t.shape.clone(), data })
    }

    /// A host copy (waits for the stream's pending work); bf16 elements come back widened to f32, as
    /// from a host view.
    pub fn download(&self, stream: &Arc<CudaStream>) -> Result<Tensor, KernelError> {
        let n = numel(&self.shape);
        let data = match &self.data {
            DeviceData::F32(s) => Data::F32(download_slice(stream, s, n)?),
            DeviceData::I32(s) => Data::I32(download_slice(stream, s, n)?),
            DeviceData::Bf16(s) => Data::F32(crate::bf16::widen(&download_slice(stream, s, n)?)),
        };
        Ok(Tensor { shape: self.shape.clone(), data })
    }

    /// The number of elements (of the shape).
    pub fn len(&self) -> usize {
        numel(&self.shape)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// ---- checks (as in the CPU kernels) ---------------------------------------------------------------

/// Exactly `N` inputs.
fn args<'t, const N: usize>(inputs: &[&'t DeviceTensor]) -> Result<[&'t DeviceTensor; N], KernelError> {
    <[&'t DeviceTensor; N]>::try_from(inputs).map_err(|_| ShapeError::Operands { want: N, got: inputs.len() }.into())
}

/// The f32 storage of an input, checked against its shape.
fn floats<'t>(t: &'t DeviceTensor, what: &str) -> Result<&'t CudaSlice<f32>, KernelError> {
    elems::<f32>(t, what)
}

/// Operand `what`, of element type `found`, read as `want`.
fn wrong_type(found: DType, want: DType, what: &str) -> KernelError {
    KernelError::operand(what, crate::error::ElementError::Type { want, found })
}

/// Operand `what`, of `len` elements, whose shape is `shape`.
fn holds(what: &str, len: usize, shape: &[u64]) -> KernelError {
    KernelError::Holds { what: what.to_string(), len, shape: shape.to_vec() }
}

/// The storage of a floating-point input of element type `T`, checked against its shape.
fn elems<'t, T: Elem>(t: &'t DeviceTensor, what: &str) -> Result<&'t CudaSlice<T>, KernelError> {
    match T::of(&t.data) {
        Some(s) if s.len() >= t.len() => Ok(s),
        Some(s) => Err(holds(what, s.len(), &t.shape)),
        None => Err(wrong_type(t.data.dtype(), T::DTYPE, what)),
    }
}

/// The storage of a floating-point tensor of element type `T` written in place, checked against its shape.
fn elems_mut<'t, T: Elem>(t: &'t mut DeviceTensor, what: &str) -> Result<&'t mut CudaSlice<T>, KernelError> {
    let (n, capacity, dtype) = (t.len(), t.data.capacity(), t.data.dtype());
    match T::of_mut(&mut t.data) {
        Some(_) if capacity < n => Err(KernelError::HoldsCount { what: what.to_string(), len: capacity, want: n }),
        Some(s) => Ok(s),
        None => Err(wrong_type(dtype, T::DTYPE, what)),
    }
}

/// The i32 storage of an input, checked against its shape.
fn ints<'t>(t: &'t DeviceTensor, what: &str) -> Result<&'t CudaSlice<i32>, KernelError> {
    match &t.data {
        DeviceData::I32(s) if s.len() >= t.len() => Ok(s),
        DeviceData::I32(s) => Err(holds(what, s.len(), &t.shape)),
        other => Err(wrong_type(other.dtype(), DType::I32, what)),
    }
}

/// The f32 storage of a tensor written in place, checked against its shape.
fn floats_mut<'t>(t: &'t mut DeviceTensor, what: &str) -> Result<&'t mut CudaSlice<f32>, KernelError> {
    elems_mut::<f32>(t, what)
}

/// An f32 input of exactly `rows * width` elements (per-row statistics, vectors).
fn per_row<'t>(t: &'t DeviceTensor, rows: usize, width: usize, what: &str) -> Result<&'t CudaSlice<f32>, KernelError> {
    per_row_of::<f32>(t, rows, width, what)
}

/// As [`per_row`], for an input of element type `T`.
fn per_row_of<'t, T: Elem>(
    t: &'t DeviceTensor,
    rows: usize,
    width: usize,
    what: &str,
) -> Result<&'t CudaSlice<T>, KernelError> {
    let s = elems::<T>(t, what)?;
    same_len(what, t.len(), rows * width)?;
    Ok(s)
}

// ---- launch configurations ------------------------------------------------------------------------

const THREADS: u32 = 256;
/// Grid-stride kernels use at most this many blocks.
const MAX_BLOCKS: usize = 1 << 14;
/// Row kernels use at most this many blocks (each loops over its rows).
const MAX_ROW_BLOCKS: usize = 1 << 16;

fn config(grid: (usize, usize), block: (u32, u32)) -> LaunchConfig {
    let dim = |x: usize| u32::try_from(x.max(1)).unwrap_or(u32::MAX);
    LaunchConfig { grid_dim: (dim(grid.0), dim(grid.1), 1), block_dim: (block.0, block.1, 1), shared_mem_bytes: 0 }
}

/// One thread per element (grid-stride), none when there are no elements.
fn elementwise(n: usize) -> Option<LaunchConfig> {
    (n > 0).then(|| config((n.div_ceil(THREADS as usize).min(MAX_BLOCKS), 1), (THREADS, 1)))
}

/// The launch of elementwise kernel `name` over `n` elements: one thread per element, or per eight for
/// the `_bf16x8` entry points (see [`bf16::by_eights`]).
fn elementwise_by(name: &str, n: usize) -> Option<LaunchConfig> {
    match name.ends_with("x8") {
        true if n > 0 => elementwise(n / 8),
        _ => elementwise(n),
    }
}

/// One block per row, of 32 to 256 threads depending on the width.
fn per_rows(rows: usize, width: usize) -> Option<LaunchConfig> {
    let threads = (width.div_ceil(32).clamp(1, 8) * 32) as u32;
    (rows > 0).then(|| config((rows.min(MAX_ROW_BLOCKS), 1), (threads, 1)))
}

/// The launch of row kernel `name` over [rows, width]: one warp a row (eight a block) for the eight-wide
/// `_bf16x8` entry points (see [`bf16::by_eights`]), else one block a row.
fn rows_by(name: &str, rows: usize, width: usize) -> Option<LaunchConfig> {
    match name.ends_with("x8") {
        true => (rows > 0).then(|| config((rows.div_ceil(8).min(MAX_ROW_BLOCKS), 1), (THREADS, 1))),
        false => per_rows(rows, width),
    }
}

/// Blocks of (32 columns, 8 rows) for `column_sum`, with enough row chunks to fill the GPU.
fn columns(rows: usize, width: usize) -> Option<LaunchConfig> {
    (rows > 0 && width > 0).then(|| config((width.div_ceil(32), rows.div_ceil(8 * 16).clamp(1, 1024)), (32, 8)))
}

fn single_block() -> Option<LaunchConfig> {
    Some(config((1, 1), (THREADS, 1)))
}

fn blas_dim(x: usize) -> Result<i32, KernelError> {
    i32::try_from(x).map_err(|_| DeviceError::BlasRange { what: "dimension", value: x }.into())
}

fn blas_stride(x: usize) -> Result<i64, KernelError> {
    i64::try_from(x).map_err(|_| DeviceError::BlasRange { what: "stride", value: x }.into())
}

// ---- the device: stream, functions, cuBLAS --------------------------------------------------------

/// Launches `$name` with `$cfg` (nothing when `None`) and the given arguments, in the order of the kernel's
/// parameters in kernels.cu.
macro_rules! launch {
    ($dev:expr, $name:expr, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        let dev: &Device = $dev;
        let name: &str = $name;
        match $cfg {
            None => Ok(()),
            Some(cfg) => {
                let func = dev.function(name)?;
                let mut builder = dev.stream.launch_builder(func);
                $( builder.arg($arg); )*
                // SAFETY: the arguments match the kernel's parameters (pointers, u64 counts, f32/f64
                // scalars), and the caller checked that every buffer holds the elements it indexes.
                unsafe { builder.launch(cfg) }
                    .map(|_| ())
                    .map_err(|error| KernelError::from(DeviceError::Launch { function: name.to_string(), error }))
            }
        }
    }};
}

/// The stream, the compiled functions and the cuBLAS handle (everything a launch needs).
struct Device {
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
    blas: CudaBlas,
    /// The gradient norm's scratch (see [`SquareSums`]).
    square_sums: std::sync::Mutex<SquareSums>,
    /// Whether bf16 attention runs on the flash kernels (see [`flash`]).
    flash: bool,
    /// Padded copies of bf16 product operands whose rows are not 16-byte aligned.
    realign: std::sync::Mutex<bf16::Realign>,
}

/// Elements of one tensor that one block of the gradient norm's first pass sums.
const SQUARE_SUM_SPAN: usize = 16 * THREADS as usize;

/// The gradient norm's scratch, grown as needed: the span table on the GPU (address, length, first block
/// per tensor) with the host copy it was last written from (the arena does not move, so the table is
/// written once), one f64 per block and one per tensor.
#[derive(Default)]
struct SquareSums {
    table: Vec<u64>,
    spans: Option<CudaSlice<u64>>,
    partials: Option<CudaSlice<f64>>,
    totals: Option<CudaSlice<f64>>,
}

/// A row-major matrix inside a buffer: `rows x cols` at `start`, rows `ld` apart, and one such block
/// every `stride` elements when batched.
#[derive(Clone, Copy, Debug)]
struct Block {
    start: usize,
    rows: usize,
    cols: usize,
    ld: usize,
    stride: usize,
}

impl Block {
    /// A contiguous `rows x cols` matrix (and batches of them, back to back).
    fn dense(rows: usize, cols: usize) -> Block {
        Block { start: 0, rows, cols, ld: cols, stride: rows * cols }
    }

    /// Whether `batches` blocks fit in `len` elements.
    fn fits(&self, batches: usize, len: usize) -> bool {
        if self.rows == 0 || self.cols == 0 || batches == 0 {
            return self.start <= len;
        }
        let last_batch = (batches - 1).checked_mul(self.stride);
        let last_row = (self.rows - 1).checked_mul(self.ld);
        let end = [last_batch, last_row, Some(self.start), Some(self.cols)]
            .into_iter()
            .try_fold(0usize, |acc, term| term.and_then(|t| acc.checked_add(t)));
        self.ld >= self.cols && end.is_some_and(|e| e <= len)
    }
}

/// One operand of a product: a block of a buffer, used transposed or not.
struct Operand<'a, T = f32> {
    data: &'a CudaSlice<T>,
    block: Block,
    transpose: bool,
}

impl<T> Clone for Operand<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Operand<'_, T> {}

impl<T> Operand<'_, T> {
    /// (rows, cols) of op(block).
    fn dims(&self) -> (usize, usize) {
        if self.transpose { (self.block.cols, self.block.rows) } else { (self.block.rows, self.block.cols) }
    }

    fn op(&self) -> cublasOperation_t {
        if self.transpose { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N }
    }
}

/// A product C (+)= alpha op(A) op(B) over `batches` blocks.
struct Product<'a, T = f32> {
    a: Operand<'a, T>,
    b: Operand<'a, T>,
    c: Block,
    batches: usize,
    alpha: f32,
    accumulate: bool,
}

/// What a checked product leaves to do.
enum Work {
    /// Nothing (no batches, or an empty output).
    Nothing,
    /// Zero the output blocks (an empty sum, not accumulated).
    Zero,
    /// Multiply (m, n, k).
    Multiply(usize, usize, usize),
}

impl<T> Product<'_, T> {
    /// Checks the dimensions and extents of the product against an output buffer of `c_len` elements.
    fn check(&self, c_len: usize) -> Result<Work, KernelError> {
        let (Product { a, b, c: cb, batches, .. }, (m, k), (k2, n)) = (self, self.a.dims(), self.b.dims());
        require(cb.rows == m && cb.cols == n && k == k2, || KernelError::Product {
            lhs: [m, k],
            rhs: [k2, n],
            out: [cb.rows, cb.cols],
        })?;
        let fits =
            a.block.fits(*batches, a.data.len()) && b.block.fits(*batches, b.data.len()) && cb.fits(*batches, c_len);
        require(fits, || KernelError::Internal(format!("a {m}x{k} by {k}x{n} product does not fit its buffers")))?;
        Ok(match (*batches == 0 || m == 0 || n == 0, k == 0) {
            (true, _) => Work::Nothing,
            (false, true) if self.accumulate => Work::Nothing,
            (false, true) => Work::Zero,
            (false, false) => Work::Multiply(m, n, k),
        })
    }
}

impl Device {
    fn function(&self, name: &str) -> Result<&CudaFunction, KernelError> {
        self.functions.get(name).ok_or_else(|| DeviceError::NotLoaded(name.to_string()).into())
    }

    /// The device address where `s` starts (for alignment checks).
    fn start<T>(&self, s: &CudaSlice<T>) -> u64 {
        use cudarc::driver::DevicePtr;
        s.device_ptr(&self.stream).0
    }

    fn zero<T: DeviceRepr + ValidAsZeroBits>(&self, s: &mut CudaSlice<T>) -> Result<(), KernelError> {
        Ok(self.stream.memset_zeros(s).map_err(driver("zeroing GPU memory"))?)
    }

    /// Runs a product after checking its dimensions and extents (row-major C = op(A) op(B) is computed
    /// by column-major cuBLAS as C^T = op(B)^T op(A)^T).
    fn gemm(&self, c: &mut CudaSlice<f32>, p: Product) -> Result<(), KernelError> {
        match p.check(c.len())? {
            Work::Nothing => Ok(()),
            Work::Zero => self.zero_blocks(c, p.c, p.batches),
            Work::Multiply(m, n, k) => self.cublas(c, &p, (m, n, k)),
        }
    }

    fn cublas(&self, c: &mut CudaSlice<f32>, p: &Product, (m, n, k): (usize, usize, usize)) -> Result<(), KernelError> {
        let gemm = GemmConfig {
            transa: p.b.op(),
            transb: p.a.op(),
            m: blas_dim(n)?,
            n: blas_dim(m)?,
            k: blas_dim(k)?,
            alpha: p.alpha,
            lda: blas_dim(p.b.block.ld.max(1))?,
            ldb: blas_dim(p.a.block.ld.max(1))?,
            beta: if p.accumulate { 1.0 } else { 0.0 },
            ldc: blas_dim(p.c.ld.max(1))?,
        };
        let missing = || KernelError::Internal(BLOCK_PAST_BUFFER.into());
        let av = p.a.data.try_slice(p.a.block.start..).ok_or_else(missing)?;
        let bv = p.b.data.try_slice(p.b.block.start..).ok_or_else(missing)?;
        let mut cv = c.try_slice_mut(p.c.start..).ok_or_else(missing)?;
        self.stream.context().bind_to_thread().map_err(driver("binding the CUDA context"))?;
        let result = if p.batches == 1 {
            // SAFETY: the extents of all three blocks were checked against their buffers.
            unsafe { self.blas.gemm(gemm, &bv, &av, &mut cv) }
        } else {
            let cfg = StridedBatchedConfig {
                gemm,
                batch_size: blas_dim(p.batches)?,
                stride_a: blas_stride(p.b.block.stride)?,
                stride_b: blas_stride(p.a.block.stride)?,
                stride_c: blas_stride(p.c.stride)?,
            };
            // SAFETY: as above, for every batch.
            unsafe { self.blas.gemm_strided_batched(cfg, &bv, &av, &mut cv) }
        };
        result.map_err(|error| DeviceError::Blas { call: "sgemm", error }.into())
    }

    /// Zeroes `batches` blocks of `c` (an empty product).
    fn zero_blocks<T: Elem>(&self, c: &mut CudaSlice<T>, b: Block, batches: usize) -> Result<(), KernelError> {
        let mut view =
            c.try_slice_mut(b.start..).ok_or_else(|| KernelError::Internal("a block starts past its buffer".into()))?;
        let (batches, rows, cols, ld, stride) =
            (batches as u64, b.rows as u64, b.cols as u64, b.ld as u64, b.stride as u64);
        let cfg = elementwise(numel(&[batches, rows, cols]));
        launch!(self, variant::<T>(ZERO_BLOCKS)?, cfg, [&mut view, &batches, &rows, &cols, &ld, &stride])
    }
}

// ---- matrix products ------------------------------------------------------------------------------

impl Device {
    fn matmul<T: Elem, C: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        ta: bool,
        tb: bool,
        acc: bool,
    ) -> Result<(), KernelError>
    where
        Device: Multiply<T, C>,
    {
        let [a, b] = args(inputs)?;
        let ((ar, ac), (br, bc)) = (split_last(&a.shape), split_last(&b.shape));
        let (av, bv) = (elems::<T>(a, "A")?, elems::<T>(b, "B")?);
        let (m, n) = split_last(&out.shape);
        let y = elems_mut::<C>(out, "the output")?;
        let product = Product {
            a: Operand { data: av, block: Block::dense(ar, ac), transpose: ta },
            b: Operand { data: bv, block: Block::dense(br, bc), transpose: tb },
            c: Block::dense(m, n),
            batches: 1,
            alpha: 1.0,
            accumulate: acc,
        };
        self.multiply(y, product)
    }

    fn batched_matmul<T: Elem, C: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
    ) -> Result<(), KernelError>
    where
        Device: Multiply<T, C>,
    {
        let [a, b] = args(inputs)?;
        let (la, m, k, n) = batched_product(&a.shape, &b.shape, &out.shape)?;
        let batches = numel(la);
        let (av, bv) = (elems::<T>(a, "A")?, elems::<T>(b, "B")?);
        let y = elems_mut::<C>(out, "the output")?;
        let product = Product {
            a: Operand { data: av, block: Block::dense(m, k), transpose: false },
            b: Operand { data: bv, block: Block::dense(k, n), transpose: false },
            c: Block::dense(m, n),
            batches,
            alpha: 1.0,
            accumulate: false,
        };
        self.multiply(y, product)
    }
}

/// A product with operands of element type `T` into an output of element type `C`: cuBLAS sgemm for
/// f32, gemmEx for bf16 operands (see [`bf16`]).
trait Multiply<T, C> {
    fn multiply(&self, c: &mut CudaSlice<C>, p: Product<T>) -> Result<(), KernelError>;
}

impl Multiply<f32, f32> for Device {
    fn multiply(&self, c: &mut CudaSlice<f32>, p: Product) -> Result<(), KernelError> {
        self.gemm(c, p)
    }
}

// ---- elementwise ----------------------------------------------------------------------------------

impl Device {
    fn map_unary<T: Elem>(
        &self,
        name: &'static str,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
    ) -> Result<(), KernelError> {
        let [x] = args(inputs)?;
        let xv = elems::<T>(x, "the input")?;
        same_len("the output", out.len(), x.len())?;
        let y = elems_mut::<T>(out, "the output")?;
        let name = by_eights(variant::<T>(name)?, x.len(), &[self.start(xv), self.start(y)]);
        let n = x.len() as u64;
        launch!(self, name, elementwise_by(name, x.len()), [y, xv, &n])
    }

    fn map_binary<T: Elem>(
        &self,
        name: &'static str,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
    ) -> Result<(), KernelError> {
        let [a, b] = args(inputs)?;
        let (av, bv) = (elems::<T>(a, "the first input")?, elems::<T>(b, "the second input")?);
        same_len("the second input", b.len(), a.len())?;
        same_len("the output", out.len(), a.len())?;
        let y = elems_mut::<T>(out, "the output")?;
        let name = by_eights(variant::<T>(name)?, a.len(), &[self.start(av), self.start(bv), self.start(y)]);
        let n = a.len() as u64;
        launch!(self, name, elementwise_by(name, a.len()), [y, av, bv, &n])
    }

    fn scale<T: Elem>(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor, factor: f64) -> Result<(), KernelError> {
        let [x] = args(inputs)?;
        let xv = elems::<T>(x, "the input")?;
        same_len("the output", out.len(), x.len())?;
        let y = elems_mut::<T>(out, "the output")?;
        let name = by_eights(variant::<T>(SCALE)?, x.len(), &[self.start(xv), self.start(y)]);
        let (factor, n) = (factor as f32, x.len() as u64);
        launch!(self, name, elementwise_by(name, x.len()), [y, xv, &factor, &n])
    }

    fn bias_add<T: Elem>(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor) -> Result<(), KernelError> {
        let [x, b] = args(inputs)?;
        let (_, width) = split_last(&x.shape);
        let (xv, bv) = (elems::<T>(x, "x")?, elems::<T>(b, "the bias")?);
        same_len("the bias", b.len(), width)?;
        same_len("the output", out.len(), x.len())?;
        let y = elems_mut::<T>(out, "the output")?;
        let starts = [self.start(xv), self.start(bv), self.start(y)];
        // Eight elements of a thread must lie in one row: the width too is a multiple of 8.
        let name = match in_eights(width, &[]) {
            true => by_eights(variant::<T>(BIAS_ADD)?, x.len(), &starts),
            false => variant::<T>(BIAS_ADD)?,
        };
        let (n, width) = (x.len() as u64, width as u64);
        launch!(self, name, elementwise_by(name, x.len()), [y, xv, bv, &n, &width])
    }

    fn softmax<T: Elem>(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor) -> Result<(), KernelError> {
        let [x] = args(inputs)?;
        let (rows, width) = split_last(&x.shape);
        let xv = elems::<T>(x, "the input")?;
        same_len("the output", out.len(), x.len())?;
        let y = elems_mut::<T>(out, "the output")?;
        let cfg = if x.is_empty() { None } else { per_rows(rows, width) };
        let (rows, width) = (rows as u64, width as u64);
        launch!(self, variant::<T>(SOFTMAX)?, cfg, [y, xv, &rows, &width])
    }

    fn softmax_grad<T: Elem>(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor) -> Result<(), KernelError> {
        let [dy, y] = args(inputs)?;
        let (rows, width) = split_last(&y.shape);
        let (dyv, yv) = (elems::<T>(dy, "dy")?, elems::<T>(y, "y")?);
        same_len("dy", dy.len(), y.len())?;
        same_len("the output", out.len(), y.len())?;
        let dx = elems_mut::<T>(out, "the output")?;
        let cfg = if y.is_empty() { None } else { per_rows(rows, width) };
        let (rows, width) = (rows as u64, width as u64);
        launch!(self, variant::<T>(SOFTMAX_GRAD)?, cfg, [dx, dyv, yv, &rows, &width])
    }

    fn causal_mask<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        fill: f32,
    ) -> Result<(), KernelError> {
        let [x] = args(inputs)?;
        let (_, rows, cols) = batch_matrix(&x.shape, "the input")?;
        let xv = elems::<T>(x, "the input")?;
        same_len("the output", out.len(), x.len())?;
        let y = elems_mut::<T>(out, "the output")?;
        let (n, rows, cols) = (x.len() as u64, rows as u64, cols as u64);
        launch!(self, variant::<T>(CAUSAL_MASK)?, elementwise(x.len()), [y, xv, &n, &rows, &cols, &fill])
    }

    fn fill(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor, value: f64) -> Result<(), KernelError> {
        args::<0>(inputs)?;
        let n = out.len();
        require(out.data.capacity() >= n, || {
            KernelError::Invalid("the output holds fewer elements than its shape".into())
        })?;
        let (cfg, count) = (elementwise(n), n as u64);
        match &mut out.data {
            DeviceData::F32(s) => {
                let bits = (value as f32).to_bits();
                launch!(self, FILL_BITS, cfg, [s, &bits, &count])
            }
            DeviceData::I32(s) => {
                let bits = (value as i32) as u32;
                launch!(self, FILL_BITS, cfg, [s, &bits, &count])
            }
            DeviceData::Bf16(_) => Err(KernelError::Internal("a bf16 fill reached the f32 kernel".into())),
        }
    }
}

// ---- dropout --------------------------------------------------------------------------------------

/// The per-tensor start of the dropout stream and the keep threshold: the CPU's mask, so that both
/// backends drop the same elements.
pub use optimus_plan::logical::DropoutMask as DropoutParams;

/// What the logical indices of a buffer depend on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct IndexKey {
    logical: Vec<u64>,
    local: Vec<u64>,
    layout: Layout,
    coords: Coords,
    mesh: Mesh,
}

impl IndexKey {
    fn of(ctx: &KernelContext) -> IndexKey {
        let meta = ctx.output;
        let (logical, local) = (meta.logical_shape.clone(), meta.shape.clone());
        IndexKey { logical, local, layout: meta.layout, coords: ctx.coords, mesh: ctx.mesh }
    }
}

// ---- data movement --------------------------------------------------------------------------------

/// The storage of an input and an output of the same element type (data movement works on either).
enum Pair<'a> {
    F32(&'a CudaSlice<f32>, &'a mut CudaSlice<f32>),
    I32(&'a CudaSlice<i32>, &'a mut CudaSlice<i32>),
    Bf16(&'a CudaSlice<u16>, &'a mut CudaSlice<u16>),
}

fn pair<'a>(x: &'a DeviceTensor, out: &'a mut DeviceTensor) -> Result<Pair<'a>, KernelError> {
    let fits = x.data.capacity() >= x.len() && out.data.capacity() >= out.len();
    match (&x.data, &mut out.data) {
        (DeviceData::F32(_), DeviceData::F32(_))
        | (DeviceData::I32(_), DeviceData::I32(_))
        | (DeviceData::Bf16(_), DeviceData::Bf16(_))
            if !fits =>
        {
            Err(KernelError::CountNotShape)
        }
        (DeviceData::F32(s), DeviceData::F32(d)) => Ok(Pair::F32(s, d)),
        (DeviceData::I32(s), DeviceData::I32(d)) => Ok(Pair::I32(s, d)),
        (DeviceData::Bf16(s), DeviceData::Bf16(d)) => Ok(Pair::Bf16(s, d)),
        _ => Err(KernelError::ElementTypesDiffer),
    }
}

impl Device {
    /// Applies `runs` between the first `src_n` / `dst_n` elements of two buffers.
    fn copy_runs<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        src: &CudaSlice<T>,
        dst: &mut CudaSlice<T>,
        (src_n, dst_n): (usize, usize),
        runs: Runs,
    ) -> Result<(), KernelError> {
        require(runs.fits(src_n, dst_n), || ShapeError::RunsOutside(runs))?;
        if runs.zero_first {
            self.stream.memset_zeros(dst).map_err(driver("zeroing GPU memory"))?;
        }
        if runs.count == 1 && runs.len > 0 {
            // One contiguous run (a reshape, a dropout that keeps everything): a device-to-device copy.
            let (from, to) = (runs.src_offset, runs.dst_offset);
            let past = || KernelError::Internal("a run is past its buffer".into());
            let src = src.try_slice(from..from + runs.len).ok_or_else(past)?;
            let mut dst = dst.try_slice_mut(to..to + runs.len).ok_or_else(past)?;
            return Ok(self.stream.memcpy_dtod(&src, &mut dst).map_err(driver("copying on the GPU"))?);
        }
        let cfg = elementwise(runs.count.saturating_mul(runs.len));
        let r = [runs.count, runs.len, runs.src_stride, runs.src_offset, runs.dst_stride, runs.dst_offset]
            .map(|v| v as u64);
        launch!(self, words::<T>(COPY_RUNS)?, cfg, [dst, src, &r[0], &r[1], &r[2], &r[3], &r[4], &r[5]])
    }

    fn move_runs(&self, x: &DeviceTensor, out: &mut DeviceTensor, runs: Runs) -> Result<(), KernelError> {
        let counts = (x.len(), out.len());
        match pair(x, out)? {
            Pair::F32(s, d) => self.copy_runs(s, d, counts, runs),
            Pair::I32(s, d) => self.copy_runs(s, d, counts, runs),
            Pair::Bf16(s, d) => self.copy_runs(s, d, counts, runs),
        }
    }

    fn reshape(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor) -> Result<(), KernelError> {
        let [x] = args(inputs)?;
        self.move_runs(x, out, reshape_runs(&x.shape, &out.shape)?)
    }

    fn select(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        dim: usize,
        index: u64,
    ) -> Result<(), KernelError> {
        let [x] = args(inputs)?;
        self.move_runs(x, out, select_runs(&x.shape, &out.shape, dim, index)?)
    }

    fn select_grad(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        dim: usize,
        index: u64,
    ) -> Result<(), KernelError> {
        let [dy] = args(inputs)?;
        self.move_runs(dy, out, select_grad_runs(&dy.shape, &out.shape, dim, index)?)
    }

    fn transpose(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        dim0: usize,
        dim1: usize,
    ) -> Result<(), KernelError> {
        let [x] = args(inputs)?;
        let swap = transpose_swap(&x.shape, &out.shape, dim0, dim1)?;
        match pair(x, out).map_err(|_| KernelError::TransposeOperands)? {
            Pair::F32(src, dst) => self.swap(src, dst, swap),
            Pair::I32(src, dst) => self.swap(src, dst, swap),
            Pair::Bf16(src, dst) => self.swap(src, dst, swap),
        }
    }

    fn swap<T>(&self, src: &CudaSlice<T>, dst: &mut CudaSlice<T>, s: Swap) -> Result<(), KernelError> {
        let n = numel(&[s.a, s.p, s.b, s.q, s.c].map(|v| v as u64));
        let d = [s.a, s.p, s.b, s.q, s.c].map(|v| v as u64);
        launch!(self, words::<T>(TRANSPOSE)?, elementwise(n), [dst, src, &d[0], &d[1], &d[2], &d[3], &d[4]])
    }

    fn slice_shard(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        ctx: &KernelContext,
        axis: usize,
        p: Placement,
    ) -> Result<(), KernelError> {
        let [x] = args(inputs)?;
        self.move_runs(x, out, slice_shard_runs(&x.shape, &out.shape, ctx.mesh, ctx.coords, axis, p)?)
    }
}

// ---- attention ------------------------------------------------------------------------------------
//
// Every product runs over heads as one strided batch. With grouped-query attention (kv_heads < heads,
// group = heads / kv_heads) query head k * group + r reads kv head k, so each product runs once per
// member r of a group, batched over the kv heads: the query-side blocks (q, the output, dy, the
// scores) step by group heads, the kv blocks by one. With one query head per kv head (group 1) this is
// a single product over all heads.

/// The [seq, d] blocks of heads first, first + step, ... of batch b in `packing` (one batch of a strided
/// product).
fn heads_from(packing: &Packing, b: usize, d: usize, first: usize, step: usize) -> Block {
    Block { start: packing.start(b, first, d), rows: packing.seq, cols: d, ld: packing.row, stride: step * d }
}

/// The operands of an attention (fused or not) in this backend's storage (f32 unless told).
type Qkv<'a, T = f32> = crate::qkv::Qkv<'a, CudaSlice<T>>;

impl<'a, T: Elem> Qkv<'a, T> {
    fn of(operands: &[&'a DeviceTensor], heads: (u64, u64), fused: bool) -> Result<Qkv<'a, T>, KernelError> {
        Qkv::new(operands, |t| t.shape.as_slice(), elems::<T>, heads, fused)
    }

    /// The blocks of a tensor packed like `packing` that member r of every group touches: for the
    /// query side (q, the output, dy, dq) query head k * group + r of each kv head k; for k and v
    /// (and their gradients) every kv head.
    fn member_block(&self, packing: Packing, query_side: bool, b: usize, r: usize) -> Block {
        if query_side {
            heads_from(&packing, b, self.d, r, self.group())
        } else {
            heads_from(&packing, b, self.d, 0, 1)
        }
    }

    /// `operand`'s blocks for member r of each group of batch b, as a product operand.
    fn operand(&self, operand: usize, b: usize, r: usize, transpose: bool) -> Operand<'a, T> {
        let block = self.member_block(self.packing[operand], operand == 0, b, r);
        Operand { data: self.data[operand], block, transpose }
    }

    /// The output's (and dy's) blocks for member r of each group of batch b.
    fn out_block(&self, b: usize, r: usize) -> Block {
        self.member_block(self.out_packing(), true, b, r)
    }

    /// The [sq, sk] score blocks of member r of each group in a dense [heads, sq, sk] scratch.
    fn scores_block(&self, r: usize) -> Block {
        let (sq, sk) = (self.seq(0), self.seq(1));
        Block { start: r * sq * sk, rows: sq, cols: sk, ld: sk, stride: self.group() * sq * sk }
    }
}

/// A scratch of [heads, rows, cols] score blocks as a product operand.
fn scratch_operand<T>(data: &CudaSlice<T>, block: Block, transpose: bool) -> Operand<'_, T> {
    Operand { data, block, transpose }
}

/// `slot` with room for at least `n` elements (reallocated when too small).
fn grow<'s, T: DeviceRepr + ValidAsZeroBits>(
    slot: &'s mut Option<CudaSlice<T>>,
    stream: &Arc<CudaStream>,
    n: usize,
) -> Result<&'s mut CudaSlice<T>, KernelError> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = None;
        *slot = Some(alloc(stream, n)?);
    }
    slot.as_mut().ok_or_else(|| KernelError::Internal("no scratch buffer".into()))
}

impl Device {
    /// The softmax(q k^T / sqrt(d)) probabilities of every head of batch b, into `probs` ([heads, sq, sk]).
    fn probabilities<T: Elem>(
        &self,
        qkv: &Qkv<T>,
        b: usize,
        causal: bool,
        probs: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError>
    where
        Device: Multiply<T, f32>,
    {
        let (sq, sk) = (qkv.seq(0), qkv.seq(1));
        for r in 0..qkv.group() {
            let product = Product {
                a: qkv.operand(0, b, r, false),
                b: qkv.operand(1, b, r, true),
                c: qkv.scores_block(r),
                batches: qkv.kv_heads,
                alpha: qkv.scale(),
                accumulate: false,
            };
            self.multiply(probs, product)?;
        }
        let rows = qkv.heads * sq;
        let cfg = if sk == 0 { None } else { per_rows(rows, sk) };
        let (rows, sq, sk, causal) = (rows as u64, sq as u64, sk as u64, i32::from(causal));
        launch!(self, ATTENTION_SOFTMAX, cfg, [probs, &rows, &sq, &sk, &causal])
    }

    fn attention(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        a: AttentionArgs,
        probs: &mut Option<CudaSlice<f32>>,
    ) -> Result<(), KernelError> {
        let qkv = Qkv::<f32>::of(inputs, (a.heads, a.kv_heads), a.fused)?;
        same_shape("the output", &out.shape, &qkv.out_shape())?;
        let (sq, sk) = (qkv.seq(0), qkv.seq(1));
        let y = floats_mut(out, "the output")?;
        let probs = grow(probs, &self.stream, qkv.heads * sq * sk)?;
        for b in 0..qkv.batch {
            self.probabilities(&qkv, b, a.causal, probs)?;
            for r in 0..qkv.group() {
                let product = Product {
                    a: scratch_operand(probs, qkv.scores_block(r), false),
                    b: qkv.operand(2, b, r, false),
                    c: qkv.out_block(b, r),
                    batches: qkv.kv_heads,
                    alpha: 1.0,
                    accumulate: false,
                };
                self.gemm(y, product)?;
            }
        }
        Ok(())
    }

    /// (dy, operands..) -> the gradient of operand `wrt` (all three, packed, when fused).
    fn attention_grad(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        a: AttentionArgs,
        scratch: &mut [Option<CudaSlice<f32>>; 2],
    ) -> Result<(), KernelError> {
        let (dy, operands) = inputs.split_first().ok_or(KernelError::NoAttentionGradient)?;
        let qkv = Qkv::<f32>::of(operands, (a.heads, a.kv_heads), a.fused)?;
        let wrt = usize::from(a.wrt);
        require(wrt < if a.fused { 1 } else { 3 }, || KernelError::NoOperand(wrt))?;
        same_shape("dy", &dy.shape, &qkv.out_shape())?;
        same_shape("the output", &out.shape, qkv.shapes[wrt])?;
        let dyv = floats(dy, "dy")?;
        let g = floats_mut(out, "the output")?;
        let n = qkv.heads * qkv.seq(0) * qkv.seq(1);
        let [probs, dprobs] = scratch;
        let (probs, dprobs) = (grow(probs, &self.stream, n)?, grow(dprobs, &self.stream, n)?);
        let want = |operand: usize| a.fused || operand == wrt;
        for b in 0..qkv.batch {
            let step = GradStep { qkv: &qkv, dy: dyv, b, want: [want(0), want(1), want(2)] };
            self.probabilities(&qkv, b, a.causal, probs)?;
            self.attention_grad_batch(&step, g, probs, dprobs)?;
        }
        Ok(())
    }

    /// The gradients of batch b, from its probabilities. dk and dv sum the products of every member of
    /// a group (the query heads that share a kv head).
    fn attention_grad_batch(
        &self,
        s: &GradStep,
        g: &mut CudaSlice<f32>,
        probs: &CudaSlice<f32>,
        dprobs: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let (qkv, b) = (s.qkv, s.b);
        let (sq, sk) = (qkv.seq(0), qkv.seq(1));
        let dout = |r| Operand { data: s.dy, block: qkv.out_block(b, r), transpose: false };
        let grad_block = |operand: usize, r| qkv.member_block(qkv.packing[operand], operand == 0, b, r);
        let product =
            |a, b_op, c, alpha, accumulate| Product { a, b: b_op, c, batches: qkv.kv_heads, alpha, accumulate };
        for r in 0..qkv.group().max(1) {
            let summed = r > 0;
            if s.want[2] {
                let p = scratch_operand(probs, qkv.scores_block(r), true);
                self.gemm(g, product(p, dout(r), grad_block(2, r), 1.0, summed))?;
            }
            if s.want[0] || s.want[1] {
                // dP = dO V^T for this member's heads.
                let c = qkv.scores_block(r);
                self.gemm(dprobs, product(dout(r), qkv.operand(2, b, r, true), c, 1.0, false))?;
            }
        }
        if !(s.want[0] || s.want[1]) {
            return Ok(());
        }
        // dS = P * (dP - rowsum(dP * P)); masked entries have P = 0.
        let cfg = if sk == 0 { None } else { per_rows(qkv.heads * sq, sk) };
        let (rows, width) = ((qkv.heads * sq) as u64, sk as u64);
        launch!(self, ATTENTION_SOFTMAX_GRAD, cfg, [&mut *dprobs, probs, &rows, &width])?;
        for r in 0..qkv.group().max(1) {
            if s.want[0] {
                let ds = scratch_operand(dprobs, qkv.scores_block(r), false);
                self.gemm(g, product(ds, qkv.operand(1, b, r, false), grad_block(0, r), qkv.scale(), false))?;
            }
            if s.want[1] {
                let ds = scratch_operand(dprobs, qkv.scores_block(r), true);
                self.gemm(g, product(ds, qkv.operand(0, b, r, false), grad_block(1, r), qkv.scale(), r > 0))?;
            }
        }
        Ok(())
    }
}

/// The parameters of `Attention` / `AttentionGrad`.
#[derive(Clone, Copy, Debug)]
struct AttentionArgs {
    heads: u64,
    kv_heads: u64,
    causal: bool,
    fused: bool,
    wrt: u8,
}

/// What the backward pass of one batch needs.
struct GradStep<'a, T = f32> {
    qkv: &'a Qkv<'a, T>,
    dy: &'a CudaSlice<T>,
    b: usize,
    /// Which operands' gradients to compute (q, k, v).
    want: [bool; 3],
}

// ---- rotary position embedding --------------------------------------------------------------------

impl Device {
    /// Rotary embedding of x [.., seq, heads * d] (`sign` 1) or its backward (`sign` -1), one thread
    /// per rotated pair.
    fn rotary<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        heads: u64,
        theta: f64,
        sign: f32,
    ) -> Result<(), KernelError> {
        let [x] = args(inputs)?;
        let (_, seq, width) = batch_matrix(&x.shape, "x")?;
        let d = optimus_plan::rotary::head_size(width, heads)?;
        let xv = elems::<T>(x, "x")?;
        same_len("the output", out.len(), x.len())?;
        let y = elems_mut::<T>(out, "the output")?;
        let rows = x.len() / width.max(1);
        let pairs = rows * (width / 2);
        let (rows, seq, width, d) = (rows as u64, seq as u64, width as u64, d as u64);
        let name = variant::<T>(ROTARY)?;
        launch!(self, name, elementwise(pairs), [y, xv, &rows, &seq, &width, &d, &theta, &sign])
    }
}

// ---- embeddings -----------------------------------------------------------------------------------

fn table_dims(shape: &[u64], what: &str) -> Result<(usize, usize), KernelError> {
    match shape[..] {
        [rows, w] => Ok((rows as usize, w as usize)),
        _ => Err(KernelError::NotTable { what: what.to_string(), shape: shape.to_vec() }),
    }
}

/// (seq, width) of a [.., seq, width] tensor whose positions come from a [ctx, width] table.
fn position_dims(table: &[u64], seq_shape: &[u64], what: &str) -> Result<(usize, usize), KernelError> {
    let (_, s, w) = batch_matrix(seq_shape, what)?;
    require(table.len() == 2 && table[1] as usize == w && s as u64 <= table[0], || KernelError::Positions {
        table: table.to_vec(),
        seq: seq_shape.to_vec(),
    })?;
    Ok((s, w))
}

/// What an embedding kernel needs to know about this device's rows.
#[derive(Clone, Copy, Debug)]
struct Rows {
    base: u64,
    masked: bool,
}

/// `base` as the signed row offset the kernels compare ids against (past i64::MAX no id matches).
fn signed_base(base: u64) -> i64 {
    i64::try_from(base).unwrap_or(i64::MAX)
}

/// One element of a device buffer (waits for the stream).
fn read_one<T: DeviceRepr + Default + Copy>(
    stream: &Arc<CudaStream>,
    s: &CudaSlice<T>,
    index: usize,
) -> Result<T, KernelError> {
    let view = s.try_slice(index..index + 1).ok_or(DeviceError::IndexOutside { index, len: s.len() })?;
    let v = stream.clone_dtoh(&view).map_err(driver("copying from the GPU"))?;
    Ok(v.first().copied().unwrap_or_default())
}

impl Device {
    /// The smallest index flagged by the last kernel that used `flag`, if any (waits for the stream).
    fn flagged(&self, flag: &CudaSlice<u64>) -> Result<Option<usize>, KernelError> {
        let f = read_one(&self.stream, flag, 0)?;
        Ok((f != 0).then_some(!f as usize))
    }

    fn clear_flag(&self, flag: &mut CudaSlice<u64>) -> Result<(), KernelError> {
        Ok(self.stream.memset_zeros(flag).map_err(driver("zeroing GPU memory"))?)
    }

    /// The CPU's error for the first id a kernel flagged as outside this device's rows, if any.
    fn check_ids(&self, flag: &CudaSlice<u64>, ids: &CudaSlice<i32>, r: Rows, rows: usize) -> Result<(), KernelError> {
        match self.flagged(flag)? {
            Some(t) if !r.masked => {
                Err(KernelError::TokenOutsideRows { id: read_one(&self.stream, ids, t)?, base: r.base, rows })
            }
            _ => Ok(()),
        }
    }

    fn embedding_lookup<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        r: Rows,
        flag: &mut CudaSlice<u64>,
    ) -> Result<(), KernelError> {
        let [ids, table] = args(inputs)?;
        let (rows, w) = table_dims(&table.shape, "the table")?;
        let (idv, tv) = (ints(ids, "the ids")?, elems::<T>(table, "the table")?);
        let mut want = ids.shape.clone();
        want.push(w as u64);
        same_shape("the output", &out.shape, &want)?;
        let y = elems_mut::<T>(out, "the output")?;
        self.clear_flag(flag)?;
        let cfg = elementwise(ids.len() * w);
        let (count, nrows, width, base) = (ids.len() as u64, rows as u64, w as u64, signed_base(r.base));
        launch!(self, variant::<T>(EMBEDDING_LOOKUP)?, cfg, [y, idv, tv, &count, &nrows, &width, &base, &mut *flag])?;
        if r.masked { Ok(()) } else { self.check_ids(flag, idv, r, rows) }
    }

    /// The rows of the padding id (a global id) get nothing.
    fn embedding_grad<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        (r, padding): (Rows, Option<u64>),
        flag: &mut CudaSlice<u64>,
    ) -> Result<(), KernelError> {
        let [ids, dy] = args(inputs)?;
        let (rows, w) = table_dims(&out.shape, "the output")?;
        let (idv, dyv) = (ints(ids, "the ids")?, elems::<T>(dy, "dy")?);
        let mut want = ids.shape.clone();
        want.push(w as u64);
        same_shape("dy", &dy.shape, &want)?;
        let g = floats_mut(out, "the output")?;
        self.zero(g)?;
        self.clear_flag(flag)?;
        let cfg = elementwise(ids.len() * w);
        let (count, nrows, width, base) = (ids.len() as u64, rows as u64, w as u64, signed_base(r.base));
        let padding = padding.map_or(-1, signed_base);
        let grad = variant::<T>(EMBEDDING_GRAD)?;
        launch!(self, grad, cfg, [g, idv, dyv, &count, &nrows, &width, &base, &padding, &mut *flag])?;
        if r.masked { Ok(()) } else { self.check_ids(flag, idv, r, rows) }
    }

    fn position_lookup<T: Elem>(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor) -> Result<(), KernelError> {
        let [table] = args(inputs)?;
        let (s, w) = position_dims(&table.shape, &out.shape, "the output")?;
        let tv = elems::<T>(table, "the table")?;
        let n = out.len();
        let y = elems_mut::<T>(out, "the output")?;
        let cfg = if s * w == 0 { None } else { elementwise(n) };
        let (n, block) = (n as u64, (s * w) as u64);
        launch!(self, variant::<T>(POSITION_LOOKUP)?, cfg, [y, tv, &n, &block])
    }

    fn position_grad<T: Elem>(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor) -> Result<(), KernelError> {
        let [dy] = args(inputs)?;
        let (s, w) = position_dims(&out.shape, &dy.shape, "dy")?;
        let dyv = elems::<T>(dy, "dy")?;
        let g = floats_mut(out, "the output")?;
        self.zero(g)?;
        let block = s * w;
        let blocks = dy.len().checked_div(block).unwrap_or(0);
        let (nblocks, nblock) = (blocks as u64, block as u64);
        launch!(self, variant::<T>(POSITION_GRAD)?, columns(blocks, block), [g, dyv, &nblocks, &nblock])
    }
}

// ---- layer norm and sums --------------------------------------------------------------------------

/// The normalised size and epsilon of a LayerNorm kernel.
#[derive(Clone, Copy, Debug)]
struct Norm {
    n: u64,
    eps: f64,
}

impl Norm {
    fn check(&self) -> Result<(), KernelError> {
        require(self.n > 0, || KernelError::EmptyNorm)
    }
}

/// The all-reduced (sum, square sum) inputs of a row-normalising kernel, checked.
fn row_stats<'t>(
    sum: &'t DeviceTensor,
    sqsum: &'t DeviceTensor,
    rows: usize,
    norm: Norm,
) -> Result<[&'t CudaSlice<f32>; 2], KernelError> {
    let stats = [per_row(sum, rows, 1, "the sum")?, per_row(sqsum, rows, 1, "the square sum")?];
    norm.check()?;
    Ok(stats)
}

impl Device {
    fn row_sum<T: Elem>(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor) -> Result<(), KernelError> {
        let [x] = args(inputs)?;
        let (rows, n) = split_last(&x.shape);
        let xv = elems::<T>(x, "x")?;
        same_len("the output", out.len(), rows)?;
        let y = floats_mut(out, "the output")?;
        let name = by_eights(variant::<T>(ROW_SUM)?, n, &[self.start(xv)]);
        let cfg = rows_by(name, rows, n);
        let (rows, n) = (rows as u64, n as u64);
        launch!(self, name, cfg, [y, xv, &rows, &n])
    }

    fn row_centered_square_sum<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        n: u64,
    ) -> Result<(), KernelError> {
        let [x, sum] = args(inputs)?;
        require(n > 0, || KernelError::EmptyNorm)?;
        let (rows, width) = split_last(&x.shape);
        let (xv, sv) = (elems::<T>(x, "x")?, per_row(sum, rows, 1, "the sum")?);
        same_len("the output", out.len(), rows)?;
        let y = floats_mut(out, "the output")?;
        let name = by_eights(variant::<T>(ROW_CENTERED_SQUARE_SUM)?, width, &[self.start(xv)]);
        let cfg = rows_by(name, rows, width);
        let (rows, width) = (rows as u64, width as u64);
        launch!(self, name, cfg, [y, xv, sv, &rows, &width, &n])
    }

    fn layer_norm_apply<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        norm: Norm,
    ) -> Result<(), KernelError> {
        let [x, sum, sqsum, gamma, beta] = args(inputs)?;
        let (rows, width) = split_last(&x.shape);
        let xv = elems::<T>(x, "x")?;
        let [sv, qv] = row_stats(sum, sqsum, rows, norm)?;
        let (gv, bv) = (per_row_of::<T>(gamma, 1, width, "gamma")?, per_row_of::<T>(beta, 1, width, "beta")?);
        same_len("the output", out.len(), x.len())?;
        let y = elems_mut::<T>(out, "the output")?;
        let starts = [self.start(xv), self.start(gv), self.start(bv), self.start(y)];
        let name = by_eights(variant::<T>(LAYER_NORM_APPLY)?, width, &starts);
        let cfg = rows_by(name, rows, width);
        let (rows, width) = (rows as u64, width as u64);
        launch!(self, name, cfg, [y, xv, sv, qv, gv, bv, &rows, &width, &norm.n, &norm.eps])
    }

    fn layer_norm_grad_sums<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        norm: Norm,
    ) -> Result<(), KernelError> {
        let [dy, x, gamma, sum, sqsum] = args(inputs)?;
        let (rows, width) = split_last(&x.shape);
        let (dyv, xv) = (per_row_of::<T>(dy, rows, width, "dy")?, elems::<T>(x, "x")?);
        let gv = per_row_of::<T>(gamma, 1, width, "gamma")?;
        let [sv, qv] = row_stats(sum, sqsum, rows, norm)?;
        same_len("the output", out.len(), rows * 2)?;
        let y = floats_mut(out, "the output")?;
        let starts = [self.start(dyv), self.start(xv), self.start(gv)];
        let name = by_eights(variant::<T>(LAYER_NORM_GRAD_SUMS)?, width, &starts);
        let cfg = rows_by(name, rows, width);
        let (rows, width) = (rows as u64, width as u64);
        launch!(self, name, cfg, [y, dyv, xv, gv, sv, qv, &rows, &width, &norm.n, &norm.eps])
    }

    fn layer_norm_grad_input<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        norm: Norm,
    ) -> Result<(), KernelError> {
        let [dy, x, gamma, sum, sqsum, sums] = args(inputs)?;
        let (rows, width) = split_last(&x.shape);
        let (dyv, xv) = (per_row_of::<T>(dy, rows, width, "dy")?, elems::<T>(x, "x")?);
        let gv = per_row_of::<T>(gamma, 1, width, "gamma")?;
        let [sv, qv] = row_stats(sum, sqsum, rows, norm)?;
        let pairs = per_row(sums, rows, 2, "the gradient sums")?;
        same_len("the output", out.len(), x.len())?;
        let dx = elems_mut::<T>(out, "the output")?;
        let starts = [self.start(dyv), self.start(xv), self.start(gv), self.start(dx)];
        let name = by_eights(variant::<T>(LAYER_NORM_GRAD_INPUT)?, width, &starts);
        let cfg = rows_by(name, rows, width);
        let (rows, width) = (rows as u64, width as u64);
        launch!(self, name, cfg, [dx, dyv, xv, gv, sv, qv, pairs, &rows, &width, &norm.n, &norm.eps])
    }

    fn layer_norm_grad_weight<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        norm: Norm,
        scratch: &mut Option<CudaSlice<f32>>,
    ) -> Result<(), KernelError> {
        let [dy, x, sum, sqsum] = args(inputs)?;
        let (rows, width) = split_last(&x.shape);
        let (dyv, xv) = (per_row_of::<T>(dy, rows, width, "dy")?, elems::<T>(x, "x")?);
        let [sv, qv] = row_stats(sum, sqsum, rows, norm)?;
        same_len("the output", out.len(), width)?;
        let g = floats_mut(out, "the output")?;
        self.zero(g)?;
        let stats = grow(scratch, &self.stream, 2 * rows)?;
        let (nrows, nwidth) = (rows as u64, width as u64);
        launch!(self, LAYER_NORM_STATS, elementwise(rows), [&mut *stats, sv, qv, &nrows, &norm.n, &norm.eps])?;
        launch!(
            self,
            variant::<T>(LAYER_NORM_GRAD_WEIGHT)?,
            columns(rows, width),
            [g, dyv, xv, &*stats, &nrows, &nwidth]
        )
    }

    fn sum_to_last<T: Elem>(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor) -> Result<(), KernelError> {
        let [x] = args(inputs)?;
        let (rows, width) = split_last(&x.shape);
        let xv = elems::<T>(x, "x")?;
        same_len("the output", out.len(), width)?;
        let g = floats_mut(out, "the output")?;
        self.zero(g)?;
        let (nrows, nwidth) = (rows as u64, width as u64);
        launch!(self, variant::<T>(SUM_TO_LAST)?, columns(rows, width), [g, xv, &nrows, &nwidth])
    }
}

// ---- RMSNorm --------------------------------------------------------------------------------------

/// The all-reduced square sums of a row-normalising kernel, checked.
fn square_sums(sqsum: &DeviceTensor, rows: usize, norm: Norm) -> Result<&CudaSlice<f32>, KernelError> {
    let sq = per_row(sqsum, rows, 1, "the square sum")?;
    norm.check()?;
    Ok(sq)
}

impl Device {
    fn row_square_sum<T: Elem>(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor) -> Result<(), KernelError> {
        let [x] = args(inputs)?;
        let (rows, n) = split_last(&x.shape);
        let xv = elems::<T>(x, "x")?;
        same_len("the output", out.len(), rows)?;
        let y = floats_mut(out, "the output")?;
        let cfg = per_rows(rows, n);
        let (rows, n) = (rows as u64, n as u64);
        launch!(self, variant::<T>(ROW_SQUARE_SUM)?, cfg, [y, xv, &rows, &n])
    }

    fn rms_norm_apply<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        norm: Norm,
    ) -> Result<(), KernelError> {
        let [x, sqsum, weight] = args(inputs)?;
        let (rows, width) = split_last(&x.shape);
        let xv = elems::<T>(x, "x")?;
        let qv = square_sums(sqsum, rows, norm)?;
        let wv = per_row_of::<T>(weight, 1, width, "the weight")?;
        same_len("the output", out.len(), x.len())?;
        let y = elems_mut::<T>(out, "the output")?;
        let cfg = per_rows(rows, width);
        let (rows, width) = (rows as u64, width as u64);
        launch!(self, variant::<T>(RMS_NORM_APPLY)?, cfg, [y, xv, qv, wv, &rows, &width, &norm.n, &norm.eps])
    }

    fn rms_norm_grad_sum<T: Elem>(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor) -> Result<(), KernelError> {
        let [dy, x, weight] = args(inputs)?;
        let (rows, width) = split_last(&x.shape);
        let (dyv, xv) = (per_row_of::<T>(dy, rows, width, "dy")?, elems::<T>(x, "x")?);
        let wv = per_row_of::<T>(weight, 1, width, "the weight")?;
        same_len("the output", out.len(), rows)?;
        let y = floats_mut(out, "the output")?;
        let cfg = per_rows(rows, width);
        let (rows, width) = (rows as u64, width as u64);
        launch!(self, variant::<T>(RMS_NORM_GRAD_SUM)?, cfg, [y, dyv, xv, wv, &rows, &width])
    }

    fn rms_norm_grad_input<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        norm: Norm,
    ) -> Result<(), KernelError> {
        let [dy, x, weight, sqsum, sums] = args(inputs)?;
        let (rows, width) = split_last(&x.shape);
        let (dyv, xv) = (per_row_of::<T>(dy, rows, width, "dy")?, elems::<T>(x, "x")?);
        let wv = per_row_of::<T>(weight, 1, width, "the weight")?;
        let qv = square_sums(sqsum, rows, norm)?;
        let sv = per_row(sums, rows, 1, "the gradient sum")?;
        same_len("the output", out.len(), x.len())?;
        let dx = elems_mut::<T>(out, "the output")?;
        let cfg = per_rows(rows, width);
        let (rows, width) = (rows as u64, width as u64);
        let name = variant::<T>(RMS_NORM_GRAD_INPUT)?;
        launch!(self, name, cfg, [dx, dyv, xv, wv, qv, sv, &rows, &width, &norm.n, &norm.eps])
    }

    /// The weight's gradient into an f32 `out` (a bf16 plan's goes through an f32 copy and one rounding).
    fn rms_norm_grad_weight<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        norm: Norm,
        scratch: &mut Option<CudaSlice<f32>>,
    ) -> Result<(), KernelError> {
        let [dy, x, sqsum] = args(inputs)?;
        let (rows, width) = split_last(&x.shape);
        let (dyv, xv) = (per_row_of::<T>(dy, rows, width, "dy")?, elems::<T>(x, "x")?);
        let qv = square_sums(sqsum, rows, norm)?;
        same_len("the output", out.len(), width)?;
        let g = floats_mut(out, "the output")?;
        self.zero(g)?;
        let stats = grow(scratch, &self.stream, rows)?;
        let (nrows, nwidth) = (rows as u64, width as u64);
        launch!(self, RMS_NORM_STATS, elementwise(rows), [&mut *stats, qv, &nrows, &norm.n, &norm.eps])?;
        let name = variant::<T>(RMS_NORM_GRAD_WEIGHT)?;
        launch!(self, name, columns(rows, width), [g, dyv, xv, &*stats, &nrows, &nwidth])
    }
}

// ---- cross-entropy --------------------------------------------------------------------------------

/// This device's vocabulary columns: global column `offset + c`; columns at or past `valid` are padding.
#[derive(Clone, Copy, Debug)]
struct Vocab {
    offset: u64,
    valid: u64,
}

impl Vocab {
    fn new(offset: optimus_plan::Offset, valid: u64, ctx: &KernelContext) -> Vocab {
        Vocab { offset: offset.at(ctx.coords), valid }
    }

    /// How many of `width` local columns are real vocabulary.
    fn live(&self, width: usize) -> usize {
        (self.valid.saturating_sub(self.offset) as usize).min(width)
    }
}

/// The logits, targets, max and stats inputs of the cross-entropy kernels, checked.
struct Logits<'t, T = f32> {
    logits: &'t CudaSlice<T>,
    targets: &'t CudaSlice<i32>,
    rows: usize,
    width: usize,
}

impl<'t, T: Elem> Logits<'t, T> {
    fn new(logits: &'t DeviceTensor, targets: &'t DeviceTensor) -> Result<Logits<'t, T>, KernelError> {
        let (rows, width) = split_last(&logits.shape);
        let lv = elems::<T>(logits, "the logits")?;
        let tv = ints(targets, "the targets")?;
        same_len("the targets", targets.len(), rows)?;
        Ok(Logits { logits: lv, targets: tv, rows, width })
    }
}

impl Device {
    /// The CPU's error for the first row a kernel flagged as having a target outside the vocabulary.
    fn check_targets(&self, flag: &CudaSlice<u64>, targets: &CudaSlice<i32>, valid: u64) -> Result<(), KernelError> {
        match self.flagged(flag)? {
            Some(r) => {
                let t = read_one(&self.stream, targets, r)?;
                Err(KernelError::TargetOutsideVocabulary { target: t, valid })
            }
            None => Ok(()),
        }
    }

    fn cross_entropy_max<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        vocab: Vocab,
    ) -> Result<(), KernelError> {
        let [logits] = args(inputs)?;
        let (rows, width) = split_last(&logits.shape);
        let lv = elems::<T>(logits, "the logits")?;
        same_len("the output", out.len(), rows)?;
        let y = floats_mut(out, "the output")?;
        let live = vocab.live(width);
        let cfg = per_rows(rows, live);
        let (rows, width, live) = (rows as u64, width as u64, live as u64);
        launch!(self, any_eights(variant::<T>(CROSS_ENTROPY_MAX)?), cfg, [y, lv, &rows, &width, &live])
    }

    fn cross_entropy_stats<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        vocab: Vocab,
        flag: &mut CudaSlice<u64>,
    ) -> Result<(), KernelError> {
        let [logits, targets, max] = args(inputs)?;
        let l = Logits::<T>::new(logits, targets)?;
        let mv = per_row(max, l.rows, 1, "the max")?;
        same_len("the output", out.len(), l.rows * 2)?;
        let y = floats_mut(out, "the output")?;
        if l.width == 0 {
            return self.zero(y);
        }
        self.clear_flag(flag)?;
        let cfg = per_rows(l.rows, vocab.live(l.width));
        let (rows, width, live) = (l.rows as u64, l.width as u64, vocab.live(l.width) as u64);
        let args = [rows, width, live, vocab.offset, vocab.valid];
        launch!(
            self,
            any_eights(variant::<T>(CROSS_ENTROPY_STATS)?),
            cfg,
            [y, l.logits, l.targets, mv, &args[0], &args[1], &args[2], &args[3], &args[4], &mut *flag]
        )?;
        self.check_targets(flag, l.targets, vocab.valid)
    }

    fn cross_entropy_count(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor) -> Result<(), KernelError> {
        let [targets] = args(inputs)?;
        let tv = ints(targets, "the targets")?;
        same_len("the output", out.len(), 1)?;
        let y = floats_mut(out, "the output")?;
        let rows = targets.len() as u64;
        launch!(self, CROSS_ENTROPY_COUNT, single_block(), [y, tv, &rows])
    }

    fn cross_entropy_loss(&self, inputs: &[&DeviceTensor], out: &mut DeviceTensor) -> Result<(), KernelError> {
        let [max, stats, targets, count] = args(inputs)?;
        let mv = floats(max, "the max")?;
        let rows = max.len();
        let sv = per_row(stats, rows, 2, "the stats")?;
        let tv = ints(targets, "the targets")?;
        same_len("the targets", targets.len(), rows)?;
        let cv = per_row(count, 1, 1, "the count")?;
        same_len("the output", out.len(), 1)?;
        let y = floats_mut(out, "the output")?;
        let rows = rows as u64;
        launch!(self, CROSS_ENTROPY_LOSS, single_block(), [y, mv, sv, tv, cv, &rows])
    }

    /// The squares of every gradient this device counts, summed into `out` (see `Kernel::GradSquareSum`).
    fn grad_square_sum(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        ctx: &KernelContext,
    ) -> Result<(), KernelError> {
        require(inputs.len() == ctx.inputs.len(), || KernelError::InputLayouts)?;
        same_len("the output", out.len(), 1)?;
        let y = floats_mut(out, "the output")?;
        self.zero(y)?;
        let mut table = Vec::new();
        let mut blocks = 0usize;
        for (k, (x, meta)) in inputs.iter().zip(ctx.inputs).enumerate() {
            if meta.layout.counts_block_at(ctx.coords.0) && !x.is_empty() {
                let xv = floats(x, &format!("gradient {k}"))?;
                table.extend([self.start(xv), x.len() as u64, blocks as u64]);
                blocks += x.len().div_ceil(SQUARE_SUM_SPAN);
            }
        }
        let tensors = table.len() / 3;
        if tensors == 0 {
            return Ok(());
        }
        let sums = &mut *self.square_sums.lock().map_err(|_| KernelError::Poisoned("the square sums are poisoned"))?;
        if sums.table != table || sums.spans.is_none() {
            sums.spans = Some(upload_slice(&self.stream, &table)?);
            sums.table = table;
        }
        let spans = sums.spans.as_ref().ok_or_else(|| KernelError::Internal("no span table".into()))?;
        let partials = grow(&mut sums.partials, &self.stream, blocks)?;
        let (t, b, per) = (tensors as u64, blocks as u64, SQUARE_SUM_SPAN as u64);
        launch!(self, SQUARE_SUM_SPANS, Some(config((blocks, 1), (THREADS, 1))), [&mut *partials, spans, &t, &per])?;
        let totals = grow(&mut sums.totals, &self.stream, tensors)?;
        let per_tensor = Some(config((tensors, 1), (THREADS, 1)));
        launch!(self, SQUARE_SUM_TENSORS, per_tensor, [&mut *totals, &*partials, spans, &t, &b])?;
        launch!(self, SQUARE_SUM_FOLD, Some(config((1, 1), (32, 1))), [y, &*totals, &t])
    }

    fn cross_entropy_grad<T: Elem>(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        vocab: Vocab,
        flag: &mut CudaSlice<u64>,
    ) -> Result<(), KernelError> {
        let [logits, targets, max, stats, dloss, count] = args(inputs)?;
        let l = Logits::<T>::new(logits, targets)?;
        let (mv, sv) = (per_row(max, l.rows, 1, "the max")?, per_row(stats, l.rows, 2, "the stats")?);
        let dl = per_row(dloss, 1, 1, "dloss")?;
        let cv = per_row(count, 1, 1, "the count")?;
        same_len("the output", out.len(), logits.len())?;
        let g = elems_mut::<T>(out, "the output")?;
        if l.width == 0 {
            return Ok(());
        }
        self.clear_flag(flag)?;
        let mut name = variant::<T>(CROSS_ENTROPY_GRAD)?;
        let mut cfg = per_rows(l.rows, l.width);
        // bf16 rows a word a thread, where the logits' rows sit in their words as the gradient's do.
        let same_place = self.start(g).abs_diff(self.start(l.logits)).is_multiple_of(16);
        if name != CROSS_ENTROPY_GRAD && l.width >= 8 && same_place && bf16::eights_enabled() {
            name = bf16::CROSS_ENTROPY_GRAD_X8;
            cfg = per_rows(l.rows, l.width / 8);
        }
        let args = [l.rows as u64, l.width as u64, vocab.live(l.width) as u64, vocab.offset, vocab.valid];
        launch!(
            self,
            name,
            cfg,
            [g, l.logits, l.targets, mv, sv, dl, cv, &args[0], &args[1], &args[2], &args[3], &args[4], &mut *flag]
        )?;
        self.check_targets(flag, l.targets, vocab.valid)
    }
}

// ---- optimizer ------------------------------------------------------------------------------------

/// The decimal a hyper-parameter was written as (0.999, not 0.99900001287), as torch holds it in an f64.
fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// The f32 scalars of torch's single-tensor AdamW step, computed in f64 as the CPU's `adamw`.
fn adamw_scalars(s: &OptimizerSettings, step: u64) -> [f32; 7] {
    let step = i32::try_from(step).unwrap_or(i32::MAX);
    let (lr, wd, beta1, beta2) = (decimal(s.lr), decimal(s.weight_decay), decimal(s.beta1), decimal(s.beta2));
    let decay = (1.0 - lr * wd) as f32;
    let step_size = (lr / (1.0 - beta1.powi(step))) as f32;
    let bias2_sqrt = (1.0 - beta2.powi(step)).sqrt() as f32;
    let (w1, w2) = ((1.0 - beta1) as f32, (1.0 - beta2) as f32);
    [decay, step_size, bias2_sqrt, w1, w2, s.beta2, s.eps]
}

/// The buffers of one optimizer update, checked.
struct Update<'a> {
    param: &'a mut CudaSlice<f32>,
    grad: &'a CudaSlice<f32>,
    state1: &'a mut CudaSlice<f32>,
    n: usize,
}

impl Device {
    fn sgd(&self, u: Update, s: &OptimizerSettings, step: u64) -> Result<(), KernelError> {
        let (n, first) = (u.n as u64, i32::from(step == 1));
        let cfg = elementwise(u.n);
        launch!(self, SGD_STEP, cfg, [u.param, u.grad, u.state1, &n, &s.lr, &s.weight_decay, &s.momentum, &first])
    }

    fn adamw(&self, u: Update, v: &mut CudaSlice<f32>, s: &OptimizerSettings, step: u64) -> Result<(), KernelError> {
        let k = adamw_scalars(s, step);
        let n = u.n as u64;
        let cfg = elementwise(u.n);
        launch!(
            self,
            ADAMW_STEP,
            cfg,
            [u.param, u.grad, u.state1, v, &n, &k[0], &k[1], &k[2], &k[3], &k[4], &k[5], &k[6]]
        )
    }
}

mod bf16;
mod collective;
mod flash;
mod many;

pub use bf16::{BF16_KERNEL_NAMES, bf16_launcher};
use bf16::{any_eights, by_eights, in_eights, variant, words};
pub use collective::{COLLECTIVE_KERNEL_NAMES, DeviceBuf, MAX_MEMBERS};
pub use flash::FLASH_KERNEL_NAMES;
pub use many::{AdamwJob, WidenJob};

// ---- the kernel runner ----------------------------------------------------------------------------

/// The compiled kernels on one GPU: runs plan kernels on [`DeviceTensor`]s on one stream.
pub struct CudaKernels {
    dev: Device,
    /// The logical index of each local element, per buffer layout and device (for dropout masks).
    logical: HashMap<IndexKey, CudaSlice<u64>>,
    /// Attention probabilities and their gradient, LayerNorm row statistics (grown as needed).
    scratch: [Option<CudaSlice<f32>>; 2],
    /// Where kernels flag invalid ids and targets.
    flag: CudaSlice<u64>,
    /// The scratch of the bf16 kernels (grown as needed).
    half: bf16::Scratch,
    /// The span tables of the many-tensor launches.
    spans: many::SpanTables,
}

impl CudaKernels {
    /// Compiles the kernels (NVRTC) and loads them into `ctx`; `stream` (of `ctx`) runs everything.
    /// The PTX is compiled for the GPU's own architecture (or [`PORTABLE_ARCH`] where this NVRTC does not
    /// know it).
    pub fn new(ctx: &Arc<CudaContext>, stream: Arc<CudaStream>) -> Result<CudaKernels, KernelError> {
        let (major, minor) = ctx.compute_capability().map_err(driver("reading the GPU's compute capability"))?;
        // Machine code for this GPU where NVRTC can make it; PTX for the driver to translate otherwise.
        if let Some(sm) = real_arch(major, minor) {
            let image = super::ptx_cache::compile_cubin_cached(sm).map_err(KernelError::from);
            let module = image
                .and_then(|cubin| CudaKernels::with_module(ctx, stream.clone(), Ptx::from_binary(cubin), Some(sm)));
            if let Ok(kernels) = module {
                return Ok(kernels);
            }
        }
        let cached = super::ptx_cache::compile_ptx_cached;
        let ptx = cached(arch_of(major, minor)).or_else(|_| cached(PORTABLE_ARCH))?;
        CudaKernels::with_ptx(ctx, stream, ptx)
    }

    /// As [`CudaKernels::new`], with PTX compiled earlier by [`compile_ptx`].
    pub fn with_ptx(ctx: &Arc<CudaContext>, stream: Arc<CudaStream>, ptx: Ptx) -> Result<CudaKernels, KernelError> {
        let arch = flash::ptx_target(&ptx.to_src());
        CudaKernels::with_module(ctx, stream, ptx, arch)
    }

    /// As [`CudaKernels::with_ptx`], with PTX or machine code (`Ptx::from_binary`) for the real
    /// architecture `arch` (`Some(90)` for sm_90; what decides whether the flash attention runs).
    fn with_module(
        ctx: &Arc<CudaContext>,
        stream: Arc<CudaStream>,
        ptx: Ptx,
        arch: Option<u32>,
    ) -> Result<CudaKernels, KernelError> {
        require(stream.context().as_ref() == ctx.as_ref(), || DeviceError::ForeignStream)?;
        // SAFETY: only tries to open the shared library.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(DeviceError::Unavailable(
                "cuBLAS (libcublas.so) cannot be loaded: install CUDA or put it on LD_LIBRARY_PATH",
            )
            .into());
        }
        let module = ctx.load_module(ptx).map_err(driver("loading the kernels' PTX"))?;
        let mut functions = HashMap::new();
        for &name in
            KERNEL_NAMES.iter().chain(BF16_KERNEL_NAMES).chain(FLASH_KERNEL_NAMES).chain(COLLECTIVE_KERNEL_NAMES)
        {
            let f =
                module.load_function(name).map_err(|error| DeviceError::Load { function: name.to_string(), error })?;
            functions.insert(name, f);
        }
        let blas = CudaBlas::new(stream.clone()).map_err(DeviceError::BlasHandle)?;
        let flag = alloc::<u64>(&stream, 1)?;
        let square_sums = std::sync::Mutex::new(SquareSums::default());
        let flash = flash::enable(&functions, arch);
        let realign = std::sync::Mutex::new(bf16::Realign::default());
        let dev = Device { stream, functions, blas, square_sums, flash, realign };
        Ok(CudaKernels {
            dev,
            logical: HashMap::new(),
            scratch: [None, None],
            flag,
            half: bf16::Scratch::default(),
            spans: many::SpanTables::default(),
        })
    }

    /// Whether bf16 attention runs on the flash kernels here (an Ampere or newer GPU, PTX built for it,
    /// and `OPTIMUS_CUDA_ATTENTION=reference` not set).
    pub fn flash_attention(&self) -> bool {
        self.dev.flash
    }

    /// The stream every kernel runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.dev.stream
    }

    /// Runs one kernel, with exactly the semantics of `cpu::kernels::run`: `out` has the output buffer's
    /// local shape and holds its previous contents (for accumulating products).
    pub fn run(
        &mut self,
        kernel: &Kernel,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        ctx: &KernelContext,
    ) -> Result<(), KernelError> {
        // Gradients kept for a non-fused attention's next `AttentionGrad` serve only the next ones.
        if !matches!(kernel, Kernel::AttentionGrad { fused: false, .. }) {
            self.half.forget_kept();
        }
        let result = if cpu_only(kernel) {
            Err(cpu_only_error(kernel))
        } else if bf16::involved(inputs, out) {
            bf16::run(self, kernel, inputs, out, ctx)
        } else {
            self.dispatch(kernel, inputs, out, ctx)
        };
        result.map_err(|e| KernelError::in_kernel(kernel, e))
    }

    fn dispatch(
        &mut self,
        kernel: &Kernel,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        ctx: &KernelContext,
    ) -> Result<(), KernelError> {
        let CudaKernels { dev, logical, scratch, flag, .. } = self;
        let dev = &*dev;
        match *kernel {
            Kernel::MatMul { transpose_a, transpose_b, accumulate } => {
                dev.matmul::<f32, f32>(inputs, out, transpose_a, transpose_b, accumulate)
            }
            Kernel::BatchedMatMul => dev.batched_matmul::<f32, f32>(inputs, out),
            Kernel::BiasAdd => dev.bias_add::<f32>(inputs, out),
            Kernel::Add => dev.map_binary::<f32>(ADD, inputs, out),
            Kernel::Mul => dev.map_binary::<f32>(MULTIPLY, inputs, out),
            Kernel::Scale { factor } => dev.scale::<f32>(inputs, out, factor),
            Kernel::Gelu { approximate: true } => dev.map_unary::<f32>(GELU_TANH, inputs, out),
            Kernel::Gelu { approximate: false } => dev.map_unary::<f32>(GELU_ERF, inputs, out),
            Kernel::Silu => dev.map_unary::<f32>(SILU, inputs, out),
            Kernel::SiluGrad => dev.map_binary::<f32>(SILU_GRAD, inputs, out),
            Kernel::GeluGrad { approximate: true } => dev.map_binary::<f32>(GELU_TANH_GRAD, inputs, out),
            Kernel::GeluGrad { approximate: false } => dev.map_binary::<f32>(GELU_ERF_GRAD, inputs, out),
            Kernel::Softmax => dev.softmax::<f32>(inputs, out),
            Kernel::SoftmaxGrad => dev.softmax_grad::<f32>(inputs, out),
            Kernel::CausalMask => dev.causal_mask::<f32>(inputs, out, f32::NEG_INFINITY),
            Kernel::CausalMaskGrad => dev.causal_mask::<f32>(inputs, out, 0.0),
            Kernel::Dropout { p, key } | Kernel::DropoutGrad { p, key } => {
                dropout::<f32>(dev, logical, inputs, out, ctx, p, key)
            }
            Kernel::Reshape => dev.reshape(inputs, out),
            Kernel::Transpose { dim0, dim1 } => dev.transpose(inputs, out, dim0.into(), dim1.into()),
            Kernel::Select { dim, index } => dev.select(inputs, out, dim.into(), index),
            Kernel::SelectGrad { dim, index } => dev.select_grad(inputs, out, dim.into(), index),
            Kernel::Attention { heads, kv_heads, causal, fused } => {
                let a = AttentionArgs { heads, kv_heads, causal, fused, wrt: 0 };
                dev.attention(inputs, out, a, &mut scratch[0])
            }
            Kernel::AttentionGrad { heads, kv_heads, causal, fused, wrt } => {
                dev.attention_grad(inputs, out, AttentionArgs { heads, kv_heads, causal, fused, wrt }, scratch)
            }
            Kernel::Rotary { heads, theta } => dev.rotary::<f32>(inputs, out, heads, theta, 1.0),
            Kernel::RotaryGrad { heads, theta } => dev.rotary::<f32>(inputs, out, heads, theta, -1.0),
            Kernel::EmbeddingLookup { offset, masked } => {
                dev.embedding_lookup::<f32>(inputs, out, Rows { base: offset.at(ctx.coords), masked }, flag)
            }
            Kernel::EmbeddingGrad { offset, masked, padding } => {
                let rows = Rows { base: offset.at(ctx.coords), masked };
                dev.embedding_grad::<f32>(inputs, out, (rows, padding), flag)
            }
            Kernel::PositionLookup => dev.position_lookup::<f32>(inputs, out),
            Kernel::PositionGrad => dev.position_grad::<f32>(inputs, out),
            Kernel::RowSum => dev.row_sum::<f32>(inputs, out),
            Kernel::RowCenteredSquareSum { n } => dev.row_centered_square_sum::<f32>(inputs, out, n),
            Kernel::LayerNormApply { n, eps } => dev.layer_norm_apply::<f32>(inputs, out, Norm { n, eps }),
            Kernel::LayerNormGradSums { n, eps } => dev.layer_norm_grad_sums::<f32>(inputs, out, Norm { n, eps }),
            Kernel::LayerNormGradInput { n, eps } => dev.layer_norm_grad_input::<f32>(inputs, out, Norm { n, eps }),
            Kernel::LayerNormGradWeight { n, eps } => {
                dev.layer_norm_grad_weight::<f32>(inputs, out, Norm { n, eps }, &mut scratch[0])
            }
            Kernel::RowSquareSum => dev.row_square_sum::<f32>(inputs, out),
            Kernel::RmsNormApply { n, eps } => dev.rms_norm_apply::<f32>(inputs, out, Norm { n, eps }),
            Kernel::RmsNormGradSum => dev.rms_norm_grad_sum::<f32>(inputs, out),
            Kernel::RmsNormGradInput { n, eps } => dev.rms_norm_grad_input::<f32>(inputs, out, Norm { n, eps }),
            Kernel::RmsNormGradWeight { n, eps } => {
                dev.rms_norm_grad_weight::<f32>(inputs, out, Norm { n, eps }, &mut scratch[0])
            }
            Kernel::SumToLast => dev.sum_to_last::<f32>(inputs, out),
            Kernel::CrossEntropyMax { offset, valid } => {
                dev.cross_entropy_max::<f32>(inputs, out, Vocab::new(offset, valid, ctx))
            }
            Kernel::CrossEntropyStats { offset, valid } => {
                dev.cross_entropy_stats::<f32>(inputs, out, Vocab::new(offset, valid, ctx), flag)
            }
            Kernel::CrossEntropyCount => dev.cross_entropy_count(inputs, out),
            Kernel::CrossEntropyLoss => dev.cross_entropy_loss(inputs, out),
            Kernel::CrossEntropyGrad { offset, valid } => {
                dev.cross_entropy_grad::<f32>(inputs, out, Vocab::new(offset, valid, ctx), flag)
            }
            Kernel::Fill { value } => dev.fill(inputs, out, value),
            // Between f32 buffers a cast is an exact copy (bf16 casts are run by `bf16::run`).
            Kernel::Cast => dev.scale::<f32>(inputs, out, 1.0),
            Kernel::SliceShard { axis, placement } => dev.slice_shard(inputs, out, ctx, axis.into(), placement),
            Kernel::GradSquareSum => dev.grad_square_sum(inputs, out, ctx),
            Kernel::OptimizerStep => Err(KernelError::Unsupported {
                kernel: "the optimizer step",
                why: "is applied by `optimizer_step`, not `run`",
            }),
            Kernel::RotaryAt { .. }
            | Kernel::PositionLookupAt
            | Kernel::CacheWrite { .. }
            | Kernel::CachedAttention { .. } => Err(cpu_only_error(kernel)),
        }
    }

    /// Keeps the stream busy for about `cycles` SM clock cycles (one thread), so that work queued
    /// behind it starts without waiting for the host (see the `hold_stream` kernel).
    pub fn hold_stream(&self, cycles: i64) -> Result<(), KernelError> {
        let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
        launch!(&self.dev, HOLD_STREAM, Some(one), [&cycles])
    }

    /// Multiplies an f32 tensor by `factor` in place (the clipping of a gradient).
    pub fn scale_in_place(&mut self, t: &mut DeviceTensor, factor: f32) -> Result<(), KernelError> {
        let n = t.len();
        let s = floats_mut(t, "the scaled buffer")?;
        let (ptr, _record) = s.device_ptr_mut(&self.dev.stream);
        self.scale_at(ptr, n, factor)
    }

    /// Drops the attention gradients kept for a non-fused attention's next `AttentionGrad` (the backend
    /// calls this before any work that is not a kernel: a transfer or a collective may write operands).
    pub fn forget_kept(&mut self) {
        self.half.forget_kept();
    }

    /// Multiplies the `n` f32 elements at device address `ptr` by `factor` in place, as
    /// [`CudaKernels::scale_in_place`] does (for a scale the backend queued by address).
    pub fn scale_at(&self, ptr: u64, n: usize, factor: f32) -> Result<(), KernelError> {
        let n64 = n as u64;
        // The scale kernel reads and writes element i only, so it may run with its output as its input.
        launch!(&self.dev, SCALE, elementwise(n), [&ptr, &ptr, &factor, &n64])
    }

    /// Runs many AdamW updates in one launch, each exactly as [`CudaKernels::optimizer_step`] after
    /// [`CudaKernels::scale_in_place`] of its gradient by its `grad_scale`. No job's buffers may overlap
    /// another's (the caller checks).
    pub fn adamw_many(
        &mut self,
        jobs: &[AdamwJob],
        settings: &OptimizerSettings,
        step: u64,
    ) -> Result<(), KernelError> {
        require(step >= 1, || KernelError::StepZero)?;
        self.dev.adamw_many(&mut self.spans, jobs, settings, step)
    }

    /// Casts many bf16 tensors to f32 in one launch, each as the plan's `Cast` kernel does. No job may
    /// write where another reads or writes (the caller checks).
    pub fn widen_many(&mut self, jobs: &[WidenJob]) -> Result<(), KernelError> {
        self.dev.widen_many(&mut self.spans, jobs)
    }

    /// Updates one parameter shard in place, exactly as `cpu::kernels::optimizer_step` (SGD with momentum
    /// or AdamW; `step` counts from 1; `state2` is only used by AdamW).
    pub fn optimizer_step(
        &mut self,
        param: &mut DeviceTensor,
        grad: &DeviceTensor,
        state1: &mut DeviceTensor,
        state2: &mut DeviceTensor,
        settings: &OptimizerSettings,
        step: u64,
    ) -> Result<(), KernelError> {
        require(step >= 1, || KernelError::StepZero)?;
        let g = floats(grad, "the gradient")?;
        let (n, m_len) = (param.len(), state1.len());
        let p = floats_mut(param, "the parameter")?;
        same_len("the gradient", grad.len(), n)?;
        let m = floats_mut(state1, "the first optimizer state")?;
        same_len("the first optimizer state", m_len, n)?;
        let update = Update { param: p, grad: g, state1: m, n };
        match settings.kind {
            OptimizerKind::Sgd => self.dev.sgd(update, settings, step),
            OptimizerKind::AdamW => {
                let v_len = state2.len();
                let v = floats_mut(state2, "the second optimizer state")?;
                same_len("the second optimizer state", v_len, n)?;
                self.dev.adamw(update, v, settings, step)
            }
        }
    }
}

/// The logical indices of the output's local elements on this device, uploaded once per layout.
fn logical_indices<'c>(
    dev: &Device,
    cache: &'c mut HashMap<IndexKey, CudaSlice<u64>>,
    ctx: &KernelContext,
) -> Result<&'c CudaSlice<u64>, KernelError> {
    let key = IndexKey::of(ctx);
    if !cache.contains_key(&key) {
        let map =
            try_logical_indices(ctx.output, ctx.coords, ctx.mesh).map_err(|e| KernelError::Layout(e.to_string()))?;
        cache.insert(key.clone(), upload_slice(&dev.stream, &map)?);
    }
    cache.get(&key).ok_or_else(|| KernelError::Internal("no logical index map".into()))
}

/// Dropout and its gradient: the mask depends only on (seed, key, logical index).
fn dropout<T: Elem>(
    dev: &Device,
    cache: &mut HashMap<IndexKey, CudaSlice<u64>>,
    inputs: &[&DeviceTensor],
    out: &mut DeviceTensor,
    ctx: &KernelContext,
    p: f64,
    key: u32,
) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    let xv = elems::<T>(x, "the input")?;
    require((0.0..=1.0).contains(&p), || KernelError::DropProbability(p))?;
    same_shape("the output", &out.shape, &ctx.output.shape)?;
    let n = x.len();
    same_len("the output", out.len(), n)?;
    let y = elems_mut::<T>(out, "the output")?;
    if p == 0.0 {
        return dev.copy_runs(xv, y, (n, n), Runs::whole(n));
    }
    if p >= 1.0 {
        return dev.zero(y);
    }
    let logical = logical_indices(dev, cache, ctx)?;
    require(logical.len() >= n, || {
        KernelError::Internal(format!("{} logical indices for {n} elements", logical.len()))
    })?;
    let mask = DropoutParams::new(ctx.seed, key, p);
    let (scale, count) = ((1.0 / (1.0 - p)) as f32, n as u64);
    launch!(dev, variant::<T>(DROPOUT)?, elementwise(n), [y, xv, logical, &count, &mask.base, &mask.threshold, &scale])
}

#[cfg(test)]
mod tests {
    use super::*;
    use optimus_plan::logical::dropout_keep;

    #[test]
    fn the_key_value_cache_kernels_have_no_launcher_and_say_they_run_on_the_cpu() {
        let kernels = [
            Kernel::RotaryAt { heads: 2, theta: 10_000.0 },
            Kernel::PositionLookupAt,
            Kernel::CacheWrite { part: 1, parts: 3 },
            Kernel::CachedAttention { heads: 4, kv_heads: 2, fused: false },
        ];
        for kernel in &kernels {
            assert!(cpu_only(kernel));
            let l = launcher(kernel);
            assert!(l.functions.is_empty() && !l.cublas, "{kernel:?} has a launcher");
            let message = KernelError::in_kernel(kernel, cpu_only_error(kernel)).to_string();
            assert!(message.contains("runs on the CPU backend only"), "{message}");
        }
        assert!(!cpu_only(&Kernel::Rotary { heads: 2, theta: 10_000.0 }) && !cpu_only(&Kernel::PositionLookup));
    }

    #[test]
    fn dropout_params_take_the_cpus_decisions() {
        for (seed, key, p) in [(42u64, 7u32, 0.1f64), (0, 0, 0.5), (u64::MAX, u32::MAX, 0.9)] {
            let mask = DropoutParams::new(seed, key, p);
            for index in (0..2000u64).chain([u64::MAX - 3, 1 << 40]) {
                assert_eq!(mask.keep(index), dropout_keep(seed, key, index, p), "seed {seed} key {key} index {index}");
            }
        }
    }

    #[test]
    fn the_kernel_runner_can_move_to_a_device_thread() {
        fn send<T: Send>() {}
        send::<CudaKernels>();
        send::<DeviceTensor>();
    }

    #[test]
    fn blocks_check_their_extent() {
        let b = Block { start: 2, rows: 3, cols: 4, ld: 5, stride: 20 };
        assert!(b.fits(2, 2 + 20 + 2 * 5 + 4));
        assert!(!b.fits(2, 2 + 20 + 2 * 5 + 3));
        assert!(Block::dense(0, 4).fits(7, 0));
    }

    #[test]
    fn launch_configurations_cover_the_work() {
        assert!(elementwise(0).is_none());
        let cfg = elementwise(1000).map(|c| (c.grid_dim.0, c.block_dim.0));
        assert_eq!(cfg, Some((4, THREADS)));
        let rows = per_rows(3, 1000).map(|c| (c.grid_dim.0, c.block_dim.0));
        assert_eq!(rows, Some((3, 256)));
        assert_eq!(per_rows(3, 5).map(|c| c.block_dim.0), Some(32));
        assert!(columns(0, 5).is_none());
        assert_eq!(columns(3000, 70).map(|c| (c.grid_dim.0, c.grid_dim.1, c.block_dim)), Some((3, 24, (32, 8, 1))));
    }

    #[test]
    fn adamw_scalars_follow_torch() {
        let s = OptimizerSettings {
            kind: OptimizerKind::AdamW,
            lr: 0.001,
            weight_decay: 0.01,
            momentum: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        };
        let [decay, step_size, bias2_sqrt, w1, w2, ..] = adamw_scalars(&s, 1);
        assert_eq!(decay, (1.0 - 0.001f64 * 0.01) as f32);
        assert_eq!(step_size, (0.001f64 / (1.0 - 0.9f64)) as f32);
        assert_eq!(bias2_sqrt, (1.0 - 0.999f64).sqrt() as f32);
        assert_eq!((w1, w2), ((1.0 - 0.9f64) as f32, (1.0 - 0.999f64) as f32));
    }
}
