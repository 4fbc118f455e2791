"""GGUF export specs of model types built by transformers' modeling code (the generic family,
models/generic.py), where llama.cpp knows the architecture: export only (import builds native
families). The tensors are transformers' own module tree's (`GenericCausalLM`'s names), which
the `gguf` package's name tables map as llama.cpp's converter does; config comes from
config.json (the generic model's `cfg.rope` is a placeholder: transformers' rotary runs).

- olmo2: llama.cpp's OLMO2 (NeoX RoPE: no Q/K permutation; post-attention and post-MLP norms,
  full-width q/k norms), as its converter writes it.
- mixtral: llama.cpp runs Mixtral as llama with experts: Q and K rows permuted per head (as
  native llama), the stacked experts split into gate/up (FUSED_EXPERTS), the router kept f32.

- qwen2_moe: llama.cpp's QWEN2MOE: the experts split as Mixtral's, the shared expert and its
  sigmoid gate (`ffn_*_shexp`, `ffn_gate_inp_shexp`); llama.cpp does not renormalise the
  top-k router weights (transformers' default, norm_topk_prob=false; true is refused).

A model type with no spec here is a one-line refusal naming it (gguf_arch.spec_for).
No torch import at module level (gguf_spec.py says why).
"""

from __future__ import annotations

from typing import Any

from slipstream.checkpoint.gguf_spec import GGUFSpec, TensorTransform, rotary_rows


def _no_tensors(cfg: Any):
    return iter(())


def rope_from_hf(w: Any, cfg: Any, hf: dict) -> None:
    """RoPE base and rotary dims from config.json (transformers 5's `rope_parameters`, or
    4.x's `rope_theta`/`rope_scaling`); scaled RoPE is refused (not mapped here yet)."""
    params = hf.get("rope_parameters") or {
        **(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10000.0),
    }  # fmt: skip
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise ValueError(
            f"GGUF export: {cfg.model_type} with rope_type {kind!r}: only unscaled RoPE is "
            "written for a model built by transformers' modeling code."
        )
    w.add_rope_freq_base(float(params.get("rope_theta", 10000.0)))
    rotary = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(int(cfg.head_dim * rotary))


def _mixtral_check(cfg: Any, hf: dict) -> None:
    if hf.get("sliding_window"):
        raise ValueError(
            f"GGUF export: mixtral with sliding_window={hf['sliding_window']}: llama.cpp runs "
            "Mixtral as llama, with full attention, so it would compute another model."
        )


def _mixtral_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_from_hf(w, cfg, hf)
    w.add_expert_count(int(hf["num_local_experts"]))
    w.add_expert_used_count(int(hf["num_experts_per_tok"]))


def _qwen2_moe_check(cfg: Any, hf: dict) -> None:
    if hf.get("norm_topk_prob"):
        raise ValueError(
            "GGUF export: qwen2_moe with norm_topk_prob=true: llama.cpp's qwen2moe does not "
            "renormalise the top-k router weights, so it would compute another model."
        )
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(
            "GGUF export: qwen2_moe with dense layers (mlp_only_layers/decoder_sparse_step): "
            "llama.cpp's qwen2moe expects a MoE block in every layer."
        )


def _qwen2_moe_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_from_hf(w, cfg, hf)
    w.add_expert_count(int(hf["num_experts"]))
    w.add_expert_used_count(int(hf["num_experts_per_tok"]))
    w.add_expert_feed_forward_length(int(hf["moe_intermediate_size"]))
    w.add_expert_shared_feed_forward_length(int(hf["shared_expert_intermediate_size"]))


OLMO2 = GGUFSpec(
    "OLMO2", "olmo2", ("olmo2",), write_metadata=rope_from_hf, extra_tensors=_no_tensors
)
MIXTRAL = GGUFSpec(
    "LLAMA",
    "llama",
    ("mixtral",),
    check=_mixtral_check,
    write_metadata=_mixtral_metadata,
    extra_tensors=_no_tensors,
    transforms=(
        rotary_rows(("q_proj.weight",), lambda cfg: cfg.num_attention_heads),
        rotary_rows(("k_proj.weight",), lambda cfg: cfg.num_key_value_heads),
    ),
)

QWEN2MOE = GGUFSpec(
    "QWEN2MOE",
    "qwen2moe",
    ("qwen2_moe",),
    check=_qwen2_moe_check,
    write_metadata=_qwen2_moe_metadata,
    extra_tensors=_no_tensors,
    transforms=(  # the shared expert's gate (1, D): one vector in llama.cpp ({n_embd})
        TensorTransform(
            ("mlp.shared_expert_gate.weight",),
            lambda cfg, name, t: [(name, t.reshape(-1))],
            lambda cfg, name, parts: iter([(name, parts[0].reshape(1, -1))]),
        ),
    ),
    pre_tokenizer="qwen2",
)

GENERIC_SPECS = {t: spec for spec in (OLMO2, MIXTRAL, QWEN2MOE) for t in spec.model_types}
