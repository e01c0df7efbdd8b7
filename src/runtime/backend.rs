//! The `Backend` trait: where a device's kernels run, and [`BackendKind`], which picks one. The CPU
//! backend (in `cpu/`) is the reference; a GPU backend implements the same trait with device kernels.

pub use super::cpu::CpuBackend;
use super::settings::{KernelContext, OptimizerSettings};
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

/// Which backend a run's devices use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendKind {
    /// Host kernels (faer products).
    #[default]
    Cpu,
    /// One NVIDIA GPU per device (feature `cuda`).
    Cuda,
}

impl BackendKind {
    /// Checks, before any device starts, that this backend can run here; a clear message if not.
    pub fn check_available(self) -> Result<(), String> {
        match self {
            BackendKind::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => super::cuda::probe().map(|_| ()),
            #[cfg(not(feature = "cuda"))]
            BackendKind::Cuda => Err("this optimusc was built without the CUDA backend; build it with \
                 `cargo build --release --features cuda` (see docs/clusters.md)"
                .into()),
        }
    }

    /// A backend for one device; `slot` picks the GPU (modulo the GPUs visible).
    pub fn create(self, slot: u64) -> Result<Box<dyn Backend>, String> {
        match self {
            BackendKind::Cpu => Ok(Box::new(CpuBackend)),
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => {
                let gpus = super::cuda::probe()? as u64;
                Ok(Box::new(super::cuda::CudaBackend::new((slot % gpus) as usize)?))
            }
            #[cfg(not(feature = "cuda"))]
            BackendKind::Cuda => {
                let _ = slot;
                self.check_available().map(|_| Box::new(CpuBackend) as Box<dyn Backend>)
            }
        }
    }
}

impl<T: Backend + ?Sized> Backend for Box<T> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn kernel(
        &mut self,
        kernel: &Kernel,
        inputs: &[&Tensor],
        out: &mut Tensor,
        ctx: &KernelContext,
    ) -> Result<(), String> {
        (**self).kernel(kernel, inputs, out, ctx)
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
        (**self).optimizer_step(param, grad, state1, state2, settings, step)
    }
}
