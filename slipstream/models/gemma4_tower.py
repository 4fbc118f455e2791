"""Gemma 4's image side (vision tower + pooler + embedder), run by slipstream over
transformers' own modules, with every index built on the host.

transformers' `Gemma4VisionModel` runs each image padded to the processor's `max_patches`,
masks the padding in every layer's attention, pools by a one-hot matrix over all padded
positions, strips empty pooled rows by a boolean index, and `get_image_features` reads the
per-image lengths on the host (5 syncs over six images, CPU). Here (data/gemma4_meta.py
builds the inputs):
- the tower sees only the images' real patches, (P, 3 * p * p) rows, no padding;
- the patch embedding is transformers' `input_proj` of 2 * (pixels - 0.5) plus the x and y
  rows of its position table;
- 2-D RoPE (Gemma 4's axial form): the first half of each head turns with the patch's x,
  the second with its y, each half rotate-half with the frequencies theta^(-4j/Dh);
- attention is bidirectional within each image (`attend(..., causal=False)` over the host
  lengths), scale 1 (q and k are RMS-normed), v normed without a scale;
- pooling is the mean of each k x k block, whose k^2 patches the collator put in
  consecutive rows: a reshape, no one-hot matrix, no boolean index.
The modules called are transformers' (`patch_embedder.input_proj`, each layer's four norms,
`self_attn.{q,k,v,o}_proj` with their clipping, `q_norm`, `k_norm`, `v_norm`, `mlp`, and
`embed_vision`), so LoRA on them, state dicts and saved adapters are unchanged.

Shapes: P patches (all images), D tower width, H heads, G key/value heads, Dh head dim,
Q = P / k^2 pooled rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream.data.gemma4_meta import PATCHES, POSITIONS, SEQ
from slipstream.ops.attention import attend


def axial_rope(positions_P2: torch.Tensor, head_dim: int, theta: float):
    """(cos, sin), each (P, Dh): Gemma 4's 2-D RoPE. Each head's halves turn by x and by y
    with the same Dh/4 frequencies theta^(-2j / (Dh/2)), repeated for the rotate-half pairing
    within each half."""
    half = head_dim // 2
    inv = 1.0 / theta ** (torch.arange(0, half, 2, device=positions_P2.device).float() / half)
    fx, fy = (positions_P2[:, i, None].float() * inv for i in (0, 1))
    angles = torch.cat([fx, fx, fy, fy], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope_2d(x_PHD: torch.Tensor, cos_PD: torch.Tensor, sin_PD: torch.Tensor) -> torch.Tensor:
    """Each half of the head rotated by its own axis's angles (rotate-half within a half)."""
    half = x_PHD.shape[-1] // 2
    out = []
    for part, c, s in zip(x_PHD.split(half, -1), cos_PD.split(half, -1), sin_PD.split(half, -1)):
        out.append(part * c[:, None] + _rotate_half(part) * s[:, None])
    return torch.cat(out, dim=-1)


def _layer(layer: nn.Module, x_PD, cos, sin, seq) -> torch.Tensor:
    """One encoder layer: sandwich-normed attention (q, k, v normed per head, 2-D RoPE on q
    and k), each image its own sequence, then the sandwich-normed gated MLP."""
    attn = layer.self_attn
    h = layer.input_layernorm(x_PD)
    q = attn.q_norm(attn.q_proj(h).unflatten(-1, (-1, attn.head_dim)))
    k = attn.k_norm(attn.k_proj(h).unflatten(-1, (-1, attn.head_dim)))
    v = attn.v_norm(attn.v_proj(h).unflatten(-1, (-1, attn.head_dim)))
    q, k = _rope_2d(q, cos, sin), _rope_2d(k, cos, sin)
    o = attend(q, k, v, seq, scale=attn.scaling, causal=False)
    x_PD = x_PD + layer.post_attention_layernorm(attn.o_proj(o.flatten(1)))
    return x_PD + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x_PD)))


def image_features(
    vision_tower: nn.Module, embed_vision: nn.Module, images: dict[str, Any]
) -> torch.Tensor:
    """(Q, D_text): every image's pooled, embedded soft tokens, in order (what
    `Gemma4Model.get_image_features` gives, concatenated). `images` holds the host-built
    inputs of data/gemma4_meta.py."""
    cfg = vision_tower.config
    embedder = vision_tower.patch_embedder
    proj = embedder.input_proj
    pixels = 2 * (images[PATCHES] - 0.5)
    x_PD = proj(pixels.to(proj.weight.dtype) if proj.weight.dtype.is_floating_point else pixels)
    positions = images[POSITIONS]
    table = embedder.position_embedding_table
    x_PD = x_PD + (table[0][positions[:, 0]] + table[1][positions[:, 1]])
    cos, sin = axial_rope(positions, cfg.head_dim, cfg.rope_parameters["rope_theta"])
    cos, sin = cos.to(x_PD.dtype), sin.to(x_PD.dtype)
    for layer in vision_tower.encoder.layers[: cfg.num_hidden_layers]:
        x_PD = _layer(layer, x_PD, cos, sin, images[SEQ])
    # The pooler: the mean of each k x k block (k^2 consecutive rows), back in the working
    # dtype as transformers' pooling matmul returns it, scaled by sqrt(D) in float32.
    k2 = cfg.pooling_kernel_size**2
    pooled = x_PD.float().unflatten(0, (-1, k2)).mean(1).to(x_PD.dtype)
    h_QD = pooled.float() * cfg.hidden_size**0.5
    if cfg.standardize:
        h_QD = (h_QD - vision_tower.std_bias.float()) * vision_tower.std_scale.float()
    return embed_vision(h_QD.to(x_PD.dtype))
