//! CPU kernels: the reference implementation of every plan [`Kernel`] on host tensors, the optimizer
//! update, and the counter-based dropout mask. Matrix products go through the library [`blas`] chooses
//! (OpenBLAS, our AVX2 kernel or faer); attention's per-head products and the bf16 emulation's through faer.

use super::blas::{self, Products};
use super::par;
use super::vmath::{self, vectorized};
use crate::error::{KernelError, batched_product, require};
pub use crate::settings::{KernelContext, OptimizerKind, OptimizerSettings};
use crate::view::TensorViews;
use crate::view::{View, ViewData, ViewMut, ViewMutData};
use faer::{MatMut, MatRef};
use optimus_plan::layout::Placement;
use optimus_plan::logical::IndexMap;
pub use optimus_plan::logical::{DropoutMask, dropout_keep, logical_indices, try_logical_indices};
use optimus_plan::shapes::{
    QUERY_TILE, Runs, ShapeError, batch_matrix, numel, reshape_runs, same_len, same_shape, select_grad_runs,
    select_runs, slice_shard_runs, split_last, transpose_swap,
};
use optimus_plan::tensor::Tensor;
use optimus_plan::{IGNORE_INDEX, Kernel, Offset};
use rayon::prelude::*;

mod cache;
mod rms_norm;

pub use cache::cached_attention_on_prefix;

/// Runs one kernel. `out` is preallocated with the output buffer's local shape (zeros on first write;
/// it holds the previous contents when the kernel accumulates). Errors are typed, never panics.
pub fn run(kernel: &Kernel, inputs: &[&Tensor], out: &mut Tensor, ctx: &KernelContext) -> Result<(), KernelError> {
    let views: Vec<View> = inputs.iter().map(|t| t.view()).collect();
    let refs: Vec<&View> = views.iter().collect();
    run_views(kernel, &refs, &mut out.view_mut(), ctx)
}

/// [`run`] on views of any storage (the host arena): the entry point of the CPU backend.
pub fn run_views(kernel: &Kernel, inputs: &[&View], out: &mut ViewMut, ctx: &KernelContext) -> Result<(), KernelError> {
    dispatch(kernel, inputs, out, ctx).map_err(|e| KernelError::in_kernel(kernel, e))
}

fn dispatch(kernel: &Kernel, inputs: &[&View], out: &mut ViewMut, ctx: &KernelContext) -> Result<(), KernelError> {
    match *kernel {
        Kernel::MatMul { transpose_a, transpose_b, accumulate } => {
            matmul_kernel(inputs, out, transpose_a, transpose_b, accumulate)
        }
        Kernel::BatchedMatMul => batched_matmul(inputs, out),
        Kernel::BiasAdd => bias_add(inputs, out),
        Kernel::Add => map_binary(inputs, out, |a, b| a + b),
        Kernel::Mul => map_binary(inputs, out, |a, b| a * b),
        Kernel::Scale { factor } => {
            let factor = factor as f32;
            map_unary(inputs, out, |x| x * factor)
        }
        Kernel::Gelu { approximate: true } => gelu_tanh_kernel(inputs, out),
        Kernel::Gelu { approximate: false } => map_unary(inputs, out, gelu_erf),
        Kernel::GeluGrad { approximate: true } => gelu_tanh_grad_kernel(inputs, out),
        Kernel::GeluGrad { approximate: false } => map_binary(inputs, out, |dy, x| dy * gelu_erf_grad(x)),
        Kernel::Silu => map_unary(inputs, out, silu),
        Kernel::SiluGrad => map_binary(inputs, out, |dy, x| dy * silu_grad(x)),
        Kernel::Softmax => softmax(inputs, out),
        Kernel::SoftmaxGrad => softmax_grad(inputs, out),
        Kernel::CausalMask => causal_mask(inputs, out, f32::NEG_INFINITY),
        Kernel::CausalMaskGrad => causal_mask(inputs, out, 0.0),
        Kernel::Dropout { p, key } | Kernel::DropoutGrad { p, key } => dropout(inputs, out, ctx, p, key),
        Kernel::Reshape => reshape(inputs, out),
        Kernel::Transpose { dim0, dim1 } => transpose(inputs, out, dim0.into(), dim1.into()),
        Kernel::Select { dim, index } => select(inputs, out, dim.into(), index),
        Kernel::SelectGrad { dim, index } => select_grad(inputs, out, dim.into(), index),
        Kernel::Attention { heads, kv_heads, causal, fused } => {
            attention(inputs, out, (heads, kv_heads), causal, fused)
        }
        Kernel::AttentionGrad { heads, kv_heads, causal, fused, wrt } => {
            attention_grad(inputs, out, (heads, kv_heads), causal, fused, wrt)
        }
        Kernel::Rotary { heads, theta } => rotary(inputs, out, heads, theta, Rotation::Forward),
        Kernel::RotaryGrad { heads, theta } => rotary(inputs, out, heads, theta, Rotation::Backward),
        Kernel::RotaryAt { heads, theta } => cache::rotary_at(inputs, out, heads, theta),
        Kernel::EmbeddingLookup { offset, masked } => embedding_lookup(inputs, out, offset.at(ctx.coords), masked),
        Kernel::EmbeddingGrad { offset, masked, padding } => {
            embedding_grad(inputs, out, (offset.at(ctx.coords), masked), padding)
        }
        Kernel::PositionLookup => position_lookup(inputs, out),
        Kernel::PositionLookupAt => cache::position_lookup_at(inputs, out),
        Kernel::CacheWrite { part, parts } => cache::cache_write(inputs, out, part, parts),
        Kernel::CachedAttention { heads, kv_heads, fused } => {
            cache::cached_attention(inputs, out, (heads, kv_heads), fused)
        }
        Kernel::PositionGrad => position_grad(inputs, out),
        Kernel::RowSum => row_sum(inputs, out),
        Kernel::RowCenteredSquareSum { n } => row_centered_square_sum(inputs, out, n),
        Kernel::LayerNormApply { n, eps } => layer_norm_apply(inputs, out, n, eps),
        Kernel::LayerNormGradSums { n, eps } => layer_norm_grad_sums(inputs, out, n, eps),
        Kernel::LayerNormGradInput { n, eps } => layer_norm_grad_input(inputs, out, n, eps),
        Kernel::LayerNormGradWeight { n, eps } => layer_norm_grad_weight(inputs, out, n, eps),
        Kernel::RowSquareSum => rms_norm::row_square_sum(inputs, out),
        Kernel::RmsNormApply { n, eps } => rms_norm::apply(inputs, out, n, eps),
        Kernel::RmsNormGradSum => rms_norm::grad_sum(inputs, out),
        Kernel::RmsNormGradInput { n, eps } => rms_norm::grad_input(inputs, out, n, eps),
        Kernel::RmsNormGradWeight { n, eps } => rms_norm::grad_weight(inputs, out, n, eps),
        Kernel::SumToLast => sum_to_last(inputs, out),
        Kernel::CrossEntropyMax { offset, valid } => cross_entropy_max(inputs, out, Vocab::new(offset, valid, ctx)),
        Kernel::CrossEntropyStats { offset, valid } => cross_entropy_stats(inputs, out, Vocab::new(offset, valid, ctx)),
        Kernel::CrossEntropyCount => cross_entropy_count(inputs, out),
        Kernel::CrossEntropyLoss => cross_entropy_loss(inputs, out),
        Kernel::CrossEntropyGrad { offset, valid } => cross_entropy_grad(inputs, out, Vocab::new(offset, valid, ctx)),
        Kernel::Fill { value } => fill(inputs, out, value),
        // The backend widens a bf16 input and rounds into a bf16 output, so a cast copies f32 to f32.
        Kernel::Cast => map_unary(inputs, out, |x| x),
        Kernel::SliceShard { axis, placement } => slice_shard(inputs, out, ctx, axis.into(), placement),
        Kernel::GradSquareSum => grad_square_sum(inputs, out, ctx),
        Kernel::OptimizerStep => Err(KernelError::Unsupported {
            kernel: "the optimizer step",
            why: "is applied by `optimizer_step`, not `run`",
        }),
    }
}

// ---- helpers ---------------------------------------------------------------------------------------

/// Exactly `N` inputs.
fn args<'t, 'v, const N: usize>(inputs: &[&'t View<'v>]) -> Result<[&'t View<'v>; N], KernelError> {
    <[&'t View<'v>; N]>::try_from(inputs).map_err(|_| ShapeError::Operands { want: N, got: inputs.len() }.into())
}

/// The f32 elements of an input, checked against its shape.
fn floats<'t>(t: &'t View, what: &str) -> Result<&'t [f32], KernelError> {
    let v = t.f32().map_err(|e| KernelError::operand(what, e))?;
    require(v.len() == numel(&t.shape), || holds(what, v.len(), &t.shape))?;
    Ok(v)
}

/// An operand `what` of `len` elements whose shape is `shape`.
fn holds(what: &str, len: usize, shape: &[u64]) -> KernelError {
    KernelError::Holds { what: what.to_string(), len, shape: shape.to_vec() }
}

/// The i32 elements of an input, checked against its shape.
fn ints<'t>(t: &'t View, what: &str) -> Result<&'t [i32], KernelError> {
    let v = t.i32().map_err(|e| KernelError::operand(what, e))?;
    require(v.len() == numel(&t.shape), || holds(what, v.len(), &t.shape))?;
    Ok(v)
}

/// The f32 elements of the output, checked against its shape.
fn floats_mut<'t>(t: &'t mut ViewMut) -> Result<&'t mut [f32], KernelError> {
    let n = numel(&t.shape);
    let v = t.f32_mut().map_err(|e| KernelError::operand("output", e))?;
    require(v.len() == n, || KernelError::HoldsCount { what: "the output".into(), len: v.len(), want: n })?;
    Ok(v)
}

/// Rows of `n` elements (none when `n == 0`).
fn rows_of(v: &[f32], n: usize) -> std::slice::ChunksExact<'_, f32> {
    v.chunks_exact(n.max(1))
}

fn rows_of_mut(v: &mut [f32], n: usize) -> std::slice::ChunksExactMut<'_, f32> {
    v.chunks_exact_mut(n.max(1))
}

/// Sum of `f(x)` with eight independent lanes (vectorisable, and more accurate than one accumulator).
fn sum_by(v: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += f(x);
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|&x| f(x)).sum();
    acc.iter().sum::<f32>() + tail
}

/// Sum of `f(a, b)` over two equally long slices, with eight lanes.
fn sum_by2(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let (mut ca, mut cb) = (a.chunks_exact(8), b.chunks_exact(8));
    for (x, y) in (&mut ca).zip(&mut cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += f(x, y);
        }
    }
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(&x, &y)| f(x, y)).sum();
    acc.iter().sum::<f32>() + tail
}

fn max_of(v: &[f32]) -> f32 {
    vmath::max_ignoring_nan(v)
}

// ---- matrix products ------------------------------------------------------------------------------

/// Products with at least this many multiply-adds are split over the kernel pool; smaller ones run
/// whole on one worker.
const PARALLEL_WORK: usize = 1 << 22;

/// dst (+)= alpha * lhs * rhs in faer: attention's small per-head products, which run on whichever
/// pool worker takes them and so must not depend on a thread's choice of library.
fn gemm(
    dst: MatMut<'_, f32>,
    lhs: MatRef<'_, f32>,
    rhs: MatRef<'_, f32>,
    accumulate: bool,
    alpha: f32,
) -> Result<(), KernelError> {
    gemm_by(Products::Faer, dst, lhs, rhs, (accumulate, alpha))
}

/// dst (+)= alpha * lhs * rhs in `blas`'s library, after checking the dimensions (faer panics
/// on a mismatch). Product kernels read `blas` on the thread that starts them.
fn gemm_by(
    blas: Products,
    dst: MatMut<'_, f32>,
    lhs: MatRef<'_, f32>,
    rhs: MatRef<'_, f32>,
    (accumulate, alpha): (bool, f32),
) -> Result<(), KernelError> {
    require(dst.nrows() == lhs.nrows() && dst.ncols() == rhs.ncols() && lhs.ncols() == rhs.nrows(), || {
        KernelError::Product {
            lhs: [lhs.nrows(), lhs.ncols()],
            rhs: [rhs.nrows(), rhs.ncols()],
            out: [dst.nrows(), dst.ncols()],
        }
    })?;
    let mut dst = dst;
    if lhs.ncols() == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return Ok(());
    }
    // A thread that runs its kernels inline would do the parts one after another: each would pack the
    // shared operand again for nothing (the results are the same bits either way).
    let work = dst.nrows() * dst.ncols() * lhs.ncols();
    let parts = if work >= PARALLEL_WORK && !par::runs_inline() { par::threads() } else { 1 };
    split_product(blas, dst, lhs, rhs, (accumulate, alpha), parts);
    Ok(())
}

/// Output rows (or columns) per part are a multiple of this, to keep faer's kernels on full tiles.
const SPLIT_ALIGN: usize = 16;

/// dst (+)= alpha * lhs * rhs over `parts` workers: the output is split into `parts` blocks of rows
/// (or of columns, when it is wider than tall), each a sequential product ([`Products::product`]). Measured on this
/// project's shapes, this beats faer's own parallel product, which splits the inner dimension too.
fn split_product(
    blas: Products,
    dst: MatMut<'_, f32>,
    lhs: MatRef<'_, f32>,
    rhs: MatRef<'_, f32>,
    scale: (bool, f32),
    parts: usize,
) {
    let (m, n) = (dst.nrows(), dst.ncols());
    let left = parts / 2;
    let cut = |len: usize| (len * left / parts.max(1)).div_ceil(SPLIT_ALIGN) * SPLIT_ALIGN;
    if parts <= 1 || (m < 2 * SPLIT_ALIGN && n < 2 * SPLIT_ALIGN) {
        blas.product(dst, lhs, rhs, scale.0, scale.1);
    } else if m >= n {
        let at = cut(m).min(m);
        let ((d0, d1), (l0, l1)) = (dst.split_at_row_mut(at), lhs.split_at_row(at));
        par::join(
            || split_product(blas, d0, l0, rhs, scale, left),
            || split_product(blas, d1, l1, rhs, scale, parts - left),
        );
    } else {
        let at = cut(n).min(n);
        let ((d0, d1), (r0, r1)) = (dst.split_at_col_mut(at), rhs.split_at_col(at));
        par::join(
            || split_product(blas, d0, lhs, r0, scale, left),
            || split_product(blas, d1, lhs, r1, scale, parts - left),
        );
    }
}

fn check_view(len: usize, start: usize, rows: usize, cols: usize, stride: usize) -> Result<(), KernelError> {
    let fits =
        if rows == 0 || cols == 0 { start <= len } else { stride >= cols && start + (rows - 1) * stride + cols <= len };
    require(fits, || KernelError::BlockOutside { rows, cols, stride, start, len })
}

/// A row-major `rows x cols` view starting at `start` whose rows are `stride` apart.
fn view(data: &[f32], start: usize, rows: usize, cols: usize, stride: usize) -> Result<MatRef<'_, f32>, KernelError> {
    check_view(data.len(), start, rows, cols, stride)?;
    Ok(MatRef::from_row_major_slice_with_stride(&data[start..], rows, cols, stride))
}

fn view_mut(
    data: &mut [f32],
    start: usize,
    rows: usize,
    cols: usize,
    stride: usize,
) -> Result<MatMut<'_, f32>, KernelError> {
    check_view(data.len(), start, rows, cols, stride)?;
    // Not `from_row_major_slice_with_stride_mut`: in faer 0.24 it builds a column-major view.
    Ok(MatMut::from_column_major_slice_with_stride_mut(&mut data[start..], cols, rows, stride).transpose_mut())
}

