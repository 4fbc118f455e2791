"""Gemma 4 image+text on the native family (models/gemma4_image.py: our text model plus
transformers' tower and embedder modules run by models/gemma4_tower.py) against transformers
+ peft on the same processed conversations: the tiny random Gemma 4 of tests/helpers/tiny_vlm.py
(per-layer inputs, a sliding and a full layer, bidirectional image rows on the sliding one),
its tower and embedder randomised at a larger scale so that images move the logits.

The image features equal transformers'; loss and every LoRA gradient (language model, and
with `vision.tower: lora` the tower's too) equal transformers + peft on two image rows (three
images of different grids) and a text row in one micro-batch; packed equals each example
alone and peft's logits; causal image rows, or the image token's own id in the per-layer
inputs (transformers puts the pad token's there), give other logits; 0 host syncs over a
whole LoRA step, tower included; greedy generation with images equals transformers'
`generate`; the merged export loads in transformers with equal logits; image rows keep
`auto` native (`implementation: transformers` is the reference); a 2-step CLI run on image
rows is native and its adapter, the tower's LoRA included, loads in peft.
"""

from __future__ import annotations

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
    lora_step_matches_peft,
    packed_equals_alone,
    random_image,
    vlm_folder,
)

import slipstream
from slipstream.data import collate, tokenize_rows
from slipstream.data.vision import ImageExample, ImageProcessing, image_inputs
from slipstream.train.setup import vision_training

SIZES = [[(40, 60)], [(60, 30), (24, 24)]]


def _row(sizes, reply, k):
    images = [random_image(h, w, seed=h + w + k) for h, w in sizes]
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Describe it."}]
    turns = [{"role": "user", "content": parts}, {"role": "assistant", "content": reply}]
    return {"messages": turns, "images": images}


def gemma4_folder(out):
    """The tiny Gemma 4 of tiny_vlm with its tower and embedder randomised (transformers'
    small init makes every image's features nearly equal), saved back."""
    folder = vlm_folder(out, "gemma4")
    hf = _hf(folder)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in [*hf.model.vision_tower.parameters(), *hf.model.embed_vision.parameters()]:
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = gemma4_folder(tmp_path_factory.mktemp("gemma4"))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    side = ImageProcessing.from_model(str(folder), tok)
    text = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    rows = [_row(s, r, k) for k, (s, r) in enumerate(zip(SIZES, ["Wide.", "Two."]))]
    examples, report = tokenize_rows([*rows, text], tok, max_tokens=1024, images=side)
    assert report.kept == 3
    return folder, tok, side, examples


def _hf(folder):
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def _hf_inputs(ex, side):
    """transformers' inputs for one example (mm_token_type_ids: its bidirectional mask)."""
    ids = torch.tensor([ex.input_ids])
    if not isinstance(ex, ImageExample):
        return {"input_ids": ids}
    return {
        "input_ids": ids,
        "mm_token_type_ids": (ids == side.image_token_id).int(),
        **ex.model_inputs(),
    }


def _native(folder, tower="frozen"):
    """Our model with LoRA (B random), on the tower too with `tower="lora"`."""
    model = slipstream.load_model(folder)
    assert type(model).__name__ == "Gemma4ImageTextLM", model.load_path
    vision = SimpleNamespace(tower=tower, projector="frozen")
    vision_training(model, vision, "lora", before_lora=True)
    # The tower's linears are transformers' ClippableLinear's `linear`: not a default target.
    targets = "all-linear" if tower == "lora" else None
    slipstream.apply_lora(model, rank=4, alpha=8, targets=targets)
    vision_training(model, vision, "lora", before_lora=False)
    randomise_lora_b(model)
    return model


