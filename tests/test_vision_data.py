"""Image rows (data/images.py, data/vision.py): TRL's vision formats through the one row loop,
ids equal to the checkpoint's own processor, labels on assistant text only, bad images counted
(or fatal under strict), image rows packed with the positions their features fill."""

from __future__ import annotations

import base64
import io
import json

import datasets
import pytest
import torch
import transformers
from helpers.tiny_vlm import random_image, vlm_folder, write_images

from slipstream.data import collate, tokenize_rows
from slipstream.data.images import images_relative_to, vision_messages
from slipstream.data.vision import ImageExample, ImageProcessing


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = vlm_folder(tmp_path_factory.mktemp("llava"), "llava")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return folder, tok, ImageProcessing.from_model(str(folder), tok)


def _row(images, text="What is it?", reply="A red square."):
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": [{"type": "text", "text": reply}]},
        ],
        "images": images,
    }


def _tokenize(rows, tok, side, **kw):
    return tokenize_rows(rows, tok, max_tokens=kw.pop("max_tokens", 512), images=side, **kw)


def test_ids_and_pixels_equal_the_processor_and_only_the_reply_is_trained(llava, tmp_path):
    folder, tok, side = llava
    names = write_images(tmp_path, [(40, 60), (25, 33)])
    data = tmp_path / "data.jsonl"
    row = _row(names, reply="Two squares.")
    data.write_text(json.dumps(row) + "\n")
    with images_relative_to(data):  # paths relative to the data file
        (ex,), report = _tokenize([row], tok, side)
        messages, sources = vision_messages(row)
        images = [s.read()[0] for s in sources]
    assert isinstance(ex, ImageExample) and report.kept == 1
    processor = transformers.AutoProcessor.from_pretrained(folder)
    text = tok.apply_chat_template(messages, tokenize=False)
    ref = processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")
    assert ex.input_ids == ref["input_ids"][0].tolist()
    torch.testing.assert_close(
        ex.model_inputs()["pixel_values"], ref["pixel_values"], atol=0, rtol=0
    )
    assert ex.sizes == [(28, 28), (28, 28)] and ex.image_tokens == [16, 16]
    trained = [i for i, t in zip(ex.input_ids, ex.trainable) if t]
    assert tok.decode(trained) == "Two squares.<|im_end|>"
    assert len(ex.feature_rows()) == 32


def test_images_in_later_turns_and_in_a_reply_are_never_targets(llava):
    folder, tok, side = llava
    first, second = random_image(40, 60), random_image(25, 33, seed=1)
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
            {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                         {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Like "},
                                              {"type": "image"},
                                              {"type": "text", "text": " this."}]},
        ],
        "images": [first, second],
    }  # fmt: skip
    (ex,), report = _tokenize([row], tok, side)
    assert report.kept == 1 and ex.image_tokens == [16, 16]
    messages, sources = vision_messages(row)
    images = [s.read()[0] for s in sources]
    processor = transformers.AutoProcessor.from_pretrained(folder)
    text = tok.apply_chat_template(messages, tokenize=False)
    ref = processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")
    assert ex.input_ids == ref["input_ids"][0].tolist()
    torch.testing.assert_close(
        ex.model_inputs()["pixel_values"], ref["pixel_values"], atol=0, rtol=0
    )
    rows = ex.feature_rows()
    assert len(rows) == 32 and not any(ex.trainable[t] for t in rows)
    trained = [i for i, t in zip(ex.input_ids, ex.trainable) if t]
    assert tok.decode(trained) == "Hello.<|im_end|>Like  this.<|im_end|>"


def test_image_values_in_every_supported_form(llava, tmp_path):
    _, tok, side = llava
    image = random_image(30, 30)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    png = buf.getvalue()
    (tmp_path / "a.png").write_bytes(png)
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    inline = _row([])
    inline["messages"][0]["content"].insert(0, {"type": "image", "path": str(tmp_path / "a.png")})
    openai = _row([])
    openai["messages"][0]["content"].insert(0, {"type": "image_url", "image_url": {"url": uri}})
    rows = [_row([png]), _row([{"bytes": png, "path": None}]), _row([image]), inline, openai]
    examples, report = _tokenize(rows, tok, side)
    assert report.kept == 5 and not report.skipped
    first = examples[0].model_inputs()["pixel_values"]
    for ex in examples[1:]:
        torch.testing.assert_close(ex.model_inputs()["pixel_values"], first, atol=0, rtol=0)
    # A datasets.Image column (decoded to PIL when read) too.
    ds = datasets.Dataset.from_dict(
        {"messages": [rows[0]["messages"]], "images": [[{"bytes": png, "path": None}]]},
        features=datasets.Features(
            {
                "messages": datasets.Dataset.from_dict({"m": [rows[0]["messages"]]}).features["m"],
                "images": datasets.Sequence(datasets.Image()),
            }
        ),
    )
    (ex,), _ = _tokenize(ds, tok, side)
    torch.testing.assert_close(ex.model_inputs()["pixel_values"], first, atol=0, rtol=0)


