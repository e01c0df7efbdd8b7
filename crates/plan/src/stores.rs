//! Where a run's parameters come from and go to, as traits: the io crate implements them for its
//! checkpoint folders and mapped weight files, and the runtime calls them, so the executor never reads
//! or writes a file format and the runtime does not depend on io.

use crate::tensor::Tensor;
use crate::{Buffer, Coords, Mesh, Plan, PlanParam};
use std::path::PathBuf;

/// Why a store failed, as the implementation's own error (an io crate error, say): callers show it or
/// downcast it.
pub type StoreError = Box<dyn std::error::Error + Send + Sync>;

/// One parameter's blocks on a device: the parameter and its optimizer states, in `PlanParam.state` order.
pub struct DeviceParamBlocks<'a> {
    pub param: &'a Tensor,
    pub states: Vec<&'a Tensor>,
}

/// A checkpoint to resume from (written on any mesh).
pub trait CheckpointSource: Send + Sync + std::fmt::Debug {
    /// Device `coords`' blocks of parameters `params` of `plan` (indices into `plan.params`, which
    /// must match the checkpoint's as a whole), in that order, each with its optimizer-state blocks
    /// when `with_state`. A pipeline stage asks for the parameters it holds.
    fn device_blocks_of(
        &self,
        plan: &Plan,
        coords: Coords,
        with_state: bool,
        params: &[usize],
    ) -> Result<Vec<(Tensor, Vec<Tensor>)>, StoreError>;

    /// Device `coords`' blocks of every parameter of `plan`, in `plan.params` order.
    fn device_blocks(
        &self,
        plan: &Plan,
        coords: Coords,
        with_state: bool,
    ) -> Result<Vec<(Tensor, Vec<Tensor>)>, StoreError> {
        let every: Vec<usize> = (0..plan.params.len()).collect();
        self.device_blocks_of(plan, coords, with_state, &every)
    }
}

/// Pretrained weights a run starts from, read block by block.
pub trait WeightSource: Send + Sync + std::fmt::Debug {
    /// Device `coords`' block of parameter `param`, whose buffer is `buffer`.
    fn block(&self, param: &PlanParam, buffer: &Buffer, coords: Coords, mesh: Mesh) -> Result<Tensor, StoreError>;
}

/// Where a training run commits its periodic checkpoints. Every device of the mesh calls
/// [`CheckpointSink::write_device`] for a step; one device calls [`CheckpointSink::prepare`] before
/// and [`CheckpointSink::commit`] after they all have.
pub trait CheckpointSink: Send + Sync + std::fmt::Debug {
    /// Where the checkpoints go (a folder), to name to the user.
    fn location(&self) -> &std::path::Path;
    /// Makes a fresh place for checkpoint `step` (after `step` updates).
    fn prepare(&self, step: u64) -> Result<(), StoreError>;
    /// Writes device `coords`' blocks of checkpoint `step`.
    fn write_device(
        &self,
        plan: &Plan,
        step: u64,
        coords: Coords,
        blocks: &[DeviceParamBlocks],
    ) -> Result<(), StoreError>;
    /// Completes checkpoint `step`, `micro_batches_done` micro-batches into the data, and returns where it lies.
    fn commit(&self, plan: &Plan, step: u64, micro_batches_done: u64) -> Result<PathBuf, StoreError>;
}
