//! Activation recomputation (`compile --recompute`): forward values the backward pass would keep are
//! dropped after the forward pass and computed again, into new buffers, just before the backward
//! instructions of their block first need them.
//!
//! The transform works on the lowered program before frees are inserted. A forward buffer is a
//! candidate when every instruction that writes it is a forward instruction of the same unit (a
//! repeated block instance for `layers`; for `selective`, a cheap kernel), and, for `layers`, when
//! nothing outside the unit reads it: a block's input and output are kept, its insides are not. For
//! each unit whose candidates the backward pass reads, copies of forward instructions (same kernels,
//! collectives, dropout keys and origins) writing new buffers are inserted before the unit's first
//! backward instruction that reads one: for `layers` the block's whole forward, one extra forward per
//! block as activation checkpointing in PyTorch and Megatron-LM does; for `selective` only the cheap
//! kernels that compute what is read. Every backward read of a recomputed buffer then reads the copy;
//! copies of kept values (a block's output) are written and freed unread. Kernels are deterministic and
//! dropout masks are counter-based, so the copies compute bit for bit what the originals did.

use super::Lowerer;
use optimus_plan::{BufferId, Instr, Kernel, Recompute, Role};
use std::collections::{BTreeMap, BTreeSet, HashSet};

/// The buffers an instruction reads (an accumulating kernel reads its output).
fn reads(instr: &Instr) -> Vec<BufferId> {
    match instr {
        Instr::Kernel { kernel, inputs, output, .. } => {
            let mut v = inputs.clone();
            if kernel.reads_its_output() {
                v.push(*output);
            }
            v
        }
        Instr::Collective { collective, .. } => vec![collective.send],
        Instr::Free { .. } => Vec::new(),
        Instr::Wait { send, recv } => vec![*send, *recv],
    }
}

/// The buffer an instruction writes.
fn writes(instr: &Instr) -> Option<BufferId> {
    match instr {
        Instr::Kernel { output, .. } => Some(*output),
        Instr::Collective { collective, .. } => Some(collective.recv),
        Instr::Free { .. } | Instr::Wait { .. } => None,
    }
}

/// Kernels `selective` recomputes: cheap to run again, and their outputs large to keep (attention
/// scores and probabilities, GELU and SiLU outputs, RMSNorm outputs and the SwiGLU product; each reads
/// values the backward pass keeps anyway, such as a norm's input and its all-reduced row statistic).
fn is_cheap(instr: &Instr) -> bool {
    matches!(
        instr,
        Instr::Kernel {
            kernel: Kernel::Gelu { .. }
                | Kernel::Silu
                | Kernel::Mul
                | Kernel::RmsNormApply { .. }
                | Kernel::Softmax
                | Kernel::CausalMask
                | Kernel::Dropout { .. }
                | Kernel::Scale { .. }
                | Kernel::BatchedMatMul,
            ..
        }
    )
}

/// Who writes and reads each buffer, by instruction index (indexed by buffer id).
#[derive(Default)]
struct Uses {
    writers: Vec<Vec<usize>>,
    readers: Vec<Vec<usize>>,
}

impl Uses {
    fn of(program: &[Instr]) -> Uses {
        let mut uses = Uses::default();
        let slot = |table: &mut Vec<Vec<usize>>, b: BufferId| -> usize {
            let i = b.0 as usize;
            if table.len() <= i {
                table.resize_with(i + 1, Vec::new);
            }
            i
        };
        for (k, instr) in program.iter().enumerate() {
            if let Some(b) = writes(instr) {
                let i = slot(&mut uses.writers, b);
                uses.writers[i].push(k);
            }
            for b in reads(instr) {
                let i = slot(&mut uses.readers, b);
                uses.readers[i].push(k);
            }
        }
        uses
    }

    /// The instructions that write `b`, in program order.
    fn writers_of(&self, b: BufferId) -> &[usize] {
        self.writers.get(b.0 as usize).map_or(&[], Vec::as_slice)
    }

    /// The instructions that read `b`, in program order.
    fn readers_of(&self, b: BufferId) -> &[usize] {
        self.readers.get(b.0 as usize).map_or(&[], Vec::as_slice)
    }

    /// Every written buffer with its writers, by buffer id.
    fn written(&self) -> impl Iterator<Item = (BufferId, &[usize])> {
        self.writers.iter().enumerate().filter(|(_, w)| !w.is_empty()).map(|(i, w)| (BufferId(i as u32), w.as_slice()))
    }
}

