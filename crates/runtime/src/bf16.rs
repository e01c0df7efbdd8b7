//! bf16 storage on the host: conversions between f32 and bf16 bit patterns (round to nearest, ties
//! to even; NaN stays a quiet NaN, infinities stay infinite, values past the bf16 range round to
//! infinity), and the widening that lets f32 kernels run on bf16 buffers: bf16 inputs are widened to
//! f32 scratch, the kernel computes in f32, and its f32 result is rounded once into the bf16 output.
//! The CPU backend does this a bounded piece at a time ([`PIECE_ELEMENTS`]: rows, whole matrices,
//! product tiles, pieces of a sum's output), bit for bit what widening whole tensors gives, so that
//! its scratch stays small whatever the tensors' sizes. Collectives exchange bf16 buffers as they are
//! (see `runtime::comm`); the widening helpers for collectives here serve backends that exchange f32.

use super::view::{Shape, View, ViewData, ViewMut, ViewMutData};
use crate::error::KernelError;
use crate::view::TensorViews;
use half::bf16;
use optimus_plan::tensor::Tensor;
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
pub fn store(scratch: &Tensor, out: &mut ViewMut) -> Result<(), KernelError> {
    let values = scratch.f32()?;
    match &mut out.data {
        ViewMutData::Bf16(bits) if bits.len() == values.len() => {
            round_into(values, bits);
            Ok(())
        }
        _ => Err(KernelError::Invalid("a bf16 scratch does not match its output".into())),
    }
}

/// Runs `f` (an f32 kernel) on `inputs` and `out`, widening bf16 operands to f32 and rounding a bf16
/// result once at the end. Operands without bf16 go straight through. `f`'s errors are of any type a
/// kernel's convert into.
pub fn with_widened<R, E: From<KernelError>>(
    inputs: &[&View],
    out: &mut ViewMut,
    out_is_read: bool,
    f: impl FnOnce(&[&View], &mut ViewMut) -> Result<R, E>,
) -> Result<R, E> {
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
pub type Product<'k> = dyn Fn(&[&View], &mut ViewMut, bool) -> Result<(), KernelError> + 'k;

/// The scratch budget of the piecewise emulation: a piece of an operand widened to f32 holds at most
/// this many elements (128 Ki: 512 KiB of f32), whatever the tensor's size, unless one unit of the
/// kernel (a row, or one matrix of a batched kernel) is larger. Smaller pieces save little memory and
/// cost time: the products' tiles get too small for the f32 kernel to run at speed.
pub const PIECE_ELEMENTS: usize = 1 << 17;

/// Scratch buffers each thread keeps for the next piece, and the largest it keeps (in elements): a
/// fixed budget per thread, reused, so that the pieces neither grow the heap nor ask the system for
/// memory again and again.
const POOLED_BUFFERS: usize = 8;
const POOLED_ELEMENTS: usize = PIECE_ELEMENTS;

thread_local! {
    static POOL: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// An f32 scratch buffer for one piece, taken from this thread's pool and given back when dropped.
struct Scratch(Vec<f32>);

impl Scratch {
    /// An empty buffer with room for `n` elements.
    fn with_capacity(n: usize) -> Scratch {
        let pooled = POOL.with(|p| {
            let mut p = p.borrow_mut();
            let at = p.iter().position(|v| v.capacity() >= n)?;
            Some(p.swap_remove(at))
        });
        let mut v = pooled.unwrap_or_else(|| Vec::with_capacity(n.max(1)));
        v.clear();
        Scratch(v)
    }

    /// `n` zeros.
    fn zeros(n: usize) -> Scratch {
        let mut s = Scratch::with_capacity(n);
        s.0.resize(n, 0.0);
        s
    }

    /// The f32 values of bf16 bits.
    fn widened(bits: &[u16]) -> Scratch {
        let mut s = Scratch::with_capacity(bits.len());
        s.0.extend(bits.iter().map(|&b| widen_one(b)));
        s
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        if v.capacity() <= POOLED_ELEMENTS {
            POOL.with(|p| {
                let mut p = p.borrow_mut();
                if p.len() < POOLED_BUFFERS {
                    p.push(v);
                }
            });
        }
    }
}

impl std::ops::Deref for Scratch {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl std::ops::DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.0
    }
}

/// `rows` x `cols` rows `first..first + rows` of a floating-point view, as f32 (borrowed when the view
/// is f32 already).
fn rows_f32<'v>(view: &'v View, first: usize, rows: usize, cols: usize) -> Result<Cow<'v, [f32]>, KernelError> {
    let range = first * cols..(first + rows) * cols;
    match view.data {
        ViewData::F32(v) => v.get(range).map(Cow::Borrowed),
        ViewData::Bf16(v) => v.get(range).map(|b| Cow::Owned(widen(b))),
        ViewData::I32(_) => None,
    }
    .ok_or(KernelError::NotBlock(PRODUCT_OPERAND))
}

