//! The `Backend` trait: where a device's kernels run, and [`BackendKind`], which picks one. The CPU
//! backend (in `cpu/`) is the reference; a GPU backend implements the same trait with device kernels.

use super::arena::ArenaLayout;
use super::comm::{CollectiveSpec, CommError, RawBlock};
use super::error::RuntimeError;
use super::settings::{KernelContext, OptimizerSettings};
use optimus_plan::tensor::Tensor;
use optimus_plan::{BufferId, Kernel, Plan};

/// The four buffers of one optimizer update: the parameter, its gradient and two optimizer states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UpdateBuffers {
    pub param: BufferId,
    pub grad: BufferId,
    pub state1: BufferId,
    pub state2: BufferId,
}

/// A collective's data exchange in the element type of its buffers: f32 blocks, or bf16 blocks as
/// their bit patterns (which travel as bf16, 2 bytes an element).
pub trait Exchanges {
    fn f32(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError>;
    fn bf16(&mut self, send: &[u16], recv: &mut [u16]) -> Result<(), CommError>;
    /// The collective itself, for a backend that runs it on its own buffers (device pointers) with a
    /// communicator of its own instead of lending host blocks; `None` where only host blocks will do.
    fn spec(&self) -> Option<CollectiveSpec<'_>> {
        None
    }
}

