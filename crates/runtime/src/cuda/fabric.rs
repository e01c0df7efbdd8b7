//! Collectives between mesh devices that share one GPU (one process, a thread and a stream each), on
//! device pointers: no host copy and no wait for the GPU.
//!
//! Every device of a group records an event on its stream once its send buffer is written, and the
//! members share (send buffer, event) through the thread fabric's meeting point ([`Fabric::meet`]).
//! Each member's stream then waits for the events of the peers it reads, and the member combines their
//! buffers in place into its own receive buffer with the kernels of `collectives.cu` (reductions in f32
//! in member order, rounded once, as the host communicators do). A second meeting shares an event that
//! marks each member's reads done; a member whose send buffer others read makes its stream wait for
//! those before any later kernel may overwrite it. The host threads only meet; the GPU streams run on.
//!
//! An event of a device is re-recorded only in its next collective on the same group, which no peer
//! enters before it has queued its waits on the previous recording, so every wait sees the recording
//! it was meant for. Events are owned by the [`SharedGpu`] of the whole run, so none is destroyed while
//! a peer may still queue a wait on it.

use super::DeviceCollectives;
use super::error::{DeviceError, driver};
use super::kernels::{CudaKernels, DeviceBuf, MAX_MEMBERS};
use crate::comm::{BlockGeometry, CollectiveSpec, CommError};
use crate::cpu::threads::Fabric;
use crate::error::RuntimeError;
use cudarc::driver::sys::{CUevent, CUevent_flags};
use cudarc::driver::{CudaEvent, CudaStream};
use optimus_plan::{CollectiveKind, Coords, Group, Mesh, ReduceOp};
use std::sync::{Arc, Mutex};

/// What the devices of one run on one GPU share: the thread fabric they meet through, and every
/// device's events (kept until the run ends).
pub struct SharedGpu {
    host: Arc<Fabric>,
    events: Mutex<Vec<CudaEvent>>,
}

impl SharedGpu {
    pub fn new(host: Arc<Fabric>) -> Arc<SharedGpu> {
        host.spin_before_sleeping();
        Arc::new(SharedGpu { host, events: Mutex::new(Vec::new()) })
    }

    /// A new event on `stream`'s context, owned by the run (no timing: only ordering).
    fn event(&self, stream: &Arc<CudaStream>) -> Result<CUevent, DeviceError> {
        let event = stream
            .context()
            .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(driver("cannot create a CUDA event"))?;
        let raw = event.cu_event();
        let poisoned = |_| DeviceError::Poisoned("a device failed while holding the event list");
        self.events.lock().map_err(poisoned)?.push(event);
        Ok(raw)
    }
}

/// A CUDA event handle as it travels between device threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct EventHandle(usize);

impl EventHandle {
    fn of(e: CUevent) -> EventHandle {
        EventHandle(e as usize)
    }

    fn raw(self) -> CUevent {
        self.0 as CUevent
    }
}

/// What a member shares before a collective: its send buffer and the event after which it is ready.
#[derive(Clone, Copy, Debug)]
struct Offer {
    send: DeviceBuf,
    ready: EventHandle,
}

/// One device's endpoint on a [`SharedGpu`].
pub struct SharedGpuEndpoint {
    gpu: Arc<SharedGpu>,
    coords: Coords,
    mesh: Mesh,
    /// Per group (in the order of `group_slot`): the event after which this device's send buffer is ready, and the one
    /// after which its reads of the peers' buffers are done.
    ready: [EventHandle; GROUP_SLOTS],
    done: [EventHandle; GROUP_SLOTS],
}

// SAFETY: the raw events are handles of the run's own context, used only through the driver API,
// which is thread-safe; the `SharedGpu` owns and outlives them.
unsafe impl Send for SharedGpuEndpoint {}

impl SharedGpuEndpoint {
    /// The endpoint of the device at `coords`, whose kernels run on `stream`.
    pub fn new(gpu: Arc<SharedGpu>, mesh: Mesh, coords: Coords, stream: &Arc<CudaStream>) -> Result<Self, DeviceError> {
        let make = || gpu.event(stream).map(EventHandle::of);
        let ready = [make()?, make()?, make()?, make()?, make()?, make()?];
        let done = [make()?, make()?, make()?, make()?, make()?, make()?];
        Ok(SharedGpuEndpoint { gpu, coords, mesh, ready, done })
    }

    fn meet<D: Copy>(&self, group: Group, mine: D) -> Result<Vec<D>, RuntimeError> {
        let shared =
            self.gpu.host.meet(group, self.coords, &mine, |parts| parts.iter().map(|p| p.first().copied()).collect());
        let shared: Option<Vec<D>> = shared.map_err(RuntimeError::Comm)?;
        shared
            .ok_or_else(|| RuntimeError::Comm(CommError::Transport("a member shared nothing for a collective".into())))
    }
}

