"""The reference policy of preference (and KL-regularised RL) objectives, without a second
copy of the base model when training adapters.

Three kinds, chosen by `build_reference`:
- "base" (LoRA/DoRA, `reference: base`, or a fresh adapter, whose start *is* the base): the
  same model with every adapter module swapped for its base layer for the reference forward
  (what peft's `disable_adapter` computes, and TRL's reference for a PEFT model with no
  "ref" adapter). Exact: the adapter's matmuls do not run at all.
- "start" (LoRA/DoRA started from `model.adapter`, `reference: start`): a frozen snapshot
  of the trainable adapter tensors taken before the first step (TRL's reference when the
  starting adapter is also loaded under the name "ref"); for the reference forward the
  live tensors and the snapshot trade values, in place (under FSDP2, in each rank's
  shard). Costs one copy of the adapter, not the base.
- "copy" (full fine-tuning): a frozen deep copy of the model taken before training (or no
  reference at all when its log-probs are precomputed, `preference.precompute_reference`).

`with ref.active() as m:` runs under `no_grad` in eval mode (no LoRA dropout) with `m` the
module to call (the live model for "base" and "start", the copy for "copy").
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def adapter_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, adapter module) for every LoRA/DoRA linear and LoRA expert block."""
    from slipstream.peft.lora import LoRALinear
    from slipstream.peft.lora_experts import LoRAExperts

    found = []
    for parent in model.modules():
        for attr, child in parent.named_children():
            if isinstance(child, (LoRALinear, LoRAExperts)):
                found.append((parent, attr, child))
    return found


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The model with each adapter module replaced by its base layer, restored on exit."""
    swapped = adapter_modules(model)
    for parent, attr, module in swapped:
        setattr(parent, attr, module.base_layer)
    try:
        yield model
    finally:
        for parent, attr, module in swapped:
            setattr(parent, attr, module)


class ReferencePolicy:
    """See the module docstring. `kind` is "base", "start" or "copy"."""

    def __init__(self, model: nn.Module, kind: str) -> None:
        if kind not in ("base", "start", "copy"):
            raise ValueError(f"reference kind {kind!r}: use base, start or copy")
        self.model, self.kind = model, kind
        self.frozen: dict[str, torch.Tensor] = {}
        self.copy: nn.Module | None = None
        if kind == "start":  # by name: FSDP2 replaces the parameter objects after this
            self.frozen = {n: p.detach().clone() for n, p in trainable(model)}
        elif kind == "copy":
            self.copy = copy.deepcopy(model).requires_grad_(False).eval()

    @contextmanager
    def active(self) -> Iterator[nn.Module]:
        target = self.copy if self.kind == "copy" else self.model
        was_training = target.training
        target.eval()
        try:
            with torch.no_grad():
                if self.kind == "base":
                    with adapters_disabled(self.model) as m:
                        yield m
                elif self.kind == "start":
                    self._swap()
                    try:
                        yield self.model
                    finally:
                        self._swap()
                else:
                    yield target
        finally:
            target.train(was_training)

    def _swap(self) -> None:
        """Trade the values of the trainable tensors and the snapshot, in place.

        In place, not by `p.data = frozen`: FSDP2 (wrap_model, after the snapshot) replaces
        each parameter by a sharded DTensor and all-gathers from its own buffer, which only
        a write into this rank's shard (`to_local`, a view of that buffer) reaches.
        """
        for name, p in trainable(self.model):
            live, frozen = p.data, self.frozen[name]
            if isinstance(live, DTensor):
                if not isinstance(frozen, DTensor):  # the first swap since sharding
                    frozen = distribute_tensor(frozen, live.device_mesh, live.placements,
                                               src_data_rank=None)  # fmt: skip
                    self.frozen[name] = frozen  # this rank's shard; no communication
                live, frozen = live.to_local(), frozen.to_local()
            spare = live.clone()
            live.copy_(frozen)
            frozen.copy_(spare)


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def build_reference(model: nn.Module, *, full: bool, reference: str, from_adapter: bool):
    """The reference for a model about to be trained: "copy" for full fine-tuning, "start"
    for an adapter loaded from `model.adapter` with `reference: start`, else "base"."""
    if full:
        return ReferencePolicy(model, "copy")
    if reference == "start" and from_adapter:
        return ReferencePolicy(model, "start")
    return ReferencePolicy(model, "base")
