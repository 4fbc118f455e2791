"""Three more image-text types on the generic path, each against transformers + peft on the
same processed conversations (tiny random models, processors built offline:
tests/helpers/tiny_vlm.py):

- Qwen3-VL (`qwen3_vl`): 3-D mRoPE from the host, and deepstack: the tower's intermediate
  features added to the image rows after the first decoder layers (forward hooks, index_add);
  Qwen3.5 and Qwen3.5-MoE (`qwen3_5`, `qwen3_5_moe`): the same positions, Gated DeltaNet layers
  run per packed sequence, generation on transformers' `generate` (all three with
  `model.implementation: transformers`: the references of tests/test_vision_native_qwen.py);
- Gemma 3 (`gemma3` with `model.implementation: transformers`, the reference path; its native
  family: tests/test_vision_native_gemma.py): each image's rows attend to one another
  (SeqInfo.image_spans), causal elsewhere, on sliding and full layers;
- Idefics3 (`idefics3`): images split into crops plus a global view, each crop its own row of
  the tower's batch; SmolVLM (`smolvlm`) the same, its placeholders by transformers' own
  `get_image_prompt_string` (its processor class builds a video processor: torchvision).

Per type: loss and every LoRA gradient equal transformers + peft (1e-4 rel) on a micro-batch
of several images of different sizes and a text row; packed equals each example alone; greedy
generation with an image equals transformers' `generate`; no host sync in a training step's
model code, the tower included: Gemma 3's SigLIP, slipstream's Qwen-VL tower (Qwen3-VL,
Qwen3.5: models/qwen_vit.py) and its passes over Gemma 4's, Idefics3's and SmolVLM's
(models/gemma4_tower.py, idefics3_tower.py).
"""

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
from slipstream.data import collate, gemma4_meta, tokenize_rows
from slipstream.data.vision import MROPE_FIELD, ImageExample, ImageProcessing, image_inputs

KINDS = ["qwen3_vl", "qwen3_5", "qwen3_5_moe", "gemma3", "gemma4", "idefics3", "smolvlm"]
QWEN35 = ("qwen3_5", "qwen3_5_moe")
NO_PROCESSOR = ("qwen3_vl", *QWEN35, "gemma4", "smolvlm")  # processors need torchvision here
# Loaded with `implementation: transformers`: Qwen3-VL, Qwen3.5 and Gemma 3 as the references
# for their native image families (tests/test_vision_native_qwen.py,
# test_vision_native_gemma.py), Gemma 4 whose native family is text only.
ON_GENERIC = ("qwen3_vl", "gemma3", *QWEN35, "gemma4")
SIZES = [[(50, 90)], [(100, 60), (30, 30)], [(9, 70), (40, 40), (64, 32)]]


def _row(sizes, reply, k):
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
    rows = [_row(s, r, k) for k, (s, r) in enumerate(zip(SIZES, ["Wide.", "Two.", "Three."]))]
    examples, report = tokenize_rows([*rows, text], tok, max_tokens=1024, images=side)
    assert report.kept == 4
    return kind, folder, tok, side, examples


def _load(kind, folder):
    how = {"implementation": "transformers"} if kind in ON_GENERIC else {}
    return slipstream.load_model(folder, **how)


def _hf(folder):
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def _hf_inputs(kind, ex, side):
    """transformers' inputs for one example, as its processor would give them."""
    ids = torch.tensor([ex.input_ids])
    if not isinstance(ex, ImageExample):
        return {"input_ids": ids}
    types = (ids == side.image_token_id).int()
    if kind in ("qwen3_vl", *QWEN35, "gemma4"):  # Gemma 4's mask reads them too
        return {"input_ids": ids, "mm_token_type_ids": types, **ex.model_inputs()}
    if kind == "gemma3":  # token_type_ids: transformers' bidirectional mask over each image
        return {"input_ids": ids, "token_type_ids": types, **ex.model_inputs()}
    crops = {k: v[None] for k, v in ex.model_inputs().items()}  # (1, crops, ...)
    return {"input_ids": ids, **crops}


