//! Safetensors checkpoints of a plan's parameters, compatible with Hugging Face GPT-2 files.
//!
//! A parameter is stored under its `checkpoint` name, found bare or behind the plan's
//! `checkpoint_prefix` (`h.0.attn.c_attn.weight` in the hub files, `transformer.h.0.attn.c_attn.weight`
//! in those of `save_pretrained`). Loading ignores GPT-2's causal-mask buffers and a tied
//! `lm_head.weight`, reads a tied MLM decoder's bias from its parent's name (`cls.predictions.bias`, as
//! BertForMaskedLM's `save_pretrained` writes it), takes the first rows of a longer position table, and
//! reads F32, F16, BF16 and F64. Every mismatch is reported at once, and nothing is returned or written unless all is well.

use super::files::FileError;
use super::output::OutputError;
use super::pretrained::{INDEX_FILE, IndexProblem, SINGLE_FILE};
use super::shards::{CheckpointError, LayoutError};
use optimus_plan::tensor::Tensor;
use optimus_plan::text::printable;
use optimus_plan::text::shape_text;
use optimus_plan::types::ParamRole;
use optimus_plan::{Plan, PlanParam};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensorError, View};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

/// One way a tensor and a model's parameter disagree: a file's tensor on loading, a value on saving,
/// a checkpoint's record on resuming. Errors list every one found. Names are kept as printed (file keys
/// with their control characters escaped).
#[derive(Clone, Debug, PartialEq)]
pub enum TensorProblem {
    /// Nothing holds the parameter; `want` is its shape, `[out, in]` when `transposed`.
    Missing { name: String, want: Vec<u64>, transposed: bool },
    /// A tensor of shape `got` where `want` was expected.
    Shape { name: String, want: Vec<u64>, transposed: bool, got: Vec<u64> },
    /// A tensor of a dtype that cannot be read.
    Dtype { name: String, dtype: Dtype },
    /// A file tensor with fewer values than its shape says.
    Short { name: String },
    /// The parameter stored under `checkpoint` is in the file twice, under the keys `first` and `second`.
    Twice { checkpoint: String, first: String, second: String },
    /// A file tensor of shape `got` that belongs to no parameter.
    Unexpected { name: String, got: Vec<u64> },
    /// Two parameters would be stored under one key.
    SharedKey { key: String },
    /// A value that is not a floating-point tensor; `why` is the tensor's own message.
    Values { name: String, why: optimus_plan::tensor::TensorError },
    /// A value whose number of elements is not its shape's.
    Count { name: String, shape: Vec<u64>, needs: u64, found: usize },
    /// A checkpoint's parameter with another number of optimizer states than the optimizer keeps.
    States { name: String, want: usize, got: usize },
    /// A checkpoint's parameter the model does not have.
    NoSuchParam { name: String },
}

impl fmt::Display for TensorProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TensorProblem::Missing { name, want, transposed } => {
                write!(f, "missing `{name}`: expected {}{}", shape_text(want), orientation_note(*transposed))
            }
            TensorProblem::Shape { name, want, transposed, got } => write!(
                f,
                "`{name}`: expected {}{}, found {}",
                shape_text(want),
                orientation_note(*transposed),
                shape_text(got)
            ),
            TensorProblem::Dtype { name, dtype } => {
                write!(f, "`{name}`: dtype {dtype:?} cannot be read (F32, F16, BF16 and F64 can)")
            }
            TensorProblem::Short { name } => write!(f, "`{name}`: the file holds fewer values than its shape says"),
            TensorProblem::Twice { checkpoint, first, second } => {
                write!(f, "`{checkpoint}` appears twice, as `{first}` and as `{second}`")
            }
            TensorProblem::Unexpected { name, got } => write!(f, "unexpected `{name}`: found {}", shape_text(got)),
            TensorProblem::SharedKey { key } => write!(f, "two parameters are stored under `{key}`"),
            TensorProblem::Values { name, why } => write!(f, "`{name}`: {why}"),
            TensorProblem::Count { name, shape, needs, found } => {
                write!(f, "`{name}`: shape {} needs {needs} values, found {found}", shape_text(shape))
            }
            TensorProblem::States { name, want, got } => write!(
                f,
                "`{name}`: the optimizer keeps {want} state tensors, the checkpoint {got} (was it written with \
                 another optimizer?)"
            ),
            TensorProblem::NoSuchParam { name } => write!(f, "unexpected `{name}`: the model has no such parameter"),
        }
    }
}

