//! Pipelines across processes: one process per device of every stage (stage-major: stage s's grid
//! is ranks s·D to s·D + D − 1, row-major within it), each stage's grid doing its collectives over a
//! communicator of its own, and the stages passing activations, gradients and the norm's shares as
//! tagged messages. A postman thread per process receives every message as it comes and files it in
//! the process's mailboxes, so a send never waits for its receiver to reach the matching receive (1F1B
//! sends in both directions at once).

use super::{MpiComm, MpiJob, install_panic_hook};
use crate::exec::{Batches, DeviceBlocks, RunConfig, StepRecord, failure_report};
use crate::pipeline::{
    Key, Mailboxes, PipelineOutput, PipelineRun, StageLink, StageMemory, StageWorker, merged_output,
};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use optimus_plan::Plan;
use optimus_plan::tensor::{Data, Tensor};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// The tag of every message between stages (on a communicator of their own).
const STAGE_TAG: i32 = 7;

/// The step number of a device's final blocks (sent to rank 0 to be saved; no run has this many steps).
const FINAL_STEP: u64 = u64::MAX;
/// The micro-batch numbers of a device's final parameters, gradients and outputs.
const FINAL_PARAMS: u64 = 0;
const FINAL_GRADS: u64 = 1;
const FINAL_OUTPUTS: u64 = 2;

/// The numbers each rank reports at the end: its memory's four and the bytes it sent.
const FIELDS: usize = 5;

/// The buffer number of the message saying which of a device's parameters have a gradient.
const GRADIENTS_PRESENT: u32 = u32::MAX;

/// A communicator used by two threads: the device's (sends) and the postman's (receives).
struct SharedComm(SimpleCommunicator);

// SAFETY: a pipeline starts only where MPI provides MPI_THREAD_MULTIPLE (checked by
// `MpiJob::run_pipeline`), under which any thread may call MPI on any communicator at any time; the
// handle is an opaque reference to MPI's own object, which MPI frees only when the job ends.
unsafe impl Send for SharedComm {}
// SAFETY: as above; the Rust side holds no state of its own behind the handle.
unsafe impl Sync for SharedComm {}

/// The messages between stage devices in different processes.
struct MpiLink {
    comm: Arc<SharedComm>,
    inbox: Arc<Mailboxes>,
    /// Devices per stage: the device of rank r in stage s is world rank s·D + r.
    devices: u64,
    world_rank: u64,
    stop: Arc<AtomicBool>,
    postman: Option<JoinHandle<()>>,
    bytes_sent: AtomicU64,
}

impl MpiLink {
    /// Starts the postman on `comm` (a duplicate of the world: stage messages meet nothing else).
    fn start(comm: SimpleCommunicator, devices: u64, timeout: Duration) -> MpiLink {
        let world_rank = comm.rank() as u64;
        let comm = Arc::new(SharedComm(comm));
        let inbox = Arc::new(Mailboxes::new(timeout));
        let stop = Arc::new(AtomicBool::new(false));
        let postman = {
            let (comm, inbox, stop) = (Arc::clone(&comm), Arc::clone(&inbox), Arc::clone(&stop));
            std::thread::spawn(move || file_incoming(&comm.0, &inbox, &stop))
        };
        MpiLink { comm, inbox, devices, world_rank, stop, postman: Some(postman), bytes_sent: AtomicU64::new(0) }
    }

    /// Sends `block` under `key` to the process of world rank `to` (blocking until MPI has taken it,
    /// which the receiver's postman does at once).
    fn send_to(&self, to: u64, key: Key, block: Tensor) {
        self.bytes_sent.fetch_add(4 * block.len() as u64, Ordering::Relaxed);
        if to == self.world_rank {
            self.inbox.deliver(key, block);
            return;
        }
        let message = encode(key, &block);
        self.comm.0.process_at_rank(to as i32).send_with_tag(&message[..], STAGE_TAG);
    }

    /// Stops the postman once nothing more can come to this process.
    fn finish(mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(postman) = self.postman.take() {
            let _ = postman.join();
        }
    }
}

