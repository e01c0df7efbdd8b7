//! Collectives over NCCL for the CUDA backend, on device buffers: one NCCL communicator per mesh row,
//! per mesh column, per data-parallel group and for the whole mesh, on a communication stream of the
//! device's own. A collective is ordered after the kernels that wrote its send buffer by an event, runs
//! on the communication stream (bf16 buffers as `ncclBfloat16`), and the device's stream waits for it by
//! another event; nothing goes through the host. All-gathers and reduce-scatters exchange member-major
//! blocks, packed and unpacked on the GPU by the kernels of `collectives.cu`.

use super::DeviceCollectives;
use super::error::{DeviceError, driver};
use super::kernels::{CudaKernels, DeviceBuf};
use crate::comm::{BlockGeometry, CollectiveSpec, CommError};
use crate::error::RuntimeError;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};
use cudarc::nccl::{Id, sys};
use optimus_plan::{CollectiveKind, Coords, Group, Mesh, ReduceOp};
use std::ffi::c_void;
use std::sync::Arc;

/// The bytes of an NCCL unique id, as they travel between processes.
pub type IdBytes = [std::ffi::c_char; 128];

/// A new NCCL unique id (made by one member of a group and shared with the others).
pub fn new_id() -> Result<IdBytes, DeviceError> {
    // SAFETY: only tries to load the library.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(DeviceError::Unavailable(
            "--backend cuda needs NCCL (libnccl.so), which cannot be loaded; see docs/clusters.md",
        ));
    }
    Id::new().map(|id| *id.internal()).map_err(DeviceError::NcclId)
}

/// The unique ids of the groups one device belongs to.
#[derive(Clone, Copy, Debug)]
pub struct GroupIds {
    pub row: IdBytes,
    pub column: IdBytes,
    pub data: IdBytes,
    pub depth: IdBytes,
    pub world: IdBytes,
}

/// Ids for every device of a mesh run as threads of this process (device k on GPU k), after checking
/// that there is a GPU for each device.
pub fn ids_for_threads(mesh: Mesh) -> Result<Vec<GroupIds>, DeviceError> {
    let gpus = super::probe()? as u64;
    if mesh.devices() > gpus {
        return Err(DeviceError::TooFewGpus { mesh, gpus });
    }
    // One id per group instance, keyed by the rank of the instance's first member.
    let mut by_first = std::collections::BTreeMap::new();
    let mut id_of = |group: Group, coords: Coords| -> Result<IdBytes, DeviceError> {
        let first = group.member_ranks(coords, mesh).first().copied().unwrap_or(0);
        if let Some(id) = by_first.get(&(group, first)) {
            return Ok(*id);
        }
        let id = new_id()?;
        by_first.insert((group, first), id);
        Ok(id)
    };
    mesh.all_coords()
        .map(|c| {
            Ok(GroupIds {
                row: id_of(Group::Row, c)?,
                column: id_of(Group::Column, c)?,
                data: id_of(Group::Data, c)?,
                depth: id_of(Group::Depth, c)?,
                world: id_of(Group::World, c)?,
            })
        })
        .collect()
}

/// One NCCL communicator, aborted when dropped (a peer that failed may never finish it).
struct RawComm(sys::ncclComm_t);

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: the communicator was initialised by `join` and is dropped once.
        let _ = unsafe { cudarc::nccl::result::comm_abort(self.0) };
    }
}

/// Joins group `id` as member `rank` of `size` (NCCL waits for every member to join).
fn join(id: IdBytes, rank: u64, size: u64) -> Result<RawComm, DeviceError> {
    let mut comm = std::mem::MaybeUninit::uninit();
    let (size, rank) =
        (i32::try_from(size).map_err(DeviceError::OutOfRange)?, i32::try_from(rank).map_err(DeviceError::OutOfRange)?);
    // SAFETY: `comm` is written by NCCL before it is read; the id is the group's 128 bytes.
    unsafe { cudarc::nccl::result::comm_init_rank(comm.as_mut_ptr(), size, sys::ncclUniqueId { internal: id }, rank) }
        .map_err(DeviceError::Nccl)?;
    // SAFETY: initialised by the successful call above.
    Ok(RawComm(unsafe { comm.assume_init() }))
}

