//! CPU kernels of the key/value cache of text generation: the position-offset rotary embedding and
//! position lookup of a decoding step, the in-place write of a step's keys or values into a cache, and
//! causal attention of the step's queries over the cache rows written so far.
//!
//! A step's first position comes from an i32 [1] operand, checked by the plan's
//! [`step_position`] against the rows the cache (or table) holds: a position past the end, or a
//! negative one, is an error. Every kernel costs in proportion to the rows the step reads or writes,
//! never to the whole cache.

use super::{
    Rotation, args, floats, floats_mut, ints, par, position_dims, position_rows, rotate, rows_of_mut, scratch,
    softmax_in_place, sum_by2, vectorized,
};
use crate::bf16::KernelOnViews;
use crate::error::KernelError;
use crate::view::{TensorViews, View, ViewData, ViewMut, ViewMutData};
use optimus_plan::rotary::Table;
use optimus_plan::shapes::{
    CacheWriteLayout, CachedAttentionLayout, batch_matrix, numel, same_len, same_shape, step_position,
};
use optimus_plan::tensor::Tensor;

/// The step's first position from the `position` operand, checked so that `seq` rows from it fit
/// `context` rows.
fn start_of(position: &View, seq: usize, context: usize) -> Result<usize, KernelError> {
    Ok(step_position(ints(position, "the position")?, seq, context)?)
}

// ---- positions --------------------------------------------------------------------------------------

/// (table [context, width], position) -> out[.., p, :] = table[position + p, :] for p < seq.
pub(super) fn position_lookup_at(inputs: &[&View], out: &mut ViewMut) -> Result<(), KernelError> {
    let [table, position] = args(inputs)?;
    let (seq, _) = position_dims(&table.shape, &out.shape, "the output")?;
    let context = table.shape.first().map_or(0, |&rows| rows as usize);
    position_rows(table, out, start_of(position, seq, context)?)
}

/// (x, position) -> [`Kernel::Rotary`](optimus_plan::Kernel::Rotary) of x with row r of each sequence
/// at position `position + r`. The angles are those of the rotary table's rows position..position +
/// seq, computed for those rows only.
pub(super) fn rotary_at(inputs: &[&View], out: &mut ViewMut, heads: u64, theta: f64) -> Result<(), KernelError> {
    let [x, position] = args(inputs)?;
    let (_, seq, _) = batch_matrix(&x.shape, "x")?;
    // The angles exist at every position: only a negative one (or one whose rows overflow) is refused.
    let start = start_of(position, seq, usize::MAX)?;
    rotate(x, out, heads, Rotation::Forward, |seq, d| Ok(Table::from_position(start, seq, d, theta)?))
}

// ---- the cache write --------------------------------------------------------------------------------

/// (x [.., seq, parts * w], position) -> cache [.., context, w], in place: rows position..position +
/// seq of each leading index take chunk `part` of x's rows; the other rows keep what they held. f32
/// and bf16 operands mix (each element is rounded or widened as it is moved; bf16 to bf16 moves bits).
pub(super) fn cache_write(inputs: &[&View], out: &mut ViewMut, part: u8, parts: u8) -> Result<(), KernelError> {
    let [x, position] = args(inputs)?;
    let layout = CacheWriteLayout::new(&x.shape, &out.shape, part, parts)?;
    let start = start_of(position, layout.seq, layout.context)?;
    let write = CacheRows { layout, start };
    match (x.data, &mut out.data) {
        (ViewData::F32(src), ViewMutData::F32(dst)) => write.copy(src, dst, |v| v),
        (ViewData::Bf16(src), ViewMutData::Bf16(dst)) => write.copy(src, dst, |bits| bits),
        (ViewData::F32(src), ViewMutData::Bf16(dst)) => write.copy(src, dst, crate::bf16::round),
        (ViewData::Bf16(src), ViewMutData::F32(dst)) => write.copy(src, dst, crate::bf16::widen_one),
        _ => Err(KernelError::Invalid("a key/value cache and the rows written into it must be floating point".into())),
    }
}

/// Where a cache write puts a step's rows.
struct CacheRows {
    layout: CacheWriteLayout,
    start: usize,
}

