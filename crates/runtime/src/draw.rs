//! Drawing a device's initial parameter blocks from the seed, in parallel on the kernel pool.

use optimus_plan::init::{param_value, unpadded_index};
use optimus_plan::logical::logical_indices;
use optimus_plan::tensor::Tensor;
use optimus_plan::{Buffer, Coords, Mesh, PlanParam};

/// This device's block of a parameter: padding rows and columns are zero. Elements are drawn in
/// parallel on the kernel pool; each depends on its index alone, so the block does not depend on the
/// number of threads.
pub fn param_block(p: &PlanParam, meta: &Buffer, coords: Coords, mesh: Mesh, seed: u64) -> Tensor {
    let indices = logical_indices(meta, coords, mesh);
    let mut values = vec![0.0f32; indices.len()];
    let fill = |start: usize, chunk: &mut [f32]| -> Result<(), ()> {
        for (value, &index) in chunk.iter_mut().zip(&indices[start..]) {
            *value = unpadded_index(index, &meta.logical_shape, &p.shape).map_or(0.0, |k| param_value(p, seed, k));
        }
        Ok(())
    };
    // `fill` never fails.
    let _ = super::cpu::par::on_pool(|| super::cpu::par::chunks(&mut values, fill));
    Tensor::from_f32(&meta.shape, values)
}
