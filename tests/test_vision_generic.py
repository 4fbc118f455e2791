"""Image-text models on the generic path (models/generic_vision.py), a tiny LLaVA: loss and
LoRA gradients equal transformers + peft on the same processed conversations, packed equal
to separate with several images of different sizes, no host sync in a training step, and
the adapter loads in peft on AutoModelForImageTextToText with equal logits."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from helpers.models import randomise_lora_b
from helpers.tiny_vlm import assert_lora_grads_match, random_image, vlm_folder
from peft import PeftModel
from peft.tuners.lora import LoraLayer

import slipstream
from slipstream.data import collate, tokenize_rows
from slipstream.data.vision import ImageProcessing, image_inputs
from slipstream.ops.packing import SeqInfo


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = vlm_folder(tmp_path_factory.mktemp("llava"), "llava")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    side = ImageProcessing.from_model(str(folder), tok)
    rows = [
        _row([(40, 60)], "What is it?", "A red square."),
        _row([(50, 30), (20, 20)], "Compare them.", "The first one is bigger."),
        _row([(9, 70)], "Describe.", "Stripes."),
    ]
    examples, _ = tokenize_rows(rows, tok, max_tokens=512, images=side)
    return folder, tok, examples


def _row(sizes, text, reply):
    images = [random_image(h, w, seed=h * w) for h, w in sizes]
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": reply},
        ],
        "images": images,
    }


def _hf(folder):
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def _hf_forward(hf, ex):
    ids = torch.tensor([ex.input_ids])
    labels = torch.tensor([[i if t else -100 for i, t in zip(ex.input_ids, ex.trainable)]])
    out = hf(input_ids=ids, pixel_values=ex.model_inputs()["pixel_values"], labels=labels)
    return out, int((labels[0, 1:] != -100).sum())


def _ours(model, examples, **kw):
    b = collate(examples)
    images = image_inputs(b.fields)
    return model.loss(b.input_ids, b.labels, b.seq, label_positions=b.label_positions,
                      images=images, **kw)  # fmt: skip


def test_loss_and_lora_grads_equal_transformers_and_peft(llava, tmp_path):
    folder, _, examples = llava
    ours = slipstream.load_model(folder)
    assert type(ours).__name__ == "GenericImageTextLM" and "image-text" in ours.load_path
    slipstream.apply_lora(ours, rank=4, alpha=8)
    wrapped = list(slipstream.peft.lora.lora_modules(ours))
    assert wrapped and not [n for n in wrapped if "vision" in n or "projector" in n]
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path)
    loss = _ours(ours, examples, reduction="sum")
    loss.backward()
    peft_model = PeftModel.from_pretrained(_hf(folder), tmp_path, is_trainable=True)
    assert not [n for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)
                and ("vision" in n or "projector" in n)]  # fmt: skip
    ref = 0
    for ex in examples:
        out, n = _hf_forward(peft_model, ex)
        ref = ref + out.loss * n
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * len(wrapped)
    assert_lora_grads_match(ours, peft_model)  # 1e-4 of each tensor's largest entry


def test_packed_equals_separate_with_images_of_different_sizes(llava):
    folder, _, examples = llava
    model = slipstream.load_model(folder).eval()
    with torch.no_grad():
        b = collate(examples)
        packed = model(b.input_ids, b.seq, images=image_inputs(b.fields))
        alone = [model(collate([ex]).input_ids, collate([ex]).seq,
                       images=image_inputs(collate([ex]).fields)) for ex in examples]  # fmt: skip
        torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-4, atol=1e-5)
        hf = _hf(folder)
        ex = examples[1]  # two images
        expected = hf(
            input_ids=torch.tensor([ex.input_ids]), pixel_values=ex.model_inputs()["pixel_values"]
        )
        torch.testing.assert_close(alone[1], expected.logits[0], rtol=1e-4, atol=1e-5)
        # The images matter: without them the logits differ.
        text_only = model(torch.tensor(ex.input_ids), SeqInfo.from_lengths([len(ex)]))
        assert (text_only - alone[1]).abs().max() > 1e-3


def test_no_host_sync_in_a_training_step(llava):
    folder, _, examples = llava
    model = slipstream.load_model(folder)
    slipstream.apply_lora(model, rank=4, alpha=8)
    batch = collate(examples).to("cpu")
    images = image_inputs(batch.fields)
    with slipstream.count_syncs() as syncs:
        loss = model.loss(batch.input_ids, batch.labels, batch.seq, reduction="sum",
                          label_positions=batch.label_positions, images=images)  # fmt: skip
        loss.backward()
    assert syncs.total == 0, syncs


def test_a_frozen_tower_and_projector_record_no_autograd_state(llava):
    folder, _, examples = llava
    model = slipstream.load_model(folder)
    slipstream.apply_lora(model, rank=4, alpha=8)
    images = image_inputs(collate(examples).fields)
    feats = model.image_features(images)
    assert not feats.requires_grad and feats.grad_fn is None  # no graph kept for the tower
    vision = tuple(f"{p}." for p in model.vision.values())
    assert not [n for n, p in model.named_parameters() if n.startswith(vision) and p.requires_grad]
    loss = _ours(model, examples, reduction="sum")
    loss.backward()
    assert not [
        n for n, p in model.named_parameters() if n.startswith(vision) and p.grad is not None
    ]
    from slipstream.config_sections import VisionSection
    from slipstream.train.setup import vision_training

    lora_tower = slipstream.load_model(folder)
    vision_training(lora_tower, VisionSection(tower="lora"), "lora", before_lora=True)
    slipstream.apply_lora(lora_tower, rank=4, alpha=8)
    assert lora_tower.image_features(images).requires_grad  # trained: the graph is kept


def test_adapter_loads_in_peft_with_equal_logits_on_images(llava, tmp_path):
    folder, _, examples = llava
    ours = slipstream.load_model(folder)
    slipstream.apply_lora(ours, rank=4, alpha=8, targets="all-linear")
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert isinstance(cfg["target_modules"], str)  # a regex: the tower's q/k/v/fc1 excluded
    hf = _hf(folder)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    ex = examples[1]
    with torch.no_grad():
        got = ours.eval()(torch.tensor(ex.input_ids), SeqInfo.from_lengths([len(ex)]),
                          images=image_inputs(collate([ex]).fields))  # fmt: skip
        expected = peft_model(input_ids=torch.tensor([ex.input_ids]),
                              pixel_values=ex.model_inputs()["pixel_values"]).logits[0]  # fmt: skip
        base = hf(input_ids=torch.tensor([ex.input_ids]),
                  pixel_values=ex.model_inputs()["pixel_values"]).logits[0]  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert (base - expected).abs().max() > 1e-3  # the adapter changed the output


def test_vision_lora_adapter_wraps_the_tower_and_loads_in_peft(llava, tmp_path):
    from slipstream.config_sections import VisionSection
    from slipstream.train.setup import vision_training

    folder, _, examples = llava
    ours = slipstream.load_model(folder)
    vision_training(ours, VisionSection(tower="lora"), "lora", before_lora=True)
    slipstream.apply_lora(ours, rank=4, alpha=8)
    wrapped = list(slipstream.peft.lora.lora_modules(ours))
    assert [n for n in wrapped if "vision_tower" in n] and not [
        n for n in wrapped if "projector" in n
    ]
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path)
    peft_model = PeftModel.from_pretrained(_hf(folder), tmp_path).eval()
    theirs = [n for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)]
    assert len(theirs) == len(wrapped) and [n for n in theirs if "vision_tower" in n]
    ex = examples[1]
    with torch.no_grad():
        got = ours.eval()(torch.tensor(ex.input_ids), SeqInfo.from_lengths([len(ex)]),
                          images=image_inputs(collate([ex]).fields))  # fmt: skip
        expected = peft_model(input_ids=torch.tensor([ex.input_ids]),
                              pixel_values=ex.model_inputs()["pixel_values"]).logits[0]  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    again = slipstream.load_adapter(slipstream.load_model(folder), tmp_path).eval()
    assert [n for n in slipstream.peft.lora.lora_modules(again) if "vision_tower" in n]
    with torch.no_grad():
        back = again(torch.tensor(ex.input_ids), SeqInfo.from_lengths([len(ex)]),
                     images=image_inputs(collate([ex]).fields))  # fmt: skip
    torch.testing.assert_close(back, got, rtol=1e-5, atol=1e-6)


def test_vision_settings_under_full_fine_tuning_and_their_errors(llava):
    from slipstream.config_sections import VisionSection
    from slipstream.train.setup import vision_training

    folder, _, _ = llava
    model = slipstream.load_model(folder)
    model.requires_grad_(True)
    vision_training(model, VisionSection(projector="full"), "full", before_lora=False)
    trains = {n.split(".")[1] for n, p in model.named_parameters() if p.requires_grad}
    assert trains == {"multi_modal_projector", "language_model", "weight"}  # lm_head.weight
    with pytest.raises(ValueError, match="vision.tower=full with train.finetune=lora"):
        vision_training(model, VisionSection(tower="full"), "lora", before_lora=True)
    text = torch.nn.Linear(2, 2)  # a model without a vision side
    with pytest.raises(ValueError, match="vision.projector=lora: this model has no vision side"):
        vision_training(text, VisionSection(projector="lora"), "lora", before_lora=True)
    from slipstream.config import load_config

    keys = ["model.path=m", "data.train=d.jsonl", "output_dir=o"]
    assert load_config(None, [*keys, "vision.tower=lora"]).vision.tower == "lora"
    with pytest.raises(ValueError, match="vision.tower"):
        load_config(None, [*keys, "vision.tower=half"])


def test_greedy_generation_with_images_equals_transformers_generate(llava):
    folder, tok, _ = llava
    model = slipstream.load_model(folder)
    prompts = [
        [{"role": "user", "content": [{"type": "image", "image": random_image(40, 60)},
                                      {"type": "text", "text": "What is it?"}]}],
        [{"role": "user", "content": "Hello there"}],  # a text prompt in the same batch
        [{"role": "user", "content": [{"type": "text", "text": "Compare"},
                                      {"type": "image", "image": random_image(30, 20, 1)},
                                      {"type": "image", "image": random_image(9, 70, 2)}]}],
    ]  # fmt: skip
    got = slipstream.generate(model, prompts, tokenizer=tok, max_new_tokens=6, stop=[])
    processor = transformers.AutoProcessor.from_pretrained(folder)
    hf = _hf(folder)
    for c, messages in zip(got, prompts):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        content = messages[0]["content"]
        images = [p["image"] for p in content if isinstance(p, dict) and p["type"] == "image"]
        inputs = processor(text=[text], images=images or None, add_special_tokens=False,
                           return_tensors="pt")  # fmt: skip
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False)
        expected = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert c.token_ids == expected[: len(c.token_ids)] and c.token_ids


def test_image_prompts_on_a_text_model_are_one_line(tmp_path):
    from helpers.runs import make_tiny_run

    model_dir, _ = make_tiny_run(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = slipstream.load_model(model_dir)
    prompt = [{"role": "user", "content": [{"type": "image", "image": random_image(9, 9)}]}]
    with pytest.raises(ValueError, match="prompt 0 has images but the model takes none"):
        slipstream.generate(model, [prompt], tokenizer=tok, max_new_tokens=2)


def test_merged_export_is_a_complete_image_text_checkpoint(llava, tmp_path):
    folder, tok, examples = llava
    ours = slipstream.load_model(folder)
    slipstream.apply_lora(ours, rank=4, alpha=8)
    randomise_lora_b(ours)
    ex = examples[0]
    images = image_inputs(collate([ex]).fields)
    with torch.no_grad():
        expected = ours.eval()(torch.tensor(ex.input_ids), SeqInfo.from_lengths([len(ex)]),
                               images=images)  # fmt: skip
    slipstream.export_merged(ours, tmp_path / "merged", tokenizer=tok)
    processor = transformers.AutoProcessor.from_pretrained(tmp_path / "merged")
    assert processor.image_token == "<image>"
    back = _hf(tmp_path / "merged")
    with torch.no_grad():
        got = back(
            input_ids=torch.tensor([ex.input_ids]), pixel_values=ex.model_inputs()["pixel_values"]
        )
    torch.testing.assert_close(got.logits[0], expected, rtol=1e-4, atol=1e-5)


def test_tower_lora_leaves_multihead_attention_alone_and_loads_in_peft(tmp_path):
    """A SigLIP tower with its attention-pooling head (nn.MultiheadAttention, as the tiny
    Gemma 3's config has it): the head's out_proj is read by MultiheadAttention's forward as
    weight and bias tensors, past any wrapper, so `vision.tower: lora` with all-linear leaves
    it alone (it broke the step: 'LoRALinear' object has no attribute 'bias'); the tower's
    other linears get LoRA, and the adapter loads in peft with our logits."""
    from slipstream.config_sections import VisionSection
    from slipstream.train.setup import vision_training

    folder = vlm_folder(tmp_path / "gemma3", "gemma3")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    side = ImageProcessing.from_model(str(folder), tok)
    [ex], _ = tokenize_rows([_row([(40, 60)], "What is it?", "A square.")], tok,
                            max_tokens=512, images=side)  # fmt: skip
    ours = slipstream.load_model(folder, implementation="transformers")
    heads = [n for n, m in ours.named_modules() if isinstance(m, torch.nn.MultiheadAttention)]
    assert heads  # the case under test is there
    vision_training(ours, VisionSection(tower="lora"), "lora", before_lora=True)
    slipstream.apply_lora(ours, rank=4, alpha=8, targets="all-linear")
    wrapped = list(slipstream.peft.lora.lora_modules(ours))
    assert [n for n in wrapped if "vision_tower" in n]
    assert not [n for n in wrapped if n.startswith(tuple(f"{h}." for h in heads))]
    loss = _ours(ours, [ex], reduction="sum")
    loss.backward()  # the step that raised
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(_hf(folder), tmp_path / "adapter").eval()
    ids, batch = torch.tensor([ex.input_ids]), collate([ex])  # its seq: the image spans
    with torch.no_grad():
        got = ours.eval()(batch.input_ids, batch.seq, images=image_inputs(batch.fields))
        types = (ids == side.image_token_id).long()  # transformers' bidirectional image rows
        pixels = ex.model_inputs()["pixel_values"]
        expected = peft_model(input_ids=ids, pixel_values=pixels, token_type_ids=types).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
