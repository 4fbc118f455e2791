"""GGUF metadata -> a Hugging Face config.json dict, for every llama.cpp architecture we export.

The inverse of `gguf_arch.write_metadata` (and of what llama.cpp's converter writes for these
architectures): hyperparameters under `{arch}.*` keys, special token ids under
`tokenizer.ggml.*`, tied embeddings when there is no `output.weight`; the rest is the family's
`GGUFSpec.read_config` (gguf_families.py): what llama.cpp fixes in code rather than in the
file, and config it keeps as tensors (Phi-3's longrope factor sets, llama3 RoPE's divisors).

Non-llama configs are completed with transformers' defaults for the model type
(`AutoConfig.for_model`), so the dict is what a config.json of that family holds.
"""

from __future__ import annotations

from typing import Any

from slipstream.checkpoint.gguf_families import BY_ARCH
from slipstream.checkpoint.gguf_fields import decimal, field

# llama.cpp architecture -> our model_type.
MODEL_TYPES = {name: spec.model_type for name, spec in BY_ARCH.items()}


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
    spec = BY_ARCH[arch]
    spec.read_config(config, reader, names)
    return _complete(config) if spec.complete else config


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


def _complete(config: dict) -> dict:
    """The config with transformers' defaults for its model type (what config.json holds)."""
    import transformers

    full = transformers.AutoConfig.for_model(**config)
    return {**full.to_dict(), "model_type": config["model_type"]}
