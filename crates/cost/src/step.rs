//! The step-time model over a plan: kernels by roofline (or by a calibrated profile's fits),
//! collectives at the flow level over the links and NICs their groups cross ([`super::flows`]), and
//! SUMMA broadcasts hidden behind the previous step's product when double-buffered.
//!
//! Instructions run one after another on each device; communication is exposed (adds to the step)
//! except where a double-buffered SUMMA issues step t's broadcasts during step t-1's product, which
//! leaves max(0, broadcasts of step t - products of step t-1) exposed, and where the sums of gradient
//! buckets over data-parallel replicas run on the communication stream beside the rest of the backward
//! pass: the compute after a bucket's sums hides them, and what is left is exposed where the gradient
//! norm (or the optimizer) first needs every gradient.
//! An instruction's SUMMA product and step come from its reason's kind ([`ReasonKind::Summa`]), never
//! from the reason's text.

use super::collective::Algorithm;
use super::flows::{self, GroupLayout};
use super::hardware::Hardware;
use optimus_plan::placement::{LinkKind, NodeMap, RankPlacement};
use optimus_plan::report::{collective_bytes, flops, kernel_flops};
use optimus_plan::types::DType;
use optimus_plan::{
    Buffer, BufferId, Collective, CollectiveKind, Group, Instr, Kernel, Mode, Plan, ReasonKind, SummaProduct,
};
use serde::Serialize;
use std::collections::BTreeMap;

/// How to simulate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    pub placement: RankPlacement,
    /// Simulate both placements (row-major and blocks) where the mesh spans nodes, and keep the faster
    /// (`simulate --placement auto`); `placement` is then not used.
    pub auto_placement: bool,
    /// Overrides the profile's collective algorithm.
    pub algorithm: Option<Algorithm>,
    /// Whether SUMMA products are double-buffered (broadcasts of step t overlap the product of t-1).
    pub overlap: bool,
    /// The devices that share a calibrated shared engine, where more than the plan's run on it at once
    /// (a pipeline's stages, each a copy of the plan's mesh, on one CPU); `None`: the plan's devices.
    pub engine_devices: Option<u64>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            placement: RankPlacement::RowMajor,
            auto_placement: false,
            algorithm: None,
            overlap: true,
            engine_devices: None,
        }
    }
}

/// Communication time of one (group, link, collective kind).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CommTime {
    pub group: String,
    pub link: String,
    pub kind: String,
    pub count: u64,
    pub bytes: u64,
    pub time_s: f64,
    pub exposed_s: f64,
}

/// Device memory against capacity.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryFit {
    pub peak_bytes_per_device: u64,
    pub capacity_bytes: u64,
    pub fits: bool,
    pub utilisation: f64,
}

/// The predicted step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Simulation {
    pub model: String,
    pub hardware: String,
    pub mesh: String,
    pub devices: u64,
    pub strategy: String,
    pub mode: String,
    pub placement: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement_note: Option<String>,
    pub algorithm: String,
    pub overlap: bool,
    pub step_time_s: f64,
    pub compute_s: f64,
    /// The fixed part of `compute_s`: kernel launch and dispatch costs.
    pub overhead_s: f64,
    pub communication_s: f64,
    pub exposed_communication_s: f64,
    pub hidden_communication_s: f64,
    pub communication: Vec<CommTime>,
    pub memory: MemoryFit,
    pub parameters: u64,
    pub tokens_per_step: u64,
    pub tokens_per_second: f64,
    pub flops_per_device: u64,
    pub model_flops_per_step: f64,
    pub mfu: f64,
}

/// The element type whose peak a matrix product runs at: its operands' (bf16 operands use the tensor
/// cores whether they accumulate into bf16 or into a float32 sum).
pub fn product_dtype(inputs: &[&Buffer], output: &Buffer) -> DType {
    inputs.first().map_or(output.dtype, |b| b.dtype)
}

