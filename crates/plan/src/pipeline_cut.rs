//! A training plan cut into pipeline stages, each with a program of its own.
//!
//! The plan is the whole model compiled for one stage's grid (its mesh and replicas). Its pieces
//! ([`crate::stages`]) are grouped into `stages x chunks` contiguous virtual stages (virtual stage
//! `v = chunk * stages + stage`); stage `s` runs the instructions of its virtual stages and nothing
//! else. Each stage's program is the whole plan's, cut to those instructions and in the same order,
//! so a stage's storage is laid out for what it runs alone, and its forward and backward passes are
//! the same arithmetic as the unpipelined plan's, instruction for instruction.
//!
//! What one stage computes and another reads travels point to point, between the devices at the same
//! mesh coordinates of the two stages (their blocks have the same layout): a [`Action::Send`] right
//! after the instruction that last writes the buffer, a [`Action::Receive`] right before the first
//! instruction of the reading stage's pass that reads it. The activations at a cut go forward and
//! their gradients back; a tied weight's gradient term goes from the head's stage to the embedding's.
//!
//! A parameter lives on every stage whose instructions read it (a tied embedding and LM head: the first
//! and the last), with its optimizer state; its gradient is summed over the micro-batches on the
//! stage that computes it and sent, once an update, to the other stages that hold a copy, so that
//! every copy takes the same step. The gradient norm's sum of squares counts each gradient on the
//! stage that computes it; the stages' sums are then added (the runtime does that, before the first
//! optimizer step).

use crate::memory::persistent;
use crate::stages::{InstructionPieces, ParameterOwners, describe_pieces, even_split, instruction_pieces, layer_of};
use crate::{BufferId, Instr, Kernel, Plan, Role};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::ops::Range;

/// One step of a stage's pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Run instruction `k` of the stage's plan.
    Run(usize),
    /// Write `buffer` with the block stage `from` sends for it (for the same micro-batch).
    Receive { buffer: BufferId, from: u64 },
    /// Send `buffer`'s block to stage `to`.
    Send { buffer: BufferId, to: u64 },
}

/// One stage's program and how it talks to the others.
#[derive(Clone, Debug)]
pub struct StageProgram {
    pub stage: u64,
    /// The whole plan cut to this stage: its instructions, parameters, inputs and outputs. Buffers the
    /// stage never touches keep their ids but get no storage (persistent ones are given the workspace
    /// role, which is laid out only where an instruction touches it). Its `memory` is the stage
    /// program's own (one micro-batch through each of its chunks).
    pub plan: Plan,
    /// The index in the whole plan's `params` of each of `plan.params`.
    pub params: Vec<usize>,
    /// Per chunk, the actions of one micro-batch's forward pass.
    pub forward: Vec<Vec<Action>>,
    /// Per chunk, the actions of one micro-batch's backward pass.
    pub backward: Vec<Vec<Action>>,
    /// The gradients this stage's backward passes compute, summed over an update's micro-batches.
    pub gradients: Vec<BufferId>,
    /// Once the micro-batches are done: each summed gradient that another stage's copy of its parameter
    /// needs, and that stage.
    pub gradient_sends: Vec<(BufferId, u64)>,
    /// The update: the gradient norm's share, the sums over replicas left, the optimizer steps.
    pub update: Vec<Action>,
    /// Whether the stage computes the loss (the one with the model's head).
    pub computes_loss: bool,
}

/// A whole pipeline: one program per stage.
#[derive(Clone, Debug)]
pub struct PipelineProgram {
    pub stages: Vec<StageProgram>,
    /// Model chunks per stage (V; 1 but for the interleaved schedule).
    pub chunks: u64,
    /// The repeated layers, in order.
    pub layers: Vec<String>,
    /// The pieces of each virtual stage (`chunk * stages + stage`): piece 0 is what runs before the
    /// first layer, piece k layer k - 1, the last what runs after the last layer.
    pub pieces: Vec<Range<usize>>,
}

