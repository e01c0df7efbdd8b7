//! Multi-process runs over MPI: one device per rank, row and column communicators split from the
//! world, every collective non-blocking and polled against the run's timeout, and any failure (an
//! error, a panic, a peer that stops answering) ends the whole job with MPI_Abort and the rank's name.

use super::comm::{
    CollectiveSpec, CommError, Communicator, Elements, ElementsMut, Payload, pack_for_scatter, reduce_into,
    unpack_gathered,
};
use super::exec::{self, Batches, DeviceBlocks, RunConfig, RunOutput, StepRecord};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::request::{Request, Scope};
use mpi::topology::Communicator as _;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use optimus_plan::layout::MESH_AXES;
#[cfg(feature = "cuda")]
use optimus_plan::layout::{COLUMN_AXIS, DATA_AXIS, DEPTH_AXIS, ROW_AXIS};
use optimus_plan::placement::{NodeMap, RankPlacement};
use optimus_plan::tensor::{Data, Tensor};
use optimus_plan::{CollectiveKind, Coords, Group, Mesh, Plan, ReduceOp};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

mod stages;

/// How a multi-process run is laid out and what it hands back.
#[derive(Clone, Copy, Debug)]
pub struct JobOptions {
    /// Which rank runs which device.
    pub placement: RankPlacement,
    /// Whether rank 0 gathers the final parameters, gradients and outputs (to save them); without it,
    /// the output holds the step records only.
    pub gather: bool,
}

/// This process's membership in an MPI job. MPI is initialised once per process, by [`MpiJob::init`],
/// and finalised when the job is dropped.
pub struct MpiJob {
    world: SimpleCommunicator,
    rank: u64,
    size: u64,
    /// Ranks sharing this node's memory (the fewest over all nodes).
    ranks_per_node: u64,
    /// This rank's index among the ranks of its node.
    local_rank: u64,
    /// What MPI lets threads do.
    threading: mpi::Threading,
    // Dropped last: finalises MPI.
    _universe: Universe,
}

