"""Our text GGUF + mmproj of image-text checkpoints in llama.cpp itself (llama-cpp-python
built with its multimodal library, libmtmd): the image embeddings llama.cpp computes equal
transformers' `get_image_features` on the same image, and so do the logits after a prompt
with the image and greedy generation. Skipped where llama-cpp-python or its libmtmd is
missing (a wheel built with `-DLLAVA_BUILD=OFF`, as README's CPU-only build line, has none).

Preprocessing is controlled so both sides see the same pixels: Gemma 3 gets an image at the
model's size (28x28: resizing is a copy on both sides); Idefics3 and SmolVLM one at the
processor's longest edge (56x56), cut into four 28x28 tiles (copies) plus an overview resized
to 28x28 (llama.cpp's Pillow-style Lanczos against Pillow's: the embeddings agree as closely
as the tiles'); Gemma 4 one of 84x120 (7 x 10 pooled 12-px cells = 70 tokens: the processor's
max_soft_tokens and llama.cpp's minimum, so neither resizes). Normalisation is the image
processor's mean and std, from the mmproj file.
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
# (height, width) of the image given (module docstring) and the rows it becomes
KINDS = {"gemma3": (28, 28), "idefics3": (56, 56), "smolvlm": (56, 56), "gemma4": (84, 120)}
ROWS = {"gemma3": 4, "idefics3": 20, "smolvlm": 20, "gemma4": 70}
# Gemma 4: a window holding the image and the prompt (transformers lets image rows see their
# whole image on sliding layers, llama.cpp only within the window).
TEXT = {"gemma3": GEMMA3_TEXT, "gemma4": dict(sliding_window=128)}
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
    vlm_folder(folder, kind, text=TEXT.get(kind))
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
    keep = ("pixel_values", "pixel_attention_mask", "image_position_ids")  # the last: Gemma 4
    return {k: v for k, v in out.items() if k in keep}


def hf_features(model, pixels: dict) -> torch.Tensor:
    """transformers' image features, every frame's rows in order: (rows, text width)."""
    with torch.no_grad():
        feats = model.get_image_features(**pixels)
    feats = getattr(feats, "pooler_output", feats)
    return (feats if torch.is_tensor(feats) else torch.cat(list(feats))).reshape(-1, WIDTH)


def test_image_embeddings_equal_transformers(exported):
    kind, folder, llm, ctx = exported
    image = random_image(*KINDS[kind], seed=3)
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
    assert ours.shape == theirs.shape == (ROWS[kind], WIDTH)
    err = (ours - theirs).abs().max() / theirs.abs().max()
    print(f"{kind}: image embeddings rel {err:.2e}")
    assert err < 1e-3, f"llama.cpp's image embeddings differ from transformers': rel {err:.2e}"
    other = hf_features(model, hf_pixels(folder, random_image(*KINDS[kind], seed=4)))
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
    tokens (Gemma 3: token_type_ids 1, Gemma 4: mm_token_type_ids 1, seen bidirectionally as
    llama.cpp decodes them)."""
    ids, types = [], []
    for part in prompt:
        n = len(part) if isinstance(part, list) else -part
        ids += part if isinstance(part, list) else [model.config.image_token_id] * n
        types += [int(not isinstance(part, list))] * n
    key = {"gemma3": "token_type_ids", "gemma4": "mm_token_type_ids"}.get(kind)
    extra = {key: torch.tensor([types])} if key else {}
    mask = torch.ones(1, len(ids), dtype=torch.long)
    return dict(input_ids=torch.tensor([ids]), attention_mask=mask, **extra,
                **hf_pixels(folder, image))  # fmt: skip


