//! Collectives over NCCL for the CUDA backend: one NCCL communicator per mesh row, per mesh column
//! and for the whole mesh, on a communication stream of its own. Host-staged like the backend: each
//! collective uploads its block, runs in NCCL and downloads the result, polling for completion
//! against the run's timeout so that a peer that stops answering fails the run instead of hanging it.

use crate::plan::{CollectiveKind, Coords, Group, Mesh, ReduceOp};
use crate::runtime::comm::{CommError, Communicator, pack_for_scatter, unpack_gathered};
use crate::shard::layout::Placement;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp as NcclOp};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The bytes of an NCCL unique id, as they travel between processes.
pub type IdBytes = [std::ffi::c_char; 128];

/// A new NCCL unique id (made by one member of a group and shared with the others).
pub fn new_id() -> Result<IdBytes, String> {
    // SAFETY: only tries to load the library.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err("--backend cuda needs NCCL (libnccl.so), which cannot be loaded; see docs/clusters.md".into());
    }
    Id::new().map(|id| *id.internal()).map_err(|e| format!("NCCL could not create a unique id: {e:?}"))
}

/// The unique ids of the groups one device belongs to.
#[derive(Clone, Copy, Debug)]
pub struct GroupIds {
    pub row: IdBytes,
    pub column: IdBytes,
    pub data: IdBytes,
    pub world: IdBytes,
}

/// Ids for every device of a mesh run as threads of this process (device k on GPU k), after checking
/// that there is a GPU for each device.
pub fn ids_for_threads(mesh: Mesh) -> Result<Vec<GroupIds>, String> {
    let gpus = super::probe()? as u64;
    if mesh.devices() > gpus {
        return Err(format!(
            "--backend cuda runs one device per GPU: the {mesh} mesh has {} devices and this machine {gpus} GPUs; \
             run across machines with mpirun or srun (docs/clusters.md)",
            mesh.devices()
        ));
    }
    // One id per group instance, keyed by the rank of the instance's first member.
    let mut by_first = std::collections::BTreeMap::new();
    let mut id_of = |group: Group, coords: Coords| -> Result<IdBytes, String> {
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
                world: id_of(Group::World, c)?,
            })
        })
        .collect()
}

/// One device's NCCL endpoint.
pub struct NcclComm {
    coords: Coords,
    mesh: Mesh,
    stream: Arc<CudaStream>,
    row: Comm,
    column: Comm,
    data: Comm,
    world: Comm,
    timeout: Duration,
}

impl NcclComm {
    /// Joins the row, column, data and mesh communicators of the device at `coords` on GPU `ordinal`. Every member of
    /// a group must call this with the same ids (NCCL's initialisation waits for all of them).
    pub fn new(ordinal: usize, mesh: Mesh, coords: Coords, ids: GroupIds, timeout: Duration) -> Result<Self, String> {
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("cannot open GPU {ordinal}: {e}"))?;
        let stream = ctx.new_stream().map_err(|e| format!("cannot create a communication stream: {e}"))?;
        let join = |id: IdBytes, rank: u64, size: u64, what: &str| {
            Comm::from_rank(Arc::clone(&stream), rank as usize, size as usize, Id::uninit(id))
                .map_err(|e| format!("device {coords} could not join its NCCL {what} communicator: {e:?}"))
        };
        Ok(NcclComm {
            coords,
            mesh,
            row: join(ids.row, coords.j(), mesh.cols, "row")?,
            column: join(ids.column, coords.i(), mesh.rows, "column")?,
            data: join(ids.data, coords.d(), mesh.data, "data")?,
            world: join(ids.world, mesh.rank_of(coords), mesh.devices(), "mesh")?,
            stream,
            timeout,
        })
    }

    /// Device `rank` of a mesh run as threads, on GPU `rank`.
    pub fn for_thread(ids: &[GroupIds], rank: u64, mesh: Mesh, timeout: Duration) -> Result<Self, String> {
        let group_ids = *ids.get(rank as usize).ok_or_else(|| format!("no NCCL ids for device {rank}"))?;
        NcclComm::new(rank as usize, mesh, mesh.coords_of(rank), group_ids, timeout)
    }

    fn group(&self, group: Group) -> &Comm {
        match group {
            Group::Row => &self.row,
            Group::Column => &self.column,
            Group::Data => &self.data,
            Group::World => &self.world,
        }
    }

    fn upload(&self, v: &[f32]) -> Result<CudaSlice<f32>, CommError> {
        self.stream.clone_htod(v).map_err(|e| CommError(format!("copying to the GPU: {e}")))
    }

    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, CommError> {
        self.stream.alloc_zeros::<f32>(n.max(1)).map_err(|e| CommError(format!("allocating on the GPU: {e}")))
    }

    /// Waits for the stream's queued work, at most the timeout; then copies `from` into `to`.
    fn finish(&self, from: &CudaSlice<f32>, to: &mut [f32], what: &dyn Fn() -> String) -> Result<(), CommError> {
        let event = self.stream.record_event(None).map_err(|e| CommError(format!("recording an event: {e}")))?;
        let start = Instant::now();
        loop {
            match event.try_is_complete() {
                Ok(true) => break,
                Ok(false) if start.elapsed() > self.timeout => {
                    return Err(CommError(format!(
                        "{} waited {:.0} s for its peers (--timeout); a peer has failed or stopped",
                        what(),
                        self.timeout.as_secs_f64()
                    )));
                }
                Ok(false) => std::thread::sleep(Duration::from_micros(20)),
                Err(e) => return Err(CommError(format!("{} failed on the GPU: {e}", what()))),
            }
        }
        if to.is_empty() {
            return Ok(());
        }
        let view = from.try_slice(..to.len()).ok_or_else(|| CommError("a received block is too short".into()))?;
        self.stream.memcpy_dtoh(&view, to).map_err(|e| CommError(format!("copying from the GPU: {e}")))
    }
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Max => NcclOp::Max,
    }
}

