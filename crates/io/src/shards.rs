//! Sharded training checkpoints: one safetensors file per device, a manifest that places every
//! stored piece in the logical tensors, crash-safe commits, and resharding onto any mesh.
//!
//! `DIR/step-00000003/` holds the state after 3 updates: `device-{i}-{j}.safetensors` with the blocks
//! device (i, j) owns (replicated data once, padding never), and `manifest.json`, which says for every
//! tensor which pieces of which files make it, and every file's size and SHA-256. A checkpoint is
//! staged in `step-00000003.tmp/` and renamed into place only when complete, so a directory without a
//! manifest, or ending in `.tmp`, is never a checkpoint. Reading computes, for any plan, which pieces
//! meet a device's block and copies them run by run. The format is described in
//! docs/checkpoint-format.md.

use super::checkpoint::{NonFiniteValue, TensorProblem, WeightsError};
use super::files::FileError;
use super::output::OutputError;
use optimus_plan::layout::{Layout, Placement};
use optimus_plan::logical::IndexMap;
use optimus_plan::stores::{CheckpointSink, CheckpointSource, DeviceParamBlocks, StoreError};
use optimus_plan::tensor::Tensor;
use optimus_plan::text::printable;
use optimus_plan::text::shape_text;
use optimus_plan::{Buffer, Coords, Mesh, Plan, Strategy};
use safetensors::{Dtype, SafeTensorError, SafeTensors, View};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};

/// Bumped whenever the checkpoint format changes incompatibly.
pub const CHECKPOINT_FORMAT_VERSION: u32 = 1;

/// The file whose presence makes a step directory a checkpoint.
pub const MANIFEST: &str = "manifest.json";

/// The suffix of a checkpoint being written.
const STAGING_SUFFIX: &str = ".tmp";

/// The suffix of a checkpoint of the same step being replaced.
const REPLACED_SUFFIX: &str = ".old";

/// The first bytes of every manifest, before the SHA-256 of the rest of it.
const MANIFEST_HEAD: &str = "{\n  \"manifest_sha256\": \"";

/// The most bytes a manifest or a sidecar may hold.
const MANIFEST_LIMIT: u64 = 256 << 20;

/// The dtype of every stored tensor.
const DTYPE: &str = "F32";

// ---- errors --------------------------------------------------------------------------------------

/// Why a checkpoint could not be written, read or exported; every message names the folder, file,
/// device or tensor concerned.
#[derive(Debug)]
pub enum CheckpointError {
    /// A file system operation failed: "cannot `action` `path`".
    Io { action: &'static str, path: PathBuf, source: std::io::Error },
    /// A file the checkpoint reads cannot be opened, is not a regular file or is too large.
    File(FileError),
    /// The staging directory is not the directory this run made (a link?).
    NotOurStaging { path: PathBuf },
    /// A device's sidecar or the manifest cannot be turned into JSON.
    Serialize { what: &'static str, source: serde_json::Error },
    /// A device's data file cannot be written.
    WriteFile { path: PathBuf, source: SafeTensorError },
    /// A commit asked to keep no checkpoint.
    KeepZero,
    /// A device wrote no sidecar before the commit.
    DeviceMissing { coords: Coords, source: FileError },
    /// A device's sidecar is not what devices write.
    InvalidSidecar { path: PathBuf, source: serde_json::Error },
    /// A device's data file has another size than the device wrote.
    WrittenSize { path: PathBuf, len: u64, wrote: u64 },
    /// Another run holds the checkpoint folder (`holder`: its pid, when the lock file names one).
    InUse { dir: PathBuf, holder: Option<u32> },
    /// A device that is not on the plan's mesh.
    OffMesh { coords: Coords, mesh: Mesh },
    /// Blocks given for another number of parameters than the plan's.
    BlockCount { want: usize, got: usize },
    /// Blocks given for another number of optimizer states than a parameter's.
    StateCount { param: String, want: usize, got: usize },
    /// A block that is not a floating-point tensor; `why` is the tensor's own message.
    Values { tensor: String, why: optimus_plan::tensor::TensorError },
    /// A block of another shape or size than its buffer's.
    BlockShape { tensor: String, want: Vec<u64>, got: Vec<u64>, values: usize },
    /// A tensor of `shape` larger than its buffer's logical shape; `stored` when the shape is the
    /// checkpoint's.
    DoesNotFit { tensor: String, shape: Vec<u64>, logical: Vec<u64>, stored: bool },
    /// A device's block cannot be located in its buffer.
    Layout(LayoutError),
    /// A buffer whose layout holds a pending sum, which cannot be stored.
    PendingSum { buffer: String, layout: Layout },
    /// A device stored a tensor that is no parameter or optimizer state.
    StrayTensor { name: String },
    /// The devices' pieces do not cover a tensor.
    Uncovered { name: String, stored: u64, total: u64 },
    /// A path that is not a directory.
    NotADirectory { path: PathBuf },
    /// A staging directory, written partly or abandoned.
    Unfinished { path: PathBuf },
    /// A directory holding no checkpoint (`unfinished`: the latest one whose writing never finished).
    NoCheckpoint { path: PathBuf, unfinished: Option<PathBuf> },
    /// The manifest's bytes are damaged.
    CorruptManifest { path: PathBuf, why: Corruption },
    /// The latest checkpoint of a folder opened as the folder cannot be read (`earlier`: the one
    /// before it, if any).
    LatestUnreadable { folder: PathBuf, earlier: Option<PathBuf>, source: Box<CheckpointError> },
    /// The manifest's contents are inconsistent.
    InvalidManifest { path: PathBuf, why: ManifestProblem },
    /// The checkpoint's parameters do not fit the model's.
    Mismatch { dir: PathBuf, model: String, problems: Vec<TensorProblem> },
    /// The blocks read are fewer than the plan's parameters.
    MissingBlock,
    /// The manifest has no record of a tensor (`name` as printed).
    NoTensor { dir: PathBuf, name: String },
    /// A data file's bytes are not safetensors.
    NotSafetensors { path: PathBuf, source: SafeTensorError },
    /// A piece lies outside its tensor.
    PieceOutOfRange { name: String },
    /// Two pieces give the same elements of a tensor.
    Overlap { dir: PathBuf, name: String },
    /// The pieces give only `filled` of the `expected` elements of a tensor.
    Incomplete { dir: PathBuf, name: String, filled: u64, expected: u64 },
    /// A data file needed and not opened.
    NotOpened { path: PathBuf },
    /// A data file lacks a piece's tensor (`key` as printed).
    NoFileTensor { path: PathBuf, key: String },
    /// A piece's tensor has another dtype or shape than the manifest says.
    PieceShape { path: PathBuf, key: String, dtype: Dtype, got: Vec<usize>, want: Vec<usize> },
    /// The manifest does not list a file a piece needs.
    UnlistedFile { name: String },
    /// A data file of another size than the manifest says.
    Truncated { path: PathBuf, len: u64, want: u64 },
    /// A data file whose SHA-256 is not the manifest's.
    CorruptFile { path: PathBuf },
    /// A parameter missing from what was read for export.
    NotRead { name: String },
    /// Tied parameters stored under one key hold different values.
    TiedDiffer { key: String },
    /// A tensor cannot be made into a safetensors view for export.
    ExportTensor { key: String, source: SafeTensorError },
    /// The exported tensors cannot be serialized.
    ExportSerialize { path: PathBuf, source: SafeTensorError },
    /// Writing the exported file failed.
    Write(OutputError),
}

impl fmt::Display for CheckpointError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckpointError::Io { action, path, source } => write!(f, "cannot {action} `{}`: {source}", path.display()),
            CheckpointError::File(e) => write!(f, "{e}"),
            CheckpointError::NotOurStaging { path } => {
                write!(f, "`{}` is not a directory made by this run (a link?); not writing there", path.display())
            }
            CheckpointError::Serialize { what, source } => write!(f, "cannot write {what}: {source}"),
            CheckpointError::WriteFile { path, source } => {
                write!(f, "cannot write checkpoint file `{}`: {source}", path.display())
            }
            CheckpointError::KeepZero => f.write_str("a checkpoint cannot be committed with keep = 0: keep at least 1"),
            CheckpointError::DeviceMissing { coords, source } => {
                write!(f, "device {coords} has not written its part of the checkpoint: {source}")
            }
            CheckpointError::InvalidSidecar { path, source } => {
                write!(f, "checkpoint sidecar `{}` is invalid: {source}", path.display())
            }
            CheckpointError::WrittenSize { path, len, wrote } => {
                write!(f, "checkpoint file `{}` has {len} bytes, its device wrote {wrote}", path.display())
            }
            CheckpointError::InUse { dir, holder } => write!(
                f,
                "checkpoint folder `{}` is in use by another run ({}); give each run a folder of its own, or wait \
                 for that run to end",
                dir.display(),
                holder.map_or("an unknown pid".to_string(), |pid| format!("pid {pid}"))
            ),
            CheckpointError::OffMesh { coords, mesh } => write!(f, "device {coords} is not on the plan's {mesh} mesh"),
            CheckpointError::BlockCount { want, got } => {
                write!(f, "expected the blocks of {want} parameters, found {got}")
            }
            CheckpointError::StateCount { param, want, got } => {
                write!(f, "`{param}` has {want} optimizer states, found {got} blocks")
            }
            CheckpointError::Values { tensor, why } => write!(f, "`{tensor}`: {why}"),
            CheckpointError::BlockShape { tensor, want, got, values } => write!(
                f,
                "the block of `{tensor}` must be {}, found {} with {values} values",
                shape_text(want),
                shape_text(got)
            ),
            CheckpointError::DoesNotFit { tensor, shape, logical, stored } => {
                let whose = if *stored { " in the checkpoint" } else { "" };
                write!(f, "`{tensor}` is {}{whose}, which does not fit {}", shape_text(shape), shape_text(logical))
            }
            CheckpointError::Layout(e) => write!(f, "{e}"),
            CheckpointError::PendingSum { buffer, layout } => {
                write!(f, "cannot checkpoint `{buffer}`: its layout {layout} holds a pending sum")
            }
            CheckpointError::StrayTensor { name } => write!(f, "a device stored `{name}`, which is no tensor"),
            CheckpointError::Uncovered { name, stored, total } => {
                write!(f, "the devices stored {stored} of the {total} elements of `{name}`")
            }
            CheckpointError::NotADirectory { path } => write!(f, "`{}` is not a checkpoint directory", path.display()),
            CheckpointError::Unfinished { path } => {
                write!(f, "`{}` is a checkpoint still being written (or abandoned)", path.display())
            }
            CheckpointError::NoCheckpoint { path, unfinished: None } => write!(
                f,
                "no checkpoint in `{}`: expected a directory with {MANIFEST}, or one holding step-NNNNNNNN/ \
                 checkpoint directories",
                path.display()
            ),
            CheckpointError::NoCheckpoint { path, unfinished: Some(unfinished) } => write!(
                f,
                "no checkpoint in `{}`: it holds `{}`, whose writing never finished (its run was stopped while \
                 writing it; the next checkpoint written there removes it)",
                path.display(),
                unfinished.display()
            ),
            CheckpointError::LatestUnreadable { folder, earlier: Some(earlier), source } => write!(
                f,
                "{source}; it is the latest checkpoint in `{}`: name an earlier one (`{}`), or move it away",
                folder.display(),
                earlier.display()
            ),
            CheckpointError::LatestUnreadable { folder, earlier: None, source } => {
                write!(f, "{source}; it is the only checkpoint in `{}`", folder.display())
            }
            CheckpointError::CorruptManifest { path, why } => {
                write!(f, "checkpoint manifest `{}` is corrupt: {why}", path.display())
            }
            CheckpointError::InvalidManifest { path, why } => {
                write!(f, "checkpoint manifest `{}` is invalid: {why}", path.display())
            }
            CheckpointError::Mismatch { dir, model, problems } => write!(
                f,
                "checkpoint `{}` does not match the parameters of model `{model}`:\n{}",
                dir.display(),
                super::checkpoint::capped_list(problems)
            ),
            CheckpointError::MissingBlock => f.write_str("a parameter block is missing"),
            CheckpointError::NoTensor { dir, name } => {
                write!(f, "checkpoint `{}` holds no tensor `{name}`", dir.display())
            }
            CheckpointError::NotSafetensors { path, source } => {
                write!(f, "checkpoint file `{}` is not a valid safetensors file: {source}", path.display())
            }
            CheckpointError::PieceOutOfRange { name } => write!(f, "a piece of `{name}` is out of range"),
            CheckpointError::Overlap { dir, name } => {
                write!(f, "checkpoint `{}` is damaged: two pieces of `{name}` give the same elements", dir.display())
            }
            CheckpointError::Incomplete { dir, name, filled, expected } => write!(
                f,
                "checkpoint `{}` does not hold all of `{name}`: its pieces give {filled} of the {expected} elements \
                 needed",
                dir.display()
            ),
            CheckpointError::NotOpened { path } => write!(f, "`{}` was not opened", path.display()),
            CheckpointError::NoFileTensor { path, key } => {
                write!(f, "checkpoint file `{}` has no tensor `{key}`", path.display())
            }
            CheckpointError::PieceShape { path, key, dtype, got, want } => write!(
                f,
                "checkpoint file `{}`: tensor `{key}` is {dtype:?} {}, the manifest says F32 {}",
                path.display(),
                shape_text(got),
                shape_text(want)
            ),
            CheckpointError::UnlistedFile { name } => write!(f, "the manifest lists no file `{name}`"),
            CheckpointError::Truncated { path, len, want } => write!(
                f,
                "checkpoint file `{}` has {len} bytes, the manifest says {want}: it is truncated or was replaced",
                path.display()
            ),
            CheckpointError::CorruptFile { path } => {
                write!(f, "checkpoint file `{}` is corrupt: its SHA-256 does not match the manifest's", path.display())
            }
            CheckpointError::NotRead { name } => write!(f, "`{name}` could not be read"),
            CheckpointError::TiedDiffer { key } => {
                write!(f, "two parameters with different values are stored under `{key}`")
            }
            CheckpointError::ExportTensor { key, source } => write!(f, "cannot export `{key}`: {source}"),
            CheckpointError::ExportSerialize { path, source } => {
                write!(f, "cannot export to `{}`: {source}", path.display())
            }
            CheckpointError::Write(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for CheckpointError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CheckpointError::Io { source, .. } => Some(source),
            CheckpointError::File(e) | CheckpointError::DeviceMissing { source: e, .. } => Some(e),
            CheckpointError::Serialize { source, .. } | CheckpointError::InvalidSidecar { source, .. } => Some(source),
            CheckpointError::WriteFile { source, .. }
            | CheckpointError::NotSafetensors { source, .. }
            | CheckpointError::ExportTensor { source, .. }
            | CheckpointError::ExportSerialize { source, .. } => Some(source),
            CheckpointError::Layout(e) => Some(e),
            CheckpointError::LatestUnreadable { source, .. } => Some(source),
            CheckpointError::Write(e) => Some(e),
            _ => None,
        }
    }
}

