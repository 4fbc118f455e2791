"""Gemma 3 image+text on the native family (models/gemma3.py `Gemma3ImageTextLM`, our SigLIP
tower and projector in models/siglip.py) against transformers + peft on the same processed
conversations: a tiny random Gemma 3 with a real Gemma3Processor built offline
(tests/helpers/tiny_vlm.py), its projector randomised (transformers initialises it to zeros,
which would make every image's features equal).

The tower's output equals transformers'; loss and every LoRA gradient (language model, and
with `vision.tower: lora` the tower's too) equal transformers + peft on three image rows (six
images) and a text row in one micro-batch, pan-and-scan crops too; packed equals each example
alone; causal image rows (no spans) give other logits; the adapters load in peft; 0 host
syncs over a whole LoRA step, tower included; greedy generation with images equals
transformers' `generate`; image rows keep `auto` on the native family, and a 2-step CLI run
on image rows is native and writes an adapter peft loads.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from helpers.models import randomise_lora_b
from helpers.native_vlm_runs import (
    assert_cli_run_is_native_and_loads_in_peft,
    assert_image_rows_keep_auto_native,
)
from helpers.tiny_vlm import (
    assert_lora_grads_match,
    lora_step_matches_peft,
    packed_equals_alone,
    peft_summed_loss,
    random_image,
    vlm_folder,
)
from peft import PeftModel

import slipstream
from slipstream.data import collate, tokenize_rows
from slipstream.data.vision import ImageExample, ImageProcessing, image_inputs
from slipstream.train.setup import vision_training

SIZES = [[(50, 90)], [(100, 60), (30, 30)], [(9, 70), (40, 40), (64, 32)]]


def _row(sizes, reply, k):
    images = [random_image(h, w, seed=h + w + k) for h, w in sizes]
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Describe it."}]
    turns = [{"role": "user", "content": parts}, {"role": "assistant", "content": reply}]
    return {"messages": turns, "images": images}


def gemma3_folder(out):
    """The tiny Gemma 3 of tiny_vlm with a random projector (and its norm) saved back."""
    folder = vlm_folder(out, "gemma3")
    hf = _hf(folder)
    torch.manual_seed(1)
    with torch.no_grad():
        projector = hf.model.multi_modal_projector
        projector.mm_input_projection_weight.normal_(0, 0.3)
        projector.mm_soft_emb_norm.weight.normal_(0, 0.3)
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = gemma3_folder(tmp_path_factory.mktemp("gemma3"))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    side = ImageProcessing.from_model(str(folder), tok)
    text = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    rows = [_row(s, r, k) for k, (s, r) in enumerate(zip(SIZES, ["Wide.", "Two.", "Three."]))]
    examples, report = tokenize_rows([*rows, text], tok, max_tokens=1024, images=side)
    assert report.kept == 4
    return folder, tok, side, examples


def _hf(folder):
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def _hf_inputs(ex, side):
    """transformers' inputs for one example, as its processor gives them (token_type_ids:
    its bidirectional mask over each image)."""
    ids = torch.tensor([ex.input_ids])
    if not isinstance(ex, ImageExample):
        return {"input_ids": ids}
    return {
        "input_ids": ids,
        "token_type_ids": (ids == side.image_token_id).int(),
        **ex.model_inputs(),
    }


def _native(folder, tower="frozen"):
    """Our model with LoRA (B random), on the tower too with `tower="lora"`."""
    model = slipstream.load_model(folder)
    assert type(model).__name__ == "Gemma3ImageTextLM", model.load_path
    vision = SimpleNamespace(tower=tower, projector="frozen")
    vision_training(model, vision, "lora", before_lora=True)
    slipstream.apply_lora(model, rank=4, alpha=8)
    randomise_lora_b(model)
    return model


def test_tower_and_projector_equal_transformers(vlm):
    folder, *_, examples = vlm
    ours, hf = slipstream.load_model(folder), _hf(folder)
    pixels = collate(examples).fields["pixel_values"]
    assert pixels.shape[0] == 6  # every image of the batch in one tower call
    with torch.no_grad():
        tower = ours.vision_tower(pixels)
        torch.testing.assert_close(tower, hf.model.vision_tower(pixels).last_hidden_state,
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
        feats = ours.image_features({"pixel_values": pixels})
        expected = hf.model.get_image_features(pixel_values=pixels).pooler_output
    assert feats.shape == (6 * 4, ours.config.hidden_size) and expected.abs().max() > 0.1
    torch.testing.assert_close(feats, expected.flatten(0, 1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tower", ["frozen", "lora"])
def test_loss_lora_grads_and_packing_equal_transformers(vlm, tmp_path, tower):
    folder, _, side, examples = vlm
    ours = _native(folder, tower)
    hf_inputs = lambda ex: _hf_inputs(ex, side)  # noqa: E731
    peft_model, images = lora_step_matches_peft(ours, folder, examples, hf_inputs, tmp_path, tower)
    with torch.no_grad():
        _, alone = packed_equals_alone(ours, examples, images)
        ex = examples[1]  # two images: peft's logits on it, and what the spans change
        expected = peft_model(**_hf_inputs(ex, side)).logits[0]
        torch.testing.assert_close(alone[1], expected, rtol=1e-4, atol=1e-5)
        c = collate([ex])
        c.seq.image_spans = ()  # causal image rows: other logits
        causal = ours(c.input_ids, c.seq, images=image_inputs(c.fields))
        assert (causal - alone[1]).abs().max() > 1e-4


def test_pan_and_scan_crops_train_as_transformers(tmp_path):
    """Pan-and-scan (on in the image processor's config): a wide image is the whole picture
    plus crops, all one size, each its own span; loss and LoRA gradients equal peft's."""
    folder = gemma3_folder(tmp_path / "gemma3")
    config = json.loads((folder / "processor_config.json").read_text())
    config["image_processor"].update(
        do_pan_and_scan=True, pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=2,
        pan_and_scan_min_ratio_to_activate=1.2,
    )  # fmt: skip
    (folder / "processor_config.json").write_text(json.dumps(config))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    side = ImageProcessing.from_model(str(folder), tok)
    rows = [_row([(28, 100)], "Wide.", 0), _row([(40, 40), (90, 30)], "Two.", 1)]
    examples, _ = tokenize_rows(rows, tok, max_tokens=1024, images=side)
    assert [n for ex in examples for n in ex.image_tokens] == [12, 4, 12]  # 1 + 2 crops
    ours = _native(folder, "lora")
    slipstream.save_adapter(ours, tmp_path / "adapter")
    b = collate(examples)
    assert b.fields["pixel_values"].shape[0] == 7 and len(b.seq.image_spans) == 7
    loss = ours.loss(b.input_ids, b.labels, b.seq, reduction="sum",
                     label_positions=b.label_positions, images=image_inputs(b.fields))  # fmt: skip
    loss.backward()
    peft_model = PeftModel.from_pretrained(_hf(folder), tmp_path / "adapter", is_trainable=True)
    ref = peft_summed_loss(peft_model.eval(), examples, lambda ex: _hf_inputs(ex, side))
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)
    assert_lora_grads_match(ours, peft_model)


