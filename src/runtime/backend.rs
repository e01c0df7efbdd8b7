//! The `Backend` trait: where a device's kernels run. The CPU backend is the reference; the MPI backend
//! reuses it with another communicator, and a GPU backend implements it with device kernels.

use super::cpu::kernels::{self, KernelContext, OptimizerSettings};
use super::tensor::Tensor;
use crate::plan::Kernel;

/// Runs the local computations of one device.
///
/// Buffers are host tensors in this version: a GPU backend keeps device copies behind this interface
/// and moves data only where the executor asks for host values (inputs, outputs, checkpoints).
pub trait Backend: Send {
    /// A short name for messages ("cpu").
    fn name(&self) -> &'static str;
    /// Runs one kernel of the plan into `out` (preallocated with the output buffer's shape).
    fn kernel(
        &mut self,
        kernel: &Kernel,
        inputs: &[&Tensor],
        out: &mut Tensor,
        ctx: &KernelContext,
    ) -> Result<(), String>;
    /// Updates one parameter shard in place (SGD with momentum or AdamW, as configured).
    fn optimizer_step(
        &mut self,
        param: &mut Tensor,
        grad: &Tensor,
        state1: &mut Tensor,
        state2: &mut Tensor,
        settings: &OptimizerSettings,
        step: u64,
    ) -> Result<(), String>;
}

/// Kernels on the host CPU (faer for matrix products).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn kernel(
        &mut self,
        kernel: &Kernel,
        inputs: &[&Tensor],
        out: &mut Tensor,
        ctx: &KernelContext,
    ) -> Result<(), String> {
        kernels::run(kernel, inputs, out, ctx)
    }

    fn optimizer_step(
        &mut self,
        param: &mut Tensor,
        grad: &Tensor,
        state1: &mut Tensor,
        state2: &mut Tensor,
        settings: &OptimizerSettings,
        step: u64,
    ) -> Result<(), String> {
        kernels::optimizer_step(param, grad, state1, state2, settings, step)
    }
}