/// What a piece of a product's operand is called in an error.
const PRODUCT_OPERAND: &str = "a product operand";

/// `first` and the number of rows of each piece of `rows` rows of `cols` elements.
fn pieces(rows: usize, cols: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = (PIECE_ELEMENTS / cols.max(1)).max(1);
    (0..rows).step_by(step).map(move |first| (first, step.min(rows - first)))
}

/// Ranges `first..first + len` of `0..total` in steps of `step`.
fn ranges(total: usize, step: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let step = step.max(1);
    (0..total).step_by(step).map(move |first| first..(first + step).min(total))
}

/// A block of a matrix stored row-major as `rows` x `cols`: rows `r` and columns `c`, as a dense f32
/// matrix (widened where the matrix is bf16).
fn block_f32(
    view: &View,
    cols: usize,
    r: &std::ops::Range<usize>,
    c: &std::ops::Range<usize>,
) -> Result<Scratch, KernelError> {
    let missing = || KernelError::NotBlock(PRODUCT_OPERAND);
    let mut out = Scratch::with_capacity(r.len() * c.len());
    for row in r.clone() {
        let range = row * cols + c.start..row * cols + c.end;
        match view.data {
            ViewData::F32(v) => out.0.extend_from_slice(v.get(range).ok_or_else(missing)?),
            ViewData::Bf16(v) => out.0.extend(v.get(range).ok_or_else(missing)?.iter().map(|&b| widen_one(b))),
            ViewData::I32(_) => return Err(missing()),
        }
    }
    Ok(out)
}

/// Rounds (or copies) a dense f32 block into rows `r` and columns `c` of a row-major output of `cols`
/// columns.
fn write_block(
    out: &mut ViewMut,
    cols: usize,
    r: &std::ops::Range<usize>,
    c: &std::ops::Range<usize>,
    block: &[f32],
) -> Result<(), KernelError> {
    for (k, row) in r.clone().enumerate() {
        write_rows(out, row * cols + c.start, &block[k * c.len()..(k + 1) * c.len()])?;
    }
    Ok(())
}

