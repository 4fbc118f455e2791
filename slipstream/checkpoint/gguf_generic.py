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
- gemma2: GEMMA2 (NeoX RoPE: no permutation): RMSNorm weights stored as 1 + w (HF adds the 1
  at run time), both softcaps and the window under their keys; the output is the token
  embedding (tied only), queries scaled by 1/sqrt(head_dim) (27B: sqrt(D/H)), every 2nd
  layer full attention: other configs are refused.
- starcoder2, stablelm, phi (llama.cpp's PHI2): NeoX RoPE, LayerNorm with biases, their
  `layer_norm_epsilon`; StableLM's parallel residual flag; partial rotary dims. Refused:
  a StarCoder2 sliding window (llama.cpp's starcoder2 attends over everything) or no biases,
  per-head q/k norms (StableLM, Phi), Phi with grouped K/V (llama.cpp's phi2 has none).
- granitemoe: GRANITE_MOE: granite's, with transformers 5's `block_sparse_moe` names put into
  the table's (router as `router.layer`, the stacked experts split into gate/up as Mixtral's);
  llama.cpp routes by softmax with the top-k renormalised, as transformers' softmax over the
  top-k logits.
- granite, smollm3: llama-style RoPE, so Q/K rows permuted per head as native llama's are;
  Granite's four multipliers (attention, embedding, residual, logits) under llama.cpp's scale
  keys (head_dim must be D/H: llama.cpp derives it); SmolLM3 with llama.cpp's fixed NoPE
  pattern only (no RoPE on every 4th layer, `no_rope_layers`) and no sliding window.

- olmo3: llama.cpp's OLMO2 with the window and its per-layer pattern (`sliding_window_pattern`,
  from `layer_types`); one RoPE for all layers (per-type RoPE parameters must agree).
- cohere2: COHERE2: parallel attention and MLP on one LayerNorm (no bias), interleaved RoPE
  as HF already stores it (no permutation), on the sliding layers only, as transformers; the
  logit scale and window under its keys. llama.cpp fixes every 4th layer full and outputs
  through the token embedding: other configs are refused, as are attention biases.
- minimax_m2: MINIMAXM2 (llama.cpp's `minimax-m2`; conversion/minimax.py,
  src/models/minimax-m2.cpp): the stacked experts split as Mixtral's,
  the router's sigmoid gating and its score-correction bias (`exp_probs_b.bias`, a buffer in
  transformers), full-width q/k norms, partial rotary dims, the expert width; a tied head is
  refused (llama.cpp requires the output tensor).
