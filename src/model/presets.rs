//! Built-in model inventories computed from config values.
//!
//! Each family has a config struct whose `inventory` method lists every parameter tensor in the
//! order `named_parameters()` yields it for the Hugging Face `transformers` module (a pre-order
//! walk: a module's own parameters before its children, in registration order). The five
//! presets reproduce `models/<name>.json` tensor for tensor; the files are the test oracle, not
//! an input (nothing here reads them).
//!
//! | preset | config | HF model id |
//! |---|---|---|
//! | `llama3_8b` | [`LLAMA3_8B`] | `meta-llama/Meta-Llama-3-8B` |
//! | `llama3_70b` | [`LLAMA3_70B`] | `meta-llama/Meta-Llama-3-70B` |
//! | `gpt_oss_20b` | [`GPT_OSS_20B`] | `openai/gpt-oss-20b` |
//! | `gpt_oss_120b` | [`GPT_OSS_120B`] | `openai/gpt-oss-120b` |
//! | `deepseek_v3_671b` | [`DEEPSEEK_V3_671B`] | `deepseek-ai/DeepSeek-V3` |

use super::{DType, Inventory, TensorSpec};
use crate::{Context, Error, Result};

/// Canonical preset names (the stems of the files in `models/`), accepted by [`by_name`].
pub const NAMES: &[&str] = &[
    "llama3_8b",
    "llama3_70b",
    "gpt_oss_20b",
    "gpt_oss_120b",
    "deepseek_v3_671b",
];

/// The canonical form of a preset name: ASCII case is ignored and `-` may stand for `_`
/// (`"Llama3-8B"` → `"llama3_8b"`). `None` if it names no preset.
pub fn canonical_name(name: &str) -> Option<&'static str> {
    let norm = name.trim().to_ascii_lowercase().replace('-', "_");
    NAMES.iter().copied().find(|&n| n == norm)
}

/// The Hugging Face model id of a preset (the `model` field of its file), by any name
/// [`canonical_name`] accepts.
pub fn model_id(name: &str) -> Option<&'static str> {
    Some(match canonical_name(name)? {
        "llama3_8b" => "meta-llama/Meta-Llama-3-8B",
        "llama3_70b" => "meta-llama/Meta-Llama-3-70B",
        "gpt_oss_20b" => "openai/gpt-oss-20b",
        "gpt_oss_120b" => "openai/gpt-oss-120b",
        "deepseek_v3_671b" => "deepseek-ai/DeepSeek-V3",
        _ => unreachable!("every entry of NAMES has a model id"),
    })
}

/// The preset called `name` (see [`canonical_name`] for the accepted spellings), with
/// [`Inventory::model`] set to its Hugging Face model id.
pub fn by_name(name: &str) -> Option<Inventory> {
    let canonical = canonical_name(name)?;
    let id = model_id(canonical)?;
    let inv = match canonical {
        "llama3_8b" => LLAMA3_8B.inventory(id),
        "llama3_70b" => LLAMA3_70B.inventory(id),
        "gpt_oss_20b" => GPT_OSS_20B.inventory(id),
        "gpt_oss_120b" => GPT_OSS_120B.inventory(id),
        "deepseek_v3_671b" => DEEPSEEK_V3_671B.inventory(id),
        _ => unreachable!("every entry of NAMES has a config"),
    };
    Some(inv.expect("built-in preset configs are valid"))
}

/// Collects tensors in registration order; every tensor is bf16 unless pushed with a dtype.
struct Builder<'a> {
    op: &'static str,
    model: &'a str,
    tensors: Vec<TensorSpec>,
}

impl<'a> Builder<'a> {
    fn new(op: &'static str, model: &'a str) -> Self {
        Builder {
            op,
            model,
            tensors: Vec::new(),
        }
    }

    fn push(&mut self, name: String, shape: &[usize]) -> Result<()> {
        self.push_as(name, shape, DType::BF16)
    }

