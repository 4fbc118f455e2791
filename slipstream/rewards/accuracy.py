"""The built-in `accuracy` reward: the completion's final answer against the row's answer,
checked with the `math-verify` package (numbers, fractions, LaTeX, sets: equal as maths, not
as text).

The final answer is the first of, in this order: the last `\\boxed{...}`, the last answer
after "final answer is" and the like, the last LaTeX or plain expression of the text
(math-verify's priorities; within one it takes the rightmost). With `boxed: true` only a
`\\boxed{...}` counts. An answer that does not parse gives None (the row is not judged, as
TRL's `accuracy_reward`); a completion without an answer gives 0.0.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from typing import Any

from slipstream.rewards.text import text_of

INSTALL_HINT = "pip install 'slipstream[grpo]' (or: pip install math-verify)"


class Accuracy:
    """1.0 when the completion's final answer equals `column`'s value as maths, else 0.0;
    None when that value does not parse."""

    __name__ = "accuracy"

    def __init__(self, column: str = "answer", boxed: bool = False) -> None:
        if importlib.util.find_spec("math_verify") is None:
            raise ValueError(f"the accuracy reward needs the math-verify package; {INSTALL_HINT}")
        if not isinstance(column, str) or not column:
            raise ValueError(f"column is {column!r}; give the name of the answer column")
        if not isinstance(boxed, bool):
            raise ValueError(f"boxed is {boxed!r}; give true or false")
        self.column, self.boxed = column, boxed
        self.columns = (column,)  # RewardFunctions checks the data has it

    def __call__(self, completions: list, **kwargs: Any) -> list[float | None]:
        from math_verify import verify

        timeout = _timeout()
        out = []
        for completion, answer in zip(completions, kwargs[self.column], strict=True):
            gold = _gold(str(answer), timeout)
            if not gold:
                out.append(None)
                continue
            pred = _final_answer(text_of(completion), self.boxed, timeout)
            out.append(float(bool(pred) and verify(list(gold), pred, timeout_seconds=timeout)))
        return out


def _timeout() -> int | None:
    # math-verify times out with signal.alarm, which only works in the main thread.
    return 5 if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _gold(answer: str, timeout: int | None) -> tuple:
    """The parsed answer column (cached: each answer is checked G times a step)."""
    from math_verify import parse

    return tuple(parse(answer, parsing_timeout=timeout))


def _final_answer(text: str, boxed: bool, timeout: int | None) -> list:
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    if boxed:
        if "\\boxed" not in text:
            return []
        text = text[text.rfind("\\boxed") :]  # the last \boxed{} and what follows it
    latex = LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True),
        boxed_match_priority=0,  # a \boxed{} answer wins over anything else in the text
        try_extract_without_anchor=not boxed,
    )
    configs = [latex] if boxed else [latex, ExprExtractionConfig()]
    return parse(
        text,
        extraction_config=configs,
        extraction_mode="first_match",
        fallback_mode="no_fallback",
        parsing_timeout=timeout,
    )