/// One device's NCCL endpoint: its communicators, its communication stream, and the scratch for
/// member-major blocks.
pub struct NcclDevice {
    coords: Coords,
    mesh: Mesh,
    comm_stream: Arc<CudaStream>,
    row: RawComm,
    column: RawComm,
    data: RawComm,
    depth: RawComm,
    world: RawComm,
    /// Recorded on the device's stream before a collective, and on the communication stream after it.
    before: CudaEvent,
    after: CudaEvent,
    scratch: Option<CudaSlice<u8>>,
}

// SAFETY: NCCL communicators may be used from any thread, one at a time (the endpoint is owned by one
// device thread).
unsafe impl Send for NcclDevice {}

impl NcclDevice {
    /// Joins the row, column, data, depth and mesh communicators of the device at `coords`, whose kernels run on
    /// `stream`. Every member of a group must call this with the same ids (NCCL's initialisation waits
    /// for all of them).
    pub fn new(stream: &Arc<CudaStream>, mesh: Mesh, coords: Coords, ids: GroupIds) -> Result<Self, DeviceError> {
        let ctx = stream.context();
        ctx.bind_to_thread().map_err(driver("cannot bind the GPU"))?;
        let comm_stream = ctx.new_stream().map_err(driver("cannot create a communication stream"))?;
        let event = || {
            ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(driver("cannot create a CUDA event"))
        };
        let joined = |id: IdBytes, rank: u64, size: u64, group: &'static str| {
            join(id, rank, size).map_err(|e| DeviceError::NcclJoin { coords, group, error: Box::new(e) })
        };
        Ok(NcclDevice {
            coords,
            mesh,
            row: joined(ids.row, coords.j(), mesh.cols, "row")?,
            column: joined(ids.column, coords.i(), mesh.rows, "column")?,
            data: joined(ids.data, coords.d(), mesh.data, "data")?,
            depth: joined(ids.depth, coords.k(), mesh.depth, "depth")?,
            world: joined(ids.world, mesh.rank_of(coords), mesh.devices(), "mesh")?,
            before: event()?,
            after: event()?,
            comm_stream,
            scratch: None,
        })
    }

    fn group(&self, group: Group) -> sys::ncclComm_t {
        match group {
            Group::Row => self.row.0,
            Group::Column => self.column.0,
            Group::Data => self.data.0,
            Group::Depth => self.depth.0,
            // A transpose's pair meets on the whole mesh's communicator, whose ranks are the mesh's.
            Group::World | Group::Mirror => self.world.0,
        }
    }

    /// Scratch of at least `bytes` (grown as needed), ordered on the device's stream.
    fn scratch(&mut self, stream: &Arc<CudaStream>, bytes: usize) -> Result<u64, DeviceError> {
        let scratch = match self.scratch.take().filter(|s| s.len() >= bytes) {
            Some(scratch) => scratch,
            None => stream.alloc_zeros::<u8>(bytes.max(1)).map_err(driver("allocating on the GPU"))?,
        };
        let at = scratch.device_ptr(stream).0;
        self.scratch = Some(scratch);
        Ok(at)
    }

    /// Queues one NCCL call on the communication stream.
    fn call(
        &self,
        spec: &CollectiveSpec<'_>,
        send: DeviceBuf,
        recv: DeviceBuf,
        (scratch, n): (u64, usize),
    ) -> Result<(), DeviceError> {
        let comm = self.group(spec.group);
        let s = self.comm_stream.cu_stream() as sys::cudaStream_t;
        let dtype = if send.bf16 { sys::ncclDataType_t::ncclBfloat16 } else { sys::ncclDataType_t::ncclFloat32 };
        let op = match spec.op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        };
        let root = i32::try_from(spec.root.unwrap_or(0)).map_err(DeviceError::OutOfRange)?;
        let (sp, rp, kp) = (send.ptr as *const c_void, recv.ptr as *mut c_void, scratch as *mut c_void);
        use cudarc::nccl::result as nccl;
        // SAFETY: the buffers are live device allocations of this GPU holding the counts given (checked
        // by the caller), ordered on the communication stream after the kernels that wrote them.
        let called = unsafe {
            match spec.kind {
                CollectiveKind::Broadcast => nccl::broadcast(sp, rp, recv.len, dtype, root, comm, s),
                CollectiveKind::Reduce => nccl::reduce(sp, rp, send.len, dtype, op, root, comm, s),
                CollectiveKind::AllReduce => nccl::all_reduce(sp, rp, recv.len, dtype, op, comm, s),
                CollectiveKind::AllGather => nccl::all_gather(sp, kp, send.len, dtype, comm, s),
                CollectiveKind::ReduceScatter => nccl::reduce_scatter(kp as *const c_void, rp, n, dtype, op, comm, s),
                CollectiveKind::Transpose => {
                    let mirror =
                        i32::try_from(self.mesh.rank_of(self.coords.mirrored())).map_err(DeviceError::OutOfRange)?;
                    nccl::group_start()
                        .and_then(|_| nccl::send(sp, send.len, dtype, mirror, comm, s))
                        .and_then(|_| nccl::recv(rp, recv.len, dtype, mirror, comm, s))
                        .and(nccl::group_end())
                }
            }
        };
        called.map(|_| ()).map_err(DeviceError::Nccl)
    }
}

