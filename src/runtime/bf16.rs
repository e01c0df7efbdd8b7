//! bf16 storage on the host: conversions between f32 and bf16 bit patterns (round to nearest, ties
//! to even; NaN stays a quiet NaN, infinities stay infinite, values past the bf16 range round to
//! infinity), and the widening that lets f32 kernels run on bf16 buffers: bf16 inputs are widened to
//! f32 scratch copies, the kernel computes in f32, and its f32 result is rounded once into the bf16
//! output. Collectives on bf16 buffers exchange the widened f32 values in the same way.

use super::tensor::Tensor;
use super::view::{Shape, View, ViewData, ViewMut, ViewMutData};
use half::bf16;
use std::borrow::Cow;

/// The bf16 nearest to `x` (ties to even), as its bits.
pub fn round(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// The f32 value of a bf16 bit pattern (exact).
pub fn widen_one(bits: u16) -> f32 {
    bf16::from_bits(bits).to_f32()
}

/// Every element widened to f32.
pub fn widen(bits: &[u16]) -> Vec<f32> {
    bits.iter().map(|&b| widen_one(b)).collect()
}

/// Rounds `values` into `bits` element by element (equal lengths).
pub fn round_into(values: &[f32], bits: &mut [u16]) {
    for (b, &x) in bits.iter_mut().zip(values) {
        *b = round(x);
    }
}

/// An f32 copy of a bf16 view, or `None` for a view that needs no widening.
pub fn widened(view: &View) -> Option<Tensor> {
    match view.data {
        ViewData::Bf16(bits) => Some(Tensor::from_f32(view.shape.as_slice(), widen(bits))),
        _ => None,
    }
}

/// An f32 scratch for a bf16 output (holding its widened contents when `keep` is set, for kernels
/// that accumulate into their output), or `None` for an output that needs none.
pub fn scratch_for(out: &ViewMut, keep: bool) -> Option<Tensor> {
    match &out.data {
        ViewMutData::Bf16(bits) => {
            let values = if keep { widen(bits) } else { vec![0.0; bits.len()] };
            Some(Tensor::from_f32(out.shape.as_slice(), values))
        }
        _ => None,
    }
}

/// Rounds an f32 scratch into the bf16 output it stands for.
pub fn store(scratch: &Tensor, out: &mut ViewMut) -> Result<(), String> {
    let values = scratch.f32()?;
    match &mut out.data {
        ViewMutData::Bf16(bits) if bits.len() == values.len() => {
            round_into(values, bits);
            Ok(())
        }
        _ => Err("a bf16 scratch does not match its output".into()),
    }
}

/// Runs `f` (an f32 kernel) on `inputs` and `out`, widening bf16 operands to f32 and rounding a bf16
/// result once at the end. Operands without bf16 go straight through.
pub fn with_widened<R>(
    inputs: &[&View],
    out: &mut ViewMut,
    out_is_read: bool,
    f: impl FnOnce(&[&View], &mut ViewMut) -> Result<R, String>,
) -> Result<R, String> {
    let wide: Vec<Option<Tensor>> = inputs.iter().map(|v| widened(v)).collect();
    let views: Vec<View> = inputs.iter().zip(&wide).map(|(v, w)| w.as_ref().map_or(**v, Tensor::view)).collect();
    let refs: Vec<&View> = views.iter().collect();
    match scratch_for(out, out_is_read) {
        Some(mut scratch) => {
            let result = f(&refs, &mut scratch.view_mut())?;
            store(&scratch, out)?;
            Ok(result)
        }
        None => f(&refs, out),
    }
}

/// An f32 matrix product on (A, B, out) views, accumulating into `out` when told.
pub type Product<'k> = dyn Fn(&[&View], &mut ViewMut, bool) -> Result<(), String> + 'k;

/// Elements widened per piece when a product is done piecewise (1 Mi elements: 4 MiB of f32).
const PIECE_ELEMENTS: usize = 1 << 20;

/// `rows` x `cols` rows `first..first + rows` of a floating-point view, as f32 (borrowed when the view
/// is f32 already).
fn rows_f32<'v>(view: &'v View, first: usize, rows: usize, cols: usize) -> Result<Cow<'v, [f32]>, String> {
    let range = first * cols..(first + rows) * cols;
    match view.data {
        ViewData::F32(v) => v.get(range).map(Cow::Borrowed),
        ViewData::Bf16(v) => v.get(range).map(|b| Cow::Owned(widen(b))),
        ViewData::I32(_) => None,
    }
    .ok_or_else(|| "a product operand is not a floating-point block of its shape".to_string())
}

