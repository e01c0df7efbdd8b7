//! bf16 products with an operand whose rows are not 16-byte aligned, padded before cuBLAS sees them.
//!
//! cuBLAS runs a product on its fast kernels (16-byte vector loads, the bulk copy engine on Hopper) only
//! when every matrix starts on a 16-byte boundary and its rows are whole 16-byte units. A vocabulary of
//! 50,257 columns (GPT-2's logits and their gradient) is neither, and the three products of the output
//! layer then run several times slower (measured on an H200 through PyTorch: 94 to 147 TFLOP/s at 50,257
//! columns, 677 to 713 at 50,264). Such a product is computed as PyTorch's compiler pads it: m, n and k
//! rounded up to multiples of 8, each operand copied into a zero-filled scratch of those sizes (the
//! zeros along k add nothing), the output computed in scratch and its m x n corner copied back.

use super::*;
use cudarc::driver::{CudaView, CudaViewMut};

/// The bytes every row start must be a multiple of.
const ALIGN: usize = 16;

/// The scratch the realigned operands live in (grown as needed, kept for the next product).
#[derive(Debug, Default)]
pub(crate) struct Realign {
    a: Option<CudaSlice<u16>>,
    b: Option<CudaSlice<u16>>,
    c16: Option<CudaSlice<u16>>,
    c32: Option<CudaSlice<f32>>,
}

/// An element type of a product operand, with its row copy kernel and its output scratch.
pub(super) trait Realignable: Elem {
    const COPY_ROWS: &'static str;
    /// The row copy that writes the destination a 16-byte word a thread, where there is one.
    const COPY_ROWS_BY_WORDS: Option<&'static str>;
    fn output_slot(r: &mut Realign) -> &mut Option<CudaSlice<Self>>;
}

impl Realignable for u16 {
    const COPY_ROWS: &'static str = COPY_ROWS_U16;
    const COPY_ROWS_BY_WORDS: Option<&'static str> = Some(COPY_ROWS_U16_X8);
    fn output_slot(r: &mut Realign) -> &mut Option<CudaSlice<u16>> {
        &mut r.c16
    }
}

impl Realignable for f32 {
    const COPY_ROWS: &'static str = COPY_ROWS_F32;
    const COPY_ROWS_BY_WORDS: Option<&'static str> = None;
    fn output_slot(r: &mut Realign) -> &mut Option<CudaSlice<f32>> {
        &mut r.c32
    }
}

pub(super) const COPY_ROWS_F32: &str = "copy_rows";
pub(super) const COPY_ROWS_U16: &str = "copy_rows_u16";
pub(super) const COPY_ROWS_U16_X8: &str = "copy_rows_u16x8";
pub(super) const PAD_ROWS_U16: &str = "pad_rows_u16";
pub(super) const PAD_ROWS_U16_X8: &str = "pad_rows_u16x8";

/// Whether a (single) block of `data` can be read by cuBLAS's aligned kernels.
fn aligned<T>(dev: &Device, data: &CudaSlice<T>, block: &Block) -> bool {
    let size = std::mem::size_of::<T>();
    let start = dev.start(data) as usize + block.start * size;
    start.is_multiple_of(ALIGN) && (block.ld * size).is_multiple_of(ALIGN)
}

impl Device {
    /// Copies the rows of `block` of `src` into `dst` (rows `dst_ld` apart, from its start), or back.
    fn copy_rows<T: Realignable>(
        &self,
        src: &CudaView<T>,
        dst: &mut CudaViewMut<T>,
        (rows, cols): (usize, usize),
        (src_ld, dst_ld): (usize, usize),
    ) -> Result<(), KernelError> {
        let (rows64, cols64, src64, dst64) = (rows as u64, cols as u64, src_ld as u64, dst_ld as u64);
        if let Some(by_words) = T::COPY_ROWS_BY_WORDS.filter(|_| cols >= 8 && super::eights_enabled()) {
            // A word of the destination a thread (its rows may start anywhere in a word).
            let len = src.len() as u64;
            let cfg = per_rows(rows, cols / 8);
            return launch!(self, by_words, cfg, [dst, src, &len, &rows64, &cols64, &src64, &dst64]);
        }
        launch!(self, T::COPY_ROWS, per_rows(rows, cols), [dst, src, &rows64, &cols64, &src64, &dst64])
    }