def test_image_tokens_and_inputs(vlm):
    kind, folder, _, side, examples = vlm
    image_rows = [ex for ex in examples if isinstance(ex, ImageExample)]
    counts = [n for ex in image_rows for n in ex.image_tokens]
    assert len(counts) == 6 and sum(len(ex.feature_rows()) for ex in image_rows) == sum(counts)
    if kind == "gemma3":  # 4 pooled tokens an image, each image one bidirectional span
        assert counts == [4] * 6 and all(ex.bidirectional for ex in image_rows)
        assert [b - a for a, b in image_rows[1].image_spans()] == [4, 4]
        b = collate(examples)
        assert len(b.seq.image_spans) == 6 and b.seq.to("cpu").image_spans == b.seq.image_spans
    elif kind == "idefics3":  # crops and a global view: counts differ with the image's shape
        assert len(set(counts)) > 1 and side.processor is not None
        processor = transformers.AutoProcessor.from_pretrained(folder)
        row = _row(SIZES[2], "Three.", 2)
        text = processor.apply_chat_template(row["messages"], tokenize=False)
        ref = processor(text=[text], images=[row["images"]], return_tensors="pt")
        assert image_rows[2].input_ids == ref["input_ids"][0].tolist()
        crops = ref["pixel_attention_mask"][0].flatten(1).any(1)  # the real crops
        ours = image_rows[2].model_inputs()["pixel_values"]
        torch.testing.assert_close(ours, ref["pixel_values"][0][crops][:, :, : ours.shape[-2]])
    elif kind == "gemma4":  # each image its own patch grid: counts differ; Gemma4Processor's
        # rule (its class needs torchvision here) gives our ids; padding patches at (-1, -1)
        from types import SimpleNamespace

        assert side.processor is None and len(set(counts)) > 1
        assert all(ex.bidirectional for ex in image_rows)
        standin = SimpleNamespace(boi_token="<|image>", image_token="<|image|>",
                                  eoi_token="<image|>")  # fmt: skip
        row = _row(SIZES[2], "Three.", 2)
        expected = []
        for image in row["images"]:
            out = side.image_processor(images=[image])
            expected += tok_ids(side, transformers.Gemma4Processor.replace_image_token(
                standin, out, 0))  # fmt: skip
        got = image_rows[2].input_ids
        start = got.index(expected[0])
        assert got[start : start + len(expected)] == expected
        pos = image_rows[2].model_inputs()["image_position_ids"]
        real = (pos != -1).all(-1).sum(-1)
        assert (real == 9 * torch.tensor(image_rows[2].image_tokens)).all() and (pos == -1).any()
    elif kind == "smolvlm":  # our placeholders == SmolVLMProcessor's rule, crops counted
        from types import SimpleNamespace

        assert side.processor is None and len(set(counts)) > 1
        standin = SimpleNamespace(
            image_seq_len=4, fake_image_token="<fake_token_around_image>", image_token="<image>",
            global_image_token="<global-img>",
        )  # fmt: skip
        row = _row(SIZES[2], "Three.", 2)
        expected = []
        for image in row["images"]:
            out = side.image_processor(images=[image], return_row_col_info=True)
            text = transformers.SmolVLMProcessor.replace_image_token(standin, out, 0)
            expected.append(tok_ids(side, text))
        got, rows = image_rows[2].input_ids, image_rows[2].image_spans()
        assert [n for n in image_rows[2].image_tokens] == [e.count(side.image_token_id)
                                                           for e in expected]  # fmt: skip
        flat = [i for e in expected for i in e]
        start = got.index(flat[0])
        assert got[start : start + len(flat)] == flat and rows
    else:  # Qwen3-VL, Qwen3.5: grids of different sizes, 3-D positions equal transformers'
        assert len(set(counts)) > 1 and side.processor is None
        hf = _hf(folder)
        for ex in image_rows:
            inputs = _hf_inputs(kind, ex, side)
            expected, _ = hf.model.get_rope_index(
                inputs["input_ids"], inputs["mm_token_type_ids"],
                image_grid_thw=ex.model_inputs()["image_grid_thw"],
            )  # fmt: skip
            assert ex.positions_3d == expected[:, 0].tolist()


def test_loss_lora_grads_and_packing_equal_transformers(vlm, tmp_path):
    kind, folder, _, side, examples = vlm
    ours = _load(kind, folder)
    assert type(ours).__name__ == "GenericImageTextLM", ours.load_path
    slipstream.apply_lora(ours, rank=4, alpha=8)
    vision = tuple(ours.vision.values())
    wrapped = list(slipstream.peft.lora.lora_modules(ours))
    assert wrapped and not [n for n in wrapped if n.startswith(vision)]
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path)
    b = collate(examples)
    images = image_inputs(b.fields)
    loss = ours.loss(b.input_ids, b.labels, b.seq, reduction="sum",
                     label_positions=b.label_positions, images=images)  # fmt: skip
    loss.backward()
    peft_model = PeftModel.from_pretrained(_hf(folder), tmp_path, is_trainable=True).eval()
    ref = peft_summed_loss(peft_model, examples, lambda ex: _hf_inputs(kind, ex, side))
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)
    assert_lora_grads_match(ours, peft_model)
    with torch.no_grad():
        packed, alone = packed_equals_alone(ours, examples, images)
        ex = examples[1]  # two images: transformers' logits on it, and what the images change
        got = alone[1]
        expected = peft_model(**_hf_inputs(kind, ex, side)).logits[0]
        atol = 1e-5
        if kind in QWEN35:  # this tiny model amplifies rounding in its image features ~1e4x:
            # 1e-8 of noise on them moves its logits by 1e-4 (measured); slipstream's tower
            # (a matmul where transformers' patch embedding is a Conv3d) gives features
            # within 4e-8 of transformers', logits within 4.4e-4 of logits up to 4.5.
            atol = 2e-4 * expected.abs().max().item()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=atol)
        c = collate([ex])
        if kind == "qwen3_vl":  # without the deepstack rows the logits differ
            real = ours._image_features
            ours._image_features = lambda im: (real(im)[0], [])
            plain = ours(c.input_ids, c.seq, images=image_inputs(c.fields))
            del ours._image_features
        elif kind in QWEN35:  # 1-D positions give other logits
            flat = {k: v for k, v in image_inputs(c.fields).items() if k != MROPE_FIELD}
            plain = ours(c.input_ids, c.seq, images=flat)
        elif kind in ("gemma3", "gemma4"):  # causal image rows (no spans) give other logits
            c.seq.image_spans = ()
            plain = ours(c.input_ids, c.seq, images=image_inputs(c.fields))
        else:  # images matter
            plain = ours(c.input_ids, c.seq)
        assert (plain - got).abs().max() > 1e-4