def test_logits_and_greedy_generation_with_the_image_equal_transformers(exported):
    kind, folder, llm, ctx = exported
    model = hf_model(folder)
    firsts = []
    for seed in (5, 6):
        image = random_image(*KINDS[kind], seed=seed)
        prompt, first, got = llama_cpp_generate(llm, ctx, image, NEW_TOKENS)
        inputs = hf_inputs(kind, model, folder, prompt, image)
        with torch.no_grad():
            theirs = model(**inputs).logits[0, -1]
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        err = (first - theirs).abs().max() / theirs.abs().max()
        print(f"{kind}: logits after the image rel {err:.2e}")
        assert err < 5e-3, f"llama.cpp's logits after the image differ: rel {err:.2e}"
        assert got == out[0, inputs["input_ids"].shape[1] :].tolist()
        firsts.append(first)
    # the image matters: another image gives other logits after the same text
    assert (firsts[0] - firsts[1]).abs().max() / firsts[0].abs().max() > 1e-2


def clip_and_standardize(folder) -> None:
    """Turn on Gemma 4's clipped linears (bounds that bite) and feature standardisation in a
    saved checkpoint, in place (the vision side only changes)."""
    config = transformers.AutoConfig.from_pretrained(str(folder))
    config.vision_config.use_clipped_linears = True
    config.vision_config.standardize = True
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(folder), config=config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, buf in model.model.vision_tower.named_buffers():
            if name.endswith(("input_max", "output_max", "input_min", "output_min")):
                sign = -1 if name.endswith("min") else 1
                buf.fill_(sign * (0.5 + torch.rand((), generator=g).item()))
            elif name.endswith("std_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))
            elif name.endswith("std_scale"):
                buf.copy_(1 + 0.2 * torch.randn(buf.shape, generator=g))
    model.float().save_pretrained(str(folder))


def test_gemma4_clamps_and_standardisation_equal_transformers(tmp_path):
    """Gemma4ClippableLinear's bounds (scalar tensors beside each weight) and std_bias /
    std_scale: llama.cpp's embeddings equal transformers', which the bounds move."""
    from slipstream.checkpoint.gguf_mmproj import export_mmproj

    folder = vlm_folder(tmp_path / "gemma4", "gemma4", text=TEXT["gemma4"])
    randomise_constant_tensors(folder)
    text = tmp_path / "g.f32.gguf"
    assert main(["export", str(folder), "--gguf", "f32", "--out", str(text)]) == 0
    clip_and_standardize(folder)  # our loader takes no clipped tower: the mmproj alone, again
    export_mmproj(folder, mmproj_path(text, "f32"), "f32")
    with mock.patch("llama_cpp.llama.llama_cpp.llama_model_default_params", _no_repack_params):
        llm = llama_cpp.Llama(model_path=str(text), n_ctx=256, n_batch=128, n_ubatch=128,
                              verbose=False, n_threads=2)  # fmt: skip
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.print_timings, params.n_threads, params.warmup = False, False, 2, False
    ctx = mtmd.mtmd_init_from_file(str(mmproj_path(text, "f32")).encode(), llm.model, params)
    assert ctx, "llama.cpp refused the mmproj"
    image = random_image(*KINDS["gemma4"], seed=3)
    parts, chunks, bitmap = tokenize(ctx, image)
    (chunk,) = [c for part, c in parts if part == "image"]
    assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0
    n = ROWS["gemma4"]
    embd = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * WIDTH,))
    ours = torch.from_numpy(embd.copy()).reshape(n, WIDTH)
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    mtmd.mtmd_free(ctx)
    llm.close()
    theirs = hf_features(hf_model(folder), hf_pixels(folder, image))
    err = (ours - theirs).abs().max() / theirs.abs().max()
    print(f"gemma4 clipped + standardised: image embeddings rel {err:.2e}")
    assert err < 1e-3, f"llama.cpp's image embeddings differ from transformers': rel {err:.2e}"
    config = transformers.AutoConfig.from_pretrained(str(folder))
    config.vision_config.use_clipped_linears = False
    auto = transformers.AutoModelForImageTextToText
    unclipped = auto.from_pretrained(str(folder), config=config).float().eval()
    moved = hf_features(unclipped, hf_pixels(folder, image))
    assert (moved - theirs).abs().max() / theirs.abs().max() > 100 * err  # the bounds bite
