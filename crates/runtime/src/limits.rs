//! What this machine can run: a plan's devices as threads of one process (at most
//! [`MAX_DEVICE_THREADS`]) and its memory (peak per device times the devices here) against the memory
//! available, refused with the numbers before any thread starts or any buffer is allocated.

use optimus_plan::memory::{persistent, touched};
use optimus_plan::pipeline::Schedule;
use optimus_plan::pipeline_cut::PipelineProgram;
use optimus_plan::report::human_bytes;
use optimus_plan::{Instr, Mesh, Plan};

/// Why this machine cannot run a plan's devices, with the numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LimitError {
    /// More device threads than one process starts: the plan's `mesh` would put `devices` here.
    Threads { mesh: Mesh, devices: u64 },
    /// `devices` devices of `per_device` bytes each need more than the `available` bytes.
    Memory { devices: u64, per_device: u64, available: u64 },
}

impl std::fmt::Display for LimitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            LimitError::Threads { mesh, devices: _ } => write!(
                f,
                "the plan's {mesh} mesh has {all} devices, but one process runs at most {MAX_DEVICE_THREADS} device \
                 threads; run one process per device with `mpirun -np {all} optimusc run ...` or `srun -n {all} \
                 optimusc run ...` (see docs/clusters.md)",
                all = mesh.devices()
            ),
            LimitError::Memory { devices, per_device, available } => write!(
                f,
                "the plan needs {devices} device{} x {} = {} but this machine has {} available; run fewer devices \
                 per machine (mpirun or srun, see docs/clusters.md), shrink the model or batch, or set \
                 {SKIP_MEMORY_CHECK}=1 to try anyway",
                if devices == 1 { "" } else { "s" },
                human_bytes(per_device),
                human_bytes(per_device.saturating_mul(devices)),
                human_bytes(available)
            ),
        }
    }
}

impl std::error::Error for LimitError {}

/// The most device threads one process starts; larger meshes run one process per device (MPI).
pub const MAX_DEVICE_THREADS: u64 = 1024;

/// Set to `1` to run even when the plan needs more memory than the machine reports available.
pub const SKIP_MEMORY_CHECK: &str = "OPTIMUS_SKIP_MEMORY_CHECK";

/// Refuses a plan whose `devices_here` devices (run by this process, or sharing this machine's memory)
/// exceed the thread cap or the memory available. The memory need is computed from the plan's
/// buffers and program, not read from its memory summary, so editing the summary cannot bypass it.
pub fn check_host_can_run(plan: &Plan, devices_here: u64) -> Result<(), LimitError> {
    check_host_for(plan, devices_here, || peak_bytes_per_device(plan))
}

/// The thread cap, then (unless [`SKIP_MEMORY_CHECK`]) `devices_here` devices of `per_device()` bytes.
fn check_host_for(plan: &Plan, devices_here: u64, per_device: impl FnOnce() -> u64) -> Result<(), LimitError> {
    check_thread_count(plan, devices_here)?;
    if std::env::var(SKIP_MEMORY_CHECK).is_ok_and(|v| v == "1") {
        return Ok(());
    }
    check_memory(per_device(), devices_here, available_memory())
}

/// As [`check_host_can_run`] for a pipeline of `program`'s stages under `schedule` with `micro_batches`
/// per update, `devices_here` of whose stage devices share this machine: each device needs at most what
/// the largest stage's memory plan says (its storage, the update's gradient sums and the activations its
/// schedule keeps for backward passes to come), which may be well above the whole plan's one-micro-batch
/// peak (GPipe keeps every micro-batch's) or well below it (a stage holds its layers only).
pub fn check_pipeline_host_can_run(
    plan: &Plan,
    run: (&PipelineProgram, Schedule, u64),
    devices_here: u64,
) -> Result<(), LimitError> {
    let (program, schedule, micro_batches) = run;
    let largest_stage = || {
        program
            .memory_plan(schedule, micro_batches)
            .map(|stages| stages.iter().map(|s| s.peak_bytes).max().unwrap_or(0))
            .unwrap_or_else(|_| peak_bytes_per_device(plan))
    };
    check_host_for(plan, devices_here, largest_stage)
}

