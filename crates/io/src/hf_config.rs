//! The `config.json` (and `generation_config.json`) that Hugging Face's `from_pretrained` reads beside
//! saved weights, for models whose parameters carry GPT-2's, Llama's or BERT's checkpoint names.
//!
//! The architecture is known from the parameter names; sizes come from the parameters' shapes where
//! a shape holds them (vocabulary, width, positions, token types, MLP width, key/value heads) and from
//! the model's config values where none does (`heads`, `eps`, `rope_theta`, `pdrop`, `pad`); the GELU
//! variant from the plan's kernels. A model that is none of the three, or lacks a value, gets no
//! config, and a note saying why.

use optimus_plan::{Instr, Kernel, Plan, PlanParam};
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// What `from_pretrained` needs beside the weights.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// `config.json`.
    pub config: Value,
    /// `generation_config.json`, for models that generate text.
    pub generation: Option<Value>,
    /// `GPT2LMHeadModel`, `LlamaForCausalLM` or `BertForMaskedLM`.
    pub architecture: &'static str,
}

impl HfConfig {
    /// As a checkpoint's manifest keeps it.
    pub fn to_json(&self) -> Value {
        json!({"architecture": self.architecture, "config": self.config, "generation": self.generation})
    }

    /// Back from [`HfConfig::to_json`]; `None` for anything else.
    pub fn from_json(value: &Value) -> Option<HfConfig> {
        let architecture = match value.get("architecture")?.as_str()? {
            "GPT2LMHeadModel" => "GPT2LMHeadModel",
            "LlamaForCausalLM" => "LlamaForCausalLM",
            "BertForMaskedLM" => "BertForMaskedLM",
            _ => return None,
        };
        let config = value.get("config").filter(|c| c.is_object())?.clone();
        let generation = value.get("generation").filter(|g| g.is_object()).cloned();
        Some(HfConfig { config, generation, architecture })
    }
}

/// The parameters by full checkpoint name (with the model's prefix), and the plan's config values.
struct Facts<'p> {
    plan: &'p Plan,
    params: BTreeMap<String, &'p PlanParam>,
}

impl<'p> Facts<'p> {
    fn of(plan: &'p Plan) -> Facts<'p> {
        let prefix = plan.checkpoint_prefix.as_deref().unwrap_or("");
        let params = plan.params.iter().map(|p| (format!("{prefix}{}", p.checkpoint), p)).collect();
        Facts { plan, params }
    }

    fn has(&self, name: &str) -> bool {
        self.params.contains_key(name)
    }

    /// The model-orientation shape of a parameter that the architecture must have.
    fn shape(&self, name: &str) -> Result<&'p [u64], String> {
        self.params.get(name).map(|p| p.shape.as_slice()).ok_or_else(|| format!("it has no parameter `{name}`"))
    }

    /// Dimension `dim` of a parameter's shape.
    fn dim(&self, name: &str, dim: usize) -> Result<u64, String> {
        let shape = self.shape(name)?;
        shape.get(dim).copied().ok_or_else(|| format!("`{name}` has shape {shape:?}, without a dimension {dim}"))
    }

    /// How many layers `{stem}N.{leaf}` there are (N = 0, 1, ... without a gap).
    fn layers(&self, stem: &str, leaf: &str) -> u64 {
        (0..).take_while(|k| self.has(&format!("{stem}{k}.{leaf}"))).count() as u64
    }

    /// A config value of the model (after `--set`), as a number.
    fn value(&self, name: &str) -> Option<f64> {
        self.plan.config.iter().find(|(n, _)| n == name).and_then(|(_, v)| match v {
            optimus_plan::types::Scalar::Int(i) => Some(*i as f64),
            optimus_plan::types::Scalar::Float(f) => Some(*f),
            _ => None,
        })
    }

    /// A config value the architecture's config needs.
    fn need(&self, name: &str, meaning: &str) -> Result<f64, String> {
        self.value(name).ok_or_else(|| format!("its config has no number `{name}` ({meaning})"))
    }

    /// Whether the GELUs are tanh-approximated (`None` when the plan has none).
    fn gelu_approximate(&self) -> Option<bool> {
        self.plan.program.iter().find_map(|instr| match instr {
            Instr::Kernel { kernel: Kernel::Gelu { approximate }, .. } => Some(*approximate),
            _ => None,
        })
    }
}

/// The config for `plan`'s model, or why it has none.
pub fn hugging_face_config(plan: &Plan) -> Result<HfConfig, String> {
    let facts = Facts::of(plan);
    let why = |e: String| format!("no config.json: {e}");
    if facts.has("transformer.wte.weight") && facts.has("transformer.h.0.attn.c_attn.weight") {
        gpt2(&facts).map_err(why)
    } else if facts.has("model.embed_tokens.weight") && facts.has("model.layers.0.self_attn.q_proj.weight") {
        llama(&facts).map_err(why)
    } else if facts.has("bert.embeddings.word_embeddings.weight") {
        bert(&facts).map_err(why)
    } else {
        Err("no config.json: the parameters are not named as GPT-2's, Llama's or BERT's, the architectures \
             optimusc writes a Hugging Face config for"
            .into())
    }
}

/// Heads from the config, checked to divide the width.
fn heads(facts: &Facts<'_>, width: u64) -> Result<u64, String> {
    let heads = facts.need("heads", "attention heads")? as u64;
    if heads == 0 || width == 0 || !width.is_multiple_of(heads) {
        return Err(format!("`heads` = {heads} does not divide the attention width {width}"));
    }
    Ok(heads)
}

