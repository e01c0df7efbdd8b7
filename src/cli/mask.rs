//! `optimusc mask-data`: BERT's masked inputs and MLM labels from a token file.

use super::Failure;
use super::run::DataDtype;
use optimus::io::data::{TokenData, TokenDtype};
use optimus::io::mask::{mask_tokens, output_paths};
use optimus::io::write_file;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug, Clone)]
pub struct MaskDataArgs {
    /// The token file to mask (flat little-endian integers of --data-dtype, as `run --data` reads).
    pub tokens: PathBuf,
    /// The id that replaces 80% of the chosen positions ([MASK]; 103 in BERT's WordPiece vocabulary).
    #[arg(long, value_name = "M")]
    pub mask_id: u32,
    /// Seed of the draws: the same seed and file give the same output.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Vocabulary size: random replacements are drawn from 0..V, and every token and the mask id must be
    /// below it [default: the largest of the file's ids and the mask id, plus 1].
    #[arg(long, value_name = "V", value_parser = clap::value_parser!(u64).range(1..))]
    pub vocab: Option<u64>,
    /// Element type of the input, and of both outputs.
    #[arg(long, value_enum, default_value_t = DataDtype::U16)]
    pub data_dtype: DataDtype,
    /// Writes OUT_PREFIX.tokens.bin (the masked inputs, for `run --data`) and OUT_PREFIX.labels.bin (the
    /// original token at chosen positions, the dtype's largest value elsewhere, for `run --labels`), each
    /// atomically.
    #[arg(short = 'o', long = "output", value_name = "OUT_PREFIX")]
    pub output: PathBuf,
}

/// The output prefix must end in a file name (`out/corpus`, not `out/`, which would write the hidden
/// `out/.tokens.bin`).
pub(super) fn check_output_prefix(prefix: &std::path::Path) -> Result<(), Failure> {
    let text = prefix.as_os_str().to_string_lossy();
    let named = prefix.file_name().is_some() && !text.ends_with('/') && !prefix.is_dir();
    if named {
        return Ok(());
    }
    Err(Failure::usage(format!(
        "-o `{}` names a folder, not a prefix: give a file name to start the outputs' names, as in `{}`",
        prefix.display(),
        std::path::Path::new(text.trim_end_matches('/')).join("corpus").display()
    )))
}

/// Runs `optimusc mask-data`.
pub fn mask_data(args: &MaskDataArgs) -> ExitCode {
    match mask_file(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => e.exit(),
    }
}

fn mask_file(args: &MaskDataArgs) -> Result<(), Failure> {
    check_output_prefix(&args.output)?;
    let (inputs, labels) = output_paths(&args.output);
    for output in [&inputs, &labels] {
        super::refuse_overwriting_input(output, &args.tokens, "-o")?;
        // Both checked before either is written: a failure leaves neither behind.
        super::check_output(output, "-o")?;
    }
    super::run::check_named_dtype(&args.tokens, args.data_dtype, "the token file")?;
    let dtype = if args.data_dtype == DataDtype::U32 { TokenDtype::U32 } else { TokenDtype::U16 };
    let data = TokenData::open(&args.tokens, dtype).map_err(|e| e.to_string())?;
    let masked = mask_tokens(&data, args.mask_id, args.vocab, args.seed).map_err(|e| Failure::usage(e.to_string()))?;
    for (path, bytes) in [(&inputs, &masked.inputs), (&labels, &masked.labels)] {
        write_file(path, bytes).map_err(|e| e.to_string())?;
    }
    let c = masked.counts;
    let share = |n: u64| 100.0 * n as f64 / c.positions.max(1) as f64;
    eprintln_safe!(
        "masked {} of {} positions ({:.2}%): {} mask id, {} random (vocabulary {}), {} kept; wrote {} and {}",
        c.chosen,
        c.positions,
        share(c.chosen),
        c.masked,
        c.random,
        masked.vocab,
        c.kept,
        inputs.display(),
        labels.display()
    );
    Ok(())
}