def test_no_host_sync_in_a_training_step(vlm):
    """Counted apart: the vision tower (slipstream's or its pass over transformers' modules
    for every type here) and the rest of the step: none in either."""
    kind, folder, _, _, examples = vlm
    model = _load(kind, folder)
    slipstream.apply_lora(model, rank=4, alpha=8)
    batch = collate(examples).to("cpu")
    images = image_inputs(batch.fields)
    with slipstream.count_syncs() as syncs:
        features = model._image_features(images)  # transformers' tower: counted apart
    model._image_features = lambda _: features
    with slipstream.count_syncs() as rest:
        loss = model.loss(batch.input_ids, batch.labels, batch.seq, reduction="sum",
                          label_positions=batch.label_positions, images=images)  # fmt: skip
        loss.backward()
    assert rest.total == 0, rest
    # Gemma 3's SigLIP, slipstream's Qwen-VL tower, its Gemma 4 and Idefics3 passes: none
    assert syncs.total == 0, syncs
    if kind == "gemma4":  # the tower saw the real patches only, no padded batch
        assert gemma4_meta.PATCHES in images and "pixel_values" not in images


def test_greedy_generation_with_an_image_equals_transformers_generate(vlm):
    kind, folder, tok, side, _ = vlm
    model = _load(kind, folder)
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
        inputs = _prompt_inputs(kind, folder, tok, side, messages)
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False)
        expected = out[0, inputs["input_ids"].shape[1] :].tolist()
        got_ids = c.token_ids
        if kind == "gemma4" and side.image_token_id in got_ids:
            # transformers' Gemma 4 embeds a generated image token as the pad token (its
            # multimodal mask covers decode steps); the random model emits one: compare the
            # tokens up to and including it.
            got_ids = got_ids[: got_ids.index(side.image_token_id) + 1]
        assert got_ids == expected[: len(got_ids)] and got_ids


def _prompt_inputs(kind, folder, tok, side, messages):
    """transformers' generate inputs for a chat prompt: its processor's, or (Qwen3-VL, whose
    processor class needs torchvision; SmolVLM's likewise) our ids, tested equal to its rule
    elsewhere."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    content = messages[0]["content"]
    images = [p["image"] for p in content if isinstance(p, dict) and p["type"] == "image"]
    if kind in NO_PROCESSOR:
        if not images:
            return {"input_ids": tok(text, add_special_tokens=False, return_tensors="pt").input_ids}
        return _hf_inputs(kind, side.encode_prompt(messages, tok), side)
    processor = transformers.AutoProcessor.from_pretrained(folder)
    inputs = processor(text=[text], images=[images] if images else None,
                       add_special_tokens=False, return_tensors="pt")  # fmt: skip
    inputs.pop("attention_mask", None)
    return inputs


def tok_ids(side, text):
    return side.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_gemma3_pan_and_scan_crops_train_as_transformers(tmp_path):
    """Gemma 3's pan-and-scan (on in the image processor's config): a wide image becomes the
    whole picture plus crops, each its own bidirectional span; loss and LoRA gradients equal
    transformers + peft on those inputs."""
    import json

    folder = vlm_folder(tmp_path / "gemma3", "gemma3")
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
    assert (
        len(examples[0].image_spans()) == 3
        and examples[0].model_inputs()["pixel_values"].shape[0] == 3
    )
    # transformers' Gemma3Processor call never turns pan-and-scan on here (its own kwargs
    # default wins over the config), so the crops' text is its replace_image_token's, checked:
    assert "Here is the original image" in tok.decode(examples[0].input_ids)
    ours = _load("gemma3", folder)
    slipstream.apply_lora(ours, rank=4, alpha=8)
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path / "adapter")
    b = collate(examples)
    loss = ours.loss(b.input_ids, b.labels, b.seq, reduction="sum",
                     label_positions=b.label_positions, images=image_inputs(b.fields))  # fmt: skip
    loss.backward()
    peft_model = PeftModel.from_pretrained(_hf(folder), tmp_path / "adapter", is_trainable=True)
    ref_loss = peft_summed_loss(peft_model.eval(), examples,
                                lambda ex: _hf_inputs("gemma3", ex, side))  # fmt: skip
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    assert_lora_grads_match(ours, peft_model)
