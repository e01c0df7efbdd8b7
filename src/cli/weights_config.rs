//! Whether weights about to be loaded were trained as this model is configured. Weights of the same
//! shapes can come from another configuration (other `heads`, another `eps`) and load without an error,
//! computing another function than they were trained for: the config values a checkpoint recorded, or
//! the `config.json` beside a saved folder, are compared with the plan's.

use optimus::plan::Plan;
use std::path::Path;

/// Config values that may differ between the run that trained weights and one that loads them: the
/// batch's shape, and dropout (off when generating).
fn may_differ(name: &str) -> bool {
    matches!(name, "batch" | "seq") || name.contains("drop")
}

/// The `config.json` keys that define the function of a GPT-2, Llama or BERT model without setting a
/// tensor's shape (those differ loudly, as shape mismatches).
const FUNCTION_KEYS: [&str; 9] = [
    "n_head",
    "num_attention_heads",
    "num_key_value_heads",
    "rope_theta",
    "layer_norm_epsilon",
    "layer_norm_eps",
    "rms_norm_eps",
    "activation_function",
    "hidden_act",
];

/// The largest `config.json` read (1 MiB): Hugging Face's are a few kilobytes.
const CONFIG_LIMIT: u64 = 1 << 20;

/// What differs between the configuration `path`'s weights were trained with and `plan`'s, as
/// `heads 4 (this model: 2)`; empty when nothing differs or the weights do not record it.
pub fn differences(path: &Path, plan: &Plan) -> Vec<String> {
    if path.join("config.json").is_file() {
        return folder_differences(&path.join("config.json"), plan);
    }
    match optimus::io::shards::Checkpoint::open(path) {
        Ok(checkpoint) => checkpoint_differences(&checkpoint.training()["config"], plan),
        Err(_) => Vec::new(),
    }
}

/// The plan's config values against those a checkpoint recorded (none in checkpoints written before
/// they were recorded).
fn checkpoint_differences(recorded: &serde_json::Value, plan: &Plan) -> Vec<String> {
    let Some(recorded) = recorded.as_object() else { return Vec::new() };
    let mut found = Vec::new();
    for (name, value) in plan.config.iter().filter(|(name, _)| !may_differ(name)) {
        let (Some(theirs), Ok(mine)) = (recorded.get(name), serde_json::to_value(value)) else { continue };
        if !same_number(theirs, &mine) {
            found.push(format!("{name} {theirs} (this model: {mine})"));
        }
    }
    found
}

/// The function-defining keys of a saved folder's `config.json` against the config the plan would write.
fn folder_differences(config: &Path, plan: &Plan) -> Vec<String> {
    let Ok(ours) = optimus::io::hf_config::hugging_face_config(plan) else { return Vec::new() };
    let Ok(bytes) = optimus::io::files::read_bounded(config, "config.json", CONFIG_LIMIT) else { return Vec::new() };
    let Ok(theirs) = serde_json::from_slice::<serde_json::Value>(&bytes) else { return Vec::new() };
    let mut found = Vec::new();
    for key in FUNCTION_KEYS {
        let (Some(theirs), Some(mine)) = (theirs.get(key), ours.config.get(key)) else { continue };
        if !same_number(theirs, mine) {
            found.push(format!("{key} {theirs} (this model: {mine})"));
        }
    }
    found
}

/// Whether two JSON values are equal, numbers by value (`4` and `4.0` alike; floats to a part in 1e9,
/// so that a value another program printed with fewer digits still matches).
pub(super) fn same_number(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => (x - y).abs() <= 1e-9 * x.abs().max(y.abs()),
        _ => a == b,
    }
}

/// The warning for weights at `path` (`--weights`, generate's `--resume`) trained with another
/// configuration than the plan's.
pub fn warning(path: &Path, plan: &Plan) -> Option<String> {
    let found = differences(path, plan);
    (!found.is_empty()).then(|| {
        format!(
            "`{}` holds weights trained with {}: they load, but this model computes another function with them \
             (give the --set values they were trained with)",
            path.display(),
            found.join(", ")
        )
    })
}