impl StageLink for MpiLink {
    fn send(&self, key: Key, block: Tensor) -> Result<(), String> {
        self.send_to(key.to * self.devices + key.rank, key, block);
        Ok(())
    }

    fn receive(&self, key: Key, what: &dyn Fn() -> String) -> Result<Tensor, String> {
        self.inbox.wait_for(key, what)
    }
}

/// The postman: receives every stage message sent to this process and files it under its key, until
/// told to stop. Polls (a blocking probe would keep it from stopping), yielding at first and then
/// sleeping up to half a millisecond between polls while nothing comes.
fn file_incoming(comm: &SimpleCommunicator, inbox: &Mailboxes, stop: &AtomicBool) {
    let mut idle = 0u32;
    loop {
        if let Some(probed) = comm.any_process().immediate_matched_probe_with_tag(STAGE_TAG) {
            let (bytes, _) = probed.matched_receive_vec::<u8>();
            match decode(&bytes) {
                Ok((key, block)) => inbox.deliver(key, block),
                Err(e) => inbox.fail(&format!("a message between stages could not be read: {e}")),
            }
            idle = 0;
            continue;
        }
        if stop.load(Ordering::Acquire) {
            return;
        }
        idle = idle.saturating_add(1);
        if idle < 200 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50 * u64::from((idle / 200).min(10))));
        }
    }
}

/// A message: the key and the tensor's element type and shape as little-endian u64s, then its elements.
fn encode(key: Key, block: &Tensor) -> Vec<u8> {
    let dtype = match block.data {
        Data::F32(_) => 0u64,
        Data::I32(_) => 1,
    };
    let mut header = vec![
        key.from,
        key.to,
        key.rank,
        key.step,
        key.micro_batch,
        u64::from(key.buffer),
        dtype,
        block.shape.len() as u64,
    ];
    header.extend(&block.shape);
    let mut bytes = Vec::with_capacity(8 * header.len() + 4 * block.len());
    header.iter().for_each(|v| bytes.extend(v.to_le_bytes()));
    match &block.data {
        Data::F32(v) => v.iter().for_each(|x| bytes.extend(x.to_le_bytes())),
        Data::I32(v) => v.iter().for_each(|x| bytes.extend(x.to_le_bytes())),
    }
    bytes
}

/// The key and tensor of a message [`encode`] made.
fn decode(bytes: &[u8]) -> Result<(Key, Tensor), String> {
    let word = |i: usize| -> Result<u64, String> {
        let chunk = bytes.get(8 * i..8 * i + 8).ok_or("the message is shorter than its header")?;
        Ok(u64::from_le_bytes(chunk.try_into().map_err(|_| "a header word is not 8 bytes")?))
    };
    let buffer = u32::try_from(word(5)?).map_err(|_| "the buffer number does not fit 32 bits")?;
    let key = Key { from: word(0)?, to: word(1)?, rank: word(2)?, step: word(3)?, micro_batch: word(4)?, buffer };
    let (dtype, dims) = (word(6)?, word(7)? as usize);
    if dims > 16 {
        return Err(format!("a tensor of {dims} dimensions"));
    }
    let shape: Vec<u64> = (0..dims).map(|d| word(8 + d)).collect::<Result<_, _>>()?;
    let body = &bytes[8 * (8 + dims)..];
    let elements = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).ok_or("the shape overflows")?;
    if body.len() as u64 != 4 * elements {
        return Err(format!("{} bytes of elements for shape {shape:?}", body.len()));
    }
    let words = body.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]);
    let data = match dtype {
        0 => Data::F32(words.map(f32::from_le_bytes).collect()),
        1 => Data::I32(words.map(i32::from_le_bytes).collect()),
        other => return Err(format!("element type {other}")),
    };
    Ok((key, Tensor { shape, data }))
}

/// Where this process sits in a pipeline job.
#[derive(Clone, Copy)]
struct Seat {
    stage: u64,
    /// The device's rank in its stage's grid.
    rank: u64,
}