def test_image_features_equal_transformers(vlm):
    folder, *_, examples = vlm
    ours, hf = slipstream.load_model(folder), _hf(folder)
    b = collate(examples)
    with torch.no_grad():
        feats = ours.image_features(image_inputs(b.fields))
        pixels = [ex.model_inputs() for ex in examples if isinstance(ex, ImageExample)]
        expected = torch.cat([
            torch.cat(list(hf.model.get_image_features(**p, return_dict=True).pooler_output))
            for p in pixels
        ])  # fmt: skip
    assert feats.shape == expected.shape and feats.shape[0] == b.fields["image_rows"].shape[0]
    assert expected.std(0).mean() > 0.1  # images differ: the test can see a wrong tower
    torch.testing.assert_close(feats, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tower", ["frozen", "lora"])
def test_loss_lora_grads_and_packing_equal_transformers(vlm, tmp_path, tower):
    folder, _, side, examples = vlm
    ours = _native(folder, tower)
    hf_inputs = lambda ex: _hf_inputs(ex, side)  # noqa: E731
    peft_model, images = lora_step_matches_peft(ours, folder, examples, hf_inputs, tmp_path, tower)
    with torch.no_grad():
        _, alone = packed_equals_alone(ours, examples, images)
        for ex, got in zip(examples, alone):
            expected = peft_model(**_hf_inputs(ex, side)).logits[0]
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        ex = examples[1]  # two images: what the spans and the per-layer ids change
        c = collate([ex])
        c.seq.image_spans = ()  # causal image rows: other logits
        causal = ours(c.input_ids, c.seq, images=image_inputs(c.fields))
        assert (causal - alone[1]).abs().max() > 1e-4
        c = collate([ex])
        x_TD = ours.embed(c.input_ids, image_inputs(c.fields))
        h_TD = ours.model(c.input_ids, c.seq, x_TD=x_TD)[0]  # image ids in the per-layer inputs
        own_ids = torch.nn.functional.linear(h_TD, ours.lm_head_weight())
        assert (ours.finish_logits(own_ids) - alone[1]).abs().max() > 1e-4


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
    folder, tok, side, _ = vlm
    model = slipstream.load_model(folder)
    assert type(model).__name__ == "Gemma4ImageTextLM"
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
    for c, messages in zip(got, prompts):
        if isinstance(messages[0]["content"], str):  # Gemma4Processor needs torchvision here
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
            inputs = {"input_ids": ids}
        else:  # our ids, tested equal to its rule in tests/test_vision_models.py
            inputs = _hf_inputs(side.encode_prompt(messages, tok), side)
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False)
        expected = out[0, inputs["input_ids"].shape[1] :].tolist()
        got_ids = c.token_ids
        if side.image_token_id in got_ids:  # transformers embeds a generated image token as
            got_ids = got_ids[: got_ids.index(side.image_token_id) + 1]  # the pad token
        assert got_ids == expected[: len(got_ids)] and got_ids


def test_merged_export_loads_in_transformers_with_equal_logits(vlm, tmp_path):
    folder, _, side, examples = vlm
    model = _native(folder, "lora")
    ex = examples[1]
    c = collate([ex])
    with torch.no_grad():
        want = model(c.input_ids, c.seq, images=image_inputs(c.fields))
        slipstream.export_merged(model, tmp_path / "merged")
        got = _hf(tmp_path / "merged")(**_hf_inputs(ex, side)).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max())


def test_image_rows_keep_auto_native_and_transformers_is_the_reference(vlm):
    folder, *_, examples = vlm
    assert_image_rows_keep_auto_native(folder, examples)


def test_cli_run_on_image_rows_is_native_and_its_adapter_loads_in_peft(vlm, tmp_path, capsys):
    assert_cli_run_is_native_and_loads_in_peft(
        vlm[0], tmp_path, capsys, _hf, lora={"targets": "all-linear"}
    )


def test_tower_lora_that_wraps_none_of_the_towers_linears_is_an_error(vlm):
    folder, *_ = vlm
    model = slipstream.load_model(folder)
    vision = SimpleNamespace(tower="lora", projector="frozen")
    vision_training(model, vision, "lora", before_lora=True)
    slipstream.apply_lora(model, rank=4, alpha=8)  # q_proj, ...: the tower's are `linear`
    with pytest.raises(ValueError, match=r"vision.tower=lora.*\(input_proj, linear\).*all-linear"):
        vision_training(model, vision, "lora", before_lora=False)
