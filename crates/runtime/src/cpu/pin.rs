//! Device threads of a CPU mesh pinned to cores, neighbours in rank order sharing one.
//!
//! When a mesh has at least as many devices as the kernel pool has workers (2x2 or 4x4 on two cores),
//! each device thread runs its own kernels ([`super::par::run_inline`]), and the operating system put
//! them wherever a core was free. Pinned, devices of consecutive ranks share a core: a mesh row first,
//! whose devices meet in every SUMMA step and sum the tied head's partial logits (8 MiB a device at
//! GPT-2 small's 2x2). Under the AVX2 cap on the 2-core Xeon of these notes, GPT-2 4/256/8/8192
//! training steps ran 1.074x and 1.083x faster on optimus 4x4, 0.993x to 1.032x on 2x2 (four runs),
//! 0.999x to 1.008x on megatron 1x2 and 1x4 (the VM's noise), and 1.018x and 1.000x on 2x2 at hidden
//! 512 and 768; a mesh column on a core instead ran 2x2 0.988x. Where a thread runs changes no bits.
//!
//! Only where the pool's workers are as many as the cores this process may use (so the mesh has all
//! of them to itself: not under `RAYON_NUM_THREADS` set lower, a CPU quota, nor an MPI rank's share of
//! a node). `OPTIMUS_PIN_DEVICES=off` (or `0`, `false`, `no`) leaves the threads to the operating system.
//!
//! Pipelined runs are not pinned: each stage's devices on cores of their own ran 0.81x (megatron 1x2)
//! and 0.79x (optimus 2x2) with two stages, as a stage's core idles through its bubbles; each core
//! holding a device of every stage ran 1.000x and 1.005x, no gain.

/// Where the device threads of one run go: thread `index` of `threads` to a core of `cores`, or
/// nowhere in particular (no cores).
pub struct DevicePins {
    cores: Vec<usize>,
    threads: u64,
}

impl DevicePins {
    /// The pins for the `threads` device threads of a mesh: every core this process may use when the
    /// threads run their own kernels (`inline`), the kernel pool has one worker per core, and there are
    /// at least as many threads as cores; else none.
    pub fn for_threads(threads: u64, inline: bool) -> DevicePins {
        let off = std::env::var("OPTIMUS_PIN_DEVICES").is_ok_and(|v| is_off(&v));
        let cores = if inline && !off { allowed_cores() } else { Vec::new() };
        let usable = cores.len() >= 2 && cores.len() == super::par::threads() && threads >= cores.len() as u64;
        DevicePins { cores: if usable { cores } else { Vec::new() }, threads }
    }

    /// Pins the calling thread, device thread `index`, to its core (nothing without cores).
    pub fn pin(&self, index: u64) {
        if let Some(core) = core_for(index, self.threads, &self.cores) {
            pin_this_thread(core);
        }
    }
}

/// Whether a value of `OPTIMUS_PIN_DEVICES` turns pinning off.
fn is_off(value: &str) -> bool {
    matches!(value.trim().to_ascii_lowercase().as_str(), "off" | "0" | "false" | "no")
}

/// The core of `cores` for the device of rank `rank` among `devices`: consecutive ranks in equal runs,
/// so that with as many devices as a multiple of the cores each core holds the same number.
fn core_for(rank: u64, devices: u64, cores: &[usize]) -> Option<usize> {
    let index = (rank as u128 * cores.len() as u128 / devices.max(1) as u128) as usize;
    cores.get(index).copied()
}

/// Pins the calling thread to `core`; a failure (a core taken away since) leaves it where it was, as
/// pinning only speeds a run up.
fn pin_this_thread(core: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: the set is a plain bit mask on the stack, sized as the call is told.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if core < libc::CPU_SETSIZE as usize {
            libc::CPU_SET(core, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = core;
}

/// The CPUs this thread may run on, in increasing order (empty where the system does not say).
fn allowed_cores() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    // SAFETY: the set is a plain bit mask on the stack, sized as the call is told.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&cpu| libc::CPU_ISSET(cpu, &set)).collect()
    }
    #[cfg(not(target_os = "linux"))]
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_ranks_share_a_core_in_equal_runs() {
        let cores = [3, 5];
        let of = |devices: u64| (0..devices).map(|r| core_for(r, devices, &cores)).collect::<Vec<_>>();
        // 2x2: the first mesh row on the first core, the second on the second.
        assert_eq!(of(4), [Some(3), Some(3), Some(5), Some(5)]);
        // 4x4: two mesh rows a core.
        assert_eq!(of(16).iter().filter(|c| **c == Some(3)).count(), 8);
        assert_eq!(of(16)[7..9], [Some(3), Some(5)]);
        // As many devices as cores: one each; three devices on two cores: two, then one.
        assert_eq!(of(2), [Some(3), Some(5)]);
        assert_eq!(of(3), [Some(3), Some(3), Some(5)]);
        assert_eq!(core_for(0, 4, &[]), None);
    }

    #[test]
    fn pinning_is_turned_off_by_the_usual_words_only() {
        for off in ["off", "0", "false", "no", " OFF "] {
            assert!(is_off(off), "{off:?}");
        }
        for on in ["on", "1", "", "yes"] {
            assert!(!is_off(on), "{on:?}");
        }
    }

    #[test]
    fn threads_that_hand_their_kernels_to_the_pool_or_are_fewer_than_the_cores_stay_unpinned() {
        assert!(DevicePins::for_threads(1_000, false).cores.is_empty(), "not inline");
        assert!(DevicePins::for_threads(1, true).cores.is_empty(), "one thread, fewer than two cores");
    }

    #[test]
    fn this_thread_may_run_on_at_least_one_core() {
        if cfg!(target_os = "linux") {
            assert!(!allowed_cores().is_empty());
        }
    }
}
