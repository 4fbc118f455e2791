"""LM head on the labelled positions only vs on every position (CPU).

Run: `python benchmarks/bench_loss.py` (under a minute on 2 cores) or `--quick` (seconds).
Forward + backward of `model.loss` (full fine-tune, every weight trainable) on a random
SmolLM2-135M-shaped model (vocab 49152, hidden 576, MLP 1536, 9 heads / 3 kv heads, tied
head), with fewer layers than its 30 so one run fits in a minute (`--layers`), on one packed
batch of `--tokens` tokens in 8 sequences. Two label densities: 38% of positions labelled
(chitchat with assistant-only labels) and every position but each sequence's last.
- full: `model.loss(ids, labels, seq)`: the head multiplies all T rows;
- positions: `model.loss(..., label_positions=...)`: the N labelled rows only.
Backend: our chunked `linear_cross_entropy` by default (what torch < 2.13 runs, and the
GPU machine's torch 2.11); `--backend torch` times torch 2.13's own op, whose CPU cost barely
moves with the row count at this vocabulary (docs/benchmarks.md).

Prediction (FLOPs): a training step costs 6*P*T for the P body weights, the attention scores
on top, and 6*V*D per row for the head (logits, grad of hidden, grad of head). Skipping the
unlabelled rows removes 6*V*D*(T - N). SmolLM2: V*D = 28.3M, the 30 layers 106.2M, so at
N/T = 0.38 the step does 1 - (0.62 * 28.3) / 134.5 = 0.87 of the work: 1.15x on the real
model; at 4 layers (14.2M body) 1.70x; at N/T = 1 nothing changes (1.0x, minus the
index_select). The "predicted" column is that ratio for the shapes measured. The softmax
and exp over the (rows, V) logits scale with the rows too and are not in the count.
Prints a markdown table measured in this one run.
"""

from __future__ import annotations

import argparse
import json
import sys

import common
import torch

from slipstream.ops import loss as loss_mod

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
    rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
)  # fmt: skip

COLUMNS = [
    "backend",
    "labelled",
    "layers",
    "T",
    "N",
    "full ms",
    "positions ms",
    "speedup",
    "predicted",
    "predicted 30 layers",
    "loss rel diff",
    "grad rel diff",
]


def chat_labels(ids_T: torch.Tensor, lengths: list[int], fraction: float) -> torch.Tensor:
    """Targets for the last `fraction` of each sequence (the 'assistant' part), else -100."""
    labels_T = torch.full_like(ids_T, -100)
    start = 0
    for n in lengths:
        k = min(n - 1, round(fraction * n))  # a sequence's last position has no target
        end = start + n - 1
        labels_T[end - k : end] = ids_T[end - k + 1 : end + 1]
        start += n
    return labels_T


def predicted_speedup(hf: dict, lengths: list[int], num_labels: int) -> float:
    """FLOPs of the full step / FLOPs with the head on `num_labels` rows (see docstring)."""
    V, D, L = hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"]
    heads, kv, Dh, F = (hf[k] for k in ("num_attention_heads", "num_key_value_heads",
                                         "head_dim", "intermediate_size"))  # fmt: skip
    body = L * (D * Dh * (2 * heads + 2 * kv) + 3 * D * F + 2 * D) + D
    T = sum(lengths)
    rest = 6 * body * T + common.step_flops(hf, lora=False).attention(lengths)
    return (rest + 6 * V * D * T) / (rest + 6 * V * D * num_labels)


def measure(hf: dict, lengths: list[int], fraction: float, reps: int) -> dict:
    model = common.build_random_model(hf)  # every weight trainable: a full fine-tune
    ids_T, _, seq = common.random_batch(lengths, hf["vocab_size"])
    labels_T = chat_labels(ids_T, lengths, fraction)
    # Built on the host from the label list, as the collator does.
    positions_N = torch.tensor([t for t, y in enumerate(labels_T.tolist()) if y != -100])

    def step(positions):
        model.zero_grad(set_to_none=True)
        loss = model.loss(ids_T, labels_T, seq, reduction="sum", label_positions=positions)
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    loss_full, grad_full = step(None)
    loss_pos, grad_pos = step(positions_N)
    times = common.time_interleaved(  # the two calls above were the warm-up
        {"full": lambda: step(None), "positions": lambda: step(positions_N)}, reps=reps, warmup=0
    )
    full_30 = {**hf, "num_hidden_layers": 30}
    return {
        "backend": "torch" if loss_mod.USE_TORCH_LCE else "chunked",
        "labelled": f"{positions_N.numel() / len(ids_T):.0%}",
        "layers": hf["num_hidden_layers"],
        "T": len(ids_T),
        "N": positions_N.numel(),
        "full ms": round(times["full"] * 1e3),  # whole ms: "2e+03" would hide digits
        "positions ms": round(times["positions"] * 1e3),
        "speedup": times["full"] / times["positions"],
        "predicted": predicted_speedup(hf, lengths, positions_N.numel()),
        "predicted 30 layers": predicted_speedup(full_30, lengths, positions_N.numel()),
        "loss rel diff": ((loss_pos - loss_full).abs() / loss_full.abs()).item(),
        "grad rel diff": ((grad_pos - grad_full).abs().max() / grad_full.abs().max()).item(),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one rep: a smoke run")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (SmolLM2 has 30)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens in the packed batch")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per contender")
    ap.add_argument(
        "--backend", choices=["chunked", "torch"], default="chunked",
        help="linear_cross_entropy backend (torch: torch's own op, torch >= 2.13)",
    )  # fmt: skip
    ap.add_argument("--json", help="also write the rows and run info to this file")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timing)")
    args = ap.parse_args(argv)
    if args.backend == "torch" and not loss_mod.USE_TORCH_LCE:
        raise SystemExit("--backend torch: this torch has no chunked linear_cross_entropy")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = {**SMOLLM2_135M, "num_hidden_layers": args.layers}
    tokens, reps = args.tokens, args.reps
    if args.quick:  # the same code on a narrow model
        shape = {**shape, "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "num_hidden_layers": 2}  # fmt: skip
        tokens, reps = 256, 1
    hf = common.hf_config("llama", **shape)
    lengths = common.split_lengths(tokens, 8)
    default_backend = loss_mod.USE_TORCH_LCE
    loss_mod.USE_TORCH_LCE = args.backend == "torch"  # the backend model.loss picks
    try:
        rows = [measure(hf, lengths, fraction, reps) for fraction in (0.38, 1.0)]
    finally:
        loss_mod.USE_TORCH_LCE = default_backend
    info = common.run_info()
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python benchmarks/bench_loss.py", *given])
    print(f"model.loss forward+backward, {tokens} tokens in 8 sequences, vocab "
          f"{shape['vocab_size']}, hidden {shape['hidden_size']}, full fine-tune")  # fmt: skip
    print(common.header(info, command))
    print(common.markdown_table(rows, COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "lengths": lengths, "rows": rows}, f)
    return rows


if __name__ == "__main__":
    main()
