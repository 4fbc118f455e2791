"""Our text GGUF + mmproj of image-text checkpoints in llama.cpp itself (llama-cpp-python
built with its multimodal library, libmtmd): the image embeddings llama.cpp computes equal
transformers' `get_image_features` on the same image, and so do the logits after a prompt
with the image and greedy generation. Skipped where llama-cpp-python or its libmtmd is
missing (a wheel built with `-DLLAVA_BUILD=OFF`, as README's CPU-only build line, has none).

Preprocessing is controlled so both sides see the same pixels: Gemma 3 gets an image at the
model's size (28x28: resizing is a copy on both sides); Idefics3 and SmolVLM one at the
processor's longest edge (56x56), cut into four 28x28 tiles (copies) plus an overview resized
to 28x28 (llama.cpp's Pillow-style Lanczos against Pillow's: the embeddings agree as closely
as the tiles'); Mistral 3 one of 42 x 56, which neither side resizes (its section below).
Normalisation is the image processor's mean and std, from the mmproj file.
"""

from __future__ import annotations

import ctypes
from unittest import mock

import numpy as np
import pytest
import torch
from helpers.tiny_vlm import random_image, randomise_constant_tensors, vlm_folder

from slipstream.checkpoint.gguf_export import mmproj_path
from slipstream.cli import main

llama_cpp = pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")
try:
    from llama_cpp import mtmd_cpp as mtmd
except (ImportError, OSError, RuntimeError, FileNotFoundError) as e:  # no libmtmd.so
    pytest.skip(f"llama-cpp-python without libmtmd: {e}", allow_module_level=True)

# Gemma 3's text model as llama.cpp runs it (1/sqrt(head_dim), its fixed layer pattern: both
# layers sliding), with a window that lets the image reach the prompt's last token.
GEMMA3_TEXT = dict(query_pre_attn_scalar=8, layer_types=["sliding_attention"] * 2,
                   sliding_window=16)  # fmt: skip
KINDS = {"gemma3": 28, "idefics3": 56, "smolvlm": 56}  # the image side given (module docstring)
PROMPT = "Look: <__media__> What is it?"
NEW_TOKENS = 6
WIDTH = 32  # the tiny models' text hidden size


def _no_repack_params():
    """Weight repacking off (llama-cli's --no-repack; tests/test_gguf_llama_cpp.py says why)."""
    params = _default_model_params()
    params.use_extra_bufts = False
    return params


_default_model_params = llama_cpp.llama_model_default_params


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
    with mock.patch("llama_cpp.llama.llama_cpp.llama_model_default_params", _no_repack_params):
        llm = llama_cpp.Llama(model_path=str(text), n_ctx=256, n_batch=128, n_ubatch=128,
                              logits_all=True, verbose=False, n_threads=2)  # fmt: skip
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.print_timings = False
    params.n_threads = 2
    params.warmup = False
    ctx = mtmd.mtmd_init_from_file(str(mmproj_path(text, "f32")).encode(), llm.model, params)
    assert ctx, "llama.cpp refused the mmproj (mtmd_init_from_file returned NULL)"
    yield kind, folder, llm, ctx
    mtmd.mtmd_free(ctx)
    llm.close()


def tokenize(ctx, image):
    """mtmd's chunks of PROMPT with `image` at the marker: ([(kind, token ids | chunk)],
    chunks, bitmap); the caller frees the last two."""
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
    parts, chunks, bitmap = tokenize(ctx, image)
    rows = []
    for part, chunk in parts:
        if part == "image":  # Idefics3: one chunk per tile, the overview last (as transformers)
            n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0
            embd = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * WIDTH,))
            rows.append(torch.from_numpy(embd.copy()).reshape(n, WIDTH))
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    ours = torch.cat(rows)
    model = hf_model(folder)
    theirs = hf_features(model, hf_pixels(folder, image))
    assert ours.shape == theirs.shape == ((4 if kind == "gemma3" else 20), WIDTH)
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err < 1e-3, f"llama.cpp's image embeddings differ from transformers': rel {err:.2e}"
    other = hf_features(model, hf_pixels(folder, random_image(*image.size, seed=4)))
    assert (ours - other).abs().max() / theirs.abs().max() > 100 * err  # the check can fail