impl From<FileError> for CheckpointError {
    fn from(e: FileError) -> CheckpointError {
        CheckpointError::File(e)
    }
}

impl From<LayoutError> for CheckpointError {
    fn from(e: LayoutError) -> CheckpointError {
        CheckpointError::Layout(e)
    }
}

/// A buffer whose layout cannot place a device's block, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct LayoutError {
    pub buffer: String,
    pub why: optimus_plan::logical::BlockError,
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "buffer `{}`: {}", self.buffer, self.why)
    }
}

impl std::error::Error for LayoutError {}

/// How a manifest's bytes are damaged.
#[derive(Debug)]
pub enum Corruption {
    /// It does not begin with `manifest_sha256`.
    Head,
    /// It ends inside its checksum.
    Truncated,
    /// Its checksum is not followed as written.
    Checksum,
    /// Its SHA-256 is not its `manifest_sha256`.
    Mismatch,
    /// It is not the JSON of a manifest.
    Json(serde_json::Error),
}

impl fmt::Display for Corruption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Corruption::Head => f.write_str(
                "it does not begin with the `manifest_sha256` that every manifest optimusc writes begins with",
            ),
            Corruption::Truncated => f.write_str("it is truncated"),
            Corruption::Checksum => f.write_str("its checksum is malformed"),
            Corruption::Mismatch => f.write_str("its SHA-256 does not match its `manifest_sha256`"),
            Corruption::Json(e) => write!(f, "{e}"),
        }
    }
}

/// An inconsistency inside a manifest; names are kept as printed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ManifestProblem {
    /// Another format version.
    Version { found: u32 },
    /// A data file named with a directory, or hidden.
    FileName { name: String },
    /// A tensor's record is inconsistent.
    Tensor { name: String, problem: RecordProblem },
    /// A parameter without the record of its value or of an optimizer state (`key`).
    NoStateTensor { param: String, key: String },
    /// The step differs from its training record's.
    RecordedStep { step: u64, recorded: u64 },
    /// The checkpoint of update `step` in a folder named for update `named`.
    FolderName { step: u64, named: u64 },
}

impl fmt::Display for ManifestProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ManifestProblem::Version { found } => {
                write!(f, "format version {found} (this optimusc reads version {CHECKPOINT_FORMAT_VERSION})")
            }
            ManifestProblem::FileName { name } => {
                write!(f, "file name `{name}` is not a plain name in the checkpoint directory")
            }
            ManifestProblem::Tensor { name, problem } => write!(f, "tensor `{name}`: {problem}"),
            ManifestProblem::NoStateTensor { param, key } => write!(f, "parameter `{param}` has no tensor `{key}`"),
            ManifestProblem::RecordedStep { step, recorded } => {
                write!(f, "its step is {step}, and its training record says update {recorded}")
            }
            ManifestProblem::FolderName { step, named } => write!(
                f,
                "it is the checkpoint of update {step}, in a folder named for update {named}: a renamed folder would \
                 be taken for another update's checkpoint; give it its name back (`{}`)",
                step_dir_name(*step)
            ),
        }
    }
}

/// An inconsistency in a tensor's record of a manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordProblem {
    /// A dtype this format never writes (as printed).
    Dtype { dtype: String },
    /// A shape whose element count overflows.
    ShapeOverflow,
    /// More pieces than are read.
    TooManyPieces { count: usize },
    /// A piece in a file the manifest does not list (as printed).
    UnlistedFile { file: String },
    /// A piece of another rank than its tensor.
    Rank { piece: usize, tensor: usize },
    /// An interval that is empty, out of order or outside the dimension.
    Interval { start: u64, len: u64, size: u64 },
    /// Pieces whose element count overflows.
    PiecesOverflow,
    /// Pieces that hold another number of elements than the shape.
    Coverage { covered: u64, shape: Vec<u64>, total: u64 },
}

impl fmt::Display for RecordProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecordProblem::Dtype { dtype } => write!(f, "dtype `{dtype}` (only {DTYPE} is written)"),
            RecordProblem::ShapeOverflow => f.write_str("its shape overflows"),
            RecordProblem::TooManyPieces { count } => write!(f, "{count} pieces (at most {MAX_PIECES} are read)"),
            RecordProblem::UnlistedFile { file } => {
                write!(f, "a piece is in `{file}`, which the manifest does not list")
            }
            RecordProblem::Rank { piece, tensor } => write!(f, "a piece of rank {piece} in a tensor of rank {tensor}"),
            RecordProblem::Interval { start, len, size } => {
                write!(f, "interval [{start}, {len}] is empty, out of order or outside 0..{size}")
            }
            RecordProblem::PiecesOverflow => f.write_str("its pieces overflow"),
            RecordProblem::Coverage { covered, shape, total } => write!(
                f,
                "its pieces hold {covered} elements and its shape {} has {total}: pieces must tile a tensor exactly",
                shape_text(shape)
            ),
        }
    }
}

