//! Checkpoints of pipelined runs: a pipeline writes the checkpoint its unpipelined plan would (the
//! same files, the same manifest), any run resumes from it at another pipeline depth, schedule, mesh
//! or strategy (or none) with the losses and final weights of a run that never stopped, and an
//! interrupt stops every stage after the same step and leaves a checkpoint to resume from.

mod common;

use common::{interrupt_after_first_step, optimusc, read_weights, text};
use optimus::io::shards::Checkpoint;
use std::path::{Path, PathBuf};

fn scratch(name: &str) -> PathBuf {
    common::scratch("pipeline-checkpoints", name)
}

/// Every run's settings: four layers (so pipelines of 2 and 4 stages fit), dropout on, AdamW with a
/// cosine schedule, clipping and four micro-batches, so that every piece of training state counts.
const TRAINING: [&str; 20] = [
    "examples/tiny.opt",
    "--json",
    "--set",
    "layers=4",
    "--set",
    "pdrop=0.1",
    "--seed",
    "13",
    "--eps",
    "0.0001",
    "--lr-schedule",
    "cosine",
    "--warmup-steps",
    "2",
    "--clip-grad-norm",
    "0.5",
    "--accum",
    "4",
    "--lr",
    "0.01",
];

/// Six updates, checkpointed after the third.
const SIX_STEPS: [&str; 4] = ["--steps", "6", "--checkpoint-every", "3"];

/// Runs `optimusc run` with the shared settings and `extra`; returns the (step, loss) records.
fn train(extra: &[&str]) -> Vec<(u64, f64)> {
    let args: Vec<&str> = ["run"].iter().chain(&TRAINING).chain(extra).copied().collect();
    let out = optimusc(&args);
    assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
    records(&String::from_utf8_lossy(&out.stdout))
}

fn records(stdout: &str) -> Vec<(u64, f64)> {
    stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON line"))
        .filter(|r| r.get("loss").is_some())
        .map(|r| (r["step"].as_u64().expect("step"), r["loss"].as_f64().expect("loss")))
        .collect()
}

/// The largest difference between two runs' tensors, relative to the larger of 1e-2 and the tensor's
/// largest magnitude.
fn weights_difference(got: &Path, want: &Path) -> f32 {
    let (got, want) = (read_weights(got), read_weights(want));
    assert_eq!(got.iter().map(|t| &t.0).collect::<Vec<_>>(), want.iter().map(|t| &t.0).collect::<Vec<_>>());
    let mut worst = 0.0f32;
    for ((name, a), (_, b)) in got.iter().zip(&want) {
        assert_eq!(a.len(), b.len(), "{name}");
        let scale = b.iter().fold(1e-2f32, |m, v| m.max(v.abs()));
        worst = a.iter().zip(b).fold(worst, |w, (x, y)| w.max((x - y).abs() / scale));
    }
    worst
}

fn assert_losses(got: &[(u64, f64)], want: &[(u64, f64)], what: &str) {
    assert_eq!(got.iter().map(|r| r.0).collect::<Vec<_>>(), want.iter().map(|r| r.0).collect::<Vec<_>>(), "{what}");
    for ((step, a), (_, b)) in got.iter().zip(want) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{what}: step {step}: {a} vs {b}");
    }
}

#[test]
fn a_pipelined_checkpoint_is_the_unpipelined_plans_and_resumes_at_any_depth() {
    let dir = scratch("depths");
    let (plain_dir, piped_dir) = (dir.join("plain"), dir.join("piped"));
    let whole = dir.join("whole.safetensors");
    let every = SIX_STEPS;
    let plain = train(
        &[&["--mesh", "2x2", "--checkpoint-dir", text(&plain_dir), "--save-weights", text(&whole)][..], &every]
            .concat(),
    );
    let piped =
        train(&[&["--mesh", "2x2", "--pipeline", "2", "--checkpoint-dir", text(&piped_dir)][..], &every].concat());
    assert_losses(&piped, &plain, "pipelined 2x2 against unpipelined");

    // The same checkpoint: every file's tensors (parameters and AdamW moments) and the manifest's
    // training record and step.
    let (a, b) = (plain_dir.join("step-00000003"), piped_dir.join("step-00000003"));
    for device in ["0-0", "0-1", "1-0", "1-1"] {
        let file = format!("device-{device}.safetensors");
        let difference = weights_difference(&b.join(&file), &a.join(&file));
        assert!(difference <= 1e-6, "{file}: {difference}");
    }
    let (ca, cb) = (Checkpoint::open(&a).expect("plain checkpoint"), Checkpoint::open(&b).expect("piped checkpoint"));
    assert_eq!(cb.step(), ca.step());

    // Resumed from the pipelined checkpoint without a pipeline on another mesh, at 4 stages of megatron
    // 1x2 under GPipe; and from the unpipelined one as an interleaved pipeline of one-device stages.
    let resumes: [(&Path, &[&str]); 3] = [
        (&b, &["--mesh", "1x1", "--strategy", "none"]),
        (&b, &["--mesh", "1x2", "--strategy", "megatron", "--pipeline", "4", "--pipeline-schedule", "gpipe"]),
        (&a, &["--mesh", "1x1", "--strategy", "none", "--pipeline", "2", "--pipeline-schedule", "interleaved"]),
    ];
    for (k, (from, flags)) in resumes.into_iter().enumerate() {
        let (weights, folder) = (dir.join(format!("resumed-{k}.safetensors")), dir.join(format!("resumed-{k}")));
        let resumed = train(
            &[
                flags,
                &SIX_STEPS,
                &["--resume", text(from), "--checkpoint-dir", text(&folder), "--save-weights", text(&weights)],
            ]
            .concat(),
        );
        assert_losses(&resumed, &plain[3..], &format!("resumed with {flags:?}"));
        let difference = weights_difference(&weights, &whole);
        assert!(difference <= 1e-5, "resumed with {flags:?}: weights differ by {difference}");
    }
}

#[test]
fn an_interrupt_stops_every_stage_after_the_step_and_leaves_a_checkpoint() {
    let dir = scratch("interrupt");
    let (folder, whole, resumed) = (dir.join("ckpt"), dir.join("whole.safetensors"), dir.join("resumed.safetensors"));
    let pipeline = ["--mesh", "1x2", "--strategy", "megatron", "--pipeline", "2", "--steps", "300"];
    train(&[&pipeline[..], &["--save-weights", text(&whole)]].concat());
    let args: Vec<&str> =
        ["run"].iter().chain(&TRAINING).chain(&pipeline).chain(&["--checkpoint-dir", text(&folder)]).copied().collect();
    let run = interrupt_after_first_step(&args);
    let stderr = &run.stderr;
    assert_eq!(run.code, Some(130), "{stderr}");
    assert!(stderr.contains("--resume"), "{stderr}");
    let done = records(&run.rest).last().map_or(1, |r| r.0 + 1);
    assert!(done < 300, "the run stopped early ({done} updates)");
    let checkpoint = Checkpoint::open(&folder).expect("a checkpoint was written");
    assert_eq!(checkpoint.step(), done, "the checkpoint is after the last finished step");
    train(&[&pipeline[..], &["--resume", text(&folder), "--save-weights", text(&resumed)]].concat());
    assert_eq!(read_weights(&resumed), read_weights(&whole), "interrupted and resumed equals uninterrupted");
}