/// The first NaN or infinite value of a tensor: which element, and whether it was an F64 narrowed to f32.
#[derive(Clone, Debug, PartialEq)]
pub struct NonFiniteValue {
    /// The tensor's name, as printed.
    pub tensor: String,
    pub value: f32,
    pub index: usize,
    pub narrowed: bool,
}

impl fmt::Display for NonFiniteValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cast = if self.narrowed { " (as f32)" } else { "" };
        write!(f, "tensor `{}` holds {}{cast} at element {}", self.tensor, non_finite_name(self.value), self.index)
    }
}

/// Why weights could not be loaded: a safetensors file, a `save_pretrained` directory or index, or a
/// checkpoint directory. Every message names the file.
#[derive(Debug)]
pub enum WeightsError {
    /// The operating system refused to look at, open or map the file.
    Unreadable { path: PathBuf, source: std::io::Error },
    /// A device, FIFO or directory where a safetensors file was expected.
    NotRegular { path: PathBuf },
    /// The file's bytes are not safetensors.
    NotSafetensors { path: PathBuf, source: SafeTensorError },
    /// The file's tensors do not fit the model's parameters; `prefix` is the model's checkpoint prefix.
    Mismatch { path: PathBuf, model: String, prefix: Option<String>, problems: Vec<TensorProblem> },
    /// Tensors holding NaN or infinite values.
    NonFinite { path: PathBuf, tensors: Vec<NonFiniteValue> },
    /// A parameter the weights were not loaded for.
    NotLoaded { name: String },
    /// A device's block of a parameter cannot be located.
    Layout(LayoutError),
    /// A `save_pretrained` directory without its files.
    NoWeightFile { dir: PathBuf },
    /// The index file cannot be read.
    Index(FileError),
    /// The index file is not JSON with a `weight_map`.
    NotAnIndex { path: PathBuf, source: serde_json::Error },
    /// The index names a shard file that is not a plain name beside it (`name` as printed).
    ShardName { index: PathBuf, name: String },
    /// The index and the shard files disagree.
    IndexMismatch { index: PathBuf, problems: Vec<IndexProblem> },
    /// Two failures of one load, reported together.
    Both(Box<WeightsError>, Box<WeightsError>),
    /// A checkpoint directory that cannot be read.
    Checkpoint(CheckpointError),
}

impl fmt::Display for WeightsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WeightsError::Unreadable { path, source } => {
                write!(f, "cannot read checkpoint `{}`: {source}", path.display())
            }
            WeightsError::NotRegular { path } => write!(
                f,
                "cannot read checkpoint `{}`: it is not a regular file (a device, FIFO or directory)",
                path.display()
            ),
            WeightsError::NotSafetensors { path, source } => {
                write!(f, "`{}` is not a valid safetensors file: {source}", path.display())
            }
            WeightsError::Mismatch { path, model, prefix, problems } => {
                let names = match prefix.as_deref() {
                    Some(prefix) if !prefix.is_empty() => {
                        format!(" (names are looked up bare and with the prefix `{prefix}`)")
                    }
                    _ => String::new(),
                };
                write!(
                    f,
                    "checkpoint `{}` does not match the parameters of model `{model}`{names}:\n{}",
                    path.display(),
                    capped_list(problems)
                )
            }
            WeightsError::NonFinite { path, tensors } => {
                match tensors.as_slice() {
                    [one] => write!(f, "weights `{}`: {one}", path.display())?,
                    _ => write!(
                        f,
                        "weights `{}`: {} tensors hold NaN or infinite values:\n{}",
                        path.display(),
                        tensors.len(),
                        capped_list(tensors)
                    )?,
                }
                f.write_str("\nhelp: pass `--allow-non-finite-weights` to load them anyway")
            }
            WeightsError::NotLoaded { name } => write!(f, "`{name}` is not in the checkpoint"),
            WeightsError::Layout(e) => write!(f, "{e}"),
            WeightsError::NoWeightFile { dir } => {
                write!(f, "`{}` holds neither {SINGLE_FILE} nor {INDEX_FILE}", dir.display())
            }
            WeightsError::Index(e) => write!(f, "{e}"),
            WeightsError::NotAnIndex { path, source } => write!(
                f,
                "`{}` is not a safetensors index (JSON with a `weight_map` of tensor names to files): {source}",
                path.display()
            ),
            WeightsError::ShardName { index, name } => write!(
                f,
                "`{}` names the file `{name}`; shard files must be plain names beside the index",
                index.display()
            ),
            WeightsError::IndexMismatch { index, problems } => {
                write!(f, "`{}` does not match its files:\n{}", index.display(), bullet_list(problems))
            }
            WeightsError::Both(first, then) => write!(f, "{first}\n{then}"),
            WeightsError::Checkpoint(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for WeightsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WeightsError::Unreadable { source, .. } => Some(source),
            WeightsError::NotSafetensors { source, .. } => Some(source),
            WeightsError::Layout(e) => Some(e),
            WeightsError::Index(e) => Some(e),
            WeightsError::NotAnIndex { source, .. } => Some(source),
            WeightsError::Both(first, _) => Some(first.as_ref()),
            WeightsError::Checkpoint(e) => Some(e),
            _ => None,
        }
    }
}