/// `CheckpointError::Io`'s constructor for `map_err`.
fn io_error(action: &'static str, path: &Path) -> impl Fn(std::io::Error) -> CheckpointError {
    move |source| CheckpointError::Io { action, path: path.to_path_buf(), source }
}

/// `step-00000003`: the directory of the checkpoint after `step` updates.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step of a checkpoint directory name (`step-` and digits only), if it is one.
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn device_file(coords: Coords) -> String {
    format!("device-{}.safetensors", coords.file_stem())
}

fn sidecar_file(coords: Coords) -> String {
    format!("device-{}.json", coords.file_stem())
}

/// The key of optimizer state `k` of a parameter, in files and in the manifest.
pub fn state_key(param: &str, k: usize) -> String {
    format!("{param}::state{k}")
}

// ---- the manifest --------------------------------------------------------------------------------

/// Everything `manifest.json` says (its `manifest_sha256` is checked on reading and not kept).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    /// Updates done when the checkpoint was written.
    pub step: u64,
    /// The model's name (informational).
    pub model: String,
    /// The mesh and strategy that wrote it (informational: any plan can read it).
    pub mesh: Mesh,
    pub strategy: Strategy,
    /// The prefix Hugging Face files put before every checkpoint name (`transformer.` for GPT-2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_prefix: Option<String>,
    /// What the runtime passed: seed, data position, schedule, optimizer, accumulation...
    pub training: serde_json::Value,
    /// The parameters, in plan order.
    pub params: Vec<ParamRecord>,
    /// Every stored tensor by key: parameter names and `{name}::state{k}`.
    pub tensors: BTreeMap<String, TensorRecord>,
    /// Every data file by name.
    pub files: BTreeMap<String, FileRecord>,
    /// What `from_pretrained` needs beside the exported weights, for GPT-2, Llama and BERT models:
    /// `{"architecture", "config", "generation"}` (see [`super::hf_config`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugging_face: Option<serde_json::Value>,
}

/// A parameter: its name, Hugging Face name and number of optimizer states.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamRecord {
    pub name: String,
    pub checkpoint: String,
    pub states: usize,
    /// Hugging Face files store it `[out, in]`: `export` writes it transposed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub checkpoint_transposed: bool,
}

/// A logical tensor and the pieces that make it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorRecord {
    /// The logical shape, without padding.
    pub shape: Vec<u64>,
    pub dtype: String,
    /// The Hugging Face name (parameters only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    pub pieces: Vec<Piece>,
}

/// A stored part of a tensor: the Cartesian product, over dimensions, of `[start, length]` intervals
/// of logical coordinates; the file's tensor `key` holds it densely, intervals in the listed order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Piece {
    pub file: String,
    pub key: String,
    pub slice: Vec<Vec<[u64; 2]>>,
}

impl Piece {
    /// The stored shape: the total length of each dimension's intervals.
    fn shape(&self) -> Vec<u64> {
        self.slice.iter().map(|d| d.iter().map(|[_, len]| len).sum()).collect()
    }

    fn elements(&self) -> u64 {
        self.shape().iter().product()
    }
}

/// A data file's size and SHA-256 (lowercase hex).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileRecord {
    pub bytes: u64,
    pub sha256: String,
}

/// What one device wrote, so that the commit need not read the data again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Sidecar {
    /// The data file and its record; none when the device stores nothing.
    file: Option<(String, FileRecord)>,
    /// The piece of each tensor it stores.
    pieces: BTreeMap<String, Piece>,
}

/// The manifest's bytes: `manifest_sha256` first, the SHA-256 of everything after it.
fn manifest_bytes(manifest: &Manifest) -> Result<Vec<u8>, CheckpointError> {
    let body = serde_json::to_string_pretty(manifest)
        .map_err(|source| CheckpointError::Serialize { what: "the manifest", source })?;
    let rest = format!("{}\n", body.strip_prefix('{').unwrap_or(&body));
    let hash = sha256_hex(rest.as_bytes());
    Ok(format!("{MANIFEST_HEAD}{hash}\",{rest}").into_bytes())
}

/// Checks a manifest's own SHA-256 and parses it.
fn parse_manifest(path: &Path, bytes: &[u8]) -> Result<Manifest, CheckpointError> {
    let corrupt = |why: Corruption| CheckpointError::CorruptManifest { path: path.to_path_buf(), why };
    let rest = bytes.strip_prefix(MANIFEST_HEAD.as_bytes()).ok_or_else(|| corrupt(Corruption::Head))?;
    let (hash, rest) = rest.split_at_checked(64).ok_or_else(|| corrupt(Corruption::Truncated))?;
    let rest = rest.strip_prefix(b"\",").ok_or_else(|| corrupt(Corruption::Checksum))?;
    if sha256_hex(rest).as_bytes() != hash {
        return Err(corrupt(Corruption::Mismatch));
    }
    serde_json::from_slice(bytes).map_err(|e| corrupt(Corruption::Json(e)))
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// ---- geometry ------------------------------------------------------------------------------------

/// Per dimension, the padded logical coordinate of each local coordinate of a device's block.
pub(super) fn block_coordinates(meta: &Buffer, coords: Coords, mesh: Mesh) -> Result<Vec<Vec<u64>>, LayoutError> {
    let map = IndexMap::new(meta, coords, mesh).map_err(|why| LayoutError { buffer: meta.name.clone(), why })?;
    Ok(map.dimensions().to_vec())
}

/// Whether device `coords` stores its block of a buffer: it is at coordinate 0 along every mesh axis
/// the layout replicates. A pending sum cannot be stored.
fn stores(meta: &Buffer, coords: Coords) -> Result<bool, CheckpointError> {
    let at = coords.0;
    let mut stores = true;
    for (axis, placement) in meta.layout.0.iter().enumerate() {
        match placement {
            Placement::Replicate => stores &= at[axis] == 0,
            Placement::Partial => {
                return Err(CheckpointError::PendingSum { buffer: meta.name.clone(), layout: meta.layout });
            }
            Placement::Shard { .. } => {}
        }
    }
    Ok(stores)
}

/// Maximal runs of consecutive values, as `[start, length]`.
fn intervals(coords: &[u64]) -> Vec<[u64; 2]> {
    let mut out: Vec<[u64; 2]> = Vec::new();
    for &c in coords {
        match out.last_mut() {
            Some([start, len]) if *start + *len == c => *len += 1,
            _ => out.push([c, 1]),
        }
    }
    out
}

/// For each dimension, the (source position, destination position) pairs to copy.
type Pairs = Vec<Vec<(usize, usize)>>;

/// Row-major strides of a shape.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut out = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        out[d] = out[d + 1].saturating_mul(shape[d + 1]);
    }
    out
}

/// Runs of pairs consecutive in both source and destination: (source, destination, length).
fn runs(pairs: &[(usize, usize)]) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for &(s, d) in pairs {
        match out.last_mut() {
            Some((rs, rd, n)) if *rs + *n == s && *rd + *n == d => *n += 1,
            _ => out.push((s, d, 1)),
        }
    }
    out
}

/// Calls `copy(source offset, destination offset, length)` for every run of the product of `pairs`
/// (row-major, runs along the last dimension); returns the number of elements copied.
fn for_each_run<E>(
    pairs: &[Vec<(usize, usize)>],
    src_shape: &[usize],
    dst_shape: &[usize],
    mut copy: impl FnMut(usize, usize, usize) -> Result<(), E>,
) -> Result<u64, E> {
    let Some((last, leading)) = pairs.split_last() else {
        copy(0, 0, 1)?;
        return Ok(1);
    };
    let runs = runs(last);
    if runs.is_empty() || leading.iter().any(Vec::is_empty) {
        return Ok(0);
    }
    let (src_strides, dst_strides) = (strides(src_shape), strides(dst_shape));
    let mut index = vec![0usize; leading.len()];
    let mut count = 0u64;
    loop {
        let (mut s, mut d) = (0usize, 0usize);
        for (k, &x) in index.iter().enumerate() {
            let (ps, pd) = leading[k][x];
            s += ps * src_strides[k];
            d += pd * dst_strides[k];
        }
        for &(rs, rd, n) in &runs {
            copy(s + rs, d + rd, n)?;
            count += n as u64;
        }
        if !advance(&mut index, leading) {
            return Ok(count);
        }
    }
}

/// The next index of an odometer over `pairs`; false after the last.
fn advance(index: &mut [usize], pairs: &[Vec<(usize, usize)>]) -> bool {
    for k in (0..index.len()).rev() {
        index[k] += 1;
        if index[k] < pairs[k].len() {
            return true;
        }
        index[k] = 0;
    }
    false
}

/// Where each destination coordinate lies in a piece dimension made of sorted `intervals`:
/// (piece position, destination position) pairs.
fn match_dimension(intervals: &[[u64; 2]], coords: &[u64]) -> Vec<(usize, usize)> {
    let mut offsets = Vec::with_capacity(intervals.len());
    let mut total = 0u64;
    for [_, len] in intervals {
        offsets.push(total);
        total += len;
    }
    let locate = |c: u64| {
        let k = intervals.partition_point(|[start, _]| *start <= c).checked_sub(1)?;
        let [start, len] = intervals[k];
        (c < start + len).then(|| (offsets[k] + c - start) as usize)
    };
    coords.iter().enumerate().filter_map(|(t, &c)| locate(c).map(|p| (p, t))).collect()
}

fn usize_shape(shape: &[u64]) -> Vec<usize> {
    shape.iter().map(|&d| d as usize).collect()
}

// ---- writing -------------------------------------------------------------------------------------

/// A checkpoint being written: every device calls [`CheckpointWriter::write_device`], then one process
/// calls [`CheckpointWriter::commit`].
#[derive(Clone, Debug)]
pub struct CheckpointWriter {
    dir: PathBuf,
    step: u64,
    staging: PathBuf,
}