impl CacheRows {
    /// Copies chunk `part` of every row of `src` (x) into its cache row of `dst`, through `convert`.
    fn copy<S: Copy, T>(&self, src: &[S], dst: &mut [T], convert: impl Fn(S) -> T) -> Result<(), KernelError> {
        let CacheWriteLayout { rows, seq, context, width, part_start, x_row } = self.layout;
        same_len("x", src.len(), numel(&[rows as u64, seq as u64, x_row as u64]))?;
        same_len("the cache", dst.len(), numel(&[rows as u64, context as u64, width as u64]))?;
        for b in 0..rows {
            for p in 0..seq {
                let from = &src[(b * seq + p) * x_row + part_start..][..width];
                let to = &mut dst[(b * context + self.start + p) * width..][..width];
                to.iter_mut().zip(from).for_each(|(t, &s)| *t = convert(s));
            }
        }
        Ok(())
    }
}

// ---- attention over the cache -----------------------------------------------------------------------

/// (q, k cache, v cache, position) -> y [.., seq, heads * d]: query row p (at position position + p)
/// of head h attends, as [`Kernel::Attention`](optimus_plan::Kernel::Attention) with `causal` does, to
/// the cache rows 0..=position + p of kv head h / (heads / kv_heads). Units of (row, head) run in
/// parallel, each reading only the cache rows it sees.
pub(super) fn cached_attention(
    inputs: &[&View],
    out: &mut ViewMut,
    heads: (u64, u64),
    fused: bool,
) -> Result<(), KernelError> {
    let [q, k, v, position] = args(inputs)?;
    let layout = CachedAttentionLayout::new(&q.shape, &k.shape, &v.shape, heads, fused)?;
    same_shape("the output", &out.shape, &layout.out_shape(&q.shape))?;
    let start = start_of(position, layout.seq, layout.context)?;
    if start == 0 && layout.seq > 1 {
        return prefill(q, (k, v), out, heads, &layout);
    }
    let step =
        Step { layout, start, q: floats(q, "q")?, k: floats(k, "the key cache")?, v: floats(v, "the value cache")? };
    let y = floats_mut(out)?;
    same_len("the output", y.len(), layout.rows * layout.seq * layout.heads * layout.d)?;
    let (d, keys) = (layout.d, start + layout.seq);
    par::costed_row_blocks(y, d, 2 * keys * d, |first, y| {
        let mut scores = scratch(1, keys)?;
        for (u, y) in rows_of_mut(y, d).enumerate() {
            step.head_row(first + u, y, &mut scores);
        }
        Ok(())
    })
}

/// A step of several rows from position 0 (a prefill): the cache holds exactly its keys and values in
/// rows 0..seq, and causal attention of q over the whole cache, top-left aligned, never reads a row
/// past a query's own. It runs as [`super::attention`] does, in tiles of products, instead of a dot
/// product per query row and head. A fused q is copied out of its qkv rows first.
fn prefill(
    q: &View,
    (k, v): (&View, &View),
    out: &mut ViewMut,
    heads: (u64, u64),
    layout: &CachedAttentionLayout,
) -> Result<(), KernelError> {
    let width = layout.heads * layout.d;
    if layout.q_row == width {
        return super::attention(&[q, k, v], out, heads, true, false);
    }
    let rows = floats(q, "q")?;
    let queries: Vec<f32> = rows.chunks_exact(layout.q_row).flat_map(|row| &row[..width]).copied().collect();
    let queries = Tensor::from_f32(&layout.out_shape(&q.shape), queries);
    super::attention(&[&queries.view(), k, v], out, heads, true, false)
}

/// A cached attention's operands (checked against its layout) and the step's first position.
struct Step<'a> {
    layout: CachedAttentionLayout,
    start: usize,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
}

