"""Pixels per batch (data/vision.py, data/images.py): tokenized image examples keep a small
source per image, not its processed pixels; the collated batch equals, tensor for tensor, the
batch of the same examples holding the images processed up front; a file gone or changed
since tokenization is one line naming it."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
from pathlib import Path

import datasets
import pytest
import torch
import transformers
from helpers.tiny_vlm import random_image, vlm_folder, write_images

from slipstream.data import collate, tokenize_rows
from slipstream.data.images import images_relative_to
from slipstream.data.vision import ImageExample, ImageProcessing, cat_inputs

KINDS = ["qwen2_5_vl", "gemma3", "mistral3", "idefics3"]  # mRoPE grids, fixed size, Pixtral, crops


@pytest.fixture(scope="module", params=KINDS)
def vlm(request, tmp_path_factory):
    folder = vlm_folder(tmp_path_factory.mktemp(request.param), request.param)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return folder, tok, ImageProcessing.from_model(str(folder), tok)


def _row(images: list, reply: str) -> dict:
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What is it?"}]
    return {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": [{"type": "text", "text": reply}]},
        ],
        "images": images,
    }


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data(tmp_path) -> tuple:
    """(jsonl path, rows, each row's images as PIL): images as a path relative to the data
    file, bytes, a datasets.Image cell and a PIL image, of different sizes."""
    (tmp_path / "pics").mkdir()
    names = write_images(tmp_path / "pics", [(40, 60), (90, 30)])
    first, second = (random_image(h, w, seed=i) for i, (h, w) in enumerate([(40, 60), (90, 30)]))
    third, fourth = random_image(33, 47, seed=7), random_image(64, 64, seed=8)
    rows = [
        _row([f"pics/{names[0]}", _png(third)], "Two pictures."),
        _row([{"bytes": _png(fourth), "path": None}], "A cell."),
        _row([f"pics/{names[1]}"], "A tall one."),
        _row([random_image(50, 20, seed=9)], "In memory."),
    ]
    pil = [[first, third], [fourth], [second], [rows[3]["images"][0]]]
    data = tmp_path / "train.jsonl"  # where the relative paths are read from
    data.write_text(json.dumps({"rows": "in memory"}) + "\n")
    return data, rows, pil


def _tokenized(vlm, tmp_path):
    folder, tok, side = vlm
    data, rows, pil = _data(tmp_path)
    with images_relative_to(data):  # paths relative to the data file, as a run reads them
        examples, report = tokenize_rows(rows, tok, max_tokens=2048, images=side)
    assert report.kept == len(rows), report.summary()
    return examples, pil, side


def _same(a, b, where="batch") -> None:
    """Equal, tensors by torch.equal (dtype too), objects field by field (a batch's fields
    are views of its `_host` buffer)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__"):  # not the packed buffer: its alignment gaps are unset bytes
        assert type(a) is type(b), where
        fields = {k: v for k, v in vars(a).items() if k != "_host"}
        _same(fields, {k: v for k, v in vars(b).items() if k != "_host"}, where)
    else:
        assert a == b, where


def test_batch_equals_the_batch_of_images_processed_up_front(vlm, tmp_path):
    examples, pil, side = _tokenized(vlm, tmp_path)
    # Up front, as tokenization kept them before: each image processed once, held.
    eager = [
        dataclasses.replace(ex, images=cat_inputs([side.process(im)[0] for im in images]))
        for ex, images in zip(examples, pil, strict=True)
    ]
    assert all(ex.images for ex in eager) and not any(ex.images for ex in examples)
    for batch in ([0, 1, 2, 3], [2, 0], [3]):
        lazy = collate([examples[i] for i in batch])
        held = collate([eager[i] for i in batch])
        floats = [v for v in lazy.fields.values() if torch.is_tensor(v) and v.is_floating_point()]
        assert floats, "the batch carries the pixels (or the tower's patches)"
        _same(lazy, held)
    # Across torchrun ranks the examples travel pickled; the same batch comes out.
    _same(collate(pickle.loads(pickle.dumps(examples))), collate(eager))


def test_examples_hold_no_pixels_and_pickle_small(vlm, tmp_path):
    examples, _, _ = _tokenized(vlm, tmp_path)

    def tensors(value) -> int:
        if isinstance(value, torch.Tensor):
            return 1
        if isinstance(value, dict):
            return sum(tensors(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(tensors(v) for v in value)
        return 0

    for ex in examples:
        assert isinstance(ex, ImageExample) and ex.images == {}
        assert tensors(vars(ex)) == 0
    two, cell, path = examples[0], examples[1], examples[2]
    assert isinstance(path.sources[0].value, str) and path.sources[0].value.startswith("/")
    assert isinstance(two.sources[1].value, bytes) and isinstance(cell.sources[0].value, bytes)
    # A path's reference: tens of bytes; the pixels it stands for: 9 KB and up at this size.
    source = len(pickle.dumps(path)) - len(pickle.dumps(dataclasses.replace(path, sources=())))
    assert source < 300 and path.model_inputs()["pixel_values"].nbytes > 20 * source
    # Ids, targets, 3-D positions (Qwen) and two images' sources (one PNG's bytes) in a few KB.
    assert len(pickle.dumps(two)) < 6_000 + len(two.sources[1].value)


def test_a_datasets_image_column_keeps_the_encoded_bytes(vlm, tmp_path):
    _, tok, side = vlm
    png = _png(random_image(30, 30))
    row = _row([{"bytes": png, "path": None}], "A square.")
    features = datasets.Dataset.from_dict({"m": [row["messages"]]}).features["m"]
    ds = datasets.Dataset.from_dict(
        {"messages": [row["messages"]], "images": [row["images"]]},
        features=datasets.Features(
            {"messages": features, "images": datasets.Sequence(datasets.Image())}
        ),
    )
    (ex,), _ = tokenize_rows(ds, tok, max_tokens=2048, images=side)
    assert ex.sources[0].value == png  # not the decoded PIL image
    (ref,), _ = tokenize_rows([row], tok, max_tokens=2048, images=side)
    _same(collate([ex]), collate([ref]))


def test_a_file_gone_or_changed_since_tokenization_is_one_line_naming_it(vlm, tmp_path):
    examples, _, _ = _tokenized(vlm, tmp_path)
    path = examples[2].sources[0].value
    original = Path(path).read_bytes()
    random_image(90, 30, seed=5).save(path)  # same size, other pixels
    with pytest.raises(ValueError) as e:
        collate(examples[1:3])
    assert str(e.value).count("\n") == 0 and path in str(e.value) and "changed" in str(e.value)
    (tmp_path / "pics" / "img1.png").unlink()
    with pytest.raises(ValueError) as e:
        collate(examples)
    assert str(e.value).count("\n") == 0 and path in str(e.value) and "gone" in str(e.value)
    Path(path).write_bytes(original)
    collate(examples)  # restored: the same bytes, the same batch


def test_an_image_whose_tokens_no_longer_match_is_an_error_naming_it(vlm, tmp_path):
    examples, _, _ = _tokenized(vlm, tmp_path)
    ex = examples[0]
    wrong = dataclasses.replace(ex, image_tokens=[ex.image_tokens[0] + 1, *ex.image_tokens[1:]])
    with pytest.raises(ValueError, match="image tokens") as e:
        collate([wrong])
    assert ex.sources[0].value in str(e.value) and str(e.value).count("\n") == 0
