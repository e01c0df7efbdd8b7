//! Work the CUDA backend holds back to run as one launch: a step's AdamW updates (with the clipping
//! scales of their gradients) and the casts of its bf16 gradients to f32. The executor issues these one
//! tensor at a time, back to back; the backend queues them and runs the queue as one launch before any
//! other work (every other backend call flushes it first, so the stream sees the same order of effects).
//! A job that touches memory a queued job touches (buffers of disjoint lifetimes share the arena) flushes
//! the queue first, so no launch reads what another part of it writes.
//! `OPTIMUS_CUDA_BATCH=off` runs every job where it is issued.

use super::kernels::{AdamwJob, CudaKernels, WidenJob};
use crate::error::{KernelError, RuntimeError};
use crate::settings::OptimizerSettings;
use std::ops::Range;

/// A clipping scale of one f32 gradient, queued until its update takes it (or the queue runs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct ScaleJob {
    pub ptr: u64,
    pub len: usize,
    pub factor: f32,
}

/// What the queue holds: one kind of work at a time.
#[derive(Debug, Default)]
enum Queue {
    #[default]
    Empty,
    Widen(Vec<WidenJob>),
    /// Scales not yet taken by an update, and updates, all with one setting and step (`None` until the
    /// first update comes).
    Update {
        scales: Vec<ScaleJob>,
        updates: Vec<AdamwJob>,
        on: Option<(OptimizerSettings, u64)>,
    },
}

/// The bytes a job reads and writes (unused places hold [`NOTHING`]); fixed arrays, since the queue
/// compares each new job with every queued one.
struct Touches {
    reads: [Range<u64>; 1],
    writes: [Range<u64>; 4],
}

/// An empty range, which overlaps nothing.
const NOTHING: Range<u64> = 0..0;

fn bytes(ptr: u64, len: usize, element: u64) -> Range<u64> {
    ptr..ptr + len as u64 * element
}

fn overlap(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end && a.start < a.end && b.start < b.end
}

impl Touches {
    fn of_widen(j: &WidenJob) -> Touches {
        Touches { reads: [bytes(j.src, j.len, 2)], writes: [bytes(j.dst, j.len, 4), NOTHING, NOTHING, NOTHING] }
    }

    fn of_update(j: &AdamwJob) -> Touches {
        let f32s = |ptr| bytes(ptr, j.len, 4);
        let scaled_grad = if j.grad_scale.is_some() { f32s(j.grad) } else { NOTHING };
        Touches { reads: [f32s(j.grad)], writes: [f32s(j.param), f32s(j.state1), f32s(j.state2), scaled_grad] }
    }

    fn of_scale(j: &ScaleJob) -> Touches {
        Touches { reads: [NOTHING], writes: [bytes(j.ptr, j.len, 4), NOTHING, NOTHING, NOTHING] }
    }

    /// Whether running `self` in one launch with `other` could race (a write against a read or a write).
    fn conflicts(&self, other: &Touches) -> bool {
        let hits = |a: &[Range<u64>], b: &[Range<u64>]| a.iter().any(|x| b.iter().any(|y| overlap(x, y)));
        hits(&self.writes, &other.writes) || hits(&self.writes, &other.reads) || hits(&self.reads, &other.writes)
    }
}

/// The queue of one device's backend.
#[derive(Debug)]
pub(super) struct Deferred {
    enabled: bool,
    queue: Queue,
}

