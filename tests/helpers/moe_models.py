"""Tiny random Qwen3-MoE and GPT-OSS checkpoints, built with transformers (eager attention)."""

from __future__ import annotations

import torch

QWEN3_MOE_BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

GPT_OSS_BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=4,
    max_position_embeddings=256,
    # the published yarn settings (truncate false), scaled down so that factor 32 = 256 / 8
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=8,
    ),
    rms_norm_eps=1e-5,
    swiglu_limit=1.0,  # small, so the tiny model's pre-activations do hit the clamp
    tie_word_embeddings=False,
)


def make_hf_moe_model(model_type: str, seed: int = 0, **overrides):
    """A transformers MoE model in float32 with every parameter random (norms near 1, routers
    and biases non-trivial, experts large enough that the GPT-OSS clamp is exercised)."""
    import transformers

    classes = {
        "qwen3_moe": (
            transformers.Qwen3MoeConfig,
            transformers.Qwen3MoeForCausalLM,
            QWEN3_MOE_BASE,
        ),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, GPT_OSS_BASE),
    }
    config_cls, model_cls, base = classes[model_type]
    config = config_cls(**{**base, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "router" in name or "mlp.gate." in name:
                p.normal_(0, 0.5)  # decisive routing: no near-ties between implementations
            elif "experts" in name or name.endswith(("bias", "sinks")):
                p.normal_(0, 0.2)
    return model
