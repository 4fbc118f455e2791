"""Packed metadata built once per forward vs rebuilt in every layer (CPU).

Run: `python benchmarks/bench_metadata.py` (under 2 minutes on 2 cores) or `--quick` (seconds).
Same random-initialised Qwen3-shaped model, same packed batch, two attention paths:
- ours: `attend` with the mask built once per batch from host lengths and cached on SeqInfo;
- baseline: every layer reads the boundaries back from the device (`.tolist()` of the
  lengths, `.item()` of the longest: two host syncs) and rebuilds its dense block-causal mask
  in a Python loop (`common.rebuild_attend`).
Each call gets a fresh SeqInfo (a new batch, as in training), so ours pays its one mask build
per forward too. Both take the dense-mask attention kernel (`attend` would run one call per
sequence at these lengths and build no mask at all: benchmarks/bench_attention.py), so the
two differ in the metadata only. Prediction: syncs 0 vs 2 per layer; mask builds 1 vs one
per layer; the time gap grows with depth. The metadata columns time that part alone (ours:
one mask build; baseline: one rebuild per layer), without the attention and MLP compute
around it.
Prints a markdown table measured in this one run.
"""

from __future__ import annotations

import argparse
import json

import common
import torch

from slipstream.debug import count_syncs
from slipstream.ops import attention
from slipstream.ops.attention import dense_causal_mask
from slipstream.ops.packing import SeqInfo

COLUMNS = [
    "layers",
    "ours ms",
    "baseline ms",
    "speedup",
    "ours metadata ms",
    "baseline metadata ms",
    "ours syncs",
    "baseline syncs",
    "ours mask builds",
    "baseline mask builds",
    "max abs diff",
]


def mask_builds(seq: SeqInfo) -> int:
    """Derived masks cached on `seq` after a forward: how many times ours built one."""
    return len(seq._cache)


def measure(layers: int, lengths: list[int], reps: int) -> dict:
    wins = attention.per_sequence_wins
    attention.per_sequence_wins = lambda lengths: False  # the dense-mask kernel, as the baseline
    try:
        return _measure(layers, lengths, reps)
    finally:
        attention.per_sequence_wins = wins


def _measure(layers: int, lengths: list[int], reps: int) -> dict:
    hf = common.hf_config("qwen3", **{**common.TINY, "num_hidden_layers": layers})
    model = common.build_random_model(hf).eval()
    ids, _, _ = common.random_batch(lengths, hf["vocab_size"])

    def ours():
        seq = SeqInfo.from_lengths(lengths)
        return model(ids, seq), seq

    def baseline():
        with common.per_layer_metadata() as stats:
            out = model(ids, SeqInfo.from_lengths(lengths))
        return out, stats.rebuilds

    def ours_metadata():  # what ours does per forward: one cached build
        dense_causal_mask(SeqInfo.from_lengths(lengths))

    def baseline_metadata():  # what the baseline does per forward: one rebuild per layer
        seq = SeqInfo.from_lengths(lengths)
        for _ in range(layers):
            common.rebuild_mask(seq)

    with torch.no_grad():
        with count_syncs() as ours_syncs:
            out_ours, seq = ours()
        with count_syncs() as base_syncs:
            out_base, rebuilds = baseline()
        times = common.time_interleaved({"ours": ours, "baseline": baseline}, reps=reps)
        meta = common.time_interleaved(
            {"ours": ours_metadata, "baseline": baseline_metadata}, reps=3 * reps
        )  # cheap and noisier than the forwards: more reps
    ours_s, base_s = times["ours"], times["baseline"]
    return {
        "layers": layers,
        "ours ms": ours_s * 1e3,
        "baseline ms": base_s * 1e3,
        "speedup": base_s / ours_s,
        "ours metadata ms": meta["ours"] * 1e3,
        "baseline metadata ms": meta["baseline"] * 1e3,
        "ours syncs": ours_syncs.total,
        "baseline syncs": base_syncs.total,
        "ours mask builds": mask_builds(seq),
        "baseline mask builds": rebuilds,
        "max abs diff": (out_ours - out_base).abs().max().item(),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one rep: a smoke run")
    ap.add_argument("--json", help="also write the rows and run info to this file")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timing)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.quick:
        depths, tokens, num_seqs, reps = (2, 4), 256, 4, 1
    else:
        depths, tokens, num_seqs, reps = (2, 16, 28), 1024, 16, 7
    lengths = common.split_lengths(tokens, num_seqs)
    rows = [measure(n, lengths, reps) for n in depths]
    info = common.run_info()
    command = "python benchmarks/bench_metadata.py" + (" --quick" if args.quick else "")
    print(f"Packed metadata, {tokens} tokens in {num_seqs} sequences, hidden 64, forward only")
    print(common.header(info, command))
    print(common.markdown_table(rows, COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "tokens": tokens, "lengths": lengths, "rows": rows}, f)
    return rows


if __name__ == "__main__":
    main()
