//! The sharded checkpoint format: written by every device of one plan, read back onto every other mesh
//! and strategy exactly (padding and fused qkv included), exported as one Hugging Face file, and
//! loaded by `run --weights DIR`; corrupt, truncated, unfinished and old checkpoints are handled.

use optimus::elab::Override;
use optimus::front::check_source;
use optimus::io::load_checkpoint;
use optimus::io::shards::{Checkpoint, CheckpointWriter, complete_checkpoints, export_safetensors, state_key};
use optimus::plan::init::{block_of, pad_to};
use optimus::plan::stores::DeviceParamBlocks;
use optimus::plan::tensor::Tensor;
use optimus::plan::{Buffer, Coords, Mesh, Mode, Plan, Strategy};
use optimus::shard::{Target, compile};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

// ---- helpers -------------------------------------------------------------------------------------

/// examples/gpt2.opt made small; a vocabulary of 50 is padded to 52 on 4-way splits, not on 2-way.
fn plan_with(sets: &[(&str, &str)], mesh: (u64, u64), strategy: Strategy, mode: Mode) -> Plan {
    let file = "examples/gpt2.opt";
    let source = std::fs::read_to_string(file).expect("example exists");
    let base = [("layers", "1"), ("hidden", "16"), ("heads", "4"), ("vocab", "50"), ("context", "8")];
    let more = [("seq", "8"), ("batch", "4")];
    let overrides: Vec<Override> = base
        .iter()
        .chain(&more)
        .chain(sets)
        .map(|(n, v)| Override { name: n.to_string(), value: v.to_string() })
        .collect();
    let model = check_source(&source, &overrides).model.expect("example checks");
    let target = Target::plain(Mesh::new(mesh.0, mesh.1), strategy, mode);
    match compile(&model, file, &source, target) {
        Ok(p) => p,
        Err(d) => panic!("compile failed: {}", optimus::diag::render_plain(file, &source, &d)),
    }
}

fn plan(mesh: (u64, u64), strategy: Strategy) -> Plan {
    plan_with(&[], mesh, strategy, Mode::Train)
}

/// The four plans every checkpoint is moved between.
fn plans() -> Vec<Plan> {
    vec![
        plan((2, 2), Strategy::Optimus),
        plan((4, 4), Strategy::Optimus),
        plan((1, 4), Strategy::Megatron),
        plan((1, 1), Strategy::None),
    ]
}

/// A fresh, empty directory for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("checkpoint_format").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}

/// Distinct pseudo-random values for every parameter and optimizer state, by tensor key.
fn logical_tensors(plan: &Plan) -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    for (k, p) in plan.params.iter().enumerate() {
        let keys = std::iter::once(p.name.clone()).chain((0..p.state.len()).map(|s| state_key(&p.name, s)));
        for (s, key) in keys.enumerate() {
            let n = p.shape.iter().product::<u64>();
            let values = (0..n).map(|e| value(k as u64 * 8 + s as u64, e)).collect();
            out.insert(key, Tensor::from_f32(&p.shape, values));
        }
    }
    out
}