    fn push_as(&mut self, name: String, shape: &[usize], dtype: DType) -> Result<()> {
        match TensorSpec::new(name.as_str(), shape, dtype) {
            Ok(t) => self.tensors.push(t),
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("{}: model {}, tensor {name}", self.op, self.model))
            }
        }
        Ok(())
    }

    /// An `nn.Linear(fan_in, fan_out)`: `weight [fan_out, fan_in]`, then `bias [fan_out]`.
    fn linear(&mut self, prefix: &str, fan_in: usize, fan_out: usize, bias: bool) -> Result<()> {
        self.push(format!("{prefix}.weight"), &[fan_out, fan_in])?;
        if bias {
            self.push(format!("{prefix}.bias"), &[fan_out])?;
        }
        Ok(())
    }

    /// An RMSNorm: `weight [dim]`.
    fn norm(&mut self, prefix: &str, dim: usize) -> Result<()> {
        self.push(format!("{prefix}.weight"), &[dim])
    }

    /// A SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`, no biases).
    fn swiglu(&mut self, prefix: &str, hidden: usize, inter: usize) -> Result<()> {
        self.linear(&format!("{prefix}.gate_proj"), hidden, inter, false)?;
        self.linear(&format!("{prefix}.up_proj"), hidden, inter, false)?;
        self.linear(&format!("{prefix}.down_proj"), inter, hidden, false)
    }

    /// `model.embed_tokens [vocab, hidden]`.
    fn embedding(&mut self, vocab: usize, hidden: usize) -> Result<()> {
        self.push("model.embed_tokens.weight".into(), &[vocab, hidden])
    }

    /// `model.norm [hidden]`, then `lm_head [vocab, hidden]` unless tied to the embedding
    /// (`named_parameters()` yields a shared parameter once, under its first name).
    fn head(&mut self, vocab: usize, hidden: usize, tied: bool) -> Result<()> {
        self.norm("model.norm", hidden)?;
        if !tied {
            self.push("lm_head.weight".into(), &[vocab, hidden])?;
        }
        Ok(())
    }

    fn finish(self) -> Result<Inventory> {
        let inv = Inventory {
            model: self.model.to_string(),
            tensors: self.tensors,
        };
        inv.validate(None, None)?;
        Ok(inv)
    }
}

fn checked_mul(op: &'static str, model: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| Error::BadInput {
        op,
        what: format!("model {model}"),
        reason: format!("{a} x {b} overflows usize"),
    })
}

/// Config of a Llama (transformers `LlamaForCausalLM`): no biases, SwiGLU MLP, GQA attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlamaConfig {
    /// `hidden_size`.
    pub hidden: usize,
    /// `intermediate_size` of the MLP.
    pub intermediate: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `num_key_value_heads`.
    pub kv_heads: usize,
    /// `head_dim`.
    pub head_dim: usize,
    /// `vocab_size`.
    pub vocab: usize,
    /// `tie_word_embeddings`: when set, `lm_head` shares the embedding and is not listed.
    pub tie_embeddings: bool,
}

/// Meta-Llama-3-8B, from HF `meta-llama/Meta-Llama-3-8B` `config.json` (same values in torchtune
/// `llama3_8b()`): hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads of 128,
/// vocab 128256, untied. 291 tensors, 8,030,261,248 parameters.
pub const LLAMA3_8B: LlamaConfig = LlamaConfig {
    hidden: 4096,
    intermediate: 14336,
    layers: 32,
    heads: 32,
    kv_heads: 8,
    head_dim: 128,
    vocab: 128256,
    tie_embeddings: false,
};

/// Meta-Llama-3-70B, from HF `meta-llama/Meta-Llama-3-70B` `config.json` (same values in
/// torchtune `llama3_70b()`): hidden 8192, intermediate 28672, 80 layers, 64 heads, 8 KV heads
/// of 128, vocab 128256, untied. 723 tensors, 70,553,706,496 parameters.
pub const LLAMA3_70B: LlamaConfig = LlamaConfig {
    hidden: 8192,
    intermediate: 28672,
    layers: 80,
    heads: 64,
    kv_heads: 8,
    head_dim: 128,
    vocab: 128256,
    tie_embeddings: false,
};