/// `first` and the number of rows of each piece of `rows` rows of `cols` elements.
fn pieces(rows: usize, cols: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = (PIECE_ELEMENTS / cols.max(1)).max(1);
    (0..rows).step_by(step).map(move |first| (first, step.min(rows - first)))
}

/// A matrix product with a bf16 operand, piece by piece so that only a piece of the large operand is
/// widened at a time (the memory of the CPU emulation stays near the plan's): `A B` in pieces of A's
/// rows and the output's; `A^T B` in pieces of the rows A and B share, accumulated in an f32 copy of the
/// output and rounded once. `run` is the f32 product on (A, B, out) views. Returns `None` for the
/// products it does not split (A^T B^T), which the caller widens whole.
pub fn product_in_pieces(
    inputs: &[&View],
    out: &mut ViewMut,
    (ta, tb, accumulate): (bool, bool, bool),
    run: &Product,
) -> Option<Result<(), String>> {
    let [a, b] = *inputs else { return None };
    let (cols_a, rows_a) = last_and_rows(a.shape.as_slice());
    let (cols_b, rows_b) = last_and_rows(b.shape.as_slice());
    let (n, m) = last_and_rows(out.shape.as_slice());
    match (ta, tb) {
        (false, _) => Some(by_output_rows(a, b, out, (rows_a, cols_a, m, n), accumulate, run)),
        (true, false) => Some(by_shared_rows(a, b, out, (rows_a, cols_a, rows_b, cols_b), accumulate, run)),
        (true, true) => None,
    }
}

/// The last dimension and the product of the others.
fn last_and_rows(shape: &[u64]) -> (usize, usize) {
    let last = shape.last().copied().unwrap_or(1) as usize;
    (last, shape.iter().rev().skip(1).product::<u64>() as usize)
}

/// out[rows] = A[rows] op(B), a piece of rows at a time.
fn by_output_rows(
    a: &View,
    b: &View,
    out: &mut ViewMut,
    (rows, cols, m, n): (usize, usize, usize, usize),
    accumulate: bool,
    run: &Product,
) -> Result<(), String> {
    if rows != m {
        return Err(format!("A has {rows} rows but the output {m}"));
    }
    let whole_b = rows_f32(b, 0, last_and_rows(b.shape.as_slice()).1, last_and_rows(b.shape.as_slice()).0)?;
    let b_view = View { shape: b.shape, data: ViewData::F32(&whole_b) };
    for (first, count) in pieces(rows, cols.max(n)) {
        let a_piece = rows_f32(a, first, count, cols)?;
        let a_shape = [count as u64, cols as u64];
        let a_view = View { shape: Shape(&a_shape), data: ViewData::F32(&a_piece) };
        let out_shape = [count as u64, n as u64];
        let mut piece =
            if accumulate { rows_f32(&out.as_view(), first, count, n)?.into_owned() } else { vec![0.0; count * n] };
        run(
            &[&a_view, &b_view],
            &mut ViewMut { shape: Shape(&out_shape), data: ViewMutData::F32(&mut piece) },
            accumulate,
        )?;
        write_rows(out, first * n, &piece)?;
    }
    Ok(())
}