impl From<CheckpointError> for WeightsError {
    fn from(e: CheckpointError) -> WeightsError {
        WeightsError::Checkpoint(e)
    }
}

/// Why a model's parameters could not be saved as one safetensors file.
#[derive(Debug)]
pub enum SaveError {
    /// Values that do not fit the parameters.
    Tensors { path: PathBuf, problems: Vec<TensorProblem> },
    /// The tensors could not be serialized.
    Serialize { path: PathBuf, source: SafeTensorError },
    /// Writing the file failed.
    Write(OutputError),
}

impl fmt::Display for SaveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SaveError::Tensors { path, problems } => {
                write!(f, "cannot save weights file `{}`:\n{}", path.display(), bullet_list(problems))
            }
            SaveError::Serialize { path, source } => {
                write!(f, "cannot save weights file `{}`: {source}", path.display())
            }
            SaveError::Write(e) => write!(f, "cannot write weights file `{}`: {}", e.path().display(), e.reason()),
        }
    }
}

impl std::error::Error for SaveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SaveError::Tensors { .. } => None,
            SaveError::Serialize { source, .. } => Some(source),
            SaveError::Write(e) => Some(e),
        }
    }
}

/// Reads a safetensors file (or an index and its shards) and returns every plan parameter's logical tensor,
/// by parameter name. A NaN or infinite weight is an error naming the tensor and the first bad element,
/// unless `allow_non_finite`.
pub fn load_checkpoint(
    path: &Path,
    plan: &Plan,
    allow_non_finite: bool,
) -> Result<BTreeMap<String, Tensor>, WeightsError> {
    let mapped = match super::pretrained::is_index(path) {
        true => super::pretrained::map_weights(path, plan, allow_non_finite)?,
        false => {
            super::mapped::MappedWeights::open(path, &[path.to_path_buf()], plan, allow_non_finite, &mut |_, _| Ok(()))?
        }
    };
    Ok(mapped.logical_params(plan))
}

/// "missing `NAME`: expected [SHAPE]", for a parameter no file tensor matches.
pub(super) fn missing(p: &PlanParam) -> TensorProblem {
    TensorProblem::Missing { name: p.checkpoint.clone(), want: stored_shape(p), transposed: is_transposed(p) }
}

/// Maps a checkpoint file into memory, so a large file is read page by page rather than copied whole. Anything
/// but a regular file (a device such as `/dev/zero`, a FIFO, a directory) is refused before it is opened.
pub(super) fn map_checkpoint(path: &Path) -> Result<memmap2::Mmap, WeightsError> {
    let cannot = |source: std::io::Error| WeightsError::Unreadable { path: path.to_path_buf(), source };
    let not_regular = || WeightsError::NotRegular { path: path.to_path_buf() };
    if !std::fs::metadata(path).map_err(cannot)?.is_file() {
        return Err(not_regular());
    }
    let file = std::fs::File::open(path).map_err(cannot)?;
    // Checked again on the open file, in case the path was replaced in between.
    if !file.metadata().map_err(cannot)?.is_file() {
        return Err(not_regular());
    }
    // SAFETY: the mapping is only read, and lives no longer than this load. Like every reader of a file, it
    // assumes no other process truncates the checkpoint while it is being loaded.
    unsafe { memmap2::Mmap::map(&file) }.map_err(cannot)
}

