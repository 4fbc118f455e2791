"""CPU attention over packed batches: one call with a dense (T, T) mask vs one call per sequence.

Run: `python benchmarks/bench_attention.py` (a few minutes on 2 cores) or `--quick` (seconds).
Forward + backward of the two CPU paths of `slipstream.ops.attention` on SmolLM2-135M's
attention shape (9 query heads, 3 kv heads, head dim 64), for packed batches of T tokens in
N equal sequences, and which one `attend` picks (`per_sequence_wins`, from the host lengths).
- dense: `sdpa_masked` with the block-diagonal causal mask (every cross-sequence score is
  computed and thrown away: T^2 scores);
- per-sequence: `_sdpa_per_sequence`, one causal SDPA call per sequence (sum(n^2) scores,
  plus a fixed cost per call).
Prediction: per-sequence wins by about T^2 / sum(n^2) = N once the sequences are long enough
that the per-call cost is small (T/N >~ 32), and loses only for many tiny sequences.
Prints a markdown table; ratios come from interleaved timing in this one run.
"""

from __future__ import annotations

import argparse
import json
import sys

import common
import torch

from slipstream.ops import attention
from slipstream.ops.packing import SeqInfo

COLUMNS = ["dtype", "T", "N", "len", "dense ms", "per-seq ms", "speedup", "picked", "max diff"]
GRID = [(128, 16), (128, 4), (256, 32), (256, 8), (512, 64), (512, 8), (1024, 128),
        (1024, 64), (1024, 8), (1024, 1), (2048, 16), (4096, 32), (4096, 4)]  # fmt: skip


def measure(T: int, N: int, dtype: torch.dtype, reps: int, heads=(9, 3, 64)) -> dict:
    H, G, Dh = heads
    lengths = [T // N] * N
    lengths[-1] += T - sum(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, Dh, generator=g, dtype=dtype).requires_grad_() for h in (H, G, G))
    grad = torch.randn(T, H, Dh, generator=g, dtype=dtype)

    def dense():
        seq = SeqInfo.from_lengths(lengths)  # a new batch: the mask is built each call
        out = attention._in_float32(attention.sdpa_masked)(
            q, k, v, attention.dense_causal_mask(seq), None
        )
        out.backward(grad)
        return out.detach()

    def per_sequence():
        seq = SeqInfo.from_lengths(lengths)
        out = attention._sdpa_per_sequence(q, k, v, seq, None, None)
        out.backward(grad)
        return out.detach()

    diff = (dense() - per_sequence()).abs().max().item()
    times = common.time_interleaved({"d": dense, "p": per_sequence}, reps=reps, warmup=0)
    picked = attention.per_sequence_wins(lengths)
    return {
        "dtype": str(dtype).removeprefix("torch."), "T": T, "N": N, "len": T // N,
        "dense ms": times["d"] * 1e3, "per-seq ms": times["p"] * 1e3,
        "speedup": times["d"] / times["p"], "picked": "per-seq" if picked else "dense",
        "max diff": diff,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one rep: a smoke run")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per contender")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    ap.add_argument("--json", help="also write the rows and run info to this file")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timing)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = (
        [torch.float32, torch.bfloat16] if args.dtype == "both" else [getattr(torch, args.dtype)]
    )
    grid, reps, heads = GRID, args.reps, (9, 3, 64)
    if args.quick:
        grid, reps, heads, dtypes = [(64, 8), (256, 2)], 1, (2, 1, 16), [torch.float32]
    rows = [measure(T, N, dt, reps, heads) for dt in dtypes for T, N in grid]
    info = common.run_info()
    given = argv if argv is not None else sys.argv[1:]
    print(common.header(info, " ".join(["python benchmarks/bench_attention.py", *given])))
    print(common.markdown_table(rows, COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f)
    return rows


if __name__ == "__main__":
    main()
