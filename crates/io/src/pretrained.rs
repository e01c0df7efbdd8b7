//! Hugging Face `save_pretrained` layouts: a directory holding `model.safetensors`, or shards
//! `model-00001-of-00004.safetensors`... with `model.safetensors.index.json` naming each tensor's file.
//!
//! Loading maps every shard into memory and matches tensors to parameters exactly as for one file, after
//! checking that the index and the files agree. Saving cuts the tensors into shards of at most
//! `max_shard_bytes` in plan order (a tensor larger than that gets a shard of its own), as
//! `save_pretrained(max_shard_size=...)` does, writing every file atomically and the index last.

use super::checkpoint::{TensorProblem, WeightsError, bullet_list, f32_tensors};
use super::mapped::MappedWeights;
use super::output::OutputError;
use optimus_plan::Plan;
use optimus_plan::tensor::Tensor;
use optimus_plan::text::printable;
use safetensors::SafeTensorError;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

/// The index file of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The one file of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Hugging Face's default `max_shard_size` ("5GB": decimal gigabytes).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;
/// An index larger than this is not an index.
const MAX_INDEX_BYTES: u64 = 64 << 20;

/// One way an index and its shard files disagree; names are kept as printed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexProblem {
    /// Shard `file` holds `key`, which the index puts in `indexed`.
    Elsewhere { key: String, file: String, indexed: String },
    /// Shard `file` holds `key`, which the index does not name.
    NotIndexed { key: String, file: String },
    /// The index puts `key` in `file`, which does not hold it.
    NotHeld { key: String, file: String },
}

impl fmt::Display for IndexProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IndexProblem::Elsewhere { key, file, indexed } => {
                write!(f, "`{key}` is in `{file}` but the index puts it in `{indexed}`")
            }
            IndexProblem::NotIndexed { key, file } => write!(f, "`{key}` is in `{file}` but not in the index"),
            IndexProblem::NotHeld { key, file } => {
                write!(f, "the index puts `{key}` in `{file}`, which does not hold it")
            }
        }
    }
}

/// Why weights could not be saved in the `save_pretrained` layout; every message names the directory
/// or the file.
#[derive(Debug)]
pub enum SaveError {
    /// Values that do not fit the parameters.
    Tensors { dir: PathBuf, problems: Vec<TensorProblem> },
    /// The directory could not be created or listed.
    Directory { dir: PathBuf, source: std::io::Error },
    /// A weight file of an earlier save could not be removed.
    RemoveStale { dir: PathBuf, name: String, source: std::io::Error },
    /// A shard could not be serialized.
    Serialize { dir: PathBuf, source: SafeTensorError },
    /// The index could not be serialized.
    Index { dir: PathBuf, source: serde_json::Error },
    /// Writing a file failed.
    Write(OutputError),
    /// An entry not a file or a link (a folder) named as a weights file: no save could replace it.
    WeightNameTaken { path: PathBuf },
}

impl fmt::Display for SaveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cannot = |f: &mut fmt::Formatter<'_>, dir: &Path| write!(f, "cannot save weights to `{}`: ", dir.display());
        match self {
            SaveError::Tensors { dir, problems } => {
                cannot(f, dir)?;
                write!(f, "\n{}", bullet_list(problems))
            }
            SaveError::Directory { dir, source } => {
                cannot(f, dir)?;
                write!(f, "{source}")
            }
            SaveError::RemoveStale { dir, name, source } => {
                cannot(f, dir)?;
                write!(f, "cannot remove the stale `{name}`: {source}")
            }
            SaveError::Serialize { dir, source } => {
                cannot(f, dir)?;
                write!(f, "{source}")
            }
            SaveError::Index { dir, source } => {
                cannot(f, dir)?;
                write!(f, "{source}")
            }
            SaveError::Write(e) => write!(f, "{e}"),
            SaveError::WeightNameTaken { path } => write!(
                f,
                "cannot save weights: `{}` is a folder named as a weights file, which a save of another size \
                 would have to replace; move it away",
                path.display()
            ),
        }
    }
}

impl std::error::Error for SaveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SaveError::Tensors { .. } | SaveError::WeightNameTaken { .. } => None,
            SaveError::Directory { source, .. } | SaveError::RemoveStale { source, .. } => Some(source),
            SaveError::Serialize { source, .. } => Some(source),
            SaveError::Index { source, .. } => Some(source),
            SaveError::Write(e) => Some(e),
        }
    }
}

/// `model.safetensors.index.json`.
#[derive(Debug, Serialize, Deserialize)]
struct Index {
    #[serde(default)]
    metadata: serde_json::Map<String, serde_json::Value>,
    weight_map: BTreeMap<String, String>,
}

