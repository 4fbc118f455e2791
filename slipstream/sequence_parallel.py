"""`train.sequence_parallel: N` under torchrun: the device mesh (data x sequence), the checks of
what can be split, and each micro-batch cut into this rank's shard on the host.

Mesh: world = D x N ranks; rank = d * N + s, so a sequence-parallel group is N consecutive
ranks (one node's GPUs, where the all-to-alls are cheap). The N ranks of a group draw the
same micro-batches (the data-parallel rank d picks them) and each keeps a contiguous
1/N of its tokens (ops/ulysses.py: the split, and attention by two all-to-alls).

Why the step equals one process's: each rank's summed loss covers its own tokens, so the
objective's weight (labelled tokens) and the loss add up over the group as over data-parallel
ranks; the trainer already sums both over all ranks. DDP (or FSDP2) spans all D x N ranks
and averages gradients over them; each rank's gradient is of the whole group's loss
(attention's backward all-to-alls bring the other ranks' share to its tokens), so with the
loop's `loss * world / weight` their mean is the one-process gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from slipstream import distributed as dist


@dataclass(frozen=True)
class Mesh:
    """This rank's place: data-parallel rank and size, sequence-parallel rank and size."""

    dp_rank: int = 0
    dp_size: int = 1
    sp_rank: int = 0
    sp_size: int = 1
    sp_group: Any = None

    def shard(self, batch: Any) -> Any:
        """This rank's shard of a host-built batch (the batch itself without sequence
        parallelism)."""
        return batch if self.sp_size == 1 else shard_batch(batch, self)


