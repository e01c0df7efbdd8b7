//! Shape checks and data-movement plans shared by every backend's kernels: a backend decides how to
//! copy, these decide what goes where, so the CPU and GPU kernels cannot drift apart.

use crate::layout::{MESH_AXES, Placement};
use crate::{Coords, Mesh};

/// The element count of a shape (saturating, so that absurd shapes fail the length checks instead).
pub fn numel(shape: &[u64]) -> usize {
    shape.iter().fold(1u64, |n, &d| n.saturating_mul(d)) as usize
}

/// (rows, last): the leading dimensions flattened and the last dimension (a scalar is 1 x 1).
pub fn split_last(shape: &[u64]) -> (usize, usize) {
    match shape.split_last() {
        Some((&last, lead)) => (numel(lead), last as usize),
        None => (1, 1),
    }
}

pub fn ensure(ok: bool, message: impl FnOnce() -> String) -> Result<(), String> {
    if ok { Ok(()) } else { Err(message()) }
}

pub fn same_len(what: &str, got: usize, want: usize) -> Result<(), String> {
    ensure(got == want, || format!("{what} has {got} elements, expected {want}"))
}

pub fn same_shape(what: &str, got: &[u64], want: &[u64]) -> Result<(), String> {
    ensure(got == want, || format!("{what} is {got:?}, expected {want:?}"))
}

/// (leading dimensions, rows, columns) of a batch of matrices.
pub fn batch_matrix<'s>(shape: &'s [u64], what: &str) -> Result<(&'s [u64], usize, usize), String> {
    match shape {
        [lead @ .., r, c] => Ok((lead, *r as usize, *c as usize)),
        _ => Err(format!("{what} must have at least two dimensions, not {shape:?}")),
    }
}

/// (before, size, after) of dimension `dim`.
fn around(shape: &[u64], dim: usize) -> Result<(usize, usize, usize), String> {
    ensure(dim < shape.len(), || format!("dimension {dim} does not exist in {shape:?}"))?;
    Ok((numel(&shape[..dim]), shape[dim] as usize, numel(&shape[dim + 1..])))
}

/// The shape without dimension `dim`.
fn without(shape: &[u64], dim: usize) -> Vec<u64> {
    shape.iter().enumerate().filter(|&(d, _)| d != dim).map(|(_, &s)| s).collect()
}

/// A copy of `count` runs of `len` elements between strided positions, for any element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Runs {
    pub count: usize,
    pub len: usize,
    pub src_stride: usize,
    pub src_offset: usize,
    pub dst_stride: usize,
    pub dst_offset: usize,
    /// Zero the destination first (it is larger than what the runs cover).
    pub zero_first: bool,
}

impl Runs {
    /// One run of `n` elements.
    pub fn whole(n: usize) -> Runs {
        Runs { count: 1, len: n, src_stride: 0, src_offset: 0, dst_stride: 0, dst_offset: 0, zero_first: false }
    }

    /// Whether every run lies inside a source of `src` and a destination of `dst` elements.
    pub fn fits(&self, src: usize, dst: usize) -> bool {
        let end = |offset: usize, stride: usize| match self.count {
            0 => 0,
            c => offset.saturating_add((c - 1).saturating_mul(stride)).saturating_add(self.len),
        };
        end(self.src_offset, self.src_stride) <= src && end(self.dst_offset, self.dst_stride) <= dst
    }
}

/// Swaps dimensions p and q of [a, p, b, q, c].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Swap {
    pub a: usize,
    pub p: usize,
    pub b: usize,
    pub q: usize,
    pub c: usize,
}

/// A copy with a new shape (same element order).
pub fn reshape_runs(x: &[u64], out: &[u64]) -> Result<Runs, String> {
    let n = numel(x);
    same_len("the output", numel(out), n)?;
    Ok(Runs::whole(n))
}

/// out = x[.., index, ..] along `dim`.
pub fn select_runs(x: &[u64], out: &[u64], dim: usize, index: u64) -> Result<Runs, String> {
    let (before, size, after) = around(x, dim)?;
    ensure((index as usize) < size, || format!("index {index} is outside dimension {dim} of {x:?}"))?;
    same_shape("the output", out, &without(x, dim))?;
    Ok(Runs {
        count: before,
        len: after,
        src_stride: size * after,
        src_offset: index as usize * after,
        dst_stride: after,
        dst_offset: 0,
        zero_first: false,
    })
}