/// The index or single file a `--weights` directory holds in the `save_pretrained` layout, if any.
pub fn pretrained_file(dir: &Path) -> Option<PathBuf> {
    [INDEX_FILE, SINGLE_FILE].iter().map(|name| dir.join(name)).find(|p| p.is_file())
}

/// Whether a path names an index file (`*.json`) rather than a safetensors file.
pub fn is_index(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"))
}

/// Maps a checkpoint for reading by device blocks: one safetensors file, an index (`*.json`) and its
/// shards, or a `save_pretrained` directory holding either. Every name, shape and dtype is checked, and
/// (unless `allow_non_finite`) every value.
pub fn map_weights(path: &Path, plan: &Plan, allow_non_finite: bool) -> Result<MappedWeights, WeightsError> {
    if path.is_dir() {
        let file = pretrained_file(path).ok_or_else(|| WeightsError::NoWeightFile { dir: path.to_path_buf() })?;
        return map_weights(&file, plan, allow_non_finite);
    }
    if !is_index(path) {
        return MappedWeights::open(path, &[path.to_path_buf()], plan, allow_non_finite, &mut |_, _| Ok(()));
    }
    let index = read_index(path)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut names: Vec<&String> = index.weight_map.values().collect();
    names.sort();
    names.dedup();
    for name in &names {
        check_shard_name(path, name)?;
    }
    let files: Vec<PathBuf> = names.iter().map(|n| dir.join(n)).collect();
    let mut listed: HashMap<&str, &str> = index.weight_map.iter().map(|(k, f)| (k.as_str(), f.as_str())).collect();
    let mut in_index = |file: usize, key: &str| -> Result<(), IndexProblem> {
        let name = names[file].as_str();
        let (key_text, file_text) = (printable(key).into_owned(), name.to_string());
        match listed.remove(key) {
            Some(f) if f == name => Ok(()),
            Some(f) => {
                Err(IndexProblem::Elsewhere { key: key_text, file: file_text, indexed: printable(f).into_owned() })
            }
            None => Err(IndexProblem::NotIndexed { key: key_text, file: file_text }),
        }
    };
    let mapped = MappedWeights::open(path, &files, plan, allow_non_finite, &mut in_index);
    let mut unmatched: Vec<IndexProblem> = listed
        .into_iter()
        .map(|(k, f)| IndexProblem::NotHeld { key: printable(k).into_owned(), file: printable(f).into_owned() })
        .collect();
    if unmatched.is_empty() {
        return mapped;
    }
    unmatched.sort_by_key(ToString::to_string);
    let listing = WeightsError::IndexMismatch { index: path.to_path_buf(), problems: unmatched };
    match mapped {
        Err(e) => Err(WeightsError::Both(Box::new(e), Box::new(listing))),
        Ok(_) => Err(listing),
    }
}

fn read_index(path: &Path) -> Result<Index, WeightsError> {
    let bytes = super::files::read_bounded(path, "checkpoint index", MAX_INDEX_BYTES).map_err(WeightsError::Index)?;
    serde_json::from_slice(&bytes).map_err(|source| WeightsError::NotAnIndex { path: path.to_path_buf(), source })
}

/// A shard must be a file beside the index: a plain name, no directories.
fn check_shard_name(index: &Path, name: &str) -> Result<(), WeightsError> {
    let plain = !name.is_empty() && !name.contains(['/', '\\']) && name != "." && name != "..";
    if plain {
        return Ok(());
    }
    Err(WeightsError::ShardName { index: index.to_path_buf(), name: printable(name).into_owned() })
}

/// What a save wrote: the files, in order.
#[derive(Debug, PartialEq)]
pub struct Saved {
    pub files: Vec<String>,
    pub bytes: u64,
    /// Why no `config.json` was written (the model is not GPT-2, Llama or BERT, or lacks a value).
    pub no_config: Option<String>,
}

