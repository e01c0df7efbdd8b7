//! bf16 storage on the host: conversions between f32 and bf16 bit patterns (round to nearest, ties
//! to even; NaN stays a quiet NaN, infinities stay infinite, values past the bf16 range round to
//! infinity), and the widening that lets f32 kernels run on bf16 buffers: bf16 inputs are widened to
//! f32 scratch copies, the kernel computes in f32, and its f32 result is rounded once into the bf16
//! output. Collectives on bf16 buffers exchange the widened f32 values in the same way.

use super::tensor::Tensor;
use super::view::{View, ViewData, ViewMut, ViewMutData};
use half::bf16;

/// The bf16 nearest to `x` (ties to even), as its bits.
pub fn round(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// The f32 value of a bf16 bit pattern (exact).
pub fn widen_one(bits: u16) -> f32 {
    bf16::from_bits(bits).to_f32()
}

/// Every element widened to f32.
pub fn widen(bits: &[u16]) -> Vec<f32> {
    bits.iter().map(|&b| widen_one(b)).collect()
}

/// Rounds `values` into `bits` element by element (equal lengths).
pub fn round_into(values: &[f32], bits: &mut [u16]) {
    for (b, &x) in bits.iter_mut().zip(values) {
        *b = round(x);
    }
}

/// An f32 copy of a bf16 view, or `None` for a view that needs no widening.
pub fn widened(view: &View) -> Option<Tensor> {
    match view.data {
        ViewData::Bf16(bits) => Some(Tensor::from_f32(view.shape.as_slice(), widen(bits))),
        _ => None,
    }
}

/// An f32 scratch for a bf16 output (holding its widened contents when `keep` is set, for kernels
/// that accumulate into their output), or `None` for an output that needs none.
pub fn scratch_for(out: &ViewMut, keep: bool) -> Option<Tensor> {
    match &out.data {
        ViewMutData::Bf16(bits) => {
            let values = if keep { widen(bits) } else { vec![0.0; bits.len()] };
            Some(Tensor::from_f32(out.shape.as_slice(), values))
        }
        _ => None,
    }
}

/// Rounds an f32 scratch into the bf16 output it stands for.
pub fn store(scratch: &Tensor, out: &mut ViewMut) -> Result<(), String> {
    let values = scratch.f32()?;
    match &mut out.data {
        ViewMutData::Bf16(bits) if bits.len() == values.len() => {
            round_into(values, bits);
            Ok(())
        }
        _ => Err("a bf16 scratch does not match its output".into()),
    }
}

/// Runs `f` (an f32 kernel) on `inputs` and `out`, widening bf16 operands to f32 and rounding a bf16
/// result once at the end. Operands without bf16 go straight through.
pub fn with_widened<R>(
    inputs: &[&View],
    out: &mut ViewMut,
    out_is_read: bool,
    f: impl FnOnce(&[&View], &mut ViewMut) -> Result<R, String>,
) -> Result<R, String> {
    let wide: Vec<Option<Tensor>> = inputs.iter().map(|v| widened(v)).collect();
    let views: Vec<View> = inputs.iter().zip(&wide).map(|(v, w)| w.as_ref().map_or(**v, Tensor::view)).collect();
    let refs: Vec<&View> = views.iter().collect();
    match scratch_for(out, out_is_read) {
        Some(mut scratch) => {
            let result = f(&refs, &mut scratch.view_mut())?;
            store(&scratch, out)?;
            Ok(result)
        }
        None => f(&refs, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_to_nearest_with_ties_to_even() {
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
        assert_eq!(widen_one(round(1.0 + 2f32.powi(-8))), 1.0);
        // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: ties go to 1 + 2^-6.
        assert_eq!(widen_one(round(1.0 + 3.0 * 2f32.powi(-8))), 1.0 + 2f32.powi(-6));
        // Just above a tie rounds up, just below rounds down.
        assert_eq!(widen_one(round(1.0 + 2f32.powi(-8) + 2f32.powi(-20))), 1.0 + 2f32.powi(-7));
        assert_eq!(widen_one(round(1.0 + 2f32.powi(-8) - 2f32.powi(-20))), 1.0);
        assert_eq!(widen_one(round(-1.0 - 3.0 * 2f32.powi(-8))), -1.0 - 2f32.powi(-6));
    }

    #[test]
    fn special_values_survive_and_overflow_goes_to_infinity() {
        assert!(widen_one(round(f32::NAN)).is_nan());
        assert_eq!(widen_one(round(f32::INFINITY)), f32::INFINITY);
        assert_eq!(widen_one(round(f32::NEG_INFINITY)), f32::NEG_INFINITY);
        assert_eq!(widen_one(round(f32::MAX)), f32::INFINITY);
        assert_eq!(widen_one(round(-0.0)).to_bits(), (-0.0f32).to_bits());
        // bf16 keeps f32's exponent range: a tiny normal f32 stays non-zero.
        assert!(widen_one(round(1e-38)) > 0.0);
    }

    #[test]
    fn widening_is_exact() {
        for bits in [0u16, 1, 0x3f80, 0x7f7f, 0x8001, 0xc2f7] {
            assert_eq!(round(widen_one(bits)), bits);
        }
    }
}