/// Seconds for one kernel on one device: by the profile's measured fit of its kind when it has one
/// (see [`crate::calibration`]), else by the roofline below.
pub fn kernel_time(kernel: &Kernel, inputs: &[&Buffer], output: &Buffer, hw: &Hardware) -> f64 {
    kernel_cost(kernel, inputs, output, hw).seconds
}

/// A kernel's seconds and the fixed part of them (launch and dispatch).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KernelCost {
    pub seconds: f64,
    pub overhead: f64,
}

/// [`kernel_time`] with its fixed part.
pub fn kernel_cost(kernel: &Kernel, inputs: &[&Buffer], output: &Buffer, hw: &Hardware) -> KernelCost {
    kernel_cost_on(kernel, (inputs, output), hw, (false, false))
}

/// [`kernel_cost`], on one thread when `single_thread` (a device thread running its own kernels), in
/// an inference plan when `infer` (a calibrated profile's `@infer` fits where it has them).
fn kernel_cost_on(
    kernel: &Kernel,
    (inputs, output): (&[&Buffer], &Buffer),
    hw: &Hardware,
    (single_thread, infer): (bool, bool),
) -> KernelCost {
    let Some(measured) = &hw.measured else {
        let overhead = hw.device.kernel_launch_us * 1e-6;
        return KernelCost { seconds: roofline_time(kernel, inputs, output, hw) + overhead, overhead };
    };
    let flops = kernel_flops(kernel, inputs, output) as f64;
    let bytes = kernel_bytes(inputs, output) as f64;
    let (flavor, kind) = (kernel.flavor(), kernel.name());
    let bf16 = touches_bf16(inputs, output);
    let seconds = |bytes, flops| match single_thread {
        true => measured.single_thread_kernel_seconds(&flavor, kind, (bf16, infer), bytes, flops),
        false => measured.kernel_seconds(&flavor, kind, (bf16, infer), bytes, flops),
    };
    KernelCost { seconds: seconds(bytes, flops), overhead: seconds(0.0, 0.0) }
}

/// Whether a kernel reads or writes a bf16 buffer.
pub fn touches_bf16(inputs: &[&Buffer], output: &Buffer) -> bool {
    inputs.iter().chain([&output]).any(|b| b.dtype == DType::Bf16)
}

/// Bytes a kernel reads and writes: its inputs and its output, once each.
pub fn kernel_bytes(inputs: &[&Buffer], output: &Buffer) -> u64 {
    inputs.iter().map(|b| b.bytes()).sum::<u64>() + output.bytes()
}

/// Roofline seconds for one kernel on one device: max(FLOPs at the achievable rate, bytes at the
/// achievable bandwidth), without the launch cost. Matrix products run at the peak of their operands' element type
/// (bf16 operands use the tensor cores whether they accumulate into bf16 or into a float32 sum); other
/// kernels at the f32 rate.
fn roofline_time(kernel: &Kernel, inputs: &[&Buffer], output: &Buffer, hw: &Hardware) -> f64 {
    let flops = kernel_flops(kernel, inputs, output) as f64;
    let bytes = kernel_bytes(inputs, output);
    let is_matrix = matches!(
        kernel,
        Kernel::MatMul { .. } | Kernel::BatchedMatMul | Kernel::Attention { .. } | Kernel::AttentionGrad { .. }
    );
    let peak = if is_matrix { hw.peak_flops(product_dtype(inputs, output)) } else { hw.peak_flops(DType::F32) };
    let d = &hw.device;
    let compute = flops / (peak * d.achievable_compute);
    let memory = bytes as f64 / (d.memory_bandwidth_gb_s * 1e9 * d.achievable_bandwidth);
    compute.max(memory)
}

/// A SUMMA step as the plan's reasons give it: the product and its step count, and the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SummaStep {
    product: SummaProduct,
    steps: u64,
    step: u64,
}

