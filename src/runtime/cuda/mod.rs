//! The CUDA backend: cuBLAS products and NVRTC-compiled kernels, one GPU per device.
//!
//! Buffers are device-resident: each device's storage is one GPU allocation laid out by the plan's
//! arena layout ([`storage::DeviceArena`]), kernels and cuBLAS products run on it in place on the
//! device's own stream, and data crosses to the host only for inputs, parameters at start, the loss,
//! outputs, checkpoints and collectives. Collectives are host-staged for now (the send block comes to
//! the host, the communicator exchanges it, the result goes back), so every communicator (threads,
//! MPI, NCCL) works unchanged and devices of one mesh can share a GPU.
//! bf16 buffers live on the GPU as bf16 (two bytes an element) and run bf16 kernels there (see
//! [`kernels`]).

pub mod kernels;
pub mod libs;
pub mod nccl;
pub mod private;
pub mod ptx_cache;
pub mod storage;

use super::arena::ArenaLayout;
use super::backend::{Backend, Exchange, Exchanges, UpdateBuffers};
use super::comm::CommError;
use super::error::RuntimeError;
use super::settings::{KernelContext, OptimizerSettings};
use super::tensor::Tensor;
use crate::plan::{BufferId, Kernel, Plan};
use cudarc::driver::{CudaContext, CudaStream};
use kernels::CudaKernels;
use std::sync::Arc;
use storage::DeviceArena;

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
        return Err("--backend cuda needs NVRTC (libnvrtc, from CUDA 12.6 or later), which cannot be loaded: install the CUDA toolkit or the nvidia-cuda-nvrtc wheel, or put it on LD_LIBRARY_PATH".into());
    }
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err("--backend cuda needs cuBLAS (libcublas, CUDA 12 or 13), which cannot be loaded: install the CUDA toolkit or the nvidia-cublas wheel, or put it on LD_LIBRARY_PATH".into());
    }
    let count = CudaContext::device_count().map_err(|e| format!("the CUDA driver reports no usable GPU: {e}"))?;
    if count < 1 {
        return Err("the CUDA driver is installed but this machine has no GPU; use --backend cpu".into());
    }
    Ok(count as usize)
}

/// Kernels on one GPU, on a stream of this device's own (devices sharing a GPU run side by side).
pub struct CudaBackend {
    kernels: CudaKernels,
    stream: Arc<CudaStream>,
    /// Wait for the GPU after every kernel (`OPTIMUS_CUDA_SYNC=1`), so that `--profile`, which times
    /// instructions on the host, sees each kernel's own GPU time instead of the time of the next wait.
    sync_each_kernel: bool,
}

impl CudaBackend {
    /// A backend on GPU `ordinal` (call [`probe`] first).
    pub fn new(ordinal: usize) -> Result<CudaBackend, String> {
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("cannot open GPU {ordinal}: {e}"))?;
        // SAFETY: every buffer of this backend is used on its one stream only (the NCCL communicator
        // copies host blocks on its own stream into allocations of its own), so cudarc need not record
        // events to order streams around each slice.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| format!("cannot create a stream on GPU {ordinal}: {e}"))?;
        let kernels = CudaKernels::new(&ctx, Arc::clone(&stream))?;
        let sync_each_kernel = std::env::var("OPTIMUS_CUDA_SYNC").is_ok_and(|v| v == "1");
        Ok(CudaBackend { kernels, stream, sync_each_kernel })
    }
}

impl Backend for CudaBackend {
    type Storage = DeviceArena;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn allocate(&mut self, plan: &Plan, layout: &ArenaLayout) -> Result<DeviceArena, RuntimeError> {
        DeviceArena::new(&self.stream, plan, layout)
    }

    fn upload(&mut self, storage: &mut DeviceArena, id: BufferId, tensor: &Tensor) -> Result<(), RuntimeError> {
        storage.upload(&self.stream, id, tensor)
    }

    fn download(&mut self, storage: &DeviceArena, id: BufferId) -> Result<Tensor, RuntimeError> {
        storage.download(&self.stream, id)
    }

    fn zero(&mut self, storage: &mut DeviceArena, id: BufferId) -> Result<(), RuntimeError> {
        storage.zero(&self.stream, id)
    }

    /// The arena stays whole: the final downloads go to host memory, not on top of it.
    fn retain(&mut self, _storage: &mut DeviceArena, _keep: &[BufferId]) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn first_non_finite(&mut self, storage: &DeviceArena, id: BufferId) -> Result<Option<(usize, f32)>, RuntimeError> {
        let host = storage.download(&self.stream, id)?;
        let first = |v: &[f32]| v.iter().position(|x| !x.is_finite()).map(|k| (k, v[k]));
        Ok(host.f32().ok().and_then(first))
    }

    fn kernel(
        &mut self,
        storage: &mut DeviceArena,
        kernel: &Kernel,
        inputs: &[BufferId],
        output: BufferId,
        ctx: &KernelContext,
    ) -> Result<(), RuntimeError> {
        let (ins, out) = storage.operands(inputs, output)?;
        self.kernels.run(kernel, &ins, out, ctx).map_err(RuntimeError::Kernel)?;
        if self.sync_each_kernel {
            self.stream.synchronize().map_err(|e| RuntimeError::Kernel(format!("waiting for the GPU: {e}")))?;
        }
        Ok(())
    }

    fn optimizer_step(
        &mut self,
        storage: &mut DeviceArena,
        b: UpdateBuffers,
        settings: &OptimizerSettings,
        step: u64,
    ) -> Result<(), RuntimeError> {
        let [p, g, s1, s2] = storage.many_mut([b.param, b.grad, b.state1, b.state2])?;
        self.kernels.optimizer_step(p, g, s1, s2, settings, step).map_err(RuntimeError::Kernel)
    }

    fn scale_in_place(&mut self, storage: &mut DeviceArena, id: BufferId, factor: f32) -> Result<(), RuntimeError> {
        let [t] = storage.many_mut([id])?;
        self.kernels.scale_in_place(t, factor).map_err(RuntimeError::Kernel)
    }

    fn collective(
        &mut self,
        storage: &mut DeviceArena,
        send: BufferId,
        recv: BufferId,
        _elementwise: bool,
        exchange: &mut Exchange<'_>,
    ) -> Result<(), RuntimeError> {
        storage.exchange(&self.stream, send, recv, &mut AsF32(exchange))
    }

    fn collective_typed(
        &mut self,
        storage: &mut DeviceArena,
        send: BufferId,
        recv: BufferId,
        _elementwise: bool,
        exchange: &mut dyn Exchanges,
    ) -> Result<(), RuntimeError> {
        storage.exchange(&self.stream, send, recv, exchange)
    }
}

/// An f32-only exchange as [`Exchanges`]: bf16 blocks are widened, exchanged and rounded back.
struct AsF32<'a, 'e>(&'a mut Exchange<'e>);

impl Exchanges for AsF32<'_, '_> {
    fn f32(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        (self.0)(send, recv)
    }

    fn bf16(&mut self, send: &[u16], recv: &mut [u16]) -> Result<(), CommError> {
        let mut wide = super::bf16::widen(recv);
        (self.0)(&super::bf16::widen(send), &mut wide)?;
        super::bf16::round_into(&wide, recv);
        Ok(())
    }
}
