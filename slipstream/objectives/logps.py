"""Per-token and per-sequence log-probs of a packed batch, for objectives that score sequences
(DPO, ORPO, SimPO; GRPO's ratios).

One forward over the packed stream; the LM head runs only on the scored positions
(`positions`, host-built), each giving the log-prob of its target (`labels[t]`, the next
token). A sequence's log-prob is the sum of its scored tokens' log-probs: a segment sum
(`index_add_`) over host-built segment indices, so no host sync and no boolean mask. The
head goes through `model.loss(..., reduction="none")`, the entry point FSDP2 registers;
under DDP the trainer runs the whole objective loss inside the wrapper's forward.

Shapes: T tokens, N scored positions, S segments.
"""

from __future__ import annotations

import torch


def token_logps(
    model: torch.nn.Module,
    input_ids_T: torch.Tensor,
    labels_T: torch.Tensor,
    seq,
    positions_N: torch.Tensor,
    temperature: float = 1.0,
    images: dict | None = None,
) -> torch.Tensor:
    """log p(labels[t] | tokens <= t) at each scored position t: (N,) float32 (of logits /
    temperature when given); `images`: the batch's image inputs (data/vision.py
    `image_inputs`), for an image-text model."""
    kwargs: dict = {"temperature": temperature} if temperature != 1.0 else {}
    if images:
        kwargs["images"] = images
    return -model.loss(
        input_ids_T, labels_T, seq, reduction="none", label_positions=positions_N, **kwargs
    )


def segment_sums(
    values_N: torch.Tensor, segments_N: torch.Tensor, num_segments: int
) -> torch.Tensor:
    """(S,) sums of `values_N` by segment index (host-built, int64, each < num_segments)."""
    out_S = torch.zeros(num_segments, dtype=values_N.dtype, device=values_N.device)
    return out_S.index_add(0, segments_N, values_N)
