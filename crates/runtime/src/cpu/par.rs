//! The CPU backend's one pool of kernel workers, sized to the machine, and the ways a kernel splits
//! its work over it. Every device thread of a run hands its kernels to this pool, so a 4x4 mesh on two
//! cores keeps two cores busy rather than sixteen threads fighting over them. Work is split only into
//! whole rows (or whole columns of a reduction), each done in the same order as on one thread, so the
//! results do not depend on the number of threads.

use rayon::prelude::*;
use rayon::{ThreadPool, ThreadPoolBuilder};
use std::cell::Cell;
use std::sync::OnceLock;

thread_local! {
    /// Whether this thread runs its kernels itself, one task after another (see [`run_inline`]).
    static INLINE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with every kernel it starts on this thread done here, its tasks one after another in the
/// order the pool would have split them (so the results are bit for bit the pool's), rather than handed
/// to the pool. For device threads that are at least as many as the pool's workers: they keep the cores
/// busy themselves, and handing each kernel over (two thread switches) costs more than it gains.
pub fn run_inline<R>(f: impl FnOnce() -> R) -> R {
    let before = INLINE.with(|inline| inline.replace(true));
    let result = f();
    INLINE.with(|inline| inline.set(before));
    result
}

/// Whether kernels started on this thread run on it (see [`run_inline`]).
pub fn runs_inline() -> bool {
    INLINE.with(Cell::get)
}

/// Whether device threads of a run should run their kernels themselves ([`run_inline`]): when there are
/// at least as many of them as the pool has workers. `OPTIMUS_DEVICE_KERNELS=pool` or `=inline` decides.
pub fn devices_run_kernels_inline(devices: usize) -> bool {
    match std::env::var("OPTIMUS_DEVICE_KERNELS").as_deref() {
        Ok("pool") => false,
        Ok("inline") => true,
        _ => devices > 1 && devices >= threads(),
    }
}

/// Whether the device thread of a run should run its whole program on a worker of the pool
/// ([`on_pool`] around it): for a run of one device, whose every kernel then starts where it is
/// instead of being handed to the pool and waited for (two thread switches a kernel, 7% of a GPT-2
/// hidden-256 step on 2 cores). `OPTIMUS_DEVICE_KERNELS=pool` hands each kernel over as before.
pub fn device_runs_on_pool(devices: usize) -> bool {
    devices == 1 && std::env::var("OPTIMUS_DEVICE_KERNELS").as_deref() != Ok("pool")
}

/// `(a(), b())`, in parallel on the pool unless this thread runs its kernels inline.
pub fn join<A: Send, B: Send>(a: impl FnOnce() -> A + Send, b: impl FnOnce() -> B + Send) -> (A, B) {
    if runs_inline() { (a(), b()) } else { rayon::join(a, b) }
}

/// Elements a task should have at least: below this, splitting costs more than it gains.
pub const GRAIN: usize = 1 << 14;

/// Tasks per worker, so that uneven tasks still balance.
const TASKS_PER_THREAD: usize = 4;

/// The kernel pool: `RAYON_NUM_THREADS` workers if set; else, under an MPI launcher that says how
/// many ranks share this node, an equal share of the cores; else one per core this process may use.
/// `None` if the pool cannot be built (kernels then run on the calling thread, one at a time).
fn pool() -> Option<&'static ThreadPool> {
    static POOL: OnceLock<Option<ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let builder = ThreadPoolBuilder::new().thread_name(|k| format!("optimus-kernel-{k}"));
        let builder = match share_of_node() {
            Some(threads) if std::env::var_os("RAYON_NUM_THREADS").is_none() => builder.num_threads(threads),
            _ => builder,
        };
        builder.build().ok()
    })
    .as_ref()
}

/// Cores per rank when an MPI launcher (Open MPI or MPICH/Hydra) says how many ranks run on this node.
fn share_of_node() -> Option<usize> {
    let local_ranks = ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|name| std::env::var(name).ok()?.trim().parse::<usize>().ok())
        .filter(|&n| n > 1)?;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    Some((cores / local_ranks).max(1))
}

/// How many workers the kernel pool has.
pub fn threads() -> usize {
    pool().map_or(1, ThreadPool::current_num_threads)
}

/// Runs `f` on the kernel pool (the calling thread waits), so that its parallel parts, faer's
/// products included, use the pool's workers and no others.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match pool() {
        Some(pool) if pool.current_thread_index().is_none() && !runs_inline() => pool.install(f),
        _ => f(),
    }
}

/// How many of `count` items of `size` elements each make one task.
pub fn items_per_task(count: usize, size: usize) -> usize {
    let by_grain = GRAIN.div_ceil(size.max(1));
    let by_balance = count.div_ceil(threads() * TASKS_PER_THREAD);
    by_grain.max(by_balance).max(1)
}