/// What a stage device holds at most under a schedule, as its program says: the figure `run --pipeline`
/// measures against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StageMemoryPlan {
    /// The stage program's memory plan: parameters, gradients, optimizer state, inputs and one
    /// micro-batch's working set at its peak.
    pub storage_bytes: u64,
    /// An update's gradient sums over its micro-batches (one copy of the gradients the stage computes).
    pub gradient_sum_bytes: u64,
    /// The most bytes of activations kept at once for backward passes to come, and in how many
    /// forward passes (micro-batches; with interleaving, micro-batch and chunk pairs).
    pub kept_bytes: u64,
    pub in_flight: u64,
    /// `storage_bytes + gradient_sum_bytes + kept_bytes`.
    pub peak_bytes: u64,
}

impl StageProgram {
    /// The bytes that chunk `chunk`'s forward pass leaves alive for its backward pass (what a device
    /// keeps aside for it): every buffer written, received or loaded in the pass and not freed by its
    /// end, but parameters, optimizer state and caches.
    pub fn kept_bytes(&self, chunk: usize) -> u64 {
        let plan = &self.plan;
        let mut alive: HashSet<BufferId> = plan.inputs.iter().map(|i| i.buffer).collect();
        for action in self.forward.get(chunk).into_iter().flatten() {
            match *action {
                Action::Run(k) => match plan.program.get(k) {
                    Some(Instr::Free { buffer }) => {
                        alive.remove(buffer);
                    }
                    Some(instr) => alive.extend(crate::memory::written(instr)),
                    None => {}
                },
                Action::Receive { buffer, .. } => {
                    alive.insert(buffer);
                }
                Action::Send { .. } => {}
            }
        }
        let kept =
            |b: &&BufferId| !matches!(plan.buffer(**b).role, Role::Parameter | Role::OptimizerState | Role::Cache);
        alive.iter().filter(kept).map(|&b| plan.buffer(b).bytes()).sum()
    }
}

impl PipelineProgram {
    /// The first stage holding parameter `k` (of the whole plan), and its index in that stage's
    /// parameters: where the parameter's block is read from (a tied one's copies are equal).
    pub fn first_holder(&self, k: usize) -> Option<(usize, usize)> {
        self.stages.iter().enumerate().find_map(|(s, stage)| Some((s, stage.params.iter().position(|&q| q == k)?)))
    }

    /// Each stage's memory under `schedule` over `micro_batches`: its program's storage, its gradient
    /// sums, and the activations of the forward passes the schedule keeps in flight at its worst.
    pub fn memory_plan(
        &self,
        schedule: crate::pipeline::Schedule,
        micro_batches: u64,
    ) -> Result<Vec<StageMemoryPlan>, crate::pipeline::ScheduleError> {
        let stages = self.stages.len() as u64;
        let mut out = Vec::with_capacity(self.stages.len());
        for stage in &self.stages {
            let kept: Vec<u64> = (0..self.chunks as usize).map(|c| stage.kept_bytes(c)).collect();
            let (mut now, mut count, mut most, mut in_flight) = (0u64, 0u64, 0u64, 0u64);
            for op in crate::pipeline::stage_order(schedule, stages, micro_batches, stage.stage)? {
                let bytes = kept.get(op.chunk as usize).copied().unwrap_or(0);
                match op.pass {
                    crate::pipeline::Pass::Forward => (now, count) = (now + bytes, count + 1),
                    crate::pipeline::Pass::Backward => (now, count) = (now - bytes, count - 1),
                }
                (most, in_flight) = (most.max(now), in_flight.max(count));
            }
            let storage = stage.plan.memory.peak_bytes;
            let sums = stage.gradients.iter().map(|&g| stage.plan.buffer(g).bytes()).sum();
            out.push(StageMemoryPlan {
                storage_bytes: storage,
                gradient_sum_bytes: sums,
                kept_bytes: most,
                in_flight,
                peak_bytes: storage + sums + most,
            });
        }
        Ok(out)
    }

    /// Stage `stage`'s chunks in words: "embedding + h.0..1", or "h.1, h.3 + head" for two chunks.
    pub fn describe_stage(&self, stage: u64) -> String {
        let p = self.stages.len() as u64;
        let parts: Vec<String> = (0..self.chunks)
            .filter_map(|c| self.pieces.get((c * p + stage) as usize))
            .map(|r| describe_pieces(&self.layers, r))
            .collect();
        parts.join(", ")
    }
}