impl MpiJob {
    /// Runs this rank's device of pipeline `pipe` (stage-major ranks, see the module). Rank 0 (stage 0's
    /// device (0, 0)) calls `on_step` and returns the output, with the whole model's final tensors
    /// when `gather`; other ranks return `None`. A failure on any rank aborts the job.
    #[allow(clippy::too_many_arguments)]
    pub fn run_pipeline(
        &self,
        plan: &Plan,
        pipe: PipelineRun<'_>,
        config: &RunConfig,
        batches: &Batches<'_>,
        initial: &BTreeMap<String, Tensor>,
        gather: bool,
        on_step: &(dyn Fn(&StepRecord) + Sync),
    ) -> Result<Option<PipelineOutput>, String> {
        let (stages, devices) = (pipe.program.stages.len() as u64, plan.mesh.devices());
        self.check_pipeline_job(plan, (pipe, config.accumulation.max(1)))?;
        let seat = Seat { stage: self.rank / devices, rank: self.rank % devices };
        let coords = plan.mesh.coords_of(seat.rank);
        install_panic_hook(format!("rank {} (stage {}, device {coords})", self.rank, seat.stage));
        crate::cpu::return_freed_memory_promptly();
        let stage_world = self
            .world
            .split_by_color_with_key(Color::with_value(seat.stage as i32), seat.rank as i32)
            .ok_or("MPI could not split the world into stages")?;
        let comm =
            MpiComm::new(&stage_world, plan.mesh, coords, config.timeout, self.rank).map_err(|e| e.to_string())?;
        let link = MpiLink::start(self.world.duplicate(), devices, config.timeout);
        let stage = &pipe.program.stages[seat.stage as usize];
        let worker =
            StageWorker { whole: plan, pipe, stage, rank: seat.rank, mail: &link, config, batches, initial, on_step };
        let result = worker
            .run(&comm)
            .unwrap_or_else(|e| self.abort(&format!("stage {} {}", seat.stage, failure_report(coords, &e))));
        let memory = self.gather_memory(stages, result.memory, link.bytes_sent.load(Ordering::Relaxed));
        let blocks = if gather { self.gather_stage_blocks(&link, pipe, seat, result.blocks)? } else { None };
        link.finish();
        let Some((stages_memory, bytes_between_stages)) = memory else { return Ok(None) };
        let run = match blocks {
            Some(per_stage) => merged_output(plan, pipe.program, &per_stage, result.records)?,
            None => crate::exec::RunOutput::of_steps(result.records, Vec::new()),
        };
        let profiles = result.profile.into_iter().collect();
        Ok(Some(PipelineOutput { run, stages: stages_memory, bytes_between_stages, profiles }))
    }