impl CheckpointWriter {
    /// Creates DIR (if needed) and a fresh staging directory `DIR/step-XXXXXXXX.tmp`, then opens it as
    /// [`CheckpointWriter::begin`] does: for a single process that writes every device itself.
    pub fn create(dir: &Path, step: u64) -> Result<CheckpointWriter, CheckpointError> {
        CheckpointWriter::prepare(dir, step)?;
        CheckpointWriter::begin(dir, step)
    }

    /// Creates DIR (if needed) and a fresh staging directory `DIR/step-XXXXXXXX.tmp`, by one process
    /// before every device calls [`CheckpointWriter::begin`]. Whatever has that name already (a
    /// staging directory a failed run left, or a link planted there) is removed, never followed or
    /// reused, and so are the staging directories of later steps (a run that got further and died);
    /// those of earlier steps are removed by [`CheckpointWriter::commit`]. The new directory is
    /// created by this process, writable by its owner alone, so nothing can be planted inside it.
    pub fn prepare(dir: &Path, step: u64) -> Result<(), CheckpointError> {
        const CREATE: &str = "create checkpoint directory";
        std::fs::create_dir_all(dir).map_err(io_error(CREATE, dir))?;
        remove_stale_staging(dir, |other| other >= step);
        let staging = staging_dir(dir, step);
        let mut builder = std::fs::DirBuilder::new();
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o755);
        builder.create(&staging).map_err(io_error(CREATE, &staging))
    }

    /// The staging directory of checkpoint `step` in DIR, made by [`CheckpointWriter::prepare`]: it
    /// must be a directory itself, not a link to one. Called by every device or rank.
    pub fn begin(dir: &Path, step: u64) -> Result<CheckpointWriter, CheckpointError> {
        let staging = staging_dir(dir, step);
        match std::fs::symlink_metadata(&staging) {
            Ok(meta) if meta.is_dir() => Ok(CheckpointWriter { dir: dir.to_path_buf(), step, staging }),
            Ok(_) => Err(CheckpointError::NotOurStaging { path: staging }),
            Err(e) => Err(io_error("open the checkpoint staging directory", &staging)(e)),
        }
    }

    /// The directory the files are written into.
    pub fn staging(&self) -> &Path {
        &self.staging
    }

    /// The checkpoint's step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Writes device `coords`' file and its sidecar `device-{i}-{j}.json` into the staging directory.
    /// `blocks` are the device's current blocks, one entry per plan parameter in order. Called by
    /// every device, in parallel threads or ranks.
    pub fn write_device(
        &self,
        plan: &Plan,
        coords: Coords,
        blocks: &[DeviceParamBlocks],
    ) -> Result<(), CheckpointError> {
        let pieces = device_pieces(plan, coords, blocks)?;
        let file = if pieces.is_empty() { None } else { Some(self.write_pieces(coords, &pieces)?) };
        let sidecar = Sidecar { file, pieces: pieces.into_iter().map(|p| (p.tensor.clone(), p.piece)).collect() };
        let bytes = serde_json::to_vec_pretty(&sidecar)
            .map_err(|source| CheckpointError::Serialize { what: "a sidecar", source })?;
        write_synced(&self.staging.join(sidecar_file(coords)), &bytes)
    }

    /// Writes the safetensors file of a device's pieces; returns its name and record.
    fn write_pieces(&self, coords: Coords, pieces: &[PieceSource]) -> Result<(String, FileRecord), CheckpointError> {
        let name = device_file(coords);
        let path = self.staging.join(&name);
        let views = pieces.iter().map(|p| (p.piece.key.clone(), p));
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(metadata), &path)
            .map_err(|source| CheckpointError::WriteFile { path: path.clone(), source })?;
        give_new_file_mode(&path)?;
        let record = hash_and_sync(&path)?;
        Ok((name, record))
    }

    /// Gathers the devices' sidecars into `manifest.json`, renames the staging directory into place
    /// (replacing a checkpoint of the same step safely), syncs DIR and keeps the newest `keep`
    /// checkpoints. Called once, by one process (the same each time), after every device's
    /// `write_device` returned. Returns the checkpoint's directory.
    pub fn commit(
        self,
        plan: &Plan,
        training: serde_json::Value,
        keep: Option<u64>,
    ) -> Result<PathBuf, CheckpointError> {
        if keep == Some(0) {
            return Err(CheckpointError::KeepZero);
        }
        let sidecars = self.read_sidecars(plan)?;
        let manifest = build_manifest(plan, self.step, training, &sidecars)?;
        write_synced(&self.staging.join(MANIFEST), &manifest_bytes(&manifest)?)?;
        self.remove_unlisted(&manifest);
        sync_dir(&self.staging)?;
        remove_stale_staging(&self.dir, |other| other != self.step);
        let final_dir = self.dir.join(step_dir_name(self.step));
        install(&self.staging, &final_dir)?;
        sync_dir(&self.dir)?;
        if let Some(keep) = keep {
            prune(&self.dir, keep, self.step)?;
        }
        Ok(final_dir)
    }

    /// Every device's sidecar, in rank order; an error names a device that wrote none.
    fn read_sidecars(&self, plan: &Plan) -> Result<Vec<Sidecar>, CheckpointError> {
        let mut out = Vec::new();
        for coords in plan.mesh.all_coords() {
            let path = self.staging.join(sidecar_file(coords));
            let bytes = super::files::read_bounded(&path, "checkpoint sidecar", MANIFEST_LIMIT)
                .map_err(|source| CheckpointError::DeviceMissing { coords, source })?;
            let sidecar: Sidecar = serde_json::from_slice(&bytes)
                .map_err(|source| CheckpointError::InvalidSidecar { path: path.clone(), source })?;
            check_written_size(&self.staging, &sidecar)?;
            out.push(sidecar);
        }
        Ok(out)
    }

    /// Removes the sidecars and anything a failed attempt left in the staging directory.
    fn remove_unlisted(&self, manifest: &Manifest) {
        let Ok(entries) = std::fs::read_dir(&self.staging) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name != MANIFEST && !manifest.files.contains_key(&name) {
                let _ = remove_any(&entry.path());
            }
        }
    }
}

/// A piece to write: the tensor it belongs to, its manifest entry, and where its data comes from.
struct PieceSource<'a> {
    tensor: String,
    piece: Piece,
    block: &'a [f32],
    block_shape: Vec<usize>,
    pairs: Pairs,
    /// The stored shape: the number of pairs of each dimension.
    shape: Vec<usize>,
}

impl View for &PieceSource<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.bytes())
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * 4
    }
}

impl PieceSource<'_> {
    /// The piece's elements, little-endian.
    fn bytes(&self) -> Vec<u8> {
        let mut values = vec![0f32; self.shape.iter().product()];
        let copied = for_each_run(&self.pairs, &self.block_shape, &self.shape, |s, d, n| {
            let (Some(src), Some(dst)) = (self.block.get(s..s + n), values.get_mut(d..d + n)) else {
                return Err("a piece run is out of range");
            };
            dst.copy_from_slice(src);
            Ok(())
        });
        debug_assert!(copied.is_ok(), "pieces are made from checked blocks");
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }
}

/// The pieces device `coords` stores, after checking that `blocks` fit the plan.
fn device_pieces<'a>(
    plan: &Plan,
    coords: Coords,
    blocks: &'a [DeviceParamBlocks],
) -> Result<Vec<PieceSource<'a>>, CheckpointError> {
    if !coords.on(plan.mesh) {
        return Err(CheckpointError::OffMesh { coords, mesh: plan.mesh });
    }
    if blocks.len() != plan.params.len() {
        return Err(CheckpointError::BlockCount { want: plan.params.len(), got: blocks.len() });
    }
    let file = device_file(coords);
    let mut out = Vec::new();
    for (p, b) in plan.params.iter().zip(blocks) {
        if b.states.len() != p.state.len() {
            return Err(CheckpointError::StateCount {
                param: p.name.clone(),
                want: p.state.len(),
                got: b.states.len(),
            });
        }
        let tensors = std::iter::once((p.name.clone(), p.buffer, b.param))
            .chain(p.state.iter().zip(&b.states).enumerate().map(|(k, (&id, &t))| (state_key(&p.name, k), id, t)));
        for (tensor, id, block) in tensors {
            let meta = plan.buffer(id);
            if stores(meta, coords)? {
                out.extend(piece_source(tensor, &file, meta, &p.shape, block, coords, plan.mesh)?);
            }
        }
    }
    Ok(out)
}

/// The piece of one block inside the unpadded `shape`, if any of it is.
fn piece_source<'a>(
    tensor: String,
    file: &str,
    meta: &Buffer,
    shape: &[u64],
    block: &'a Tensor,
    coords: Coords,
    mesh: Mesh,
) -> Result<Option<PieceSource<'a>>, CheckpointError> {
    let values = block.f32().map_err(|why| CheckpointError::Values { tensor: tensor.clone(), why })?;
    if block.shape != meta.shape || values.len() as u64 != meta.elements() {
        return Err(CheckpointError::BlockShape {
            tensor,
            want: meta.shape.clone(),
            got: block.shape.clone(),
            values: values.len(),
        });
    }
    if !fits(shape, &meta.logical_shape) {
        let (shape, logical) = (shape.to_vec(), meta.logical_shape.clone());
        return Err(CheckpointError::DoesNotFit { tensor, shape, logical, stored: false });
    }
    let logical = block_coordinates(meta, coords, mesh)?;
    let mut pairs = Vec::with_capacity(shape.len());
    let mut slice = Vec::with_capacity(shape.len());
    for (coords, &size) in logical.iter().zip(shape) {
        let kept: Vec<u64> = coords.iter().copied().filter(|&c| c < size).collect();
        pairs.push(
            coords.iter().enumerate().filter(|&(_, &c)| c < size).enumerate().map(|(k, (t, _))| (t, k)).collect(),
        );
        slice.push(intervals(&kept));
    }
    if slice.iter().any(Vec::is_empty) {
        return Ok(None);
    }
    let stored: Vec<usize> = pairs.iter().map(Vec::len).collect();
    let piece = Piece { file: file.to_string(), key: tensor.clone(), slice };
    Ok(Some(PieceSource { tensor, piece, block: values, block_shape: usize_shape(&meta.shape), pairs, shape: stored }))
}

