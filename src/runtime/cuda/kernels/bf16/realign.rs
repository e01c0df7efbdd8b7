//! bf16 products whose operand rows are not 16-byte aligned, realigned before cuBLAS sees them.
//!
//! cuBLAS runs a product on its fast kernels (16-byte vector loads, the bulk copy engine on Hopper) only
//! when every matrix starts on a 16-byte boundary and its leading dimension is a multiple of 16 bytes.
//! A vocabulary of 50,257 columns (GPT-2's logits and their gradient) is neither, and the three products
//! of the output layer then run on kernels for 2-byte alignment, several times slower. Such an operand is
//! copied into a scratch whose rows are padded to 16 bytes (the output is computed there and copied
//! back), which costs a pass over it, as PyTorch's compiler pads such products.

use super::*;
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr};

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
    fn output_slot(r: &mut Realign) -> &mut Option<CudaSlice<Self>>;
}

impl Realignable for u16 {
    const COPY_ROWS: &'static str = COPY_ROWS_U16;
    fn output_slot(r: &mut Realign) -> &mut Option<CudaSlice<u16>> {
        &mut r.c16
    }
}

impl Realignable for f32 {
    const COPY_ROWS: &'static str = COPY_ROWS_F32;
    fn output_slot(r: &mut Realign) -> &mut Option<CudaSlice<f32>> {
        &mut r.c32
    }
}

pub(super) const COPY_ROWS_F32: &str = "copy_rows";
pub(super) const COPY_ROWS_U16: &str = "copy_rows_u16";

/// Whether a (single) block of `data` can be read by cuBLAS's aligned kernels.
fn aligned<T>(data: &CudaSlice<T>, block: &Block, stream: &CudaStream) -> bool {
    let size = std::mem::size_of::<T>();
    let start = data.device_ptr(stream).0 as usize + block.start * size;
    start.is_multiple_of(ALIGN) && (block.ld * size).is_multiple_of(ALIGN)
}

/// The leading dimension of a realigned copy of a block of `cols` elements of `T`.
fn padded_ld<T>(cols: usize) -> usize {
    let per = ALIGN / std::mem::size_of::<T>();
    cols.div_ceil(per).max(1) * per
}

impl Device {
    /// Copies the rows of `block` of `src` into `dst` (rows `dst_ld` apart, from its start), or back.
    fn copy_rows<T: Realignable>(
        &self,
        src: &CudaView<T>,
        dst: &mut CudaViewMut<T>,
        (rows, cols): (usize, usize),
        (src_ld, dst_ld): (usize, usize),
    ) -> Result<(), String> {
        let (rows64, cols64, src64, dst64) = (rows as u64, cols as u64, src_ld as u64, dst_ld as u64);
        launch!(self, T::COPY_ROWS, per_rows(rows, cols), [dst, src, &rows64, &cols64, &src64, &dst64])
    }

    /// A realigned copy of operand `op` (a single block) in `slot`, or `None` when it is aligned.
    fn realigned_operand<'s>(
        &self,
        op: &Operand<u16>,
        slot: &'s mut Option<CudaSlice<u16>>,
    ) -> Result<Option<(&'s CudaSlice<u16>, Block)>, String> {
        let b = op.block;
        if aligned(op.data, &b, &self.stream) {
            return Ok(None);
        }
        let ld = padded_ld::<u16>(b.cols);
        let scratch = grow(slot, &self.stream, b.rows * ld)?;
        let src = op.data.try_slice(b.start..).ok_or("internal error: a product block starts past its buffer")?;
        self.copy_rows(&src, &mut scratch.slice_mut(..), (b.rows, b.cols), (b.ld, ld))?;
        Ok(Some((&*scratch, Block { start: 0, rows: b.rows, cols: b.cols, ld, stride: b.rows * ld })))
    }

    /// The product `p` (one batch) with every misaligned operand realigned: A and B copied into padded
    /// scratch, and a misaligned output computed in scratch (after a copy of its old contents when the
    /// product accumulates) and copied back. `None` when every operand is aligned.
    pub(super) fn realigned_product<C: BlasOut + Realignable>(
        &self,
        c: &mut CudaSlice<C>,
        p: &Product<u16>,
        dims: (usize, usize, usize),
    ) -> Result<Option<()>, String> {
        let out_aligned = aligned(c, &p.c, &self.stream);
        let inputs_aligned = aligned(p.a.data, &p.a.block, &self.stream) && aligned(p.b.data, &p.b.block, &self.stream);
        if p.batches != 1 || (out_aligned && inputs_aligned) {
            return Ok(None);
        }
        let mut guard = self.realign.lock().map_err(|_| "the realignment scratch is poisoned".to_string())?;
        let mut out_slot = C::output_slot(&mut guard).take();
        let Realign { a, b, .. } = &mut *guard;
        let mut product = Product { a: p.a, b: p.b, c: p.c, batches: 1, alpha: p.alpha, accumulate: p.accumulate };
        if let Some((data, block)) = self.realigned_operand(&p.a, a)? {
            product.a = Operand { data, block, transpose: p.a.transpose };
        }
        if let Some((data, block)) = self.realigned_operand(&p.b, b)? {
            product.b = Operand { data, block, transpose: p.b.transpose };
        }
        let result = if out_aligned {
            self.gemm_ex(c, &product, dims)
        } else {
            self.run_into_padded_output(c, product, dims, &mut out_slot)
        };
        *C::output_slot(&mut guard) = out_slot;
        result.map(Some)
    }

    /// Runs `product` into a scratch with rows padded to 16 bytes (after a copy of the output's old
    /// contents when it accumulates) and copies the result into the output block `product.c` of `c`.
    fn run_into_padded_output<C: BlasOut + Realignable>(
        &self,
        c: &mut CudaSlice<C>,
        mut product: Product<u16>,
        dims: (usize, usize, usize),
        slot: &mut Option<CudaSlice<C>>,
    ) -> Result<(), String> {
        let target = product.c;
        let (rows, cols, ld) = (target.rows, target.cols, padded_ld::<C>(target.cols));
        let scratch = grow(slot, &self.stream, rows * ld)?;
        let missing = || "internal error: a product block starts past its buffer".to_string();
        if product.accumulate {
            let old = c.try_slice(target.start..).ok_or_else(missing)?;
            self.copy_rows(&old, &mut scratch.slice_mut(..), (rows, cols), (target.ld, ld))?;
        }
        product.c = Block { start: 0, rows, cols, ld, stride: rows * ld };
        self.gemm_ex(scratch, &product, dims)?;
        let mut into = c.try_slice_mut(target.start..).ok_or_else(missing)?;
        self.copy_rows(&scratch.slice(..), &mut into, (rows, cols), (ld, target.ld))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_rows_are_whole_16_byte_units() {
        assert_eq!(padded_ld::<u16>(50_257), 50_264);
        assert_eq!(padded_ld::<u16>(768), 768);
        assert_eq!(padded_ld::<f32>(50_257), 50_260);
        assert_eq!(padded_ld::<f32>(1), 4);
    }
}