    /// A job of one process per device of every stage, where MPI lets threads share it.
    fn check_pipeline_job(&self, plan: &Plan, (pipe, micro_batches): (PipelineRun<'_>, u64)) -> Result<(), String> {
        let stages = pipe.program.stages.len() as u64;
        let wanted = stages * plan.mesh.devices();
        if self.size != wanted {
            return Err(format!(
                "a pipeline of {stages} stages of the {} mesh ({} devices each) needs {wanted} processes but the \
                 job has {}; start it with -np {wanted}",
                plan.mesh,
                plan.mesh.devices(),
                self.size
            ));
        }
        if self.threading != mpi::Threading::Multiple {
            return Err(format!(
                "this MPI provides {:?} threading, but a pipeline receives on a thread of its own and needs \
                 MPI_THREAD_MULTIPLE",
                self.threading
            ));
        }
        let run = (pipe.program, pipe.schedule, micro_batches);
        super::super::limits::check_pipeline_host_can_run(plan, run, self.ranks_per_node).map_err(|e| e.to_string())
    }

    /// Every stage's memory (that of its device of rank 0) and the bytes all sent, on rank 0 (each rank
    /// sends `FIELDS` numbers).
    fn gather_memory(&self, stages: u64, memory: StageMemory, bytes: u64) -> Option<(Vec<StageMemory>, u64)> {
        let mine =
            [memory.storage_bytes, memory.gradient_sum_bytes, memory.peak_kept_bytes, memory.peak_in_flight, bytes];
        let root = self.world.process_at_rank(0);
        if self.rank != 0 {
            root.gather_into(&mine[..]);
            return None;
        }
        let mut all = vec![0u64; FIELDS * self.size as usize];
        root.gather_into_root(&mine[..], &mut all[..]);
        let devices = self.size / stages.max(1);
        let total = all.chunks_exact(FIELDS).map(|r| r[4]).sum();
        let first_of_each_stage = all.chunks_exact(FIELDS).step_by(devices.max(1) as usize);
        let memory = first_of_each_stage
            .map(|r| StageMemory {
                storage_bytes: r[0],
                gradient_sum_bytes: r[1],
                peak_kept_bytes: r[2],
                peak_in_flight: r[3],
            })
            .collect();
        Some((memory, total))
    }

    /// Every stage device's final blocks on rank 0 (by stage, then rank), sent through the stage link.
    fn gather_stage_blocks(
        &self,
        link: &MpiLink,
        pipe: PipelineRun<'_>,
        seat: Seat,
        (params, grads, outputs): DeviceBlocks,
    ) -> Result<Option<Vec<Vec<DeviceBlocks>>>, String> {
        let key = |micro_batch, buffer: usize| Key {
            from: seat.stage,
            to: 0,
            rank: seat.rank,
            step: FINAL_STEP,
            micro_batch,
            buffer: buffer as u32,
        };
        let present: Vec<i32> = grads.iter().map(|g| i32::from(g.is_some())).collect();
        link.send_to(
            0,
            key(FINAL_GRADS, GRADIENTS_PRESENT as usize),
            Tensor::from_i32(&[present.len() as u64], present),
        );
        params.into_iter().enumerate().for_each(|(j, t)| link.send_to(0, key(FINAL_PARAMS, j), t));
        grads
            .into_iter()
            .enumerate()
            .filter_map(|(j, g)| Some((j, g?)))
            .for_each(|(j, t)| link.send_to(0, key(FINAL_GRADS, j), t));
        outputs.into_iter().enumerate().for_each(|(j, t)| link.send_to(0, key(FINAL_OUTPUTS, j), t));
        if self.rank != 0 {
            return Ok(None);
        }
        let devices = self.size / pipe.program.stages.len().max(1) as u64;
        let mut per_stage = Vec::with_capacity(pipe.program.stages.len());
        for (s, stage) in pipe.program.stages.iter().enumerate() {
            let mut blocks = Vec::with_capacity(devices as usize);
            for rank in 0..devices {
                let from = Seat { stage: s as u64, rank };
                blocks.push(receive_blocks(link, from, &stage.plan)?);
            }
            per_stage.push(blocks);
        }
        Ok(Some(per_stage))
    }
}

/// One stage device's final blocks, as [`MpiJob::gather_stage_blocks`] sent them.
fn receive_blocks(link: &MpiLink, from: Seat, plan: &Plan) -> Result<DeviceBlocks, String> {
    let key = |micro_batch, buffer: usize| Key {
        from: from.stage,
        to: 0,
        rank: from.rank,
        step: FINAL_STEP,
        micro_batch,
        buffer: buffer as u32,
    };
    let what = || format!("the final blocks of stage {} device {}", from.stage, from.rank);
    let present = link.receive(key(FINAL_GRADS, GRADIENTS_PRESENT as usize), &what)?;
    let present = present.i32().map_err(|e| e.to_string())?.to_vec();
    let params = (0..plan.params.len()).map(|j| link.receive(key(FINAL_PARAMS, j), &what)).collect::<Result<_, _>>()?;
    let grads = present
        .iter()
        .enumerate()
        .map(|(j, &has)| if has == 1 { link.receive(key(FINAL_GRADS, j), &what).map(Some) } else { Ok(None) })
        .collect::<Result<_, _>>()?;
    let outputs =
        (0..plan.outputs.len()).map(|j| link.receive(key(FINAL_OUTPUTS, j), &what)).collect::<Result<_, _>>()?;
    Ok((params, grads, outputs))
}