def llama_cpp_generate(llm, ctx, image, n: int) -> tuple[list, torch.Tensor, list[int]]:
    """llama.cpp on PROMPT with `image`, chunk by chunk: the prompt as [token ids | -rows of an
    image], the logits after it and `n` greedy tokens. A token mtmd could not find (-1: the
    tiny tokenizer has no "\\n\\n", which mtmd puts before Idefics3's overview) is left out."""
    parts, chunks, bitmap = tokenize(ctx, image)
    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
    prompt, n_past = [], 0
    for i, (part, value) in enumerate(parts):
        last = i == len(parts) - 1
        if part == "text":
            ids = [t for t in value if t >= 0]
            prompt.append(ids)
            arr = (llama_cpp.llama_token * len(ids))(*ids)  # alive while the batch points at it
            assert (
                llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(arr, len(ids))) == 0
            )
            n_past += len(ids)
        else:
            prompt.append(-mtmd.mtmd_input_chunk_get_n_tokens(value))
            new = llama_cpp.llama_pos(0)
            rc = mtmd.mtmd_helper_eval_chunk_single(
                ctx, llm.ctx, value, n_past, 0, 128, last, ctypes.byref(new)
            )
            assert rc == 0
            n_past = new.value
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    vocab, first, tokens = llm.n_vocab(), None, []
    for _ in range(n):
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        logits = torch.from_numpy(np.ctypeslib.as_array(logits, shape=(vocab,)).copy())
        first = logits if first is None else first
        tokens.append(int(logits.argmax()))
        arr = (llama_cpp.llama_token * 1)(tokens[-1])
        assert llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(arr, 1)) == 0
    return prompt, first, tokens


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
        prompt, first, got = llama_cpp_generate(llm, ctx, image, NEW_TOKENS)
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


# --- Mistral 3: llama.cpp's pixtral. A 42 x 56 image (6 x 8 patches of 7, merged 2 x 2 to 3 rows
# of 4) is a multiple of patch x merge with at least llama.cpp's 8 tokens and under the
# processor's longest edge (56): neither side resizes it. mtmd's image chunk is the rows with
# [IMG_BREAK] embeddings between them (14 rows); [IMG_END] follows as text.
MISTRAL3_IMAGE, MISTRAL3_GRID = (42, 56), (3, 4)


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    """The tiny Mistral 3 as llama.cpp runs it (helpers.tiny_vlm.mistral3_as_llama_cpp), its f32
    text GGUF and mmproj, llama.cpp's model and context and the mtmd context on them."""
    from helpers.tiny_vlm import mistral3_as_llama_cpp

    folder = mistral3_as_llama_cpp(vlm_folder(tmp_path_factory.mktemp("mistral3"), "mistral3"))
    randomise_constant_tensors(folder)  # norms at one
    text = tmp_path_factory.mktemp("gguf") / "mistral3.f32.gguf"
    assert main(["export", str(folder), "--gguf", "f32", "--out", str(text)]) == 0
    with mock.patch("llama_cpp.llama.llama_cpp.llama_model_default_params", _no_repack_params):
        llm = llama_cpp.Llama(model_path=str(text), n_ctx=256, n_batch=128, n_ubatch=128,
                              logits_all=True, verbose=False, n_threads=2)  # fmt: skip
    ctx = _mtmd(mmproj_path(text, "f32"), llm)
    yield folder, text, llm, ctx
    mtmd.mtmd_free(ctx)
    llm.close()


def _mtmd(mmproj, llm):
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.print_timings, params.n_threads, params.warmup = False, False, 2, False
    ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), llm.model, params)
    assert ctx, "llama.cpp refused the mmproj (mtmd_init_from_file returned NULL)"
    return ctx


def _encode(ctx, image) -> torch.Tensor:
    """mtmd's embeddings of the one image chunk: (rows, text width)."""
    parts, chunks, bitmap = tokenize(ctx, image)
    (chunk,) = [value for part, value in parts if part == "image"]
    n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
    assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0
    embd = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * WIDTH,)).copy()
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    return torch.from_numpy(embd).reshape(n, WIDTH)


def _mistral3_pixels(folder, image) -> dict:
    processor = transformers.AutoImageProcessor.from_pretrained(str(folder))
    out = processor(images=[image], return_tensors="pt")
    assert out["image_sizes"].tolist() == [list(MISTRAL3_IMAGE)]  # not resized
    return {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}


