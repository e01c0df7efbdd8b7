//! `optimusc export`: one Hugging Face safetensors file from a sharded training checkpoint.

use super::Failure;
use optimus::diag::group_digits;
use optimus::io::shards::{Checkpoint, export_safetensors};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug, Clone)]
pub struct ExportArgs {
    /// A checkpoint directory (DIR/step-NNNNNNNN, with manifest.json), or a directory of them, of which
    /// the latest complete one is exported. No model is needed: names come from the manifest.
    pub checkpoint: PathBuf,
    /// The safetensors file to write: every parameter as F32 under its Hugging Face name (with the
    /// model's checkpoint prefix, as `run --save-weights` writes), tied weights once, metadata
    /// format=pt. Written atomically; `-` writes to standard output.
    #[arg(short = 'o', long = "output", value_name = "FILE.safetensors")]
    pub output: PathBuf,
}

/// Runs `optimusc export`.
pub fn export(args: &ExportArgs) -> ExitCode {
    match export_checkpoint(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => e.exit(),
    }
}

fn export_checkpoint(args: &ExportArgs) -> Result<(), Failure> {
    let checkpoint = Checkpoint::open(&args.checkpoint)?;
    let summary = export_safetensors(&checkpoint, &args.output)?;
    eprintln_safe!(
        "exported step {} of `{}` ({} tensors, {} parameters) to {}",
        summary.step,
        checkpoint.dir().display(),
        summary.tensors,
        group_digits(u128::from(summary.elements)),
        args.output.display()
    );
    Ok(())
}