/// Writes every parameter as F32 under its prefixed checkpoint name, atomically, with `format: pt`.
pub fn save_checkpoint(path: &Path, plan: &Plan, params: &BTreeMap<String, Tensor>) -> Result<(), SaveError> {
    let tensors =
        f32_tensors(plan, params).map_err(|problems| SaveError::Tensors { path: path.to_path_buf(), problems })?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let views: Vec<(&str, &F32Bytes)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|source| SaveError::Serialize { path: path.to_path_buf(), source })?;
    super::output::write_file(path, &bytes).map_err(SaveError::Write)
}

/// File tensors assigned to parameters, and what did not fit.
pub(super) struct Matching<'p, 'd> {
    /// By parameter name: the file's key and tensor.
    pub found: HashMap<&'p str, (String, TensorView<'d>)>,
    /// Duplicates and other problems found while matching.
    pub problems: Vec<TensorProblem>,
    /// Tensors that belong to no parameter and are not ignorable.
    pub extras: Vec<TensorProblem>,
}

/// Assigns each file tensor to the parameter whose checkpoint name it carries, bare or prefixed.
pub(super) fn match_tensors<'p, 'd>(plan: &'p Plan, file: &[(String, TensorView<'d>)]) -> Matching<'p, 'd> {
    let by_checkpoint: HashMap<&str, &PlanParam> = plan.params.iter().map(|p| (p.checkpoint.as_str(), p)).collect();
    let prefix = plan.checkpoint_prefix.as_deref().unwrap_or("");
    let mut matching = Matching { found: HashMap::new(), problems: Vec::new(), extras: Vec::new() };
    let lookup = |key: &str| {
        by_checkpoint
            .get(key)
            .or_else(|| key.strip_prefix(prefix).filter(|_| !prefix.is_empty()).and_then(|k| by_checkpoint.get(k)))
            .copied()
    };
    let mut tensors: Vec<&(String, TensorView<'d>)> = file.iter().collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut aliased = Vec::new();
    for (key, view) in tensors.into_iter().cloned() {
        let alias_of = || decoder_bias_alias(&key).and_then(|k| lookup(&k)).filter(|p| p.role == ParamRole::LinearBias);
        let param = lookup(&key);
        if let (None, Some(p)) = (param, alias_of()) {
            aliased.push((p, key, view));
            continue;
        }
        match param {
            Some(p) => {
                if let Some((first, _)) = matching.found.get(p.name.as_str()) {
                    matching.problems.push(TensorProblem::Twice {
                        checkpoint: p.checkpoint.clone(),
                        first: printable(first).into_owned(),
                        second: printable(&key).into_owned(),
                    });
                } else {
                    matching.found.insert(p.name.as_str(), (key, view));
                }
            }
            None if ignorable(plan, prefix, &key, view.shape()) => {}
            None => matching
                .extras
                .push(TensorProblem::Unexpected { name: printable(&key).into_owned(), got: u64_shape(view.shape()) }),
        }
    }
    // Read only where the decoder's own name is absent: a file holding both holds the one tied tensor twice.
    for (p, key, view) in aliased {
        matching.found.entry(p.name.as_str()).or_insert((key, view));
    }
    matching
}

/// Hugging Face ties an MLM decoder's bias to its parent's (`cls.predictions.decoder.bias` is
/// `cls.predictions.bias` in BertForMaskedLM, `lm_head.decoder.bias` is `lm_head.bias` in RoBERTa) and
/// `save_pretrained` writes only the parent's: the decoder bias's name for a file key `A.bias`.
fn decoder_bias_alias(key: &str) -> Option<String> {
    key.strip_suffix(".bias").filter(|stem| !stem.is_empty()).map(|stem| format!("{stem}.decoder.bias"))
}

/// GPT-2's causal-mask buffers (`*.attn.bias`, `*.attn.masked_bias` with no parameter's shape), and
/// `lm_head.weight` when no parameter is stored under that name (it is tied to the token embedding).
fn ignorable(plan: &Plan, prefix: &str, key: &str, shape: &[usize]) -> bool {
    let bare = key.strip_prefix(prefix).unwrap_or(key);
    if bare == "lm_head.weight" || key == "lm_head.weight" {
        return true;
    }
    let mut parts = key.rsplit('.');
    let (last, layer) = (parts.next(), parts.next());
    let is_mask = layer == Some("attn") && matches!(last, Some("bias") | Some("masked_bias"));
    is_mask && !plan.params.iter().any(|p| p.shape.iter().map(|&d| d as usize).eq(shape.iter().copied()))
}

/// How many leading elements of the file tensor make the parameter (its shape checked, the first rows of a
/// longer position table), once its dtype is known to be readable.
pub(super) fn check_view(p: &PlanParam, key: &str, view: &TensorView<'_>) -> Result<usize, TensorProblem> {
    let name = printable(key).into_owned();
    let stored = stored_shape(p);
    let Some(count) = elements_to_take(p, &stored, view.shape()) else {
        let got = u64_shape(view.shape());
        return Err(TensorProblem::Shape { name, want: stored, transposed: is_transposed(p), got });
    };
    if !matches!(view.dtype(), Dtype::F32 | Dtype::F64 | Dtype::F16 | Dtype::BF16) {
        return Err(TensorProblem::Dtype { name, dtype: view.dtype() });
    }
    let needed = count.checked_mul(view.dtype().bitsize() / 8).filter(|&n| n <= view.data().len());
    needed.map(|_| count).ok_or(TensorProblem::Short { name })
}

/// A shape of file dimensions as plan dimensions.
fn u64_shape(shape: &[usize]) -> Vec<u64> {
    shape.iter().map(|&d| d as u64).collect()
}

/// The first NaN or infinite value among the first `count` elements of a file tensor.
pub(super) fn first_non_finite_in(key: &str, dtype: Dtype, data: &[u8], count: usize) -> Option<NonFiniteValue> {
    let width = dtype.bitsize() / 8;
    let value = |k: usize| -> f32 {
        let b = &data[k * width..k * width + width];
        match dtype {
            Dtype::F64 => f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32,
            Dtype::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            Dtype::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    };
    let index = (0..count.min(data.len() / width.max(1))).find(|&k| !value(k).is_finite())?;
    let tensor = printable(key).into_owned();
    Some(NonFiniteValue { tensor, value: value(index), index, narrowed: dtype == Dtype::F64 })
}

/// The index and value of the first NaN or infinite value.
pub(super) fn first_non_finite(values: &[f32]) -> Option<(usize, f32)> {
    values.iter().position(|v| !v.is_finite()).map(|i| (i, values[i]))
}

/// What a non-finite value is called in messages: NaN, infinity or -infinity.
pub(super) fn non_finite_name(value: f32) -> &'static str {
    if value.is_nan() {
        "NaN"
    } else if value > 0.0 {
        "infinity"
    } else {
        "-infinity"
    }
}

/// The model shape `[in, out]` of a weight that checkpoints store `[out, in]`.
pub(super) fn transposed_dims(p: &PlanParam) -> Option<(usize, usize)> {
    match (p.checkpoint_transposed, p.shape.as_slice()) {
        (true, &[in_dim, out_dim]) => Some((in_dim as usize, out_dim as usize)),
        _ => None,
    }
}

/// The parameter's shape in checkpoint files: its model shape, reversed for a weight stored `[out, in]`.
fn stored_shape(p: &PlanParam) -> Vec<u64> {
    let mut shape = p.shape.clone();
    if transposed_dims(p).is_some() {
        shape.reverse();
    }
    shape
}

/// Whether checkpoint files store the parameter `[out, in]`, the model's shape reversed.
fn is_transposed(p: &PlanParam) -> bool {
    transposed_dims(p).is_some()
}

/// Says why a transposed parameter's expected shape is the model's reversed.
fn orientation_note(transposed: bool) -> &'static str {
    if transposed { " ([out, in], as the model declares `out_in`)" } else { "" }
}

