//! The GPU time of one instruction, for `run --profile` and `calibrate --backend cuda`: a pair of
//! events around the instruction's launches, with the stream held busy while the host queues them.
//!
//! Timed by the host, an instruction would count the host's launch and a wait for the GPU (about
//! 10 µs, more than many small kernels take). Events recorded right after a sync would count the host's
//! queuing as well, since the GPU reaches the first event before the launches arrive. So each timed
//! instruction first launches `hold_stream`, which keeps the GPU busy for [`HOLD_CYCLES`] while the host
//! queues the start event, the instruction and the stop event; the time between the two events is then
//! what the GPU spent on the instruction.

use super::error::{DeviceError, driver};
use super::kernels::CudaKernels;
use crate::error::RuntimeError;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::Arc;
use std::time::Duration;

/// How long `hold_stream` keeps the GPU busy before an instruction, in SM clock cycles: about 100 µs at
/// 2 GHz, more than the host takes to queue an instruction's launches (the most, a padded product,
/// makes about six).
pub const HOLD_CYCLES: i64 = 200_000;

/// Times instructions on one stream, one at a time.
pub struct GpuTimer {
    start: CudaEvent,
    stop: CudaEvent,
    /// The last instruction's GPU time, until taken.
    last: Option<Duration>,
}

impl GpuTimer {
    /// A timer for the instructions queued on `stream`.
    pub fn new(stream: &Arc<CudaStream>) -> Result<GpuTimer, DeviceError> {
        let ctx = stream.context();
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let event = || ctx.new_event(timing).map_err(driver("creating the profile's GPU events"));
        Ok(GpuTimer { start: event()?, stop: event()?, last: None })
    }

    /// Before an instruction: holds the stream busy, then marks the instruction's start.
    pub fn begin(&mut self, kernels: &CudaKernels, stream: &CudaStream) -> Result<(), RuntimeError> {
        self.last = None;
        kernels.hold_stream(HOLD_CYCLES).map_err(RuntimeError::Kernel)?;
        Ok(self.start.record(stream).map_err(driver("recording the profile's start event"))?)
    }

    /// After the instruction's launches: marks its end, waits for the GPU to reach it, and keeps the
    /// time between the two marks.
    pub fn end(&mut self, stream: &CudaStream) -> Result<(), RuntimeError> {
        self.stop.record(stream).map_err(driver("recording the profile's stop event"))?;
        let ms = self.start.elapsed_ms(&self.stop).map_err(driver("waiting for the profile's events"))?;
        self.last = Some(Duration::from_secs_f64(f64::from(ms.max(0.0)) * 1e-3));
        Ok(())
    }

    /// The GPU time of the instruction timed last, once.
    pub fn take(&mut self) -> Option<Duration> {
        self.last.take()
    }
}
