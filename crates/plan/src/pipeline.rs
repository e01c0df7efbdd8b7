//! Pipeline schedules: the order in which each pipeline stage runs the forward and backward passes of
//! its micro-batches, for GPipe, 1F1B and interleaved 1F1B (Narayanan et al., SC 2021).
//!
//! A pipeline of `stages` devices (P) runs `micro_batches` (m) micro-batches through the model, cut
//! into `stages x chunks` contiguous pieces: stage s holds the chunks c = 0 .. V-1, model piece
//! (virtual stage) c P + s, so a micro-batch visits stage 0, 1, .., P-1 once per chunk. GPipe and 1F1B
//! have one chunk a stage (V = 1); the interleaved schedule has V >= 2.
//!
//! - GPipe runs every forward, then every backward: all m micro-batches' activations are alive at once.
//! - 1F1B (PipeDream-Flush) runs P - s - 1 forwards to fill the pipeline, then alternates one forward
//!   and one backward, then drains: stage s keeps at most P - s micro-batches of activations.
//! - Interleaved 1F1B does the same over the V m (chunk, micro-batch) pairs, in groups of P
//!   micro-batches per chunk; it needs m to be a multiple of P.
//!
//! These are orders only; `optimus_cost::pipeline` times them.

use serde::Serialize;
use std::fmt;

/// Which pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Schedule {
    GPipe,
    OneFOneB,
    /// Interleaved 1F1B with this many model chunks on every stage (2 or more).
    Interleaved {
        chunks: u64,
    },
}

impl Schedule {
    /// "gpipe", "1f1b" or "interleaved", as `--pipeline-schedule` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Interleaved { .. } => "interleaved",
        }
    }

    /// Model chunks on every stage (V).
    pub fn chunks(self) -> u64 {
        match self {
            Schedule::GPipe | Schedule::OneFOneB => 1,
            Schedule::Interleaved { chunks } => chunks,
        }
    }
}

/// A forward or a backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pass {
    Forward,
    Backward,
}

/// One pass of one micro-batch through one of a stage's chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Op {
    pub pass: Pass,
    pub micro_batch: u64,
    pub chunk: u64,
}

/// Why a schedule cannot be made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScheduleError {
    NoStages,
    NoMicroBatches,
    /// Interleaving needs at least two chunks a stage.
    TooFewChunks(u64),
    /// Interleaving takes the micro-batches P at a time.
    MicroBatchesNotMultiple {
        micro_batches: u64,
        stages: u64,
    },
    /// A stage the pipeline does not have.
    NoSuchStage {
        stage: u64,
        stages: u64,
    },
}

impl fmt::Display for ScheduleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleError::NoStages => write!(f, "a pipeline needs at least one stage"),
            ScheduleError::NoMicroBatches => write!(f, "a pipeline needs at least one micro-batch"),
            ScheduleError::TooFewChunks(v) => {
                write!(f, "the interleaved schedule needs 2 or more virtual stages per device, not {v}")
            }
            ScheduleError::NoSuchStage { stage, stages } => {
                write!(f, "stage {stage} of a pipeline of {stages} stages (they are numbered from 0)")
            }
            ScheduleError::MicroBatchesNotMultiple { micro_batches, stages } => write!(
                f,
                "the interleaved schedule takes micro-batches {stages} at a time (one per stage): {micro_batches} \
                 micro-batches are not a multiple of {stages} stages"
            ),
        }
    }
}

impl std::error::Error for ScheduleError {}

/// The passes stage `stage` of `stages` runs, in order, for `micro_batches` micro-batches.
pub fn stage_order(schedule: Schedule, stages: u64, micro_batches: u64, stage: u64) -> Result<Vec<Op>, ScheduleError> {
    check(schedule, stages, micro_batches)?;
    if stage >= stages {
        return Err(ScheduleError::NoSuchStage { stage, stages });
    }
    let (p, m, s) = (stages, micro_batches, stage);
    let op = |pass, micro_batch, chunk| Op { pass, micro_batch, chunk };
    Ok(match schedule {
        Schedule::GPipe => {
            (0..m).map(|k| op(Pass::Forward, k, 0)).chain((0..m).map(|k| op(Pass::Backward, k, 0))).collect()
        }
        Schedule::OneFOneB => one_f_one_b(m, (p - s - 1).min(m), |k| (k, 0), |k| (k, 0)),
        Schedule::Interleaved { chunks: v } => {
            // The k-th forward of this stage: chunk (k / P) mod V of micro-batch P (k / (P V)) + k mod P;
            // backwards walk the chunks the other way.
            let forward = |k: u64| ((k / (p * v)) * p + k % p, (k / p) % v);
            let backward = |k: u64| ((k / (p * v)) * p + k % p, v - 1 - (k / p) % v);
            let warmup = ((p - s - 1) * 2 + (v - 1) * p).min(m * v);
            one_f_one_b(m * v, warmup, forward, backward)
        }
    })
}

