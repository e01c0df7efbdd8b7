//! The CUDA backend: cuBLAS products and NVRTC-compiled kernels, one GPU per device.
//!
//! This version is host-staged: buffers live in host memory between instructions, and each kernel
//! uploads its operands, runs on the GPU and downloads its result, so any communicator (threads or
//! MPI) works unchanged. Device-resident buffers with NCCL collectives are the next step.

pub mod kernels;
pub mod nccl;

use super::backend::Backend;
use super::settings::{KernelContext, OptimizerSettings};
use super::tensor::Tensor;
use crate::plan::Kernel;
use cudarc::driver::{CudaContext, CudaStream};
use kernels::{CudaKernels, DeviceTensor};
use std::sync::Arc;

/// How many GPUs this process can use, or why it can use none. Never panics: the driver library is
/// probed before cudarc touches it.
pub fn probe() -> Result<usize, String> {
    // SAFETY: only tries to load the driver library; no CUDA call is made if it is absent.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("--backend cuda needs an NVIDIA GPU and its driver, but the CUDA driver library \
                    (libcuda.so) cannot be loaded on this machine; use --backend cpu"
            .into());
    }
    // SAFETY: as above, for the runtime compiler and cuBLAS, which the backend loads at start.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("--backend cuda needs NVRTC (libnvrtc.so.12, CUDA 12.6 or later), which cannot be loaded".into());
    }
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err("--backend cuda needs cuBLAS (libcublas.so.12), which cannot be loaded".into());
    }
    let count = CudaContext::device_count().map_err(|e| format!("the CUDA driver reports no usable GPU: {e}"))?;
    if count < 1 {
        return Err("the CUDA driver is installed but this machine has no GPU; use --backend cpu".into());
    }
    Ok(count as usize)
}

/// Kernels on one GPU.
pub struct CudaBackend {
    kernels: CudaKernels,
    stream: Arc<CudaStream>,
}

impl CudaBackend {
    /// A backend on GPU `ordinal` (call [`probe`] first).
    pub fn new(ordinal: usize) -> Result<CudaBackend, String> {
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("cannot open GPU {ordinal}: {e}"))?;
        let stream = ctx.default_stream();
        let kernels = CudaKernels::new(&ctx, Arc::clone(&stream))?;
        Ok(CudaBackend { kernels, stream })
    }

    fn upload(&self, t: &Tensor) -> Result<DeviceTensor, String> {
        DeviceTensor::upload(&self.stream, t)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn kernel(
        &mut self,
        kernel: &Kernel,
        inputs: &[&Tensor],
        out: &mut Tensor,
        ctx: &KernelContext,
    ) -> Result<(), String> {
        let operands = inputs.iter().map(|t| self.upload(t)).collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&DeviceTensor> = operands.iter().collect();
        let mut result = self.upload(out)?;
        self.kernels.run(kernel, &refs, &mut result, ctx)?;
        *out = result.download(&self.stream)?;
        Ok(())
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
        let (mut p, g) = (self.upload(param)?, self.upload(grad)?);
        let (mut s1, mut s2) = (self.upload(state1)?, self.upload(state2)?);
        self.kernels.optimizer_step(&mut p, &g, &mut s1, &mut s2, settings, step)?;
        *param = p.download(&self.stream)?;
        *state1 = s1.download(&self.stream)?;
        *state2 = s2.download(&self.stream)?;
        Ok(())
    }
}