/// out = A^T op(B) summed over the rows A and B share, a piece of rows at a time, in f32.
fn by_shared_rows(
    a: &View,
    b: &View,
    out: &mut ViewMut,
    (rows, cols_a, rows_b, cols_b): (usize, usize, usize, usize),
    accumulate: bool,
    run: &Product,
) -> Result<(), String> {
    if rows != rows_b {
        return Err(format!("A^T B needs as many rows in A ({rows}) as in B ({rows_b})"));
    }
    let mut total = match (accumulate, &out.data) {
        (true, ViewMutData::Bf16(bits)) => widen(bits),
        (true, ViewMutData::F32(v)) => v.to_vec(),
        _ => vec![0.0; out.len()],
    };
    let out_shape = out.shape;
    for (k, (first, count)) in pieces(rows, cols_a.max(cols_b)).enumerate() {
        let (a_piece, b_piece) = (rows_f32(a, first, count, cols_a)?, rows_f32(b, first, count, cols_b)?);
        let (a_shape, b_shape) = ([count as u64, cols_a as u64], [count as u64, cols_b as u64]);
        let a_view = View { shape: Shape(&a_shape), data: ViewData::F32(&a_piece) };
        let b_view = View { shape: Shape(&b_shape), data: ViewData::F32(&b_piece) };
        let mut sum = ViewMut { shape: out_shape, data: ViewMutData::F32(&mut total) };
        run(&[&a_view, &b_view], &mut sum, accumulate || k > 0)?;
    }
    write_rows(out, 0, &total)
}

/// An f32 kernel on views.
pub type KernelOnViews<'k> = dyn Fn(&[&View], &mut ViewMut) -> Result<(), String> + 'k;

/// An f32 collective on a send view and a receive view.
pub type ExchangeOnViews<'k> = dyn FnMut(&[&View], &mut ViewMut) -> Result<(), String> + 'k;

/// The inputs a row-separable kernel reads row by row (`true`) or whole (`false`): each output row
/// depends only on the same rows of the former. `None` for the kernels that are not split this way
/// (their rows depend on their position, as the causal mask and dropout do, or they sum over rows).
pub fn row_split(kernel: &crate::plan::Kernel) -> Option<&'static [bool]> {
    use crate::plan::Kernel as K;
    Some(match kernel {
        K::Gelu { .. } | K::Silu | K::Softmax | K::Scale { .. } | K::RowSum | K::CrossEntropyMax { .. } | K::Cast => {
            &[true]
        }
        K::GeluGrad { .. } | K::SiluGrad | K::SoftmaxGrad | K::Add | K::RowCenteredSquareSum { .. } => &[true, true],
        K::Mul => &[true, true],
        K::RowSquareSum => &[true],
        K::RmsNormApply { .. } => &[true, true, false],
        K::RmsNormGradSum => &[true, true, false],
        K::RmsNormGradInput { .. } => &[true, true, false, true, true],
        K::BiasAdd => &[true, false],
        K::CrossEntropyStats { .. } => &[true, true, true],
        K::CrossEntropyGrad { .. } => &[true, true, true, true, false, false],
        K::LayerNormApply { .. } => &[true, true, true, false, false],
        K::LayerNormGradSums { .. } => &[true, true, false, true, true],
        K::LayerNormGradInput { .. } => &[true, true, false, true, true, true],
        _ => return None,
    })
}

/// Runs a row-separable kernel (see [`row_split`]) a piece of rows at a time, widening only a piece of
/// each bf16 operand and rounding each piece of a bf16 output, so that the CPU emulation of bf16 needs
/// little more memory than the plan. `None` when the operands are not whole rows of the output's row
/// count (the caller then widens them whole).
pub fn by_rows(inputs: &[&View], out: &mut ViewMut, split: &[bool], run: &KernelOnViews) -> Option<Result<(), String>> {
    let (width, rows) = last_and_rows(out.shape.as_slice());
    if rows < 2 || split.len() != inputs.len() {
        return None;
    }
    let widths: Option<Vec<usize>> = inputs
        .iter()
        .zip(split)
        .map(|(v, &s)| if !s { Some(0) } else { (v.len() % rows == 0).then(|| v.len() / rows) })
        .collect();
    let widths = widths?;
    let whole: Vec<Option<Tensor>> =
        inputs.iter().zip(split).map(|(v, &s)| if s { None } else { widened(v) }).collect();
    let widest = widths.iter().copied().chain([width]).max().unwrap_or(1);
    Some(pieces(rows, widest).try_for_each(|(first, count)| {
        let parts: Vec<Part> = inputs
            .iter()
            .zip(&widths)
            .zip(&whole)
            .map(|((v, &w), whole)| match whole {
                Some(t) => Ok(Part::Whole(t.view())),
                None if w == 0 => Ok(Part::Whole(**v)),
                None => Part::rows(v, first, count, w),
            })
            .collect::<Result<_, _>>()?;
        let views: Vec<View> = parts.iter().map(Part::view).collect();
        let refs: Vec<&View> = views.iter().collect();
        let mut piece = vec![0.0f32; count * width];
        let shape = [count as u64, width as u64];
        run(&refs, &mut ViewMut { shape: Shape(&shape), data: ViewMutData::F32(&mut piece) })?;
        write_rows(out, first * width, &piece)
    }))
}

