//! The CUDA backend: cuBLAS products and NVRTC-compiled kernels, one GPU per device.
//!
//! Buffers are device-resident: each device's storage is one GPU allocation laid out by the plan's
//! arena layout ([`storage::DeviceArena`]), kernels and cuBLAS products run on it in place on the
//! device's own stream, and data crosses to the host only for inputs, parameters at start, the loss,
//! outputs and checkpoints. Collectives run on device pointers: between devices that share one GPU
//! through [`fabric`] (each reads its peers' buffers in place), and between devices on GPUs of their own
//! through NCCL ([`nccl`]). Where neither applies (devices spread over several GPUs of one process with
//! more devices than GPUs), the send block comes to the host and the run's communicator exchanges it.
//! bf16 buffers live on the GPU as bf16 (two bytes an element) and run bf16 kernels there (see
//! [`kernels`]).

mod deferred;
pub mod error;
pub mod fabric;
pub mod kernels;
pub mod libs;
pub mod nccl;
pub mod private;
pub mod ptx_cache;
pub mod storage;
pub mod timer;

use super::arena::ArenaLayout;
use super::backend::{Backend, Exchanges, GpuLink, UpdateBuffers};
use super::comm::CollectiveSpec;
use super::error::{KernelError, RuntimeError};
use super::settings::{KernelContext, OptimizerKind, OptimizerSettings};
use cudarc::driver::{CudaContext, CudaStream};
use deferred::{Deferred, ScaleJob};
pub use error::DeviceError;
use error::driver;
use kernels::{AdamwJob, CudaKernels, DeviceBuf, WidenJob};
use optimus_plan::tensor::Tensor;
use optimus_plan::{BufferId, Coords, Instr, Kernel, Mesh, Plan};
use std::sync::Arc;
use storage::DeviceArena;
use timer::GpuTimer;

/// How many GPUs this process can use, or why it can use none. Never panics: the driver library is
/// probed before cudarc touches it.
pub fn probe() -> Result<usize, DeviceError> {
    // SAFETY: only tries to load the driver library; no CUDA call is made if it is absent.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(DeviceError::Unavailable(
            "--backend cuda needs an NVIDIA GPU and its driver, but the CUDA driver library \
             (libcuda.so) cannot be loaded on this machine; use --backend cpu",
        ));
    }
    // SAFETY: as above, for the runtime compiler and cuBLAS, which the backend loads at start.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(DeviceError::Unavailable(
            "--backend cuda needs NVRTC (libnvrtc, from CUDA 12.6 or later), which cannot be loaded: install the \
             CUDA toolkit or the nvidia-cuda-nvrtc wheel, or put it on LD_LIBRARY_PATH",
        ));
    }
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(DeviceError::Unavailable(
            "--backend cuda needs cuBLAS (libcublas, CUDA 12 or 13), which cannot be loaded: install the CUDA \
             toolkit or the nvidia-cublas wheel, or put it on LD_LIBRARY_PATH",
        ));
    }
    let (status, version) = driver_calls(|| {
        let mut version = 0;
        // SAFETY: the call writes one int; it needs no context and no cuInit.
        let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
        (status, version)
    })?;
    if status != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(DeviceError::Unavailable(BROKEN_DRIVER));
    }
    if version < MIN_DRIVER_VERSION {
        return Err(DeviceError::OldDriver { version });
    }
    match driver_calls(CudaContext::device_count)? {
        Ok(count) if count >= 1 => Ok(count as usize),
        Ok(_) => Err(DeviceError::NoGpu),
        Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE => Err(DeviceError::NoGpu),
        Err(e) => Err(driver("the CUDA driver reports no usable GPU")(e)),
    }
}

/// The oldest driver the backend runs on, as `cuDriverGetVersion` gives it: CUDA 12.6.
const MIN_DRIVER_VERSION: i32 = 12060;

/// Why a driver library that loads cannot be used: it lacks a function the backend calls, or fails the
/// first call.
const BROKEN_DRIVER: &str = "--backend cuda needs a CUDA driver for CUDA 12.6 or later, and this machine's libcuda.so \
                             lacks functions the backend calls or fails them (an old or broken driver): install \
                             the NVIDIA driver, or use --backend cpu";