/// Writes every parameter as F32 in the `save_pretrained` layout into `dir` (created if needed): one
/// `model.safetensors` when everything fits in one shard, otherwise numbered shards and the index.
pub fn save_pretrained(
    dir: &Path,
    plan: &Plan,
    params: &BTreeMap<String, Tensor>,
    max_shard_bytes: u64,
) -> Result<Saved, SaveError> {
    let dir_path = || dir.to_path_buf();
    let tensors = f32_tensors(plan, params).map_err(|problems| SaveError::Tensors { dir: dir_path(), problems })?;
    let groups = shard_groups(tensors.iter().map(|(_, t)| t.byte_len()), max_shard_bytes);
    let count = groups.len();
    let name = |k: usize| {
        if count == 1 { SINGLE_FILE.to_string() } else { format!("model-{:05}-of-{count:05}.safetensors", k + 1) }
    };
    let mut names: Vec<String> = (0..count).map(name).collect();
    if count > 1 {
        names.push(INDEX_FILE.to_string());
    }
    names.extend(CONFIG_FILES.iter().map(|n| n.to_string()));
    make_writable_folder(dir, &names)?;
    // The old index goes first: from here on the folder never holds an index of an old set of shards.
    remove_weight_files(dir, &[])?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let mut weight_map = BTreeMap::new();
    let mut files = Vec::with_capacity(count);
    let mut total = 0u64;
    for (k, range) in groups.into_iter().enumerate() {
        let file = name(k);
        let shard = &tensors[range];
        for (key, t) in shard {
            weight_map.insert(key.clone(), file.clone());
            total += t.byte_len();
        }
        let views: Vec<(&str, &super::checkpoint::F32Bytes)> = shard.iter().map(|(k, t)| (k.as_str(), t)).collect();
        let bytes = safetensors::serialize(views, Some(metadata.clone()))
            .map_err(|source| SaveError::Serialize { dir: dir_path(), source })?;
        super::output::write_file(&dir.join(&file), &bytes).map_err(SaveError::Write)?;
        files.push(file);
    }
    if count > 1 {
        let mut meta = serde_json::Map::new();
        meta.insert("total_size".to_string(), serde_json::Value::from(total));
        let index = Index { metadata: meta, weight_map };
        let text =
            serde_json::to_string_pretty(&index).map_err(|source| SaveError::Index { dir: dir_path(), source })?;
        super::output::write_file(&dir.join(INDEX_FILE), format!("{text}\n").as_bytes()).map_err(SaveError::Write)?;
        files.push(INDEX_FILE.to_string());
    }
    remove_weight_files(dir, &files)?;
    let no_config = match super::hf_config::hugging_face_config(plan) {
        Ok(config) => {
            files.extend(write_configs(dir, &config)?);
            None
        }
        Err(why) => Some(why),
    };
    Ok(Saved { files, bytes: total, no_config })
}

/// The configuration files [`write_configs`] may write.
pub const CONFIG_FILES: [&str; 2] = ["config.json", "generation_config.json"];

/// What a `save_pretrained` folder may hold once written, but numbered shards (whose names depend on
/// the tensors' sizes): the single file or the index, the configs, and `extra` (a tokenizer's files).
pub fn folder_files(extra: &[&str]) -> Vec<String> {
    [SINGLE_FILE, INDEX_FILE].iter().chain(&CONFIG_FILES).chain(extra).map(|n| n.to_string()).collect()
}

/// Checks that each of `names` can be written into `dir` (made for the check if it does not exist), and
/// leaves the file system as it was: a folder it made is removed again. For a check long before the
/// writing (`run --save-weights DIR/` before its first step), so that a run refused or failed in
/// between leaves no empty folder behind.
pub fn check_all_writable(dir: &Path, names: &[String]) -> Result<(), SaveError> {
    let made = make_writable_folder(dir, names)?;
    remove_made_folders(&made);
    Ok(())
}

/// Removes `made` (folders, deepest first, as [`make_writable_folder`] returns them) while each is
/// empty: a folder something was written into stays, and so do those above it.
pub fn remove_made_folders(made: &[PathBuf]) {
    for folder in made {
        if std::fs::remove_dir(folder).is_err() {
            break;
        }
    }
}

/// [`check_all_writable`], keeping the folder for the writing that follows at once: a save that cannot
/// finish (a name taken by a folder, a folder that cannot be written) leaves the file system as it was.
/// Returns the folders it made, deepest first, for a writer that fails later to remove again
/// ([`remove_made_folders`]).
pub fn make_writable_folder(dir: &Path, names: &[String]) -> Result<Vec<PathBuf>, SaveError> {
    // `a/../b` makes `a` and `b`: an ancestor ending in `..` (or `.`) is no folder of its own.
    let made: Vec<PathBuf> = dir
        .ancestors()
        .filter(|p| !p.as_os_str().is_empty() && p.file_name().is_some())
        .take_while(|p| !p.exists())
        .map(Path::to_path_buf)
        .collect();
    // A file where the folder (or one above it) would go: say so, not the OS's "File exists".
    let plain: PathBuf = dir.components().collect();
    if let Some(file) = plain.ancestors().find(|p| !p.as_os_str().is_empty() && p.exists() && !p.is_dir()) {
        let source = std::io::Error::new(
            std::io::ErrorKind::NotADirectory,
            format!("`{}` is a file, not a folder", file.display()),
        );
        return Err(SaveError::Directory { dir: dir.to_path_buf(), source });
    }
    std::fs::create_dir_all(dir).map_err(|source| SaveError::Directory { dir: dir.to_path_buf(), source })?;
    let checked = no_folder_named_as_weights(dir).and_then(|()| {
        names.iter().try_for_each(|n| super::output::check_writable(&dir.join(n)).map_err(SaveError::Write))
    });
    match checked {
        Ok(()) => Ok(made),
        Err(e) => {
            remove_made_folders(&made);
            Err(e)
        }
    }
}

