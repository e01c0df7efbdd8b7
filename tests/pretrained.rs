//! The `save_pretrained` layout: `run --save-weights DIR/` shards by size with an index, `--weights` reads a
//! directory, an index or a single file to the same losses, and an index that disagrees with its files is an
//! error naming the difference.

mod common;

use common::file_names;
use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pretrained").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}

fn optimusc(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

const TINY: &str = "examples/tiny.opt";

/// The per-step losses of three SGD steps from `weights`, on `mesh`.
fn losses(weights: &Path, mesh: &[&str]) -> Vec<String> {
    let mut args =
        vec!["run", TINY, "--steps", "3", "--optimizer", "sgd", "--weights", weights.to_str().expect("utf-8")];
    args.extend(mesh);
    let (ok, text) = optimusc(&args);
    assert!(ok, "{text}");
    text.lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| l.split_whitespace().nth(3).unwrap_or("").to_string())
        .collect()
}

#[test]
fn sharded_and_single_file_checkpoints_give_the_same_losses() {
    let dir = scratch("same_losses");
    let (single, sharded) = (dir.join("single.safetensors"), dir.join("sharded"));
    let sharded_arg = format!("{}/", sharded.display());
    let (ok, text) =
        optimusc(&["run", TINY, "--steps", "1", "--seed", "5", "--save-weights", single.to_str().expect("utf-8")]);
    assert!(ok, "{text}");
    let (ok, text) = optimusc(&[
        "run",
        TINY,
        "--steps",
        "1",
        "--seed",
        "5",
        "--save-weights",
        &sharded_arg,
        "--max-shard-size",
        "20KB",
    ]);
    assert!(ok, "{text}");
    let index = sharded.join("model.safetensors.index.json");
    let shards: Vec<_> = std::fs::read_dir(&sharded)
        .expect("directory")
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    assert!(shards.len() > 2, "20KB shards split the tiny model: {shards:?}");
    for name in &shards {
        let len = std::fs::metadata(sharded.join(name)).expect("shard").len();
        // A shard holds at most 20 KB of tensors, or one larger tensor (tiny's largest is well below 80 KB).
        assert!(len < 80_000, "{name}: {len} bytes");
    }
    let text = std::fs::read_to_string(&index).expect("index written");
    let json: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let listed = json["weight_map"].as_object().expect("weight_map");
    assert!(listed.values().all(|f| shards.contains(&f.as_str().unwrap_or("").to_string())), "{text}");

    for mesh in
        [&["--mesh", "1x1", "--strategy", "none"][..], &["--mesh", "2x2"], &["--mesh", "1x4", "--strategy", "megatron"]]
    {
        let expected = losses(&single, mesh);
        assert_eq!(expected.len(), 3);
        assert_eq!(losses(&sharded, mesh), expected, "{mesh:?}: directory");
        assert_eq!(losses(&index, mesh), expected, "{mesh:?}: index file");
    }
}

#[test]
fn an_index_that_disagrees_with_its_files_is_an_error() {
    let dir = scratch("disagrees");
    let sharded = dir.join("ckpt");
    let arg = format!("{}/", sharded.display());
    let (ok, text) = optimusc(&["run", TINY, "--steps", "1", "--save-weights", &arg, "--max-shard-size", "20KB"]);
    assert!(ok, "{text}");
    let index = sharded.join("model.safetensors.index.json");
    let original = std::fs::read_to_string(&index).expect("index");
    let mut json: serde_json::Value = serde_json::from_str(&original).expect("JSON");
    let map = json["weight_map"].as_object_mut().expect("weight_map");
    let key = map.keys().next().expect("a tensor").clone();
    map.insert(key.clone(), serde_json::Value::from("model-99999-of-99999.safetensors"));
    std::fs::write(&index, serde_json::to_string(&json).expect("JSON")).expect("write");
    let (ok, text) = optimusc(&["run", TINY, "--steps", "1", "--weights", index.to_str().expect("utf-8")]);
    assert!(!ok && text.contains("model-99999-of-99999.safetensors"), "a missing shard is named: {text}");

    std::fs::write(&index, original.replace(&format!("\"{key}\""), "\"renamed.weight\"")).expect("write");
    let (ok, text) = optimusc(&["run", TINY, "--steps", "1", "--weights", sharded.to_str().expect("utf-8")]);
    assert!(!ok, "{text}");
    assert!(text.contains(&format!("`{key}` is in")) && text.contains("not in the index"), "{text}");

    std::fs::write(&index, "{\"weight_map\": {\"x\": \"../escape.safetensors\"}}").expect("write");
    let (ok, text) = optimusc(&["run", TINY, "--steps", "1", "--weights", index.to_str().expect("utf-8")]);
    assert!(!ok && text.contains("plain names beside the index"), "{text}");
}

