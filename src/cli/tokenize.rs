//! `optimusc tokenize`: text corpora to the token files `run --data` reads, with a sidecar that names
//! the tokenizer and counts what was written.

use super::Failure;
use optimus::io::output::{write_file, write_with};
use optimus::plan::text::plural;
use optimus::text::Tokenizer;
use optimus::text::corpus::{Corpus, Piece};
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct TokenizeArgs {
    /// The corpus: text files (each one document, UTF-8) or JSON Lines files (`.jsonl`, each line's
    /// `"text"` one document), read in order.
    #[arg(required = true, value_name = "CORPUS")]
    pub corpus: Vec<PathBuf>,
    /// `gpt2` (GPT-2's byte-level BPE, built in, as tiktoken's `r50k_base`) or the path of a Hugging
    /// Face `tokenizer.json` (Llama 3's BPE, BERT's WordPiece, ...). Text is encoded as ordinary text:
    /// no special tokens are added around it.
    #[arg(long, default_value = "gpt2", value_name = "gpt2|PATH/tokenizer.json")]
    pub tokenizer: String,
    /// Writes PREFIX.u16 (PREFIX.u32 when the vocabulary has more than 65,535 tokens), PREFIX.val.u16
    /// with --val-fraction, and PREFIX.json: the tokenizer, the vocabulary size, the separator, the
    /// corpus files, their documents, bytes of text and tokens in all, and the tokens of each file
    /// written. Each file is replaced whole or not at all.
    #[arg(short = 'o', long = "output", value_name = "PREFIX")]
    pub output: PathBuf,
    /// The share of the tokens, taken from the end of the corpus, written to PREFIX.val.* for
    /// `run --val-data` (0 <= F < 1) [default: 0, no validation file].
    #[arg(long, value_name = "F", default_value_t = 0.0, hide_default_value = true)]
    pub val_fraction: f64,
    /// The token written between documents [default: the tokenizer's end-of-text token:
    /// <|endoftext|>, <|end_of_text|>, </s>, [SEP] or <eos>, whichever it has].
    #[arg(long, value_name = "TOKEN")]
    pub eot: Option<String>,
}

/// Runs `optimusc tokenize`.
pub fn tokenize(args: &TokenizeArgs) -> ExitCode {
    match tokenize_corpus(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => e.exit(),
    }
}

/// The files a tokenize run writes.
struct Outputs {
    train: PathBuf,
    val: Option<PathBuf>,
    sidecar: PathBuf,
}

impl Outputs {
    fn of(prefix: &Path, extension: &str, with_val: bool) -> Outputs {
        let named = |suffix: &str| {
            let mut name = prefix.as_os_str().to_os_string();
            name.push(suffix);
            PathBuf::from(name)
        };
        Outputs {
            train: named(&format!(".{extension}")),
            val: with_val.then(|| named(&format!(".val.{extension}"))),
            sidecar: named(".json"),
        }
    }

    fn all(&self) -> impl Iterator<Item = &PathBuf> {
        std::iter::once(&self.train).chain(&self.val).chain(std::iter::once(&self.sidecar))
    }

    /// The token files an earlier tokenize of this prefix wrote, as the sidecar there now names them,
    /// that these outputs do not replace: a validation split, or the other width's files. Only the
    /// names tokenize gives this prefix count, so nothing else is ever taken for one.
    fn left_by_earlier_run(&self, prefix: &Path) -> Vec<PathBuf> {
        let Ok(text) = std::fs::read_to_string(&self.sidecar) else { return Vec::new() };
        let Ok(earlier) = serde_json::from_str::<serde_json::Value>(&text) else { return Vec::new() };
        let named: Vec<&std::ffi::OsStr> = ["train", "val"]
            .iter()
            .filter_map(|split| earlier[split]["path"].as_str())
            .filter_map(|path| Path::new(path).file_name())
            .collect();
        let ours: Vec<PathBuf> = self.all().cloned().collect();
        ["u16", "u32"]
            .iter()
            .flat_map(|extension| {
                let earlier = Outputs::of(prefix, extension, true);
                std::iter::once(earlier.train).chain(earlier.val)
            })
            .filter(|path| !ours.contains(path) && path.is_file())
            .filter(|path| path.file_name().is_some_and(|name| named.contains(&name)))
            .collect()
    }
}

/// Removes the token files an earlier tokenize of the prefix left ([`Outputs::left_by_earlier_run`]),
/// once this run's are written, saying so: a stale validation split would be read as this corpus's.
fn remove_earlier_outputs(stale: &[PathBuf], sidecar: &Path) {
    for path in stale {
        match std::fs::remove_file(path) {
            Ok(()) => eprintln_safe!(
                "note: removed `{}`, written by an earlier tokenize of this prefix ({} no longer names it)",
                path.display(),
                sidecar.display()
            ),
            Err(e) => eprintln_safe!(
                "warning: `{}`, written by an earlier tokenize of this prefix, could not be removed ({e}); {} no \
                 longer names it",
                path.display(),
                sidecar.display()
            ),
        }
    }
}

