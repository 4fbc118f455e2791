"""Mistral 3 on the generic image-text path: Pixtral keeps each image's own size, so images
of different sizes become different numbers of feature rows. Its processor class needs
torchvision here: the placeholders follow our rule, checked against transformers'
PixtralProcessor.replace_image_token on the image processor's output; loss and LoRA grads
equal transformers + peft; packed equals separate."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.models import randomise_lora_b
from helpers.tiny_vlm import assert_lora_grads_match, peft_summed_loss, random_image, vlm_folder
from peft import PeftModel

import slipstream
from slipstream.data import collate, pixtral_meta, tokenize_rows
from slipstream.data.vision import ImageProcessing, image_inputs

SIZES = [[(40, 60)], [(20, 30), (56, 14)], [(33, 33)]]


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    folder = vlm_folder(tmp_path_factory.mktemp("mistral3"), "mistral3")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    side = ImageProcessing.from_model(str(folder), tok)
    rows = []
    for k, sizes in enumerate(SIZES):
        images = [random_image(h, w, seed=h + w) for h, w in sizes]
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Describe."}]
        reply = ["Wide.", "Two small ones.", "A square."][k]
        turns = [{"role": "user", "content": parts}, {"role": "assistant", "content": reply}]
        rows.append({"messages": turns, "images": images})
    examples, _ = tokenize_rows(rows, tok, max_tokens=512, images=side)
    return folder, side, rows, examples


def test_placeholders_match_the_features_transformers_tower_gives(mistral3):
    folder, side, rows, examples = mistral3
    assert side.processor is None and side.placeholder == "[IMG]"
    hf = _hf(folder)
    counts = []  # PixtralProcessor (not importable here) is checked through its model
    for row in rows:
        for image in row["images"]:
            out = side.image_processor(images=[image], return_tensors="pt")
            with torch.no_grad():
                feats = hf.model.get_image_features(**out, return_dict=True).pooler_output
            counts.append(feats[0].shape[0])
    assert [n for ex in examples for n in ex.image_tokens] == counts
    assert len(set(counts)) > 2  # images of different sizes: different feature rows
    # Each image: rows of [IMG], each ended by [IMG_BREAK], the last by [IMG_END].
    ex = examples[0]
    (h, w), ids = ex.sizes[0], ex.input_ids
    first, last = ex.feature_rows()[0], ex.feature_rows()[-1] + 1
    tokens = ids[first : last + 1]
    cols = w // 14
    expected = ([side.image_token_id] * cols + [tokens[cols]]) * (h // 14)
    assert tokens[:-1] == expected[:-1] and tokens[cols] != side.image_token_id
    # Several images of one example are padded as the image processor batches them.
    two = side.image_processor(images=rows[1]["images"], return_tensors="pt")
    torch.testing.assert_close(examples[1].model_inputs()["pixel_values"], two["pixel_values"])


def _hf(folder):
    return transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)


def test_loss_and_lora_grads_equal_transformers_and_packed_equals_separate(mistral3, tmp_path):
    folder, _, _, examples = mistral3
    ours = slipstream.load_model(folder)
    slipstream.apply_lora(ours, rank=4, alpha=8)
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path)
    b = collate(examples)
    loss = ours.loss(b.input_ids, b.labels, b.seq, reduction="sum",
                     label_positions=b.label_positions, images=image_inputs(b.fields))  # fmt: skip
    loss.backward()
    peft_model = PeftModel.from_pretrained(_hf(folder), tmp_path, is_trainable=True).eval()
    ref = peft_summed_loss(
        peft_model,
        examples,
        lambda ex: {"input_ids": torch.tensor([ex.input_ids]), **ex.model_inputs()},
    )
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)
    assert_lora_grads_match(ours, peft_model)
    with torch.no_grad():
        packed = ours(b.input_ids, b.seq, images=image_inputs(b.fields))
        alone = [ours(collate([ex]).input_ids, collate([ex]).seq,
                      images=image_inputs(collate([ex]).fields)) for ex in examples]  # fmt: skip
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-4, atol=1e-5)


def _tower_lora(folder):
    """LoRA on the language model and every linear of the Pixtral tower (vision.tower: lora)."""
    from slipstream.config_sections import VisionSection
    from slipstream.train.setup import vision_training

    model = slipstream.load_model(folder)
    vision_training(model, VisionSection(tower="lora"), "lora", before_lora=True)
    slipstream.apply_lora(model, rank=4, alpha=8, targets="all-linear")
    return model


def test_a_whole_training_step_makes_no_host_sync_and_the_tower_sees_no_padding(mistral3):
    """slipstream's Pixtral pass (models/pixtral_tower.py): the batch carries each image's
    valid patches, not the padded pixels, and tower, projector, language model, loss and
    backward read no device value on the host (transformers' tower: 11 over two images)."""
    folder, _, _, examples = mistral3
    batch = collate(examples).to("cpu")
    images = image_inputs(batch.fields)
    assert "pixel_values" not in images
    sizes = [s for ex in examples for s in ex.sizes]
    assert images[pixtral_meta.SEQ].lengths == tuple((h // 7) * (w // 7) for h, w in sizes)
    for model in (slipstream.load_model(folder), _tower_lora(folder)):
        if not slipstream.peft.lora.lora_modules(model):
            slipstream.apply_lora(model, rank=4, alpha=8)
        with slipstream.count_syncs() as syncs:
            loss = model.loss(batch.input_ids, batch.labels, batch.seq, reduction="sum",
                              label_positions=batch.label_positions, images=images)  # fmt: skip
            loss.backward()
        assert syncs.total == 0, syncs


def test_tower_lora_loss_and_grads_equal_transformers_and_peft(mistral3, tmp_path):
    folder, _, _, examples = mistral3
    ours = _tower_lora(folder)
    assert "model.vision_tower.transformer.layers.0.attention.q_proj" in set(
        slipstream.peft.lora.lora_modules(ours)
    )
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path)
    b = collate(examples)
    loss = ours.loss(b.input_ids, b.labels, b.seq, reduction="sum",
                     label_positions=b.label_positions, images=image_inputs(b.fields))  # fmt: skip
    loss.backward()
    peft_model = PeftModel.from_pretrained(_hf(folder), tmp_path, is_trainable=True).eval()
    ref = peft_summed_loss(
        peft_model,
        examples,
        lambda ex: {"input_ids": torch.tensor([ex.input_ids]), **ex.model_inputs()},
    )
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)
    assert_lora_grads_match(ours, peft_model)
    assert [n for n, p in ours.named_parameters() if "vision_tower" in n and p.grad is not None]


def test_greedy_generation_with_images_equals_transformers_generate(mistral3):
    folder, side, _, _ = mistral3
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = slipstream.load_model(folder)
    prompts = [
        [{"role": "user", "content": [{"type": "image", "image": random_image(40, 60)},
                                      {"type": "text", "text": "What is it?"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "Compare"},
                                      {"type": "image", "image": random_image(30, 20, 1)},
                                      {"type": "image", "image": random_image(14, 56, 2)}]}],
    ]  # fmt: skip
    got = slipstream.generate(model, prompts, tokenizer=tok, max_new_tokens=6, stop=[])
    hf = _hf(folder)
    for c, messages in zip(got, prompts, strict=True):
        ex = side.encode_prompt(messages, tok)  # our ids: PixtralProcessor needs torchvision
        out = hf.generate(input_ids=torch.tensor([ex.input_ids]), **ex.model_inputs(),
                          max_new_tokens=6, do_sample=False)  # fmt: skip
        expected = out[0, len(ex.input_ids) :].tolist()
        assert c.token_ids == expected[: len(c.token_ids)] and c.token_ids
