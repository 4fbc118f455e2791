"""Tiny FP8 checkpoints: a saved float checkpoint's decoder projections rewritten in place as
block-wise float8_e4m3fn weights with their `weight_scale_inv`, as DeepSeek-V3 / Qwen3-FP8
checkpoints store them (scale = block amax / 448, the e4m3 maximum), plus the
`quantization_config` those checkpoints carry."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0
# Decoder-layer matrices a published FP8 checkpoint quantises: attention and MLP
# projections, per-expert or stacked experts; not routers, norms, embeddings or the head.
QUANTISED = ("_proj.weight", "experts.gate_up_proj", "experts.down_proj")


def quantize_blocks(w: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 (..., R, C), weight_scale_inv (..., R/bm, C/bn) float32) of a float tensor."""
    *lead, rows, cols = w.shape
    blocks = w.float().reshape(*lead, rows // bm, bm, cols // bn, bn)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn).reshape(w.shape), scale_inv


def to_fp8(folder: Path, block=(16, 16), within: str = ".layers.", **quant) -> Path:
    """Rewrite `folder` (one model.safetensors) as an FP8 checkpoint: each decoder matrix whose
    name contains `within` quantised in `block` blocks; `quant`: extra quantization_config
    keys (or overrides: quant_method, weight_block_size)."""
    folder = Path(folder)
    state = load_file(folder / "model.safetensors")
    out = {}
    for name, t in state.items():
        if within in name and name.endswith(QUANTISED) and t.ndim >= 2:
            out[name], out[name + "_scale_inv"] = quantize_blocks(t, *block)
        else:
            out[name] = t
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "weight_block_size": list(block), **quant,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder
