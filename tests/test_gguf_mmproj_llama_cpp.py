"""Our text GGUF + mmproj of image-text checkpoints in llama.cpp itself (llama-cpp-python
built with its multimodal library, libmtmd): the image embeddings llama.cpp computes equal
transformers' `get_image_features` on the same image, and so do the logits after a prompt
with the image and greedy generation. Skipped where llama-cpp-python or its libmtmd is
missing (a wheel built with `-DLLAVA_BUILD=OFF`, as README's CPU-only build line, has none).

Preprocessing is controlled so both sides see the same pixels: Gemma 3 gets an image at the
model's size (28x28: resizing is a copy on both sides); Idefics3 and SmolVLM one at the
processor's longest edge (56x56), cut into four 28x28 tiles (copies) plus an overview resized
to 28x28 (llama.cpp's Pillow-style Lanczos against Pillow's: the embeddings agree as closely
as the tiles'). Normalisation is the image processor's mean and std, from the mmproj file.
"""

from __future__ import annotations

import pytest
import torch
from helpers.llama_cpp_mtmd import close, generate, image_embeddings, load
from helpers.tiny_vlm import random_image, randomise_constant_tensors, vlm_folder

from slipstream.checkpoint.gguf_export import mmproj_path
from slipstream.cli import main

transformers = pytest.importorskip("transformers")

# Gemma 3's text model as llama.cpp runs it (1/sqrt(head_dim), its fixed layer pattern: both
# layers sliding), with a window that lets the image reach the prompt's last token.
GEMMA3_TEXT = dict(query_pre_attn_scalar=8, layer_types=["sliding_attention"] * 2,
                   sliding_window=16)  # fmt: skip
KINDS = {"gemma3": 28, "idefics3": 56, "smolvlm": 56}  # the image side given (module docstring)
PROMPT = "Look: <__media__> What is it?"
NEW_TOKENS = 6
WIDTH = 32  # the tiny models' text hidden size


@pytest.fixture(scope="module", params=list(KINDS))
def exported(request, tmp_path_factory):
    """A tiny checkpoint of the type, its f32 text GGUF and mmproj, llama.cpp's model and
    context and the mtmd context on them."""
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    vlm_folder(folder, kind, text=GEMMA3_TEXT if kind == "gemma3" else None)
    randomise_constant_tensors(folder)  # Gemma 3's projector starts at zero, norms at one
    text = tmp_path_factory.mktemp("gguf") / f"{kind}.f32.gguf"
    assert main(["export", str(folder), "--gguf", "f32", "--out", str(text)]) == 0
    llm, ctx = load(text, mmproj_path(text, "f32"))
    yield kind, folder, llm, ctx
    close(llm, ctx)


def hf_model(folder):
    return transformers.AutoModelForImageTextToText.from_pretrained(str(folder)).float().eval()


def hf_pixels(folder, image) -> dict:
    """The image processor's tensors for one image (Idefics3's tiles + overview as frames)."""
    processor = transformers.AutoImageProcessor.from_pretrained(str(folder))
    out = processor(images=[[image]], return_tensors="pt")
    return {k: v for k, v in out.items() if k in ("pixel_values", "pixel_attention_mask")}


def hf_features(model, pixels: dict) -> torch.Tensor:
    """transformers' image features, every frame's rows in order: (rows, text width)."""
    with torch.no_grad():
        feats = model.get_image_features(**pixels)
    feats = getattr(feats, "pooler_output", feats)
    return (feats if torch.is_tensor(feats) else torch.cat(list(feats))).reshape(-1, WIDTH)


def test_image_embeddings_equal_transformers(exported):
    kind, folder, llm, ctx = exported
    image = random_image(KINDS[kind], KINDS[kind], seed=3)
    ours = image_embeddings(ctx, image, PROMPT, WIDTH)
    model = hf_model(folder)
    theirs = hf_features(model, hf_pixels(folder, image))
    assert ours.shape == theirs.shape == ((4 if kind == "gemma3" else 20), WIDTH)
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err < 1e-3, f"llama.cpp's image embeddings differ from transformers': rel {err:.2e}"
    other = hf_features(model, hf_pixels(folder, random_image(*image.size, seed=4)))
    assert (ours - other).abs().max() / theirs.abs().max() > 100 * err  # the check can fail


def hf_inputs(kind, model, folder, prompt: list, image) -> dict:
    """The same prompt for transformers: the token ids llama.cpp ran, the image's rows as image
    tokens (Gemma 3: token_type_ids 1, seen bidirectionally as llama.cpp decodes them)."""
    ids, types = [], []
    for part in prompt:
        n = len(part) if isinstance(part, list) else -part
        ids += part if isinstance(part, list) else [model.config.image_token_id] * n
        types += [int(not isinstance(part, list))] * n
    extra = {"token_type_ids": torch.tensor([types])} if kind == "gemma3" else {}
    mask = torch.ones(1, len(ids), dtype=torch.long)
    return dict(input_ids=torch.tensor([ids]), attention_mask=mask, **extra,
                **hf_pixels(folder, image))  # fmt: skip


def test_logits_and_greedy_generation_with_the_image_equal_transformers(exported):
    kind, folder, llm, ctx = exported
    model = hf_model(folder)
    firsts = []
    for seed in (5, 6):
        image = random_image(KINDS[kind], KINDS[kind], seed=seed)
        prompt, first, got = generate(llm, ctx, image, PROMPT, NEW_TOKENS)
        inputs = hf_inputs(kind, model, folder, prompt, image)
        with torch.no_grad():
            theirs = model(**inputs).logits[0, -1]
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        err = (first - theirs).abs().max() / theirs.abs().max()
        assert err < 5e-3, f"llama.cpp's logits after the image differ: rel {err:.2e}"
        assert got == out[0, inputs["input_ids"].shape[1] :].tolist()
        firsts.append(first)
    # the image matters: another image gives other logits after the same text
    assert (firsts[0] - firsts[1]).abs().max() / firsts[0].abs().max() > 1e-2