/// Calls `f(first_row, block)` on blocks of whole rows of `y` (rows of `width` elements), in parallel
/// when `y` is large enough. The first error stops the others.
pub fn row_blocks<E: Send>(
    y: &mut [f32],
    width: usize,
    f: impl Fn(usize, &mut [f32]) -> Result<(), E> + Sync,
) -> Result<(), E> {
    costed_row_blocks(y, width, width, f)
}

/// As [`row_blocks`], for rows whose computation reads `cost` elements each (a row's statistics
/// written as `width` values from a much longer input row).
pub fn costed_row_blocks<E: Send>(
    y: &mut [f32],
    width: usize,
    cost: usize,
    f: impl Fn(usize, &mut [f32]) -> Result<(), E> + Sync,
) -> Result<(), E> {
    let width = width.max(1);
    let rows = y.len() / width;
    let per_task = items_per_task(rows, cost);
    if per_task >= rows {
        return f(0, y);
    }
    if runs_inline() {
        return y.chunks_mut(per_task * width).enumerate().try_for_each(|(k, block)| f(k * per_task, block));
    }
    y.par_chunks_mut(per_task * width).enumerate().try_for_each(|(k, block)| f(k * per_task, block))
}

/// Calls `f(start, chunk)` on consecutive chunks of `y`, in parallel when `y` is large enough.
pub fn chunks<E: Send>(y: &mut [f32], f: impl Fn(usize, &mut [f32]) -> Result<(), E> + Sync) -> Result<(), E> {
    row_blocks(y, 1, f)
}

/// Calls `f(first_column, block)` on blocks of columns of a `width`-long result reduced over `rows`
/// rows (a bias or LayerNorm weight gradient): each task sums its columns over every row, in row
/// order, so the sums are those of one thread.
pub fn column_blocks<E: Send>(
    g: &mut [f32],
    rows: usize,
    f: impl Fn(usize, &mut [f32]) -> Result<(), E> + Sync,
) -> Result<(), E> {
    let width = g.len();
    let per_task = items_per_task(width, rows).max(16);
    if per_task >= width {
        return f(0, g);
    }
    if runs_inline() {
        return g.chunks_mut(per_task).enumerate().try_for_each(|(k, block)| f(k * per_task, block));
    }
    g.par_chunks_mut(per_task).enumerate().try_for_each(|(k, block)| f(k * per_task, block))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_blocks_cover_every_row_once_in_whole_rows() {
        let width = 7;
        let mut y = vec![0.0f32; width * 10_000];
        row_blocks(&mut y, width, |first, block| {
            assert_eq!(block.len() % width, 0);
            for (r, row) in block.chunks_exact_mut(width).enumerate() {
                row.fill((first + r) as f32);
            }
            Ok::<(), ()>(())
        })
        .expect("no error");
        for (r, row) in y.chunks_exact(width).enumerate() {
            assert!(row.iter().all(|&v| v == r as f32), "row {r}");
        }
    }

    #[test]
    fn column_blocks_cover_every_column_once() {
        let mut g = vec![0.0f32; 1000];
        column_blocks(&mut g, 5000, |first, block| {
            for (c, v) in block.iter_mut().enumerate() {
                *v += (first + c) as f32;
            }
            Ok::<(), ()>(())
        })
        .expect("no error");
        assert!(g.iter().enumerate().all(|(c, &v)| v == c as f32));
    }

    #[test]
    fn inline_kernels_run_every_task_on_the_calling_thread_in_the_pools_blocks() {
        let caller = std::thread::current().id();
        let mut y = vec![0.0f32; 1 << 20];
        let blocks = std::sync::Mutex::new(Vec::new());
        run_inline(|| {
            on_pool(|| {
                row_blocks(&mut y, 4, |first, block| {
                    assert_eq!(std::thread::current().id(), caller);
                    blocks.lock().map_err(|_| ())?.push((first, block.len()));
                    Ok::<(), ()>(())
                })
            })
        })
        .expect("no error");
        let blocks = blocks.into_inner().expect("no poisoned lock");
        let per_task = items_per_task((1 << 20) / 4, 4);
        assert_eq!(blocks.len(), (1usize << 18).div_ceil(per_task));
        assert!(blocks.windows(2).all(|w| w[1].0 == w[0].0 + w[0].1 / 4), "in order: {blocks:?}");
        assert!(!runs_inline(), "the flag is this thread's only while `run_inline` runs");
    }

    #[test]
    fn the_first_error_is_returned() {
        let mut y = vec![0.0f32; 1 << 20];
        let result = chunks(&mut y, |start, _| if start > 0 { Err(start) } else { Ok(()) });
        assert!(result.is_err() || threads() == 1);
    }
}