impl SummaStep {
    /// The SUMMA step an instruction belongs to, if it belongs to one.
    fn of(kind: Option<&ReasonKind>) -> Option<SummaStep> {
        match kind {
            Some(&ReasonKind::Summa { product, step, steps, .. }) => Some(SummaStep { product, steps, step }),
            _ => None,
        }
    }

    /// Whether `self` is the step right after `previous` of the same product. A product's steps run
    /// 1 to q in program order, so the first step of the next product never follows the last of this one.
    fn follows(self, previous: SummaStep) -> bool {
        self.product == previous.product && self.steps == previous.steps && self.step == previous.step + 1
    }
}

/// Tracks the SUMMA step in progress and how much of the previous step's compute is left to hide
/// broadcasts behind.
#[derive(Default)]
struct Overlap {
    current: Option<SummaStep>,
    step_compute: f64,
    budget: f64,
}

impl Overlap {
    /// Moves to the SUMMA step of an instruction of kind `kind`; false when it is not part of one.
    fn enter(&mut self, kind: Option<&ReasonKind>) -> bool {
        let Some(step) = SummaStep::of(kind) else { return false };
        if self.current != Some(step) {
            let next = self.current.is_some_and(|previous| step.follows(previous));
            self.budget = if next { self.step_compute } else { 0.0 };
            self.step_compute = 0.0;
            self.current = Some(step);
        }
        true
    }

    /// Hides what it can of a broadcast; returns the exposed part.
    fn hide(&mut self, time: f64) -> f64 {
        let hidden = time.min(self.budget);
        self.budget -= hidden;
        time - hidden
    }
}

/// What communication time is counted under: (group, link, collective kind).
type CommKey = (&'static str, LinkKind, &'static str);

/// Running totals of one step, instruction by instruction.
#[derive(Default)]
struct Tally {
    compute: f64,
    /// The fixed part of `compute`: kernel launch and dispatch.
    overhead: f64,
    communication: f64,
    exposed: f64,
    by_group: BTreeMap<CommKey, CommTime>,
    overlap: Overlap,
    /// Whether SUMMA products are double-buffered and gradient sums over the replicas run beside the
    /// backward pass.
    double_buffered: bool,
    /// Gradient sums over the replicas still running on the communication stream, oldest first: the
    /// (group, link, kind) they are counted under and the seconds they have left.
    background: std::collections::VecDeque<(CommKey, f64)>,
    /// The plan's own schedule of overlapped collectives, when it has one (`--overlap`): followed
    /// instead of the double-buffering and gradient-sum models above.
    stream: Option<Stream>,
}

/// A device's compute and communication streams, for a plan whose collectives say where they start
/// and where they are waited for: collectives run one after another on the communication stream,
/// each from when it is started (and the stream is free); computation waits only at a collective's
/// wait, or for a collective that is not overlapped.
#[derive(Default)]
struct Stream {
    /// Seconds into the step on the compute stream.
    now: f64,
    /// When the communication stream is next free.
    free: f64,
    /// Overlapped collectives in flight: their receive buffer, when they end, and their row.
    in_flight: Vec<(BufferId, f64, CommKey)>,
}

impl Tally {
    fn kernel(&mut self, cost: KernelCost, reason: Option<&ReasonKind>) {
        let time = cost.seconds;
        if let Some(stream) = self.stream.as_mut() {
            stream.now += time;
        }
        self.wait_for_gradient_sums(reason);
        self.compute += time;
        self.overhead += cost.overhead;
        self.run_beside(time);
        if self.double_buffered && self.overlap.enter(reason) {
            self.overlap.step_compute += time;
        }
    }

