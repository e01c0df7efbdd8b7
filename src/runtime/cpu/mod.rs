//! The CPU backend: kernels on host memory, and a mesh of device threads in one process.

#[cfg(test)]
mod bf16_pieces_tests;
pub mod kernels;
pub mod par;
pub mod threads;
pub mod vmath;

use super::arena::{ArenaLayout, HostArena};
#[cfg(feature = "cuda")]
use super::backend::BackendKind;
use super::backend::{Backend, DeviceSlot, Exchanges, GpuLink, UpdateBuffers};
use super::comm::Communicator;
use super::error::{RuntimeError, unreachable};
pub use super::exec::{Batches, DeviceBlocks, DeviceResult, RunConfig, RunOutput, StepRecord, assemble, run_device};
use super::settings::{KernelContext, OptimizerSettings};
use super::tensor::Tensor;
use super::view::{View, ViewData, ViewMut, ViewMutData};
use crate::plan::{BufferId, Kernel, Plan};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use threads::{Fabric, ThreadComm};

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

/// Runs a plan on one thread per device. `on_step` is called by device (0, 0) after every step.
/// Parameters start from `initial` where given (logical tensors by name), else from the seed.
pub fn run(
    plan: &Plan,
    config: &RunConfig,
    batches: &Batches<'_>,
    initial: &BTreeMap<String, Tensor>,
    on_step: &(dyn Fn(&StepRecord) + Sync),
) -> Result<RunOutput, String> {
    super::limits::check_host_can_run(plan, plan.mesh.devices())?;
    return_freed_memory_promptly();
    let fabric = Fabric::new(plan.mesh, config.timeout);
    let devices = plan.mesh.devices();
    let links = gpu_links(plan.mesh, config, &fabric)?;
    let results: Vec<Result<DeviceResult, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..devices)
            .map(|rank| {
                let fabric = std::sync::Arc::clone(&fabric);
                let slot = DeviceSlot { index: rank, link: links.get(rank as usize).cloned().unwrap_or_default() };
                scope.spawn(move || {
                    let coords = plan.mesh.coords_of(rank);
                    let comm = ThreadComm::new(std::sync::Arc::clone(&fabric), coords);
                    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        run_device(plan, comm, slot, config, batches, initial, on_step)
                    }));
                    let result = match outcome {
                        Ok(r) => r,
                        Err(_) => Err("a kernel panicked (an internal error)".to_string()),
                    };
                    result.map_err(|e| {
                        let message = format!("device {coords} failed: {e}");
                        ThreadComm::new(fabric, coords).abort(&message);
                        message
                    })
                })
            })
            .collect();
        join_or_abandon(handles, &fabric, plan.mesh)
    });
    if let Some(first) = fabric.failure() {
        return Err(first);
    }
    let mut per_device = Vec::with_capacity(results.len());
    let mut profiles = Vec::new();
    for r in results {
        let (records, blocks, profile) = r?;
        per_device.push((records, blocks));
        profiles.extend(profile);
    }
    Ok(RunOutput { profiles, ..assemble(plan, per_device)? })
}

/// How each device of a run on threads exchanges its collectives: a CPU run, or a single device, through
/// the thread fabric; a CUDA mesh with a GPU for every device through NCCL; a CUDA mesh on one GPU on
/// device pointers between the devices' streams ([`super::cuda::fabric`]); a CUDA mesh spread over
/// fewer GPUs than devices (but more than one) through the thread fabric, host-staged.
fn gpu_links(
    mesh: crate::plan::Mesh,
    config: &RunConfig,
    fabric: &std::sync::Arc<Fabric>,
) -> Result<Vec<GpuLink>, String> {
    let devices = mesh.devices() as usize;
    #[cfg(feature = "cuda")]
    if config.backend == BackendKind::Cuda && devices > 1 {
        let gpus = super::cuda::probe()?;
        if devices <= gpus {
            let ids = super::cuda::nccl::ids_for_threads(mesh)?;
            return Ok(ids.into_iter().map(|ids| GpuLink::Nccl(Box::new(ids))).collect());
        }
        if gpus == 1 && std::env::var("OPTIMUS_CUDA_COLLECTIVES").is_ok_and(|v| v == "host") {
            return Ok(vec![GpuLink::Host; devices]);
        }
        if gpus == 1 {
            let gpu = super::cuda::fabric::SharedGpu::new(std::sync::Arc::clone(fabric));
            return Ok(vec![GpuLink::SharedGpu(gpu); devices]);
        }
    }
    let _ = (config, fabric);
    Ok(vec![GpuLink::Host; devices])
}

/// How long device threads may take to stop once the run has failed before the run is given up.
const STOP_GRACE: Duration = Duration::from_secs(3);

/// Joins every device thread. Once the run has failed, a thread that has not stopped within
/// [`STOP_GRACE`] (hung in a kernel, say) is reported through [`super::watchdog`], naming its device,
/// so that the command line can end the process instead of waiting for it forever.
fn join_or_abandon<T>(
    handles: Vec<std::thread::ScopedJoinHandle<'_, Result<T, String>>>,
    fabric: &Fabric,
    mesh: crate::plan::Mesh,
) -> Vec<Result<T, String>> {
    let mut failed_at = None;
    while !handles.iter().all(|h| h.is_finished()) {
        if let Some(failure) = fabric.failure() {
            let since = *failed_at.get_or_insert_with(Instant::now);
            if since.elapsed() >= STOP_GRACE {
                let stuck: Vec<String> = (0..handles.len() as u64)
                    .filter(|&r| !handles[r as usize].is_finished())
                    .map(|r| mesh.coords_of(r).to_string())
                    .collect();
                super::watchdog::abandon(format!(
                    "{failure}; device {} did not stop within {} s after that (hung), so the run was abandoned",
                    stuck.join(", "),
                    STOP_GRACE.as_secs()
                ));
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a device thread panicked".into()))).collect()
}

/// Whether a kernel runs on bf16 buffers as they are: kernels that only move elements (reshape,
/// transpose, select, slice, the embedding and position lookups) move their bits between bf16 buffers
/// without widening them to f32 and back (which is exact anyway), and a fill writes bf16 directly.
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
) -> Option<Result<(), String>> {
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
                let x = ins.first().ok_or("dropout takes one input")?.f32()?;
                kernels::dropout_rows(x, out.f32_mut()?, ctx, (*p, *key), first)
            };
            bf16::by_rows_at(refs, out, &[true], &rows)
        }
        Kernel::SumToLast => Some(bf16::sum_to_last(refs, out)),
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
        if has_bf16 && let Some(done) = par::on_pool(|| bf16_in_pieces(kernel, &refs, out, ctx)) {
            return done.map_err(RuntimeError::Kernel);
        }
        let run = |ins: &[&View], out: &mut ViewMut| kernels::run_views(kernel, ins, out, ctx);
        par::on_pool(|| super::bf16::with_widened(&refs, out, kernel.reads_its_output(), run))
            .map_err(RuntimeError::Kernel)
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
}
