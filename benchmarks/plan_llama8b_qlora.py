"""The planner's longest single sequence for Llama-3.1-8B QLoRA (NF4, LoRA r16 all-linear,
bf16, offload) on 80 GB and 141 GB, untiled and with the MLP in 8 tiles (docs/benchmarks.md).

Run: `python benchmarks/plan_llama8b_qlora.py` (config.json only: no weights, no GPU).
"""

from __future__ import annotations

import json
from pathlib import Path

from slipstream.config import RunConfig
from slipstream.memory.plan import GiB, PlanInputs, estimate, longest, parse_size

HERE = Path(__file__).resolve().parent
MODEL = HERE / "model_configs" / "llama-3.1-8b"

cfg = RunConfig.model_validate({
    "model": {"path": str(MODEL), "dtype": "bfloat16", "quantization": "nf4"},
    "data": {"train": "unused.jsonl"},
    "lora": {"rank": 16, "alpha": 32, "targets": "all-linear"},
    "train": {"tokens_per_batch": 65536},
    "output_dir": "unused",
})  # fmt: skip
inp = PlanInputs.from_config(cfg, "cuda", json.loads((MODEL / "config.json").read_text()))
for tiles in (1, 8):
    for budget in ("80GB", "141GB"):
        plan = estimate(inp, 65536, "offload", tiles)
        plan.budget = parse_size(budget)
        n = longest(inp, plan)
        at = estimate(inp, n, "offload", tiles)
        print(f"{budget} tiles={tiles}: {n:,} tokens, device {at.peak / GiB:.1f} GiB, "
              f"pinned host {sum(at.host.values()) / GiB:.1f} GiB")  # fmt: skip