/// A matrix product with a bf16 operand, tile by tile so that only a bounded piece of each operand is
/// widened at a time (the memory of the CPU emulation stays near the plan's): the output is cut into
/// tiles of rows and columns, and each tile sums its products over pieces of the shared dimension in
/// an f32 accumulator, rounded into a bf16 output once. Every output element is accumulated in the
/// order of the shared dimension, as the whole product would. `run` is the f32 product on (A, B, out)
/// views with the same transposes. `None` when the operands are not two matrices of matching shapes.
pub fn product_in_pieces(
    inputs: &[&View],
    out: &mut ViewMut,
    (ta, tb, accumulate): (bool, bool, bool),
    run: &Product,
) -> Option<Result<(), KernelError>> {
    let [a, b] = *inputs else { return None };
    let (cols_a, rows_a) = last_and_rows(a.shape.as_slice());
    let (cols_b, rows_b) = last_and_rows(b.shape.as_slice());
    let (n, m) = last_and_rows(out.shape.as_slice());
    let (am, k) = if ta { (cols_a, rows_a) } else { (rows_a, cols_a) };
    let (bk, bn) = if tb { (cols_b, rows_b) } else { (rows_b, cols_b) };
    if am != m || bk != k || bn != n || out.len() != m * n {
        return None;
    }
    // The shared dimension is cut only past 1024, and in multiples of 1024: faer blocks the shared
    // dimension itself, and pieces of such lengths keep its order of additions on every shape the
    // tests check (bf16_pieces_tests compares the bits); other lengths need not.
    let kk = if k <= 1024 { k.max(1) } else { (PIECE_ELEMENTS / m.max(n).max(1)).max(1024) / 1024 * 1024 };
    let nn = n.min(PIECE_ELEMENTS / kk).max(1);
    let mm = m.min(PIECE_ELEMENTS / kk.max(nn)).max(1);
    let tile = |rm: std::ops::Range<usize>, rn: std::ops::Range<usize>, out: &mut ViewMut| -> Result<(), KernelError> {
        let mut sum =
            if accumulate { block_f32(&out.as_view(), n, &rm, &rn)? } else { Scratch::zeros(rm.len() * rn.len()) };
        let sum_shape = [rm.len() as u64, rn.len() as u64];
        for (piece, rk) in ranges(k, kk).enumerate() {
            let (a_rows, a_cols) = if ta { (&rk, &rm) } else { (&rm, &rk) };
            let (b_rows, b_cols) = if tb { (&rn, &rk) } else { (&rk, &rn) };
            let a_block = block_f32(a, cols_a, a_rows, a_cols)?;
            let b_block = block_f32(b, cols_b, b_rows, b_cols)?;
            let a_shape = [a_rows.len() as u64, a_cols.len() as u64];
            let b_shape = [b_rows.len() as u64, b_cols.len() as u64];
            let a_view = View { shape: Shape(&a_shape), data: ViewData::F32(&a_block) };
            let b_view = View { shape: Shape(&b_shape), data: ViewData::F32(&b_block) };
            let mut sum_view = ViewMut { shape: Shape(&sum_shape), data: ViewMutData::F32(&mut sum) };
            run(&[&a_view, &b_view], &mut sum_view, accumulate || piece > 0)?;
        }
        write_block(out, n, &rm, &rn, &sum)
    };
    Some(ranges(n, nn).try_for_each(|rn| ranges(m, mm).try_for_each(|rm| tile(rm, rn.clone(), out))))
}

/// The last dimension and the product of the others.
fn last_and_rows(shape: &[u64]) -> (usize, usize) {
    let last = shape.last().copied().unwrap_or(1) as usize;
    (last, shape.iter().rev().skip(1).product::<u64>() as usize)
}

/// An f32 kernel on views.
pub type KernelOnViews<'k> = dyn Fn(&[&View], &mut ViewMut) -> Result<(), KernelError> + 'k;

/// An f32 collective on a send view and a receive view, failing with errors of type `E`.
pub type ExchangeOnViews<'k, E> = dyn FnMut(&[&View], &mut ViewMut) -> Result<(), E> + 'k;

/// The inputs a row-separable kernel reads row by row (`true`) or whole (`false`): each output row
/// depends only on the same rows of the former. `None` for the kernels that are not split this way
/// (their rows depend on their position, as the causal mask and dropout do, or they sum over rows).
pub fn row_split(kernel: &optimus_plan::Kernel) -> Option<&'static [bool]> {
    use optimus_plan::Kernel as K;
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
pub fn by_rows(
    inputs: &[&View],
    out: &mut ViewMut,
    split: &[bool],
    run: &KernelOnViews,
) -> Option<Result<(), KernelError>> {
    by_rows_at(inputs, out, split, &|ins, out, _| run(ins, out))
}

/// An f32 kernel on a piece of rows of its operands, told the index of the piece's first row.
pub type KernelOnRows<'k> = dyn Fn(&[&View], &mut ViewMut, usize) -> Result<(), KernelError> + 'k;

/// [`by_rows`] for a kernel that needs to know where its piece starts (dropout, whose mask depends on
/// the logical index of each element).
pub fn by_rows_at(
    inputs: &[&View],
    out: &mut ViewMut,
    split: &[bool],
    run: &KernelOnRows,
) -> Option<Result<(), KernelError>> {
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
                None => Part::rows(v, first, count, w, vec![count as u64, w as u64]),
            })
            .collect::<Result<_, _>>()?;
        let views: Vec<View> = parts.iter().map(Part::view).collect();
        let refs: Vec<&View> = views.iter().collect();
        let mut piece = Scratch::zeros(count * width);
        let shape = [count as u64, width as u64];
        run(&refs, &mut ViewMut { shape: Shape(&shape), data: ViewMutData::F32(&mut piece) }, first)?;
        write_rows(out, first * width, &piece)
    }))
}