fn matmul_kernel(inputs: &[&View], out: &mut ViewMut, ta: bool, tb: bool, accumulate: bool) -> Result<(), KernelError> {
    let [a, b] = args(inputs)?;
    let ((ar, ac), (br, bc)) = (split_last(&a.shape), split_last(&b.shape));
    let (av, bv) = (floats(a, "A")?, floats(b, "B")?);
    let (m, n) = split_last(&out.shape);
    let y = floats_mut(out)?;
    let a = MatRef::from_row_major_slice(av, ar, ac);
    let b = MatRef::from_row_major_slice(bv, br, bc);
    let a = if ta { a.transpose() } else { a };
    let b = if tb { b.transpose() } else { b };
    gemm_by(blas::for_this_thread(), MatMut::from_row_major_slice_mut(y, m, n), a, b, (accumulate, 1.0))
}

fn batched_matmul(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [a, b] = args(inputs)?;
    let (_, m, k, n) = batched_product(&a.shape, &b.shape, &out.shape)?;
    let (av, bv) = (floats(a, "A")?, floats(b, "B")?);
    let y = floats_mut(out)?;
    let blas = blas::for_this_thread();
    par::costed_row_blocks(y, m * n, m * n * k, |first, y| {
        for (t, y) in rows_of_mut(y, m * n).enumerate().map(|(t, y)| (first + t, y)) {
            let lhs = view(av, t * m * k, m, k, k)?;
            let rhs = view(bv, t * k * n, k, n, n)?;
            gemm_by(blas, view_mut(y, 0, m, n, n)?, lhs, rhs, (false, 1.0))?;
        }
        Ok(())
    })
}

// ---- elementwise ----------------------------------------------------------------------------------

fn map_unary(inputs: &[&View], out: &mut ViewMut, f: impl Fn(f32) -> f32 + Sync) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    let x = floats(x, "the input")?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), x.len())?;
    par::chunks(y, |start, y| {
        vectorized(
            #[inline(always)]
            || {
                for (y, &x) in y.iter_mut().zip(&x[start..]) {
                    *y = f(x);
                }
            },
        );
        Ok::<(), KernelError>(())
    })
}

fn map_binary(inputs: &[&View], out: &mut ViewMut, f: impl Fn(f32, f32) -> f32 + Sync) -> Result<(), KernelError> {
    let [a, b] = args(inputs)?;
    let (a, b) = (floats(a, "the first input")?, floats(b, "the second input")?);
    same_len("the second input", b.len(), a.len())?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), a.len())?;
    par::chunks(y, |start, y| {
        vectorized(
            #[inline(always)]
            || {
                for ((y, &a), &b) in y.iter_mut().zip(&a[start..]).zip(&b[start..]) {
                    *y = f(a, b);
                }
            },
        );
        Ok::<(), KernelError>(())
    })
}

fn bias_add(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [x, b] = args(inputs)?;
    let (_, n) = split_last(&x.shape);
    let (xv, bv) = (floats(x, "x")?, floats(b, "the bias")?);
    same_len("the bias", bv.len(), n)?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), xv.len())?;
    par::row_blocks(y, n, |first, y| {
        vectorized(
            #[inline(always)]
            || {
                for (yr, xr) in rows_of_mut(y, n).zip(rows_of(&xv[first * n..], n)) {
                    for ((y, &x), &b) in yr.iter_mut().zip(xr).zip(bv) {
                        *y = x + b;
                    }
                }
            },
        );
        Ok::<(), KernelError>(())
    })
}

/// sqrt(2 / pi).
const SQRT_2_OVER_PI: f32 = std::f32::consts::FRAC_2_SQRT_PI * std::f32::consts::FRAC_1_SQRT_2;
/// 1 / sqrt(2 pi).
const INV_SQRT_2PI: f32 = 0.5 * std::f32::consts::FRAC_2_SQRT_PI * std::f32::consts::FRAC_1_SQRT_2;
const GELU_CUBIC: f32 = 0.044_715;

/// sigmoid(2u) for the tanh approximation's u = sqrt(2/pi) (x + 0.044715 x^3): 0.5 (1 + tanh u) = sigmoid(2u).
/// The gate is 1 / (1 + e^a) with this exponent a = -2u.
#[inline(always)]
fn gelu_gate_exponent(x: f32) -> f32 {
    -2.0 * SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)
}

/// The gate from e^a.
#[inline(always)]
fn gelu_gate_from(exp_a: f32) -> f32 {
    1.0 / (1.0 + exp_a)
}

/// The tanh approximation (Hugging Face `gelu_new`), 0.5 x (1 + tanh u), computed as x sigmoid(2u): one
/// exp, and no cancellation or overflow at either tail.
#[inline(always)]
fn gelu_tanh_from(x: f32, exp_a: f32) -> f32 {
    x * gelu_gate_from(exp_a)
}

/// d/dx of x sigmoid(2u) = s + 2 x s (1 - s) u'.
#[inline(always)]
fn gelu_tanh_grad_from(x: f32, exp_a: f32) -> f32 {
    let s = gelu_gate_from(exp_a);
    s + 2.0 * x * s * (1.0 - s) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x * x)
}

fn gelu_tanh_kernel(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    let x = floats(x, "the input")?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), x.len())?;
    par::chunks(y, |start, y| {
        let x = &x[start..start + y.len()];
        vectorized(
            #[inline(always)]
            || y.iter_mut().zip(x).for_each(|(y, &x)| *y = gelu_tanh_from(x, vmath::exp(gelu_gate_exponent(x)))),
        );
        Ok::<(), KernelError>(())
    })
}

fn gelu_tanh_grad_kernel(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [dy, x] = args(inputs)?;
    let (dy, x) = (floats(dy, "dy")?, floats(x, "x")?);
    same_len("x", x.len(), dy.len())?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), dy.len())?;
    par::chunks(y, |start, y| {
        let (dy, x) = (&dy[start..start + y.len()], &x[start..start + y.len()]);
        vectorized(
            #[inline(always)]
            || {
                for ((y, &dy), &x) in y.iter_mut().zip(dy).zip(x) {
                    *y = dy * gelu_tanh_grad_from(x, vmath::exp(gelu_gate_exponent(x)));
                }
            },
        );
        Ok::<(), KernelError>(())
    })
}

/// SiLU, x * sigmoid(x), as torch.nn.functional.silu.
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// d silu / dx = s + x s (1 - s), s = sigmoid(x).
fn silu_grad(x: f32) -> f32 {
    let s = 1.0 / (1.0 + (-x).exp());
    s + x * s * (1.0 - s)
}

/// The exact GELU, x * Phi(x).
fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

fn gelu_erf_grad(x: f32) -> f32 {
    let cdf = 0.5 * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2));
    cdf + x * INV_SQRT_2PI * (-0.5 * x * x).exp()
}

/// Max-subtracted softmax of a row, in place.
/// Max-subtracted softmax of a row, in place.
fn softmax_in_place(row: &mut [f32]) {
    vmath::softmax_row(row);
}

fn softmax(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    let (_, n) = split_last(&x.shape);
    let xv = floats(x, "the input")?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), xv.len())?;
    par::row_blocks(y, n, |first, y| {
        y.copy_from_slice(&xv[first * n..first * n + y.len()]);
        rows_of_mut(y, n).for_each(softmax_in_place);
        Ok::<(), KernelError>(())
    })
}

fn softmax_grad(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [dy, y] = args(inputs)?;
    let (_, n) = split_last(&y.shape);
    let (dyv, yv) = (floats(dy, "dy")?, floats(y, "y")?);
    same_len("dy", dyv.len(), yv.len())?;
    let dx = floats_mut(out)?;
    same_len("the output", dx.len(), yv.len())?;
    par::row_blocks(dx, n, |first, dx| {
        let (dyv, yv) = (&dyv[first * n..], &yv[first * n..]);
        for ((dxr, dyr), yr) in rows_of_mut(dx, n).zip(rows_of(dyv, n)).zip(rows_of(yv, n)) {
            let dot = sum_by2(dyr, yr, |a, b| a * b);
            for ((dx, &dy), &y) in dxr.iter_mut().zip(dyr).zip(yr) {
                *dx = y * (dy - dot);
            }
        }
        Ok::<(), KernelError>(())
    })
}

/// Copies x, replacing entries above the diagonal of each trailing matrix by `fill`.
fn causal_mask(inputs: &[&View], out: &mut ViewMut, fill: f32) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    let (_, rows, cols) = batch_matrix(&x.shape, "the input")?;
    let xv = floats(x, "the input")?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), xv.len())?;
    par::row_blocks(y, rows * cols, |first, y| {
        let xv = &xv[first * rows * cols..];
        for (ym, xm) in rows_of_mut(y, rows * cols).zip(rows_of(xv, rows * cols)) {
            for (r, (yr, xr)) in rows_of_mut(ym, cols).zip(rows_of(xm, cols)).enumerate() {
                let keep = (r + 1).min(cols);
                yr[..keep].copy_from_slice(&xr[..keep]);
                yr[keep..].fill(fill);
            }
        }
        Ok::<(), KernelError>(())
    })
}

// ---- dropout and logical indices ------------------------------------------------------------------

/// Dropout and its gradient: the mask depends only on (seed, key, logical index).
fn dropout(inputs: &[&View], out: &mut ViewMut, ctx: &KernelContext, p: f64, key: u32) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    let xv = floats(x, "the input")?;
    require((0.0..=1.0).contains(&p), || KernelError::DropProbability(p))?;
    same_shape("the output", &out.shape, &ctx.output.shape)?;
    let y = floats_mut(out)?;
    dropout_rows(xv, y, ctx, (p, key), 0)
}

/// Dropout (or its gradient) on whole rows of the output `ctx.output` describes, from row `first_row`
/// on (rows run over every dimension but the last): `xv` and `y` hold those rows. Run on pieces of rows
/// with their first row, it gives what it gives on the whole tensor (the mask depends only on the
/// logical index of each element).
pub fn dropout_rows(
    xv: &[f32],
    y: &mut [f32],
    ctx: &KernelContext,
    (p, key): (f64, u32),
    first_row: usize,
) -> Result<(), KernelError> {
    require((0.0..=1.0).contains(&p), || KernelError::DropProbability(p))?;
    same_len("the output", y.len(), xv.len())?;
    if p == 0.0 {
        return par::chunks(y, |start, y| {
            y.copy_from_slice(&xv[start..start + y.len()]);
            Ok::<(), KernelError>(())
        });
    }
    if p >= 1.0 {
        y.fill(0.0);
        return Ok(());
    }
    let mask = DropoutMask::new(ctx.seed, key, p);
    let scale = (1.0 / (1.0 - p)) as f32;
    let map = IndexMap::new(ctx.output, ctx.coords, ctx.mesh).map_err(|e| KernelError::Layout(e.to_string()))?;
    let Some((last, last_stride)) = map.last_dimension() else {
        require(first_row == 0, || {
            KernelError::Invalid("a dropout without dimensions cannot start past its first row".into())
        })?;
        map.for_each(|local, logical| y[local] = if mask.keep(logical) { xv[local] * scale } else { 0.0 });
        return Ok(());
    };
    par::row_blocks(y, last.len(), |first, y| {
        for (r, row) in rows_of_mut(y, last.len()).enumerate() {
            let (base, start) = (map.row_base(first_row + first + r), (first + r) * last.len());
            for ((y, &x), &m) in row.iter_mut().zip(&xv[start..]).zip(last) {
                *y = if mask.keep(base + m * last_stride) { x * scale } else { 0.0 };
            }
        }
        Ok::<(), KernelError>(())
    })
}

// ---- data movement --------------------------------------------------------------------------------

/// Applies `runs` from `x` to `out` for either element type (both must match).
fn move_runs(x: &View, out: &mut ViewMut, runs: Runs) -> Result<(), KernelError> {
    let (src_n, dst_n) = (numel(&x.shape), numel(&out.shape));
    match (&x.data, &mut out.data) {
        (ViewData::F32(s), ViewMutData::F32(d)) if s.len() == src_n && d.len() == dst_n => Ok(runs.apply(s, d)?),
        (ViewData::I32(s), ViewMutData::I32(d)) if s.len() == src_n && d.len() == dst_n => Ok(runs.apply(s, d)?),
        (ViewData::Bf16(s), ViewMutData::Bf16(d)) if s.len() == src_n && d.len() == dst_n => Ok(runs.apply(s, d)?),
        (ViewData::F32(_), ViewMutData::F32(_))
        | (ViewData::I32(_), ViewMutData::I32(_))
        | (ViewData::Bf16(_), ViewMutData::Bf16(_)) => Err(KernelError::CountNotShape),
        _ => Err(KernelError::ElementTypesDiffer),
    }
}

fn reshape(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    move_runs(x, out, reshape_runs(&x.shape, &out.shape)?)
}

fn select(inputs: &[&View], out: &mut ViewMut, dim: usize, index: u64) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    move_runs(x, out, select_runs(&x.shape, &out.shape, dim, index)?)
}

fn select_grad(inputs: &[&View], out: &mut ViewMut, dim: usize, index: u64) -> Result<(), KernelError> {
    let [dy] = args(inputs)?;
    move_runs(dy, out, select_grad_runs(&dy.shape, &out.shape, dim, index)?)
}

fn transpose(inputs: &[&View], out: &mut ViewMut, dim0: usize, dim1: usize) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    let swap = transpose_swap(&x.shape, &out.shape, dim0, dim1)?;
    let n = numel(&x.shape);
    match (&x.data, &mut out.data) {
        (ViewData::F32(src), ViewMutData::F32(dst)) if src.len() == n && dst.len() == n => swap.apply(src, dst),
        (ViewData::I32(src), ViewMutData::I32(dst)) if src.len() == n && dst.len() == n => swap.apply(src, dst),
        (ViewData::Bf16(src), ViewMutData::Bf16(dst)) if src.len() == n && dst.len() == n => swap.apply(src, dst),
        _ => return Err(KernelError::TransposeOperands),
    }
    Ok(())
}

/// The input holds the whole extent of the placement's dimension; the output this device's block.
fn slice_shard(
    inputs: &[&View],
    out: &mut ViewMut,
    ctx: &KernelContext,
    axis: usize,
    p: Placement,
) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    move_runs(x, out, slice_shard_runs(&x.shape, &out.shape, ctx.mesh, ctx.coords, axis, p)?)
}

fn fill(inputs: &[&View], out: &mut ViewMut, value: f64) -> Result<(), KernelError> {
    args::<0>(inputs)?;
    match &mut out.data {
        ViewMutData::F32(v) => v.fill(value as f32),
        ViewMutData::I32(v) => v.fill(value as i32),
        ViewMutData::Bf16(v) => v.fill(crate::bf16::round(value as f32)),
    }
    Ok(())
}

// ---- rotary position embedding --------------------------------------------------------------------

/// Which way rotary turns each pair: by +angle (the embedding) or -angle (its backward, the transpose).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rotation {
    Forward,
    Backward,
}

/// x [.., seq, heads * d] -> each head's halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin),
/// the angle of row r being (r mod seq) * inv_freq (Hugging Face Llama's `rotate_half`). Backward
/// turns the other way: (dy1 cos + dy2 sin, dy2 cos - dy1 sin).
fn rotary(inputs: &[&View], out: &mut ViewMut, heads: u64, theta: f64, rotation: Rotation) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    rotate(x, out, heads, rotation, |seq, d| Ok(optimus_plan::rotary::Table::new(seq, d, theta)?))
}

