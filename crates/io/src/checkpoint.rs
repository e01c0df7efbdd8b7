//! Safetensors checkpoints of a plan's parameters, compatible with Hugging Face GPT-2 files.
//!
//! A parameter is stored under its `checkpoint` name, found bare or behind the plan's
//! `checkpoint_prefix` (`h.0.attn.c_attn.weight` in the hub files, `transformer.h.0.attn.c_attn.weight`
//! in those of `save_pretrained`). Loading ignores GPT-2's causal-mask buffers and a tied
//! `lm_head.weight`, reads a tied MLM decoder's bias from its parent's name (`cls.predictions.bias`, as
//! BertForMaskedLM's `save_pretrained` writes it), takes the first rows of a longer position table, and
//! reads F32, F16, BF16 and F64. Every mismatch is reported at once, and nothing is returned or written unless all is well.

use optimus_plan::tensor::Tensor;
use optimus_plan::text::printable;
use optimus_plan::text::shape_text;
use optimus_plan::types::ParamRole;
use optimus_plan::{Plan, PlanParam};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, View};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Reads a safetensors file (or an index and its shards) and returns every plan parameter's logical tensor,
/// by parameter name. A NaN or infinite weight is an error naming the tensor and the first bad element,
/// unless `allow_non_finite`.
pub fn load_checkpoint(path: &Path, plan: &Plan, allow_non_finite: bool) -> Result<BTreeMap<String, Tensor>, String> {
    let mapped = match super::pretrained::is_index(path) {
        true => super::pretrained::map_weights(path, plan, allow_non_finite)?,
        false => {
            super::mapped::MappedWeights::open(path, &[path.to_path_buf()], plan, allow_non_finite, &mut |_, _| Ok(()))?
        }
    };
    Ok(mapped.logical_params(plan))
}

/// "missing `NAME`: expected [SHAPE]", for a parameter no file tensor matches.
pub(super) fn missing(p: &PlanParam) -> String {
    format!("missing `{}`: expected {}{}", p.checkpoint, shape_text(&stored_shape(p)), orientation_note(p))
}

/// Maps a checkpoint file into memory, so a large file is read page by page rather than copied whole. Anything
/// but a regular file (a device such as `/dev/zero`, a FIFO, a directory) is refused before it is opened.
pub(super) fn map_checkpoint(path: &Path) -> Result<memmap2::Mmap, String> {
    let cannot = |e: std::io::Error| format!("cannot read checkpoint `{}`: {e}", path.display());
    let not_regular = || {
        format!("cannot read checkpoint `{}`: it is not a regular file (a device, FIFO or directory)", path.display())
    };
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
pub fn save_checkpoint(path: &Path, plan: &Plan, params: &BTreeMap<String, Tensor>) -> Result<(), String> {
    let tensors = f32_tensors(plan, params)
        .map_err(|problems| format!("cannot save checkpoint `{}`:\n{}", path.display(), bullet_list(&problems)))?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let views: Vec<(&str, &F32Bytes)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|e| format!("cannot save checkpoint `{}`: {e}", path.display()))?;
    super::output::write_file(path, &bytes)
        .map_err(|e| format!("cannot write checkpoint `{}`: {}", e.path().display(), e.reason()))
}

/// File tensors assigned to parameters, and what did not fit.
pub(super) struct Matching<'p, 'd> {
    /// By parameter name: the file's key and tensor.
    pub found: HashMap<&'p str, (String, TensorView<'d>)>,
    /// Duplicates and other problems found while matching.
    pub problems: Vec<String>,
    /// Tensors that belong to no parameter and are not ignorable.
    pub extras: Vec<String>,
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
                    matching.problems.push(format!(
                        "`{}` appears twice, as `{}` and as `{}`",
                        p.checkpoint,
                        printable(first),
                        printable(&key)
                    ));
                } else {
                    matching.found.insert(p.name.as_str(), (key, view));
                }
            }
            None if ignorable(plan, prefix, &key, view.shape()) => {}
            None => {
                matching.extras.push(format!("unexpected `{}`: found {}", printable(&key), shape_text(view.shape())))
            }
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
pub(super) fn check_view(p: &PlanParam, key: &str, view: &TensorView<'_>) -> Result<usize, String> {
    let key = printable(key);
    let stored = stored_shape(p);
    let count = elements_to_take(p, &stored, view.shape()).ok_or_else(|| {
        format!("`{key}`: expected {}{}, found {}", shape_text(&stored), orientation_note(p), shape_text(view.shape()))
    })?;
    if !matches!(view.dtype(), Dtype::F32 | Dtype::F64 | Dtype::F16 | Dtype::BF16) {
        return Err(format!("`{key}`: dtype {:?} cannot be read (F32, F16, BF16 and F64 can)", view.dtype()));
    }
    let needed = count.checked_mul(view.dtype().bitsize() / 8).filter(|&n| n <= view.data().len());
    needed.map(|_| count).ok_or_else(|| format!("`{key}`: the file holds fewer values than its shape says"))
}

