"""Built-in rewards on a completion's text and length: `format` (a regex) and `length` (a soft
penalty past a budget). A completion is a string or TRL's `[{"role": "assistant", "content":
text}]`; `text_of` reads either."""

from __future__ import annotations

import re
from typing import Any


def text_of(completion: Any) -> str:
    """The text of a completion: the string itself, or the content of its last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        return completion[-1].get("content") or ""
    raise ValueError(
        f"a completion is a {type(completion).__name__}; expected a string or "
        '[{"role": "assistant", "content": ...}]'
    )


class Format:
    """1.0 when `pattern` matches the completion's text (stripped of surrounding whitespace;
    `re.search` with DOTALL: anchor it with ^ and $ to require the whole text), else 0.0."""

    __name__ = "format"

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"pattern is {pattern!r}; give a regular expression (a string)")
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise ValueError(
                f"pattern {pattern!r} is not a valid regular expression: {e}"
            ) from None

    def __call__(self, completions: list, **kwargs: Any) -> list[float]:
        return [1.0 if self.regex.search(text_of(c).strip()) else 0.0 for c in completions]


class Length:
    """0 up to `budget` tokens, then falling linearly to -1 at `budget + ramp`, -1 beyond: the
    shape of DAPO's soft overlong punishment (TRL's `get_soft_overlong_punishment(budget +
    ramp, ramp)`). `unit: chars` counts characters of the text instead of tokens."""

    __name__ = "length"

    def __init__(self, budget: int, ramp: int | None = None, unit: str = "tokens") -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"budget is {budget!r}; give a whole number >= 0 ({unit})")
        ramp = max(1, budget // 4) if ramp is None else ramp
        if isinstance(ramp, bool) or not isinstance(ramp, int) or ramp < 1:
            raise ValueError(f"ramp is {ramp!r}; give a whole number >= 1 ({unit})")
        if unit not in ("tokens", "chars"):
            raise ValueError(f"unit is {unit!r}; give tokens or chars")
        self.budget, self.ramp, self.unit = budget, ramp, unit

    def __call__(
        self, completions: list, completion_ids: list | None = None, **kwargs: Any
    ) -> list[float]:
        if self.unit == "chars":
            sizes = [len(text_of(c)) for c in completions]
        elif completion_ids is None:
            raise ValueError("it counts tokens and got no completion_ids; set unit: chars")
        else:
            sizes = [len(ids) for ids in completion_ids]
        return [max(-1.0, min(0.0, (self.budget - s) / self.ramp)) for s in sizes]
