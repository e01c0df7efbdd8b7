//! Metrics logs: the JSON lines `optimusc run --log FILE` appends (one record per line, the objects
//! `--json` prints), and reading them back as curves for `optimusc plot`.
//!
//! [`MetricsLog`] appends: it never truncates, so a resumed run continues the same file, and each
//! record is written with one write and flushed. A log to standard output or error (`-`,
//! `/dev/stdout`, `/dev/stderr`, ...) writes to the process's own stream rather than opening the name
//! again, which would start at the beginning of a redirected file and overwrite what is there. [`read_metrics`] reads a log into [`Metrics`]: a line
//! that is not a JSON object is an error naming its line number, records without a known field are
//! skipped, and a step that appears again (a resumed run) takes its latest values.

use super::files::FileError;
use super::output::OutputError;
use std::collections::BTreeMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

/// Why a metrics log cannot be appended to or read; every message names the file.
#[derive(Debug)]
pub enum MetricsError {
    /// The log's path cannot be written at all.
    Output(OutputError),
    /// The log cannot be opened for appending, or an append failed.
    Append { path: PathBuf, source: std::io::Error },
    /// The log cannot be created or opened for appending.
    Open { path: PathBuf, source: std::io::Error },
    /// The log to read cannot be opened, or is not a regular file.
    File(FileError),
    /// A line of the log to read is not a record.
    Line { path: PathBuf, error: LineError },
}

impl fmt::Display for MetricsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetricsError::Output(e) => write!(f, "{e}"),
            MetricsError::Append { path, source } => write!(f, "cannot append to `{}`: {source}", path.display()),
            MetricsError::Open { path, source } => {
                write!(f, "cannot open `{}` for appending: {source}", path.display())
            }
            MetricsError::File(e) => write!(f, "{e}"),
            MetricsError::Line { path, error } => write!(f, "`{}`: {error}", path.display()),
        }
    }
}

impl std::error::Error for MetricsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            MetricsError::Output(e) => Some(e),
            MetricsError::Append { source, .. } | MetricsError::Open { source, .. } => Some(source),
            MetricsError::File(e) => Some(e),
            MetricsError::Line { error, .. } => Some(error),
        }
    }
}

/// Why a line of a metrics log is not a record; `line` counts from 1.
#[derive(Debug)]
pub enum LineError {
    /// Reading the line failed.
    Unreadable { line: usize, source: std::io::Error },
    /// JSON, but not an object.
    NotAnObject { line: usize },
    /// Not JSON.
    NotJson { line: usize, source: serde_json::Error },
}

impl fmt::Display for LineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LineError::Unreadable { line, source } => write!(f, "line {line}: cannot read it: {source}"),
            LineError::NotAnObject { line } => {
                write!(f, "line {line}: expected a JSON object such as {{\"step\": 0, \"loss\": 4.2}}")
            }
            LineError::NotJson { line, source } => {
                // serde's message ends with its own position, whose line is always 1 here.
                let message = source.to_string();
                let message = message.rsplit_once(" at line ").map_or(message.as_str(), |(m, _)| m);
                write!(f, "line {line}, column {}: not JSON: {message}", source.column())
            }
        }
    }
}

impl std::error::Error for LineError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LineError::Unreadable { source, .. } => Some(source),
            LineError::NotJson { source, .. } => Some(source),
            LineError::NotAnObject { .. } => None,
        }
    }
}

/// Tells before a run whether `path` can be appended to, without changing it or leaving anything
/// behind: an existing file must open for appending, a new one must be creatable in its directory.
pub fn check_appendable(path: &Path) -> Result<(), MetricsError> {
    super::output::check_writable(path).map_err(MetricsError::Output)?;
    if Sink::standard(path).is_some() {
        return Ok(());
    }
    if std::fs::metadata(path).is_ok() {
        OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|source| MetricsError::Append { path: path.to_path_buf(), source })?;
    }
    Ok(())
}

/// A metrics log open for appending; shared by the threads that report steps.
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
    sink: Mutex<Sink>,
}

/// Where a log's lines go: a file opened for appending, or one of the process's own streams.
#[derive(Debug)]
enum Sink {
    File(File),
    Stdout,
    Stderr,
}

impl Sink {
    /// The process's stream that `path` names, if it names one.
    fn standard(path: &Path) -> Option<Sink> {
        if super::output::is_standard_output(path) {
            Some(Sink::Stdout)
        } else if super::output::is_standard_error(path) {
            Some(Sink::Stderr)
        } else {
            None
        }
    }

    fn write_line(&mut self, line: &[u8]) -> std::io::Result<()> {
        match self {
            Sink::File(file) => file.write_all(line).and_then(|()| file.flush()),
            Sink::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(line).and_then(|()| out.flush())
            }
            Sink::Stderr => std::io::stderr().lock().write_all(line),
        }
    }
}