impl Step<'_> {
    /// Writes unit `unit` of the output into `y` (its d values): the unit of query row `unit / heads`
    /// (batch row b, sequence row p) and head `unit % heads`. `scores` holds at least position + seq.
    fn head_row(&self, unit: usize, y: &mut [f32], scores: &mut [f32]) {
        let CachedAttentionLayout { seq, context, heads, kv_heads, d, q_row, .. } = self.layout;
        let (row, h) = (unit / heads, unit % heads);
        let (b, p) = (row / seq, row % seq);
        let kv_row = kv_heads * d;
        let kv_base = b * context * kv_row + (h / (heads / kv_heads)) * d;
        let query = &self.q[row * q_row + h * d..][..d];
        let scores = &mut scores[..self.start + p + 1];
        // As the attention kernel's product with alpha = 1 / sqrt(d): each score is the f32 dot product
        // times the scale.
        let scale = 1.0 / (d as f32).sqrt();
        for (t, s) in scores.iter_mut().enumerate() {
            *s = sum_by2(query, &self.k[kv_base + t * kv_row..][..d], |a, b| a * b) * scale;
        }
        softmax_in_place(scores);
        y.fill(0.0);
        for (t, &weight) in scores.iter().enumerate() {
            let value = &self.v[kv_base + t * kv_row..][..d];
            vectorized(
                #[inline(always)]
                || y.iter_mut().zip(value).for_each(|(y, &v)| *y += weight * v),
            );
        }
    }
}

/// The CPU's bf16 emulation of [`Kernel::CachedAttention`](optimus_plan::Kernel::CachedAttention)
/// (`run`, the f32 kernel): only the cache rows the step reads (0..position + seq of each leading
/// index) are widened to f32, and q is widened whole, so a step costs in proportion to the rows it
/// attends to, not to the cache. Operands the kernel would refuse (a position past the cache, say) go
/// to the kernel whole, which reports them.
pub fn cached_attention_on_prefix(inputs: &[&View], out: &mut ViewMut, run: &KernelOnViews) -> Result<(), KernelError> {
    let (&[q, k, v, position], Some(keys)) = (inputs, keys_read(inputs)) else {
        return widened_whole(inputs, out, run);
    };
    let (Some(k_rows), Some(v_rows)) = (cache_prefix(k, keys)?, cache_prefix(v, keys)?) else {
        return widened_whole(inputs, out, run);
    };
    crate::bf16::with_widened(&[q, &k_rows.view(), &v_rows.view(), position], out, false, |ins, out| run(ins, out))
}

/// `run` on every operand widened whole.
fn widened_whole(inputs: &[&View], out: &mut ViewMut, run: &KernelOnViews) -> Result<(), KernelError> {
    crate::bf16::with_widened(inputs, out, false, |ins, out| run(ins, out))
}

/// The cache rows (of each leading index) a cached attention's step reads: position + seq; `None`
/// for operands the kernel refuses.
fn keys_read(inputs: &[&View]) -> Option<usize> {
    let [q, k, _, position] = inputs else { return None };
    let (_, seq, _) = batch_matrix(&q.shape, "q").ok()?;
    let (_, context, _) = batch_matrix(&k.shape, "the key cache").ok()?;
    let start = step_position(position.i32().ok()?, seq, context).ok()?;
    Some(start + seq)
}

/// An f32 copy of rows 0..keys of every leading index of a cache [.., context, w] (its shape with
/// `keys` positions), or `None` for one that does not hold them.
fn cache_prefix(cache: &View, keys: usize) -> Result<Option<Tensor>, KernelError> {
    let Ok((lead, context, width)) = batch_matrix(&cache.shape, "a cache") else { return Ok(None) };
    if keys > context || cache.len() != numel(&cache.shape) {
        return Ok(None);
    }
    let (rows, per_row) = (numel(lead), keys * width);
    let mut values = Vec::new();
    values
        .try_reserve_exact(rows * per_row)
        .map_err(|_| KernelError::ScratchAllocation { rows: rows * keys, cols: width })?;
    for b in 0..rows {
        let block = b * context * width..b * context * width + per_row;
        match cache.data {
            ViewData::F32(v) => values.extend_from_slice(&v[block]),
            ViewData::Bf16(bits) => values.extend(bits[block].iter().map(|&x| crate::bf16::widen_one(x))),
            ViewData::I32(_) => return Ok(None),
        }
    }
    let mut shape = cache.shape.to_vec();
    let rank = shape.len();
    shape[rank - 2] = keys as u64;
    Ok(Some(Tensor::from_f32(&shape, values)))
}