/// out = zeros with dy placed at `index` along `dim` (the gradient of [`select_runs`]).
pub fn select_grad_runs(dy: &[u64], out: &[u64], dim: usize, index: u64) -> Result<Runs, String> {
    let (before, size, after) = around(out, dim)?;
    ensure((index as usize) < size, || format!("index {index} is outside dimension {dim} of {out:?}"))?;
    same_shape("dy", dy, &without(out, dim))?;
    Ok(Runs {
        count: before,
        len: after,
        src_stride: after,
        src_offset: 0,
        dst_stride: size * after,
        dst_offset: index as usize * after,
        zero_first: true,
    })
}

/// The swap that transposes dimensions `dim0` and `dim1` of `x` into `out`.
pub fn transpose_swap(x: &[u64], out: &[u64], dim0: usize, dim1: usize) -> Result<Swap, String> {
    let rank = x.len();
    ensure(dim0 < rank && dim1 < rank, || format!("cannot swap dimensions {dim0} and {dim1} of {x:?}"))?;
    let mut swapped = x.to_vec();
    swapped.swap(dim0, dim1);
    same_shape("the output", out, &swapped)?;
    let (d0, d1) = (dim0.min(dim1), dim0.max(dim1));
    Ok(Swap {
        a: numel(&x[..d0]),
        p: x[d0] as usize,
        b: numel(&x[d0 + 1..d1.max(d0 + 1)]),
        q: if d0 == d1 { 1 } else { x[d1] as usize },
        c: numel(&x[d1 + 1..]),
    })
}

/// The block of `x` of the device at `coords` (which holds the whole extent of the placement's dimension) along
/// mesh `axis`; a replicated placement is a plain copy.
pub fn slice_shard_runs(
    x: &[u64],
    out: &[u64],
    mesh: Mesh,
    coords: Coords,
    axis: usize,
    p: Placement,
) -> Result<Runs, String> {
    let Placement::Shard { dim, outer, inner } = p else {
        ensure(p == Placement::Replicate, || "cannot slice into a pending sum".to_string())?;
        return reshape_runs(x, out);
    };
    ensure(axis < MESH_AXES, || format!("mesh axis {axis} does not exist"))?;
    let (parts, coord) = (mesh.axes()[axis], coords.0[axis]);
    let dim = usize::from(dim);
    let (before, size, after) = around(x, dim)?;
    let (outer, inner) = (outer.max(1) as usize, inner.max(1) as usize);
    let mid = size / outer.saturating_mul(inner);
    let whole = mid.saturating_mul(outer).saturating_mul(inner) == size;
    ensure(parts > 0 && coord < parts && whole && mid.is_multiple_of(parts as usize), || {
        format!("dimension {dim} of {x:?} viewed as [{outer}, _, {inner}] cannot be split in {parts}")
    })?;
    let chunk = mid / parts as usize;
    let mut want = x.to_vec();
    want[dim] = (outer * chunk * inner) as u64;
    same_shape("the output", out, &want)?;
    let len = chunk * inner * after;
    Ok(Runs {
        count: before * outer,
        len,
        src_stride: mid * inner * after,
        src_offset: coord as usize * len,
        dst_stride: len,
        dst_offset: 0,
        zero_first: false,
    })
}

/// Query rows per attention tile: a tile's scores ([QUERY_TILE, keys]) stay in cache, are never
/// stored for the backward pass (it recomputes them), and a causal tile reads only the keys its rows
/// can see, which halves a causal attention's products.
pub const QUERY_TILE: usize = 64;

/// Where the blocks of one attention operand live: head h of batch b starts at
/// `b*seq*row + part + h*d` and its rows are `row` apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packing {
    pub seq: usize,
    pub row: usize,
    pub part: usize,
}

impl Packing {
    pub fn start(&self, b: usize, h: usize, d: usize) -> usize {
        b * self.seq * self.row + self.part + h * d
    }
}

/// The checked layout of an attention's operands: q, k, v as three tensors, or fused into one
/// [.., seq, (3, heads, d)] tensor. k and v hold `kv_heads` heads (grouped-query attention when fewer
/// than `heads`): query head h reads kv head h / (heads / kv_heads).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttentionLayout {
    pub packing: [Packing; 3],
    /// q's shape (the fused tensor's when fused).
    pub q_shape: Vec<u64>,
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub d: usize,
}

