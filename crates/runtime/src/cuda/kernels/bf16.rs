//! Plan kernels on bf16 buffers, kept as bf16 on the GPU (two bytes an element).
//!
//! A kernel whose operands have the element types a bf16 plan gives them (bf16 tensors, f32 statistics,
//! i32 ids; see [`native`]) runs its `_bf16` entry point of kernels.cu: operands are read widened to f32,
//! the arithmetic is the f32 kernel's, and a bf16 result is rounded once (to nearest, ties to even) when
//! stored, as on the CPU backend. Products run on the tensor cores through cuBLAS `gemmEx` with bf16
//! operands and f32 accumulation (`CUBLAS_COMPUTE_32F`), into a bf16 or f32 output. Column sums (bias,
//! LayerNorm weight, position and embedding gradients) and scatter-adds are summed in an f32 scratch and
//! rounded once. Attention keeps its scores, probabilities and their gradient in f32 and rounds the
//! probabilities (and dS) to bf16 only as operands of the bf16 products P V, P^T dO, dS K and dS^T Q.
//!
//! Any other combination of element types, and kernels without a bf16 entry point (a kernel added
//! later, fills, the gradient norm), run [`widened`]: their bf16 operands are widened to f32 on the
//! GPU, the f32 kernel runs, and a bf16 output is rounded once, exactly as the CPU backend does.

mod realign;

use super::*;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType};
use cudarc::driver::{DevicePtr, DevicePtrMut};
pub(crate) use realign::Realign;
use realign::{COPY_ROWS_F32, COPY_ROWS_U16, COPY_ROWS_U16_X8, PAD_ROWS_U16, PAD_ROWS_U16_X8, Realignable};
use std::ffi::c_void;

/// The bf16 entry points of kernels.cu, next to the f32 kernel each stands for.
const ENTRY_POINTS: &[(&str, &str)] = &[
    (BIAS_ADD, "bias_add_bf16"),
    (ADD, "add_bf16"),
    (MULTIPLY, "multiply_bf16"),
    (SCALE, "scale_bf16"),
    (GELU_TANH, "gelu_tanh_bf16"),
    (GELU_ERF, "gelu_erf_bf16"),
    (SILU, "silu_bf16"),
    (SILU_GRAD, "silu_grad_bf16"),
    (GELU_TANH_GRAD, "gelu_tanh_grad_bf16"),
    (GELU_ERF_GRAD, "gelu_erf_grad_bf16"),
    (CAUSAL_MASK, "causal_mask_bf16"),
    (DROPOUT, "dropout_bf16"),
    (ZERO_BLOCKS, "zero_blocks_bf16"),
    (SOFTMAX, "softmax_bf16"),
    (SOFTMAX_GRAD, "softmax_grad_bf16"),
    (EMBEDDING_LOOKUP, "embedding_lookup_bf16"),
    (EMBEDDING_GRAD, "embedding_grad_bf16"),
    (POSITION_LOOKUP, "position_lookup_bf16"),
    (POSITION_GRAD, "position_grad_bf16"),
    (ROW_SUM, "row_sum_bf16"),
    (ROW_CENTERED_SQUARE_SUM, "row_centered_square_sum_bf16"),
    (LAYER_NORM_APPLY, "layer_norm_apply_bf16"),
    (LAYER_NORM_GRAD_SUMS, "layer_norm_grad_sums_bf16"),
    (LAYER_NORM_GRAD_INPUT, "layer_norm_grad_input_bf16"),
    (LAYER_NORM_GRAD_WEIGHT, "layer_norm_grad_weight_bf16"),
    (SUM_TO_LAST, "sum_to_last_bf16"),
    (CROSS_ENTROPY_MAX, "cross_entropy_max_bf16"),
    (CROSS_ENTROPY_STATS, "cross_entropy_stats_bf16"),
    (CROSS_ENTROPY_GRAD, "cross_entropy_grad_bf16"),
    (ROTARY, "rotary_bf16"),
    (ROW_SQUARE_SUM, "row_square_sum_bf16"),
    (RMS_NORM_APPLY, "rms_norm_apply_bf16"),
    (RMS_NORM_GRAD_SUM, "rms_norm_grad_sum_bf16"),
    (RMS_NORM_GRAD_INPUT, "rms_norm_grad_input_bf16"),
    (RMS_NORM_GRAD_WEIGHT, "rms_norm_grad_weight_bf16"),
];

/// The copies of 16-bit words, next to the 32-bit copy each stands for.
const WORD_COPIES: &[(&str, &str)] = &[(COPY_RUNS, COPY_RUNS_U16), (TRANSPOSE, TRANSPOSE_U16)];

const COPY_RUNS_U16: &str = "copy_runs_u16";
const TRANSPOSE_U16: &str = "transpose_u16";
const CAST_F32_TO_BF16: &str = "cast_f32_to_bf16";
const CAST_BF16_TO_F32: &str = "cast_bf16_to_f32";

/// Every bf16 (and 16-bit) `__global__` function of kernels.cu.
pub const BF16_KERNEL_NAMES: &[&str] = &[
    "bias_add_bf16",
    "add_bf16",
    "multiply_bf16",
    "scale_bf16",
    "gelu_tanh_bf16",
    "gelu_erf_bf16",
    "silu_bf16",
    "silu_grad_bf16",
    "gelu_tanh_grad_bf16",
    "gelu_erf_grad_bf16",
    "causal_mask_bf16",
    "dropout_bf16",
    "zero_blocks_bf16",
    "softmax_bf16",
    "softmax_grad_bf16",
    "embedding_lookup_bf16",
    "embedding_grad_bf16",
    "position_lookup_bf16",
    "position_grad_bf16",
    "row_sum_bf16",
    "row_centered_square_sum_bf16",
    "layer_norm_apply_bf16",
    "layer_norm_grad_sums_bf16",
    "layer_norm_grad_input_bf16",
    "layer_norm_grad_weight_bf16",
    "sum_to_last_bf16",
    "cross_entropy_max_bf16",
    "cross_entropy_stats_bf16",
    "cross_entropy_grad_bf16",
    COPY_RUNS_U16,
    TRANSPOSE_U16,
    CAST_F32_TO_BF16,
    CAST_BF16_TO_F32,
    COPY_ROWS_F32,
    COPY_ROWS_U16,
    COPY_ROWS_U16_X8,
    PAD_ROWS_U16,
    PAD_ROWS_U16_X8,
    "add_bf16x8",
    "multiply_bf16x8",
    "scale_bf16x8",
    "gelu_tanh_bf16x8",
    "gelu_erf_bf16x8",
    "silu_bf16x8",
    "silu_grad_bf16x8",
    "gelu_tanh_grad_bf16x8",
    "gelu_erf_grad_bf16x8",
    "bias_add_bf16x8",
    CAST_F32_TO_BF16_X8,
    CAST_BF16_TO_F32_X8,
    COLUMN_PARTIALS,
    COLUMN_TOTALS,
    "row_sum_bf16x8",
    "row_centered_square_sum_bf16x8",
    "layer_norm_apply_bf16x8",
    "layer_norm_grad_sums_bf16x8",
    "layer_norm_grad_input_bf16x8",
    LAYER_NORM_WEIGHT_PARTIALS,
    "cross_entropy_max_bf16x8",
    "cross_entropy_stats_bf16x8",
    CAST_BF16_TO_F32_SPANS,
    CROSS_ENTROPY_GRAD_X8,
    "rotary_bf16",
    "row_square_sum_bf16",
    "rms_norm_apply_bf16",
    "rms_norm_grad_sum_bf16",
    "rms_norm_grad_input_bf16",
    "rms_norm_grad_weight_bf16",
];