#[cfg(test)]
mod tests {
    use super::super::run;
    use crate::settings::KernelContext;
    use optimus_plan::init::mix64;
    use optimus_plan::layout::Layout;
    use optimus_plan::shapes::{ensure, numel};
    use optimus_plan::tensor::Tensor;
    use optimus_plan::types::DType;
    use optimus_plan::{Buffer, BufferId, Coords, Kernel, Mesh, Role};

    type R = Result<(), String>;

    /// `Ok` when `ok` holds, else the message.
    fn check(ok: bool, message: impl FnOnce() -> String) -> R {
        Ok(ensure(ok, message)?)
    }

    /// Deterministic values in [-1, 1) for a seed.
    fn random(seed: u64, shape: &[u64]) -> Tensor {
        let n = numel(shape) as u64;
        let values = (0..n).map(|k| (mix64(seed * 1_000_003 + k) >> 40) as f32 / (1u64 << 23) as f32 - 1.0);
        Tensor::from_f32(shape, values.collect())
    }

    fn position(p: i32) -> Tensor {
        Tensor::from_i32(&[1], vec![p])
    }

    fn vals(t: &Tensor) -> Vec<f32> {
        t.f32().map(<[f32]>::to_vec).unwrap_or_default()
    }

    /// Runs a kernel on one device into `out` (which keeps its contents for a kernel that reads them).
    fn run_into(kernel: &Kernel, inputs: &[&Tensor], out: &mut Tensor) -> R {
        let meta = Buffer {
            id: BufferId(0),
            name: "out".into(),
            dtype: DType::F32,
            logical_shape: out.shape.clone(),
            layout: Layout::REPLICATED,
            shape: out.shape.clone(),
            role: Role::Workspace,
        };
        let ctx =
            KernelContext { coords: Coords::new(0, 0, 0), mesh: Mesh::new(1, 1), seed: 42, inputs: &[], output: &meta };
        Ok(run(kernel, inputs, out, &ctx)?)
    }

    /// A kernel's f32 output of `shape`, from zeros.
    fn eval(kernel: &Kernel, inputs: &[&Tensor], shape: &[u64]) -> Result<Tensor, String> {
        let mut out = Tensor::zeros(DType::F32, shape);
        run_into(kernel, inputs, &mut out)?;
        Ok(out)
    }

    /// Rows from..to of the second to last dimension of a [b, s, w] tensor.
    fn rows(t: &Tensor, from: usize, to: usize) -> Tensor {
        let (b, s, w) = (t.shape[0] as usize, t.shape[1] as usize, t.shape[2] as usize);
        let v = vals(t);
        let picked = (0..b).flat_map(|i| v[(i * s + from) * w..(i * s + to) * w].to_vec());
        Tensor::from_f32(&[b as u64, (to - from) as u64, w as u64], picked.collect())
    }

