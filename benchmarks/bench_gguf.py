"""A LoRA run exported to GGUF and scored in llama.cpp: held-out loss per type vs the merged model.

    python benchmarks/bench_gguf.py RUN_DIR [--types q8_0,q4_k_m] [--json out.json]

RUN_DIR is a LoRA run whose `data/eval.jsonl` holds the held-out chats (what `slipstream demo`
leaves). For each type the run is exported with `export_run_gguf` (merge, convert, quantize),
then every held-out chat is run through llama.cpp (llama-cpp-python) on the same token ids our
data pipeline makes; the loss is the mean next-token cross-entropy over the assistant tokens,
as the trainer's eval. The merged model's loss (float32, ours) is the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

COLUMNS = ["type", "file MiB", "held-out loss (llama.cpp)", "merged model (ours)", "delta"]


def held_out(run: Path, tokenizer) -> list:
    from slipstream.data.labels import encode_chat

    rows = [json.loads(line) for line in (run / "data" / "eval.jsonl").read_text().splitlines()]
    return [encode_chat(tokenizer, r["messages"], "assistant") for r in rows]


def nll(logits: np.ndarray, ex) -> tuple[float, int]:
    """Summed cross-entropy of ex's trainable tokens given logits (T, V) of its ids."""
    x = logits[:-1].astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    targets = np.array(ex.input_ids[1:])
    mask = np.array(ex.trainable[1:])
    picked = logp[np.arange(len(targets)), targets]
    return float(-(picked * mask).sum()), int(mask.sum())


def loss_llama_cpp(path: Path, examples: list) -> float:
    import llama_cpp

    n_ctx = max(len(e) for e in examples) + 8
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False,
                          n_threads=os.cpu_count() or 2)  # fmt: skip
    total, count = 0.0, 0
    for ex in examples:
        llm.reset()
        llm.eval(ex.input_ids)
        s, n = nll(np.asarray(llm.scores[: len(ex)]), ex)
        total, count = total + s, count + n
    return total / count


@torch.no_grad()
def loss_ours(model, examples: list) -> float:
    from slipstream.ops.packing import SeqInfo

    total, count = 0.0, 0
    for ex in examples:
        ids = torch.tensor(ex.input_ids)
        s, n = nll(model(ids, SeqInfo.from_lengths([len(ids)])).float().numpy(), ex)
        total, count = total + s, count + n
    return total / count


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="a LoRA run folder with data/eval.jsonl (e.g. runs/demo)")
    p.add_argument("--types", default="q8_0,q4_k_m")
    p.add_argument("--base", help="the base model (default: the adapter's), e.g. smollm2-demo")
    p.add_argument("--out-dir", help="where the GGUF files go (default: the run folder)")
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)
    from slipstream.checkpoint.adapter import load_adapter
    from slipstream.checkpoint.gguf_export import export_run_gguf
    from slipstream.checkpoint.hf import load_model
    from slipstream.checkpoint.tokenizer import load_tokenizer
    from slipstream.peft.lora import merge_lora
    from slipstream.sources import adapter_base

    run = Path(args.run)
    out_dir = Path(args.out_dir or run)
    tokenizer = load_tokenizer(str(run))
    examples = held_out(run, tokenizer)
    base = args.base or adapter_base(run)
    model = load_model(base)
    load_adapter(model, run)
    merge_lora(model)
    ref = loss_ours(model, examples)
    del model
    rows = []
    for t in args.types.split(","):
        start = time.perf_counter()
        path = export_run_gguf(run, t, out_dir / f"{run.resolve().name}.{t}.gguf", base=base)
        seconds = time.perf_counter() - start
        loss = loss_llama_cpp(path, examples)
        rows.append({"type": t, "file MiB": round(path.stat().st_size / 2**20, 1),
                     "held-out loss (llama.cpp)": round(loss, 4),
                     "merged model (ours)": round(ref, 4), "delta": round(loss - ref, 4),
                     "export s": round(seconds, 1)})  # fmt: skip
    tokens = sum(sum(e.trainable[1:]) for e in examples)
    print(f"{len(examples)} held-out chats, {tokens} assistant tokens, torch {torch.__version__}")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in COLUMNS) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
