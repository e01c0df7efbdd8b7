//! Comparing two runs' tensors: how `verify` and the numerics tests decide that a sharded run computes
//! what one device computes.

use optimus_plan::tensor::Tensor;
use std::collections::BTreeMap;

/// Tensors whose largest magnitude is below this fraction of the largest in their set are numerically
/// zero: attention's key bias has an exactly zero gradient (softmax ignores a shift shared by all keys),
/// so what either side computes for it is float noise. Such tensors are measured against this fraction
/// of the set's scale instead of their own.
pub const ZERO_FRACTION: f64 = 1e-3;

fn max_abs(t: &Tensor) -> f64 {
    t.f32().map_or(0.0, |v| v.iter().fold(0f64, |m, x| m.max(f64::from(x.abs()))))
}

/// max |a - b| / scale, with scale = max(max |b|, floor). A NaN or infinity on either side is an
/// infinite difference: it must fail a comparison, never vanish in a maximum.
pub fn relative_difference(a: &Tensor, b: &Tensor, floor: f64) -> f64 {
    let (Ok(x), Ok(y)) = (a.f32(), b.f32()) else { return f64::INFINITY };
    if x.len() != y.len() || a.shape != b.shape || x.iter().chain(y).any(|v| !v.is_finite()) {
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
    // A non-finite tensor's own difference is infinite; it must not also poison the others' floor.
    let floor = if set_scale.is_finite() { ZERO_FRACTION * set_scale } else { 0.0 };
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(values: &[f32]) -> Tensor {
        let mut t = Tensor::zeros(optimus_plan::types::DType::F32, &[values.len() as u64]);
        if let Ok(v) = t.f32_mut() {
            v.copy_from_slice(values);
        }
        t
    }

    #[test]
    fn non_finite_values_on_either_side_fail() {
        let good = tensor(&[1.0, 2.0]);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let broken = tensor(&[1.0, bad]);
            assert_eq!(relative_difference(&broken, &good, 0.0), f64::INFINITY);
            assert_eq!(relative_difference(&good, &broken, 0.0), f64::INFINITY);
            assert_eq!(relative_difference(&broken, &broken, 0.0), f64::INFINITY);
        }
        assert_eq!(relative_difference(&good, &good, 0.0), 0.0);
    }

    #[test]
    fn a_nan_tensor_does_not_hide_the_others() {
        let reference = BTreeMap::from([("a".to_string(), tensor(&[f32::NAN])), ("b".to_string(), tensor(&[1.0]))]);
        let candidate = BTreeMap::from([("a".to_string(), tensor(&[f32::NAN])), ("b".to_string(), tensor(&[1.5]))]);
        let d: BTreeMap<String, f64> = relative_differences(&candidate, &reference).into_iter().collect();
        assert_eq!(d["a"], f64::INFINITY);
        assert!((d["b"] - 0.5).abs() < 1e-12, "{d:?}");
    }
}