fn value(stream: u64, index: u64) -> f32 {
    let h = optimus::plan::init::mix64(stream.wrapping_mul(0x9E37_79B9) ^ index);
    (h >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

/// A device's block of a logical tensor laid out as `meta`, padding zero.
fn expected_block(logical: &Tensor, meta: &Buffer, coords: Coords, mesh: Mesh) -> Tensor {
    block_of(&pad_to(logical, meta).expect("pads"), meta, coords, mesh).expect("block")
}

fn devices(mesh: Mesh) -> impl Iterator<Item = Coords> {
    mesh.all_coords()
}

/// Writes a checkpoint of `logical` from every device of `plan`; returns its directory.
fn write(plan: &Plan, dir: &Path, step: u64, logical: &BTreeMap<String, Tensor>, keep: Option<u64>) -> PathBuf {
    let writer = CheckpointWriter::create(dir, step).expect("begins");
    for coords in devices(plan.mesh) {
        let blocks: Vec<(Tensor, Vec<Tensor>)> = plan
            .params
            .iter()
            .map(|p| {
                let block = |key: &str, id| expected_block(&logical[key], plan.buffer(id), coords, plan.mesh);
                let states = p.state.iter().enumerate().map(|(k, &id)| block(&state_key(&p.name, k), id)).collect();
                (block(&p.name, p.buffer), states)
            })
            .collect();
        let views: Vec<DeviceParamBlocks> =
            blocks.iter().map(|(param, states)| DeviceParamBlocks { param, states: states.iter().collect() }).collect();
        writer.write_device(plan, coords, &views).expect("device writes");
    }
    let training = serde_json::json!({"seed": 7, "step": step, "wrote": plan.mesh.to_string()});
    writer.commit(plan, training, keep).expect("commits")
}

/// Every device block of `plan` read from `checkpoint` equals the block of the logical tensors.
fn assert_reads_back(checkpoint: &Checkpoint, plan: &Plan, logical: &BTreeMap<String, Tensor>, what: &str) {
    for coords in devices(plan.mesh) {
        let blocks = checkpoint.device_blocks(plan, coords, true).expect("device blocks");
        assert_eq!(blocks.len(), plan.params.len());
        for (p, (param, states)) in plan.params.iter().zip(&blocks) {
            let expected = expected_block(&logical[&p.name], plan.buffer(p.buffer), coords, plan.mesh);
            assert_eq!(param, &expected, "{what}: `{}` on device {coords}", p.name);
            assert_eq!(states.len(), p.state.len());
            for (k, (state, &id)) in states.iter().zip(&p.state).enumerate() {
                let expected = expected_block(&logical[&state_key(&p.name, k)], plan.buffer(id), coords, plan.mesh);
                assert_eq!(state, &expected, "{what}: state {k} of `{}` on device {coords}", p.name);
            }
        }
    }
}

fn files_of(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir).expect("readable").map(|e| e.expect("entry").path()).collect();
    files.sort();
    files
}

// ---- resharding ----------------------------------------------------------------------------------

#[test]
fn every_mesh_reads_what_every_mesh_wrote() {
    let plans = plans();
    let padded: Vec<Vec<u64>> = plans.iter().map(|p| p.buffer(p.params[0].buffer).logical_shape.clone()).collect();
    assert!(plans.iter().any(|p| !p.padding.is_empty()), "some plan pads the vocabulary: {padded:?}");
    let logical = logical_tensors(&plans[0]);
    for (s, source) in plans.iter().enumerate() {
        let dir = write(source, &scratch(&format!("reshard-{s}")), 3, &logical, None);
        assert!(dir.ends_with("step-00000003"), "{}", dir.display());
        let checkpoint = Checkpoint::open(dir.parent().expect("parent")).expect("opens the latest");
        assert_eq!(checkpoint.step(), 3);
        assert_eq!(checkpoint.training()["wrote"], source.mesh.to_string());
        for target in &plans {
            let what =
                format!("{} {} -> {} {}", source.strategy.name(), source.mesh, target.strategy.name(), target.mesh);
            assert_reads_back(&checkpoint, target, &logical, &what);
        }
        let params = checkpoint.logical_params(Some(source)).expect("logical params");
        for p in &source.params {
            assert_eq!(params[&p.name], logical[&p.name], "logical `{}`", p.name);
        }
    }
}

#[test]
fn replicated_data_is_stored_once_and_padding_never() {
    let source = plan((4, 4), Strategy::Optimus);
    let logical = logical_tensors(&source);
    let dir = write(&source, &scratch("stored-once"), 1, &logical, None);
    let checkpoint = Checkpoint::open(&dir).expect("opens");
    for (name, record) in &checkpoint.manifest().tensors {
        let stored: u64 = record
            .pieces
            .iter()
            .map(|p| p.slice.iter().map(|d| d.iter().map(|i| i[1]).sum::<u64>()).product::<u64>())
            .sum();
        assert_eq!(stored, record.shape.iter().product::<u64>(), "`{name}` is stored exactly once");
    }
    // The fused qkv weight's head split takes several intervals of its last dimension.
    let fused =
        checkpoint.manifest().tensors.values().flat_map(|t| &t.pieces).any(|p| p.slice.iter().any(|d| d.len() > 1));
    assert!(fused, "some piece is non-contiguous");
    let files = checkpoint.manifest().files.len();
    assert_eq!(files, 16, "every device of a 4x4 mesh stores a part");
    // Sidecars are gone; only device files and the manifest remain.
    for file in files_of(&dir) {
        let name = file.file_name().expect("name").to_string_lossy().into_owned();
        assert!(name == "manifest.json" || name.ends_with(".safetensors"), "{name}");
    }
}

#[test]
fn export_writes_the_hugging_face_tensors() {
    let source = plan((2, 2), Strategy::Optimus);
    let logical = logical_tensors(&source);
    let root = scratch("export");
    write(&source, &root.join("ckpt"), 5, &logical, None);
    let out = root.join("model.safetensors");
    let checkpoint = Checkpoint::open(&root.join("ckpt")).expect("opens");
    let summary = export_safetensors(&checkpoint, &out).expect("exports");
    assert_eq!((summary.step, summary.tensors), (5, source.params.len()));
    let single = plan((1, 1), Strategy::None);
    let loaded = load_checkpoint(&out, &single, false).expect("the export loads as a Hugging Face file");
    for p in &single.params {
        assert_eq!(loaded[&p.name], logical[&p.name], "`{}`", p.name);
    }
    let bytes = std::fs::read(&out).expect("written");
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).expect("valid");
    assert_eq!(metadata.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));
    let prefix = source.checkpoint_prefix.clone().unwrap_or_default();
    assert!(metadata.info(&format!("{prefix}{}", source.params[0].checkpoint)).is_some(), "prefixed names");
}

