"""Qwen2.5-VL on the generic image-text path (`implementation: transformers`; `auto` takes the
native family: tests/test_vision_native_qwen.py): 3-D mRoPE positions built on the host per
packed sequence (data/mrope.py) equal transformers' get_rope_index; loss and LoRA grads equal
transformers + peft with images of different grids and a text row in one micro-batch; packed
equals separate; the 1-D positions would give other logits; greedy generation with images
(decode positions after the prompt's largest 3-D one) equals transformers' generate."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.models import randomise_lora_b
from helpers.tiny_vlm import (
    assert_lora_grads_match,
    packed_equals_alone,
    peft_summed_loss,
    random_image,
    vlm_folder,
)
from peft import PeftModel

import slipstream
from slipstream.data import collate, tokenize_rows
from slipstream.data.vision import MROPE_FIELD, ImageExample, ImageProcessing, image_inputs


def _row(sizes, reply):
    images = [random_image(h, w, seed=h + w) for h, w in sizes]
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Describe it."}]
    turns = [{"role": "user", "content": parts}, {"role": "assistant", "content": reply}]
    return {"messages": turns, "images": images}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = vlm_folder(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    side = ImageProcessing.from_model(str(folder), tok)
    text = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    rows = [_row([(50, 90)], "Wide."), _row([(100, 60), (30, 30)], "Two of them."), text]
    examples, _ = tokenize_rows(rows, tok, max_tokens=512, images=side)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    return folder, side, examples, hf.eval()


def _hf_inputs(ex, side):
    ids = torch.tensor([ex.input_ids])
    if not isinstance(ex, ImageExample):
        return {"input_ids": ids}
    return {
        "input_ids": ids,
        "mm_token_type_ids": (ids == side.image_token_id).int(),
        **ex.model_inputs(),
    }


def test_host_mrope_positions_equal_transformers_rope_index(qwen):
    _, side, examples, hf = qwen
    for ex in examples[:2]:
        inputs = _hf_inputs(ex, side)
        expected, _ = hf.model.get_rope_index(
            inputs["input_ids"],
            inputs["mm_token_type_ids"],
            image_grid_thw=ex.model_inputs()["image_grid_thw"],
        )
        assert ex.positions_3d == expected[:, 0].tolist()
    b = collate(examples)
    lengths = [len(ex) for ex in examples]
    last = b.fields[MROPE_FIELD][:, sum(lengths[:2]) :]
    assert last.tolist() == [list(range(lengths[2]))] * 3  # a text row: 1-D positions thrice


def test_loss_lora_grads_and_packing_equal_transformers(qwen, tmp_path):
    folder, side, examples, _ = qwen
    ours = slipstream.load_model(folder, implementation="transformers")
    assert ours.vision == {"tower": "model.visual", "projector": "model.visual.merger"}
    slipstream.apply_lora(ours, rank=4, alpha=8)
    assert not [n for n in slipstream.peft.lora.lora_modules(ours) if ".visual." in n]
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path)
    b = collate(examples)
    images = image_inputs(b.fields)
    loss = ours.loss(b.input_ids, b.labels, b.seq, reduction="sum",
                     label_positions=b.label_positions, images=images)  # fmt: skip
    loss.backward()
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path, is_trainable=True).eval()
    ref = peft_summed_loss(peft_model, examples, lambda ex: _hf_inputs(ex, side))
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)
    assert_lora_grads_match(ours, peft_model)
    with torch.no_grad():
        packed, alone = packed_equals_alone(ours, examples, images)
        flat = {k: v for k, v in images.items() if k != MROPE_FIELD}  # 1-D positions only
        assert (ours(b.input_ids, b.seq, images=flat) - packed).abs().max() > 1e-3


def test_greedy_generation_with_images_equals_transformers_generate(qwen):
    folder, side, _, hf = qwen
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = [
        [{"role": "user", "content": [{"type": "image", "image": random_image(50, 90)},
                                      {"type": "text", "text": "What is it?"}]}],
        [{"role": "user", "content": "Hello there"}],
        [{"role": "user", "content": [{"type": "image", "image": random_image(100, 60, 1)},
                                      {"type": "text", "text": "And this?"}]}],
    ]  # fmt: skip
    model = slipstream.load_model(folder, implementation="transformers")
    got = slipstream.generate(model, prompts, tokenizer=tok, max_new_tokens=6, stop=[])
    for c, messages in zip(got, prompts):
        if isinstance(messages[0]["content"], str):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            inputs = {
                "input_ids": tok(text, add_special_tokens=False, return_tensors="pt").input_ids
            }
        else:  # our ids (its processor class needs torchvision), tested equal to its rule
            inputs = _hf_inputs(side.encode_prompt(messages, tok), side)
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False)
        expected = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert c.token_ids == expected[: len(c.token_ids)] and c.token_ids