/// [`rotary`] of x with the angles of `table(seq, d)`: row r of each sequence turns by the table's row
/// r mod seq (positions 0..seq for [`Kernel::Rotary`], a decoding step's positions for
/// [`Kernel::RotaryAt`]).
fn rotate(
    x: &View,
    out: &mut ViewMut,
    heads: u64,
    rotation: Rotation,
    table: impl FnOnce(usize, usize) -> Result<optimus_plan::rotary::Table, KernelError>,
) -> Result<(), KernelError> {
    same_shape("the output", &out.shape, &x.shape)?;
    let (_, seq, width) = batch_matrix(&x.shape, "x")?;
    let d = optimus_plan::rotary::head_size(width, heads)?;
    let table = table(seq, d)?;
    require(table.cos.len() == seq * table.half && table.sin.len() == table.cos.len(), || {
        KernelError::Internal(format!("a rotary table of {} angles for {seq} rows", table.cos.len()))
    })?;
    let sign = if rotation == Rotation::Forward { 1.0f32 } else { -1.0 };
    let xv = floats(x, "x")?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), xv.len())?;
    par::row_blocks(y, width, |first, y| {
        for (k, (yr, xr)) in y.chunks_exact_mut(width).zip(xv[first * width..].chunks_exact(width)).enumerate() {
            let (cos, sin) = table.at((first + k) % seq.max(1));
            for (yh, xh) in yr.chunks_exact_mut(d).zip(xr.chunks_exact(d)) {
                let (y1, y2) = yh.split_at_mut(d / 2);
                let (x1, x2) = xh.split_at(d / 2);
                for i in 0..d / 2 {
                    let (c, s) = (cos[i], sign * sin[i]);
                    y1[i] = x1[i] * c - x2[i] * s;
                    y2[i] = x2[i] * c + x1[i] * s;
                }
            }
        }
        Ok::<(), KernelError>(())
    })
}

// ---- attention ------------------------------------------------------------------------------------

/// The operands of an attention (fused or not) in this backend's storage.
type Qkv<'a> = crate::qkv::Qkv<'a, [f32]>;

impl<'a> Qkv<'a> {
    fn of(operands: &[&'a View], heads: (u64, u64), fused: bool) -> Result<Qkv<'a>, KernelError> {
        Qkv::new(operands, |t| t.shape.as_slice(), floats, heads, fused)
    }

    /// Rows [start, start + rows) of the [seq, d] block of `operand` for batch b that query head h
    /// reads (its kv head for k and v).
    fn rows(
        &self,
        operand: usize,
        b: usize,
        h: usize,
        start: usize,
        rows: usize,
    ) -> Result<MatRef<'a, f32>, KernelError> {
        let p = self.packing[operand];
        view(self.data[operand], p.start(b, self.head_of(operand, h), self.d) + start * p.row, rows, self.d, p.row)
    }

    /// Rows [start, start + rows) of the [seq, d] block query head h touches (its kv head for k and v)
    /// in one batch's part of a gradient laid out like `operand` (the packed gradient of a fused
    /// input, or the operand's own gradient).
    fn grad_rows<'g>(
        &self,
        g: &'g mut [f32],
        operand: usize,
        h: usize,
        start: usize,
        rows: usize,
    ) -> Result<MatMut<'g, f32>, KernelError> {
        let p = self.packing[operand];
        view_mut(g, p.start(0, self.head_of(operand, h), self.d) + start * p.row, rows, self.d, p.row)
    }

    /// The query tiles of one head: [`QUERY_TILE`] rows at a time, each with the keys it can see.
    fn tiles(&self, causal: bool) -> impl Iterator<Item = Tile> + use<> {
        let (sq, sk) = (self.seq(0), self.seq(1));
        (0..sq).step_by(QUERY_TILE).map(move |start| {
            let rows = QUERY_TILE.min(sq - start);
            Tile { start, rows, keys: if causal { (start + rows).min(sk) } else { sk } }
        })
    }

    /// The softmax(q k^T / sqrt(d)) probabilities of one tile of batch b, head h, into `probs`
    /// ([rows, keys]); entries a causal row cannot see are 0.
    fn probabilities(
        &self,
        b: usize,
        h: usize,
        causal: bool,
        tile: Tile,
        probs: &mut [f32],
    ) -> Result<(), KernelError> {
        let Tile { start, rows, keys } = tile;
        let probs = probs.get_mut(..rows * keys).ok_or(KernelError::AttentionScratch)?;
        let dst = view_mut(probs, 0, rows, keys, keys)?;
        gemm(dst, self.rows(0, b, h, start, rows)?, self.rows(1, b, h, 0, keys)?.transpose(), false, self.scale())?;
        for (r, row) in rows_of_mut(probs, keys).enumerate() {
            let live = if causal { (start + r + 1).min(keys) } else { keys };
            let (live, masked) = row.split_at_mut(live);
            softmax_in_place(live);
            masked.fill(0.0);
        }
        Ok(())
    }
}

/// Query rows [start, start + rows) of one head and how many keys they see.
#[derive(Clone, Copy, Debug)]
struct Tile {
    start: usize,
    rows: usize,
    keys: usize,
}

/// A zeroed [rows, cols] scratch matrix, or an error when it cannot be allocated.
fn scratch(rows: usize, cols: usize) -> Result<Vec<f32>, KernelError> {
    let n = rows.checked_mul(cols).ok_or(KernelError::ScratchTooLarge { rows, cols })?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| KernelError::ScratchAllocation { rows, cols })?;
    v.resize(n, 0.0f32);
    Ok(v)
}

/// Each batch's attention is independent: batches run in parallel, each with its own scratch (one
/// tile of scores), and write their own rows of the output.
fn attention(
    inputs: &[&View],
    out: &mut ViewMut,
    heads: (u64, u64),
    causal: bool,
    fused: bool,
) -> Result<(), KernelError> {
    let qkv = Qkv::of(inputs, heads, fused)?;
    same_shape("the output", &out.shape, &qkv.out_shape())?;
    let (sq, sk, d, width) = (qkv.seq(0), qkv.seq(1), qkv.d, qkv.heads * qkv.d);
    let y = floats_mut(out)?;
    let out_pack = qkv.out_packing();
    par::costed_row_blocks(y, sq * width, sq * sk * width, |first, y| {
        let mut probs = scratch(QUERY_TILE.min(sq), sk)?;
        for (k, y) in rows_of_mut(y, sq * width).enumerate() {
            let b = first + k;
            for h in 0..qkv.heads {
                for tile in qkv.tiles(causal) {
                    qkv.probabilities(b, h, causal, tile, &mut probs)?;
                    let p = view(&probs, 0, tile.rows, tile.keys, tile.keys)?;
                    let dst = view_mut(y, out_pack.start(0, h, d) + tile.start * width, tile.rows, d, width)?;
                    gemm(dst, p, qkv.rows(2, b, h, 0, tile.keys)?, false, 1.0)?;
                }
            }
        }
        Ok(())
    })
}

/// (dy, operands..) -> the gradient of operand `wrt` (all three, packed, when fused).
fn attention_grad(
    inputs: &[&View],
    out: &mut ViewMut,
    heads: (u64, u64),
    causal: bool,
    fused: bool,
    wrt: u8,
) -> Result<(), KernelError> {
    let (dy, operands) = inputs.split_first().ok_or(KernelError::NoAttentionGradient)?;
    let qkv = Qkv::of(operands, heads, fused)?;
    let wrt = usize::from(wrt);
    require(wrt < if fused { 1 } else { 3 }, || KernelError::NoOperand(wrt))?;
    let want = |operand: usize| fused || operand == wrt;
    let out_shape = qkv.shapes[wrt];
    same_shape("dy", &dy.shape, &qkv.out_shape())?;
    same_shape("the output", &out.shape, out_shape)?;
    let dyv = floats(dy, "dy")?;
    let g = floats_mut(out)?;
    let (sq, sk, width) = (qkv.seq(0), qkv.seq(1), qkv.heads * qkv.d);
    let grad_pack = qkv.packing[wrt];
    let per_batch = grad_pack.seq * grad_pack.row;
    par::costed_row_blocks(g, per_batch, sq * sk * width, |first, g| {
        let mut probs = scratch(QUERY_TILE.min(sq), sk)?;
        let mut dprobs = if want(0) || want(1) { scratch(QUERY_TILE.min(sq), sk)? } else { Vec::new() };
        for (k, g) in rows_of_mut(g, per_batch).enumerate() {
            for h in 0..qkv.heads {
                let head = AttentionHead { qkv: &qkv, b: first + k, h, causal };
                head.gradient(dyv, g, &want, &mut probs, &mut dprobs)?;
            }
        }
        Ok(())
    })
}

/// One head of one batch of an attention's backward pass.
struct AttentionHead<'q, 'a> {
    qkv: &'q Qkv<'a>,
    b: usize,
    h: usize,
    causal: bool,
}

impl AttentionHead<'_, '_> {
    /// Writes this head's part of the wanted gradients into `g` (this batch's part of the output),
    /// tile by tile, recomputing each tile's probabilities into `probs`. dK and dV sum over tiles and
    /// over the query heads that share a kv head: the first head of each group (heads run in order)
    /// zeroes them.
    fn gradient(
        &self,
        dyv: &[f32],
        g: &mut [f32],
        want: &impl Fn(usize) -> bool,
        probs: &mut [f32],
        dprobs: &mut [f32],
    ) -> Result<(), KernelError> {
        let (qkv, h) = (self.qkv, self.h);
        let first_of_group = h.is_multiple_of(qkv.group().max(1));
        for operand in [1, 2].into_iter().filter(|&o| want(o) && first_of_group) {
            qkv.grad_rows(g, operand, h, 0, qkv.seq(1))?.fill(0.0);
        }
        for tile in qkv.tiles(self.causal) {
            self.tile_gradient(tile, dyv, g, want, probs, dprobs)?;
        }
        Ok(())
    }

    fn tile_gradient(
        &self,
        tile: Tile,
        dyv: &[f32],
        g: &mut [f32],
        want: &impl Fn(usize) -> bool,
        probs: &mut [f32],
        dprobs: &mut [f32],
    ) -> Result<(), KernelError> {
        let (qkv, b, h) = (self.qkv, self.b, self.h);
        let Tile { start, rows, keys } = tile;
        let (d, width, scale) = (qkv.d, qkv.heads * qkv.d, qkv.scale());
        qkv.probabilities(b, h, self.causal, tile, probs)?;
        let p = view(probs, 0, rows, keys, keys)?;
        let dout = view(dyv, qkv.out_packing().start(b, h, d) + start * width, rows, d, width)?;
        if want(2) {
            gemm(qkv.grad_rows(g, 2, h, 0, keys)?, p.transpose(), dout, true, 1.0)?;
        }
        if !(want(0) || want(1)) {
            return Ok(());
        }
        // dS = P * (dP - rowsum(dP * P)), with dP = dO V^T; masked entries have P = 0.
        let dprobs = dprobs.get_mut(..rows * keys).ok_or(KernelError::AttentionScratch)?;
        gemm(view_mut(dprobs, 0, rows, keys, keys)?, dout, qkv.rows(2, b, h, 0, keys)?.transpose(), false, 1.0)?;
        for (dpr, pr) in rows_of_mut(dprobs, keys).zip(rows_of(&probs[..rows * keys], keys)) {
            let dot = sum_by2(dpr, pr, |a, b| a * b);
            for (dp, &p) in dpr.iter_mut().zip(pr) {
                *dp = p * (*dp - dot);
            }
        }
        let ds = view(dprobs, 0, rows, keys, keys)?;
        if want(0) {
            gemm(qkv.grad_rows(g, 0, h, start, rows)?, ds, qkv.rows(1, b, h, 0, keys)?, false, scale)?;
        }
        if want(1) {
            gemm(qkv.grad_rows(g, 1, h, 0, keys)?, ds.transpose(), qkv.rows(0, b, h, start, rows)?, true, scale)?;
        }
        Ok(())
    }
}

// ---- embeddings -----------------------------------------------------------------------------------

/// The table row of `id` on a device whose rows start at `base`, if it holds it.
fn local_row(id: i32, base: u64, rows: usize) -> Option<usize> {
    let row = i64::from(id) - i64::try_from(base).ok()?;
    usize::try_from(row).ok().filter(|&r| r < rows)
}

fn table_dims(t: &View, what: &str) -> Result<(usize, usize), KernelError> {
    match t.shape[..] {
        [rows, w] => Ok((rows as usize, w as usize)),
        _ => Err(KernelError::NotTable { what: what.to_string(), shape: t.shape.to_vec() }),
    }
}

fn embedding_lookup(inputs: &[&View], out: &mut ViewMut, base: u64, masked: bool) -> Result<(), KernelError> {
    let [ids, table] = args(inputs)?;
    let (rows, w) = table_dims(table, "the table")?;
    let idv = ints(ids, "the ids")?;
    let mut want = ids.shape.to_vec();
    want.push(w as u64);
    same_shape("the output", &out.shape, &want)?;
    let at = (rows, w, base, masked);
    match (table.data, &mut out.data) {
        (ViewData::F32(t), ViewMutData::F32(y)) => lookup_rows(idv, t, y, at),
        // bf16 rows are moved as they are (widening and rounding back would give the same bits).
        (ViewData::Bf16(t), ViewMutData::Bf16(y)) => lookup_rows(idv, t, y, at),
        _ => Err(KernelError::TableAndOutput),
    }
}

/// Copies table row `id - base` (of `rows` rows of `w`) into each output row, zeros for ids outside
/// this device's rows when `masked`.
fn lookup_rows<T: Copy + Default>(
    idv: &[i32],
    tv: &[T],
    y: &mut [T],
    (rows, w, base, masked): (usize, usize, u64, bool),
) -> Result<(), KernelError> {
    same_len("the table", tv.len(), rows * w)?;
    for (dst, &id) in y.chunks_exact_mut(w.max(1)).zip(idv) {
        match local_row(id, base, rows) {
            Some(r) => dst.copy_from_slice(&tv[r * w..(r + 1) * w]),
            None if masked => dst.fill(T::default()),
            None => return Err(KernelError::TokenOutsideRows { id, base, rows }),
        }
    }
    Ok(())
}

/// The rows of the padding id (`padding`, a global id) get nothing.
fn embedding_grad(
    inputs: &[&View],
    out: &mut ViewMut,
    (base, masked): (u64, bool),
    padding: Option<u64>,
) -> Result<(), KernelError> {
    let [ids, dy] = args(inputs)?;
    let (rows, w) = table_dims(&out.as_view(), "the output")?;
    let (idv, dyv) = (ints(ids, "the ids")?, floats(dy, "dy")?);
    let mut want = ids.shape.to_vec();
    want.push(w as u64);
    same_shape("dy", &dy.shape, &want)?;
    let g = floats_mut(out)?;
    g.fill(0.0);
    for (src, &id) in rows_of(dyv, w).zip(idv) {
        if is_padding(id, padding) {
            continue;
        }
        match local_row(id, base, rows) {
            Some(r) => {
                for (g, &d) in g[r * w..(r + 1) * w].iter_mut().zip(src) {
                    *g += d;
                }
            }
            None if masked => {}
            None => return Err(KernelError::TokenOutsideRows { id, base, rows }),
        }
    }
    Ok(())
}