def build_mesh(sequence_parallel: int) -> Mesh:
    """The run's mesh, once, after `distributed.init` (every rank builds every group)."""
    world, rank = dist.world_size(), dist.rank()
    n = sequence_parallel
    if n == 1:
        return Mesh(dp_rank=rank, dp_size=world)
    if world % n:
        raise ValueError(
            f"train.sequence_parallel={n} needs torchrun with a multiple of {n} processes; "
            f"this run has {world}"
        )
    groups = [tdist.new_group(list(range(d * n, (d + 1) * n))) for d in range(world // n)]
    return Mesh(rank // n, world // n, rank % n, n, groups[rank // n])


def check_model(model: Any, n: int) -> None:
    """A one-line error for a model the split cannot serve (before any step)."""
    if n == 1:
        return
    cfg = model.config
    key = f"train.sequence_parallel={n}"
    generic = getattr(cfg, "implementation", "native") != "native"
    if generic:
        _check_generic(model, key)
    recurrent = [] if generic else _non_attention_layers(model)
    if recurrent:
        kinds = ", ".join(sorted({k for _, k in recurrent}))
        raise ValueError(
            f"{key}: {len(recurrent)} layers of {cfg.model_type} ({kinds}, first layer "
            f"{recurrent[0][0]}) carry a state from token to token, which a rank cannot start "
            "without the previous shard's; sequence parallelism splits attention layers only"
        )
    H = cfg.num_attention_heads
    kv = [g for g, _, _ in model.kv_layout()]  # per layer (Gemma 4's differ)
    G = next((g for g in kv if g % n), kv[0])
    if H % n or G % n:
        raise ValueError(
            f"{key} must divide the attention heads ({H} query, {G} key/value heads of "
            f"{cfg.model_type}): each rank attends over 1/{n} of them; use a divisor of {G}"
        )
    if model.rope_switch_length is not None:
        raise ValueError(
            f"{key}: {cfg.model_type}'s RoPE picks its tables from each whole sequence's length "
            "(long RoPE), which a shard does not see; train without sequence parallelism"
        )
    if getattr(model, "router_aux_loss_coef", 0.0) > 0:
        raise ValueError(
            f"{key}: the MoE load-balancing loss needs every token's routing at once; "
            "set train.router_aux_loss_coef=0"
        )


def _check_generic(model: Any, key: str) -> None:
    """transformers' modeling code (models/generic.py): its softmax attention goes through our
    attention function, so `attend` does the shard's all-to-alls (ops/ulysses.py) and RoPE
    reads each token's position from the shard's `SeqInfo` (the position ids the backbone is
    given); refused: what a shard cannot compute alone."""
    from slipstream.models.generic import GenericCausalLM

    cfg = model.config
    if model.per_sequence:  # generic_hooks.per_sequence_mixers: they carry a state
        first = model.per_sequence[0]
        mixer = model.decoder_layers().get_submodule(first.removeprefix("layers."))
        cls = type(mixer).__name__.removeprefix("PerSequence")
        raise ValueError(
            f"{key}: {first} of {cfg.model_type} ({cls}; {len(model.per_sequence)} such "
            "layers) carries a state from token to token, which a rank cannot start without "
            "the previous shard's; sequence parallelism splits softmax attention layers only"
        )
    if type(model) is not GenericCausalLM:
        raise ValueError(
            f"{key}: {cfg.model_type} is an image-text model (its positions come from its "
            "images); sequence parallelism serves text models only"
        )
    dynamic = sorted(t for t in _rope_types(cfg.hf) if "dynamic" in t or t == "longrope")
    if dynamic:
        raise ValueError(
            f"{key}: {cfg.model_type}'s RoPE ({dynamic[0]}) picks its tables from the longest "
            "position in the forward, which a shard does not see; train without sequence "
            "parallelism"
        )


def _rope_types(hf: Any) -> set[str]:
    """Every `rope_type` in a config.json dict (per layer kind, text config included)."""
    if isinstance(hf, dict):
        found = {v for k, v in hf.items() if k == "rope_type" and isinstance(v, str)}
        return found.union(*(_rope_types(v) for v in hf.values()))
    return set()


def _non_attention_layers(model: Any) -> list[tuple[int, str]]:
    """(index, token mixer class) of each decoder layer that mixes tokens by other means
    than softmax attention (Qwen3.5's Gated DeltaNet: an exact split would need a scan of
    the state across ranks, not built)."""
    from slipstream.models.common import Attention

    out = []
    for i, layer in enumerate(model.decoder_layers()):
        if not isinstance(getattr(layer, "self_attn", None), Attention):
            skip = ("input_layernorm", "post_attention_layernorm", "mlp")
            mixers = [type(m).__name__ for n, m in layer.named_children() if n not in skip]
            out.append((i, "/".join(mixers) or type(layer).__name__))
    return out


def check_objective(objective: Any, n: int) -> None:
    if n > 1 and objective.name != "sft":
        raise ValueError(
            f"train.sequence_parallel={n} supports train.objective=sft (a loss summed per "
            f"token); {objective.name}'s per-sequence sums would span ranks"
        )


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """A host-built SFT batch (`PackedBatch`) cut to this rank's tokens: input ids, labels and
    the scored positions in its slice, its `SeqInfo` with the whole batch's for attention."""
    from slipstream.data.packed import PackedBatch
    from slipstream.ops.ulysses import shard_seq

    if batch.fields:
        raise ValueError(
            f"train.sequence_parallel={mesh.sp_size} cannot split a batch with "
            f"{', '.join(sorted(batch.fields))} (image features); train text only"
        )
    seq, part = shard_seq(batch.seq, mesh.sp_rank, mesh.sp_size, mesh.sp_group)
    labels = batch.labels[part].clone()
    positions = batch.label_positions
    if positions is not None:
        cut = torch.searchsorted(positions, positions.new_tensor([part.start, part.stop]))
        lo, hi = cut.tolist()  # a host tensor: no device sync
        positions = positions[lo:hi] - part.start
        num_labels = hi - lo
    else:
        num_labels = int((labels != -100).sum())
    return PackedBatch(batch.input_ids[part].clone(), labels, seq, num_labels, positions)
