//! The compiler: `.opt` source --[`syntax::parse`]--> AST --[`elab::elaborate`]--> typed logical graph
//! ([`ir::Model`]) --[`autodiff`]--> training graph --[`shard::compile`]--> a verified
//! [`optimus_plan::Plan`]. Each stage reports [`diag::Diagnostic`]s carrying source spans.

pub mod autodiff;
pub mod decode;
pub mod diag;
pub mod elab;
pub mod front;
pub mod ir;
pub mod shard;
pub mod syntax;