/// Runs the local computations of one device on storage it owns.
///
/// The executor allocates a device's [`Backend::Storage`] once, from the plan's [`ArenaLayout`], and
/// names buffers by id from then on; host tensors cross only at the edges ([`Backend::upload`] of
/// parameters and inputs, [`Backend::download`] of the loss, outputs and checkpoints). Storage carries
/// each buffer's element type (the plan's dtype), so a kernel sees f32 or i32 views as the plan says.
pub trait Backend: Send {
    /// Every buffer of one device, in this backend's memory.
    type Storage: Send;
    /// A short name for messages ("cpu").
    fn name(&self) -> &'static str;
    /// Allocates one device's storage for `plan`, laid out as `layout` says (zero-filled).
    fn allocate(&mut self, plan: &Plan, layout: &ArenaLayout) -> Result<Self::Storage, RuntimeError>;
    /// Lays `storage` out for another plan in place, keeping the contents of the buffers both plans
    /// place alike ([`crate::arena::places_alike`]); `false` (nothing done) where the backend cannot
    /// (the GPU backends: the key/value cache runs on the CPU only).
    fn relayout(
        &mut self,
        storage: &mut Self::Storage,
        plan: &Plan,
        layout: &ArenaLayout,
    ) -> Result<bool, RuntimeError> {
        let _ = (storage, plan, layout);
        Ok(false)
    }
    /// Copies a host tensor into a buffer.
    fn upload(&mut self, storage: &mut Self::Storage, id: BufferId, tensor: &Tensor) -> Result<(), RuntimeError>;
    /// A host copy of a buffer.
    fn download(&mut self, storage: &Self::Storage, id: BufferId) -> Result<Tensor, RuntimeError>;
    /// A host copy of a buffer into `into`, reusing its allocation where the backend can (a pipeline
    /// stage keeps activations aside once per micro-batch: fresh allocations would fault their pages in
    /// every time).
    fn download_into(&mut self, storage: &Self::Storage, id: BufferId, into: &mut Tensor) -> Result<(), RuntimeError> {
        *into = self.download(storage, id)?;
        Ok(())
    }
    /// Zero-fills a buffer (what a buffer holds when it comes alive).
    fn zero(&mut self, storage: &mut Self::Storage, id: BufferId) -> Result<(), RuntimeError>;
    /// The first NaN or infinity of a floating-point buffer, with its element index.
    fn first_non_finite(&mut self, storage: &Self::Storage, id: BufferId)
    -> Result<Option<(usize, f32)>, RuntimeError>;
    /// Runs one kernel of the plan from `inputs` into `output` (which holds zeros when it has just come
    /// alive, and its previous contents otherwise, for kernels that accumulate).
    fn kernel(
        &mut self,
        storage: &mut Self::Storage,
        kernel: &Kernel,
        inputs: &[BufferId],
        output: BufferId,
        ctx: &KernelContext,
    ) -> Result<(), RuntimeError>;
    /// Updates one parameter shard in place (SGD with momentum or AdamW, as configured).
    fn optimizer_step(
        &mut self,
        storage: &mut Self::Storage,
        buffers: UpdateBuffers,
        settings: &OptimizerSettings,
        step: u64,
    ) -> Result<(), RuntimeError>;
    /// Multiplies a floating-point buffer by `factor` in place (the clipping of a gradient). This default
    /// goes through a host copy; a backend whose storage is not host memory runs it where the buffer is.
    fn scale_in_place(&mut self, storage: &mut Self::Storage, id: BufferId, factor: f32) -> Result<(), RuntimeError> {
        let t = self.download(storage, id)?;
        let scaled: Vec<f32> = t.f32()?.iter().map(|&x| x * factor).collect();
        self.upload(storage, id, &Tensor::from_f32(&t.shape, scaled))
    }
    /// At the end of a run, before the final downloads: releases the storage of every buffer but
    /// `keep`, so that the host copies do not come on top of the whole arena.
    fn retain(&mut self, storage: &mut Self::Storage, keep: &[BufferId]) -> Result<(), RuntimeError>;
    /// Lends `exchange` the `send` block and the `recv` buffer of one collective, in their element type:
    /// f32 blocks, or bf16 blocks as they are (a bf16 buffer paired with an f32 one is widened). A
    /// backend with a communicator of its own (device pointers) may run the collective itself from
    /// [`Exchanges::spec`] instead. `elementwise`: the collective combines element k of every member
    /// into element k (broadcast, reduce, all-reduce), so a backend may run it on pieces of the buffers,
    /// one after another.
    fn collective(
        &mut self,
        storage: &mut Self::Storage,
        send: BufferId,
        recv: BufferId,
        elementwise: bool,
        exchange: &mut dyn Exchanges,
    ) -> Result<(), RuntimeError>;
    /// Whether [`Backend::collective`] lends `exchange` the buffers themselves, where they stay until
    /// the run ends (no widened or staged copies), so that a communicator may keep using them after
    /// the call, for an overlapped collective. When not, an overlapped collective runs to the end
    /// where it starts.
    fn lends_in_place(&self, storage: &Self::Storage, send: BufferId, recv: BufferId) -> bool {
        let _ = (storage, send, recv);
        false
    }
    /// Whether the devices of this process can read each other's blocks in place (host memory):
    /// [`Backend::raw_block`] and [`Backend::borrow_block`] work.
    fn reads_blocks_in_place(&self) -> bool {
        false
    }
    /// Where a buffer's block is in memory the devices of this process share (host memory), for a
    /// broadcast read in place; `None` where the backend's storage is not such memory.
    fn raw_block(&self, storage: &Self::Storage, id: BufferId) -> Option<RawBlock> {
        let _ = (storage, id);
        None
    }
    /// Makes buffer `id` read `block` (another device's block of the same size) until
    /// [`Backend::end_borrow`]; `false` (nothing done) where the backend cannot.
    ///
    /// # Safety
    /// `block` must stay alive and unwritten until `end_borrow(id)`.
    unsafe fn borrow_block(
        &mut self,
        storage: &mut Self::Storage,
        id: BufferId,
        block: RawBlock,
    ) -> Result<bool, RuntimeError> {
        let _ = (storage, id, block);
        Ok(false)
    }
    /// Buffer `id` reads its own storage again.
    fn end_borrow(&mut self, storage: &mut Self::Storage, id: BufferId) {
        let _ = (storage, id);
    }
    /// Whether buffers `a` and `b` may share storage (true where the backend cannot tell).
    fn may_overlap(&self, storage: &Self::Storage, a: BufferId, b: BufferId) -> bool {
        let _ = (storage, a, b);
        true
    }
    /// When profiling: the device's own time for the last kernel, update or scaling, where the backend
    /// measures it (a GPU's, by events), taken once; `None` where the host's clock is the measure.
    fn take_device_time(&mut self) -> Option<std::time::Duration> {
        None
    }
}

