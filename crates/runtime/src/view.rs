//! Borrowed tensors: a buffer's shape and a slice of its elements in some storage (the host arena,
//! or a host [`Tensor`]). Kernels read [`View`]s and write one [`ViewMut`]; the accessors are named as
//! on [`Tensor`], so a kernel reads the same either way.

use crate::error::ElementError;
use optimus_plan::tensor::{Data, Tensor};
use optimus_plan::types::DType;

/// A view's shape, borrowed: reads like the `Vec<u64>` of a [`Tensor`] (`&view.shape` is a
/// `&[u64]`), so kernels written against tensors read the same against views.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Shape<'a>(pub &'a [u64]);

impl<'a> Shape<'a> {
    pub fn as_slice(&self) -> &'a [u64] {
        self.0
    }
}

impl std::ops::Deref for Shape<'_> {
    type Target = [u64];

    fn deref(&self) -> &[u64] {
        self.0
    }
}

impl std::fmt::Debug for Shape<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Elements of a read-only view.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ViewData<'a> {
    F32(&'a [f32]),
    I32(&'a [i32]),
    /// bf16 elements as their bit patterns (see [`super::bf16`]); kernels read them widened to f32.
    Bf16(&'a [u16]),
}

/// Elements of a writable view.
#[derive(Debug, PartialEq)]
pub enum ViewMutData<'a> {
    F32(&'a mut [f32]),
    I32(&'a mut [i32]),
    Bf16(&'a mut [u16]),
}

/// A read-only dense row-major tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct View<'a> {
    pub shape: Shape<'a>,
    pub data: ViewData<'a>,
}

/// A writable dense row-major tensor.
#[derive(Debug, PartialEq)]
pub struct ViewMut<'a> {
    pub shape: Shape<'a>,
    pub data: ViewMutData<'a>,
}

/// f32 asked of a view of integers.
const EXPECTED_FLOATS: ElementError = ElementError::Type { want: DType::F32, found: DType::I32 };

/// i32 asked of a view of floating-point elements (f32 or bf16).
fn expected_integers(found: DType) -> ElementError {
    ElementError::Type { want: DType::I32, found }
}

impl<'a> View<'a> {
    pub fn len(&self) -> usize {
        match self.data {
            ViewData::F32(v) => v.len(),
            ViewData::I32(v) => v.len(),
            ViewData::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The f32 elements, or an error naming what was found instead.
    pub fn f32(&self) -> Result<&'a [f32], ElementError> {
        match self.data {
            ViewData::F32(v) => Ok(v),
            ViewData::I32(_) => Err(EXPECTED_FLOATS),
            ViewData::Bf16(_) => Err(ElementError::Unwidened),
        }
    }

    pub fn i32(&self) -> Result<&'a [i32], ElementError> {
        match self.data {
            ViewData::I32(v) => Ok(v),
            ViewData::F32(_) => Err(expected_integers(DType::F32)),
            ViewData::Bf16(_) => Err(expected_integers(DType::Bf16)),
        }
    }

    /// A host copy (for the edges of a run: outputs, checkpoints); bf16 elements come back as f32.
    pub fn to_tensor(&self) -> Tensor {
        let data = match self.data {
            ViewData::F32(v) => Data::F32(v.to_vec()),
            ViewData::I32(v) => Data::I32(v.to_vec()),
            ViewData::Bf16(v) => Data::F32(super::bf16::widen(v)),
        };
        Tensor { shape: self.shape.0.to_vec(), data }
    }

    /// What [`View::to_tensor`] gives, written into `into`'s allocation where its element type matches.
    pub fn copy_into(&self, into: &mut Tensor) {
        fn refill<T: Copy>(vec: &mut Vec<T>, values: &[T]) {
            vec.clear();
            vec.extend_from_slice(values);
        }
        match (self.data, &mut into.data) {
            (ViewData::F32(v), Data::F32(out)) => refill(out, v),
            (ViewData::I32(v), Data::I32(out)) => refill(out, v),
            (ViewData::Bf16(v), Data::F32(out)) => {
                out.clear();
                out.extend(v.iter().map(|&b| super::bf16::widen_one(b)));
            }
            _ => {
                *into = self.to_tensor();
                return;
            }
        }
        into.shape.clear();
        into.shape.extend_from_slice(self.shape.0);
    }
}

impl ViewMut<'_> {
    /// A read-only view of the same elements.
    pub fn as_view(&self) -> View<'_> {
        let data = match &self.data {
            ViewMutData::F32(v) => ViewData::F32(v),
            ViewMutData::I32(v) => ViewData::I32(v),
            ViewMutData::Bf16(v) => ViewData::Bf16(v),
        };
        View { shape: self.shape, data }
    }

    pub fn len(&self) -> usize {
        match &self.data {
            ViewMutData::F32(v) => v.len(),
            ViewMutData::I32(v) => v.len(),
            ViewMutData::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn f32(&self) -> Result<&[f32], ElementError> {
        match &self.data {
            ViewMutData::F32(v) => Ok(v),
            ViewMutData::I32(_) => Err(EXPECTED_FLOATS),
            ViewMutData::Bf16(_) => Err(ElementError::Unwidened),
        }
    }

    pub fn f32_mut(&mut self) -> Result<&mut [f32], ElementError> {
        match &mut self.data {
            ViewMutData::F32(v) => Ok(v),
            ViewMutData::I32(_) => Err(EXPECTED_FLOATS),
            ViewMutData::Bf16(_) => Err(ElementError::Unwidened),
        }
    }

    pub fn i32(&self) -> Result<&[i32], ElementError> {
        match &self.data {
            ViewMutData::I32(v) => Ok(v),
            ViewMutData::F32(_) => Err(expected_integers(DType::F32)),
            ViewMutData::Bf16(_) => Err(expected_integers(DType::Bf16)),
        }
    }

    pub fn i32_mut(&mut self) -> Result<&mut [i32], ElementError> {
        match &mut self.data {
            ViewMutData::I32(v) => Ok(v),
            ViewMutData::F32(_) => Err(expected_integers(DType::F32)),
            ViewMutData::Bf16(_) => Err(expected_integers(DType::Bf16)),
        }
    }
}

/// A host tensor seen as a view of a kernel's operand.
pub trait TensorViews {
    /// This tensor as a read-only view.
    fn view(&self) -> View<'_>;
    /// This tensor as a writable view (its shape stays).
    fn view_mut(&mut self) -> ViewMut<'_>;
}

impl TensorViews for Tensor {
    fn view(&self) -> View<'_> {
        let data = match &self.data {
            Data::F32(v) => ViewData::F32(v),
            Data::I32(v) => ViewData::I32(v),
        };
        View { shape: Shape(&self.shape), data }
    }

    fn view_mut(&mut self) -> ViewMut<'_> {
        let data = match &mut self.data {
            Data::F32(v) => ViewMutData::F32(v),
            Data::I32(v) => ViewMutData::I32(v),
        };
        ViewMut { shape: Shape(&self.shape), data }
    }
}
