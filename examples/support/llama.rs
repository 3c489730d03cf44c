//! The glue that trains candle-transformers 0.11.1's Llama through `fully_shard`
//! (`examples/llama.rs`, `tests/llama_tests.rs`).
//!
//! candle-transformers' `Llama::forward` cannot be trained: three of its kernels are forward
//! only (`rms_norm`, `rope` and `softmax_last_dim` run through `apply_op*_no_bwd`, so backward
//! stops at the final norm and every parameter but `lm_head` gets no gradient), and it returns
//! only the last position's logits. Its layers are private, so the kernels cannot be swapped
//! from outside. The change carried here, the smallest that works: [`DiffLlama`] runs the same
//! computation on the same `VarBuilder` paths with candle-nn's differentiable twins of those
//! three kernels (`ops::rms_norm_slow`, `rotary_emb::rope_slow`, `ops::softmax`) and returns
//! every position's logits. Parameters, names and initial values come from candle-transformers'
//! own `Llama::load` ([`llama_params`]); `tests/llama_tests.rs` checks that the last position's
//! logits equal `Llama::forward`'s on the same tensors (to 1e-5) and that every parameter gets
//! a nonzero gradient.

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{embedding, linear_no_bias, Embedding, Linear, Module, VarBuilder, VarMap};
use candle_transformers::models::llama::{Config, Llama};
use candle_transformers::utils::repeat_kv;
use ragged::demo::SplitMix;

/// A tiny Llama: 2 layers, hidden 64, 4 heads (2 key/value heads: grouped-query attention),
/// vocabulary 128, 16 positions.
pub fn tiny_config() -> Config {
    Config {
        hidden_size: 64,
        intermediate_size: 128,
        vocab_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        use_flash_attn: false,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: 16,
        tie_word_embeddings: false,
    }
}

/// Llama's parameters as candle-transformers names them (`Llama::load` on a `VarMap` records
/// every `VarBuilder` path it asks for), sorted by name so that every rank lists them alike
/// (a `VarMap` is a `HashMap`). Matrices get seeded values (uniform in `±1/√fan_in`), norms
/// keep `Llama::load`'s ones, so runs are reproducible.
pub fn llama_params(cfg: &Config, seed: u64) -> candle_core::Result<Vec<(String, Tensor)>> {
    let map = VarMap::new();
    Llama::load(VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu), cfg)?;
    let mut params: Vec<(String, Tensor)> = map
        .data()
        .lock()
        .map_err(|_| candle_core::Error::Msg("VarMap lock poisoned".into()))?
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    let mut rng = SplitMix(seed);
    for (_, t) in params.iter_mut().filter(|(_, t)| t.rank() >= 2) {
        let bound = 1.0 / (t.dims()[t.rank() - 1] as f32).sqrt();
        let values: Vec<f32> = (0..t.elem_count()).map(|_| bound * rng.uniform()).collect();
        *t = Tensor::from_vec(values, t.dims(), &Device::Cpu)?;
    }
    Ok(params)
}

/// candle-transformers' Llama block on its own paths, with differentiable kernels.
struct Block {
    input_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    post_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// Llama with differentiable kernels (see the module doc).
pub struct DiffLlama {
    cfg: Config,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: Tensor,
    lm_head: Linear,
}

impl DiffLlama {
    /// Builds the model from `vb` with candle-transformers' paths and shapes.
    pub fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let kv = h / cfg.num_attention_heads * cfg.num_key_value_heads;
        let block = |vb: VarBuilder| -> candle_core::Result<Block> {
            let (a, m) = (vb.pp("self_attn"), vb.pp("mlp"));
            Ok(Block {
                input_norm: vb.get(h, "input_layernorm.weight")?,
                q: linear_no_bias(h, h, a.pp("q_proj"))?,
                k: linear_no_bias(h, kv, a.pp("k_proj"))?,
                v: linear_no_bias(h, kv, a.pp("v_proj"))?,
                o: linear_no_bias(h, h, a.pp("o_proj"))?,
                post_norm: vb.get(h, "post_attention_layernorm.weight")?,
                gate: linear_no_bias(h, i, m.pp("gate_proj"))?,
                up: linear_no_bias(h, i, m.pp("up_proj"))?,
                down: linear_no_bias(i, h, m.pp("down_proj"))?,
            })
        };
        let blocks = (0..cfg.num_hidden_layers)
            .map(|l| block(vb.pp(format!("model.layers.{l}"))))
            .collect::<candle_core::Result<_>>()?;
        Ok(DiffLlama {
            cfg: cfg.clone(),
            embed: embedding(cfg.vocab_size, h, vb.pp("model.embed_tokens"))?,
            blocks,
            norm: vb.get(h, "model.norm.weight")?,
            lm_head: linear_no_bias(h, cfg.vocab_size, vb.pp("lm_head"))?,
        })
    }

