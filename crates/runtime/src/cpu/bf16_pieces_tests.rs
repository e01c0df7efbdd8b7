//! The CPU's piecewise bf16 emulation against widening whole tensors: every kernel that
//! `bf16_in_pieces` cuts into bounded pieces gives the bits the f32 kernel gives on whole widened
//! operands, rounded once, on operands several pieces large.

use super::bf16_in_pieces;
use super::blas;
use super::kernels;
use crate::bf16::{self, PIECE_ELEMENTS};
use crate::settings::KernelContext;
use crate::view::{Shape, View, ViewData, ViewMut, ViewMutData};
use optimus_plan::init::mix64;
use optimus_plan::layout::Layout;
use optimus_plan::types::DType;
use optimus_plan::{Buffer, BufferId, Coords, Kernel, Mesh, Offset, Role};

/// An operand: bf16 bits, f32 values or i32 ids, with its shape.
enum Operand {
    Bf16(Vec<u64>, Vec<u16>),
    F32(Vec<u64>, Vec<f32>),
    I32(Vec<u64>, Vec<i32>),
}

impl Operand {
    fn view(&self) -> View<'_> {
        match self {
            Operand::Bf16(s, v) => View { shape: Shape(s), data: ViewData::Bf16(v) },
            Operand::F32(s, v) => View { shape: Shape(s), data: ViewData::F32(v) },
            Operand::I32(s, v) => View { shape: Shape(s), data: ViewData::I32(v) },
        }
    }
}

/// Deterministic values in [-1, 1) for a seed.
fn values(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64).map(|k| (mix64(seed * 1_000_003 + k) >> 40) as f32 / (1u64 << 23) as f32 - 1.0).collect()
}

fn bf16_of(seed: u64, shape: &[u64]) -> Operand {
    let n = shape.iter().product::<u64>() as usize;
    Operand::Bf16(shape.to_vec(), values(seed, n).iter().map(|&x| bf16::round(x)).collect())
}

fn f32_of(shape: &[u64], v: Vec<f32>) -> Operand {
    Operand::F32(shape.to_vec(), v)
}

fn meta(shape: &[u64], dtype: DType) -> Buffer {
    Buffer {
        id: BufferId(0),
        name: "out".into(),
        dtype,
        logical_shape: shape.to_vec(),
        layout: Layout::REPLICATED,
        shape: shape.to_vec(),
        role: Role::Workspace,
    }
}

/// Runs `kernel` piecewise and whole (widened) into a bf16 output of `out_shape` holding `initial`,
/// and asserts the pieces were taken and the bits agree.
fn same_bits(kernel: &Kernel, operands: &[Operand], out_shape: &[u64], initial: u16) {
    let views: Vec<View> = operands.iter().map(Operand::view).collect();
    let refs: Vec<&View> = views.iter().collect();
    let out_meta = meta(out_shape, DType::Bf16);
    let input_meta: Vec<Buffer> = views.iter().map(|v| meta(v.shape.as_slice(), DType::Bf16)).collect();
    let input_refs: Vec<&Buffer> = input_meta.iter().collect();
    let ctx = KernelContext {
        coords: Coords::new(0, 0, 0),
        mesh: Mesh::new(1, 1),
        seed: 7,
        inputs: &input_refs,
        output: &out_meta,
    };
    let n = out_shape.iter().product::<u64>() as usize;
    let mut whole = vec![initial; n];
    let mut out = ViewMut { shape: Shape(out_shape), data: ViewMutData::Bf16(&mut whole) };
    let run = |ins: &[&View], out: &mut ViewMut| kernels::run_views(kernel, ins, out, &ctx);
    // As the backend runs them: the emulation's products in faer.
    blas::faer_only(|| bf16::with_widened(&refs, &mut out, kernel.reads_its_output(), run))
        .expect("the whole kernel runs");
    let mut pieces = vec![initial; n];
    let mut out = ViewMut { shape: Shape(out_shape), data: ViewMutData::Bf16(&mut pieces) };
    blas::faer_only(|| bf16_in_pieces(kernel, &refs, &mut out, &ctx))
        .expect("the kernel is cut into pieces")
        .expect("the pieces run");
    let differ = whole.iter().zip(&pieces).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "{kernel:?}: {differ} of {n} elements differ");
}