def test_bad_image_rows_are_counted_by_reason_or_fatal_under_strict(llava, tmp_path):
    _, tok, side = llava
    (tmp_path / "broken.png").write_bytes(b"not an image")
    names = write_images(tmp_path, [(30, 30)])
    video = _row(names)
    video["messages"][0]["content"].append({"type": "video", "video": "clip.mp4"})
    typed = _row(names, text="see <image> here")  # the text holds a placeholder of its own
    rows = [
        _row(names),
        _row(["missing.png"]),
        _row(["broken.png"]),
        _row(["https://example.com/cat.png"]),
        video,
        {**_row(names), "images": names * 2},  # more images than image parts
        {**_row(names + names), "images": names},  # more image parts than images
        typed,
    ]
    data = tmp_path / "data.jsonl"
    data.touch()
    with images_relative_to(data):
        examples, report = _tokenize(rows, tok, side)
        assert len(examples) == 1
        assert dict(report.skipped) == {
            "image_missing": 1, "image_unreadable": 1, "remote_image": 1, "unsupported_part": 1,
            "image_count": 3,
        }  # fmt: skip
        assert "row 1: image_missing: turn 0 part 0: no image file" in report.first_skip
        with pytest.raises(ValueError, match=r"data row 1: image_missing: .*missing\.png"):
            _tokenize(rows, tok, side, strict=True)


def test_an_image_the_token_limit_would_cut_is_a_counted_skip(llava):
    _, tok, side = llava
    image = random_image(30, 30)
    late = _row([])  # the image after a long text: a cut at 60 tokens falls before it
    late["messages"][0]["content"] = [{"type": "text", "text": "word " * 80}, {"type": "image"}]
    late["images"] = [image]
    rows = [_row([image]), _row([image], reply="word " * 80), late]
    examples, report = _tokenize(rows, tok, side, max_tokens=60, overlong="truncate")
    assert len(examples) == 2 and report.truncated == 1
    assert dict(report.skipped) == {"image_truncated": 1}
    assert "do not fit 60 without cutting an image" in report.first_skip
    assert all(len(ex.feature_rows()) == 16 and len(ex) <= 60 for ex in examples)
    # Dropping (the default) drops it whole, counted as over the length limit.
    examples, report = _tokenize(rows, tok, side, max_tokens=60, overlong="drop")
    assert len(examples) == 1 and report.dropped == 2


def test_image_rows_pack_with_the_rows_their_features_fill(llava, tmp_path):
    _, tok, side = llava
    text_row = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    }
    rows = [
        _row([random_image(30, 30)]),
        text_row,
        _row([random_image(20, 50), random_image(9, 9)]),
    ]
    examples, _ = _tokenize(rows, tok, side)
    batch = collate(examples)
    starts = [0, len(examples[0]), len(examples[0]) + len(examples[1])]
    expected = [
        s + t
        for s, ex in zip(starts, examples)
        if isinstance(ex, ImageExample)
        for t in ex.feature_rows()
    ]
    assert batch.fields["image_rows"].tolist() == expected and len(expected) == 48
    ids = batch.input_ids
    assert (ids[batch.fields["image_rows"]] == side.image_token_id).all()
    assert int((ids == side.image_token_id).sum()) == 48
    assert batch.fields["pixel_values"].shape == (3, 3, 28, 28)
    moved = batch.to("cpu")  # one buffer: the image fields travel with the ids
    torch.testing.assert_close(moved.fields["pixel_values"], batch.fields["pixel_values"])


def test_images_beside_another_row_format_are_a_counted_skip(llava):
    _, tok, side = llava
    turns = [{"from": "human", "value": "<image>What?"}, {"from": "gpt", "value": "A cat."}]
    sharegpt = {"conversations": turns, "images": ["a.png"]}
    ok = _row([random_image(9, 9)])
    examples, report = _tokenize([ok, sharegpt], tok, side)
    assert len(examples) == 1 and dict(report.skipped) == {"image_format": 1}
    assert "images beside a 'sharegpt' row; give TRL's messages" in report.first_skip


def test_a_text_model_still_counts_image_rows_as_skips(llava):
    _, tok, _ = llava
    rows = [
        _row([random_image(30, 30)]),
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
    ]
    examples, report = tokenize_rows(rows, tok, max_tokens=512)
    assert len(examples) == 1 and dict(report.skipped) == {"image_part": 1}


def test_qwen_vl_placeholders_follow_the_grid_where_its_processor_cannot_be_built(tmp_path):
    from types import SimpleNamespace

    folder = vlm_folder(tmp_path, "qwen2_5_vl")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    with pytest.raises(Exception, match="[Tt]orchvision"):
        transformers.AutoProcessor.from_pretrained(folder)
    side = ImageProcessing.from_model(str(folder), tok)
    assert side.processor is None and side.placeholder == "<|image_pad|>"
    images = [random_image(50, 90), random_image(100, 60, seed=1)]
    (ex,), _ = _tokenize([_row(images)], tok, side)
    # transformers' own rule, run on the image processor's output.
    standin = SimpleNamespace(image_processor=side.image_processor, image_token="<|image_pad|>")
    expected, grids = [], []
    for image in images:
        out = side.image_processor(images=[image], return_tensors="pt")
        text = transformers.Qwen2_5_VLProcessor.replace_image_token(standin, out, 0)
        expected.append(text.count("<|image_pad|>"))
        grids += out["image_grid_thw"].tolist()
    assert ex.image_tokens == expected and expected[0] != expected[1]
    assert len(ex.feature_rows()) == sum(expected)
    assert ex.model_inputs()["image_grid_thw"].tolist() == grids
    assert ex.sizes == [(h * 14, w * 14) for _, h, w in grids]


def test_a_hub_model_s_image_side_offline_and_uncached_is_one_line(llava, monkeypatch):
    _, tok, _ = llava
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="'nobody/no-such-vlm' is a hub id, but the hub cannot"):
        ImageProcessing.from_model("nobody/no-such-vlm", tok)