impl LlamaConfig {
    /// The inventory: `embed_tokens`; per layer `q/k/v/o_proj`, `gate/up/down_proj`,
    /// `input_layernorm`, `post_attention_layernorm`; then `norm` and (untied) `lm_head`.
    pub fn inventory(&self, model_name: &str) -> Result<Inventory> {
        const OP: &str = "LlamaConfig::inventory";
        let c = self;
        let q_dim = checked_mul(OP, model_name, c.heads, c.head_dim)?;
        let kv_dim = checked_mul(OP, model_name, c.kv_heads, c.head_dim)?;
        let mut b = Builder::new(OP, model_name);
        b.embedding(c.vocab, c.hidden)?;
        for i in 0..c.layers {
            let p = format!("model.layers.{i}");
            b.linear(&format!("{p}.self_attn.q_proj"), c.hidden, q_dim, false)?;
            b.linear(&format!("{p}.self_attn.k_proj"), c.hidden, kv_dim, false)?;
            b.linear(&format!("{p}.self_attn.v_proj"), c.hidden, kv_dim, false)?;
            b.linear(&format!("{p}.self_attn.o_proj"), q_dim, c.hidden, false)?;
            b.swiglu(&format!("{p}.mlp"), c.hidden, c.intermediate)?;
            b.norm(&format!("{p}.input_layernorm"), c.hidden)?;
            b.norm(&format!("{p}.post_attention_layernorm"), c.hidden)?;
        }
        b.head(c.vocab, c.hidden, c.tie_embeddings)?;
        b.finish()
    }
}

/// Config of a gpt-oss model (transformers `GptOssForCausalLM`): attention sinks, GQA
/// attention, a biased top-k router and fused 3-D expert tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptOssConfig {
    /// `hidden_size`.
    pub hidden: usize,
    /// `intermediate_size` of one expert.
    pub intermediate: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// `num_attention_heads` (also the length of `self_attn.sinks`).
    pub heads: usize,
    /// `num_key_value_heads`.
    pub kv_heads: usize,
    /// `head_dim`.
    pub head_dim: usize,
    /// `num_local_experts`.
    pub experts: usize,
    /// `vocab_size`.
    pub vocab: usize,
    /// `attention_bias`: biases on `q/k/v/o_proj`.
    pub attention_bias: bool,
    /// `tie_word_embeddings`.
    pub tie_embeddings: bool,
}

/// gpt-oss-20b, from HF `openai/gpt-oss-20b` `config.json`: 24 layers, 32 experts, otherwise as
/// [`GPT_OSS_120B`]. 411 tensors, 20,914,757,184 parameters.
pub const GPT_OSS_20B: GptOssConfig = GptOssConfig {
    layers: 24,
    experts: 32,
    ..GPT_OSS_120B
};

/// gpt-oss-120b, from HF `openai/gpt-oss-120b` `config.json` (and openai/gpt-oss
/// `gpt_oss/torch/model.py` `ModelConfig`): hidden = intermediate = 2880, 36 layers, 128 experts,
/// 64 query heads and 8 KV heads of 64, vocab 201088, attention biases, untied. 615 tensors,
/// 116,829,156,672 parameters.
pub const GPT_OSS_120B: GptOssConfig = GptOssConfig {
    hidden: 2880,
    intermediate: 2880,
    layers: 36,
    heads: 64,
    kv_heads: 8,
    head_dim: 64,
    experts: 128,
    vocab: 201088,
    attention_bias: true,
    tie_embeddings: false,
};

impl GptOssConfig {
    /// The inventory: `embed_tokens`; per layer `self_attn.sinks [heads]`, `q/k/v/o_proj`
    /// (weight then bias), `mlp.router` weight `[E, hidden]` and bias `[E]`, the fused
    /// `mlp.experts.gate_up_proj [E, hidden, 2*inter]`, `gate_up_proj_bias [E, 2*inter]`,
    /// `down_proj [E, inter, hidden]`, `down_proj_bias [E, hidden]`, then the two norms; then
    /// `norm` and (untied) `lm_head`.
    pub fn inventory(&self, model_name: &str) -> Result<Inventory> {
        const OP: &str = "GptOssConfig::inventory";
        let c = self;
        let q_dim = checked_mul(OP, model_name, c.heads, c.head_dim)?;
        let kv_dim = checked_mul(OP, model_name, c.kv_heads, c.head_dim)?;
        let gate_up = checked_mul(OP, model_name, 2, c.intermediate)?;
        let bias = c.attention_bias;
        let mut b = Builder::new(OP, model_name);
        b.embedding(c.vocab, c.hidden)?;
        for i in 0..c.layers {
            let p = format!("model.layers.{i}");
            b.push(format!("{p}.self_attn.sinks"), &[c.heads])?;
            b.linear(&format!("{p}.self_attn.q_proj"), c.hidden, q_dim, bias)?;
            b.linear(&format!("{p}.self_attn.k_proj"), c.hidden, kv_dim, bias)?;
            b.linear(&format!("{p}.self_attn.v_proj"), c.hidden, kv_dim, bias)?;
            b.linear(&format!("{p}.self_attn.o_proj"), q_dim, c.hidden, bias)?;
            b.linear(&format!("{p}.mlp.router"), c.hidden, c.experts, true)?;
            let e = format!("{p}.mlp.experts");
            b.push(format!("{e}.gate_up_proj"), &[c.experts, c.hidden, gate_up])?;
            b.push(format!("{e}.gate_up_proj_bias"), &[c.experts, gate_up])?;
            b.push(
                format!("{e}.down_proj"),
                &[c.experts, c.intermediate, c.hidden],
            )?;
            b.push(format!("{e}.down_proj_bias"), &[c.experts, c.hidden])?;
            b.norm(&format!("{p}.input_layernorm"), c.hidden)?;
            b.norm(&format!("{p}.post_attention_layernorm"), c.hidden)?;
        }
        b.head(c.vocab, c.hidden, c.tie_embeddings)?;
        b.finish()
    }
}