/// Why a plan cannot be cut into stages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CutError {
    /// Pipelines run training plans.
    NotTraining,
    /// Every virtual stage needs a repeated layer of its own.
    TooFewLayers { layers: usize, virtual_stages: u64 },
    /// The given split does not cover the pieces in order.
    BadSplit(String),
    /// The plan does something a stage cut cannot place (an internal limit, named).
    Unsupported(String),
}

impl std::fmt::Display for CutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CutError::NotTraining => write!(f, "a pipeline runs a training plan (`--mode train`)"),
            CutError::TooFewLayers { layers, virtual_stages } => write!(
                f,
                "{virtual_stages} pipeline stages (stages x virtual stages) need at least {virtual_stages} repeated \
                 layers, one a stage; the model has {layers}"
            ),
            CutError::BadSplit(why) => write!(f, "the stage split {why}"),
            CutError::Unsupported(why) => write!(f, "this plan cannot be cut into pipeline stages: {why}"),
        }
    }
}

impl std::error::Error for CutError {}

/// Which pass of which chunk an instruction is in, on its stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Pass {
    Forward(u64),
    Backward(u64),
    Update,
}

/// A buffer's last writer in the forward and backward passes: its instruction and stage.
#[derive(Clone, Copy, Debug)]
struct Writer {
    index: usize,
    stage: u64,
}

/// Cuts `plan` into `stages` stages of `chunks` chunks each. `pieces` gives each virtual stage's pieces
/// (contiguous, in order, covering every piece, each with a layer); `None` splits the layers evenly.
pub fn cut(
    plan: &Plan,
    stages: u64,
    chunks: u64,
    pieces: Option<&[Range<usize>]>,
) -> Result<PipelineProgram, CutError> {
    if plan.mode != crate::Mode::Train || plan.grad_norm.is_none() {
        return Err(CutError::NotTraining);
    }
    let cut = instruction_pieces(plan);
    check_layers_in_order(&cut)?;
    let layers = cut.layers.len();
    let virtual_stages = stages.max(1) * chunks.max(1);
    let ranges = match pieces {
        Some(given) => given.to_vec(),
        None => even_split(layers, virtual_stages as usize),
    };
    if ranges.is_empty() || layers < virtual_stages as usize {
        return Err(CutError::TooFewLayers { layers, virtual_stages });
    }
    check_split(&ranges, layers, virtual_stages)?;
    let mut vstage_of_piece = vec![0u64; layers + 2];
    for (v, r) in ranges.iter().enumerate() {
        for piece in r.clone() {
            vstage_of_piece[piece] = v as u64;
        }
    }
    let cutter = Cutter::new(plan, (stages.max(1), chunks.max(1)), &cut, &vstage_of_piece);
    let programs = cutter.programs()?;
    Ok(PipelineProgram { stages: programs, chunks: chunks.max(1), layers: cut.layers, pieces: ranges })
}

/// The forward pass must run the repeated layers in order, each once: a block applied twice (`h(h(x))`)
/// runs layer 0 again after the last, and its activations would flow from the last stage back to the
/// first and forward again, which no schedule of point-to-point sends orders (1F1B and interleaved
/// waited until their timeout).
fn check_layers_in_order(cut: &InstructionPieces) -> Result<(), CutError> {
    let layers = cut.layers.len();
    let mut latest = 0;
    for &piece in cut.piece_of.iter().take(cut.forward_end) {
        if !(1..=layers).contains(&piece) {
            continue;
        }
        if piece < latest {
            let (again, after) = (&cut.layers[piece - 1], &cut.layers[latest - 1]);
            return Err(CutError::Unsupported(format!(
                "its forward pass runs the repeated layer `{again}` again after `{after}` (a block applied more than \
                 once); pipeline stages hold contiguous runs of layers run once each, so run it without --pipeline"
            )));
        }
        latest = piece;
    }
    Ok(())
}

