//! What a plan declares before its program: every buffer's shape splits exactly as its layout says,
//! and every parameter, input and padding record agrees with the buffer it names.

use crate::layout::{MAJOR_ORDER, Placement};
use crate::{Buffer, Instr, Kernel, Mesh, Plan, PlanParam};

/// The most bytes one tensor may have: what a Rust allocation can hold.
const MAX_TENSOR_BYTES: u64 = isize::MAX as u64;

/// Checks buffers, parameters, inputs and padding records (buffer ids are known to be valid).
pub(super) fn check_declarations(plan: &Plan, errors: &mut Vec<String>) {
    for b in &plan.buffers {
        if let Err(e) = check_split(b, plan.mesh) {
            errors.push(format!("buffer `{}`: {e}", b.name));
        }
    }
    for p in &plan.params {
        if let Err(e) = check_param(plan, p) {
            errors.push(format!("parameter `{}`: {e}", p.name));
        }
    }
    for input in &plan.inputs {
        let b = plan.buffer(input.buffer);
        if input.shape != b.logical_shape {
            errors.push(format!(
                "input `{}`: shape {:?} does not match its buffer `{}` {:?}",
                input.name, input.shape, b.name, b.logical_shape
            ));
        }
    }
    for output in &plan.outputs {
        let b = plan.buffer(output.buffer);
        let Some(shape) = &output.unpadded else { continue };
        let fits = shape.len() == b.logical_shape.len() && shape.iter().zip(&b.logical_shape).all(|(s, l)| s <= l);
        if !fits {
            errors.push(format!(
                "output `{}`: unpadded shape {:?} does not fit its buffer `{}` {:?}",
                output.name, shape, b.name, b.logical_shape
            ));
        }
    }
    for (k, pad) in plan.padding.iter().enumerate() {
        if let Err(e) = check_padding(plan, k) {
            errors.push(format!("padding record {k} (`{}` dimension {}): {e}", pad.tensor, pad.dim));
        }
    }
    check_optimizer_steps(plan, errors);
}

/// Each optimizer step updates a parameter from the gradient and the two state buffers its record
/// declares (the run creates and checkpoints a parameter's state from that record, so a step reading
/// other buffers would read buffers nothing wrote).
fn check_optimizer_steps(plan: &Plan, errors: &mut Vec<String>) {
    for (index, instr) in plan.program.iter().enumerate() {
        let Instr::Kernel { kernel: Kernel::OptimizerStep, inputs, .. } = instr else { continue };
        let declared = plan.params.iter().find(|p| inputs.first() == Some(&p.buffer));
        let agrees = declared
            .is_some_and(|p| inputs.len() == 4 && p.grad == Some(inputs[1]) && p.state.as_slice() == &inputs[2..]);
        if !agrees {
            let names: Vec<&str> = inputs.iter().map(|&id| plan.buffer(id).name.as_str()).collect();
            let record = declared.map_or("no parameter's buffer".to_string(), |p| {
                let state: Vec<&str> = p.state.iter().map(|&id| plan.buffer(id).name.as_str()).collect();
                let grad = p.grad.map_or("none", |g| plan.buffer(g).name.as_str());
                format!("parameter `{}`, whose record declares gradient `{grad}` and state {state:?}", p.name)
            });
            errors.push(format!(
                "instruction {index} (optimizer step) reads {names:?}: the first is {record}; a step reads \
                 its parameter, gradient and two state buffers"
            ));
        }
    }
}

/// The element count of a shape and its size in bytes, if both fit.
pub fn checked_bytes(shape: &[u64], element_bytes: u64) -> Option<(u64, u64)> {
    let elements = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))?;
    let bytes = elements.checked_mul(element_bytes).filter(|&b| b <= MAX_TENSOR_BYTES)?;
    Some((elements, bytes))
}

/// Each split dimension divides exactly: viewed as [outer, mid, inner], `mid` splits evenly over the
/// mesh axis (the most significant axis first, each within the chunk of the one before; see
/// `MAJOR_ORDER`), as the kernels index it.
fn check_split(b: &Buffer, mesh: Mesh) -> Result<(), String> {
    let mut extents = b.logical_shape.clone();
    for axis in MAJOR_ORDER {
        let Placement::Shard { dim, outer, inner } = b.layout.0[axis] else { continue };
        let parts = mesh.axes()[axis];
        let Some(size) = extents.get_mut(usize::from(dim)) else {
            return Err(format!(
                "layout {} splits dimension {dim} of a rank-{} tensor",
                b.layout,
                b.logical_shape.len()
            ));
        };
        let (outer, inner) = (outer.max(1), inner.max(1));
        let whole = outer.checked_mul(inner).filter(|&f| size.is_multiple_of(f));
        let mid = whole.map(|f| *size / f).filter(|m| m.is_multiple_of(parts));
        let Some(mid) = mid else {
            return Err(format!(
                "dimension {dim} ({size}) viewed as [{outer}, _, {inner}] does not split evenly over {parts} devices"
            ));
        };
        *size = outer * (mid / parts) * inner;
    }
    Ok(())
}

/// A parameter's model shape is its buffer's logical shape, except where a padding record pads it; its
/// gradient and optimizer state are laid out exactly like it.
fn check_param(plan: &Plan, p: &PlanParam) -> Result<(), String> {
    let b = plan.buffer(p.buffer);
    let padded = |d: usize| {
        plan.padding.iter().any(|r| {
            r.tensor == p.name
                && usize::from(r.dim) == d
                && Some(&r.logical) == p.shape.get(d)
                && r.padded == b.logical_shape[d]
        })
    };
    let agrees = p.shape.len() == b.logical_shape.len()
        && p.shape.iter().zip(&b.logical_shape).enumerate().all(|(d, (s, l))| s == l || padded(d));
    if !agrees {
        return Err(format!("shape {:?} does not match its buffer `{}` {:?}", p.shape, b.name, b.logical_shape));
    }
    for other in p.grad.iter().chain(&p.state).map(|&id| plan.buffer(id)) {
        if (&other.logical_shape, other.layout, other.dtype) != (&b.logical_shape, b.layout, b.dtype) {
            return Err(format!(
                "`{}` ({:?} {:?} laid out {}) is not shaped like its buffer `{}` ({:?} {:?} laid out {})",
                other.name, other.dtype, other.logical_shape, other.layout, b.name, b.dtype, b.logical_shape, b.layout
            ));
        }
    }
    Ok(())
}

/// A padding record names a parameter's dimension, from its model size up to its buffer's size.
fn check_padding(plan: &Plan, k: usize) -> Result<(), String> {
    let pad = &plan.padding[k];
    let param = plan.params.iter().find(|p| p.name == pad.tensor).ok_or("no parameter has that name")?;
    let b = plan.buffer(param.buffer);
    let d = usize::from(pad.dim);
    let (Some(&model), Some(&buffer)) = (param.shape.get(d), b.logical_shape.get(d)) else {
        return Err(format!("the parameter has no dimension {d}"));
    };
    if (pad.logical, pad.padded) != (model, buffer) || pad.logical > pad.padded {
        return Err(format!(
            "pads {} to {}, but the parameter is {model} and its buffer `{}` {buffer} there",
            pad.logical, pad.padded, b.name
        ));
    }
    Ok(())
}
