"""The model contract: what the trainer, offload, compile, distributed, generation and export
may assume of any model slipstream builds, native (`common.CausalLM`) or generic
(`generic.GenericCausalLM`). Nothing outside `slipstream/models/` reaches past it (into
`model.model.layers`, say).

Shapes: T tokens (flat, packed), D hidden, V vocab.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from slipstream.ops.packing import SeqInfo


@runtime_checkable
class LanguageModel(Protocol):
    """`model(input_ids_T, seq)` -> logits (T, V); `loss(...)` as `CausalLM.loss`."""

    config: object  # models.common.ModelConfig: model_type, hf (config.json), implementation

    def decoder_layers(self) -> nn.ModuleList:
        """The decoder layers, in order: what checkpointing/offload, compile and FSDP2 wrap."""
        ...

    def input_embeddings(self) -> nn.Module:
        """The token embedding module (its weight's device and dtype are the model's)."""
        ...

    def embed(self, input_ids_T: torch.Tensor, images: dict | None = None) -> torch.Tensor:
        """(T, D): the embedding stage. An image-text model runs its vision tower once over
        the batch's images and writes the features into the rows `images["image_rows"]`
        names (host-built: data/vision.py); `hidden_states`, `loss` and `model(...)` then
        take the same `images=`. A text model refuses images."""
        ...

    def lm_head_weight(self) -> torch.Tensor:
        """(V, D): the head's weight (the embedding's when tied)."""
        ...

    def finish_logits(self, logits_TV: torch.Tensor) -> torch.Tensor:
        """Raw head logits (h @ W^T) -> the model's logits (scaling, final softcap)."""
        ...

    def kv_layout(self) -> list[tuple[int, int, int]]:
        """(kv heads, head dim, layer whose KV cache it reads) of each layer (generation)."""
        ...

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (RoPE tables) after `to_empty`."""
        ...

    def hidden_states(self, input_ids_T: torch.Tensor, seq: SeqInfo) -> torch.Tensor: ...

    def loss(self, input_ids_T: torch.Tensor, labels_T: torch.Tensor, seq: SeqInfo, **kw): ...

    def __call__(self, input_ids_T: torch.Tensor, seq: SeqInfo) -> torch.Tensor: ...
