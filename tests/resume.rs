//! Checkpoints in training runs, end to end: a run stopped and resumed equals one that never stopped
//! (bit for bit on the same mesh, within 1e-5 on another mesh or strategy), an interrupt finishes the
//! step and leaves a checkpoint to resume from, `kill -9` at any moment never leaves a checkpoint that
//! loads wrongly, a flipped byte is an error naming its file, and bad flag combinations are usage errors.

mod common;

use common::{interrupt_after_first_step, optimusc, read_weights, text};
use optimus::io::shards::Checkpoint;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// A fresh folder for one test's files.
fn scratch(name: &str) -> PathBuf {
    common::scratch("resume", name)
}

/// Settings every run of a comparison shares: dropout on, AdamW with a cosine schedule and warm-up,
/// clipping and two micro-batches, so that every piece of training state must be restored. AdamW's eps
/// is 1e-4, as in scripts/hf_compare.py: with 1e-8, float32 rounding noise in gradients that are
/// analytically zero (the attention key bias) is divided by ~eps and differs between meshes by more
/// than 1e-5, whatever the checkpoint does.
const TRAINING: [&str; 18] = [
    "--eps",
    "0.0001",
    "--seed",
    "11",
    "--set",
    "pdrop=0.1",
    "--lr-schedule",
    "cosine",
    "--warmup-steps",
    "2",
    "--min-lr",
    "0.0001",
    "--clip-grad-norm",
    "0.5",
    "--accum",
    "2",
    "--lr",
    "0.01",
];

/// Runs tiny.opt for `steps` updates in total with the shared settings and `extra` flags; returns the
/// train records (step, loss) and asserts success.
fn train(mesh: &[&str], steps: u64, extra: &[&str]) -> Vec<(u64, f32)> {
    let steps = steps.to_string();
    let mut args = vec!["run", "examples/tiny.opt", "--json", "--steps", &steps];
    args.extend_from_slice(mesh);
    args.extend_from_slice(&TRAINING);
    args.extend_from_slice(extra);
    let out = optimusc(&args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    records(&String::from_utf8_lossy(&out.stdout))
}

fn records(stdout: &str) -> Vec<(u64, f32)> {
    stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON line"))
        .filter(|r| r.get("loss").is_some())
        .map(|r| (r["step"].as_u64().expect("step"), r["loss"].as_f64().expect("loss") as f32))
        .collect()
}

const TWO_BY_TWO: &[&str] = &["--mesh", "2x2"];

#[test]
fn a_run_resumed_on_the_same_mesh_is_bit_identical_to_one_that_never_stopped() {
    let dir = scratch("same-mesh");
    let (whole, resumed) = (dir.join("whole.safetensors"), dir.join("resumed.safetensors"));
    let ckpt = dir.join("ckpt");
    let uninterrupted = train(TWO_BY_TWO, 6, &["--save-weights", text(&whole)]);
    // The same run, checkpointing every 3 updates; then resumed from the one after update 3.
    let first = train(TWO_BY_TWO, 6, &["--checkpoint-dir", text(&ckpt), "--checkpoint-every", "3"]);
    assert_eq!(first, uninterrupted, "checkpointing changes nothing");
    let after_3 = ckpt.join("step-00000003");
    // The folder holds the checkpoint after update 6 too: the resumed run writes into another one.
    let again = dir.join("again");
    let rest = train(
        TWO_BY_TWO,
        6,
        &["--resume", text(&after_3), "--checkpoint-dir", text(&again), "--save-weights", text(&resumed)],
    );
    assert_eq!(rest, uninterrupted[3..], "steps 3..5 keep their numbers and losses, bit for bit");
    assert_eq!(read_weights(&resumed), read_weights(&whole), "final weights bit-identical");
}

#[test]
fn a_checkpoint_resumes_on_other_meshes_and_strategies() {
    let dir = scratch("other-mesh");
    let whole = dir.join("whole.safetensors");
    let uninterrupted = train(TWO_BY_TWO, 6, &["--save-weights", text(&whole)]);
    let reference = read_weights(&whole);
    // The same run, checkpointing after updates 3 and 6 and keeping only the newest; then again keeping both.
    let newest = dir.join("newest");
    train(TWO_BY_TWO, 6, &["--checkpoint-dir", text(&newest), "--checkpoint-every", "3", "--keep", "1"]);
    let kept: Vec<_> = std::fs::read_dir(&newest).expect("dir").flatten().map(|e| e.file_name()).collect();
    let kept: Vec<_> = kept.into_iter().filter(|name| name != ".optimusc.lock").collect();
    assert_eq!(kept, vec![std::ffi::OsString::from("step-00000006")], "--keep 1 keeps only the newest");
    let ckpt = dir.join("ckpt");
    train(TWO_BY_TWO, 6, &["--checkpoint-dir", text(&ckpt), "--checkpoint-every", "3"]);
    let after_3 = ckpt.join("step-00000003");
    let meshes: [&[&str]; 5] = [
        &["--mesh", "4x4"],
        &["--mesh", "1x4", "--strategy", "megatron"],
        &["--mesh", "1x1", "--strategy", "none"],
        &["--mesh", "2x2x2", "--strategy", "tesseract"],
        &["--mesh", "2x2x2", "--strategy", "3d"],
    ];
    for mesh in meshes {
        let name = format!("{}-{}", mesh[1], mesh[mesh.len() - 1]);
        let out = dir.join(format!("resumed-{name}.safetensors"));
        let folder = dir.join(format!("resumed-{name}"));
        let rest = train(
            mesh,
            6,
            &["--resume", text(&after_3), "--checkpoint-dir", text(&folder), "--save-weights", text(&out)],
        );
        assert_eq!(rest.iter().map(|r| r.0).collect::<Vec<_>>(), vec![3, 4, 5]);
        for ((_, a), (_, b)) in rest.iter().zip(&uninterrupted[3..]) {
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{mesh:?}: losses {rest:?} vs {uninterrupted:?}");
        }
        for ((name, a), (_, b)) in read_weights(&out).iter().zip(&reference) {
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
            let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(diff <= 1e-5 * scale, "{mesh:?}: {name} differs by {diff} (scale {scale})");
        }
    }
}

#[test]
fn a_tesseract_checkpoint_resumes_on_a_flat_grid() {
    let dir = scratch("tesseract");
    let tesseract: &[&str] = &["--mesh", "2x2x2", "--strategy", "tesseract"];
    let whole = dir.join("whole.safetensors");
    let uninterrupted = train(TWO_BY_TWO, 5, &["--save-weights", text(&whole)]);
    let ckpt = dir.join("ckpt");
    let first = train(tesseract, 5, &["--checkpoint-dir", text(&ckpt), "--checkpoint-every", "2"]);
    for ((_, a), (_, b)) in first.iter().zip(&uninterrupted) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "tesseract {first:?} vs 2x2 {uninterrupted:?}");
    }
    let resumed = dir.join("resumed.safetensors");
    let again = dir.join("again");
    let after_2 = ckpt.join("step-00000002");
    let rest = train(
        TWO_BY_TWO,
        5,
        &["--resume", text(&after_2), "--checkpoint-dir", text(&again), "--save-weights", text(&resumed)],
    );
    assert_eq!(rest.iter().map(|r| r.0).collect::<Vec<_>>(), vec![2, 3, 4]);
    for ((_, a), (_, b)) in rest.iter().zip(&uninterrupted[2..]) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "resumed {rest:?} vs {uninterrupted:?}");
    }
    for ((name, a), (_, b)) in read_weights(&resumed).iter().zip(&read_weights(&whole)) {
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff <= 1e-5 * scale, "{name} differs by {diff} (scale {scale})");
    }
}

