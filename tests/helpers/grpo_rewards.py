"""Reward functions with TRL's signature for the GRPO run tests (loaded by path from the
config, as a user's would be): completion length / 10, and 1 when the completion has an
'e' (None for prompts about the sun, so some rewards are NaN)."""

from __future__ import annotations


def _text(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def length(completions, **kwargs):
    return [len(_text(c)) / 10 for c in completions]


def has_e(prompts, completions, answer, **kwargs):
    assert len(answer) == len(completions) and all(a.startswith("answer") for a in answer)
    pairs = zip(prompts, completions, strict=True)
    return [None if "sun" in str(p) else float("e" in _text(c)) for p, c in pairs]
