"""Native Qwen-VL image-text families (models/qwen_vl.py: Qwen2.5-VL, Qwen3-VL) against
transformers + peft on the same processed conversations (tiny random models, processors built
offline: tests/helpers/tiny_vlm.py): two image rows (three images of different grids) and a
text row in one micro-batch.

Per type: `auto` takes the native family; loss and every LoRA gradient equal transformers +
peft (1e-4 rel), the adapter loading in peft on AutoModelForImageTextToText with equal logits;
packed equals separate; 1-D positions give other logits (the mRoPE test can fail), and so
does Qwen3-VL without its deepstack rows; 0 host syncs in a LoRA step, slipstream's tower
(models/qwen_vit.py) included, with LoRA on it;
greedy generation with an image equals transformers' `generate`; the merged export loads in
transformers with equal logits; LoRA on the tower (`vision.tower: lora`) loads in peft; a
2-step CLI run takes the native family.
"""

from __future__ import annotations

import json

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
from slipstream.models.qwen_vit import QwenVisionTower

KINDS = ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"]
SIZES = [[(50, 90)], [(100, 60), (30, 30)]]


def _atol(kind, logits):
    """1e-5, or for the tiny Qwen3.5s 2e-4 of the largest logit: they amplify rounding in
    their image features ~1e4x (1e-8 of noise moves the logits by 1e-4, measured), and
    slipstream's tower (a matmul for transformers' Conv3d patch embedding) gives features
    within 4e-8 of transformers' (tests/test_vision_models.py, the same bound)."""
    return 2e-4 * logits.abs().max().item() if kind.startswith("qwen3_5") else 1e-5


def _row(sizes, reply, k=0):
    images = [random_image(h, w, seed=h + w + k) for h, w in sizes]
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Describe it."}]
    turns = [{"role": "user", "content": parts}, {"role": "assistant", "content": reply}]
    return {"messages": turns, "images": images}


@pytest.fixture(scope="module", params=KINDS)
def vlm(request, tmp_path_factory):
    kind = request.param
    folder = vlm_folder(tmp_path_factory.mktemp(kind), kind)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    side = ImageProcessing.from_model(str(folder), tok)
    text = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    rows = [_row(s, r, k) for k, (s, r) in enumerate(zip(SIZES, ["Wide.", "Two of them."]))]
    examples, report = tokenize_rows([*rows, text], tok, max_tokens=512, images=side)
    assert report.kept == 3
    grids = [tuple(g) for ex in examples[:2] for g in ex.model_inputs()["image_grid_thw"].tolist()]
    assert len(set(grids)) == 3  # three grids
    return kind, folder, tok, side, examples


def _hf(folder):
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def _hf_inputs(ex, side):
    ids = torch.tensor([ex.input_ids])
    if not isinstance(ex, ImageExample):
        return {"input_ids": ids}
    return {
        "input_ids": ids,
        "mm_token_type_ids": (ids == side.image_token_id).int(),
        **ex.model_inputs(),
    }


def _native(folder):
    model = slipstream.load_model(folder)
    assert type(model).__name__ == "ImageTextLM", model.load_path
    assert "native family" in model.load_path
    return model


def test_loss_lora_grads_packing_and_peft_logits_equal_transformers(vlm, tmp_path):
    kind, folder, _, side, examples = vlm
    ours = _native(folder)
    assert ours.vision == {"tower": "model.visual", "projector": "model.visual.merger"}
    slipstream.apply_lora(ours, rank=4, alpha=8)
    wrapped = list(slipstream.peft.lora.lora_modules(ours))
    assert wrapped and not [n for n in wrapped if ".visual." in n]
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path)
    b = collate(examples)
    images = image_inputs(b.fields)
    loss = ours.loss(b.input_ids, b.labels, b.seq, reduction="sum",
                     label_positions=b.label_positions, images=images)  # fmt: skip
    loss.backward()
    peft_model = PeftModel.from_pretrained(_hf(folder), tmp_path, is_trainable=True).eval()
    ref = peft_summed_loss(peft_model, examples, lambda ex: _hf_inputs(ex, side))
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)
    assert_lora_grads_match(ours, peft_model)
    with torch.no_grad():
        packed, alone = packed_equals_alone(ours, examples, images)
        for ex, got in zip(examples, alone):  # the adapter in peft: equal logits
            expected = peft_model(**_hf_inputs(ex, side)).logits[0]
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=_atol(kind, expected))
        flat = {k: v for k, v in images.items() if k != MROPE_FIELD}  # 1-D positions
        assert (ours(b.input_ids, b.seq, images=flat) - packed).abs().max() > 1e-3
        tower = ours.model.visual
        feats, deepstack = tower(images["pixel_values"], images)
        assert len(deepstack) == (2 if kind == "qwen3_vl" else 0)
        if deepstack:  # without the deepstack rows the logits differ
            tower.forward = lambda pixels, images: (feats, [])
            assert (ours(b.input_ids, b.seq, images=images) - packed).abs().max() > 1e-3