/// The manifest of a plan's checkpoint from its devices' sidecars; an error names a tensor whose
/// pieces do not cover it.
fn build_manifest(
    plan: &Plan,
    step: u64,
    training: serde_json::Value,
    sidecars: &[Sidecar],
) -> Result<Manifest, CheckpointError> {
    let mut tensors = BTreeMap::new();
    let mut params = Vec::new();
    for p in &plan.params {
        let record = |checkpoint: Option<String>| TensorRecord {
            shape: p.shape.clone(),
            dtype: DTYPE.to_string(),
            checkpoint,
            pieces: Vec::new(),
        };
        tensors.insert(p.name.clone(), record(Some(p.checkpoint.clone())));
        for k in 0..p.state.len() {
            tensors.insert(state_key(&p.name, k), record(None));
        }
        params.push(ParamRecord {
            name: p.name.clone(),
            checkpoint: p.checkpoint.clone(),
            states: p.state.len(),
            checkpoint_transposed: p.checkpoint_transposed,
        });
    }
    let mut files = BTreeMap::new();
    for sidecar in sidecars {
        for (name, piece) in &sidecar.pieces {
            let record = tensors.get_mut(name).ok_or_else(|| CheckpointError::StrayTensor { name: name.clone() })?;
            record.pieces.push(piece.clone());
        }
        if let Some((name, record)) = &sidecar.file {
            files.insert(name.clone(), record.clone());
        }
    }
    for (name, record) in &tensors {
        let stored: u64 = record.pieces.iter().map(Piece::elements).sum();
        let total: u64 = record.shape.iter().product();
        if stored != total {
            return Err(CheckpointError::Uncovered { name: name.clone(), stored, total });
        }
    }
    Ok(Manifest {
        format_version: CHECKPOINT_FORMAT_VERSION,
        step,
        model: plan.model.clone(),
        mesh: plan.mesh,
        strategy: plan.strategy,
        checkpoint_prefix: plan.checkpoint_prefix.clone(),
        training,
        params,
        tensors,
        files,
        hugging_face: super::hf_config::hugging_face_config(plan).ok().map(|c| c.to_json()),
    })
}

/// Checks that a device's data file has the size its sidecar says.
fn check_written_size(staging: &Path, sidecar: &Sidecar) -> Result<(), CheckpointError> {
    let Some((name, record)) = &sidecar.file else { return Ok(()) };
    let path = staging.join(name);
    let len = std::fs::metadata(&path).map_err(io_error("read", &path))?.len();
    if len != record.bytes {
        return Err(CheckpointError::WrittenSize { path, len, wrote: record.bytes });
    }
    Ok(())
}

// ---- files and directories -----------------------------------------------------------------------

/// Writes a new file (never over one that exists, never through a link) and syncs it to disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let cannot = io_error("write", path);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NOFOLLOW);
    let mut file = options.open(path).map_err(&cannot)?;
    file.write_all(bytes).map_err(&cannot)?;
    file.sync_all().map_err(&cannot)
}

/// Gives a file safetensors wrote (through a temporary file, created owner-only) the permissions of
/// the checkpoint's other files: those of any new file, 0666 less the umask.
fn give_new_file_mode(path: &Path) -> Result<(), CheckpointError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = 0o666 & !process_umask();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io_error("write", path))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// This process's umask, as Linux reports it in /proc/self/status (changing it to read it would race
/// with the other threads creating files); 0o022, the usual one, where it cannot be read.
#[cfg(unix)]
fn process_umask() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = status.lines().find_map(|line| line.strip_prefix("Umask:"));
    field.and_then(|value| u32::from_str_radix(value.trim(), 8).ok()).unwrap_or(0o022)
}

/// Syncs a written file to disk and returns its size and SHA-256.
fn hash_and_sync(path: &Path) -> Result<FileRecord, CheckpointError> {
    let cannot = io_error("write", path);
    let mut file = File::open(path).map_err(&cannot)?;
    file.sync_all().map_err(&cannot)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buffer).map_err(&cannot)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        bytes += n as u64;
    }
    Ok(FileRecord { bytes, sha256: hex(&hasher.finalize()) })
}

/// Syncs a directory, so that the names created or renamed in it are on disk.
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_error("sync directory", dir))
}

/// Removes a file or a directory tree; one already gone is fine. A link is removed itself, never what
/// it points to (and `remove_dir_all` follows no link inside the tree).
fn remove_any(path: &Path) -> std::io::Result<()> {
    let removed = match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    };
    match removed {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Removes a checkpoint directory: its manifest first, so that it stops being a checkpoint at once. A
/// link in its place is removed itself, and nothing is removed through it.
fn remove_checkpoint(path: &Path) -> std::io::Result<()> {
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
        remove_any(&path.join(MANIFEST))?;
    }
    remove_any(path)
}

/// `DIR/step-XXXXXXXX.tmp`, where checkpoint `step` is written before it is renamed into place.
fn staging_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("{}{STAGING_SUFFIX}", step_dir_name(step)))
}

/// Whether something (a file, a directory or a link, dangling or not) has this name.
fn occupied(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// What is at `path` when it is there and neither a directory (a checkpoint is one) nor a link (a
/// link named as a checkpoint is removed itself, never followed): "a file" or "a special file".
fn foreign_entry(path: &Path) -> Option<&'static str> {
    let kind = std::fs::symlink_metadata(path).ok()?.file_type();
    if kind.is_dir() || kind.is_symlink() {
        None
    } else if kind.is_file() {
        Some("a file")
    } else {
        Some("a special file")
    }
}

/// The first entry of `dir` named as a checkpoint (`step-N`) that is not a directory, with what it
/// is: a run would stop at that checkpoint rather than replace it, so it is found before step 0.
pub fn foreign_step_entry(dir: &Path) -> Option<(PathBuf, &'static str)> {
    let entries = std::fs::read_dir(dir).ok()?;
    entries.flatten().find_map(|entry| {
        let named = entry.file_name().to_str().and_then(parse_step_dir).is_some();
        let path = entry.path();
        if named { foreign_entry(&path).map(|what| (path, what)) } else { None }
    })
}

/// The entries of DIR named `step-N` + `suffix`, with their steps.
fn step_entries(dir: &Path, suffix: &str) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut out: Vec<(u64, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step =
                if suffix.is_empty() { parse_step_dir(&name) } else { parse_step_dir(name.strip_suffix(suffix)?) };
            Some((step?, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// Removes the staging directories of the steps `stale` selects (best effort: another rank may be
/// removing them too).
fn remove_stale_staging(dir: &Path, stale: impl Fn(u64) -> bool) {
    for (step, path) in step_entries(dir, STAGING_SUFFIX) {
        if stale(step) {
            let _ = remove_any(&path);
        }
    }
}

/// The update a checkpoint is after, as its manifest, its training record and its folder's name
/// (`step-NNNNNNNN`, where the folder is so named) say it, must be one: a folder renamed, or a manifest
/// whose step was edited (and its hash recomputed), would resume another update's weights at this step,
/// or be taken for the latest when it is not.
fn check_step_agrees(dir: &Path, manifest: &Manifest) -> Result<(), ManifestProblem> {
    let step = manifest.step;
    let recorded = manifest.training.get("step").and_then(serde_json::Value::as_u64);
    if let Some(recorded) = recorded.filter(|&s| s != step) {
        return Err(ManifestProblem::RecordedStep { step, recorded });
    }
    match dir.file_name().and_then(|n| n.to_str()).and_then(parse_step_dir) {
        Some(named) if named != step => Err(ManifestProblem::FolderName { step, named }),
        _ => Ok(()),
    }
}

/// The complete checkpoints in DIR (`step-N` directories with a manifest), oldest first.
pub fn complete_checkpoints(dir: &Path) -> Vec<(u64, PathBuf)> {
    step_entries(dir, "").into_iter().filter(|(_, path)| path.join(MANIFEST).is_file()).collect()
}

/// Renames the staging directory to `final_dir`. An existing checkpoint there is renamed away first
/// and removed only once the new one is in place; one left renamed away by a crash is put back first.
fn install(staging: &Path, final_dir: &Path) -> Result<(), CheckpointError> {
    let mut replaced = final_dir.as_os_str().to_owned();
    replaced.push(REPLACED_SUFFIX);
    let replaced = PathBuf::from(replaced);
    let cannot = |action: &'static str| io_error(action, final_dir);
    if occupied(&replaced) {
        if occupied(final_dir) {
            remove_checkpoint(&replaced).map_err(cannot("clean up an old copy of"))?;
        } else {
            std::fs::rename(&replaced, final_dir).map_err(cannot("restore"))?;
        }
    }
    let parent = final_dir.parent().unwrap_or(Path::new("."));
    if let Some(name) = foreign_entry(final_dir) {
        // Not ours to replace: a file the user put where this checkpoint goes.
        let why = format!("{name} holds this checkpoint's name; move it away");
        return Err(cannot("install the checkpoint")(std::io::Error::new(std::io::ErrorKind::AlreadyExists, why)));
    }
    if occupied(final_dir) {
        std::fs::rename(final_dir, &replaced).map_err(cannot("move away the checkpoint"))?;
        sync_dir(parent)?;
    }
    std::fs::rename(staging, final_dir).map_err(cannot("install the checkpoint"))?;
    sync_dir(parent)?;
    if occupied(&replaced) {
        remove_checkpoint(&replaced).map_err(cannot("remove the replaced copy of"))?;
    }
    Ok(())
}

/// Keeps the newest `keep` complete checkpoints (and always the one of step `current`).
fn prune(dir: &Path, keep: u64, current: u64) -> Result<(), CheckpointError> {
    let all = complete_checkpoints(dir);
    let excess = all.len().saturating_sub(keep as usize);
    for (step, path) in all.into_iter().take(excess) {
        if step != current {
            remove_checkpoint(&path).map_err(io_error("remove old checkpoint", &path))?;
        }
    }
    Ok(())
}

/// The lock file of a checkpoint folder (see [`lock_checkpoint_dir`]).
const LOCK_FILE: &str = ".optimusc.lock";

/// An exclusive lock on a checkpoint folder, held while a run writes checkpoints into it. It is
/// released when dropped, or when the process ends, however it ends (an advisory `flock`).
#[derive(Debug)]
pub struct CheckpointLock {
    _file: File,
}

/// Creates DIR if needed and locks it for this run through `DIR/.optimusc.lock` (which records the
/// holder's pid). A folder another run holds is refused, naming that run's pid, so two runs never
/// write, prune or replace each other's checkpoints. The lock file is opened without following a link.
pub fn lock_checkpoint_dir(dir: &Path) -> Result<CheckpointLock, CheckpointError> {
    let path = dir.join(LOCK_FILE);
    let cannot = io_error("lock the checkpoint folder through", &path);
    std::fs::create_dir_all(dir).map_err(&cannot)?;
    let mut options = std::fs::OpenOptions::new();
    options.read(true).write(true).create(true).truncate(false);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NOFOLLOW);
    let mut file = options.open(&path).map_err(&cannot)?;
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a file descriptor this function owns; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() != ErrorKind::WouldBlock {
                return Err(cannot(error));
            }
            let mut holder = String::new();
            let _ = (&mut file).take(32).read_to_string(&mut holder);
            let holder = holder.trim().parse::<u32>().ok();
            return Err(CheckpointError::InUse { dir: dir.to_path_buf(), holder });
        }
    }
    file.set_len(0).and_then(|()| write!(file, "{}", std::process::id())).map_err(&cannot)?;
    Ok(CheckpointLock { _file: file })
}

