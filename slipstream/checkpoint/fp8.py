"""FP8 checkpoints, dequantised while they load; and which `quantization_config`s load at all.

An FP8 checkpoint (config.json `quantization_config: {"quant_method": "fp8",
"weight_block_size": [128, 128], ...}`: Qwen3-*-FP8, Ministral 3, DeepSeek-style MoE) stores
each quantised weight `W (..., rows, cols)` as float8_e4m3fn beside `W_scale_inv
(..., rows / bm, cols / bn)`, one float per bm x bn block (`x.weight` -> `x.weight_scale_inv`,
a stacked expert tensor `x.gate_up_proj` -> `x.gate_up_proj_scale_inv`). Its float value is
`w = fp8.float() * scale_inv` broadcast over the block, computed in float32 and rounded once
to the model's dtype: transformers' `Fp8Dequantize._dequantize_one` (transformers 5.24,
integrations/finegrained_fp8.py), equal to it bit for bit (tests/test_fp8.py).

The model never holds FP8: each weight is dequantised the moment its pair is read (native
families: `dequantized` wraps the tensor stream of checkpoint/hf.py; the generic family:
transformers' own loader with `dequantize=True`, which runs the same op per tensor), so host
memory holds the model in its dtype plus one weight in flight. Training, adapters and exports
then see a plain full-precision base; an export is not re-quantised.

Shapes are checked from the safetensors headers before a weight loads (`check_fp8_tensors`):
a block that does not tile its weight (DeepSeek's ceil-divided grids: a 576-row weight in
128-row blocks) is refused, as transformers 5.24 refuses it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCALE_SUFFIX = "_scale_inv"
# Static activation scales: used by FP8 matmuls only; a dequantised model has no use for them.
DROPPED_SUFFIXES = (".activation_scale", ".input_scale")
# quant_methods that load: bitsandbytes 4-bit as it is (peft/qlora.py), MXFP4 experts
# dequantised (models/gpt_oss.py), FP8 dequantised (here).
LOADABLE = ("bitsandbytes", "fp8", "mxfp4")
ADVICE = "load the model's unquantised (bf16) checkpoint instead"
# Scale tensors carry a few thousand values at most: dequantising in chunks of this many
# weight values bounds the float32 scratch at 64 MB, whatever the weight's size.
CHUNK = 16 * 1024**2


@dataclass(frozen=True)
class Fp8Format:
    """A checkpoint's FP8 layout: `block` (rows, cols) of one scale, None for one scale a
    tensor; `ue8m0`: scales stored as power-of-two exponents (uint8, 2^(b - 127))."""

    block: tuple[int, int] | None
    ue8m0: bool = False

    def describe(self) -> str:
        blocks = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "one scale a tensor"
        return f"FP8 ({blocks})"


def check_quantization(hf: dict[str, Any], where: str = "config.json") -> Fp8Format | None:
    """The FP8 layout of a config.json, None for a checkpoint that is not FP8; a one-line
    ValueError for a quantization slipstream cannot load (torch-free: called before anything
    heavy loads)."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in LOADABLE:
        raise ValueError(
            f"{where}: quantization_config.quant_method {method!r} is not supported (slipstream "
            f"loads {', '.join(LOADABLE)}); {ADVICE}."
        )
    if method != "fp8":
        return None
    block = qc.get("weight_block_size")
    ok = block is None or (
        isinstance(block, list | tuple) and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    )  # fmt: skip
    if not ok:
        raise ValueError(
            f"{where}: quantization_config.weight_block_size {block!r} is not two positive "
            "integers (e.g. [128, 128]); fix config.json."
        )
    scale_fmt = qc.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise ValueError(
            f"{where}: quantization_config.scale_fmt {scale_fmt!r} is not supported "
            f"('float' or 'ue8m0'); {ADVICE}."
        )
    return Fp8Format(tuple(block) if block else None, scale_fmt == "ue8m0")


