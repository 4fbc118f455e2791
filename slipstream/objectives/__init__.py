"""Training objectives: how rows become examples, examples a packed batch, and a batch a
loss. One trainer runs them all (slipstream/train/loop.py); `train.objective` picks one.

The contract an objective meets is `objectives/base.py` (`Objective`, `OnlineObjective`;
docs/dev/INTERFACES.md). `OBJECTIVES` is the registry: each name maps to an `Entry`, the
"module:callable" that builds the objective from the run config (`callable(cfg)`) and,
when it has options, the "module:Class" of its config section (an `ObjectiveSection`, in a
torch-free module beside the objective), from which `RunConfig` is composed. Adding an
objective is its module(s) and one line here. Objectives are imported only when a run
starts, so the config can check a name without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple


class Entry(NamedTuple):
    objective: str  # "module:callable" built as callable(cfg)
    section: str | None = None  # "module:Class" of its config section, torch-free


_PREFERENCE = "slipstream.objectives.preference_config:PreferenceSection"
_GRPO = "slipstream.objectives.grpo_config:GRPOSection"

OBJECTIVES: dict[str, Entry] = {
    "sft": Entry("slipstream.objectives.sft:SFT"),
    "dpo": Entry("slipstream.objectives.preference:dpo", _PREFERENCE),
    "orpo": Entry("slipstream.objectives.preference:ORPO", _PREFERENCE),
    "simpo": Entry("slipstream.objectives.preference:SimPO", _PREFERENCE),
    "grpo": Entry("slipstream.objectives.grpo:GRPO", _GRPO),
    "rloo": Entry(
        "slipstream.objectives.rloo:RLOO", "slipstream.objectives.rloo_config:RLOOSection"
    ),
    "distill": Entry(
        "slipstream.objectives.distill:Distill",
        "slipstream.objectives.distill_config:DistillSection",
    ),
    "kto": Entry("slipstream.objectives.kto:KTO", "slipstream.objectives.kto_config:KTOSection"),
    "reward": Entry(
        "slipstream.objectives.reward:Reward", "slipstream.objectives.reward_config:RewardSection"
    ),
}


def load(path: str) -> Any:
    """The object a "module:name" path names."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def objective_sections() -> dict[str, type]:
    """{section key: its class} of every registered objective, in registry order; objectives
    may share a section (dpo, orpo, simpo), never a key between two classes."""
    sections: dict[str, type] = {}
    for name, entry in OBJECTIVES.items():
        if entry.section is None:
            continue
        cls = load(entry.section)
        if sections.setdefault(cls.key, cls) is not cls:
            raise TypeError(f"objective {name}: section '{cls.key}' is already another class's")
    return sections


def section_key(name: str) -> str | None:
    """The config section objective `name` reads, if any."""
    entry = OBJECTIVES[name]
    return load(entry.section).key if entry.section else None


def build_objective(cfg: Any) -> Any:
    """The objective `cfg.train.objective` names, built from the run config and checked
    against the contract (objectives/base.py)."""
    from slipstream.objectives.base import check_objective

    name = cfg.train.objective
    if name not in OBJECTIVES:
        raise ValueError(f"train.objective = {name!r}; use one of {', '.join(OBJECTIVES)}")
    objective = load(OBJECTIVES[name].objective)(cfg)
    check_objective(objective, OBJECTIVES[name].objective)
    return objective