    /// Every |got - want| <= tol.
    fn close(got: &[f32], want: &[f32], tol: f32, what: &str) -> R {
        check(got.len() == want.len(), || format!("{what}: {} values, expected {}", got.len(), want.len()))?;
        for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
            check((g - w).abs() <= tol, || format!("{what}: element {k} is {g}, expected {w}"))?;
        }
        Ok(())
    }

    /// The chunks a generation runs: a prompt of 3 rows at position 0, then one row a step.
    const CHUNKS: [(usize, usize); 4] = [(0, 3), (3, 4), (4, 5), (5, 6)];

    /// Causal attention over the whole sequence, against a prompt and decoding steps that write their
    /// keys and values into caches (NaN where nothing was written, so that reading a row past a
    /// query's position would show) and attend over them: row for row the same, within 1e-5.
    fn check_against_causal_attention(fused: bool, (heads, kv_heads): (u64, u64)) -> R {
        let (batch, seq, d, context) = (2u64, 6u64, 4u64, 9u64);
        let (q_width, kv_width) = (heads * d, kv_heads * d);
        let (operands, whole) = if fused {
            let x = random(1, &[batch, seq, 3 * q_width]);
            let whole = Kernel::Attention { heads, kv_heads, causal: true, fused };
            let y = eval(&whole, &[&x], &[batch, seq, q_width])?;
            (vec![x], y)
        } else {
            let (q, k, v) = (
                random(2, &[batch, seq, q_width]),
                random(3, &[batch, seq, kv_width]),
                random(4, &[batch, seq, kv_width]),
            );
            let whole = Kernel::Attention { heads, kv_heads, causal: true, fused };
            let y = eval(&whole, &[&q, &k, &v], &[batch, seq, q_width])?;
            (vec![q, k, v], y)
        };
        let nan = Tensor::from_f32(&[batch, context, kv_width], vec![f32::NAN; (batch * context * kv_width) as usize]);
        let (mut k_cache, mut v_cache) = (nan.clone(), nan);
        for (from, to) in CHUNKS {
            let at = position(from as i32);
            let chunk: Vec<Tensor> = operands.iter().map(|t| rows(t, from, to)).collect();
            let (q, k_source, v_source, parts) =
                if fused { (&chunk[0], &chunk[0], &chunk[0], 3) } else { (&chunk[0], &chunk[1], &chunk[2], 1) };
            let part = |n: u8| if fused { n } else { 0 };
            run_into(&Kernel::CacheWrite { part: part(1), parts }, &[k_source, &at], &mut k_cache)?;
            run_into(&Kernel::CacheWrite { part: part(2), parts }, &[v_source, &at], &mut v_cache)?;
            let attention = Kernel::CachedAttention { heads, kv_heads, fused };
            let shape = [batch, (to - from) as u64, q_width];
            let y = eval(&attention, &[q, &k_cache, &v_cache, &at], &shape)?;
            let what = format!("fused {fused}, {heads}/{kv_heads} heads, rows {from}..{to}");
            close(&vals(&y), &vals(&rows(&whole, from, to)), 1e-5, &what)?;
        }
        Ok(())
    }

    #[test]
    fn cached_attention_after_chunked_cache_writes_equals_causal_attention_fused() -> R {
        check_against_causal_attention(true, (2, 2))
    }

    #[test]
    fn cached_attention_after_chunked_cache_writes_equals_causal_attention_unfused() -> R {
        check_against_causal_attention(false, (2, 2))
    }

    #[test]
    fn cached_attention_after_chunked_cache_writes_equals_causal_attention_grouped_query() -> R {
        check_against_causal_attention(false, (4, 2))
    }

    #[test]
    fn cache_write_fills_the_steps_rows_and_keeps_the_others() -> R {
        // x [2, 1, 3 * 2]: the keys are chunk 1, columns 2..4 of each row.
        let x = Tensor::from_f32(&[2, 1, 6], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0]);
        let mut cache = Tensor::from_f32(&[2, 3, 2], vec![-1.0; 12]);
        run_into(&Kernel::CacheWrite { part: 1, parts: 3 }, &[&x, &position(1)], &mut cache)?;
        let want = [-1.0, -1.0, 3.0, 4.0, -1.0, -1.0, -1.0, -1.0, 9.0, 10.0, -1.0, -1.0];
        check(vals(&cache) == want, || format!("the cache holds {:?}, expected {want:?}", vals(&cache)))?;
        Ok(())
    }

    #[test]
    fn cached_attention_of_one_row_weighs_the_values_it_sees() -> R {
        // One head of d = 1 at position 1 sees keys 0 and 1 (2 and 0: scores 2 and 0 for q = 1), never
        // row 2: y = (e^2 * 10 + 1 * 20) / (e^2 + 1).
        let q = Tensor::from_f32(&[1, 1, 1], vec![1.0]);
        let k = Tensor::from_f32(&[1, 3, 1], vec![2.0, 0.0, 100.0]);
        let v = Tensor::from_f32(&[1, 3, 1], vec![10.0, 20.0, 1000.0]);
        let attention = Kernel::CachedAttention { heads: 1, kv_heads: 1, fused: false };
        let y = eval(&attention, &[&q, &k, &v, &position(1)], &[1, 1, 1])?;
        let e = 2.0f64.exp();
        close(&vals(&y), &[((e * 10.0 + 20.0) / (e + 1.0)) as f32], 1e-5, "one row")
    }

    #[test]
    fn rotary_at_a_position_equals_the_rows_of_rotary_over_the_longer_sequence() -> R {
        let (heads, theta) = (2u64, 10_000.0);
        let x = random(5, &[2, 9, 2 * 8]);
        let whole = eval(&Kernel::Rotary { heads, theta }, &[&x], &x.shape)?;
        for (from, to) in [(0, 4), (4, 5), (5, 9), (8, 9)] {
            let chunk = rows(&x, from, to);
            let y = eval(&Kernel::RotaryAt { heads, theta }, &[&chunk, &position(from as i32)], &chunk.shape)?;
            let want = vals(&rows(&whole, from, to));
            check(vals(&y) == want, || format!("rows {from}..{to}: {:?}, expected {want:?}", vals(&y)))?;
        }
        // Far along, the angles still come from the position: rows 1000.. of a longer rotary.
        let long = random(6, &[1, 1002, 2 * 8]);
        let whole = eval(&Kernel::Rotary { heads, theta }, &[&long], &long.shape)?;
        let chunk = rows(&long, 1000, 1002);
        let y = eval(&Kernel::RotaryAt { heads, theta }, &[&chunk, &position(1000)], &chunk.shape)?;
        check(vals(&y) == vals(&rows(&whole, 1000, 1002)), || "rows 1000..1002 differ".into())
    }

    #[test]
    fn position_lookup_at_a_position_equals_the_rows_of_the_longer_lookup() -> R {
        let table = random(7, &[8, 3]);
        let whole = eval(&Kernel::PositionLookup, &[&table], &[2, 8, 3])?;
        for (from, to) in [(0, 3), (3, 4), (5, 8)] {
            let shape = [2, (to - from) as u64, 3];
            let y = eval(&Kernel::PositionLookupAt, &[&table, &position(from as i32)], &shape)?;
            let want = vals(&rows(&whole, from, to));
            check(vals(&y) == want, || format!("rows {from}..{to}: {:?}, expected {want:?}", vals(&y)))?;
        }
        // Row p of the table, exactly.
        let y = eval(&Kernel::PositionLookupAt, &[&table, &position(6)], &[1, 1, 3])?;
        check(vals(&y) == vals(&table)[18..21], || format!("row 6 is {:?}", vals(&y)))
    }

    /// The error `kernel` gives, checked to be one (not a panic, nor a success).
    fn error_of(kernel: &Kernel, inputs: &[&Tensor], out: &mut Tensor) -> Result<String, String> {
        match run_into(kernel, inputs, out) {
            Ok(()) => Err(format!("{kernel:?} ran at a position it cannot reach")),
            Err(e) => Ok(e),
        }
    }

    #[test]
    fn positions_past_the_cache_or_negative_are_errors() -> R {
        let (x, q) = (random(8, &[2, 2, 6]), random(9, &[2, 2, 4]));
        let before = random(10, &[2, 5, 2]);
        let attention = Kernel::CachedAttention { heads: 2, kv_heads: 1, fused: false };
        let kernels = [
            (Kernel::CacheWrite { part: 0, parts: 3 }, vec![&x], before.clone()),
            (attention, vec![&q, &before, &before], Tensor::zeros(DType::F32, &[2, 2, 4])),
        ];
        for (kernel, inputs, out) in &kernels {
            // Two rows from position 4 would end at 6, past the 5 the cache holds; -1 is before it.
            for (p, says) in [(4, "do not fit"), (-1, "negative"), (i32::MAX, "do not fit")] {
                let at = position(p);
                let all: Vec<&Tensor> = inputs.iter().copied().chain([&at]).collect();
                let error = error_of(kernel, &all, &mut out.clone())?;
                check(error.contains(says), || format!("{kernel:?} at {p}: {error}"))?;
            }
        }
        // A failed write leaves the cache as it was.
        let mut cache = before.clone();
        error_of(&Kernel::CacheWrite { part: 0, parts: 3 }, &[&x, &position(4)], &mut cache)?;
        check(cache == before, || "a refused write changed the cache".into())?;
        let table = random(11, &[5, 3]);
        let mut out = Tensor::zeros(DType::F32, &[1, 2, 3]);
        let error = error_of(&Kernel::PositionLookupAt, &[&table, &position(4)], &mut out)?;
        check(error.contains("do not fit"), || error.clone())?;
        let rotary = Kernel::RotaryAt { heads: 2, theta: 10_000.0 };
        let mut out = Tensor::zeros(DType::F32, &q.shape);
        let error = error_of(&rotary, &[&q, &position(-3)], &mut out)?;
        check(error.contains("negative"), || error.clone())
    }

    #[test]
    fn the_bf16_emulation_widens_only_the_cache_rows_a_step_reads() -> R {
        use crate::view::{Shape, View, ViewData, ViewMut, ViewMutData};
        let shape = [2u64, 5, 2];
        let bits: Vec<u16> = (0..20).map(|k| crate::bf16::round(k as f32)).collect();
        let cache = View { shape: Shape(&shape), data: ViewData::Bf16(&bits) };
        let prefix = super::cache_prefix(&cache, 3)?.ok_or("no prefix")?;
        let want = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0];
        check(prefix.shape == [2, 3, 2] && vals(&prefix) == want, || format!("the prefix is {prefix:?}"))?;
        // Two query rows from position 1 read rows 0..3; from position 4 they would pass the cache, and
        // the kernel, run whole, says so.
        let (q_shape, q) = ([2u64, 2, 2], vec![crate::bf16::round(0.5); 8]);
        let q = View { shape: Shape(&q_shape), data: ViewData::Bf16(&q) };
        let ats = [[1], [4]];
        let at = |k: usize| View { shape: Shape(&[1]), data: ViewData::I32(&ats[k]) };
        check(super::keys_read(&[&q, &cache, &cache, &at(0)]) == Some(3), || "keys read from position 1".into())?;
        check(super::keys_read(&[&q, &cache, &cache, &at(1)]).is_none(), || "keys read from position 4".into())?;
        let kernel = Kernel::CachedAttention { heads: 1, kv_heads: 1, fused: false };
        let meta = Buffer {
            id: BufferId(0),
            name: "out".into(),
            dtype: DType::Bf16,
            logical_shape: q_shape.to_vec(),
            layout: Layout::REPLICATED,
            shape: q_shape.to_vec(),
            role: Role::Workspace,
        };
        let ctx =
            KernelContext { coords: Coords::new(0, 0, 0), mesh: Mesh::new(1, 1), seed: 42, inputs: &[], output: &meta };
        let kernel_run = |ins: &[&View], out: &mut ViewMut| super::super::run_views(&kernel, ins, out, &ctx);
        let ones = vec![crate::bf16::round(1.0); 20];
        let keys = View { shape: Shape(&shape), data: ViewData::Bf16(&ones) };
        let mut y = vec![0u16; 8];
        let mut out = ViewMut { shape: Shape(&q_shape), data: ViewMutData::Bf16(&mut y) };
        super::cached_attention_on_prefix(&[&q, &keys, &cache, &at(0)], &mut out, &kernel_run)?;
        // Every key is the same, so the weights are uniform: the mean of the values seen,
        // rounded to bf16 (row 0 sees value rows 0..=1, row 1 rows 0..=2, of each leading index).
        let means = [1.0, 2.0, 2.0, 3.0, 11.0, 12.0, 12.0, 13.0];
        let got: Vec<f32> = y.iter().map(|&b| crate::bf16::widen_one(b)).collect();
        close(&got, &means, 0.0, "the bf16 attention")?;
        let mut out = ViewMut { shape: Shape(&q_shape), data: ViewMutData::Bf16(&mut y) };
        let error = super::cached_attention_on_prefix(&[&q, &keys, &cache, &at(1)], &mut out, &kernel_run)
            .map_err(String::from)
            .err()
            .ok_or("position 4 ran")?;
        check(error.contains("do not fit"), || error.clone())
    }
}
