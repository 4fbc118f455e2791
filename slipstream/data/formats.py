"""Dataset row formats, detected from the columns, all converted to chat messages or raw text.

Formats (name: columns):
- "messages": `messages` = [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]
- "sharegpt": `conversations` = [{"from": "human"|"gpt"|"system", "value": str}, ...]
- "prompt_completion": `prompt`, `completion` (str) -> one user turn, one assistant turn
- "alpaca": `instruction`, optional `input`, `output` -> user = instruction (+ blank line + input)
- "text": `text` (str), raw language modelling, every token a target

With `data.format: auto` each row is read in the first format whose columns it fills
(`row_format`), so a file mixing `messages` rows and `prompt`/`completion` rows trains on
both; the columns alone pick the format of a row that fills none.

A turn's content is a string or, as in TRL's and OpenAI's format, a list of parts
(`[{"type": "text", "text": "Hello"}, ...]`): the text parts are joined with nothing between
them, which is what the chat templates that accept parts render (Gemma 3/4, Qwen2.5-VL,
Qwen3-VL, Qwen3.5, GLM-4 MoE, LFM2.5, SmolVLM/Idefics3 among TRL 1.16's templates); templates
that take only strings (SmolLM2, Llama 3.x, Qwen2.5, Phi-3) would print the list or fail, and
Qwen3's drops it, so the joined string goes to the template. An image part skips the row
(`image_part`) until vision-language models are trained.

A malformed row raises `RowError(reason, detail)` (data/rows.py); the row loop counts those by
`reason`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from slipstream.data.rows import RowError

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
# Content part types that carry pixels (transformers/TRL: image, video; OpenAI: image_url,
# input_image): a text model cannot read them.
VISION_PARTS = {"image", "image_url", "input_image", "video"}
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


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


def row_format(row: Mapping[str, Any], fallback: str) -> str:
    """The first format (in detection order) whose columns this row fills, else `fallback`
    (the format the dataset's columns detect)."""
    for name, needed in _DETECT:
        if all(row.get(key) is not None for key in needed):
            return name
    return fallback


def text_content(content: Any, where: str) -> str:
    """A turn's content as text: a string as it is, a list of parts as its text parts joined
    (module docstring). RowError for an image part or anything that is not text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RowError("wrong_type", f"{where}: content is {type(content).__name__}, expected str")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type", "text") if isinstance(part, Mapping) else None
        if kind in VISION_PARTS:
            raise RowError(
                "image_part", f"{where} part {j} is {kind!r}: image parts need a vision model"
            )
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RowError(
                "wrong_type", f"{where} part {j} is not a text part {{'type': 'text', 'text': str}}"
            )
        texts.append(part["text"])
    return "".join(texts)


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
        if not isinstance(role, str) or not isinstance(text, (str, list)):
            raise RowError(
                "wrong_type", f"turn {i}: {role_key!r}/{text_key!r} must be strings (or text parts)"
            )
        if role not in roles:
            raise RowError(
                "bad_role", f"turn {i} has role {role!r}; expected one of {sorted(roles)}"
            )
        out.append({"role": roles[role], "content": text_content(text, f"turn {i}")})
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
