//! How this process was started: alone, or as one rank of a job launched by mpirun, mpiexec or srun.
//! Detection reads only the launcher's environment, so it works without initialising MPI.

/// A launcher that started this process as one rank of several.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Which launcher set the environment ("Open MPI mpirun", "Slurm srun", ...).
    pub launcher: &'static str,
    /// This process's rank among `size`.
    pub rank: u64,
    pub size: u64,
}

/// The environment variables each launcher sets: (launcher, size variable, rank variable).
const LAUNCHERS: [(&str, &str, &str); 3] = [
    ("Open MPI mpirun", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("MPICH/Intel MPI (Hydra)", "PMI_SIZE", "PMI_RANK"),
    ("Slurm srun", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"),
];

/// The launch this process belongs to, read from the environment; `None` when started on its own.
pub fn detect() -> Option<Launch> {
    detect_in(|name| std::env::var(name).ok())
}

/// [`detect`] over any environment lookup (for tests).
pub fn detect_in(env: impl Fn(&str) -> Option<String>) -> Option<Launch> {
    LAUNCHERS.iter().find_map(|&(launcher, size_var, rank_var)| {
        let size = env(size_var)?.trim().parse::<u64>().ok()?;
        let rank = env(rank_var).and_then(|r| r.trim().parse::<u64>().ok()).unwrap_or(0);
        (size >= 1 && rank < size).then_some(Launch { launcher, rank, size })
    })
}

impl Launch {
    /// Whether the job has more than one process, so devices run one per process.
    pub fn is_multi_process(&self) -> bool {
        self.size > 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn reads_each_launcher() {
        let ompi = detect_in(env(&[("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_RANK", "3")]));
        assert_eq!(ompi, Some(Launch { launcher: "Open MPI mpirun", rank: 3, size: 4 }));
        let hydra = detect_in(env(&[("PMI_SIZE", "9"), ("PMI_RANK", "0")]));
        assert_eq!(hydra.map(|l| (l.rank, l.size)), Some((0, 9)));
        let slurm = detect_in(env(&[("SLURM_STEP_NUM_TASKS", "16"), ("SLURM_PROCID", "5")]));
        assert_eq!(slurm.map(|l| (l.launcher, l.rank, l.size)), Some(("Slurm srun", 5, 16)));
    }

    #[test]
    fn a_batch_script_or_a_plain_shell_is_not_a_launch() {
        // sbatch sets SLURM_NTASKS and SLURM_PROCID in the batch script, but no job step size.
        assert_eq!(detect_in(env(&[("SLURM_NTASKS", "16"), ("SLURM_PROCID", "0")])), None);
        assert_eq!(detect_in(env(&[])), None);
        assert_eq!(detect_in(env(&[("OMPI_COMM_WORLD_SIZE", "two")])), None);
        assert_eq!(detect_in(env(&[("PMI_SIZE", "2"), ("PMI_RANK", "2")])), None);
    }

    #[test]
    fn one_process_is_not_multi_process() {
        let one = detect_in(env(&[("OMPI_COMM_WORLD_SIZE", "1")]));
        assert_eq!(one.as_ref().map(Launch::is_multi_process), Some(false));
    }
}
