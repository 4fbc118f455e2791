"""Qwen-VL vision towers on CPU: slipstream's (models/qwen_vit.py, host-built metadata, packed
non-causal attention) against transformers' own (SDPA), same weights, same patches.

Run: `python benchmarks/bench_qwen_vit.py [--reps 3] [--json FILE]` (about a minute on 2
cores), `--quick` (tiny shapes: a smoke run).

Towers: Qwen2.5-VL-shaped (window attention, window 112 px, the last of 4 blocks full) and
Qwen3-VL-shaped (learned 48 x 48 position table, a deepstack merger after block 1), both width
256 in 4 heads, depth 4, random weights, float32, trained (forward + backward of every
parameter). A step is one tower call over 4 images of different sizes (224 x 224,
448 x 336, 112 x 560, 336 x 336 px, cut to whole merge blocks: 1,920 patches of 14 px,
1,360 of 16 px), then backward of the features' sum; best of `--reps`. Host syncs counted by
`count_syncs` over the same step.

Prediction (written before the first run): the same time within ~10% (the same math: one
attention call per image or window on both; ours builds its indices on the host before the
step, which costs nothing measurable on CPU); syncs 0 against transformers' 13+. Measured:
1.26x / 1.44x (docs/benchmarks.md), mostly the patch embedding: transformers' Conv3d with
kernel = stride takes 91 ms forward + backward on CPU for 1,920 patches at width 256, the
same map as one matmul 14 ms.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

import slipstream
from slipstream.data.qwen_vit_meta import vit_metadata
from slipstream.models.qwen_vit import QwenVisionTower

SIZES = [(224, 224), (448, 336), (112, 560), (336, 336)]  # (height, width) px


def towers(kind: str, quick: bool):
    width, depth = (32, 2) if quick else (256, 4)
    common = dict(depth=depth, hidden_size=width, intermediate_size=width * 2, num_heads=4,
                  out_hidden_size=width, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    if kind == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

        cfg = transformers.Qwen2_5_VLVisionConfig(
            **common, patch_size=14, window_size=112, fullatt_block_indexes=[depth - 1]
        )
        cls = m.Qwen2_5_VisionTransformerPretrainedModel
    else:
        from transformers.models.qwen3_vl import modeling_qwen3_vl as m

        cfg = transformers.Qwen3VLVisionConfig(
            **common, patch_size=16, num_position_embeddings=2304, deepstack_visual_indexes=[1]
        )
        cls = m.Qwen3VLVisionModel
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = cls._from_config(cfg).float()
    return hf, QwenVisionTower.adopt(hf), cfg


def inputs(cfg, quick: bool):
    step = cfg.patch_size * cfg.spatial_merge_size
    sizes = [(h // 4, w // 4) for h, w in SIZES] if quick else SIZES
    grids = [(1, max(step, h // step * step) // cfg.patch_size,
              max(step, w // step * step) // cfg.patch_size) for h, w in sizes]  # fmt: skip
    n = sum(t * h * w for t, h, w in grids)
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    return torch.randn(n, width, generator=torch.Generator().manual_seed(1)), grids


def _theirs(hf, pixels, grid_thw) -> None:
    hf(pixels, grid_thw=grid_thw, return_dict=True).pooler_output.sum().backward()


def _ours(tower, pixels, meta) -> None:
    tower(pixels, meta)[0].sum().backward()


def timed(step, reps: int) -> float:
    step()  # warm-up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows = []
    for kind in ("qwen2_5_vl", "qwen3_vl"):
        hf, ours, cfg = towers(kind, args.quick)
        pixels, grids = inputs(cfg, args.quick)
        grid_thw = torch.tensor(grids)
        meta = vit_metadata(grids, ours.geometry)  # the collator's work, before the step

        steps = (
            ("transformers", lambda hf=hf, x=pixels, g=grid_thw: _theirs(hf, x, g)),
            ("slipstream", lambda tower=ours, x=pixels, m=meta: _ours(tower, x, m)),
        )
        for name, step in steps:
            with slipstream.count_syncs() as syncs:
                step()
            seconds = timed(step, args.reps)
            rows.append({"tower": kind, "variant": name, "patches": pixels.shape[0],
                         "ms": round(seconds * 1e3, 1), "syncs": syncs.total})  # fmt: skip
        rows[-1]["speedup"] = round(rows[-2]["ms"] / rows[-1]["ms"], 2)
    for r in rows:
        print(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