impl MpiJob {
    /// Initialises MPI and installs a panic hook that aborts the whole job, so that a panicking rank
    /// never leaves the others waiting.
    pub fn init() -> Result<MpiJob, String> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or("MPI was already initialised in this process")?;
        let world = universe.world();
        let rank = world.rank() as u64;
        install_panic_hook(format!("rank {rank}"));
        let node = world.split_shared(world.rank());
        let local = node.size();
        let mut fewest = 0;
        world.all_reduce_into(&local, &mut fewest, SystemOperation::min());
        Ok(MpiJob {
            size: world.size() as u64,
            rank,
            ranks_per_node: fewest.max(1) as u64,
            local_rank: node.rank() as u64,
            threading,
            world,
            _universe: universe,
        })
    }

    pub fn rank(&self) -> u64 {
        self.rank
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// This rank's index on its node (which GPU it takes).
    pub fn local_rank(&self) -> u64 {
        self.local_rank
    }

    /// How many ranks failed a step that every rank takes, given whether this one did.
    pub fn failures(&self, failed: bool) -> u64 {
        let mine = i32::from(failed);
        let mut total = 0;
        self.world.all_reduce_into(&mine, &mut total, SystemOperation::sum());
        total as u64
    }

    /// Rank 0's answer, given to every rank (`ok` is ignored elsewhere).
    pub fn leader_agrees(&self, ok: bool) -> bool {
        let mut flag = i32::from(ok);
        self.world.process_at_rank(0).broadcast_into(&mut flag);
        flag == 1
    }

    /// Prints the error with this rank's name and ends every process of the job.
    pub fn abort(&self, message: &str) -> ! {
        optimus_plan::text::write_stderr(&format!("error: rank {}: {message}\n", self.rank));
        abort_world(1)
    }

    /// The device each rank runs, and a note when the placement could not be followed.
    pub fn devices(&self, plan: &Plan, placement: RankPlacement) -> (Vec<Coords>, Option<String>) {
        let map = NodeMap::of_plan(plan, self.ranks_per_node, placement);
        (map.devices_by_rank(), map.note)
    }

    /// Runs this rank's device of the plan. Rank 0 (which holds device (0, 0)) calls `on_step` and
    /// returns the output (assembled tensors when `options.gather`); other ranks return `None`. A failure
    /// on any rank aborts the job.
    pub fn run(
        &self,
        plan: &Plan,
        config: &RunConfig,
        batches: &Batches<'_>,
        initial: &BTreeMap<String, Tensor>,
        options: JobOptions,
        on_step: &(dyn Fn(&StepRecord) + Sync),
    ) -> Result<Option<RunOutput>, String> {
        let placement = options.placement;
        super::limits::check_host_can_run(plan, self.ranks_per_node).unwrap_or_else(|e| self.abort(&e.to_string()));
        if self.size != plan.mesh.devices() {
            return Err(format!(
                "the plan's {} mesh has {} devices but the job has {} processes; start it with -np {}",
                plan.mesh,
                plan.mesh.devices(),
                self.size,
                plan.mesh.devices()
            ));
        }
        let (devices, note) = self.devices(plan, placement);
        if let (Some(note), 0) = (note, self.rank) {
            optimus_plan::text::write_stderr(&format!("note: {note}\n"));
        }
        let coords = devices[self.rank as usize];
        install_panic_hook(format!("rank {} (device {coords})", self.rank));
        super::cpu::return_freed_memory_promptly();
        let comm =
            MpiComm::new(&self.world, plan.mesh, coords, config.timeout, self.rank).map_err(|e| e.to_string())?;
        let link = match config.backend {
            #[cfg(feature = "cuda")]
            crate::backend::BackendKind::Cuda => crate::backend::GpuLink::Nccl(Box::new(self.nccl_ids(&comm))),
            _ => crate::backend::GpuLink::Host,
        };
        let slot = crate::backend::DeviceSlot { index: self.local_rank, link };
        let outcome = exec::run_device(plan, &comm, slot, config, batches, initial, on_step);
        let (records, blocks, profile) = match outcome {
            Ok(r) => r,
            Err(e) => self.abort(&format!("device {coords} failed: {e}")),
        };
        // Profiles are not gathered: rank 0 reports its own device's.
        let profiles: Vec<_> = profile.into_iter().collect();
        if !options.gather {
            let steps = if self.rank == 0 { records } else { Vec::new() };
            let empty = RunOutput::of_steps(steps, profiles);
            return Ok((self.rank == 0).then_some(empty));
        }
        let gathered = gather_blocks(&comm.mesh_world, blocks).map_err(|e| e.to_string())?;
        match gathered {
            Some(per_device) => {
                let mut all: Vec<(Vec<StepRecord>, DeviceBlocks)> =
                    per_device.into_iter().map(|b| (Vec::new(), b)).collect();
                if let Some(first) = all.first_mut() {
                    first.0 = records;
                }
                let output = exec::assemble(plan, all)?;
                Ok(Some(RunOutput { profiles, ..output }))
            }
            None => Ok(None),
        }
    }
}

#[cfg(feature = "cuda")]
impl MpiJob {
    /// The NCCL ids of this rank's groups: each group's first member makes the group's id and
    /// broadcasts it over the group's MPI communicator. The backend joins them on its GPU (rank on its
    /// node, modulo the GPUs visible).
    fn nccl_ids(&self, comm: &MpiComm) -> crate::cuda::nccl::GroupIds {
        use crate::cuda::nccl::{GroupIds, IdBytes, new_id};
        let share = |group: &SimpleCommunicator| -> IdBytes {
            let mut id: IdBytes = [0; 128];
            if group.rank() == 0 {
                id = new_id().unwrap_or_else(|e| self.abort(&e.to_string()));
            }
            group.process_at_rank(0).broadcast_into(&mut id[..]);
            id
        };
        GroupIds {
            row: share(&comm.axes[COLUMN_AXIS]),
            column: share(&comm.axes[ROW_AXIS]),
            data: share(&comm.axes[DATA_AXIS]),
            depth: share(&comm.axes[DEPTH_AXIS]),
            world: share(&comm.mesh_world),
        }
    }
}

/// Makes a panic anywhere in this process print its message with `who` and abort the MPI job.
fn install_panic_hook(who: String) {
    std::panic::set_hook(Box::new(move |info| {
        optimus_plan::text::write_stderr(&format!("error: {who} panicked: {info}\n"));
        abort_world(101)
    }));
}

