//! Host tensors: the contents of one plan buffer on one device.

use crate::types::DType;

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
    pub fn f32(&self) -> Result<&[f32], String> {
        match &self.data {
            Data::F32(v) => Ok(v),
            Data::I32(_) => Err("expected a floating-point tensor, found integers".into()),
        }
    }

    pub fn f32_mut(&mut self) -> Result<&mut [f32], String> {
        match &mut self.data {
            Data::F32(v) => Ok(v),
            Data::I32(_) => Err("expected a floating-point tensor, found integers".into()),
        }
    }

    pub fn i32(&self) -> Result<&[i32], String> {
        match &self.data {
            Data::I32(v) => Ok(v),
            Data::F32(_) => Err("expected an integer tensor, found floating point".into()),
        }
    }

    pub fn i32_mut(&mut self) -> Result<&mut [i32], String> {
        match &mut self.data {
            Data::I32(v) => Ok(v),
            Data::F32(_) => Err("expected an integer tensor, found floating point".into()),
        }
    }
}
