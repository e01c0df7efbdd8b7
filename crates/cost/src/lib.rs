//! The simulator's cost model: hardware profiles, collective times, rank placement, the step-time
//! model over a plan, and the searches (largest batch, scaling sweeps) built on it.

pub mod calibration;
pub mod collective;
pub mod flows;
pub mod hardware;
pub mod pipeline;
pub mod planner;
pub mod plot;
pub mod search;
pub mod staged;
pub mod step;

pub use collective::{Algorithm, collective_time};
pub use hardware::{Hardware, Link};
pub use optimus_plan::placement::{LinkKind, NodeMap, RankPlacement};
pub use step::{Options, Simulation, simulate};