/// Config of a DeepSeek-V3 model (HF checkpoint layout: transformers v4 / the checkpoint's own
/// `modeling_deepseek.py`, one 2-D `Linear` per expert): MLA attention, dense SwiGLU layers, then
/// MoE layers with routed experts, a sigmoid router with an fp32 score-correction bias, and
/// shared experts. Main model only (the multi-token-prediction layer is not included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeepSeekV3Config {
    /// `hidden_size`.
    pub hidden: usize,
    /// `intermediate_size` of the dense MLP layers.
    pub intermediate: usize,
    /// `moe_intermediate_size` of one routed expert (and, times `n_shared_experts`, of the
    /// shared-expert MLP).
    pub moe_intermediate: usize,
    /// `num_hidden_layers` (main model).
    pub layers: usize,
    /// `first_k_dense_replace`: layers below this index are dense.
    pub first_k_dense_replace: usize,
    /// `moe_layer_freq`: from `first_k_dense_replace` on, layer `i` is MoE when
    /// `i % moe_layer_freq == 0`.
    pub moe_layer_freq: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `q_lora_rank`; `None` replaces `q_a_proj`/`q_a_layernorm`/`q_b_proj` by one `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// `kv_lora_rank`.
    pub kv_lora_rank: usize,
    /// `qk_nope_head_dim`.
    pub qk_nope_head_dim: usize,
    /// `qk_rope_head_dim`.
    pub qk_rope_head_dim: usize,
    /// `v_head_dim`.
    pub v_head_dim: usize,
    /// `n_routed_experts`; 0 makes every layer dense.
    pub n_routed_experts: usize,
    /// `n_shared_experts`: one `shared_experts` MLP of `n_shared_experts * moe_intermediate`
    /// (0: none).
    pub n_shared_experts: usize,
    /// `vocab_size`.
    pub vocab: usize,
    /// `attention_bias`: biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`.
    pub attention_bias: bool,
    /// `tie_word_embeddings`.
    pub tie_embeddings: bool,
}

/// DeepSeek-V3 (671B main model), from HF `deepseek-ai/DeepSeek-V3` `config.json` (= the repo's
/// `inference/configs/config_671B.json`): hidden 7168, dense intermediate 18432, expert
/// intermediate 2048, 61 layers of which the first 3 dense, 128 heads, q_lora 1536, kv_lora 512,
/// qk nope/rope head dims 128/64, v head dim 128, 256 routed + 1 shared experts, vocab 129280,
/// no attention bias, untied. 45,395 tensors, 671,026,419,200 parameters.
pub const DEEPSEEK_V3_671B: DeepSeekV3Config = DeepSeekV3Config {
    hidden: 7168,
    intermediate: 18432,
    moe_intermediate: 2048,
    layers: 61,
    first_k_dense_replace: 3,
    moe_layer_freq: 1,
    heads: 128,
    q_lora_rank: Some(1536),
    kv_lora_rank: 512,
    qk_nope_head_dim: 128,
    qk_rope_head_dim: 64,
    v_head_dim: 128,
    n_routed_experts: 256,
    n_shared_experts: 1,
    vocab: 129280,
    attention_bias: false,
    tie_embeddings: false,
};