/// What the stream of tokens held once the whole corpus was read.
struct Tokenized {
    tokens: u64,
    documents: u64,
    /// Bytes of the files read.
    file_bytes: u64,
    /// Bytes of the documents' text (a `.jsonl` file's `text` fields, not its JSON).
    text_bytes: u64,
}

fn tokenize_corpus(args: &TokenizeArgs) -> Result<(), Failure> {
    if !(0.0..1.0).contains(&args.val_fraction) {
        return Err(Failure::usage(format!("--val-fraction {} is not in [0, 1)", args.val_fraction)));
    }
    super::mask::check_output_prefix(&args.output)?;
    let tokenizer = Tokenizer::load(&args.tokenizer).map_err(|e| Failure::usage(e.to_string()))?;
    let separator = match &args.eot {
        Some(token) => Some(tokenizer.separator(Some(token)).map_err(|e| Failure::usage(e.to_string()))?),
        None => tokenizer.end_of_text().map(|(_, id)| id),
    };
    let wide = tokenizer.vocab_size() > u32::from(u16::MAX);
    let extension = if wide { "u32" } else { "u16" };
    let outputs = Outputs::of(&args.output, extension, args.val_fraction > 0.0);
    for output in outputs.all() {
        for input in args.corpus.iter().chain([&PathBuf::from(&args.tokenizer)]) {
            super::refuse_overwriting_input(output, input, "-o")?;
        }
        super::check_output(output, "-o")?;
    }
    let corpus = Corpus::open(&args.corpus).map_err(|e| e.to_string())?;
    warn_of_files_given_twice(&args.corpus);
    let stale = outputs.left_by_earlier_run(&args.output);
    let directory = outputs.train.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut stream = tempfile::tempfile_in(directory)
        .map_err(|e| format!("cannot make a scratch file in `{}`: {e}", directory.display()))?;
    let started = Instant::now();
    let tokenized = {
        let mut writer = TokenWriter { out: BufWriter::new(&mut stream), wide, tokens: 0 };
        let mut progress = Progress::new(corpus.total_bytes());
        let counted = stream_tokens(&corpus, &tokenizer, separator, &mut writer, &mut progress)?;
        writer.out.flush().map_err(|e| format!("cannot write the scratch file: {e}"))?;
        progress.finish();
        counted
    };
    let val_tokens = split_point(&tokenized, args.val_fraction)?;
    let train_tokens = tokenized.tokens - val_tokens;
    let width = if wide { 4 } else { 2 };
    copy_range(&mut stream, (0, train_tokens * width), &outputs.train)?;
    if let Some(val) = &outputs.val {
        copy_range(&mut stream, (train_tokens * width, val_tokens * width), val)?;
    }
    let sidecar = sidecar(args, &tokenizer, separator, &outputs, &tokenized, (train_tokens, val_tokens));
    let text = serde_json::to_string_pretty(&sidecar).map_err(|e| format!("cannot write the sidecar: {e}"))?;
    write_file(&outputs.sidecar, format!("{text}\n").as_bytes()).map_err(|e| e.to_string())?;
    remove_earlier_outputs(&stale, &outputs.sidecar);
    report(&outputs, &tokenized, (train_tokens, val_tokens), started.elapsed(), tokenizer.vocab_size());
    Ok(())
}

/// Little-endian token ids into the scratch file, u16 or u32.
struct TokenWriter<W: Write> {
    out: W,
    wide: bool,
    tokens: u64,
}

impl<W: Write> TokenWriter<W> {
    fn write(&mut self, ids: &[u32]) -> Result<(), Failure> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if self.wide {
                bytes.extend_from_slice(&id.to_le_bytes());
            } else {
                // The vocabulary is at most 65,535 tokens (see `tokenize_corpus`), so every id fits.
                let narrow = u16::try_from(id).map_err(|_| format!("token id {id} does not fit a u16 file"))?;
                bytes.extend_from_slice(&narrow.to_le_bytes());
            }
        }
        self.out.write_all(&bytes).map_err(|e| format!("cannot write the scratch file: {e}"))?;
        self.tokens += ids.len() as u64;
        Ok(())
    }
}

/// Text tokenized in parallel per batch of this many bytes of pieces.
const BATCH_BYTES: usize = 8 << 20;

