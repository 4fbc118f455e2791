"""llama3 RoPE scaling (Llama 3.1+) back from a GGUF's `rope_freqs` tensor.

llama.cpp keeps llama3 RoPE as one divisor per frequency, r_i = plain inv_freq_i / scaled
inv_freq_i (`rope_freqs.weight`, what its converter and `gguf_arch.extra_tensors` write), and
no scaling keys. transformers' llama3 rule is continuous and piecewise in x = 1/wavelength:
r = 1 for high frequencies, r = factor for low ones, and between them
1/r = (1 - s)/factor + s, with s = (old * x - low) / (high - low) linear in x
(old = original_max_position_embeddings, low/high = low_freq_factor/high_freq_factor).
So the divisors give `factor` (their largest) and the line s(x) = (x - x0) / (x1 - x0) with
x0 = low/old and x1 = high/old; every (old, low, high) on that line computes the same
frequencies. `old` is the file's `rope.scaling.original_context_length` (our exporter writes
it; llama.cpp ignores it outside yarn), else the one that makes low_freq_factor 1, as in
every Llama 3.x release (8192, low 1, high 4), rounded to an integer.

With fewer than two mid-band frequencies the line is not determined: we take low 1 / high 4
where they fit the bands, else bounds between the bands. Divisors all 1 are plain RoPE (no
scaling); all equal to one factor > 1, linear scaling. Each result is checked: our RoPE code
must give the file's frequencies (plain / r, float32) within VERIFY_RTOL, and each number is
the shortest decimal that fits them as well as the unrounded solution (or within CLEAN_RTOL).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from slipstream.checkpoint.gguf_fields import decimal
from slipstream.models.rope import RopeConfig, rope_inv_freq

EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7
BAND_RTOL = 4 * EPS32  # a divisor this close to 1 (or to factor) is in that band
CLEAN_RTOL = 2 * EPS32  # a rounder number may leave a frequency this far off (float32 noise)
VERIFY_RTOL = 1e-6  # the config's frequencies vs the file's (8 float32 ulps)


def llama3_rope_scaling(
    divisors: np.ndarray,
    theta: float,
    head_dim: int,
    context_length: int,
    original: int | None = None,
) -> dict | None:
    """transformers' `rope_scaling` for llama.cpp's per-frequency RoPE divisors (head_dim/2,),
    highest frequency first; None when they are all 1. A one-line error if no llama3 rule
    gives them."""
    r = _checked(divisors, head_dim)
    plain = RopeConfig(theta=theta)
    inv_freq = rope_inv_freq(plain, head_dim)[0]
    target = (inv_freq / torch.tensor(r, dtype=torch.float32)).double()  # llama.cpp's
    F = float(r.max())
    high, low = r <= 1 + BAND_RTOL, r >= F * (1 - BAND_RTOL)
    if high.all():
        return None
    if low.all():
        return _cleaned(target, head_dim, replace(plain, rope_type="linear", factor=F))
    F = float(np.median(r[low]))  # float32 noise: one low-band divisor may be off by an ulp
    x = inv_freq.double().numpy() / (2 * math.pi)  # 1/wavelength
    mid = ~(high | low)
    s = (1 / r[mid] - 1 / F) / (1 - 1 / F)
    if mid.sum() >= 2:
        p, q = np.polyfit(x[mid], s, 1)
        x0, x1 = -q / p, (1 - q) / p
        if not (p > 0 and x0 > 0):
            raise ValueError(
                "GGUF rope_freqs.weight is not llama3 RoPE: its mid-band divisors do not "
                "fall with the wavelength as transformers' llama3 rule makes them."
            )
        old = original or max(1, round(1 / x0))
        lines = [(x0, x1)]
    else:
        old = original or max(1, round(context_length / F))
        lines = _degenerate_lines(x, high, low, mid, s, old)
    for x0, x1 in lines:
        bands = dict(low_freq_factor=old * x0, high_freq_factor=old * x1)
        rope = replace(plain, rope_type="llama3", factor=F, **bands,
                       original_max_position_embeddings=int(old))  # fmt: skip
        out = _cleaned(target, head_dim, rope)
        if out is not None:
            return out
    raise ValueError(
        "GGUF rope_freqs.weight is not llama3 RoPE: no factor, low/high_freq_factor and "
        "original_max_position_embeddings reproduce its frequencies."
    )


def _checked(divisors: np.ndarray, head_dim: int) -> np.ndarray:
    """The divisors as float64 (head_dim/2,), or a one-line error naming the first bad one."""
    r = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if r.size != head_dim // 2:
        raise ValueError(
            f"GGUF rope_freqs.weight has {r.size} values; head_dim {head_dim} needs "
            f"{head_dim // 2}."
        )
    rule = "llama3 divisors rise from 1 towards the factor as frequencies fall"
    for i, v in enumerate(r):
        if not (np.isfinite(v) and v >= 1 - BAND_RTOL):
            raise ValueError(f"GGUF rope_freqs.weight[{i}] is {v:g}, below 1: {rule}.")
        if i and v < r[i - 1] * (1 - BAND_RTOL):
            raise ValueError(
                f"GGUF rope_freqs.weight[{i}] is {v:g}, below [{i - 1}] ({r[i - 1]:g}): {rule}."
            )
    return r


def _degenerate_lines(x, high, low, mid, s, old) -> list[tuple[float, float]]:
    """(x0, x1) candidates when at most one divisor is mid-band: low 1, high 4 (Llama 3.x's)
    where they fit the bands, else bounds between the bands."""
    xL = x[low].max()  # the highest low-band frequency: x0 >= xL
    xH = x[high].min() if high.any() else math.inf  # the lowest high-band one: x1 <= xH
    if not mid.any():
        fallback = [(xL + (xH - xL) / 3, xL + 2 * (xH - xL) / 3)] if high.any() else []
        return [(1 / old, 4 / old), *fallback]
    xm, sm = float(x[mid][0]), float(s[0])  # the line passes through (xm, sm)

    def line(width: float) -> tuple[float, float]:
        return xm - sm * width, xm - sm * width + width

    widest = min((xm - xL) / sm, (xH - xm) / (1 - sm))
    widths = [(xm - 1 / old) / sm, (4 / old - xm) / (1 - sm), widest / 2]
    return [line(w) for w in widths if 0 < w <= widest]


def _cleaned(target: torch.Tensor, head_dim: int, rope: RopeConfig) -> dict | None:
    """`rope`'s rope_scaling dict, each number the shortest decimal that fits the file's
    frequencies as well (or within CLEAN_RTOL); None when `rope` does not fit them."""
    fields = ["factor"]
    if rope.rope_type == "llama3":
        fields += ["low_freq_factor", "high_freq_factor"]
    for name in fields:
        value = getattr(rope, name)
        allowed = max(_error(rope, head_dim, target), CLEAN_RTOL)
        for candidate in _decimals(value):
            trial = replace(rope, **{name: candidate})
            if _error(trial, head_dim, target) <= allowed:
                rope = trial
                break
    if _error(rope, head_dim, target) > VERIFY_RTOL:
        return None
    out = {"rope_type": rope.rope_type, "factor": rope.factor}
    if rope.rope_type == "llama3":
        out.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    return out


def _decimals(value: float) -> list[float]:
    """`value` with 1, 2, ... 8 significant digits, then the float32 shortest decimal."""
    return [float(f"{value:.{d}g}") for d in range(1, 9)] + [decimal(value)]


def _error(rope: RopeConfig, head_dim: int, target: torch.Tensor) -> float:
    """The largest relative difference of `rope`'s frequencies from `target`."""
    inv = rope_inv_freq(rope, head_dim)[0].double()
    return float(((inv - target).abs() / target).max())
