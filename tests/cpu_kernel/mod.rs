//! One CPU kernel run on a single device into a fresh f32 output: the reference the kernel-level tests
//! (attention variants, Llama's operators, the flash tiling model) compare against.

use optimus::plan::layout::Layout;
use optimus::plan::tensor::Tensor;
use optimus::plan::types::DType;
use optimus::plan::{Buffer, BufferId, Coords, Kernel, Mesh, Role};
use optimus::runtime::cpu::kernels as cpu;
use optimus::runtime::settings::KernelContext;

/// Runs `kernel` on `inputs` on a 1x1 mesh into a fresh f32 output of `shape`.
pub fn eval(kernel: &Kernel, inputs: &[&Tensor], shape: &[u64]) -> Result<Tensor, String> {
    let meta = Buffer {
        id: BufferId(0),
        name: "out".into(),
        dtype: DType::F32,
        logical_shape: shape.to_vec(),
        layout: Layout::REPLICATED,
        shape: shape.to_vec(),
        role: Role::Workspace,
    };
    let ctx =
        KernelContext { coords: Coords::new(0, 0, 0), mesh: Mesh::new(1, 1), seed: 1, inputs: &[], output: &meta };
    let mut out = Tensor::zeros(DType::F32, shape);
    cpu::run(kernel, inputs, &mut out, &ctx)?;
    Ok(out)
}