/// Every device's block read straight from the mapped files equals the block cut from the whole logical
/// tensor, on meshes that pad and split the vocabulary, for [in, out] and [out, in] linears.
#[test]
fn device_blocks_read_from_mapped_files_equal_blocks_of_the_logical_tensors() {
    use optimus::front::check_source;
    use optimus::plan::init::{block_of, pad_to};
    use optimus::plan::{Mesh, Mode, Strategy};
    use optimus::shard::{Target, compile};
    let dir = scratch("blocks");
    for (name, text) in [("gpt", std::fs::read_to_string(TINY).expect("tiny")), ("llama", llama_like())] {
        let model_path = dir.join(format!("{name}.opt"));
        std::fs::write(&model_path, &text).expect("write");
        let weights = dir.join(format!("{name}.safetensors"));
        let (ok, out) = optimusc(&[
            "run",
            model_path.to_str().expect("utf-8"),
            "--steps",
            "1",
            "--seed",
            "9",
            "--save-weights",
            weights.to_str().expect("utf-8"),
        ]);
        assert!(ok, "{out}");
        let model = check_source(&text, &[]).model.expect("checks");
        for (rows, cols, strategy) in [(2, 2, Strategy::Optimus), (1, 4, Strategy::Megatron), (4, 4, Strategy::Optimus)]
        {
            let target = Target::plain(Mesh::new(rows, cols), strategy, Mode::Train);
            let Ok(plan) = compile(&model, name, &text, target) else { continue };
            let mapped = optimus::io::pretrained::map_weights(&weights, &plan, false).expect("maps");
            let logical = mapped.logical_params(&plan);
            for p in &plan.params {
                let meta = plan.buffer(p.buffer);
                let padded = pad_to(&logical[&p.name], meta).expect("pads");
                for coords in plan.mesh.all_coords() {
                    let expected = block_of(&padded, meta, coords, plan.mesh).expect("block");
                    let read = mapped.block(p, meta, coords, plan.mesh).expect("reads");
                    assert_eq!(read, expected, "{name} {rows}x{cols} {} device {coords}", p.name);
                }
            }
        }
    }
}