/// Tokenizes every piece of the corpus in order into `writer`, with `separator` between documents.
fn stream_tokens<W: Write>(
    corpus: &Corpus,
    tokenizer: &Tokenizer,
    separator: Option<u32>,
    writer: &mut TokenWriter<W>,
    progress: &mut Progress,
) -> Result<Tokenized, Failure> {
    let mut pieces = corpus.pieces();
    let mut documents = 0u64;
    let mut text_bytes = 0u64;
    loop {
        let mut batch: Vec<Piece> = Vec::new();
        let mut bytes = 0;
        while bytes < BATCH_BYTES {
            match pieces.next() {
                Some(piece) => {
                    let piece = piece.map_err(|e| e.to_string())?;
                    bytes += piece.text.len();
                    batch.push(piece);
                }
                None => break,
            }
        }
        if batch.is_empty() {
            let file_bytes = corpus.total_bytes();
            return Ok(Tokenized { tokens: writer.tokens, documents, file_bytes, text_bytes });
        }
        let texts: Vec<String> = batch.iter().map(|p| p.text.clone()).collect();
        let ids = tokenizer.encode_all(&texts).map_err(|e| e.to_string())?;
        for (piece, ids) in batch.iter().zip(&ids) {
            text_bytes += piece.text.len() as u64;
            if piece.starts_document {
                documents += 1;
                if documents > 1 {
                    let id = separator.ok_or_else(|| {
                        optimus::text::TextError::NoEndOfText { tokenizer: tokenizer.name().to_string() }.to_string()
                    })?;
                    writer.write(&[id])?;
                }
            }
            writer.write(ids)?;
        }
        if let Some(last) = batch.last() {
            progress.update(last.bytes_read, writer.tokens);
        }
    }
}

/// How many of the tokens go to validation: `fraction` of them, rounded, and at least one token on
/// each side when a fraction is asked for.
fn split_point(tokenized: &Tokenized, fraction: f64) -> Result<u64, Failure> {
    let tokens = tokenized.tokens;
    if tokens == 0 && tokenized.file_bytes == 0 {
        return Err("the corpus has no tokens: every file is empty".to_string().into());
    }
    if tokens == 0 && tokenized.text_bytes == 0 {
        return Err("the corpus has no tokens: it has no text (every `text` of its .jsonl lines is empty)"
            .to_string()
            .into());
    }
    if tokens == 0 {
        let bytes = plural(tokenized.text_bytes, "byte");
        return Err(format!("the corpus has no tokens: the tokenizer made none of its {bytes} of text").into());
    }
    if fraction == 0.0 {
        return Ok(0);
    }
    let val = (tokens as f64 * fraction).round() as u64;
    if val == 0 || val >= tokens {
        return Err(Failure::usage(format!(
            "--val-fraction {fraction} of {tokens} tokens leaves {} for training and {val} for validation: \
             each needs at least one",
            tokens.saturating_sub(val)
        )));
    }
    Ok(val)
}