#[test]
fn an_interrupt_finishes_the_step_writes_a_checkpoint_and_says_how_to_resume() {
    let dir = scratch("interrupt");
    let ckpt = dir.join("ckpt");
    let whole = dir.join("whole.safetensors");
    train(TWO_BY_TWO, 60, &["--save-weights", text(&whole)]);
    let mut args = vec!["run", "examples/tiny.opt", "--json", "--steps", "60", "--checkpoint-dir", text(&ckpt)];
    args.extend_from_slice(TWO_BY_TWO);
    args.extend_from_slice(&TRAINING);
    let run = interrupt_after_first_step(&args);
    let stderr = &run.stderr;
    assert_eq!(run.code, Some(130), "{stderr}");
    assert!(stderr.contains("--resume"), "{stderr}");
    let done = records(&run.rest).last().map_or(1, |r| r.0 + 1);
    assert!(done < 60, "the run stopped early ({done} updates)");
    let checkpoint = Checkpoint::open(&ckpt).expect("a checkpoint was written");
    assert_eq!(checkpoint.step(), done, "the checkpoint is after the last finished step");
    let resumed = dir.join("resumed.safetensors");
    train(TWO_BY_TWO, 60, &["--resume", text(&ckpt), "--save-weights", text(&resumed)]);
    assert_eq!(read_weights(&resumed), read_weights(&whole), "interrupted and resumed equals uninterrupted");
}

