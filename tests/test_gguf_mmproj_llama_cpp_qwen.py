"""Our Qwen-VL text GGUF + mmproj in llama.cpp itself (llama-cpp-python with libmtmd; the
module is skipped without them): mtmd's image embeddings equal transformers'
`get_image_features`, and the logits after a prompt with the image and greedy tokens equal
transformers' (text decoded at M-RoPE positions after mtmd's n_past: helpers/llama_cpp_mtmd.py).

Qwen2.5-VL is the tiny checkpoint rebuilt as llama.cpp's qwen2.5vl graph runs it
(`qwen2_5_vl_as_llama_cpp`: a windowed block, then a full one) on a 224 x 112 image: 16 x 8
patches, two 112-px attention windows, 32 merged rows. Its side lengths are multiples of 28,
so neither side resizes and both see the same pixels.

Qwen3-VL is the tiny checkpoint with mRoPE sections llama.cpp turns as transformers does
(`qwen3_vl_as_llama_cpp`: [2, 1, 1]; the default [1, 1, 2] is refused, gguf_qwen_vl.py) on a
128 x 96 image: 8 x 6 patches (the 4 x 4 position table resampled), 12 merged rows. Each of
mtmd's rows is the merger's output then the two deepstack features (3 x 32), which it hands the
text model as one input and llama.cpp adds after decoder layers 0 and 1; transformers' are
compared as the same concatenation.

Qwen3.5 and Qwen3.5-MoE are the tiny checkpoints as built (their interleaved sections [2, 1, 1]
already turn as llama.cpp's do) on the same 128 x 96 image: the Qwen3-VL tower without
deepstack, its 12 merged rows of 32, before the qwen35 / qwen35moe text model.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from helpers.llama_cpp_mtmd import (
    assert_generation_equals_transformers,
    assert_images_matter,
    close,
    generate,
    image_embeddings,
    load,
)
from helpers.tiny_vlm import (
    qwen2_5_vl_as_llama_cpp,
    qwen3_vl_as_llama_cpp,
    random_image,
    randomise_constant_tensors,
    vlm_folder,
)

from slipstream.checkpoint.gguf_export import mmproj_path
from slipstream.cli import main

transformers = pytest.importorskip("transformers")

PROMPT = "Look: <__media__> What is it?"
NEW_TOKENS = 6
# model_type -> (the checkpoint as llama.cpp runs it, image (height, width), merged rows, a
# row's width: the text hidden size 32, times 3 with Qwen3-VL's two deepstack features)
KINDS = {
    "qwen2_5_vl": (qwen2_5_vl_as_llama_cpp, (112, 224), 32, 32),
    "qwen3_vl": (qwen3_vl_as_llama_cpp, (96, 128), 12, 96),
    # vlm_folder's own (interleaved [2, 1, 1] sections already): 16-px patches, 4 x 3 merged
    "qwen3_5": (lambda folder: folder, (96, 128), 12, 32),
    "qwen3_5_moe": (lambda folder: folder, (96, 128), 12, 32),
}


@pytest.fixture(scope="module", params=list(KINDS))
def exported(request, tmp_path_factory):
    """A tiny checkpoint of the type, its f32 text GGUF and mmproj loaded in llama.cpp, and
    transformers' model of it: (kind, folder, llm, ctx, model)."""
    kind = request.param
    folder = KINDS[kind][0](vlm_folder(tmp_path_factory.mktemp(kind), kind))
    randomise_constant_tensors(folder)  # norms at one, biases at zero as initialised
    text = tmp_path_factory.mktemp("gguf") / f"{kind}.f32.gguf"
    assert main(["export", str(folder), "--gguf", "f32", "--out", str(text)]) == 0
    llm, ctx = load(text, mmproj_path(text, "f32"))
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(folder)).float()
    yield kind, folder, llm, ctx, model.eval()
    close(llm, ctx)


def hf_pixels(folder, image) -> dict:
    processor = transformers.AutoImageProcessor.from_pretrained(str(folder))
    return dict(processor(images=[image], return_tensors="pt"))  # pixel_values, image_grid_thw


def hf_features(model, pixels: dict) -> torch.Tensor:
    """transformers' image features, each row's deepstack features after it: (merged rows,
    text width x (1 + deepstack))."""
    with torch.no_grad():
        out = model.model.get_image_features(**pixels)
    parts = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
    return torch.cat([torch.cat(list(p)) for p in parts], dim=-1)


def hf_inputs(model, folder, prompt: list, image) -> dict:
    """The prompt llama.cpp ran for transformers: its token ids, the image's rows as image
    tokens (marked in mm_token_type_ids, from which transformers builds M-RoPE positions)."""
    ids = []
    for part in prompt:
        ids += part if isinstance(part, list) else [model.config.image_token_id] * -part
    ids = torch.tensor([ids])
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                mm_token_type_ids=(ids == model.config.image_token_id).int(),
                **hf_pixels(folder, image))  # fmt: skip


def test_image_embeddings_equal_transformers(exported):
    kind, folder, llm, ctx, model = exported
    _, size, rows, width = KINDS[kind]
    image = random_image(*size, seed=3)
    ours = image_embeddings(ctx, image, PROMPT, width)
    theirs = hf_features(model, hf_pixels(folder, image))
    assert ours.shape == theirs.shape == (rows, width)
    err = (ours - theirs).abs().max() / theirs.abs().max()
    print(f"{kind}: image embeddings rel {err:.2e}")
    assert err < 1e-3, f"llama.cpp's image embeddings differ from transformers': rel {err:.2e}"
    other = hf_features(model, hf_pixels(folder, random_image(*size, seed=4)))
    assert (ours - other).abs().max() / theirs.abs().max() > 100 * err  # the check can fail


def test_logits_and_greedy_generation_with_the_image_equal_transformers(exported):
    kind, folder, llm, ctx, model = exported
    firsts = []
    for seed in (5, 6):
        image = random_image(*KINDS[kind][1], seed=seed)
        prompt, first, got = generate(llm, ctx, image, PROMPT, NEW_TOKENS)
        assert -KINDS[kind][2] in prompt  # the image's rows went in as one chunk
        inputs = hf_inputs(model, folder, prompt, image)
        assert_generation_equals_transformers(model, inputs, first, got, NEW_TOKENS, kind)
        firsts.append(first)
    assert_images_matter(firsts)


def test_qwen3_vl_deepstack_reaches_the_text_model(exported):
    """llama.cpp's logits are transformers' with deepstack, not without it (the features are
    added after decoder layers 0 and 1, not only carried in the mmproj's rows)."""
    kind, folder, llm, ctx, model = exported
    if kind != "qwen3_vl":
        pytest.skip("deepstack: Qwen3-VL only")
    image = random_image(*KINDS[kind][1], seed=5)
    prompt, first, _ = generate(llm, ctx, image, PROMPT, 1)
    inputs = hf_inputs(model, folder, prompt, image)
    text_model = type(model.model.language_model)
    with torch.no_grad():
        theirs = model(**inputs).logits[0, -1]
        with mock.patch.object(text_model, "_deepstack_process", lambda self, h, *a: h):
            without = model(**inputs).logits[0, -1]
    err = (first - theirs).abs().max() / theirs.abs().max()
    assert (first - without).abs().max() / theirs.abs().max() > 10 * err