/// Writes bytes `start..start + len` of the scratch file to `path` (replaced whole or not at all).
fn copy_range(stream: &mut File, (start, len): (u64, u64), path: &Path) -> Result<(), Failure> {
    stream.seek(SeekFrom::Start(start)).map_err(|e| format!("cannot read the scratch file: {e}"))?;
    let mut part = stream.take(len);
    write_with(path, &mut |out: &mut dyn Write| std::io::copy(&mut part, out).map(|_| ()))
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn sidecar(
    args: &TokenizeArgs,
    tokenizer: &Tokenizer,
    separator: Option<u32>,
    outputs: &Outputs,
    tokenized: &Tokenized,
    (train, val): (u64, u64),
) -> serde_json::Value {
    let file = |path: &PathBuf, tokens: u64| serde_json::json!({"path": path.display().to_string(), "tokens": tokens});
    let separator = separator.map(|id| {
        let token = tokenizer.decode(&[id]).unwrap_or_default();
        serde_json::json!({"id": id, "token": token})
    });
    serde_json::json!({
        "tokenizer": tokenizer.name(),
        "vocab_size": tokenizer.vocab_size(),
        "dtype": if tokenizer.vocab_size() > u32::from(u16::MAX) { "u32" } else { "u16" },
        "separator": separator,
        "corpus": args.corpus.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "documents": tokenized.documents,
        "bytes": tokenized.text_bytes,
        "tokens": tokenized.tokens,
        "train": file(&outputs.train, train),
        "val": outputs.val.as_ref().map(|v| file(v, val)),
    })
}

fn report(outputs: &Outputs, tokenized: &Tokenized, (train, val): (u64, u64), took: Duration, vocab: u32) {
    let rate = tokenized.file_bytes as f64 / took.as_secs_f64().max(1e-9) / 1e6;
    let per_token = tokenized.text_bytes as f64 / tokenized.tokens.max(1) as f64;
    let mut line = format!(
        "tokenized {}, {} of text, into {} ({per_token:.2} bytes a token) in {:.1} s ({rate:.1} MB/s): {} ({})",
        plural(tokenized.documents, "document"),
        plural(tokenized.text_bytes, "byte"),
        plural(tokenized.tokens, "token"),
        took.as_secs_f64(),
        outputs.train.display(),
        plural(train, "token"),
    );
    if let Some(path) = &outputs.val {
        line.push_str(&format!(", {} ({})", path.display(), plural(val, "token")));
    }
    line.push_str(&format!(", {}", outputs.sidecar.display()));
    eprintln_safe!("{line}");
    for note in few_tokens_notes(train, outputs.val.as_ref().map(|_| val)) {
        eprintln_safe!("note: {note}");
    }
    eprintln_safe!("next: {}", run_hint(outputs, vocab));
}

/// Tokens a window of GPT-2's context takes (its `seq` of 1024, and the next token as the last target).
const GPT2_WINDOW: u64 = 1025;

/// What files too short for a long context allow: a run reads windows of `seq + 1` tokens, so `seq`
/// must stay under the tokens of the file it reads. One note per such file.
fn few_tokens_notes(train: u64, val: Option<u64>) -> Vec<String> {
    let files = [("the training file", Some(train)), ("the validation file", val)];
    files
        .into_iter()
        .filter_map(|(which, tokens)| tokens.filter(|&t| t < GPT2_WINDOW).map(|t| (which, t)))
        .map(|(which, tokens)| match tokens {
            0 | 1 => format!(
                "{which} holds {}: a run reads windows of seq + 1 tokens, at least 2, so no model can read it; \
                 give more text",
                plural(tokens, "token")
            ),
            _ => format!(
                "{which} holds {}: a run reads windows of seq + 1 tokens, so the model's `seq` must be under \
                 {tokens} to read it (`--set seq=N`), or give more text",
                plural(tokens, "token")
            ),
        })
        .collect()
}

/// Warns of a corpus file named more than once (its documents are then tokenized each time).
fn warn_of_files_given_twice(corpus: &[PathBuf]) {
    let mut seen: Vec<PathBuf> = Vec::new();
    let mut warned: Vec<PathBuf> = Vec::new();
    for path in corpus {
        let same = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
        if seen.contains(&same) && !warned.contains(&same) {
            let times = corpus.iter().filter(|p| std::fs::canonicalize(p).unwrap_or_else(|_| (*p).clone()) == same);
            eprintln_safe!(
                "warning: `{}` is given {} times: its documents are tokenized each time",
                path.display(),
                times.count()
            );
            warned.push(same.clone());
        }
        seen.push(same);
    }
}

/// The `run` that trains on what was written (the model's vocabulary must hold every id).
fn run_hint(outputs: &Outputs, vocab: u32) -> String {
    let mut hint = format!("optimusc run MODEL.opt --set vocab={vocab} --data {}", super::shell_path(&outputs.train));
    if let Some(val) = &outputs.val {
        hint.push_str(&format!(" --val-data {} --eval-every 100", super::shell_path(val)));
    }
    if vocab > u32::from(u16::MAX) {
        hint.push_str(" --data-dtype u32");
    }
    hint
}

/// Progress over the corpus's bytes: a bar with throughput and ETA on a terminal, else a line every
/// 10 seconds.
struct Progress {
    total: u64,
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
    last_line: Instant,
}

/// How often a progress line is printed when standard error is not a terminal.
const LINE_EVERY: Duration = Duration::from_secs(10);

impl Progress {
    fn new(total: u64) -> Progress {
        let template = "{bar:30} {bytes}/{total_bytes}  {bytes_per_sec}  {msg}  ETA {eta}";
        let bar = super::terminal_bar(total, template, false);
        Progress { total, bar, started: Instant::now(), last_line: Instant::now() }
    }

    fn update(&mut self, bytes: u64, tokens: u64) {
        if let Some(bar) = &self.bar {
            bar.set_position(bytes);
            bar.set_message(format!("{tokens} tokens"));
        } else if self.last_line.elapsed() >= LINE_EVERY && bytes < self.total {
            self.last_line = Instant::now();
            let elapsed = self.started.elapsed().as_secs_f64();
            let left = elapsed * (self.total - bytes) as f64 / bytes.max(1) as f64;
            eprintln_safe!(
                "tokenized {bytes} of {} bytes ({:.0}%), {tokens} tokens, {:.1} MB/s, ETA {}",
                self.total,
                100.0 * bytes as f64 / self.total.max(1) as f64,
                bytes as f64 / elapsed.max(1e-9) / 1e6,
                super::run::duration_text(left)
            );
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
