//! `optimusc run` and `verify` refuse what would train on nonsense or do nothing silently: numbers out
//! of range, compile flags that disagree with a plan, a non-finite loss, and a device thread that hangs.

mod common;

use common::file_names;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

fn scratch(name: &str) -> PathBuf {
    let dir = common::process_dir("run-guards");
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn hyperparameters_out_of_range_are_usage_errors_naming_the_flag() {
    let cases: &[(&str, &str)] = &[
        ("--lr", "nan"),
        ("--lr", "-1"),
        ("--lr", "inf"),
        ("--beta1", "1.5"),
        ("--beta1", "1"),
        ("--beta2", "-1"),
        ("--eps", "-1"),
        ("--momentum", "nan"),
        ("--weight-decay", "inf"),
        ("--timeout", "1e300"),
        ("--timeout", "0"),
        ("--steps", "0"),
    ];
    for (flag, value) in cases {
        let assignment = format!("{flag}={value}");
        let out = optimusc(&["run", "examples/tiny.opt", "--steps", "1", &assignment]);
        assert_eq!(out.status.code(), Some(2), "run {assignment}: {}", stderr(&out));
        assert!(stderr(&out).contains(flag), "run {assignment} names the flag: {}", stderr(&out));
    }
    for (flag, value) in [("--lr", "nan"), ("--momentum", "-0.5"), ("--tolerance", "nan"), ("--steps", "0")] {
        let assignment = format!("{flag}={value}");
        let out = optimusc(&["verify", "examples/tiny.opt", &assignment]);
        assert_eq!(out.status.code(), Some(2), "verify {assignment}: {}", stderr(&out));
        assert!(stderr(&out).contains(flag), "verify {assignment} names the flag: {}", stderr(&out));
    }
}

/// `--max-shard-size` without a folder to shard into (`--save-weights FILE`, or no --save-weights) is a
/// usage error before step 0, rather than ignored.
#[test]
fn a_shard_size_without_a_folder_to_shard_is_refused() {
    let file = scratch("one-file.safetensors");
    let _ = std::fs::remove_file(&file);
    let file_arg = file.to_str().expect("utf-8").to_string();
    for extra in [&["--save-weights", &file_arg][..], &[]] {
        let mut args = vec!["run", "examples/tiny.opt", "--steps", "1", "--max-shard-size", "1KB"];
        args.extend_from_slice(extra);
        let out = optimusc(&args);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {}", stderr(&out));
        assert!(stderr(&out).contains("--max-shard-size sizes the shards of --save-weights DIR/"), "{}", stderr(&out));
        assert!(!file.exists(), "nothing saved");
    }
}

/// Weights trained with another configuration of the same shapes (other `heads`) load with a warning
/// naming what differs, from a checkpoint (its recorded config values) and from a saved folder (its
/// config.json); the same configuration, or another dropout, loads without one.
#[test]
fn weights_trained_with_other_heads_load_with_a_warning() {
    let dir = scratch("other-heads");
    let _ = std::fs::remove_dir_all(&dir);
    let (folder, checkpoints) = (format!("{}/w/", dir.display()), dir.join("ck"));
    let checkpoints = checkpoints.to_str().expect("utf-8");
    // GPT-2 small enough to train a step, so that the folder has a config.json.
    let gpt2 = [
        "run",
        "examples/gpt2.opt",
        "--steps",
        "1",
        "--set",
        "layers=1",
        "--set",
        "hidden=32",
        "--set",
        "vocab=64",
        "--set",
        "context=16",
        "--set",
        "seq=8",
        "--set",
        "batch=2",
    ];
    let trained = optimusc(
        &[&gpt2[..], &["--set", "heads=4", "--save-weights", &folder, "--checkpoint-dir", checkpoints]].concat(),
    );
    assert!(trained.status.success(), "{}", stderr(&trained));
    let load = |from: &str, sets: &[&str]| {
        let out = optimusc(&[&gpt2[..], &["--weights", from], sets].concat());
        assert!(out.status.success(), "{}", stderr(&out));
        stderr(&out)
    };
    let warned = load(checkpoints, &["--set", "heads=2"]);
    assert!(warned.contains("holds weights trained with heads 4 (this model: 2)"), "{warned}");
    let warned = load(&folder, &["--set", "heads=2"]);
    assert!(warned.contains("holds weights trained with n_head 4 (this model: 2)"), "{warned}");
    for from in [checkpoints, &folder] {
        let quiet = load(from, &["--set", "heads=4", "--set", "pdrop=0.2"]);
        assert!(!quiet.contains("holds weights trained with"), "{quiet}");
    }
}

/// `--shuffle` on a token file shorter than one window says there is nothing to shuffle.
#[test]
fn shuffling_less_than_one_window_says_so() {
    let data = scratch("eight.u16");
    token_file(&data, &[1, 2, 3, 4, 5, 6, 7, 8]);
    let out =
        optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--data", data.to_str().expect("utf-8"), "--shuffle"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("fewer than one window of 9 (seq + 1): there is nothing to shuffle"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn compile_flags_given_with_a_plan_must_agree_with_it() {
    let plan = scratch("tiny-2x2.json");
    let plan_arg = plan.to_str().expect("utf-8 path");
    let out = optimusc(&["compile", "examples/tiny.opt", "--mesh", "2x2", "-o", plan_arg]);
    assert!(out.status.success(), "{}", stderr(&out));
    for flags in [
        &["--mesh", "4x4"][..],
        &["--strategy", "megatron"],
        &["--mode", "infer"],
        &["--set", "batch=4"],
        &["--set", "no_such_value=1"],
        &["--layouts", "paper"],
    ] {
        let mut args = vec!["run", plan_arg, "--steps", "1"];
        args.extend_from_slice(flags);
        let out = optimusc(&args);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(flags[0]), "{flags:?} is named: {}", stderr(&out));
    }
    // Flags that say what the plan already is change nothing and are accepted.
    let out = optimusc(&[
        "run",
        plan_arg,
        "--steps",
        "1",
        "--mesh",
        "2x2",
        "--strategy",
        "optimus",
        "--mode",
        "train",
        "--set",
        "batch=8",
        "--layouts",
        "auto",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = optimusc(&["simulate", plan_arg, "--hardware", "dgx-a100", "--mesh", "1x4"]);
    assert_eq!(out.status.code(), Some(2), "simulate: {}", stderr(&out));
}

#[test]
fn a_non_finite_loss_stops_before_any_update_naming_the_step_and_tensor() {
    let saved = scratch("never-written.safetensors");
    for mesh in
        [&["--mesh", "1x1", "--strategy", "none"][..], &["--mesh", "2x2"], &["--mesh", "1x2", "--strategy", "megatron"]]
    {
        let mut args = vec!["run", "examples/tiny.opt", "--optimizer", "sgd", "--lr", "1e30", "--steps", "4"];
        args.extend_from_slice(mesh);
        args.extend_from_slice(&["--save-weights", saved.to_str().expect("utf-8 path")]);
        let out = optimusc(&args);
        let text = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{mesh:?}: {text}");
        assert!(text.contains("step 1: the loss is"), "{mesh:?} names the step: {text}");
        assert!(text.contains("the first tensor to hold a NaN or an infinity is `"), "{mesh:?} names a tensor: {text}");
        assert!(text.contains("examples/tiny.opt:"), "{mesh:?} names the source line: {text}");
        assert!(!saved.exists(), "{mesh:?}: no weights are written from a non-finite state");
    }
}

#[test]
fn a_hung_device_thread_ends_the_process_within_the_timeout_and_names_it() {
    // Device 2 in row-major order is (1, 0).
    hung_device_is_named("2x2", 2, "device (1, 0) did not stop");
    // On a data-parallel mesh (2 replicas of 2x2), device 6 is (1, 0) of replica 1.
    hung_device_is_named("2x2x2", 6, "device (1, 0, replica 1) did not stop");
}

/// Device `rank` of `mesh` hangs at its second step: the process ends within the timeout, naming it.
fn hung_device_is_named(mesh: &str, rank: u64, named: &str) {
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(["run", "examples/tiny.opt", "--mesh", mesh, "--steps", "3", "--timeout", "2"])
        .env("OPTIMUS_INJECT_FAULT", format!("hang:{rank}:1"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("optimusc starts");
    let deadline = start + Duration::from_secs(30);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            child.kill().expect("kill");
            panic!("a hung device thread kept the process alive for 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("output");
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(start.elapsed() < Duration::from_secs(15), "{mesh}: took {:?}", start.elapsed());
    assert!(text.contains(named), "{mesh}: {text}");
}

#[test]
fn a_save_weights_path_that_cannot_be_written_fails_before_step_0() {
    let missing_dir = scratch("no-such-dir").join("w.safetensors");
    // A directory (save_pretrained layout) under a regular file cannot be created.
    let file = scratch("plain-file");
    std::fs::write(&file, b"x").expect("write");
    let under_file = format!("{}/", file.join("weights").display());
    for path in [missing_dir.to_str().expect("utf-8 path"), under_file.as_str()] {
        let out = optimusc(&["run", "examples/tiny.opt", "--steps", "50", "--save-weights", path]);
        let text = stderr(&out);
        // Refused before any work, as an unwritable --log or --checkpoint-dir is: a usage error.
        assert_eq!(out.status.code(), Some(2), "{path}: {text}");
        assert!(text.contains("--save-weights") && text.contains(path), "{path}: {text}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("step 0"), "{path}: no step ran");
    }
}

#[test]
fn an_output_that_is_the_input_is_refused_and_the_input_kept() {
    let model = scratch("model.opt");
    std::fs::copy("examples/tiny.opt", &model).expect("copy model");
    let model_arg = model.to_str().expect("utf-8 path");
    let out = optimusc(&["compile", model_arg, "--mesh", "2x2", "-o", model_arg]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("-o"), "{}", stderr(&out));
    assert_eq!(std::fs::read(&model).expect("model"), std::fs::read("examples/tiny.opt").expect("tiny"));
    let plan = scratch("plan-for-dot.json");
    let plan_arg = plan.to_str().expect("utf-8 path");
    assert!(optimusc(&["compile", model_arg, "--mesh", "2x2", "-o", plan_arg]).status.success());
    let before = std::fs::read(&plan).expect("plan");
    let out = optimusc(&["inspect", plan_arg, "--dot", plan_arg]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(std::fs::read(&plan).expect("plan"), before, "the plan is intact");
}

/// Losses of `steps` steps that all see the same batch and never change the weights (SGD, lr 0).
fn losses_on_one_repeated_batch(pdrop: &str, mesh: &[&str]) -> Vec<f64> {
    // tiny.opt reads 8 sequences of 8 tokens: a file of exactly 64 tokens gives every step the same windows.
    let data = scratch("one-batch.u16");
    let tokens: Vec<u8> = (0..64u16).flat_map(|t| (t % 100).to_le_bytes()).collect();
    std::fs::write(&data, tokens).expect("write data");
    let set = format!("pdrop={pdrop}");
    let mut args = vec!["run", "examples/tiny.opt", "--set", &set, "--optimizer", "sgd", "--lr", "0", "--steps", "3"];
    args.extend_from_slice(&["--json", "--data", data.to_str().expect("utf-8 path")]);
    args.extend_from_slice(mesh);
    let out = optimusc(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON")["loss"].as_f64().expect("loss"))
        .collect()
}

#[test]
fn dropout_draws_a_new_mask_every_step() {
    for mesh in [&["--mesh", "1x1", "--strategy", "none"][..], &["--mesh", "2x2"]] {
        let plain = losses_on_one_repeated_batch("0.0", mesh);
        assert!(plain.windows(2).all(|w| w[0] == w[1]), "{mesh:?}: same batch, same weights: {plain:?}");
        let dropped = losses_on_one_repeated_batch("0.3", mesh);
        assert!(dropped.windows(2).all(|w| w[0] != w[1]), "{mesh:?}: each step's mask differs: {dropped:?}");
    }
}

/// A --checkpoint-dir that could never be written is a usage error before step 0 (it was found at the
/// first checkpoint, after the steps before it had run), and nothing is created.
#[test]
fn a_checkpoint_dir_that_cannot_be_made_fails_before_step_0() {
    let file = scratch("a-file");
    std::fs::write(&file, b"x").expect("a regular file");
    for dir in [file.join("checkpoints"), file.join("deeper").join("checkpoints"), file.clone()] {
        let dir_text = dir.to_str().expect("utf-8 path");
        let args =
            ["run", "examples/tiny.opt", "--steps", "3", "--checkpoint-every", "2", "--checkpoint-dir", dir_text];
        let out = optimusc(&args);
        let text = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{dir_text}: {text}");
        assert!(text.contains("--checkpoint-dir") && text.contains(dir_text), "{dir_text}: {text}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("step 0"), "{dir_text}: no step ran");
    }
    assert_eq!(std::fs::read(&file).expect("the file is kept"), b"x");
    // A file of the user's named as a checkpoint: refused before step 0, and kept.
    let dir = scratch("holds-a-step-file");
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("step-00000002"), b"mine").expect("a file");
    let dir_text = dir.to_str().expect("utf-8 path");
    let out = optimusc(&[
        "run",
        "examples/tiny.opt",
        "--steps",
        "3",
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        dir_text,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("holds a file named as a checkpoint"), "{}", stderr(&out));
    assert_eq!(std::fs::read(dir.join("step-00000002")).expect("kept"), b"mine");
    // A folder that takes no new files (on Linux, /proc takes none even as root): the message names
    // that folder and the system's reason, not the probe file it tried.
    if std::path::Path::new("/proc/self").exists() {
        let out = optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--checkpoint-dir", "/proc/optimus-x"]);
        let text = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{text}");
        assert!(text.contains("no new file can be made in `/proc`") && !text.contains("probe"), "{text}");
    }
}

/// Little-endian u16 token ids.
fn token_file(path: &std::path::Path, ids: &[u16]) {
    std::fs::write(path, ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>()).expect("write tokens");
}

/// An output named onto an input of the same command (a log onto the data, saved weights onto the
/// model or the weights, a masked file onto its source, even through a link, an export into its own
/// checkpoint) is a usage error naming both, and the input is left as it was.
#[test]
fn outputs_onto_their_own_inputs_are_refused() {
    let data = scratch("onto-data.u16");
    token_file(&data, &(0..4096u16).map(|i| i % 101).collect::<Vec<_>>());
    let before = std::fs::read(&data).expect("read");
    let link = scratch("onto-link.tokens.bin");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&data, &link).expect("symlink");
    let ckpt = scratch("onto-ckpt");
    let _ = std::fs::remove_dir_all(&ckpt);
    let trained =
        optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--checkpoint-dir", ckpt.to_str().expect("utf-8")]);
    assert!(trained.status.success(), "{}", stderr(&trained));
    let inside = ckpt.join("step-00000001").join("model.safetensors");
    let d = data.to_str().expect("utf-8");
    let cases: Vec<Vec<&str>> = vec![
        vec!["run", "examples/tiny.opt", "--steps", "1", "--data", d, "--log", d],
        vec!["run", "examples/tiny.opt", "--steps", "1", "--data", d, "--save-weights", d],
        vec!["run", "examples/tiny.opt", "--steps", "1", "--val-data", d, "--log", d],
        vec!["run", "examples/tiny.opt", "--steps", "1", "--save-weights", "examples/tiny.opt"],
        vec!["mask-data", d, "--mask-id", "3", "-o", link.to_str().expect("utf-8").trim_end_matches(".tokens.bin")],
        vec!["export", ckpt.to_str().expect("utf-8"), "-o", inside.to_str().expect("utf-8")],
    ];
    for args in cases {
        let out = optimusc(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(args[args.len() - 1]) || err.contains("inside the checkpoint"), "{args:?}: {err}");
        assert_eq!(std::fs::read(&data).expect("read"), before, "{args:?} changed the input");
    }
    assert!(!inside.exists(), "nothing was written into the checkpoint");
}

/// `mask-data -o DIR/` would write hidden `DIR/.tokens.bin`: a usage error asking for a file name.
#[test]
fn a_mask_data_prefix_without_a_file_name_is_refused() {
    let data = scratch("prefix.u16");
    token_file(&data, &[1, 2, 3, 4, 5, 6, 7, 8]);
    let folder = scratch("prefix-out");
    std::fs::create_dir_all(&folder).expect("dir");
    for prefix in [format!("{}/", folder.display()), folder.display().to_string()] {
        let out = optimusc(&["mask-data", data.to_str().expect("utf-8"), "--mask-id", "3", "-o", &prefix]);
        assert_eq!(out.status.code(), Some(2), "{prefix}: {}", stderr(&out));
        assert!(stderr(&out).contains("names a folder"), "{}", stderr(&out));
    }
    assert_eq!(std::fs::read_dir(&folder).expect("dir").count(), 0, "nothing written");
}

/// Validation ids above the vocabulary are a usage error before step 0, not a failure after training.
#[test]
fn validation_ids_above_the_vocabulary_are_refused_before_training() {
    let val = scratch("val-above.u16");
    token_file(&val, &[5000u16; 4096]);
    let out =
        optimusc(&["run", "examples/tiny.opt", "--steps", "3", "--json", "--val-data", val.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--val-data") && stderr(&out).contains("5000"), "{}", stderr(&out));
    assert!(out.stdout.is_empty(), "no step ran: {}", String::from_utf8_lossy(&out.stdout));
}

/// A run without --data says that its tokens are drawn from the seed.
#[test]
fn a_run_on_seed_drawn_tokens_says_so() {
    let out = optimusc(&["run", "examples/tiny.opt", "--steps", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("no --data") && stderr(&out).contains("drawn from seed 0"), "{}", stderr(&out));
    let data = scratch("seeded.u16");
    token_file(&data, &(0..4096u16).map(|i| i % 101).collect::<Vec<_>>());
    let out = optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--data", data.to_str().expect("utf-8")]);
    assert!(!stderr(&out).contains("no --data"), "{}", stderr(&out));
}

/// A second `--save-weights DIR/` leaves no file of the first: its old shards and index are removed, so
/// `--weights DIR` loads the new weights.
#[test]
fn saving_weights_again_into_a_folder_leaves_no_stale_shard() {
    let dir = scratch("resaved");
    let _ = std::fs::remove_dir_all(&dir);
    let target = format!("{}/", dir.display());
    let first =
        optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--save-weights", &target, "--max-shard-size", "20KB"]);
    assert!(first.status.success(), "{}", stderr(&first));
    let names = |d: &std::path::Path| {
        let mut n: Vec<String> = std::fs::read_dir(d)
            .expect("dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    };
    assert!(names(&dir).len() > 2, "sharded: {:?}", names(&dir));
    std::fs::write(dir.join("notes.txt"), "mine").expect("write");
    let second = optimusc(&["run", "examples/tiny.opt", "--steps", "3", "--save-weights", &target]);
    assert!(second.status.success(), "{}", stderr(&second));
    assert_eq!(names(&dir), ["model.safetensors", "notes.txt"], "only the new set, and files that are not weights");
}

/// Outputs of several files are all checked before any is written: one that cannot be (its name taken
/// by a folder) fails the command with nothing of the others left behind.
#[test]
fn an_output_of_several_files_is_written_whole_or_not_at_all() {
    // mask-data: the labels' name is a folder; the inputs' file was written before.
    let data = scratch("whole.u16");
    token_file(&data, &[1, 2, 3, 4, 5, 6, 7, 8]);
    let prefix = scratch("whole-masked");
    std::fs::create_dir_all(prefix.with_extension("labels.bin")).expect("dir");
    let out = optimusc(&[
        "mask-data",
        data.to_str().expect("utf-8"),
        "--mask-id",
        "3",
        "-o",
        prefix.to_str().expect("utf-8"),
    ]);
    // Every output is checked before anything is written: a usage error (exit status 2).
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("labels.bin") && stderr(&out).contains("directory"), "{}", stderr(&out));
    assert!(!prefix.with_extension("tokens.bin").exists(), "the inputs' file is not left behind");

    // run --save-weights DIR/: the index's name, or the tokenizer's, is a folder; the shards were
    // written before, and the tokenizer's files after the weights.
    // A numbered shard's name taken by a folder is found before step 0 too, though the shards' names
    // depend on the tensors' sizes.
    for (taken, extra) in [
        ("model.safetensors.index.json", &["--max-shard-size", "1KB"][..]),
        ("tokenizer_config.json", &["--tokenizer", "gpt2"]),
        ("model-00002-of-00031.safetensors", &["--max-shard-size", "1KB"]),
    ] {
        let dir = scratch(&format!("whole-{taken}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join(taken)).expect("dir");
        let target = format!("{}/", dir.display());
        let mut args = vec!["run", "examples/tiny.opt", "--steps", "5", "--save-weights", &target];
        args.extend_from_slice(extra);
        let out = optimusc(&args);
        assert_eq!(out.status.code(), Some(2), "{taken}: {}", stderr(&out));
        assert!(stderr(&out).contains("--save-weights") && stderr(&out).contains(taken), "{}", stderr(&out));
        assert!(!String::from_utf8_lossy(&out.stdout).contains("step 0"), "{taken}: no step ran");
        assert_eq!(file_names(&dir), [taken], "{taken}: nothing written");
    }

    // export -o DIR/ --tokenizer: the tokenizer config's name is a folder (the model's vocabulary holds
    // GPT-2's ids, so the tokenizer itself is accepted).
    let checkpoints = scratch("whole-checkpoints");
    let _ = std::fs::remove_dir_all(&checkpoints);
    let saved = optimusc(&[
        "run",
        "examples/tiny.opt",
        "--set",
        "vocab=50257",
        "--steps",
        "1",
        "--checkpoint-dir",
        checkpoints.to_str().expect("utf-8"),
    ]);
    assert!(saved.status.success(), "{}", stderr(&saved));
    let step = std::fs::read_dir(&checkpoints).expect("checkpoints").flatten().map(|e| e.path()).find(|p| p.is_dir());
    let step = step.expect("a checkpoint folder");
    let exported = scratch("whole-exported");
    let _ = std::fs::remove_dir_all(&exported);
    std::fs::create_dir_all(exported.join("tokenizer_config.json")).expect("dir");
    let target = format!("{}/", exported.display());
    let out = optimusc(&["export", step.to_str().expect("utf-8"), "-o", &target, "--tokenizer", "gpt2"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("tokenizer_config.json"), "{}", stderr(&out));
    assert_eq!(file_names(&exported), ["tokenizer_config.json"], "nothing exported");
}

#[test]
fn gradient_accumulation_above_a_million_micro_batches_is_a_usage_error() {
    for accum in ["1000001", "18446744073709551615"] {
        let out = optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--accum", accum]);
        assert_eq!(out.status.code(), Some(2), "{accum}: {}", stderr(&out));
        assert!(stderr(&out).contains("--accum") && stderr(&out).contains("1..=1000000"), "{}", stderr(&out));
    }
}

/// `--save-weights NEW/` is checked before the first step without leaving the folder behind: a run
/// refused after the check (data that does not fit the model) writes nothing, and a run that trains
/// makes the folder when it saves.
#[test]
fn a_save_weights_folder_is_not_left_behind_by_a_refused_run() {
    let data = scratch("late-refusal.u16");
    token_file(&data, &[5000; 80]);
    let folder = scratch("never-made");
    let _ = std::fs::remove_dir_all(&folder);
    let target = format!("{}/", folder.display());
    let data_arg = data.to_str().expect("utf-8");
    let out = optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--data", data_arg, "--save-weights", &target]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(!folder.exists(), "no folder after a refused run");
    let out = optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--save-weights", &target]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(folder.join("model.safetensors").exists(), "the folder is made when the weights are saved");
}

/// Tokens drawn from the seed need the model's `vocab`: a model without one is a usage error before
/// step 0 in `run` and `verify`, not a device's failure once the run has started.
#[test]
fn drawn_tokens_without_a_vocabulary_are_a_usage_error_before_step_0() {
    let model = scratch("no-vocab.opt");
    let text = "model m\nconfig {\n  batch = 4\n  seq = 4\n}\ninput tokens: i32[batch, seq]\ninput targets: i32[batch, seq]\nlayer e = embedding(8, 16)\nlayer head = linear(16, 8)\nforward {\n  output loss = cross_entropy(head(e(tokens)), targets)\n}\n";
    std::fs::write(&model, text).expect("written");
    let model = model.to_str().expect("utf-8");
    for command in [&["run", model, "--steps", "1"][..], &["verify", model, "--mesh", "1x2", "--strategy", "megatron"]]
    {
        let out = optimusc(command);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{command:?}: {err}");
        assert!(
            err.contains("tokens drawn from the seed") && err.contains("`vocab`") && !err.contains("step 0"),
            "{err}"
        );
    }
}

/// A fault rehearsal that could never fire (a device past the mesh) or that cannot be read is a usage
/// error, not a run that passes for the wrong reason.
#[test]
fn an_injected_fault_past_the_mesh_or_malformed_is_a_usage_error() {
    for (value, message) in [("error:9:0", "names device 9, and the 2x2 mesh has 4"), ("bogus", "not KIND:DEVICE:STEP")]
    {
        let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
            .args(["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "1"])
            .env("OPTIMUS_INJECT_FAULT", value)
            .output()
            .expect("optimusc runs");
        let err = stderr(&out);
        assert!(out.status.code() == Some(2) && err.contains(message), "{value}: {err}");
    }
}
