"""MoE block forward+backward on CPU: slipstream vs the per-expert loop vs transformers.

Run: `python benchmarks/bench_moe.py` (under 2 minutes on 2 cores) or `--quick` (seconds).
All implementations share one Qwen3-MoE-shaped block's weights and the same routing, at a
fixed token count, so what varies with E is the cost of dispatching to E experts. The goal:
slipstream's time flat in E. Prints a markdown table measured in this one run.

The loop (like transformers' eager experts) indexes the stacked weights per expert, so its
backward materialises a full (E, ...) zero gradient per expert: E^2 memory traffic, seconds
at E=128. torch's CPU `_grouped_mm` is itself one small GEMM per expert (R/E rows each), so on
CPU even the grouped path slows with E; the tiled fallback runs 3 `bmm`s whatever E is.

Columns: `ours` = moe_forward (torch._grouped_mm where supported), `ours tiled` = the same with
the sync-free tiled fallback GEMM, `loop` = route + per-expert `torch.where` loop (the
reference), `hf eager` / `hf grouped_mm` = transformers' Qwen3MoeSparseMoeBlock with its
experts implementation set to eager / grouped_mm.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from slipstream.ops import moe


def build_block(E: int, k: int, D: int, I: int, impl: str | None) -> Qwen3MoeSparseMoeBlock:
    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E)
    cfg.num_experts_per_tok = k
    cfg._experts_implementation = impl
    torch.manual_seed(0)  # same weights for every implementation
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, D**-0.5)
    return block


def ours(block, x_TD, backend="auto"):
    ex, k = block.experts, block.gate.top_k
    logits_TE = F.linear(x_TD, block.gate.weight)
    if backend == "tiled":
        saved, moe._GROUPED_MM_CPU = moe._GROUPED_MM_CPU, False
    try:
        return moe.moe_forward(x_TD, logits_TE, ex.gate_up_proj, ex.down_proj, k).y_TD
    finally:
        if backend == "tiled":
            moe._GROUPED_MM_CPU = saved


def loop(block, x_TD):
    ex = block.experts
    weights_TK, ids_TK = moe.route(F.linear(x_TD, block.gate.weight), block.gate.top_k)
    return moe.moe_loop_reference(x_TD, weights_TK, ids_TK, ex.gate_up_proj, ex.down_proj)


def hf(block, x_TD):
    return block(x_TD[None])[0]


def time_fwd_bwd(fn, block, x_TD, g_TD, reps: int) -> float:
    """Median wall time (ms) of forward + backward. The first run is a warm-up, unless it took
    over half a second: then it is the one sample (the slow loops at E=128 take seconds)."""
    times = []
    for _ in range(reps + 1):
        x = x_TD.detach().requires_grad_()
        block.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        (fn(block, x) * g_TD).sum().backward()
        times.append((time.perf_counter() - t0) * 1e3)
        if times[0] > 500:
            return times[0]
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one rep: a smoke run")
    # One thread by default: on a shared 2-core machine, OpenMP barriers between the many small
    # per-expert GEMMs measured the scheduler, not the work (788 ms vs 56 ms for one call).
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        T, D, I, experts, topks, reps = 64, 64, 32, (8, 32), (2,), 1
    else:
        T, D, I, experts, topks, reps = 512, 256, 128, (8, 32, 128), (2, 8), 3
    impls = {
        "ours": lambda b, x: ours(b, x),
        "ours tiled": lambda b, x: ours(b, x, "tiled"),
        "loop": loop,
        "hf eager": hf,
        "hf grouped_mm": hf,
    }
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 CPU, "
        f"T={T} D={D} I={I}, forward+backward, median of {reps}; "
        f"torch._grouped_mm on CPU: {moe._GROUPED_MM_CPU}\n"
    )
    names = list(impls)
    print("| E | k | " + " | ".join(f"{n} ms" for n in names) + " | loop/ours | hf eager/ours |")
    print("|---|---|" + "---:|" * (len(names) + 2))
    for k in topks:
        for E in experts:
            torch.manual_seed(1)
            x_TD, g_TD = torch.randn(T, D), torch.randn(T, D)
            ms = {}
            for name, fn in impls.items():
                impl = "grouped_mm" if name == "hf grouped_mm" else None
                ms[name] = time_fwd_bwd(fn, build_block(E, k, D, I, impl), x_TD, g_TD, reps)
            cells = " | ".join(f"{ms[n]:.1f}" for n in names)
            ratios = f"{ms['loop'] / ms['ours']:.2f}x | {ms['hf eager'] / ms['ours']:.2f}x"
            print(f"| {E} | {k} | {cells} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