/// At most [`MAX_DEVICE_THREADS`] devices in one process.
pub fn check_thread_count(plan: &Plan, devices_here: u64) -> Result<(), LimitError> {
    if devices_here <= MAX_DEVICE_THREADS {
        return Ok(());
    }
    Err(LimitError::Threads { mesh: plan.mesh, devices: devices_here })
}

/// Refuses when `devices` devices of `per_device` bytes each need more than `available` bytes
/// (skipped when the available memory is unknown).
pub fn check_memory(per_device: u64, devices: u64, available: Option<u64>) -> Result<(), LimitError> {
    let Some(available) = available else { return Ok(()) };
    if per_device.saturating_mul(devices) <= available {
        return Ok(());
    }
    Err(LimitError::Memory { devices, per_device, available })
}

/// The most bytes one device holds at once: persistent buffers plus every buffer from its first use
/// to its free, in program order (the figure `memory.peak_bytes` reports, recomputed; saturating, and
/// safe on plans that were never verified).
pub fn peak_bytes_per_device(plan: &Plan) -> u64 {
    let bytes = |id: usize| {
        plan.buffers
            .get(id)
            .map_or(0, |b| optimus_plan::verify::checked_bytes(&b.shape, b.dtype.bytes()).map_or(u64::MAX, |(_, n)| n))
    };
    let mut live = vec![false; plan.buffers.len()];
    let mut current = 0u64;
    for (id, b) in plan.buffers.iter().enumerate() {
        if persistent(b.role) {
            live[id] = true;
            current = current.saturating_add(bytes(id));
        }
    }
    let mut peak = current;
    for instr in &plan.program {
        for id in touched(instr).into_iter().map(|b| b.0 as usize) {
            let Some(alive) = live.get_mut(id) else { continue };
            match instr {
                Instr::Free { .. } if *alive => current = current.saturating_sub(bytes(id)),
                Instr::Free { .. } => {}
                _ if !*alive => current = current.saturating_add(bytes(id)),
                _ => {}
            }
            *alive = !matches!(instr, Instr::Free { .. });
        }
        peak = peak.max(current);
    }
    peak
}

/// The memory this process may still use: the kernel's `MemAvailable`, lowered by a cgroup (v2)
/// limit when one is set; `None` when neither can be read (not Linux).
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| mem_available(&t));
    let cgroup = cgroup_headroom();
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` from the text of /proc/meminfo, in bytes.
pub fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// memory.max - memory.current of this process's cgroup (v2), if it has a limit.
fn cgroup_headroom() -> Option<u64> {
    let path = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let relative = path.lines().find_map(|l| l.strip_prefix("0::"))?.trim();
    let dir = std::path::Path::new("/sys/fs/cgroup").join(relative.trim_start_matches('/'));
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok()?.trim().parse::<u64>().ok();
    Some(read("memory.max")?.saturating_sub(read("memory.current")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_reads_kib() {
        let text = "MemTotal:       16000000 kB\nMemFree:  1 kB\nMemAvailable:    5242880 kB\n";
        assert_eq!(mem_available(text), Some(5 * 1024 * 1024 * 1024));
        assert_eq!(mem_available("MemTotal: 3 kB\n"), None);
    }

    #[test]
    fn memory_need_is_refused_with_the_numbers() {
        let gib = 1u64 << 30;
        let err = check_memory(3 * gib + gib / 5, 4, Some(5 * gib)).expect_err("12.8 GiB > 5 GiB").to_string();
        assert!(err.contains("4 devices x 3.20 GiB = 12.80 GiB"), "{err}");
        assert!(err.contains("5.00 GiB available") && err.contains(SKIP_MEMORY_CHECK), "{err}");
        assert_eq!(check_memory(gib, 4, Some(5 * gib)), Ok(()));
        assert_eq!(check_memory(u64::MAX, u64::MAX, None), Ok(()));
    }
}
