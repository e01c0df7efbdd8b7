//! Comparing two runs' tensors: how `verify` and the numerics tests decide that a sharded run computes
//! what one device computes.

use optimus_plan::tensor::Tensor;
use std::collections::BTreeMap;

/// The absolute part of each tensor's allowance, as a fraction of the largest magnitude in its set
/// (all the gradients, all the updated values): every difference is measured against the tensor's own
/// largest magnitude plus this share of the set's, as `rtol * (|b| + atol)` tests do. A tensor that is
/// zero in exact arithmetic (attention's key bias; a bias before a norm over the positions, which
/// removes anything the positions share) holds float noise on both sides, of the size of the sums that
/// cancelled in it, not of its own: measured against itself (or 1/1000 of the set's largest, as
/// before), even a pure data-parallel split, which changes only the order of the sums, failed it. The
/// bias before a norm over 4 to 16 positions reached 1.6e-6 to 5e-6 of the set's largest on 2x1x1, 1x2,
/// 2x2 and 2x2x2 (3d) meshes, three seeds; 1/10 allows 1e-5 of it at verify's 1e-4, the float32 `atol`
/// of `torch.testing` for values of unit scale, and changes the measure of a tensor of the set's own
/// scale by a tenth.
pub const ABSOLUTE_FRACTION: f64 = 0.1;

fn max_abs(t: &Tensor) -> f64 {
    t.f32().map_or(0.0, |v| v.iter().fold(0f64, |m, x| m.max(f64::from(x.abs()))))
}

/// max |a - b| / (max |b| + absolute). A NaN or infinity on either side is an infinite difference: it
/// must fail a comparison, never vanish in a maximum.
pub fn relative_difference(a: &Tensor, b: &Tensor, absolute: f64) -> f64 {
    let (Ok(x), Ok(y)) = (a.f32(), b.f32()) else { return f64::INFINITY };
    if x.len() != y.len() || a.shape != b.shape || x.iter().chain(y).any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let diff = x.iter().zip(y).fold(0f64, |m, (p, q)| m.max(f64::from((p - q).abs())));
    let scale = max_abs(b) + absolute;
    if scale == 0.0 { diff } else { diff / scale }
}

/// The difference of every tensor of `reference` from its namesake in `candidate` (infinite if missing),
/// each relative to its own largest magnitude plus [`ABSOLUTE_FRACTION`] of the set's.
pub fn relative_differences(
    candidate: &BTreeMap<String, Tensor>,
    reference: &BTreeMap<String, Tensor>,
) -> Vec<(String, f64)> {
    let set_scale = reference.values().map(max_abs).fold(0f64, f64::max);
    // A non-finite tensor's own difference is infinite; it must not also poison the others' measure.
    let absolute = if set_scale.is_finite() { ABSOLUTE_FRACTION * set_scale } else { 0.0 };
    let mut out: Vec<(String, f64)> = reference
        .iter()
        .map(|(name, r)| {
            (name.clone(), candidate.get(name).map_or(f64::INFINITY, |c| relative_difference(c, r, absolute)))
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
        // b is measured against its own 1.0 plus a tenth of the set's largest finite magnitude (1.0).
        assert!((d["b"] - 0.5 / 1.1).abs() < 1e-12, "{d:?}");
    }

    #[test]
    fn noise_in_a_tensor_that_is_zero_passes_and_an_error_in_a_small_one_does_not() {
        let reference = BTreeMap::from([
            ("large".to_string(), tensor(&[1.0, -0.5])),
            ("zero".to_string(), tensor(&[0.0, 0.0])),
            ("small".to_string(), tensor(&[1e-3, 0.0])),
        ]);
        // Float noise of 2e-6 of the set's largest where exact arithmetic gives zero; the small tensor
        // zeroed (a lost term); the large one off by 1e-5 of itself.
        let candidate = BTreeMap::from([
            ("large".to_string(), tensor(&[1.0 + 1e-5, -0.5])),
            ("zero".to_string(), tensor(&[2e-6, -1e-6])),
            ("small".to_string(), tensor(&[0.0, 0.0])),
        ]);
        let d: BTreeMap<String, f64> = relative_differences(&candidate, &reference).into_iter().collect();
        assert!(d["zero"] < 1e-4, "{d:?}");
        assert!(d["small"] > 50.0 * 1e-4, "{d:?}");
        assert!((d["large"] - 1e-5 / 1.1).abs() < 1e-7, "{d:?}");
    }
}
