//! Many tensors in one launch: the AdamW updates of a step (with their clipping scales) and the casts of
//! its bf16 gradients to f32, which the plan issues one tensor at a time (148 launches each for GPT-2
//! small, most of them too small to fill the GPU). Each launch reads a span table (addresses, length,
//! first block) that is uploaded once and kept while the tensors stay where they are (the arena does not
//! move), as the gradient norm's is. The arithmetic is the one-tensor kernels' own, so results are
//! bit-identical.

use super::{Device, DeviceError, KernelError, SQUARE_SUM_SPAN, THREADS, adamw_scalars, config, upload_slice};
use crate::settings::OptimizerSettings;
use cudarc::driver::{CudaSlice, PushKernelArg};

/// One AdamW update: device addresses of f32 buffers of `len` elements each, and the clipping factor
/// to apply to the gradient first (which the update also writes back into the gradient).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamwJob {
    pub param: u64,
    pub grad: u64,
    pub state1: u64,
    pub state2: u64,
    pub len: usize,
    pub grad_scale: Option<f32>,
}

/// One cast of `len` bf16 elements at `src` to f32 at `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WidenJob {
    pub src: u64,
    pub dst: u64,
    pub len: usize,
}

/// A span table on the GPU with the host copy it was written from.
#[derive(Default)]
pub(super) struct SpanTable {
    host: Vec<u64>,
    device: Option<CudaSlice<u64>>,
}

impl SpanTable {
    /// The table on the GPU, uploaded only when it differs from the last one.
    fn device(&mut self, dev: &Device, table: Vec<u64>) -> Result<&CudaSlice<u64>, KernelError> {
        if self.host != table || self.device.is_none() {
            self.device = Some(upload_slice(&dev.stream, &table)?);
            self.host = table;
        }
        self.device.as_ref().ok_or_else(|| KernelError::Internal("no span table".into()))
    }
}

/// The span tables of the two many-tensor launches.
#[derive(Default)]
pub(super) struct SpanTables {
    adamw: SpanTable,
    widen: SpanTable,
}

/// The span table of `jobs`: each non-empty tensor's `F` fields, its length and its first block; with
/// the tensors and the blocks in all.
fn spans<J, const F: usize>(jobs: &[J], fields: impl Fn(&J) -> ([u64; F], usize)) -> (Vec<u64>, u64, usize) {
    let mut table = Vec::with_capacity(jobs.len() * (F + 2));
    let (mut tensors, mut blocks) = (0u64, 0usize);
    for job in jobs {
        let (addresses, len) = fields(job);
        if len == 0 {
            continue;
        }
        table.extend(addresses);
        table.extend([len as u64, blocks as u64]);
        tensors += 1;
        blocks += len.div_ceil(SQUARE_SUM_SPAN);
    }
    (table, tensors, blocks)
}

/// A clipping factor as the kernel reads it: the f32 bits, and bit 32 set when it applies.
fn scale_word(scale: Option<f32>) -> u64 {
    scale.map_or(0, |f| (1u64 << 32) | u64::from(f.to_bits()))
}

impl Device {
    /// Runs every AdamW update of `jobs` in one launch (the parameters must not overlap each other's
    /// buffers: the caller checks).
    pub(super) fn adamw_many(
        &self,
        tables: &mut SpanTables,
        jobs: &[AdamwJob],
        s: &OptimizerSettings,
        step: u64,
    ) -> Result<(), KernelError> {
        let row = |j: &AdamwJob| ([j.param, j.grad, j.state1, j.state2, scale_word(j.grad_scale)], j.len);
        let (table, tensors, blocks) = spans(jobs, row);
        if blocks == 0 {
            return Ok(());
        }
        let k = adamw_scalars(s, step);
        let spans = tables.adamw.device(self, table)?;
        let per = SQUARE_SUM_SPAN as u64;
        let cfg = Some(config((blocks, 1), (THREADS, 1)));
        launch!(
            self,
            super::names::ADAMW_SPANS,
            cfg,
            [spans, &tensors, &per, &k[0], &k[1], &k[2], &k[3], &k[4], &k[5], &k[6]]
        )
    }

    /// Widens every bf16 source of `jobs` into its f32 destination in one launch.
    pub(super) fn widen_many(&self, tables: &mut SpanTables, jobs: &[WidenJob]) -> Result<(), KernelError> {
        let (table, tensors, blocks) = spans(jobs, |j| ([j.src, j.dst], j.len));
        if blocks == 0 {
            return Ok(());
        }
        let spans = tables.widen.device(self, table)?;
        let per = SQUARE_SUM_SPAN as u64;
        let cfg = Some(config((blocks, 1), (THREADS, 1)));
        launch!(self, super::bf16::CAST_BF16_TO_F32_SPANS, cfg, [spans, &tensors, &per])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn span_tables_number_blocks_across_tensors_and_skip_empty_ones() {
        let jobs = [
            WidenJob { src: 10, dst: 20, len: SQUARE_SUM_SPAN + 1 },
            WidenJob { src: 30, dst: 40, len: 0 },
            WidenJob { src: 50, dst: 60, len: 3 },
        ];
        let (table, tensors, blocks) = spans(&jobs, |j| ([j.src, j.dst], j.len));
        assert_eq!((tensors, blocks), (2, 3));
        let span = SQUARE_SUM_SPAN as u64;
        assert_eq!(table, vec![10, 20, span + 1, 0, 50, 60, 3, 2]);
    }

    #[test]
    fn a_clipping_factor_carries_its_bits_and_a_flag() {
        assert_eq!(scale_word(None), 0);
        let word = scale_word(Some(0.5));
        assert_eq!(word >> 32, 1);
        assert_eq!(f32::from_bits(word as u32), 0.5);
        // A factor whose bits are all zero (0.0) still applies.
        assert_eq!(scale_word(Some(0.0)), 1 << 32);
    }
}