/// Whether token `id` is the padding id, whose embedding row gets no gradient.
pub fn is_padding(id: i32, padding: Option<u64>) -> bool {
    padding.is_some_and(|p| u64::try_from(id).is_ok_and(|id| id == p))
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

fn position_lookup(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [table] = args(inputs)?;
    position_rows(table, out, 0)
}

/// out[.., p, :] = table[start + p, :] for p < seq (f32 or bf16 rows, moved as they are).
fn position_rows(table: &View, out: &mut ViewMut, start: usize) -> Result<(), KernelError> {
    let (s, w) = position_dims(&table.shape, &out.shape, "the output")?;
    fn repeat<T: Copy>(tv: &[T], y: &mut [T], (start, n): (usize, usize)) -> Result<(), KernelError> {
        let rows = start.checked_add(n).and_then(|end| tv.get(start..end));
        let rows = rows.ok_or_else(|| KernelError::Invalid("the table is smaller than its shape".into()))?;
        for block in y.chunks_exact_mut(n.max(1)) {
            block.copy_from_slice(rows);
        }
        Ok(())
    }
    let at = (start.saturating_mul(w), s * w);
    match (table.data, &mut out.data) {
        (ViewData::F32(t), ViewMutData::F32(y)) => repeat(t, y, at),
        // bf16 rows are moved as they are.
        (ViewData::Bf16(t), ViewMutData::Bf16(y)) => repeat(t, y, at),
        _ => Err(KernelError::TableAndOutput),
    }
}

fn position_grad(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [dy] = args(inputs)?;
    let (s, w) = position_dims(&out.shape, &dy.shape, "dy")?;
    let dyv = floats(dy, "dy")?;
    let g = floats_mut(out)?;
    g.fill(0.0);
    for block in rows_of(dyv, s * w) {
        for (g, &d) in g.iter_mut().zip(block) {
            *g += d;
        }
    }
    Ok(())
}

// ---- layer norm -----------------------------------------------------------------------------------

/// Per-row column statistics: `count` rows of `width` values each.
fn per_row<'t>(t: &'t View, rows: usize, width: usize, what: &str) -> Result<&'t [f32], KernelError> {
    let v = floats(t, what)?;
    same_len(what, v.len(), rows * width)?;
    Ok(v)
}

/// (mean, 1 / sqrt(var + eps)) of each row from the all-reduced sums.
fn mean_rstd(sum: &[f32], sqsum: &[f32], n: u64, eps: f64) -> Result<Vec<(f32, f32)>, KernelError> {
    require(n > 0, || KernelError::EmptyNorm)?;
    let n = n as f64;
    let stats = sum.iter().zip(sqsum).map(|(&s, &q)| {
        let (mean, var) = (f64::from(s) / n, f64::from(q) / n);
        (mean as f32, (1.0 / (var + eps).sqrt()) as f32)
    });
    Ok(stats.collect())
}

fn row_sum(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    row_sum_of(inputs, out, |v| v)
}

/// (x) -> [rows, 1]: the sum of f(v) over each row of x (RowSum with f the identity, RMSNorm's sum of
/// squares with f(v) = v^2).
pub(super) fn row_sum_of(
    inputs: &[&View],
    out: &mut ViewMut,
    f: impl Fn(f32) -> f32 + Sync,
) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    let (rows, n) = split_last(&x.shape);
    let xv = floats(x, "x")?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), rows)?;
    y.fill(0.0);
    par::costed_row_blocks(y, 1, n, |first, y| {
        for (y, row) in y.iter_mut().zip(rows_of(&xv[first * n..], n)) {
            *y = sum_by(row, &f);
        }
        Ok::<(), KernelError>(())
    })
}

/// The sum of the squares of every input this device counts (see [`optimus_plan::Kernel::GradSquareSum`]),
/// accumulated in f64.
fn grad_square_sum(inputs: &[&View], out: &mut ViewMut, ctx: &KernelContext) -> Result<(), KernelError> {
    require(inputs.len() == ctx.inputs.len(), || KernelError::InputLayouts)?;
    let mut total = 0.0f64;
    for (k, (x, meta)) in inputs.iter().zip(ctx.inputs).enumerate() {
        if meta.layout.counts_block_at(ctx.coords.0) {
            total += square_sum(floats(x, &format!("gradient {k}"))?);
        }
    }
    let y = floats_mut(out)?;
    same_len("the output", y.len(), 1)?;
    y[0] = total as f32;
    Ok(())
}

/// The sum of squares of `v` in f64, over four lanes (in vector code: the same bits, faster).
fn square_sum(v: &[f32]) -> f64 {
    vectorized(
        #[inline(always)]
        || square_sum_formula(v),
    )
}

#[inline(always)]
fn square_sum_formula(v: &[f32]) -> f64 {
    let mut acc = [0.0f64; 4];
    let mut chunks = v.chunks_exact(4);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += f64::from(x) * f64::from(x);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    acc.iter().sum::<f64>() + tail
}

fn row_centered_square_sum(inputs: &[&View], out: &mut ViewMut, n: u64) -> Result<(), KernelError> {
    let [x, sum] = args(inputs)?;
    require(n > 0, || KernelError::EmptyNorm)?;
    let (rows, width) = split_last(&x.shape);
    let (xv, sv) = (floats(x, "x")?, per_row(sum, rows, 1, "the sum")?);
    let y = floats_mut(out)?;
    same_len("the output", y.len(), rows)?;
    y.fill(0.0);
    par::costed_row_blocks(y, 1, width, |first, y| {
        for ((y, row), &s) in y.iter_mut().zip(rows_of(&xv[first * width..], width)).zip(&sv[first..]) {
            let mean = (f64::from(s) / n as f64) as f32;
            *y = sum_by(row, |v| (v - mean) * (v - mean));
        }
        Ok::<(), KernelError>(())
    })
}

fn layer_norm_apply(inputs: &[&View], out: &mut ViewMut, n: u64, eps: f64) -> Result<(), KernelError> {
    let [x, sum, sqsum, gamma, beta] = args(inputs)?;
    let (rows, width) = split_last(&x.shape);
    let xv = floats(x, "x")?;
    let stats = mean_rstd(per_row(sum, rows, 1, "the sum")?, per_row(sqsum, rows, 1, "the square sum")?, n, eps)?;
    let (gv, bv) = (per_row(gamma, 1, width, "gamma")?, per_row(beta, 1, width, "beta")?);
    let y = floats_mut(out)?;
    same_len("the output", y.len(), xv.len())?;
    par::row_blocks(y, width, |first, y| {
        vectorized(
            #[inline(always)]
            || {
                for ((yr, xr), &(mean, rstd)) in
                    rows_of_mut(y, width).zip(rows_of(&xv[first * width..], width)).zip(&stats[first..])
                {
                    for (((y, &x), &g), &b) in yr.iter_mut().zip(xr).zip(gv).zip(bv) {
                        *y = (x - mean) * rstd * g + b;
                    }
                }
            },
        );
        Ok::<(), KernelError>(())
    })
}

fn layer_norm_grad_sums(inputs: &[&View], out: &mut ViewMut, n: u64, eps: f64) -> Result<(), KernelError> {
    let [dy, x, gamma, sum, sqsum] = args(inputs)?;
    let (rows, width) = split_last(&x.shape);
    let (dyv, xv) = (per_row(dy, rows, width, "dy")?, floats(x, "x")?);
    let gv = per_row(gamma, 1, width, "gamma")?;
    let stats = mean_rstd(per_row(sum, rows, 1, "the sum")?, per_row(sqsum, rows, 1, "the square sum")?, n, eps)?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), rows * 2)?;
    y.fill(0.0);
    par::costed_row_blocks(y, 2, 2 * width, |first, y| {
        let mut scaled = vec![0.0f32; width];
        let rows = rows_of(&dyv[first * width..], width).zip(rows_of(&xv[first * width..], width));
        for ((pair, (dyr, xr)), &(mean, rstd)) in y.chunks_exact_mut(2).zip(rows).zip(&stats[first..]) {
            for ((s, &dy), &g) in scaled.iter_mut().zip(dyr).zip(gv) {
                *s = dy * g;
            }
            pair[0] = sum_by(&scaled, |v| v);
            pair[1] = sum_by2(&scaled, xr, |s, x| s * (x - mean) * rstd);
        }
        Ok::<(), KernelError>(())
    })
}

fn layer_norm_grad_input(inputs: &[&View], out: &mut ViewMut, n: u64, eps: f64) -> Result<(), KernelError> {
    let [dy, x, gamma, sum, sqsum, sums] = args(inputs)?;
    let (rows, width) = split_last(&x.shape);
    let (dyv, xv) = (per_row(dy, rows, width, "dy")?, floats(x, "x")?);
    let gv = per_row(gamma, 1, width, "gamma")?;
    let stats = mean_rstd(per_row(sum, rows, 1, "the sum")?, per_row(sqsum, rows, 1, "the square sum")?, n, eps)?;
    let sv = per_row(sums, rows, 2, "the gradient sums")?;
    let dx = floats_mut(out)?;
    same_len("the output", dx.len(), xv.len())?;
    let inv_n = (1.0 / n as f64) as f32;
    par::row_blocks(dx, width, |first, dx| {
        let (dyv, xv) = (&dyv[first * width..], &xv[first * width..]);
        let rows_iter = rows_of_mut(dx, width).zip(rows_of(dyv, width)).zip(rows_of(xv, width));
        let per_row = stats[first..].iter().zip(sv[first * 2..].chunks_exact(2));
        vectorized(
            #[inline(always)]
            || {
                for (((dxr, dyr), xr), (&(mean, rstd), pair)) in rows_iter.zip(per_row) {
                    let (a, b) = (pair[0] * inv_n, pair[1] * inv_n);
                    for (((dx, &dy), &x), &g) in dxr.iter_mut().zip(dyr).zip(xr).zip(gv) {
                        let xhat = (x - mean) * rstd;
                        *dx = rstd * (dy * g - a - xhat * b);
                    }
                }
            },
        );
        Ok::<(), KernelError>(())
    })
}

fn layer_norm_grad_weight(inputs: &[&View], out: &mut ViewMut, n: u64, eps: f64) -> Result<(), KernelError> {
    let [dy, x, sum, sqsum] = args(inputs)?;
    let (rows, width) = split_last(&x.shape);
    let (dyv, xv) = (per_row(dy, rows, width, "dy")?, floats(x, "x")?);
    let stats = mean_rstd(per_row(sum, rows, 1, "the sum")?, per_row(sqsum, rows, 1, "the square sum")?, n, eps)?;
    let g = floats_mut(out)?;
    same_len("the output", g.len(), width)?;
    par::column_blocks(g, rows, |first, g| {
        g.fill(0.0);
        let columns = first..first + g.len();
        vectorized(
            #[inline(always)]
            || {
                for ((dyr, xr), &(mean, rstd)) in rows_of(dyv, width).zip(rows_of(xv, width)).zip(&stats) {
                    for ((g, &dy), &x) in g.iter_mut().zip(&dyr[columns.clone()]).zip(&xr[columns.clone()]) {
                        *g += dy * (x - mean) * rstd;
                    }
                }
            },
        );
        Ok::<(), KernelError>(())
    })
}

fn sum_to_last(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [x] = args(inputs)?;
    let (_, width) = split_last(&x.shape);
    let xv = floats(x, "x")?;
    let g = floats_mut(out)?;
    same_len("the output", g.len(), width)?;
    let rows = xv.len() / width.max(1);
    par::column_blocks(g, rows, |first, g| {
        g.fill(0.0);
        // Each column summed over the rows in order, several columns at once in vector code.
        vectorized(
            #[inline(always)]
            || {
                for row in rows_of(xv, width) {
                    for (g, &v) in g.iter_mut().zip(&row[first..]) {
                        *g += v;
                    }
                }
            },
        );
        Ok::<(), KernelError>(())
    })
}

// ---- cross-entropy --------------------------------------------------------------------------------

/// This device's vocabulary columns: global column `offset + c`; columns at or past `valid` are padding.
#[derive(Clone, Copy, Debug)]
struct Vocab {
    offset: u64,
    valid: u64,
}

impl Vocab {
    fn new(offset: Offset, valid: u64, ctx: &KernelContext) -> Vocab {
        Vocab { offset: offset.at(ctx.coords), valid }
    }

    /// How many of `width` local columns are real vocabulary.
    fn live(&self, width: usize) -> usize {
        (self.valid.saturating_sub(self.offset) as usize).min(width)
    }

    /// The global column of a target, checked; `None` for an ignored target ([`IGNORE_INDEX`]).
    fn target(&self, t: i32) -> Result<Option<u64>, KernelError> {
        if t == IGNORE_INDEX {
            return Ok(None);
        }
        let valid = self.valid;
        u64::try_from(t)
            .ok()
            .filter(|&t| t < valid)
            .map(Some)
            .ok_or(KernelError::TargetOutsideVocabulary { target: t, valid })
    }

    /// The local column of a global one, if this device holds it.
    fn local(&self, column: u64, width: usize) -> Option<usize> {
        column.checked_sub(self.offset).map(|c| c as usize).filter(|&c| c < width)
    }
}

fn cross_entropy_max(inputs: &[&View], out: &mut ViewMut, vocab: Vocab) -> Result<(), KernelError> {
    let [logits] = args(inputs)?;
    let (rows, width) = split_last(&logits.shape);
    let lv = floats(logits, "the logits")?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), rows)?;
    y.fill(f32::NEG_INFINITY);
    let live = vocab.live(width);
    par::costed_row_blocks(y, 1, width, |first, y| {
        for (y, row) in y.iter_mut().zip(rows_of(&lv[first * width..], width)) {
            *y = max_of(&row[..live]);
        }
        Ok::<(), KernelError>(())
    })
}

fn cross_entropy_stats(inputs: &[&View], out: &mut ViewMut, vocab: Vocab) -> Result<(), KernelError> {
    let [logits, targets, max] = args(inputs)?;
    let (rows, width) = split_last(&logits.shape);
    let lv = floats(logits, "the logits")?;
    let tv = ints(targets, "the targets")?;
    same_len("the targets", tv.len(), rows)?;
    let mv = per_row(max, rows, 1, "the max")?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), rows * 2)?;
    y.fill(0.0);
    let live = vocab.live(width);
    par::costed_row_blocks(y, 2, width, |first, y| {
        let per_row = rows_of(&lv[first * width..], width).zip(&tv[first..]).zip(&mv[first..]);
        for (pair, ((row, &t), &m)) in y.chunks_exact_mut(2).zip(per_row) {
            let column = vocab.target(t)?;
            pair[0] = column.and_then(|column| vocab.local(column, width)).map_or(0.0, |c| row[c]);
            pair[1] = vmath::exp_sub_sum(&row[..live], m);
        }
        Ok(())
    })
}

/// The number of targets that are not [`IGNORE_INDEX`], as f32.
fn cross_entropy_count(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [targets] = args(inputs)?;
    let tv = ints(targets, "the targets")?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), 1)?;
    y[0] = tv.iter().filter(|&&t| t != IGNORE_INDEX).count() as f32;
    Ok(())
}

/// The divisor of the mean: the global count of targets not ignored, at least 1 (a batch with every
/// target ignored has loss 0 and zero gradients, where PyTorch gives NaN).
fn divisor(counted: &View) -> Result<f64, KernelError> {
    let c = per_row(counted, 1, 1, "the count")?;
    Ok(f64::from(c[0]).max(1.0))
}

fn cross_entropy_loss(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [max, stats, targets, counted] = args(inputs)?;
    let mv = floats(max, "the max")?;
    let sv = per_row(stats, mv.len(), 2, "the stats")?;
    let tv = ints(targets, "the targets")?;
    same_len("the targets", tv.len(), mv.len())?;
    let count = divisor(counted)?;
    let y = floats_mut(out)?;
    same_len("the output", y.len(), 1)?;
    let total: f64 = mv
        .iter()
        .zip(sv.chunks_exact(2))
        .zip(tv)
        .filter(|(_, t)| **t != IGNORE_INDEX)
        .map(|((&m, s), _)| f64::from(m) + f64::from(s[1]).ln() - f64::from(s[0]))
        .sum();
    y[0] = (total / count) as f32;
    Ok(())
}