- glm4_moe: GLM4_MOE (after conversion/glm.py and src/models/glm4-moe.cpp): NeoX partial
  RoPE (no permutation), the leading dense layers, routed and shared experts, sigmoid gating
  with the score-correction bias, routed scaling and top-k renormalisation under llama.cpp's
  keys, expert groups (llama.cpp's build_moe_ffn scores a group by its top 2, as HF); no
  NextN/MTP layers (transformers builds none); no shared expert refused.
- ernie4_5_moe: ERNIE4_5_MOE (after conversion/ernie.py and src/models/ernie4-5-moe.cpp):
  interleaved RoPE as HF stores it, softmax routing with the score-correction bias and top-k
  renormalisation, the MoE interleave step and leading dense layers, shared experts at their
  true width; refused: biases, partial rotary, MoE layers ending before the last layer.
- llama4_text: LLAMA4 (after conversion/llama.py's Llama4Model and src/models/llama4.cpp):
  interleaved RoPE as HF's complex rotary (no permutation), the experts' (E, D, 2F) gate_up
  split and transposed, the shared expert at the experts' width, dense layers at
  intermediate_size_mlp, the chunked/full pattern per layer. llama.cpp fixes chunks of 8192,
  NoPE on every 4th layer with its query temperature (floor 8192, scale 0.1), q/k L2 norms
  unless 128 experts: other configs are refused, as are configs with no chunked layer.
  llama3 RoPE scaling (the released configs') as the rope_freqs tensor of divisors.
- deepseek_v3: DEEPSEEK2 (after conversion/deepseek.py's DeepseekV2Model and
  src/models/deepseek2.cpp): MLA as llama.cpp's absorbed form, kv_b_proj split per head into
  k_b (transposed) and v_b, one compressed K/V head (key/value lengths kv_lora_rank + rope,
  kv_lora_rank; the decompressed sizes under the _mla keys); interleaved RoPE as HF's
  rope_interleave (no permutation); sigmoid routing with the score-correction bias, groups,
  top-k renormalisation and routed scaling under their keys; YaRN (the released configs') as
  the converter writes it. Refused: rope_interleave=false,
  no q_lora_rank, biases.
- falcon_h1: FALCON_H1 (after conversion/falcon_h1.py, mamba.py's Mamba2Model and
  src/models/falcon-h1.cpp, mamba-base.cpp): attention and Mamba-2 in parallel on one norm;
  every muP multiplier folded into its weight as the converter does (embedding, lm_head,
  attention in/key/out, ssm in/out, the in_proj's per-section mup vector, MLP gate/down);
  A as -exp(A_log), dt_bias as ssm_dt.bias, D and A as (H, 1), the conv kernel (C, K), the
  grouped norm (G, d/G); NeoX RoPE (no permutation). Refused: biases (only weights are
  scaled), no conv bias, norm before gate, a dt clamp, a tied head with multipliers.
- nemotron_h: NEMOTRON_H_MOE (llama.cpp's `nemotron_h_moe`, which its converter picks since
  transformers' config has num_experts_per_tok; conversion/nemotron.py, src/models/nemotron-h.cpp):
  Mamba-2, attention (no RoPE) and MoE layers told apart by per-layer K/V heads and FFN widths
  (both 0: Mamba-2), the mixers under the table's backbone.* names, gateless ReLU^2 experts
  stacked as HF holds them, sigmoid routing with the score bias, the gated grouped SSM norm;
  refused: dense mlp layers (every FFN layer is MoE there), latent MoE, biases, groups.
- qwen3_next: QWEN3NEXT (after conversion/qwen.py's Qwen3NextModel and
  src/models/qwen3next.cpp): in_proj_qkvz, rows grouped per key head, regrouped into attn_qkv
  (all q, k, v) and attn_gate (z); A = -exp(A_log), dt_bias as ssm_dt.bias, the conv kernel
  (C, K); every RMSNorm but the DeltaNet's stored as 1 + w (HF adds the 1 at run time); the
  gated attention's q_proj as HF holds it; which layers are recurrent under
  attention.recurrent_layers; the shared expert's gate as one vector. llama.cpp renormalises
  the top-k and runs MoE in every layer: other configs are refused. Export only.
- lfm2: LFM2: its short convolutions' (D, 1, L) kernels as (D, L), K/V head counts per layer
  (0 on the convolution layers: how llama.cpp tells them apart), the feed-forward width as
  the block computes it (`block_auto_adjust_ff_dim`), `norm_eps`, `conv_L_cache`.

Activations are checked too: llama.cpp fixes each architecture's (GELU tanh for gemma2,
starcoder2 and phi2; SiLU for the rest).

These follow llama.cpp's converter (convert_hf_to_gguf.py / conversion/*.py); the tests check
names and layout against the `gguf` package's tables, read some back with transformers' own
GGUF loader, and run every type here in llama.cpp itself (llama-cpp-python 0.3.36: logits
within 5e-3 relative and greedy tokens equal ours; docs/generic.md has the figures).

A model type with no spec here is a one-line refusal naming it (gguf_arch.spec_for).
No torch import at module level (gguf_spec.py says why).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from slipstream.checkpoint.gguf_qwen35 import gated_deltanet_metadata
from slipstream.checkpoint.gguf_spec import GGUFSpec, TensorTransform, rotary_rows, yarn_metadata

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")


def _no_tensors(cfg: Any):
    return iter(())


def rope_from_hf(w: Any, cfg: Any, hf: dict, allow: tuple[str, ...] = ()) -> None:
    """RoPE base and rotary dims from config.json (transformers 5's `rope_parameters`, or
    4.x's `rope_theta`/`rope_scaling`); scaled RoPE is refused but for the types in `allow`
    (llama3 for Llama 4: its divisors are the rope_freqs tensor, `_llama3_freqs`)."""
    params = hf.get("rope_parameters") or {
        **(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10000.0),
    }  # fmt: skip
    if {"full_attention", "sliding_attention"} & params.keys():  # per layer type (OLMo 3)
        kinds = list(params.values())
        if any(k != kinds[0] for k in kinds):
            raise ValueError(
                f"GGUF export: {cfg.model_type} with RoPE per layer type {params}: llama.cpp "
                "runs one RoPE for every layer, so it would compute another model."
            )
        params = kinds[0]
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default" and kind not in allow:
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


def _refuse(model_type: str, what: str, why: str) -> None:
    raise ValueError(
        f"GGUF export: {model_type} with {what}: {why}, so it would compute another model."
    )


def _activation(model_type: str, hf: dict, key: str, allowed: tuple[str, ...]) -> None:
    act = hf.get(key)
    if act not in allowed:
        _refuse(model_type, f"{key}={act}", f"llama.cpp's {model_type} runs {allowed[0]}")


def _gemma2_check(cfg: Any, hf: dict) -> None:
    from slipstream.checkpoint.gguf_families import check_layer_types

    if not cfg.tie_word_embeddings:
        _refuse(
            "gemma2", "an untied lm_head", "llama.cpp's gemma2 outputs through the token embedding"
        )
    scalar, heads = float(hf.get("query_pre_attn_scalar") or cfg.head_dim), cfg.num_attention_heads
    if scalar != cfg.head_dim and not (
        cfg.num_hidden_layers == 46 and scalar * heads == cfg.hidden_size
    ):
        _refuse("gemma2", f"query_pre_attn_scalar={scalar:g}",
                "llama.cpp scales queries by 1/sqrt(head_dim) (27B excepted)")  # fmt: skip
    _activation("gemma2", hf, "hidden_activation", _GELU_TANH)
    check_layer_types(cfg, hf, 2)


def _gemma2_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_from_hf(w, cfg, hf)
    w.add_attn_logit_softcapping(float(hf["attn_logit_softcapping"]))
    w.add_final_logit_softcapping(float(hf["final_logit_softcapping"]))
    w.add_sliding_window(int(hf["sliding_window"]))


def _layer_norm_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_from_hf(w, cfg, hf)
    w.add_layer_norm_eps(float(hf.get("layer_norm_eps") or hf.get("norm_epsilon") or 1e-5))


def _starcoder2_check(cfg: Any, hf: dict) -> None:
    if hf.get("sliding_window"):
        _refuse("starcoder2", f"sliding_window={hf['sliding_window']}",
                "llama.cpp's starcoder2 attends over the whole context")  # fmt: skip
    if not hf.get("use_bias", True):
        _refuse("starcoder2", "use_bias=false", "llama.cpp's starcoder2 expects the biases")
    _activation("starcoder2", hf, "hidden_act", _GELU_TANH)


def _stablelm_check(cfg: Any, hf: dict) -> None:
    if hf.get("qk_layernorm"):
        _refuse("stablelm", "qk_layernorm=true", "its per-head q/k norms are not written here")
    _activation("stablelm", hf, "hidden_act", ("silu",))


def _stablelm_metadata(w: Any, cfg: Any, hf: dict) -> None:
    _layer_norm_metadata(w, cfg, hf)
    w.add_parallel_residual(bool(hf.get("use_parallel_residual", True)))


def _phi_check(cfg: Any, hf: dict) -> None:
    if hf.get("qk_layernorm"):
        _refuse("phi", "qk_layernorm=true", "llama.cpp's phi2 has no q/k norms")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        _refuse("phi", f"{cfg.num_key_value_heads} key/value heads",
                "llama.cpp's phi2 has as many as query heads")  # fmt: skip
    _activation("phi", hf, "hidden_act", _GELU_TANH)


def _llama_rows(*suffix: str) -> tuple[TensorTransform, ...]:
    """Q and K rows permuted per head: llama.cpp runs these with llama's (GPT-J) RoPE."""
    return (
        rotary_rows(tuple(f"q_proj.{x}" for x in suffix), lambda cfg: cfg.num_attention_heads),
        rotary_rows(tuple(f"k_proj.{x}" for x in suffix), lambda cfg: cfg.num_key_value_heads),
    )


def _granite_check(cfg: Any, hf: dict) -> None:
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        _refuse("granite", f"head_dim={cfg.head_dim}",
                "llama.cpp's granite derives it as hidden_size / num_attention_heads")  # fmt: skip
    _activation("granite", hf, "hidden_act", ("silu",))


def _granite_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_from_hf(w, cfg, hf)
    w.add_attention_scale(float(hf["attention_multiplier"]))
    w.add_embedding_scale(float(hf["embedding_multiplier"]))
    w.add_residual_scale(float(hf["residual_multiplier"]))
    w.add_logit_scale(float(hf["logits_scaling"]))


def _split_moe(cfg: Any, name: str, t: Any) -> list[tuple[str, Any]]:
    """granitemoe's (E, 2F, D) [gate; up] under the names the gguf table maps."""
    half, base = t.shape[1] // 2, name.removesuffix("block_sparse_moe.experts.gate_up_proj")
    return [(base + "mlp.experts.gate_proj.weight", t[:, :half]),
            (base + "mlp.experts.up_proj.weight", t[:, half:])]  # fmt: skip


def _join_moe(cfg: Any, name: str, parts: list[Any]) -> Iterator[tuple[str, Any]]:
    import torch

    yield name, torch.cat(parts, dim=1)


def _granitemoe_check(cfg: Any, hf: dict) -> None:
    _granite_check(cfg, hf)
    if hf.get("shared_intermediate_size"):
        _refuse("granitemoe", "a shared expert", "its shared MLP is not written here")


def _granitemoe_metadata(w: Any, cfg: Any, hf: dict) -> None:
    _granite_metadata(w, cfg, hf)
    w.add_expert_count(int(hf["num_local_experts"]))
    w.add_expert_used_count(int(hf["num_experts_per_tok"]))


def _smollm3_check(cfg: Any, hf: dict) -> None:
    L = cfg.num_hidden_layers
    fixed = [int((i + 1) % 4 != 0) for i in range(L)]  # 0: no RoPE on that layer
    if list(hf.get("no_rope_layers") or fixed)[:L] != fixed:  # transformers reads the first L
        _refuse("smollm3", f"no_rope_layers={hf.get('no_rope_layers')}",
                "llama.cpp's smollm3 skips RoPE on every 4th layer exactly")  # fmt: skip
    if hf.get("use_sliding_window"):
        _refuse("smollm3", "use_sliding_window=true", "llama.cpp's smollm3 has no window")
    _activation("smollm3", hf, "hidden_act", ("silu",))


GEMMA2 = GGUFSpec(
    "GEMMA2", "gemma2", ("gemma2",), check=_gemma2_check, write_metadata=_gemma2_metadata,
    extra_tensors=_no_tensors,
    transforms=(  # Gemma's RMSNorm multiplies by 1 + w; llama.cpp's by the stored weight
        TensorTransform(
            ("norm.weight",),
            lambda cfg, name, t: [(name, t.float() + 1.0)],
            lambda cfg, name, parts: iter([(name, parts[0] - 1.0)]),
        ),
    ),
)  # fmt: skip
STARCODER2 = GGUFSpec(
    "STARCODER2", "starcoder2", ("starcoder2",), check=_starcoder2_check,
    write_metadata=_layer_norm_metadata, extra_tensors=_no_tensors,
)  # fmt: skip
STABLELM = GGUFSpec(
    "STABLELM", "stablelm", ("stablelm",), check=_stablelm_check,
    write_metadata=_stablelm_metadata, extra_tensors=_no_tensors,
)  # fmt: skip
PHI2 = GGUFSpec(
    "PHI2", "phi2", ("phi",), check=_phi_check, write_metadata=_layer_norm_metadata,
    extra_tensors=_no_tensors,
)  # fmt: skip
GRANITE = GGUFSpec(
    "GRANITE", "granite", ("granite",), check=_granite_check, write_metadata=_granite_metadata,
    extra_tensors=_no_tensors, transforms=_llama_rows("weight", "bias"),
)  # fmt: skip
GRANITEMOE = GGUFSpec(
    "GRANITE_MOE", "granitemoe", ("granitemoe",), check=_granitemoe_check,
    write_metadata=_granitemoe_metadata, extra_tensors=_no_tensors,
    transforms=(
        *_llama_rows("weight", "bias"),
        TensorTransform(
            ("block_sparse_moe.router.weight",),
            lambda cfg, name, t: [(name.replace(".router.", ".router.layer."), t)],
            lambda cfg, name, parts: iter([(name, parts[0])]),
        ),
        TensorTransform(("block_sparse_moe.experts.gate_up_proj",), _split_moe, _join_moe),
        TensorTransform(
            ("block_sparse_moe.experts.down_proj",),
            lambda cfg, name, t: [(name.replace("block_sparse_moe.", "mlp.") + ".weight", t)],
            lambda cfg, name, parts: iter([(name, parts[0])]),
        ),
    ),
)  # fmt: skip
SMOLLM3 = GGUFSpec(
    "SMOLLM3", "smollm3", ("smollm3",), check=_smollm3_check, write_metadata=rope_from_hf,
    extra_tensors=_no_tensors, transforms=_llama_rows("weight", "bias"),
)  # fmt: skip


def _overwrite(w: Any, key: str) -> None:
    """Drop `key`, written by the common hyperparameters (gguf_arch.write_metadata), so the
    spec's own value replaces it without the writer's duplicate-key warning."""
    w.kv_data[0].pop(key.format(arch=w.arch), None)


def _lfm2_check(cfg: Any, hf: dict) -> None:
    if hf.get("conv_bias"):
        _refuse("lfm2", "conv_bias=true", "llama.cpp's lfm2 convolutions have no bias")


def _lfm2_ff(hf: dict) -> int:
    """The width of LFM2's feed-forward blocks, as transformers' Lfm2MLP derives it."""
    ff = int(hf.get("block_ff_dim") or hf["intermediate_size"])
    if hf.get("block_auto_adjust_ff_dim"):
        ff = int(2 * ff / 3)
        if hf.get("block_ffn_dim_multiplier") is not None:
            ff = int(hf["block_ffn_dim_multiplier"] * ff)
        multiple = int(hf["block_multiple_of"])
        ff = multiple * ((ff + multiple - 1) // multiple)
    return ff


def _lfm2_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_from_hf(w, cfg, hf)
    kv = [cfg.num_key_value_heads if kind != "conv" else 0 for kind in hf["layer_types"]]
    for key in ("{arch}.attention.head_count_kv", "{arch}.feed_forward_length",
                "{arch}.attention.layer_norm_rms_epsilon"):  # fmt: skip
        _overwrite(w, key)
    w.add_head_count_kv(kv[: cfg.num_hidden_layers])
    w.add_feed_forward_length(_lfm2_ff(hf))
    w.add_layer_norm_rms_eps(float(hf["norm_eps"]))
    w.add_shortconv_l_cache(int(hf["conv_L_cache"]))


LFM2 = GGUFSpec(
    "LFM2", "lfm2", ("lfm2",), check=_lfm2_check, write_metadata=_lfm2_metadata,
    extra_tensors=_no_tensors,
    transforms=(  # the depthwise kernel (D, 1, L): llama.cpp's conv op takes (D, L)
        TensorTransform(
            ("conv.conv.weight",),
            lambda cfg, name, t: [(name, t.squeeze(1))],
            lambda cfg, name, parts: iter([(name, parts[0].unsqueeze(1))]),
        ),
    ),
)  # fmt: skip


def _olmo3_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_from_hf(w, cfg, hf)
    L = cfg.num_hidden_layers
    w.add_sliding_window(int(hf["sliding_window"]))
    w.add_sliding_window_pattern([t == "sliding_attention" for t in hf["layer_types"][:L]])


def _cohere2_check(cfg: Any, hf: dict) -> None:
    from slipstream.checkpoint.gguf_families import check_layer_types

    if not cfg.tie_word_embeddings:
        _refuse(
            "cohere2",
            "an untied lm_head",
            "llama.cpp's cohere2 outputs through the token embedding",
        )
    if hf.get("attention_bias"):
        _refuse("cohere2", "attention_bias=true", "llama.cpp's cohere2 has no biases")
    _activation("cohere2", hf, "hidden_act", ("silu",))
    check_layer_types(cfg, hf, 4)


def _cohere2_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_from_hf(w, cfg, hf)
    w.add_layer_norm_eps(float(hf["layer_norm_eps"]))
    w.add_logit_scale(float(hf["logit_scale"]))
    w.add_sliding_window(int(hf["sliding_window"]))


# A sigmoid router's score-correction bias (a buffer: GenericWeights yields it) under the gguf
# table's name, ...e_score_correction.bias, which llama.cpp calls blk.N.exp_probs_b.bias.
SCORE_BIAS = TensorTransform(
    ("e_score_correction_bias",),
    lambda cfg, name, t: [(name.removesuffix("_bias") + ".bias", t.float())],
    lambda cfg, name, parts: iter([(name, parts[0])]),
)


def _glm4_moe_check(cfg: Any, hf: dict) -> None:
    groups = int(hf.get("n_group") or 1)
    if groups > 1 and int(hf["n_routed_experts"]) // groups < 2:  # HF sums a group's top 2
        _refuse("glm4_moe", f"n_group={groups}", "llama.cpp scores a group by its top 2 experts")
    if not hf.get("n_shared_experts"):  # src/models/glm4-moe.cpp always adds the shared MLP
        _refuse("glm4_moe", "no shared expert", "llama.cpp's glm4moe always runs one")
    _activation("glm4_moe", hf, "hidden_act", ("silu",))


def _glm4_moe_metadata(w: Any, cfg: Any, hf: dict) -> None:
    import gguf

    rope_from_hf(w, cfg, hf)  # partial rotary (0.5 in GLM-4.5), NeoX: no permutation
    w.add_expert_count(int(hf["n_routed_experts"]))
    w.add_expert_used_count(int(hf["num_experts_per_tok"]))
    w.add_expert_feed_forward_length(int(hf["moe_intermediate_size"]))
    w.add_expert_shared_count(int(hf.get("n_shared_experts") or 0))
    w.add_leading_dense_block_count(int(hf.get("first_k_dense_replace") or 0))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(float(hf.get("routed_scaling_factor") or 1.0))
    w.add_expert_weights_norm(bool(hf.get("norm_topk_prob")))
    w.add_expert_group_count(int(hf.get("n_group") or 1))  # llama.cpp's group-limited routing
    w.add_expert_group_used_count(int(hf.get("topk_group") or 1))


def _ernie_check(cfg: Any, hf: dict) -> None:
    if hf.get("use_bias"):
        _refuse("ernie4_5_moe", "use_bias=true", "llama.cpp's ernie4_5-moe has no o/MLP biases")
    end = hf.get("moe_layer_end_index")
    if end is not None and 0 <= int(end) < cfg.num_hidden_layers - 1:
        _refuse("ernie4_5_moe", f"moe_layer_end_index={end}",
                "llama.cpp's ernie4_5-moe keeps MoE layers to the last layer")  # fmt: skip
    rotary = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    if rotary != 1.0:
        _refuse("ernie4_5_moe", f"partial_rotary_factor={rotary}",
                "llama.cpp's ernie4_5-moe rotates the whole head")  # fmt: skip
    _activation("ernie4_5_moe", hf, "hidden_act", ("silu",))


def _ernie_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_from_hf(w, cfg, hf)
    w.add_expert_count(int(hf["moe_num_experts"]))
    w.add_expert_used_count(int(hf["moe_k"]))
    w.add_interleave_moe_layer_step(int(hf.get("moe_layer_interval") or 1))
    w.add_leading_dense_block_count(int(hf.get("moe_layer_start_index") or 0))
    w.add_expert_feed_forward_length(int(hf["moe_intermediate_size"]))
    shared = int(hf.get("moe_num_shared_experts") or 0)
    w.add_expert_shared_count(shared)
    # the shared MLP's true width, as transformers builds it (llama.cpp's converter writes
    # intermediate_size // num_key_value_heads, the same number on the released models)
    w.add_expert_shared_feed_forward_length(int(hf["moe_intermediate_size"]) * shared)


ERNIE4_5_MOE = GGUFSpec(
    "ERNIE4_5_MOE", "ernie4_5-moe", ("ernie4_5_moe",), check=_ernie_check,
    write_metadata=_ernie_metadata, extra_tensors=_no_tensors,
    transforms=(  # transformers 5 holds the bias (1, E) under the router (gate.moe_statics)
        TensorTransform(
            ("mlp.gate.moe_statics.e_score_correction_bias",),
            lambda cfg, name, t: [(name.replace("gate.moe_statics.e_score_correction_bias",
                                                "moe_statics.e_score_correction.bias"),
                                   t.float().reshape(-1))],
            lambda cfg, name, parts: iter([(name, parts[0].reshape(1, -1))]),
        ),
    ),
)  # fmt: skip
GLM4_MOE = GGUFSpec(
    "GLM4_MOE", "glm4moe", ("glm4_moe",), check=_glm4_moe_check,
    write_metadata=_glm4_moe_metadata, extra_tensors=_no_tensors, transforms=(SCORE_BIAS,),
)  # fmt: skip


def _minimax_m2_metadata(w: Any, cfg: Any, hf: dict) -> None:
    import gguf

    rope_from_hf(w, cfg, hf)
    w.add_expert_count(int(hf["num_local_experts"]))
    w.add_expert_used_count(int(hf["num_experts_per_tok"]))
    w.add_expert_feed_forward_length(int(hf["intermediate_size"]))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _minimax_m2_check(cfg: Any, hf: dict) -> None:
    if cfg.tie_word_embeddings:  # src/models/minimax-m2.cpp requires its own output tensor
        _refuse("minimax_m2", "a tied lm_head", "llama.cpp's minimax-m2 loads a separate output")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        _refuse("minimax_m2", f"scoring_func={hf['scoring_func']}",
                "transformers' and llama.cpp's MiniMax-M2 routers are sigmoid")  # fmt: skip
    _activation("minimax_m2", hf, "hidden_act", ("silu",))


MINIMAX_M2 = GGUFSpec(
    "MINIMAXM2", "minimax-m2", ("minimax_m2",), check=_minimax_m2_check,
    write_metadata=_minimax_m2_metadata, extra_tensors=_no_tensors,
    transforms=(SCORE_BIAS,),
)  # fmt: skip
OLMO3 = GGUFSpec(
    "OLMO2", "olmo2", ("olmo3",), write_metadata=_olmo3_metadata, extra_tensors=_no_tensors
)
COHERE2 = GGUFSpec(
    "COHERE2", "cohere2", ("cohere2",), check=_cohere2_check, write_metadata=_cohere2_metadata,
    extra_tensors=_no_tensors,
)  # fmt: skip


def _llama4_check(cfg: Any, hf: dict) -> None:
    L, E = cfg.num_hidden_layers, int(hf["num_local_experts"])
    kinds = list(hf.get("layer_types") or [])[:L]
    if "chunked_attention" not in kinds:  # llama.cpp's sliding_window=0 form drops RoPE on
        _refuse("llama4_text", "no chunked layers",  # the last layer; not written here
                "llama.cpp's llama4 fixes its NoPE layers by the chunked form")  # fmt: skip
    if int(hf.get("attention_chunk_size") or 0) != 8192:
        _refuse("llama4_text", f"attention_chunk_size={hf.get('attention_chunk_size')}",
                "llama.cpp's llama4 fixes its chunks at 8192 tokens")  # fmt: skip
    rope = [int((i + 1) % 4 != 0) for i in range(L)]  # 0: NoPE (llama.cpp's fixed step 4)
    if [int(x) for x in hf["no_rope_layers"][:L]] != rope:
        _refuse("llama4_text", f"no_rope_layers={hf['no_rope_layers'][:L]}",
                "llama.cpp's llama4 skips RoPE on every 4th layer exactly")  # fmt: skip
    if 0 in rope and (
        not hf.get("attn_temperature_tuning")
        or (hf.get("floor_scale"), hf.get("attn_scale")) != (8192, 0.1)
    ):
        _refuse("llama4_text", "attention temperature "
                f"{hf.get('attn_temperature_tuning')}/{hf.get('floor_scale')}/"
                f"{hf.get('attn_scale')}",
                "llama.cpp's llama4 scales NoPE queries with floor 8192, scale 0.1")  # fmt: skip
    step = int(hf.get("interleave_moe_layer_step") or 1)
    moe = [i for i in range(L) if (i + 1) % step == 0]
    if list(hf.get("moe_layers") or moe)[: len(moe) + 1] != moe:
        _refuse("llama4_text", f"moe_layers={hf.get('moe_layers')}",
                f"llama.cpp's llama4 puts experts on every {step}th layer")  # fmt: skip
    if bool(hf.get("use_qk_norm")) != (E != 128):  # llama.cpp: off for the 128-expert type
        _refuse("llama4_text", f"use_qk_norm={hf.get('use_qk_norm')} and {E} experts",
                "llama.cpp's llama4 norms q/k unless it has 128 experts")  # fmt: skip
    if hf.get("attention_bias"):
        _refuse("llama4_text", "attention_bias=true", "llama.cpp's llama4 has no biases")
    _activation("llama4_text", hf, "hidden_act", ("silu",))


def _hf_rope(cfg: Any) -> Any:
    from dataclasses import replace

    from slipstream.checkpoint.gguf_spec import text_hf
    from slipstream.models.rope import RopeConfig

    return replace(cfg, rope=RopeConfig.from_hf(text_hf(cfg)))


def _llama3_freqs(cfg: Any) -> Iterator[tuple[str, Any]]:
    """llama3 RoPE's divisors as llama.cpp's rope_freqs (the generic cfg's own RoPE is a
    placeholder: read config.json's)."""
    from slipstream.checkpoint.gguf_spec import llama3_rope_tensors

    yield from llama3_rope_tensors(_hf_rope(cfg))


def _llama4_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_from_hf(w, cfg, hf, allow=("llama3",))  # interleaved as HF's complex rotary: as is
    if _hf_rope(cfg).rope.rope_type == "llama3":  # the divisors: the rope_freqs tensor
        w.add_rope_scaling_orig_ctx_len(int(_hf_rope(cfg).rope.original_max_position_embeddings))
    L = cfg.num_hidden_layers
    _overwrite(w, "{arch}.feed_forward_length")
    w.add_feed_forward_length(int(hf["intermediate_size_mlp"]))  # the dense layers' width
    w.add_expert_feed_forward_length(int(hf["intermediate_size"]))  # experts' and shared
    w.add_expert_count(int(hf["num_local_experts"]))
    w.add_expert_used_count(int(hf["num_experts_per_tok"]))
    w.add_interleave_moe_layer_step(int(hf.get("interleave_moe_layer_step") or 1))
    w.add_sliding_window_pattern([t == "chunked_attention" for t in hf["layer_types"][:L]])


def _llama4_split(cfg: Any, name: str, t: Any) -> list[tuple[str, Any]]:
    """Llama 4's (E, D, 2F) [gate | up] as llama.cpp's (E, F, D) gate and up stacks."""
    half, base = t.shape[-1] // 2, name.removesuffix("gate_up_proj")
    g, u = t.transpose(-1, -2).split(half, dim=-2)
    return [(base + "gate_proj.weight", g), (base + "up_proj.weight", u)]


def _llama4_join(cfg: Any, name: str, parts: list[Any]) -> Iterator[tuple[str, Any]]:
    import torch

    yield name, torch.cat(parts, dim=-2).transpose(-1, -2)


LLAMA4 = GGUFSpec(
    "LLAMA4", "llama4", ("llama4_text",), check=_llama4_check, write_metadata=_llama4_metadata,
    extra_tensors=_llama3_freqs,
    transforms=(
        TensorTransform(("feed_forward.experts.gate_up_proj",), _llama4_split, _llama4_join),
        TensorTransform(  # (E, F, D) -> llama.cpp's (E, D, F)
            ("feed_forward.experts.down_proj",),
            lambda cfg, name, t: [(name + ".weight", t.transpose(-1, -2))],
            lambda cfg, name, parts: iter([(name, parts[0].transpose(-1, -2))]),
        ),
    ),
)  # fmt: skip


def _deepseek_check(cfg: Any, hf: dict) -> None:
    if not hf.get("rope_interleave", True):  # HF rotates halves then; llama.cpp pairs
        _refuse("deepseek_v3", "rope_interleave=false", "llama.cpp's deepseek2 rotates pairs")
    if not hf.get("q_lora_rank"):  # llama.cpp reads it but for its fixed "lite" layer counts
        _refuse("deepseek_v3", "no q_lora_rank", "llama.cpp's deepseek2 requires the q LoRA")
    if hf.get("attention_bias"):
        _refuse("deepseek_v3", "attention_bias=true", "llama.cpp's deepseek2 has no biases")
    E, groups = int(hf["n_routed_experts"]), int(hf.get("n_group") or 1)
    if groups > 1 and E // groups < 2:  # HF sums each group's top 2, as llama.cpp
        _refuse("deepseek_v3", f"n_group={groups}", "llama.cpp scores a group by its top 2 experts")
    _activation("deepseek_v3", hf, "hidden_act", ("silu",))


def _deepseek_yarn(w: Any, cfg: Any) -> None:
    """YaRN (DeepSeek-V3's released configs) under llama.cpp's keys, as its converter writes
    them: the log multiplier as 0.1 * mscale_all_dim (llama.cpp's deepseek2 divides by 0.1 and
    scales K.Q by its mscale squared, as HF's yarn_apply_mscale)."""
    rope = _hf_rope(cfg).rope
    if rope.rope_type != "yarn":
        return
    yarn_metadata(w, rope)
    if rope.mscale_all_dim:
        w.add_rope_scaling_yarn_log_mul(0.1 * float(rope.mscale_all_dim))


def _deepseek_metadata(w: Any, cfg: Any, hf: dict) -> None:
    import gguf

    rope_from_hf(w, cfg, hf, allow=("yarn",))  # interleaved as HF's rope_interleave: as is
    _deepseek_yarn(w, cfg)
    r, rope, nope = (
        int(hf["kv_lora_rank"]),
        int(hf["qk_rope_head_dim"]),
        int(hf["qk_nope_head_dim"]),
    )
    for key in ("{arch}.attention.head_count_kv", "{arch}.attention.key_length",
                "{arch}.attention.value_length", "{arch}.rope.dimension_count"):  # fmt: skip
        _overwrite(w, key)
    # MLA absorbed: one compressed K/V head of kv_lora_rank (+ the RoPE part for K); the
    # per-head sizes after decompression under the _mla keys (as the converter writes them)
    w.add_head_count_kv(1)
    w.add_key_length(r + rope)
    w.add_value_length(r)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(int(hf["v_head_dim"]))
    w.add_rope_dimension_count(rope)
    w.add_q_lora_rank(int(hf["q_lora_rank"]))
    w.add_kv_lora_rank(r)
    w.add_leading_dense_block_count(int(hf.get("first_k_dense_replace") or 0))
    w.add_expert_feed_forward_length(int(hf["moe_intermediate_size"]))
    w.add_expert_count(int(hf["n_routed_experts"]))
    w.add_expert_used_count(int(hf["num_experts_per_tok"]))
    w.add_expert_shared_count(int(hf.get("n_shared_experts") or 0))
    w.add_expert_weights_scale(float(hf.get("routed_scaling_factor") or 1.0))
    w.add_expert_weights_norm(bool(hf.get("norm_topk_prob")))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # HF's DeepseekV3TopkRouter
    w.add_expert_group_count(int(hf.get("n_group") or 1))
    w.add_expert_group_used_count(int(hf.get("topk_group") or 1))


def _mla_split(cfg: Any, name: str, t: Any) -> list[tuple[str, Any]]:
    """kv_b_proj (H * (nope + v), r) as llama.cpp's absorbed k_b (H, r, nope), v_b (H, v, r)."""
    from slipstream.checkpoint.gguf_spec import text_hf

    hf = text_hf(cfg)
    nope, v = int(hf["qk_nope_head_dim"]), int(hf["v_head_dim"])
    kv = t.reshape(-1, nope + v, t.shape[-1])
    k, v = kv.split([nope, v], dim=1)
    return [(name.replace("kv_b_proj", "k_b_proj"), k.transpose(1, 2)),
            (name.replace("kv_b_proj", "v_b_proj"), v)]  # fmt: skip


def _mla_join(cfg: Any, name: str, parts: list[Any]) -> Iterator[tuple[str, Any]]:
    import torch

    k, v = parts
    kv = torch.cat([k.transpose(1, 2), v], dim=1)
    yield name, kv.reshape(-1, kv.shape[-1])


DEEPSEEK_V3 = GGUFSpec(
    "DEEPSEEK2", "deepseek2", ("deepseek_v3",), check=_deepseek_check,
    write_metadata=_deepseek_metadata, extra_tensors=_no_tensors,
    transforms=(TensorTransform(("self_attn.kv_b_proj.weight",), _mla_split, _mla_join),
                SCORE_BIAS),
)  # fmt: skip


def _falcon_h1_check(cfg: Any, hf: dict) -> None:
    for key in ("attention_bias", "projectors_bias", "mamba_proj_bias", "mlp_bias"):
        if hf.get(key):
            _refuse("falcon_h1", f"{key}=true", "llama.cpp gets multipliers in the weights only")
    if not hf.get("mamba_conv_bias", True):
        _refuse("falcon_h1", "mamba_conv_bias=false", "llama.cpp's mamba2 adds a conv bias")
    if hf.get("mamba_rms_norm") and hf.get("mamba_norm_before_gate", True):
        _refuse("falcon_h1", "mamba_norm_before_gate=true",
                "llama.cpp's mamba2 gates before its grouped norm")  # fmt: skip
    limit = tuple(  # transformers writes inf as {"__float__": "Infinity"}
        float(x["__float__"] if isinstance(x, dict) else x)
        for x in hf.get("time_step_limit") or (0.0, float("inf"))
    )
    if limit != (0.0, float("inf")):
        _refuse("falcon_h1", f"time_step_limit={limit}", "llama.cpp's mamba2 does not clamp dt")
    d_ssm = int(hf.get("mamba_d_ssm") or hf["mamba_expand"] * cfg.hidden_size)
    if d_ssm != int(hf["mamba_n_heads"]) * int(hf["mamba_d_head"]):
        _refuse("falcon_h1", f"mamba_d_ssm={d_ssm}",
                "llama.cpp's mamba2 derives its head size as d_ssm / heads")  # fmt: skip
    if cfg.tie_word_embeddings and _falcon_mult(hf, "lm_head.weight") != 1.0:
        _refuse("falcon_h1", "a tied lm_head and multipliers",
                "llama.cpp would scale the embedding and the head alike")  # fmt: skip
    _activation("falcon_h1", hf, "hidden_act", ("silu",))


def _falcon_mult(hf: dict, name: str) -> float:
    """The constant Falcon-H1 multiplies this weight's output by (the converter folds it)."""
    attn_in = float(hf.get("attention_in_multiplier", 1.0))
    mlp = hf.get("mlp_multipliers") or (1.0, 1.0)
    table = {
        "feed_forward.gate_proj.weight": float(mlp[0]),
        "feed_forward.down_proj.weight": float(mlp[1]),
        "self_attn.q_proj.weight": attn_in,
        "self_attn.k_proj.weight": attn_in * float(hf.get("key_multiplier", 1.0)),
        "self_attn.v_proj.weight": attn_in,
        "self_attn.o_proj.weight": float(hf.get("attention_out_multiplier", 1.0)),
        "mamba.out_proj.weight": float(hf.get("ssm_out_multiplier", 1.0)),
        "lm_head.weight": float(hf.get("lm_head_multiplier", 1.0)),
        "embed_tokens.weight": float(hf.get("embedding_multiplier", 1.0)),
    }
    return next(v for k, v in table.items() if name.endswith(k))


def _falcon_mup(hf: dict, hidden: int) -> Any:
    """in_proj's per-row multipliers: ssm_in_multiplier times the mup vector's z, x, B, C, dt
    sections (transformers' compute_mup_vector)."""
    import torch

    d = int(hf.get("mamba_d_ssm") or hf["mamba_expand"] * hidden)
    gs = int(hf["mamba_n_groups"]) * int(hf["mamba_d_state"])
    sizes = [d, d, gs, gs, int(hf["mamba_n_heads"])]
    m = [float(x) for x in hf.get("ssm_multipliers") or [1.0] * 5]
    vec = torch.cat([torch.full((n,), x) for n, x in zip(sizes, m, strict=True)])
    return vec * float(hf.get("ssm_in_multiplier", 1.0))


def _falcon_scale(cfg: Any, name: str, t: Any, inverse: bool = False) -> Any:
    from slipstream.checkpoint.gguf_spec import text_hf

    hf = text_hf(cfg)
    if name.endswith("mamba.in_proj.weight"):
        m = _falcon_mup(hf, cfg.hidden_size).to(t.device)[:, None]
    else:
        m = _falcon_mult(hf, name)
    return t.float() / m if inverse else t.float() * m


def _falcon_h1_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_from_hf(w, cfg, hf)  # NeoX RoPE as HF's rotate_half: no permutation
    w.add_ssm_conv_kernel(int(hf["mamba_d_conv"]))
    w.add_ssm_inner_size(int(hf.get("mamba_d_ssm") or hf["mamba_expand"] * cfg.hidden_size))
    w.add_ssm_state_size(int(hf["mamba_d_state"]))
    w.add_ssm_time_step_rank(int(hf["mamba_n_heads"]))
    w.add_ssm_group_count(int(hf["mamba_n_groups"]))


def _falcon_same(suffix: str, export, inverse) -> TensorTransform:
    return TensorTransform(
        (suffix,),
        lambda cfg, name, t: [(name, export(cfg, name, t))],
        lambda cfg, name, parts: iter([(name, inverse(cfg, name, parts[0]))]),
    )


def _falcon_norm(cfg: Any, t: Any) -> Any:
    from slipstream.checkpoint.gguf_spec import text_hf

    return t.reshape(int(text_hf(cfg)["mamba_n_groups"]), -1)


FALCON_H1 = GGUFSpec(
    "FALCON_H1", "falcon-h1", ("falcon_h1",), check=_falcon_h1_check,
    write_metadata=_falcon_h1_metadata, extra_tensors=_no_tensors,
    transforms=(
        *(_falcon_same(x, _falcon_scale, lambda c, n, t: _falcon_scale(c, n, t, True))
          for x in ("feed_forward.gate_proj.weight", "feed_forward.down_proj.weight",
                    "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                    "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                    "mamba.out_proj.weight", "mamba.in_proj.weight", "lm_head.weight",
                    "embed_tokens.weight")),
        TensorTransform(  # transformers' dt_bias: llama.cpp's ssm_dt.bias
            ("mamba.dt_bias",),
            lambda cfg, name, t: [(name.replace("dt_bias", "dt_proj.bias"), t)],
            lambda cfg, name, parts: iter([(name, parts[0])]),
        ),
        TensorTransform(  # A = -exp(A_log), (H, 1) as llama.cpp's {1, H}
            ("mamba.A_log",),
            lambda cfg, name, t: [(name, -t.float().exp()[:, None])],
            lambda cfg, name, parts: iter([(name, (-parts[0][:, 0]).log())]),
        ),
        _falcon_same("mamba.D", lambda c, n, t: t[:, None], lambda c, n, t: t[:, 0]),
        _falcon_same("mamba.conv1d.weight", lambda c, n, t: t.squeeze(1),
                     lambda c, n, t: t.unsqueeze(1)),
        _falcon_same("mamba.norm.weight", lambda c, n, t: _falcon_norm(c, t),
                     lambda c, n, t: t.reshape(-1)),
    ),
)  # fmt: skip


def _nemotron_kinds(cfg: Any, hf: dict) -> list[str]:
    return list(
        hf.get("layers_block_type") or []
    )  # transformers' layer count (no num_hidden_layers)


def _nemotron_h_check(cfg: Any, hf: dict) -> None:
    kinds = _nemotron_kinds(cfg, hf)
    if "mlp" in kinds:  # the converter picks nemotron_h_moe: every FFN layer is MoE there
        _refuse(
            "nemotron_h", "dense mlp layers", "llama.cpp's nemotron_h_moe runs FFN layers as MoE"
        )
    if "moe" not in kinds:
        _refuse("nemotron_h", "no moe layer", "llama.cpp's nemotron_h_moe needs its experts")
    for key in ("moe_latent_size", "mlp_bias", "attention_bias", "use_bias", "mamba_proj_bias"):
        if hf.get(key):
            _refuse("nemotron_h", f"{key}={hf[key]}", "not written for llama.cpp here")
    if not hf.get("use_conv_bias", True):
        _refuse("nemotron_h", "use_conv_bias=false", "llama.cpp's mamba2 adds a conv bias")
    if int(hf.get("n_group") or 1) > 1:
        _refuse("nemotron_h", f"n_group={hf['n_group']}",
                "llama.cpp's converter writes no group count used")  # fmt: skip
    limit = tuple(
        float(x["__float__"] if isinstance(x, dict) else x)
        for x in hf.get("time_step_limit") or (0.0, float("inf"))
    )
    if limit != (0.0, float("inf")):
        _refuse("nemotron_h", f"time_step_limit={limit}", "llama.cpp's mamba2 does not clamp dt")
    _activation("nemotron_h", hf, "mlp_hidden_act", ("relu2",))
    _activation("nemotron_h", hf, "mamba_hidden_act", ("silu",))


def _nemotron_h_metadata(w: Any, cfg: Any, hf: dict) -> None:
    kinds = _nemotron_kinds(cfg, hf)
    for key in ("{arch}.attention.head_count_kv", "{arch}.feed_forward_length",
                "{arch}.attention.layer_norm_rms_epsilon"):  # fmt: skip
        _overwrite(w, key)
    # llama.cpp tells layers apart by these: both 0 is Mamba-2, K/V heads attention, a width MoE
    w.add_head_count_kv(
        [
            cfg.num_key_value_heads if "attention" in k and k != "linear_attention" else 0
            for k in kinds
        ]
    )
    ff = int(hf["moe_intermediate_size"])
    w.add_feed_forward_length([ff if k == "moe" else 0 for k in kinds])
    eps = float(hf["layer_norm_epsilon"])
    w.add_layer_norm_eps(eps)
    w.add_layer_norm_rms_eps(eps)
    w.add_ssm_conv_kernel(int(hf["conv_kernel"]))
    w.add_ssm_inner_size(int(hf["mamba_num_heads"]) * int(hf["mamba_head_dim"]))
    w.add_ssm_state_size(int(hf["ssm_state_size"]))
    w.add_ssm_time_step_rank(int(hf["mamba_num_heads"]))
    w.add_ssm_group_count(int(hf["n_groups"]))
    w.add_expert_used_count(int(hf["num_experts_per_tok"]))
    w.add_expert_feed_forward_length(ff)
    w.add_expert_shared_feed_forward_length(int(hf["moe_shared_expert_intermediate_size"]))
    w.add_expert_count(int(hf["n_routed_experts"]))
    w.add_expert_shared_count(int(hf.get("n_shared_experts") or 0))
    w.add_expert_weights_norm(bool(hf.get("norm_topk_prob")))
    w.add_expert_weights_scale(float(hf.get("routed_scaling_factor") or 1.0))


def _nemotron(suffix: str, fn=None, name_to=None) -> TensorTransform:
    """transformers' model.layers.N.mixer.* under the gguf table's backbone.layers.N.mixer.*
    (the converter renames them so), with `fn` applied to the tensor."""

    def export(cfg, name, t):
        out = name.replace("model.layers.", "backbone.layers.", 1)
        return [(name_to(out) if name_to else out, fn(cfg, t) if fn else t)]

    return TensorTransform((suffix,), export, lambda cfg, name, parts: iter([(name, parts[0])]))


def _nemotron_experts(name: str) -> str:
    """The stacked experts under the table's merged name (model.layers.N.mlp.experts.*)."""
    name = name.replace("backbone.layers.", "model.layers.", 1)
    return name.replace(".mixer.experts.", ".mlp.experts.") + ".weight"


def _nemotron_norm(cfg: Any, t: Any) -> Any:
    from slipstream.checkpoint.gguf_spec import text_hf

    return t.reshape(int(text_hf(cfg)["n_groups"]), -1)


NEMOTRON_H = GGUFSpec(
    "NEMOTRON_H_MOE", "nemotron_h_moe", ("nemotron_h",), check=_nemotron_h_check,
    write_metadata=_nemotron_h_metadata, extra_tensors=_no_tensors,
    transforms=(
        *(_nemotron(x) for x in ("mixer.in_proj.weight", "mixer.conv1d.bias",
                                 "mixer.out_proj.weight", "mixer.q_proj.weight",
                                 "mixer.k_proj.weight", "mixer.v_proj.weight",
                                 "mixer.o_proj.weight", "mixer.gate.weight",
                                 "mixer.shared_experts.up_proj.weight",
                                 "mixer.shared_experts.down_proj.weight")),
        _nemotron("mixer.conv1d.weight", lambda cfg, t: t.squeeze(1)),
        _nemotron("mixer.dt_bias", None, lambda n: n.replace("dt_bias", "dt_proj.bias")),
        _nemotron("mixer.A_log", lambda cfg, t: -t.float().exp()[:, None]),
        _nemotron("mixer.D", lambda cfg, t: t[:, None]),
        _nemotron("mixer.norm.weight", _nemotron_norm),
        _nemotron("mixer.experts.up_proj", None, _nemotron_experts),  # (E, F, D)
        _nemotron("mixer.experts.down_proj", None, _nemotron_experts),  # (E, D, F)
        _nemotron("mixer.gate.e_score_correction_bias", lambda cfg, t: t.float(),
                  lambda n: n.removesuffix("_bias") + ".bias"),
    ),
)  # fmt: skip


def _qwen3_next_check(cfg: Any, hf: dict) -> None:
    if not hf.get("norm_topk_prob", True):  # src/models/qwen3next.cpp: norm_w = true
        _refuse("qwen3_next", "norm_topk_prob=false", "llama.cpp's qwen3next renormalises top-k")
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step") or 1) != 1:
        _refuse("qwen3_next", "dense layers (mlp_only_layers/decoder_sparse_step)",
                "llama.cpp's qwen3next expects a MoE block in every layer")  # fmt: skip
    if hf.get("attention_bias"):
        _refuse("qwen3_next", "attention_bias=true", "llama.cpp's qwen3next has no biases")
    _activation("qwen3_next", hf, "hidden_act", ("silu",))


def _qwen3_next_metadata(w: Any, cfg: Any, hf: dict) -> None:
    rope_from_hf(w, cfg, hf)  # NeoX partial RoPE: no permutation
    L = cfg.num_hidden_layers
    w.add_expert_count(int(hf["num_experts"]))
    w.add_expert_used_count(int(hf["num_experts_per_tok"]))
    w.add_expert_feed_forward_length(int(hf["moe_intermediate_size"]))
    w.add_expert_shared_feed_forward_length(int(hf["shared_expert_intermediate_size"]))
    gated_deltanet_metadata(w, hf, [t == "linear_attention" for t in hf["layer_types"][:L]])


def _qkvz_split(cfg: Any, name: str, t: Any) -> list[tuple[str, Any]]:
    """in_proj_qkvz, rows grouped per key head [q, k, v, z], as llama.cpp's attn_qkv (all q,
    then all k, then all v rows) and attn_gate (the z rows)."""
    import torch

    from slipstream.checkpoint.gguf_spec import text_hf

    hf = text_hf(cfg)
    nk, hk, hv = (int(hf[k]) for k in ("linear_num_key_heads", "linear_key_head_dim",
                                        "linear_value_head_dim"))  # fmt: skip
    r = int(hf["linear_num_value_heads"]) // nk
    q, k, v, z = t.reshape(nk, -1, t.shape[-1]).split([hk, hk, r * hv, r * hv], dim=1)
    base = name.removesuffix("in_proj_qkvz.weight")
    flat = [x.reshape(-1, t.shape[-1]) for x in (q, k, v, z)]
    return [
        (base + "in_proj_qkv.weight", torch.cat(flat[:3])),
        (base + "in_proj_z.weight", flat[3]),
    ]


def _qwen3_next_join(cfg: Any, name: str, parts: list[Any]) -> Iterator[tuple[str, Any]]:
    raise NotImplementedError("GGUF import of qwen3_next: export only")


QWEN3_NEXT = GGUFSpec(
    "QWEN3NEXT", "qwen3next", ("qwen3_next",), check=_qwen3_next_check,
    write_metadata=_qwen3_next_metadata, extra_tensors=_no_tensors,
    transforms=(
        TensorTransform(("linear_attn.in_proj_qkvz.weight",), _qkvz_split, _qwen3_next_join),
        TensorTransform(("linear_attn.dt_bias",),
                        lambda cfg, name, t: [(name.replace("dt_bias", "dt_proj.bias"), t)],
                        _qwen3_next_join),
        TensorTransform(("linear_attn.A_log",),
                        lambda cfg, name, t: [(name, -t.float().exp())], _qwen3_next_join),
        TensorTransform(("linear_attn.conv1d.weight",),
                        lambda cfg, name, t: [(name, t.squeeze(1))], _qwen3_next_join),
        TensorTransform(("linear_attn.norm.weight",),  # a plain weight: no + 1
                        lambda cfg, name, t: [(name, t)], _qwen3_next_join),
        TensorTransform(("norm.weight", "layernorm.weight"),  # Qwen3-Next's RMSNorm: 1 + w
                        lambda cfg, name, t: [(name, t.float() + 1.0)], _qwen3_next_join),
        TensorTransform(("mlp.shared_expert_gate.weight",),  # (1, D): one vector ({n_embd})
                        lambda cfg, name, t: [(name, t.reshape(-1))], _qwen3_next_join),
    ),
    pre_tokenizer="qwen2",
)  # fmt: skip

SPECS = (OLMO2, OLMO3, MIXTRAL, QWEN2MOE, GEMMA2, STARCODER2, STABLELM, PHI2, GRANITE, GRANITEMOE,
         SMOLLM3, LFM2, COHERE2, MINIMAX_M2, GLM4_MOE, ERNIE4_5_MOE, LLAMA4, DEEPSEEK_V3,
         FALCON_H1, NEMOTRON_H, QWEN3_NEXT)  # fmt: skip
GENERIC_SPECS = {t: spec for spec in SPECS for t in spec.model_types}