/// A checkpoint folder a run commits into: the runtime's [`CheckpointSink`].
#[derive(Debug)]
pub struct CheckpointFolder {
    pub dir: PathBuf,
    /// Keep only the newest `keep` checkpoints.
    pub keep: Option<u64>,
    /// What the run was (seed, optimizer, data...), stored in each manifest with the data position.
    pub training: serde_json::Value,
    /// The folder's lock, held until the run ends.
    pub lock: Option<CheckpointLock>,
}

impl CheckpointSink for CheckpointFolder {
    fn location(&self) -> &Path {
        &self.dir
    }

    fn prepare(&self, step: u64) -> Result<(), StoreError> {
        CheckpointWriter::prepare(&self.dir, step).map_err(StoreError::from)
    }

    fn write_device(
        &self,
        plan: &Plan,
        step: u64,
        coords: Coords,
        blocks: &[DeviceParamBlocks],
    ) -> Result<(), StoreError> {
        CheckpointWriter::begin(&self.dir, step)
            .and_then(|writer| writer.write_device(plan, coords, blocks))
            .map_err(StoreError::from)
    }

    fn commit(&self, plan: &Plan, step: u64, micro_batches_done: u64) -> Result<PathBuf, StoreError> {
        let mut training = self.training.clone();
        if let Some(fields) = training.as_object_mut() {
            fields.insert("step".into(), step.into());
            fields.insert("micro_batches_done".into(), micro_batches_done.into());
        }
        CheckpointWriter::begin(&self.dir, step)
            .and_then(|writer| writer.commit(plan, training, self.keep))
            .map_err(StoreError::from)
    }
}

// ---- reading -------------------------------------------------------------------------------------

impl CheckpointSource for Checkpoint {
    fn device_blocks_of(
        &self,
        plan: &Plan,
        coords: Coords,
        with_state: bool,
        params: &[usize],
    ) -> Result<Vec<(Tensor, Vec<Tensor>)>, StoreError> {
        Checkpoint::device_blocks_of(self, plan, coords, with_state, params).map_err(StoreError::from)
    }
}

/// A complete checkpoint: its directory and manifest.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
}

/// One copy planned from a piece into a destination tensor.
struct Transfer<'m> {
    piece: &'m Piece,
    /// (piece position, destination position) pairs of each dimension.
    pairs: Pairs,
}

/// A destination tensor and the copies that fill it.
struct Target<'m> {
    name: String,
    shape: Vec<u64>,
    transfers: Vec<Transfer<'m>>,
    /// How many elements the pieces must fill (those inside the unpadded shape).
    expected: u64,
}

impl Checkpoint {
    /// A checkpoint directory (one with `manifest.json`), or a directory of checkpoints, of which the
    /// latest complete one is taken. Staging directories (`*.tmp`) are never checkpoints.
    pub fn open(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let meta = std::fs::metadata(path).map_err(io_error("open checkpoint", path))?;
        if !meta.is_dir() {
            return Err(CheckpointError::NotADirectory { path: path.to_path_buf() });
        }
        if path.join(MANIFEST).exists() {
            if path.file_name().is_some_and(|n| n.to_string_lossy().ends_with(STAGING_SUFFIX)) {
                return Err(CheckpointError::Unfinished { path: path.to_path_buf() });
            }
            return Checkpoint::read(path);
        }
        let mut found = complete_checkpoints(path);
        let Some((_, latest)) = found.pop() else {
            let unfinished = step_entries(path, STAGING_SUFFIX).pop().map(|(_, staged)| staged);
            return Err(CheckpointError::NoCheckpoint { path: path.to_path_buf(), unfinished });
        };
        Checkpoint::read(&latest).map_err(|source| CheckpointError::LatestUnreadable {
            folder: path.to_path_buf(),
            earlier: found.pop().map(|(_, earlier)| earlier),
            source: Box::new(source),
        })
    }

    /// Reads and checks the manifest of a checkpoint directory.
    fn read(dir: &Path) -> Result<Checkpoint, CheckpointError> {
        let path = dir.join(MANIFEST);
        let bytes = super::files::read_bounded(&path, "checkpoint manifest", MANIFEST_LIMIT)?;
        let manifest = parse_manifest(&path, &bytes)?;
        check_manifest(&manifest).map_err(|why| CheckpointError::InvalidManifest { path: path.clone(), why })?;
        check_step_agrees(dir, &manifest)
            .map_err(|why| CheckpointError::InvalidManifest { path: path.clone(), why })?;
        Ok(Checkpoint { dir: dir.to_path_buf(), manifest })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    pub fn training(&self) -> &serde_json::Value {
        &self.manifest.training
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Checks every data file's size and SHA-256 against the manifest.
    pub fn verify(&self) -> Result<(), CheckpointError> {
        self.open_files(self.manifest.files.keys().map(String::as_str).collect()).map(|_| ())
    }

    /// Device `coords`' block of every plan parameter (laid out as the plan's buffer, padding zero)
    /// and, with `with_state`, of its optimizer states, whatever mesh and strategy wrote the
    /// checkpoint. Only the files holding pieces that meet the device's blocks are read (mapped), and
    /// each is checked against its size and SHA-256 once.
    pub fn device_blocks(
        &self,
        plan: &Plan,
        coords: Coords,
        with_state: bool,
    ) -> Result<Vec<(Tensor, Vec<Tensor>)>, CheckpointError> {
        let every: Vec<usize> = (0..plan.params.len()).collect();
        self.device_blocks_of(plan, coords, with_state, &every)
    }

    /// [`Checkpoint::device_blocks`] of parameters `params` alone (indices into `plan.params`, in that
    /// order): what a pipeline stage holds. The plan is checked against the checkpoint as a whole.
    pub fn device_blocks_of(
        &self,
        plan: &Plan,
        coords: Coords,
        with_state: bool,
        params: &[usize],
    ) -> Result<Vec<(Tensor, Vec<Tensor>)>, CheckpointError> {
        if !coords.on(plan.mesh) {
            return Err(CheckpointError::OffMesh { coords, mesh: plan.mesh });
        }
        self.check_plan(plan, with_state)?;
        let chosen: Vec<&optimus_plan::PlanParam> = params
            .iter()
            .map(|&k| plan.params.get(k).ok_or(CheckpointError::MissingBlock))
            .collect::<Result<_, _>>()?;
        let mut targets = Vec::new();
        for p in &chosen {
            let states = if with_state { p.state.len() } else { 0 };
            let names = std::iter::once((p.name.clone(), p.buffer))
                .chain(p.state.iter().take(states).enumerate().map(|(k, &id)| (state_key(&p.name, k), id)));
            for (name, id) in names {
                targets.push(self.block_target(name, plan.buffer(id), coords, plan.mesh)?);
            }
        }
        let mut filled = self.fill(&targets)?.into_iter();
        let mut out = Vec::with_capacity(chosen.len());
        for p in &chosen {
            let param = filled.next().ok_or(CheckpointError::MissingBlock)?;
            let states = if with_state { filled.by_ref().take(p.state.len()).collect() } else { Vec::new() };
            out.push((param, states));
        }
        Ok(out)
    }

    /// Every parameter's logical (unpadded) tensor by parameter name: those of `plan` (which must
    /// match the checkpoint's), or all the checkpoint holds.
    pub fn logical_params(&self, plan: Option<&Plan>) -> Result<BTreeMap<String, Tensor>, CheckpointError> {
        if let Some(plan) = plan {
            self.check_plan(plan, false)?;
        }
        let names: Vec<String> = match plan {
            Some(plan) => plan.params.iter().map(|p| p.name.clone()).collect(),
            None => self.manifest.params.iter().map(|p| p.name.clone()).collect(),
        };
        let targets = names.iter().map(|name| self.logical_target(name)).collect::<Result<Vec<_>, _>>()?;
        Ok(names.into_iter().zip(self.fill(&targets)?).collect())
    }

    /// Every problem between the plan's parameters and the checkpoint's, at once.
    fn check_plan(&self, plan: &Plan, with_state: bool) -> Result<(), CheckpointError> {
        let mut problems = Vec::new();
        let by_name: HashMap<&str, &ParamRecord> = self.manifest.params.iter().map(|p| (p.name.as_str(), p)).collect();
        for p in &plan.params {
            let (name, want) = (p.name.clone(), p.shape.clone());
            let Some(record) = by_name.get(p.name.as_str()) else {
                problems.push(TensorProblem::Missing { name, want, transposed: false });
                continue;
            };
            let got = self.manifest.tensors.get(&p.name).map(|t| t.shape.clone()).unwrap_or_default();
            if got != p.shape {
                problems.push(TensorProblem::Shape { name: name.clone(), want, transposed: false, got });
            }
            if with_state && record.states != p.state.len() {
                problems.push(TensorProblem::States { name, want: p.state.len(), got: record.states });
            }
        }
        let planned: BTreeSet<&str> = plan.params.iter().map(|p| p.name.as_str()).collect();
        for p in self.manifest.params.iter().filter(|p| !planned.contains(p.name.as_str())) {
            problems.push(TensorProblem::NoSuchParam { name: printable(&p.name).into_owned() });
        }
        if problems.is_empty() {
            return Ok(());
        }
        Err(CheckpointError::Mismatch { dir: self.dir.clone(), model: plan.model.clone(), problems })
    }

    /// The copies that make a device's block of tensor `name`, laid out as `meta`.
    fn block_target(
        &self,
        name: String,
        meta: &Buffer,
        coords: Coords,
        mesh: Mesh,
    ) -> Result<Target<'_>, CheckpointError> {
        let record = self.record(&name)?;
        if !fits(&record.shape, &meta.logical_shape) {
            let (shape, logical) = (record.shape.clone(), meta.logical_shape.clone());
            return Err(CheckpointError::DoesNotFit { tensor: name, shape, logical, stored: true });
        }
        let logical = block_coordinates(meta, coords, mesh)?;
        let expected =
            logical.iter().zip(&record.shape).map(|(c, &s)| c.iter().filter(|&&c| c < s).count() as u64).product();
        Ok(Target { name, shape: meta.shape.clone(), transfers: transfers(record, &logical), expected })
    }

    /// The copies that make the whole logical tensor `name`.
    fn logical_target(&self, name: &str) -> Result<Target<'_>, CheckpointError> {
        let record = self.record(name)?;
        let logical: Vec<Vec<u64>> = record.shape.iter().map(|&s| (0..s).collect()).collect();
        let expected = record.shape.iter().product();
        Ok(Target {
            name: name.to_string(),
            shape: record.shape.clone(),
            transfers: transfers(record, &logical),
            expected,
        })
    }

