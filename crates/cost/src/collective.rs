//! Collective times by the alpha-beta model: a message of n bytes over a link costs
//! alpha + n * beta (alpha the latency, beta = 1 / bandwidth).
//!
//! For a group of p members and a payload of n bytes per member (as `inspect` reports it: the buffer
//! broadcast or reduced; the gathered buffer of an all-gather; the unscattered buffer of a
//! reduce-scatter):
//!
//! | collective     | ring (bandwidth-optimal)            | tree (binomial, latency-optimal)     |
//! |----------------|-------------------------------------|--------------------------------------|
//! | all-reduce     | 2(p-1) alpha + 2(p-1)/p n beta      | 2 ceil(log2 p) (alpha + n beta)      |
//! | all-gather     | (p-1) alpha + (p-1)/p n beta        | ceil(log2 p) alpha + (p-1)/p n beta  |
//! | reduce-scatter | (p-1) alpha + (p-1)/p n beta        | ceil(log2 p) alpha + (p-1)/p n beta  |
//! | broadcast      | (p-1) alpha + n beta (pipelined)    | ceil(log2 p) (alpha + n beta)        |
//! | reduce         | (p-1) alpha + n beta (pipelined)    | ceil(log2 p) (alpha + n beta)        |
//!
//! The tree all-gather and reduce-scatter are recursive doubling and halving. `auto` takes the faster.

use super::hardware::Link;
use optimus_plan::CollectiveKind;
use serde::{Deserialize, Serialize};

/// Which algorithm collectives use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    Ring,
    Tree,
    /// The faster of ring and tree for each collective.
    #[default]
    Auto,
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::Auto => "auto",
        }
    }
}

/// Seconds for one collective over `p` members with `bytes` of payload per member.
pub fn collective_time(kind: CollectiveKind, p: u64, bytes: f64, link: Link, algorithm: Algorithm) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    match algorithm {
        Algorithm::Ring => ring_time(kind, p, bytes, link),
        Algorithm::Tree => tree_time(kind, p, bytes, link),
        Algorithm::Auto => ring_time(kind, p, bytes, link).min(tree_time(kind, p, bytes, link)),
    }
}

/// The ring algorithm's time.
pub fn ring_time(kind: CollectiveKind, p: u64, bytes: f64, link: Link) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let (alpha, beta) = (link.latency, 1.0 / link.bandwidth);
    let steps = (p - 1) as f64;
    let fraction = steps / p as f64;
    match kind {
        CollectiveKind::AllReduce => 2.0 * steps * alpha + 2.0 * fraction * bytes * beta,
        CollectiveKind::AllGather | CollectiveKind::ReduceScatter => steps * alpha + fraction * bytes * beta,
        // A transpose's pair exchanges its blocks at once, both ways: one step.
        CollectiveKind::Broadcast | CollectiveKind::Reduce | CollectiveKind::Transpose => steps * alpha + bytes * beta,
    }
}

/// The binomial-tree (recursive doubling / halving) algorithm's time.
pub fn tree_time(kind: CollectiveKind, p: u64, bytes: f64, link: Link) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let (alpha, beta) = (link.latency, 1.0 / link.bandwidth);
    let rounds = ceil_log2(p) as f64;
    let fraction = (p - 1) as f64 / p as f64;
    match kind {
        CollectiveKind::AllReduce => 2.0 * rounds * (alpha + bytes * beta),
        CollectiveKind::AllGather | CollectiveKind::ReduceScatter => rounds * alpha + fraction * bytes * beta,
        CollectiveKind::Broadcast | CollectiveKind::Reduce | CollectiveKind::Transpose => {
            rounds * (alpha + bytes * beta)
        }
    }
}

/// ceil(log2 p) for p >= 1.
pub fn ceil_log2(p: u64) -> u32 {
    if p <= 1 { 0 } else { 64 - (p - 1).leading_zeros() }
}