/// The dropout probability (`pdrop`, else none).
fn dropout(facts: &Facts<'_>) -> f64 {
    facts.value("pdrop").unwrap_or(0.0)
}

/// An end-of-text id for a generation config: `eos` from the config, else `default` if the vocabulary
/// holds it.
fn end_of_text(facts: &Facts<'_>, vocab: u64, default: Option<u64>) -> Value {
    let id = facts.value("eos").map(|v| v as u64).or(default).filter(|&id| id < vocab);
    id.map_or(Value::Null, Value::from)
}

fn generation(bos: &Value, eos: &Value) -> Value {
    json!({"_from_model_config": true, "bos_token_id": bos, "eos_token_id": eos})
}

fn gpt2(facts: &Facts<'_>) -> Result<HfConfig, String> {
    let (vocab, hidden) = (facts.dim("transformer.wte.weight", 0)?, facts.dim("transformer.wte.weight", 1)?);
    let context = facts.dim("transformer.wpe.weight", 0)?;
    let layers = facts.layers("transformer.h.", "attn.c_attn.weight");
    let ffn = facts.dim("transformer.h.0.mlp.c_fc.weight", 1)?;
    if facts.has("lm_head.weight") {
        return Err("GPT2LMHeadModel ties its head to `transformer.wte.weight`, and this model has an untied \
                    `lm_head.weight`"
            .into());
    }
    let activation = if facts.gelu_approximate().unwrap_or(true) { "gelu_new" } else { "gelu" };
    let eos = end_of_text(facts, vocab, Some(50256));
    let pdrop = dropout(facts);
    let config = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": context,
        "n_ctx": context,
        "n_embd": hidden,
        "n_layer": layers,
        "n_head": heads(facts, hidden)?,
        "n_inner": ffn,
        "activation_function": activation,
        "resid_pdrop": pdrop,
        "embd_pdrop": pdrop,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": facts.need("eps", "the LayerNorm epsilon")?,
        "initializer_range": 0.02,
        "scale_attn_weights": true,
        "tie_word_embeddings": true,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    });
    Ok(HfConfig { generation: Some(generation(&eos, &eos)), config, architecture: "GPT2LMHeadModel" })
}

fn llama(facts: &Facts<'_>) -> Result<HfConfig, String> {
    let embed = "model.embed_tokens.weight";
    let (vocab, hidden) = (facts.dim(embed, 0)?, facts.dim(embed, 1)?);
    let layers = facts.layers("model.layers.", "self_attn.q_proj.weight");
    let attention_width = facts.dim("model.layers.0.self_attn.q_proj.weight", 1)?;
    let heads = heads(facts, attention_width)?;
    let head_dim = attention_width / heads;
    let kv_width = facts.dim("model.layers.0.self_attn.k_proj.weight", 1)?;
    if !kv_width.is_multiple_of(head_dim) {
        return Err(format!("the key width {kv_width} is not a whole number of heads of {head_dim}"));
    }
    let eos = end_of_text(facts, vocab, None);
    let bos = facts.value("bos").map(|v| v as u64).filter(|&id| id < vocab).map_or(Value::Null, Value::from);
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": facts.dim("model.layers.0.mlp.gate_proj.weight", 1)?,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_width / head_dim,
        "head_dim": head_dim,
        "max_position_embeddings": facts.value("context").map_or(Value::Null, |c| Value::from(c as u64)),
        "rms_norm_eps": facts.need("eps", "the RMSNorm epsilon")?,
        "rope_theta": facts.need("rope_theta", "the rotary base")?,
        "hidden_act": "silu",
        "attention_bias": facts.has("model.layers.0.self_attn.q_proj.bias"),
        "mlp_bias": facts.has("model.layers.0.mlp.gate_proj.bias"),
        "attention_dropout": 0.0,
        "tie_word_embeddings": !facts.has("lm_head.weight"),
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    });
    Ok(HfConfig { generation: Some(generation(&bos, &eos)), config, architecture: "LlamaForCausalLM" })
}

fn bert(facts: &Facts<'_>) -> Result<HfConfig, String> {
    let words = "bert.embeddings.word_embeddings.weight";
    let (vocab, hidden) = (facts.dim(words, 0)?, facts.dim(words, 1)?);
    let activation = if facts.gelu_approximate().unwrap_or(false) { "gelu_new" } else { "gelu" };
    let pdrop = dropout(facts);
    let config = json!({
        "architectures": ["BertForMaskedLM"],
        "model_type": "bert",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": facts.layers("bert.encoder.layer.", "attention.self.query.weight"),
        "num_attention_heads": heads(facts, hidden)?,
        "intermediate_size": facts.dim("bert.encoder.layer.0.intermediate.dense.weight", 1)?,
        "hidden_act": activation,
        "hidden_dropout_prob": pdrop,
        "attention_probs_dropout_prob": pdrop,
        "max_position_embeddings": facts.dim("bert.embeddings.position_embeddings.weight", 0)?,
        "type_vocab_size": facts.dim("bert.embeddings.token_type_embeddings.weight", 0)?,
        "layer_norm_eps": facts.need("eps", "the LayerNorm epsilon")?,
        "pad_token_id": facts.value("pad").map_or(0, |p| p as u64),
        "initializer_range": 0.02,
        "tie_word_embeddings": true,
        "torch_dtype": "float32",
    });
    Ok(HfConfig { generation: None, config, architecture: "BertForMaskedLM" })
}
