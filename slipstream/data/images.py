"""Images in chat rows: TRL's vision formats read into template-ready messages and PIL images.

A row's `messages` turns hold a string or a list of content parts. Image parts are
`{"type": "image"}` (the next image of the row-level `images` list), or inline:
`{"type": "image", "image" | "path" | "url": value}`, `{"type": "image_url", "image_url":
{"url": value}}` (OpenAI's). A value is a file path (relative to the data file,
`images_relative_to`), a `data:` URI, bytes, a `datasets.Image` cell (`{"bytes", "path"}`) or
a PIL image. Remote URLs are not fetched (the machines that train are often offline): such a
row is a counted skip that says to download the images first.

`vision_messages(row)` -> (messages whose content is always a list of `{"type": "text",
"text"}` and `{"type": "image"}` parts, the row's images in the order their parts appear).
Every problem is a `RowError` (data/rows.py), counted by reason: `image_count` (parts and
images do not pair up), `image_missing`, `image_unreadable`, `remote_image`,
`unsupported_part` (video, audio, unknown types).
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import io
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from slipstream.data.formats import CHAT_ROLES
from slipstream.data.rows import RowError

IMAGE_PARTS = ("image", "image_url", "input_image")
_ROOT: contextvars.ContextVar[Path | None] = contextvars.ContextVar("image_root", default=None)


@contextlib.contextmanager
def images_relative_to(data_file: str | Path | None) -> Iterator[None]:
    """Relative image paths of rows read inside the block are under `data_file`'s folder."""
    path = Path(data_file).expanduser() if data_file else None
    token = _ROOT.set(path.parent if path is not None and path.is_file() else None)
    try:
        yield
    finally:
        _ROOT.reset(token)


def has_images(row: Mapping[str, Any]) -> bool:
    """Whether a row carries images: a non-empty `images` column or an image content part."""
    if row.get("images"):
        return True
    messages = row.get("messages")
    if not isinstance(messages, list):
        return False
    return any(
        isinstance(part, Mapping) and part.get("type") in IMAGE_PARTS
        for m in messages
        if isinstance(m, Mapping) and isinstance(m.get("content"), list)
        for part in m["content"]
    )


def vision_messages(row: Mapping[str, Any]) -> tuple[list[dict], list[Any]]:
    """(messages with content parts, PIL images in part order); see the module docstring."""
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RowError("missing_field", "an image row needs a non-empty 'messages' list")
    listed = row.get("images") or []
    if not isinstance(listed, list):
        listed = [listed]
    out, values, next_listed = [], [], 0
    for i, turn in enumerate(messages):
        if not isinstance(turn, Mapping) or turn.get("role") not in CHAT_ROLES:
            raise RowError("bad_role", f"turn {i}: expected an object with a chat role")
        content = turn.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise RowError("wrong_type", f"turn {i}: content must be a string or a list of parts")
        kept = []
        for j, part in enumerate(parts):
            where = f"turn {i} part {j}"
            kind = part.get("type", "text") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                kept.append({"type": "text", "text": part["text"]})
                continue
            if kind not in IMAGE_PARTS:
                raise RowError("unsupported_part", f"{where} is {kind!r}; use text or image parts")
            value = _inline_value(part)
            if value is None:
                if next_listed >= len(listed):
                    raise RowError(
                        "image_count",
                        f"{where} is image {next_listed + 1} but the row's 'images' has "
                        f"{len(listed)}",
                    )
                value, next_listed = listed[next_listed], next_listed + 1
            values.append((where, value))
            kept.append({"type": "image"})
        out.append({"role": turn["role"], "content": kept})
    if next_listed < len(listed):
        raise RowError(
            "image_count",
            f"the row's 'images' has {len(listed)} but its messages have {next_listed} "
            "image parts for them; add a {'type': 'image'} part per image",
        )
    return out, [load_image(value, where) for where, value in values]


def _inline_value(part: Mapping[str, Any]) -> Any:
    for key in ("image", "path", "url"):
        if part.get(key) is not None:
            return part[key]
    url = part.get("image_url")
    return url.get("url") if isinstance(url, Mapping) else url


def load_image(value: Any, where: str) -> Any:
    """A PIL image (loaded, RGB) from any supported value (module docstring)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, Mapping):  # a datasets.Image cell: bytes, or a path
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str) and value.startswith("data:"):
        try:
            value = base64.b64decode(value.split(",", 1)[1])
        except (IndexError, ValueError):
            raise RowError("image_unreadable", f"{where}: a malformed data: URI") from None
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        raise RowError(
            "remote_image", f"{where}: {value[:80]} is a URL; download the images and give paths"
        )
    if isinstance(value, str):
        path = Path(value.removeprefix("file://")).expanduser()
        root = _ROOT.get()
        path = root / path if root is not None and not path.is_absolute() else path
        if not path.is_file():
            raise RowError("image_missing", f"{where}: no image file {path}")
        value = path
    elif isinstance(value, (bytes, bytearray)):
        value = io.BytesIO(value)
    else:
        raise RowError("image_unreadable", f"{where}: an image of type {type(value).__name__}")
    try:
        with Image.open(value) as image:
            return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        name = value if isinstance(value, Path) else "the image bytes"
        raise RowError("image_unreadable", f"{where}: {name}: {e}") from None
