//! optimus: a declarative sharding compiler for transformers.
//!
//! Pipeline: `.opt` source --[`syntax::parse`]--> AST --[`elab::elaborate`]--> typed logical
//! graph ([`ir::Model`]). Each stage reports [`diag::Diagnostic`]s carrying source spans.

pub mod autodiff;
pub mod check;
pub mod cost;
pub mod diag;
pub mod elab;
pub mod io;
pub mod ir;
pub mod plan;
pub mod runtime;
pub mod shard;
pub mod span;
pub mod syntax;