/// Runs `calls` into the CUDA driver through cudarc, which panics where the library lacks a function
/// (a stub, an old or a broken driver): that is a driver this machine cannot use, not a crash. The
/// panic's report is silenced while the calls run (a probe runs once, before any device thread).
fn driver_calls<T>(calls: impl FnOnce() -> T + std::panic::UnwindSafe) -> Result<T, DeviceError> {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(calls);
    std::panic::set_hook(report);
    result.map_err(|_| DeviceError::Unavailable(BROKEN_DRIVER))
}

/// The name of GPU `ordinal` and its memory in bytes (call [`probe`] first).
pub fn describe(ordinal: usize) -> Result<(String, u64), DeviceError> {
    let ctx = CudaContext::new(ordinal).map_err(driver(&format!("cannot open GPU {ordinal}")))?;
    let name = ctx.name().map_err(driver("reading the GPU's name"))?;
    let bytes = ctx.total_mem().map_err(driver("reading the GPU's memory size"))?;
    Ok((name, bytes as u64))
}

/// A communicator that runs the plan's collectives on device buffers, ordered on the device's stream.
pub trait DeviceCollectives: Send {
    /// Queues one collective from `send` into `recv` (this device's buffers) after the work already on
    /// `kernels`' stream. `Ok(false)`: this communicator does not take it (every member of the group
    /// decides alike), and the backend stages it through the host instead.
    fn run(
        &mut self,
        kernels: &CudaKernels,
        spec: &CollectiveSpec<'_>,
        send: DeviceBuf,
        recv: DeviceBuf,
    ) -> Result<bool, RuntimeError>;
}

/// Kernels on one GPU, on a stream of this device's own (devices sharing a GPU run side by side).
pub struct CudaBackend {
    kernels: CudaKernels,
    stream: Arc<CudaStream>,
    /// Wait for the GPU after every kernel (`OPTIMUS_CUDA_SYNC=1`), so that `--profile`, which times
    /// instructions on the host, sees each kernel's own GPU time instead of the time of the next wait.
    sync_each_kernel: bool,
    /// Collectives on device pointers (`None`: host blocks through the run's communicator).
    collectives: Option<Box<dyn DeviceCollectives>>,
    /// How long a download waits for the GPU (whose queue may wait on peers) before the run fails.
    timeout: std::time::Duration,
    /// Updates and gradient casts held back to run many at a time (see [`deferred`]).
    deferred: Deferred,
    /// With `--profile`: each kernel, update and scaling timed on the GPU (see [`timer`]).
    timer: Option<GpuTimer>,
}

impl CudaBackend {
    /// A backend on GPU `ordinal` (call [`probe`] first) for the device at `coords` of `mesh`, whose
    /// collectives go as `link` says; `timed`: every kernel instruction is timed on the GPU, alone
    /// (`--profile`), and [`Backend::take_device_time`] gives its time.
    pub fn new(
        ordinal: usize,
        link: GpuLink,
        (mesh, coords): (Mesh, Coords),
        (timeout, timed): (std::time::Duration, bool),
    ) -> Result<CudaBackend, RuntimeError> {
        let ctx = CudaContext::new(ordinal).map_err(driver(&format!("cannot open GPU {ordinal}")))?;
        // SAFETY: every buffer of this backend is used on its one stream only; the communicators order
        // their own streams and their peers' reads by events of their own, so cudarc need not record
        // events around each slice.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(driver(&format!("cannot create a stream on GPU {ordinal}")))?;
        let kernels = CudaKernels::new(&ctx, Arc::clone(&stream))?;
        let sync_each_kernel = std::env::var("OPTIMUS_CUDA_SYNC").is_ok_and(|v| v == "1");
        let collectives: Option<Box<dyn DeviceCollectives>> = match link {
            GpuLink::Host => None,
            GpuLink::SharedGpu(gpu) => Some(Box::new(fabric::SharedGpuEndpoint::new(gpu, mesh, coords, &stream)?)),
            GpuLink::Nccl(ids) => Some(Box::new(nccl::NcclDevice::new(&stream, mesh, coords, *ids)?)),
        };
        // Profiles time each instruction alone: nothing is held back for them.
        let deferred = Deferred::new(sync_each_kernel || timed);
        let timer = if timed { Some(GpuTimer::new(&stream)?) } else { None };
        Ok(CudaBackend { kernels, stream, sync_each_kernel, collectives, timeout, deferred, timer })
    }

