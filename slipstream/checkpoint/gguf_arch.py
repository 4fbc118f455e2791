"""What a model family becomes in llama.cpp: its GGUF architecture, metadata and tensors.

Names come from the `gguf` package's own tables (`gguf.get_tensor_name_map(arch, n_blocks)`,
the `MODEL_ARCH` enum and `GGUFWriter.add_*` keys); here we only say which architecture a
family is and reshape the tensors where llama.cpp's layout differs from Hugging Face's:

- llama/mistral: Q and K rows permuted so each head's rotary pairs are interleaved (llama.cpp
  runs this architecture with GPT-J-style RoPE; HF rotates halves).
- gemma3: RMSNorm weights stored as 1 + w (HF's Gemma3RMSNorm adds the 1 at run time).
- qwen3_moe: one (E, F, D) tensor per expert projection (HF names one matrix per expert).
- gpt_oss: gate/up de-interleaved and every expert matrix transposed to (E, out, in).
- llama3 RoPE: the per-frequency scale factors as the `rope_freqs` tensor (and
  original_max_position_embeddings as `rope.scaling.original_context_length`, which llama.cpp
  reads for yarn only: import takes it to rebuild the same config, `gguf_llama3.py`); phi3
  longrope: `rope_factors_long/short`.

Every function takes the merged model's HF-named tensors (what `export_merged` writes), one
at a time; only a MoE layer's experts are held together until the layer is complete.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

# model_type -> llama.cpp architecture (gguf.MODEL_ARCH member name).
ARCHS = {
    "llama": "LLAMA",
    "mistral": "LLAMA",  # llama.cpp runs Mistral 7B as llama (no sliding window: see docs)
    "qwen2": "QWEN2",
    "qwen3": "QWEN3",
    "qwen3_moe": "QWEN3MOE",
    "phi3": "PHI3",
    "gemma3_text": "GEMMA3",
    "gemma3": "GEMMA3",  # the text model of the multimodal checkpoint
    "gpt_oss": "GPT_OSS",
}
# llama.cpp's BPE pre-tokenizer names (its vocab loader refuses names it does not know) for
# the tokenizers these families ship; others get "default" (GPT-2 rules).
PRE_TOKENIZER = {"LLAMA": "llama-bpe", "QWEN2": "qwen2", "QWEN3": "qwen2", "QWEN3MOE": "qwen2",
                 "GPT_OSS": "gpt-4o"}  # fmt: skip
PER_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def gguf_arch(model_type: str) -> Any:
    """The gguf.MODEL_ARCH of a family, or a one-line error naming the supported ones."""
    import gguf

    if model_type not in ARCHS:
        raise ValueError(
            f"GGUF export: model_type {model_type!r} has no llama.cpp architecture here; "
            f"supported: {', '.join(sorted(ARCHS))}."
        )
    return gguf.MODEL_ARCH[ARCHS[model_type]]


def text_hf(cfg: Any) -> dict:
    """config.json of the language model (a multimodal Gemma 3's text_config)."""
    hf = cfg.hf
    if cfg.model_type == "gemma3":
        return {**hf.get("text_config", {}), "model_type": "gemma3_text"}
    return hf


def check_supported(cfg: Any) -> None:
    """Refuse what llama.cpp would run differently from us (one line: what and why)."""
    hf = text_hf(cfg)
    kind = cfg.model_type
    if kind in ("gemma3", "gemma3_text"):
        scalar, hd = float(cfg.query_pre_attn_scalar), cfg.head_dim
        if scalar != hd and not (
            cfg.num_hidden_layers == 62 and scalar * cfg.num_attention_heads == cfg.hidden_size
        ):
            raise ValueError(
                f"GGUF export: gemma3 with query_pre_attn_scalar={scalar:g} != head_dim={hd}: "
                "llama.cpp scales queries by 1/sqrt(head_dim) (27B excepted), so it would "
                "compute another model."
            )
    _check_layer_types(cfg, hf)
    if kind == "gpt_oss":
        limit = hf.get("swiglu_limit", 7.0)
        if float(limit) != 7.0:
            raise ValueError(
                f"GGUF export: gpt_oss with swiglu_limit={limit}: llama.cpp fixes the expert "
                "SwiGLU clamp at 7.0 (the published models'), so it would compute another model."
            )
    if kind == "qwen3_moe":
        from slipstream.models.qwen3_moe import sparse_layers

        if not all(sparse_layers(cfg)):
            raise ValueError(
                "GGUF export: qwen3_moe with dense layers (mlp_only_layers/decoder_sparse_step):"
                " llama.cpp's qwen3moe expects a MoE block in every layer."
            )
        if not hf.get("norm_topk_prob", False):
            raise ValueError(
                "GGUF export: qwen3_moe with norm_topk_prob=false: llama.cpp's qwen3moe "
                "always renormalises the top-k router weights."
            )


# llama.cpp fixes which layers are full attention: every n-th, counting from 1.
FULL_EVERY = {"gemma3": 6, "gemma3_text": 6, "gpt_oss": 2}


def _check_layer_types(cfg: Any, hf: dict) -> None:
    n = FULL_EVERY.get(cfg.model_type)
    if n is None:
        return
    L = cfg.num_hidden_layers
    fixed = ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(L)]
    types = list(getattr(cfg, "layer_types", None) or hf.get("layer_types") or fixed)
    if types != fixed:
        raise ValueError(
            f"GGUF export: {cfg.model_type} with layer_types {types}: llama.cpp makes every "
            f"{n}th layer full attention and the others sliding, so it would compute another "
            "model."
        )


def write_metadata(w: Any, cfg: Any, arch: Any) -> None:
    """Hyperparameters under llama.cpp's keys (`GGUFWriter.add_*`), as its converter writes them."""
    hf = text_hf(cfg)
    name = ARCHS.get(cfg.model_type)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(int(hf.get("max_position_embeddings") or 4096))
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    if name == "PHI3":
        _phi3_metadata(w, cfg, hf)
        return
    rope = cfg.rope
    w.add_rope_freq_base(float(rope.theta))
    w.add_rope_dimension_count(cfg.head_dim)
    if rope.rope_type == "linear":
        w.add_rope_scaling_type(_rope_type("LINEAR"))
        w.add_rope_scaling_factor(float(rope.factor))
    elif rope.rope_type == "yarn":
        w.add_rope_scaling_type(_rope_type("YARN"))
        w.add_rope_scaling_factor(float(rope.factor))
        w.add_rope_scaling_orig_ctx_len(int(rope.original_max_position_embeddings))
        w.add_rope_scaling_yarn_beta_fast(float(rope.beta_fast))
        w.add_rope_scaling_yarn_beta_slow(float(rope.beta_slow))
        if rope.attention_factor is not None:
            w.add_rope_scaling_yarn_attn_factor(float(rope.attention_factor))
    elif rope.rope_type == "llama3":  # the divisors are the rope_freqs tensor; this key picks
        # which of the configs computing them comes back on import (llama.cpp reads it for yarn)
        w.add_rope_scaling_orig_ctx_len(int(rope.original_max_position_embeddings))
    if name == "GEMMA3":
        w.add_rope_freq_base_swa(float(cfg.local_rope.theta))
        if cfg.sliding_window:
            w.add_sliding_window(int(cfg.sliding_window))
    if name in ("QWEN3MOE", "GPT_OSS"):
        from slipstream.models.moe_block import num_experts_from_hf

        w.add_expert_count(num_experts_from_hf(hf))
        w.add_expert_used_count(int(hf["num_experts_per_tok"]))
        width = hf["moe_intermediate_size"] if name == "QWEN3MOE" else hf["intermediate_size"]
        w.add_expert_feed_forward_length(int(width))
    if name == "GPT_OSS":
        w.add_sliding_window(int(hf.get("sliding_window") or 128))


def _rope_type(member: str) -> Any:
    import gguf

    return gguf.RopeScalingType[member]


def _phi3_metadata(w: Any, cfg: Any, hf: dict) -> None:
    from slipstream.models.phi3 import Phi3Rope

    rope = Phi3Rope.from_hf(hf)
    w.add_rope_freq_base(float(rope.theta))
    w.add_rope_dimension_count(rope.rotary_dim)
    w.add_rope_scaling_orig_ctx_len(int(rope.original_max))
    w.add_sliding_window(int(hf.get("sliding_window") or 0))  # 0: none (llama.cpp's rule)
    if rope.long_factor is not None:
        w.add_rope_scaling_attn_factors(float(rope.attention_factor))


