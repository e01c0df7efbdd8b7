//! Times a pipeline schedule ([`optimus_plan::pipeline`]): each stage runs its passes in the schedule's
//! order, each pass as soon as its stage is free and its input has arrived (a forward needs the previous
//! virtual stage's forward of the same micro-batch, a backward the next one's backward, each plus a
//! point-to-point transfer). The result is the step's length, each stage's busy time, the bubble (the
//! idle share of the stages' time) and the micro-batches of activations each stage holds at its peak.

use optimus_plan::pipeline::{Op, Pass, Schedule, ScheduleError, stage_order};
use std::collections::HashMap;

/// What one stage's passes take, per chunk it holds (seconds).
#[derive(Clone, Debug, PartialEq)]
pub struct StageCost {
    pub forward_s: Vec<f64>,
    pub backward_s: Vec<f64>,
}

impl StageCost {
    /// A stage whose `chunks` chunks each take `forward_s` and `backward_s`.
    pub fn uniform(chunks: u64, forward_s: f64, backward_s: f64) -> StageCost {
        StageCost { forward_s: vec![forward_s; chunks as usize], backward_s: vec![backward_s; chunks as usize] }
    }
}

/// A timed schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// From the first forward to the last backward.
    pub step_s: f64,
    /// Each stage's time running passes.
    pub busy_s: Vec<f64>,
    /// 1 - (the stages' busy time) / (stages x step): the share of the pipeline's time it idles.
    pub bubble_fraction: f64,
    /// 1 - (the busiest stage's busy time) / step: how much of the pipeline's time its bottleneck
    /// stage idles, filling and draining; (P - 1) / (V m + P - 1) with equal stages, like
    /// `bubble_fraction`, which unequal stages raise and this one does not.
    pub bottleneck_bubble_fraction: f64,
    /// Each stage's most micro-batch chunks of activations alive at once (forwarded, not yet backward).
    pub peak_in_flight: Vec<u64>,
    /// Each stage's passes in the order it runs them, with when each starts and ends.
    pub passes: Vec<Vec<TimedPass>>,
}

/// One pass of a stage, placed in time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimedPass {
    pub op: Op,
    pub start_s: f64,
    pub end_s: f64,
}

/// Why a schedule cannot be timed.
#[derive(Clone, Debug, PartialEq)]
pub enum TimelineError {
    Schedule(ScheduleError),
    /// A stage waited for a pass no stage could run (a schedule that contradicts itself).
    Stuck {
        stage: usize,
        pass: Op,
    },
    /// `costs` must give every stage a time for each of its chunks.
    Costs {
        stages: usize,
        chunks: u64,
    },
}

impl std::fmt::Display for TimelineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TimelineError::Schedule(e) => write!(f, "{e}"),
            TimelineError::Stuck { stage, pass } => write!(f, "stage {stage} waits forever before {pass:?}"),
            TimelineError::Costs { stages, chunks } => {
                write!(
                    f,
                    "every one of the {stages} stages needs a forward and a backward time for each of its {chunks} chunks"
                )
            }
        }
    }
}

impl std::error::Error for TimelineError {}

/// Times `schedule` over `costs.len()` stages and `micro_batches` micro-batches, with `p2p_s` for every
/// transfer between consecutive virtual stages (none on one stage).
pub fn time_schedule(
    schedule: Schedule,
    micro_batches: u64,
    costs: &[StageCost],
    p2p_s: f64,
) -> Result<Timeline, TimelineError> {
    let stages = costs.len() as u64;
    let chunks = schedule.chunks();
    let fits = |c: &StageCost| c.forward_s.len() as u64 == chunks && c.backward_s.len() as u64 == chunks;
    if !costs.iter().all(fits) {
        return Err(TimelineError::Costs { stages: costs.len(), chunks });
    }
    let orders: Vec<Vec<Op>> = (0..stages)
        .map(|s| stage_order(schedule, stages, micro_batches, s))
        .collect::<Result<_, _>>()
        .map_err(TimelineError::Schedule)?;
    let ends = run(&orders, costs, stages * chunks, p2p_s)?;
    let step_s = ends.values().copied().fold(0.0, f64::max);
    let busy_s: Vec<f64> = costs
        .iter()
        .map(|c| micro_batches as f64 * (c.forward_s.iter().sum::<f64>() + c.backward_s.iter().sum::<f64>()))
        .collect();
    let busy: f64 = busy_s.iter().sum();
    // Idle shares are never below zero; rounding left one stage's at -1e-16 (printed "-0.0%").
    let bubble_fraction = if step_s > 0.0 { (1.0 - busy / (stages as f64 * step_s)).max(0.0) } else { 0.0 };
    let busiest = busy_s.iter().copied().fold(0.0, f64::max);
    let bottleneck_bubble_fraction = if step_s > 0.0 { (1.0 - busiest / step_s).max(0.0) } else { 0.0 };
    let peak_in_flight = orders.iter().map(|order| peak_alive(order)).collect();
    let passes = orders
        .iter()
        .enumerate()
        .map(|(s, order)| {
            order
                .iter()
                .map(|&op| {
                    let end_s =
                        ends.get(&(op.pass, op.chunk * stages + s as u64, op.micro_batch)).copied().unwrap_or(0.0);
                    let cost = &costs[s];
                    let took = match op.pass {
                        Pass::Forward => cost.forward_s[op.chunk as usize],
                        Pass::Backward => cost.backward_s[op.chunk as usize],
                    };
                    TimedPass { op, start_s: end_s - took, end_s }
                })
                .collect()
        })
        .collect();
    Ok(Timeline { step_s, busy_s, bubble_fraction, bottleneck_bubble_fraction, peak_in_flight, passes })
}