/// The kernels whose operands are batches of matrices (every dimension but the last two) computed
/// matrix by matrix: each matrix of the output depends only on the same matrix of each input.
pub fn matrix_split(kernel: &optimus_plan::Kernel) -> bool {
    use optimus_plan::Kernel as K;
    matches!(
        kernel,
        K::BatchedMatMul | K::CausalMask | K::CausalMaskGrad | K::Attention { .. } | K::AttentionGrad { .. }
    )
}

/// (matrices, rows, columns) of a shape of two dimensions or more.
fn matrices(shape: &[u64]) -> Option<(usize, u64, u64)> {
    match shape {
        [lead @ .., r, c] => Some((lead.iter().product::<u64>() as usize, *r, *c)),
        _ => None,
    }
}

/// Runs a kernel of [`matrix_split`] a piece of whole matrices at a time (as many as fit the piece
/// budget, at least one), each operand's piece shaped [count, rows, columns], widening only that piece
/// of each bf16 operand and rounding each piece of a bf16 output. `None` when an operand does not have
/// the output's number of matrices.
pub fn by_matrices(inputs: &[&View], out: &mut ViewMut, run: &KernelOnViews) -> Option<Result<(), KernelError>> {
    let (units, out_r, out_c) = matrices(out.shape.as_slice())?;
    if units < 2 {
        return None;
    }
    let dims: Vec<(u64, u64)> = inputs
        .iter()
        .map(|v| matrices(v.shape.as_slice()).filter(|&(u, r, c)| u == units && v.len() == u * (r * c) as usize))
        .map(|d| d.map(|(_, r, c)| (r, c)))
        .collect::<Option<_>>()?;
    let size = |(r, c): (u64, u64)| (r * c) as usize;
    let widest = dims.iter().copied().chain([(out_r, out_c)]).map(size).max().unwrap_or(1);
    let out_size = size((out_r, out_c));
    Some(pieces(units, widest).try_for_each(|(first, count)| {
        let parts: Vec<Part> = inputs
            .iter()
            .zip(&dims)
            .map(|(v, &(r, c))| Part::rows(v, first, count, size((r, c)), vec![count as u64, r, c]))
            .collect::<Result<_, _>>()?;
        let views: Vec<View> = parts.iter().map(Part::view).collect();
        let refs: Vec<&View> = views.iter().collect();
        let mut piece = Scratch::zeros(count * out_size);
        let shape = [count as u64, out_r, out_c];
        run(&refs, &mut ViewMut { shape: Shape(&shape), data: ViewMutData::F32(&mut piece) })?;
        write_rows(out, first * out_size, &piece)
    }))
}

/// Adds every row's contribution to a range of output elements into an f32 accumulator of that range.
type AddToRange<'k> = dyn Fn(std::ops::Range<usize>, &mut [f32]) -> Result<(), KernelError> + 'k;

/// Sums over rows into a bf16 (or f32) output `out`, a bounded piece of the output at a time:
/// `add(elements, acc)` adds, in row order, every row's contribution to those elements of the output
/// into the f32 accumulator `acc` (zeroed first), which is then rounded once into the output. The order
/// of the additions is the whole kernel's, so the result is too.
fn sum_into_columns(out: &mut ViewMut, add: &AddToRange) -> Result<(), KernelError> {
    let n = out.len();
    ranges(n, PIECE_ELEMENTS).try_for_each(|columns| {
        let mut acc = Scratch::zeros(columns.len());
        add(columns.clone(), &mut acc)?;
        write_rows(out, columns.start, &acc)
    })
}

/// One element of a floating-point view as f32.
fn at(view: &View, k: usize) -> Result<f32, KernelError> {
    match view.data {
        ViewData::F32(v) => v.get(k).copied(),
        ViewData::Bf16(v) => v.get(k).map(|&b| widen_one(b)),
        ViewData::I32(_) => None,
    }
    .ok_or(KernelError::NotBlock("an operand"))
}

/// `SumToLast` (x) -> [last]: the sum over rows, a bounded piece of columns at a time, in row order.
pub fn sum_to_last(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [x] = inputs else { return Err(KernelError::Takes { kernel: "sum_to_last", inputs: "one input" }) };
    let width = out.len();
    let (x_width, rows) = last_and_rows(x.shape.as_slice());
    if x_width != width {
        return Err(KernelError::Invalid(format!("an input of {x_width} columns does not sum into {width}")));
    }
    sum_into_columns(out, &|columns, acc| {
        for row in 0..rows {
            for (a, c) in acc.iter_mut().zip(columns.clone()) {
                *a += at(x, row * width + c)?;
            }
        }
        Ok(())
    })
}