/// Ends every process of the job (MPI_Abort on the world communicator).
fn abort_world(code: i32) -> ! {
    // SAFETY: called only after MPI_Init_thread (MPI_THREAD_MULTIPLE), from any thread.
    unsafe {
        mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, code);
    }
    // MPI_Abort does not return; should an implementation return, end this process anyway.
    std::process::exit(code)
}

/// One rank's endpoint: a communicator for its group along each mesh axis, and the whole mesh.
pub struct MpiComm {
    coords: Coords,
    mesh: Mesh,
    /// Per mesh axis, the communicator of the devices that differ from this one along that axis only,
    /// ranked by their coordinate on it.
    axes: [SimpleCommunicator; MESH_AXES],
    /// The world, reordered so that each device's rank is its mesh rank.
    mesh_world: SimpleCommunicator,
    timeout: Duration,
    world_rank: u64,
}

impl MpiComm {
    fn new(
        world: &SimpleCommunicator,
        mesh: Mesh,
        coords: Coords,
        timeout: Duration,
        world_rank: u64,
    ) -> Result<MpiComm, CommError> {
        let split = |color: u64, key: u64| {
            world
                .split_by_color_with_key(Color::with_value(color as i32), key as i32)
                .ok_or_else(|| CommError::Transport("MPI could not split the world communicator".to_string()))
        };
        // The group along an axis is named by the rank of its first member (coordinate 0 on the axis).
        let along = |axis: usize| {
            let mut first = coords;
            first.0[axis] = 0;
            split(mesh.rank_of(first), coords.0[axis])
        };
        Ok(MpiComm {
            coords,
            mesh,
            axes: [along(0)?, along(1)?, along(2)?, along(3)?],
            mesh_world: split(0, mesh.rank_of(coords))?,
            timeout,
            world_rank,
        })
    }

    fn group(&self, group: Group) -> &SimpleCommunicator {
        match group.axis() {
            Some(axis) => &self.axes[axis],
            None => &self.mesh_world,
        }
    }

    /// Polls a request until it completes; past the timeout the job is aborted (a request cannot be
    /// abandoned while MPI may still write into its buffer).
    fn complete<'a, D: ?Sized, S: Scope<'a>>(&self, mut request: Request<'a, D, S>, what: &dyn Fn() -> String) {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            match request.test() {
                Ok(_) => return,
                Err(pending) => request = pending,
            }
            if start.elapsed() > self.timeout {
                self.abort(&format!(
                    "{} waited {:.0} s for its peers (--timeout); a peer has failed or stopped",
                    what(),
                    self.timeout.as_secs_f64()
                ));
            }
            polls = polls.saturating_add(1);
            if polls < 1000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

/// bf16 elements a member contributes to one round of a reduction: the scratch of a bf16 reduction is
/// a few buffers of this many bf16 elements and a fixed f32 accumulator, whatever the buffer's size.
const BF16_PIECE: usize = 1 << 18;

/// bf16 collectives: the payload is bf16 (`u16` bit patterns, 2 bytes an element). A reduction is a
/// reduce-scatter by all-to-all (member m receives every member's m-th chunk, as bf16) summed by its
/// owner in f32 in member order and rounded once, then all-gathered (or gathered on the root) as bf16:
/// no partial sum is ever rounded, and the result is the thread communicator's, bit for bit.
impl MpiComm {
    /// Sends chunk m of `out` (`parts` chunks of `chunk` elements) to member m; returns every member's
    /// chunk for this member, in member order.
    fn all_to_all(&self, comm: &SimpleCommunicator, out: &[u16], chunk: usize, what: &dyn Fn() -> String) -> Vec<u16> {
        let mut got = vec![0u16; out.len()];
        debug_assert_eq!(out.len(), chunk * comm.size() as usize);
        mpi::request::scope(|s| self.complete(comm.immediate_all_to_all_into(s, out, &mut got[..]), what));
        got
    }

    /// This member's chunk of `piece` (split into `parts` equal chunks, the last padded with zeros)
    /// summed over the group in f32 and rounded once.
    fn reduce_chunk(
        &self,
        comm: &SimpleCommunicator,
        piece: &[u16],
        op: ReduceOp,
        what: &dyn Fn() -> String,
    ) -> Vec<u16> {
        let parts = comm.size() as usize;
        let chunk = piece.len().div_ceil(parts).max(1);
        let mut out = vec![0u16; parts * chunk];
        out[..piece.len()].copy_from_slice(piece);
        let got = self.all_to_all(comm, &out, chunk, what);
        let members: Vec<&[u16]> = got.chunks_exact(chunk).collect();
        let mut mine = vec![0u16; chunk];
        reduce_into(&members, 0, &mut mine, op);
        mine
    }