    /// Adds a collective of `time` seconds; SUMMA broadcasts hide behind the previous step's product.
    fn collective(&mut self, c: &Collective, link: LinkKind, bytes: u64, time: f64, reason: Option<&ReasonKind>) {
        let (kind, group) = (c.kind, c.group);
        let overlapped = c.overlapped.then_some(c.recv);
        self.wait_for_gradient_sums(reason);
        let key = (group.name(), link, kind.name());
        let shown = match self.stream.as_mut() {
            Some(stream) => stream.start(time, overlapped, key),
            None => self.modelled_exposure(kind, time, reason, &key),
        };
        self.communication += time;
        self.exposed += shown;
        let e = self.by_group.entry(key).or_insert_with(|| CommTime {
            group: group.name().to_string(),
            link: link.name().to_string(),
            kind: kind.name().to_string(),
            count: 0,
            bytes: 0,
            time_s: 0.0,
            exposed_s: 0.0,
        });
        e.count += 1;
        e.bytes += bytes;
        e.time_s += time;
        e.exposed_s += shown;
    }

    /// The exposed part of a collective under the runtime model (SUMMA broadcasts hide behind the
    /// previous step's product; gradient sums run beside the backward pass).
    fn modelled_exposure(
        &mut self,
        kind: CollectiveKind,
        time: f64,
        reason: Option<&ReasonKind>,
        key: &CommKey,
    ) -> f64 {
        let in_summa = self.double_buffered && self.overlap.enter(reason);
        let beside = self.double_buffered && matches!(reason, Some(ReasonKind::DataParallelGradient { .. }));
        let shown = if in_summa && kind == CollectiveKind::Broadcast {
            self.overlap.hide(time)
        } else if beside {
            0.0
        } else {
            time
        };
        if beside {
            self.background.push_back((*key, time));
        }
        shown
    }

    /// The wait for the overlapped collective into `recv`: the compute stream stops until it ends.
    fn wait(&mut self, recv: BufferId) {
        let Some(stream) = self.stream.as_mut() else { return };
        let Some(k) = stream.in_flight.iter().position(|(r, _, _)| *r == recv) else { return };
        let (_, end, key) = stream.in_flight.remove(k);
        let shown = (end - stream.now).max(0.0);
        stream.now += shown;
        self.exposed += shown;
        if let Some(e) = self.by_group.get_mut(&key) {
            e.exposed_s += shown;
        }
    }

    /// Waits for every overlapped collective still in flight (the end of the step).
    fn finish_stream(&mut self) {
        let pending: Vec<BufferId> = self.stream.iter().flat_map(|s| s.in_flight.iter().map(|f| f.0)).collect();
        for recv in pending {
            self.wait(recv);
        }
    }
}

impl Stream {
    /// Starts a collective of `time` seconds on the communication stream; returns the part the compute
    /// stream waits for now (all of what is left of it when it is not overlapped, nothing when it is).
    fn start(&mut self, time: f64, overlapped: Option<BufferId>, key: CommKey) -> f64 {
        let end = self.now.max(self.free) + time;
        self.free = end;
        match overlapped {
            Some(recv) => {
                self.in_flight.push((recv, end, key));
                0.0
            }
            None => {
                let shown = end - self.now;
                self.now = end;
                shown
            }
        }
    }
}

impl Tally {
    /// Compute of `time` seconds runs while the oldest gradient sums progress on the communication
    /// stream.
    fn run_beside(&mut self, mut time: f64) {
        while let Some((_, left)) = self.background.front_mut() {
            let done = left.min(time);
            *left -= done;
            time -= done;
            if *left > 0.0 {
                return;
            }
            self.background.pop_front();
        }
    }

    /// The gradient norm and the optimizer need every gradient summed: what is left of the sums is
    /// exposed there (and at the end of the step).
    fn wait_for_gradient_sums(&mut self, reason: Option<&ReasonKind>) {
        let needs_gradients = matches!(reason, None | Some(ReasonKind::GradientNorm | ReasonKind::Optimizer));
        if !needs_gradients {
            return;
        }
        for (key, left) in std::mem::take(&mut self.background) {
            self.exposed += left;
            if let Some(e) = self.by_group.get_mut(&key) {
                e.exposed_s += left;
            }
        }
    }
}