/// `PositionGrad` (dy [.., seq, width]) -> d table [context, width]: the sum of dy over the leading
/// dimensions into the table's first `seq` rows (the others zero), a bounded piece at a time.
pub fn position_grad(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [dy] = inputs else { return Err(KernelError::Takes { kernel: "position_grad", inputs: "one input" }) };
    let (blocks, s, w) = matrices(dy.shape.as_slice())
        .ok_or_else(|| KernelError::Invalid("dy must have two dimensions or more".into()))?;
    let block = (s * w) as usize;
    let (table_w, table_rows) = last_and_rows(out.shape.as_slice());
    if table_w as u64 != w || (table_rows as u64) < s {
        return Err(KernelError::Invalid(format!(
            "a table {:?} cannot take the gradient of {:?}",
            out.shape, dy.shape
        )));
    }
    sum_into_columns(out, &|columns, acc| {
        for b in 0..blocks {
            for (a, c) in acc.iter_mut().zip(columns.clone()).filter(|(_, c)| *c < block) {
                *a += at(dy, b * block + c)?;
            }
        }
        Ok(())
    })
}

/// `LayerNormGradWeight` (dy, x, sum, sqsum) -> [last]: the sum over rows of dy * (x - mean) * rstd (the
/// kernel's formula, mean and rstd from the all-reduced sums as it takes them), a bounded piece of
/// columns at a time, in row order.
pub fn layer_norm_grad_weight(inputs: &[&View], out: &mut ViewMut, n: u64, eps: f64) -> Result<(), KernelError> {
    let [dy, x, sum, sqsum] = inputs else {
        return Err(KernelError::Takes { kernel: "layer_norm_grad_weight", inputs: "dy, x and two sums" });
    };
    let width = out.len();
    let (x_width, rows) = last_and_rows(x.shape.as_slice());
    if x_width != width || dy.len() != x.len() || sum.len() != rows || sqsum.len() != rows || n == 0 {
        return Err(KernelError::Invalid(format!(
            "layer norm weight gradient operands do not match an output of {width}"
        )));
    }
    let nf = n as f64;
    let stats = |row: usize| -> Result<(f32, f32), KernelError> {
        let (mean, var) = (f64::from(at(sum, row)?) / nf, f64::from(at(sqsum, row)?) / nf);
        Ok((mean as f32, (1.0 / (var + eps).sqrt()) as f32))
    };
    sum_into_columns(out, &|columns, acc| {
        for row in 0..rows {
            let (mean, rstd) = stats(row)?;
            for (a, c) in acc.iter_mut().zip(columns.clone()) {
                let k = row * width + c;
                *a += at(dy, k)? * (at(x, k)? - mean) * rstd;
            }
        }
        Ok(())
    })
}

/// `EmbeddingGrad` (ids, dy) -> d table [rows, width] for a device whose table rows start at `base`: the
/// scatter-add of dy rows into the rows their ids name, in the order of the ids, a bounded piece of
/// table rows at a time (rows another device holds are skipped when `masked`, an error otherwise; the
/// rows of the padding id get nothing).
pub fn embedding_grad(
    inputs: &[&View],
    out: &mut ViewMut,
    (base, masked): (u64, bool),
    padding: Option<u64>,
) -> Result<(), KernelError> {
    let [ids, dy] = inputs else { return Err(KernelError::Takes { kernel: "embedding_grad", inputs: "ids and dy" }) };
    let ids = ids.i32()?;
    let (w, rows) = last_and_rows(out.shape.as_slice());
    if dy.len() != ids.len() * w {
        return Err(KernelError::Invalid(format!("dy {:?} is not one row of {w} per id", dy.shape)));
    }
    let local = |id: i32| usize::try_from(i64::from(id) - base as i64).ok().filter(|&r| r < rows);
    if let Some(&id) = ids.iter().find(|&&id| local(id).is_none()).filter(|_| !masked) {
        return Err(KernelError::TokenOutsideRows { id, base, rows });
    }
    sum_into_columns(out, &|elements, acc| {
        let kept = ids.iter().enumerate().filter(|(_, id)| !super::cpu::kernels::is_padding(**id, padding));
        for (t, r) in kept.filter_map(|(t, &id)| local(id).map(|r| (t, r))) {
            let row = r * w..(r + 1) * w;
            let (from, to) = (row.start.max(elements.start), row.end.min(elements.end));
            for k in from..to {
                acc[k - elements.start] += at(dy, t * w + k - row.start)?;
            }
        }
        Ok(())
    })
}

