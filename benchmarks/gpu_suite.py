"""The GPU suite: one script, no network, at most 8 minutes on one H200.

Run: `python benchmarks/gpu_suite.py [--out FILE] [--budget-s 450]`; `--dry-run` runs the same
code paths with tiny shapes on CPU in seconds (the test suite does, so this never rots).
Writes JSON to `--out` (default `$OUT/gpu_suite.json` when OUT is set, else gpu_suite.json)
and prints a markdown table last.

Models are random-initialised with real shapes (no weights): Qwen3-0.6B, Qwen3-8B, when
the `gpt_oss` family exists a GPT-OSS-20B-shaped MoE, and last (the first rows the time
guard cuts) Qwen3.5-9B and Qwen3.5-35B-A3B (hybrid Gated DeltaNet; fla's kernels when
flash-linear-attention imports), Gemma 4 E4B (per-layer inputs, K/V sharing) and 26B-A4B
(MoE), and Qwen2.5-VL-7B on image rows (gpu_vision_row.py: 16 images of mixed grids packed
with their text, ~16k tokens, images/s beside tokens/s; the tower frozen, no MFU). Every text
row trains at 16k tokens per step (16 packed sequences), bf16, LoRA r=16
alpha=32 on all linear layers unless it says "full".
Step = summed loss / labelled tokens, backward, clip, fused AdamW, zero_grad.
- ours: everything on (LoRA, offload with double-buffered reloads, metadata built once);
- ablations: metadata cache off (per-layer rebuild, `common.rebuild_attend`), offload single
  buffer, offload off (recompute), MoE one-pass off (per-expert loop), regional compile;
- generation: `slipstream.generate` on the Qwen3-8B shape with the LoRA adapter unmerged,
  64 prompts x 256 new tokens, generated tokens/s and host syncs per call;
- GRPO (Qwen3-0.6B shape): one rollout (16 prompts of 64..192 tokens x G=8, up to 256
  sampled tokens each, random rewards) then one optimizer step on its packed sequences
  (offload on); generation and training seconds, tokens/s of each, syncs of the training
  part, peak memory;
- generic: the everything-on row on the generic family (transformers' Qwen3 modeling code
  with our attention function, offload and loss; docs/generic.md), Qwen3-0.6B shape;
- transformers + PEFT on the same shapes and LoRA settings, gradient checkpointing, the best
  attention the image has (flash_attention_2 if `flash_attn` imports, else flex_attention on
  CUDA, else sdpa), packed via position_ids when a runtime check shows that gives
  per-sequence results, padded otherwise; float32 adapters (peft's default), as ours.
MFU = (4·N·T with LoRA or 6·N·T full, + attention FLOPs) / step time / 989 TFLOP/s (H200 bf16
dense); N = active parameters; the trainer's formula, `slipstream/train/flops.py`.
Syncs per step: `count_syncs()` over one audited step (after warm-up), plus the number of
`torch.cuda.set_sync_debug_mode("warn")` warnings in that step. Warm-up steps are not timed;
`torch.cuda.synchronize()` runs only at the ends of each timed region. A failing row prints
its error and the suite goes on; a global time guard skips rows that would pass the budget.
The rows themselves: gpu_rows.py (ours, generation, GRPO; how a step is measured) and
hf_baseline.py (transformers + PEFT).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import traceback
from typing import Any

import common
import torch
from gpu_rows import OursCache, Setup, Variant, free_memory, generate_row, grpo_row, ours_row
from gpu_vision_row import MODEL as VISION_MODEL
from gpu_vision_row import shapes as vision_shapes
from gpu_vision_row import vision_row
from hf_baseline import hf_row

H200_PEAK = 989e12
SHAPES = common.REAL_SHAPES


def variants(has_moe_family: bool) -> list[Variant]:
    """Rows in priority order: what the targets need first, so the time guard cuts the rest."""
    rows = [  # the published targets first: Qwen3-8B vs transformers, MFU, offload cost
        Variant("ours, everything on", "qwen3-8b", need_s=45),
        Variant("transformers + PEFT", "qwen3-8b", impl="hf", need_s=60),
        Variant("offload off (recompute)", "qwen3-8b", ckpt="recompute"),
        Variant("generation: 64 prompts x 256 new tokens", "qwen3-8b", impl="generate", need_s=60),
        Variant("ours, everything on", "qwen3-0.6b", need_s=20),
        Variant("transformers + PEFT", "qwen3-0.6b", impl="hf", need_s=25),
        Variant(
            "GRPO step: 16 prompts x 8 completions x 256 tokens",
            "qwen3-0.6b",
            impl="grpo",
            need_s=60,
        ),
        Variant("metadata cache off (per-layer rebuild)", "qwen3-8b", metadata_cache=False),
        Variant("offload single buffer", "qwen3-8b", double_buffer=False),
        Variant("regional compile + everything on", "qwen3-8b", compile=True, need_s=120),
        Variant("full fine-tune, everything on", "qwen3-0.6b", lora=False),
        Variant("regional compile + everything on", "qwen3-0.6b", compile=True, need_s=60),
        # the generic family: transformers' Qwen3 modeling code under our packing, offload
        # and loss (docs/generic.md), against the native row above
        Variant(
            "generic (transformers' modeling code), everything on",
            "qwen3-0.6b",
            impl="generic",
            need_s=30,
        ),
    ]
    moe = [
        Variant("ours, everything on", "gpt-oss-20b", need_s=90),
        Variant("MoE one-pass off (per-expert loop)", "gpt-oss-20b", moe_one_pass=False,
                need_s=90),
        Variant("transformers + PEFT", "gpt-oss-20b", impl="hf", need_s=120),
    ]  # fmt: skip
    qwen35 = [  # last: the time guard cuts them first; `--only qwen3.5` runs them alone
        Variant("ours, everything on", "qwen3.5-9b", need_s=60),
        Variant("transformers + PEFT", "qwen3.5-9b", impl="hf", need_s=90),
        Variant("ours, everything on", "qwen3.5-35b-a3b", need_s=120),
        Variant("transformers + PEFT", "qwen3.5-35b-a3b", impl="hf", need_s=150),
    ]
    gemma4 = [  # last: the newest family's rows, cut first by the time guard
        Variant("ours, everything on", "gemma4-e4b", need_s=60),
        Variant("transformers + PEFT", "gemma4-e4b", impl="hf", need_s=90),
        Variant("ours, everything on", "gemma4-26b-a4b", need_s=90),
        Variant("transformers + PEFT", "gemma4-26b-a4b", impl="hf", need_s=120),
    ]
    vision = [  # image rows: cut by the time guard before the text rows above
        Variant("ours, everything on (image rows)", VISION_MODEL, impl="vision", need_s=90),
    ]
    if has_moe_family:
        return rows[:5] + moe[:1] + rows[5:] + moe[1:] + qwen35 + gemma4 + vision
    return rows + [Variant(v.name, v.model, impl="skip") for v in moe] + qwen35 + gemma4 + vision


class RowTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise RowTimeout("row ran past its share of the time budget")


def run_row(v: Variant, setup: Setup) -> dict:
    hf = setup.shapes.get(v.model, {})
    row: dict[str, Any] = {"model": v.model, "layers": hf.get("num_hidden_layers"),
                           "variant": v.name, "impl": v.impl}  # fmt: skip
    if v.impl == "skip":
        return {**row, "status": "skipped: no gpt_oss family in slipstream.models yet"}
    left = setup.deadline - time.monotonic()
    need = 0.5 if setup.dry else v.need_s
    if left < need:
        return {**row, "status": f"skipped: time guard ({left:.0f} s left, needs ~{need:.0f})"}
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, max(left, 1.0))
    t0 = time.monotonic()
    try:
        rows = {"hf": hf_row, "generate": generate_row, "grpo": grpo_row, "vision": vision_row}
        row.update(rows.get(v.impl, ours_row)(v, setup))
        row["status"] = "ok"
    except Exception as e:  # one failing row must not stop the suite
        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        row["traceback"] = traceback.format_exc(limit=6)
        OursCache.clear()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        free_memory()
    row["row s"] = time.monotonic() - t0
    if "step s" in row and v.impl == "vision":  # its own batch; MFU would need the tower's
        row["tokens/s"] = row["tokens"] / row["step s"]  # forward-only FLOPs: not given
    elif "step s" in row:
        tokens = sum(setup.lengths)
        row["tokens/s"] = tokens / row["step s"]
        flops = common.step_flops(hf, lora=v.lora)
        row["n_active"] = flops.n_active
        if setup.device.type == "cuda":
            row["MFU %"] = 100 * flops(setup.lengths) / row["step s"] / H200_PEAK
    return row


# ----------------------------------------------------------------------------- main

COLUMNS = ["model", "layers", "variant", "attention", "packing", "tokens/s", "images/s", "step s",
           "peak GB", "MFU %", "vs ours", "syncs/step", "cuda sync warnings", "H2D GB/s",
           "exposed copy ms/step", "status"]  # fmt: skip


def add_ratios(rows: list[dict]) -> None:
    """`vs ours`: this row's tokens/s over the same model's everything-on row."""
    base = {r["model"]: r["tokens/s"] for r in rows
            if r["variant"] == "ours, everything on" and r.get("tokens/s")}  # fmt: skip
    for r in rows:
        if r.get("tokens/s") and r["model"] in base and r["impl"] not in ("generate", "grpo"):
            r["vs ours"] = r["tokens/s"] / base[r["model"]]


def make_setup(args) -> Setup:
    deadline = time.monotonic() + args.budget_s
    if args.dry_run:
        tiny = {k: v for k, v in common.TINY.items()}
        shapes = {
            "qwen3-0.6b": common.hf_config("qwen3", **{**tiny, "tie_word_embeddings": True}),
            "qwen3-8b": common.hf_config("qwen3", **{**tiny, "num_hidden_layers": 3}),
        }
        from slipstream.models import FAMILIES

        if "gpt_oss" in FAMILIES:
            shapes["gpt-oss-20b"] = common.hf_config("gpt_oss", **tiny)
        linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, layer_types=["linear_attention",
                      "full_attention"], shared_expert_intermediate_size=32)  # fmt: skip
        for name, kind in (("qwen3.5-9b", "qwen3_5_text"), ("qwen3.5-35b-a3b", "qwen3_5_moe_text")):
            shapes[name] = common.hf_config(kind, **{**tiny, **linear})
        for name in ("gemma4-e4b", "gemma4-26b-a4b"):  # real per-layer structure, tiny sizes
            big = common.REAL_SHAPES[name]
            small = {
                **tiny,
                "num_hidden_layers": 4,
                "global_head_dim": 32,
                "sliding_window": 8,
                "vocab_size_per_layer_input": tiny["vocab_size"],
                "num_kv_shared_layers": 2 if big.get("num_kv_shared_layers") else 0,
            }
            keep = (
                "hidden_size_per_layer_input",
                "enable_moe_block",
                "attention_k_eq_v",
                "num_global_key_value_heads",
                "final_logit_softcapping",
                "top_k_experts",
            )
            small.update(
                {
                    k: min(big[k], 16) if k == "hidden_size_per_layer_input" else big[k]
                    for k in keep
                    if k in big
                }
            )
            small["layer_types"] = ["sliding_attention", "full_attention"] * 2
            shapes[name] = common.hf_config("gemma4_text", **small)
        shapes[VISION_MODEL] = vision_shapes(dry=True)
        lengths = common.split_lengths(192, 4)
        return Setup(torch.device("cpu"), torch.float32, lengths, 1, 1, True, deadline, shapes)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_suite: no CUDA device; use --dry-run for the CPU smoke run")
    shapes = {name: common.hf_config(s["model_type"], **{k: v for k, v in s.items()
                                                         if k != "model_type"})
              for name, s in SHAPES.items() if name != "gpt-oss-20b"}  # fmt: skip
    from slipstream.models import FAMILIES

    if "gpt_oss" in FAMILIES:
        s = SHAPES["gpt-oss-20b"]
        shapes["gpt-oss-20b"] = common.hf_config("gpt_oss", **{k: v for k, v in s.items()
                                                               if k != "model_type"})  # fmt: skip
    shapes[VISION_MODEL] = vision_shapes(dry=False)
    lengths = common.split_lengths(args.tokens, args.tokens // 1024)
    return Setup(torch.device("cuda"), torch.bfloat16, lengths, 2, 3, False, deadline, shapes)


def default_out() -> str:
    out = os.environ.get("OUT")
    return os.path.join(out, "gpu_suite.json") if out else "gpu_suite.json"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, seconds")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_suite.json)")
    ap.add_argument("--budget-s", type=float, default=450, help="time guard for all rows")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per step (GPU)")
    ap.add_argument("--only", default=None, help="run rows whose model contains this text")
    args = ap.parse_args(argv)
    started = time.monotonic()
    setup = make_setup(args)
    from slipstream.models import FAMILIES

    rows, paths = [], set()
    for v in variants("gpt_oss" in FAMILIES):
        if args.only and args.only not in v.model:
            continue
        path = (v.impl, v.lora, v.ckpt, v.double_buffer, v.metadata_cache, v.moe_one_pass,
                v.compile, "moe" if "oss" in v.model or "-a" in v.model else "dense",
                v.model.split("-")[0])  # fmt: skip
        if setup.dry and path in paths:  # same code path as a row above: seconds saved
            continue
        paths.add(path)
        row = run_row(v, setup)
        rows.append(row)
        print(f"[{time.monotonic() - started:6.1f} s] {v.model} / {v.name}: {row['status']}",
              {k: common.fmt(row.get(k)) for k in ("tokens/s", "step s", "peak GB", "MFU %")},
              flush=True)  # fmt: skip
        if row.get("traceback"):
            print(row["traceback"], flush=True)
    add_ratios(rows)
    info = common.run_info(setup.device)
    out = args.out or default_out()
    with open(out, "w") as f:
        report = {"info": info, "lengths": setup.lengths, "dry_run": setup.dry,
                  "seconds": time.monotonic() - started, "rows": rows}  # fmt: skip
        json.dump(report, f, indent=2, default=str)
    command = "python benchmarks/gpu_suite.py" + (" --dry-run" if setup.dry else "")
    print(f"\nGPU suite: {sum(setup.lengths)} tokens/step in {len(setup.lengths)} packed "
          f"sequences, {str(setup.dtype).removeprefix('torch.')}, LoRA r=16 a=32 all linear; "
          f"JSON: {out}; {time.monotonic() - started:.0f} s")  # fmt: skip
    print(common.header(info, command))
    print(common.markdown_table(rows, COLUMNS))
    return rows


if __name__ == "__main__":
    main()