#[test]
fn the_command_line_exports_and_runs_from_a_checkpoint_directory() {
    let source = plan((1, 4), Strategy::Megatron);
    let logical = logical_tensors(&source);
    let root = scratch("cli");
    write(&source, &root.join("ckpt"), 2, &logical, None);
    let exe = env!("CARGO_BIN_EXE_optimusc");
    let exported = root.join("exported.safetensors");
    let status = Command::new(exe).arg("export").arg(root.join("ckpt")).arg("-o").arg(&exported).status();
    assert!(status.expect("runs").success(), "export succeeds");
    // Inference does not change the weights: what --weights DIR loads is what --save-weights writes.
    let saved = root.join("saved.safetensors");
    let sets = ["layers=1", "hidden=16", "heads=4", "vocab=50", "context=8", "seq=8", "batch=4"];
    let mut run = Command::new(exe);
    run.args(["run", "examples/gpt2.opt", "--mesh", "2x2", "--mode", "infer", "--steps", "1", "--weights"]);
    run.arg(root.join("ckpt")).arg("--save-weights").arg(&saved);
    for s in sets {
        run.args(["--set", s]);
    }
    let output = run.output().expect("runs");
    assert!(output.status.success(), "run --weights DIR: {}", String::from_utf8_lossy(&output.stderr));
    let single = plan((1, 1), Strategy::None);
    for file in [&exported, &saved] {
        let loaded = load_checkpoint(file, &single, false).expect("loads");
        for p in &single.params {
            assert_eq!(loaded[&p.name], logical[&p.name], "`{}` in {}", p.name, file.display());
        }
    }
}

