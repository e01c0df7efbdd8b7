//! An attention's operands as a backend holds them, with their layout (the arithmetic is the plan's
//! [`AttentionLayout`]); each backend adds its own accessors.

use crate::error::KernelError;
use optimus_plan::shapes::{AttentionLayout, ShapeError};

/// An attention's operands as one backend holds them (`T` is its f32 storage), with their layout.
pub struct Qkv<'a, T: ?Sized> {
    pub data: [&'a T; 3],
    /// Shape of each operand (all the fused tensor's when fused).
    pub shapes: [&'a [u64]; 3],
    pub layout: AttentionLayout,
}

impl<T: ?Sized> std::ops::Deref for Qkv<'_, T> {
    type Target = AttentionLayout;

    fn deref(&self) -> &AttentionLayout {
        &self.layout
    }
}

impl<'a, T: ?Sized> Qkv<'a, T> {
    /// Checks the operands (one fused tensor, or q, k, v) and reaches their data with `data_of`.
    pub fn new<X>(
        operands: &[&'a X],
        shape_of: impl Fn(&'a X) -> &'a [u64],
        data_of: impl Fn(&'a X, &str) -> Result<&'a T, KernelError>,
        (heads, kv_heads): (u64, u64),
        fused: bool,
    ) -> Result<Qkv<'a, T>, KernelError> {
        let shapes: Vec<&'a [u64]> = operands.iter().map(|&t| shape_of(t)).collect();
        let layout = AttentionLayout::new(&shapes, heads, kv_heads, fused)?;
        let (data, shapes) = match operands {
            [qkv] => ([data_of(qkv, "the fused input")?; 3], [shapes[0]; 3]),
            [q, k, v] => ([data_of(q, "q")?, data_of(k, "k")?, data_of(v, "v")?], [shapes[0], shapes[1], shapes[2]]),
            _ => return Err(ShapeError::Operands { want: 3, got: operands.len() }.into()),
        };
        Ok(Qkv { data, shapes, layout })
    }
}