fn record(event: EventHandle, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
    stream.context().bind_to_thread().map_err(gpu_error("binding the CUDA context"))?;
    // SAFETY: the event and the stream belong to the bound context, and the event outlives the call.
    unsafe { cudarc::driver::result::event::record(event.raw(), stream.cu_stream()) }
        .map_err(gpu_error("recording a CUDA event"))
}

fn wait(stream: &Arc<CudaStream>, event: EventHandle) -> Result<(), RuntimeError> {
    // SAFETY: as for `record`; the event was recorded before it was shared.
    unsafe {
        cudarc::driver::result::stream::wait_event(
            stream.cu_stream(),
            event.raw(),
            cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .map_err(gpu_error("ordering a stream after a CUDA event"))
}

fn gpu_error(what: &str) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::Comm(CommError::Transport(format!("{what}: {e}")))
}

/// The index of a group's event pair (see `SharedGpuEndpoint::ready`).
fn group_slot(group: Group) -> usize {
    match group {
        Group::Row => 0,
        Group::Column => 1,
        Group::Data => 2,
        Group::Depth => 3,
        Group::World => 4,
        Group::Mirror => 5,
    }
}

/// How many kinds of group a device belongs to (see `group_slot`).
const GROUP_SLOTS: usize = 6;

/// Which members' send buffers member `reader` reads.
fn reads(kind: CollectiveKind, root: u64, reader: u64, member: u64) -> bool {
    match kind {
        CollectiveKind::Broadcast => member == root,
        CollectiveKind::Reduce => reader == root,
        _ => true,
    }
}

impl DeviceCollectives for SharedGpuEndpoint {
    fn run(
        &mut self,
        kernels: &CudaKernels,
        spec: &CollectiveSpec<'_>,
        send: DeviceBuf,
        recv: DeviceBuf,
    ) -> Result<bool, RuntimeError> {
        let size = self.mesh.group_size_at(spec.group, self.coords);
        if size as usize > MAX_MEMBERS {
            return Ok(false);
        }
        let stream = kernels.stream();
        let slot = group_slot(spec.group);
        let me = spec.group.member_index(self.coords, self.mesh);
        let root = spec.root.unwrap_or(0);
        record(self.ready[slot], stream)?;
        let offers = self.meet(spec.group, Offer { send, ready: self.ready[slot] })?;
        for (k, offer) in offers.iter().enumerate() {
            if k as u64 != me && reads(spec.kind, root, me, k as u64) {
                wait(stream, offer.ready)?;
            }
        }
        let sends: Vec<DeviceBuf> = offers.iter().map(|o| o.send).collect();
        let combined = combine_on_gpu(kernels, spec, me, &sends, recv).map_err(RuntimeError::Comm);
        // Meet again even when combining failed, so that no peer waits for this device until timeout.
        record(self.done[slot], stream)?;
        let done = self.meet(spec.group, self.done[slot])?;
        combined?;
        for (k, &event) in done.iter().enumerate() {
            if k as u64 != me && reads(spec.kind, root, k as u64, me) {
                wait(stream, event)?;
            }
        }
        Ok(true)
    }
}

/// This member's result of the collective from the members' send buffers (`sends`, in member order),
/// queued on the member's stream.
fn combine_on_gpu(
    kernels: &CudaKernels,
    spec: &CollectiveSpec<'_>,
    me: u64,
    sends: &[DeviceBuf],
    recv: DeviceBuf,
) -> Result<(), CommError> {
    let max = spec.op == ReduceOp::Max;
    let geometry = || {
        let shard = spec.shard.ok_or(CommError::NoPlacement(spec.kind))?;
        BlockGeometry::of(spec.full, shard, sends.len() as u64)
            .ok_or_else(|| CommError::Transport(format!("{} over a placement that is not a split", spec.kind.name())))
    };
    let launched = match spec.kind {
        CollectiveKind::Broadcast => {
            let root = sends.get(spec.root.unwrap_or(0) as usize);
            let src = root.ok_or_else(|| CommError::Transport("a broadcast from no such root".into()))?;
            kernels.copy_buffer(*src, recv)
        }
        CollectiveKind::Reduce if spec.root.unwrap_or(0) != me => Ok(()),
        CollectiveKind::Reduce | CollectiveKind::AllReduce => kernels.reduce_members(sends, recv, max, None),
        CollectiveKind::AllGather => kernels.gather_members(sends, recv, &geometry()?),
        CollectiveKind::ReduceScatter => kernels.reduce_members(sends, recv, max, Some((geometry()?, me))),
        CollectiveKind::Transpose => {
            // The mirror's block, or this device's own on the diagonal (alone in its group).
            let mirror = sends.len().checked_sub(1 + me as usize).and_then(|m| sends.get(m));
            let src = mirror.ok_or_else(|| CommError::Transport("a transpose without its mirror's block".into()))?;
            kernels.copy_buffer(*src, recv)
        }
    };
    launched.map_err(|e| CommError::Transport(e.to_string()))
}