/// A device of a run: its index among the devices of this process (what picks its GPU), and how a GPU
/// device exchanges the plan's collectives (the CPU backend always lends host blocks to the run's
/// communicator).
#[derive(Clone, Default)]
pub struct DeviceSlot {
    pub index: u64,
    pub link: GpuLink,
}

/// How a GPU device runs the plan's collectives.
#[derive(Clone, Default)]
pub enum GpuLink {
    /// Host blocks through the run's communicator (one device; devices spread over GPUs that share no
    /// communicator; a CPU run).
    #[default]
    Host,
    /// On device pointers, with the other devices of the run on the same GPU.
    #[cfg(feature = "cuda")]
    SharedGpu(std::sync::Arc<super::cuda::fabric::SharedGpu>),
    /// NCCL on device pointers, one GPU per device; the ids of the device's groups.
    #[cfg(feature = "cuda")]
    Nccl(Box<super::cuda::nccl::GroupIds>),
}

/// The first GPU of this process, for a measured profile's device.
#[derive(Clone, Debug, PartialEq)]
pub struct FirstGpu {
    pub name: String,
    pub memory_bytes: u64,
    /// How many GPUs this process sees (a mesh shares the first only where it sees one).
    pub visible: usize,
}

/// The first GPU's name and memory, and how many GPUs there are; why not where this build has no CUDA
/// backend or this machine no usable GPU (as [`BackendKind::check_available`] says it, which a command
/// calls first).
pub fn first_gpu() -> Result<FirstGpu, String> {
    #[cfg(feature = "cuda")]
    {
        let visible = super::cuda::probe().map_err(|e| e.to_string())?;
        let (name, memory_bytes) = super::cuda::describe(0).map_err(|e| e.to_string())?;
        Ok(FirstGpu { name, memory_bytes, visible })
    }
    #[cfg(not(feature = "cuda"))]
    {
        // Says how to build one.
        BackendKind::Cuda.check_available()?;
        Err("this optimusc was built without the CUDA backend".into())
    }
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
    /// For CUDA, where the libraries exist only under names cudarc does not open (CUDA 13's, NCCL's
    /// soname), restarts the command with them linked (see [`super::cuda::libs`]): call it before anything
    /// is printed or started (before `MPI_Init`). Returns a warning to show when a restart was needed but
    /// could not be made. (The CPU's: an OpenBLAS that `OPTIMUS_BLAS` names and that does not load is
    /// refused before any command runs, [`super::cpu::blas::named_library_problem`].)
    pub fn find_libraries(self) -> Option<String> {
        #[cfg(feature = "cuda")]
        if self == BackendKind::Cuda {
            return super::cuda::libs::restart_with_links_if_needed();
        }
        None
    }

    /// Checks, before any device starts, that this backend can run here; a clear message if not (after
    /// [`BackendKind::find_libraries`]).
    pub fn check_available(self) -> Result<(), String> {
        match self {
            BackendKind::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => {
                let warning = self.find_libraries();
                super::cuda::probe().map(|_| ()).map_err(|e| match warning {
                    Some(warning) => format!("{e} ({warning})"),
                    None => e.to_string(),
                })
            }
            #[cfg(not(feature = "cuda"))]
            BackendKind::Cuda => Err("this optimusc was built without the CUDA backend; build it with \
                 `cargo build --release --features cuda` (see docs/clusters.md)"
                .into()),
        }
    }
}