/// A pass of virtual stage `virtual_stage` on micro-batch `micro_batch`.
type PassKey = (Pass, u64, u64);

/// Runs every stage's passes in order, each as early as its stage and its input allow: the end time
/// of every pass, keyed by (pass, virtual stage, micro-batch). `virtual_stages` is stages x chunks.
fn run(
    orders: &[Vec<Op>],
    costs: &[StageCost],
    virtual_stages: u64,
    p2p_s: f64,
) -> Result<HashMap<PassKey, f64>, TimelineError> {
    let (stages, last_virtual) = (orders.len() as u64, virtual_stages - 1);
    let mut ends: HashMap<PassKey, f64> = HashMap::new();
    let mut next = vec![0usize; orders.len()];
    let mut free = vec![0.0f64; orders.len()];
    loop {
        let mut progressed = false;
        for (s, order) in orders.iter().enumerate() {
            while let Some(op) = order.get(next[s]) {
                let virtual_stage = op.chunk * stages + s as u64;
                let ready = match input_of(op, virtual_stage, last_virtual) {
                    None => 0.0,
                    Some((pass, from)) => match ends.get(&(pass, from, op.micro_batch)) {
                        Some(&end) if from != virtual_stage => end + p2p_s,
                        Some(&end) => end,
                        None => break,
                    },
                };
                let cost = &costs[s];
                let chunk = op.chunk as usize;
                let took = if op.pass == Pass::Forward { cost.forward_s[chunk] } else { cost.backward_s[chunk] };
                let end = free[s].max(ready) + took;
                free[s] = end;
                ends.insert((op.pass, virtual_stage, op.micro_batch), end);
                next[s] += 1;
                progressed = true;
            }
        }
        if !progressed {
            let waiting = orders.iter().enumerate().find_map(|(s, order)| order.get(next[s]).map(|&pass| (s, pass)));
            return match waiting {
                Some((stage, pass)) => Err(TimelineError::Stuck { stage, pass }),
                None => Ok(ends),
            };
        }
    }
}

/// The pass whose output `op` (on `virtual_stage`) waits for: the forward of the virtual stage before,
/// the backward of the one after, or (the last virtual stage's backward) its own forward; `None` for
/// the first virtual stage's forward, which reads the inputs.
fn input_of(op: &Op, virtual_stage: u64, last_virtual: u64) -> Option<(Pass, u64)> {
    match op.pass {
        Pass::Forward if virtual_stage > 0 => Some((Pass::Forward, virtual_stage - 1)),
        Pass::Backward if virtual_stage < last_virtual => Some((Pass::Backward, virtual_stage + 1)),
        Pass::Backward => Some((Pass::Forward, virtual_stage)),
        Pass::Forward => None,
    }
}

/// Cores shared by every stage's devices: the threads of one process on one CPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SharedCores {
    /// Devices of each stage (threads, each running its own passes).
    pub stage_devices: u64,
    /// Kernels the cores run at once.
    pub cores: u64,
}

