"""Run in a fresh process by tests/test_memory_plan_rss.py: the memory plan of a LoRA step, then
the step itself on CPU (as `train` runs it: glibc keeps freed memory, frozen linears
prepacked for oneDNN, each layer recomputed, AdamW), and the process's peak RSS.

Usage: python rss_step.py MODEL_DIR TOKENS TILES STEPS -> one JSON line
{"plan": bytes, "components": {...}, "peak_rss": bytes, "after_load_rss": bytes}.
"""

from __future__ import annotations

import json
import resource
import sys

import torch

from slipstream.memory.host_heap import keep_freed_memory
from slipstream.memory.plan import PlanInputs, estimate, read_hf_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main(model_dir: str, tokens: int, tiles: int, steps: int) -> None:
    torch.set_num_threads(1)
    keep_freed_memory()  # as prepare_run does on CPU, before the plan
    hf = read_hf_config(model_dir)
    inp = PlanInputs(
        hf=hf, device="cpu", dtype=torch.float32, quantization="none", method="lora", rank=8,
        alpha=16, targets=TARGETS, use_dora=False, optimizer="adamw", tokens=tokens,
        mode="recompute", tiles=tiles, prepack=True, world=1,
    )  # fmt: skip
    plan = estimate(inp, tokens, "recompute", tiles)

    from slipstream.checkpoint.hf import load_model
    from slipstream.memory.offload import apply_checkpointing
    from slipstream.memory.tiled_mlp import apply_mlp_tiling
    from slipstream.ops.frozen_linear import apply_prepacked_linears
    from slipstream.ops.packing import SeqInfo
    from slipstream.peft.lora import apply_lora
    from slipstream.train.optim import build_optimizer

    model = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    apply_lora(model, rank=8, alpha=16, targets=TARGETS)
    apply_prepacked_linears(model)
    apply_mlp_tiling(model, tiles)
    apply_checkpointing(model, "recompute")
    opt = build_optimizer(model.named_parameters(), lr=1e-4, weight_decay=0.0,
                          device=torch.device("cpu"))  # fmt: skip
    ids = torch.randint(0, hf["vocab_size"], (tokens,), generator=torch.Generator().manual_seed(0))
    seq = SeqInfo.from_lengths([tokens])
    for _ in range(steps):  # the second step holds the optimizer states too
        loss = model.loss(ids, ids, seq, reduction="sum", label_positions=torch.arange(tokens))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"plan": plan.peak, "components": plan.components, "peak_rss": peak}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
