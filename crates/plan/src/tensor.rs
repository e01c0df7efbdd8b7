//! Host tensors: the contents of one plan buffer on one device.

use crate::types::DType;

/// Why a tensor's elements cannot be read as asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorError {
    /// The tensor holds elements of type `found`; the caller asked for `want`.
    ElementType { want: DType, found: DType },
}

impl std::fmt::Display for TensorError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let TensorError::ElementType { want, found } = *self;
        match (want.is_integer(), found.is_integer()) {
            (false, true) => f.write_str("expected a floating-point tensor, found integers"),
            (true, false) => f.write_str("expected an integer tensor, found floating point"),
            _ => write!(f, "expected {} elements, found {}", want.name(), found.name()),
        }
    }
}

impl std::error::Error for TensorError {}

/// For callers whose errors are still messages: the same text.
impl From<TensorError> for String {
    fn from(e: TensorError) -> String {
        e.to_string()
    }
}

/// Element storage. Floating-point buffers are f32 on the CPU; integer buffers (token ids) are i32.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

/// A dense row-major tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<u64>,
    pub data: Data,
}

impl Tensor {
    /// A zero-filled tensor of the given element type and shape.
    pub fn zeros(dtype: DType, shape: &[u64]) -> Tensor {
        let n = shape.iter().product::<u64>() as usize;
        let data = if dtype.is_integer() { Data::I32(vec![0; n]) } else { Data::F32(vec![0.0; n]) };
        Tensor { shape: shape.to_vec(), data }
    }

    pub fn from_f32(shape: &[u64], values: Vec<f32>) -> Tensor {
        Tensor { shape: shape.to_vec(), data: Data::F32(values) }
    }

    pub fn from_i32(shape: &[u64], values: Vec<i32>) -> Tensor {
        Tensor { shape: shape.to_vec(), data: Data::I32(values) }
    }

    pub fn len(&self) -> usize {
        match &self.data {
            Data::F32(v) => v.len(),
            Data::I32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The f32 elements, or an error naming what was found instead.
    pub fn f32(&self) -> Result<&[f32], TensorError> {
        match &self.data {
            Data::F32(v) => Ok(v),
            Data::I32(_) => Err(TensorError::ElementType { want: DType::F32, found: DType::I32 }),
        }
    }

    pub fn f32_mut(&mut self) -> Result<&mut [f32], TensorError> {
        match &mut self.data {
            Data::F32(v) => Ok(v),
            Data::I32(_) => Err(TensorError::ElementType { want: DType::F32, found: DType::I32 }),
        }
    }

    pub fn i32(&self) -> Result<&[i32], TensorError> {
        match &self.data {
            Data::I32(v) => Ok(v),
            Data::F32(_) => Err(TensorError::ElementType { want: DType::I32, found: DType::F32 }),
        }
    }

    pub fn i32_mut(&mut self) -> Result<&mut [i32], TensorError> {
        match &mut self.data {
            Data::I32(v) => Ok(v),
            Data::F32(_) => Err(TensorError::ElementType { want: DType::I32, found: DType::F32 }),
        }
    }
}
