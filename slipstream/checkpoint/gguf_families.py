"""Each family's GGUF spec (`GGUFSpec`, gguf_spec.py): everything family-specific about its
llama.cpp form, export and import side by side. A new family is one spec here and its line in
SPECS.

- llama/mistral: Q and K rows permuted so each head's rotary pairs are interleaved (llama.cpp
  runs this architecture with GPT-J-style RoPE; HF rotates halves); llama3 RoPE as the
  `rope_freqs` divisors (and original_max_position_embeddings as
  `rope.scaling.original_context_length`, which llama.cpp reads for yarn only: import takes
  it to rebuild the same config, `gguf_llama3.py`).
- mistral3: Mistral 3's language model (model.language_model) as llama.cpp's mistral3 (llama's
  layout; export only, its vision side goes to the mmproj); a Ministral 3 one with YaRN's keys,
  its mscale_all_dim as `rope.scaling.yarn_log_multiplier` and Llama 4's attention temperature
  beta as `attention.temperature_scale`.
- gemma3: RMSNorm weights stored as 1 + w (HF's Gemma3RMSNorm adds the 1 at run time).
- qwen3_moe: one (E, F, D) tensor per expert projection (HF names one matrix per expert:
  stacked as they come by `gguf_arch.gguf_tensors`, split again on import).
- gpt_oss: gate/up de-interleaved and every expert matrix transposed to (E, out, in).
- phi3: longrope's factor sets as `rope_factors_long/short`.

What llama.cpp fixes in code rather than in the file comes back on import from the spec
(gpt-oss's SwiGLU clamp 7.0 and alternating sliding layers; qwen3moe's renormalised top-k;
Gemma 3's query scale 1/sqrt(head_dim)), and export refuses a config that differs from it.
No torch import at module level (gguf_spec.py says why).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from slipstream.checkpoint.gguf_fields import decimal, field
from slipstream.checkpoint.gguf_gemma4 import GEMMA4
from slipstream.checkpoint.gguf_qwen35 import QWEN35, QWEN35MOE
from slipstream.checkpoint.gguf_qwen_vl import QWEN2VL, QWEN3VL
from slipstream.checkpoint.gguf_spec import (
    GGUFSpec,
    TensorTransform,
    rope_metadata,
    rotary_rows,
    text_hf,
)

# Tensors that are configuration, not weights (read into the config, skipped as weights).
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")


# ----------------------------------------------------------------------------- shared parts


def check_layer_types(cfg: Any, hf: dict, every: int) -> None:
    """llama.cpp fixes which layers are full attention: every n-th, counting from 1."""
    L = cfg.num_hidden_layers
    fixed = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(L)]
    types = list(getattr(cfg, "layer_types", None) or hf.get("layer_types") or fixed)
    if types != fixed:
        raise ValueError(
            f"GGUF export: {cfg.model_type} with layer_types {types}: llama.cpp makes every "
            f"{every}th layer full attention and the others sliding, so it would compute another "
            "model."
        )


def _experts_metadata(w: Any, hf: dict, width: int) -> None:
    from slipstream.models.moe_block import num_experts_from_hf

    w.add_expert_count(num_experts_from_hf(hf))
    w.add_expert_used_count(int(hf["num_experts_per_tok"]))
    w.add_expert_feed_forward_length(int(width))


def _experts(reader: Any, arch: str) -> dict:
    p = arch + "."
    return {
        "num_experts": int(field(reader, p + "expert_count")),
        "num_experts_per_tok": int(field(reader, p + "expert_used_count")),
        "expert_width": int(field(reader, p + "expert_feed_forward_length")),
    }


def _attention_bias(config: dict, reader: Any, names: set[str]) -> None:
    config["attention_bias"] = "blk.0.attn_q.bias" in names


def _same(cfg: Any, name: str, parts: list[Any]) -> Iterator[tuple[str, Any]]:
    yield name, parts[0]


# ----------------------------------------------------------------------------- llama


def _llama_config(config: dict, reader: Any, names: set[str]) -> None:
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


LLAMA = GGUFSpec(
    "LLAMA",
    "llama",
    ("llama", "mistral"),  # llama.cpp runs Mistral 7B as llama (no sliding window: see docs)
    read_config=_llama_config,
    complete=False,
    transforms=(
        rotary_rows(("q_proj.weight", "q_proj.bias"), lambda cfg: cfg.num_attention_heads),
        rotary_rows(("k_proj.weight", "k_proj.bias"), lambda cfg: cfg.num_key_value_heads),
    ),
    pre_tokenizer="llama-bpe",
)


def _mistral3_check(cfg: Any, hf: dict) -> None:
    """Mistral 3's language model as llama.cpp's mistral3 graph runs it: a Mistral decoder
    (llama's, Q/K permuted the same way) with plain RoPE, or a Ministral 3 one
    (`_ministral3_check`); no sliding window."""
    kind = hf.get("model_type")
    if kind == "ministral3":
        _ministral3_check(cfg.rope, hf)
    elif kind != "mistral":
        raise ValueError(
            f"GGUF export: mistral3 with a {kind!r} language model: only a Mistral or "
            "Ministral 3 one is written here."
        )
    elif cfg.rope.rope_type != "default":
        raise ValueError(
            f"GGUF export: mistral3 with {cfg.rope.rope_type} RoPE scaling: llama.cpp's "
            "mistral3 is written here with plain RoPE only (or Ministral 3's yarn)."
        )
    window, longest = hf.get("sliding_window"), int(hf.get("max_position_embeddings") or 0)
    if window and int(window) < longest:
        raise ValueError(
            f"GGUF export: mistral3 with sliding_window {window} < max_position_embeddings "
            f"{longest}: llama.cpp's mistral3 attends to the whole context."
        )


def _ministral3_beta(hf: dict) -> Any:
    """Ministral 3's attention temperature beta (rope_parameters' llama_4_scaling_beta)."""
    return {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}.get(
        "llama_4_scaling_beta"
    )


def _ministral3_check(rope: Any, hf: dict) -> None:
    """Ministral 3 (transformers' ministral3): YaRN RoPE, and queries at position p scaled by
    1 + beta * log(1 + floor(p / original_max_position_embeddings)) after RoPE, as llama.cpp's
    mistral3 does (attention.temperature_scale, its floor the YaRN original context). llama.cpp
    computes YaRN's attention factor as get_mscale(factor) / get_mscale(factor, log_mul) with
    mscale 1, and rounds the ramp's ends (transformers' truncate)."""
    differs = None
    if rope.rope_type != "yarn":  # llama.cpp's converter asserts yarn for ministral3 too
        differs = f"{rope.rope_type} RoPE (llama.cpp's converter: yarn only)"
    elif _ministral3_beta(hf) is None:
        differs = "no llama_4_scaling_beta (transformers' ministral3 needs it)"
    elif rope.attention_factor is not None:
        differs = (f"attention_factor {rope.attention_factor} (llama.cpp's mistral3 computes "
                   "it from factor and mscale_all_dim)")  # fmt: skip
    elif rope.mscale and rope.mscale_all_dim and rope.mscale != 1:
        differs = f"mscale {rope.mscale} (llama.cpp's mistral3 takes 1)"
    elif not rope.truncate:
        differs = "truncate=false (llama.cpp rounds YaRN's correction range)"
    if differs:
        raise ValueError(
            f"GGUF export: mistral3 with a ministral3 language model with {differs}: llama.cpp "
            "would compute another model."
        )


def _mistral3_metadata(w: Any, cfg: Any, hf: dict) -> None:
    """RoPE's keys (yarn's for Ministral 3); Ministral 3's mscale_all_dim and temperature beta
    as llama.cpp's converter writes them. (llama-cpp-python's Llama() replaces the file's YaRN
    betas by 32 and 1 unless given yarn_beta_fast=yarn_beta_slow=-1; llama-cli reads them.)"""
    rope_metadata(w, cfg, hf)
    if hf.get("model_type") != "ministral3":
        return
    if cfg.rope.mscale and cfg.rope.mscale_all_dim:  # else transformers' get_mscale(factor)
        w.add_rope_scaling_yarn_log_mul(float(cfg.rope.mscale_all_dim))
    w.add_attn_temperature_scale(float(_ministral3_beta(hf)))


# Mistral 3's language model (model.language_model: IMAGE_TEXT_LM): llama.cpp's mistral3, as
# its converter writes Mistral3ForConditionalGeneration. Export only, as qwen2vl. Its
# checkpoints ship Mistral's Tekken BPE tokenizer: llama.cpp's "tekken" pre-tokenizer.
MISTRAL3 = GGUFSpec(
    "MISTRAL3", "mistral3", ("mistral3",), check=_mistral3_check,
    write_metadata=_mistral3_metadata, transforms=LLAMA.transforms, pre_tokenizer="tekken",
)  # fmt: skip

# ----------------------------------------------------------------------------- qwen


def _qwen3_moe_check(cfg: Any, hf: dict) -> None:
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


def _qwen3_moe_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_metadata(w, cfg, hf)
    _experts_metadata(w, hf, hf["moe_intermediate_size"])


def _qwen3_moe_config(config: dict, reader: Any, names: set[str]) -> None:
    config.update(_experts(reader, "qwen3moe"), norm_topk_prob=True, decoder_sparse_step=1)
    config["moe_intermediate_size"] = config.pop("expert_width")


def _unstack_experts(cfg: Any, name: str, parts: list[Any]) -> Iterator[tuple[str, Any]]:
    w = parts[0]  # (E, F, D) -> E tensors named per expert, as the hub checkpoints
    prefix, _, proj = name.removesuffix(".weight").rpartition(".")
    for e in range(w.shape[0]):
        yield f"{prefix}.{e}.{proj}.weight", w[e]


QWEN2 = GGUFSpec("QWEN2", "qwen2", ("qwen2",), pre_tokenizer="qwen2")
QWEN3 = GGUFSpec("QWEN3", "qwen3", ("qwen3",), read_config=_attention_bias, pre_tokenizer="qwen2")
QWEN3MOE = GGUFSpec(
    "QWEN3MOE",
    "qwen3moe",
    ("qwen3_moe",),
    check=_qwen3_moe_check,
    write_metadata=_qwen3_moe_metadata,
    read_config=_qwen3_moe_config,
    transforms=(
        TensorTransform(  # stacked by gguf_arch.gguf_tensors as the per-expert tensors come
            (
                "mlp.experts.gate_proj.weight",
                "mlp.experts.up_proj.weight",
                "mlp.experts.down_proj.weight",
            ),
            lambda cfg, name, t: [(name, t)],
            _unstack_experts,
        ),
    ),  # fmt: skip
    pre_tokenizer="qwen2",
)

# ----------------------------------------------------------------------------- phi3


def _phi3_metadata(w: Any, cfg: Any, hf: dict) -> None:
    from slipstream.models.phi3 import Phi3Rope

    rope = Phi3Rope.from_hf(hf)
    w.add_rope_freq_base(float(rope.theta))
    w.add_rope_dimension_count(rope.rotary_dim)
    w.add_rope_scaling_orig_ctx_len(int(rope.original_max))
    w.add_sliding_window(int(hf.get("sliding_window") or 0))  # 0: none (llama.cpp's rule)
    if rope.long_factor is not None:
        w.add_rope_scaling_attn_factors(float(rope.attention_factor))


def _phi3_tensors(cfg: Any) -> Iterator[tuple[str, Any]]:
    """longrope's factor sets, which llama.cpp wants as tensors."""
    import gguf
    import torch

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


