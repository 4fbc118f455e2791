"""Gemma 4's text model as llama.cpp's `gemma4` architecture (its GGUFSpec; export only).

What llama.cpp's gemma4 reads, from its converter (Gemma4Model) and its model code
(src/models/gemma4.cpp), and how our config (models/gemma4.py) maps onto it:
- layer kinds as `attention.sliding_window_pattern` (one bool a layer, true = sliding);
  sliding and full layers each have one head dim (`key_length_swa` / `key_length`) and RoPE
  (`rope.freq_base_swa` + `rope.dimension_count_swa` / `rope.freq_base` +
  `rope.dimension_count`); KV heads and MLP widths per layer as arrays;
- the full layers' RoPE turns pairs (i, i + Dh/2) over the whole head (n_rot = Dh) with
  per-frequency divisors `rope_freqs` (Dh/2,): ours theta^(-2i/Dh) / f_i = our inv_freq_i,
  so "proportional" RoPE's pass-through pairs get 1e30 (frequency 0, as its converter);
- K/V sharing as `attention.shared_kv_layers`: llama.cpp's shared layer reuses layer
  L - shared - 1 (full) or L - shared - 2 (sliding), so the refusal compares that with ours;
- per-layer inputs (`embedding_length_per_layer_input`, the per-layer table and projections),
  `layer_scalar` as `layer_output_scale`, final logit softcapping; attention scale 1 and the
  weightless v norm are fixed in its code, as ours;
- RMSNorm weights as they are (Gemma 4 scales by w, not 1 + w: no shift, unlike gemma3);
- MoE (26B-A4B): router `proj` as `ffn_gate_inp`, its `scale` as `ffn_gate_inp.scale`,
  `per_expert_scale` as `ffn_down_exps.scale` (llama.cpp scales each expert's output, which
  equals our scaling of its routing weight), fused gate_up (E, 2F, D) and down (E, D, F) as
  they are.
Refused in one line, before anything is written: whatever llama.cpp fixes otherwise (exact
GELU, attention bias, a per-layer vocabulary other than the vocabulary, sliding RoPE other than
the default, head dims that differ within a kind, K/V sources other than llama.cpp's); and a
GGUF LoRA (gguf_lora.py) on `per_layer_model_projection`, where llama.cpp applies none.
No torch import at module level (gguf_spec.py says why).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from slipstream.checkpoint.gguf_spec import GGUFSpec, TensorTransform

UNTURNED = 1e30  # llama.cpp's converter's divisor for a pair RoPE does not turn


def _kind_value(cfg: Any, values: tuple, kind: str) -> set:
    return {v for v, t in zip(values, cfg.layer_types, strict=True) if t == kind}


def llama_cpp_kv_sources(cfg: Any) -> list[int]:
    """The layer whose K/V each layer uses in llama.cpp (llama-model.cpp's reuse callback)."""
    L = cfg.num_hidden_layers
    first = L - sum(s != i for i, s in enumerate(cfg.kv_source))
    sliding = [t == "sliding_attention" for t in cfg.layer_types]
    return [i if i < first else first - (2 if sliding[i] else 1) for i in range(L)]


def _check(cfg: Any, hf: dict) -> None:
    def refuse(what: str, why: str) -> None:
        raise ValueError(
            f"GGUF export: {cfg.model_type} with {what}: {why}, so it would compute another model."
        )

    if cfg.gelu_approximate != "tanh":
        refuse("hidden_activation gelu (exact)", "llama.cpp's gemma4 runs the tanh GELU")
    if cfg.attention_bias:
        refuse("attention_bias", "llama.cpp's gemma4 loads no attention biases")
    if cfg.per_layer_dim and cfg.per_layer_vocab != cfg.vocab_size:
        refuse(
            f"vocab_size_per_layer_input={cfg.per_layer_vocab} != vocab_size={cfg.vocab_size}",
            "llama.cpp's per-layer table has one row per token of the vocabulary",
        )
    rope = cfg.rope
    if rope.rope_type != "default":
        refuse(f"sliding-layer RoPE {rope.rope_type!r}", "llama.cpp scales no sliding RoPE")
    for kind in ("sliding_attention", "full_attention"):
        dims = _kind_value(cfg, cfg.head_dims, kind)
        if len(dims) > 1:
            refuse(f"{kind} head dims {sorted(dims)}", "llama.cpp has one head dim per kind")
    sources = llama_cpp_kv_sources(cfg)
    if sources != list(cfg.kv_source):
        refuse(
            f"K/V sources {list(cfg.kv_source)}",
            f"llama.cpp's shared layers reuse the last layer computing K/V (full ones) or the "
            f"one before it (sliding ones): {sources}",
        )
    if sum(s == i for i, s in enumerate(cfg.kv_source)) < 2:
        refuse("fewer than 2 layers computing K/V", "llama.cpp's gemma4 needs at least two")
    full = _full_head_dim(cfg)
    if len(_full_inv_freq(cfg)) != full // 2:
        refuse(
            f"full-layer RoPE {cfg.full_rope}",
            "llama.cpp turns every pair (i, i + head_dim/2) of a full layer",
        )


def _full_head_dim(cfg: Any) -> int:
    dims = _kind_value(cfg, cfg.head_dims, "full_attention")
    return dims.pop() if dims else cfg.head_dim


def _full_inv_freq(cfg: Any) -> Any:
    from slipstream.models.gemma4 import full_inv_freq

    return full_inv_freq(cfg.full_rope, _full_head_dim(cfg))


def _full_theta(cfg: Any) -> float:
    return float(cfg.full_rope.get("rope_theta", 1_000_000.0))


def _replace(w: Any, key: str, add: Any, value: Any) -> None:
    """`add(value)` for `key` (a gguf.Keys template), replacing what the common
    hyperparameters (gguf_arch.write_metadata) wrote there, without the writer's warning."""
    w.kv_data[0].pop(key.format(arch=w.arch), None)
    add(value)


def _metadata(w: Any, cfg: Any, hf: dict) -> None:
    """The keys module docstring lists; the common ones (gguf_arch.write_metadata: the
    sliding layers' head dim and KV heads) replaced where Gemma 4 has them per layer."""
    from gguf import Keys

    sliding = [t == "sliding_attention" for t in cfg.layer_types]
    full_dim = _full_head_dim(cfg)
    _replace(w, Keys.Attention.KEY_LENGTH, w.add_key_length, full_dim)
    _replace(w, Keys.Attention.VALUE_LENGTH, w.add_value_length, full_dim)
    w.add_key_length_swa(cfg.head_dim)
    w.add_value_length_swa(cfg.head_dim)
    _replace(w, Keys.Attention.HEAD_COUNT_KV, w.add_head_count_kv, list(cfg.kv_heads))
    widths = [cfg.intermediate_size * (2 if wide else 1) for wide in cfg.double_wide]
    width = widths if len(set(widths)) > 1 else widths[0]
    _replace(w, Keys.LLM.FEED_FORWARD_LENGTH, w.add_feed_forward_length, width)
    w.add_sliding_window_pattern(sliding)
    w.add_sliding_window(int(cfg.sliding_window or 0))
    w.add_shared_kv_layers(sum(s != i for i, s in enumerate(cfg.kv_source)))
    w.add_embedding_length_per_layer_input(cfg.per_layer_dim)
    w.add_rope_freq_base(_full_theta(cfg))
    w.add_rope_dimension_count(full_dim)
    w.add_rope_freq_base_swa(float(cfg.rope.theta))
    w.add_rope_dimension_count_swa(cfg.rope.rotary_dim(cfg.head_dim))
    if cfg.final_softcap:
        w.add_final_logit_softcapping(float(cfg.final_softcap))
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.top_k)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def _rope_freqs(cfg: Any) -> Iterator[tuple[str, Any]]:
    """The full layers' divisors: llama.cpp's theta^(-2i/Dh) over ours, 1e30 where ours is 0."""
    import gguf
    import torch

    inv_freq = _full_inv_freq(cfg).double()
    Dh = _full_head_dim(cfg)
    plain = _full_theta(cfg) ** (-torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)
    divisors = torch.where(inv_freq > 0, plain / inv_freq.clamp_min(1e-300), UNTURNED)
    yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", divisors.float()


def _renamed(suffix: str, new: str) -> TensorTransform:
    """A tensor kept as it is under another name (what llama.cpp's table renames)."""
    return TensorTransform(
        (suffix,),
        lambda cfg, name, t: [(name.removesuffix(suffix) + new, t)],
        lambda cfg, name, parts: iter([(name, parts[0])]),
    )


GEMMA4 = GGUFSpec(
    "GEMMA4",
    "gemma4",
    ("gemma4_text", "gemma4"),  # gemma4: the text model of the multimodal checkpoint
    check=_check,
    write_metadata=_metadata,
    extra_tensors=_rope_freqs,
    transforms=(
        _renamed("layer_scalar", "layer_scalar.weight"),
        _renamed("experts.gate_up_proj", "experts.gate_up_proj.weight"),
        _renamed("experts.down_proj", "experts.down_proj.weight"),
        _renamed("router.scale", "router.proj.scale"),
        _renamed("router.per_expert_scale", "experts.down_proj.scale"),
    ),
    # llama.cpp's per-layer input projection is a plain ggml_mul_mat (gemma4.cpp): measured,
    # a LoRA on it left llama.cpp's logits 31% of the adapter's move away from merging.
    no_lora=("per_layer_model_projection",),
)