/// The cross-entropy gradient written a 16-byte word a thread (see kernels.cu).
pub(super) const CROSS_ENTROPY_GRAD_X8: &str = "cross_entropy_grad_bf16x8";

const LAYER_NORM_WEIGHT_PARTIALS: &str = "layer_norm_weight_partials_bf16x8";

const CAST_F32_TO_BF16_X8: &str = "cast_f32_to_bf16x8";
const CAST_BF16_TO_F32_X8: &str = "cast_bf16_to_f32x8";
/// Many casts from bf16 to f32 in one launch (see `super::many`).
pub(super) const CAST_BF16_TO_F32_SPANS: &str = "cast_bf16_to_f32_spans";
const COLUMN_PARTIALS: &str = "column_partials_bf16x8";
const COLUMN_TOTALS: &str = "column_totals_bf16";

/// The bf16 elementwise kernels that also move eight elements a thread (`_bf16x8`), next to the scalar
/// entry point each stands for.
const BY_EIGHTS: &[(&str, &str)] = &[
    ("add_bf16", "add_bf16x8"),
    ("multiply_bf16", "multiply_bf16x8"),
    ("scale_bf16", "scale_bf16x8"),
    ("gelu_tanh_bf16", "gelu_tanh_bf16x8"),
    ("gelu_erf_bf16", "gelu_erf_bf16x8"),
    ("silu_bf16", "silu_bf16x8"),
    ("silu_grad_bf16", "silu_grad_bf16x8"),
    ("gelu_tanh_grad_bf16", "gelu_tanh_grad_bf16x8"),
    ("gelu_erf_grad_bf16", "gelu_erf_grad_bf16x8"),
    ("bias_add_bf16", "bias_add_bf16x8"),
    (CAST_F32_TO_BF16, CAST_F32_TO_BF16_X8),
    (CAST_BF16_TO_F32, CAST_BF16_TO_F32_X8),
    // Row kernels: one warp a row, eight columns a lane (width a multiple of 8).
    ("row_sum_bf16", "row_sum_bf16x8"),
    ("row_centered_square_sum_bf16", "row_centered_square_sum_bf16x8"),
    ("layer_norm_apply_bf16", "layer_norm_apply_bf16x8"),
    ("layer_norm_grad_sums_bf16", "layer_norm_grad_sums_bf16x8"),
    ("layer_norm_grad_input_bf16", "layer_norm_grad_input_bf16x8"),
];

/// Whether the eight-at-a-time kernels may run: always, unless `OPTIMUS_CUDA_VECTOR=off` (to measure
/// what they gain; both give the same bits).
pub(super) fn eights_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("OPTIMUS_CUDA_VECTOR").map_or(true, |v| v != "off"))
}

/// Whether `n` elements of operands starting at device addresses `starts` split into whole 16-byte words
/// of each: n a multiple of 8 and every start 16-byte aligned. Row kernels pass the row's width as `n`:
/// then every row of every operand starts on a whole word too.
pub(super) fn in_eights(n: usize, starts: &[u64]) -> bool {
    eights_enabled() && n > 0 && n.is_multiple_of(8) && starts.iter().all(|s| s.is_multiple_of(16))
}

/// The bf16 kernels that read eight elements at a time whatever their alignment (two aligned words,
/// shifted), next to the one-element kernel each stands for: the cross-entropy's max and sums, whose rows
/// are the vocabulary's width (50,257 for GPT-2) and rarely start on a 16-byte word.
const ANY_EIGHTS: &[(&str, &str)] = &[
    ("cross_entropy_max_bf16", "cross_entropy_max_bf16x8"),
    ("cross_entropy_stats_bf16", "cross_entropy_stats_bf16x8"),
];

