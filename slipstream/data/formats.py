"""Dataset row formats, detected from the columns, all converted to chat messages or raw text.

Formats (name: columns):
- "messages": `messages` = [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]
- "sharegpt": `conversations` = [{"from": "human"|"gpt"|"system", "value": str}, ...]
- "prompt_completion": `prompt`, `completion` (str) -> one user turn, one assistant turn
- "alpaca": `instruction`, optional `input`, `output` -> user = instruction (+ blank line + input)
- "text": `text` (str), raw language modelling, every token a target

A malformed row raises `RowError(reason, detail)`; the tokenizer counts those by `reason`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

FORMATS = ("messages", "sharegpt", "prompt_completion", "alpaca", "text")

# Checked in this order, so a dataset with both `messages` and `text` is read as chat.
_DETECT = (
    ("messages", {"messages"}),
    ("sharegpt", {"conversations"}),
    ("prompt_completion", {"prompt", "completion"}),
    ("alpaca", {"instruction", "output"}),
    ("text", {"text"}),
)
CHAT_ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


class RowError(Exception):
    """A malformed row: `reason` is a short counter key, `detail` says what is wrong."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def detect_format(columns: Iterable[str], override: str = "auto") -> str:
    """The format name for a dataset with these columns (or `override` when not "auto")."""
    cols = set(columns)
    if override != "auto":
        if override not in FORMATS:
            raise ValueError(
                f"data format {override!r} is not one of {', '.join(FORMATS)} (or 'auto')."
            )
        return override
    for name, needed in _DETECT:
        if needed <= cols:
            return name
    if {"chosen", "rejected"} <= cols:
        raise ValueError(
            f"columns {sorted(cols)} are preference data (chosen/rejected), which SFT cannot "
            "train on; set train.objective to dpo, orpo or simpo."
        )
    raise ValueError(
        f"cannot detect the data format from columns {sorted(cols)}; expected one of: "
        "messages | conversations | prompt+completion | instruction+output | text "
        "(or set data.format)."
    )


def _field(row: Mapping[str, Any], key: str, kind: type, *, optional: bool = False) -> Any:
    value = row.get(key)
    if value is None:
        if optional:
            return kind()
        raise RowError("missing_field", f"no {key!r}")
    if not isinstance(value, kind):
        raise RowError("wrong_type", f"{key!r} is {type(value).__name__}, expected {kind.__name__}")
    return value


def _turns(value: list, role_key: str, text_key: str, roles: Mapping[str, str]) -> list[dict]:
    if not value:
        raise RowError("empty", "conversation has no turns")
    out = []
    for i, turn in enumerate(value):
        if not isinstance(turn, Mapping):
            raise RowError("wrong_type", f"turn {i} is {type(turn).__name__}, expected an object")
        role, text = turn.get(role_key), turn.get(text_key)
        if role is None or text is None:
            missing = role_key if role is None else text_key
            raise RowError("missing_field", f"turn {i} has no {missing!r}")
        if not isinstance(role, str) or not isinstance(text, str):
            raise RowError("wrong_type", f"turn {i}: {role_key!r}/{text_key!r} must be strings")
        if role not in roles:
            raise RowError(
                "bad_role", f"turn {i} has role {role!r}; expected one of {sorted(roles)}"
            )
        out.append({"role": roles[role], "content": text})
    return out


def to_messages(row: Mapping[str, Any], fmt: str) -> list[dict] | str:
    """Convert one row to a list of {"role", "content"} messages, or a str for "text"."""
    if fmt == "messages":
        return _turns(_field(row, "messages", list), "role", "content", {r: r for r in CHAT_ROLES})
    if fmt == "sharegpt":
        return _turns(_field(row, "conversations", list), "from", "value", SHAREGPT_ROLES)
    if fmt == "prompt_completion":
        prompt, completion = _field(row, "prompt", str), _field(row, "completion", str)
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if fmt == "alpaca":
        instruction = _field(row, "instruction", str)
        extra = _field(row, "input", str, optional=True)
        output = _field(row, "output", str)
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    if fmt == "text":
        text = _field(row, "text", str)
        if not text:
            raise RowError("empty", "'text' is empty")
        return text
    raise ValueError(f"data format {fmt!r} is not one of {', '.join(FORMATS)}.")
