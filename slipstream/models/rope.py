"""Rotary position embeddings (RoPE) driven by packed position ids.

The inverse frequencies are computed once, on the host, from the checkpoint's config; each
forward turns `seq.position_ids` into one `(T, Dh)` cos/sin pair that every layer shares.
Scaling types: default, linear (position interpolation), llama3 (frequency-band smoothing),
yarn (NTK-by-parts with an attention temperature). Partial rotary (`partial_rotary_factor`,
0.75 on Phi-4-mini): RoPE turns the first R = int(Dh * factor) features of each head and
passes the rest through, as transformers does for every family that sets it.

Multimodal RoPE (mRoPE, Qwen-VL): each token has three positions (t, h, w: (3, T), built on
the host, data/mrope.py) and each rotary frequency reads one of them, by sections
(`mrope_section` [s_t, s_h, s_w], summing to R/2): in blocks (Qwen2-VL, Qwen2.5-VL: the first
s_t frequencies read t, the next s_h h, the last s_w w) or interleaved (Qwen3-VL, Qwen3.5:
t h w t h w ..., h and w on the first s_h and s_w of their turns, t on the rest). A text token's
positions are (p, p, p), so text alone gives the 1-D tables.

Shapes: T tokens, H heads, Dh head dim, R rotary dims (Dh unless partial), F = R/2 frequencies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(cls, hf: dict) -> RopeConfig:
        """Read `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x)."""
        params = dict(hf.get("rope_scaling") or {})
        params.update(hf.get("rope_parameters") or {})
        theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
        if rope_type not in ("default", "linear", "llama3", "yarn"):
            raise ValueError(
                f"config.json: rope type {rope_type!r} is not supported; "
                "supported: default, linear, llama3, yarn."
            )
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in params.items() if k in known and v is not None}
        if hf.get("partial_rotary_factor") is not None:  # 4.x keeps it at the top level
            kwargs.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
        if rope_type in ("llama3", "yarn") and "original_max_position_embeddings" not in kwargs:
            kwargs["original_max_position_embeddings"] = hf.get("max_position_embeddings")
        return cls(theta=float(theta), rope_type=rope_type, **kwargs)

    def rotary_dim(self, head_dim: int) -> int:
        """R, the features of each head RoPE turns: int(head_dim * partial_rotary_factor)."""
        R = int(head_dim * self.partial_rotary_factor)
        if not (0 < R <= head_dim and R % 2 == 0):
            raise ValueError(
                f"config.json: partial_rotary_factor={self.partial_rotary_factor} gives {R} "
                f"rotary dims of head_dim {head_dim}; it must give an even number in "
                f"(0, {head_dim}]."
            )
        return R


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (R/2,) in float32 and the cos/sin scale (1.0 except for yarn)."""
    R = rope.rotary_dim(head_dim)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, R, 2, dtype=torch.int64).float() / R))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, R)
    return inv_freq, 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, base = rope.factor, rope.theta
    attn = rope.attention_factor
    if attn is None:
        if rope.mscale and rope.mscale_all_dim:
            attn = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attn = mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp  # 1 where the frequency is kept, 0 where it is interpolated
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate
    return inv_freq, float(attn)


def rope_cos_sin(
    position_ids_T: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, R) for the given positions; computed in float32, then cast."""
    freqs_TF = position_ids_T.float()[:, None] * inv_freq.float()[None, :]
    emb_TD = torch.cat([freqs_TF, freqs_TF], dim=-1)
    return (emb_TD.cos() * scale).to(dtype), (emb_TD.sin() * scale).to(dtype)


def mrope_axes(section, interleaved: bool, freqs: int) -> list[int]:
    """Which position row (0 t, 1 h, 2 w) each of the F rotary frequencies reads (module
    docstring); in blocks the sections must sum to F (a one-line error), interleaved they are
    cut at F, as transformers' slices are."""
    if len(section) != 3 or (not interleaved and sum(section) != freqs):
        raise ValueError(
            f"config.json: rope mrope_section={list(section)} must be three numbers summing to "
            f"{freqs} (half the rotary dims)."
        )
    if not interleaved:
        return [axis for axis, n in enumerate(section) for _ in range(n)]
    axes = [0] * freqs
    for axis in (1, 2):  # transformers' apply_interleaved_mrope: h at 1, 4, ..., w at 2, 5, ...
        for j in range(axis, min(section[axis] * 3, freqs), 3):  # its slice, cut at F
            axes[j] = axis
    return axes


def mrope_cos_sin(
    positions_3T: torch.Tensor,
    inv_freq: torch.Tensor,
    axes_F: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, R) of 3-D positions: frequency j turns by position row axes_F[j]."""
    pos_FT = positions_3T.index_select(0, axes_F).float()  # a gather: no host sync
    freqs_TF = pos_FT.T * inv_freq.float()[None, :]
    emb_TD = torch.cat([freqs_TF, freqs_TF], dim=-1)
    return (emb_TD.cos() * scale).to(dtype), (emb_TD.sin() * scale).to(dtype)


def apply_rope(x_THD: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate the two halves of each head's first R features (R = cos's width):
    x*cos + rotate_half(x)*sin; the features past R pass through."""
    cos_TR, sin_TR = cos_sin
    R = cos_TR.shape[-1]
    if x_THD.shape[-1] > R:
        return torch.cat([apply_rope(x_THD[..., :R], cos_sin), x_THD[..., R:]], dim=-1)
    x1, x2 = x_THD.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x_THD * cos_TR[:, None, :] + rotated * sin_TR[:, None, :]
