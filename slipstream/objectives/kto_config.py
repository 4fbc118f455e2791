"""The `kto` config section (objectives/kto.py). No torch import: the run config is composed
from it before torch loads."""

from __future__ import annotations

from typing import ClassVar, Literal

from slipstream.config_section import ObjectiveSection, option


class KTOSection(ObjectiveSection):
    """train.objective = kto (slipstream/objectives/kto.py; docs/preference.md)."""

    key: ClassVar[str] = "kto"
    meaning: ClassVar[str] = "the kto objective's settings (TRL's KTOConfig names)"

    beta: float = option(0.1, "deviation from the reference: higher, less", gt=0)
    desirable_weight: float = option(1.0, "weight of a desirable example's loss", gt=0)
    undesirable_weight: float = option(1.0, "weight of an undesirable example's loss", gt=0)
    loss_type: Literal["kto", "apo_zero_unpaired"] = option(
        "kto", "kto: with the KL estimate of mismatched pairs; apo_zero_unpaired: without"
    )
    reference: Literal["start", "base"] = option(
        "start", "reference with LoRA: the starting adapter frozen, or the base (adapters off)"
    )