    fn record(&self, name: &str) -> Result<&TensorRecord, CheckpointError> {
        self.manifest
            .tensors
            .get(name)
            .ok_or_else(|| CheckpointError::NoTensor { dir: self.dir.clone(), name: printable(name).into_owned() })
    }

    /// Makes every target tensor: opens and checks the files its pieces are in, then copies.
    fn fill(&self, targets: &[Target]) -> Result<Vec<Tensor>, CheckpointError> {
        let needed = targets.iter().flat_map(|t| &t.transfers).map(|t| t.piece.file.as_str()).collect();
        let maps = self.open_files(needed)?;
        let mut files = BTreeMap::new();
        for (name, map) in &maps {
            let parsed = SafeTensors::deserialize(map)
                .map_err(|source| CheckpointError::NotSafetensors { path: self.dir.join(name), source })?;
            files.insert(name.as_str(), parsed);
        }
        targets.iter().map(|t| self.fill_one(&files, t)).collect()
    }

    /// Copies a target's pieces into it. Every piece's data is found in its file before the target is
    /// allocated (so a manifest's shapes cannot make memory its files do not back), and an element that
    /// two pieces both give is an error (so a duplicated piece cannot stand in for a missing one).
    fn fill_one(&self, files: &BTreeMap<&str, SafeTensors<'_>>, target: &Target) -> Result<Tensor, CheckpointError> {
        let datas = target.transfers.iter().map(|t| self.piece_data(files, t.piece)).collect::<Result<Vec<_>, _>>()?;
        let name = || target.name.clone();
        let dst_shape = usize_shape(&target.shape);
        let n = dst_shape.iter().product::<usize>();
        let mut values = vec![0f32; n];
        let mut seen = vec![0u64; n.div_ceil(64)];
        let mut filled = 0u64;
        for (transfer, data) in target.transfers.iter().zip(datas) {
            let src_shape = usize_shape(&transfer.piece.shape());
            filled += for_each_run(&transfer.pairs, &src_shape, &dst_shape, |s, d, n| {
                let (Some(src), Some(dst)) = (data.get(s * 4..(s + n) * 4), values.get_mut(d..d + n)) else {
                    return Err(CheckpointError::PieceOutOfRange { name: name() });
                };
                if !mark_once(&mut seen, d, n) {
                    return Err(CheckpointError::Overlap { dir: self.dir.clone(), name: name() });
                }
                for (v, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                    *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
                Ok(())
            })?;
        }
        if filled != target.expected {
            let (dir, expected) = (self.dir.clone(), target.expected);
            return Err(CheckpointError::Incomplete { dir, name: name(), filled, expected });
        }
        Ok(Tensor::from_f32(&target.shape, values))
    }

    /// A piece's bytes, after checking the file's tensor is F32 of the piece's shape.
    fn piece_data<'d>(
        &self,
        files: &BTreeMap<&str, SafeTensors<'d>>,
        piece: &Piece,
    ) -> Result<&'d [u8], CheckpointError> {
        let path = self.dir.join(&piece.file);
        let Some(file) = files.get(piece.file.as_str()) else { return Err(CheckpointError::NotOpened { path }) };
        let key = printable(&piece.key).into_owned();
        let Ok(view) = file.tensor(&piece.key) else { return Err(CheckpointError::NoFileTensor { path, key }) };
        let want: Vec<usize> = usize_shape(&piece.shape());
        if view.dtype() != Dtype::F32
            || view.shape() != want.as_slice()
            || view.data().len() != want.iter().product::<usize>() * 4
        {
            let (dtype, got) = (view.dtype(), view.shape().to_vec());
            return Err(CheckpointError::PieceShape { path, key, dtype, got, want });
        }
        Ok(view.data())
    }

    /// Maps the named data files, each checked against its size and SHA-256.
    fn open_files(&self, names: BTreeSet<&str>) -> Result<BTreeMap<String, memmap2::Mmap>, CheckpointError> {
        let mut out = BTreeMap::new();
        for name in names {
            let unlisted = || CheckpointError::UnlistedFile { name: name.to_string() };
            let record = self.manifest.files.get(name).ok_or_else(unlisted)?;
            out.insert(name.to_string(), verified_map(&self.dir.join(name), record)?);
        }
        Ok(out)
    }
}

/// The copies from `record`'s pieces into a tensor whose dimension d holds logical coordinates
/// `logical[d]`; pieces that miss it are left out.
fn transfers<'m>(record: &'m TensorRecord, logical: &[Vec<u64>]) -> Vec<Transfer<'m>> {
    record
        .pieces
        .iter()
        .filter_map(|piece| {
            let pairs: Pairs = piece.slice.iter().zip(logical).map(|(iv, c)| match_dimension(iv, c)).collect();
            (!pairs.iter().any(Vec::is_empty)).then_some(Transfer { piece, pairs })
        })
        .collect()
}

/// Maps a checkpoint data file after checking its size and SHA-256.
fn verified_map(path: &Path, record: &FileRecord) -> Result<memmap2::Mmap, CheckpointError> {
    let (file, len) = super::files::open_regular(path, "checkpoint file")?;
    if len != record.bytes {
        return Err(CheckpointError::Truncated { path: path.to_path_buf(), len, want: record.bytes });
    }
    // SAFETY: the mapping is only read, and lives no longer than this load. Like every reader of a file, it
    // assumes no other process truncates the checkpoint while it is being loaded.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_error("read", path))?;
    if map.len() as u64 != record.bytes || sha256_hex(&map) != record.sha256 {
        return Err(CheckpointError::CorruptFile { path: path.to_path_buf() });
    }
    Ok(map)
}

/// The most pieces a manifest may give one tensor (a 1024 x 1024 mesh writes one per device).
const MAX_PIECES: usize = 1 << 20;

/// Marks elements `at .. at + n` in the bit set `seen`; false when one was marked already.
fn mark_once(seen: &mut [u64], at: usize, n: usize) -> bool {
    for k in at..at + n {
        let (word, bit) = (k / 64, 1u64 << (k % 64));
        match seen.get_mut(word) {
            Some(w) if *w & bit == 0 => *w |= bit,
            _ => return false,
        }
    }
    true
}

/// Checks a manifest's inner consistency, so that reading can trust its numbers.
fn check_manifest(m: &Manifest) -> Result<(), ManifestProblem> {
    if m.format_version != CHECKPOINT_FORMAT_VERSION {
        return Err(ManifestProblem::Version { found: m.format_version });
    }
    for name in m.files.keys() {
        if name.is_empty() || name.starts_with('.') || name.contains(['/', '\\']) {
            return Err(ManifestProblem::FileName { name: printable(name).into_owned() });
        }
    }
    for (name, t) in &m.tensors {
        check_tensor(m, t)
            .map_err(|problem| ManifestProblem::Tensor { name: printable(name).into_owned(), problem })?;
    }
    for p in &m.params {
        let keys = std::iter::once(p.name.clone()).chain((0..p.states).map(|k| state_key(&p.name, k)));
        for key in keys {
            if !m.tensors.contains_key(&key) {
                let (param, key) = (printable(&p.name).into_owned(), printable(&key).into_owned());
                return Err(ManifestProblem::NoStateTensor { param, key });
            }
        }
    }
    Ok(())
}