/// An element-by-element collective (`f` on f32 send and receive slices) run a piece at a time on
/// buffers of which one at least is bf16: each piece of the send buffer is widened, the receive piece
/// widened (a member that receives nothing keeps its contents), and the result rounded back. `None`
/// when neither buffer is bf16 or their sizes differ (the caller handles those whole).
pub fn exchange_in_pieces(send: &View, recv: &mut ViewMut, f: &mut ExchangeOnViews) -> Option<Result<(), String>> {
    let any_bf16 = matches!(send.data, ViewData::Bf16(_)) || matches!(recv.data, ViewMutData::Bf16(_));
    if !any_bf16 || send.len() != recv.len() {
        return None;
    }
    let len = send.len();
    Some(pieces(len, 1).try_for_each(|(first, count)| {
        let s = rows_f32(send, first, count, 1)?;
        let mut r = rows_f32(&recv.as_view(), first, count, 1)?.into_owned();
        let shape = [count as u64];
        let s_view = View { shape: Shape(&shape), data: ViewData::F32(&s) };
        f(&[&s_view], &mut ViewMut { shape: Shape(&shape), data: ViewMutData::F32(&mut r) })?;
        write_rows(recv, first, &r)
    }))
}

/// One operand of a piece of rows: a whole view, or rows of it (widened to f32, or borrowed).
enum Part<'v> {
    Whole(View<'v>),
    Rows { shape: [u64; 2], data: PartData<'v> },
}

enum PartData<'v> {
    F32(Cow<'v, [f32]>),
    I32(&'v [i32]),
}

impl<'v> Part<'v> {
    fn rows(view: &View<'v>, first: usize, count: usize, width: usize) -> Result<Part<'v>, String> {
        let range = first * width..(first + count) * width;
        let missing = || "an operand is not whole rows of its shape".to_string();
        let data = match view.data {
            ViewData::F32(v) => PartData::F32(Cow::Borrowed(v.get(range).ok_or_else(missing)?)),
            ViewData::Bf16(v) => PartData::F32(Cow::Owned(widen(v.get(range).ok_or_else(missing)?))),
            ViewData::I32(v) => PartData::I32(v.get(range).ok_or_else(missing)?),
        };
        Ok(Part::Rows { shape: [count as u64, width as u64], data })
    }

    fn view(&self) -> View<'_> {
        match self {
            Part::Whole(v) => *v,
            Part::Rows { shape, data: PartData::F32(v) } => View { shape: Shape(shape), data: ViewData::F32(v) },
            Part::Rows { shape, data: PartData::I32(v) } => View { shape: Shape(shape), data: ViewData::I32(v) },
        }
    }
}

/// Stores f32 values into an output from element `at` on, rounding where the output is bf16.
fn write_rows(out: &mut ViewMut, at: usize, values: &[f32]) -> Result<(), String> {
    let range = at..at + values.len();
    match &mut out.data {
        ViewMutData::Bf16(bits) => bits.get_mut(range).map(|b| round_into(values, b)),
        ViewMutData::F32(v) => v.get_mut(range).map(|v| v.copy_from_slice(values)),
        ViewMutData::I32(_) => None,
    }
    .ok_or_else(|| "a product's output is not a floating-point block of its shape".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_to_nearest_with_ties_to_even() {
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
        assert_eq!(widen_one(round(1.0 + 2f32.powi(-8))), 1.0);
        // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: ties go to 1 + 2^-6.
        assert_eq!(widen_one(round(1.0 + 3.0 * 2f32.powi(-8))), 1.0 + 2f32.powi(-6));
        // Just above a tie rounds up, just below rounds down.
        assert_eq!(widen_one(round(1.0 + 2f32.powi(-8) + 2f32.powi(-20))), 1.0 + 2f32.powi(-7));
        assert_eq!(widen_one(round(1.0 + 2f32.powi(-8) - 2f32.powi(-20))), 1.0);
        assert_eq!(widen_one(round(-1.0 - 3.0 * 2f32.powi(-8))), -1.0 - 2f32.powi(-6));
    }

    #[test]
    fn special_values_survive_and_overflow_goes_to_infinity() {
        assert!(widen_one(round(f32::NAN)).is_nan());
        assert_eq!(widen_one(round(f32::INFINITY)), f32::INFINITY);
        assert_eq!(widen_one(round(f32::NEG_INFINITY)), f32::NEG_INFINITY);
        assert_eq!(widen_one(round(f32::MAX)), f32::INFINITY);
        assert_eq!(widen_one(round(-0.0)).to_bits(), (-0.0f32).to_bits());
        // bf16 keeps f32's exponent range: a tiny normal f32 stays non-zero.
        assert!(widen_one(round(1e-38)) > 0.0);
    }

    /// A plain f32 product on views, for checking the piecewise one.
    fn naive(ins: &[&View], out: &mut ViewMut, accumulate: bool, (ta, tb): (bool, bool)) -> Result<(), String> {
        let [a, b] = ins else { return Err("two inputs".into()) };
        let (av, bv) = (a.f32()?, b.f32()?);
        let ((ca, ra), (cb, _)) = (last_and_rows(a.shape.as_slice()), last_and_rows(b.shape.as_slice()));
        let (n, m) = last_and_rows(out.shape.as_slice());
        let k = if ta { ra } else { ca };
        let y = out.f32_mut()?;
        for i in 0..m {
            for j in 0..n {
                let mut sum = if accumulate { y[i * n + j] } else { 0.0 };
                for t in 0..k {
                    let x = if ta { av[t * ca + i] } else { av[i * ca + t] };
                    let w = if tb { bv[j * cb + t] } else { bv[t * cb + j] };
                    sum += x * w;
                }
                y[i * n + j] = sum;
            }
        }
        Ok(())
    }

    #[test]
    fn products_in_pieces_match_the_whole_product() -> Result<(), String> {
        // 2100 rows of 1000: three pieces of A's rows (or of the rows A and B share).
        let (rows, k, n) = (2100usize, 1000usize, 3usize);
        let value = |i: usize| ((i * 7919) % 17) as f32 / 8.0 - 1.0;
        let a: Vec<u16> = (0..rows * k).map(|i| round(value(i))).collect();
        let a_shape = [rows as u64, k as u64];
        let a_view = View { shape: Shape(&a_shape), data: ViewData::Bf16(&a) };
        let a_wide = Tensor::from_f32(&a_shape, widen(&a));
        for (ta, b_shape, out_shape) in [
            (false, [k as u64, n as u64], [rows as u64, n as u64]),
            (true, [rows as u64, n as u64], [k as u64, n as u64]),
        ] {
            let b = Tensor::from_f32(&b_shape, (0..b_shape.iter().product::<u64>() as usize).map(value).collect());
            let elements = out_shape.iter().product::<u64>() as usize;
            let mut want = Tensor::from_f32(&out_shape, vec![0.5; elements]);
            naive(&[&a_wide.view(), &b.view()], &mut want.view_mut(), true, (ta, false))?;
            let mut got = vec![round(0.5); elements];
            let mut out = ViewMut { shape: Shape(&out_shape), data: ViewMutData::Bf16(&mut got) };
            let run = |ins: &[&View], out: &mut ViewMut, acc: bool| naive(ins, out, acc, (ta, false));
            product_in_pieces(&[&a_view, &b.view()], &mut out, (ta, false, true), &run).ok_or("split")??;
            let want: Vec<u16> = want.f32()?.iter().map(|&x| round(x)).collect();
            assert_eq!(got, want, "transpose_a {ta}");
        }
        Ok(())
    }

    #[test]
    fn widening_is_exact() {
        for bits in [0u16, 1, 0x3f80, 0x7f7f, 0x8001, 0xc2f7] {
            assert_eq!(round(widen_one(bits)), bits);
        }
    }
}