/// `export --tokenizer` refuses a tokenizer whose ids the checkpoint's vocabulary cannot hold (GPT-2's
/// 50,257 beside tiny.opt's 101), as `run --tokenizer` does, before writing anything.
#[test]
fn export_refuses_a_tokenizer_larger_than_the_vocabulary() {
    let root = scratch("export-tokenizer");
    let exe = env!("CARGO_BIN_EXE_optimusc");
    let ckpt = root.join("ckpt");
    let trained = Command::new(exe)
        .args(["run", "examples/tiny.opt", "--steps", "1", "--checkpoint-dir"])
        .arg(&ckpt)
        .output()
        .expect("runs");
    assert!(trained.status.success(), "{}", String::from_utf8_lossy(&trained.stderr));
    let exported = root.join("exported");
    let out = Command::new(exe)
        .arg("export")
        .arg(&ckpt)
        .arg("-o")
        .arg(format!("{}/", exported.display()))
        .args(["--tokenizer", "gpt2"])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("makes ids up to 50256") && stderr.contains("a vocabulary of 101"), "{stderr}");
    assert!(!exported.exists(), "nothing written");
}

// ---- damage --------------------------------------------------------------------------------------

/// Reads everything a 1x1 plan needs (every file) with optimizer state.
fn read_all(dir: &Path, target: &Plan) -> Result<(), String> {
    let checkpoint = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    checkpoint.device_blocks(target, Coords::default(), true).map(|_| ()).map_err(|e| e.to_string())
}

#[test]
fn a_flipped_byte_in_any_file_is_an_error_naming_it() {
    let source = plan((2, 2), Strategy::Optimus);
    let target = plan((1, 1), Strategy::None);
    let dir = write(&source, &scratch("flip"), 1, &logical_tensors(&source), None);
    for file in files_of(&dir) {
        let original = std::fs::read(&file).expect("readable");
        let len = original.len();
        for at in [0, 7, 8, 100, len / 2, len - 5, len - 1] {
            let mut bytes = original.clone();
            bytes[at] ^= 0x01;
            std::fs::write(&file, &bytes).expect("writes");
            let error = read_all(&dir, &target).expect_err("a flipped byte is noticed");
            let name = file.file_name().expect("name").to_string_lossy().into_owned();
            assert!(error.contains(&name), "flipping byte {at} of {name}: {error}");
        }
        std::fs::write(&file, &original).expect("restores");
    }
    read_all(&dir, &target).expect("the restored checkpoint reads");
}

#[test]
fn a_truncated_file_is_an_error_naming_it() {
    let source = plan((2, 2), Strategy::Optimus);
    let target = plan((1, 1), Strategy::None);
    let dir = write(&source, &scratch("truncate"), 1, &logical_tensors(&source), None);
    for file in files_of(&dir) {
        let original = std::fs::read(&file).expect("readable");
        for keep in [0, original.len() / 2, original.len() - 1] {
            std::fs::write(&file, &original[..keep]).expect("truncates");
            let error = read_all(&dir, &target).expect_err("a truncated file is noticed");
            let name = file.file_name().expect("name").to_string_lossy().into_owned();
            assert!(error.contains(&name), "{name} cut to {keep} bytes: {error}");
        }
        std::fs::write(&file, &original).expect("restores");
    }
}

#[test]
fn a_plan_of_another_model_is_told_what_differs() {
    let source = plan((2, 2), Strategy::Optimus);
    let dir = write(&source, &scratch("mismatch"), 1, &logical_tensors(&source), None);
    let checkpoint = Checkpoint::open(&dir).expect("opens");
    let wider = plan_with(&[("hidden", "32")], (1, 1), Strategy::None, Mode::Train);
    let error = checkpoint.device_blocks(&wider, Coords::default(), false).expect_err("shapes differ").to_string();
    assert!(error.contains("expected [") && error.contains(&wider.params[0].name), "{error}");
    let deeper = plan_with(&[("layers", "2")], (1, 1), Strategy::None, Mode::Train);
    let error = checkpoint.logical_params(Some(&deeper)).expect_err("a layer is missing").to_string();
    assert!(error.contains("missing `"), "{error}");
    let infer = plan_with(&[], (1, 1), Strategy::None, Mode::Infer);
    let error =
        checkpoint.device_blocks(&infer, Coords::default(), true).expect_err("no optimizer state to match").to_string();
    assert!(error.contains("state tensors"), "{error}");
    checkpoint.device_blocks(&infer, Coords::default(), false).expect("parameters alone load into an inference plan");
}

