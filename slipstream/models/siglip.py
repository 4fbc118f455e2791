"""SigLIP vision tower and Gemma 3's multimodal projector, as Gemma3ForConditionalGeneration
holds them (`model.vision_tower.*`, `model.multi_modal_projector.*`: transformers' parameter
names below those prefixes, so adapters and exports keep them).

The tower: a patch convolution plus a learned position table, pre-norm encoder layers
(LayerNorm, attention with biases, gelu MLP), a final LayerNorm. SigLIP images are all one
size (the image processor resizes them to `image_size`), so the micro-batch's images are one
(N, C, H, W) batch with no padding, and each image's patches attend to one another densely:
one SDPA call over the whole batch, no mask, nothing read back to the host. The pooling head
of SigLIP (`vision_use_head`) is not used by Gemma 3 and not held.

The projector: each image's patch grid average-pooled to `mm_tokens_per_image` tokens, a
Gemma RMSNorm, then a (C, D) projection into the language model's width.

Shapes: N images, C tower width, P patches an image, Hv heads, Dv head dim, M tokens an image
after pooling, D the language model's width.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# SiglipVisionConfig's defaults for keys a config.json's vision_config may leave out.
DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # -> F.gelu's `approximate`


@dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    gelu_approximate: str
    layer_norm_eps: float

    @classmethod
    def from_hf(cls, vision: dict[str, Any]) -> SiglipConfig:
        full = {**DEFAULTS, **vision}
        act = full["hidden_act"]
        if act not in ACTIVATIONS:
            raise ValueError(
                f"config.json: vision_config.hidden_act {act!r} is not supported; "
                f"supported: {', '.join(ACTIVATIONS)}."
            )
        for key in ("image_size", "patch_size"):
            if not isinstance(full[key], int):
                raise ValueError(f"config.json: vision_config.{key}={full[key]!r}: one int")
        return cls(
            **{k: full[k] for k in DEFAULTS if k != "hidden_act"},
            gelu_approximate=ACTIVATIONS[act],
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        C, p = cfg.hidden_size, cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, C, kernel_size=p, stride=p)
        self.position_embedding = nn.Embedding(cfg.patches_per_side**2, C)

    def forward(self, pixels_NCHW: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels_NCHW.to(self.patch_embedding.weight.dtype))
        return x.flatten(2).transpose(1, 2) + self.position_embedding.weight  # (N, P, C)


class SiglipAttention(nn.Module):
    """Dense bidirectional attention over each image's patches (all images one size)."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        C = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.k_proj, self.v_proj = nn.Linear(C, C), nn.Linear(C, C)
        self.q_proj, self.out_proj = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x_NPC: torch.Tensor) -> torch.Tensor:
        N, P, C = x_NPC.shape

        def heads(proj: nn.Linear) -> torch.Tensor:  # (N, Hv, P, Dv)
            return proj(x_NPC).view(N, P, self.num_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        o = F.scaled_dot_product_attention(q, k, v)  # (N, Hv, P, Dv): no mask, no padding
        return self.out_proj(o.transpose(1, 2).reshape(N, P, C))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = functools.partial(F.gelu, approximate=cfg.gelu_approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        C, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(C, eps=eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(C, eps=eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x_NPC: torch.Tensor) -> torch.Tensor:
        x_NPC = x_NPC + self.self_attn(self.layer_norm1(x_NPC))
        return x_NPC + self.mlp(self.layer_norm2(x_NPC))


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x_NPC: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x_NPC = layer(x_NPC)
        return x_NPC


class SiglipVisionTower(nn.Module):
    """Pixels (N, C_in, H, W), every image resized to `image_size` -> (N, P, C) features."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels_NCHW: torch.Tensor) -> torch.Tensor:
        size = self.config.image_size
        if tuple(pixels_NCHW.shape[-2:]) != (size, size):  # shapes only: no sync
            raise ValueError(
                f"pixel_values are {tuple(pixels_NCHW.shape[-2:])} but the vision tower takes "
                f"{size}x{size} images; the data's image processor does not match this model"
            )
        return self.post_layernorm(self.encoder(self.embeddings(pixels_NCHW)))


class Gemma3MultiModalProjector(nn.Module):
    """(N, P, C) tower features -> (N, M, D): average pool to M tokens, RMSNorm, project."""

    def __init__(self, cfg: SiglipConfig, tokens_per_image: int, dim: int, norm: nn.Module):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(cfg.hidden_size, dim))
        self.mm_soft_emb_norm = norm
        self.side = cfg.patches_per_side
        tokens_per_side = int(tokens_per_image**0.5)
        if tokens_per_side**2 != tokens_per_image or self.side % tokens_per_side:
            raise ValueError(
                f"config.json: mm_tokens_per_image={tokens_per_image} must be a square whose "
                f"side divides the tower's {self.side} patches a side"
            )
        self.kernel = self.side // tokens_per_side

    def forward(self, x_NPC: torch.Tensor) -> torch.Tensor:
        N, _, C = x_NPC.shape
        grid = x_NPC.transpose(1, 2).reshape(N, C, self.side, self.side)
        pooled_NMC = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        out = self.mm_soft_emb_norm(pooled_NMC) @ self.mm_input_projection_weight
        return out.type_as(x_NPC)