    /// A bf16 reduction to every member (`root` `None`) or to the root alone, a piece at a time.
    fn reduce_bf16(
        &self,
        comm: &SimpleCommunicator,
        (root, op): (Option<u64>, ReduceOp),
        send: &[u16],
        recv: &mut [u16],
        what: &dyn Fn() -> String,
    ) {
        let parts = comm.size() as usize;
        let me = comm.rank() as u64;
        for start in (0..send.len()).step_by(BF16_PIECE * parts) {
            let piece = &send[start..(start + BF16_PIECE * parts).min(send.len())];
            let mine = self.reduce_chunk(comm, piece, op, what);
            let mut gathered = vec![0u16; mine.len() * parts];
            match root {
                None => mpi::request::scope(|s| {
                    self.complete(comm.immediate_all_gather_into(s, &mine[..], &mut gathered[..]), what)
                }),
                Some(r) if r == me => {
                    let process = comm.process_at_rank(r as i32);
                    mpi::request::scope(|s| {
                        self.complete(process.immediate_gather_into_root(s, &mine[..], &mut gathered[..]), what)
                    })
                }
                Some(r) => {
                    let process = comm.process_at_rank(r as i32);
                    mpi::request::scope(|s| self.complete(process.immediate_gather_into(s, &mine[..]), what));
                    continue;
                }
            }
            recv[start..start + piece.len()].copy_from_slice(&gathered[..piece.len()]);
        }
    }

    /// A bf16 reduce-scatter: member m's block of the packed buffer, a piece at a time, goes to member
    /// m, which sums the pieces in f32 and rounds once.
    fn reduce_scatter_bf16(
        &self,
        comm: &SimpleCommunicator,
        op: ReduceOp,
        packed: &[u16],
        recv: &mut [u16],
        what: &dyn Fn() -> String,
    ) {
        let (parts, block) = (comm.size() as usize, recv.len());
        for start in (0..block).step_by(BF16_PIECE) {
            let len = BF16_PIECE.min(block - start);
            let mut out = vec![0u16; parts * len];
            for (m, dst) in out.chunks_exact_mut(len).enumerate() {
                dst.copy_from_slice(&packed[m * block + start..m * block + start + len]);
            }
            let got = self.all_to_all(comm, &out, len, what);
            let members: Vec<&[u16]> = got.chunks_exact(len).collect();
            reduce_into(&members, 0, &mut recv[start..start + len], op);
        }
    }
}

fn operation(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
    }
}

fn same_len(send: usize, recv: usize) -> Result<(), CommError> {
    if send == recv { Ok(()) } else { Err(CommError::SizeMismatch { sent: send, expected: recv }) }
}

/// How a payload type reduces over MPI: f32 with MPI's own operations; bf16 by an all-to-all whose
/// chunks their owners sum in f32 and round once (see [`MpiComm::reduce_bf16`]).
trait Wire: Payload + Equivalence {
    /// `send` combined over `comm` into `recv` on every member (`root` `None`) or on the root alone.
    fn reduce(
        mpi: &MpiComm,
        comm: &SimpleCommunicator,
        at: (Option<u64>, ReduceOp),
        send: &[Self],
        recv: &mut [Self],
        what: &dyn Fn() -> String,
    );
    /// Member m's block of the member-major `packed`, combined over `comm`, into member m's `recv`.
    fn reduce_scatter(
        mpi: &MpiComm,
        comm: &SimpleCommunicator,
        op: ReduceOp,
        packed: &[Self],
        recv: &mut [Self],
        what: &dyn Fn() -> String,
    );
}

