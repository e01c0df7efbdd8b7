//! Where a run's start-up time goes: with `OPTIMUS_TRACE_STARTUP=1`, each stage prints on standard error
//! the seconds since the process started (its first call), so that the time to the first step can be
//! split between compiling the plan, drawing the initial weights, opening the backend (CUDA context,
//! kernels, cuBLAS) and writing the parameters.

use std::sync::OnceLock;
use std::time::Instant;

static START: OnceLock<Instant> = OnceLock::new();

/// Notes that the stage `what` is done (the first call starts the clock).
pub fn mark(what: &str) {
    let start = *START.get_or_init(Instant::now);
    if std::env::var("OPTIMUS_TRACE_STARTUP").is_ok_and(|v| v == "1") {
        optimus_plan::text::write_stderr(&format!("startup: {what} at {:.2} s\n", start.elapsed().as_secs_f64()));
    }
}