fn check_split(ranges: &[Range<usize>], layers: usize, virtual_stages: u64) -> Result<(), CutError> {
    if ranges.len() as u64 != virtual_stages {
        return Err(CutError::BadSplit(format!(
            "has {} runs of layers for {virtual_stages} virtual stages",
            ranges.len()
        )));
    }
    let mut next = 0;
    for r in ranges {
        let has_layer = r.clone().any(|k| (1..=layers).contains(&k));
        if r.start != next || r.end <= r.start || !has_layer {
            return Err(CutError::BadSplit(format!(
                "must give every virtual stage a contiguous run of at least one layer, in order (a run at pieces {}..{})",
                r.start, r.end
            )));
        }
        next = r.end;
    }
    if next != layers + 2 {
        return Err(CutError::BadSplit(format!("covers {next} of the {} pieces", layers + 2)));
    }
    Ok(())
}

/// The buffers an instruction reads and writes, for the transfers between stages (an optimizer step
/// writes its parameter and state in place; a wait is where its collective's result is written).
fn reads_writes(instr: &Instr) -> (Vec<BufferId>, Vec<BufferId>) {
    match instr {
        Instr::Kernel { kernel: Kernel::OptimizerStep, inputs, .. } => {
            let writes = [0, 2, 3].iter().filter_map(|&k| inputs.get(k).copied()).collect();
            (inputs.clone(), writes)
        }
        Instr::Kernel { kernel, inputs, output, .. } => {
            let mut reads = inputs.clone();
            if kernel.reads_its_output() {
                reads.push(*output);
            }
            (reads, vec![*output])
        }
        Instr::Collective { collective, .. } => (vec![collective.send], vec![collective.recv]),
        Instr::Wait { recv, .. } => (Vec::new(), vec![*recv]),
        Instr::Free { .. } => (Vec::new(), Vec::new()),
    }
}

/// The state of the cut as it walks the plan once.
struct Cutter<'a> {
    plan: &'a Plan,
    stages: u64,
    chunks: u64,
    forward_end: usize,
    updates_begin: usize,
    /// Each instruction's virtual stage (forward and backward instructions but frees).
    vstage: Vec<Option<u64>>,
    /// Each parameter's stages, and the stage that computes its gradient.
    holders: Vec<BTreeSet<u64>>,
    grad_stage: Vec<Option<u64>>,
    /// The parameter each buffer belongs to (its block, gradient, state, and what the update derives
    /// them from).
    owner: ParameterOwners,
    /// Each gradient buffer's parameter.
    grad_of: HashMap<BufferId, usize>,
}