impl Wire for f32 {
    fn reduce(
        mpi: &MpiComm,
        comm: &SimpleCommunicator,
        (root, op): (Option<u64>, ReduceOp),
        send: &[f32],
        recv: &mut [f32],
        what: &dyn Fn() -> String,
    ) {
        let op = operation(op);
        match root {
            None => mpi::request::scope(|s| mpi.complete(comm.immediate_all_reduce_into(s, send, recv, op), what)),
            Some(root) => {
                let process = comm.process_at_rank(root as i32);
                if comm.rank() as u64 == root {
                    mpi::request::scope(|s| mpi.complete(process.immediate_reduce_into_root(s, send, recv, op), what));
                } else {
                    mpi::request::scope(|s| mpi.complete(process.immediate_reduce_into(s, send, op), what));
                }
            }
        }
    }

    fn reduce_scatter(
        mpi: &MpiComm,
        comm: &SimpleCommunicator,
        op: ReduceOp,
        packed: &[f32],
        recv: &mut [f32],
        what: &dyn Fn() -> String,
    ) {
        let op = operation(op);
        mpi::request::scope(|s| mpi.complete(comm.immediate_reduce_scatter_block_into(s, packed, recv, op), what));
    }
}

impl Wire for u16 {
    fn reduce(
        mpi: &MpiComm,
        comm: &SimpleCommunicator,
        at: (Option<u64>, ReduceOp),
        send: &[u16],
        recv: &mut [u16],
        what: &dyn Fn() -> String,
    ) {
        mpi.reduce_bf16(comm, at, send, recv, what);
    }

    fn reduce_scatter(
        mpi: &MpiComm,
        comm: &SimpleCommunicator,
        op: ReduceOp,
        packed: &[u16],
        recv: &mut [u16],
        what: &dyn Fn() -> String,
    ) {
        mpi.reduce_scatter_bf16(comm, op, packed, recv, what);
    }
}

impl MpiComm {
    /// One collective on elements of a wire type (see [`Wire`]).
    fn run<E: Wire>(&self, spec: &CollectiveSpec<'_>, send: &[E], recv: &mut [E]) -> Result<(), CommError> {
        let CollectiveSpec { kind, group, root, op, shard, full } = *spec;
        let comm = self.group(group);
        let (me, parts) = (comm.rank() as u64, comm.size() as u64);
        let coords = self.coords;
        let what = || format!("device {coords}'s {} over its {} group", kind.name(), group.name());
        match kind {
            CollectiveKind::Broadcast => {
                let root = root.unwrap_or(0);
                if me == root {
                    same_len(send.len(), recv.len())?;
                    recv.copy_from_slice(send);
                }
                let process = comm.process_at_rank(root as i32);
                mpi::request::scope(|s| self.complete(process.immediate_broadcast_into(s, recv), &what));
            }
            CollectiveKind::Reduce => {
                let root = root.unwrap_or(0);
                if me == root {
                    same_len(send.len(), recv.len())?;
                }
                E::reduce(self, comm, (Some(root), op), send, recv, &what);
            }
            CollectiveKind::AllReduce => {
                same_len(send.len(), recv.len())?;
                E::reduce(self, comm, (None, op), send, recv, &what);
            }
            CollectiveKind::AllGather => {
                let shard = shard.ok_or(CommError::NoPlacement(kind))?;
                same_len(full.iter().product::<u64>() as usize, recv.len())?;
                let mut blocks = vec![E::default(); send.len() * parts as usize];
                mpi::request::scope(|s| self.complete(comm.immediate_all_gather_into(s, send, &mut blocks[..]), &what));
                unpack_gathered(full, shard, parts, &blocks, recv);
            }
            CollectiveKind::ReduceScatter => {
                let shard = shard.ok_or(CommError::NoPlacement(kind))?;
                same_len(send.len(), recv.len() * parts as usize)?;
                let packed = pack_for_scatter(full, shard, parts, send, recv.len());
                E::reduce_scatter(self, comm, op, &packed, recv, &what);
            }
            CollectiveKind::Transpose => self.exchange_with_mirror(send, recv, &what)?,
        }
        Ok(())
    }

    /// A transpose: this device's block goes to its mirror (j, i) and the mirror's comes back, one
    /// send and one receive on the mesh's communicator (whose ranks are the mesh's); a device on the
    /// diagonal keeps its own.
    fn exchange_with_mirror<E: Wire>(
        &self,
        send: &[E],
        recv: &mut [E],
        what: &dyn Fn() -> String,
    ) -> Result<(), CommError> {
        same_len(send.len(), recv.len())?;
        let mirror = self.mesh.rank_of(self.coords.mirrored());
        if mirror == self.mesh.rank_of(self.coords) {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let peer = self.mesh_world.process_at_rank(mirror as i32);
        mpi::request::scope(|s| {
            let sent = peer.immediate_send(s, send);
            self.complete(peer.immediate_receive_into(s, recv), what);
            self.complete(sent, what);
        });
        Ok(())
    }
}

impl Communicator for &MpiComm {
    fn coords(&self) -> Coords {
        self.coords
    }

