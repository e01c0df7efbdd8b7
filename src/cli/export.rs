//! `optimusc export`: one Hugging Face safetensors file from a sharded training checkpoint.

use super::Failure;
use optimus::io::shards::{Checkpoint, ExportSummary, export_safetensors};
use optimus::plan::text::group_digits;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug, Clone)]
pub struct ExportArgs {
    /// A checkpoint directory (DIR/step-NNNNNNNN, with manifest.json), or a directory of them, of which
    /// the latest complete one is exported. No model is needed: names come from the manifest.
    pub checkpoint: PathBuf,
    /// The safetensors file to write: every parameter as F32 under its Hugging Face name (with the
    /// model's checkpoint prefix, as `run --save-weights` writes), tied weights once, metadata
    /// format=pt. Written atomically; `-` writes to standard output. A directory (an existing one, or a
    /// path ending in `/`) gets what `from_pretrained` opens: `model.safetensors`, and for GPT-2, Llama
    /// and BERT models `config.json` (and `generation_config.json`) from the model the checkpoint was
    /// trained as.
    #[arg(short = 'o', long = "output", value_name = "FILE.safetensors|DIR/")]
    pub output: PathBuf,
    /// With `-o DIR/`: also write this tokenizer's `tokenizer.json` and `tokenizer_config.json` (`gpt2`,
    /// or a Hugging Face tokenizer.json), so that `AutoTokenizer.from_pretrained(DIR)` opens the folder.
    #[arg(long, value_name = "gpt2|PATH/tokenizer.json")]
    pub tokenizer: Option<String>,
}

/// Runs `optimusc export`.
pub fn export(args: &ExportArgs) -> ExitCode {
    match export_checkpoint(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => e.exit(),
    }
}

/// The exported file must not go into the checkpoint it is read from: a checkpoint holds only what its
/// manifest lists.
fn refuse_writing_into(output: &std::path::Path, checkpoint: &std::path::Path) -> Result<(), Failure> {
    if output.as_os_str() == "-" {
        return Ok(());
    }
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    let (Ok(into), Ok(checkpoint)) = (std::fs::canonicalize(parent), std::fs::canonicalize(checkpoint)) else {
        return Ok(());
    };
    if into.starts_with(&checkpoint) {
        return Err(Failure::usage(format!(
            "-o `{}` is inside the checkpoint `{}`, which holds only what its manifest lists; write the export \
             elsewhere",
            output.display(),
            checkpoint.display()
        )));
    }
    Ok(())
}

