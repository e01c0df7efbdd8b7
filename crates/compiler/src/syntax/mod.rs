//! The front end: grammar (grammar/optimus.pest), parser and AST.

pub mod ast;
mod expect;
pub mod parser;

pub use parser::parse;