#[test]
fn kill_9_at_any_moment_never_leaves_a_checkpoint_that_loads_wrongly() {
    let dir = scratch("kill9");
    let mut loaded = 0;
    // A deterministic spread of moments, from before the first checkpoint to deep into the run.
    for (round, delay_ms) in [40u64, 130, 220, 310, 450, 700].into_iter().enumerate() {
        let ckpt = dir.join(format!("ckpt{round}"));
        let mut args = vec!["run", "examples/tiny.opt", "--steps", "400", "--checkpoint-dir", text(&ckpt)];
        args.extend_from_slice(&["--checkpoint-every", "1", "--keep", "2"]);
        args.extend_from_slice(TWO_BY_TWO);
        args.extend_from_slice(&TRAINING);
        let mut child = Command::new(env!("CARGO_BIN_EXE_optimusc"))
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn");
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        if !ckpt.exists() {
            continue;
        }
        match Checkpoint::open(&ckpt) {
            Ok(checkpoint) => {
                checkpoint.verify().unwrap_or_else(|e| panic!("round {round}: the latest checkpoint is bad: {e}"));
                let steps = (checkpoint.step() + 1).to_string();
                let out = optimusc(&[
                    "run",
                    "examples/tiny.opt",
                    "--mesh",
                    "2x2",
                    "--steps",
                    &steps,
                    "--resume",
                    text(&ckpt),
                    "--seed",
                    "11",
                    "--accum",
                    "2",
                    "--set",
                    "pdrop=0.1",
                ]);
                assert!(out.status.success(), "round {round}: {}", String::from_utf8_lossy(&out.stderr));
                loaded += 1;
            }
            Err(e) => assert!(e.to_string().contains("no checkpoint in"), "round {round}: {e}"),
        }
    }
    assert!(loaded >= 3, "only {loaded} of the kills came after a checkpoint: the moments are too early");
}

/// A checkpoint's files are readable alike: the devices' safetensors files (which the safetensors crate
/// writes through an owner-only temporary file) have the permissions of its manifest.
fn every_file_has_the_manifests_permissions(step: &std::path::Path, files: &[PathBuf]) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |path: &std::path::Path| std::fs::metadata(path).expect("metadata").permissions().mode() & 0o777;
        let manifest = mode(&step.join("manifest.json"));
        for file in files {
            assert_eq!(mode(file), manifest, "{}", file.display());
        }
    }
    #[cfg(not(unix))]
    let _ = (step, files);
}

#[test]
fn a_flipped_byte_in_any_checkpoint_file_is_an_error_naming_it() {
    let dir = scratch("flipped");
    let ckpt = dir.join("ckpt");
    train(TWO_BY_TWO, 2, &["--checkpoint-dir", text(&ckpt), "--checkpoint-every", "1"]);
    let step = ckpt.join("step-00000001");
    let other = dir.join("other");
    let files: Vec<PathBuf> = std::fs::read_dir(&step).expect("dir").flatten().map(|e| e.path()).collect();
    assert!(files.len() >= 2, "{files:?}");
    every_file_has_the_manifests_permissions(&step, &files);
    for file in files {
        let original = std::fs::read(&file).expect("read");
        let mut flipped = original.clone();
        let at = original.len() / 2;
        flipped[at] ^= 0x10;
        std::fs::write(&file, &flipped).expect("write");
        let out = optimusc(&[
            "run",
            "examples/tiny.opt",
            "--mesh",
            "2x2",
            "--steps",
            "2",
            "--resume",
            text(&step),
            "--checkpoint-dir",
            text(&other),
            "--seed",
            "11",
            "--accum",
            "2",
        ]);
        std::fs::write(&file, &original).expect("restore");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let name = file.file_name().and_then(|n| n.to_str()).expect("name");
        assert!(!out.status.success(), "{name}: a flipped byte was accepted");
        assert!(stderr.contains(name), "{name}: {stderr}");
    }
}

#[test]
fn checkpoint_flags_are_checked_before_running() {
    let dir = scratch("usage");
    let ckpt = dir.join("ckpt");
    train(TWO_BY_TWO, 2, &["--checkpoint-dir", text(&ckpt)]);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--steps", "4", "--checkpoint-every", "2"], "--checkpoint-dir"),
        (vec!["--steps", "4", "--keep", "2"], "--checkpoint-dir"),
        (vec!["--steps", "4", "--resume", text(&ckpt), "--weights", text(&ckpt)], "--weights"),
        (vec!["--steps", "4", "--resume", text(&ckpt), "--seed", "12", "--accum", "2"], "seed"),
        (vec!["--steps", "2", "--resume", text(&ckpt), "--seed", "11", "--accum", "2"], "--steps"),
        (vec!["--steps", "4", "--resume", text(&dir)], "no checkpoint in"),
        (vec!["--steps", "4", "--checkpoint-dir", "examples/tiny.opt"], "not a directory"),
        (vec!["--steps", "4", "--mode", "infer", "--checkpoint-dir", text(&dir)], "--mode train"),
    ];
    for (flags, wanted) in cases {
        let mut args = vec!["run", "examples/tiny.opt", "--mesh", "2x2"];
        args.extend_from_slice(&flags);
        let out = optimusc(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(matches!(out.status.code(), Some(1 | 2)), "{flags:?}: {stderr}");
        assert!(stderr.contains(wanted), "{flags:?}: {stderr}");
    }
}

