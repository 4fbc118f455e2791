"""GPU suite row `plan`: the memory planner's estimate against `torch.cuda.max_memory_allocated`.

Run: `python benchmarks/gpu_suite_plan.py [--out FILE]` on a GPU (about 2 minutes on an H200);
`--dry-run` runs the same code on CPU with tiny shapes, comparing with the live-tensor
tracker instead (tests/test_benchmarks.py runs it). Each row builds a random model of real
shapes (bf16, LoRA r=16 on all linear layers), applies the row's checkpointing and MLP tiles,
runs two training steps over one sequence and reads the second's peak; beside it the plan's
estimate for the same settings (`slipstream.memory.plan.estimate`, device cuda: it excludes
the CUDA context, which `max_memory_allocated` does not see either) and their ratio. A
failing row prints its error and the rest go on. Writes JSON to --out (default
$OUT/gpu_suite_plan.json when OUT is set) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import common
import torch

ROWS = [  # (shape, tokens, checkpointing, MLP tiles)
    ("qwen3-0.6b", 32768, "offload", 1),
    ("qwen3-0.6b", 32768, "recompute", 4),
    ("qwen3-0.6b", 131072, "offload", 8),
    ("qwen3-8b", 32768, "offload", 1),
    ("qwen3-8b", 65536, "offload", 8),
    ("qwen3-8b", 16384, "none", 1),
]
DRY_SHAPE = dict(
    model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=192,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=4096,
)  # fmt: skip


def plan_inputs(hf: dict, device: str, dtype: torch.dtype, tokens: int):
    from slipstream.memory.plan import PlanInputs

    return PlanInputs(
        hf=hf, device=device, dtype=dtype, quantization="none", method="lora", rank=16,
        alpha=32, targets="all-linear", use_dora=False, optimizer="adamw", tokens=tokens,
        mode="auto", tiles="auto", prepack=False, world=1,
    )  # fmt: skip


def measure_row(hf: dict, tokens: int, mode: str, tiles: int, dry: bool) -> dict:
    from slipstream.memory.measure import measure_step
    from slipstream.memory.offload import apply_checkpointing
    from slipstream.memory.plan import estimate
    from slipstream.memory.tiled_mlp import apply_mlp_tiling
    from slipstream.peft.lora import apply_lora
    from slipstream.train.optim import build_optimizer

    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    inp = plan_inputs(hf, device.type, dtype, tokens)
    plan = estimate(inp, tokens, mode, tiles)
    estimated = plan.peak - plan.components.get("process (libraries, heap)", 0)
    model = common.build_random_model(hf, dtype=dtype, device=device)
    apply_lora(model, rank=16, alpha=32, targets="all-linear")
    apply_mlp_tiling(model, tiles)
    apply_checkpointing(model, mode, force=dry and mode == "offload")
    optimizer = build_optimizer(model.named_parameters(), lr=1e-5, weight_decay=0.0,
                                device=device)  # fmt: skip
    start = time.perf_counter()
    measured = measure_step(model, optimizer, [tokens], track=dry)
    seconds = time.perf_counter() - start
    peak = measured.live_peak if dry else measured.cuda_peak
    del model, optimizer
    if not dry:
        torch.cuda.empty_cache()
    return {
        "estimate GiB": estimated / 2**30, "measured GiB": peak / 2**30,
        "estimate / measured": estimated / peak, "seconds": seconds,
        "what": "live tensors" if dry else "max_memory_allocated",
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out = args.out or os.path.join(os.environ.get("OUT", "."), "gpu_suite_plan.json")
    rows = []
    for shape, tokens, mode, tiles in ROWS[:3] if args.dry_run else ROWS:
        hf = DRY_SHAPE if args.dry_run else common.REAL_SHAPES[shape]
        tokens = 256 if args.dry_run else tokens
        row = {"shape": shape, "tokens": tokens, "checkpointing": mode, "tiles": tiles}
        try:
            row.update(measure_row(dict(hf), tokens, mode, tiles, args.dry_run))
        except Exception as e:  # one failing row must not cost the others
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    info = common.run_info("cpu" if args.dry_run else "cuda")
    with open(out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    columns = ["shape", "tokens", "checkpointing", "tiles", "estimate GiB", "measured GiB",
               "estimate / measured", "seconds"]  # fmt: skip
    print(common.markdown_table(rows, columns))
    return rows


if __name__ == "__main__":
    main()
