"""Run under torchrun by tests/test_distributed.py (2 gloo ranks, CPU): greedy generation on
an FSDP2-sharded model inside `distributed.gathered_for_generation`, each rank with its own
prompts and length and rank 1 with two calls (so the ranks run different numbers of
forwards), the first time before the root's first forward; then a training forward and
backward on the resharded model, then generation again. Writes OUT/rank-R.json: the
unsharded model's tokens and loss, and those of the sharded one.

Usage: python -m torch.distributed.run --nproc_per_node 2 fsdp_generation.py MODEL_DIR OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from slipstream import distributed as dist
from slipstream.checkpoint.hf import load_model
from slipstream.generation import engine
from slipstream.generation.sampling import Sampling
from slipstream.ops.packing import SeqInfo


def generate(model, rank: int) -> list[list[list[int]]]:
    """Rank 0: one call of 3 tokens a row; rank 1: two calls of 19 tokens a row."""
    prompts = [[5 + rank, 17, 33], [40, 41 + rank, 42, 43, 44]]
    steps = 3 if rank == 0 else 19
    calls = []
    for _ in range(rank + 1):
        rows = engine.run(model, prompts, max_new_tokens=steps, sampling=Sampling(0.0))
        calls.append([r.token_ids for r in rows])
    return calls


def batch() -> tuple[torch.Tensor, torch.Tensor, SeqInfo]:
    ids = torch.arange(3, 3 + 9) * 7 % 250
    return ids, torch.cat([ids[1:], torch.tensor([-100])]), SeqInfo.from_lengths([4, 5])


def loss_and_grad(model) -> tuple[float, torch.Tensor]:
    """A training forward and backward: (loss, the embedding's full gradient)."""
    loss = model.loss(*batch())
    loss.backward()
    return float(loss), dist.full_tensor(model.model.embed_tokens.weight.grad).clone()


def main(model_dir: str, out: str) -> None:
    dist.init(torch.device("cpu"), timeout_s=30)
    rank = dist.rank()
    model = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    want_tokens = generate(model, rank)
    want_loss, want_grad = loss_and_grad(model)
    model.zero_grad(set_to_none=True)
    dist.wrap_model(model, "fsdp", torch.device("cpu"))
    with dist.gathered_for_generation(model):
        first = generate(model, rank)
    resharded = all(hasattr(p, "full_tensor") for p in model.parameters())
    got_loss, got_grad = loss_and_grad(model)
    with torch.no_grad():  # the layers reshard after a forward again (the root does not)
        model.loss(*batch())
    layers_resharded = all(hasattr(p, "full_tensor") for p in model.model.layers.parameters())
    with dist.gathered_for_generation(model):
        second = generate(model, rank)
    result = {
        "want_tokens": want_tokens, "first": first, "second": second, "resharded": resharded,
        "layers_resharded": layers_resharded, "want_loss": want_loss, "got_loss": got_loss,
        "grad_max_diff": float((got_grad - want_grad).abs().max()),
    }  # fmt: skip
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