def test_no_host_sync_in_a_lora_step_tower_included(vlm):
    _, folder, _, _, examples = vlm
    model = _native(folder)
    assert isinstance(model.model.visual, QwenVisionTower)  # slipstream's packed tower
    model.no_lora_prefixes = ()  # LoRA on the tower too: its step runs under autograd
    slipstream.apply_lora(model, rank=4, alpha=8, targets="all-linear")
    assert any(n.startswith("model.visual.") and "lora_" in n for n, _ in model.named_parameters())
    batch = collate(examples).to("cpu")
    images = image_inputs(batch.fields)
    with slipstream.count_syncs() as syncs:
        loss = model.loss(batch.input_ids, batch.labels, batch.seq, reduction="sum",
                          label_positions=batch.label_positions, images=images)  # fmt: skip
        loss.backward()
    assert syncs.total == 0, syncs


def test_greedy_generation_with_an_image_equals_transformers_generate(vlm):
    _, folder, tok, side, _ = vlm
    prompts = [
        [{"role": "user", "content": [{"type": "image", "image": random_image(50, 90)},
                                      {"type": "text", "text": "What is it?"}]}],
        [{"role": "user", "content": "Hello there"}],
        [{"role": "user", "content": [{"type": "image", "image": random_image(100, 60, 1)},
                                      {"type": "image", "image": random_image(30, 30, 2)},
                                      {"type": "text", "text": "And these?"}]}],
    ]  # fmt: skip
    got = slipstream.generate(_native(folder), prompts, tokenizer=tok, max_new_tokens=6, stop=[])
    hf = _hf(folder)
    for c, messages in zip(got, prompts):
        if isinstance(messages[0]["content"], str):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
            inputs = {"input_ids": ids}
        else:  # our ids (its processor class needs torchvision), tested equal to its rule
            inputs = _hf_inputs(side.encode_prompt(messages, tok), side)
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False)
        expected = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert c.token_ids == expected[: len(c.token_ids)] and c.token_ids


def test_merged_export_and_tower_lora_load_in_transformers_and_peft(vlm, tmp_path):
    kind, folder, _, side, examples = vlm
    ex = examples[1]
    c = collate([ex])
    model = _native(folder)
    model.no_lora_prefixes = ()  # vision.tower: lora (train/setup.py sets it so)
    slipstream.apply_lora(model, rank=4, alpha=8, targets="all-linear")
    assert [n for n in slipstream.peft.lora.lora_modules(model) if ".visual.blocks." in n]
    randomise_lora_b(model)
    slipstream.save_adapter(model, tmp_path / "adapter")
    with torch.no_grad():
        want = model(c.input_ids, c.seq, images=image_inputs(c.fields))
        peft_model = PeftModel.from_pretrained(_hf(folder), tmp_path / "adapter").eval()
        got = peft_model(**_hf_inputs(ex, side)).logits[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=_atol(kind, want))
        slipstream.export_merged(model, tmp_path / "merged")
        merged = _hf(tmp_path / "merged")
        got = merged(**_hf_inputs(ex, side)).logits[0]
        # W + s B A rounds in float32 (4 of 15k Qwen3.5 logits off by 2e-5): 1e-5 of the largest.
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max())


def test_a_two_step_cli_run_takes_the_native_family(vlm, tmp_path, capsys):
    from helpers.tiny_vlm import run_config, write_picture_rows

    from slipstream import cli

    kind, folder, _, _, _ = vlm
    data, out = write_picture_rows(tmp_path, [(50, 90), (40, 40)]), tmp_path / "out"
    assert cli.main(["train", str(run_config(tmp_path / "run.yaml", folder, data, out))]) == 0
    assert f"{kind}: native family slipstream/models/" in capsys.readouterr().err
    losses = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses if "loss" in r] == [1, 2]
    PeftModel.from_pretrained(_hf(folder), out)  # the run's adapter loads in peft