def _mistral3_features(model, folder, image) -> torch.Tensor:
    with torch.no_grad():
        return model.get_image_features(**_mistral3_pixels(folder, image)).pooler_output[0]


def _split_breaks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mtmd's image rows -> (the merged patches, row-major; the [IMG_BREAK] rows)."""
    ny, nx = MISTRAL3_GRID
    assert rows.shape[0] == ny * nx + ny - 1  # one [IMG_BREAK] after each row but the last
    per_row = rows[: ny * (nx + 1) - 1].tolist() + [[float("nan")] * WIDTH]
    grid = torch.tensor(per_row).reshape(ny, nx + 1, WIDTH)
    return grid[:, :nx].reshape(-1, WIDTH), grid[:-1, nx]


def test_mistral3_image_embeddings_equal_transformers(mistral3, tmp_path):
    folder, text, llm, ctx = mistral3
    image = random_image(*MISTRAL3_IMAGE, seed=3)
    feats, breaks = _split_breaks(_encode(ctx, image))
    model = hf_model(folder)
    theirs = _mistral3_features(model, folder, image)
    assert feats.shape == theirs.shape == (12, WIDTH)
    # 2e-3, not 1e-3: measured 5.9e-4..7.6e-4 here, from ggml's GELU (tanh form, an f16 table)
    # and flash attention's f16 (6.4e-4 without it); the weights are large enough for RoPE.
    err = (feats - theirs).abs().max() / theirs.abs().max()
    assert err < 2e-3, f"llama.cpp's image embeddings differ from transformers': rel {err:.2e}"
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    brk = tok.convert_tokens_to_ids("[IMG_BREAK]")
    assert torch.equal(breaks, model.get_input_embeddings().weight[brk].detach().expand(2, -1))
    other = _mistral3_features(model, folder, random_image(*MISTRAL3_IMAGE, seed=4))
    assert (feats - other).abs().max() / theirs.abs().max() > 100 * err  # the check can fail
    # The tower's Q/K rows left in transformers' order: llama.cpp computes another tower.
    unpermuted = tmp_path / "mmproj-unpermuted.gguf"
    with mock.patch("slipstream.checkpoint.gguf_mmproj_pixtral.permute_rotary", lambda t, h: t):
        from slipstream.checkpoint.gguf_mmproj import export_mmproj

        export_mmproj(folder, unpermuted, "f32")
    wrong_ctx = _mtmd(unpermuted, llm)
    wrong, _ = _split_breaks(_encode(wrong_ctx, image))
    mtmd.mtmd_free(wrong_ctx)
    assert (wrong - theirs).abs().max() / theirs.abs().max() > 2e-2  # measured: 7.8e-2


def _mistral3_ids(model, folder, prompt: list) -> list[int]:
    """transformers' ids for llama.cpp's prompt: an image's rows of [IMG], each ended by
    [IMG_BREAK] where mtmd put its embedding; [IMG_END] is the next text chunk's first id."""
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    brk, end = tok.convert_tokens_to_ids(["[IMG_BREAK]", "[IMG_END]"])
    ny, nx = MISTRAL3_GRID
    rows = ([model.config.image_token_id] * nx + [brk]) * ny
    ids = []
    for i, part in enumerate(prompt):
        if isinstance(part, list):
            ids += part
        else:
            assert -part == len(rows) - 1 and prompt[i + 1][0] == end
            ids += rows[:-1]
    return ids


def test_mistral3_logits_and_greedy_generation_with_the_image_equal_transformers(mistral3):
    folder, text, llm, ctx = mistral3
    model = hf_model(folder)
    firsts = []
    for seed in (6, 7):
        image = random_image(*MISTRAL3_IMAGE, seed=seed)
        prompt, first, got = llama_cpp_generate(llm, ctx, image, NEW_TOKENS)
        ids = torch.tensor([_mistral3_ids(model, folder, prompt)])
        inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                      **_mistral3_pixels(folder, image))  # fmt: skip
        with torch.no_grad():
            theirs = model(**inputs).logits[0, -1]
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        err = (first - theirs).abs().max() / theirs.abs().max()
        assert err < 5e-3, f"llama.cpp's logits after the image differ: rel {err:.2e}"
        assert got == out[0, ids.shape[1] :].tolist()
        firsts.append(first)
    # the image matters: another image gives other logits after the same text
    assert (firsts[0] - firsts[1]).abs().max() / firsts[0].abs().max() > 1e-2