// ---- directories ---------------------------------------------------------------------------------

#[test]
fn unfinished_directories_are_never_checkpoints() {
    let source = plan((1, 1), Strategy::None);
    let logical = logical_tensors(&source);
    let root = scratch("unfinished");
    let error = Checkpoint::open(&root).expect_err("an empty directory holds none").to_string();
    assert!(error.contains("no checkpoint"), "{error}");
    // A folder holding only a checkpoint whose writing was stopped says so.
    std::fs::create_dir_all(root.join("step-00000001.tmp")).expect("creates");
    let error = Checkpoint::open(&root).expect_err("an unfinished one is none").to_string();
    assert!(error.contains("step-00000001.tmp`, whose writing never finished"), "{error}");
    std::fs::remove_dir(root.join("step-00000001.tmp")).expect("removes");
    let done = write(&source, &root, 2, &logical, None);
    // A later step still staged (with a manifest even), and a later one without a manifest.
    let staged = root.join("step-00000009.tmp");
    std::fs::create_dir_all(&staged).expect("creates");
    std::fs::copy(done.join("manifest.json"), staged.join("manifest.json")).expect("copies");
    std::fs::create_dir_all(root.join("step-00000010")).expect("creates");
    assert_eq!(Checkpoint::open(&root).expect("opens").step(), 2);
    assert!(Checkpoint::open(&staged).is_err_and(|e| e.to_string().contains("still being written")));
    // A new checkpoint removes stale staging directories; its own commit leaves none.
    std::fs::create_dir_all(root.join("step-00000001.tmp")).expect("creates");
    write(&source, &root, 4, &logical, None);
    let names: Vec<String> =
        files_of(&root).iter().map(|p| p.file_name().expect("name").to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["step-00000002", "step-00000004", "step-00000010"]);
    assert_eq!(Checkpoint::open(&root).expect("opens").step(), 4);
}

/// A folder whose latest checkpoint's manifest is damaged is not opened at an older one without a
/// word: the error names the damage, that it is the latest, and the one before it (or that it is the
/// only one).
#[test]
fn a_folder_whose_latest_checkpoint_is_damaged_names_the_one_before_it() {
    let source = plan((1, 1), Strategy::None);
    let logical = logical_tensors(&source);
    let root = scratch("damaged-latest");
    write(&source, &root, 3, &logical, None);
    let latest = write(&source, &root, 5, &logical, None);
    std::fs::write(latest.join("manifest.json"), b"garbage").expect("write");
    let error = Checkpoint::open(&root).expect_err("the latest is damaged").to_string();
    let earlier = root.join("step-00000003");
    assert!(error.contains("does not begin with the `manifest_sha256`"), "{error}");
    assert!(
        error.contains("it is the latest checkpoint in") && error.contains(&earlier.display().to_string()),
        "{error}"
    );
    assert_eq!(Checkpoint::open(&earlier).expect("the earlier one opens").step(), 3);
    std::fs::remove_dir_all(&earlier).expect("remove");
    let error = Checkpoint::open(&root).expect_err("the only one is damaged").to_string();
    assert!(error.contains("it is the only checkpoint in"), "{error}");
}