/// The seconds of a pipeline's passes when every stage's devices share `shared.cores` cores: each
/// pass costs core-seconds (the work of its stage's devices), every runnable device thread gets an
/// equal share of the cores but never more than one, and a pass starts once its stage is free and its
/// input has come (`p2p_s` after the pass that sends it). Stages then run side by side only as far as
/// the cores allow: with more device threads than cores, a stage's bubble is another stage's time.
pub fn time_shared_schedule(
    schedule: Schedule,
    micro_batches: u64,
    costs: &[StageCost],
    p2p_s: f64,
    shared: SharedCores,
) -> Result<f64, TimelineError> {
    let stages = costs.len() as u64;
    let chunks = schedule.chunks();
    let orders: Vec<Vec<Op>> = (0..stages)
        .map(|s| stage_order(schedule, stages, micro_batches, s))
        .collect::<Result<_, _>>()
        .map_err(TimelineError::Schedule)?;
    let last_virtual = stages * chunks - 1;
    let cost_of = |s: usize, op: &Op| {
        let cost = &costs[s];
        let chunk = op.chunk as usize;
        let took = if op.pass == Pass::Forward { cost.forward_s.get(chunk) } else { cost.backward_s.get(chunk) };
        took.copied().ok_or(TimelineError::Costs { stages: costs.len(), chunks })
    };
    let mut ends: HashMap<PassKey, f64> = HashMap::new();
    let mut next = vec![0usize; orders.len()];
    let mut running: Vec<Option<f64>> = vec![None; orders.len()];
    let mut now = 0.0f64;
    loop {
        let mut wake = f64::INFINITY;
        for (s, order) in orders.iter().enumerate() {
            let Some(op) = order.get(next[s]).filter(|_| running[s].is_none()) else { continue };
            let virtual_stage = op.chunk * stages + s as u64;
            let ready = match input_of(op, virtual_stage, last_virtual) {
                None => Some(0.0),
                Some((pass, from)) => ends
                    .get(&(pass, from, op.micro_batch))
                    .map(|&end| if from != virtual_stage { end + p2p_s } else { end }),
            };
            match ready {
                Some(at) if at <= now => running[s] = Some(cost_of(s, op)?),
                Some(at) => wake = wake.min(at),
                None => {}
            }
        }
        let active = running.iter().filter(|r| r.is_some()).count();
        if active == 0 {
            if wake.is_finite() {
                now = wake;
                continue;
            }
            let waiting = orders.iter().enumerate().find_map(|(s, order)| order.get(next[s]).map(|&pass| (s, pass)));
            return match waiting {
                Some((stage, pass)) => Err(TimelineError::Stuck { stage, pass }),
                None => Ok(now),
            };
        }
        // Core-seconds a second for each running stage.
        let devices = shared.stage_devices.max(1) as f64;
        let rate = devices * (shared.cores.max(1) as f64 / (devices * active as f64)).min(1.0);
        let first_done = running.iter().flatten().map(|left| left / rate).fold(f64::INFINITY, f64::min);
        let step = first_done.min(wake - now);
        now += step;
        for (s, slot) in running.iter_mut().enumerate() {
            let Some(left) = slot.as_mut() else { continue };
            *left -= rate * step;
            if *left <= 1e-12 * rate.max(1.0) {
                let op = orders[s][next[s]];
                ends.insert((op.pass, op.chunk * stages + s as u64, op.micro_batch), now);
                next[s] += 1;
                *slot = None;
            }
        }
    }
}

