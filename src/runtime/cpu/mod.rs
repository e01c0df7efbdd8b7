//! The CPU backend: kernels on host memory, and a mesh of device threads in one process.

pub mod kernels;
pub mod threads;

use super::Device;
use super::backend::BackendKind;
use super::comm::Communicator;
use super::fault::Fault;
use super::init::gather_blocks;
use super::profile::Profile;
use super::tensor::Tensor;
use crate::plan::Plan;
use kernels::OptimizerSettings;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use threads::{Fabric, ThreadComm};

/// How to run a plan.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub seed: u64,
    pub steps: u64,
    pub optimizer: OptimizerSettings,
    /// How long a collective waits for its peers before the run fails.
    pub timeout: Duration,
    /// A failure to inject, for testing how runs fail (see [`crate::runtime::fault`]).
    pub fault: Option<Fault>,
    /// Where kernels run.
    pub backend: BackendKind,
    /// Time every instruction of every device into [`RunOutput::profiles`] (the first step is left
    /// out as warm-up when there are more).
    pub profile: bool,
}

/// What one step produced, as seen by device (0, 0).
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    pub step: u64,
    /// The loss of the step's forward pass (before the update), if the model has one.
    pub loss: Option<f32>,
    pub elapsed: Duration,
}

/// Everything a run leaves behind, assembled into logical tensors.
#[derive(Clone, Debug)]
pub struct RunOutput {
    pub steps: Vec<StepRecord>,
    /// Final parameters, by parameter name (padding removed).
    pub params: BTreeMap<String, Tensor>,
    /// Gradients of the last step, by parameter name (train plans).
    pub grads: BTreeMap<String, Tensor>,
    /// Outputs of the last step, by output name.
    pub outputs: BTreeMap<String, Tensor>,
    /// Each device's instruction times (row-major device order) when [`RunConfig::profile`] is set.
    pub profiles: Vec<Profile>,
}

/// Inputs of step k, as logical tensors by input name.
pub type Batches<'a> = dyn Fn(u64) -> Result<BTreeMap<String, Tensor>, String> + Sync + 'a;

/// Blocks one device hands back at the end of a run: parameters, gradients, outputs (plan order).
pub type DeviceBlocks = (Vec<Tensor>, Vec<Option<Tensor>>, Vec<Tensor>);

