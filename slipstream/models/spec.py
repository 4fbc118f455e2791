"""A model family as one object: `FamilySpec` (torch-free, so lookups answer before torch loads).

Each family module exports `SPEC`; `slipstream.models.family_spec` returns a native family's
or the generic one (models/generic.py: transformers' own modeling code). What the rest of the
code may assume of the model a spec builds is `models.contract.LanguageModel`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FamilySpec:
    """name: the family (a module of slipstream.models); config_from_hf(hf dict) -> config;
    build(config) -> model (on the current default device: meta while loading);
    weights(config) -> WeightMap (checkpoint names); load: None for families whose weights
    stream into `build`'s model by the weight map (checkpoint/hf.py), else
    load(hf, folder, dtype, device, quantize, source) -> model, for a family that loads
    through another loader (generic: transformers' own, with its checkpoint conversions)."""

    name: str
    config_from_hf: Callable[[dict[str, Any]], Any]
    build: Callable[[Any], Any]
    weights: Callable[[Any], Any]
    load: Callable[..., Any] | None = None