/// One instruction's part in a simulated step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct InstrCost {
    /// What it adds to the step: its kernel's time, or the exposed part of its collective (a wait
    /// adds what is left of the collective it waits for).
    pub step_s: f64,
    /// Its kernel's or its collective's whole time, hidden or not.
    pub busy_s: f64,
}

/// Simulates one step of a plan on a cluster. With `auto_placement`, on a mesh that spans nodes, both
/// placements are simulated and the faster kept (row-major on a tie); its `placement` then ends in
/// "(auto)" and its note gives the other's step.
pub fn simulate(plan: &Plan, hw: &Hardware, options: &Options) -> Simulation {
    simulate_recording(plan, hw, options, false).0
}

/// [`simulate`], with each instruction's part in the step (one per instruction of the program).
pub fn simulate_costed(plan: &Plan, hw: &Hardware, options: &Options) -> (Simulation, Vec<InstrCost>) {
    simulate_recording(plan, hw, options, true)
}

/// [`simulate`], with each instruction's part in the step when `record` (else none).
fn simulate_recording(plan: &Plan, hw: &Hardware, options: &Options, record: bool) -> (Simulation, Vec<InstrCost>) {
    let placed =
        |placement| simulate_placed(plan, hw, &Options { placement, auto_placement: false, ..*options }, record);
    if !options.auto_placement {
        return placed(options.placement);
    }
    let row_major = placed(RankPlacement::RowMajor);
    let spans_nodes = plan.mesh.devices() > hw.intra_node.gpus_per_node.max(1);
    let blocks = spans_nodes.then(|| placed(RankPlacement::Blocks)).filter(|b| b.0.placement_note.is_none());
    let ((mut best, costs), other) = match blocks {
        Some(b) if b.0.step_time_s < row_major.0.step_time_s => (b, Some(row_major.0)),
        Some(b) => (row_major, Some(b.0)),
        None => (row_major, None),
    };
    if let Some(other) = other {
        let (ms, other_ms) = (best.step_time_s * 1e3, other.step_time_s * 1e3);
        best.placement_note = Some(match other_ms - ms > 1e-6 * ms {
            true => format!(
                "--placement auto: {} ({ms:.1} ms a step) is faster than {} ({other_ms:.1} ms)",
                best.placement, other.placement
            ),
            false => {
                format!("--placement auto: {} and {} give the same step ({ms:.1} ms)", best.placement, other.placement)
            }
        });
    }
    best.placement = format!("{} (auto)", best.placement);
    (best, costs)
}

