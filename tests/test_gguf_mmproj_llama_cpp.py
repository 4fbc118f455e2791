"""Our text GGUF + mmproj of an image-text checkpoint in llama.cpp itself (llama-cpp-python
built with its multimodal library, libmtmd): the image embeddings llama.cpp computes equal
transformers' `get_image_features` on the same image, and greedy generation with the image
equals transformers' `generate`. Skipped where llama-cpp-python or its libmtmd is missing
(the default wheel build of the README leaves mtmd out: `-DLLAVA_BUILD=OFF`).

The image is given at the model's own size, so both sides' resizing is the identity and the
pixels they normalise are the same bytes.
"""

from __future__ import annotations

import ctypes
from unittest import mock

import numpy as np
import pytest
import torch
from helpers.tiny_vlm import random_image, randomise_constant_tensors, vlm_folder

from slipstream.checkpoint.gguf_mmproj import mmproj_path
from slipstream.cli import main

llama_cpp = pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")
try:
    from llama_cpp import mtmd_cpp as mtmd
except (ImportError, OSError, RuntimeError, FileNotFoundError) as e:  # no libmtmd.so
    pytest.skip(f"llama-cpp-python without libmtmd: {e}", allow_module_level=True)

GEMMA3_TEXT = dict(query_pre_attn_scalar=8, layer_types=["sliding_attention"] * 2,
                   sliding_window=16)  # fmt: skip
PROMPT = "Look: <__media__> What is it?"
NEW_TOKENS = 6


def _no_repack_params():
    """Weight repacking off (llama-cli's --no-repack; tests/test_gguf_llama_cpp.py says why)."""
    params = _default_model_params()
    params.use_extra_bufts = False
    return params


_default_model_params = llama_cpp.llama_model_default_params


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny Gemma 3 checkpoint, its f32 text GGUF and mmproj, llama.cpp's model, context and
    mtmd context on them."""
    folder = vlm_folder(tmp_path_factory.mktemp("gemma3"), "gemma3", text=GEMMA3_TEXT)
    randomise_constant_tensors(folder)  # Gemma 3's projector starts at zero
    text = tmp_path_factory.mktemp("gguf") / "g.f32.gguf"
    assert main(["export", str(folder), "--gguf", "f32", "--out", str(text)]) == 0
    with mock.patch("llama_cpp.llama.llama_cpp.llama_model_default_params", _no_repack_params):
        llm = llama_cpp.Llama(model_path=str(text), n_ctx=128, n_batch=64, n_ubatch=64,
                              logits_all=True, verbose=False, n_threads=2)  # fmt: skip
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.print_timings = False
    params.n_threads = 2
    params.warmup = False
    ctx = mtmd.mtmd_init_from_file(str(mmproj_path(text, "f32")).encode(), llm.model, params)
    assert ctx, "llama.cpp refused the mmproj (mtmd_init_from_file returned NULL)"
    yield folder, llm, ctx
    mtmd.mtmd_free(ctx)
    llm.close()


def tokenize(ctx, image) -> list:
    """mtmd's chunks of PROMPT with `image` at the marker: [(kind, token ids | chunk)]."""
    rgb = np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))
    data = (ctypes.c_uint8 * rgb.size).from_buffer_copy(rgb.tobytes())
    bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, data)
    chunks = mtmd.mtmd_input_chunks_init()
    text = mtmd.mtmd_input_text()
    text.text, text.text_len = PROMPT.encode(), len(PROMPT.encode())
    text.add_special, text.parse_special = True, True
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
    out = []
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            out.append(("text", [ids[j] for j in range(n.value)]))
        else:
            out.append(("image", chunk))
    return out, chunks, bitmap


def hf_model(folder):
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(folder))
    return model.float().eval()


def hf_pixels(folder, image) -> torch.Tensor:
    processor = transformers.AutoImageProcessor.from_pretrained(str(folder))
    return processor(images=[image], return_tensors="pt")["pixel_values"].float()