/// Enough rows of `width` for three pieces or more.
fn rows_for(width: u64) -> u64 {
    3 * PIECE_ELEMENTS as u64 / width + 5
}

#[test]
fn products_in_tiles_give_the_whole_products_bits() {
    let (m, k, n) = (rows_for(96), 96u64, 80u64);
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        for accumulate in [false, true] {
            let a = if ta { bf16_of(1, &[k, m]) } else { bf16_of(1, &[m, k]) };
            let b = if tb { bf16_of(2, &[n, k]) } else { bf16_of(2, &[k, n]) };
            let kernel = Kernel::MatMul { transpose_a: ta, transpose_b: tb, accumulate };
            same_bits(&kernel, &[a, b], &[m, n], bf16::round(0.25));
        }
    }
}

#[test]
fn products_whose_output_is_large_in_both_dimensions_agree() {
    // A^T B over many shared rows into a 300 x 400 output: tiles of the output and pieces of the
    // shared rows.
    let (rows, m, n) = (700u64, 300u64, 400u64);
    let kernel = Kernel::MatMul { transpose_a: true, transpose_b: false, accumulate: false };
    same_bits(&kernel, &[bf16_of(3, &[rows, m]), bf16_of(4, &[rows, n])], &[m, n], 0);
    let kernel = Kernel::MatMul { transpose_a: false, transpose_b: true, accumulate: false };
    same_bits(&kernel, &[bf16_of(5, &[n, 64]), bf16_of(6, &[m * 3, 64])], &[n, m * 3], 0);
}

#[test]
fn products_split_over_a_long_shared_dimension_agree() {
    // 3000 shared rows into an 80 x 70 output: pieces of the shared dimension, summed in f32.
    let kernel = Kernel::MatMul { transpose_a: true, transpose_b: false, accumulate: false };
    same_bits(&kernel, &[bf16_of(29, &[3000, 80]), bf16_of(30, &[3000, 70])], &[80, 70], 0);
    // 5000 shared rows into a 48 x 40 output: pieces of 2048.
    same_bits(&kernel, &[bf16_of(31, &[5000, 48]), bf16_of(32, &[5000, 40])], &[48, 40], 0);
    let kernel = Kernel::MatMul { transpose_a: false, transpose_b: false, accumulate: true };
    same_bits(&kernel, &[bf16_of(33, &[60, 3500]), bf16_of(34, &[3500, 50])], &[60, 50], bf16::round(0.5));
}

#[test]
fn batched_kernels_in_pieces_of_matrices_agree() {
    let (b, s, d) = (24u64, 64u64, 48u64);
    same_bits(&Kernel::BatchedMatMul, &[bf16_of(7, &[b, s, d]), bf16_of(8, &[b, d, s])], &[b, s, s], 0);
    same_bits(&Kernel::CausalMask, &[bf16_of(9, &[b, 2, s, s])], &[b, 2, s, s], 0);
    same_bits(&Kernel::CausalMaskGrad, &[bf16_of(10, &[b, 2, s, s])], &[b, 2, s, s], 0);
    let (heads, head) = (4u64, 16u64);
    let fused_in = [b, s, 3 * heads * head];
    let out = [b, s, heads * head];
    for causal in [false, true] {
        let attention = Kernel::Attention { heads, kv_heads: heads, causal, fused: true };
        same_bits(&attention, &[bf16_of(11, &fused_in)], &out, 0);
        let grad = Kernel::AttentionGrad { heads, kv_heads: heads, causal, fused: true, wrt: 0 };
        same_bits(&grad, &[bf16_of(12, &out), bf16_of(13, &fused_in)], &fused_in, 0);
    }
    let qkv = [b, s, heads * head];
    let grad = Kernel::AttentionGrad { heads, kv_heads: heads, causal: true, fused: false, wrt: 1 };
    same_bits(&grad, &[bf16_of(14, &qkv), bf16_of(15, &qkv), bf16_of(16, &qkv), bf16_of(17, &qkv)], &qkv, 0);
}

#[test]
fn dropout_in_pieces_of_rows_keeps_its_mask() {
    let shape = [rows_for(40), 40];
    for kernel in [Kernel::Dropout { p: 0.3, key: 5 }, Kernel::DropoutGrad { p: 0.5, key: 9 }] {
        same_bits(&kernel, &[bf16_of(18, &shape)], &shape, 0);
    }
}

