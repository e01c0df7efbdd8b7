//! Helpers shared by the end-to-end tests that run `optimusc` and compare saved weights.

// Not every suite that shares these helpers uses each of them.
#![allow(dead_code)]

use optimus::plan::Plan;
use optimus::plan::tensor::Tensor;
use safetensors::SafeTensors;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh, empty folder `name` for one test's files, under a folder of `suite` and this process (so
/// that nothing an earlier run left, even one whose process had the same id, meets this one).
pub fn scratch(suite: &str, name: &str) -> PathBuf {
    let dir = process_dir(suite).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// The folder of files that `tag`'s tests make in this process: `optimus-tests/{tag}-{pid}` in the
/// temporary folder. The first call in a process also removes the folders of test processes that have
/// ended, so that the suite's runs do not pile up in the temporary folder (they once left 2 GB there);
/// a failed test's files stay until a later test process starts.
pub fn process_dir(tag: &str) -> PathBuf {
    static ENDED_REMOVED: std::sync::Once = std::sync::Once::new();
    let root = std::env::temp_dir().join("optimus-tests");
    ENDED_REMOVED.call_once(|| remove_ended_processes_dirs(&root));
    let dir = root.join(format!("{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Removes the folders under `root` whose name ends in the id of a process that no longer runs. Only
/// where /proc tells which processes run (Linux); elsewhere nothing is removed.
fn remove_ended_processes_dirs(root: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(root) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name.to_str().and_then(|n| n.rsplit('-').next()).and_then(|p| p.parse::<u32>().ok());
        let ended = pid.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
        if ended {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Writes the model `source` as `name.opt` in a fresh folder of `suite` and asserts that `optimusc
/// verify` passes on every (strategy, mesh) of `meshes`.
pub fn verifies_on(suite: &str, name: &str, source: &str, meshes: &[(&str, &str)]) {
    let path = scratch(suite, name).join(format!("{name}.opt"));
    std::fs::write(&path, source).expect("the model is written");
    let path = path.to_string_lossy().into_owned();
    for &(strategy, mesh) in meshes {
        let out = optimusc(&["verify", &path, "--strategy", strategy, "--mesh", mesh]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("verified"),
            "{name} on {strategy} {mesh}:\n{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Runs the built `optimusc` with `args`.
pub fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

/// What an `optimusc` interrupted by SIGINT after its first step record left: its exit code, its
/// standard error, and the standard output it printed after that record.
pub struct Interrupted {
    pub code: Option<i32>,
    pub stderr: String,
    pub rest: String,
}

/// Runs `optimusc` with `args` (a run that prints a JSON record per step), sends it SIGINT once its
/// first record (step 0) is out, and waits for it to end.
pub fn interrupt_after_first_step(args: &[&str]) -> Interrupted {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = lines.next().expect("a first record").expect("read");
    assert!(first.contains("\"step\":0"), "{first}");
    let status = Command::new("kill").args(["-INT", &child.id().to_string()]).status().expect("kill");
    assert!(status.success());
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let output = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    Interrupted { code: output.status.code(), stderr, rest: rest.join("\n") }
}

/// `optimusc run` of a four-layer tiny.opt as a pipeline of 2 stages with 2 micro-batches, whose SGD
/// rate of 1e30 makes the weights overflow after the first update, so that step 1's loss is NaN.
pub const NAN_LOSS_PIPELINE: [&str; 14] = [
    "run",
    "examples/tiny.opt",
    "--set",
    "layers=4",
    "--steps",
    "3",
    "--accum",
    "2",
    "--pipeline",
    "2",
    "--optimizer",
    "sgd",
    "--lr",
    "1e30",
];

/// A path as a command-line argument.
pub fn text(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// Every tensor of a safetensors file of float32 tensors, by name (sorted), as f32 values.
pub fn read_weights(path: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(path).expect("saved weights");
    let file = SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut out: Vec<(String, Vec<f32>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            (name, values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Batch `index` of `tokens` and `targets` for a plan's `batch x seq` inputs: a repeating pattern the
/// model can learn (so that the loss falls over the steps), each id moved by up to `noise` - 1 drawn
/// from the index.
pub fn pattern_batches(
    plan: &Plan,
    noise: u64,
) -> impl Fn(u64) -> Result<BTreeMap<String, Tensor>, String> + Sync + use<> {
    let int = |name: &str| match plan.config.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()) {
        Some(optimus::plan::types::Scalar::Int(v)) => v as u64,
        other => panic!("config {name} is {other:?}"),
    };
    let (vocab, batch, seq) = (int("vocab"), int("batch"), int("seq"));
    move |index| {
        let mut out = BTreeMap::new();
        for (k, name) in ["targets", "tokens"].iter().enumerate() {
            let draw = |n: u64| optimus::plan::init::mix64((index * 8 + k as u64) ^ n) % noise;
            let ids = (0..batch * seq).map(|n| ((n % 7) * 13 + draw(n)) as i32 % vocab as i32).collect();
            out.insert(name.to_string(), Tensor::from_i32(&[batch, seq], ids));
        }
        Ok(out)
    }
}

/// AdamW at rate 3e-3 with weight decay 0.01 and PyTorch's betas and epsilon.
pub fn adamw() -> optimus::runtime::settings::OptimizerSettings {
    optimus::runtime::settings::OptimizerSettings {
        kind: optimus::runtime::settings::OptimizerKind::AdamW,
        lr: 3e-3,
        weight_decay: 0.01,
        momentum: 0.9,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    }
}

/// Training on the example paragraph, validated on it after every second update (the vocabulary must
/// hold its 333 token ids).
pub const PARAGRAPH_VALIDATED_EVERY_2: [&str; 6] =
    ["--data", "examples/data/paragraph.u16", "--val-data", "examples/data/paragraph.u16", "--eval-every", "2"];

/// A calibrated profile of our CPU runtime (threads on 2 shared cores), as `calibrate` writes one: the
/// figures are round, not this machine's.
pub const SHARED_CPU: &str = r#"
name = "two-core-cpu"
description = "a 2-core CPU whose device threads share the cores"
[device]
name = "cpu"
memory_gb = 24.0
memory_bandwidth_gb_s = 20.0
achievable_bandwidth = 1.0
achievable_compute = 1.0
kernel_launch_us = 14.0
[device.peak_tflops]
f32 = 0.35
[intra_node]
gpus_per_node = 1024
bandwidth_gb_s = 15.0
latency_us = 50.0
[inter_node]
nic_bandwidth_gb_s = 15.0
latency_us = 50.0
nics_per_node = 1
[collectives]
algorithm = "auto"
[measured]
runtime = "cpu"
threads = 2
shared_engine = true
overlap = false
[[measured.dispatch]]
devices = 8
us = 2.0
[measured.kernels.default]
launch_us = 10.0
gb_s = 20.0
gflop_s = 150.0
[measured.single_thread_kernels.default]
launch_us = 5.0
gb_s = 12.0
gflop_s = 80.0
"#;

/// The names of the files in `dir`, sorted (none when it does not exist).
pub fn file_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// Blocks B0..B9, each calling its layer (an instance of the next block) 8 times nested, and a B10 that
/// returns its input: 8^10 runs of B10's forward, none making an operator, so neither the instance nor
/// the graph limit stops them; only the evaluation limit does.
pub fn forwards_multiplying_calls() -> String {
    let mut src = String::from("model m\ninput x: f32[4]\n");
    for i in 0..10 {
        src.push_str(&format!(
            "block B{i} {{ layer a = B{}() forward(x) {{ return a(a(a(a(a(a(a(a(x)))))))) }} }}\n",
            i + 1
        ));
    }
    src.push_str("block B10 { forward(x) { return x } }\nlayer top = B0()\nforward { output y = top(x) }\n");
    src
}

/// A u16 token file of 400 ids (0 to 99, repeating: inside tiny.opt's vocabulary of 128) with the id
/// 5000, past that vocabulary, at token offset `bad`.
pub fn tokens_with_a_bad_id(path: &Path, bad: usize) {
    let mut tokens: Vec<u16> = (0..400).map(|i| (i % 100) as u16).collect();
    tokens[bad] = 5000;
    std::fs::write(path, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).expect("writes");
}
