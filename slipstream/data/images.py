"""Images in chat rows: TRL's vision formats read into template-ready messages and PIL images.

A row's `messages` turns hold a string or a list of content parts. Image parts are
`{"type": "image"}` (the next image of the row-level `images` list), or inline:
`{"type": "image", "image" | "path" | "url": value}`, `{"type": "image_url", "image_url":
{"url": value}}` (OpenAI's). A value is a file path (relative to the data file,
`images_relative_to`), a `data:` URI, bytes, a `datasets.Image` cell (`{"bytes", "path"}`) or
a PIL image. Remote URLs are not fetched (the machines that train are often offline): such a
row is a counted skip that says to download the images first.

`vision_messages(row)` -> (messages whose content is always a list of `{"type": "text",
"text"}` and `{"type": "image"}` parts, the row's images as `ImageSource`s in the order their
parts appear). Every problem is a `RowError` (data/rows.py), counted by reason: `image_count`
(parts and images do not pair up), `image_missing`, `image_unreadable`, `remote_image`,
`unsupported_part` (video, audio, unknown types).

An `ImageSource` is what a training example keeps of an image instead of its pixels (the
image processor runs again per batch, data/vision.py): the resolved absolute file path (with
the crc32 of its bytes, so a file changed since tokenization is an error, not other pixels),
the encoded bytes (bytes, `data:` URIs, `datasets.Image` cells), or a PIL image handed in
memory. `ImageSource.read()` is tokenization's read (a `RowError`: a counted skip);
`reload()` the collator's (a one-line `ValueError` naming the file: the run stops).
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import dataclasses
import io
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
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


def vision_messages(row: Mapping[str, Any]) -> tuple[list[dict], list[ImageSource]]:
    """(messages with content parts, the images' sources in part order); module docstring."""
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
    return out, [image_source(value, where) for where, value in values]


def _inline_value(part: Mapping[str, Any]) -> Any:
    for key in ("image", "path", "url"):
        if part.get(key) is not None:
            return part[key]
    url = part.get("image_url")
    return url.get("url") if isinstance(url, Mapping) else url


@dataclass(frozen=True)
class ImageSource:
    """One image as an example keeps it (module docstring): `value` is a resolved absolute
    path (str), encoded bytes, or a PIL image; `where` the row part it came from; `crc32`
    the file's bytes' checksum once `read()` has read it (paths only)."""

    value: Any
    where: str
    crc32: int | None = None

    def name(self) -> str:
        """The file, or where in its row an image given inline was."""
        return self.value if isinstance(self.value, str) else f"the image of {self.where}"

    def read(self) -> tuple[Any, ImageSource]:
        """(the image, PIL RGB; this source with the file's crc32); RowError if unreadable."""
        from PIL import Image

        value, crc = self.value, None
        if isinstance(value, Image.Image):
            return value.convert("RGB"), self
        if isinstance(value, str) and not Path(value).is_file():
            raise RowError("image_missing", f"{self.where}: no image file {value}")
        try:
            if isinstance(value, str):  # read once: the checksum and the decode see one copy
                value = Path(value).read_bytes()
                crc = zlib.crc32(value)
            with Image.open(io.BytesIO(value)) as image:
                return image.convert("RGB"), dataclasses.replace(self, crc32=crc)
        except (OSError, ValueError, SyntaxError) as e:
            name = self.value if isinstance(self.value, str) else "the image bytes"
            raise RowError("image_unreadable", f"{self.where}: {name}: {e}") from None

    def reload(self) -> Any:
        """The image again, after tokenization (PIL RGB): a one-line ValueError naming the file
        when it is gone, unreadable or not the bytes that were tokenized."""
        try:
            image, now = self.read()
        except RowError as e:
            what = "is gone" if e.reason == "image_missing" else f"is unreadable ({e.detail})"
            raise ValueError(
                f"image {self.name()} {what} since the data was tokenized; restore it or "
                "start the run again"
            ) from None
        if now.crc32 != self.crc32:
            raise ValueError(
                f"image {self.name()} changed since the data was tokenized; restore it or "
                "start the run again"
            )
        return image


def image_source(value: Any, where: str) -> ImageSource:
    """An `ImageSource` from any supported value (module docstring): relative paths resolved
    now (`images_relative_to` is set only while rows are tokenized), `data:` URIs decoded;
    RowError for a URL, a missing file or a value of another type."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return ImageSource(value, where)
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
        return ImageSource(str(path.resolve()), where)
    if isinstance(value, (bytes, bytearray)):
        return ImageSource(bytes(value), where)
    raise RowError("image_unreadable", f"{where}: an image of type {type(value).__name__}")


def undecoded_images(rows: Any) -> Any:
    """A `datasets.Dataset` whose Image features hand `{"bytes", "path"}` cells instead of
    decoded PIL images (the same Arrow data, not a copy), so that examples keep the encoded
    bytes rather than the decoded pixels; other rows as they are."""
    import copy

    features = getattr(rows, "features", None)
    if features is None:
        return rows
    plain = _undecoded(features)
    if plain == features:
        return rows
    rows = copy.deepcopy(rows)  # datasets shares the Arrow buffers of a deep copy
    rows.info.features = type(features)(plain)
    return rows


def _undecoded(feature: Any) -> Any:
    from datasets import Image

    if isinstance(feature, Image):
        return dataclasses.replace(feature, decode=False)
    if isinstance(feature, Mapping):
        return {k: _undecoded(v) for k, v in feature.items()}
    if isinstance(feature, (list, tuple)):
        return [_undecoded(v) for v in feature]
    if dataclasses.is_dataclass(feature) and hasattr(feature, "feature"):  # List, Sequence
        return dataclasses.replace(feature, feature=_undecoded(feature.feature))
    return feature