fn export_checkpoint(args: &ExportArgs) -> Result<(), Failure> {
    let checkpoint = Checkpoint::open(&args.checkpoint).map_err(|e| e.to_string())?;
    refuse_writing_into(&args.output, checkpoint.dir())?;
    let folder = args.output.as_os_str() != "-" && super::run::saves_a_directory(&args.output);
    if args.tokenizer.is_some() && !folder {
        return Err(Failure::usage("--tokenizer writes the tokenizer's files into -o DIR/: give a folder".into()));
    }
    let tokenizer = args
        .tokenizer
        .as_deref()
        .map(optimus::text::Tokenizer::load)
        .transpose()
        .map_err(|e| Failure::usage(format!("--tokenizer: {e}")))?;
    if let Some(tokenizer) = &tokenizer {
        check_tokenizer_fits(tokenizer, &checkpoint)?;
    }
    let weights = if folder { args.output.join(optimus::io::pretrained::SINGLE_FILE) } else { args.output.clone() };
    if !folder && args.output.as_os_str() != "-" {
        // Checked before the checkpoint's shards are read and gathered, as the folder's files are.
        super::check_output(&args.output, "-o")?;
    }
    let mut made = Vec::new();
    if folder {
        // Every file the folder will hold is checked before any is written.
        let tokenizer_files = if tokenizer.is_some() { &optimus::text::HUB_FILES[..] } else { &[] };
        let names = optimus::io::pretrained::folder_files(tokenizer_files);
        made = optimus::io::pretrained::make_writable_folder(&args.output, &names)
            .map_err(|e| Failure::usage(e.to_string()))?;
    }
    let written = write_export(args, (&checkpoint, tokenizer.as_ref()), &weights, folder);
    if written.is_err() {
        // A checkpoint that cannot be read (a shard cut short, a checksum that differs) leaves no
        // empty folder behind.
        optimus::io::pretrained::remove_made_folders(&made);
    }
    let summary = written?;
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

/// Writes the checkpoint's weights to `weights` and, into a folder, its config and the tokenizer's
/// files, and removes the weight files of an earlier save there (an index and its shards, which
/// `--weights DIR` would otherwise read instead of the new file).
fn write_export(
    args: &ExportArgs,
    (checkpoint, tokenizer): (&Checkpoint, Option<&optimus::text::Tokenizer>),
    weights: &std::path::Path,
    folder: bool,
) -> Result<ExportSummary, Failure> {
    let summary = export_safetensors(checkpoint, weights).map_err(|e| e.to_string())?;
    if !folder {
        return Ok(summary);
    }
    let kept = [optimus::io::pretrained::SINGLE_FILE.to_string()];
    optimus::io::pretrained::remove_weight_files(&args.output, &kept).map_err(|e| e.to_string())?;
    write_hugging_face_config(checkpoint, &args.output)?;
    if let Some(tokenizer) = tokenizer {
        let context = checkpoint_context(checkpoint);
        for (name, text) in tokenizer.hub_files(context).map_err(|e| e.to_string())? {
            optimus::io::write_file(&args.output.join(name), text.as_bytes()).map_err(|e| e.to_string())?;
        }
    }
    Ok(summary)
}

/// The vocabulary the checkpoint's model was trained with: its recorded `vocab` config value, or the
/// Hugging Face config its manifest keeps; `None` for a checkpoint that records neither.
fn checkpoint_vocab(checkpoint: &Checkpoint) -> Option<u64> {
    let recorded = checkpoint.training()["config"]["vocab"].as_u64();
    let hugging_face = || checkpoint.manifest().hugging_face.as_ref()?.get("vocab_size")?.as_u64();
    recorded.or_else(hugging_face)
}

/// The context the checkpoint's model was trained with (its `context` config value), which the
/// tokenizer's config gives as `model_max_length`, as `run --save-weights` writes it.
fn checkpoint_context(checkpoint: &Checkpoint) -> Option<u64> {
    checkpoint.training()["config"]["context"].as_u64()
}

/// A tokenizer whose ids the checkpoint's embedding has no rows for is refused, as `run --tokenizer` is.
fn check_tokenizer_fits(tokenizer: &optimus::text::Tokenizer, checkpoint: &Checkpoint) -> Result<(), Failure> {
    match checkpoint_vocab(checkpoint) {
        Some(vocab) if u64::from(tokenizer.vocab_size()) > vocab => Err(Failure::usage(format!(
            "--tokenizer {} makes ids up to {}, and `{}` was trained with a vocabulary of {vocab}: its embedding \
             has no row for the others",
            tokenizer.name(),
            tokenizer.vocab_size() - 1,
            checkpoint.dir().display()
        ))),
        _ => Ok(()),
    }
}

/// Writes the config the checkpoint's manifest keeps beside the exported weights, or says why there is
/// none (a model that is not GPT-2, Llama or BERT, or a checkpoint written before manifests kept it).
fn write_hugging_face_config(checkpoint: &Checkpoint, dir: &std::path::Path) -> Result<(), Failure> {
    let kept = checkpoint.manifest().hugging_face.as_ref().and_then(optimus::io::hf_config::HfConfig::from_json);
    match kept {
        Some(config) => {
            optimus::io::pretrained::write_configs(dir, &config).map_err(|e| e.to_string())?;
        }
        None => eprintln_safe!(
            "note: no config.json: the checkpoint's manifest holds none (its model is not GPT-2, Llama or BERT, \
             or an older optimusc wrote it); from_pretrained needs one beside the weights"
        ),
    }
    Ok(())
}