def _phi3_config(config: dict, reader: Any, names: set[str]) -> None:
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


PHI3 = GGUFSpec("PHI3", "phi3", ("phi3",), write_metadata=_phi3_metadata,
                extra_tensors=_phi3_tensors, read_config=_phi3_config)  # fmt: skip

# ----------------------------------------------------------------------------- gemma3


def _gemma3_check(cfg: Any, hf: dict) -> None:
    scalar, hd = float(cfg.query_pre_attn_scalar), cfg.head_dim
    if scalar != hd and not (
        cfg.num_hidden_layers == 62 and scalar * cfg.num_attention_heads == cfg.hidden_size
    ):
        raise ValueError(
            f"GGUF export: gemma3 with query_pre_attn_scalar={scalar:g} != head_dim={hd}: "
            "llama.cpp scales queries by 1/sqrt(head_dim) (27B excepted), so it would "
            "compute another model."
        )
    check_layer_types(cfg, hf, 6)


def _gemma3_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_metadata(w, cfg, hf)
    w.add_rope_freq_base_swa(float(cfg.local_rope.theta))
    if cfg.sliding_window:
        w.add_sliding_window(int(cfg.sliding_window))


def _gemma3_config(config: dict, reader: Any, names: set[str]) -> None:
    _attention_bias(config, reader, names)
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


