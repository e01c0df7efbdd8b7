//! Mesh-independent initial values: every element of a parameter is a function of the seed, the
//! parameter's name and its logical index, so every mesh starts from the same logical model.

use super::logical::{BlockError, IndexMap, logical_indices};
use super::tensor::{Data, Tensor};
use crate::types::Init;
use crate::{Buffer, Coords, Mesh, PlanParam};

/// SplitMix64: a fast, well-mixed 64-bit hash used as a counter-based generator.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A stable 64-bit hash of a name (FNV-1a), so values do not depend on parameter order.
pub fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// A standard normal sample for (seed, stream, index), by Box-Muller on two counter-based uniforms.
pub fn normal(seed: u64, stream: u64, index: u64) -> f64 {
    let base = mix64(seed ^ mix64(stream ^ mix64(index)));
    let u1 = ((mix64(base) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let u2 = ((mix64(base ^ 0xD1B5_4A32_D192_ED03) >> 11) as f64) / (1u64 << 53) as f64;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// The logical multi-index of a linear index in `shape`.
fn unravel(mut index: u64, shape: &[u64]) -> Vec<u64> {
    let mut out = vec![0; shape.len()];
    for (d, &size) in shape.iter().enumerate().rev() {
        let size = size.max(1);
        out[d] = index % size;
        index /= size;
    }
    out
}

/// The value of one element of a parameter, by its index in the unpadded logical shape.
pub fn param_value(p: &PlanParam, seed: u64, unpadded_index: u64) -> f32 {
    match p.init {
        Init::Normal { std } => (std * normal(seed, name_hash(&p.name), unpadded_index)) as f32,
        Init::Zeros => 0.0,
        Init::Ones => 1.0,
    }
}

/// The index in the unpadded `shape` of element `index` of a (padded) `logical` shape of the same rank,
/// or `None` for a padding element.
pub fn unpadded_index(index: u64, logical: &[u64], shape: &[u64]) -> Option<u64> {
    let (mut rest, mut unpadded, mut stride) = (index, 0u64, 1u64);
    for (&size, &real) in logical.iter().zip(shape).rev() {
        let size = size.max(1);
        let at = rest % size;
        rest /= size;
        if at >= real {
            return None;
        }
        unpadded += at * stride;
        stride *= real;
    }
    Some(unpadded)
}

/// This device's block of a logical tensor laid out as `meta` says.
pub fn block_of(logical: &Tensor, meta: &Buffer, coords: Coords, mesh: Mesh) -> Result<Tensor, BlockError> {
    if logical.shape != meta.logical_shape {
        let (name, want, got) = (meta.name.clone(), meta.logical_shape.clone(), logical.shape.clone());
        return Err(BlockError::LogicalShape { name, want, got });
    }
    let indices = logical_indices(meta, coords, mesh);
    let data = match &logical.data {
        Data::F32(v) => Data::F32(indices.iter().map(|&k| v[k as usize]).collect()),
        Data::I32(v) => Data::I32(indices.iter().map(|&k| v[k as usize]).collect()),
    };
    Ok(Tensor { shape: meta.shape.clone(), data })
}

/// Assembles a logical tensor from every device's block (blocks indexed by rank), a local row of the
/// last dimension at a time (one copy where the row's logical coordinates are consecutive).
pub fn gather_blocks(blocks: &[&Tensor], meta: &Buffer, mesh: Mesh) -> Result<Tensor, BlockError> {
    let total = meta.logical_shape.iter().product::<u64>() as usize;
    let mut out = vec![0.0f32; total];
    for (rank, block) in blocks.iter().enumerate() {
        let coords = mesh.coords_of(rank as u64);
        let values = block.f32().map_err(|_| BlockError::Integers)?;
        let map = IndexMap::new(meta, coords, mesh)?;
        let local: usize = map.dimensions().iter().map(Vec::len).product();
        if values.len() != local {
            let got = block.shape.clone();
            return Err(BlockError::LogicalShape { name: meta.name.clone(), want: meta.shape.clone(), got });
        }
        scatter_rows(&map, values, &mut out);
    }
    Ok(Tensor::from_f32(&meta.logical_shape, out))
}

/// Rows of the last dimension of a logical tensor, from every device's block (blocks indexed by
/// rank) without assembling the rest: for each wanted row (its index over every dimension but the
/// last, in the logical shape), its values, padding included. What one wants from a large output of
/// which a few rows matter (the logits of the last position of each sequence).
pub fn gather_rows(blocks: &[&Tensor], meta: &Buffer, mesh: Mesh, wanted: &[u64]) -> Result<Vec<Vec<f32>>, BlockError> {
    let width = meta.logical_shape.last().copied().unwrap_or(1).max(1);
    let mut out = vec![vec![0.0f32; width as usize]; wanted.len()];
    for (rank, block) in blocks.iter().enumerate() {
        let values = block.f32().map_err(|_| BlockError::Integers)?;
        let map = IndexMap::new(meta, mesh.coords_of(rank as u64), mesh)?;
        let local: usize = map.dimensions().iter().map(Vec::len).product();
        let Some((last, stride)) = map.last_dimension().filter(|_| values.len() == local) else {
            let got = block.shape.clone();
            return Err(BlockError::LogicalShape { name: meta.name.clone(), want: meta.shape.clone(), got });
        };
        for (row, chunk) in values.chunks_exact(last.len().max(1)).enumerate() {
            let logical_row = map.row_base(row) / (width * stride).max(1);
            for (k, _) in wanted.iter().enumerate().filter(|&(_, &w)| w == logical_row) {
                for (v, &m) in chunk.iter().zip(last) {
                    out[k][m as usize] = *v;
                }
            }
        }
    }
    Ok(out)
}

/// Writes a device's `values` (local order) to their places in the logical `out`.
fn scatter_rows(map: &IndexMap, values: &[f32], out: &mut [f32]) {
    let Some((last, stride)) = map.last_dimension() else {
        map.for_each(|local, index| out[index as usize] = values[local]);
        return;
    };
    let width = last.len();
    if width == 0 {
        return;
    }
    let consecutive = stride == 1 && last.windows(2).all(|w| w[1] == w[0] + 1);
    for (row, chunk) in values.chunks_exact(width).enumerate() {
        let base = map.row_base(row) as usize;
        if consecutive {
            let start = base + last[0] as usize;
            out[start..start + width].copy_from_slice(chunk);
        } else {
            for (v, &m) in chunk.iter().zip(last) {
                out[base + (m * stride) as usize] = *v;
            }
        }
    }
}

/// Drops the padding of a logical tensor: keeps the leading `shape` corner, a row of the last
/// dimension at a time.
pub fn unpad(t: &Tensor, shape: &[u64]) -> Tensor {
    if t.shape == shape {
        return t.clone();
    }
    let Ok(values) = t.f32() else { return t.clone() };
    let (Some((&width, rows_shape)), Some(&from_width)) = (shape.split_last(), t.shape.last()) else {
        return t.clone();
    };
    let total: u64 = shape.iter().product();
    let mut out = Vec::with_capacity(total as usize);
    let rows: u64 = rows_shape.iter().product();
    for row in 0..rows {
        let at = unravel(row, rows_shape);
        let from_row = at.iter().zip(&t.shape).fold(0u64, |acc, (a, s)| acc * s + a);
        let start = (from_row * from_width) as usize;
        out.extend_from_slice(&values[start..start + width as usize]);
    }
    Tensor::from_f32(shape, out)
}

/// Pads a logical tensor with zeros to a buffer's (padded) logical shape.
pub fn pad_to(t: &Tensor, meta: &Buffer) -> Result<Tensor, BlockError> {
    if t.shape == meta.logical_shape {
        return Ok(t.clone());
    }
    if t.shape.len() != meta.logical_shape.len() || t.shape.iter().zip(&meta.logical_shape).any(|(a, b)| a > b) {
        let (name, shape, logical) = (meta.name.clone(), t.shape.clone(), meta.logical_shape.clone());
        return Err(BlockError::DoesNotFit { name, shape, logical });
    }
    let values = t.f32().map_err(|_| BlockError::Integers)?;
    let total: u64 = meta.logical_shape.iter().product();
    let mut out = vec![0.0f32; total as usize];
    for (k, v) in values.iter().enumerate() {
        let at = unravel(k as u64, &t.shape);
        let index = at.iter().zip(&meta.logical_shape).fold(0u64, |acc, (a, s)| acc * s + a);
        out[index as usize] = *v;
    }
    Ok(Tensor::from_f32(&meta.logical_shape, out))
}