impl<'a> Cutter<'a> {
    fn new(
        plan: &'a Plan,
        (stages, chunks): (u64, u64),
        cut: &InstructionPieces,
        vstage_of_piece: &[u64],
    ) -> Cutter<'a> {
        let (forward_end, updates_begin) = (cut.forward_end, cut.updates_begin);
        let mut vstage = vec![None; plan.program.len()];
        let mut collective_vstage: HashMap<BufferId, u64> = HashMap::new();
        for (i, instr) in plan.program.iter().enumerate().take(updates_begin) {
            let v = vstage_of_piece.get(cut.piece_of[i]).copied().unwrap_or(0);
            vstage[i] = match instr {
                Instr::Kernel { .. } => Some(v),
                Instr::Collective { collective, .. } => {
                    collective_vstage.insert(collective.recv, v);
                    Some(v)
                }
                Instr::Wait { recv, .. } => Some(collective_vstage.get(recv).copied().unwrap_or(v)),
                Instr::Free { .. } => None,
            };
        }
        let mut cutter = Cutter {
            plan,
            stages,
            chunks,
            forward_end,
            updates_begin,
            vstage,
            holders: vec![BTreeSet::new(); plan.params.len()],
            grad_stage: vec![None; plan.params.len()],
            owner: ParameterOwners::of_plan(plan, updates_begin),
            grad_of: plan.params.iter().enumerate().filter_map(|(k, p)| Some((p.grad?, k))).collect(),
        };
        cutter.find_holders(cut, vstage_of_piece);
        cutter
    }

    /// Each parameter's stages (those whose passes read or write it; its layer's, or the stage computing its
    /// gradient, when none does) and the stage computing its gradient.
    fn find_holders(&mut self, cut: &InstructionPieces, vstage_of_piece: &[u64]) {
        let param_of: HashMap<BufferId, usize> =
            self.plan.params.iter().enumerate().map(|(k, p)| (p.buffer, k)).collect();
        for (i, instr) in self.plan.program.iter().enumerate().take(self.updates_begin) {
            let Some(v) = self.vstage[i] else { continue };
            let s = v % self.stages;
            let (reads, writes) = reads_writes(instr);
            for b in reads.iter().chain(&writes) {
                if let Some(&k) = param_of.get(b) {
                    self.holders[k].insert(s);
                }
            }
            for w in &writes {
                if let Some(&k) = self.grad_of.get(w) {
                    self.grad_stage[k].get_or_insert(s);
                }
            }
        }
        let layer_index: HashMap<&str, usize> = cut.layers.iter().enumerate().map(|(k, l)| (l.as_str(), k)).collect();
        for (k, p) in self.plan.params.iter().enumerate() {
            if self.holders[k].is_empty() {
                let home = layer_of(&p.name)
                    .and_then(|l| layer_index.get(l))
                    .map(|&layer| vstage_of_piece.get(layer + 1).copied().unwrap_or(0) % self.stages);
                self.holders[k].insert(self.grad_stage[k].or(home).unwrap_or(0));
            }
        }
    }

    /// The stages an update instruction runs on: those holding the parameters it touches, or every
    /// stage when it touches none.
    fn update_stages(&self, instr: &Instr) -> BTreeSet<u64> {
        let (reads, writes) = reads_writes(instr);
        let mut stages = BTreeSet::new();
        for b in reads.iter().chain(&writes) {
            if let Some(k) = self.owner.of(*b) {
                stages.extend(self.holders[k].iter().copied());
            }
        }
        if stages.is_empty() { (0..self.stages).collect() } else { stages }
    }

    /// The stage whose share of the gradient norm counts the buffer (a gradient on the stage computing
    /// it; anything else on the first stage holding its parameter, or stage 0).
    fn norm_stage(&self, b: BufferId) -> u64 {
        match self.owner.of(b) {
            Some(k) => self.grad_stage[k].or_else(|| self.holders[k].first().copied()).unwrap_or(0),
            None => 0,
        }
    }

    /// Walks the plan once and builds every stage's program.
    fn programs(&self) -> Result<Vec<StageProgram>, CutError> {
        let plan = self.plan;
        let p = self.stages;
        let mut builds: Vec<StageBuild> = (0..p).map(|_| StageBuild::default()).collect();
        let mut last_writer: HashMap<BufferId, Writer> = HashMap::new();
        // Per buffer, the stages that touched it and the pass of their last touch (for its frees).
        let mut touched_by: HashMap<BufferId, Vec<(u64, Pass)>> = HashMap::new();
        let mut sends: HashMap<(u64, usize), Vec<(BufferId, u64)>> = HashMap::new();
        for (i, instr) in plan.program.iter().enumerate() {
            let members = self.members(i, instr, &touched_by);
            let (_, writes) = reads_writes(instr);
            for (s, pass) in members {
                let stage_instr = self.stage_instruction(instr, s);
                let (reads, _) = reads_writes(&stage_instr);
                let mut receives = Vec::new();
                for &b in &reads {
                    if persistent(plan.buffer(b).role) || builds[s as usize].has(pass, b) {
                        continue;
                    }
                    let from = self.source(s, pass, b, i, &last_writer)?;
                    if pass == Pass::Update {
                        builds[from as usize].gradient_sends.push((b, s));
                    } else if let Some(w) = last_writer.get(&b) {
                        sends.entry((w.stage, w.index)).or_default().push((b, s));
                    }
                    receives.push((b, from));
                    builds[s as usize].note_written(pass, b);
                }
                let build = &mut builds[s as usize];
                build.entries.push(Entry { global: i, pass, receives, instr: stage_instr });
                match instr {
                    Instr::Free { buffer } => build.note_freed(pass, *buffer),
                    _ => {
                        for &w in &writes {
                            build.note_written(pass, w);
                            if matches!(pass, Pass::Backward(_)) && self.grad_param(w).is_some() {
                                build.gradients.insert(w);
                            }
                        }
                        for &b in reads.iter().chain(&writes) {
                            let list = touched_by.entry(b).or_default();
                            list.retain(|(t, _)| *t != s);
                            list.push((s, pass));
                        }
                    }
                }
            }
            if i < self.updates_begin
                && let Some(v) = self.vstage[i]
            {
                for &w in &writes {
                    last_writer.insert(w, Writer { index: i, stage: v % p });
                }
            }
        }
        Ok(builds.into_iter().enumerate().map(|(s, b)| self.finish(s as u64, b, &sends)).collect())
    }

    /// The stages (and passes) that run instruction `i`.
    fn members(&self, i: usize, instr: &Instr, touched_by: &HashMap<BufferId, Vec<(u64, Pass)>>) -> Vec<(u64, Pass)> {
        let p = self.stages;
        if let Instr::Free { buffer } = instr {
            let touched = touched_by.get(buffer).cloned().unwrap_or_default();
            let mut members: Vec<(u64, Pass)> = touched
                .into_iter()
                .map(|(s, pass)| if i >= self.updates_begin { (s, Pass::Update) } else { (s, pass) })
                .collect();
            members.sort_by_key(|(s, _)| *s);
            return members;
        }
        if i >= self.updates_begin {
            let stages = match instr {
                Instr::Kernel { kernel: Kernel::GradSquareSum, .. } => (0..p).collect(),
                _ => self.update_stages(instr),
            };
            return stages.into_iter().map(|s| (s, Pass::Update)).collect();
        }
        let Some(v) = self.vstage[i] else { return Vec::new() };
        let chunk = v / p;
        let pass = if i < self.forward_end { Pass::Forward(chunk) } else { Pass::Backward(chunk) };
        vec![(v % p, pass)]
    }

    /// The parameter whose gradient buffer `b` is.
    fn grad_param(&self, b: BufferId) -> Option<usize> {
        self.grad_of.get(&b).copied()
    }

    /// Where stage `s` gets buffer `b`, which its pass reads at instruction `i` without having it.
    fn source(
        &self,
        s: u64,
        pass: Pass,
        b: BufferId,
        i: usize,
        last_writer: &HashMap<BufferId, Writer>,
    ) -> Result<u64, CutError> {
        let name = &self.plan.buffer(b).name;
        if pass == Pass::Update {
            return match self.grad_param(b).and_then(|k| self.grad_stage[k]) {
                Some(from) if from != s => Ok(from),
                _ => Err(CutError::Unsupported(format!(
                    "stage {s}'s update reads `{name}`, which is not a gradient another stage computes"
                ))),
            };
        }
        match last_writer.get(&b) {
            Some(w) => Ok(w.stage),
            None => Err(CutError::Unsupported(format!(
                "instruction {i} reads `{name}` on stage {s} before any instruction writes it"
            ))),
        }
    }

    /// The instruction as stage `s` runs it: the gradient norm's sum of squares over the gradients
    /// this stage counts.
    fn stage_instruction(&self, instr: &Instr, s: u64) -> Instr {
        match instr {
            Instr::Kernel { kernel: Kernel::GradSquareSum, inputs, output, origin, reason } => Instr::Kernel {
                kernel: Kernel::GradSquareSum,
                inputs: inputs.iter().copied().filter(|&b| self.norm_stage(b) == s).collect(),
                output: *output,
                origin: *origin,
                reason: *reason,
            },
            other => other.clone(),
        }
    }

    /// Stage `s`'s program from what the walk gathered.
    fn finish(&self, s: u64, build: StageBuild, sends: &HashMap<(u64, usize), Vec<(BufferId, u64)>>) -> StageProgram {
        let chunks = self.chunks as usize;
        let mut forward = vec![Vec::new(); chunks];
        let mut backward = vec![Vec::new(); chunks];
        let mut update = Vec::new();
        let mut program = Vec::with_capacity(build.entries.len());
        let mut sent: HashSet<(BufferId, u64)> = HashSet::new();
        let forward_end =
            build.entries.iter().position(|e| !matches!(e.pass, Pass::Forward(_))).unwrap_or(build.entries.len());
        for (k, entry) in build.entries.into_iter().enumerate() {
            let actions = match entry.pass {
                Pass::Forward(c) => &mut forward[c as usize],
                Pass::Backward(c) => &mut backward[c as usize],
                Pass::Update => &mut update,
            };
            actions.extend(entry.receives.iter().map(|&(buffer, from)| Action::Receive { buffer, from }));
            actions.push(Action::Run(k));
            for &(buffer, to) in sends.get(&(s, entry.global)).into_iter().flatten() {
                if sent.insert((buffer, to)) {
                    actions.push(Action::Send { buffer, to });
                }
            }
            program.push(entry.instr);
        }
        let params: Vec<usize> = (0..self.plan.params.len()).filter(|&k| self.holders[k].contains(&s)).collect();
        let gradients: Vec<BufferId> =
            self.plan.params.iter().filter_map(|p| p.grad).filter(|g| build.gradients.contains(g)).collect();
        let plan = self.stage_plan(program, &params, forward_end);
        let computes_loss = plan.outputs.iter().any(|o| o.is_loss);
        let mut gradient_sends = build.gradient_sends;
        gradient_sends.sort_by_key(|&(b, to)| (b.0, to));
        gradient_sends.dedup();
        StageProgram { stage: s, plan, params, forward, backward, gradients, gradient_sends, update, computes_loss }
    }

    /// The whole plan with `program` for its program, `params` for its parameters, and its inputs and
    /// outputs cut to those the program touches.
    fn stage_plan(&self, program: Vec<Instr>, params: &[usize], forward_end: usize) -> Plan {
        let mut touched = vec![false; self.plan.buffers.len()];
        for instr in &program {
            crate::memory::for_each_touched(instr, |b| touched[b.0 as usize] = true);
        }
        let mut plan = self.plan.clone();
        plan.params = params.iter().filter_map(|&k| self.plan.params.get(k).cloned()).collect();
        let mut held = vec![false; plan.buffers.len()];
        for p in &plan.params {
            for b in std::iter::once(p.buffer).chain(p.state.iter().copied()) {
                held[b.0 as usize] = true;
            }
        }
        plan.inputs.retain(|input| touched[input.buffer.0 as usize]);
        for input in &plan.inputs {
            held[input.buffer.0 as usize] = true;
        }
        plan.outputs.retain(|o| touched[o.buffer.0 as usize]);
        for b in &mut plan.buffers {
            if persistent(b.role) && !held[b.id.0 as usize] {
                b.role = Role::Workspace;
            }
        }
        plan.memory = crate::memory::plan_memory(&program, &plan.buffers, forward_end);
        plan.program = program;
        plan
    }
}

