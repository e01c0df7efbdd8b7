//! Hugging Face safetensors weights kept memory-mapped, from which each device reads only its own block of
//! each parameter (converted to f32, transposed for `[out, in]` weights, padding zero): a run never builds
//! a whole logical tensor of a file it was given, so a rank holds its shards, not the model.
//!
//! Opening checks everything loading whole tensors checks (names, shapes, dtypes, and NaN or infinite
//! values, scanned in place) and reports every mismatch at once.

use super::checkpoint::{Matching, WeightsError, first_non_finite_in, map_checkpoint, match_tensors, missing};
use super::pretrained::IndexProblem;
use optimus_plan::stores::{StoreError, WeightSource};
use optimus_plan::tensor::Tensor;
use optimus_plan::{Buffer, Coords, Mesh, Plan, PlanParam};
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where one parameter lies in the mapped files.
#[derive(Debug)]
struct Entry {
    map: usize,
    /// Byte offset of the tensor's data in its map.
    start: usize,
    dtype: Dtype,
    /// The parameter's model shape (before padding).
    shape: Vec<u64>,
    /// `[in, out]` of a weight the file stores `[out, in]`.
    transposed: Option<(u64, u64)>,
}

/// A checkpoint's files, mapped, and where each plan parameter lies in them.
#[derive(Debug)]
pub struct MappedWeights {
    path: PathBuf,
    maps: Vec<memmap2::Mmap>,
    entries: BTreeMap<String, Entry>,
}

