//! Metrics logs: the JSON lines `optimusc run --log FILE` appends (one record per line, the objects
//! `--json` prints), and reading them back as curves for `optimusc plot`.
//!
//! [`MetricsLog`] appends: it never truncates, so a resumed run continues the same file, and each
//! record is written with one write and flushed. A log to standard output or error (`-`,
//! `/dev/stdout`, `/dev/stderr`, ...) writes to the process's own stream rather than opening the name
//! again, which would start at the beginning of a redirected file and overwrite what is there. [`read_metrics`] reads a log into [`Metrics`]: a line
//! that is not a JSON object is an error naming its line number, records without a known field are
//! skipped, and a step that appears again (a resumed run) takes its latest values.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

/// Tells before a run whether `path` can be appended to, without changing it or leaving anything
/// behind: an existing file must open for appending, a new one must be creatable in its directory.
pub fn check_appendable(path: &Path) -> Result<(), String> {
    super::output::check_writable(path)?;
    if Sink::standard(path).is_some() {
        return Ok(());
    }
    if std::fs::metadata(path).is_ok() {
        OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| format!("cannot append to `{}`: {e}", path.display()))?;
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
    pub fn append_to(path: &Path) -> Result<MetricsLog, String> {
        let sink = match Sink::standard(path) {
            Some(stream) => stream,
            None => Sink::File(
                OpenOptions::new()
                    .append(true)
                    .create(true)
                    .open(path)
                    .map_err(|e| format!("cannot open `{}` for appending: {e}", path.display()))?,
            ),
        };
        Ok(MetricsLog { path: path.to_path_buf(), sink: Mutex::new(sink) })
    }

    /// Appends `record` as one line, in a single write, and flushes it.
    pub fn append(&self, record: &serde_json::Value) -> Result<(), String> {
        let line = format!("{record}\n");
        let mut sink = self.sink.lock().unwrap_or_else(PoisonError::into_inner);
        sink.write_line(line.as_bytes()).map_err(|e| format!("cannot append to `{}`: {e}", self.path.display()))
    }
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
}

impl Metrics {
    /// Whether no record had anything to plot.
    pub fn is_empty(&self) -> bool {
        self.loss.is_empty() && self.val_loss.is_empty() && self.tokens_per_s.is_empty()
    }

    /// Takes the known fields of one record; a record without a step, or fields that are not finite
    /// numbers, add nothing.
    fn add(&mut self, record: &serde_json::Map<String, serde_json::Value>) {
        let Some(step) = record.get("step").and_then(serde_json::Value::as_u64) else { return };
        let series =
            [("loss", &mut self.loss), ("val_loss", &mut self.val_loss), ("tokens_per_s", &mut self.tokens_per_s)];
        for (field, curve) in series {
            if let Some(value) = record.get(field).and_then(serde_json::Value::as_f64).filter(|v| v.is_finite()) {
                curve.insert(step, value);
            }
        }
    }
}

/// Reads a metrics log (a regular file); see the module documentation. Blank lines are skipped.
pub fn read_metrics(path: &Path) -> Result<Metrics, String> {
    let (file, _) = super::files::open_regular(path, "metrics log")?;
    parse_metrics(BufReader::new(file)).map_err(|e| format!("`{}`: {e}", path.display()))
}

/// [`read_metrics`] on any reader; errors name the line (from 1).
pub fn parse_metrics(reader: impl BufRead) -> Result<Metrics, String> {
    let mut metrics = Metrics::default();
    for (index, line) in reader.lines().enumerate() {
        let number = index + 1;
        let line = line.map_err(|e| format!("line {number}: cannot read it: {e}"))?;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<serde_json::Value>(&line) {
            Ok(serde_json::Value::Object(record)) => metrics.add(&record),
            Ok(_) => {
                return Err(format!("line {number}: expected a JSON object such as {{\"step\": 0, \"loss\": 4.2}}"));
            }
            Err(e) => {
                // serde's message ends with its own position, whose line is always 1 here.
                let message = e.to_string();
                let message = message.rsplit_once(" at line ").map_or(message.as_str(), |(m, _)| m);
                return Err(format!("line {number}, column {}: not JSON: {message}", e.column()));
            }
        }
    }
    Ok(metrics)
}
