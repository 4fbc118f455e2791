"""GGUF metadata -> a Hugging Face config.json dict, for every llama.cpp architecture we export.

The inverse of `gguf_arch.write_metadata` (and of what llama.cpp's converter writes for these
architectures): hyperparameters under `{arch}.*` keys, special token ids under
`tokenizer.ggml.*`, tied embeddings when there is no `output.weight`, and what llama.cpp fixes
in code rather than in the file (gpt-oss's SwiGLU clamp 7.0 and alternating sliding layers;
qwen3moe's renormalised top-k; Gemma 3's query scale 1/sqrt(head_dim)). Phi-3's longrope
factor sets are tensors in the file (`rope_factors_long/short`); they come back as config, and
so does llama3 RoPE from its `rope_freqs` divisors (`gguf_llama3.py`).

Non-llama configs are completed with transformers' defaults for the model type
(`AutoConfig.for_model`), so the dict is what a config.json of that family holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from slipstream.checkpoint.gguf_fields import decimal, field

# llama.cpp architecture -> our model_type.
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "phi3": "phi3",
    "gemma3": "gemma3_text",
    "gpt-oss": "gpt_oss",
}
# Tensors that are configuration, not weights (read here, skipped by the tensor reader).
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")


def hf_config_from_gguf(reader: Any, path: Any = "GGUF file") -> dict:
    """A Hugging Face config dict from a GGUF's metadata, or a one-line error for an
    architecture we do not read."""
    arch = field(reader, "general.architecture")
    if field(reader, "general.type") == "adapter":
        from slipstream.sources import lora_gguf_error

        raise ValueError(lora_gguf_error(path, "load_model"))
    model_type_for(arch, path)
    names = {t.name for t in reader.tensors}
    config = _common(reader, arch, names)
    if arch == "llama":
        _llama(config, reader, names)
        return config
    if arch in ("qwen3", "gemma3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "qwen3moe":
        config.update(_experts(reader, arch), norm_topk_prob=True, decoder_sparse_step=1)
        config["moe_intermediate_size"] = config.pop("expert_width")
    elif arch == "gpt-oss":
        _gpt_oss(config, reader)
    elif arch == "phi3":
        _phi3(config, reader)
    elif arch == "gemma3":
        _gemma3(config, reader)
    return _complete(config)


def model_type_for(arch: str | None, path: Any = "GGUF file") -> str:
    """Our model_type of a llama.cpp architecture, or a one-line error listing those we read."""
    if arch not in MODEL_TYPES:
        supported = ", ".join(MODEL_TYPES)
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} cannot be imported; supported: {supported}."
        )
    return MODEL_TYPES[arch]


def _common(reader: Any, arch: str, names: set[str]) -> dict:
    p = arch + "."
    heads = int(field(reader, p + "attention.head_count"))
    hidden = int(field(reader, p + "embedding_length"))
    vocab = field(reader, p + "vocab_size") or len(field(reader, "tokenizer.ggml.tokens", []))
    config = {
        "model_type": MODEL_TYPES[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(field(reader, p + "attention.key_length", hidden // heads)),
        "max_position_embeddings": int(field(reader, p + "context_length", 2048)),
        "rms_norm_eps": decimal(field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": decimal(field(reader, p + "rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = field(reader, f"tokenizer.ggml.{key.replace('pad_', 'padding_')}")
        if value is not None:
            config[key] = int(value)
    return config


def _llama(config: dict, reader: Any, names: set[str]) -> None:
    config.update(
        architectures=["LlamaForCausalLM"],
        hidden_act="silu",
        attention_bias="blk.0.attn_q.bias" in names,
        mlp_bias=False,
    )
    scaling = field(reader, "llama.rope.scaling.type")
    if "rope_freqs.weight" in names:
        _llama3(config, reader, scaling)
    elif scaling and scaling != "none":
        factor = decimal(field(reader, "llama.rope.scaling.factor", 1.0))
        config["rope_scaling"] = {"rope_type": scaling, "factor": factor}


def _llama3(config: dict, reader: Any, scaling: str | None) -> None:
    """llama3 RoPE (Llama 3.1+) from its per-frequency divisors (`gguf_llama3.py`)."""
    from gguf.quants import dequantize

    from slipstream.checkpoint.gguf_llama3 import llama3_rope_scaling

    if scaling not in (None, "none"):  # llama.cpp would apply both
        raise ValueError(
            f"GGUF llama with rope_freqs and rope scaling type {scaling!r}: not a transformers "
            "model (llama3 RoPE has no other scaling on top)."
        )
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    original = field(reader, "llama.rope.scaling.original_context_length")
    rope = llama3_rope_scaling(
        dequantize(t.data, t.tensor_type),
        config["rope_theta"],
        config["head_dim"],
        config["max_position_embeddings"],
        int(original) if original is not None else None,
    )
    if rope is not None:
        config["rope_scaling"] = rope


def _experts(reader: Any, arch: str) -> dict:
    p = arch + "."
    return {
        "num_experts": int(field(reader, p + "expert_count")),
        "num_experts_per_tok": int(field(reader, p + "expert_used_count")),
        "expert_width": int(field(reader, p + "expert_feed_forward_length")),
    }


def _gpt_oss(config: dict, reader: Any) -> None:
    p = "gpt-oss."
    experts = _experts(reader, "gpt-oss")
    config.update(
        num_local_experts=experts["num_experts"],
        num_experts_per_tok=experts["num_experts_per_tok"],
        intermediate_size=experts["expert_width"],
        sliding_window=int(field(reader, p + "attention.sliding_window", 128)),
        swiglu_limit=7.0,  # llama.cpp's, fixed in code (gguf_arch.check_supported)
        attention_bias=True,
    )
    # llama.cpp: every other layer sliding, the first one included (transformers' default).
    L = config["num_hidden_layers"]
    config["layer_types"] = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)
    ]
    kind = field(reader, p + "rope.scaling.type")
    if kind not in (None, "none", "yarn"):
        raise ValueError(f"GGUF gpt-oss with rope scaling {kind!r}: only yarn is supported.")
    rope = {"rope_type": "default"}
    if kind == "yarn":
        rope = {
            "rope_type": "yarn",
            "factor": decimal(field(reader, p + "rope.scaling.factor")),
            "original_max_position_embeddings": int(
                field(reader, p + "rope.scaling.original_context_length")
            ),
            "beta_fast": decimal(field(reader, p + "rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": decimal(field(reader, p + "rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,  # the published models' (llama.cpp does not truncate)
        }
        attention = field(reader, p + "rope.scaling.yarn_attn_factor")
        if attention is not None:
            rope["attention_factor"] = decimal(attention)
    config["rope_scaling"] = rope  # with rope_theta: transformers 4.x's keys, which 5.x converts


def _phi3(config: dict, reader: Any) -> None:
    p = "phi3."
    rotary = field(reader, p + "rope.dimension_count")
    if rotary is not None:
        config["partial_rotary_factor"] = int(rotary) / config["head_dim"]
    window = int(field(reader, p + "attention.sliding_window", 0))
    config["sliding_window"] = window or None  # 0: none (llama.cpp's rule)
    original = field(reader, p + "rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = int(original)
    factors = {t.name: t for t in reader.tensors if t.name in CONFIG_TENSORS}
    if factors:
        long, short = (
            [decimal(x) for x in np.asarray(factors[f"rope_factors_{k}.weight"].data)]
            for k in ("long", "short")
        )
        config["rope_scaling"] = {"type": "longrope", "long_factor": long, "short_factor": short}
        # Kept only where it is not the one transformers derives (max / original lengths).
        from slipstream.models.phi3 import Phi3Rope

        attention = field(reader, p + "rope.scaling.attn_factor")
        derived = Phi3Rope.from_hf(config).attention_factor
        if attention is not None and np.float32(attention) != np.float32(derived):
            config["rope_scaling"]["attention_factor"] = decimal(attention)


def _gemma3(config: dict, reader: Any) -> None:
    p = "gemma3."
    # llama.cpp scales queries by 1/sqrt(head_dim) (the 62-layer 27B by 1/sqrt(D/H)).
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    heads = config["num_attention_heads"]
    config["query_pre_attn_scalar"] = hidden // heads if layers == 62 else config["head_dim"]
    local = field(reader, p + "rope.freq_base_swa")
    if local is not None:
        config["rope_local_base_freq"] = decimal(local)
    window = field(reader, p + "attention.sliding_window")
    if window is not None:
        config["sliding_window"] = int(window)
    factor = field(reader, p + "rope.scaling.factor")
    if factor is not None and decimal(factor) != 1.0:
        config["rope_scaling"] = {"rope_type": "linear", "factor": decimal(factor)}


def _complete(config: dict) -> dict:
    """The config with transformers' defaults for its model type (what config.json holds)."""
    import transformers

    full = transformers.AutoConfig.for_model(**config)
    return {**full.to_dict(), "model_type": config["model_type"]}