#[test]
fn retention_keeps_the_newest_and_a_step_is_replaced_whole() {
    let source = plan((2, 2), Strategy::Optimus);
    let logical = logical_tensors(&source);
    let root = scratch("retention");
    for step in 1..=4 {
        write(&source, &root, step, &logical, Some(2));
    }
    let steps: Vec<u64> = complete_checkpoints(&root).into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, [3, 4]);
    // Step 4 again, from another mesh: the new one replaces the old, and nothing else is left.
    let other = plan((1, 4), Strategy::Megatron);
    write(&other, &root, 4, &logical, Some(2));
    let checkpoint = Checkpoint::open(&root).expect("opens");
    assert_eq!((checkpoint.step(), checkpoint.manifest().mesh), (4, other.mesh));
    assert_reads_back(&checkpoint, &source, &logical, "after replacing");
    assert_eq!(files_of(&root).len(), 2, "{:?}", files_of(&root));
}

// ---- manifests that lie --------------------------------------------------------------------------

/// Rewrites a checkpoint's manifest through `edit`, with a valid `manifest_sha256` (as a forger would).
fn forge_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    use sha2::{Digest, Sha256};
    let path = dir.join("manifest.json");
    let mut manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("JSON");
    manifest.as_object_mut().expect("object").remove("manifest_sha256");
    edit(&mut manifest);
    let body = serde_json::to_string_pretty(&manifest).expect("serialises");
    let rest = format!("{}\n", body.strip_prefix('{').expect("an object"));
    let hash: String = Sha256::digest(rest.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(&path, format!("{{\n  \"manifest_sha256\": \"{hash}\",{rest}")).expect("write");
}

/// The first tensor with several pieces, by name.
fn split_tensor(manifest: &serde_json::Value) -> String {
    let tensors = manifest["tensors"].as_object().expect("tensors");
    tensors.iter().find(|(_, t)| t["pieces"].as_array().is_some_and(|p| p.len() > 1)).expect("a split tensor").0.clone()
}

/// A change to a manifest's JSON, given the name of a tensor with several pieces.
type ManifestEdit = fn(&mut serde_json::Value, &str);

/// Pieces must tile each tensor exactly: a duplicated piece in place of a missing one, a piece more, and
/// a shape larger than the pieces (which would allocate what no file holds) are errors naming the
/// tensor, on every reader, before anything the manifest's shapes ask for is allocated.
#[test]
fn pieces_that_do_not_tile_a_tensor_are_refused() {
    let source = plan((1, 2), Strategy::Megatron);
    let logical = logical_tensors(&source);
    let cases: [(&str, ManifestEdit); 3] = [
        ("the same elements", |m, name| {
            let pieces = m["tensors"][name]["pieces"].as_array_mut().expect("pieces");
            pieces[1] = pieces[0].clone();
        }),
        ("pieces must tile", |m, name| {
            let pieces = m["tensors"][name]["pieces"].as_array_mut().expect("pieces");
            pieces.push(pieces[0].clone());
        }),
        ("pieces must tile", |m, name| {
            let shape = m["tensors"][name]["shape"].as_array_mut().expect("shape");
            shape[0] = serde_json::json!(1u64 << 40);
        }),
    ];
    for (k, (wanted, edit)) in cases.into_iter().enumerate() {
        let root = scratch(&format!("forged-{k}"));
        let dir = write(&source, &root, 1, &logical, None);
        let mut name = String::new();
        forge_manifest(&dir, |m| {
            name = split_tensor(m);
            edit(m, &name);
        });
        let error = match Checkpoint::open(&dir) {
            Err(e) => e.to_string(),
            Ok(checkpoint) => {
                let whole = checkpoint.logical_params(None).err().map(|e| e.to_string());
                let blocks = checkpoint.device_blocks(&source, Coords::default(), true).err();
                let exported = export_safetensors(&checkpoint, &root.join("out.safetensors")).err();
                assert!(whole.is_some() && blocks.is_some() && exported.is_some(), "case {k}: a reader accepted it");
                whole.unwrap_or_default()
            }
        };
        assert!(error.contains(wanted) && error.contains(&name), "case {k}: {error}");
    }
}