    fn mesh(&self) -> Mesh {
        self.mesh
    }

    fn collective<T: Payload>(
        &mut self,
        spec: &CollectiveSpec<'_>,
        send: &[T],
        recv: &mut [T],
    ) -> Result<(), CommError> {
        match (T::elements(send), T::elements_mut(recv)) {
            (Elements::F32(send), ElementsMut::F32(recv)) => self.run(spec, send, recv),
            (Elements::Bf16(send), ElementsMut::Bf16(recv)) => self.run(spec, send, recv),
            _ => Err(CommError::MixedElements),
        }
    }

    fn abort(&self, reason: &str) {
        optimus_plan::text::write_stderr(&format!("error: rank {}: {reason}\n", self.world_rank));
        abort_world(1)
    }
}

/// Gathers every device's final blocks on mesh rank 0, in row-major device order.
fn gather_blocks(
    mesh_world: &SimpleCommunicator,
    blocks: DeviceBlocks,
) -> Result<Option<Vec<DeviceBlocks>>, CommError> {
    let devices = mesh_world.size() as usize;
    let (params, grads, outputs) = blocks;
    let gather_all = |tensors: &[Tensor]| -> Vec<Option<Vec<Tensor>>> {
        tensors.iter().map(|t| gather_tensor(mesh_world, t)).collect()
    };
    let params = gather_all(&params);
    let outputs = gather_all(&outputs);
    let grads: Vec<Option<Option<Vec<Tensor>>>> =
        grads.iter().map(|g| g.as_ref().map(|t| gather_tensor(mesh_world, t))).collect();
    if mesh_world.rank() != 0 {
        return Ok(None);
    }
    let missing = || CommError::Transport("a gathered block is missing on rank 0".to_string());
    let mut per_device: Vec<DeviceBlocks> = (0..devices).map(|_| (Vec::new(), Vec::new(), Vec::new())).collect();
    for p in params {
        for (d, t) in p.ok_or_else(missing)?.into_iter().enumerate() {
            per_device[d].0.push(t);
        }
    }
    for g in grads {
        match g {
            Some(blocks) => {
                for (d, t) in blocks.ok_or_else(missing)?.into_iter().enumerate() {
                    per_device[d].1.push(Some(t));
                }
            }
            None => per_device.iter_mut().for_each(|d| d.1.push(None)),
        }
    }
    for o in outputs {
        for (d, t) in o.ok_or_else(missing)?.into_iter().enumerate() {
            per_device[d].2.push(t);
        }
    }
    Ok(Some(per_device))
}

/// Gathers one buffer's block from every device on mesh rank 0 (`Some` there, `None` elsewhere).
fn gather_tensor(mesh_world: &SimpleCommunicator, t: &Tensor) -> Option<Vec<Tensor>> {
    let devices = mesh_world.size() as usize;
    let root = mesh_world.process_at_rank(0);
    let is_root = mesh_world.rank() == 0;
    let split = |data: Data| -> Vec<Tensor> {
        let n = t.len().max(1);
        match data {
            Data::F32(v) => v.chunks(n).map(|c| Tensor::from_f32(&t.shape, c.to_vec())).collect(),
            Data::I32(v) => v.chunks(n).map(|c| Tensor::from_i32(&t.shape, c.to_vec())).collect(),
        }
    };
    match &t.data {
        Data::F32(v) if is_root => {
            let mut all = vec![0.0f32; v.len() * devices];
            root.gather_into_root(&v[..], &mut all[..]);
            Some(split(Data::F32(all)))
        }
        Data::I32(v) if is_root => {
            let mut all = vec![0i32; v.len() * devices];
            root.gather_into_root(&v[..], &mut all[..]);
            Some(split(Data::I32(all)))
        }
        Data::F32(v) => {
            root.gather_into(&v[..]);
            None
        }
        Data::I32(v) => {
            root.gather_into(&v[..]);
            None
        }
    }
}
