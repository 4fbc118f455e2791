"""Image+text rows -> token ids, targets and the images' model inputs, with the checkpoint's
own image processor and chat template.

The conversation (data/images.py: parts and image sources) is rendered by the chat template,
which prints one placeholder per image part (`<image>`, `<start_of_image>`,
`<|image_pad|>`, `[IMG]`); each placeholder is then replaced, in order, by the image's token
sequence, computed from the image processor's output (its grid sizes say how many tokens).
That is the processor class's own `replace_image_token` where the class builds here; where it
cannot (Qwen-VL's needs torchvision for its video side), a rule of ours for the model type
(`RULES`), tested equal to the processor's ids where the processor builds
(tests/test_vision_data.py). The expanded texts are tokenized as text rows are
(data/labels.py `encode_chat`: assistant-only targets by prefix rendering); tokens of an
image sequence are never targets.

`ImageExample` holds what packing needs (ids, targets, per image its size and token count,
3-D positions, the tower's geometry), the id of the token whose rows receive the image
features, and per image a small `ImageSource` (data/images.py: a resolved path, encoded
bytes or a PIL image). Its model inputs (`pixel_values` and the model's extras:
`image_grid_thw`, `image_sizes`, ...) are computed when a batch is collated
(`ImageExample.model_inputs()`: `ImageProcessing.process` again, the same processor, so the
tensors are bit-identical to processing at tokenization), concatenated over the example's
images along dim 0; the collator (data/collate.py) concatenates them over the batch and
builds the rows those features fill on the host, and, for the towers slipstream runs itself
(Qwen-VL's, Mistral 3's Pixtral, Gemma 4's, Idefics3's), their host-built metadata
(data/qwen_vit_meta.py, pixtral_meta.py, gemma4_meta.py, idefics3_meta.py).

Why per batch: processed pixels are float32 patches, 4.6 MiB an image at Qwen2.5-VL's
resolution for 448x448 (measured: 916 MiB held for 200; more for a larger screenshot), so
50k images kept from tokenization to the end of the run are hundreds of GB of host memory;
a batch's own images are a few (the same 200 as sources: 4 MiB). What it costs is the image
processor's time once per image per epoch, on the host, when the batch is collated: 13 ms an
image there against 2.8 ms to concatenate held pixels (docs/benchmarks.md). Only hand-built
examples and generation prompts (a handful of images, processed once to build the prompt
anyway) keep their inputs in `images`; a run has no option to keep them all: its memory
would grow with the dataset again, and the time is better won back by overlapping collation
with the device step.

An example names the `ImageProcessing` that made it by its checkpoint folder (`processing`),
looked up in this process's table of built ones (`processing_for`): examples pickle small
across torchrun ranks (every rank builds the run's ImageProcessing when it tokenizes its
share of the rows). The image's size and token count are checked again when it is processed:
a file that changed since tokenization is an error naming it (`ImageSource.reload`), never a
batch whose rows do not match its features.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from slipstream.data.gemma4_meta import GEMMA4_TYPES, Gemma4Geometry
from slipstream.data.gemma4_meta import KEYS as GEMMA4_KEYS
from slipstream.data.idefics3_meta import IDEFICS3_TYPES, Idefics3Geometry
from slipstream.data.idefics3_meta import KEYS as IDEFICS3_KEYS
from slipstream.data.images import ImageSource, vision_messages
from slipstream.data.labels import Example, encode_chat
from slipstream.data.mrope import mrope_positions
from slipstream.data.pixtral_meta import KEYS as PIXTRAL_KEYS
from slipstream.data.pixtral_meta import PIXTRAL_TYPES, PixtralGeometry
from slipstream.data.qwen_vit_meta import KEYS as VIT_KEYS
from slipstream.data.qwen_vit_meta import VIT_TYPES, VitGeometry
from slipstream.data.rows import RowError
from slipstream.sources import is_hub_id

log = logging.getLogger("slipstream")

# What each model's forward takes of the image processor's output (besides pixel_values).
MODEL_INPUTS = (
    "pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask",
    "image_position_ids",  # Gemma 4: each patch's (x, y), (-1, -1) for padding
)  # fmt: skip
# 3-D rotary positions: data/mrope.py (Qwen3.5's get_rope_index gives still images the same).
MROPE_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
# Image tokens that attend to their whole image (transformers' token_type_ids mask).
# Gemma 4's only on its sliding layers (models/generic_hooks.py, use_bidirectional_attention).
BIDIRECTIONAL_TYPES = ("gemma3", "gemma4")
# Image processors that split an image into crops and say the grid only when asked.
ROW_COL_TYPES = ("idefics3", "smolvlm")
MROPE_FIELD = "mrope_position_ids"  # (3, T): the packed batch's 3-D positions
# (R,) int64: which feature row each of `image_rows` takes, when sequences share their images
# (a preference pair's chosen and rejected: the tower runs once a pair; models/common.py).
FEATURE_INDEX = "image_feature_index"


@dataclass
class ImageExample(Example):
    """An Example with images: `images` (input name -> tensor, the example's images
    concatenated along dim 0) when computed up front, else empty: `model_inputs()` computes
    them from `sources` with the `processing` (a checkpoint folder, `processing_for`) that
    tokenized it; `image_token_id` (the placeholder rows features fill), `sizes` ((height,
    width) of each image after resizing), `image_tokens` (per image)."""

    images: dict[str, torch.Tensor] = field(default_factory=dict)
    image_token_id: int = -1
    sizes: list[tuple[int, int]] = field(default_factory=list)
    image_tokens: list[int] = field(default_factory=list)
    positions_3d: list[list[int]] | None = None  # Qwen-VL's mRoPE positions (data/mrope.py)
    bidirectional: bool = False  # each image's rows see one another (BIDIRECTIONAL_TYPES)
    # A tower whose inputs are built at packing (Qwen-VL's, data/qwen_vit_meta.py; Pixtral's,
    # data/pixtral_meta.py; Gemma 4's, data/gemma4_meta.py; Idefics3's, data/idefics3_meta.py):
    # `tower.metadata(images)` over the batch's concatenated images.
    tower: VitGeometry | PixtralGeometry | Gemma4Geometry | Idefics3Geometry | None = None
    sources: tuple[ImageSource, ...] = ()  # where each image comes from (data/images.py)
    processing: str | None = None  # the ImageProcessing that tokenized it (processing_for)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The images' model inputs (input name -> tensor, concatenated along dim 0): `images`
        when held, else processed now from `sources` (module docstring)."""
        if self.images:
            return self.images
        side = processing_for(self.processing)
        processed = [side.reprocess(*image) for image in zip(self.sources, self.sizes,
                                                              self.image_tokens)]  # fmt: skip
        return cat_inputs(processed)

    def feature_rows(self) -> list[int]:
        """The token positions that receive image features, in order (host scan)."""
        return [t for t, i in enumerate(self.input_ids) if i == self.image_token_id]

    def image_spans(self) -> list[tuple[int, int]]:
        """(start, end) of each run of consecutive image-token positions: one image's rows."""
        spans: list[list[int]] = []
        for t in self.feature_rows():
            if spans and spans[-1][1] == t:
                spans[-1][1] = t + 1
            else:
                spans.append([t, t + 1])
        return [(a, b) for a, b in spans]

    def followed_by_text(self, keep: int, ids: list[int]) -> ImageExample:
        """This example's first `keep` tokens (its images among them) then text, as the
        example of `ids` (`ids[:keep]` are this one's; a completion holds no images): the added
        tokens are targets, and Qwen-VL's 3-D positions count on from the kept ones' largest
        + 1 (transformers' rope_deltas; where text follows a prompt, its next position)."""
        positions = self.positions_3d
        if positions is not None:
            kept = [axis[:keep] for axis in positions]
            p = max(map(max, kept)) + 1
            positions = [axis + list(range(p, p + len(ids) - keep)) for axis in kept]
        trainable = self.trainable[:keep] + [True] * (len(ids) - keep)
        return replace(self, input_ids=ids, trainable=trainable, positions_3d=positions)

    def truncated(self, max_tokens: int) -> ImageExample:
        """The first `max_tokens` tokens; RowError when the cut falls before an image ends."""
        rows = self.feature_rows()
        if rows and rows[-1] >= max_tokens:
            raise RowError(
                "image_truncated",
                f"{len(self)} tokens ({len(rows)} of them image tokens) do not fit "
                f"{max_tokens} without cutting an image; raise the limit or use smaller images",
            )
        cut = None if self.positions_3d is None else [a[:max_tokens] for a in self.positions_3d]
        return replace(
            self, input_ids=self.input_ids[:max_tokens], trainable=self.trainable[:max_tokens],
            positions_3d=cut,
        )  # fmt: skip