GEMMA3 = GGUFSpec(
    "GEMMA3",
    "gemma3",
    ("gemma3_text", "gemma3"),  # gemma3: the text model of the multimodal checkpoint
    check=_gemma3_check,
    write_metadata=_gemma3_metadata,
    read_config=_gemma3_config,
    transforms=(
        TensorTransform(
            ("norm.weight",),
            lambda cfg, name, t: [(name, t.float() + 1.0)],
            lambda cfg, name, parts: iter([(name, parts[0] - 1.0)]),
        ),
    ),
)

# ----------------------------------------------------------------------------- gpt-oss


def _gpt_oss_check(cfg: Any, hf: dict) -> None:
    check_layer_types(cfg, hf, 2)
    limit = hf.get("swiglu_limit", 7.0)
    if float(limit) != 7.0:
        raise ValueError(
            f"GGUF export: gpt_oss with swiglu_limit={limit}: llama.cpp fixes the expert "
            "SwiGLU clamp at 7.0 (the published models'), so it would compute another model."
        )


def _gpt_oss_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_metadata(w, cfg, hf)
    _experts_metadata(w, hf, hf["intermediate_size"])
    w.add_sliding_window(int(hf.get("sliding_window") or 128))


def _gpt_oss_config(config: dict, reader: Any, names: set[str]) -> None:
    p = "gpt-oss."
    experts = _experts(reader, "gpt-oss")
    config.update(
        num_local_experts=experts["num_experts"],
        num_experts_per_tok=experts["num_experts_per_tok"],
        intermediate_size=experts["expert_width"],
        sliding_window=int(field(reader, p + "attention.sliding_window", 128)),
        swiglu_limit=7.0,  # llama.cpp's, fixed in code (refused otherwise by _gpt_oss_check)
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


def _split_gate_up(cfg: Any, name: str, t: Any) -> list[tuple[str, Any]]:
    w = t.transpose(-1, -2)  # (E, D, 2I) -> (E, 2I, D), gate at even rows
    base = name.removesuffix("gate_up_proj")
    return [(base + "gate_proj.weight", w[:, 0::2].contiguous()),
            (base + "up_proj.weight", w[:, 1::2].contiguous())]  # fmt: skip


def _join_gate_up(cfg: Any, name: str, parts: list[Any]) -> Iterator[tuple[str, Any]]:
    import torch

    gate, up = parts  # (E, I, D) each -> (E, D, 2I), gate at even columns
    yield name, torch.stack((gate, up), dim=2).flatten(1, 2).transpose(1, 2).contiguous()


def _split_gate_up_bias(cfg: Any, name: str, t: Any) -> list[tuple[str, Any]]:
    base = name.removesuffix("gate_up_proj_bias")
    return [(base + "gate_proj.bias", t[:, 0::2].contiguous()),
            (base + "up_proj.bias", t[:, 1::2].contiguous())]  # fmt: skip


def _join_gate_up_bias(cfg: Any, name: str, parts: list[Any]) -> Iterator[tuple[str, Any]]:
    import torch

    yield name, torch.stack(parts, dim=2).flatten(1, 2)  # (E, I) x 2 -> (E, 2I)


GPT_OSS = GGUFSpec(
    "GPT_OSS",
    "gpt-oss",
    ("gpt_oss",),
    check=_gpt_oss_check,
    write_metadata=_gpt_oss_metadata,
    read_config=_gpt_oss_config,
    transforms=(
        TensorTransform(("self_attn.sinks",), lambda cfg, name, t: [(name + ".weight", t)], _same),
        TensorTransform(("mlp.experts.gate_up_proj",), _split_gate_up, _join_gate_up),
        TensorTransform(
            ("mlp.experts.gate_up_proj_bias",), _split_gate_up_bias, _join_gate_up_bias
        ),
        TensorTransform(  # (E, I, D) -> (E, D, I) and back
            ("mlp.experts.down_proj",),
            lambda cfg, name, t: [(name + ".weight", t.transpose(-1, -2).contiguous())],
            lambda cfg, name, parts: iter([(name, parts[0].transpose(1, 2).contiguous())]),
        ),
        TensorTransform(
            ("mlp.experts.down_proj_bias",),
            lambda cfg, name, t: [(name.removesuffix("_bias") + ".bias", t)],
            _same,
        ),
    ),
    pre_tokenizer="gpt-4o",
)

SPECS = (LLAMA, QWEN2, QWEN3, QWEN3MOE, PHI3, GEMMA3, GPT_OSS)
# Language models of image-text types: gguf_qwen_vl.py, gguf_qwen35.py, gguf_gemma4.py,
# MISTRAL3 above
EXPORT_ONLY = (QWEN2VL, QWEN3VL, QWEN35, QWEN35MOE, MISTRAL3, GEMMA4)
BY_MODEL_TYPE = {t: spec for spec in (*SPECS, *EXPORT_ONLY) for t in spec.model_types}
BY_ARCH = {spec.name: spec for spec in SPECS}  # a file's general.architecture: what import reads
