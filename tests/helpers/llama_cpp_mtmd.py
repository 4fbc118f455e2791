"""llama.cpp's multimodal library (mtmd, through llama-cpp-python) driven from a test: load a
text GGUF and its mmproj, split a prompt with an image into mtmd's chunks, read the image
embeddings mtmd computes, and run the prompt then greedy tokens. Importing it skips the test
module where llama-cpp-python or its libmtmd is missing (a wheel built with
`-DLLAVA_BUILD=OFF`, as README's CPU-only build line, has none).

Text is decoded at explicit positions from mtmd's returned n_past: after an image, an M-RoPE
model (Qwen-VL) continues at n_past + max(grid side), not at n_past + its rows, which
`llama_batch_get_one` would assume (measured on Qwen2.5-VL: logits wrong, greedy tokens
differ; with explicit positions rel 7e-4, tokens equal).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")
try:
    from llama_cpp import mtmd_cpp as mtmd
except (ImportError, OSError, RuntimeError, FileNotFoundError) as e:  # no libmtmd.so
    pytest.skip(f"llama-cpp-python without libmtmd: {e}", allow_module_level=True)

_default_model_params = llama_cpp.llama_model_default_params


def no_repack_params():
    """Weight repacking off (llama-cli's --no-repack; tests/test_gguf_llama_cpp.py says why)."""
    params = _default_model_params()
    params.use_extra_bufts = False
    return params


def load(text: Path, mmproj: Path):
    """llama.cpp's model and context on the text GGUF (f32 logits of every token, 2 threads;
    YaRN's betas from the file, as llama-cli's: llama-cpp-python's own default is 32 / 1) and
    the mtmd context of the mmproj on it: (llm, ctx); free with `close`."""
    with mock.patch("llama_cpp.llama.llama_cpp.llama_model_default_params", no_repack_params):
        llm = llama_cpp.Llama(model_path=str(text), n_ctx=256, n_batch=128, n_ubatch=128,
                              logits_all=True, verbose=False, n_threads=2,
                              yarn_beta_fast=-1.0, yarn_beta_slow=-1.0)  # fmt: skip
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.print_timings = False
    params.n_threads = 2
    params.warmup = False
    ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), llm.model, params)
    assert ctx, "llama.cpp refused the mmproj (mtmd_init_from_file returned NULL)"
    return llm, ctx


def close(llm, ctx) -> None:
    mtmd.mtmd_free(ctx)
    llm.close()


def tokenize(ctx, image, prompt: str):
    """mtmd's chunks of `prompt` with `image` at its <__media__> marker: ([(kind, token ids |
    chunk)], chunks, bitmap); the caller frees the last two (`free`)."""
    rgb = np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))
    data = (ctypes.c_uint8 * rgb.size).from_buffer_copy(rgb.tobytes())
    bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, data)
    chunks = mtmd.mtmd_input_chunks_init()
    text = mtmd.mtmd_input_text()
    text.text, text.text_len = prompt.encode(), len(prompt.encode())
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


def free(chunks, bitmap) -> None:
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)


def image_embeddings(ctx, image, prompt: str, width: int) -> torch.Tensor:
    """The embeddings mtmd's encoder gives the image's chunks, in order: (rows, width)."""
    parts, chunks, bitmap = tokenize(ctx, image, prompt)
    rows = []
    for part, chunk in parts:
        if part == "image":  # Idefics3: one chunk per tile, the overview last (as transformers)
            n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0
            embd = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * width,))
            rows.append(torch.from_numpy(embd.copy()).reshape(n, width))
    free(chunks, bitmap)
    return torch.cat(rows)


def decode_at(llm, ids: list[int], pos0: int) -> None:
    """Decode `ids` at positions pos0, pos0 + 1, ... (logits of the last one)."""
    batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
    batch.n_tokens = len(ids)
    for i, t in enumerate(ids):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = i == len(ids) - 1
    rc = llama_cpp.llama_decode(llm.ctx, batch)
    llama_cpp.llama_batch_free(batch)
    assert rc == 0, f"llama_decode returned {rc}"


def generate(llm, ctx, image, prompt: str, n: int) -> tuple[list, torch.Tensor, list[int]]:
    """llama.cpp on `prompt` with `image`, chunk by chunk: the prompt as [token ids | -rows of
    an image], the logits after it and `n` greedy tokens. A token mtmd could not find (-1: the
    tiny tokenizer has no "\\n\\n", which mtmd puts before Idefics3's overview) is left out."""
    parts, chunks, bitmap = tokenize(ctx, image, prompt)
    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
    shown, n_past = [], 0
    for i, (part, value) in enumerate(parts):
        if part == "text":
            ids = [t for t in value if t >= 0]
            shown.append(ids)
            decode_at(llm, ids, n_past)
            n_past += len(ids)
        else:
            shown.append(-mtmd.mtmd_input_chunk_get_n_tokens(value))
            new, last = llama_cpp.llama_pos(0), i == len(parts) - 1
            rc = mtmd.mtmd_helper_eval_chunk_single(
                ctx, llm.ctx, value, n_past, 0, 128, last, ctypes.byref(new)
            )
            assert rc == 0, f"mtmd_helper_eval_chunk_single returned {rc}"
            n_past = new.value
    free(chunks, bitmap)
    vocab, first, tokens = llm.n_vocab(), None, []
    for _ in range(n):
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        logits = torch.from_numpy(np.ctypeslib.as_array(logits, shape=(vocab,)).copy())
        first = logits if first is None else first
        tokens.append(int(logits.argmax()))
        decode_at(llm, [tokens[-1]], n_past)
        n_past += 1
    return shown, first, tokens


def assert_generation_equals_transformers(model, inputs: dict, first, got, n: int, what: str):
    """transformers on `inputs` (the prompt llama.cpp ran, image included): its logits after the
    prompt within 5e-3 relative of llama.cpp's `first`, its `n` greedy tokens llama.cpp's `got`."""
    with torch.no_grad():
        theirs = model(**inputs).logits[0, -1]
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    err = (first - theirs).abs().max() / theirs.abs().max()
    print(f"{what}: logits after the image rel {err:.2e}")
    assert err < 5e-3, f"llama.cpp's logits after the image differ: rel {err:.2e}"
    assert got == out[0, inputs["input_ids"].shape[1] :].tolist()


def assert_images_matter(firsts: list) -> None:
    """Two images give other logits after the same text (the check above can fail)."""
    assert (firsts[0] - firsts[1]).abs().max() / firsts[0].abs().max() > 1e-2