/// The eight-at-a-time entry point of kernel `name` that reads any alignment (see [`ANY_EIGHTS`]), else
/// `name`.
pub(super) fn any_eights(name: &'static str) -> &'static str {
    match eights_enabled() {
        true => ANY_EIGHTS.iter().find(|(one, _)| *one == name).map_or(name, |&(_, eight)| eight),
        false => name,
    }
}

/// The eight-at-a-time entry point of elementwise kernel `name` where [`in_eights`] holds, else `name`.
pub(super) fn by_eights(name: &'static str, n: usize, starts: &[u64]) -> &'static str {
    if !in_eights(n, starts) {
        return name;
    }
    BY_EIGHTS.iter().find(|(one, _)| *one == name).map_or(name, |&(_, eight)| eight)
}

/// The entry point of kernel `name` for tensors of element type `T`.
pub(super) fn variant<T: Elem>(name: &'static str) -> Result<&'static str, KernelError> {
    if T::DTYPE != DType::Bf16 {
        return Ok(name);
    }
    let found = ENTRY_POINTS.iter().find(|(f32_name, _)| *f32_name == name);
    found
        .map(|&(_, bf16_name)| bf16_name)
        .ok_or_else(|| KernelError::Internal(format!("`{name}` has no bf16 entry point")))
}

/// The copy kernel `name` (of 32-bit words) for elements of `T`'s size.
pub(super) fn words<T>(name: &'static str) -> Result<&'static str, KernelError> {
    match std::mem::size_of::<T>() {
        4 => Ok(name),
        2 => WORD_COPIES
            .iter()
            .find(|(wide, _)| *wide == name)
            .map(|&(_, narrow)| narrow)
            .ok_or_else(|| KernelError::Internal(format!("`{name}` has no 16-bit version"))),
        size => Err(KernelError::Internal(format!("no copy kernel moves {size}-byte elements"))),
    }
}

/// What a plan kernel launches on the bf16 operands of a bf16 plan, or `None` when it runs widened
/// (its bf16 operands cast to f32 on the GPU, then its f32 [`launcher`], then a cast back).
pub fn bf16_launcher(kernel: &Kernel) -> Option<Launcher> {
    const ZERO: &str = "zero_blocks_bf16";
    native(kernel)?;
    let kernels = Launcher::kernels;
    Some(match kernel {
        Kernel::Cast => kernels(&[
            CAST_F32_TO_BF16,
            CAST_BF16_TO_F32,
            CAST_F32_TO_BF16_X8,
            CAST_BF16_TO_F32_X8,
            CAST_BF16_TO_F32_SPANS,
            COPY_RUNS_U16,
        ]),
        Kernel::MatMul { .. } | Kernel::BatchedMatMul => {
            Launcher::product(&[ZERO, COPY_ROWS_F32, COPY_ROWS_U16, COPY_ROWS_U16_X8, PAD_ROWS_U16, PAD_ROWS_U16_X8])
        }
        Kernel::Attention { .. } => Launcher::product(&[
            ATTENTION_SOFTMAX,
            CAST_F32_TO_BF16,
            ZERO,
            super::flash::FORWARD_D64,
            super::flash::FORWARD_D128,
        ]),
        Kernel::AttentionGrad { .. } => Launcher::product(&[
            ATTENTION_SOFTMAX,
            ATTENTION_SOFTMAX_GRAD,
            CAST_F32_TO_BF16,
            ZERO,
            super::flash::FORWARD_D64,
            super::flash::FORWARD_D128,
            super::flash::BACKWARD_D64,
            super::flash::BACKWARD_D128,
            super::flash::DQ_STORE,
        ]),
        Kernel::Dropout { .. } | Kernel::DropoutGrad { .. } => kernels(&["dropout_bf16", COPY_RUNS_U16]),
        Kernel::Reshape | Kernel::Select { .. } | Kernel::SelectGrad { .. } | Kernel::SliceShard { .. } => {
            kernels(&[COPY_RUNS_U16])
        }
        Kernel::Transpose { .. } => kernels(&[TRANSPOSE_U16]),
        Kernel::EmbeddingGrad { .. } => kernels(&["embedding_grad_bf16", CAST_F32_TO_BF16]),
        Kernel::PositionGrad => kernels(&["position_grad_bf16", CAST_F32_TO_BF16]),
        Kernel::SumToLast => {
            kernels(&["sum_to_last_bf16", CAST_F32_TO_BF16, CAST_F32_TO_BF16_X8, COLUMN_PARTIALS, COLUMN_TOTALS])
        }
        Kernel::LayerNormGradWeight { .. } => kernels(&[
            LAYER_NORM_STATS,
            "layer_norm_grad_weight_bf16",
            CAST_F32_TO_BF16,
            CAST_F32_TO_BF16_X8,
            LAYER_NORM_WEIGHT_PARTIALS,
            COLUMN_TOTALS,
        ]),
        Kernel::BiasAdd => kernels(&["bias_add_bf16", "bias_add_bf16x8"]),
        Kernel::Add => kernels(&["add_bf16", "add_bf16x8"]),
        Kernel::Mul => kernels(&["multiply_bf16", "multiply_bf16x8"]),
        Kernel::Scale { .. } => kernels(&["scale_bf16", "scale_bf16x8"]),
        Kernel::Gelu { approximate: true } => kernels(&["gelu_tanh_bf16", "gelu_tanh_bf16x8"]),
        Kernel::Gelu { approximate: false } => kernels(&["gelu_erf_bf16", "gelu_erf_bf16x8"]),
        Kernel::GeluGrad { approximate: true } => kernels(&["gelu_tanh_grad_bf16", "gelu_tanh_grad_bf16x8"]),
        Kernel::GeluGrad { approximate: false } => kernels(&["gelu_erf_grad_bf16", "gelu_erf_grad_bf16x8"]),
        Kernel::Silu => kernels(&["silu_bf16", "silu_bf16x8"]),
        Kernel::SiluGrad => kernels(&["silu_grad_bf16", "silu_grad_bf16x8"]),
        Kernel::Softmax => kernels(&["softmax_bf16"]),
        Kernel::SoftmaxGrad => kernels(&["softmax_grad_bf16"]),
        Kernel::CausalMask | Kernel::CausalMaskGrad => kernels(&["causal_mask_bf16"]),
        Kernel::EmbeddingLookup { .. } => kernels(&["embedding_lookup_bf16"]),
        Kernel::PositionLookup => kernels(&["position_lookup_bf16"]),
        Kernel::RowSum => kernels(&["row_sum_bf16", "row_sum_bf16x8"]),
        Kernel::RowCenteredSquareSum { .. } => {
            kernels(&["row_centered_square_sum_bf16", "row_centered_square_sum_bf16x8"])
        }
        Kernel::LayerNormApply { .. } => kernels(&["layer_norm_apply_bf16", "layer_norm_apply_bf16x8"]),
        Kernel::LayerNormGradSums { .. } => kernels(&["layer_norm_grad_sums_bf16", "layer_norm_grad_sums_bf16x8"]),
        Kernel::LayerNormGradInput { .. } => kernels(&["layer_norm_grad_input_bf16", "layer_norm_grad_input_bf16x8"]),
        Kernel::CrossEntropyMax { .. } => kernels(&["cross_entropy_max_bf16", "cross_entropy_max_bf16x8"]),
        Kernel::CrossEntropyStats { .. } => kernels(&["cross_entropy_stats_bf16", "cross_entropy_stats_bf16x8"]),
        Kernel::CrossEntropyGrad { .. } => kernels(&["cross_entropy_grad_bf16", CROSS_ENTROPY_GRAD_X8]),
        Kernel::Rotary { .. } | Kernel::RotaryGrad { .. } => kernels(&["rotary_bf16"]),
        Kernel::RowSquareSum => kernels(&["row_square_sum_bf16"]),
        Kernel::RmsNormApply { .. } => kernels(&["rms_norm_apply_bf16"]),
        Kernel::RmsNormGradSum => kernels(&["rms_norm_grad_sum_bf16"]),
        Kernel::RmsNormGradInput { .. } => kernels(&["rms_norm_grad_input_bf16"]),
        Kernel::RmsNormGradWeight { .. } => {
            kernels(&[RMS_NORM_STATS, "rms_norm_grad_weight_bf16", CAST_F32_TO_BF16, CAST_F32_TO_BF16_X8])
        }
        _ => return None,
    })
}

// ---- which kernels run on bf16 operands -----------------------------------------------------------

/// An operand's element type as the signatures below spell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ty {
    /// bf16
    H,
    /// f32
    F,
    /// i32
    I,
}

use Ty::{F, H, I};

fn ty(data: &DeviceData) -> Ty {
    match data {
        DeviceData::Bf16(_) => H,
        DeviceData::F32(_) => F,
        DeviceData::I32(_) => I,
    }
}

/// The inputs' element types and the output's (any of a list) with which `kernel` runs natively on
/// bf16: those of bf16 plans. `None` for kernels that always run [`widened`].
fn native(kernel: &Kernel) -> Option<(&'static [Ty], &'static [Ty])> {
    const BF16: &[Ty] = &[H];
    const STAT: &[Ty] = &[F];
    Some(match kernel {
        Kernel::MatMul { .. } | Kernel::BatchedMatMul => (&[H, H], &[H, F]),
        Kernel::BiasAdd
        | Kernel::Add
        | Kernel::Mul
        | Kernel::SoftmaxGrad
        | Kernel::SiluGrad
        | Kernel::GeluGrad { .. } => (&[H, H], BF16),
        Kernel::Scale { .. }
        | Kernel::Gelu { .. }
        | Kernel::Silu
        | Kernel::Softmax
        | Kernel::CausalMask
        | Kernel::CausalMaskGrad
        | Kernel::Dropout { .. }
        | Kernel::DropoutGrad { .. }
        | Kernel::Reshape
        | Kernel::Transpose { .. }
        | Kernel::Select { .. }
        | Kernel::SelectGrad { .. }
        | Kernel::SliceShard { .. }
        | Kernel::PositionLookup
        | Kernel::PositionGrad
        | Kernel::SumToLast => (&[H], BF16),
        Kernel::Cast => (&[H], &[H, F]),
        Kernel::Attention { fused: true, .. } => (&[H], BF16),
        Kernel::Attention { fused: false, .. } => (&[H, H, H], BF16),
        Kernel::AttentionGrad { fused: true, .. } => (&[H, H], BF16),
        Kernel::AttentionGrad { fused: false, .. } => (&[H, H, H, H], BF16),
        Kernel::EmbeddingLookup { .. } | Kernel::EmbeddingGrad { .. } => (&[I, H], BF16),
        Kernel::RowSum | Kernel::CrossEntropyMax { .. } => (&[H], STAT),
        Kernel::RowCenteredSquareSum { .. } => (&[H, F], STAT),
        Kernel::LayerNormApply { .. } => (&[H, F, F, H, H], BF16),
        Kernel::LayerNormGradSums { .. } => (&[H, H, H, F, F], STAT),
        Kernel::LayerNormGradInput { .. } => (&[H, H, H, F, F, F], BF16),
        Kernel::LayerNormGradWeight { .. } => (&[H, H, F, F], BF16),
        Kernel::CrossEntropyStats { .. } => (&[H, I, F], STAT),
        Kernel::CrossEntropyGrad { .. } => (&[H, I, F, F, F, F], BF16),
        Kernel::Rotary { .. } | Kernel::RotaryGrad { .. } => (&[H], BF16),
        Kernel::RowSquareSum => (&[H], STAT),
        Kernel::RmsNormApply { .. } => (&[H, F, H], BF16),
        Kernel::RmsNormGradSum => (&[H, H, H], STAT),
        Kernel::RmsNormGradInput { .. } => (&[H, H, H, F, F], BF16),
        Kernel::RmsNormGradWeight { .. } => (&[H, H, F], BF16),
        _ => return None,
    })
}

/// Whether a cast from f32 into bf16 (the plan's weight copies), which no bf16 input announces.
fn rounding_cast(kernel: &Kernel, inputs: &[&DeviceTensor], out: &DeviceTensor) -> bool {
    matches!(kernel, Kernel::Cast) && matches!(inputs, [x] if ty(&x.data) == F) && ty(&out.data) == H
}

/// Whether any operand is bf16 (the kernel then runs here).
pub(super) fn involved(inputs: &[&DeviceTensor], out: &DeviceTensor) -> bool {
    ty(&out.data) == H || inputs.iter().any(|t| ty(&t.data) == H)
}

/// Runs a kernel with a bf16 operand: natively when its element types are those of a bf16 plan,
/// [`widened`] otherwise.
pub(super) fn run(
    k: &mut CudaKernels,
    kernel: &Kernel,
    inputs: &[&DeviceTensor],
    out: &mut DeviceTensor,
    ctx: &KernelContext,
) -> Result<(), KernelError> {
    if rounding_cast(kernel, inputs, out) {
        let [x] = args(inputs)?;
        same_len("the output", out.len(), x.len())?;
        return round_into(&k.dev, x, out);
    }
    let types: Vec<Ty> = inputs.iter().map(|t| ty(&t.data)).collect();
    match native(kernel) {
        Some((ins, outs)) if ins == types.as_slice() && outs.contains(&ty(&out.data)) => {
            run_native(k, kernel, inputs, out, ctx)
        }
        _ => widened(k, kernel, inputs, out, ctx),
    }
}

/// Runs a kernel whose operands have the element types [`native`] gives.
fn run_native(
    k: &mut CudaKernels,
    kernel: &Kernel,
    inputs: &[&DeviceTensor],
    out: &mut DeviceTensor,
    ctx: &KernelContext,
) -> Result<(), KernelError> {
    type B = u16;
    let CudaKernels { dev, logical, scratch, flag, half, .. } = k;
    let dev = &*dev;
    let out_f32 = ty(&out.data) == F;
    match *kernel {
        Kernel::MatMul { transpose_a: ta, transpose_b: tb, accumulate: acc } if out_f32 => {
            dev.matmul::<B, f32>(inputs, out, ta, tb, acc)
        }
        Kernel::MatMul { transpose_a: ta, transpose_b: tb, accumulate: acc } => {
            dev.matmul::<B, B>(inputs, out, ta, tb, acc)
        }
        Kernel::BatchedMatMul if out_f32 => dev.batched_matmul::<B, f32>(inputs, out),
        Kernel::BatchedMatMul => dev.batched_matmul::<B, B>(inputs, out),
        Kernel::BiasAdd => dev.bias_add::<B>(inputs, out),
        Kernel::Add => dev.map_binary::<B>(ADD, inputs, out),
        Kernel::Mul => dev.map_binary::<B>(MULTIPLY, inputs, out),
        Kernel::Scale { factor } => dev.scale::<B>(inputs, out, factor),
        Kernel::Gelu { approximate: true } => dev.map_unary::<B>(GELU_TANH, inputs, out),
        Kernel::Gelu { approximate: false } => dev.map_unary::<B>(GELU_ERF, inputs, out),
        Kernel::Silu => dev.map_unary::<B>(SILU, inputs, out),
        Kernel::SiluGrad => dev.map_binary::<B>(SILU_GRAD, inputs, out),
        Kernel::GeluGrad { approximate: true } => dev.map_binary::<B>(GELU_TANH_GRAD, inputs, out),
        Kernel::GeluGrad { approximate: false } => dev.map_binary::<B>(GELU_ERF_GRAD, inputs, out),
        Kernel::Softmax => dev.softmax::<B>(inputs, out),
        Kernel::SoftmaxGrad => dev.softmax_grad::<B>(inputs, out),
        Kernel::CausalMask => dev.causal_mask::<B>(inputs, out, f32::NEG_INFINITY),
        Kernel::CausalMaskGrad => dev.causal_mask::<B>(inputs, out, 0.0),
        Kernel::Dropout { p, key } | Kernel::DropoutGrad { p, key } => {
            dropout::<B>(dev, logical, inputs, out, ctx, p, key)
        }
        Kernel::Reshape => dev.reshape(inputs, out),
        Kernel::Transpose { dim0, dim1 } => dev.transpose(inputs, out, dim0.into(), dim1.into()),
        Kernel::Select { dim, index } => dev.select(inputs, out, dim.into(), index),
        Kernel::SelectGrad { dim, index } => dev.select_grad(inputs, out, dim.into(), index),
        Kernel::SliceShard { axis, placement } => dev.slice_shard(inputs, out, ctx, axis.into(), placement),
        Kernel::Attention { heads, kv_heads, causal, fused } => {
            let a = AttentionArgs { heads, kv_heads, causal, fused, wrt: 0 };
            dev.attention_bf16(inputs, out, a, &mut scratch[0], &mut half.probs)
        }
        Kernel::AttentionGrad { heads, kv_heads, causal, fused, wrt } => {
            let a = AttentionArgs { heads, kv_heads, causal, fused, wrt };
            dev.attention_grad_bf16(inputs, out, a, scratch, half)
        }
        Kernel::EmbeddingLookup { offset, masked } => {
            dev.embedding_lookup::<B>(inputs, out, Rows { base: offset.at(ctx.coords), masked }, flag)
        }
        Kernel::EmbeddingGrad { offset, masked, padding } => {
            let rows = Rows { base: offset.at(ctx.coords), masked };
            through_f32(dev, out, |wide| dev.embedding_grad::<B>(inputs, wide, (rows, padding), flag))
        }
        Kernel::PositionLookup => dev.position_lookup::<B>(inputs, out),
        Kernel::PositionGrad => through_f32(dev, out, |wide| dev.position_grad::<B>(inputs, wide)),
        Kernel::RowSum => dev.row_sum::<B>(inputs, out),
        Kernel::RowCenteredSquareSum { n } => dev.row_centered_square_sum::<B>(inputs, out, n),
        Kernel::LayerNormApply { n, eps } => dev.layer_norm_apply::<B>(inputs, out, Norm { n, eps }),
        Kernel::LayerNormGradSums { n, eps } => dev.layer_norm_grad_sums::<B>(inputs, out, Norm { n, eps }),
        Kernel::LayerNormGradInput { n, eps } => dev.layer_norm_grad_input::<B>(inputs, out, Norm { n, eps }),
        Kernel::LayerNormGradWeight { n, eps } => {
            let [stats, _] = scratch;
            match dev.layer_norm_weight_bf16(inputs, out, Norm { n, eps }, stats, &mut half.columns)? {
                true => Ok(()),
                false => {
                    through_f32(dev, out, |wide| dev.layer_norm_grad_weight::<B>(inputs, wide, Norm { n, eps }, stats))
                }
            }
        }
        Kernel::SumToLast => match dev.column_sums_bf16(inputs, out, &mut half.columns)? {
            true => Ok(()),
            false => through_f32(dev, out, |wide| dev.sum_to_last::<B>(inputs, wide)),
        },
        Kernel::CrossEntropyMax { offset, valid } => {
            dev.cross_entropy_max::<B>(inputs, out, Vocab::new(offset, valid, ctx))
        }
        Kernel::CrossEntropyStats { offset, valid } => {
            dev.cross_entropy_stats::<B>(inputs, out, Vocab::new(offset, valid, ctx), flag)
        }
        Kernel::CrossEntropyGrad { offset, valid } => {
            dev.cross_entropy_grad::<B>(inputs, out, Vocab::new(offset, valid, ctx), flag)
        }
        Kernel::Cast => cast_from_bf16(dev, inputs, out),
        Kernel::Rotary { heads, theta } => dev.rotary::<B>(inputs, out, heads, theta, 1.0),
        Kernel::RotaryGrad { heads, theta } => dev.rotary::<B>(inputs, out, heads, theta, -1.0),
        Kernel::RowSquareSum => dev.row_square_sum::<B>(inputs, out),
        Kernel::RmsNormApply { n, eps } => dev.rms_norm_apply::<B>(inputs, out, Norm { n, eps }),
        Kernel::RmsNormGradSum => dev.rms_norm_grad_sum::<B>(inputs, out),
        Kernel::RmsNormGradInput { n, eps } => dev.rms_norm_grad_input::<B>(inputs, out, Norm { n, eps }),
        Kernel::RmsNormGradWeight { n, eps } => {
            let [stats, _] = scratch;
            through_f32(dev, out, |wide| dev.rms_norm_grad_weight::<B>(inputs, wide, Norm { n, eps }, stats))
        }
        _ => Err(KernelError::Internal(format!("{kernel:?} has no bf16 kernel"))),
    }
}

// ---- casts and the widened fallback ---------------------------------------------------------------

/// An f32 copy of a bf16 tensor, or `None` for a tensor of another type.
fn widen(dev: &Device, t: &DeviceTensor) -> Result<Option<DeviceTensor>, KernelError> {
    let src = match &t.data {
        DeviceData::Bf16(_) => elems::<u16>(t, "a bf16 operand")?,
        _ => return Ok(None),
    };
    let mut wide = DeviceTensor::zeros(&dev.stream, DType::F32, &t.shape)?;
    let n = t.len() as u64;
    let y = floats_mut(&mut wide, "the widened copy")?;
    let name = by_eights(CAST_BF16_TO_F32, t.len(), &[dev.start(src), dev.start(y)]);
    launch!(dev, name, elementwise_by(name, t.len()), [y, src, &n])?;
    Ok(Some(wide))
}

/// Rounds an f32 tensor into a bf16 one of the same length (to nearest, ties to even).
fn round_into(dev: &Device, wide: &DeviceTensor, out: &mut DeviceTensor) -> Result<(), KernelError> {
    let x = floats(wide, "the f32 result")?;
    same_len("the bf16 output", out.len(), wide.len())?;
    let n = wide.len() as u64;
    let y = elems_mut::<u16>(out, "the bf16 output")?;
    let name = by_eights(CAST_F32_TO_BF16, wide.len(), &[dev.start(x), dev.start(y)]);
    launch!(dev, name, elementwise_by(name, wide.len()), [y, x, &n])
}

/// A cast from bf16: widened into an f32 output, copied into a bf16 one.
fn cast_from_bf16(dev: &Device, inputs: &[&DeviceTensor], out: &mut DeviceTensor) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    let src = elems::<u16>(x, "the input")?;
    same_len("the output", out.len(), x.len())?;
    let n = x.len();
    if let DeviceData::Bf16(y) = &mut out.data {
        return dev.copy_runs(src, y, (n, n), Runs::whole(n));
    }
    let y = floats_mut(out, "the output")?;
    let count = n as u64;
    let name = by_eights(CAST_BF16_TO_F32, n, &[dev.start(src), dev.start(y)]);
    launch!(dev, name, elementwise_by(name, n), [y, src, &count])
}

/// Runs `f` into an f32 scratch of the output's shape and rounds the result into the bf16 output once
/// (for the kernels that sum into their output with atomics).
fn through_f32(
    dev: &Device,
    out: &mut DeviceTensor,
    f: impl FnOnce(&mut DeviceTensor) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    let mut wide = DeviceTensor::zeros(&dev.stream, DType::F32, &out.shape)?;
    f(&mut wide)?;
    round_into(dev, &wide, out)
}

/// Runs the f32 kernel on f32 copies of the bf16 operands (made on the GPU) and rounds a bf16 output
/// once: what the CPU backend does for every kernel.
fn widened(
    k: &mut CudaKernels,
    kernel: &Kernel,
    inputs: &[&DeviceTensor],
    out: &mut DeviceTensor,
    ctx: &KernelContext,
) -> Result<(), KernelError> {
    let wide: Vec<Option<DeviceTensor>> = inputs.iter().map(|t| widen(&k.dev, t)).collect::<Result<_, _>>()?;
    let refs: Vec<&DeviceTensor> = inputs.iter().zip(&wide).map(|(&t, w)| w.as_ref().unwrap_or(t)).collect();
    if ty(&out.data) != H {
        return k.dispatch(kernel, &refs, out, ctx);
    }
    let mut scratch = match (kernel.reads_its_output(), widen(&k.dev, out)?) {
        (true, Some(w)) => w,
        _ => DeviceTensor::zeros(&k.dev.stream, DType::F32, &out.shape)?,
    };
    k.dispatch(kernel, &refs, &mut scratch, ctx)?;
    round_into(&k.dev, &scratch, out)
}

// ---- products: cuBLAS gemmEx ----------------------------------------------------------------------

/// An output element type of a bf16 product, as cuBLAS names it.
trait BlasOut: Elem {
    const BLAS: cudaDataType;
}

impl BlasOut for f32 {
    const BLAS: cudaDataType = cudaDataType::CUDA_R_32F;
}

impl BlasOut for u16 {
    const BLAS: cudaDataType = cudaDataType::CUDA_R_16BF;
}

impl<C: BlasOut + Realignable> Multiply<u16, C> for Device {
    fn multiply(&self, c: &mut CudaSlice<C>, p: Product<u16>) -> Result<(), KernelError> {
        match p.check(c.len())? {
            Work::Nothing => Ok(()),
            Work::Zero => self.zero_blocks(c, p.c, p.batches),
            Work::Multiply(m, n, k) => match self.realigned_product(c, &p, (m, n, k))? {
                Some(()) => Ok(()),
                None => self.gemm_ex(c, &p, (m, n, k)),
            },
        }
    }
}

impl Device {
    /// C (+)= alpha op(A) op(B) with bf16 A and B and f32 accumulation, on the tensor cores where the GPU
    /// has them (row-major C = op(A) op(B) is computed as column-major C^T = op(B)^T op(A)^T, as sgemm).
    fn gemm_ex<C: BlasOut>(
        &self,
        c: &mut CudaSlice<C>,
        p: &Product<u16>,
        (m, n, k): (usize, usize, usize),
    ) -> Result<(), KernelError> {
        let dims = [blas_dim(n)?, blas_dim(m)?, blas_dim(k)?];
        let (ldb, lda, ldc) =
            (blas_dim(p.b.block.ld.max(1))?, blas_dim(p.a.block.ld.max(1))?, blas_dim(p.c.ld.max(1))?);
        let (stride_b, stride_a) = (blas_stride(p.b.block.stride)?, blas_stride(p.a.block.stride)?);
        let (stride_c, batches) = (blas_stride(p.c.stride)?, blas_dim(p.batches)?);
        let missing = || KernelError::Internal(BLOCK_PAST_BUFFER.into());
        let av = p.a.data.try_slice(p.a.block.start..).ok_or_else(missing)?;
        let bv = p.b.data.try_slice(p.b.block.start..).ok_or_else(missing)?;
        let mut cv = c.try_slice_mut(p.c.start..).ok_or_else(missing)?;
        self.stream.context().bind_to_thread().map_err(driver("binding the CUDA context"))?;
        let (alpha, beta) = (p.alpha, if p.accumulate { 1.0f32 } else { 0.0f32 });
        let (a_ptr, _a_done) = av.device_ptr(&self.stream);
        let (b_ptr, _b_done) = bv.device_ptr(&self.stream);
        let (c_ptr, _c_done) = cv.device_ptr_mut(&self.stream);
        let (bf16, compute, algo) =
            (cudaDataType::CUDA_R_16BF, cublasComputeType_t::CUBLAS_COMPUTE_32F, cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT);
        let (alpha, beta) = (&alpha as *const f32 as *const c_void, &beta as *const f32 as *const c_void);
        let (a, b, cp) = (a_ptr as *const c_void, b_ptr as *const c_void, c_ptr as *mut c_void);
        let handle = *self.blas.handle();
        // SAFETY: the extents of all three blocks (every batch) were checked against their buffers by
        // `Product::check`; the pointers stay valid while the views are borrowed (to the end of this
        // function, after the call is queued on the handle's stream, which is `self.stream`); alpha and
        // beta are host f32 scalars, as CUBLAS_COMPUTE_32F reads them.
        let result = unsafe {
            if p.batches == 1 {
                cudarc::cublas::result::gemm_ex(
                    handle,
                    p.b.op(),
                    p.a.op(),
                    dims[0],
                    dims[1],
                    dims[2],
                    alpha,
                    b,
                    bf16,
                    ldb,
                    a,
                    bf16,
                    lda,
                    beta,
                    cp,
                    C::BLAS,
                    ldc,
                    compute,
                    algo,
                )
            } else {
                cudarc::cublas::result::gemm_strided_batched_ex(
                    handle,
                    p.b.op(),
                    p.a.op(),
                    dims[0],
                    dims[1],
                    dims[2],
                    alpha,
                    b,
                    bf16,
                    ldb,
                    stride_b,
                    a,
                    bf16,
                    lda,
                    stride_a,
                    beta,
                    cp,
                    C::BLAS,
                    ldc,
                    stride_c,
                    batches,
                    compute,
                    algo,
                )
            }
        };
        result.map_err(|error| DeviceError::Blas { call: "gemmEx (bf16)", error }.into())
    }
}

// ---- column sums ----------------------------------------------------------------------------------

/// About how many blocks the first pass of the column sums gives the GPU (four a multiprocessor on a
/// 132-multiprocessor H100 or H200).
const COLUMN_BLOCKS: usize = 528;

/// The first pass of the column sums over [rows, width]: its launch (blocks of 256 columns across,
/// chunks of rows down, about [`COLUMN_BLOCKS`] blocks in all), the rows each block sums (a multiple of
/// 8, the block's height) and how many chunks the rows make.
fn column_chunks(rows: usize, width: usize) -> (LaunchConfig, usize, usize) {
    let across = width.div_ceil(256).max(1);
    let chunks = (COLUMN_BLOCKS / across).clamp(1, rows.div_ceil(8).max(1));
    let span = rows.div_ceil(chunks).next_multiple_of(8);
    let chunks = rows.div_ceil(span).max(1);
    (config((across, chunks), (32, 8)), span, chunks)
}

impl Device {
    /// SumToLast of a bf16 [rows, width] into a bf16 [width] in two passes without atomics (kernels.cu's
    /// `column_partials_bf16x8`, then [`Device::column_totals`]), where the width is a multiple of 8 and x
    /// 16-byte aligned; `false`, with nothing run, otherwise.
    fn column_sums_bf16(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        part: &mut Option<CudaSlice<f32>>,
    ) -> Result<bool, KernelError> {
        let [x] = args(inputs)?;
        let (rows, width) = split_last(&x.shape);
        let xv = elems::<u16>(x, "x")?;
        if ty(&out.data) != H || rows == 0 || !in_eights(width, &[self.start(xv)]) {
            return Ok(false);
        }
        same_len("the output", out.len(), width)?;
        let (first, span, chunks) = column_chunks(rows, width);
        let part = grow(part, &self.stream, chunks * width)?;
        let (r, w, sp) = (rows as u64, width as u64, span as u64);
        launch!(self, COLUMN_PARTIALS, Some(first), [&mut *part, xv, &r, &w, &sp])?;
        self.column_totals(out, part, chunks, width)?;
        Ok(true)
    }

    /// LayerNormGradWeight of bf16 dy and x into a bf16 [width] by the column sums' two passes (the rows'
    /// mean and rstd first, as the f32 kernel takes them), where the width is a multiple of 8 and dy and
    /// x 16-byte aligned; `false`, with nothing run, otherwise.
    fn layer_norm_weight_bf16(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        norm: Norm,
        stats: &mut Option<CudaSlice<f32>>,
        part: &mut Option<CudaSlice<f32>>,
    ) -> Result<bool, KernelError> {
        let [dy, x, sum, sqsum] = args(inputs)?;
        let (rows, width) = split_last(&x.shape);
        let (dyv, xv) = (per_row_of::<u16>(dy, rows, width, "dy")?, elems::<u16>(x, "x")?);
        if ty(&out.data) != H || rows == 0 || !in_eights(width, &[self.start(dyv), self.start(xv)]) {
            return Ok(false);
        }
        let [sv, qv] = row_stats(sum, sqsum, rows, norm)?;
        same_len("the output", out.len(), width)?;
        let stats = grow(stats, &self.stream, 2 * rows)?;
        let (r, w) = (rows as u64, width as u64);
        launch!(self, LAYER_NORM_STATS, elementwise(rows), [&mut *stats, sv, qv, &r, &norm.n, &norm.eps])?;
        let (first, span, chunks) = column_chunks(rows, width);
        let part = grow(part, &self.stream, chunks * width)?;
        let sp = span as u64;
        launch!(self, LAYER_NORM_WEIGHT_PARTIALS, Some(first), [&mut *part, dyv, xv, &*stats, &r, &w, &sp])?;
        self.column_totals(out, part, chunks, width)?;
        Ok(true)
    }

    /// The column sums' second pass: each column's `chunks` partial sums in `part` added in order and
    /// rounded once into the bf16 output.
    fn column_totals(
        &self,
        out: &mut DeviceTensor,
        part: &CudaSlice<f32>,
        chunks: usize,
        width: usize,
    ) -> Result<(), KernelError> {
        let y = elems_mut::<u16>(out, "the output")?;
        let (ch, w) = (chunks as u64, width as u64);
        launch!(self, COLUMN_TOTALS, Some(config((width.div_ceil(32), 1), (32, 8))), [y, part, &ch, &w])
    }
}

// ---- attention ------------------------------------------------------------------------------------

/// The bf16 scratch of the kernels: attention probabilities (and their gradient) rounded to bf16 as
/// product operands.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    probs: Option<CudaSlice<u16>>,
    /// The per-chunk column sums of [`Device::column_sums_bf16`].
    columns: Option<CudaSlice<f32>>,
    /// The log-sum-exp, D and dQ sums of the flash attention's backward pass.
    flash: super::flash::Scratch,
}

impl Scratch {
    /// Drops the attention gradients kept for the next `AttentionGrad` (see `flash::Kept`).
    pub(super) fn forget_kept(&mut self) {
        self.flash.forget();
    }
}

impl Device {
    /// Rounds the first `n` elements of an f32 scratch into a bf16 one.
    fn round_scratch(&self, wide: &CudaSlice<f32>, narrow: &mut CudaSlice<u16>, n: usize) -> Result<(), KernelError> {
        require(wide.len() >= n && narrow.len() >= n, || KernelError::Internal("a scratch is too small".into()))?;
        let count = n as u64;
        let name = by_eights(CAST_F32_TO_BF16, n, &[self.start(wide), self.start(narrow)]);
        launch!(self, name, elementwise_by(name, n), [narrow, wide, &count])
    }

    /// softmax(q k^T / sqrt(d)) v per head, with bf16 q, k, v and output: the scores and probabilities are
    /// f32; the probabilities are rounded to bf16 for the product with v.
    fn attention_bf16(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        a: AttentionArgs,
        probs: &mut Option<CudaSlice<f32>>,
        half: &mut Option<CudaSlice<u16>>,
    ) -> Result<(), KernelError> {
        let qkv = Qkv::<u16>::of(inputs, (a.heads, a.kv_heads), a.fused)?;
        same_shape("the output", &out.shape, &qkv.out_shape())?;
        let (sq, sk) = (qkv.seq(0), qkv.seq(1));
        let y = elems_mut::<u16>(out, "the output")?;
        if let Some(done) = self.flash_attention(&qkv, a.causal, y) {
            return done;
        }
        let n = qkv.heads * sq * sk;
        let (probs, half) = (grow(probs, &self.stream, n)?, grow(half, &self.stream, n)?);
        for b in 0..qkv.batch {
            self.probabilities(&qkv, b, a.causal, probs)?;
            self.round_scratch(probs, half, n)?;
            for r in 0..qkv.group() {
                let p = scratch_operand(&*half, qkv.scores_block(r), false);
                self.multiply(
                    y,
                    per_head(p, qkv.operand(2, b, r, false), qkv.out_block(b, r), qkv.kv_heads, 1.0, false),
                )?;
            }
        }
        Ok(())
    }

    /// (dy, operands..) -> the gradient of operand `wrt` (all three, packed, when fused), all bf16.
    fn attention_grad_bf16(
        &self,
        inputs: &[&DeviceTensor],
        out: &mut DeviceTensor,
        a: AttentionArgs,
        scratch: &mut [Option<CudaSlice<f32>>; 2],
        half: &mut Scratch,
    ) -> Result<(), KernelError> {
        let (dy, operands) = inputs.split_first().ok_or(KernelError::NoAttentionGradient)?;
        let qkv = Qkv::<u16>::of(operands, (a.heads, a.kv_heads), a.fused)?;
        let wrt = usize::from(a.wrt);
        require(wrt < if a.fused { 1 } else { 3 }, || KernelError::NoOperand(wrt))?;
        same_shape("dy", &dy.shape, &qkv.out_shape())?;
        same_shape("the output", &out.shape, qkv.shapes[wrt])?;
        let dyv = elems::<u16>(dy, "dy")?;
        let g = elems_mut::<u16>(out, "the output")?;
        if let Some(done) = self.flash_attention_grad(&qkv, a, dyv, g, &mut half.flash) {
            return done;
        }
        let n = qkv.heads * qkv.seq(0) * qkv.seq(1);
        let [probs, dprobs] = scratch;
        let (probs, dprobs) = (grow(probs, &self.stream, n)?, grow(dprobs, &self.stream, n)?);
        let half = grow(&mut half.probs, &self.stream, n)?;
        let want = |operand: usize| a.fused || operand == wrt;
        for b in 0..qkv.batch {
            let step = GradStep { qkv: &qkv, dy: dyv, b, want: [want(0), want(1), want(2)] };
            self.probabilities(&qkv, b, a.causal, probs)?;
            self.attention_grad_batch_bf16(&step, g, [&mut *probs, &mut *dprobs], half)?;
        }
        Ok(())
    }

    /// The gradients of batch b from its f32 probabilities: dV = P^T dO, dP = dO V^T (f32),
    /// dS = P (dP - rowsum(dP P)) (f32), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d), with P and dS
    /// rounded to bf16 (in `half`) as product operands.
    fn attention_grad_batch_bf16(
        &self,
        s: &GradStep<u16>,
        g: &mut CudaSlice<u16>,
        [probs, dprobs]: [&mut CudaSlice<f32>; 2],
        half: &mut CudaSlice<u16>,
    ) -> Result<(), KernelError> {
        let (qkv, b) = (s.qkv, s.b);
        let (sq, sk, heads, kv) = (qkv.seq(0), qkv.seq(1), qkv.heads, qkv.kv_heads);
        let n = heads * sq * sk;
        let dout = |r| Operand { data: s.dy, block: qkv.out_block(b, r), transpose: false };
        let grad_block = |operand: usize, r| qkv.member_block(qkv.packing[operand], operand == 0, b, r);
        if s.want[2] {
            self.round_scratch(probs, half, n)?;
            for r in 0..qkv.group() {
                let p = scratch_operand(&*half, qkv.scores_block(r), true);
                self.multiply(g, per_head(p, dout(r), grad_block(2, r), kv, 1.0, r > 0))?;
            }
        }
        if !(s.want[0] || s.want[1]) {
            return Ok(());
        }
        for r in 0..qkv.group() {
            let c = qkv.scores_block(r);
            self.multiply(&mut *dprobs, per_head(dout(r), qkv.operand(2, b, r, true), c, kv, 1.0, false))?;
        }
        let cfg = if sk == 0 { None } else { per_rows(heads * sq, sk) };
        let (rows, width) = ((heads * sq) as u64, sk as u64);
        launch!(self, ATTENTION_SOFTMAX_GRAD, cfg, [&mut *dprobs, &*probs, &rows, &width])?;
        self.round_scratch(dprobs, half, n)?;
        for r in 0..qkv.group() {
            if s.want[0] {
                let ds = scratch_operand(&*half, qkv.scores_block(r), false);
                self.multiply(g, per_head(ds, qkv.operand(1, b, r, false), grad_block(0, r), kv, qkv.scale(), false))?;
            }
            if s.want[1] {
                let ds = scratch_operand(&*half, qkv.scores_block(r), true);
                self.multiply(g, per_head(ds, qkv.operand(0, b, r, false), grad_block(1, r), kv, qkv.scale(), r > 0))?;
            }
        }
        Ok(())
    }
}

/// A product over `batches` blocks, accumulated into the output or not.
fn per_head<'a>(
    a: Operand<'a, u16>,
    b: Operand<'a, u16>,
    c: Block,
    batches: usize,
    alpha: f32,
    accumulate: bool,
) -> Product<'a, u16> {
    Product { a, b, c, batches, alpha, accumulate }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bf16_entry_point_is_listed_once() {
        for (_, name) in ENTRY_POINTS.iter().chain(WORD_COPIES).chain(BY_EIGHTS).chain(ANY_EIGHTS) {
            assert_eq!(BF16_KERNEL_NAMES.iter().filter(|n| *n == name).count(), 1, "`{name}`");
        }
        let besides = 12;
        assert_eq!(
            BF16_KERNEL_NAMES.len(),
            ENTRY_POINTS.len() + WORD_COPIES.len() + BY_EIGHTS.len() + ANY_EIGHTS.len() + besides,
            "two casts, five row copies, three column-sum passes, the many-tensor cast, the word-wise \
             cross-entropy gradient"
        );
    }

    #[test]
    fn eight_at_a_time_only_on_whole_aligned_words() {
        assert_eq!(by_eights("add_bf16", 64, &[0x1000, 0x2010]), "add_bf16x8");
        assert_eq!(by_eights(CAST_F32_TO_BF16, 8, &[0x1000]), CAST_F32_TO_BF16_X8);
        assert_eq!(by_eights("add_bf16", 60, &[0x1000]), "add_bf16", "n not a multiple of 8");
        assert_eq!(by_eights("add_bf16", 64, &[0x1000, 0x2008]), "add_bf16", "a start off 16 bytes");
        assert_eq!(by_eights("add_bf16", 0, &[]), "add_bf16", "nothing to do");
        assert_eq!(by_eights("softmax_bf16", 64, &[0x1000]), "softmax_bf16", "no eight-wide version");
        assert_eq!(by_eights("add", 64, &[0x1000]), "add", "f32 keeps its kernel");
    }

    #[test]
    fn column_chunks_cover_every_row_once_and_fill_the_gpu() {
        for (rows, width) in [(8192, 768), (8192, 3072), (8192, 2304), (1, 8), (7, 16), (100_000, 8), (33, 50_264)] {
            let (launch, span, chunks) = column_chunks(rows, width);
            assert_eq!(launch.grid_dim, (width.div_ceil(256) as u32, chunks as u32, 1), "{rows}x{width}");
            assert!(span.is_multiple_of(8) && span > 0, "{rows}x{width}: span {span}");
            assert!(span * chunks >= rows && span * (chunks - 1) < rows, "{rows}x{width}: {chunks} chunks of {span}");
            assert!(chunks <= 65_535, "{rows}x{width}: the grid's second dimension");
        }
        let (_, _, chunks) = column_chunks(8192, 768);
        assert!(chunks * 3 >= COLUMN_BLOCKS / 2, "GPT-2's bias gradients fill the GPU: {chunks} chunks");
    }

    #[test]
    fn variants_pick_the_entry_point_of_the_element_type() -> Result<(), String> {
        assert_eq!(variant::<f32>(GELU_TANH)?, "gelu_tanh");
        assert_eq!(variant::<u16>(GELU_TANH)?, "gelu_tanh_bf16");
        assert!(variant::<u16>(ADAMW_STEP).is_err());
        assert_eq!(words::<f32>(COPY_RUNS)?, COPY_RUNS);
        assert_eq!(words::<i32>(TRANSPOSE)?, TRANSPOSE);
        assert_eq!(words::<u16>(TRANSPOSE)?, TRANSPOSE_U16);
        assert!(words::<u64>(COPY_RUNS).is_err());
        Ok(())
    }
}