/// A row-major `[rows, cols]` matrix as row-major `[cols, rows]`.
pub(super) fn transpose_2d(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; values.len()];
    for (r, row) in values.chunks_exact(cols.max(1)).take(rows).enumerate() {
        for (c, &v) in row.iter().enumerate() {
            out[c * rows + r] = v;
        }
    }
    out
}

/// How many leading elements of a file tensor of shape `found` make the parameter (stored as `expected`), if it
/// fits.
fn elements_to_take(p: &PlanParam, expected: &[u64], found: &[usize]) -> Option<usize> {
    let expected: Vec<usize> = expected.iter().map(|&d| d as usize).collect();
    let count = expected.iter().product();
    if found == expected.as_slice() {
        return Some(count);
    }
    let longer_table = p.role == ParamRole::PositionEmbedding
        && found.len() == expected.len()
        && !found.is_empty()
        && found[1..] == expected[1..]
        && found[0] >= expected[0];
    longer_table.then_some(count)
}

/// Most problems listed in one checkpoint error; the rest are counted.
pub const MAX_LISTED_PROBLEMS: usize = 20;

/// A bullet list of the first [`MAX_LISTED_PROBLEMS`] lines, then "... and N more".
pub(super) fn capped_list(lines: &[impl fmt::Display]) -> String {
    let shown = lines.len().min(MAX_LISTED_PROBLEMS);
    let mut list = bullet_list(&lines[..shown]);
    if lines.len() > shown {
        list.push_str(&format!("\n  ... and {} more", lines.len() - shown));
    }
    list
}