fn check_tensor(m: &Manifest, t: &TensorRecord) -> Result<(), RecordProblem> {
    if t.dtype != DTYPE {
        return Err(RecordProblem::Dtype { dtype: printable(&t.dtype).into_owned() });
    }
    let total = t.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).ok_or(RecordProblem::ShapeOverflow)?;
    if t.pieces.len() > MAX_PIECES {
        return Err(RecordProblem::TooManyPieces { count: t.pieces.len() });
    }
    let mut covered = 0u64;
    for piece in &t.pieces {
        if !m.files.contains_key(&piece.file) {
            return Err(RecordProblem::UnlistedFile { file: printable(&piece.file).into_owned() });
        }
        if piece.slice.len() != t.shape.len() {
            return Err(RecordProblem::Rank { piece: piece.slice.len(), tensor: t.shape.len() });
        }
        for (intervals, &size) in piece.slice.iter().zip(&t.shape) {
            check_intervals(intervals, size)?;
        }
        let elements = piece.slice.iter().map(|dim| dim.iter().map(|[_, len]| len).sum::<u64>()).product::<u64>();
        covered = covered.checked_add(elements).ok_or(RecordProblem::PiecesOverflow)?;
    }
    // Each piece is inside the shape; equal counts and no overlap (checked as pieces are copied) mean the
    // pieces tile the tensor exactly.
    if covered != total {
        return Err(RecordProblem::Coverage { covered, shape: t.shape.clone(), total });
    }
    Ok(())
}

/// Intervals must be non-empty, increasing, disjoint and inside `size`.
fn check_intervals(intervals: &[[u64; 2]], size: u64) -> Result<(), RecordProblem> {
    let mut end = 0u64;
    for (k, &[start, len]) in intervals.iter().enumerate() {
        let stop = start.checked_add(len).filter(|&s| s <= size && len > 0 && (k == 0 || start >= end));
        end = stop.ok_or(RecordProblem::Interval { start, len, size })?;
    }
    Ok(())
}

/// Whether a tensor of `shape` fits inside a buffer's `logical` shape (same rank, no dimension larger).
fn fits(shape: &[u64], logical: &[u64]) -> bool {
    shape.len() == logical.len() && shape.iter().zip(logical).all(|(s, l)| s <= l)
}

// ---- whole models --------------------------------------------------------------------------------

/// A `--weights` path: a safetensors file (Hugging Face names), or a checkpoint directory (or a
/// directory of them), of which the parameters are read whatever mesh wrote them. A NaN or infinite
/// weight is an error naming it, unless `allow_non_finite`.
pub fn load_weights(
    path: &Path,
    plan: &Plan,
    allow_non_finite: bool,
) -> Result<BTreeMap<String, Tensor>, WeightsError> {
    if !path.is_dir() {
        return super::checkpoint::load_checkpoint(path, plan, allow_non_finite);
    }
    if let Some(file) = super::pretrained::pretrained_file(path) {
        return super::checkpoint::load_checkpoint(&file, plan, allow_non_finite);
    }
    let checkpoint = Checkpoint::open(path)?;
    let params = checkpoint.logical_params(Some(plan))?;
    if !allow_non_finite {
        let tensors: Vec<NonFiniteValue> = params.iter().filter_map(|(name, t)| non_finite(name, t)).collect();
        if !tensors.is_empty() {
            return Err(WeightsError::NonFinite { path: checkpoint.dir().to_path_buf(), tensors });
        }
    }
    Ok(params)
}

/// "tensor `x` holds NaN at element 3", for a tensor's first NaN or infinite value.
fn non_finite(name: &str, t: &Tensor) -> Option<NonFiniteValue> {
    let (index, value) = super::checkpoint::first_non_finite(t.f32().ok()?)?;
    Some(NonFiniteValue { tensor: printable(name).into_owned(), value, index, narrowed: false })
}

/// What [`export_safetensors`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSummary {
    pub step: u64,
    pub tensors: usize,
    pub elements: u64,
}

/// Writes a checkpoint's parameters as one Hugging Face safetensors file (F32, prefixed checkpoint
/// names, `format: pt`), atomically. A checkpoint name shared by several parameters (tied weights)
/// is written once when their values agree.
pub fn export_safetensors(checkpoint: &Checkpoint, output: &Path) -> Result<ExportSummary, CheckpointError> {
    let params = checkpoint.logical_params(None)?;
    let prefix = checkpoint.manifest.checkpoint_prefix.as_deref().unwrap_or("");
    let mut tensors: BTreeMap<String, (&Tensor, HfTensor)> = BTreeMap::new();
    for p in &checkpoint.manifest.params {
        let t = params.get(&p.name).ok_or_else(|| CheckpointError::NotRead { name: p.name.clone() })?;
        let key = format!("{prefix}{}", p.checkpoint);
        match tensors.get(&key) {
            Some((first, _)) if *first == t => {}
            Some(_) => return Err(CheckpointError::TiedDiffer { key }),
            None => {
                let (shape, values) = hf_orientation(p, t)?;
                let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                tensors.insert(key, (t, (shape, bytes)));
            }
        }
    }
    let mut views = Vec::with_capacity(tensors.len());
    for (key, (_, (shape, bytes))) in &tensors {
        let view = safetensors::tensor::TensorView::new(Dtype::F32, usize_shape(shape), bytes)
            .map_err(|source| CheckpointError::ExportTensor { key: key.clone(), source })?;
        views.push((key.clone(), view));
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|source| CheckpointError::ExportSerialize { path: output.to_path_buf(), source })?;
    super::output::write_file(output, &bytes).map_err(CheckpointError::Write)?;
    let elements = tensors.values().map(|(t, _)| t.shape.iter().product::<u64>()).sum();
    Ok(ExportSummary { step: checkpoint.step(), tensors: tensors.len(), elements })
}

/// A tensor's shape and little-endian F32 bytes as a Hugging Face file holds it.
type HfTensor = (Vec<u64>, Vec<u8>);

/// A parameter's shape and values as Hugging Face files hold it: transposed for an `[out, in]` weight.
fn hf_orientation(p: &ParamRecord, t: &Tensor) -> Result<(Vec<u64>, Vec<f32>), CheckpointError> {
    let values = t.f32().map_err(|why| CheckpointError::Values { tensor: p.name.clone(), why })?;
    match (p.checkpoint_transposed, t.shape.as_slice()) {
        (true, &[rows, cols]) => {
            Ok((vec![cols, rows], super::checkpoint::transpose_2d(values, rows as usize, cols as usize)))
        }
        _ => Ok((t.shape.clone(), values.to_vec())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_round_trip_and_staging_is_never_a_step() {
        assert_eq!(step_dir_name(3), "step-00000003");
        assert_eq!(parse_step_dir("step-00000003"), Some(3));
        assert_eq!(parse_step_dir("step-123456789"), Some(123_456_789));
        for name in ["step-00000003.tmp", "step-00000003.old", "step-", "step-+1", "steps-1", "step-1a"] {
            assert_eq!(parse_step_dir(name), None, "{name}");
        }
    }

    #[test]
    fn intervals_are_maximal_runs() {
        assert_eq!(intervals(&[0, 1, 2, 6, 7, 9]), vec![[0, 3], [6, 2], [9, 1]]);
        assert!(intervals(&[]).is_empty());
    }

    #[test]
    fn dimensions_match_through_intervals() {
        // A piece holding coordinates 2..4 and 8..10 (positions 0..4); a block holding 1, 3, 8, 11.
        let pairs = match_dimension(&[[2, 2], [8, 2]], &[1, 3, 8, 11]);
        assert_eq!(pairs, vec![(1, 1), (2, 2)]);
    }

    #[test]
    fn runs_copy_a_product_row_by_row() {
        // Source 2x4; copy rows {1} x columns {1, 2, 3} into a 1x3 destination.
        let pairs = vec![vec![(1, 0)], vec![(1, 0), (2, 1), (3, 2)]];
        let mut calls = Vec::new();
        let n = for_each_run(&pairs, &[2, 4], &[1, 3], |s, d, n| {
            calls.push((s, d, n));
            Ok::<(), ()>(())
        });
        assert_eq!(n, Ok(3));
        assert_eq!(calls, vec![(5, 0, 3)]);
        let scalar = for_each_run(&[], &[], &[], |s, d, n| {
            assert_eq!((s, d, n), (0, 0, 1));
            Ok::<(), ()>(())
        });
        assert_eq!(scalar, Ok(1));
    }

    #[test]
    fn bad_intervals_are_refused() {
        assert!(check_intervals(&[[0, 2], [2, 2]], 4).is_ok());
        assert!(check_intervals(&[[0, 2], [1, 2]], 4).is_err(), "overlap");
        assert!(check_intervals(&[[2, 2], [0, 1]], 4).is_err(), "order");
        assert!(check_intervals(&[[0, 0]], 4).is_err(), "empty");
        assert!(check_intervals(&[[3, 2]], 4).is_err(), "outside");
        assert!(check_intervals(&[[u64::MAX, 2]], 4).is_err(), "overflow");
    }

    fn manifest() -> Manifest {
        Manifest {
            format_version: CHECKPOINT_FORMAT_VERSION,
            step: 7,
            model: "m".into(),
            mesh: Mesh::new(1, 1),
            strategy: Strategy::None,
            checkpoint_prefix: None,
            training: serde_json::json!({"seed": 1, "lr": 1.0}),
            params: Vec::new(),
            tensors: BTreeMap::new(),
            files: BTreeMap::new(),
            hugging_face: None,
        }
    }

    #[test]
    fn the_manifest_checks_its_own_bytes() {
        let bytes = manifest_bytes(&manifest()).expect("serializes");
        let path = Path::new("manifest.json");
        assert_eq!(parse_manifest(path, &bytes).ok(), Some(manifest()));
        let json: serde_json::Value = serde_json::from_slice(&bytes).expect("plain JSON");
        assert!(json["manifest_sha256"].is_string());
        for k in 0..bytes.len() {
            let mut flipped = bytes.clone();
            flipped[k] ^= 0x20;
            let error = parse_manifest(path, &flipped).expect_err("a flipped byte is noticed").to_string();
            assert!(error.contains("`manifest.json`"), "{error}");
        }
    }

    #[test]
    fn a_manifest_of_another_version_is_refused() {
        let mut m = manifest();
        m.format_version = 99;
        assert!(check_manifest(&m).is_err_and(|e| e.to_string().contains("format version 99")));
        let mut m = manifest();
        m.files.insert("../x".into(), FileRecord { bytes: 0, sha256: String::new() });
        assert!(check_manifest(&m).is_err_and(|e| e.to_string().contains("not a plain name")));
    }
}
