"""The `preference` config section: dpo | orpo | simpo (objectives/preference.py). No torch
import: the run config is composed from it before torch loads."""

from __future__ import annotations

from typing import ClassVar, Literal

from slipstream.config_section import ObjectiveSection, option


class PreferenceSection(ObjectiveSection):
    """train.objective = dpo | orpo | simpo (slipstream/objectives/preference.py)."""

    key: ClassVar[str] = "preference"
    meaning: ClassVar[str] = "dpo | orpo | simpo objectives' settings"

    beta: float = option(0.1, "DPO's KL weight (IPO's tau); ORPO's lambda; SimPO's beta", gt=0)
    loss_type: Literal["sigmoid", "ipo", "hinge"] = option("sigmoid", "DPO's loss")
    label_smoothing: float = option(0.0, "conservative DPO / SimPO", ge=0, lt=0.5)
    simpo_gamma: float = option(0.5, "SimPO's target margin")
    # DPO's reference with LoRA: start = the starting adapter, frozen (the base when the
    # adapter is fresh); base = the model with adapters disabled. Full fine-tuning: a copy.
    reference: Literal["start", "base"] = option(
        "start", "DPO's reference: the starting adapter frozen, or the base (adapters off)"
    )
    # Compute the reference log-probs of every pair once before training (no frozen copy
    # of the model kept with full fine-tuning; no reference forward per step).
    precompute_reference: bool = option(False, "reference log-probs once, before training")
