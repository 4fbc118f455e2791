"""The pydantic base of every run-config section, and its field helper (no torch import).

`slipstream/config.py` holds the run's own sections (model, data, lora, train); each
objective's section lives beside the objective (`objectives/*_config.py`) as an
`ObjectiveSection`, and `RunConfig` is composed from the registered ones
(`slipstream.objectives.OBJECTIVES`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    # extra="forbid" is a backstop: unknown keys are caught earlier, with a suggestion.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def option(default: Any, meaning: str, **rules: Any) -> Any:
    """A config field: its default, one line of meaning (`slipstream config` prints it), rules."""
    return Field(default, description=meaning, **rules)


class ObjectiveSection(Section):
    """An objective's own config section: `key` is its name in the YAML (`grpo:`), `meaning`
    the line `slipstream config` shows for it. Objectives that share options share a class."""

    key: ClassVar[str]
    meaning: ClassVar[str]

    def check_run(self, cfg: Any) -> None:
        """Rules across sections (`cfg` the whole RunConfig), run when `train.objective` is
        one that reads this section: raise ValueError with one line naming the keys."""

    @classmethod
    def from_options(cls, who: str, options: dict[str, Any]) -> ObjectiveSection:
        """The section from keyword options named as its keys (tests, the Python API), its
        defaults for the rest; `who` names the caller in the error for an unknown option."""
        unknown = sorted(set(options) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"{who} options {unknown}: use {', '.join(cls.model_fields)}")
        return cls(**options)
