//! The CPU backend: kernels on host memory, and a mesh of device threads in one process.

#[cfg(test)]
mod bf16_pieces_tests;
pub mod blas;
pub mod kernels;
pub mod par;
pub mod pin;
pub mod sgemm;
pub mod threads;
pub mod vmath;

use super::arena::{ArenaLayout, HostArena};
use super::backend::{Backend, Exchanges, UpdateBuffers};
use super::comm::RawBlock;
use super::error::{KernelError, RuntimeError, unreachable};
use super::settings::{KernelContext, OptimizerSettings};
use super::view::{View, ViewData, ViewMut, ViewMutData};
use optimus_plan::tensor::Tensor;
use optimus_plan::{BufferId, Kernel, Plan};

/// Bytes from which a freed allocation goes back to the operating system at once (see
/// [`return_freed_memory_promptly`]).
const RETURN_FREED_FROM: i32 = 128 * 1024;

/// Asks the C allocator (glibc) to give freed blocks of [`RETURN_FREED_FROM`] bytes or more back to the
/// operating system at once, instead of keeping them in each thread's heap for later. A device's
/// memory is its arena, laid out from the plan; what kernels allocate besides (the bounded pieces of
/// the bf16 emulation, attention tiles, host copies of a step's inputs) is transient, and glibc's
/// default (raising the threshold to the largest block freed so far, up to 32 MiB, and keeping such
/// blocks in every thread's heap) would leave several MiB resident per device thread, memory the plan
/// does not hold. Other allocators, and other systems, are left as they are.
pub fn return_freed_memory_promptly() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // glibc's mallopt parameters (malloc.h).
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        unsafe extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        // SAFETY: mallopt only changes allocator parameters; any value is accepted or refused (0).
        unsafe {
            mallopt(M_MMAP_THRESHOLD, RETURN_FREED_FROM);
            mallopt(M_TRIM_THRESHOLD, RETURN_FREED_FROM);
        }
    }
}

/// Whether a kernel runs on bf16 buffers as they are: kernels that only move elements (reshape,
/// transpose, select, slice, the embedding and position lookups, a decoding step's included) move
/// their bits between bf16 buffers without widening them to f32 and back (which is exact anyway), and
/// a fill writes bf16 directly.
fn runs_on_bf16_bits(kernel: &Kernel, inputs: &[&View], out: &ViewMut) -> bool {
    let moves = matches!(
        kernel,
        Kernel::Reshape
            | Kernel::Transpose { .. }
            | Kernel::Select { .. }
            | Kernel::SelectGrad { .. }
            | Kernel::SliceShard { .. }
            | Kernel::EmbeddingLookup { .. }
            | Kernel::PositionLookup
            | Kernel::PositionLookupAt
            | Kernel::Fill { .. }
    );
    let floats_are_bf16 = inputs.iter().all(|v| matches!(v.data, ViewData::Bf16(_) | ViewData::I32(_)));
    moves && floats_are_bf16 && matches!(out.data, ViewMutData::Bf16(_))
}

/// Runs a kernel with a bf16 operand the way the CPU emulates bf16: widening bf16 operands to f32 and
/// rounding the f32 result into a bf16 output, a bounded piece at a time wherever the kernel allows it
/// (see [`super::bf16`]), so that the scratch stays small whatever the tensors' sizes. `None` for a
/// kernel that is widened whole.
fn bf16_in_pieces(
    kernel: &Kernel,
    refs: &[&View],
    out: &mut ViewMut,
    ctx: &KernelContext,
) -> Option<Result<(), KernelError>> {
    use super::bf16;
    let run = |ins: &[&View], out: &mut ViewMut| kernels::run_views(kernel, ins, out, ctx);
    match kernel {
        Kernel::MatMul { transpose_a, transpose_b, accumulate } => {
            let flags = (*transpose_a, *transpose_b, *accumulate);
            let product = |ins: &[&View], out: &mut ViewMut, accumulate: bool| {
                let k = Kernel::MatMul { transpose_a: flags.0, transpose_b: flags.1, accumulate };
                kernels::run_views(&k, ins, out, ctx)
            };
            bf16::product_in_pieces(refs, out, flags, &product)
        }
        Kernel::Dropout { p, key } | Kernel::DropoutGrad { p, key } => {
            let rows = |ins: &[&View], out: &mut ViewMut, first: usize| {
                let x = ins.first().ok_or(KernelError::Takes { kernel: "dropout", inputs: "one input" })?.f32()?;
                kernels::dropout_rows(x, out.f32_mut()?, ctx, (*p, *key), first)
            };
            bf16::by_rows_at(refs, out, &[true], &rows)
        }
        Kernel::SumToLast => Some(bf16::sum_to_last(refs, out)),
        // A cache write rounds, widens or moves each element of the step's rows itself: widening the
        // whole cache would cost its every row, each step.
        Kernel::CacheWrite { .. } => Some(run(refs, out)),
        // Only the cache rows the step attends to are widened.
        Kernel::CachedAttention { .. } => Some(kernels::cached_attention_on_prefix(refs, out, &run)),
        Kernel::PositionGrad => Some(bf16::position_grad(refs, out)),
        Kernel::LayerNormGradWeight { n, eps } => Some(bf16::layer_norm_grad_weight(refs, out, *n, *eps)),
        Kernel::EmbeddingGrad { offset, masked, padding } => {
            Some(bf16::embedding_grad(refs, out, (offset.at(ctx.coords), *masked), *padding))
        }
        k if bf16::matrix_split(k) => bf16::by_matrices(refs, out, &run),
        k => bf16::row_split(k).and_then(|split| bf16::by_rows(refs, out, split, &run)),
    }
}

