"""The Qwen-VL language models as llama.cpp's M-RoPE architectures (GGUFSpec, gguf_spec.py):
Qwen2.5-VL's Qwen2 decoder as `qwen2vl`, Qwen3-VL's Qwen3 decoder as `qwen3vl` (interleaved
sections, deepstack). Export only: these files hold no vision side (that is the mmproj,
gguf_mmproj_qwen.py), so import has no checkpoint to rebuild.

M-RoPE in llama.cpp: each rotary frequency reads one of four positions (t, h, w and a fourth
that is 0 for text tokens and for mtmd's image rows), by `rope.dimension_sections`. In blocks
(qwen2vl) that is ours when the three sections cover the frequencies (models/rope.py checks
they sum to them). Interleaved (qwen3vl) llama.cpp gives frequency j to t, h, w when j % 3 is
0, 1, 2 and j < 3 x that section, else to the fourth; transformers (and we) give those to t.
The released Qwen3-VL checkpoints (head_dim 128, sections 24/20/20, base 5e6) have two such
frequencies, 61 and 62 of 64, turning 4e-7 rad a position (0.01 rad at 32k): llama.cpp's
converter writes them so, and so do we. A config where such a frequency turns more than 1e-6
rad a position is refused (the tiny test model's 1/1/2 sections: frequency 3 of 4, 1e-3 rad;
let through, llama.cpp's logits after an image were rel 7.9e-3 from transformers', against
1.0e-3 with 2/1/1, which covers every frequency).

Deepstack (Qwen3-VL): llama.cpp's qwen3vl takes each image row as n_embd x (1 + n) inputs, the
merger's output then the n deepstack features, and adds feature k after decoder layer k, as
transformers does; `n_deepstack_layers` is the number of deepstack_visual_indexes. A feature
on the last layer is refused: llama.cpp adds it after keeping only the rows that give logits,
and aborts (GGML_ASSERT in ggml_add, measured on a 2-layer model with 2 features); the
released checkpoints have 3 features and 28 or more layers.
"""

from __future__ import annotations

from typing import Any

from slipstream.checkpoint.gguf_spec import GGUFSpec, rope_metadata

FOURTH = 3  # llama.cpp's fourth position row (0 for text)
MAX_DROPPED_RATE = 1e-6  # rad a position: module docstring


def llama_cpp_imrope_axes(section: list[int], freqs: int) -> list[int]:
    """The position row (0 t, 1 h, 2 w, 3 FOURTH) llama.cpp's interleaved M-RoPE turns each of
    the `freqs` frequencies by (ggml's rope, is_imrope): sectors wrap at the sections' sum."""
    total = sum(section)
    axes = []
    for j in range(freqs):
        sector = j % total
        axis = sector % 3
        axes.append(axis if sector < 3 * section[axis] else FOURTH)
    return axes


def _qwen3vl_check(cfg: Any, hf: dict) -> None:
    from slipstream.models.qwen_vl import mrope_section
    from slipstream.models.rope import mrope_axes, rope_inv_freq

    if cfg.rope.rope_type != "default" or cfg.rope.rotary_dim(cfg.head_dim) != cfg.head_dim:
        raise ValueError(
            f"GGUF export: qwen3_vl with rope type {cfg.rope.rope_type!r} and rotary dims "
            f"{cfg.rope.rotary_dim(cfg.head_dim)} of head_dim {cfg.head_dim}: llama.cpp's "
            "qwen3vl runs default RoPE over the whole head."
        )
    deepstack = len((hf.get("vision_config") or {}).get("deepstack_visual_indexes") or [])
    if deepstack >= cfg.num_hidden_layers:
        raise ValueError(
            f"GGUF export: qwen3_vl with {deepstack} deepstack features and "
            f"{cfg.num_hidden_layers} decoder layers: llama.cpp's qwen3vl aborts when the last "
            "layer gets one (it needs fewer features than layers)."
        )
    section = mrope_section(hf, cfg.model_type)
    inv_freq, _ = rope_inv_freq(cfg.rope, cfg.head_dim)
    ours = mrope_axes(section, True, len(inv_freq))
    theirs = llama_cpp_imrope_axes(section, len(inv_freq))
    moved = [j for j, (a, b) in enumerate(zip(ours, theirs, strict=True))
             if a != b and float(inv_freq[j]) > MAX_DROPPED_RATE]  # fmt: skip
    if moved:
        raise ValueError(
            f"GGUF export: qwen3_vl with mrope_section {section}: llama.cpp's interleaved "
            f"M-RoPE turns rotary frequencies {moved} of {len(inv_freq)} by other positions "
            "than transformers (it gives j to t/h/w only while j < 3 x that section), so it "
            "would compute another model; use sections that cover every frequency "
            "(e.g. for 4: [2, 1, 1])."
        )


def _qwen2vl_metadata(w: Any, cfg: Any, hf: dict) -> None:
    """Qwen2's RoPE keys plus llama.cpp's M-RoPE sections (t, h, w, 0: pairs of the head's
    rotary frequencies each axis turns; text positions are (p, p, p) in llama.cpp as here)."""
    from slipstream.models.qwen_vl import mrope_section

    rope_metadata(w, cfg, hf)
    w.add_rope_dimension_sections([*mrope_section(hf, cfg.model_type), 0])


def _qwen3vl_metadata(w: Any, cfg: Any, hf: dict) -> None:
    """qwen2vl's keys plus the number of deepstack features each image row carries."""
    _qwen2vl_metadata(w, cfg, hf)
    deepstack = (hf.get("vision_config") or {}).get("deepstack_visual_indexes") or []
    w.add_num_deepstack_layers(len(deepstack))


# Qwen2.5-VL's language model (our Qwen2 decoder with mRoPE).
QWEN2VL = GGUFSpec(
    "QWEN2VL", "qwen2vl", ("qwen2_5_vl",), write_metadata=_qwen2vl_metadata,
    pre_tokenizer="qwen2",
)  # fmt: skip
# Qwen3-VL's (our Qwen3 decoder: q/k RMSNorm, interleaved mRoPE, deepstack).
QWEN3VL = GGUFSpec(
    "QWEN3VL", "qwen3vl", ("qwen3_vl",), check=_qwen3vl_check,
    write_metadata=_qwen3vl_metadata, pre_tokenizer="qwen2",
)  # fmt: skip
