//! Helpers shared by the end-to-end tests that run `optimusc` and compare saved weights.

use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh, empty folder `name` for one test's files, under a folder of `suite` and this process (so
/// that nothing an earlier run left, even one whose process had the same id, meets this one).
#[allow(dead_code)] // not every suite that shares these helpers writes files
pub fn scratch(suite: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("optimus-{suite}-{}", std::process::id())).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Runs the built `optimusc` with `args`.
pub fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

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