#[test]
fn sums_over_rows_in_pieces_agree() {
    let (rows, width) = (rows_for(700) / 2, 700u64);
    same_bits(&Kernel::SumToLast, &[bf16_of(19, &[rows, width])], &[width], 0);
    // LayerNorm's weight gradient reads float32 sums; their values need only be plausible.
    let sum = f32_of(&[rows, 1], values(20, rows as usize));
    let sqsum = f32_of(&[rows, 1], values(21, rows as usize).iter().map(|v| v.abs() * 700.0 + 1.0).collect());
    let kernel = Kernel::LayerNormGradWeight { n: 700, eps: 1e-5 };
    same_bits(&kernel, &[bf16_of(22, &[rows, width]), bf16_of(23, &[rows, width]), sum, sqsum], &[width], 0);
    // Positions: [batch, seq, width] into a [context, width] table of more rows than seq.
    same_bits(&Kernel::PositionGrad, &[bf16_of(24, &[6, 300, 256])], &[400, 256], 0);
}

#[test]
fn embedding_gradients_and_lookups_agree() {
    let (vocab, width, tokens) = (1500u64, 96u64, 2000u64);
    let ids: Vec<i32> = (0..tokens).map(|t| (mix64(t) % (vocab + 200)) as i32).collect();
    let ids_op = || Operand::I32(vec![tokens / 4, 4], ids.clone());
    // Ids past this device's rows are skipped when masked.
    let masked = Kernel::EmbeddingGrad { offset: Offset::ZERO, masked: true, padding: None };
    same_bits(&masked, &[ids_op(), bf16_of(25, &[tokens / 4, 4, width])], &[vocab, width], 0);
    let in_range: Vec<i32> = ids.iter().map(|&id| id % vocab as i32).collect();
    let unmasked = Kernel::EmbeddingGrad { offset: Offset::ZERO, masked: false, padding: None };
    let in_range_op = Operand::I32(vec![tokens / 4, 4], in_range);
    same_bits(&unmasked, &[in_range_op, bf16_of(26, &[tokens / 4, 4, width])], &[vocab, width], 0);
}

#[test]
fn row_kernels_split_as_before() {
    let shape = [rows_for(64), 64];
    same_bits(&Kernel::Gelu { approximate: true }, &[bf16_of(27, &shape)], &shape, 0);
    same_bits(&Kernel::Softmax, &[bf16_of(28, &shape)], &shape, 0);
}

#[test]
fn cache_kernels_on_bf16_read_and_write_only_the_steps_rows_and_agree() {
    let (rows, context, heads, kv_heads, head) = (3u64, 40u64, 4u64, 2u64, 8u64);
    let at = || Operand::I32(vec![1], vec![17]);
    let (q_width, kv_width) = (heads * head, kv_heads * head);
    let cache = [rows, context, kv_width];
    // A prompt of 5 rows at position 17, and a decoding step of one.
    for seq in [5u64, 1] {
        let grouped = Kernel::CachedAttention { heads, kv_heads, fused: false };
        let q = bf16_of(40 + seq, &[rows, seq, q_width]);
        same_bits(&grouped, &[q, bf16_of(41, &cache), bf16_of(42, &cache), at()], &[rows, seq, q_width], 0);
        let fused = Kernel::CachedAttention { heads: kv_heads, kv_heads, fused: true };
        let qkv = bf16_of(43 + seq, &[rows, seq, 3 * kv_width]);
        same_bits(&fused, &[qkv, bf16_of(44, &cache), bf16_of(45, &cache), at()], &[rows, seq, kv_width], 0);
        // A cache write keeps the cache's other rows: bf16 bits moved, or f32 rows rounded.
        let write = Kernel::CacheWrite { part: 2, parts: 3 };
        same_bits(&write, &[bf16_of(46, &[rows, seq, 3 * kv_width]), at()], &cache, bf16::round(0.75));
        let wide = f32_of(&[rows, seq, 3 * kv_width], values(47, (rows * seq * 3 * kv_width) as usize));
        same_bits(&write, &[wide, at()], &cache, bf16::round(-0.5));
    }
}