    /// Marks the start of a timed instruction (when profiling).
    fn begin_timing(&mut self) -> Result<(), RuntimeError> {
        match self.timer.as_mut() {
            Some(timer) => timer.begin(&self.kernels, &self.stream),
            None => Ok(()),
        }
    }

    /// Marks the end of a timed instruction and waits for its time (when profiling).
    fn end_timing(&mut self) -> Result<(), RuntimeError> {
        match self.timer.as_mut() {
            Some(timer) => timer.end(&self.stream),
            None => Ok(()),
        }
    }

    /// Runs the held-back work before anything else reaches the stream.
    fn flush(&mut self) -> Result<(), RuntimeError> {
        self.deferred.flush(&mut self.kernels)
    }

    /// Before work that is not a plan kernel (a transfer, a collective, an update): the held-back work
    /// runs, and no attention gradient kept for the next kernel survives it.
    fn before_other_work(&mut self) -> Result<(), RuntimeError> {
        self.kernels.forget_kept();
        self.flush()
    }

    /// The cast of a bf16 buffer into an f32 one of the same length, as a job to hold back.
    fn widen_job(
        storage: &DeviceArena,
        kernel: &Kernel,
        inputs: &[BufferId],
        output: BufferId,
        stream: &Arc<CudaStream>,
    ) -> Option<WidenJob> {
        let (Kernel::Cast, [input]) = (kernel, inputs) else { return None };
        let src = DeviceBuf::of(storage.tensor(*input).ok()?, stream).ok()?;
        let dst = DeviceBuf::of(storage.tensor(output).ok()?, stream).ok()?;
        (src.bf16 && !dst.bf16 && src.len == dst.len).then_some(WidenJob { src: src.ptr, dst: dst.ptr, len: src.len })
    }