/// A small Llama-shaped model with [out, in] linears and a vocabulary no mesh divides.
fn llama_like() -> String {
    let text = std::fs::read_to_string("examples/llama.opt").expect("llama");
    let mut out = String::new();
    for line in text.lines() {
        let line = match line.split_whitespace().next() {
            Some("vocab") => "  vocab = 101",
            Some("context") => "  context = 16",
            Some("seq") => "  seq = 8",
            Some("batch") => "  batch = 4",
            Some("layers") if line.contains('=') && !line.contains("repeat") => "  layers = 1",
            Some("heads") => "  heads = 4",
            Some("kv_heads") => "  kv_heads = 4",
            Some("hidden") => "  hidden = 32",
            Some("ffn") => "  ffn = 48",
            _ => line,
        };
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// `config.json` of a `--save-weights DIR/` run of `model` with the small config values.
fn saved_config(test: &str, model: &str, extra: &[&str]) -> (serde_json::Value, String, PathBuf) {
    let dir = scratch(test);
    let out = format!("{}/", dir.join("export").display());
    let mut args = vec!["run", model, "--steps", "1", "--save-weights", &out];
    args.extend(["--set", "layers=3", "--set", "hidden=32", "--set", "heads=4", "--set", "ffn=48"]);
    args.extend(["--set", "vocab=101", "--set", "seq=8", "--set", "context=16", "--set", "batch=4"]);
    args.extend(extra);
    let (ok, text) = optimusc(&args);
    assert!(ok, "{text}");
    let config = std::fs::read(dir.join("export/config.json"))
        .map(|bytes| serde_json::from_slice(&bytes).expect("JSON"))
        .unwrap_or(serde_json::Value::Null);
    (config, text, dir.join("export"))
}

#[test]
fn a_saved_folder_holds_the_config_from_pretrained_needs() {
    let (gpt2, text, dir) = saved_config("config_gpt2", "examples/gpt2.opt", &["--set", "eps=0.001"]);
    assert!(text.contains("model.safetensors, config.json, generation_config.json"), "{text}");
    let expected = [("n_layer", 3.0), ("n_embd", 32.0), ("n_head", 4.0), ("n_inner", 48.0), ("vocab_size", 101.0)];
    for (key, value) in expected.into_iter().chain([("n_positions", 16.0), ("layer_norm_epsilon", 0.001)]) {
        assert_eq!(gpt2[key].as_f64(), Some(value), "{key}: {gpt2}");
    }
    assert_eq!((gpt2["activation_function"].as_str(), gpt2["eos_token_id"].as_u64()), (Some("gelu_new"), None));
    assert!(dir.join("generation_config.json").is_file());
    let (llama, ..) = saved_config("config_llama", "examples/llama.opt", &["--set", "kv_heads=2"]);
    assert_eq!((llama["num_key_value_heads"].as_u64(), llama["head_dim"].as_u64()), (Some(2), Some(8)));
    assert_eq!((llama["intermediate_size"].as_u64(), llama["tie_word_embeddings"].as_bool()), (Some(48), Some(false)));
    let (bert, ..) = saved_config("config_bert", "examples/bert.opt", &[]);
    assert_eq!(
        (bert["architectures"][0].as_str(), bert["type_vocab_size"].as_u64()),
        (Some("BertForMaskedLM"), Some(2))
    );
    // A model of none of these architectures gets its weights and a note, no config.
    let dir = scratch("config_none");
    let out = format!("{}/", dir.join("export").display());
    let (ok, text) = optimusc(&["run", TINY, "--steps", "1", "--save-weights", &out]);
    assert!(ok && text.contains("note: no config.json: the parameters are not named as GPT-2's"), "{text}");
    assert!(dir.join("export/model.safetensors").is_file() && !dir.join("export/config.json").exists());
}

#[test]
fn a_saved_folder_gets_the_tokenizer_named_and_a_tokenizer_the_model_cannot_hold_is_refused() {
    let dir = scratch("tokenizer");
    let out = format!("{}/", dir.join("export").display());
    let small =
        ["--set", "layers=1", "--set", "hidden=16", "--set", "heads=2", "--set", "seq=8", "--set", "context=16"];
    let mut args = vec!["run", "examples/gpt2.opt", "--steps", "1", "--set", "vocab=50257", "--set", "batch=2"];
    args.extend(small);
    let (ok, text) = optimusc(&[&args[..], &["--save-weights", &out, "--tokenizer", "gpt2"]].concat());
    assert!(ok && text.contains("saved the tokenizer gpt2"), "{text}");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("export/tokenizer_config.json")).expect("written"))
            .expect("JSON");
    assert_eq!((config["eos_token"].as_str(), config["model_max_length"].as_u64()), (Some("<|endoftext|>"), Some(16)));
    assert!(dir.join("export/tokenizer.json").is_file());
    // Before any step: a vocabulary smaller than the tokenizer's, or no folder to write into.
    let mut small_vocab = vec!["run", "examples/gpt2.opt", "--steps", "1", "--set", "vocab=1000", "--set", "batch=2"];
    small_vocab.extend(small);
    let (ok, text) = optimusc(&[&small_vocab[..], &["--save-weights", &out, "--tokenizer", "gpt2"]].concat());
    assert!(!ok && text.contains("give --set vocab=50257 or more") && !text.contains("step 0"), "{text}");
    let file = dir.join("w.safetensors").display().to_string();
    let (ok, text) = optimusc(&[&args[..], &["--save-weights", &file, "--tokenizer", "gpt2"]].concat());
    assert!(!ok && text.contains("give a folder"), "{text}");
}

