//! The angles of rotary position embeddings, as Hugging Face Llama computes them (in float32).
//!
//! `LlamaRotaryEmbedding` builds `inv_freq = 1 / theta ** (arange(0, d, 2).float() / d)` and
//! `freqs = position.float() * inv_freq` in float32, then takes cos and sin of those float32 angles.
//! Rounding each step to float32 the same way matters: at position 4000 one float32 ulp of the angle
//! is 2.4e-4, far more than the 1e-6 a model must agree to. Each step here is computed exactly (in
//! f64) and rounded to f32 once, so it is the correctly rounded float32 result; the CUDA kernel does
//! the same in double precision.

/// The inverse frequency of pair i of a head of size d: 1 / theta^(2i / d), rounded as float32.
pub fn inv_freq(theta: f64, d: usize, i: usize) -> f32 {
    let exponent = (2 * i) as f32 / d as f32;
    let power = (theta as f32 as f64).powf(f64::from(exponent)) as f32;
    1.0 / power
}

/// cos and sin of the float32 angle `position * inv_freq` of each of the d / 2 pairs of a head at
/// `position`, appended to `cos` and `sin`.
pub fn angles_at(position: usize, inv_freqs: &[f32], cos: &mut Vec<f32>, sin: &mut Vec<f32>) {
    for &f in inv_freqs {
        let angle = f64::from(position as f32 * f);
        cos.push(angle.cos() as f32);
        sin.push(angle.sin() as f32);
    }
}

/// cos and sin tables [seq, d / 2] for positions 0..seq.
pub struct Table {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl Table {
    pub fn new(seq: usize, d: usize, theta: f64) -> Result<Table, String> {
        let half = d / 2;
        let inv: Vec<f32> = (0..half).map(|i| inv_freq(theta, d, i)).collect();
        let n = seq.checked_mul(half).ok_or("the rotary table is too large")?;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        cos.try_reserve_exact(n).map_err(|_| "cannot allocate the rotary table")?;
        sin.try_reserve_exact(n).map_err(|_| "cannot allocate the rotary table")?;
        for position in 0..seq {
            angles_at(position, &inv, &mut cos, &mut sin);
        }
        Ok(Table { half, cos, sin })
    }

    /// (cos, sin) of the pairs at `position`.
    pub fn at(&self, position: usize) -> (&[f32], &[f32]) {
        let range = position * self.half..(position + 1) * self.half;
        (&self.cos[range.clone()], &self.sin[range])
    }
}

/// The head size of x [.., seq, heads * d] for rotary: d must be a positive even number.
pub fn head_size(width: usize, heads: u64) -> Result<usize, String> {
    let heads = usize::try_from(heads).map_err(|_| format!("{heads} heads is too many"))?;
    if heads == 0 || !width.is_multiple_of(heads) {
        return Err(format!("{heads} heads do not divide the width {width}"));
    }
    let d = width / heads;
    if d == 0 || !d.is_multiple_of(2) {
        return Err(format!("rotary needs an even head size, but {width} / {heads} heads is {d}"));
    }
    Ok(d)
}