fn cross_entropy_grad(inputs: &[&View], out: &mut ViewMut, vocab: Vocab) -> Result<(), KernelError> {
    let [logits, targets, max, stats, dloss, counted] = args(inputs)?;
    let (rows, width) = split_last(&logits.shape);
    let lv = floats(logits, "the logits")?;
    let tv = ints(targets, "the targets")?;
    same_len("the targets", tv.len(), rows)?;
    let (mv, sv) = (per_row(max, rows, 1, "the max")?, per_row(stats, rows, 2, "the stats")?);
    let dl = per_row(dloss, 1, 1, "dloss")?;
    let factor = (f64::from(dl[0]) / divisor(counted)?) as f32;
    let g = floats_mut(out)?;
    same_len("the output", g.len(), lv.len())?;
    let live = vocab.live(width);
    par::row_blocks(g, width, |first, g| {
        let per_row_data = tv[first..].iter().zip(&mv[first..]).zip(sv[first * 2..].chunks_exact(2));
        for ((gr, lr), ((&t, &m), s)) in
            rows_of_mut(g, width).zip(rows_of(&lv[first * width..], width)).zip(per_row_data)
        {
            let Some(column) = vocab.target(t)? else {
                gr.fill(0.0);
                continue;
            };
            let target = vocab.local(column, width);
            let inv = 1.0 / s[1];
            let (live_g, padding) = gr.split_at_mut(live);
            vectorized(
                #[inline(always)]
                || live_g.iter_mut().zip(&lr[..live]).for_each(|(g, &x)| *g = vmath::exp(x - m) * inv * factor),
            );
            padding.fill(0.0);
            if let Some(c) = target {
                live_g[c] -= factor;
            }
        }
        Ok(())
    })
}

// ---- optimizer ------------------------------------------------------------------------------------

/// torch.lerp: a + w (b - a), computed from the nearer end.
fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if w.abs() < 0.5 { a + w * (b - a) } else { b - (b - a) * (1.0 - w) }
}

/// In-place update of one parameter shard, exactly as torch.optim.SGD (momentum, dampening 0, nesterov
/// false, weight_decay added to the gradient) or torch.optim.AdamW (decoupled weight decay
/// p *= 1 - lr*wd, bias-corrected moments, eps added after sqrt). `step` counts from 1. `state1` is
/// SGD's momentum buffer / AdamW's exp_avg, `state2` AdamW's exp_avg_sq.
pub fn optimizer_step(
    param: &mut Tensor,
    grad: &Tensor,
    state1: &mut Tensor,
    state2: &mut Tensor,
    settings: &OptimizerSettings,
    step: u64,
) -> Result<(), KernelError> {
    let (mut state1, mut state2) = (state1.view_mut(), state2.view_mut());
    optimizer_step_views(&mut param.view_mut(), &grad.view(), &mut state1, &mut state2, settings, step)
}

/// [`optimizer_step`] on views of any storage (the host arena).
pub fn optimizer_step_views(
    param: &mut ViewMut,
    grad: &View,
    state1: &mut ViewMut,
    state2: &mut ViewMut,
    settings: &OptimizerSettings,
    step: u64,
) -> Result<(), KernelError> {
    require(step >= 1, || KernelError::StepZero)?;
    let g = floats(grad, "the gradient")?;
    let p = floats_mut(param)?;
    same_len("the gradient", g.len(), p.len())?;
    let m = floats_mut(state1)?;
    same_len("the first optimizer state", m.len(), p.len())?;
    match settings.kind {
        OptimizerKind::Sgd => {
            sgd(p, g, m, settings, step);
            Ok(())
        }
        OptimizerKind::AdamW => {
            let v = floats_mut(state2)?;
            same_len("the second optimizer state", v.len(), p.len())?;
            adamw(p, g, m, v, settings, step);
            Ok(())
        }
    }
}

fn sgd(p: &mut [f32], g: &[f32], buf: &mut [f32], s: &OptimizerSettings, step: u64) {
    if par::runs_inline() {
        return sgd_chunk(p, g, buf, s, step);
    }
    let per_task = par::items_per_task(p.len(), 1);
    p.par_chunks_mut(per_task).zip(g.par_chunks(per_task)).zip(buf.par_chunks_mut(per_task)).for_each(
        |((p, g), buf)| {
            sgd_chunk(p, g, buf, s, step);
        },
    );
}

fn sgd_chunk(p: &mut [f32], g: &[f32], buf: &mut [f32], s: &OptimizerSettings, step: u64) {
    for ((p, &g), b) in p.iter_mut().zip(g).zip(buf) {
        let mut d = if s.weight_decay != 0.0 { g + s.weight_decay * *p } else { g };
        if s.momentum != 0.0 {
            *b = if step == 1 { d } else { s.momentum * *b + d };
            d = *b;
        }
        *p -= s.lr * d;
    }
}

/// The decimal a hyper-parameter was written as (0.999, not 0.99900001287), as torch holds it in an f64.
fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// torch's single-tensor AdamW: scalars in f64, cast to f32 where they meet the tensors.
fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: &OptimizerSettings, step: u64) {
    let step = i32::try_from(step).unwrap_or(i32::MAX);
    let (lr, wd, beta1, beta2) = (decimal(s.lr), decimal(s.weight_decay), decimal(s.beta1), decimal(s.beta2));
    let decay = (1.0 - lr * wd) as f32;
    let step_size = (lr / (1.0 - beta1.powi(step))) as f32;
    let bias2_sqrt = (1.0 - beta2.powi(step)).sqrt() as f32;
    let (w1, w2) = ((1.0 - beta1) as f32, (1.0 - beta2) as f32);
    let (beta2, eps) = (s.beta2, s.eps);
    let chunk = |p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]| {
        vectorized(
            #[inline(always)]
            || {
                for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
                    *p *= decay;
                    *m = lerp(*m, g, w1);
                    *v = *v * beta2 + w2 * g * g;
                    let denom = v.sqrt() / bias2_sqrt + eps;
                    *p += -step_size * *m / denom;
                }
            },
        )
    };
    if par::runs_inline() {
        return chunk(p, g, m, v);
    }
    let per_task = par::items_per_task(p.len(), 1);
    let chunks = p.par_chunks_mut(per_task).zip(g.par_chunks(per_task));
    chunks
        .zip(m.par_chunks_mut(per_task))
        .zip(v.par_chunks_mut(per_task))
        .for_each(|(((p, g), m), v)| chunk(p, g, m, v));
}

#[cfg(test)]
mod tests {
    use super::*;
    use optimus_plan::init::mix64 as splitmix64;
    use optimus_plan::layout::Layout;
    use optimus_plan::shapes::ensure;
    use optimus_plan::tensor::Data;
    use optimus_plan::types::DType;
    use optimus_plan::{Buffer, Coords, Mesh};
    use optimus_plan::{BufferId, Role};

    type R = Result<(), String>;

    const ONE: Mesh = Mesh::new(1, 1);
    const TWO_BY_TWO: Mesh = Mesh::new(2, 2);

    /// Deterministic uniforms in [-1, 1).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 += 1;
            (splitmix64(self.0) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }

