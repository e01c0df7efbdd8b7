//! Checkpoint orientation of linear weights: a model declaring `linear_orientation: "out_in"` (or a linear's
//! `orientation: "out_in"`) stores its linear weights `[out, in]` in checkpoints, as torch.nn.Linear does, and
//! loads them back transposed; square layers included, so the shape alone is never what decides.

use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A small decoder with Hugging Face's Llama-style names: a `model` block holding `layers` (named like the
/// config value), one square and two non-square linears per layer, an untied head.
const MODEL: &str = r#"model t(linear_orientation: "out_in")
config {
  vocab = 40
  seq = 6
  batch = 2
  layers = 2
  hidden = 8
  ffn = 12
}
input tokens: i32[batch, seq]
input targets: i32[batch, seq]
block Layer {
  layer sq   = linear(hidden, hidden)
  layer up   = linear(hidden, ffn, bias: false)
  layer down = linear(ffn, hidden, bias: false)
  forward(x) {
    x = x + sq(x)
    return x + down(gelu(up(x)))
  }
}
block Model {
  layer embed_tokens = embedding(vocab, hidden)
  layer layers = repeat(layers) Layer()
  layer norm = layernorm(hidden)
  forward(tokens) {
    return norm(layers(embed_tokens(tokens)))
  }
}
layer model = Model()
layer lm_head = linear(hidden, vocab, bias: false)
forward {
  output loss = cross_entropy(lm_head(model(tokens)), targets)
}
"#;

fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("orientation").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}

fn optimusc(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// One SGD step at learning rate 0 from seed 7 (or from `weights`): the initial weights, saved, and the loss.
fn save_initial(model: &Path, out: &Path, weights: Option<&Path>) -> String {
    let mut args = vec![
        "run",
        model.to_str().expect("utf-8 path"),
        "--steps",
        "1",
        "--seed",
        "7",
        "--optimizer",
        "sgd",
        "--lr",
        "0",
        "--save-weights",
        out.to_str().expect("utf-8 path"),
    ];
    if let Some(w) = weights {
        args.extend(["--weights", w.to_str().expect("utf-8 path")]);
    }
    let (ok, text) = optimusc(&args);
    assert!(ok, "{text}");
    let line = text.lines().find(|l| l.starts_with("step 0:")).unwrap_or_else(|| panic!("no step line: {text}"));
    line.split_whitespace().nth(3).expect("loss").to_string()
}

fn tensor(file: &SafeTensors<'_>, key: &str) -> (Vec<usize>, Vec<f32>) {
    let view = file.tensor(key).unwrap_or_else(|e| panic!("{key}: {e}"));
    let values = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    (view.shape().to_vec(), values)
}

#[test]
fn out_in_weights_are_the_transpose_of_in_out_weights_and_load_back() {
    let dir = scratch("transpose");
    let out_in = dir.join("out_in.opt");
    let in_out = dir.join("in_out.opt");
    std::fs::write(&out_in, MODEL).expect("write");
    std::fs::write(&in_out, MODEL.replace(r#"(linear_orientation: "out_in")"#, "")).expect("write");
    let (a, b) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    let loss_out_in = save_initial(&out_in, &a, None);
    let loss_in_out = save_initial(&in_out, &b, None);
    assert_eq!(loss_out_in, loss_in_out, "same seed, same model: the orientation only changes the files");

    let (bytes_a, bytes_b) = (std::fs::read(&a).expect("read"), std::fs::read(&b).expect("read"));
    let (fa, fb) =
        (SafeTensors::deserialize(&bytes_a).expect("valid"), SafeTensors::deserialize(&bytes_b).expect("valid"));
    let mut names = fa.names();
    names.sort();
    let mut transposed = 0;
    for key in names {
        let ((sa, va), (sb, vb)) = (tensor(&fa, key), tensor(&fb, key));
        let linear = key.ends_with("weight")
            && (key.contains(".sq.") || key.contains(".up.") || key.contains(".down.") || key.starts_with("lm_head"));
        if !linear {
            assert_eq!((&sa, &va), (&sb, &vb), "{key} is not a linear weight and is stored as it is");
            continue;
        }
        let (rows, cols) = (sb[0], sb[1]);
        assert_eq!(sa, vec![cols, rows], "{key}: [out, in]");
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(va[c * rows + r], vb[r * cols + c], "{key}[{r}, {c}]");
            }
        }
        transposed += 1;
    }
    assert_eq!(transposed, 7, "three linears in each of two layers, and the head");

    // Each file loads into its own model and reproduces the loss; the other orientation's file does not load.
    assert_eq!(save_initial(&out_in, &dir.join("a2.safetensors"), Some(&a)), loss_out_in);
    assert_eq!(save_initial(&in_out, &dir.join("b2.safetensors"), Some(&b)), loss_in_out);
    let (ok, text) =
        optimusc(&["run", out_in.to_str().expect("utf-8"), "--steps", "1", "--weights", b.to_str().expect("utf-8")]);
    assert!(!ok, "an [in, out] file must not load into an [out, in] model: {text}");
    assert!(text.contains("[out, in]"), "the error says which orientation was expected: {text}");
}

#[test]
fn a_layer_may_share_a_config_values_name() {
    let dir = scratch("names");
    let model = dir.join("m.opt");
    std::fs::write(&model, MODEL).expect("write");
    let (ok, text) = optimusc(&["check", model.to_str().expect("utf-8")]);
    assert!(ok, "{text}");
    // embed 40*8, per layer sq 8*8+8, up 8*12, down 12*8, norm 16, head 8*40: the config `layers` (2) repeats.
    let params = 40 * 8 + 2 * (8 * 8 + 8 + 8 * 12 + 12 * 8) + 16 + 8 * 40;
    assert_eq!(params, 1184);
    assert!(text.contains("1,184 parameters"), "{text}");
}

#[test]
fn export_writes_out_in_weights_as_save_weights_does() {
    let dir = scratch("export");
    let model = dir.join("m.opt");
    std::fs::write(&model, MODEL).expect("write");
    let (saved, ckpt, exported) = (dir.join("saved.safetensors"), dir.join("ckpt"), dir.join("exported.safetensors"));
    let (ok, text) = optimusc(&[
        "run",
        model.to_str().expect("utf-8"),
        "--mesh",
        "2x2",
        "--steps",
        "2",
        "--checkpoint-dir",
        ckpt.to_str().expect("utf-8"),
        "--checkpoint-every",
        "2",
        "--save-weights",
        saved.to_str().expect("utf-8"),
    ]);
    assert!(ok, "{text}");
    let (ok, text) = optimusc(&["export", ckpt.to_str().expect("utf-8"), "-o", exported.to_str().expect("utf-8")]);
    assert!(ok, "{text}");
    let (a, b) = (std::fs::read(&saved).expect("read"), std::fs::read(&exported).expect("read"));
    let (fa, fb) = (SafeTensors::deserialize(&a).expect("valid"), SafeTensors::deserialize(&b).expect("valid"));
    let mut names = fa.names();
    names.sort();
    let mut other = fb.names();
    other.sort();
    assert_eq!(names, other);
    for key in names {
        assert_eq!(tensor(&fa, key), tensor(&fb, key), "{key}");
    }
}