/// A description of the first NaN or infinite value among the first `count` elements of a file tensor.
pub(super) fn first_non_finite_in(key: &str, dtype: Dtype, data: &[u8], count: usize) -> Option<String> {
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
    let cast = if dtype == Dtype::F64 { " (as f32)" } else { "" };
    Some(format!("tensor `{}` holds {}{cast} at element {index}", printable(key), non_finite_name(value(index))))
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

/// Says why a transposed parameter's expected shape is the model's reversed.
fn orientation_note(p: &PlanParam) -> &'static str {
    if transposed_dims(p).is_some() { " ([out, in], as the model declares `out_in`)" } else { "" }
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

pub(super) fn non_finite_message(path: &Path, problems: &[String]) -> String {
    let head = match problems {
        [one] => format!("weights `{}`: {one}", path.display()),
        _ => format!(
            "weights `{}`: {} tensors hold NaN or infinite values:\n{}",
            path.display(),
            problems.len(),
            capped_list(problems)
        ),
    };
    format!("{head}\nhelp: pass `--allow-non-finite-weights` to load them anyway")
}

/// Most problems listed in one checkpoint error; the rest are counted.
pub const MAX_LISTED_PROBLEMS: usize = 20;

/// A bullet list of the first [`MAX_LISTED_PROBLEMS`] lines, then "... and N more".
pub(super) fn capped_list(lines: &[String]) -> String {
    let shown = lines.len().min(MAX_LISTED_PROBLEMS);
    let mut list = bullet_list(&lines[..shown]);
    if lines.len() > shown {
        list.push_str(&format!("\n  ... and {} more", lines.len() - shown));
    }
    list
}

pub(super) fn mismatch_message(path: &Path, plan: &Plan, problems: &[String]) -> String {
    let names = match plan.checkpoint_prefix.as_deref() {
        Some(prefix) if !prefix.is_empty() => format!(" (names are looked up bare and with the prefix `{prefix}`)"),
        _ => String::new(),
    };
    format!(
        "checkpoint `{}` does not match the parameters of model `{}`{names}:\n{}",
        path.display(),
        plan.model,
        capped_list(problems)
    )
}

pub(super) fn bullet_list(lines: &[String]) -> String {
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
) -> Result<Vec<(String, F32Bytes)>, Vec<String>> {
    let prefix = plan.checkpoint_prefix.as_deref().unwrap_or("");
    let mut out: Vec<(String, F32Bytes)> = Vec::new();
    let mut problems = Vec::new();
    let mut keys = std::collections::HashSet::new();
    for p in &plan.params {
        let key = format!("{prefix}{}", p.checkpoint);
        if !keys.insert(key.clone()) {
            problems.push(format!("two parameters are stored under `{key}`"));
        }
        match param_bytes(p, params.get(&p.name)) {
            Ok(bytes) => out.push((key, bytes)),
            Err(e) => problems.push(e),
        }
    }
    if problems.is_empty() { Ok(out) } else { Err(problems) }
}

fn param_bytes(p: &PlanParam, tensor: Option<&Tensor>) -> Result<F32Bytes, String> {
    let expected = shape_text(&p.shape);
    let t = tensor.ok_or_else(|| format!("missing `{}`: expected {expected}", p.name))?;
    if t.shape != p.shape {
        return Err(format!("`{}`: expected {expected}, found {}", p.name, shape_text(&t.shape)));
    }
    let values = t.f32().map_err(|e| format!("`{}`: {e}", p.name))?;
    let count: u64 = p.shape.iter().product();
    if values.len() as u64 != count {
        return Err(format!("`{}`: shape {expected} needs {count} values, found {}", p.name, values.len()));
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
