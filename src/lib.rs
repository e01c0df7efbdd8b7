//! optimus: a declarative sharding compiler for transformers, and the runtimes that run its plans.
//!
//! The workspace's crates, from the ground floor up (none depends on one above it):
//! [`plan`] (the plan, layouts, shapes, verifier, host tensors), [`compiler`] (source to plan),
//! [`runtime`] (executor, backends, communicators), [`io`] (checkpoints, data, weights, plans),
//! [`cost`] (simulator, planner, calibration fits). This crate joins them for `optimusc`.

pub mod calibrate;

pub use optimus_compiler as compiler;
pub use optimus_compiler::{autodiff, decode, diag, elab, front, ir, shard, syntax};
pub use optimus_cost as cost;
pub use optimus_io as io;
pub use optimus_plan as plan;
pub use optimus_plan::span;
pub use optimus_runtime as runtime;
pub use optimus_text as text;