def extra_tensors(cfg: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors llama.cpp wants that HF derives from config.json (RoPE factors)."""
    import gguf

    name = ARCHS.get(cfg.model_type)
    if name == "PHI3":
        from slipstream.models.phi3 import Phi3Rope

        rope = Phi3Rope.from_hf(text_hf(cfg))
        if rope.long_factor is not None:
            yield (
                gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight",
                torch.tensor(rope.long_factor, dtype=torch.float32),
            )
            yield (
                gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight",
                torch.tensor(rope.short_factor, dtype=torch.float32),
            )
    elif cfg.rope.rope_type == "llama3":
        from dataclasses import replace

        from slipstream.models.rope import rope_inv_freq

        plain, _ = rope_inv_freq(replace(cfg.rope, rope_type="default"), cfg.head_dim)
        scaled, _ = rope_inv_freq(cfg.rope, cfg.head_dim)
        # llama.cpp divides each frequency by its factor: factor = plain / scaled.
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", plain / scaled


def hf_named_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors under transformers' text-model names (no vision tower):
    the family's weight map (models/weights.py) without a multimodal layout's prefixes."""
    from slipstream.models import weight_map

    yield from weight_map(model.config).hf_state(model)


def gguf_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(llama.cpp name, tensor in llama.cpp's layout), one at a time, float32 or model dtype."""
    import gguf

    cfg = model.config
    arch = gguf_arch(cfg.model_type)
    kind = ARCHS[cfg.model_type]
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    experts: dict[str, dict[int, torch.Tensor]] = {}
    num_experts = getattr(cfg, "num_experts", None) or _num_experts(cfg)

    def rename(hf_name: str) -> str:
        out = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if out is None:
            raise ValueError(f"GGUF export: no llama.cpp name for tensor {hf_name!r} ({kind}).")
        return out

    yield from extra_tensors(cfg)
    for name, t in hf_named_tensors(model):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        m = PER_EXPERT.match(name)
        if m is not None:  # qwen3_moe: stack a layer's experts once all have come
            key = f"{m.group(1)}.{m.group(3)}.weight"
            experts.setdefault(key, {})[int(m.group(2))] = t
            if len(experts[key]) == num_experts:
                parts = experts.pop(key)
                yield rename(key), torch.stack([parts[e] for e in range(num_experts)])
            continue
        yield from to_llama_cpp(kind, cfg, name, t, rename)
    assert not experts, f"incomplete experts: {sorted(experts)[:3]}"


def _num_experts(cfg: Any) -> int:
    from slipstream.models.moe_block import num_experts_from_hf

    try:
        return num_experts_from_hf(text_hf(cfg))
    except (KeyError, ValueError, TypeError):
        return 0


def to_llama_cpp(
    kind: str, cfg: Any, name: str, t: torch.Tensor, rename
) -> Iterator[tuple[str, Any]]:
    """(llama.cpp name, tensor) for one HF tensor (gguf.py's `to_hf` is the inverse)."""
    if kind == "LLAMA" and name.endswith(("q_proj.weight", "q_proj.bias")):
        yield rename(name), permute_rotary(t, cfg.num_attention_heads)
    elif kind == "LLAMA" and name.endswith(("k_proj.weight", "k_proj.bias")):
        yield rename(name), permute_rotary(t, cfg.num_key_value_heads)
    elif kind == "GEMMA3" and name.endswith("norm.weight"):
        yield rename(name), t.float() + 1.0
    elif kind == "GPT_OSS" and name.endswith("self_attn.sinks"):
        yield rename(name + ".weight"), t
    elif kind == "GPT_OSS" and name.endswith("mlp.experts.gate_up_proj"):
        w = t.transpose(-1, -2)  # (E, D, 2I) -> (E, 2I, D), gate at even rows
        base = name.removesuffix("gate_up_proj")
        yield rename(base + "gate_proj.weight"), w[:, 0::2].contiguous()
        yield rename(base + "up_proj.weight"), w[:, 1::2].contiguous()
    elif kind == "GPT_OSS" and name.endswith("mlp.experts.gate_up_proj_bias"):
        base = name.removesuffix("gate_up_proj_bias")
        yield rename(base + "gate_proj.bias"), t[:, 0::2].contiguous()
        yield rename(base + "up_proj.bias"), t[:, 1::2].contiguous()
    elif kind == "GPT_OSS" and name.endswith("mlp.experts.down_proj"):
        yield rename(name + ".weight"), t.transpose(-1, -2).contiguous()  # (E, I, D) -> (E, D, I)
    elif kind == "GPT_OSS" and name.endswith("mlp.experts.down_proj_bias"):
        yield rename(name.removesuffix("_bias") + ".bias"), t
    elif name.endswith("mlp.experts.gate_up_proj"):  # fused (E, 2F, D): gate rows first
        half = t.shape[1] // 2
        base = name.removesuffix("gate_up_proj")
        yield rename(base + "gate_proj.weight"), t[:, :half]
        yield rename(base + "up_proj.weight"), t[:, half:]
    elif name.endswith("mlp.experts.down_proj"):
        yield rename(name + ".weight"), t
    else:
        yield rename(name), t


def permute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF's rotate-half rows -> llama.cpp's interleaved pairs, per head (inverse of import)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