/// An element-by-element collective (`f` on f32 send and receive slices) run a piece at a time on
/// buffers of which one at least is bf16: each piece of the send buffer is widened, the receive piece
/// widened (a member that receives nothing keeps its contents), and the result rounded back. `None`
/// when neither buffer is bf16 or their sizes differ (the caller handles those whole). `f`'s errors are
/// of any type a kernel's convert into.
pub fn exchange_in_pieces<E: From<KernelError>>(
    send: &View,
    recv: &mut ViewMut,
    f: &mut ExchangeOnViews<E>,
) -> Option<Result<(), E>> {
    let any_bf16 = matches!(send.data, ViewData::Bf16(_)) || matches!(recv.data, ViewMutData::Bf16(_));
    if !any_bf16 || send.len() != recv.len() {
        return None;
    }
    let len = send.len();
    Some(pieces(len, 1).try_for_each(|(first, count)| -> Result<(), E> {
        let s = rows_f32(send, first, count, 1)?;
        let mut r = rows_f32(&recv.as_view(), first, count, 1)?.into_owned();
        let shape = [count as u64];
        let s_view = View { shape: Shape(&shape), data: ViewData::F32(&s) };
        f(&[&s_view], &mut ViewMut { shape: Shape(&shape), data: ViewMutData::F32(&mut r) })?;
        Ok(write_rows(recv, first, &r)?)
    }))
}

/// One operand of a piece of rows: a whole view, or rows of it (widened to f32, or borrowed).
enum Part<'v> {
    Whole(View<'v>),
    Rows { shape: Vec<u64>, data: PartData<'v> },
}

enum PartData<'v> {
    Borrowed(&'v [f32]),
    Widened(Scratch),
    I32(&'v [i32]),
}

impl<'v> Part<'v> {
    /// Rows `first..first + count` of `width` elements each, shaped `shape`.
    fn rows(
        view: &View<'v>,
        first: usize,
        count: usize,
        width: usize,
        shape: Vec<u64>,
    ) -> Result<Part<'v>, KernelError> {
        let range = first * width..(first + count) * width;
        let missing = || KernelError::NotRows;
        let data = match view.data {
            ViewData::F32(v) => PartData::Borrowed(v.get(range).ok_or_else(missing)?),
            ViewData::Bf16(v) => PartData::Widened(Scratch::widened(v.get(range).ok_or_else(missing)?)),
            ViewData::I32(v) => PartData::I32(v.get(range).ok_or_else(missing)?),
        };
        Ok(Part::Rows { shape, data })
    }

    fn view(&self) -> View<'_> {
        match self {
            Part::Whole(v) => *v,
            Part::Rows { shape, data: PartData::Borrowed(v) } => View { shape: Shape(shape), data: ViewData::F32(v) },
            Part::Rows { shape, data: PartData::Widened(v) } => View { shape: Shape(shape), data: ViewData::F32(v) },
            Part::Rows { shape, data: PartData::I32(v) } => View { shape: Shape(shape), data: ViewData::I32(v) },
        }
    }
}

/// Stores f32 values into an output from element `at` on, rounding where the output is bf16.
fn write_rows(out: &mut ViewMut, at: usize, values: &[f32]) -> Result<(), KernelError> {
    let range = at..at + values.len();
    match &mut out.data {
        ViewMutData::Bf16(bits) => bits.get_mut(range).map(|b| round_into(values, b)),
        ViewMutData::F32(v) => v.get_mut(range).map(|v| v.copy_from_slice(values)),
        ViewMutData::I32(_) => None,
    }
    .ok_or(KernelError::NotBlock("a product's output"))
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
    fn naive(ins: &[&View], out: &mut ViewMut, accumulate: bool, (ta, tb): (bool, bool)) -> Result<(), KernelError> {
        let [a, b] = ins else { return Err(KernelError::Invalid("two inputs".into())) };
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
