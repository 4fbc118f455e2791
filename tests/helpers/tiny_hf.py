"""Tiny random configs of transformers' own config classes, for the generic family's tests
(float32, no network): every size the config class has is shrunk to a few units."""

from __future__ import annotations

from typing import Any

import pytest

# Sizes set wherever the config class has the attribute (its text config for multimodal ones).
TINY: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 256,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "kv_lora_rank": 8,
    "q_lora_rank": 8,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "mamba_d_state": 8,
    "mamba_n_heads": 4,
    "mamba_d_head": 8,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 1,
    "mamba_head_dim": 8,
    "mamba_num_heads": 4,
    "ssm_state_size": 8,
    "n_groups": 1,
    "conv_kernel": 4,
    "block_dim": 32,
    "block_ff_dim": 48,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}


# What a type needs beyond TINY for a consistent tiny config.
PER_TYPE: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"head_dim": 4, "qk_head_dim": 8, "num_key_value_heads": 4},
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "falcon_h1": {"mamba_d_ssm": 32, "mamba_chunk_size": 8},
}


def gemma4_text(layers: int, moe: bool = False, **overrides: Any) -> dict[str, Any]:
    """Gemma 4's per-layer structure at a tiny size: sliding/full alternating (last full),
    full layers with their own head dim and KV heads (k = v there), per-layer inputs,
    the last half of the layers reusing earlier layers' K/V with double-wide MLPs."""
    kinds = ["sliding_attention", "full_attention"] * layers
    sizes = {
        "layer_types": kinds[: layers - 1] + ["full_attention"],
        "sliding_window": 4,
        "global_head_dim": 16,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "vocab_size_per_layer_input": TINY["vocab_size"],
        "hidden_size_per_layer_input": 8,
        "num_kv_shared_layers": layers // 2 if layers > 2 else 0,
        "use_double_wide_mlp": True,
        "final_logit_softcapping": 30.0,
    }
    if moe:  # 26B-A4B: a dense MLP beside the experts in every layer, no per-layer inputs,
        # no K/V sharing (transformers 5.24 cannot run sharing without per-layer inputs)
        sizes.update(enable_moe_block=True, num_experts=4, top_k_experts=2,
                     moe_intermediate_size=16, hidden_size_per_layer_input=0,
                     num_kv_shared_layers=0, use_double_wide_mlp=False)  # fmt: skip
    return {**sizes, **overrides}


# Configs whose __post_init__ derives per-layer structure from the sizes (Gemma 4's
# per_layer_config from layer_types and global_head_dim): built from them, not shrunk after.
BUILT: dict[str, Any] = {
    "gemma4_text": gemma4_text,
    "gemma4_text_moe": lambda layers, **o: gemma4_text(layers, moe=True, **o),
}


def tiny_config(model_type: str, layers: int = 2, **overrides: Any):
    """transformers' config for `model_type`, shrunk (TINY), `layers` decoder layers.
    `gemma4_text_moe` is gemma4_text with its MoE block."""
    from transformers import AutoConfig

    if model_type in BUILT:
        base = AutoConfig.for_model(model_type.removesuffix("_moe"))
        sizes = {k: v for k, v in TINY.items() if _has(base, k)}
        sizes.update(head_dim=TINY["head_dim"], num_hidden_layers=layers)
        sizes.update(BUILT[model_type](layers, **overrides))
        return AutoConfig.for_model(base.model_type, **sizes)
    cfg = AutoConfig.for_model(model_type)
    text = cfg.get_text_config()
    sizes = {**TINY, "num_hidden_layers": layers, **PER_TYPE.get(model_type, {}), **overrides}
    for key, value in sizes.items():
        if key in overrides or key in PER_TYPE.get(model_type, {}) or _has(text, key):
            setattr(text, key, value)
    for key in ("layer_types", "layers_block_type"):  # per-layer kinds: the first `layers`
        kinds = getattr(text, key, None)
        if isinstance(kinds, list | tuple) and kinds and len(kinds) != layers:
            mixed = list(dict.fromkeys(kinds))
            setattr(text, key, [mixed[i % len(mixed)] for i in range(layers)])
    return cfg


def _has(config, key: str) -> bool:
    try:
        return hasattr(config, key)
    except Exception:  # Gemma 4: a per-layer attribute (head_dim) has no global value
        return False


def save_tiny(folder, model_type: str, seed: int = 0, **overrides: Any):
    """transformers' random model of `tiny_config(model_type, **overrides)` (seeded), saved
    to `folder` by its save_pretrained; returns `folder`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def quiet():
    """transformers' warnings and progress bars off (import the fixture by name)."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def random_lora(model, folder, targets=None, std: float = 0.3, seed: int = 3) -> None:
    """LoRA r4 alpha 8 on `model` (slipstream's `apply_lora`) with random B factors (B = 0
    would hide a wrong adapter: it changes nothing), saved as a PEFT adapter in `folder`."""
    import torch

    from slipstream.checkpoint.adapter import save_adapter
    from slipstream.peft.lora import apply_lora

    apply_lora(model, rank=4, alpha=8, targets=targets)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)
    save_adapter(model, folder)
