//! The angles of rotary position embeddings, as Hugging Face Llama computes them (in float32).
//!
//! `LlamaRotaryEmbedding` builds `inv_freq = 1 / theta ** (arange(0, d, 2).float() / d)` and
//! `freqs = position.float() * inv_freq` in float32, then takes cos and sin of those float32 angles.
//! Rounding each step to float32 the same way matters: at position 4000 one float32 ulp of the angle
//! is 2.4e-4, far more than the 1e-6 a model must agree to. Each step here is computed exactly (in
//! f64) and rounded to f32 once, so it is the correctly rounded float32 result; the CUDA kernel does
//! the same in double precision.

/// Why rotary position embeddings cannot run on a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RotaryError {
    /// More heads than this machine can count.
    TooManyHeads(u64),
    /// A head count that does not divide the width.
    Heads { heads: usize, width: usize },
    /// A head size that is zero or odd (rotary turns pairs).
    OddHeadSize { width: usize, heads: usize, d: usize },
    /// A table of more elements than this machine can count.
    TableTooLarge,
    /// A table whose memory the allocator refused.
    TableAllocation,
}

impl std::fmt::Display for RotaryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            RotaryError::TooManyHeads(heads) => write!(f, "{heads} heads is too many"),
            RotaryError::Heads { heads, width } => write!(f, "{heads} heads do not divide the width {width}"),
            RotaryError::OddHeadSize { width, heads, d } => {
                write!(f, "rotary needs an even head size, but {width} / {heads} heads is {d}")
            }
            RotaryError::TableTooLarge => f.write_str("the rotary table is too large"),
            RotaryError::TableAllocation => f.write_str("cannot allocate the rotary table"),
        }
    }
}

impl std::error::Error for RotaryError {}

/// For callers whose errors are still messages (the verifier): the same text.
impl From<RotaryError> for String {
    fn from(e: RotaryError) -> String {
        e.to_string()
    }
}

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
    pub fn new(seq: usize, d: usize, theta: f64) -> Result<Table, RotaryError> {
        Table::from_position(0, seq, d, theta)
    }

    /// The table of positions start..start + seq (a decoding step's): row r holds position start + r.
    pub fn from_position(start: usize, seq: usize, d: usize, theta: f64) -> Result<Table, RotaryError> {
        let half = d / 2;
        let inv: Vec<f32> = (0..half).map(|i| inv_freq(theta, d, i)).collect();
        let n = seq.checked_mul(half).ok_or(RotaryError::TableTooLarge)?;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        cos.try_reserve_exact(n).map_err(|_| RotaryError::TableAllocation)?;
        sin.try_reserve_exact(n).map_err(|_| RotaryError::TableAllocation)?;
        for position in start..start.checked_add(seq).ok_or(RotaryError::TableTooLarge)? {
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
pub fn head_size(width: usize, heads: u64) -> Result<usize, RotaryError> {
    let heads = usize::try_from(heads).map_err(|_| RotaryError::TooManyHeads(heads))?;
    if heads == 0 || !width.is_multiple_of(heads) {
        return Err(RotaryError::Heads { heads, width });
    }
    let d = width / heads;
    if d == 0 || !d.is_multiple_of(2) {
        return Err(RotaryError::OddHeadSize { width, heads, d });
    }
    Ok(d)
}