/// `total` forwards and backwards: `warmup` forwards, then one forward and one backward in turn, then
/// the backwards left; `forward(k)` and `backward(k)` give the k-th one's (micro-batch, chunk).
fn one_f_one_b(
    total: u64,
    warmup: u64,
    forward: impl Fn(u64) -> (u64, u64),
    backward: impl Fn(u64) -> (u64, u64),
) -> Vec<Op> {
    let f = |k| {
        let (micro_batch, chunk) = forward(k);
        Op { pass: Pass::Forward, micro_batch, chunk }
    };
    let b = |k| {
        let (micro_batch, chunk) = backward(k);
        Op { pass: Pass::Backward, micro_batch, chunk }
    };
    let mut order: Vec<Op> = (0..warmup).map(f).collect();
    for k in 0..total - warmup {
        order.push(f(warmup + k));
        order.push(b(k));
    }
    order.extend((total - warmup..total).map(b));
    order
}

fn check(schedule: Schedule, stages: u64, micro_batches: u64) -> Result<(), ScheduleError> {
    if stages == 0 {
        return Err(ScheduleError::NoStages);
    }
    if micro_batches == 0 {
        return Err(ScheduleError::NoMicroBatches);
    }
    if let Schedule::Interleaved { chunks } = schedule {
        if chunks < 2 {
            return Err(ScheduleError::TooFewChunks(chunks));
        }
        if !micro_batches.is_multiple_of(stages) {
            return Err(ScheduleError::MicroBatchesNotMultiple { micro_batches, stages });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    const SCHEDULES: [Schedule; 4] =
        [Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved { chunks: 2 }, Schedule::Interleaved { chunks: 3 }];

    #[test]
    fn every_stage_runs_each_pass_of_each_micro_batch_and_chunk_once_forward_first() {
        for schedule in SCHEDULES {
            for p in 1..=6 {
                for m in (1..=12).filter(|m| schedule.chunks() == 1 || m % p == 0) {
                    for s in 0..p {
                        let order = stage_order(schedule, p, m, s).expect("a valid schedule");
                        let unique: BTreeSet<Op> = order.iter().copied().collect();
                        assert_eq!(unique.len(), order.len(), "{schedule:?} P={p} m={m} s={s}: a pass twice");
                        assert_eq!(order.len() as u64, 2 * m * schedule.chunks());
                        for (k, op) in order.iter().enumerate() {
                            assert!(op.micro_batch < m && op.chunk < schedule.chunks(), "{op:?}");
                            if op.pass == Pass::Backward {
                                let forward = Op { pass: Pass::Forward, ..*op };
                                assert!(order[..k].contains(&forward), "{schedule:?} P={p} m={m} s={s}: {op:?}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_fills_with_the_stages_after_it() {
        let order = stage_order(Schedule::OneFOneB, 4, 8, 0).expect("valid");
        let warmup = order.iter().take_while(|o| o.pass == Pass::Forward).count();
        assert_eq!(warmup, 4, "P - s - 1 forwards, then the steady state's first forward");
        let last = stage_order(Schedule::OneFOneB, 4, 8, 3).expect("valid");
        assert_eq!((last[0].pass, last[1].pass), (Pass::Forward, Pass::Backward), "the last stage alternates at once");
    }

    #[test]
    fn impossible_schedules_say_why() {
        assert_eq!(stage_order(Schedule::GPipe, 0, 4, 0), Err(ScheduleError::NoStages));
        assert_eq!(stage_order(Schedule::OneFOneB, 2, 0, 0), Err(ScheduleError::NoMicroBatches));
        assert_eq!(stage_order(Schedule::Interleaved { chunks: 1 }, 2, 4, 0), Err(ScheduleError::TooFewChunks(1)));
        assert_eq!(stage_order(Schedule::OneFOneB, 4, 8, 4), Err(ScheduleError::NoSuchStage { stage: 4, stages: 4 }));
        let uneven =
            stage_order(Schedule::Interleaved { chunks: 2 }, 4, 6, 0).expect_err("6 micro-batches on 4 stages");
        assert!(uneven.to_string().contains("not a multiple of 4"), "{uneven}");
    }
}