def test_no_host_sync_in_a_lora_step_tower_included(vlm):
    folder, *_, examples = vlm
    model = _native(folder, "lora")
    batch = collate(examples).to("cpu")
    images = image_inputs(batch.fields)
    with slipstream.count_syncs() as syncs:
        loss = model.loss(batch.input_ids, batch.labels, batch.seq, reduction="sum",
                          label_positions=batch.label_positions, images=images)  # fmt: skip
        loss.backward()
    assert syncs.total == 0, syncs
    assert any(p.grad is not None for n, p in model.named_parameters() if "vision_tower" in n)


def test_greedy_generation_with_images_equals_transformers_generate(vlm):
    folder, tok, *_ = vlm
    model = slipstream.load_model(folder)
    assert type(model).__name__ == "Gemma3ImageTextLM"
    prompts = [
        [{"role": "user", "content": [{"type": "image", "image": random_image(40, 60)},
                                      {"type": "text", "text": "What is it?"}]}],
        [{"role": "user", "content": "Hello there"}],
        [{"role": "user", "content": [{"type": "text", "text": "Compare"},
                                      {"type": "image", "image": random_image(30, 20, 1)},
                                      {"type": "image", "image": random_image(9, 70, 2)}]}],
    ]  # fmt: skip
    got = slipstream.generate(model, prompts, tokenizer=tok, max_new_tokens=6, stop=[])
    hf = _hf(folder)
    processor = transformers.AutoProcessor.from_pretrained(folder)
    for c, messages in zip(got, prompts):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        content = messages[0]["content"]
        pics = [p["image"] for p in content if isinstance(p, dict) and p["type"] == "image"]
        inputs = processor(text=[text], images=[pics] if pics else None,
                           add_special_tokens=False, return_tensors="pt")  # fmt: skip
        inputs.pop("attention_mask", None)
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False)
        expected = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert c.token_ids == expected[: len(c.token_ids)] and c.token_ids


def test_image_rows_keep_auto_native_and_transformers_is_the_reference(vlm):
    folder, *_, examples = vlm
    assert_image_rows_keep_auto_native(folder, examples)


def test_cli_run_on_image_rows_is_native_and_its_adapter_loads_in_peft(vlm, tmp_path, capsys):
    assert_cli_run_is_native_and_loads_in_peft(
        vlm[0], tmp_path, capsys, _hf, train={"tokens_per_batch": 128}
    )
