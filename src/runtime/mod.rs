//! Running plans. A [`Device`] executes the SPMD program on its own buffers and talks to its peers
//! through a [`comm::Communicator`]; backends differ only in where kernels run and how peers talk.
//! The CPU backend (threads in one process) is the reference every other backend is checked against.

pub mod backend;
pub mod comm;
pub mod compare;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fault;
pub mod init;
pub mod launch;
pub mod limits;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod shapes;
pub mod tensor;

use crate::plan::{Buffer, BufferId, Instr, Kernel, Plan, ReduceOp, Role};
use backend::Backend;
use comm::Communicator;
use cpu::kernels::{KernelContext, OptimizerSettings};
use tensor::{Data, Tensor};

/// One device's state: its buffers, the backend that runs its kernels, and its endpoint to the others.
pub struct Device<'p, B: Backend, C: Communicator> {
    pub plan: &'p Plan,
    pub backend: B,
    pub comm: C,
    pub seed: u64,
    buffers: Vec<Option<Tensor>>,
}

impl<'p, B: Backend, C: Communicator> Device<'p, B, C> {
    /// A device with its parameter shards initialised from the seed and zeroed optimizer state.
    pub fn new(plan: &'p Plan, backend: B, comm: C, seed: u64) -> Device<'p, B, C> {
        let (i, j) = comm.coords();
        let mut buffers: Vec<Option<Tensor>> = vec![None; plan.buffers.len()];
        for p in &plan.params {
            let meta = plan.buffer(p.buffer);
            buffers[p.buffer.0 as usize] = Some(init::param_block(p, meta, i, j, plan.mesh, seed));
            for s in &p.state {
                let m = plan.buffer(*s);
                buffers[s.0 as usize] = Some(Tensor::zeros(m.dtype, &m.shape));
            }
        }
        Device { plan, backend, comm, seed, buffers }
    }

    pub fn coords(&self) -> (u64, u64) {
        self.comm.coords()
    }

    /// The current contents of a buffer, if it is alive.
    pub fn read(&self, id: BufferId) -> Option<&Tensor> {
        self.buffers.get(id.0 as usize).and_then(Option::as_ref)
    }

    /// Replaces a buffer's contents (loading inputs or checkpoint shards).
    pub fn write(&mut self, id: BufferId, tensor: Tensor) -> Result<(), String> {
        let meta = self.plan.buffer(id);
        if tensor.shape != meta.shape {
            return Err(format!("buffer `{}` is {:?} on each device, not {:?}", meta.name, meta.shape, tensor.shape));
        }
        self.buffers[id.0 as usize] = Some(tensor);
        Ok(())
    }

    /// Loads each input's block from the logical input tensors (by input name).
    pub fn load_inputs(&mut self, inputs: &std::collections::BTreeMap<String, Tensor>) -> Result<(), String> {
        let (i, j) = self.coords();
        for input in &self.plan.inputs {
            let logical = inputs.get(&input.name).ok_or_else(|| format!("no data for input `{}`", input.name))?;
            let meta = self.plan.buffer(input.buffer);
            let block = init::block_of(logical, meta, i, j, self.plan.mesh)?;
            self.write(input.buffer, block)?;
        }
        Ok(())
    }

    /// Runs the whole program once (one training or inference step).
    pub fn step(&mut self, optimizer: &OptimizerSettings, step: u64) -> Result<(), String> {
        let plan = self.plan;
        for (index, instr) in plan.program.iter().enumerate() {
            let result = match instr {
                Instr::Kernel { kernel: Kernel::OptimizerStep, inputs, .. } => self.optimizer(inputs, optimizer, step),
                Instr::Kernel { kernel, inputs, output, .. } => self.kernel(kernel, inputs, *output),
                Instr::Collective { collective: c, .. } => self.collective(c),
                Instr::Free { buffer } => {
                    if plan.buffer(*buffer).role != Role::Parameter {
                        self.buffers[buffer.0 as usize] = None;
                    }
                    Ok(())
                }
            };
            result.map_err(|e| format!("instruction {index}: {e}"))?;
        }
        Ok(())
    }

    fn take_output(&mut self, id: BufferId) -> Tensor {
        let meta = self.plan.buffer(id);
        self.buffers[id.0 as usize].take().unwrap_or_else(|| Tensor::zeros(meta.dtype, &meta.shape))
    }

    fn kernel(&mut self, kernel: &Kernel, inputs: &[BufferId], output: BufferId) -> Result<(), String> {
        let plan = self.plan;
        let mut out = self.take_output(output);
        let result = {
            let mut refs = Vec::with_capacity(inputs.len());
            for id in inputs {
                let t = self.buffers[id.0 as usize]
                    .as_ref()
                    .ok_or_else(|| format!("buffer `{}` is not alive", plan.buffer(*id).name))?;
                refs.push(t);
            }
            let metas: Vec<&Buffer> = inputs.iter().map(|&b| plan.buffer(b)).collect();
            let (i, j) = self.comm.coords();
            let ctx =
                KernelContext { i, j, mesh: plan.mesh, seed: self.seed, inputs: &metas, output: plan.buffer(output) };
            self.backend.kernel(kernel, &refs, &mut out, &ctx)
        };
        self.buffers[output.0 as usize] = Some(out);
        result
    }

    fn optimizer(&mut self, inputs: &[BufferId], settings: &OptimizerSettings, step: u64) -> Result<(), String> {
        let [p, g, s1, s2] = inputs else { return Err("optimizer step needs (param, grad, state, state)".into()) };
        let missing = || "optimizer buffers are not alive".to_string();
        let mut param = self.buffers[p.0 as usize].take().ok_or_else(missing)?;
        let mut state1 = self.buffers[s1.0 as usize].take().ok_or_else(missing)?;
        let mut state2 = self.buffers[s2.0 as usize].take().ok_or_else(missing)?;
        let result = match self.buffers[g.0 as usize].as_ref() {
            Some(grad) => self.backend.optimizer_step(&mut param, grad, &mut state1, &mut state2, settings, step),
            None => Err(missing()),
        };
        self.buffers[p.0 as usize] = Some(param);
        self.buffers[s1.0 as usize] = Some(state1);
        self.buffers[s2.0 as usize] = Some(state2);
        result
    }

    fn collective(&mut self, c: &crate::plan::Collective) -> Result<(), String> {
        let plan = self.plan;
        let (send_meta, recv_meta) = (plan.buffer(c.send), plan.buffer(c.recv));
        let full = if send_meta.elements() >= recv_meta.elements() { &send_meta.shape } else { &recv_meta.shape };
        let mut recv = self.take_output(c.recv);
        let result = match (self.buffers[c.send.0 as usize].as_ref().map(|t| &t.data), &mut recv.data) {
            (Some(Data::F32(send)), Data::F32(out)) => self
                .comm
                .collective(c.kind, c.group, c.root, c.op.unwrap_or(ReduceOp::Sum), c.shard, full, send, out)
                .map_err(|e| e.0),
            (None, _) => Err(format!("buffer `{}` is not alive", send_meta.name)),
            _ => Err(format!("only floating-point buffers are communicated, not `{}`", send_meta.name)),
        };
        self.buffers[c.recv.0 as usize] = Some(recv);
        result
    }
}
