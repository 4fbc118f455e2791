"""MoE block forward+backward on CPU: slipstream vs the per-expert loop vs transformers.

Run: `python benchmarks/bench_moe.py [--json out.json]` (about a minute on 2 cores) or
`--quick` (seconds).
All implementations share one Qwen3-MoE-shaped block's weights and the same routing, at a
fixed token count, so what varies with E is the cost of dispatching to E experts. The goal:
slipstream's time flat in E. Prints a markdown table measured in this one run.

The loop (like transformers' eager experts) indexes the stacked weights per expert, so its
backward materialises a full (E, ...) zero gradient per expert: E^2 memory traffic, seconds
at E=128. torch's CPU `_grouped_mm` is itself one small GEMM per expert (R/E rows each), so on
CPU even the grouped path slows with E; the tiled fallback runs 3 `bmm`s whatever E is.

Columns: `ours` = the Qwen3-MoE block the models run (`MoEBlock` -> `ops.moe.moe`,
torch._grouped_mm where supported), `ours tiled` = the same with the sync-free tiled fallback
GEMM, `loop` = route + `moe_loop_reference` (per-expert `torch.where`, each expert through
the block's experts module), `hf eager` / `hf grouped_mm` = transformers'
Qwen3MoeSparseMoeBlock with its experts implementation set to eager / grouped_mm.
"""

from __future__ import annotations

import argparse
import json
import time

import common
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from slipstream.models import qwen3_moe
from slipstream.ops import moe

IMPLS = ("ours", "ours tiled", "loop", "hf eager", "hf grouped_mm")
COLUMNS = [
    "E", "k", *(f"{n} ms" for n in IMPLS),
    "loop/ours", "hf eager/ours", "hf grouped_mm/ours", "max abs diff",
]  # fmt: skip
SLOW_S = 0.5  # a call slower than this is timed once: the E=128 loops take seconds each


def hf_config(E: int, k: int, D: int, I: int) -> Qwen3MoeConfig:
    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E)
    cfg.num_experts_per_tok = k
    return cfg


def build_block(E: int, k: int, D: int, I: int, impl: str | None) -> Qwen3MoeSparseMoeBlock:
    cfg = hf_config(E, k, D, I)
    cfg._experts_implementation = impl
    torch.manual_seed(0)  # same weights for every implementation
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, D**-0.5)
    return block


def build_ours(E: int, k: int, D: int, I: int) -> qwen3_moe.Qwen3MoeBlock:
    """The block the models run, with the weights `build_block` gives transformers' (the HF
    names match: gate.weight, experts.gate_up_proj, experts.down_proj)."""
    hf = build_block(E, k, D, I, None)
    ours = qwen3_moe.Qwen3MoeBlock(qwen3_moe.config_from_hf(hf_config(E, k, D, I).to_dict()))
    ours.load_state_dict(hf.state_dict())
    return ours


def ours(block, x_TD, tiled=False):
    saved = moe._GROUPED_MM_CPU
    moe._GROUPED_MM_CPU = saved and not tiled
    try:
        return block(x_TD)[0]
    finally:
        moe._GROUPED_MM_CPU = saved


def loop(block, x_TD):
    logits_TE, norm = block.router_logits(x_TD), block.norm_topk_prob
    weights_TK, ids_TK = moe.route(logits_TE, block.k, norm_topk_prob=norm)
    return moe.moe_loop_reference(x_TD, weights_TK, ids_TK, block.experts, block.num_experts)


def hf(block, x_TD):
    return block(x_TD[None])[0]


def measure(E: int, k: int, T: int, D: int, I: int, reps: int) -> dict:
    """One row: forward+backward ms of each implementation, calls interleaved so that load
    drift on shared cores hits every contender alike; the first call of each is a warm-up."""
    torch.manual_seed(1)
    x_TD, g_TD = torch.randn(T, D), torch.randn(T, D)
    fns = {
        "ours": (ours, "ours"),
        "ours tiled": (lambda b, x: ours(b, x, tiled=True), "ours"),
        "loop": (loop, "ours"),
        "hf eager": (hf, None),
        "hf grouped_mm": (hf, "grouped_mm"),
    }
    blocks = {
        name: build_ours(E, k, D, I) if impl == "ours" else build_block(E, k, D, I, impl)
        for name, (_, impl) in fns.items()
    }
    times: dict[str, list[float]] = {name: [] for name in fns}
    outputs = {}
    for rep in range(reps + 1):
        for name, (fn, _) in fns.items():
            if rep and times[name] and times[name][0] > SLOW_S:
                continue  # slow: its first call is its one sample
            x = x_TD.clone().requires_grad_()
            blocks[name].zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            y_TD = fn(blocks[name], x)
            (y_TD * g_TD).sum().backward()
            times[name].append(time.perf_counter() - t0)
            outputs[name] = y_TD.detach()
    row = {"E": E, "k": k}
    for name, t in times.items():
        samples = t if len(t) == 1 else t[1:]
        row[f"{name} ms"] = sorted(samples)[len(samples) // 2] * 1e3
    for name in ("loop", "hf eager", "hf grouped_mm"):
        row[f"{name}/ours"] = row[f"{name} ms"] / row["ours ms"]
    row["max abs diff"] = (outputs["ours"] - outputs["hf eager"]).abs().max().item()
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one rep: a smoke run")
    # One thread by default: on a shared 2-core machine, OpenMP barriers between the many small
    # per-expert GEMMs measured the scheduler, not the work (788 ms vs 56 ms for one call).
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--json", help="also write the rows and run info to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        T, D, I, experts, topks, reps = 64, 64, 32, (8, 32), (2,), 1
    else:
        T, D, I, experts, topks, reps = 512, 256, 128, (8, 32, 128), (2, 8), 7
    info = common.run_info()
    rows = [measure(E, k, T, D, I, reps) for k in topks for E in experts]
    command = "python benchmarks/bench_moe.py" + (" --quick" if args.quick else "")
    print(common.header(info, command))
    print(
        f"\nQwen3-MoE-shaped block, float32, T={T} D={D} I={I}, forward+backward, median of "
        f"{reps}; torch._grouped_mm on CPU: {moe._GROUPED_MM_CPU}\n"
    )
    print(common.markdown_table(rows, COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "shape": {"T": T, "D": D, "I": I}, "rows": rows}, f)
    return rows


if __name__ == "__main__":
    main()