impl Lowerer<'_> {
    /// The unit an instruction belongs to: the repeated block instance its origin lies in, or (for
    /// `selective`, which needs no block) its own layer scope; `None` outside any block for `layers`.
    /// `units` holds the names of `self.recompute_units`.
    fn unit_of(&self, instr: &Instr, mode: Recompute, units: &HashSet<&str>) -> Option<String> {
        let origin = match instr {
            Instr::Kernel { origin, .. } | Instr::Collective { origin, .. } => *origin,
            Instr::Free { .. } | Instr::Wait { .. } => return None,
        };
        let scope = &self.origins.get(origin as usize)?.scope;
        // The longest unit that is the scope or a prefix of it ending before a `.`.
        let ends = scope.match_indices('.').map(|(i, _)| i).chain(std::iter::once(scope.len()));
        let block = ends.rev().find_map(|end| units.get(&scope[..end]).copied());
        match (block, mode) {
            (Some(b), _) => Some(b.to_string()),
            (None, Recompute::Selective) => Some(scope.clone()),
            (None, _) => None,
        }
    }

    /// Rewrites `self.program` so that the backward pass recomputes what `mode` says instead of keeping
    /// it; `forward_end` is where the backward pass begins (unchanged: copies go after it).
    /// The recomputation a target asks for: the flag's, else `layers` over the blocks the model marks
    /// `checkpoint` (if any); sets the units `layers` recomputes.
    pub(super) fn recompute_mode(&mut self) -> Recompute {
        let (mode, units) = match self.target.memory.recompute {
            Some(Recompute::Layers) => (Recompute::Layers, self.model.repeated_blocks.clone()),
            Some(mode) => (mode, self.model.repeated_blocks.clone()),
            None if !self.model.checkpointed_blocks.is_empty() => {
                (Recompute::Layers, self.model.checkpointed_blocks.clone())
            }
            None => (Recompute::None, Vec::new()),
        };
        self.recompute_units = units;
        mode
    }

    pub(super) fn recompute_for_backward(&mut self, mode: Recompute, forward_end: usize) {
        if mode == Recompute::None || forward_end >= self.program.len() {
            return;
        }
        let program = std::mem::take(&mut self.program);
        let unit_names: HashSet<&str> = self.recompute_units.iter().map(String::as_str).collect();
        let units: Vec<Option<String>> = program.iter().map(|i| self.unit_of(i, mode, &unit_names)).collect();
        let candidates = self.candidates(&program, &units, mode, forward_end);
        let uses = Uses::of(&program);
        // Per unit: the candidates the backward pass reads, and where the first such read is.
        let mut needed: BTreeMap<String, (usize, BTreeSet<BufferId>)> = BTreeMap::new();
        for (&b, unit) in &candidates {
            let backward: Vec<usize> = uses.readers_of(b).iter().copied().filter(|&k| k >= forward_end).collect();
            if let Some(&first) = backward.iter().min() {
                let entry = needed.entry(unit.clone()).or_insert((first, BTreeSet::new()));
                entry.0 = entry.0.min(first);
                entry.1.insert(b);
            }
        }
        let mut insertions: BTreeMap<usize, Vec<Instr>> = BTreeMap::new();
        let mut copies: BTreeMap<BufferId, BufferId> = BTreeMap::new();
        for (unit, (at, wanted)) in needed {
            // `layers` runs the block's whole forward again, as activation checkpointing does (one extra
            // forward per block); `selective` only what the backward pass reads.
            let closure = match mode {
                Recompute::Layers => (0..forward_end).filter(|&k| units[k].as_deref() == Some(unit.as_str())).collect(),
                _ => closure(&program, &uses, &candidates, &wanted),
            };
            // Each unit computes into its own copies; backward reads of a dropped value go to the copy
            // its own unit makes (inserted before any of them).
            let outputs: BTreeSet<BufferId> = closure.iter().filter_map(|&k| writes(&program[k])).collect();
            let local: BTreeMap<BufferId, BufferId> =
                outputs.into_iter().map(|b| (b, self.recomputed_buffer(b))).collect();
            let block: Vec<Instr> =
                closure.iter().map(|&k| self.recomputed_instr(&program[k], &local, &unit)).collect();
            insertions.entry(at).or_default().extend(block);
            copies.extend(local.into_iter().filter(|(b, _)| candidates.get(b) == Some(&unit)));
        }
        self.program = splice(program, forward_end, insertions, &copies);
    }

    /// Forward buffers that may be dropped and recomputed, with their unit.
    fn candidates(
        &self,
        program: &[Instr],
        units: &[Option<String>],
        mode: Recompute,
        forward_end: usize,
    ) -> BTreeMap<BufferId, String> {
        let uses = Uses::of(program);
        let kept: BTreeSet<BufferId> = self
            .outputs
            .iter()
            .map(|o| o.buffer)
            .chain(self.grad_norm)
            .chain(self.plan_params.iter().map(|p| p.buffer))
            .collect();
        let mut out = BTreeMap::new();
        for (b, writers) in uses.written() {
            let role = self.buffers[b.0 as usize].role;
            if kept.contains(&b) || !matches!(role, Role::Activation | Role::Workspace) {
                continue;
            }
            let Some(unit) = units[writers[0]].clone() else { continue };
            let in_unit = |k: &usize| units[*k].as_deref() == Some(unit.as_str());
            if !writers.iter().all(|&k| k < forward_end && in_unit(&k)) {
                continue;
            }
            let eligible = match mode {
                Recompute::Layers => uses.readers_of(b).iter().all(in_unit),
                Recompute::Selective => writers.iter().all(|&k| is_cheap(&program[k])),
                Recompute::None => false,
            };
            if eligible {
                out.insert(b, unit);
            }
        }
        out
    }

    /// A new buffer for the recomputed value of `b`: same block, a backward-pass temporary.
    fn recomputed_buffer(&mut self, b: BufferId) -> BufferId {
        let meta = self.buffers[b.0 as usize].clone();
        let id = BufferId(u32::try_from(self.buffers.len()).unwrap_or(u32::MAX));
        self.buffers.push(optimus_plan::Buffer {
            id,
            name: format!("{} (recomputed)", meta.name),
            role: Role::Workspace,
            ..meta
        });
        id
    }

    /// The reason of the recomputed copy of an instruction whose reason is `original`: the same kind, and
    /// text that says which block it recomputes.
    fn recomputed_reason(&mut self, original: u32, unit: &str) -> u32 {
        match self.reasons.get(original as usize) {
            Some(reason) => self.reason(reason.recomputed(unit)),
            None => original,
        }
    }

    /// A copy of a forward instruction that writes (and reads) the recomputed buffers.
    fn recomputed_instr(&mut self, instr: &Instr, copies: &BTreeMap<BufferId, BufferId>, unit: &str) -> Instr {
        let swap = |b: &BufferId| copies.get(b).copied().unwrap_or(*b);
        match instr {
            Instr::Kernel { kernel, inputs, output, origin, reason } => {
                let reason = self.recomputed_reason(*reason, unit);
                Instr::Kernel {
                    kernel: kernel.clone(),
                    inputs: inputs.iter().map(swap).collect(),
                    output: swap(output),
                    origin: *origin,
                    reason,
                }
            }
            Instr::Collective { collective, origin, reason } => {
                let reason = self.recomputed_reason(*reason, unit);
                let mut c = collective.clone();
                c.send = swap(&c.send);
                c.recv = swap(&c.recv);
                Instr::Collective { collective: c, origin: *origin, reason }
            }
            Instr::Free { buffer } => Instr::Free { buffer: swap(buffer) },
            Instr::Wait { send, recv } => Instr::Wait { send: swap(send), recv: swap(recv) },
        }
    }
}

