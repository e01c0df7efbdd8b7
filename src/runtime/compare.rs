//! Comparing two runs' tensors: how `verify` and the numerics tests decide that a sharded run computes
//! what one device computes.

use super::tensor::Tensor;
use std::collections::BTreeMap;

/// Tensors whose largest magnitude is below this fraction of the largest in their set are numerically
/// zero: attention's key bias has an exactly zero gradient (softmax ignores a shift shared by all keys),
/// so what either side computes for it is float noise. Such tensors are measured against this fraction
/// of the set's scale instead of their own.
pub const ZERO_FRACTION: f64 = 1e-3;

fn max_abs(t: &Tensor) -> f64 {
    t.f32().map_or(0.0, |v| v.iter().fold(0f64, |m, x| m.max(f64::from(x.abs()))))
}

/// max |a - b| / scale, with scale = max(max |b|, floor).
pub fn relative_difference(a: &Tensor, b: &Tensor, floor: f64) -> f64 {
    let (Ok(x), Ok(y)) = (a.f32(), b.f32()) else { return f64::INFINITY };
    if x.len() != y.len() || a.shape != b.shape {
        return f64::INFINITY;
    }
    let diff = x.iter().zip(y).fold(0f64, |m, (p, q)| m.max(f64::from((p - q).abs())));
    let scale = max_abs(b).max(floor);
    if scale == 0.0 { diff } else { diff / scale }
}

/// The difference of every tensor of `reference` from its namesake in `candidate` (infinite if missing),
/// each relative to its own scale or, for numerically zero tensors, to [`ZERO_FRACTION`] of the set's.
pub fn relative_differences(
    candidate: &BTreeMap<String, Tensor>,
    reference: &BTreeMap<String, Tensor>,
) -> Vec<(String, f64)> {
    let set_scale = reference.values().map(max_abs).fold(0f64, f64::max);
    let floor = ZERO_FRACTION * set_scale;
    let mut out: Vec<(String, f64)> = reference
        .iter()
        .map(|(name, r)| {
            (name.clone(), candidate.get(name).map_or(f64::INFINITY, |c| relative_difference(c, r, floor)))
        })
        .collect();
    for name in candidate.keys().filter(|n| !reference.contains_key(*n)) {
        out.push((name.clone(), f64::INFINITY));
    }
    out
}