    /// Logits of every position, `[batch, seq, vocab]`.
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (_, seq) = ids.dims2()?;
        let (cos, sin) = self.rope_tables(seq)?;
        let mask = causal_mask(seq)?;
        let eps = self.cfg.rms_norm_eps as f32;
        let mut x = self.embed.forward(ids)?;
        for b in &self.blocks {
            let a = candle_nn::ops::rms_norm_slow(&x, &b.input_norm, eps)?;
            x = (self.attention(b, &a, &cos, &sin, &mask)? + x)?;
            let m = candle_nn::ops::rms_norm_slow(&x, &b.post_norm, eps)?;
            let gated = (candle_nn::ops::silu(&b.gate.forward(&m)?)? * b.up.forward(&m)?)?;
            x = (b.down.forward(&gated)? + x)?;
        }
        let x = candle_nn::ops::rms_norm_slow(&x, &self.norm, eps)?;
        self.lm_head.forward(&x)
    }

    /// Mean next-token cross-entropy over `ids` (`[batch, seq]`).
    pub fn loss(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, seq) = ids.dims2()?;
        let logits = self.forward(&ids.narrow(1, 0, seq - 1)?)?;
        let targets = ids.narrow(1, 1, seq - 1)?.reshape(b * (seq - 1))?;
        let logits = logits.reshape((b * (seq - 1), self.cfg.vocab_size))?;
        candle_nn::loss::cross_entropy(&logits, &targets)
    }

    /// Causal self-attention with grouped key/value heads (`x`: `[batch, seq, hidden]`).
    fn attention(
        &self,
        b: &Block,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let (batch, seq, hidden) = x.dims3()?;
        let (heads, kv_heads) = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads);
        let hd = hidden / heads;
        let split = |t: Tensor, n: usize| -> candle_core::Result<Tensor> {
            t.reshape((batch, seq, n, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = split(b.q.forward(x)?, heads)?;
        let k = split(b.k.forward(x)?, kv_heads)?;
        let v = split(b.v.forward(x)?, kv_heads)?;
        let q = candle_nn::rotary_emb::rope_slow(&q, cos, sin)?;
        let k = candle_nn::rotary_emb::rope_slow(&k, cos, sin)?;
        let k = repeat_kv(k, heads / kv_heads)?.contiguous()?;
        let v = repeat_kv(v, heads / kv_heads)?.contiguous()?;
        let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
        let att = att.broadcast_add(mask)?;
        let att = candle_nn::ops::softmax(&att, D::Minus1)?;
        let y = att
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((batch, seq, hidden))?;
        b.o.forward(&y)
    }

    /// Llama's rotary tables for positions `0..seq`: `θ_i = 1 / theta^(2i/d)`, `[seq, d/2]`.
    fn rope_tables(&self, seq: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let hd = self.cfg.hidden_size / self.cfg.num_attention_heads;
        let inv: Vec<f32> = (0..hd)
            .step_by(2)
            .map(|i| 1.0 / self.cfg.rope_theta.powf(i as f32 / hd as f32))
            .collect();
        let inv = Tensor::from_vec(inv, (1, hd / 2), &Device::Cpu)?;
        let pos = Tensor::arange(0u32, seq as u32, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .reshape((seq, 1))?;
        let angles = pos.matmul(&inv)?;
        Ok((angles.cos()?, angles.sin()?))
    }
}

/// `[seq, seq]`: 0 on and below the diagonal, −∞ above (added to the attention scores).
fn causal_mask(seq: usize) -> candle_core::Result<Tensor> {
    let values: Vec<f32> = (0..seq * seq)
        .map(|e| {
            if e % seq > e / seq {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(values, (seq, seq), &Device::Cpu)
}