/// Kernels on the host CPU (faer for matrix products), on a [`HostArena`].
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    type Storage = HostArena;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn allocate(&mut self, plan: &Plan, layout: &ArenaLayout) -> Result<HostArena, RuntimeError> {
        HostArena::new(plan, layout)
    }

    fn relayout(&mut self, storage: &mut HostArena, plan: &Plan, layout: &ArenaLayout) -> Result<bool, RuntimeError> {
        storage.relayout(plan, layout)?;
        Ok(true)
    }

    fn upload(&mut self, storage: &mut HostArena, id: BufferId, tensor: &Tensor) -> Result<(), RuntimeError> {
        storage.write(id, tensor)
    }

    fn download(&mut self, storage: &HostArena, id: BufferId) -> Result<Tensor, RuntimeError> {
        storage.download(id)
    }

    fn download_into(&mut self, storage: &HostArena, id: BufferId, into: &mut Tensor) -> Result<(), RuntimeError> {
        storage.download_into(id, into)
    }

    fn zero(&mut self, storage: &mut HostArena, id: BufferId) -> Result<(), RuntimeError> {
        storage.zero(id)
    }

    fn retain(&mut self, storage: &mut HostArena, keep: &[BufferId]) -> Result<(), RuntimeError> {
        storage.retain(keep)
    }

    fn first_non_finite(&mut self, storage: &HostArena, id: BufferId) -> Result<Option<(usize, f32)>, RuntimeError> {
        storage.first_non_finite(id)
    }

    fn kernel(
        &mut self,
        storage: &mut HostArena,
        kernel: &Kernel,
        inputs: &[BufferId],
        output: BufferId,
        ctx: &KernelContext,
    ) -> Result<(), RuntimeError> {
        let (ins, mut outs) = storage.operands(inputs, &[output])?;
        let refs: Vec<&View> = ins.iter().collect();
        let out = outs.first_mut().ok_or_else(|| unreachable("one output"))?;
        // bf16 operands are widened to f32 and the result rounded once into a bf16 output: the CPU
        // computes in f32 throughout and stores bf16 where the plan says.
        let has_bf16 =
            refs.iter().any(|v| matches!(v.data, ViewData::Bf16(_))) || matches!(out.data, ViewMutData::Bf16(_));
        if has_bf16 && runs_on_bf16_bits(kernel, &refs, out) {
            return par::on_pool(|| kernels::run_views(kernel, &refs, out, ctx)).map_err(RuntimeError::Kernel);
        }
        // The emulation's products stay in faer, whose tiles give the whole product's bits.
        if has_bf16 && let Some(done) = par::on_pool(|| blas::faer_only(|| bf16_in_pieces(kernel, &refs, out, ctx))) {
            return done.map_err(RuntimeError::Kernel);
        }
        let run = |ins: &[&View], out: &mut ViewMut| kernels::run_views(kernel, ins, out, ctx);
        let widened = || super::bf16::with_widened(&refs, out, kernel.reads_its_output(), run);
        let done = if has_bf16 { par::on_pool(|| blas::faer_only(widened)) } else { par::on_pool(widened) };
        done.map_err(RuntimeError::Kernel)
    }

    fn optimizer_step(
        &mut self,
        storage: &mut HostArena,
        b: UpdateBuffers,
        settings: &OptimizerSettings,
        step: u64,
    ) -> Result<(), RuntimeError> {
        let (ins, mut outs) = storage.operands(&[b.grad], &[b.param, b.state1, b.state2])?;
        let ([grad], [param, state1, state2]) = (&ins[..], &mut outs[..]) else {
            return Err(unreachable("a gradient and three updated buffers"));
        };
        par::on_pool(|| kernels::optimizer_step_views(param, grad, state1, state2, settings, step))
            .map_err(RuntimeError::Kernel)
    }

    fn collective(
        &mut self,
        storage: &mut HostArena,
        send: BufferId,
        recv: BufferId,
        elementwise: bool,
        exchange: &mut dyn Exchanges,
    ) -> Result<(), RuntimeError> {
        storage.exchange(send, recv, elementwise, exchange)
    }

    fn lends_in_place(&self, storage: &HostArena, send: BufferId, recv: BufferId) -> bool {
        storage.lends_in_place(send, recv)
    }

    fn reads_blocks_in_place(&self) -> bool {
        true
    }

    fn raw_block(&self, storage: &HostArena, id: BufferId) -> Option<RawBlock> {
        storage.raw_block(id).ok()
    }

    unsafe fn borrow_block(
        &mut self,
        storage: &mut HostArena,
        id: BufferId,
        block: RawBlock,
    ) -> Result<bool, RuntimeError> {
        // SAFETY: passed on from the caller.
        unsafe { storage.borrow(id, block)? };
        Ok(true)
    }

    fn end_borrow(&mut self, storage: &mut HostArena, id: BufferId) {
        storage.end_borrow(id);
    }

    fn may_overlap(&self, storage: &HostArena, a: BufferId, b: BufferId) -> bool {
        storage.regions_overlap(a, b).unwrap_or(true)
    }
}