    /// `op` as an operand of the padded product: itself when it is aligned and already `dims` (rows,
    /// cols) in size, else a copy in `slot`, zero-filled to `dims`.
    fn padded_operand<'s>(
        &self,
        op: &Operand<'s, u16>,
        dims: (usize, usize),
        slot: &'s mut Option<CudaSlice<u16>>,
    ) -> Result<Operand<'s, u16>, KernelError> {
        let b = op.block;
        if aligned(self, op.data, &b) && (b.rows, b.cols) == dims {
            return Ok(*op);
        }
        let (rows, ld) = dims;
        let scratch = grow(slot, &self.stream, rows * ld)?;
        let wide = in_eights(ld, &[self.start(scratch)]);
        let mut view = scratch.slice_mut(0..rows * ld);
        let src = op.data.try_slice(b.start..).ok_or_else(|| KernelError::Internal(BLOCK_PAST_BUFFER.into()))?;
        require(b.rows <= rows && b.cols <= ld, || KernelError::Internal("a padded operand shrinks".into()))?;
        // The copy writes the padding's zeros too: no separate pass over the whole scratch.
        let (r, c, src_ld, dst_rows, dst_ld) = (b.rows as u64, b.cols as u64, b.ld as u64, rows as u64, ld as u64);
        if wide {
            let len = src.len() as u64;
            let cfg = elementwise(rows * ld / 8);
            launch!(self, PAD_ROWS_U16_X8, cfg, [&mut view, &src, &len, &r, &c, &src_ld, &dst_rows, &dst_ld])?;
        } else {
            launch!(self, PAD_ROWS_U16, per_rows(rows, ld), [&mut view, &src, &r, &c, &src_ld, &dst_rows, &dst_ld])?;
        }
        let block = Block { start: 0, rows, cols: ld, ld, stride: rows * ld };
        Ok(Operand { data: &*scratch, block, transpose: op.transpose })
    }

    /// The product `p` (one batch, `(m, n, k)`) padded when an operand is misaligned: m, n and k
    /// rounded up to multiples of 8, A and B in zero-filled scratch of those sizes, the output computed
    /// in scratch (after a copy of its old contents when the product accumulates) unless it is aligned
    /// and unchanged in size, and its m x n corner copied back. `None` when every operand is aligned.
    pub(super) fn realigned_product<C: BlasOut + Realignable>(
        &self,
        c: &mut CudaSlice<C>,
        p: &Product<u16>,
        (m, n, k): (usize, usize, usize),
    ) -> Result<Option<()>, KernelError> {
        let out_aligned = aligned(self, c, &p.c);
        let inputs_aligned = aligned(self, p.a.data, &p.a.block) && aligned(self, p.b.data, &p.b.block);
        if p.batches != 1 || (out_aligned && inputs_aligned) {
            return Ok(None);
        }
        let (m2, n2, k2) = (pad(m), pad(n), pad(k));
        let mut guard =
            self.realign.lock().map_err(|_| KernelError::Poisoned("the realignment scratch is poisoned"))?;
        let mut out_slot = C::output_slot(&mut guard).take();
        let Realign { a, b, .. } = &mut *guard;
        let a_dims = if p.a.transpose { (k2, m2) } else { (m2, k2) };
        let b_dims = if p.b.transpose { (n2, k2) } else { (k2, n2) };
        let product = Product {
            a: self.padded_operand(&p.a, a_dims, a)?,
            b: self.padded_operand(&p.b, b_dims, b)?,
            c: p.c,
            batches: 1,
            alpha: p.alpha,
            accumulate: p.accumulate,
        };
        let result = if out_aligned && (m2, n2) == (m, n) {
            self.gemm_ex(c, &product, (m, n, k2))
        } else {
            self.run_into_padded_output(c, product, (m2, n2, k2), &mut out_slot)
        };
        *C::output_slot(&mut guard) = out_slot;
        result.map(Some)
    }

    /// Runs `product` (padded to `(m2, n2, k2)`) into an m2 x n2 scratch (after a copy of the output's
    /// old contents when it accumulates) and copies its corner into the output block `product.c` of `c`.
    fn run_into_padded_output<C: BlasOut + Realignable>(
        &self,
        c: &mut CudaSlice<C>,
        mut product: Product<u16>,
        (m2, n2, k2): (usize, usize, usize),
        slot: &mut Option<CudaSlice<C>>,
    ) -> Result<(), KernelError> {
        let target = product.c;
        let (rows, cols) = (target.rows, target.cols);
        let scratch = grow(slot, &self.stream, m2 * n2)?;
        let missing = || KernelError::Internal(BLOCK_PAST_BUFFER.into());
        if product.accumulate {
            let old = c.try_slice(target.start..).ok_or_else(missing)?;
            self.copy_rows(&old, &mut scratch.slice_mut(..), (rows, cols), (target.ld, n2))?;
        }
        product.c = Block { start: 0, rows: m2, cols: n2, ld: n2, stride: m2 * n2 };
        self.gemm_ex(scratch, &product, (m2, n2, k2))?;
        // The copy back stays one element a thread: its destination rows are the misaligned ones, and
        // eight-element stores from each lane (16 bytes apart across a warp) measured 2.5x slower.
        let mut into = c.try_slice_mut(target.start..).ok_or_else(missing)?;
        self.copy_rows(&scratch.slice(..), &mut into, (rows, cols), (n2, target.ld))
    }
}

/// A product dimension rounded up to a multiple of 8 (16 bytes of bf16).
fn pad(x: usize) -> usize {
    x.div_ceil(8).max(1) * 8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_sizes_are_whole_16_byte_units_of_bf16_and_of_f32() {
        assert_eq!(pad(50_257), 50_264);
        assert_eq!(pad(768), 768);
        assert_eq!(pad(1), 8);
        assert_eq!(pad(0), 8);
        assert!((pad(50_257) * 2).is_multiple_of(ALIGN) && (pad(50_257) * 4).is_multiple_of(ALIGN));
    }
}
