"""Native Gemma 4 vs the generic family (transformers' modeling code) on one checkpoint, CPU.

Run: `python benchmarks/bench_gemma4.py [--reps 3] [--json FILE]` (minutes on 2 cores),
`--quick` (seconds, tiny shapes). Part 1 of bench_generic.py (`native_vs_generic`: the same
random checkpoint loaded both ways, LoRA r16 on q/k/v/o + gate/up/down (MoE: q/k/v/o; the
MLP names would put LoRA on the experts on both paths but on the dense MLP beside them only
natively), prepacked frozen linears, recompute checkpointing, a LoRA step on 1,024 packed
tokens in 7 sequences, timed interleaved; syncs of loss + backward) at two Gemma 4 shapes,
hidden 256, 6 layers alternating sliding (window 128) and full, vocab 8192, final softcap:
- dense, E2B/E4B-like: full layers with head dim 128 and 1 KV head, k = v, per-layer inputs
  (P = 64), the last 2 layers reusing earlier layers' K/V;
- MoE, 26B-A4B-like: 16 experts top-4 (width 128) beside the dense MLP, no per-layer inputs.

Prediction: native >= generic (the same GEMMs; the generic path adds transformers' Python
dispatch and, on the MoE rows, its router's separate softmax/top-k), 1.0-1.2x.
"""

from __future__ import annotations

import argparse
import json

import common
from bench_generic import COLUMNS, native_vs_generic

BASE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=128, vocab_size=8192,
            layer_types=["sliding_attention", "full_attention"] * 3,
            final_logit_softcapping=30.0, tie_word_embeddings=True,
            max_position_embeddings=4096)  # fmt: skip
SHAPES = {
    "dense": dict(BASE, vocab_size_per_layer_input=8192, hidden_size_per_layer_input=64,
                  num_kv_shared_layers=2),
    "moe": dict(BASE, hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=16,
                top_k_experts=4, moe_intermediate_size=128),
}  # fmt: skip


def quick(shape: dict) -> dict:
    small = dict(shape, hidden_size=64, intermediate_size=128, head_dim=16, global_head_dim=32,
                 vocab_size=512, num_hidden_layers=4, sliding_window=8,
                 layer_types=["sliding_attention", "full_attention"] * 2)  # fmt: skip
    if "vocab_size_per_layer_input" in small:
        small.update(vocab_size_per_layer_input=512, hidden_size_per_layer_input=16)
    if small.get("enable_moe_block"):
        small.update(num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    return small


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 1 rep: seconds")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="also write the rows and run info to this file")
    args = ap.parse_args(argv)
    from transformers.utils import logging

    logging.set_verbosity_error()
    tokens, reps = (128, 1) if args.quick else (1024, args.reps)
    rows = []
    for name, shape in SHAPES.items():
        got = native_vs_generic("gemma4_text", quick(shape) if args.quick else shape, tokens, reps)
        rows += [{**r, "model": f"gemma4_text ({name})"} for r in got]
    info = common.run_info()
    command = "python benchmarks/bench_gemma4.py" + (" --quick" if args.quick else "")
    print(f"Native Gemma 4 vs generic: a LoRA step, {tokens} tokens, median of {reps}")
    print(common.header(info, command))
    print(common.markdown_table(rows, COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f)
    return rows


if __name__ == "__main__":
    main()
