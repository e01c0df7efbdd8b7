//! `inspect --memory SIZE`: the largest batch whose plan fits a device's memory, found by recompiling the
//! plan's model with the plan's target at other batch sizes.

use optimus::cost::search::{self, MaxBatch, Source};
use optimus::plan::{MemoryOptions, Plan};
use optimus::shard::Target;
use serde::Serialize;

/// The answer, with what it was asked for.
#[derive(Clone, Debug, Serialize)]
pub struct Fit {
    pub memory_bytes: u64,
    #[serde(flatten)]
    pub found: MaxBatch,
    /// The plan's own batch, and whether it fits.
    pub plan_batch: Option<u64>,
    pub plan_fits: bool,
}

/// Recompiles the plan's model (its `source` file, with the config values the plan was compiled with)
/// at growing batch sizes on the plan's target.
pub fn largest_batch(plan: &Plan, capacity: u64) -> Result<Fit, String> {
    if super::is_decoding_step(plan) {
        return Err("the search compiles the model at other batch sizes without key/value caches, so it does not \
                    size a decoding step (compile --max-context): compile the step with --set batch=N to see that \
                    batch's memory"
            .to_string());
    }
    // Bounded, and only a regular file: a plan can name any path (a device, a FIFO) as its source.
    let limit = optimus::io::files::MODEL_SOURCE_LIMIT;
    let bytes = optimus::io::files::read_bounded(std::path::Path::new(&plan.source), "", limit).map_err(|e| {
        format!(
            "the plan's model cannot be read ({e}); the search recompiles it at other batch sizes, so run inspect \
             where the plan was compiled"
        )
    })?;
    let text = String::from_utf8(bytes)
        .map_err(|_| format!("the plan's model `{}` is not UTF-8 text; the search recompiles it", plan.source))?;
    // The config values the plan was compiled with (but batch, which the search sets).
    let overrides = super::plan_overrides(plan, &text, &["batch"])?;
    let source = Source { name: &plan.source, text: &text, overrides: &overrides };
    let memory = MemoryOptions { recompute: Some(plan.recompute), precision: plan.precision, zero: plan.zero };
    let target = Target { mesh: plan.mesh, strategy: plan.strategy, mode: plan.mode, memory, layouts: plan.layouts };
    let found = search::max_batch(&source, target, capacity);
    let plan_batch = plan.positive_config("batch");
    Ok(Fit { memory_bytes: capacity, found, plan_batch, plan_fits: plan.memory.peak_bytes <= capacity })
}

/// The text `inspect` prints after its report.
pub fn render(fit: &Fit) -> String {
    let size = optimus::plan::report::human_bytes(fit.memory_bytes);
    let mut out = format!("\nlargest batch that fits {size} per device: ");
    match (&fit.found.reason, fit.found.max_batch) {
        (Some(reason), _) => out.push_str(&format!("none ({reason})\n")),
        (None, batch) => out.push_str(&format!(
            "{batch} (batches are multiples of {}; {})\n",
            fit.found.multiple,
            optimus::plan::text::plural(fit.found.compilations, "compilation")
        )),
    }
    if let Some(batch) = fit.plan_batch {
        let verdict = if fit.plan_fits { "fits" } else { "does not fit" };
        out.push_str(&format!("  this plan's batch {batch} {verdict}\n"));
    }
    out
}