/// Links left or planted under a checkpoint folder are removed or renamed themselves, never followed:
/// a staging link of the next step, a `.old` link of a replaced step, and a finished-step link that
/// `--keep` prunes all point at a folder that must come through untouched.
#[test]
fn links_under_the_checkpoint_folder_are_never_followed() {
    let dir = scratch("links");
    let ckpt = dir.join("ckpt");
    train(TWO_BY_TWO, 2, &["--checkpoint-dir", text(&ckpt), "--checkpoint-every", "1"]);
    let victim = dir.join("victim");
    std::fs::create_dir_all(&victim).expect("victim");
    std::fs::write(victim.join("manifest.json"), "not ours").expect("write");
    std::fs::write(victim.join("keep.txt"), "keep").expect("write");
    std::fs::remove_dir_all(ckpt.join("step-00000001")).expect("remove");
    for name in ["step-00000001", "step-00000003.tmp", "step-00000003.old"] {
        std::os::unix::fs::symlink(&victim, ckpt.join(name)).expect("symlink");
    }
    let resume = ["--resume", text(&ckpt), "--checkpoint-dir", text(&ckpt), "--checkpoint-every", "1", "--keep", "1"];
    train(TWO_BY_TWO, 4, &resume);
    assert_eq!(std::fs::read_to_string(victim.join("manifest.json")).expect("kept"), "not ours");
    assert_eq!(std::fs::read_to_string(victim.join("keep.txt")).expect("kept"), "keep");
    let mut names: Vec<String> = std::fs::read_dir(&ckpt)
        .expect("dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, [".optimusc.lock", "step-00000004"], "every link was removed, none followed");
    assert!(!std::fs::symlink_metadata(ckpt.join("step-00000004")).expect("meta").file_type().is_symlink());
    assert_eq!(Checkpoint::open(&ckpt).expect("opens").step(), 4);
}

/// A run holds its checkpoint folder: a second run on it is a usage error naming the holder.
#[test]
fn two_runs_never_share_a_checkpoint_folder() {
    let dir = scratch("lock");
    let ckpt = dir.join("ckpt");
    let held = optimus::io::shards::lock_checkpoint_dir(&ckpt).expect("locks");
    let out = optimusc(&["run", "examples/tiny.opt", "--steps", "2", "--checkpoint-dir", text(&ckpt)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("in use by another run") && stderr.contains(&format!("pid {}", std::process::id())),
        "{stderr}"
    );
    assert!(!ckpt.join("step-00000002").exists(), "nothing was written");
    drop(held);
    train(TWO_BY_TWO, 2, &["--checkpoint-dir", text(&ckpt)]);
    assert_eq!(Checkpoint::open(&ckpt).expect("opens").step(), 2);
}

/// A run never writes into a folder holding checkpoints of later updates than its own start (they would
/// mix, and `--resume DIR` would continue the other run); `--resume` alone keeps checkpointing into the
/// folder of the checkpoint it resumes.
#[test]
fn checkpoints_of_two_histories_never_mix_and_resume_keeps_its_folder() {
    let dir = scratch("histories");
    let ckpt = dir.join("ckpt");
    train(TWO_BY_TWO, 4, &["--checkpoint-dir", text(&ckpt), "--checkpoint-every", "2"]);
    let after_2 = ckpt.join("step-00000002");
    for extra in [vec!["--resume", text(&after_2)], vec!["--checkpoint-dir", text(&ckpt)]] {
        let mut args = vec!["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "6"];
        args.extend_from_slice(&TRAINING);
        args.extend_from_slice(&extra);
        let out = optimusc(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains("later updates") && stderr.contains("update 4"), "{extra:?}: {stderr}");
    }
    assert_eq!(Checkpoint::open(&ckpt).expect("opens").step(), 4, "nothing was written");
    // The advice names a checkpoint that can be resumed: not the latest when its manifest is damaged.
    let manifest = ckpt.join("step-00000004").join("manifest.json");
    let kept = std::fs::read(&manifest).expect("read");
    std::fs::write(&manifest, b"garbage").expect("damage");
    let mut args = vec!["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "6"];
    args.extend_from_slice(&TRAINING);
    args.extend_from_slice(&["--checkpoint-dir", text(&ckpt)]);
    let out = optimusc(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let earlier = format!("--resume {}", after_2.display());
    assert!(stderr.contains(&earlier) && stderr.contains("the latest cannot be read"), "{stderr}");
    std::fs::write(&manifest, kept).expect("restore");
    // A checkpoint resumed with another model file is told as that, not as other settings.
    let other = optimusc(&["run", "examples/gpt2.opt", "--steps", "6", "--mesh", "2x2", "--resume", text(&ckpt)]);
    let stderr = String::from_utf8_lossy(&other.stderr);
    assert_eq!(other.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is a checkpoint of model `tiny`, and this run's model is `gpt2`"), "{stderr}");
    // So it is with a flag that differs too, and with a plan of another model: the model comes first.
    let with_flag = ["run", "examples/gpt2.opt", "--steps", "6", "--mesh", "2x2", "--seed", "5", "--resume"];
    let plan = ckpt.parent().expect("a parent").join("gpt2-plan.json");
    let compiled = optimusc(&["compile", "examples/gpt2.opt", "--set", "layers=1", "--mesh", "2x2", "-o", text(&plan)]);
    assert!(compiled.status.success(), "{}", String::from_utf8_lossy(&compiled.stderr));
    let with_plan = ["run", text(&plan), "--steps", "6", "--resume"];
    for args in [&with_flag[..], &with_plan[..]] {
        let other = optimusc(&[args, &[text(&ckpt)]].concat());
        let stderr = String::from_utf8_lossy(&other.stderr);
        assert_eq!(other.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("is a checkpoint of model `tiny`, and this run's model is `gpt2`"), "{stderr}");
        assert!(!stderr.contains("other settings") && !stderr.contains("disagree"), "{stderr}");
    }
    train(TWO_BY_TWO, 6, &["--resume", text(&ckpt)]);
    assert_eq!(Checkpoint::open(&ckpt).expect("opens").step(), 6, "the resumed run checkpointed into its folder");
}

/// A run resumed with nothing but `--resume` (and its mesh) continues as it was trained: the data file,
/// the optimizer, the schedule, clipping, accumulation, the seed, the `--set` values and `--steps` come
/// from the checkpoint, and the records and weights are those of the run that never stopped. A flag
/// given with another value is refused, naming both, unless `--allow-changes`.
#[test]
fn a_run_resumed_without_its_flags_continues_as_it_was_trained() {
    let dir = scratch("no-flags");
    let data = dir.join("tokens.u16");
    let ids: Vec<u8> = (0..8192u32).map(|i| ((i * 7 + i / 13) % 101) as u16).flat_map(u16::to_le_bytes).collect();
    std::fs::write(&data, ids).expect("tokens");
    let whole = dir.join("whole.safetensors");
    let uninterrupted = train(TWO_BY_TWO, 6, &["--data", text(&data), "--save-weights", text(&whole)]);
    let ckpt = dir.join("ckpt");
    train(TWO_BY_TWO, 6, &["--data", text(&data), "--checkpoint-dir", text(&ckpt), "--checkpoint-every", "3"]);
    let after_3 = ckpt.join("step-00000003");
    let resumed = dir.join("resumed.safetensors");
    let again = dir.join("again");
    let base = ["run", "examples/tiny.opt", "--json", "--mesh", "2x2", "--resume", text(&after_3)];
    let out = optimusc(&[&base[..], &["--checkpoint-dir", text(&again), "--save-weights", text(&resumed)]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("continuing with the checkpoint's") && stderr.contains("--data"), "{stderr}");
    assert!(!stderr.contains("no --data"), "the recorded data file is used: {stderr}");
    assert_eq!(records(&String::from_utf8_lossy(&out.stdout)), uninterrupted[3..], "records bit for bit");
    assert_eq!(read_weights(&resumed), read_weights(&whole), "final weights bit-identical");
    let changed = optimusc(&[&base[..], &["--checkpoint-dir", text(&dir.join("changed")), "--lr", "0.02"]].concat());
    let stderr = String::from_utf8_lossy(&changed.stderr);
    assert_eq!(changed.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--lr 0.02") && stderr.contains("0.01") && stderr.contains("--allow-changes"), "{stderr}");
    let same_value = optimusc(&[&base[..], &["--checkpoint-dir", text(&dir.join("same")), "--lr", "1e-2"]].concat());
    assert!(
        same_value.status.success(),
        "the same value spelled otherwise: {}",
        String::from_utf8_lossy(&same_value.stderr)
    );
    let allowed_dir = dir.join("allowed");
    let allowed = [&base[..], &["--checkpoint-dir", text(&allowed_dir), "--lr", "0.02", "--allow-changes"]].concat();
    let out = optimusc(&allowed);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_ne!(records(&String::from_utf8_lossy(&out.stdout)), uninterrupted[3..], "the new rate is used");
}

/// `--set` is compared name by name: a resumed run that sets a value the checkpoint left to the model
/// file, to the value it had, keeps the checkpoint's other `--set`s (`pdrop=0.1`) and runs as the run
/// that never stopped; another value is refused naming it, and with `--allow-changes` it changes that
/// value alone. The seed, `--accum` and `--optimizer` are refused even with `--allow-changes`, and the
/// refusal does not suggest it.
#[test]
fn set_values_are_compared_name_by_name_on_resume() {
    let dir = scratch("sets");
    let ckpt = dir.join("ckpt");
    let uninterrupted = train(TWO_BY_TWO, 4, &[]);
    train(TWO_BY_TWO, 4, &["--checkpoint-dir", text(&ckpt), "--checkpoint-every", "2"]);
    let after_2 = ckpt.join("step-00000002");
    let base = ["run", "examples/tiny.opt", "--json", "--mesh", "2x2", "--resume", text(&after_2)];
    let run_with = |name: &str, extra: &[&str]| {
        let folder = dir.join(name);
        optimusc(&[&base[..], &["--checkpoint-dir", text(&folder)], extra].concat())
    };
    // tiny.opt's batch is 8 and its eps 0.00001: the same values, however spelled, change nothing.
    let same = run_with("same", &["--set", "batch=8", "--set", "eps=1e-5"]);
    let stderr = String::from_utf8_lossy(&same.stderr);
    assert!(same.status.success(), "{stderr}");
    assert!(stderr.contains("continuing with the checkpoint's") && stderr.contains("--set pdrop=0.1"), "{stderr}");
    assert_eq!(records(&String::from_utf8_lossy(&same.stdout)), uninterrupted[2..], "records bit for bit");
    // Another value of a name the checkpoint did not set, and of one it did.
    for (set, says) in [
        ("eps=0.001", "--set eps=0.001 (the checkpoint has eps=0.00001)"),
        ("pdrop=0.2", "--set pdrop=0.2 (the checkpoint has pdrop=0.1)"),
    ] {
        let changed = run_with(set, &["--set", set]);
        let stderr = String::from_utf8_lossy(&changed.stderr);
        assert_eq!(changed.status.code(), Some(2), "{set}: {stderr}");
        assert!(stderr.contains(says) && stderr.contains("--allow-changes"), "{set}: {stderr}");
    }
    // The last --set of a name counts; a name the model does not have is the compiler's error to give.
    let last = run_with("last", &["--set", "pdrop=0.2", "--set", "pdrop=0.1"]);
    assert!(last.status.success(), "{}", String::from_utf8_lossy(&last.stderr));
    let unknown = run_with("unknown", &["--set", "pdorp=0.1"]);
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    assert_eq!(unknown.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("pdrop") && !stderr.contains("--allow-changes"), "{stderr}");
    let allowed = run_with("allowed", &["--set", "eps=0.001", "--allow-changes"]);
    let stderr = String::from_utf8_lossy(&allowed.stderr);
    assert!(allowed.status.success(), "{stderr}");
    assert!(stderr.contains("--set pdrop=0.1"), "the other --set is kept: {stderr}");
    for fixed in [&["--seed", "3"][..], &["--accum", "1"], &["--optimizer", "sgd"]] {
        let refused = run_with("fixed", &[fixed, &["--allow-changes"]].concat());
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{fixed:?}: {stderr}");
        assert!(stderr.contains(fixed[0]) && stderr.contains("must be those it was trained with"), "{stderr}");
        assert!(stderr.contains("--allow-changes does not change them"), "{fixed:?}: {stderr}");
    }
}

/// The precision is recorded too: a bf16 run resumed without `--precision` goes on in bf16, and asking
/// for f32 instead is refused unless `--allow-changes`.
#[test]
fn a_resumed_run_keeps_its_precision() {
    let dir = scratch("precision");
    let ckpt = dir.join("ckpt");
    let bf16 = ["--precision", "bf16"];
    let whole = train(TWO_BY_TWO, 4, &bf16);
    train(TWO_BY_TWO, 4, &[&bf16[..], &["--checkpoint-dir", text(&ckpt), "--checkpoint-every", "2"]].concat());
    let after_2 = ckpt.join("step-00000002");
    let base = ["run", "examples/tiny.opt", "--json", "--mesh", "2x2", "--resume", text(&after_2)];
    let resumed = optimusc(&[&base[..], &["--checkpoint-dir", text(&dir.join("again"))]].concat());
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert!(resumed.status.success() && stderr.contains("--precision bf16"), "{stderr}");
    assert_eq!(records(&String::from_utf8_lossy(&resumed.stdout)), whole[2..], "bf16 records bit for bit");
    let f32 = optimusc(&[&base[..], &["--checkpoint-dir", text(&dir.join("f32")), "--precision", "f32"]].concat());
    assert_eq!(f32.status.code(), Some(2), "{}", String::from_utf8_lossy(&f32.stderr));
}

/// The model a checkpoint trained is the model it resumes: a model file edited since (another eps), or a
/// plan compiled with other heads, is refused naming the values, unless `--allow-changes`.
#[test]
fn a_model_changed_since_the_checkpoint_is_refused() {
    let dir = scratch("model-changed");
    let model = dir.join("tiny.opt");
    let source = std::fs::read_to_string("examples/tiny.opt").expect("tiny.opt");
    std::fs::write(&model, &source).expect("a copy of tiny.opt");
    let ckpt = dir.join("ckpt");
    let first = ["run", text(&model), "--mesh", "2x2", "--steps", "2", "--checkpoint-dir", text(&ckpt)];
    assert!(optimusc(&first).status.success());
    let edited = source.replace("eps     = 0.00001", "eps     = 0.1");
    assert_ne!(edited, source, "tiny.opt sets eps as this test expects");
    std::fs::write(&model, edited).expect("the edited model");
    let resume = |input: &str, name: &str, extra: &[&str]| {
        let folder = dir.join(name);
        let args = ["run", input, "--mesh", "2x2", "--steps", "4", "--resume", text(&ckpt), "--checkpoint-dir"];
        optimusc(&[&args[..], &[text(&folder)], extra].concat())
    };
    let out = resume(text(&model), "edited", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("other config values: eps 0.1 (the checkpoint has 0.00001)"), "{stderr}");
    assert!(resume(text(&model), "allowed", &["--allow-changes"]).status.success());
    std::fs::write(&model, &source).expect("the model as trained");
    let plan = dir.join("heads.json");
    let compiled = optimusc(&["compile", text(&model), "--mesh", "2x2", "--set", "heads=4", "-o", text(&plan)]);
    assert!(compiled.status.success(), "{}", String::from_utf8_lossy(&compiled.stderr));
    let out = resume(text(&plan), "plan", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("heads 4 (the checkpoint has 8)"), "{stderr}");
    assert!(resume(text(&model), "as-trained", &[]).status.success());
}

/// A checkpoint knows its data file by where it was and what it held: resumed from another working
/// directory it reads that file (not one at the same relative path there), the same file named another
/// way or copied elsewhere is accepted, another file or the file changed in place is refused.
#[test]
fn a_resumed_run_reads_the_data_it_trained_on_whatever_the_working_directory() {
    let dir = scratch("data-identity");
    let (home, elsewhere) = (dir.join("home"), dir.join("elsewhere"));
    for folder in [&home, &elsewhere] {
        std::fs::create_dir_all(folder.join("data")).expect("a folder");
        std::fs::copy("examples/tiny.opt", folder.join("tiny.opt")).expect("a copy of tiny.opt");
    }
    let tokens = |seed: u32| -> Vec<u8> {
        (0..8192u32).map(|i| ((i * 7 + i / 13 + seed) % 101) as u16).flat_map(u16::to_le_bytes).collect()
    };
    std::fs::write(home.join("data/tokens.u16"), tokens(0)).expect("tokens");
    std::fs::write(elsewhere.join("data/tokens.u16"), tokens(5)).expect("other tokens, same name");
    let run_in = |cwd: &std::path::Path, args: &[&str]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_optimusc"));
        command.current_dir(cwd).args(["run", "tiny.opt", "--json", "--mesh", "2x2", "--steps", "4"]).args(args);
        command.output().expect("optimusc runs")
    };
    let whole = run_in(&home, &["--data", "data/tokens.u16"]);
    assert!(whole.status.success(), "{}", String::from_utf8_lossy(&whole.stderr));
    let uninterrupted = records(&String::from_utf8_lossy(&whole.stdout));
    let ckpt = dir.join("ckpt");
    let first = ["--data", "data/tokens.u16", "--checkpoint-dir", text(&ckpt), "--checkpoint-every", "2"];
    assert!(run_in(&home, &first).status.success());
    let after_2 = ckpt.join("step-00000002");
    let resume = |cwd: &std::path::Path, name: &str, extra: &[&str]| {
        let folder = dir.join(name);
        run_in(cwd, &[&["--resume", text(&after_2), "--checkpoint-dir", text(&folder)], extra].concat())
    };
    let out = resume(&elsewhere, "elsewhere", &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(records(&String::from_utf8_lossy(&out.stdout)), uninterrupted[2..], "the trained file, bit for bit");
    let copy = elsewhere.join("copy.u16");
    std::fs::copy(home.join("data/tokens.u16"), &copy).expect("a copy of the data");
    let absolute = home.join("data/tokens.u16");
    for (name, data, cwd) in [("dot", "./data/tokens.u16", &home), ("absolute", text(&absolute), &elsewhere)] {
        let out = resume(cwd, name, &["--data", data]);
        assert!(out.status.success(), "{data}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let out = resume(&elsewhere, "copy", &["--data", text(&copy)]);
    assert!(out.status.success(), "a copy: {}", String::from_utf8_lossy(&out.stderr));
    let out = resume(&elsewhere, "other", &["--data", "data/tokens.u16"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("another file than the checkpoint's"), "{stderr}");
    std::fs::write(home.join("data/tokens.u16"), tokens(9)).expect("the data changed in place");
    let out = resume(&home, "changed", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("changed after the checkpoint trained on it"), "{stderr}");
    assert!(resume(&home, "changed-allowed", &["--allow-changes"]).status.success());
}

/// A flag given with the value the run would take anyway is no change: AdamW's weight decay of 0.01,
/// SGD's of 0, float32, a decay floor of 0.
#[test]
fn defaults_given_explicitly_on_resume_are_no_change() {
    let dir = scratch("defaults");
    for (optimizer, extra, defaults) in [
        (
            "adamw",
            &["--lr-schedule", "cosine"][..],
            &["--weight-decay", "0.01", "--precision", "f32", "--min-lr", "0"][..],
        ),
        ("sgd", &[][..], &["--weight-decay", "0", "--precision", "f32"][..]),
    ] {
        let ckpt = dir.join(optimizer);
        let base = ["run", "examples/tiny.opt", "--optimizer", optimizer, "--checkpoint-dir", text(&ckpt)];
        let first = optimusc(&[&base[..], &["--steps", "2"], extra].concat());
        assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
        let again = dir.join(format!("{optimizer}-again"));
        let args = ["run", "examples/tiny.opt", "--steps", "3", "--resume", text(&ckpt), "--checkpoint-dir"];
        let out = optimusc(&[&args[..], &[text(&again)], defaults].concat());
        assert!(out.status.success(), "{optimizer} {defaults:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// Outputs that would corrupt a checkpoint, or make a folder mean two things, are refused before step 0:
/// `--save-weights` or `--log` inside the checkpoint resumed from, a Hugging Face save into a folder of
/// checkpoints, and the two outputs on one file. A folder that holds both a save and checkpoints is not
/// read as either by `--weights`.
#[test]
fn outputs_that_would_corrupt_a_checkpoint_are_refused() {
    let dir = scratch("outputs-into-checkpoints");
    let ckpt = dir.join("ckpt");
    assert!(
        optimusc(&["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "2", "--checkpoint-dir", text(&ckpt)])
            .status
            .success()
    );
    let step = ckpt.join("step-00000002");
    let (shard, manifest) = (step.join("device-0-0.safetensors"), step.join("manifest.json"));
    let before = (std::fs::read(&shard).expect("a shard"), std::fs::read(&manifest).expect("the manifest"));
    let resume = ["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "4", "--resume", text(&ckpt)];
    for (flag, output, says) in [
        ("--save-weights", text(&shard), "lies in the checkpoint folder"),
        ("--log", text(&manifest), "lies in the checkpoint folder"),
        ("--save-weights", text(&ckpt), "lies in the checkpoint folder"),
        ("--save-weights", text(&step), "lies in the checkpoint folder"),
    ] {
        let again = dir.join("again");
        let out = optimusc(&[&resume[..], &["--checkpoint-dir", text(&again), flag, output]].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {output}: {stderr}");
        assert!(stderr.contains(says), "{flag} {output}: {stderr}");
    }
    assert_eq!(
        (std::fs::read(&shard).expect("a shard"), std::fs::read(&manifest).expect("the manifest")),
        before,
        "the checkpoint is untouched"
    );
    // Not resumed from either: a save into a folder of checkpoints, or into one checkpoint.
    for folder in [&ckpt, &step] {
        let out = optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--save-weights", text(folder)]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("holds training checkpoints"), "{stderr}");
    }
    let log = dir.join("run.jsonl");
    let same =
        optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--save-weights", text(&log), "--log", text(&log)]);
    assert_eq!(same.status.code(), Some(2), "{}", String::from_utf8_lossy(&same.stderr));
    // A save beside checkpoints (copied in by hand): --weights names neither.
    let both = dir.join("both");
    let saved = optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--save-weights", &format!("{}/", text(&both))]);
    assert!(saved.status.success(), "{}", String::from_utf8_lossy(&saved.stderr));
    let copied = std::process::Command::new("cp").arg("-r").arg(&step).arg(&both).status().expect("cp runs");
    assert!(copied.success());
    let out = optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--weights", text(&both)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("holds both a Hugging Face save"), "{stderr}");
}

/// A checkpoint's folder name, its manifest's step and its training record's step are one: a folder
/// renamed to a later update is refused (it would be taken for the latest and resume update 2's state
/// as update 9's), naming the name to give it back.
#[test]
fn a_renamed_checkpoint_folder_is_refused() {
    let dir = scratch("renamed");
    let ckpt = dir.join("ckpt");
    let first = ["run", "examples/tiny.opt", "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir"];
    assert!(optimusc(&[&first[..], &[text(&ckpt)]].concat()).status.success());
    std::fs::rename(ckpt.join("step-00000002"), ckpt.join("step-00000009")).expect("renamed");
    let out = optimusc(&["run", "examples/tiny.opt", "--steps", "6", "--resume", text(&ckpt)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("the checkpoint of update 2, in a folder named for update 9"), "{stderr}");
    assert!(stderr.contains("`step-00000002`") && stderr.contains("step-00000004"), "{stderr}");
}

/// A checkpoint that cannot be written on a mesh of several devices is reported with its cause, by the
/// device that writes it, not as another device's consequence.
#[test]
fn a_checkpoint_that_cannot_be_written_says_why() {
    use std::io::{BufRead, BufReader};
    let dir = scratch("unwritable");
    let ckpt = dir.join("ckpt");
    let mut child = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "100000", "--json", "--checkpoint-every", "1"])
        .arg("--checkpoint-dir")
        .arg(&ckpt)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("optimusc starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().expect("a first record").expect("a line");
    assert!(first.contains("\"step\""), "{first}");
    std::fs::remove_dir_all(&ckpt).expect("the folder removed");
    std::fs::write(&ckpt, "in the way").expect("a file in its place");
    lines.for_each(drop);
    let out = child.wait_with_output().expect("optimusc ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    // Whichever checkpoint came first after the folder went (the run may have written more before).
    let cause = format!(": cannot create checkpoint directory `{}`", text(&ckpt));
    assert!(stderr.contains("error: device (0, 0) failed: checkpoint after step "), "{stderr}");
    assert!(stderr.contains(&cause) && stderr.contains("(os error"), "{stderr}");
}
