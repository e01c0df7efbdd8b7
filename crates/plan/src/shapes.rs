//! Shape checks and data-movement plans shared by every backend's kernels: a backend decides how to
//! copy, these decide what goes where, so the CPU and GPU kernels cannot drift apart. What a check
//! finds wrong is a [`ShapeError`], whose message is the same whichever backend (or the verifier) asks.

use crate::layout::{MESH_AXES, Placement};
use crate::{Coords, Mesh};

/// What a shape check finds wrong. `Display` gives the message every backend and the verifier print.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShapeError {
    /// An operand has another element count than the check wants ([`same_len`]).
    Length { what: String, got: usize, want: usize },
    /// An operand has another shape than the check wants ([`same_shape`]).
    Shape { what: String, got: Vec<u64>, want: Vec<u64> },
    /// An operand has fewer dimensions than `at_least` ([`batch_matrix`]).
    Rank { what: String, shape: Vec<u64>, at_least: usize },
    /// A dimension past the rank of `shape`.
    NoDimension { dim: usize, shape: Vec<u64> },
    /// An index outside the dimension it selects from.
    Index { index: u64, dim: usize, shape: Vec<u64> },
    /// Two dimensions to swap, one of them past the rank of `shape`.
    Swap { dim0: usize, dim1: usize, shape: Vec<u64> },
    /// Another number of operands than a kernel takes.
    Operands { want: usize, got: usize },
    /// A mesh axis a mesh does not have.
    NoMeshAxis(usize),
    /// Dimension `dim` of `shape`, viewed as [outer, _, inner], does not split into `parts` blocks.
    Split { dim: usize, shape: Vec<u64>, outer: usize, inner: usize, parts: u64 },
    /// A slice of a tensor that is a pending sum.
    PendingSum,
    /// An attention without heads.
    NoHeads,
    /// Query heads that do not group evenly over the key/value heads.
    HeadGroups { heads: usize, kv_heads: usize },
    /// A fused attention input whose key/value heads are not its query heads.
    FusedHeads { heads: usize, kv_heads: usize },
    /// An attention width that does not split into `heads` heads (three times over when `fused`).
    Width { width: usize, heads: usize, fused: bool },
    /// q and k whose leading dimensions or head sizes differ.
    QueryKey { q: Vec<u64>, heads: usize, k: Vec<u64>, kv_heads: usize },
    /// Runs that do not fit their source and destination (a bug).
    RunsOutside(Runs),
    /// A check's own message ([`ensure`]).
    Invalid(String),
}

/// A count as a word, as the messages write small ones.
fn count_word(n: usize) -> String {
    match n {
        1 => "one".into(),
        2 => "two".into(),
        3 => "three".into(),
        n => n.to_string(),
    }
}