def _qwen_vl(processed: Mapping[str, Any], i: int, side: ImageProcessing) -> str:
    merge = side.image_processor.merge_size
    return side.placeholder * int(processed["image_grid_thw"][i].prod() // merge**2)


def _pixtral(processed: Mapping[str, Any], i: int, side: ImageProcessing) -> str:
    """Rows of [IMG] per merged patch, each row closed by [IMG_BREAK], the last by [IMG_END]
    (PixtralProcessor's rule, for Mistral 3)."""
    vision = side.config.get("vision_config") or {}
    patch = vision.get("patch_size", 14) * side.config.get("spatial_merge_size", 1)
    height, width = (int(v) for v in processed["image_sizes"][i])
    row = "[IMG]" * (width // patch) + "[IMG_BREAK]"
    return (row * (height // patch))[: -len("[IMG_BREAK]")] + "[IMG_END]"


def _smolvlm(processed: Mapping[str, Any], i: int, side: ImageProcessing) -> str:
    """SmolVLMProcessor's own string for image i (its crops' grid, then the global view),
    with the image_seq_len its processor_config.json gives."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    tok, seq_len = side.tokenizer, side.processor_config.get("image_seq_len", 64)
    rows = [r for row in processed["rows"] for r in row]
    cols = [c for col in processed["cols"] for c in col]
    return get_image_prompt_string(
        rows[i], cols[i], seq_len,
        fake_token_around_image=getattr(tok, "fake_image_token", "<fake_token_around_image>"),
        image_token=getattr(tok, "image_token", "<image>"),
        global_image_token=getattr(tok, "global_image_token", "<global-img>"),
    )  # fmt: skip


def _gemma4(processed: Mapping[str, Any], i: int, side: ImageProcessing) -> str:
    """Gemma4Processor's rule: the image's soft tokens between its begin/end tokens (ids from
    config.json), as many as the image processor says."""
    tok, cfg = side.tokenizer, side.config
    n = int(processed["num_soft_tokens_per_image"][i])
    boi, eoi = tok.convert_ids_to_tokens([cfg["boi_token_id"], cfg["eoi_token_id"]])
    return boi + side.placeholder * n + eoi


# model_type -> (placeholder the chat template prints, replacement for image i), for
# processors that cannot be built without torchvision; placeholder None: the image token.
RULES: dict[str, tuple[str, Callable[[Mapping[str, Any], int, ImageProcessing], str]]] = {
    "qwen2_vl": ("<|image_pad|>", _qwen_vl),
    "qwen2_5_vl": ("<|image_pad|>", _qwen_vl),
    "qwen3_vl": ("<|image_pad|>", _qwen_vl),
    "qwen3_5": ("<|image_pad|>", _qwen_vl),  # Qwen3VLProcessor's rule
    "qwen3_5_moe": ("<|image_pad|>", _qwen_vl),
    "mistral3": ("[IMG]", _pixtral),
    "smolvlm": ("<image>", _smolvlm),  # its processor class builds a video processor
    "gemma4": (None, _gemma4),  # Gemma4Processor builds a video processor (torchvision)
}


class ImageProcessing:
    """A checkpoint's image side: its image processor, the placeholder its template prints,
    the token sequence each image becomes, and the id of the rows its features fill."""

    def __init__(self, folder: str, tokenizer: Any) -> None:
        from transformers import AutoImageProcessor, AutoProcessor

        config = _config_json(folder)
        self.config = config
        self.tokenizer = tokenizer
        self.processor_config = _config_json(folder, "processor_config.json")
        self.model_type = config.get("model_type")
        self.processor = None
        try:
            self.processor = AutoProcessor.from_pretrained(folder)
            self.image_processor = self.processor.image_processor
            self.placeholder = self.processor.image_token
            self.replace_image = lambda processed, i: self.processor.replace_image_token(
                processed, image_idx=i
            )
        except Exception as e:  # e.g. a video processor that needs torchvision
            if self.model_type not in RULES:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise ValueError(
                    f"model.path {folder}: its processor cannot be built ({first}) and "
                    f"slipstream has no image-token rule for {self.model_type!r}"
                ) from None
            self.image_processor = AutoImageProcessor.from_pretrained(folder)
            self.placeholder, rule = RULES[self.model_type]
            self.replace_image = lambda processed, i: rule(processed, i, self)
        token = config.get("image_token_id", config.get("image_token_index"))
        if token is None:
            raise ValueError(f"model.path {folder}: config.json has no image_token_id")
        self.image_token_id = int(token)
        self.tower = None  # the geometry a tower's host-built inputs depend on
        if self.model_type in VIT_TYPES:
            self.tower = VitGeometry.of(config.get("vision_config") or {}, self.model_type)
        elif self.model_type in PIXTRAL_TYPES:
            self.tower = PixtralGeometry.of(config)
        elif self.model_type in GEMMA4_TYPES:
            self.tower = Gemma4Geometry.of(config)
        elif self.model_type in IDEFICS3_TYPES:
            self.tower = Idefics3Geometry.of(config)
        if self.placeholder is None:  # the template prints the image token itself
            self.placeholder = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.added_ids = set(tokenizer.get_added_vocab().values())
        self._sequence_ids: dict[str, list[int]] = {}  # replacement text -> its ids
        self.folder = str(Path(folder).resolve())
        _BUILT[self.folder] = self  # what its examples' `processing` names

    @classmethod
    def from_model(cls, path: str, tokenizer: Any) -> ImageProcessing | None:
        """The image side of a checkpoint (a local folder, or a hub id whose config files
        are fetched), or None for a text-only one."""
        folder = Path(path)
        if not folder.exists() and is_hub_id(str(path)):
            folder = _hub_config_files(str(path))
        has = any(
            (folder / n).is_file() for n in ("preprocessor_config.json", "processor_config.json")
        )
        return cls(str(folder), tokenizer) if folder.is_dir() and has else None

    def process(self, image: Any) -> tuple[dict[str, torch.Tensor], str, tuple[int, int]]:
        """(one image's model inputs, its token sequence, its (height, width) resized)."""
        extra = {"return_row_col_info": True} if self.model_type in ROW_COL_TYPES else {}
        out = self.image_processor(images=[image], return_tensors="pt", **extra)
        inputs = {k: torch.as_tensor(out[k]) for k in MODEL_INPUTS if k in out}
        if inputs["pixel_values"].dim() == 5:  # (1, crops, C, H, W): one image's crops
            inputs = {k: v[0] if k.startswith("pixel_") else v for k, v in inputs.items()}
        if "image_grid_thw" in inputs:
            patch = self.image_processor.patch_size
            _, h, w = inputs["image_grid_thw"][0].tolist()  # host tensors from the processor
            size = (h * patch, w * patch)
        elif "image_sizes" in inputs:
            size = tuple(inputs["image_sizes"][0].tolist())
        elif "image_position_ids" in inputs:  # Gemma 4: the real patches' (x, y) grid
            patch = self.image_processor.patch_size
            x, y = (inputs["image_position_ids"][0].amax(0) + 1).tolist()  # host tensors
            size = (y * patch, x * patch)
        else:
            size = tuple(inputs["pixel_values"].shape[-2:])
        return inputs, self.replace_image(out, 0), size

    def reprocess(self, source: ImageSource, size: tuple[int, int], tokens: int) -> dict:
        """One image's model inputs from its source, after tokenization: a one-line ValueError
        naming it when it is gone or changed, or its size or token count (what its example's
        rows and positions were built from) are no longer what they were."""
        inputs, text, now = self.process(source.reload())
        count = self._ids(self.tokenizer, text).count(self.image_token_id)
        if (tuple(now), count) != (tuple(size), tokens):
            raise ValueError(
                f"image {source.name()} is now {now[0]}x{now[1]} ({count} image tokens), "
                f"not the {size[0]}x{size[1]} ({tokens}) it was tokenized as; start the run again"
            )
        return inputs

    def encode(self, row: Mapping[str, Any], tokenizer: Any, train_on: str) -> ImageExample:
        """One image row as an ImageExample (module docstring): its pixels are not kept;
        RowError for a bad row."""
        messages, sources = vision_messages(row)
        images, sources = zip(*(s.read() for s in sources)) if sources else ((), ())
        processed = [self.process(image) for image in images]
        expand = self._expander([text for _, text, _ in processed])
        self._check_count(_render(tokenizer, messages), len(images))
        ex = encode_chat(tokenizer, messages, train_on, expand=expand)
        return self._example(tokenizer, ex.input_ids, ex.trainable, processed, sources)

    def encode_prompt(self, messages: list[dict], tokenizer: Any) -> ImageExample:
        """A chat prompt with image parts, rendered with the generation prompt, as an
        ImageExample (no targets) that holds its model inputs: what `slipstream.generate`
        prefills."""
        messages, sources = vision_messages({"messages": messages})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        (ex,), processed = self._encode_texts([text], sources, tokenizer, targets=False)
        return replace(ex, images=cat_inputs([inputs for inputs, _, _ in processed]))

    def encode_rendered(
        self, texts: list[str], sources: list[ImageSource], tokenizer: Any
    ) -> list[ImageExample]:
        """Texts the chat template rendered over the same images (`sources`, in part order;
        a preference pair's prompt, prompt + chosen and prompt + rejected), each with its
        placeholders expanded and tokenized, as ImageExamples that share those images: the
        same sources, sizes and token counts; every token but the images' own is a target
        (the caller picks which it scores). RowError for a bad row."""
        return self._encode_texts(texts, sources, tokenizer, targets=True)[0]

    def _encode_texts(self, texts, sources, tokenizer, targets: bool):
        images, sources = zip(*(s.read() for s in sources)) if sources else ((), ())
        processed = [self.process(image) for image in images]
        expand = self._expander([t for _, t, _ in processed])
        examples = []
        for text in texts:
            self._check_count(text, len(images))
            ids = tokenizer(expand(text), add_special_tokens=False)["input_ids"]
            trainable = [targets] * len(ids)  # _example takes the image tokens out
            examples.append(self._example(tokenizer, ids, trainable, processed, sources))
        return examples, processed

    def _check_count(self, text: str, images: int) -> None:
        if text.count(self.placeholder) != images:
            raise RowError(
                "image_count",
                f"the chat template printed {text.count(self.placeholder)} image placeholders "
                f"({self.placeholder!r}) for {images} images",
            )

    def _example(self, tokenizer, ids, trainable, processed, sources) -> ImageExample:
        sequences = [self._ids(tokenizer, text) for _, text, _ in processed]
        # The special tokens of an image's sequence are never targets (an image in a reply).
        image_ids = {i for seq_ids in sequences for i in seq_ids if i in self.added_ids}
        trainable = [t and i not in image_ids for i, t in zip(ids, trainable)]
        counts = [seq_ids.count(self.image_token_id) for seq_ids in sequences]
        sizes = [size for *_, size in processed]
        positions = None
        if self.model_type in MROPE_TYPES:  # 3-D positions from the grids, on the host
            merge = self.image_processor.merge_size
            # host tensors from the processor
            grids = [g for p, _, _ in processed for g in p["image_grid_thw"].tolist()]
            positions = mrope_positions(ids, self.image_token_id, grids, merge)
        ids = list(ids)
        return ImageExample(
            ids, trainable, {}, self.image_token_id, sizes, counts, positions,
            bidirectional=self._bidirectional(), tower=self.tower, sources=tuple(sources),
            processing=self.folder,
        )  # fmt: skip

    def _bidirectional(self) -> bool:
        """Whether each image's rows see one another: Gemma 3's always; Gemma 4's when its
        text config says so (use_bidirectional_attention "vision", as transformers reads it)."""
        if self.model_type == "gemma4":
            text = self.config.get("text_config") or {}
            return text.get("use_bidirectional_attention") == "vision"
        return self.model_type in BIDIRECTIONAL_TYPES

    def _expander(self, replacements: list[str]) -> Callable[[str], str]:
        """A text's placeholders replaced in order by `replacements` (one per image)."""

        def expand(text: str) -> str:
            pieces = text.split(self.placeholder)
            if len(pieces) - 1 > len(replacements):
                raise RowError(
                    "image_count",
                    f"the chat template printed {len(pieces) - 1} image placeholders "
                    f"({self.placeholder!r}) for {len(replacements)} images",
                )
            out = [pieces[0]]
            for k, piece in enumerate(pieces[1:]):
                out += [replacements[k], piece]
            return "".join(out)

        return expand

    def _ids(self, tokenizer: Any, text: str) -> list[int]:
        if text not in self._sequence_ids:
            self._sequence_ids[text] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._sequence_ids[text]


def run_image_side(model_path: str | None, tokenizer: Any) -> ImageProcessing | None:
    """The image side of a run's checkpoint (`model.path`: a folder, hub id or built-in
    name), or None: no path, or a text model."""
    from slipstream.sources import resolve_model

    return ImageProcessing.from_model(resolve_model(model_path), tokenizer) if model_path else None


# Checkpoint folder -> the ImageProcessing built for it in this process (ImageExample's
# `processing`); the last one built wins (the same files, the same processor).
_BUILT: dict[str, ImageProcessing] = {}


def processing_for(folder: str | None) -> ImageProcessing:
    """The ImageProcessing built in this process for checkpoint `folder` (an ImageExample's
    `processing`); a ValueError when none was."""
    if folder not in _BUILT:
        raise ValueError(
            f"examples with images from {folder} need that checkpoint's image processor in "
            "this process: build ImageProcessing.from_model(...) before collating them"
        )
    return _BUILT[folder]


def cat_inputs(inputs: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Model inputs of several images (name -> tensor each) concatenated along dim 0: every
    image of one model has the same inputs."""
    return {k: cat_images([p[k] for p in inputs]) for k in inputs[0]}


def _render(tokenizer: Any, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False)


def _hub_config_files(repo_id: str) -> Path:
    """A hub checkpoint's config, processor and template files (the cache when offline)."""
    from huggingface_hub import snapshot_download

    from slipstream.hub import hub_error, hub_files_only

    files_only = hub_files_only(repo_id, "model.path")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.jinja"],
                                      local_files_only=files_only))  # fmt: skip
    except Exception as e:  # offline, unknown repo, gated: huggingface_hub's own words
        raise hub_error("model.path", repo_id, "processor", e) from None


def _config_json(folder: str, name: str = "config.json") -> dict:
    path = Path(folder) / name
    return json.loads(path.read_text()) if path.is_file() else {}


def packed_images(
    examples: list[tuple[int, ImageExample]], owners: Sequence[int] | None = None
) -> dict[str, Any]:
    """The image inputs of packed examples ((first token's position, example) each): every
    model input concatenated in order, and `image_rows` (R,) int64, the packed positions
    their features fill (a host scan: the model never looks for placeholder ids); Qwen-VL's
    tower metadata over all the images (data/qwen_vit_meta.py: tensors and SeqInfos).
    `owners[k]`: the entry whose images entry k holds, k itself or an earlier entry with
    the same images in the same rows (a preference pair's rejected sequence holds its chosen's
    prompt): such images are processed and run through the tower once, and `image_feature_index`
    (R,) says which feature row each image row takes."""
    owners = list(range(len(examples))) if owners is None else list(owners)
    rows, index, first, count = [], [], {}, 0  # first: an owner's first feature row
    for k, ((start, ex), owner) in enumerate(zip(examples, owners, strict=True)):
        mine = ex.feature_rows()
        if owner == k:
            first[k], count = count, count + len(mine)
        assert len(mine) == len(examples[owner][1].feature_rows()), "shared images differ"
        rows += [start + t for t in mine]
        index += range(first[owner], first[owner] + len(mine))
    out: dict[str, Any] = {"image_rows": torch.tensor(rows, dtype=torch.int64)}
    if len(index) != count:
        out[FEATURE_INDEX] = torch.tensor(index, dtype=torch.int64)
    out.update(cat_inputs([ex.model_inputs() for k, (_, ex) in enumerate(examples)
                           if owners[k] == k]))  # fmt: skip
    geometry = examples[0][1].tower
    if geometry is not None:  # host tensors from the image processor
        out.update(geometry.metadata(out))
        for name in geometry.replaces:
            del out[name]
    return out


def packed_positions_3d(examples: list[Any]) -> torch.Tensor | None:
    """(3, T) int64: every example's 3-D positions concatenated (a text example's are its
    1-D positions thrice), or None when no example has any."""
    if not any(getattr(ex, "positions_3d", None) for ex in examples):
        return None
    parts = []
    for ex in examples:
        mine = getattr(ex, "positions_3d", None)
        parts.append(torch.tensor(mine) if mine else torch.arange(len(ex)).expand(3, -1))
    return torch.cat(parts, dim=1).to(torch.int64)


def cat_images(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Tensors concatenated along dim 0; pixel batches (N, C, H, W) of different sizes (Pixtral
    keeps each image's size) and pixel masks (N, H, W) zero-padded at the bottom and right to
    the largest, as transformers' image processors batch them (the true sizes are
    `image_sizes`, or the mask)."""
    if tensors[0].dim() >= 3 and len({t.shape[-2:] for t in tensors}) > 1:
        h = max(t.shape[-2] for t in tensors)
        w = max(t.shape[-1] for t in tensors)
        pad = torch.nn.functional.pad
        tensors = [pad(t, (0, w - t.shape[-1], 0, h - t.shape[-2])) for t in tensors]
    return torch.cat(tensors)


def packed_image_spans(examples: list[tuple[int, ImageExample]]) -> tuple[tuple[int, int], ...]:
    """The packed (start, end) of every image of the bidirectional examples (SeqInfo's
    `image_spans`), from the host ids."""
    return tuple(
        (start + a, start + b) for start, ex in examples if ex.bidirectional
        for a, b in ex.image_spans()
    )  # fmt: skip


def image_fields(
    placed: list[tuple[int, ImageExample]],
    sequences: Sequence[Any],
    owners: Sequence[int] | None = None,
) -> tuple[dict[str, Any], tuple[tuple[int, int], ...]]:
    """(the image fields of a batch of `placed` (`packed_images`, `owners` included) and, for
    Qwen-VL, the 3-D positions of all its `sequences` (examples, or id lists for text); the
    image spans for its `seq.image_spans`)."""
    fields = packed_images(placed, owners)
    positions = packed_positions_3d(sequences)
    if positions is not None:
        fields[MROPE_FIELD] = positions
    return fields, packed_image_spans(placed)


def build_with_images(
    builder: Any,
    placed: list[tuple[int, ImageExample]],
    sequences: Sequence[Any],
    owners: Sequence[int] | None = None,
) -> Any:
    """The batch `builder` builds, with `image_fields` as whole-tensor fields and their spans
    as its `seq.image_spans` (Gemma 3: each image's rows see one another, ops/attention.py);
    no image field when nothing is `placed`."""
    fields, spans = image_fields(placed, sequences, owners) if placed else ({}, ())
    for name, tensor in fields.items():
        builder.put(name, tensor)
    batch = builder.build()
    if spans:
        batch.seq.image_spans = spans
    return batch


def image_inputs(fields: Mapping[str, Any]) -> dict[str, Any] | None:
    """A batch's image inputs (`image_rows`, the model inputs, Qwen-VL's tower metadata),
    or None without images."""
    if "image_rows" not in fields:
        return None
    names = ("image_rows", FEATURE_INDEX, MROPE_FIELD, *MODEL_INPUTS, *VIT_KEYS, *PIXTRAL_KEYS,
             *GEMMA4_KEYS, *IDEFICS3_KEYS)  # fmt: skip
    return {k: v for k, v in fields.items() if k in names}
