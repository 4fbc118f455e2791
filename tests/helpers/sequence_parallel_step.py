"""Run under torchrun by tests/test_sequence_parallel.py (2 gloo ranks, CPU, float32): for a few
tiny native models (GQA llama; GPT-OSS: sinks, a sliding window, MoE; Gemma 3: local and
global RoPE, windows) and generic ones (transformers' modeling code: OLMo 2, Mixtral without
its router loss), one training step on a packed batch of uneven sequences (the longest
spans both ranks' shards) split by `train.sequence_parallel`'s code, against the same step
on the whole batch in this process. The ranks' summed losses and all-reduced gradients must
equal the whole batch's. Also the live-tensor peak of both steps (activations, not weights).
Writes OUT/rank-R.json, for the model types named after OUT (default: every one).

Usage (PYTHONPATH=.:tests): python -m torch.distributed.run --nproc_per_node 2
    -m helpers.sequence_parallel_step OUT [MODEL_TYPE ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

from slipstream import distributed as dist
from slipstream.data.packed import PackedBuilder
from slipstream.memory.offload import apply_checkpointing
from slipstream.memory.tracker import LiveTensors
from slipstream.models import family_for
from slipstream.objectives.sft import SFT
from slipstream.sequence_parallel import build_mesh

LENGTHS = [37, 5, 190, 13, 3]  # T = 248: 124 a rank; the 190 spans both

MODELS = {
    "llama": dict(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "gpt_oss": dict(
        vocab_size=97, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "gemma3_text": dict(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        query_pre_attn_scalar=24, sliding_window=16, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-6,
    ),
}  # fmt: skip
GENERIC = ("olmo2", "mixtral")  # tiny_hf's configs, built by models/generic.py


def build(model_type: str) -> torch.nn.Module:
    if model_type in GENERIC:
        from helpers.tiny_hf import tiny_config
        from slipstream.models import generic

        hf = tiny_config(model_type, vocab_size=97).to_dict()
        model = generic.build(generic.config_from_hf({**hf, "model_type": model_type}))
        model.router_aux_loss_coef = 0.0  # Mixtral's: refused under sequence parallelism
    else:
        family = family_for(model_type, "test")
        hf = {**MODELS[model_type], "model_type": model_type}
        model = family.build(family.config_from_hf(hf))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.float().train()


def batch():
    g = torch.Generator().manual_seed(1)
    builder = PackedBuilder()
    for n in LENGTHS:  # every other token scored: positions on both sides of the cut
        ids = torch.randint(0, 97, (n,), generator=g).tolist()
        builder.add(ids, [(a, a + 1) for a in range(1, n, 2)])
    return builder.build()


def step(model, b, weight: int) -> tuple[float, dict[str, torch.Tensor], int]:
    """(summed loss / weight, gradients, live-tensor peak above the start) of one step."""
    model.zero_grad(set_to_none=True)
    with LiveTensors("cpu", include=list(model.parameters())) as live:
        loss, _ = SFT().micro_batch_loss(model, b)
        (loss / weight).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item() / weight, grads, live.peak - live.start


def main(out: str, model_types: list[str]) -> None:
    dist.init(torch.device("cpu"), timeout_s=60)
    mesh = build_mesh(2)
    results = {}
    for model_type in model_types or (*MODELS, *GENERIC):
        model = build(model_type)
        apply_checkpointing(model, "recompute")  # the recompute runs the all-to-alls again
        whole = batch()
        want_loss, want_grads, whole_peak = step(model, whole, whole.num_labels)
        mine = mesh.shard(whole)
        loss, grads, shard_peak = step(model, mine, whole.num_labels)
        summed = torch.tensor([loss, mine.num_labels], dtype=torch.float64)
        tdist.all_reduce(summed)
        worst = 0.0
        for name, g in grads.items():
            tdist.all_reduce(g)
            scale = want_grads[name].abs().max().item() + 1e-12
            worst = max(worst, (g - want_grads[name]).abs().max().item() / scale)
        results[model_type] = {
            "want_loss": want_loss, "loss": summed[0].item(),
            "labels": summed[1].item(), "want_labels": whole.num_labels,
            "tokens": mine.input_ids.numel(), "pieces": list(mine.seq.lengths),
            "starts": mine.seq.position_ids[mine.seq.cu_seqlens[:-1].long()].tolist(),
            "grad_rel_err": worst, "whole_peak": whole_peak, "shard_peak": shard_peak,
        }  # fmt: skip
    Path(out, f"rank-{dist.rank()}.json").write_text(json.dumps(results))
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