impl std::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShapeError::Length { what, got, want } => write!(f, "{what} has {got} elements, expected {want}"),
            ShapeError::Shape { what, got, want } => write!(f, "{what} is {got:?}, expected {want:?}"),
            ShapeError::Rank { what, shape, at_least } => {
                write!(f, "{what} must have at least {} dimensions, not {shape:?}", count_word(*at_least))
            }
            ShapeError::NoDimension { dim, shape } => write!(f, "dimension {dim} does not exist in {shape:?}"),
            ShapeError::Index { index, dim, shape } => {
                write!(f, "index {index} is outside dimension {dim} of {shape:?}")
            }
            ShapeError::Swap { dim0, dim1, shape } => {
                write!(f, "cannot swap dimensions {dim0} and {dim1} of {shape:?}")
            }
            ShapeError::Operands { want, got } => write!(f, "expects {want} inputs, got {got}"),
            ShapeError::NoMeshAxis(axis) => write!(f, "mesh axis {axis} does not exist"),
            ShapeError::Split { dim, shape, outer, inner, parts } => {
                write!(f, "dimension {dim} of {shape:?} viewed as [{outer}, _, {inner}] cannot be split in {parts}")
            }
            ShapeError::PendingSum => f.write_str("cannot slice into a pending sum"),
            ShapeError::NoHeads => f.write_str("attention needs at least one head"),
            ShapeError::HeadGroups { heads, kv_heads } => {
                write!(f, "{heads} query heads cannot be grouped over {kv_heads} key/value heads")
            }
            ShapeError::FusedHeads { heads, kv_heads } => {
                write!(f, "a fused input has {heads} key/value heads, not {kv_heads}")
            }
            ShapeError::Width { width, heads, fused: true } => write!(f, "width {width} is not 3 x {heads} heads"),
            ShapeError::Width { width, heads, fused: false } => {
                write!(f, "width {width} is not a multiple of {heads} heads")
            }
            ShapeError::QueryKey { q, heads, k, kv_heads } => {
                write!(f, "q {q:?} ({heads} heads) and k {k:?} ({kv_heads} heads) do not match")
            }
            ShapeError::RunsOutside(runs) => write!(f, "internal error: {runs:?} does not fit"),
            ShapeError::Invalid(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for ShapeError {}

/// For callers whose errors are still messages (the verifier): the same text.
impl From<ShapeError> for String {
    fn from(e: ShapeError) -> String {
        e.to_string()
    }
}

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

/// `Ok` when `ok` holds, else the check's own message.
pub fn ensure(ok: bool, message: impl FnOnce() -> String) -> Result<(), ShapeError> {
    if ok { Ok(()) } else { Err(ShapeError::Invalid(message())) }
}

/// `Ok` when `ok` holds, else the error `error` makes.
fn require(ok: bool, error: impl FnOnce() -> ShapeError) -> Result<(), ShapeError> {
    if ok { Ok(()) } else { Err(error()) }
}

pub fn same_len(what: &str, got: usize, want: usize) -> Result<(), ShapeError> {
    require(got == want, || ShapeError::Length { what: what.to_string(), got, want })
}

pub fn same_shape(what: &str, got: &[u64], want: &[u64]) -> Result<(), ShapeError> {
    require(got == want, || ShapeError::Shape { what: what.to_string(), got: got.to_vec(), want: want.to_vec() })
}

/// (leading dimensions, rows, columns) of a batch of matrices.
pub fn batch_matrix<'s>(shape: &'s [u64], what: &str) -> Result<(&'s [u64], usize, usize), ShapeError> {
    match shape {
        [lead @ .., r, c] => Ok((lead, *r as usize, *c as usize)),
        _ => Err(ShapeError::Rank { what: what.to_string(), shape: shape.to_vec(), at_least: 2 }),
    }
}