/// Simulates one step of a plan with its ranks placed as `options.placement` says.
fn simulate_placed(plan: &Plan, hw: &Hardware, options: &Options, record: bool) -> (Simulation, Vec<InstrCost>) {
    let nodes = NodeMap::of_plan(plan, hw.intra_node.gpus_per_node, options.placement);
    let algorithm = options.algorithm.unwrap_or(hw.collectives.algorithm);
    let layouts: BTreeMap<Group, GroupLayout> =
        Group::ALL.into_iter().map(|g| (g, GroupLayout::of(&nodes, g))).collect();
    // Plans repeat the same collectives layer after layer: each (group, kind, bytes) is costed once.
    let mut costed: BTreeMap<(Group, &'static str, u64), (LinkKind, f64)> = BTreeMap::new();
    let measured = hw.measured.as_ref();
    let overlap = options.overlap && measured.is_none_or(|m| m.overlap);
    // A pipeline's stages share the cores: every device thread of every stage counts, for the work
    // and for what each kernel and collective costs beyond it (a thread that waits at a collective is
    // woken among all of them).
    let engine = Engine::of(options.engine_devices.unwrap_or(plan.mesh.devices()), hw);
    // A plan that says what overlaps is followed as it says, where the engine can run communication
    // beside computation (not one whose cores the devices share: their copies take the same cores).
    let scheduled = plan.overlap && overlap && !engine.shared;
    let mut tally = Tally {
        double_buffered: overlap && !plan.overlap,
        stream: scheduled.then(Stream::default),
        ..Tally::default()
    };
    let mut costs = Vec::with_capacity(if record { plan.program.len() } else { 0 });
    for instr in &plan.program {
        let before = tally.compute + tally.exposed;
        let mut busy_s = 0.0;
        match instr {
            Instr::Kernel { kernel, inputs, output, reason, .. } => {
                let ins: Vec<&Buffer> = inputs.iter().map(|&b| plan.buffer(b)).collect();
                let on = (engine.single_thread(), plan.mode == Mode::Infer);
                let one = kernel_cost_on(kernel, (&ins, plan.buffer(*output)), hw, on);
                let cost = engine.kernel(one);
                busy_s = cost.seconds;
                tally.kernel(cost, reason_kind(plan, *reason));
            }
            Instr::Collective { collective: c, reason, .. } => {
                let bytes = collective_bytes(plan, c);
                let (link_kind, modelled) = *costed.entry((c.group, c.kind.name(), bytes)).or_insert_with(|| {
                    flows::collective_seconds(c.kind, &layouts[&c.group], bytes as f64, hw, algorithm)
                });
                let members = plan.mesh.group_size(c.group);
                let measured_time = measured.and_then(|m| {
                    m.collective_seconds(c.kind, members, plan.mesh.devices(), bytes as f64, engine.shared)
                });
                let t = measured_time.unwrap_or(modelled) + engine.collective();
                busy_s = t;
                tally.collective(c, link_kind, bytes, t, reason_kind(plan, *reason));
            }
            Instr::Wait { recv, .. } => tally.wait(*recv),
            Instr::Free { .. } => {}
        }
        if record {
            costs.push(InstrCost { step_s: tally.compute + tally.exposed - before, busy_s });
        }
    }
    tally.finish_stream();
    tally.wait_for_gradient_sums(None);
    let placement = if nodes.note.is_some() { RankPlacement::RowMajor } else { options.placement };
    let header = Header {
        placement: placement.name().to_string(),
        placement_note: nodes.note.clone(),
        algorithm: algorithm.name().to_string(),
    };
    // What overlapped: a plan that schedules its own overlap, the collectives it marks (none, for a
    // plan whose flag says overlap and whose program has nothing overlapped); else SUMMA double buffering.
    let overlapped = match plan.overlap {
        true => {
            scheduled
                && plan
                    .program
                    .iter()
                    .any(|i| matches!(i, Instr::Collective { collective, .. } if collective.overlapped))
        }
        false => overlap,
    };
    (assemble(plan, hw, Options { overlap: overlapped, ..*options }, header, tally), costs)
}

/// The compute engine a device's kernels run on: its own, or one shared by the `devices` of its node
/// (threads of one process on the same cores), on which each kernel of each device also costs
/// `dispatch` seconds (handing it to the engine and waking the device when it is done) and each
/// collective `rendezvous` seconds (its members meet: the threads that wait sleep and wake).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Engine {
    shared: bool,
    devices: f64,
    dispatch: f64,
    rendezvous: f64,
    /// Kernels that run at once on the shared engine: its threads, when every device thread runs its
    /// own kernels (a mesh of at least as many devices as the profile's threads), else 1 (the devices'
    /// kernels queue on the pool one by one).
    lanes: f64,
}

impl Engine {
    /// The engine of `devices` devices running at once: shared when a calibrated profile says the
    /// node's devices share one.
    fn of(devices: u64, hw: &Hardware) -> Engine {
        match &hw.measured {
            Some(m) if m.shared_engine && devices > 1 => {
                let devices = devices.min(hw.intra_node.gpus_per_node).max(1);
                let inline = devices >= m.threads.max(1) && !m.single_thread_kernels.is_empty();
                let lanes = if inline { m.threads.max(1) as f64 } else { 1.0 };
                let (dispatch, rendezvous) = (m.dispatch_seconds(devices), m.rendezvous_seconds(devices));
                Engine { shared: true, devices: devices as f64, dispatch, rendezvous, lanes }
            }
            _ => Engine { shared: false, devices: 1.0, dispatch: 0.0, rendezvous: 0.0, lanes: 1.0 },
        }
    }