def test_image_embeddings_equal_transformers(exported):
    folder, llm, ctx = exported
    image = random_image(28, 28, seed=3)  # the model's size: no resizing on either side
    parts, chunks, bitmap = tokenize(ctx, image)
    (chunk,) = [c for kind, c in parts if kind == "image"]
    n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
    assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0
    width = llm.n_embd()
    ours = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * width,))
    ours = torch.from_numpy(ours.copy()).reshape(n, width)
    with torch.no_grad():
        feats = hf_model(folder).get_image_features(pixel_values=hf_pixels(folder, image))
    feats = getattr(feats, "pooler_output", feats)
    theirs = (feats if torch.is_tensor(feats) else torch.cat(list(feats))).reshape(-1, width)
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    assert theirs.shape == ours.shape == (4, 32)  # mm_tokens_per_image rows of the text width
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err < 1e-3, f"llama.cpp's image embeddings differ from transformers': rel {err:.2e}"
    other = random_image(28, 28, seed=4)  # the comparison can fail: another image differs
    with torch.no_grad():
        feats2 = hf_model(folder).get_image_features(pixel_values=hf_pixels(folder, other))
    feats2 = getattr(feats2, "pooler_output", feats2)
    other_rows = (feats2 if torch.is_tensor(feats2) else torch.cat(list(feats2))).reshape(-1, width)
    assert (ours - other_rows).abs().max() / theirs.abs().max() > 100 * err


def llama_cpp_generate(llm, ctx, image, n: int) -> tuple[list, torch.Tensor, list[int]]:
    """llama.cpp on PROMPT with `image`: mtmd's chunks as token ids (the image's rows as -n),
    the logits after the prompt and `n` greedy tokens."""
    parts, chunks, bitmap = tokenize(ctx, image)
    prompt = [p if kind == "text" else -mtmd.mtmd_input_chunk_get_n_tokens(p) for kind, p in parts]
    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
    n_past = llama_cpp.llama_pos(0)
    rc = mtmd.mtmd_helper_eval_chunks(ctx, llm.ctx, chunks, 0, 0, 64, True, ctypes.byref(n_past))
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    assert rc == 0
    vocab, first, tokens = llm.n_vocab(), None, []
    for _ in range(n):
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        logits = torch.from_numpy(np.ctypeslib.as_array(logits, shape=(vocab,)).copy())
        first = logits if first is None else first
        tokens.append(int(logits.argmax()))
        batch = llama_cpp.llama_batch_get_one((llama_cpp.llama_token * 1)(tokens[-1]), 1)
        assert llama_cpp.llama_decode(llm.ctx, batch) == 0
    return prompt, first, tokens


def hf_inputs(model, folder, prompt: list, image) -> dict:
    """The same prompt for transformers: mtmd's token ids, the image's rows as image tokens
    (token_type_ids 1: seen bidirectionally, as llama.cpp decodes an image's rows)."""
    ids, types = [], []
    for part in prompt:
        n = len(part) if isinstance(part, list) else -part
        ids += part if isinstance(part, list) else [model.config.image_token_id] * n
        types += [int(not isinstance(part, list))] * n
    assert types.count(1) == 4  # mm_tokens_per_image
    return dict(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                pixel_values=hf_pixels(folder, image))  # fmt: skip


def test_logits_and_greedy_generation_with_the_image_equal_transformers(exported):
    folder, llm, ctx = exported
    model = hf_model(folder)
    firsts = []
    for seed in (5, 6):
        image = random_image(28, 28, seed=seed)
        prompt, first, got = llama_cpp_generate(llm, ctx, image, NEW_TOKENS)
        inputs = hf_inputs(model, folder, prompt, image)
        with torch.no_grad():
            theirs = model(**inputs).logits[0, -1]
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        err = (first - theirs).abs().max() / theirs.abs().max()
        assert err < 5e-3, f"llama.cpp's logits after the image differ: rel {err:.2e}"
        assert got == out[0, inputs["input_ids"].shape[1] :].tolist()
        firsts.append(first)
    # the image matters: another image gives other logits after the same text
    assert (firsts[0] - firsts[1]).abs().max() / firsts[0].abs().max() > 1e-2