fn launched<T>(result: Result<T, cudarc::nccl::result::NcclError>, what: &dyn Fn() -> String) -> Result<(), CommError> {
    result.map(|_| ()).map_err(|e| CommError(format!("{} failed in NCCL: {e:?}", what())))
}

impl Communicator for NcclComm {
    fn coords(&self) -> Coords {
        self.coords
    }

    fn mesh(&self) -> Mesh {
        self.mesh
    }

    fn collective(
        &mut self,
        kind: CollectiveKind,
        group: Group,
        root: Option<u64>,
        op: ReduceOp,
        shard: Option<Placement>,
        full: &[u64],
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), CommError> {
        let comm = self.group(group);
        let parts = comm.world_size() as u64;
        let coords = self.coords;
        let what = || format!("device {coords}'s {} over its {} group", kind.name(), group.name());
        let (op, root) = (nccl_op(op), root.unwrap_or(0) as i32);
        match kind {
            CollectiveKind::Broadcast => {
                let mut buffer = if comm.rank() as i32 == root { self.upload(send)? } else { self.zeros(recv.len())? };
                launched(comm.broadcast_in_place(&mut buffer, root), &what)?;
                self.finish(&buffer, recv, &what)
            }
            CollectiveKind::Reduce => {
                let source = self.upload(send)?;
                let mut result = self.zeros(send.len())?;
                launched(comm.reduce(&source, Some(&mut result), &op, root), &what)?;
                let mine = if comm.rank() as i32 == root { recv } else { &mut [][..] };
                self.finish(&result, mine, &what)
            }
            CollectiveKind::AllReduce => {
                let source = self.upload(send)?;
                let mut result = self.zeros(recv.len())?;
                launched(comm.all_reduce(&source, &mut result, &op), &what)?;
                self.finish(&result, recv, &what)
            }
            CollectiveKind::AllGather => {
                let shard = shard.ok_or_else(|| CommError("all-gather without a placement".into()))?;
                let source = self.upload(send)?;
                let mut gathered = self.zeros(send.len() * parts as usize)?;
                launched(comm.all_gather(&source, &mut gathered), &what)?;
                let mut blocks = vec![0.0f32; send.len() * parts as usize];
                self.finish(&gathered, &mut blocks, &what)?;
                unpack_gathered(full, shard, parts, &blocks, recv);
                Ok(())
            }
            CollectiveKind::ReduceScatter => {
                let shard = shard.ok_or_else(|| CommError("reduce-scatter without a placement".into()))?;
                let source = self.upload(&pack_for_scatter(full, shard, parts, send, recv.len()))?;
                let mut result = self.zeros(recv.len())?;
                launched(comm.reduce_scatter(&source, &mut result, &op), &what)?;
                self.finish(&result, recv, &what)
            }
        }
    }

    fn abort(&self, reason: &str) {
        // NCCL communicators are aborted when dropped; peers stuck in a collective fail by timeout.
        let _ = reason;
    }
}
