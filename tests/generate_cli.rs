//! `optimusc generate` end to end: the same tokens on every mesh, the end-of-text stop, the streamed
//! text equal to the JSON record's, and bad requests refused. (Greedy tokens against Hugging Face's
//! `generate` are checked by scripts/hf_generate_check.py.)

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
}

#[test]
fn bad_requests_are_usage_errors() {
    let cases: &[(&[&str], &str)] = &[
        (&[], "give at least one non-empty --prompt"),
        (&["--prompt", "x", "--temperature", "0"], "--temperature 0 must be a positive number"),
        (&["--prompt", "x", "--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
        (&["--prompt", "x", "--top-k", "0"], "--top-k 0 leaves no token"),
        (&["--prompt-ids", "1,2,x"], "is not a comma-separated list of token ids"),
        (
            &["--prompt-ids", "1,60000", "--max-new-tokens", "4"],
            "prompt token 60000 is not below the model's vocabulary size 50257",
        ),
        (&["--prompt", "x", "--max-new-tokens", "30"], "generate at most 24 new tokens"),
        (&["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0 generates nothing"),
        (&["--prompt", "x", "--mode", "train"], "drop --mode train"),
        (&["--prompt", "x", "--timeout", "0"], "--timeout 0 is not a positive number of seconds"),
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