    /// Waits until the GPU has run everything queued on this device's stream, at most the timeout: the
    /// queue may wait on peers (their events, NCCL), and a peer that failed must fail this run, not hang it.
    fn wait_for_queue(&self) -> Result<(), RuntimeError> {
        if self.collectives.is_none() {
            return Ok(());
        }
        let gpu = |e| RuntimeError::Device(driver("waiting for the GPU")(e));
        let event = self.stream.record_event(None).map_err(gpu)?;
        let start = std::time::Instant::now();
        while !event.try_is_complete().map_err(gpu)? {
            if start.elapsed() > self.timeout {
                return Err(RuntimeError::Comm(super::comm::CommError::Transport(format!(
                    "the GPU waited {:.0} s for this device's peers (--timeout); a peer has failed or stopped",
                    self.timeout.as_secs_f64()
                ))));
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        Ok(())
    }

    /// Runs a collective on device pointers where this device has such a communicator and the executor
    /// says what the collective is; `false` where the host must stage it.
    fn collective_on_device(
        &mut self,
        storage: &DeviceArena,
        send: BufferId,
        recv: BufferId,
        exchange: &dyn Exchanges,
    ) -> Result<bool, RuntimeError> {
        let (Some(collectives), Some(spec)) = (self.collectives.as_mut(), exchange.spec()) else { return Ok(false) };
        let buf = |id| DeviceBuf::of(storage.tensor(id)?, &self.stream).map_err(RuntimeError::Storage);
        let (send, recv) = (buf(send)?, buf(recv)?);
        collectives.run(&self.kernels, &spec, send, recv)
    }
}

impl Backend for CudaBackend {
    type Storage = DeviceArena;

    fn name(&self) -> &'static str {
        "cuda"
    }

    /// Refuses a plan with a kernel that runs on the CPU backend only (the key/value cache of text
    /// generation) before allocating anything.
    fn allocate(&mut self, plan: &Plan, layout: &ArenaLayout) -> Result<DeviceArena, RuntimeError> {
        let cpu_only = plan.program.iter().find_map(|instr| match instr {
            Instr::Kernel { kernel, .. } if kernels::cpu_only(kernel) => Some(kernel),
            _ => None,
        });
        if let Some(kernel) = cpu_only {
            return Err(RuntimeError::Kernel(KernelError::in_kernel(kernel, kernels::cpu_only_error(kernel))));
        }
        self.before_other_work()?;
        DeviceArena::new(&self.stream, plan, layout)
    }

    fn upload(&mut self, storage: &mut DeviceArena, id: BufferId, tensor: &Tensor) -> Result<(), RuntimeError> {
        self.before_other_work()?;
        storage.upload(&self.stream, id, tensor)
    }

    fn download(&mut self, storage: &DeviceArena, id: BufferId) -> Result<Tensor, RuntimeError> {
        self.before_other_work()?;
        self.wait_for_queue()?;
        storage.download(&self.stream, id)
    }

    fn zero(&mut self, storage: &mut DeviceArena, id: BufferId) -> Result<(), RuntimeError> {
        self.before_other_work()?;
        storage.zero(&self.stream, id)
    }

    /// The arena stays whole: the final downloads go to host memory, not on top of it.
    fn retain(&mut self, _storage: &mut DeviceArena, _keep: &[BufferId]) -> Result<(), RuntimeError> {
        self.before_other_work()
    }

    fn first_non_finite(&mut self, storage: &DeviceArena, id: BufferId) -> Result<Option<(usize, f32)>, RuntimeError> {
        self.before_other_work()?;
        self.wait_for_queue()?;
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
        if self.deferred.enabled()
            && let Some(job) = CudaBackend::widen_job(storage, kernel, inputs, output, &self.stream)
        {
            return self.deferred.widen(&mut self.kernels, job);
        }
        self.flush()?;
        self.begin_timing()?;
        let (ins, out) = storage.operands(inputs, output)?;
        self.kernels.run(kernel, &ins, out, ctx).map_err(RuntimeError::Kernel)?;
        self.end_timing()?;
        if self.sync_each_kernel {
            self.stream.synchronize().map_err(driver("waiting for the GPU"))?;
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
        self.kernels.forget_kept();
        if self.deferred.enabled()
            && settings.kind == OptimizerKind::AdamW
            && step >= 1
            && let Some(job) = adamw_job(storage, &b, &self.stream)
        {
            return self.deferred.update(&mut self.kernels, job, settings, step);
        }
        self.before_other_work()?;
        self.begin_timing()?;
        let [p, g, s1, s2] = storage.many_mut([b.param, b.grad, b.state1, b.state2])?;
        self.kernels.optimizer_step(p, g, s1, s2, settings, step).map_err(RuntimeError::Kernel)?;
        self.end_timing()
    }

    fn scale_in_place(&mut self, storage: &mut DeviceArena, id: BufferId, factor: f32) -> Result<(), RuntimeError> {
        self.kernels.forget_kept();
        if self.deferred.enabled()
            && let Ok(t) = storage.tensor(id)
            && let Ok(buf) = DeviceBuf::of(t, &self.stream)
            && !buf.bf16
        {
            return self.deferred.scale(&mut self.kernels, ScaleJob { ptr: buf.ptr, len: buf.len, factor });
        }
        self.before_other_work()?;
        self.begin_timing()?;
        let [t] = storage.many_mut([id])?;
        self.kernels.scale_in_place(t, factor).map_err(RuntimeError::Kernel)?;
        self.end_timing()
    }

    fn take_device_time(&mut self) -> Option<std::time::Duration> {
        self.timer.as_mut().and_then(GpuTimer::take)
    }

    fn collective(
        &mut self,
        storage: &mut DeviceArena,
        send: BufferId,
        recv: BufferId,
        _elementwise: bool,
        exchange: &mut dyn Exchanges,
    ) -> Result<(), RuntimeError> {
        self.before_other_work()?;
        if self.collective_on_device(storage, send, recv, exchange)? {
            return Ok(());
        }
        storage.exchange(&self.stream, send, recv, exchange)
    }
}

/// An AdamW update of four f32 buffers of one length, as a job to hold back (`None`: run it where it is
/// issued, which reports what is wrong with the buffers).
fn adamw_job(storage: &DeviceArena, b: &UpdateBuffers, stream: &Arc<CudaStream>) -> Option<AdamwJob> {
    let buf = |id| DeviceBuf::of(storage.tensor(id).ok()?, stream).ok().filter(|d| !d.bf16);
    let [p, g, m, v] = [buf(b.param)?, buf(b.grad)?, buf(b.state1)?, buf(b.state2)?];
    let same = [g.len, m.len, v.len].iter().all(|&n| n == p.len);
    same.then_some(AdamwJob { param: p.ptr, grad: g.ptr, state1: m.ptr, state2: v.ptr, len: p.len, grad_scale: None })
}