def without_quantization(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json of the dequantised model: no `quantization_config` (a save must not claim
    FP8 weights it does not hold)."""
    return {k: v for k, v in hf.items() if k != "quantization_config"}


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def check_fp8_tensors(
    headers: dict[str, tuple[str, tuple[int, ...]]], fmt: Fp8Format, source: str
) -> int:
    """A one-line ValueError for an FP8 weight without its scale (or a scale without its
    weight), or a block that does not tile its weight; `headers`: name -> (safetensors
    dtype, shape), read without loading a tensor. Returns the number of FP8 weights."""
    n = 0
    for name, (dtype, shape) in headers.items():
        if name.endswith(SCALE_SUFFIX):
            weight = name.removesuffix(SCALE_SUFFIX)
            if weight not in headers or not headers[weight][0].startswith("F8"):
                raise ValueError(
                    f"{source}: tensor {name!r} has no FP8 weight {weight!r} beside it; "
                    f"the checkpoint is incomplete or not block-FP8: {ADVICE}."
                )
            continue
        if not dtype.startswith("F8"):
            continue
        if scale_name(name) not in headers:
            raise ValueError(
                f"{source}: FP8 tensor {name!r} has no {scale_name(name)!r}; the checkpoint is "
                f"incomplete or stores another FP8 layout: {ADVICE}."
            )
        _check_grid(name, shape, headers[scale_name(name)][1], fmt, source)
        n += 1
    return n


def _check_grid(name: str, shape, scale_shape, fmt: Fp8Format, source: str) -> None:
    if len(shape) < 2:
        raise ValueError(f"{source}: FP8 tensor {name!r} has shape {tuple(shape)}: not a matrix.")
    rows, cols = shape[-2:]
    if fmt.block is None:
        if _numel(scale_shape) == 1:
            return
        raise ValueError(
            f"{source}: {scale_name(name)!r} has shape {tuple(scale_shape)}, but config.json "
            "has no weight_block_size (one scale a tensor); set it to the checkpoint's block."
        )
    bm, bn = fmt.block
    grid = (*shape[:-2], rows // bm, cols // bn)
    if rows % bm or cols % bn:
        why = "the block does not tile it"
    elif tuple(scale_shape) != grid:
        why = f"its scales are {tuple(scale_shape)}, not the {grid} of that block"
    else:
        return
    raise ValueError(
        f"{source}: FP8 tensor {name!r} {tuple(shape)} does not match quantization_config."
        f"weight_block_size [{bm}, {bn}]: {why}; {ADVICE}."
    )


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def dequantize_fp8(q, scale_inv, dtype, device=None):
    """w = q.float() * scale_inv over its blocks, rounded once to `dtype`: q (..., R, C) any
    float8, scale_inv (..., R/bm, C/bn) (or one value), on `device` (default q's). Computed a
    few block rows at a time (CHUNK): one float32 scratch of 64 MB at most."""
    import math

    import torch

    device = torch.device(device) if device is not None else q.device
    rows, cols = q.shape[-2:]
    s = scale_inv.to(device)
    s = (s.to(torch.float32) - 127.0).exp2() if s.dtype == torch.uint8 else s.to(torch.float32)
    if s.numel() == 1:  # one scale for the whole tensor
        s = s.reshape(1, 1, 1).expand(math.prod(q.shape[:-2]), 1, 1)
    sr, sc = s.shape[-2:]
    bm, bn = rows // sr, cols // sc
    q_Gbcn = q.reshape(-1, bm, sc, bn)  # G = (leading dims) x block rows
    s_Gc = s.reshape(-1, sc)
    out = torch.empty(q.shape, dtype=dtype, device=device)
    out_Gbcn = out.view(-1, bm, sc, bn)
    step = max(1, CHUNK // (bm * cols))
    for g in range(0, q_Gbcn.shape[0], step):
        block = q_Gbcn[g : g + step].to(device).to(torch.float32)
        out_Gbcn[g : g + step] = block.mul_(s_Gc[g : g + step, None, :, None])
    return out


def dequantized(
    tensors: Iterator[tuple[str, Any]], dtype, device=None, source: str = ""
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) stream with each FP8 weight and its scale replaced by
    the dequantised weight in `dtype` (on `device`), under the weight's name; activation
    scales dropped; everything else as it is. A weight waits for its scale (and the other
    way round) only until the pair is read: adjacent in a shard, as names sort."""
    waiting: dict[str, Any] = {}
    for name, tensor in tensors:
        if name.endswith(DROPPED_SUFFIXES):
            continue
        is_scale = name.endswith(SCALE_SUFFIX)
        if not is_scale and not (tensor.is_floating_point() and tensor.element_size() == 1):
            yield name, tensor
            continue
        weight = name.removesuffix(SCALE_SUFFIX) if is_scale else name
        other = waiting.pop(weight, None)
        if other is None:
            waiting[weight] = tensor
            continue
        q, s = (other, tensor) if is_scale else (tensor, other)
        yield weight, dequantize_fp8(q, s, dtype, device)
    if waiting:
        name = next(iter(waiting))
        raise ValueError(
            f"{source}: FP8 weight {name!r} or its scale is missing; the checkpoint is truncated."
        )


def safetensors_headers(folder: Path, files: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype as safetensors writes it: "F8_E4M3", "BF16", ...; shape), from the
    files' JSON headers alone (no tensor is read)."""
    import json
    import struct

    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        with open(folder / file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                headers[name] = (info["dtype"], tuple(info["shape"]))
    return headers