impl MetricsLog {
    /// Opens `path` for appending, creating it if it does not exist; its contents are kept.
    pub fn append_to(path: &Path) -> Result<MetricsLog, MetricsError> {
        let sink = match Sink::standard(path) {
            Some(stream) => stream,
            None => {
                let open = |source| MetricsError::Open { path: path.to_path_buf(), source };
                let mut file = OpenOptions::new().append(true).create(true).open(path).map_err(open)?;
                // A log whose last line was cut short (a killed run, a full disk) gets the rest of that
                // line ended first, so that the next record is a line of its own.
                if !ends_a_line(path) {
                    file.write_all(b"\n")
                        .map_err(|source| MetricsError::Append { path: path.to_path_buf(), source })?;
                }
                Sink::File(file)
            }
        };
        Ok(MetricsLog { path: path.to_path_buf(), sink: Mutex::new(sink) })
    }

    /// Appends `record` as one line, in a single write, and flushes it.
    pub fn append(&self, record: &serde_json::Value) -> Result<(), MetricsError> {
        let line = format!("{record}\n");
        let mut sink = self.sink.lock().unwrap_or_else(PoisonError::into_inner);
        sink.write_line(line.as_bytes()).map_err(|source| MetricsError::Append { path: self.path.clone(), source })
    }
}

/// Whether the file at `path` is empty or ends with a line break (a file that cannot be read counts as
/// ending one: nothing is added to it).
fn ends_a_line(path: &Path) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else { return true };
    if file.metadata().map_or(true, |m| m.len() == 0 || !m.is_file()) {
        return true;
    }
    let mut last = [0u8; 1];
    file.seek(SeekFrom::End(-1)).and_then(|_| file.read_exact(&mut last)).map_or(true, |()| last[0] == b'\n')
}

/// The curves of a metrics log, by step; a later record of a step replaced an earlier one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metrics {
    /// Training loss (`loss`).
    pub loss: BTreeMap<u64, f64>,
    /// Validation loss (`val_loss`).
    pub val_loss: BTreeMap<u64, f64>,
    /// Throughput (`tokens_per_s`).
    pub tokens_per_s: BTreeMap<u64, f64>,
    /// Records read (JSON objects), whether or not they held anything to plot.
    pub records: usize,
    /// The field names those records had, so that a log with nothing to plot can say what it holds.
    pub fields: std::collections::BTreeSet<String>,
    /// Records with a finite `loss`, `val_loss` or `tokens_per_s` left out: without a whole-number
    /// `step` (missing, negative, fractional or past 2^64), and throughputs below zero.
    pub without_step: usize,
    pub negative_throughputs: usize,
}

impl Metrics {
    /// Whether no record had anything to plot.
    pub fn is_empty(&self) -> bool {
        self.loss.is_empty() && self.val_loss.is_empty() && self.tokens_per_s.is_empty()
    }

    /// Takes the known fields of one record; a record without a step, or fields that are not finite
    /// numbers, add nothing.
    fn add(&mut self, record: &serde_json::Map<String, serde_json::Value>) {
        self.records += 1;
        if self.fields.len() < MAX_FIELDS_KEPT {
            self.fields.extend(record.keys().take(MAX_FIELDS_KEPT).cloned());
        }
        let value = |field: &str| record.get(field).and_then(serde_json::Value::as_f64).filter(|v| v.is_finite());
        let Some(step) = record.get("step").and_then(serde_json::Value::as_u64) else {
            if ["loss", "val_loss", "tokens_per_s"].iter().any(|f| value(f).is_some()) {
                self.without_step += 1;
            }
            return;
        };
        let throughput = value("tokens_per_s");
        if throughput.is_some_and(|t| t < 0.0) {
            self.negative_throughputs += 1;
        }
        let series = [
            (value("loss"), &mut self.loss),
            (value("val_loss"), &mut self.val_loss),
            (throughput.filter(|t| *t >= 0.0), &mut self.tokens_per_s),
        ];
        for (value, curve) in series {
            if let Some(value) = value {
                curve.insert(step, value);
            }
        }
    }
}

/// Field names [`Metrics::fields`] keeps at most (a log of arbitrary JSON could have millions).
const MAX_FIELDS_KEPT: usize = 64;

/// Reads a metrics log (a regular file); see the module documentation. Blank lines are skipped.
pub fn read_metrics(path: &Path) -> Result<Metrics, MetricsError> {
    let (file, _) = super::files::open_regular(path, "metrics log").map_err(MetricsError::File)?;
    parse_metrics(BufReader::new(file)).map_err(|error| MetricsError::Line { path: path.to_path_buf(), error })
}

/// [`read_metrics`] on any reader; errors name the line (from 1).
pub fn parse_metrics(reader: impl BufRead) -> Result<Metrics, LineError> {
    let mut metrics = Metrics::default();
    // A record that ends before its JSON does: an error unless it is the log's last, which a killed run
    // leaves cut short (that one is skipped).
    let mut cut_short: Option<LineError> = None;
    for (index, line) in reader.lines().enumerate() {
        let line_number = index + 1;
        let text = line.map_err(|source| LineError::Unreadable { line: line_number, source })?;
        if text.trim().is_empty() {
            continue;
        }
        if let Some(error) = cut_short.take() {
            return Err(error);
        }
        match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(serde_json::Value::Object(record)) => metrics.add(&record),
            Ok(_) => return Err(LineError::NotAnObject { line: line_number }),
            Err(source) if source.is_eof() => cut_short = Some(LineError::NotJson { line: line_number, source }),
            Err(source) => return Err(LineError::NotJson { line: line_number, source }),
        }
    }
    Ok(metrics)
}