pub(super) fn bullet_list(lines: &[impl fmt::Display]) -> String {
    lines.iter().map(|l| format!("  - {l}")).collect::<Vec<_>>().join("\n")
}

/// A tensor to write: F32 bytes, little-endian.
pub(super) struct F32Bytes {
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl F32Bytes {
    pub(super) fn byte_len(&self) -> u64 {
        self.bytes.len() as u64
    }
}

/// Serialized by reference, so that writing a file (or one shard of it) copies no tensor.
impl View for &F32Bytes {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }

    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Every parameter as F32 bytes under its prefixed checkpoint name, or every problem found.
pub(super) fn f32_tensors(
    plan: &Plan,
    params: &BTreeMap<String, Tensor>,
) -> Result<Vec<(String, F32Bytes)>, Vec<TensorProblem>> {
    let prefix = plan.checkpoint_prefix.as_deref().unwrap_or("");
    let mut out: Vec<(String, F32Bytes)> = Vec::new();
    let mut problems = Vec::new();
    let mut keys = std::collections::HashSet::new();
    for p in &plan.params {
        let key = format!("{prefix}{}", p.checkpoint);
        if !keys.insert(key.clone()) {
            problems.push(TensorProblem::SharedKey { key: key.clone() });
        }
        match param_bytes(p, params.get(&p.name)) {
            Ok(bytes) => out.push((key, bytes)),
            Err(e) => problems.push(e),
        }
    }
    if problems.is_empty() { Ok(out) } else { Err(problems) }
}

fn param_bytes(p: &PlanParam, tensor: Option<&Tensor>) -> Result<F32Bytes, TensorProblem> {
    let name = || p.name.clone();
    let want = || p.shape.clone();
    let t = tensor.ok_or_else(|| TensorProblem::Missing { name: name(), want: want(), transposed: false })?;
    if t.shape != p.shape {
        return Err(TensorProblem::Shape { name: name(), want: want(), transposed: false, got: t.shape.clone() });
    }
    let values = t.f32().map_err(|why| TensorProblem::Values { name: name(), why })?;
    let count: u64 = p.shape.iter().product();
    if values.len() as u64 != count {
        return Err(TensorProblem::Count { name: name(), shape: want(), needs: count, found: values.len() });
    }
    let stored = stored_shape(p);
    let bytes = match transposed_dims(p) {
        Some((in_dim, out_dim)) => transpose_2d(values, in_dim, out_dim).iter().flat_map(|v| v.to_le_bytes()).collect(),
        None => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    Ok(F32Bytes { shape: stored.iter().map(|&d| d as usize).collect(), bytes })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn only_a_decoder_bias_has_a_parent_name() {
        assert_eq!(decoder_bias_alias("cls.predictions.bias").as_deref(), Some("cls.predictions.decoder.bias"));
        assert_eq!(decoder_bias_alias("cls.predictions.weight").as_deref(), None);
        assert_eq!(decoder_bias_alias(".bias").as_deref(), None);
    }
}