/// The forward instructions (in program order) that compute `wanted` from kept values: the writers of
/// each wanted buffer, and of every candidate they read, transitively.
fn closure(
    program: &[Instr],
    uses: &Uses,
    candidates: &BTreeMap<BufferId, String>,
    wanted: &BTreeSet<BufferId>,
) -> BTreeSet<usize> {
    let mut instrs = BTreeSet::new();
    let mut seen: BTreeSet<BufferId> = BTreeSet::new();
    let mut stack: Vec<BufferId> = wanted.iter().copied().collect();
    while let Some(b) = stack.pop() {
        if !seen.insert(b) {
            continue;
        }
        for &k in uses.writers_of(b) {
            if instrs.insert(k) {
                stack.extend(reads(&program[k]).into_iter().filter(|r| candidates.contains_key(r)));
            }
        }
    }
    instrs
}

/// The program with each block of copies inserted before its instruction, and every backward read of a
/// recomputed buffer reading the copy.
fn splice(
    program: Vec<Instr>,
    forward_end: usize,
    mut insertions: BTreeMap<usize, Vec<Instr>>,
    copies: &BTreeMap<BufferId, BufferId>,
) -> Vec<Instr> {
    let swap = |b: &mut BufferId| {
        if let Some(c) = copies.get(b) {
            *b = *c;
        }
    };
    let mut out = Vec::with_capacity(program.len() + insertions.values().map(Vec::len).sum::<usize>());
    for (k, mut instr) in program.into_iter().enumerate() {
        if let Some(block) = insertions.remove(&k) {
            out.extend(block);
        }
        if k >= forward_end {
            match &mut instr {
                Instr::Kernel { inputs, output, kernel, .. } => {
                    inputs.iter_mut().for_each(swap);
                    if kernel.reads_its_output() {
                        swap(output);
                    }
                }
                Instr::Collective { collective, .. } => swap(&mut collective.send),
                Instr::Wait { send, recv } => {
                    swap(send);
                    swap(recv);
                }
                Instr::Free { .. } => {}
            }
        }
        out.push(instr);
    }
    out
}
