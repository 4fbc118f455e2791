"""Mistral 3's image side (Pixtral tower + patch merger + projector), run by slipstream over
transformers' own modules, with every index built on the host.

transformers' `PixtralVisionModel` convolves the padded pixel batch, cuts each image's patch
grid by its `image_sizes` (device values read on the host: a sync per image), attends over
all the batch's patches with one dense block-diagonal (P, P) mask, and the patch merger and
the feature split read the sizes again (11 syncs over two images, CPU). Here:
- the collator cuts each image's valid patches out of its (padded) pixels on the host, so the
  tower sees (P, C * p * p) patch rows with no padding (`pixtral_patches`);
- the patch convolution is a matmul with the conv weight flattened (same weights);
- 2-D RoPE (Pixtral's axial form: the even frequencies turn with the patch row, the odd
  with the column) over host-built (row, column) positions;
- attention is bidirectional within each image, one SDPA call per image over host lengths
  (work linear in each image's patches squared, not in the batch's);
- the patch merger's 2 x 2 unfold is a gather with a host-built index.
The modules called are transformers' (`patch_conv`, `ln_pre`, each layer's norms,
`attention.{q,k,v,o}_proj`, `feed_forward`, the projector's `norm`, `merging_layer`,
`linear_1`, `linear_2`), so LoRA on them, state dicts and saved adapters are unchanged.

Shapes: N images, P patches (all images), D tower width, H heads, Dh head dim, M = merge^2,
Q merged feature rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.data.pixtral_meta import MERGE_INDEX, PATCHES, POSITIONS, SEQ
from slipstream.ops.attention import attend


def axial_rope(positions_P2: torch.Tensor, head_dim: int, theta: float):
    """(cos, sin), each (P, Dh): Pixtral's 2-D RoPE. Of the head's frequencies
    theta^(-2k/Dh), the even k turn with the row and the odd with the column; the Dh/2 angles
    are repeated for the rotate-half pairing."""
    k = torch.arange(0, head_dim, 2, device=positions_P2.device).float()
    inv = 1.0 / theta ** (k / head_dim)
    pos = positions_P2.float()
    angles = torch.cat([pos[:, :1] * inv[0::2], pos[:, 1:] * inv[1::2]], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x_PHD: torch.Tensor, cos_PD: torch.Tensor, sin_PD: torch.Tensor) -> torch.Tensor:
    half = x_PHD.shape[-1] // 2
    rotated = torch.cat([-x_PHD[..., half:], x_PHD[..., :half]], dim=-1)
    return x_PHD * cos_PD[:, None] + rotated * sin_PD[:, None]


def _layer(layer: nn.Module, x_PD, cos, sin, seq) -> torch.Tensor:
    """One Pixtral layer: pre-norm attention with 2-D RoPE, each image its own sequence
    (`attend(..., causal=False)` over the host-built SeqInfo), then the gated MLP."""
    attn = layer.attention
    h = layer.attention_norm(x_PD)
    heads = attn.num_heads
    q, k, v = (p(h).unflatten(-1, (heads, -1)) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    o = attend(q, k, v, seq, scale=attn.scaling, causal=False)
    x_PD = x_PD + attn.o_proj(o.flatten(1))
    return x_PD + layer.feed_forward(layer.ffn_norm(x_PD))


def image_features(
    vision_tower: nn.Module,
    projector: nn.Module,
    feature_layer: int | Sequence[int],
    merge: int,
    images: dict[str, Any],
) -> torch.Tensor:
    """(Q, D_text): every image's merged, projected feature rows, in order (what
    `Mistral3Model.get_image_features` gives, concatenated). `images` holds the host-built
    inputs of data/pixtral_meta.py."""
    cfg = vision_tower.config
    weight = vision_tower.patch_conv.weight  # (D, C, p, p)
    x_PD = vision_tower.ln_pre(F.linear(images[PATCHES].to(weight.dtype), weight.flatten(1)))
    cos, sin = axial_rope(images[POSITIONS], cfg.head_dim, cfg.rope_parameters["rope_theta"])
    cos, sin = cos.to(x_PD.dtype), sin.to(x_PD.dtype)
    layers = vision_tower.transformer.layers
    wanted = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    wanted = [k % (len(layers) + 1) for k in wanted]  # hidden_states[k]: after k layers
    states = [x_PD]
    for layer in layers[: max(wanted)]:
        states.append(_layer(layer, states[-1], cos, sin, images[SEQ]))
    feats_PD = projector.norm(torch.cat([states[k] for k in wanted], dim=-1))
    # The patch merger: each merge x merge block's rows, channel-major (F.unfold's order).
    blocks_QMD = feats_PD.index_select(0, images[MERGE_INDEX]).unflatten(0, (-1, merge**2))
    merged_QD = projector.patch_merger.merging_layer(blocks_QMD.transpose(1, 2).flatten(1))
    return projector.linear_2(projector.act(projector.linear_1(merged_QD)))