impl DeepSeekV3Config {
    /// Whether decoder layer `layer` has the MoE MLP (as in `modeling_deepseek.py`: routed
    /// experts exist, `layer >= first_k_dense_replace` and `layer % moe_layer_freq == 0`).
    /// A `moe_layer_freq` of 0 is treated as 1.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.n_routed_experts > 0
            && layer >= self.first_k_dense_replace
            && layer % self.moe_layer_freq.max(1) == 0
    }

    /// The inventory: `embed_tokens`; per layer the MLA attention (`q_a_proj [q_lora, hidden]`,
    /// `q_a_layernorm [q_lora]`, `q_b_proj [heads*(nope+rope), q_lora]` — or `q_proj` without
    /// q_lora —, `kv_a_proj_with_mqa [kv_lora+rope, hidden]`, `kv_a_layernorm [kv_lora]`,
    /// `kv_b_proj [heads*(nope+v), kv_lora]`, `o_proj [hidden, heads*v]`), then either the dense
    /// SwiGLU MLP or, on MoE layers, `mlp.experts.<j>.{gate,up,down}_proj` for every routed
    /// expert, `mlp.gate.weight [E, hidden]`, `mlp.gate.e_score_correction_bias [E]` (fp32) and
    /// `mlp.shared_experts` (a SwiGLU MLP), then the two norms; then `norm` and (untied)
    /// `lm_head`.
    pub fn inventory(&self, model_name: &str) -> Result<Inventory> {
        const OP: &str = "DeepSeekV3Config::inventory";
        let c = self;
        let mul = |a, b| checked_mul(OP, model_name, a, b);
        let qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim;
        let q_out = mul(c.heads, qk_head)?;
        let kv_a_out = c.kv_lora_rank + c.qk_rope_head_dim;
        let kv_b_out = mul(c.heads, c.qk_nope_head_dim + c.v_head_dim)?;
        let o_in = mul(c.heads, c.v_head_dim)?;
        let shared_inter = mul(c.n_shared_experts, c.moe_intermediate)?;
        let bias = c.attention_bias;
        let mut b = Builder::new(OP, model_name);
        b.embedding(c.vocab, c.hidden)?;
        for i in 0..c.layers {
            let a = format!("model.layers.{i}.self_attn");
            match c.q_lora_rank {
                Some(r) => {
                    b.linear(&format!("{a}.q_a_proj"), c.hidden, r, bias)?;
                    b.norm(&format!("{a}.q_a_layernorm"), r)?;
                    b.linear(&format!("{a}.q_b_proj"), r, q_out, false)?;
                }
                None => b.linear(&format!("{a}.q_proj"), c.hidden, q_out, false)?,
            }
            b.linear(&format!("{a}.kv_a_proj_with_mqa"), c.hidden, kv_a_out, bias)?;
            b.norm(&format!("{a}.kv_a_layernorm"), c.kv_lora_rank)?;
            b.linear(&format!("{a}.kv_b_proj"), c.kv_lora_rank, kv_b_out, false)?;
            b.linear(&format!("{a}.o_proj"), o_in, c.hidden, bias)?;

            let m = format!("model.layers.{i}.mlp");
            if c.is_moe_layer(i) {
                for j in 0..c.n_routed_experts {
                    b.swiglu(&format!("{m}.experts.{j}"), c.hidden, c.moe_intermediate)?;
                }
                b.push(format!("{m}.gate.weight"), &[c.n_routed_experts, c.hidden])?;
                b.push_as(
                    format!("{m}.gate.e_score_correction_bias"),
                    &[c.n_routed_experts],
                    DType::F32,
                )?;
                if c.n_shared_experts > 0 {
                    b.swiglu(&format!("{m}.shared_experts"), c.hidden, shared_inter)?;
                }
            } else {
                b.swiglu(&m, c.hidden, c.intermediate)?;
            }
            b.norm(&format!("model.layers.{i}.input_layernorm"), c.hidden)?;
            b.norm(
                &format!("model.layers.{i}.post_attention_layernorm"),
                c.hidden,
            )?;
        }
        b.head(c.vocab, c.hidden, c.tie_embeddings)?;
        b.finish()
    }
}
