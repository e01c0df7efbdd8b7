//! `optimusc generate` end to end: the same tokens on every mesh, the end-of-text stop, the streamed
//! text equal to the JSON record's, and bad requests refused. (Greedy tokens against Hugging Face's
//! `generate` are checked by scripts/hf_generate_check.py.)

mod common;

use serde_json::Value;
use std::process::{Command, Output};

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

const SMALL: &[&str] = &[
    "generate",
    "examples/gpt2.opt",
    "--set",
    "layers=2",
    "--set",
    "hidden=32",
    "--set",
    "heads=4",
    "--set",
    "ffn=64",
    "--set",
    "vocab=50257",
    "--set",
    "context=24",
    "--set",
    "pdrop=0",
];

fn generate(extra: &[&str]) -> Output {
    let mut args = SMALL.to_vec();
    args.extend(extra);
    let out = optimusc(&args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn records(extra: &[&str]) -> Vec<Value> {
    let mut args = extra.to_vec();
    args.push("--json");
    let out = generate(&args);
    String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("JSON")).collect()
}

#[test]
fn prompts_continue_alike_on_every_mesh_and_stop_at_end_of_text() {
    let prompts = ["--prompt", "The mesh", "--prompt-ids", "464,2068,7586,21831", "--max-new-tokens", "6"];
    let one = records(&prompts);
    assert_eq!(one.len(), 2);
    assert_eq!(
        one[1]["ids"].as_array().map(|ids| ids[..4].to_vec()),
        Some(vec![464.into(), 2068.into(), 7586.into(), 21831.into()])
    );
    for r in &one {
        assert_eq!((r["new_tokens"].as_u64(), r["finish"].as_str()), (Some(6), Some("length")), "{r}");
    }
    for mesh in [&["--mesh", "2x2"][..], &["--mesh", "1x4", "--strategy", "megatron"], &["--mesh", "2x1x1"]] {
        let other = records(&[&prompts[..], mesh].concat());
        let ids = |rs: &[Value]| rs.iter().map(|r| r["ids"].clone()).collect::<Vec<_>>();
        assert_eq!(ids(&other), ids(&one), "{mesh:?}");
    }
    // With the second generated token as the end of text, the first prompt stops after it.
    let second = one[0]["generated"][1].as_u64().expect("an id").to_string();
    let stopped = records(&[&prompts[..], &["--eos", &second]].concat());
    let generated = stopped[0]["generated"].as_array().expect("ids");
    assert_eq!(stopped[0]["finish"].as_str(), Some("eos"));
    assert!(generated.len() <= 2 && generated.last().and_then(Value::as_u64).map(|id| id.to_string()) == Some(second));
}

#[test]
fn one_prompt_streams_the_text_of_its_record() {
    let record = &records(&["--prompt", "Hello world", "--max-new-tokens", "5"])[0];
    let streamed = generate(&["--prompt", "Hello world", "--max-new-tokens", "5"]);
    let text = format!("{}\n", record["text"].as_str().expect("a text"));
    assert_eq!(String::from_utf8_lossy(&streamed.stdout), text);
    assert!(text.starts_with("Hello world"));
    // On meshes whose rows the one prompt is padded for, it streams the same text, unnumbered.
    for mesh in [&["--mesh", "2x2"][..], &["--mesh", "2x1x1"]] {
        let padded = generate(&[&["--prompt", "Hello world", "--max-new-tokens", "5"][..], mesh].concat());
        assert_eq!(String::from_utf8_lossy(&padded.stdout), text, "{mesh:?}");
    }
}

#[test]
fn bad_requests_are_usage_errors() {
    let cases: &[(&[&str], &str)] = &[
        (&[], "give at least one non-empty --prompt"),
        (&["--prompt", "x", "--temperature", "0"], "--temperature 0 must be a positive number"),
        (&["--prompt", "x", "--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
        (&["--prompt", "x", "--top-k", "0"], "--top-k 0 leaves no token"),
        (&["--prompt-ids", "1,2,x"], "is not a comma-separated list of token ids"),
        (&["--prompt-ids", "1,999999999999"], "token id 999999999999 is more than the largest, 4294967295"),
        (
            &["--prompt-ids", "1,60000", "--max-new-tokens", "4"],
            "prompt token 60000 is not below the model's vocabulary size 50257",
        ),
        (
            &["--prompt-ids", "1,2", "--max-new-tokens", "4", "--eos", "50257"],
            "--eos 50257 is not below the model's vocabulary size 50257",
        ),
        (&["--prompt", "x", "--max-new-tokens", "30"], "generate at most 24 new tokens"),
        // A count near 2^64 is refused as too many, not wrapped around into an internal error.
        (&["--prompt-ids", "1,2", "--max-new-tokens", "18446744073709551615"], "generate at most 23 new tokens"),
        (
            &[
                "--prompt-ids",
                "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25",
                "--max-new-tokens",
                "1",
            ],
            "the longest prompt has 25 tokens, more than the model's context 24: shorten it",
        ),
        (&["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0 generates nothing"),
        (&["--prompt", "x", "--mode", "train"], "drop --mode train"),
        (&["--prompt", "x", "--timeout", "0"], "--timeout 0 is not a positive number of seconds"),
        (&["--prompt", "x", "--max-context", "30"], "--max-context 30 is more than the model's context 24"),
        (
            &["--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--max-context", "6"],
            "--max-context 6 holds fewer positions than the longest prompt and --max-new-tokens 5 need (7)",
        ),
    ];
    for (extra, message) in cases {
        let mut args = SMALL.to_vec();
        args.extend(*extra);
        let out = optimusc(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains(message), "{extra:?}: {stderr}");
    }
}

#[test]
fn generate_and_eval_refuse_to_start_under_mpirun() {
    for command in [SMALL, &["eval", "examples/gpt2.opt", "--data", "examples/data/paragraph.u16"]] {
        let mut args = command.to_vec();
        args.extend(["--prompt", "x"].iter().filter(|_| command[0] == "generate"));
        let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
            .args(&args)
            .env("OMPI_COMM_WORLD_SIZE", "2")
            .env("OMPI_COMM_WORLD_RANK", "0")
            .output()
            .expect("optimusc runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("start it without mpirun or srun"), "{args:?}: {stderr}");
    }
}

/// Token ids and logits of every record.
fn ids_and_logits(rs: &[Value]) -> (Vec<Value>, Vec<Vec<f64>>) {
    let logits = |r: &Value| r["logits"].as_array().expect("logits").iter().filter_map(Value::as_f64).collect();
    (rs.iter().map(|r| r["ids"].clone()).collect(), rs.iter().map(logits).collect())
}

/// The key/value cache decodes what recomputing the whole sequence does: the same tokens and logits
/// within float32 rounding, for prompts of different lengths (rows inside their prompt take its next
/// token while others generate), on every strategy's mesh (tesseract and 3d too), GPT-2 (fused
/// attention, position table, dropout in the model and off at inference) and Llama (grouped-query,
/// rotary) sampled with a seed.
#[test]
fn the_cache_decodes_as_recomputing_the_sequence_does() {
    let gpt2 = [
        "--set",
        "pdrop=0.1",
        "--prompt-ids",
        "11,12",
        "--prompt-ids",
        "464,2068,7586,21831,3",
        "--max-new-tokens",
        "7",
    ];
    let llama: &[&str] = &[
        "generate",
        "examples/llama.opt",
        "--set",
        "layers=2",
        "--set",
        "hidden=32",
        "--set",
        "heads=4",
        "--set",
        "kv_heads=2",
        "--set",
        "ffn=64",
        "--set",
        "vocab=97",
        "--set",
        "context=20",
        "--prompt-ids",
        "5,6,7",
        "--prompt-ids",
        "9",
        "--prompt-ids",
        "1,2,3,4,5,6",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--seed",
        "7",
        "--json",
    ];
    let meshes: [&[&str]; 6] = [
        &[],
        &["--mesh", "2x2"],
        &["--mesh", "1x2", "--strategy", "megatron"],
        &["--mesh", "2x1x1"],
        &["--mesh", "2x2x2", "--strategy", "tesseract"],
        &["--mesh", "2x2x2", "--strategy", "3d"],
    ];
    for mesh in meshes {
        let cached = records(&[&gpt2[..], mesh].concat());
        let recomputed = records(&[&gpt2[..], mesh, &["--no-cache"]].concat());
        assert_same_generation(&cached, &recomputed, mesh);
        let run = |extra: &[&str]| {
            let out = optimusc(&[llama, mesh, extra].concat());
            assert!(out.status.success(), "{mesh:?}: {}", String::from_utf8_lossy(&out.stderr));
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            text.lines().map(|l| serde_json::from_str(l).expect("JSON")).collect::<Vec<Value>>()
        };
        assert_same_generation(&run(&[]), &run(&["--no-cache"]), mesh);
    }
}

fn assert_same_generation(cached: &[Value], recomputed: &[Value], mesh: &[&str]) {
    let ((ids, logits), (want_ids, want_logits)) = (ids_and_logits(cached), ids_and_logits(recomputed));
    assert_eq!(ids, want_ids, "{mesh:?}");
    for (got, want) in logits.iter().flatten().zip(want_logits.iter().flatten()) {
        assert!((got - want).abs() < 1e-5, "{mesh:?}: logit {got} against {want}");
    }
    assert_eq!(logits.concat().len(), want_logits.concat().len());
}

/// `compile --max-context` plans a decoding step whose caches `inspect` counts: two per layer, each
/// this device's batch rows x every position x its kv heads' columns in float32.
#[test]
fn a_decoding_step_plan_counts_its_caches() {
    let dir = common::process_dir("decode-plan");
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let plan = dir.join("decode.json");
    let plan_path = plan.to_str().expect("a UTF-8 path");
    let (layers, batch, context, kv_width) = (3u64, 4u64, 40u64, 16u64);
    let compile = optimusc(&[
        "compile",
        "examples/llama.opt",
        "--set",
        "layers=3",
        "--set",
        "hidden=32",
        "--set",
        "heads=4",
        "--set",
        "kv_heads=2",
        "--set",
        "ffn=64",
        "--set",
        "vocab=97",
        "--set",
        "context=64",
        "--set",
        "seq=1",
        "--set",
        "batch=4",
        "--mesh",
        "2x2",
        "--max-context",
        "40",
        "-o",
        plan_path,
    ]);
    assert!(compile.status.success(), "{}", String::from_utf8_lossy(&compile.stderr));
    let inspect = optimusc(&["inspect", plan_path, "--json"]);
    assert!(inspect.status.success(), "{}", String::from_utf8_lossy(&inspect.stderr));
    let report: Value = serde_json::from_slice(&inspect.stdout).expect("JSON");
    let cache = &report["memory"]["cache"];
    // kv_heads * head = 2 * 8 = 16 columns; 2x2 splits the batch over rows and the heads over columns.
    assert_eq!(cache.as_u64(), Some(layers * 2 * (batch / 2) * context * (kv_width / 2) * 4), "{report}");
    let text = optimusc(&["inspect", plan_path]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("key/value caches"));
    let too_long =
        optimusc(&["compile", "examples/gpt2.opt", "--set", "seq=16", "--max-context", "8", "-o", plan_path]);
    assert!(String::from_utf8_lossy(&too_long.stderr).contains("does not fit caches of --max-context 8"));
    // Caches longer than the model's context (GPT-2's 1024 positions) would need positions it has no
    // embedding for; 2^40 of them, a buffer no machine holds, was an internal error.
    for context in ["1025", "1099511627776"] {
        let longer = optimusc(&["compile", "examples/gpt2.opt", "--max-context", context, "-o", plan_path]);
        let stderr = String::from_utf8_lossy(&longer.stderr);
        assert!(
            !longer.status.success()
                && stderr.contains(&format!("--max-context {context} is more than the model's context 1024")),
            "{stderr}"
        );
        assert!(!stderr.contains("internal error"), "{stderr}");
    }
    let run = optimusc(&["run", plan_path, "--steps", "1"]);
    assert_eq!(run.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&run.stderr).contains("is a decoding step with key/value caches"));
    // eval, which scores whole sequences, and inspect --memory, whose search compiles without caches,
    // say what the plan is rather than blame its inputs or size it as a plain inference plan.
    let eval = optimusc(&["eval", plan_path, "--data", plan_path]);
    let stderr = String::from_utf8_lossy(&eval.stderr);
    assert!(eval.status.code() == Some(2) && stderr.contains("eval scores whole sequences"), "{stderr}");
    let sized = optimusc(&["inspect", plan_path, "--memory", "1GB"]);
    let stderr = String::from_utf8_lossy(&sized.stderr);
    assert!(sized.status.code() == Some(1) && stderr.contains("does not size a decoding step"), "{stderr}");
    let bert = optimusc(&["compile", "examples/bert.opt", "--max-context", "8", "-o", plan_path]);
    assert!(
        String::from_utf8_lossy(&bert.stderr).contains("is not causal"),
        "{}",
        String::from_utf8_lossy(&bert.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A plan stands for its model, config values, mesh and strategy: generating from it gives what
/// generating from the model with the same flags gives; flags that disagree with it are refused.
#[test]
fn a_plan_generates_as_its_model_does() {
    let dir = common::process_dir("generate-plan");
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let plan = dir.join("plan.json");
    let plan_path = plan.to_str().expect("a UTF-8 path");
    let sets =
        ["--set", "layers=2", "--set", "hidden=32", "--set", "heads=4", "--set", "vocab=101", "--set", "context=20"];
    let compile = optimusc(
        &[
            &["compile", "examples/gpt2.opt", "--set", "seq=8"][..],
            &sets,
            &["--mesh", "1x2", "--strategy", "megatron", "-o", plan_path],
        ]
        .concat(),
    );
    assert!(compile.status.success(), "{}", String::from_utf8_lossy(&compile.stderr));
    let prompt = ["--prompt-ids", "3,4,5", "--max-new-tokens", "5", "--json"];
    let from_plan = optimusc(&[&["generate", plan_path][..], &prompt].concat());
    let from_model = optimusc(
        &[&["generate", "examples/gpt2.opt"][..], &sets, &["--mesh", "1x2", "--strategy", "megatron"], &prompt]
            .concat(),
    );
    assert!(from_plan.status.success(), "{}", String::from_utf8_lossy(&from_plan.stderr));
    let ids = |out: &Output| -> Value { serde_json::from_slice::<Value>(&out.stdout).expect("JSON")["ids"].clone() };
    assert_eq!(ids(&from_plan), ids(&from_model));
    // A plan whose model file is gone says so.
    let moved = dir.join("gpt2.opt");
    std::fs::copy("examples/gpt2.opt", &moved).expect("a copy of the model");
    let moved_plan = dir.join("moved.json");
    let moved_args = [&["compile", moved.to_str().expect("a UTF-8 path"), "--set", "seq=8"][..], &sets];
    let compiled = optimusc(&[&moved_args.concat()[..], &["-o", moved_plan.to_str().expect("a UTF-8 path")]].concat());
    assert!(compiled.status.success(), "{}", String::from_utf8_lossy(&compiled.stderr));
    std::fs::remove_file(&moved).expect("the copy is removed");
    let orphan = optimusc(&["generate", moved_plan.to_str().expect("a UTF-8 path"), "--prompt-ids", "3"]);
    assert_eq!(orphan.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&orphan.stderr).contains("which is not here"));
    // A model file changed since (a config value renamed) is told as that, not as a `--set` never given.
    let renamed = std::fs::read_to_string("examples/gpt2.opt").expect("the model").replace("pdrop", "p_drop");
    std::fs::write(&moved, renamed).expect("the changed model");
    let changed = optimusc(&["generate", moved_plan.to_str().expect("a UTF-8 path"), "--prompt-ids", "3"]);
    let stderr = String::from_utf8_lossy(&changed.stderr);
    assert_eq!(changed.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("config value `pdrop`, which its model") && !stderr.contains("--set"), "{stderr}");
    let conflicting = optimusc(&["generate", plan_path, "--mesh", "2x2", "--prompt-ids", "3"]);
    assert_eq!(conflicting.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&conflicting.stderr).contains("--mesh 2x2 (the plan is for a 1x2 mesh)"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// One new token after prompts of one length is one forward pass (no cache to keep); and an
/// end-of-text token chosen by the prefill ends the run after one decode step that chooses nothing.
#[test]
fn one_new_token_and_an_end_of_text_first_token_end_the_run() {
    let one = records(&["--prompt-ids", "464,2068,7586", "--max-new-tokens", "1"]);
    let more = records(&["--prompt-ids", "464,2068,7586", "--max-new-tokens", "3"]);
    assert_eq!(one[0]["generated"].as_array().map(Vec::len), Some(1));
    assert_eq!(one[0]["generated"][0], more[0]["generated"][0]);
    let first = more[0]["generated"][0].as_u64().expect("an id").to_string();
    let stopped = records(&["--prompt-ids", "464,2068,7586", "--max-new-tokens", "3", "--eos", &first]);
    assert_eq!((stopped[0]["new_tokens"].as_u64(), stopped[0]["finish"].as_str()), (Some(1), Some("eos")));
}

#[test]
fn a_model_that_is_not_a_causal_language_model_is_refused_naming_its_inputs() {
    let out = optimusc(&["generate", "examples/bert.opt", "--prompt-ids", "1,2", "--max-new-tokens", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("this model's inputs are `segments`, `targets`, `tokens`"), "{stderr}");
}