impl Deferred {
    /// A queue, or none (every job runs where it is issued) when `off` (profiles) or with
    /// `OPTIMUS_CUDA_BATCH=off`.
    pub fn new(off: bool) -> Deferred {
        let env_off = std::env::var("OPTIMUS_CUDA_BATCH").is_ok_and(|v| v == "off" || v == "0");
        Deferred { enabled: !(off || env_off), queue: Queue::Empty }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Queues a cast of a bf16 gradient to f32 (after running what else is queued, if it must).
    pub fn widen(&mut self, kernels: &mut CudaKernels, job: WidenJob) -> Result<(), RuntimeError> {
        let touches = Touches::of_widen(&job);
        if !matches!(self.queue, Queue::Widen(_)) || self.conflicts(&touches) {
            self.flush(kernels)?;
        }
        match &mut self.queue {
            Queue::Widen(jobs) => jobs.push(job),
            queue => *queue = Queue::Widen(vec![job]),
        }
        Ok(())
    }

    /// Queues a clipping scale of a gradient, which the gradient's update takes.
    pub fn scale(&mut self, kernels: &mut CudaKernels, job: ScaleJob) -> Result<(), RuntimeError> {
        let same_kind = matches!(self.queue, Queue::Update { .. });
        if !same_kind || self.conflicts(&Touches::of_scale(&job)) {
            self.flush(kernels)?;
        }
        match &mut self.queue {
            Queue::Update { scales, .. } => scales.push(job),
            queue => *queue = Queue::Update { scales: vec![job], updates: vec![], on: None },
        }
        Ok(())
    }

    /// Queues an AdamW update, with the queued scale of its gradient if there is one.
    pub fn update(
        &mut self,
        kernels: &mut CudaKernels,
        mut job: AdamwJob,
        settings: &OptimizerSettings,
        step: u64,
    ) -> Result<(), RuntimeError> {
        let mut taken = None;
        if let Queue::Update { scales, .. } = &mut self.queue
            && let Some(k) = scales.iter().position(|s| s.ptr == job.grad && s.len == job.len)
        {
            taken = Some(scales.remove(k));
            job.grad_scale = taken.map(|s| s.factor);
        }
        let joins = match &self.queue {
            Queue::Update { on, .. } => on.is_none_or(|(s, t)| s == *settings && t == step),
            _ => false,
        };
        if !joins || self.conflicts(&Touches::of_update(&job)) {
            // Give the scale back, so that the flush runs it before this update reads the gradient.
            if let (Some(scale), Queue::Update { scales, .. }) = (taken, &mut self.queue) {
                scales.push(scale);
                job.grad_scale = None;
            }
            self.flush(kernels)?;
        }
        match &mut self.queue {
            Queue::Update { updates, on, .. } => {
                *on = Some((*settings, step));
                updates.push(job);
            }
            queue => *queue = Queue::Update { scales: vec![], updates: vec![job], on: Some((*settings, step)) },
        }
        Ok(())
    }

    /// Whether `touches` races with anything queued.
    fn conflicts(&self, touches: &Touches) -> bool {
        match &self.queue {
            Queue::Empty => false,
            Queue::Widen(jobs) => jobs.iter().any(|j| touches.conflicts(&Touches::of_widen(j))),
            Queue::Update { scales, updates, .. } => {
                scales.iter().any(|j| touches.conflicts(&Touches::of_scale(j)))
                    || updates.iter().any(|j| touches.conflicts(&Touches::of_update(j)))
            }
        }
    }

    /// Runs everything queued: the casts in one launch; the scales no update took, then the updates in one.
    pub fn flush(&mut self, kernels: &mut CudaKernels) -> Result<(), RuntimeError> {
        let ran = match std::mem::take(&mut self.queue) {
            Queue::Empty => Ok(()),
            Queue::Widen(jobs) => kernels.widen_many(&jobs),
            Queue::Update { scales, updates, on } => run_updates(kernels, &scales, &updates, on),
        };
        ran.map_err(RuntimeError::Kernel)
    }
}

fn run_updates(
    kernels: &mut CudaKernels,
    scales: &[ScaleJob],
    updates: &[AdamwJob],
    on: Option<(OptimizerSettings, u64)>,
) -> Result<(), KernelError> {
    for s in scales {
        kernels.scale_at(s.ptr, s.len, s.factor)?;
    }
    match on {
        Some((settings, step)) if !updates.is_empty() => kernels.adamw_many(updates, &settings, step),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(base: u64, len: usize) -> AdamwJob {
        AdamwJob {
            param: base,
            grad: base + 0x1000,
            state1: base + 0x2000,
            state2: base + 0x3000,
            len,
            grad_scale: None,
        }
    }

    #[test]
    fn casts_that_share_no_bytes_can_run_together() {
        let a = Touches::of_widen(&WidenJob { src: 0, dst: 0x100, len: 16 });
        let b = Touches::of_widen(&WidenJob { src: 0x200, dst: 0x300, len: 16 });
        assert!(!a.conflicts(&b));
    }

    #[test]
    fn a_cast_into_memory_another_cast_reads_must_wait() {
        // The second cast's output lands where the first one's bf16 source was (freed, then reused).
        let first = Touches::of_widen(&WidenJob { src: 0x100, dst: 0x1000, len: 64 });
        let second = Touches::of_widen(&WidenJob { src: 0x2000, dst: 0x100, len: 8 });
        assert!(second.conflicts(&first));
        // Reading what a queued job writes conflicts too.
        let reader = Touches::of_widen(&WidenJob { src: 0x1010, dst: 0x3000, len: 8 });
        assert!(reader.conflicts(&first));
    }

    #[test]
    fn updates_of_distinct_parameters_do_not_conflict_and_a_scale_of_their_gradient_does() {
        let a = Touches::of_update(&update(0x10000, 256));
        let b = Touches::of_update(&update(0x20000, 256));
        assert!(!a.conflicts(&b));
        let scale = Touches::of_scale(&ScaleJob { ptr: 0x10000 + 0x1000, len: 256, factor: 0.5 });
        assert!(scale.conflicts(&a));
    }

    #[test]
    fn empty_ranges_touch_nothing() {
        assert!(!overlap(&(5..5), &(0..10)));
        assert!(overlap(&(0..10), &(9..12)));
        assert!(!overlap(&(0..10), &(10..12)));
    }
}