/// The most micro-batch chunks forwarded and not yet backward at any point of `order`.
fn peak_alive(order: &[Op]) -> u64 {
    let mut alive = 0i64;
    let mut peak = 0i64;
    for op in order {
        alive += if op.pass == Pass::Forward { 1 } else { -1 };
        peak = peak.max(alive);
    }
    peak as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uniform(schedule: Schedule, stages: u64, m: u64, (f, b): (f64, f64)) -> Timeline {
        let v = schedule.chunks();
        let costs = vec![StageCost::uniform(v, f / v as f64, b / v as f64); stages as usize];
        match time_schedule(schedule, m, &costs, 0.0) {
            Ok(t) => t,
            Err(e) => panic!("{schedule:?} P={stages} m={m}: {e}"),
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    fn shared(schedule: Schedule, stages: u64, m: u64, (f, b): (f64, f64), cores: SharedCores) -> f64 {
        let v = schedule.chunks();
        let costs = vec![StageCost::uniform(v, f / v as f64, b / v as f64); stages as usize];
        match time_shared_schedule(schedule, m, &costs, 0.0, cores) {
            Ok(t) => t,
            Err(e) => panic!("{schedule:?} P={stages} m={m}: {e}"),
        }
    }

    #[test]
    fn stages_with_a_core_each_run_as_on_their_own_devices() {
        // One device a stage and a core for each: the ordinary timeline, bubble included.
        for (schedule, p, m) in [(Schedule::OneFOneB, 2, 4), (Schedule::GPipe, 4, 8), (Schedule::OneFOneB, 4, 4)] {
            let alone = uniform(schedule, p, m, (1.0, 2.0)).step_s;
            let cores = SharedCores { stage_devices: 1, cores: p };
            assert!(close(shared(schedule, p, m, (1.0, 2.0), cores), alone), "{schedule:?} P={p} m={m}");
        }
    }

    #[test]
    fn stages_sharing_too_few_cores_take_their_work_over_the_cores() {
        // 1F1B on 2 stages of one device each and one core: the work of both, one after the other.
        let one = SharedCores { stage_devices: 1, cores: 1 };
        assert!(close(shared(Schedule::OneFOneB, 2, 4, (1.0, 2.0), one), 2.0 * 4.0 * 3.0));
        // Two stages of 2 devices on 2 cores: a pass alone runs at full speed (2 cores for its 2
        // devices, half its core-seconds in seconds); the bubble leaves no core idle, so the step is the
        // whole work over 2 cores.
        let two = SharedCores { stage_devices: 2, cores: 2 };
        assert!(close(shared(Schedule::OneFOneB, 2, 4, (1.0, 2.0), two), 2.0 * 4.0 * 3.0 / 2.0));
        // Two one-device stages on two cores: as the ordinary timeline ((m + P - 1) (f + b)).
        let pair = SharedCores { stage_devices: 1, cores: 2 };
        assert!(close(shared(Schedule::OneFOneB, 2, 4, (1.0, 2.0), pair), 5.0 * 3.0));
    }

    #[test]
    fn one_f_one_b_and_gpipe_take_m_plus_p_minus_1_passes_and_their_bubble_is_the_formula() {
        for schedule in [Schedule::OneFOneB, Schedule::GPipe] {
            for p in 1..=8u64 {
                for m in 1..=16u64 {
                    let t = uniform(schedule, p, m, (1.0, 2.0));
                    let (pf, mf) = (p as f64, m as f64);
                    assert!(close(t.step_s, (mf + pf - 1.0) * 3.0), "{schedule:?} P={p} m={m}: {}", t.step_s);
                    let formula = (pf - 1.0) / (mf + pf - 1.0);
                    assert!(close(t.bubble_fraction, formula), "{schedule:?} P={p} m={m}: {}", t.bubble_fraction);
                    assert!(close(t.bottleneck_bubble_fraction, formula), "{schedule:?} P={p} m={m}");
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_keeps_at_most_p_minus_s_micro_batches_where_gpipe_keeps_them_all() {
        for (p, m) in [(4u64, 8u64), (4, 2), (8, 32), (2, 1)] {
            let one_f_one_b = uniform(Schedule::OneFOneB, p, m, (1.0, 2.0));
            let gpipe = uniform(Schedule::GPipe, p, m, (1.0, 2.0));
            for s in 0..p {
                assert_eq!(one_f_one_b.peak_in_flight[s as usize], (p - s).min(m), "P={p} m={m} s={s}");
                assert_eq!(gpipe.peak_in_flight[s as usize], m);
            }
        }
    }

    #[test]
    fn interleaving_divides_the_bubble_by_the_chunks() {
        for v in [2u64, 3, 4] {
            for p in [2u64, 4, 8] {
                for m in [p, 2 * p, 4 * p] {
                    let t = uniform(Schedule::Interleaved { chunks: v }, p, m, (1.0, 2.0));
                    let (pf, mf, vf) = (p as f64, m as f64, v as f64);
                    assert!(
                        close(t.step_s, (mf + (pf - 1.0) / vf) * 3.0),
                        "V={v} P={p} m={m}: step {} against {}",
                        t.step_s,
                        (mf + (pf - 1.0) / vf) * 3.0
                    );
                    let formula = (pf - 1.0) / (vf * mf + pf - 1.0);
                    assert!(close(t.bubble_fraction, formula), "V={v} P={p} m={m}: {}", t.bubble_fraction);
                    assert!(close(t.bottleneck_bubble_fraction, formula), "V={v} P={p} m={m}");
                    // Megatron's warm-up: 2 (P - s - 1) + (V - 1) P forwards, then one more before the
                    // first backward.
                    for s in 0..p {
                        let warm = (2 * (p - s - 1) + (v - 1) * p + 1).min(m * v);
                        assert_eq!(t.peak_in_flight[s as usize], warm, "V={v} P={p} m={m} s={s}");
                    }
                }
            }
        }
    }

    #[test]
    fn transfers_and_a_slow_stage_lengthen_the_step() {
        let even = vec![StageCost::uniform(1, 1.0, 2.0); 4];
        let base = time_schedule(Schedule::OneFOneB, 8, &even, 0.0).expect("valid");
        let with_p2p = time_schedule(Schedule::OneFOneB, 8, &even, 0.1).expect("valid");
        assert!(with_p2p.step_s > base.step_s);
        let mut slow = even.clone();
        slow[2] = StageCost::uniform(1, 2.0, 4.0);
        let uneven = time_schedule(Schedule::OneFOneB, 8, &slow, 0.0).expect("valid");
        assert!(uneven.step_s >= 8.0 * 6.0, "the slowest stage bounds the step: {}", uneven.step_s);
        let wrong = time_schedule(Schedule::Interleaved { chunks: 2 }, 8, &even, 0.0)
            .expect_err("one time a stage for two chunks");
        assert_eq!(wrong, TimelineError::Costs { stages: 4, chunks: 2 });
    }
}
