"""Qwen3.5's GGUF form (native models/qwen3_5.py, qwen3_5_moe.py): llama.cpp's `qwen35` and
`qwen35moe` (after conversion/qwen.py's Qwen3_5TextModel / Qwen3_5MoeTextModel and
src/models/qwen35.cpp, qwen35moe.cpp). Export only, as for Qwen2.5-VL's qwen2vl.

What differs from the HF checkpoint:
- value heads regrouped: HF orders a DeltaNet layer's H value heads by key head (head h reads
  key head h // r, r = H / Hk); llama.cpp broadcasts key heads tiled (head h reads h % Hk),
  so every value-head axis is reordered (r, Hk) <- (Hk, r): the V rows of in_proj_qkv and its
  conv channels, in_proj_z's rows, in_proj_a/b's rows, A and dt_bias, out_proj's columns;
- A stored as -exp(A_log), dt_bias as ssm_dt.bias, the conv kernel (C, 1, W) as (C, W);
- every RMSNorm but the DeltaNet's gated one stored as 1 + w (HF adds the 1 at run time);
- the gated attention's q_proj ([query | gate] per head) as HF holds it; RoPE is llama.cpp's
  interleaved M-RoPE (IMROPE: NeoX pairs, no Q/K permutation) on the first
  `partial_rotary_factor` of each head, its t/h/w sections under rope.dimension_sections;
- which layers are DeltaNet under attention.recurrent_layers (`gated_deltanet_metadata`, the
  ssm.* keys gguf_generic's qwen3_next writes too);
- MoE (qwen35moe): experts stacked, the shared expert's gate (1, D) as one vector; softmax
  top-k renormalised, as our block always does and llama.cpp's qwen35moe fixes.
The MTP head (`mtp.*`, never a model parameter here) is not written: llama.cpp
runs the trunk alone without it.

Refused in one line, because llama.cpp would compute another model: key and value head dims
that differ (llama.cpp sizes both by ssm.state_size), rms_norm_eps other than 1e-6 (llama.cpp
L2-normalises q/k with it; HF with a fixed 1e-6), scaled RoPE, M-RoPE sections under which
llama.cpp would turn a frequency by another position row than HF, attention biases.
No torch import at module level (gguf_spec.py says why).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from slipstream.checkpoint.gguf_spec import GGUFSpec, TensorTransform, text_hf


def _refuse(cfg: Any, what: str, why: str) -> None:
    raise ValueError(
        f"GGUF export: {cfg.model_type} with {what}: {why}, so it would compute another model."
    )


def _sections(cfg: Any) -> list[int]:
    from slipstream.models.qwen_vl import mrope_section

    return mrope_section(text_hf(cfg), "qwen3_5")


def llama_cpp_axes(section: list[int], freqs: int) -> list[int]:
    """The position row (0 t, 1 h, 2 w, 3 the fourth, 0 for text) llama.cpp's IMROPE turns
    each of the F rotary frequencies by (ggml's ggml_mrope_cache_init, sections cycling)."""
    s0, s1, s2 = section
    axes = []
    for j in range(freqs):
        s = j % (s0 + s1 + s2)
        if s % 3 == 1 and s < 3 * s1:
            axes.append(1)
        elif s % 3 == 2 and s < 3 * s2:
            axes.append(2)
        elif s % 3 == 0 and s < 3 * s0:
            axes.append(0)
        else:
            axes.append(3)
    return axes


def _check(cfg: Any, hf: dict) -> None:
    from slipstream.models.rope import mrope_axes

    lin = cfg.linear
    if lin["key_head_dim"] != lin["value_head_dim"]:
        _refuse(cfg, f"linear_key_head_dim={lin['key_head_dim']} != linear_value_head_dim="
                f"{lin['value_head_dim']}", "llama.cpp sizes both by ssm.state_size")  # fmt: skip
    if float(cfg.rms_norm_eps) != 1e-6:
        _refuse(cfg, f"rms_norm_eps={cfg.rms_norm_eps:g}", "llama.cpp L2-normalises the "
                "DeltaNet's q and k with it, HF with a fixed 1e-6")  # fmt: skip
    if cfg.rope.rope_type != "default":
        _refuse(cfg, f"rope_type {cfg.rope.rope_type!r}", "only unscaled M-RoPE is written here")
    if cfg.attention_bias:
        _refuse(cfg, "attention_bias=true", "llama.cpp's qwen35 has no attention biases")
    section, freqs = _sections(cfg), cfg.rope.rotary_dim(cfg.head_dim) // 2
    if sum(section) > cfg.head_dim or llama_cpp_axes(section, freqs) != mrope_axes(
        section, True, freqs
    ):
        _refuse(cfg, f"mrope_section={section} for {freqs} rotary frequencies", "llama.cpp's "
                "interleaved M-RoPE would turn some by another position row than HF")  # fmt: skip


def gated_deltanet_metadata(w: Any, hf: dict, recurrent: list[bool]) -> None:
    """Gated DeltaNet sizes under llama.cpp's ssm.* keys (Qwen3.5's and gguf_generic's
    Qwen3-Next's), which layers are DeltaNet (`recurrent`, {arch}.attention.recurrent_layers:
    this gguf package has no add_ method for it) and the interval llama.cpp's default pattern
    would use."""
    w.add_ssm_conv_kernel(int(hf["linear_conv_kernel_dim"]))
    w.add_ssm_state_size(int(hf["linear_key_head_dim"]))
    w.add_ssm_group_count(int(hf["linear_num_key_heads"]))
    w.add_ssm_time_step_rank(int(hf["linear_num_value_heads"]))
    w.add_ssm_inner_size(int(hf["linear_value_head_dim"]) * int(hf["linear_num_value_heads"]))
    w.add_array(f"{w.arch}.attention.recurrent_layers", recurrent)
    w.add_full_attention_interval(int(hf.get("full_attention_interval") or 4))


def _metadata(w: Any, cfg: Any, hf: dict) -> None:
    w.add_rope_freq_base(float(cfg.rope.theta))
    w.add_rope_dimension_count(cfg.rope.rotary_dim(cfg.head_dim))
    w.add_rope_dimension_sections([*_sections(cfg), 0])
    sizes = {**hf, **{f"linear_{k}": v for k, v in cfg.linear.items()}}  # defaults filled
    gated_deltanet_metadata(w, sizes, [t == "linear_attention" for t in cfg.layer_types])


def _metadata_moe(w: Any, cfg: Any, hf: dict) -> None:
    from slipstream.models.moe_block import num_experts_from_hf

    _metadata(w, cfg, hf)
    w.add_expert_count(num_experts_from_hf(hf))
    w.add_expert_used_count(int(hf["num_experts_per_tok"]))
    w.add_expert_feed_forward_length(int(hf["moe_intermediate_size"]))
    w.add_expert_shared_feed_forward_length(int(hf.get("shared_expert_intermediate_size", 512)))


# ----------------------------------------------------------------------------- value heads


def regroup(t: Any, dim: int, outer: int, inner: int, width: int) -> Any:
    """Along `dim`, (outer, inner, width) blocks -> (inner, outer, width): HF's value heads
    grouped by key head (outer = Hk, inner = r) to llama.cpp's tiled order; swapping outer and
    inner undoes it."""
    x = t.movedim(dim, 0)
    rest = x.shape[1:]
    x = x.reshape(outer, inner, width, *rest).transpose(0, 1).reshape(-1, *rest)
    return x.movedim(0, dim).contiguous()


def _heads(cfg: Any) -> tuple[int, int, int, int]:
    lin = cfg.linear  # (Hk, r, K, V)
    Hk = lin["num_key_heads"]
    return Hk, lin["num_value_heads"] // Hk, lin["key_head_dim"], lin["value_head_dim"]


def _tiled(dim: int, width: str, back: bool = False):
    """t -> t with its value-head axis `dim` in llama.cpp's order (`back`: HF's); `width` is
    each head's features there ("V" or "1")."""

    def fn(cfg: Any, t: Any) -> Any:
        Hk, r, _, V = _heads(cfg)
        w = V if width == "V" else 1
        return regroup(t, dim, r, Hk, w) if back else regroup(t, dim, Hk, r, w)

    return fn


def _v_part(fn):
    """fn applied to the V rows only (after 2 Hk K rows of q and k): in_proj_qkv, conv1d."""

    def part(cfg: Any, t: Any) -> Any:
        import torch

        Hk, _, K, _ = _heads(cfg)
        return torch.cat([t[: 2 * Hk * K], fn(cfg, t[2 * Hk * K :])])

    return part


def _form(suffix: str, export, inverse, rename=None, rows=False, cols=False) -> TensorTransform:
    """A transform of the tensors ending with `suffix`: `export(cfg, t)` to llama.cpp,
    `inverse(cfg, t)` back; `rename` (HF name -> the name llama.cpp's table knows)."""

    def to_llama_cpp(cfg: Any, name: str, t: Any) -> list[tuple[str, Any]]:
        return [(rename(name) if rename else name, export(cfg, t))]

    def to_hf(cfg: Any, name: str, parts: list[Any]) -> Iterator[tuple[str, Any]]:
        yield name, inverse(cfg, parts[0])

    return TensorTransform((suffix,), to_llama_cpp, to_hf, rows=rows, cols=cols)


def _neg_exp(fn):
    return lambda cfg, t: fn(cfg, -t.float().exp())


def _log_neg(fn):
    return lambda cfg, t: fn(cfg, t).neg().log()


def _dt_proj(name: str) -> str:
    return name.replace("dt_bias", "dt_proj.bias")


def _conv(fn, back: bool = False):
    """The conv kernel (C, 1, W) as (C, W), its V channels by `fn` (and back)."""
    if back:
        return lambda cfg, t: _v_part(fn)(cfg, t).unsqueeze(1)
    return lambda cfg, t: _v_part(fn)(cfg, t.squeeze(1))


V_ROWS, V_BACK = _tiled(0, "V"), _tiled(0, "V", back=True)
H_ROWS, H_BACK = _tiled(0, "1"), _tiled(0, "1", back=True)
TRANSFORMS = (
    _form("linear_attn.in_proj_qkv.weight", _v_part(V_ROWS), _v_part(V_BACK), rows=True),
    _form("linear_attn.in_proj_z.weight", V_ROWS, V_BACK, rows=True),
    _form("linear_attn.in_proj_a.weight", H_ROWS, H_BACK, rows=True),
    _form("linear_attn.in_proj_b.weight", H_ROWS, H_BACK, rows=True),
    _form("linear_attn.out_proj.weight", _tiled(1, "V"), _tiled(1, "V", back=True), cols=True),
    _form("linear_attn.A_log", _neg_exp(H_ROWS), _log_neg(H_BACK)),
    _form("linear_attn.dt_bias", H_ROWS, H_BACK, rename=_dt_proj),
    _form("linear_attn.conv1d.weight", _conv(V_ROWS), _conv(V_BACK, back=True)),
    _form("linear_attn.norm.weight", lambda cfg, t: t, lambda cfg, t: t),  # plain: no + 1
    # every other RMSNorm (the layers' two, q/k, the final one): 1 + w
    _form("norm.weight", lambda cfg, t: t.float() + 1.0, lambda cfg, t: t - 1.0),
)
SHARED_GATE = _form(  # (1, D) -> one vector ({n_embd})
    "mlp.shared_expert_gate.weight", lambda cfg, t: t.reshape(-1), lambda cfg, t: t[None]
)

QWEN35 = GGUFSpec(
    "QWEN35", "qwen35", ("qwen3_5_text", "qwen3_5"), check=_check, write_metadata=_metadata,
    extra_tensors=lambda cfg: iter(()), transforms=TRANSFORMS, pre_tokenizer="qwen35",
)  # fmt: skip
QWEN35MOE = GGUFSpec(
    "QWEN35MOE", "qwen35moe", ("qwen3_5_moe_text", "qwen3_5_moe"), check=_check,
    write_metadata=_metadata_moe, extra_tensors=lambda cfg: iter(()),
    transforms=(*TRANSFORMS, SHARED_GATE), pre_tokenizer="qwen35",
)  # fmt: skip