/// What [`run_device`] hands back: its step records, its final blocks and its profile (if profiling).
pub type DeviceRun = (Vec<StepRecord>, DeviceBlocks, Option<Profile>);

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
    let fabric = Fabric::new(plan.mesh, config.timeout);
    let devices = plan.mesh.devices();
    #[cfg(feature = "cuda")]
    let nccl = match config.backend {
        BackendKind::Cuda => Some(super::cuda::nccl::ids_for_threads(plan.mesh)?),
        BackendKind::Cpu => None,
    };
    let results: Vec<Result<DeviceRun, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..devices)
            .map(|rank| {
                let fabric = std::sync::Arc::clone(&fabric);
                #[cfg(feature = "cuda")]
                let nccl = nccl.as_deref();
                scope.spawn(move || {
                    let (i, j) = (rank / plan.mesh.cols, rank % plan.mesh.cols);
                    let comm = ThreadComm::new(std::sync::Arc::clone(&fabric), i, j);
                    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        #[cfg(feature = "cuda")]
                        if let Some(ids) = nccl {
                            let comm = super::cuda::nccl::NcclComm::for_thread(ids, rank, plan.mesh, config.timeout)?;
                            return run_device(plan, comm, rank, config, batches, initial, on_step);
                        }
                        run_device(plan, comm, rank, config, batches, initial, on_step)
                    }));
                    let result = match outcome {
                        Ok(r) => r,
                        Err(_) => Err("a kernel panicked (an internal error)".to_string()),
                    };
                    result.map_err(|e| {
                        let message = format!("device ({i}, {j}) failed: {e}");
                        ThreadComm::new(fabric, i, j).abort(&message);
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
                    .map(|r| format!("({}, {})", r / mesh.cols, r % mesh.cols))
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

/// Runs one device of the mesh for the configured steps and returns its records and final blocks.
/// `on_step` is called on device (0, 0) only; `slot` picks the GPU of a GPU backend.
pub fn run_device<C: Communicator>(
    plan: &Plan,
    comm: C,
    slot: u64,
    config: &RunConfig,
    batches: &Batches<'_>,
    initial: &BTreeMap<String, Tensor>,
    on_step: &(dyn Fn(&StepRecord) + Sync),
) -> Result<DeviceRun, String> {
    let mut device = Device::new(plan, config.backend.create(slot)?, comm, config.seed);
    let (i, j) = device.coords();
    device.profile = config.profile.then(|| Profile::new(plan, (i, j)));
    for p in &plan.params {
        if let Some(t) = initial.get(&p.name) {
            let block = super::init::block_of(
                &super::init::pad_to(t, plan.buffer(p.buffer))?,
                plan.buffer(p.buffer),
                i,
                j,
                plan.mesh,
            )?;
            device.write(p.buffer, block)?;
        }
    }
    let mut records = Vec::new();
    let device_index = i * plan.mesh.cols + j;
    for step in 0..config.steps {
        if let Some(fault) = &config.fault {
            fault.trigger(device_index, step)?;
        }
        let start = Instant::now();
        device.load_inputs(&batches(step)?)?;
        match device.step(&config.optimizer, step + 1) {
            Ok(()) => {}
            Err(super::StepError::Failed(e)) => return Err(format!("step {step}: {e}")),
            Err(super::StepError::NonFiniteLoss(value)) => {
                device.load_inputs(&batches(step)?)?;
                let culprit = device.first_non_finite().map_err(|e| format!("step {step}: {e}"))?;
                return Err(format!(
                    "step {step}: the loss is {value}, so the run stops before updating any weight (none are saved); {culprit}"
                ));
            }
        }
        let loss = plan
            .outputs
            .iter()
            .find(|o| o.is_loss)
            .and_then(|o| device.read(o.buffer))
            .and_then(|t| t.f32().ok()?.first().copied());
        let record = StepRecord { step, loss, elapsed: start.elapsed() };
        if let Some(profile) = device.profile.as_mut() {
            profile.finish_step(record.elapsed, step == 0 && config.steps > 1);
        }
        if (i, j) == (0, 0) {
            on_step(&record);
        }
        records.push(record);
    }
    let take = |id| device.read(id).cloned();
    let lost = |what: &str, name: &str| format!("the plan does not keep {what} `{name}` to the end of a step");
    let params = plan
        .params
        .iter()
        .map(|p| take(p.buffer).ok_or_else(|| lost("parameter", &p.name)))
        .collect::<Result<Vec<_>, _>>()?;
    let grads = plan.params.iter().map(|p| p.grad.and_then(take)).collect();
    let outputs = plan
        .outputs
        .iter()
        .map(|o| take(o.buffer).ok_or_else(|| lost("output", &o.name)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((records, (params, grads, outputs), device.profile.take()))
}

/// Assembles logical tensors from every device's blocks (in row-major device order).
pub fn assemble(plan: &Plan, per_device: Vec<(Vec<StepRecord>, DeviceBlocks)>) -> Result<RunOutput, String> {
    let steps = per_device.first().map(|d| d.0.clone()).unwrap_or_default();
    let mut out = RunOutput {
        steps,
        params: BTreeMap::new(),
        grads: BTreeMap::new(),
        outputs: BTreeMap::new(),
        profiles: Vec::new(),
    };
    for (k, p) in plan.params.iter().enumerate() {
        let blocks: Vec<&Tensor> = per_device.iter().map(|d| &d.1.0[k]).collect();
        let full = gather_blocks(&blocks, plan.buffer(p.buffer), plan.mesh)?;
        out.params.insert(p.name.clone(), super::init::unpad(&full, &p.shape));
        if let Some(g) = p.grad {
            let blocks: Option<Vec<&Tensor>> = per_device.iter().map(|d| d.1.1[k].as_ref()).collect();
            if let Some(blocks) = blocks {
                let full = gather_blocks(&blocks, plan.buffer(g), plan.mesh)?;
                out.grads.insert(p.name.clone(), super::init::unpad(&full, &p.shape));
            }
        }
    }
    for (k, o) in plan.outputs.iter().enumerate() {
        let blocks: Vec<&Tensor> = per_device.iter().map(|d| &d.1.2[k]).collect();
        out.outputs.insert(o.name.clone(), gather_blocks(&blocks, plan.buffer(o.buffer), plan.mesh)?);
    }
    Ok(out)
}
