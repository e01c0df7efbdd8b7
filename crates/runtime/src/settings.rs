//! What the executor hands every backend: where a kernel runs (`KernelContext`) and how parameters are
//! updated (`OptimizerSettings`). Backend-neutral, so no backend imports another to run.

use optimus_plan::{Buffer, Coords, Mesh};

/// What a kernel may need to know about where it runs.
#[derive(Clone, Copy, Debug)]
pub struct KernelContext<'a> {
    /// This device's mesh coordinates.
    pub coords: Coords,
    pub mesh: Mesh,
    /// The run's seed, for dropout masks.
    pub seed: u64,
    /// Metadata of each input buffer (shape, logical shape, layout).
    pub inputs: &'a [&'a Buffer],
    /// Metadata of the output buffer.
    pub output: &'a Buffer,
}

/// Which optimizer [`optimizer_step`] applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    Sgd,
    AdamW,
}

/// Hyper-parameters of the optimizer, as in `torch.optim.SGD` / `torch.optim.AdamW`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimizerSettings {
    pub kind: OptimizerKind,
    pub lr: f32,
    pub weight_decay: f32,
    /// SGD only.
    pub momentum: f32,
    /// AdamW only.
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
}