/// `export CHECKPOINT -o DIR/ --tokenizer gpt2` makes the folder `run --save-weights DIR/ --tokenizer
/// gpt2` makes at the same step, file for file and byte for byte, replaces an earlier sharded save in
/// that folder (whose index `--weights DIR` would otherwise read instead), and a checkpoint that cannot
/// be read leaves no folder behind, nested ones included.
#[test]
fn an_export_folder_is_the_save_weights_folder_and_replaces_an_earlier_save() {
    let dir = scratch("export-folder");
    let (checkpoints, saved, sharded) = (dir.join("ck"), dir.join("saved"), dir.join("sharded"));
    let small = [
        "run",
        "examples/gpt2.opt",
        "--steps",
        "1",
        "--set",
        "vocab=50257",
        "--set",
        "batch=2",
        "--set",
        "layers=1",
        "--set",
        "hidden=16",
        "--set",
        "heads=2",
        "--set",
        "seq=8",
        "--set",
        "context=16",
        "--tokenizer",
        "gpt2",
    ];
    let path = |p: &Path| format!("{}/", p.display());
    let checkpoint_dir = checkpoints.display().to_string();
    let (ok, text) =
        optimusc(&[&small[..], &["--checkpoint-dir", &checkpoint_dir, "--save-weights", &path(&saved)]].concat());
    assert!(ok, "{text}");
    let (ok, text) = optimusc(&[&small[..], &["--save-weights", &path(&sharded), "--max-shard-size", "1MB"]].concat());
    assert!(ok, "{text}");
    assert!(file_names(&sharded).contains(&"model.safetensors.index.json".to_string()), "{:?}", file_names(&sharded));
    let (ok, text) = optimusc(&["export", &checkpoint_dir, "-o", &path(&sharded), "--tokenizer", "gpt2"]);
    assert!(ok, "{text}");
    assert_eq!(file_names(&sharded), file_names(&saved));
    for name in file_names(&saved) {
        let read = |d: &Path| std::fs::read(d.join(&name)).unwrap_or_default();
        assert!(read(&sharded) == read(&saved), "{name} differs");
    }
    // A checkpoint cut short: no folder, however deep.
    let broken = dir.join("broken");
    let (ok, text) = optimusc(&["run", TINY, "--steps", "1", "--checkpoint-dir", &broken.display().to_string()]);
    assert!(ok, "{text}");
    let shard = std::fs::read_dir(&broken)
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|step| std::fs::read_dir(step.path()).into_iter().flatten().flatten())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .expect("a device shard");
    let bytes = std::fs::read(&shard).expect("read");
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).expect("cut short");
    let nested = dir.join("new");
    let (ok, text) = optimusc(&["export", &broken.display().to_string(), "-o", &path(&nested.join("a/b"))]);
    assert!(!ok && text.contains("bytes"), "{text}");
    assert!(!nested.exists(), "export left {} behind", nested.display());
    // Through a `..`: both folders the path made are removed.
    let (ok, text) = optimusc(&["export", &broken.display().to_string(), "-o", &path(&dir.join("zz/../yy"))]);
    assert!(!ok, "{text}");
    assert!(!dir.join("zz").exists() && !dir.join("yy").exists(), "export left a folder behind");
}