impl AttentionLayout {
    /// Checks the operand shapes (one when `fused`, else q, k, v) against `heads` and `kv_heads`.
    pub fn new(shapes: &[&[u64]], heads: u64, kv_heads: u64, fused: bool) -> Result<AttentionLayout, String> {
        let (heads, kv_heads) = (heads as usize, kv_heads as usize);
        ensure(heads > 0 && kv_heads > 0, || "attention needs at least one head".to_string())?;
        ensure(heads.is_multiple_of(kv_heads), || {
            format!("{heads} query heads cannot be grouped over {kv_heads} key/value heads")
        })?;
        let expected = if fused { 1 } else { 3 };
        ensure(shapes.len() == expected, || format!("expects {expected} inputs, got {}", shapes.len()))?;
        if fused {
            ensure(kv_heads == heads, || format!("a fused input has {heads} key/value heads, not {kv_heads}"))?;
            let (lead, s, w) = batch_matrix(shapes[0], "the fused input")?;
            ensure(w.is_multiple_of(heads.saturating_mul(3)), || format!("width {w} is not 3 x {heads} heads"))?;
            let d = w / (3 * heads);
            let pack = |k: usize| Packing { seq: s, row: w, part: k * heads * d };
            let packing = [pack(0), pack(1), pack(2)];
            let batch = numel(lead);
            return Ok(AttentionLayout { packing, q_shape: shapes[0].to_vec(), batch, heads, kv_heads, d });
        }
        let (q, k, v) = (shapes[0], shapes[1], shapes[2]);
        let (lq, sq, w) = batch_matrix(q, "q")?;
        let (lk, sk, wk) = batch_matrix(k, "k")?;
        same_shape("v", v, k)?;
        ensure(w.is_multiple_of(heads), || format!("width {w} is not a multiple of {heads} heads"))?;
        let d = w / heads;
        ensure(lq == lk && wk == kv_heads * d, || {
            format!("q {q:?} ({heads} heads) and k {k:?} ({kv_heads} heads) do not match")
        })?;
        let packing = [
            Packing { seq: sq, row: w, part: 0 },
            Packing { seq: sk, row: wk, part: 0 },
            Packing { seq: sk, row: wk, part: 0 },
        ];
        Ok(AttentionLayout { packing, q_shape: q.to_vec(), batch: numel(lq), heads, kv_heads, d })
    }

    /// How many query heads share each key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// The head of `operand` that query head h reads: h itself for q, h / group for k and v.
    pub fn head_of(&self, operand: usize, h: usize) -> usize {
        if operand == 0 { h } else { h / self.group().max(1) }
    }

    pub fn seq(&self, operand: usize) -> usize {
        self.packing[operand].seq
    }

    /// The shape of the attention output (and of dy): q's leading dimensions, then heads * d.
    pub fn out_shape(&self) -> Vec<u64> {
        let mut shape = self.q_shape.clone();
        if let Some(last) = shape.last_mut() {
            *last = (self.heads * self.d) as u64;
        }
        shape
    }

    /// The packing of the output and of dy.
    pub fn out_packing(&self) -> Packing {
        Packing { seq: self.seq(0), row: self.heads * self.d, part: 0 }
    }

    /// 1 / sqrt(d), in f32.
    pub fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }
}

impl Runs {
    /// Copies the runs from `src` into `dst`.
    pub fn apply<T: Copy + Default>(&self, src: &[T], dst: &mut [T]) -> Result<(), String> {
        ensure(self.fits(src.len(), dst.len()), || format!("internal error: {self:?} does not fit"))?;
        if self.zero_first {
            dst.fill(T::default());
        }
        for t in 0..self.count {
            let (s, d) = (self.src_offset + t * self.src_stride, self.dst_offset + t * self.dst_stride);
            dst[d..d + self.len].copy_from_slice(&src[s..s + self.len]);
        }
        Ok(())
    }
}

/// Copies runs of c in tiles of (p, q).
impl Swap {
    const TILE: usize = 16;

    /// Copies `src` into `dst` with the two dimensions swapped.
    pub fn apply<T: Copy>(&self, src: &[T], dst: &mut [T]) {
        let Swap { a, p, b, q, c } = *self;
        for ia in 0..a {
            for ib in 0..b {
                for p0 in (0..p).step_by(Self::TILE) {
                    for q0 in (0..q).step_by(Self::TILE) {
                        for iq in q0..(q0 + Self::TILE).min(q) {
                            for ip in p0..(p0 + Self::TILE).min(p) {
                                let s = (((ia * p + ip) * b + ib) * q + iq) * c;
                                let d = (((ia * q + iq) * b + ib) * p + ip) * c;
                                if c == 1 {
                                    dst[d] = src[s];
                                } else {
                                    dst[d..d + c].copy_from_slice(&src[s..s + c]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