    /// What a kernel adds to the step. On a shared engine every device's call queues on it, and the
    /// one-device launch cost gives way to the shared engine's dispatch cost: with other devices' work
    /// queued, the engine never idles waiting for a launch.
    fn kernel(self, cost: KernelCost) -> KernelCost {
        if !self.shared {
            return cost;
        }
        let overhead = self.devices * self.dispatch;
        KernelCost { seconds: self.devices / self.lanes * (cost.seconds - cost.overhead) + overhead, overhead }
    }

    /// Whether a kernel's cost is its cost on one thread (each device thread running its own).
    fn single_thread(self) -> bool {
        self.lanes > 1.0
    }

    /// What the rendezvous of one collective on every device adds to the step.
    fn collective(self) -> f64 {
        if self.shared { self.devices * self.rendezvous } else { 0.0 }
    }
}

/// How many kernels a calibrated shared engine runs at once when `devices` devices share it (its
/// threads, when each device thread runs its own kernels; else 1, the devices' kernels queueing on its
/// pool), or `None` when the devices do not share one engine.
pub fn shared_engine_lanes(devices: u64, hw: &Hardware) -> Option<u64> {
    let engine = Engine::of(devices, hw);
    engine.shared.then_some(engine.lanes as u64)
}

/// What the simulation was run with, as reported.
struct Header {
    placement: String,
    placement_note: Option<String>,
    algorithm: String,
}

fn assemble(plan: &Plan, hw: &Hardware, options: Options, header: Header, tally: Tally) -> Simulation {
    let step = tally.compute + tally.exposed;
    let throughput = Throughput::of(plan, hw, step);
    let capacity = hw.memory_bytes();
    let peak = plan.memory.peak_bytes;
    Simulation {
        model: plan.model.clone(),
        hardware: hw.name.clone(),
        mesh: plan.mesh.to_string(),
        devices: plan.mesh.devices(),
        strategy: plan.strategy.name().to_string(),
        mode: if plan.mode == Mode::Train { "train" } else { "infer" }.to_string(),
        placement: header.placement,
        placement_note: header.placement_note,
        algorithm: header.algorithm,
        overlap: options.overlap,
        step_time_s: step,
        compute_s: tally.compute,
        overhead_s: tally.overhead,
        communication_s: tally.communication,
        exposed_communication_s: tally.exposed,
        hidden_communication_s: tally.communication - tally.exposed,
        communication: tally.by_group.into_values().collect(),
        memory: MemoryFit {
            peak_bytes_per_device: peak,
            capacity_bytes: capacity,
            fits: peak <= capacity,
            utilisation: peak as f64 / capacity as f64,
        },
        parameters: throughput.parameters,
        tokens_per_step: throughput.tokens,
        tokens_per_second: if step > 0.0 { throughput.tokens as f64 / step } else { 0.0 },
        flops_per_device: flops(plan),
        model_flops_per_step: throughput.model_flops,
        mfu: throughput.mfu,
    }
}

fn reason_kind(plan: &Plan, reason: u32) -> Option<&ReasonKind> {
    plan.reasons.get(reason as usize).map(|r| &r.kind)
}

/// Tokens, parameters and model FLOP utilisation of a step.
struct Throughput {
    parameters: u64,
    tokens: u64,
    model_flops: f64,
    mfu: f64,
}

