"""A CPU LoRA training step: where the time goes, and what each CPU technique is worth.

Run: `python benchmarks/bench_cpu_step.py` (a few minutes on 2 cores), `--profile` (adds
torch.profiler's self time per op group), `--quick` (seconds, tiny shapes).
The step is the trainer's: a random SmolLM2-135M-shaped model (vocab 49152, hidden 576, MLP
1536, 9/3 heads, tied head) cut to `--layers` (6), LoRA r16 on all linears, every layer
checkpointed (recompute: the CPU default), `model.loss` on the labelled rows (38%, chitchat's
assistant-only density) of 1,024 packed tokens in 7 sequences, backward, AdamW step.
Variants, timed interleaved in one run:
- before: attention through the dense (T, T) mask, torch's own GEMMs (oneDNN off), nothing
  prepacked: what the trainer did before these techniques;
- no prepack: today's defaults but `train.prepack=false`;
- ours: today's defaults (per-sequence attention, oneDNN GEMMs for the float32 head,
  frozen linears prepacked);
- `--compile`: "no prepack" plus `train.compile` (regional torch.compile, Inductor's C++
  backend; the trainer does not prepack under compile: dynamo cannot trace packed weights).
Prints a markdown table (ms per step, ratio to "before", loss) and, with --profile, one of
self CPU ms per op group for "before" and "ours".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import common
import torch
from bench_loss import SMOLLM2_135M, chat_labels

from slipstream.memory.host_heap import keep_freed_memory
from slipstream.ops import attention, frozen_linear, onednn

COLUMNS = ["variant", "dtype", "ms/step", "vs before", "cpu ms/step", "cpu vs before", "loss"]
GROUP_COLUMNS = ["group", "before ms", "ours ms"]
# Op name fragments -> group, first match wins (torch.profiler self CPU time per op).
GROUPS = [
    ("attention", ("attention", "sdpa", "_flash", "softmax_backward", "_softmax")),
    ("GEMM", ("mkldnn::", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")),
    ("LM head softmax/CE", ("logsumexp", "aten::exp", "gather", "scatter_add")),
    ("optimizer", ("adam", "_foreach", "lerp", "addcmul", "addcdiv")),
    ("copies and casts", ("copy_", "aten::to", "_to_copy", "aten::cat", "clone", "contiguous")),
    ("elementwise (norm, RoPE, SwiGLU, residual)", ("aten::",)),
]


def build(hf: dict, dtype: torch.dtype, variant: str):
    from slipstream.memory.offload import apply_checkpointing
    from slipstream.peft.lora import apply_lora

    model = common.build_random_model(hf, dtype=dtype)
    apply_lora(model, rank=16, alpha=32, targets="all-linear")
    if variant == "ours":  # not under compile: dynamo cannot trace oneDNN's packed weights
        frozen_linear.apply_prepacked_linears(model)
    apply_checkpointing(model, "recompute")
    if variant == "compile":
        from slipstream.compile import apply_compile

        apply_compile(model)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-4)


@contextlib.contextmanager
def techniques(variant: str):
    """`before` switches the CPU attention picker and oneDNN GEMMs back to the old paths."""
    if variant != "before":
        yield
        return
    wins, enabled = attention.per_sequence_wins, onednn.ENABLED
    attention.per_sequence_wins = lambda lengths: sum(lengths) > attention.DENSE_MASK_MAX_TOKENS
    onednn.ENABLED = False
    try:
        yield
    finally:
        attention.per_sequence_wins, onednn.ENABLED = wins, enabled


def group_of(name: str) -> str | None:
    for group, fragments in GROUPS:
        if any(f in name.lower() for f in fragments):
            return group
    return None


def profile(step) -> dict[str, float]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    groups: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        group = group_of(event.key)
        if group is not None:
            groups[group] += event.self_cpu_time_total / 1e3
    return dict(groups)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one rep: a smoke run")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5, help="timed steps per variant")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--compile", action="store_true", help="add ours + train.compile")
    ap.add_argument("--profile", action="store_true", help="self CPU time per op group")
    ap.add_argument("--json", help="also write the rows and run info to this file")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timing)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the trainer does on CPU (memory/host_heap.py), for every variant
    shape = {**SMOLLM2_135M, "num_hidden_layers": args.layers}
    tokens, reps = args.tokens, args.reps
    if args.quick:
        shape = {**shape, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "num_hidden_layers": 2}  # fmt: skip
        tokens, reps = 256, 1
    hf = common.hf_config("llama", **shape)
    dtype = getattr(torch, args.dtype)
    lengths = common.split_lengths(tokens, 7)
    ids, _, seq = common.random_batch(lengths, shape["vocab_size"])
    labels = chat_labels(ids, lengths, 0.38)
    positions = torch.tensor([t for t, y in enumerate(labels.tolist()) if y != -100])
    variants = ["before", "no prepack", "ours"] + (["compile"] if args.compile else [])
    built = {v: build(hf, dtype, v) for v in variants}
    losses: dict[str, float] = {}
    cpu_s: dict[str, list[float]] = {v: [] for v in variants}

    def step(variant: str):
        model, opt = built[variant]
        start = time.process_time()
        with techniques(variant):
            loss = model.loss(ids, labels, seq, reduction="sum", label_positions=positions)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[variant] = loss.item() / len(positions)
        cpu_s[variant].append(time.process_time() - start)

    fns = {v: (lambda v=v: step(v)) for v in variants}
    times = common.time_interleaved(fns, reps=reps, warmup=2 if args.compile else 1)
    # Process CPU time beside wall time: on shared cores the wall clock includes waiting for
    # a core; with one thread the CPU time is what an idle machine's wall clock would read.
    cpu = {v: statistics.median(ts[-reps:]) for v, ts in cpu_s.items()}
    rows = [
        {"variant": v, "dtype": args.dtype, "ms/step": times[v] * 1e3,
         "vs before": times["before"] / times[v], "cpu ms/step": cpu[v] * 1e3,
         "cpu vs before": cpu["before"] / cpu[v], "loss": losses[v]}
        for v in variants
    ]  # fmt: skip
    info = {**common.run_info(), "load": os.getloadavg()[0]}
    given = argv if argv is not None else sys.argv[1:]
    print(f"LoRA step, {tokens} tokens in 7 sequences, {shape['num_hidden_layers']} layers, "
          f"load average {info['load']:.1f}")  # fmt: skip
    print(common.header(info, " ".join(["python benchmarks/bench_cpu_step.py", *given])))
    print(common.markdown_table(rows, COLUMNS))
    groups = []
    if args.profile:
        before, ours = profile(fns["before"]), profile(fns["ours"])
        groups = [{"group": g, "before ms": before.get(g, 0.0), "ours ms": ours.get(g, 0.0)}
                  for g, _ in GROUPS]  # fmt: skip
        groups.append({"group": "total", "before ms": sum(before.values()),
                       "ours ms": sum(ours.values())})  # fmt: skip
        print(common.markdown_table(groups, GROUP_COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "lengths": lengths, "rows": rows, "groups": groups}, f)
    return rows


if __name__ == "__main__":
    main()
