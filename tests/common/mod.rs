//! Helpers shared by the end-to-end tests that run `optimusc` and compare saved weights.

use safetensors::SafeTensors;
use std::path::Path;
use std::process::{Command, Output};

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