impl Throughput {
    /// Model FLOPs are 6 N T for training and 2 N T for inference (N parameters, T tokens), over the
    /// peak of the dtype products run in on every device (bf16 in a bf16 plan, whose master weights are
    /// float32; else the parameters' dtype).
    fn of(plan: &Plan, hw: &Hardware, step: f64) -> Throughput {
        let parameters: u64 = plan.params.iter().map(|p| p.shape.iter().product::<u64>()).sum();
        let tokens = tokens_per_step(plan);
        let factor = if plan.mode == Mode::Train { 6.0 } else { 2.0 };
        let model_flops = factor * parameters as f64 * tokens as f64;
        let capacity = device_peak_flops(plan, hw) * plan.mesh.devices() as f64 * step;
        let mfu = if capacity > 0.0 { model_flops / capacity } else { 0.0 };
        Throughput { parameters, tokens, model_flops, mfu }
    }
}

/// The FLOP/s one device's model FLOP utilisation is measured against: the peak of the element type
/// its products run in (bf16 in a bf16 plan, whose master weights are float32; else the parameters').
pub fn device_peak_flops(plan: &Plan, hw: &Hardware) -> f64 {
    let dtype = match plan.precision {
        optimus_plan::Precision::Bf16 => DType::Bf16,
        optimus_plan::Precision::F32 => plan.params.first().map_or(DType::F32, |p| plan.buffer(p.buffer).dtype),
    };
    hw.peak_flops(dtype)
}

/// An update of several micro steps of a simulated plan, as `run --accum` runs it: every micro step's
/// kernels and communication but the optimizer steps and the replicas' gradient sums, which run once
/// (the sums beside the last micro step's backward pass, exposed as in the plain simulation).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Accumulated {
    pub step_s: f64,
    pub compute_s: f64,
    pub exposed_communication_s: f64,
    /// The exposed gradient sums over the replicas, in `exposed_communication_s`.
    pub data_parallel_s: f64,
}

/// `micro_steps` micro steps of `sim` with the optimizer (`optimizer_s` of its kernels) and the
/// replicas' gradient sums once ([`Accumulated`]).
pub fn accumulate(sim: &Simulation, optimizer_s: f64, micro_steps: u64) -> Accumulated {
    let a = micro_steps as f64;
    let data_parallel_s = gradient_sums_exposed_s(sim);
    let compute_s = a * (sim.compute_s - optimizer_s) + optimizer_s;
    let exposed_communication_s = a * (sim.exposed_communication_s - data_parallel_s) + data_parallel_s;
    Accumulated { step_s: compute_s + exposed_communication_s, compute_s, exposed_communication_s, data_parallel_s }
}

/// The seconds of a plan's optimizer steps, each at its kernel time.
pub fn optimizer_seconds(plan: &Plan, hw: &Hardware) -> f64 {
    plan.program
        .iter()
        .filter_map(|instr| match instr {
            Instr::Kernel { kernel: kernel @ Kernel::OptimizerStep, inputs, output, .. } => {
                let ins: Vec<&Buffer> = inputs.iter().map(|&b| plan.buffer(b)).collect();
                Some(kernel_time(kernel, &ins, plan.buffer(*output), hw))
            }
            _ => None,
        })
        .sum()
}

/// Exposed seconds of one micro step's gradient sums over the replicas: the all-reduces (or ZeRO-1's
/// reduce-scatters) of the data group, which `run --accum` issues once per update. ZeRO-1's
/// all-gathers of the weights happen in every micro step and are left with the rest.
pub fn gradient_sums_exposed_s(sim: &Simulation) -> f64 {
    let summed = |kind: &str| kind == CollectiveKind::AllReduce.name() || kind == CollectiveKind::ReduceScatter.name();
    sim.communication
        .iter()
        .filter(|c| c.group == Group::Data.name() && summed(&c.kind))
        .fold(0.0, |sum, c| sum + c.exposed_s)
}

/// Tokens in one step: the logical size of the `tokens` input (else the first input).
pub fn tokens_per_step(plan: &Plan) -> u64 {
    let input = plan.inputs.iter().find(|i| i.name == "tokens").or(plan.inputs.first());
    input.map_or(0, |i| i.shape.iter().product())
}
