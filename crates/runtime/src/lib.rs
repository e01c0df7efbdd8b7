//! Running plans. A [`Device`] executes the SPMD program on its own buffers and talks to its peers
//! through a [`comm::Communicator`]; backends differ only in where kernels run and how peers talk.
//! The CPU backend (threads in one process) is the reference every other backend is checked against.

pub mod arena;
pub mod backend;
pub mod bf16;
pub mod comm;
pub mod compare;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod draw;
pub mod error;
pub mod exec;
pub mod fault;
pub mod launch;
pub mod limits;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod peak;
pub mod pipeline;
pub mod profile;
pub mod qkv;
pub mod schedule;
pub mod settings;
pub mod startup;
pub mod view;
pub mod watchdog;

pub use exec::{Device, StepError, describe_instruction, in_instruction};