        fn values(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.next()).collect()
        }

        fn tensor(&mut self, shape: &[u64]) -> Tensor {
            Tensor::from_f32(shape, self.values(numel(shape)))
        }
    }

    fn meta_with(logical: &[u64], local: &[u64], layout: Layout, dtype: DType) -> Buffer {
        Buffer {
            id: BufferId(0),
            name: "t".into(),
            dtype,
            logical_shape: logical.to_vec(),
            layout,
            shape: local.to_vec(),
            role: Role::Workspace,
        }
    }

    fn meta(shape: &[u64]) -> Buffer {
        meta_with(shape, shape, Layout::REPLICATED, DType::F32)
    }

    /// Runs a kernel on device (i, j) with a fresh output described by `out`.
    fn eval_on(
        kernel: &Kernel,
        inputs: &[&Tensor],
        out: &Buffer,
        i: u64,
        j: u64,
        mesh: Mesh,
    ) -> Result<Tensor, String> {
        let mut t = Tensor::zeros(out.dtype, &out.shape);
        let ctx = KernelContext { coords: Coords::new(i, j, 0), mesh, seed: 42, inputs: &[], output: out };
        run(kernel, inputs, &mut t, &ctx)?;
        Ok(t)
    }

    /// Runs a kernel on a single device with an f32 output of `shape`.
    fn eval(kernel: &Kernel, inputs: &[&Tensor], shape: &[u64]) -> Result<Tensor, String> {
        eval_on(kernel, inputs, &meta(shape), 0, 0, ONE)
    }

    fn vals(t: &Tensor) -> Vec<f32> {
        t.f32().map(<[f32]>::to_vec).unwrap_or_default()
    }

    fn to64(v: &[f32]) -> Vec<f64> {
        v.iter().map(|&x| f64::from(x)).collect()
    }

    /// Every |got - want| <= tol * max(1, |want|).
    fn close(got: &[f32], want: &[f64], tol: f64) -> R {
        same_len("the result", got.len(), want.len())?;
        for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
            let ok = (f64::from(g) - w).abs() <= tol * w.abs().max(1.0) || (w.is_infinite() && f64::from(g) == w);
            ensure(ok, || format!("element {k}: got {g}, want {w}"))?;
        }
        Ok(())
    }

    /// Every |got - want| <= tol * max |want| (for gradients checked against finite differences).
    fn close_rel(got: &[f32], want: &[f64], tol: f64) -> R {
        same_len("the gradient", got.len(), want.len())?;
        let scale = want.iter().fold(1e-3f64, |m, w| m.max(w.abs()));
        for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
            let err = (f64::from(g) - w).abs();
            ensure(err <= tol * scale, || {
                format!("element {k}: got {g}, finite differences give {w} (scale {scale})")
            })?;
        }
        Ok(())
    }

    /// d/dx of sum(w * f(x)) by central differences of the (f32) kernel `f`.
    fn numeric_grad(x: &Tensor, w: &[f32], f: impl Fn(&Tensor) -> Result<Tensor, String>) -> Result<Vec<f64>, String> {
        let xv = vals(x);
        let h = 1e-2f32;
        let weighted = |t: &Tensor| vals(t).iter().zip(w).map(|(&y, &w)| f64::from(y) * f64::from(w)).sum::<f64>();
        let mut grad = Vec::with_capacity(xv.len());
        for k in 0..xv.len() {
            let (mut plus, mut minus) = (xv.clone(), xv.clone());
            plus[k] += h;
            minus[k] -= h;
            let up = weighted(&f(&Tensor::from_f32(&x.shape, plus.clone()))?);
            let down = weighted(&f(&Tensor::from_f32(&x.shape, minus.clone()))?);
            grad.push((up - down) / f64::from(plus[k] - minus[k]));
        }
        Ok(grad)
    }

    fn naive_matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for r in 0..m {
            for col in 0..n {
                c[r * n + col] = (0..k).map(|t| a[r * k + t] * b[t * n + col]).sum();
            }
        }
        c
    }

    fn transpose64(a: &[f64], rows: usize, cols: usize) -> Vec<f64> {
        (0..rows * cols).map(|k| a[(k % rows) * cols + k / rows]).collect()
    }

    fn softmax64(row: &[f64]) -> Vec<f64> {
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = row.iter().map(|x| (x - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        e.iter().map(|x| x / sum).collect()
    }

    fn unravel(mut k: usize, shape: &[u64]) -> Vec<usize> {
        let mut idx = vec![0; shape.len()];
        for d in (0..shape.len()).rev() {
            idx[d] = k % shape[d] as usize;
            k /= shape[d] as usize;
        }
        idx
    }

    fn ravel(idx: &[usize], shape: &[u64]) -> usize {
        idx.iter().zip(shape).fold(0, |acc, (&i, &s)| acc * s as usize + i)
    }

    // ---- products ----

    #[test]
    fn matmul_matches_naive_for_every_transpose_and_accumulation() -> R {
        let mut rng = Rng(1);
        let (m, k, n) = (6usize, 4usize, 5usize);
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            // A is [2, 3, 4] (6 x 4) or, transposed, [2, 2, 6] (4 x 6); likewise B.
            let a_shape: Vec<u64> = if ta { vec![2, 2, 6] } else { vec![2, 3, 4] };
            let b_shape: Vec<u64> = if tb { vec![5, 4] } else { vec![4, 5] };
            let (a, b) = (rng.tensor(&a_shape), rng.tensor(&b_shape));
            let a_op = if ta { transpose64(&to64(&vals(&a)), k, m) } else { to64(&vals(&a)) };
            let b_op = if tb { transpose64(&to64(&vals(&b)), n, k) } else { to64(&vals(&b)) };
            let want = naive_matmul(&a_op, &b_op, m, k, n);
            for accumulate in [false, true] {
                let kernel = Kernel::MatMul { transpose_a: ta, transpose_b: tb, accumulate };
                let mut out = rng.tensor(&[2, 3, 5]);
                let before = to64(&vals(&out));
                let ctx = KernelContext {
                    coords: Coords::new(0, 0, 0),
                    mesh: ONE,
                    seed: 0,
                    inputs: &[],
                    output: &meta(&[2, 3, 5]),
                };
                run(&kernel, &[&a, &b], &mut out, &ctx)?;
                let want: Vec<f64> =
                    want.iter().zip(&before).map(|(w, c)| if accumulate { w + c } else { *w }).collect();
                close(&vals(&out), &want, 1e-5)?;
            }
        }
        Ok(())
    }

    #[test]
    fn large_matmul_uses_the_parallel_path_and_stays_exact() -> R {
        let mut rng = Rng(2);
        let (m, k, n) = (170usize, 160usize, 165usize);
        let (a, b) = (rng.tensor(&[m as u64, k as u64]), rng.tensor(&[n as u64, k as u64]));
        let kernel = Kernel::MatMul { transpose_a: false, transpose_b: true, accumulate: false };
        let out = eval(&kernel, &[&a, &b], &[m as u64, n as u64])?;
        let want = naive_matmul(&to64(&vals(&a)), &transpose64(&to64(&vals(&b)), n, k), m, k, n);
        close(&vals(&out), &want, 1e-4)
    }

    #[test]
    fn matmul_rejects_mismatched_shapes() {
        let (a, b) = (Tensor::zeros(DType::F32, &[2, 3]), Tensor::zeros(DType::F32, &[4, 5]));
        let kernel = Kernel::MatMul { transpose_a: false, transpose_b: false, accumulate: false };
        assert!(eval(&kernel, &[&a, &b], &[2, 5]).is_err());
        assert!(eval(&kernel, &[&a], &[2, 5]).is_err());
    }

    #[test]
    fn batched_matmul_matches_naive() -> R {
        let mut rng = Rng(3);
        let (a, b) = (rng.tensor(&[2, 3, 4, 5]), rng.tensor(&[2, 3, 5, 6]));
        let out = eval(&Kernel::BatchedMatMul, &[&a, &b], &[2, 3, 4, 6])?;
        let (av, bv) = (to64(&vals(&a)), to64(&vals(&b)));
        let want: Vec<f64> =
            (0..6).flat_map(|t| naive_matmul(&av[t * 20..(t + 1) * 20], &bv[t * 30..(t + 1) * 30], 4, 5, 6)).collect();
        close(&vals(&out), &want, 1e-5)?;
        assert!(eval(&Kernel::BatchedMatMul, &[&a, &rng.tensor(&[3, 2, 5, 6])], &[2, 3, 4, 6]).is_err());
        Ok(())
    }

    // ---- elementwise ----

    #[test]
    fn bias_add_add_and_scale() -> R {
        let mut rng = Rng(4);
        let (x, b, y) = (rng.tensor(&[3, 2, 4]), rng.tensor(&[4]), rng.tensor(&[3, 2, 4]));
        let (xv, bv, yv) = (vals(&x), vals(&b), vals(&y));
        let out = eval(&Kernel::BiasAdd, &[&x, &b], &[3, 2, 4])?;
        let want: Vec<f64> = xv.iter().enumerate().map(|(k, &v)| f64::from(v) + f64::from(bv[k % 4])).collect();
        close(&vals(&out), &want, 1e-6)?;
        let out = eval(&Kernel::Add, &[&x, &y], &[3, 2, 4])?;
        let want: Vec<f64> = xv.iter().zip(&yv).map(|(&a, &b)| f64::from(a) + f64::from(b)).collect();
        close(&vals(&out), &want, 1e-6)?;
        let out = eval(&Kernel::Scale { factor: -2.5 }, &[&x], &[3, 2, 4])?;
        let want: Vec<f64> = xv.iter().map(|&a| -2.5 * f64::from(a)).collect();
        close(&vals(&out), &want, 1e-6)?;
        assert!(eval(&Kernel::BiasAdd, &[&x, &rng.tensor(&[3])], &[3, 2, 4]).is_err());
        Ok(())
    }

    #[test]
    fn gelu_matches_both_formulas() -> R {
        let x = Tensor::from_f32(&[11], vec![-30.0, -4.0, -2.0, -1.0, -0.3, 0.0, 0.2, 1.0, 2.5, 5.0, 30.0]);
        let xs = to64(&vals(&x));
        let exact: Vec<f64> = xs.iter().map(|&x| 0.5 * x * (1.0 + libm::erf(x / 2f64.sqrt()))).collect();
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let tanh: Vec<f64> = xs.iter().map(|&x| 0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())).collect();
        close(&vals(&eval(&Kernel::Gelu { approximate: false }, &[&x], &[11])?), &exact, 1e-6)?;
        close(&vals(&eval(&Kernel::Gelu { approximate: true }, &[&x], &[11])?), &tanh, 1e-6)?;
        for approximate in [false, true] {
            let grad = vals(&eval(&Kernel::GeluGrad { approximate }, &[&x, &x], &[11])?);
            assert!(grad.iter().all(|g| g.is_finite()), "{grad:?}");
        }
        Ok(())
    }

    #[test]
    fn silu_is_x_sigmoid_x_and_its_grad_matches_finite_differences() -> R {
        let x = Tensor::from_f32(&[7], vec![-30.0, -3.0, -0.5, 0.0, 0.7, 4.0, 30.0]);
        let exact: Vec<f64> = to64(&vals(&x)).iter().map(|&x| x / (1.0 + (-x).exp())).collect();
        close(&vals(&eval(&Kernel::Silu, &[&x], &[7])?), &exact, 1e-6)?;
        let mut rng = Rng(9);
        let x = Tensor::from_f32(&[4, 5], rng.values(20).iter().map(|v| 3.0 * v).collect());
        let dy = rng.tensor(&[4, 5]);
        let analytic = eval(&Kernel::SiluGrad, &[&dy, &x], &[4, 5])?;
        let numeric = numeric_grad(&x, &vals(&dy), |x| eval(&Kernel::Silu, &[x], &[4, 5]))?;
        close_rel(&vals(&analytic), &numeric, 1e-3)
    }

    #[test]
    fn gelu_grad_matches_finite_differences() -> R {
        let mut rng = Rng(5);
        let x = Tensor::from_f32(&[4, 5], rng.values(20).iter().map(|v| 3.0 * v).collect());
        let dy = rng.tensor(&[4, 5]);
        for approximate in [false, true] {
            let analytic = eval(&Kernel::GeluGrad { approximate }, &[&dy, &x], &[4, 5])?;
            let numeric = numeric_grad(&x, &vals(&dy), |x| eval(&Kernel::Gelu { approximate }, &[x], &[4, 5]))?;
            close_rel(&vals(&analytic), &numeric, 1e-3)?;
        }
        Ok(())
    }

    #[test]
    fn softmax_matches_naive_even_for_large_logits() -> R {
        let mut rng = Rng(6);
        let mut v = rng.values(24);
        v[0] = 80.0;
        v[7] = -90.0;
        let x = Tensor::from_f32(&[2, 3, 4], v);
        let out = eval(&Kernel::Softmax, &[&x], &[2, 3, 4])?;
        let want: Vec<f64> = to64(&vals(&x)).chunks(4).flat_map(softmax64).collect();
        close(&vals(&out), &want, 1e-6)
    }

    #[test]
    fn softmax_grad_matches_finite_differences() -> R {
        let mut rng = Rng(7);
        let (x, dy) = (rng.tensor(&[3, 6]), rng.tensor(&[3, 6]));
        let y = eval(&Kernel::Softmax, &[&x], &[3, 6])?;
        let analytic = eval(&Kernel::SoftmaxGrad, &[&dy, &y], &[3, 6])?;
        let numeric = numeric_grad(&x, &vals(&dy), |x| eval(&Kernel::Softmax, &[x], &[3, 6]))?;
        close_rel(&vals(&analytic), &numeric, 1e-3)
    }

    #[test]
    fn causal_mask_and_its_gradient() -> R {
        let mut rng = Rng(8);
        let x = rng.tensor(&[2, 3, 3]);
        let masked = eval(&Kernel::CausalMask, &[&x], &[2, 3, 3])?;
        let grad = eval(&Kernel::CausalMaskGrad, &[&x], &[2, 3, 3])?;
        for (k, ((&m, &g), &v)) in vals(&masked).iter().zip(&vals(&grad)).zip(&vals(&x)).enumerate() {
            let (row, col) = ((k / 3) % 3, k % 3);
            if col > row {
                assert_eq!((m, g), (f32::NEG_INFINITY, 0.0), "element {k}");
            } else {
                assert_eq!((m, g), (v, v), "element {k}");
            }
        }
        let after = eval(&Kernel::Softmax, &[&masked], &[2, 3, 3])?;
        assert_eq!(vals(&after)[1], 0.0);
        Ok(())
    }

    // ---- dropout and layouts ----

    #[test]
    fn dropout_keeps_about_one_minus_p_and_scales() -> R {
        let x = Tensor::from_f32(&[64, 64], vec![1.0; 4096]);
        let identity = eval(&Kernel::Dropout { p: 0.0, key: 1 }, &[&x], &[64, 64])?;
        assert_eq!(identity, x);
        let out = vals(&eval(&Kernel::Dropout { p: 0.3, key: 1 }, &[&x], &[64, 64])?);
        let kept = out.iter().filter(|&&v| v != 0.0).count() as f64 / 4096.0;
        assert!((kept - 0.7).abs() < 0.03, "kept {kept}");
        assert!(out.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.7).abs() < 1e-6));
        let other = vals(&eval(&Kernel::Dropout { p: 0.3, key: 2 }, &[&x], &[64, 64])?);
        assert_ne!(out, other, "different keys give different masks");
        let grad = vals(&eval(&Kernel::DropoutGrad { p: 0.3, key: 1 }, &[&x], &[64, 64])?);
        assert_eq!(out, grad, "the gradient applies the forward's mask");
        let all = vals(&eval(&Kernel::Dropout { p: 1.0, key: 1 }, &[&x], &[64, 64])?);
        assert!(all.iter().all(|&v| v == 0.0));
        for index in 0..1000 {
            assert_eq!(dropout_keep(42, 1, index, 0.3), out[index as usize] != 0.0);
        }
        Ok(())
    }

    #[test]
    fn logical_indices_follow_the_layout() -> R {
        // [4, 6] split rows over i and columns over j: device (1, 0) holds rows 2..4, columns 0..3.
        let layout = Layout::new(Placement::shard(0), Placement::shard(1));
        let m = meta_with(&[4, 6], &[2, 3], layout, DType::F32);
        assert_eq!(try_logical_indices(&m, Coords::new(1, 0, 0), TWO_BY_TWO)?, vec![12, 13, 14, 18, 19, 20]);
        // Columns of 12 viewed as [3, 2, 2] with the middle split in two: member 1 holds 2,3 6,7 10,11.
        let layout = Layout::new(Placement::Replicate, Placement::Shard { dim: 1, outer: 3, inner: 2 });
        let m = meta_with(&[2, 12], &[2, 6], layout, DType::F32);
        let want = vec![2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23];
        assert_eq!(try_logical_indices(&m, Coords::new(0, 1, 0), Mesh::new(1, 2))?, want);
        // A local shape that disagrees with the layout is an error, not a panic.
        let bad = meta_with(&[4, 6], &[4, 3], Layout::new(Placement::shard(0), Placement::Replicate), DType::F32);
        assert!(try_logical_indices(&bad, Coords::new(0, 0, 0), TWO_BY_TWO).is_err());
        assert!(logical_indices(&bad, Coords::new(0, 0, 0), TWO_BY_TWO).is_empty());
        Ok(())
    }

    #[test]
    fn dropout_mask_is_the_same_on_blocks_of_a_2x2_layout() -> R {
        let mut rng = Rng(9);
        let cases: [(&[u64], Layout, bool); 4] = [
            (&[4, 6, 8], Layout::new(Placement::shard(0), Placement::Shard { dim: 2, outer: 2, inner: 2 }), true),
            (&[4, 6, 8], Layout::new(Placement::shard(1), Placement::shard(0)), true),
            (&[4, 6, 8], Layout::new(Placement::Replicate, Placement::shard(2)), false),
            (&[4, 8], Layout::new(Placement::shard(1), Placement::shard(1)), true),
        ];
        for (logical, layout, exclusive) in cases {
            let x = rng.tensor(logical);
            let xv = vals(&x);
            for kernel in [Kernel::Dropout { p: 0.4, key: 7 }, Kernel::DropoutGrad { p: 0.4, key: 7 }] {
                let whole = vals(&eval(&kernel, &[&x], logical)?);
                let local = layout.local_shape(logical, TWO_BY_TWO.axes());
                let m = meta_with(logical, &local, layout, DType::F32);
                let mut seen = vec![0u32; xv.len()];
                for (i, j) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                    let idx = try_logical_indices(&m, Coords::new(i, j, 0), TWO_BY_TWO)?;
                    let block = Tensor::from_f32(&local, idx.iter().map(|&k| xv[k as usize]).collect());
                    let out = vals(&eval_on(&kernel, &[&block], &m, i, j, TWO_BY_TWO)?);
                    for (l, &k) in idx.iter().enumerate() {
                        assert_eq!(out[l], whole[k as usize], "{layout} device ({i}, {j}) element {k}");
                        seen[k as usize] += 1;
                    }
                }
                if exclusive {
                    assert!(seen.iter().all(|&c| c == 1), "{layout}: every element on exactly one device");
                }
            }
        }
        Ok(())
    }

    // ---- data movement ----

    #[test]
    fn reshape_transpose_select_and_select_grad() -> R {
        let mut rng = Rng(10);
        let x = rng.tensor(&[2, 3, 4, 5]);
        let xv = vals(&x);
        assert_eq!(vals(&eval(&Kernel::Reshape, &[&x], &[6, 20])?), xv);
        assert!(eval(&Kernel::Reshape, &[&x], &[6, 21]).is_err());
        for (d0, d1, shape) in
            [(1u8, 3u8, [2u64, 5, 4, 3]), (3, 0, [5, 3, 4, 2]), (2, 3, [2, 3, 5, 4]), (1, 1, [2, 3, 4, 5])]
        {
            let out = vals(&eval(&Kernel::Transpose { dim0: d0, dim1: d1 }, &[&x], &shape)?);
            for (k, &v) in xv.iter().enumerate() {
                let mut idx = unravel(k, &x.shape);
                idx.swap(d0.into(), d1.into());
                assert_eq!(out[ravel(&idx, &shape)], v);
            }
        }
        // Larger than a tile, and on integers.
        let ids = Tensor::from_i32(&[3, 40, 33], (0..3960).collect());
        let t = eval_on(
            &Kernel::Transpose { dim0: 1, dim1: 2 },
            &[&ids],
            &meta_with(&[3, 33, 40], &[3, 33, 40], Layout::REPLICATED, DType::I32),
            0,
            0,
            ONE,
        )?;
        let tv = t.i32()?;
        for k in 0..3960usize {
            let idx = unravel(k, &[3, 40, 33]);
            assert_eq!(tv[ravel(&[idx[0], idx[2], idx[1]], &[3, 33, 40])], k as i32);
        }
        let sel = vals(&eval(&Kernel::Select { dim: 2, index: 1 }, &[&x], &[2, 3, 5])?);
        for (k, &v) in sel.iter().enumerate() {
            let idx = unravel(k, &[2, 3, 5]);
            assert_eq!(v, xv[ravel(&[idx[0], idx[1], 1, idx[2]], &x.shape)]);
        }
        assert!(eval(&Kernel::Select { dim: 2, index: 4 }, &[&x], &[2, 3, 5]).is_err());
        let dy = Tensor::from_f32(&[2, 3, 5], sel.clone());
        let grad = vals(&eval(&Kernel::SelectGrad { dim: 2, index: 1 }, &[&dy], &[2, 3, 4, 5])?);
        for (k, &v) in grad.iter().enumerate() {
            let want = if unravel(k, &x.shape)[2] == 1 { xv[k] } else { 0.0 };
            assert_eq!(v, want);
        }
        Ok(())
    }

    #[test]
    fn slice_shard_takes_this_devices_block() -> R {
        let mut rng = Rng(11);
        // A fused (3, heads, head) axis split over the heads on mesh axis 1.
        let x = rng.tensor(&[4, 12]);
        let placement = Placement::Shard { dim: 1, outer: 3, inner: 2 };
        let mesh = Mesh::new(1, 2);
        let m = meta_with(&[4, 12], &[4, 6], Layout::new(Placement::Replicate, placement), DType::F32);
        for j in 0..2 {
            let out = eval_on(&Kernel::SliceShard { axis: 1, placement }, &[&x], &m, 0, j, mesh)?;
            let want: Vec<f32> =
                try_logical_indices(&m, Coords::new(0, j, 0), mesh)?.iter().map(|&k| vals(&x)[k as usize]).collect();
            assert_eq!(vals(&out), want);
        }
        // Integer ids, rows split over mesh axis 0 of a 2x2 mesh (already split over columns by axis 1).
        let ids = Tensor::from_i32(&[4, 3], (0..12).collect());
        let m = meta_with(&[4, 3], &[2, 3], Layout::new(Placement::shard(0), Placement::Replicate), DType::I32);
        let kernel = Kernel::SliceShard { axis: 0, placement: Placement::shard(0) };
        let out = eval_on(&kernel, &[&ids], &m, 1, 1, TWO_BY_TWO)?;
        assert_eq!(out.i32()?, &[6, 7, 8, 9, 10, 11]);
        let partial = Kernel::SliceShard { axis: 0, placement: Placement::Partial };
        assert!(eval_on(&partial, &[&ids], &m, 1, 1, TWO_BY_TWO).is_err());
        Ok(())
    }

    #[test]
    fn fill_sets_every_element() -> R {
        assert_eq!(vals(&eval(&Kernel::Fill { value: 1.5 }, &[], &[])?), vec![1.5]);
        assert_eq!(vals(&eval(&Kernel::Fill { value: -2.0 }, &[], &[2, 2])?), vec![-2.0; 4]);
        Ok(())
    }

    // ---- attention ----

    /// softmax(q k^T / sqrt(d)) v per batch and head; q is [batch, sq, heads*d], k and v [batch, sk, heads*d].
    #[allow(clippy::too_many_arguments)]
    fn attention64(
        q: &[f64],
        k: &[f64],
        v: &[f64],
        batch: usize,
        sq: usize,
        sk: usize,
        heads: usize,
        d: usize,
        causal: bool,
    ) -> Vec<f64> {
        let w = heads * d;
        let mut out = vec![0.0; batch * sq * w];
        for b in 0..batch {
            for h in 0..heads {
                for r in 0..sq {
                    let live = if causal { (r + 1).min(sk) } else { sk };
                    let scores: Vec<f64> = (0..live)
                        .map(|c| {
                            (0..d)
                                .map(|e| q[(b * sq + r) * w + h * d + e] * k[(b * sk + c) * w + h * d + e])
                                .sum::<f64>()
                        })
                        .map(|s| s / (d as f64).sqrt())
                        .collect();
                    let p = softmax64(&scores);
                    for e in 0..d {
                        out[(b * sq + r) * w + h * d + e] =
                            (0..live).map(|c| p[c] * v[(b * sk + c) * w + h * d + e]).sum();
                    }
                }
            }
        }
        out
    }

    /// The q, k and v parts of a fused [.., s, 3 * w] tensor.
    fn unfuse(fused: &Tensor, w: usize) -> [Tensor; 3] {
        let v = vals(fused);
        let mut shape = fused.shape.clone();
        if let Some(last) = shape.last_mut() {
            *last = w as u64;
        }
        let part = |p: usize| {
            Tensor::from_f32(&shape, v.chunks(3 * w).flat_map(|row| row[p * w..(p + 1) * w].to_vec()).collect())
        };
        [part(0), part(1), part(2)]
    }

    #[test]
    fn attention_matches_naive_fused_and_unfused() -> R {
        let mut rng = Rng(12);
        let (batch, s, heads, d) = (2usize, 5usize, 2usize, 3usize);
        let w = heads * d;
        let fused = rng.tensor(&[batch as u64, s as u64, 3 * w as u64]);
        let [q, k, v] = unfuse(&fused, w);
        let out_shape = [batch as u64, s as u64, w as u64];
        for causal in [false, true] {
            let want = attention64(&to64(&vals(&q)), &to64(&vals(&k)), &to64(&vals(&v)), batch, s, s, heads, d, causal);
            let kernel = Kernel::Attention { heads: heads as u64, kv_heads: heads as u64, causal, fused: true };
            close(&vals(&eval(&kernel, &[&fused], &out_shape)?), &want, 1e-5)?;
            let kernel = Kernel::Attention { heads: heads as u64, kv_heads: heads as u64, causal, fused: false };
            close(&vals(&eval(&kernel, &[&q, &k, &v], &out_shape)?), &want, 1e-5)?;
        }
        // Keys longer than queries (no mask).
        let (k2, v2) = (rng.tensor(&[batch as u64, 7, w as u64]), rng.tensor(&[batch as u64, 7, w as u64]));
        let want = attention64(&to64(&vals(&q)), &to64(&vals(&k2)), &to64(&vals(&v2)), batch, s, 7, heads, d, false);
        let kernel = Kernel::Attention { heads: heads as u64, kv_heads: heads as u64, causal: false, fused: false };
        close(&vals(&eval(&kernel, &[&q, &k2, &v2], &out_shape)?), &want, 1e-5)?;
        assert!(
            eval(&Kernel::Attention { heads: 4, kv_heads: 4, causal: false, fused: true }, &[&fused], &out_shape)
                .is_err()
        );
        Ok(())
    }

    #[test]
    fn attention_grads_match_finite_differences() -> R {
        let mut rng = Rng(13);
        let (heads, w) = (2u64, 6u64);
        for causal in [false, true] {
            let dy = rng.tensor(&[2, 4, w]);
            let fused = rng.tensor(&[2, 4, 3 * w]);
            let forward = Kernel::Attention { heads, kv_heads: heads, causal, fused: true };
            let grad = Kernel::AttentionGrad { heads, kv_heads: heads, causal, fused: true, wrt: 0 };
            let analytic = eval(&grad, &[&dy, &fused], &fused.shape)?;
            let numeric = numeric_grad(&fused, &vals(&dy), |x| eval(&forward, &[x], &dy.shape))?;
            close_rel(&vals(&analytic), &numeric, 2e-3).map_err(|e| format!("fused causal={causal}: {e}"))?;
            let bad = Kernel::AttentionGrad { heads, kv_heads: heads, causal, fused: true, wrt: 1 };
            assert!(eval(&bad, &[&dy, &fused], &fused.shape).is_err());

            let sk = if causal { 4 } else { 5 };
            let (q, k, v) = (rng.tensor(&[2, 4, w]), rng.tensor(&[2, sk, w]), rng.tensor(&[2, sk, w]));
            let operands = [&q, &k, &v];
            let forward = Kernel::Attention { heads, kv_heads: heads, causal, fused: false };
            for wrt in 0..3u8 {
                let grad = Kernel::AttentionGrad { heads, kv_heads: heads, causal, fused: false, wrt };
                let x = operands[usize::from(wrt)];
                let analytic = eval(&grad, &[&dy, &q, &k, &v], &x.shape)?;
                let numeric = numeric_grad(x, &vals(&dy), |x| {
                    let mut ops = operands;
                    ops[usize::from(wrt)] = x;
                    eval(&forward, &ops, &dy.shape)
                })?;
                close_rel(&vals(&analytic), &numeric, 2e-3).map_err(|e| format!("wrt {wrt} causal={causal}: {e}"))?;
            }
        }
        Ok(())
    }

    /// The gradients of q, k and v of attention64, by the textbook formulas in f64 (no tiling).
    #[allow(clippy::too_many_arguments)]
    fn attention_grads64(
        dy: &[f64],
        [q, k, v]: [&[f64]; 3],
        batch: usize,
        sq: usize,
        sk: usize,
        heads: usize,
        d: usize,
        causal: bool,
    ) -> [Vec<f64>; 3] {
        let w = heads * d;
        let scale = 1.0 / (d as f64).sqrt();
        let (mut dq, mut dk, mut dv) =
            (vec![0.0; batch * sq * w], vec![0.0; batch * sk * w], vec![0.0; batch * sk * w]);
        let (qa, ka) = (
            |b: usize, r: usize, h: usize| (b * sq + r) * w + h * d,
            |b: usize, c: usize, h: usize| (b * sk + c) * w + h * d,
        );
        for b in 0..batch {
            for h in 0..heads {
                for r in 0..sq {
                    let live = if causal { (r + 1).min(sk) } else { sk };
                    let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(a, b)| a * b).sum::<f64>();
                    let scores: Vec<f64> =
                        (0..live).map(|c| dot(&q[qa(b, r, h)..][..d], &k[ka(b, c, h)..][..d]) * scale).collect();
                    let p = softmax64(&scores);
                    let dp: Vec<f64> =
                        (0..live).map(|c| dot(&dy[qa(b, r, h)..][..d], &v[ka(b, c, h)..][..d])).collect();
                    let row_dot: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                    for c in 0..live {
                        let ds = p[c] * (dp[c] - row_dot) * scale;
                        for e in 0..d {
                            dv[ka(b, c, h) + e] += p[c] * dy[qa(b, r, h) + e];
                            dq[qa(b, r, h) + e] += ds * k[ka(b, c, h) + e];
                            dk[ka(b, c, h) + e] += ds * q[qa(b, r, h) + e];
                        }
                    }
                }
            }
        }
        [dq, dk, dv]
    }

    #[test]
    fn attention_over_several_query_tiles_matches_the_untiled_formulas() -> R {
        let mut rng = Rng(14);
        let (batch, heads, d) = (3usize, 2usize, 3usize);
        let w = heads * d;
        let sq = QUERY_TILE + QUERY_TILE / 2 + 3;
        for (causal, sk) in [(true, sq), (false, sq + 9), (false, sq - 20)] {
            let q = rng.tensor(&[batch as u64, sq as u64, w as u64]);
            let (k, v) =
                (rng.tensor(&[batch as u64, sk as u64, w as u64]), rng.tensor(&[batch as u64, sk as u64, w as u64]));
            let dy = rng.tensor(&q.shape);
            let ops64 = [to64(&vals(&q)), to64(&vals(&k)), to64(&vals(&v))];
            let want = attention64(&ops64[0], &ops64[1], &ops64[2], batch, sq, sk, heads, d, causal);
            let forward = Kernel::Attention { heads: heads as u64, kv_heads: heads as u64, causal, fused: false };
            close(&vals(&eval(&forward, &[&q, &k, &v], &q.shape)?), &want, 1e-5)
                .map_err(|e| format!("forward causal={causal} sk={sk}: {e}"))?;
            let ops = [ops64[0].as_slice(), ops64[1].as_slice(), ops64[2].as_slice()];
            let grads = attention_grads64(&to64(&vals(&dy)), ops, batch, sq, sk, heads, d, causal);
            for (wrt, want) in grads.iter().enumerate() {
                let kernel = Kernel::AttentionGrad {
                    heads: heads as u64,
                    kv_heads: heads as u64,
                    causal,
                    fused: false,
                    wrt: wrt as u8,
                };
                let shape = [&q, &k, &v][wrt].shape.clone();
                let got = eval(&kernel, &[&dy, &q, &k, &v], &shape)?;
                close(&vals(&got), want, 1e-5).map_err(|e| format!("wrt {wrt} causal={causal} sk={sk}: {e}"))?;
            }
        }
        Ok(())
    }

    // ---- embeddings ----

    #[test]
    fn embedding_lookup_and_grad_with_an_offset() -> R {
        let mut rng = Rng(14);
        let table = rng.tensor(&[5, 3]);
        let tv = vals(&table);
        let ids = Tensor::from_i32(&[2, 2], vec![3, 7, 9, 5]);
        let offset = Offset { axis: Some(1), block: 5 };
        let mesh = Mesh::new(1, 2);
        let out_meta = meta(&[2, 2, 3]);
        let lookup = Kernel::EmbeddingLookup { offset, masked: true };
        let out = vals(&eval_on(&lookup, &[&ids, &table], &out_meta, 0, 1, mesh)?);
        let row = |r: usize| tv[r * 3..(r + 1) * 3].to_vec();
        let want: Vec<f32> = [vec![0.0; 3], row(2), row(4), row(0)].concat();
        assert_eq!(out, want);
        let unmasked = Kernel::EmbeddingLookup { offset, masked: false };
        let err = eval_on(&unmasked, &[&ids, &table], &out_meta, 0, 1, mesh).err().unwrap_or_default();
        assert!(err.contains("token id 3"), "{err}");

        let ids = Tensor::from_i32(&[2, 2], vec![7, 3, 7, 5]);
        let dy = rng.tensor(&[2, 2, 3]);
        let dv = vals(&dy);
        let grad = Kernel::EmbeddingGrad { offset, masked: true, padding: None };
        let mut stale = Tensor::from_f32(&[5, 3], vec![9.0; 15]);
        let ctx = KernelContext { coords: Coords::new(0, 1, 0), mesh, seed: 0, inputs: &[], output: &meta(&[5, 3]) };
        run(&grad, &[&ids, &dy], &mut stale, &ctx)?;
        let mut want = vec![0.0f64; 15];
        for (slot, local) in [(0usize, 2usize), (2, 2), (3, 0)] {
            for c in 0..3 {
                want[local * 3 + c] += f64::from(dv[slot * 3 + c]);
            }
        }
        close(&vals(&stale), &want, 1e-6)?;
        let unmasked = Kernel::EmbeddingGrad { offset, masked: false, padding: None };
        assert!(eval_on(&unmasked, &[&ids, &dy], &meta(&[5, 3]), 0, 1, mesh).is_err());
        // With 7 the padding id, its row (local row 2 here) gets nothing; the others are unchanged.
        let padded = Kernel::EmbeddingGrad { offset, masked: true, padding: Some(7) };
        run(&padded, &[&ids, &dy], &mut stale, &ctx)?;
        for (k, w) in want.iter_mut().enumerate() {
            if k / 3 == 2 {
                *w = 0.0;
            }
        }
        close(&vals(&stale), &want, 1e-6)?;
        Ok(())
    }

    #[test]
    fn position_lookup_and_grad() -> R {
        let mut rng = Rng(15);
        let table = rng.tensor(&[6, 4]);
        let out = vals(&eval(&Kernel::PositionLookup, &[&table], &[2, 3, 4])?);
        let head = vals(&table)[..12].to_vec();
        assert_eq!(out, [head.clone(), head].concat());
        let dy = rng.tensor(&[2, 3, 4]);
        let dv = to64(&vals(&dy));
        let grad = vals(&eval(&Kernel::PositionGrad, &[&dy], &[6, 4])?);
        let want: Vec<f64> = (0..24).map(|k| if k < 12 { dv[k] + dv[k + 12] } else { 0.0 }).collect();
        close(&grad, &want, 1e-6)?;
        assert!(eval(&Kernel::PositionLookup, &[&table], &[2, 7, 4]).is_err());
        Ok(())
    }

    // ---- layer norm ----

    /// Row statistics of x split along its last dimension into `parts`, summed as an all-reduce would.
    fn ln_stats(parts: &[&Tensor], rows: &[u64], n: u64) -> Result<(Tensor, Tensor), String> {
        let mut sum = Tensor::zeros(DType::F32, rows);
        for p in parts {
            sum = eval(&Kernel::Add, &[&sum, &eval(&Kernel::RowSum, &[p], rows)?], rows)?;
        }
        let mut sqsum = Tensor::zeros(DType::F32, rows);
        for p in parts {
            let local = eval(&Kernel::RowCenteredSquareSum { n }, &[p, &sum], rows)?;
            sqsum = eval(&Kernel::Add, &[&sqsum, &local], rows)?;
        }
        Ok((sum, sqsum))
    }

    fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f64) -> Result<Tensor, String> {
        let n = *x.shape.last().unwrap_or(&1);
        let rows = [x.shape[0], 1];
        let (sum, sqsum) = ln_stats(&[x], &rows, n)?;
        eval(&Kernel::LayerNormApply { n, eps }, &[x, &sum, &sqsum, gamma, beta], &x.shape)
    }

    /// (dx, dgamma, dbeta) of a layer norm over [rows, n].
    fn layer_norm_grads(dy: &Tensor, x: &Tensor, gamma: &Tensor, eps: f64) -> Result<[Tensor; 3], String> {
        let n = *x.shape.last().unwrap_or(&1);
        let rows = [x.shape[0], 1];
        let (sum, sqsum) = ln_stats(&[x], &rows, n)?;
        let sums = eval(&Kernel::LayerNormGradSums { n, eps }, &[dy, x, gamma, &sum, &sqsum], &[x.shape[0], 2])?;
        let dx = eval(&Kernel::LayerNormGradInput { n, eps }, &[dy, x, gamma, &sum, &sqsum, &sums], &x.shape)?;
        let dgamma = eval(&Kernel::LayerNormGradWeight { n, eps }, &[dy, x, &sum, &sqsum], &[n])?;
        let dbeta = eval(&Kernel::SumToLast, &[dy], &[n])?;
        Ok([dx, dgamma, dbeta])
    }

    #[test]
    fn layer_norm_matches_naive() -> R {
        let mut rng = Rng(16);
        let (x, gamma, beta) = (rng.tensor(&[5, 8]), rng.tensor(&[8]), rng.tensor(&[8]));
        let y = layer_norm(&x, &gamma, &beta, 1e-5)?;
        let (g, b) = (to64(&vals(&gamma)), to64(&vals(&beta)));
        let want: Vec<f64> = to64(&vals(&x))
            .chunks(8)
            .flat_map(|row| {
                let mean = row.iter().sum::<f64>() / 8.0;
                let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / 8.0;
                let rstd = 1.0 / (var + 1e-5).sqrt();
                row.iter().enumerate().map(|(c, v)| (v - mean) * rstd * g[c] + b[c]).collect::<Vec<_>>()
            })
            .collect();
        close(&vals(&y), &want, 1e-5)
    }

    #[test]
    fn layer_norm_grads_match_finite_differences() -> R {
        let mut rng = Rng(17);
        let eps = 1e-5;
        let (x, gamma, beta, dy) = (rng.tensor(&[4, 8]), rng.tensor(&[8]), rng.tensor(&[8]), rng.tensor(&[4, 8]));
        let [dx, dgamma, dbeta] = layer_norm_grads(&dy, &x, &gamma, eps)?;
        let w = vals(&dy);
        close_rel(&vals(&dx), &numeric_grad(&x, &w, |x| layer_norm(x, &gamma, &beta, eps))?, 2e-3)?;
        close_rel(&vals(&dgamma), &numeric_grad(&gamma, &w, |g| layer_norm(&x, g, &beta, eps))?, 2e-3)?;
        close_rel(&vals(&dbeta), &numeric_grad(&beta, &w, |b| layer_norm(&x, &gamma, b, eps))?, 2e-3)
    }

    /// Splits [rows, n] into two [rows, n / 2] halves along the last dimension.
    fn halves(t: &Tensor) -> [Tensor; 2] {
        let (_, n) = split_last(&t.shape);
        let v = vals(t);
        let half = |h: usize| {
            let data = v.chunks(n.max(1)).flat_map(|r| r[h * n / 2..(h + 1) * n / 2].to_vec()).collect();
            let mut shape = t.shape.clone();
            if let Some(last) = shape.last_mut() {
                *last /= 2;
            }
            Tensor::from_f32(&shape, data)
        };
        [half(0), half(1)]
    }

    fn join(a: &Tensor, b: &Tensor) -> Vec<f32> {
        let (_, n) = split_last(&a.shape);
        vals(a).chunks(n).zip(vals(b).chunks(n)).flat_map(|(x, y)| [x, y].concat()).collect()
    }

    #[test]
    fn layer_norm_split_in_two_halves_equals_the_whole() -> R {
        let mut rng = Rng(18);
        let (n, eps) = (8u64, 1e-5);
        let (x, gamma, beta, dy) = (rng.tensor(&[3, 8]), rng.tensor(&[8]), rng.tensor(&[8]), rng.tensor(&[3, 8]));
        let whole = layer_norm(&x, &gamma, &beta, eps)?;
        let [whole_dx, whole_dgamma, _] = layer_norm_grads(&dy, &x, &gamma, eps)?;
        let ([x0, x1], [g0, g1], [b0, b1], [dy0, dy1]) = (halves(&x), halves(&gamma), halves(&beta), halves(&dy));
        let rows = [3u64, 1];
        let (sum, sqsum) = ln_stats(&[&x0, &x1], &rows, n)?;
        let apply = Kernel::LayerNormApply { n, eps };
        let y0 = eval(&apply, &[&x0, &sum, &sqsum, &g0, &b0], &x0.shape)?;
        let y1 = eval(&apply, &[&x1, &sum, &sqsum, &g1, &b1], &x1.shape)?;
        close(&join(&y0, &y1), &to64(&vals(&whole)), 1e-5)?;
        let sums_kernel = Kernel::LayerNormGradSums { n, eps };
        let s0 = eval(&sums_kernel, &[&dy0, &x0, &g0, &sum, &sqsum], &[3, 2])?;
        let s1 = eval(&sums_kernel, &[&dy1, &x1, &g1, &sum, &sqsum], &[3, 2])?;
        let sums = eval(&Kernel::Add, &[&s0, &s1], &[3, 2])?;
        let input = Kernel::LayerNormGradInput { n, eps };
        let dx0 = eval(&input, &[&dy0, &x0, &g0, &sum, &sqsum, &sums], &x0.shape)?;
        let dx1 = eval(&input, &[&dy1, &x1, &g1, &sum, &sqsum, &sums], &x1.shape)?;
        close(&join(&dx0, &dx1), &to64(&vals(&whole_dx)), 1e-5)?;
        let weight = Kernel::LayerNormGradWeight { n, eps };
        let dg0 = vals(&eval(&weight, &[&dy0, &x0, &sum, &sqsum], &[4])?);
        let dg1 = vals(&eval(&weight, &[&dy1, &x1, &sum, &sqsum], &[4])?);
        close(&[dg0, dg1].concat(), &to64(&vals(&whole_dgamma)), 1e-5)
    }

    // ---- cross-entropy ----

    struct CeRun {
        loss: f32,
        grad: Vec<f32>,
    }

    /// Cross-entropy over vocabulary blocks of `width` columns on devices j = 0.., all-reducing as the plan would.
    fn cross_entropy_split(blocks: &[Tensor], targets: &Tensor, valid: u64, dloss: f32) -> Result<CeRun, String> {
        let rows = targets.len() as u64;
        let width = *blocks.first().and_then(|b| b.shape.last()).unwrap_or(&0);
        let offset = if blocks.len() > 1 { Offset { axis: Some(1), block: width } } else { Offset::ZERO };
        let mesh = Mesh::new(1, blocks.len() as u64);
        let on = |kernel: &Kernel, inputs: &[&Tensor], shape: &[u64], j: u64| {
            eval_on(kernel, inputs, &meta(shape), 0, j, mesh)
        };
        let mut max = vec![f32::NEG_INFINITY; rows as usize];
        for (j, b) in blocks.iter().enumerate() {
            let local = on(&Kernel::CrossEntropyMax { offset, valid }, &[b], &[rows, 1], j as u64)?;
            for (m, l) in max.iter_mut().zip(vals(&local)) {
                *m = m.max(l);
            }
        }
        let max = Tensor::from_f32(&[rows, 1], max);
        let mut stats = Tensor::zeros(DType::F32, &[rows, 2]);
        for (j, b) in blocks.iter().enumerate() {
            let local = on(&Kernel::CrossEntropyStats { offset, valid }, &[b, targets, &max], &[rows, 2], j as u64)?;
            stats = eval(&Kernel::Add, &[&stats, &local], &[rows, 2])?;
        }
        let counted = eval(&Kernel::CrossEntropyCount, &[targets], &[1])?;
        let loss = eval(&Kernel::CrossEntropyLoss, &[&max, &stats, targets, &counted], &[])?;
        let dl = Tensor::from_f32(&[], vec![dloss]);
        let grad_kernel = Kernel::CrossEntropyGrad { offset, valid };
        let mut grads = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            grads.push(on(&grad_kernel, &[b, targets, &max, &stats, &dl, &counted], &b.shape, j as u64)?);
        }
        let grad = match &grads[..] {
            [g] => vals(g),
            [a, b] => join(a, b),
            _ => return Err("one or two blocks".into()),
        };
        Ok(CeRun { loss: vals(&loss)[0], grad })
    }

    #[test]
    fn cross_entropy_matches_naive_and_its_grad_finite_differences() -> R {
        let mut rng = Rng(19);
        let logits = Tensor::from_f32(&[6, 7], rng.values(42).iter().map(|v| 4.0 * v).collect());
        let targets = Tensor::from_i32(&[6], vec![0, 6, 3, 3, 1, 5]);
        let run = cross_entropy_split(std::slice::from_ref(&logits), &targets, 7, 0.7)?;
        let lv = to64(&vals(&logits));
        let want: f64 = lv
            .chunks(7)
            .zip(targets.i32()?)
            .map(|(row, &t)| {
                let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                max + row.iter().map(|l| (l - max).exp()).sum::<f64>().ln() - row[t as usize]
            })
            .sum::<f64>()
            / 6.0;
        close(&[run.loss], &[want], 1e-6)?;
        let numeric = numeric_grad(&logits, &[0.7], |x| {
            let r = cross_entropy_split(std::slice::from_ref(x), &targets, 7, 0.7)?;
            Ok(Tensor::from_f32(&[], vec![r.loss]))
        })?;
        close_rel(&run.grad, &numeric, 2e-3)
    }

    #[test]
    fn cross_entropy_ignores_targets_of_minus_100_in_the_mean_and_the_gradient() -> R {
        // Equal logits over 4 columns: every counted row loses ln 4, so the mean is ln 4 whatever the
        // number of ignored rows; a mean over all 3 rows would be 2/3 ln 4.
        let zeros = Tensor::from_f32(&[3, 4], vec![0.0; 12]);
        let targets = Tensor::from_i32(&[3], vec![2, IGNORE_INDEX, 0]);
        let run = cross_entropy_split(std::slice::from_ref(&zeros), &targets, 4, 1.0)?;
        close(&[run.loss], &[4f64.ln()], 1e-7)?;
        // d loss / d logit = (1/4 - onehot) / 2 on counted rows, 0 on the ignored one.
        let want = [0.125, 0.125, -0.375, 0.125, 0.0, 0.0, 0.0, 0.0, -0.375, 0.125, 0.125, 0.125];
        close(&run.grad, &want, 1e-7)?;
        // Random logits, split over two devices: the mean over the counted rows, and finite differences.
        let mut rng = Rng(23);
        let logits = Tensor::from_f32(&[5, 6], rng.values(30).iter().map(|v| 3.0 * v).collect());
        let targets = Tensor::from_i32(&[5], vec![IGNORE_INDEX, 5, 0, IGNORE_INDEX, 3]);
        let run = cross_entropy_split(&halves(&logits), &targets, 6, 0.9)?;
        let want: f64 = to64(&vals(&logits))
            .chunks(6)
            .zip(targets.i32()?)
            .filter(|(_, t)| **t != IGNORE_INDEX)
            .map(|(row, &t)| {
                let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                max + row.iter().map(|l| (l - max).exp()).sum::<f64>().ln() - row[t as usize]
            })
            .sum::<f64>()
            / 3.0;
        close(&[run.loss], &[want], 1e-6)?;
        let numeric = numeric_grad(&logits, &[0.9], |x| {
            let r = cross_entropy_split(&halves(x), &targets, 6, 0.9)?;
            Ok(Tensor::from_f32(&[], vec![r.loss]))
        })?;
        close_rel(&run.grad, &numeric, 2e-3)?;
        // Every target ignored: loss 0 and no gradient (PyTorch would give NaN).
        let none = Tensor::from_i32(&[3], vec![IGNORE_INDEX; 3]);
        let run = cross_entropy_split(std::slice::from_ref(&zeros), &none, 4, 1.0)?;
        close(&[run.loss], &[0.0], 0.0)?;
        close(&run.grad, &[0.0; 12], 0.0)
    }

    #[test]
    fn cross_entropy_over_a_split_padded_vocabulary_equals_the_whole() -> R {
        let mut rng = Rng(20);
        // Nine real columns padded to ten, split 5 + 5; the padding column holds a huge logit.
        let logits = rng.tensor(&[4, 9]);
        let lv = vals(&logits);
        let padded: Vec<f32> = lv.chunks(9).flat_map(|r| [r, &[100.0]].concat()).collect();
        let padded = Tensor::from_f32(&[4, 10], padded);
        let targets = Tensor::from_i32(&[4], vec![8, 0, 4, 5]);
        let whole = cross_entropy_split(&[logits], &targets, 9, 1.3)?;
        let split = cross_entropy_split(&halves(&padded), &targets, 9, 1.3)?;
        close(&[split.loss], &[f64::from(whole.loss)], 1e-6)?;
        let want: Vec<f64> = whole.grad.chunks(9).flat_map(|r| [to64(r), vec![0.0]].concat()).collect();
        close(&split.grad, &want, 1e-6)?;
        for bad in [9, -1] {
            let targets = Tensor::from_i32(&[4], vec![0, bad, 1, 2]);
            let err = cross_entropy_split(&halves(&padded), &targets, 9, 1.0).err().unwrap_or_default();
            assert!(err.contains(&format!("target {bad}")), "{err}");
        }
        Ok(())
    }

    // ---- optimizer ----

    fn settings(kind: OptimizerKind) -> OptimizerSettings {
        OptimizerSettings { kind, lr: 0.1, weight_decay: 0.01, momentum: 0.9, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
    }

    #[test]
    fn sgd_with_momentum_and_weight_decay_matches_torch() -> R {
        let (p0, g1, g2) = ([0.5f32, -1.0, 2.0], [0.1f32, 0.2, -0.3], [-0.4f32, 0.05, 0.6]);
        let s = settings(OptimizerKind::Sgd);
        let mut param = Tensor::from_f32(&[3], p0.to_vec());
        let (mut buf, mut unused) = (Tensor::zeros(DType::F32, &[3]), Tensor::zeros(DType::F32, &[0]));
        optimizer_step(&mut param, &Tensor::from_f32(&[3], g1.to_vec()), &mut buf, &mut unused, &s, 1)?;
        optimizer_step(&mut param, &Tensor::from_f32(&[3], g2.to_vec()), &mut buf, &mut unused, &s, 2)?;
        let (lr, wd, mu) = (0.1, 0.01, 0.9);
        let mut want = Vec::new();
        for k in 0..3 {
            let p = f64::from(p0[k]);
            let b1 = f64::from(g1[k]) + wd * p;
            let p1 = p - lr * b1;
            let b2 = mu * b1 + f64::from(g2[k]) + wd * p1;
            want.push(p1 - lr * b2);
        }
        close(&vals(&param), &want, 1e-6)
    }

    #[test]
    fn adamw_matches_torch() -> R {
        let (p0, g1, g2) = ([0.5f32, -1.0, 2.0], [0.1f32, 0.2, -0.3], [-0.4f32, 0.05, 0.6]);
        let s = OptimizerSettings { lr: 1e-3, ..settings(OptimizerKind::AdamW) };
        let mut param = Tensor::from_f32(&[3], p0.to_vec());
        let (mut m, mut v) = (Tensor::zeros(DType::F32, &[3]), Tensor::zeros(DType::F32, &[3]));
        optimizer_step(&mut param, &Tensor::from_f32(&[3], g1.to_vec()), &mut m, &mut v, &s, 1)?;
        optimizer_step(&mut param, &Tensor::from_f32(&[3], g2.to_vec()), &mut m, &mut v, &s, 2)?;
        let (lr, wd, b1, b2, eps) = (1e-3, 0.01, 0.9f64, 0.999f64, 1e-8);
        let mut want = Vec::new();
        for k in 0..3 {
            let (mut p, mut mk, mut vk) = (f64::from(p0[k]), 0.0, 0.0);
            for (t, g) in [(1, f64::from(g1[k])), (2, f64::from(g2[k]))] {
                p *= 1.0 - lr * wd;
                mk = b1 * mk + (1.0 - b1) * g;
                vk = b2 * vk + (1.0 - b2) * g * g;
                let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
                p -= lr / bc1 * mk / (vk.sqrt() / bc2.sqrt() + eps);
            }
            want.push(p);
        }
        close(&vals(&param), &want, 1e-6)
    }

    #[test]
    fn optimizer_rejects_bad_arguments() {
        let s = settings(OptimizerKind::AdamW);
        let mut p = Tensor::zeros(DType::F32, &[3]);
        let (mut m, mut v) = (Tensor::zeros(DType::F32, &[3]), Tensor::zeros(DType::F32, &[3]));
        assert!(optimizer_step(&mut p, &Tensor::zeros(DType::F32, &[3]), &mut m, &mut v, &s, 0).is_err());
        assert!(optimizer_step(&mut p, &Tensor::zeros(DType::F32, &[2]), &mut m, &mut v, &s, 1).is_err());
        let mut short = Tensor::zeros(DType::F32, &[2]);
        assert!(optimizer_step(&mut p, &Tensor::zeros(DType::F32, &[3]), &mut m, &mut short, &s, 1).is_err());
    }

    #[test]
    fn bad_plans_give_errors_not_panics() {
        let x = Tensor::zeros(DType::F32, &[2, 3]);
        let ids = Tensor::zeros(DType::I32, &[2, 3]);
        assert!(eval(&Kernel::OptimizerStep, &[&x], &[2, 3]).is_err());
        assert!(eval(&Kernel::Softmax, &[&ids], &[2, 3]).is_err());
        assert!(eval(&Kernel::Softmax, &[&x, &x], &[2, 3]).is_err());
        assert!(eval(&Kernel::Gelu { approximate: true }, &[&x], &[3, 3]).is_err());
        assert!(eval(&Kernel::Transpose { dim0: 0, dim1: 5 }, &[&x], &[3, 2]).is_err());
        assert!(eval(&Kernel::Reshape, &[&x], &[6]).is_ok());
        let broken = Tensor { shape: vec![2, 3], data: Data::F32(vec![0.0; 5]) };
        assert!(eval(&Kernel::Scale { factor: 2.0 }, &[&broken], &[2, 3]).is_err());
        assert!(
            eval(&Kernel::Attention { heads: 0, kv_heads: 0, causal: false, fused: true }, &[&x], &[2, 1]).is_err()
        );
        assert!(eval(&Kernel::LayerNormApply { n: 0, eps: 1e-5 }, &[&x, &x, &x, &x, &x], &[2, 3]).is_err());
    }
}