impl DeviceCollectives for NcclDevice {
    fn run(
        &mut self,
        kernels: &CudaKernels,
        spec: &CollectiveSpec<'_>,
        send: DeviceBuf,
        recv: DeviceBuf,
    ) -> Result<bool, RuntimeError> {
        if send.bf16 != recv.bf16 {
            return Ok(false);
        }
        let coords = self.coords;
        let what = |e: &dyn std::fmt::Display| {
            RuntimeError::Comm(CommError::Transport(format!(
                "device {coords}'s {} over its {} group failed in NCCL: {e}",
                spec.kind.name(),
                spec.group.name()
            )))
        };
        let parts = self.mesh.group_size(spec.group);
        let stream = kernels.stream();
        let geometry = || {
            let shard = spec.shard.ok_or_else(|| what(&"a collective without a placement"))?;
            BlockGeometry::of(spec.full, shard, parts).ok_or_else(|| what(&"a placement that is not a split"))
        };
        let equal = |sent: usize, expected: usize| {
            (sent == expected).then_some(()).ok_or_else(|| what(&CommError::SizeMismatch { sent, expected }))
        };
        if spec.kind == CollectiveKind::Transpose && self.coords.mirrored() == self.coords {
            // On the diagonal a device is its own mirror: its block stays.
            equal(send.len, recv.len)?;
            kernels.copy_buffer(send, recv).map_err(|e| what(&e))?;
            return Ok(true);
        }
        let scratch = match spec.kind {
            CollectiveKind::AllReduce | CollectiveKind::Broadcast | CollectiveKind::Transpose => {
                equal(send.len, recv.len)?;
                (0, 0)
            }
            CollectiveKind::Reduce => (0, 0),
            CollectiveKind::AllGather => {
                let g = geometry()?;
                equal(send.len, g.block_len() as usize)?;
                (self.scratch(stream, send.bytes() * parts as usize).map_err(|e| what(&e))?, 0)
            }
            CollectiveKind::ReduceScatter => {
                let g = geometry()?;
                equal(recv.len, g.block_len() as usize)?;
                let at = self.scratch(stream, recv.bytes() * parts as usize).map_err(|e| what(&e))?;
                let packed = DeviceBuf { ptr: at, len: recv.len * parts as usize, bf16: send.bf16 };
                kernels.pack_members(send, packed, &g, parts).map_err(|e| what(&e))?;
                (at, recv.len)
            }
        };
        let order = |e| what(&driver("ordering the streams")(e));
        self.before.record(stream).map_err(order)?;
        self.comm_stream.wait(&self.before).map_err(order)?;
        self.call(spec, send, recv, scratch).map_err(|e| what(&e))?;
        self.after.record(&self.comm_stream).map_err(order)?;
        stream.wait(&self.after).map_err(order)?;
        if spec.kind == CollectiveKind::AllGather {
            let g = geometry()?;
            let n = send.len;
            let blocks: Vec<DeviceBuf> = (0..parts as usize)
                .map(|k| DeviceBuf { ptr: scratch.0 + (k * n * send.element_bytes()) as u64, len: n, bf16: send.bf16 })
                .collect();
            kernels.gather_members(&blocks, recv, &g).map_err(|e| what(&e))?;
        }
        Ok(true)
    }
}