impl MappedWeights {
    /// Maps `files` (one, or the shards an index names; `index` pairs each tensor with its file) and matches
    /// their tensors to `plan`'s parameters. `path` names the checkpoint in messages.
    pub(super) fn open(
        path: &Path,
        files: &[PathBuf],
        plan: &Plan,
        allow_non_finite: bool,
        check: &mut dyn FnMut(usize, &str) -> Result<(), IndexProblem>,
    ) -> Result<MappedWeights, WeightsError> {
        let maps = files.iter().map(|f| map_checkpoint(f)).collect::<Result<Vec<_>, _>>()?;
        let mut parsed = Vec::with_capacity(maps.len());
        for (file, map) in files.iter().zip(&maps) {
            parsed.push(
                SafeTensors::deserialize(map)
                    .map_err(|source| WeightsError::NotSafetensors { path: file.clone(), source })?,
            );
        }
        let mut tensors = Vec::new();
        let mut problems = Vec::new();
        for (k, file) in parsed.iter().enumerate() {
            for (key, view) in file.tensors() {
                match check(k, &key) {
                    Ok(()) => tensors.push((k, key, view)),
                    Err(e) => problems.push(e),
                }
            }
        }
        if !problems.is_empty() {
            return Err(WeightsError::IndexMismatch { index: path.to_path_buf(), problems });
        }
        let listed: Vec<(String, safetensors::tensor::TensorView<'_>)> =
            tensors.iter().map(|(_, key, view)| (key.clone(), view.clone())).collect();
        let file_of: BTreeMap<&str, usize> = tensors.iter().map(|(k, key, _)| (key.as_str(), *k)).collect();
        let Matching { mut found, mut problems, mut extras } = match_tensors(plan, &listed);
        let mut entries = BTreeMap::new();
        let mut non_finite = Vec::new();
        for p in &plan.params {
            let Some((key, view)) = found.remove(p.name.as_str()) else {
                problems.push(missing(p));
                continue;
            };
            let map = file_of.get(key.as_str()).copied().unwrap_or(0);
            match super::checkpoint::check_view(p, &key, &view) {
                Ok(count) => {
                    let data = view.data();
                    let start = data.as_ptr() as usize - maps[map].as_ptr() as usize;
                    let entry = Entry {
                        map,
                        start,
                        dtype: view.dtype(),
                        shape: p.shape.clone(),
                        transposed: super::checkpoint::transposed_dims(p).map(|(i, o)| (i as u64, o as u64)),
                    };
                    if !allow_non_finite && let Some(bad) = first_non_finite_in(&key, view.dtype(), data, count) {
                        non_finite.push(bad);
                    }
                    entries.insert(p.name.clone(), entry);
                }
                Err(e) => problems.push(e),
            }
        }
        problems.append(&mut extras);
        if !problems.is_empty() {
            let (model, prefix) = (plan.model.clone(), plan.checkpoint_prefix.clone());
            return Err(WeightsError::Mismatch { path: path.to_path_buf(), model, prefix, problems });
        }
        if !non_finite.is_empty() {
            return Err(WeightsError::NonFinite { path: path.to_path_buf(), tensors: non_finite });
        }
        Ok(MappedWeights { path: path.to_path_buf(), maps, entries })
    }

    /// The checkpoint's path, as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Device (i, j)'s block of parameter `p`, laid out as its buffer `meta` (padding zero).
    pub fn block(&self, p: &PlanParam, meta: &Buffer, coords: Coords, mesh: Mesh) -> Result<Tensor, WeightsError> {
        let entry = self.entries.get(&p.name).ok_or_else(|| WeightsError::NotLoaded { name: p.name.clone() })?;
        let axes = super::shards::block_coordinates(meta, coords, mesh).map_err(WeightsError::Layout)?;
        Ok(Tensor::from_f32(&meta.shape, self.grid(entry, &axes)))
    }

    /// Every parameter's whole logical (unpadded) tensor, by parameter name.
    pub fn logical_params(&self, plan: &Plan) -> BTreeMap<String, Tensor> {
        let mut out = BTreeMap::new();
        for p in &plan.params {
            let Some(entry) = self.entries.get(&p.name) else { continue };
            let axes: Vec<Vec<u64>> = entry.shape.iter().map(|&s| (0..s).collect()).collect();
            out.insert(p.name.clone(), Tensor::from_f32(&entry.shape, self.grid(entry, &axes)));
        }
        out
    }

    /// The values at every logical index of the grid `axes` (one list of coordinates per dimension), in
    /// row-major order.
    fn grid(&self, entry: &Entry, axes: &[Vec<u64>]) -> Vec<f32> {
        let total: usize = axes.iter().map(Vec::len).product();
        let mut values = Vec::with_capacity(total);
        let (mut at, mut index) = (vec![0usize; axes.len()], vec![0u64; axes.len()]);
        for _ in 0..total {
            for ((slot, &k), axis) in index.iter_mut().zip(&at).zip(axes) {
                *slot = axis[k];
            }
            values.push(self.element(entry, &index));
            advance(&mut at, axes);
        }
        values
    }

    /// The value at logical index `at` (zero in padding), read from the file.
    fn element(&self, entry: &Entry, at: &[u64]) -> f32 {
        if at.len() != entry.shape.len() || at.iter().zip(&entry.shape).any(|(a, s)| a >= s) {
            return 0.0;
        }
        let flat = match (entry.transposed, at) {
            (Some((rows, _)), &[r, c]) => c * rows + r,
            _ => at.iter().zip(&entry.shape).fold(0u64, |acc, (a, s)| acc * s + a),
        };
        let bytes = &self.maps[entry.map][entry.start..];
        read_f32(entry.dtype, bytes, flat as usize)
    }
}

/// Element `k` of little-endian data of `dtype`, as f32 (0 if out of range or unreadable: opening checked both).
fn read_f32(dtype: Dtype, bytes: &[u8], k: usize) -> f32 {
    let at = |n: usize| bytes.get(k * n..k * n + n);
    match dtype {
        Dtype::F32 => at(4).map_or(0.0, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::F64 => {
            at(8).map_or(0.0, |b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32)
        }
        Dtype::F16 => at(2).map_or(0.0, |b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        Dtype::BF16 => at(2).map_or(0.0, |b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        _ => 0.0,
    }
}

/// The next multi-index in row-major order over `axes`.
fn advance(at: &mut [usize], axes: &[Vec<u64>]) {
    for d in (0..at.len()).rev() {
        at[d] += 1;
        if at[d] < axes[d].len() {
            return;
        }
        at[d] = 0;
    }
}

impl WeightSource for MappedWeights {
    fn block(&self, param: &PlanParam, buffer: &Buffer, coords: Coords, mesh: Mesh) -> Result<Tensor, StoreError> {
        MappedWeights::block(self, param, buffer, coords, mesh).map_err(StoreError::from)
    }
}
