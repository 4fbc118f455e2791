"""The generation options a user gives, checked without torch: `Sampling` and `generate` check
them, and the `generate`/`chat` commands check their flags by the same rules before a model
loads (a load takes seconds; a bad flag should not wait for it).

`name(key)` spells an option in the message: the API's keyword (`top_p`) by default, the
CLI's flag (`--top-p`) from the commands.
"""

from __future__ import annotations

from collections.abc import Callable


def check_options(
    *,
    max_new_tokens: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    num_return_sequences: int = 1,
    name: Callable[[str], str] = str,
) -> None:
    """A one-line ValueError naming the first option out of its range."""
    if max_new_tokens < 1:
        raise ValueError(f"{name('max_new_tokens')} is {max_new_tokens}; give at least 1")
    if num_return_sequences < 1:
        raise ValueError(
            f"{name('num_return_sequences')} is {num_return_sequences}; give at least 1"
        )
    if not temperature >= 0:  # also NaN
        raise ValueError(f"{name('temperature')} is {temperature}; give 0 (greedy) or more")
    if not 0 < top_p <= 1:
        raise ValueError(f"{name('top_p')} is {top_p}; give a value in (0, 1]")
    if top_k < 0:
        raise ValueError(f"{name('top_k')} is {top_k}; give 0 (off) or a positive count")


def flag(key: str) -> str:
    """The CLI flag of an API keyword: top_p -> --top-p."""
    return "--" + key.replace("_", "-")
