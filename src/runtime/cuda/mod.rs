//! The CUDA backend: cuBLAS products and NVRTC-compiled kernels, one GPU per device.
//!
//! This version is host-staged: buffers live in a host arena (the CPU backend's storage) between
//! instructions, and each kernel uploads its operands, runs on the GPU and downloads its result, so
//! any communicator (threads or MPI) works unchanged. Device-resident buffers with NCCL collectives are the next step.
//! Buffers travel in their plan's element type: bf16 buffers go to the GPU and back as bf16 (two bytes
//! an element) and run bf16 kernels there (see [`kernels`]).

pub mod kernels;
pub mod nccl;

use super::arena::{ArenaLayout, HostArena};
use super::backend::{Backend, Exchange, UpdateBuffers};
use super::error::RuntimeError;
use super::settings::{KernelContext, OptimizerSettings};
use super::tensor::Tensor;
use super::view::View;
use crate::plan::{BufferId, Kernel, Plan};
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

    /// A GPU copy of a host view, in its element type.
    fn upload_view(&self, view: &View) -> Result<DeviceTensor, RuntimeError> {
        DeviceTensor::upload_view(&self.stream, view).map_err(RuntimeError::Kernel)
    }

    /// Copies a GPU tensor back into its host buffer (of the same element type).
    fn download_to(&self, storage: &mut HostArena, id: BufferId, t: &DeviceTensor) -> Result<(), RuntimeError> {
        t.download_into(&self.stream, &mut storage.view_mut(id)?).map_err(RuntimeError::Kernel)
    }
}

impl Backend for CudaBackend {
    /// Host-staged for now: buffers live in a host arena and each kernel copies its operands to the
    /// GPU and its result back. Device-resident storage (a `CudaSlice` arena) is the next step; the
    /// trait already names buffers by id, so the executor will not change.
    type Storage = HostArena;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn allocate(&mut self, plan: &Plan, layout: &ArenaLayout) -> Result<HostArena, RuntimeError> {
        HostArena::new(plan, layout)
    }

    fn upload(&mut self, storage: &mut HostArena, id: BufferId, tensor: &Tensor) -> Result<(), RuntimeError> {
        storage.write(id, tensor)
    }

    fn download(&mut self, storage: &HostArena, id: BufferId) -> Result<Tensor, RuntimeError> {
        storage.download(id)
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
        let operands = inputs.iter().map(|&id| self.upload_view(&storage.view(id)?)).collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&DeviceTensor> = operands.iter().collect();
        let mut result = self.upload_view(&storage.view(output)?)?;
        self.kernels.run(kernel, &refs, &mut result, ctx).map_err(RuntimeError::Kernel)?;
        self.download_to(storage, output, &result)
    }

    fn optimizer_step(
        &mut self,
        storage: &mut HostArena,
        b: UpdateBuffers,
        settings: &OptimizerSettings,
        step: u64,
    ) -> Result<(), RuntimeError> {
        let (mut p, g) = (self.upload_view(&storage.view(b.param)?)?, self.upload_view(&storage.view(b.grad)?)?);
        let mut s1 = self.upload_view(&storage.view(b.state1)?)?;
        let mut s2 = self.upload_view(&storage.view(b.state2)?)?;
        self.kernels.optimizer_step(&mut p, &g, &mut s1, &mut s2, settings, step).map_err(RuntimeError::Kernel)?;
        self.download_to(storage, b.param, &p)?;
        self.download_to(storage, b.state1, &s1)?;
        self.download_to(storage, b.state2, &s2)
    }

    fn collective(
        &mut self,
        storage: &mut HostArena,
        send: BufferId,
        recv: BufferId,
        elementwise: bool,
        exchange: &mut Exchange<'_>,
    ) -> Result<(), RuntimeError> {
        storage.exchange(send, recv, elementwise, exchange)
    }
}