/// One instruction of a stage: where it is in the whole plan, its pass, what it receives first.
struct Entry {
    global: usize,
    pass: Pass,
    receives: Vec<(BufferId, u64)>,
    instr: Instr,
}

/// What the walk gathers for one stage.
#[derive(Default)]
struct StageBuild {
    entries: Vec<Entry>,
    /// The buffers each pass has (written or received) and not freed.
    have: HashMap<Pass, HashSet<BufferId>>,
    /// The parameters' gradients that the stage's backward passes write.
    gradients: BTreeSet<BufferId>,
    gradient_sends: Vec<(BufferId, u64)>,
}

impl StageBuild {
    /// Whether `pass` has `b`: written or received earlier in the pass, or (a backward pass) kept from
    /// its chunk's forward pass, or (the update) summed by this stage's backward passes.
    fn has(&self, pass: Pass, b: BufferId) -> bool {
        let holds = |p: Pass| self.have.get(&p).is_some_and(|set| set.contains(&b));
        match pass {
            Pass::Forward(_) => holds(pass),
            Pass::Backward(c) => holds(pass) || holds(Pass::Forward(c)),
            Pass::Update => holds(pass) || self.gradients.contains(&b),
        }
    }

    fn note_written(&mut self, pass: Pass, b: BufferId) {
        self.have.entry(pass).or_default().insert(b);
    }

    fn note_freed(&mut self, pass: Pass, b: BufferId) {
        if let Some(set) = self.have.get_mut(&pass) {
            set.remove(&b);
        }
    }
}