/// Refuses a folder in `dir` named as a weights file (a numbered shard among them, whose names depend
/// on the tensors' sizes and so cannot be listed before the save): found before training, not after.
fn no_folder_named_as_weights(dir: &Path) -> Result<(), SaveError> {
    let entries = std::fs::read_dir(dir).map_err(|source| SaveError::Directory { dir: dir.to_path_buf(), source })?;
    for entry in entries.flatten() {
        let named_as_weights = is_weight_file(&entry.file_name().to_string_lossy());
        if named_as_weights && entry.file_type().is_ok_and(|t| t.is_dir()) {
            return Err(SaveError::WeightNameTaken { path: entry.path() });
        }
    }
    Ok(())
}

/// Writes `config.json` and, for a model that generates, `generation_config.json`; returns their names.
pub fn write_configs(dir: &Path, config: &super::hf_config::HfConfig) -> Result<Vec<String>, SaveError> {
    let mut written = Vec::new();
    for (name, value) in [(CONFIG_FILES[0], Some(&config.config)), (CONFIG_FILES[1], config.generation.as_ref())] {
        let Some(value) = value else { continue };
        let text = serde_json::to_string_pretty(value)
            .map_err(|source| SaveError::Index { dir: dir.to_path_buf(), source })?;
        super::output::write_file(&dir.join(name), format!("{text}\n").as_bytes()).map_err(SaveError::Write)?;
        written.push(name.to_string());
    }
    Ok(written)
}

/// Whether a file name is one `save_pretrained` writes: `model.safetensors`, a numbered shard
/// `model-00001-of-00004.safetensors`, or the index.
fn is_weight_file(name: &str) -> bool {
    let numbered = |rest: &str| {
        let Some((k, n)) = rest.strip_suffix(".safetensors").and_then(|r| r.split_once("-of-")) else { return false };
        [k, n].iter().all(|d| d.len() == 5 && d.bytes().all(|b| b.is_ascii_digit()))
    };
    name == SINGLE_FILE || name == INDEX_FILE || name.strip_prefix("model-").is_some_and(numbered)
}

/// Removes the weight files of an earlier save from `dir`, but those in `keep`: with no `keep`, only the
/// index (so that no index names shards of two saves); after a save, every old shard and single file
/// the new set does not name. A link is removed itself, never what it points to.
pub fn remove_weight_files(dir: &Path, keep: &[String]) -> Result<(), SaveError> {
    let entries = std::fs::read_dir(dir).map_err(|source| SaveError::Directory { dir: dir.to_path_buf(), source })?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let stale = if keep.is_empty() { name == INDEX_FILE } else { is_weight_file(&name) && !keep.contains(&name) };
        if stale && entry.file_type().is_ok_and(|t| !t.is_dir()) {
            std::fs::remove_file(entry.path()).map_err(|source| SaveError::RemoveStale {
                dir: dir.to_path_buf(),
                name: name.clone(),
                source,
            })?;
        }
    }
    Ok(())
}

/// Consecutive groups of tensors (by index) of at most `max` bytes each; a tensor larger than `max` alone.
fn shard_groups(sizes: impl Iterator<Item = u64>, max: u64) -> Vec<std::ops::Range<usize>> {
    let sizes: Vec<u64> = sizes.collect();
    let mut groups = Vec::new();
    let (mut start, mut bytes) = (0usize, 0u64);
    for (i, &size) in sizes.iter().enumerate() {
        if i > start && bytes.saturating_add(size) > max {
            groups.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes = bytes.saturating_add(size);
    }
    groups.push(start..sizes.len());
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_fill_up_to_the_limit_in_order_and_a_large_tensor_stands_alone() {
        assert_eq!(shard_groups([4u64, 4, 4].into_iter(), 8), vec![0..2, 2..3]);
        assert_eq!(shard_groups([4u64, 20, 4].into_iter(), 8), vec![0..1, 1..2, 2..3]);
        assert_eq!(shard_groups([4u64, 4, 4].into_iter(), 100), vec![0..3]);
    }
}