/// (before, size, after) of dimension `dim`.
fn around(shape: &[u64], dim: usize) -> Result<(usize, usize, usize), ShapeError> {
    require(dim < shape.len(), || ShapeError::NoDimension { dim, shape: shape.to_vec() })?;
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
pub fn reshape_runs(x: &[u64], out: &[u64]) -> Result<Runs, ShapeError> {
    let n = numel(x);
    same_len("the output", numel(out), n)?;
    Ok(Runs::whole(n))
}

/// out = x[.., index, ..] along `dim`.
pub fn select_runs(x: &[u64], out: &[u64], dim: usize, index: u64) -> Result<Runs, ShapeError> {
    let (before, size, after) = around(x, dim)?;
    require((index as usize) < size, || ShapeError::Index { index, dim, shape: x.to_vec() })?;
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
pub fn select_grad_runs(dy: &[u64], out: &[u64], dim: usize, index: u64) -> Result<Runs, ShapeError> {
    let (before, size, after) = around(out, dim)?;
    require((index as usize) < size, || ShapeError::Index { index, dim, shape: out.to_vec() })?;
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
pub fn transpose_swap(x: &[u64], out: &[u64], dim0: usize, dim1: usize) -> Result<Swap, ShapeError> {
    let rank = x.len();
    require(dim0 < rank && dim1 < rank, || ShapeError::Swap { dim0, dim1, shape: x.to_vec() })?;
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
) -> Result<Runs, ShapeError> {
    let Placement::Shard { dim, outer, inner } = p else {
        require(p == Placement::Replicate, || ShapeError::PendingSum)?;
        return reshape_runs(x, out);
    };
    require(axis < MESH_AXES, || ShapeError::NoMeshAxis(axis))?;
    let (parts, coord) = (mesh.axes()[axis], coords.0[axis]);
    let dim = usize::from(dim);
    let (before, size, after) = around(x, dim)?;
    let (outer, inner) = (outer.max(1) as usize, inner.max(1) as usize);
    let mid = size / outer.saturating_mul(inner);
    let whole = mid.saturating_mul(outer).saturating_mul(inner) == size;
    require(parts > 0 && coord < parts && whole && mid.is_multiple_of(parts as usize), || ShapeError::Split {
        dim,
        shape: x.to_vec(),
        outer,
        inner,
        parts,
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
    pub fn new(shapes: &[&[u64]], heads: u64, kv_heads: u64, fused: bool) -> Result<AttentionLayout, ShapeError> {
        let (heads, kv_heads) = (heads as usize, kv_heads as usize);
        require(heads > 0 && kv_heads > 0, || ShapeError::NoHeads)?;
        require(heads.is_multiple_of(kv_heads), || ShapeError::HeadGroups { heads, kv_heads })?;
        let expected = if fused { 1 } else { 3 };
        require(shapes.len() == expected, || ShapeError::Operands { want: expected, got: shapes.len() })?;
        if fused {
            require(kv_heads == heads, || ShapeError::FusedHeads { heads, kv_heads })?;
            let (lead, s, w) = batch_matrix(shapes[0], "the fused input")?;
            require(w.is_multiple_of(heads.saturating_mul(3)), || ShapeError::Width { width: w, heads, fused })?;
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
        require(w.is_multiple_of(heads), || ShapeError::Width { width: w, heads, fused })?;
        let d = w / heads;
        require(lq == lk && wk == kv_heads * d, || ShapeError::QueryKey {
            q: q.to_vec(),
            heads,
            k: k.to_vec(),
            kv_heads,
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
    pub fn apply<T: Copy + Default>(&self, src: &[T], dst: &mut [T]) -> Result<(), ShapeError> {
        require(self.fits(src.len(), dst.len()), || ShapeError::RunsOutside(*self))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The typed errors print the messages the checks printed as strings.
    #[test]
    fn messages_read_as_before() {
        let rank = batch_matrix(&[3], "A").map(|_| ()).expect_err("one dimension");
        assert_eq!(rank.to_string(), "A must have at least two dimensions, not [3]");
        let select = select_runs(&[2, 3], &[3], 0, 5).expect_err("index past the dimension");
        assert_eq!(select.to_string(), "index 5 is outside dimension 0 of [2, 3]");
        let swap = transpose_swap(&[2, 3], &[3, 2], 0, 2).expect_err("no dimension 2");
        assert_eq!(swap.to_string(), "cannot swap dimensions 0 and 2 of [2, 3]");
        let width = AttentionLayout::new(&[&[2, 6], &[2, 6], &[2, 6]], 4, 4, false).expect_err("6 / 4 heads");
        assert_eq!(width.to_string(), "width 6 is not a multiple of 4 heads");
        let length = same_len("the output", 3, 4).expect_err("3 != 4");
        assert_eq!(length.to_string(), "the output has 3 elements, expected 4");
        assert_eq!(String::from(ensure(false, || "as written".into()).expect_err("false")), "as written");
    }
}

/// The shapes of a [`crate::Kernel::CacheWrite`]: x [lead.., seq, parts * width] into a cache
/// [lead.., context, width].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheWriteLayout {
    /// The leading dimensions flattened (batch rows).
    pub rows: usize,
    pub seq: usize,
    pub context: usize,
    /// One chunk's width: the cache's row.
    pub width: usize,
    /// Where chunk `part` starts in a row of x, and x's row.
    pub part_start: usize,
    pub x_row: usize,
}

impl CacheWriteLayout {
    pub fn new(x: &[u64], cache: &[u64], part: u8, parts: u8) -> Result<CacheWriteLayout, ShapeError> {
        let (lead, seq, x_row) = batch_matrix(x, "x")?;
        let (cache_lead, context, width) = batch_matrix(cache, "the cache")?;
        ensure(parts >= 1 && part < parts, || format!("chunk {part} of {parts} does not exist"))?;
        ensure(lead == cache_lead, || format!("x {x:?} and the cache {cache:?} have other leading dimensions"))?;
        ensure(x_row == width * usize::from(parts), || {
            format!("x's rows ({x_row}) are not {parts} chunks of the cache's rows ({width})")
        })?;
        ensure(seq <= context, || format!("{seq} rows do not fit a cache of {context}"))?;
        let part_start = usize::from(part) * width;
        Ok(CacheWriteLayout { rows: numel(lead), seq, context, width, part_start, x_row })
    }
}

/// The shapes of a [`crate::Kernel::CachedAttention`]: q [lead.., seq, heads * d] (the fused
/// [lead.., seq, 3 * heads * d] when `fused`), caches [lead.., context, kv_heads * d].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedAttentionLayout {
    pub rows: usize,
    pub seq: usize,
    pub context: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub d: usize,
    /// q's row (the fused row when fused); q's heads start at its beginning.
    pub q_row: usize,
}

impl CachedAttentionLayout {
    pub fn new(
        q: &[u64],
        k_cache: &[u64],
        v_cache: &[u64],
        (heads, kv_heads): (u64, u64),
        fused: bool,
    ) -> Result<CachedAttentionLayout, ShapeError> {
        let (heads, kv_heads) = (heads as usize, kv_heads as usize);
        require(heads > 0 && kv_heads > 0, || ShapeError::NoHeads)?;
        require(heads.is_multiple_of(kv_heads), || ShapeError::HeadGroups { heads, kv_heads })?;
        require(!fused || kv_heads == heads, || ShapeError::FusedHeads { heads, kv_heads })?;
        same_shape("the value cache", v_cache, k_cache)?;
        let (lead, seq, q_row) = batch_matrix(q, "q")?;
        let (cache_lead, context, kv_row) = batch_matrix(k_cache, "the key cache")?;
        let width = if fused { 3 * heads } else { heads };
        require(q_row.is_multiple_of(width), || ShapeError::Width { width: q_row, heads, fused })?;
        let d = q_row / width;
        require(lead == cache_lead && kv_row == kv_heads * d, || ShapeError::QueryKey {
            q: q.to_vec(),
            heads,
            k: k_cache.to_vec(),
            kv_heads,
        })?;
        ensure(seq <= context, || format!("{seq} query rows do not fit a cache of {context}"))?;
        Ok(CachedAttentionLayout { rows: numel(lead), seq, context, heads, kv_heads, d, q_row })
    }

    /// The output's shape: [lead.., seq, heads * d].
    pub fn out_shape(&self, q: &[u64]) -> Vec<u64> {
        let mut shape = q.to_vec();
        if let Some(last) = shape.last_mut() {
            *last = (self.heads * self.d) as u64;
        }
        shape
    }
}

/// The step's first position from a `position` operand's elements (an i32 [1] input), checked so that
/// `seq` rows from it fit `context` positions.
pub fn step_position(values: &[i32], seq: usize, context: usize) -> Result<usize, ShapeError> {
    let [position] = values else {
        return Err(ShapeError::Invalid(format!("the position operand has {} elements, not one", values.len())));
    };
    let start =
        usize::try_from(*position).map_err(|_| ShapeError::Invalid(format!("the position {position} is negative")))?;
    ensure(start.checked_add(seq).is_some_and(|end| end <= context), || {
        format!("positions {start}..{} do not fit the {context} the cache or table holds", start.saturating_add(seq))
    })?;
    Ok(start)
}
