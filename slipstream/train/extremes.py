"""Metrics reduced by min or max instead of summed: an objective's `metric_extremes`
({name: "min" | "max"}, e.g. reward's `min_reward`). Every other metric is a sum. The same
fold serves a step's micro-batches, the meter's interval and the eval batches; a logged step
reduces over ranks with one all-reduce (MIN, a max negated). Device tensors, no host sync.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

_START = {"sum": 0.0, "min": math.inf, "max": -math.inf}  # each reduction's identity


def kind_of(extremes: Mapping[str, str], name: str) -> str:
    return extremes.get(name, "sum")


def start(kind: str, device: torch.device | str) -> torch.Tensor:
    """An empty accumulator: 0 for a sum, +inf for a min, -inf for a max (float32)."""
    return torch.full((), _START[kind], device=device)


def fold(kind: str, total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """`total` combined with `value` (a new tensor; `total` None: `value` itself)."""
    if total is None:
        return value
    if kind == "min":
        return torch.minimum(total, value)
    if kind == "max":
        return torch.maximum(total, value)
    return total + value


def split(metrics: Mapping[str, float], extremes: Mapping[str, str]) -> tuple[dict, dict]:
    """(the sums, the extremes) of a dict of metric values."""
    sums = {n: v for n, v in metrics.items() if n not in extremes}
    return sums, {n: v for n, v in metrics.items() if n in extremes}
