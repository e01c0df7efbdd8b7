//! A run in one process: a thread per device of the mesh, each on its backend (the CPU's, or a GPU's),
//! exchanging collectives through the thread fabric, NCCL, or device pointers on a shared GPU.

use super::backend::{BackendKind, DeviceSlot, GpuLink};
use super::comm::Communicator;
use super::cpu::return_freed_memory_promptly;
use super::cpu::threads::{Fabric, ThreadComm};
use super::error::RuntimeError;
use super::exec::{Batches, DeviceResult, RunConfig, RunOutput, StepRecord, assemble, run_device};
use optimus_plan::Plan;
use optimus_plan::tensor::Tensor;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Runs a plan on one thread per device. `on_step` is called by device (0, 0) after every step.
/// Parameters start from `initial` where given (logical tensors by name), else from the seed.
pub fn run(
    plan: &Plan,
    config: &RunConfig,
    batches: &Batches<'_>,
    initial: &BTreeMap<String, Tensor>,
    on_step: &(dyn Fn(&StepRecord) + Sync),
) -> Result<RunOutput, String> {
    super::limits::check_host_can_run(plan, plan.mesh.devices()).map_err(|e| e.to_string())?;
    return_freed_memory_promptly();
    let fabric = Fabric::new(plan.mesh, config.timeout);
    let devices = plan.mesh.devices();
    let links = gpu_links(plan.mesh, config, &fabric)?;
    let inline = config.backend == BackendKind::Cpu
        && config.kernels_inline.unwrap_or_else(|| super::cpu::par::devices_run_kernels_inline(devices as usize));
    let whole_on_pool = config.backend == BackendKind::Cpu
        && !inline
        && config.kernels_inline.is_none()
        && super::cpu::par::device_runs_on_pool(devices as usize);
    let pins = &super::cpu::pin::DevicePins::for_threads(devices, inline);
    let results: Vec<Result<DeviceResult, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..devices)
            .map(|rank| {
                let fabric = std::sync::Arc::clone(&fabric);
                let slot = DeviceSlot { index: rank, link: links.get(rank as usize).cloned().unwrap_or_default() };
                scope.spawn(move || {
                    pins.pin(rank);
                    let coords = plan.mesh.coords_of(rank);
                    let comm = ThreadComm::new(std::sync::Arc::clone(&fabric), coords);
                    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let device = || run_device(plan, comm, slot, config, batches, initial, on_step);
                        if inline {
                            super::cpu::par::run_inline(device)
                        } else if whole_on_pool {
                            super::cpu::par::on_pool(device)
                        } else {
                            device()
                        }
                    }));
                    let result = match outcome {
                        Ok(r) => r,
                        Err(_) => Err("a kernel panicked (an internal error)".to_string()),
                    };
                    result.map_err(|e| {
                        let message = super::exec::failure_report(coords, &e);
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
    if !config.final_state {
        let steps = per_device.into_iter().next().map(|d| d.0).unwrap_or_default();
        return Ok(RunOutput::of_steps(steps, profiles));
    }
    Ok(RunOutput { profiles, ..assemble(plan, per_device)? })
}

/// How each device of a run on threads exchanges its collectives: a CPU run, or a single device, through
/// the thread fabric; a CUDA mesh with a GPU for every device through NCCL; a CUDA mesh on one GPU on
/// device pointers between the devices' streams ([`super::cuda::fabric`]); a CUDA mesh spread over
/// fewer GPUs than devices (but more than one) through the thread fabric, host-staged.
fn gpu_links(
    mesh: optimus_plan::Mesh,
    config: &RunConfig,
    fabric: &std::sync::Arc<Fabric>,
) -> Result<Vec<GpuLink>, RuntimeError> {
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
fn join_or_abandon<T, E: From<&'static str>>(
    handles: Vec<std::thread::ScopedJoinHandle<'_, Result<T, E>>>,
    fabric: &Fabric,
    mesh: optimus_plan::Mesh,
) -> Vec<Result<T, E>> {
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
