"""Qwen-VL's vision tower, packed and sync-free: Qwen2.5-VL's (window attention, RMSNorm,
gated MLP) and Qwen3-VL / Qwen3.5's (a learned position table resampled to each grid,
LayerNorm, plain MLP, Qwen3-VL's deepstack mergers), one module for both.

`tower(pixel_values, images) -> (feats_UD, deepstack)`: the patches of every image of a
micro-batch in one stream, no padding; each block's attention runs over the images' (or
windows') host-built boundaries (`images[SEQ]`, `images[WINDOW_SEQ]`: SeqInfo) through
slipstream's packed attention, bidirectional; every index (window order, rotary positions,
interpolation taps) comes from data/qwen_vit_meta.py, built on the host. transformers' tower
derives them from `grid_thw` inside its forward: 21 host syncs a training step on
Qwen2.5-VL, 14 on Qwen3-VL (`count_syncs`, tests/test_qwen_vit.py); this one has none.

Parameter names and shapes are transformers' `model.visual` (`patch_embed.proj`,
`blocks.{i}.attn.qkv`, `merger.mlp.0`, `deepstack_merger_list.{k}.linear_fc1`, ...), so state
dicts, peft target names, save_pretrained and exports are unchanged; `adopt(hf_visual)`
builds one around transformers' own parameter objects.

Shapes: N patches, U = N / merge^2 feature rows, D tower width, H heads, Dh head dim,
Do output width (the language model's).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.data.qwen_vit_meta import (
    INTERP_INDEX,
    INTERP_WEIGHT,
    ROTARY_POSITIONS,
    SEQ,
    WINDOW_INDEX,
    WINDOW_REVERSE,
    WINDOW_SEQ,
    VitGeometry,
    vision_config,
    vit_metadata,
)
from slipstream.models.common import RMSNorm
from slipstream.ops.attention import attend

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride over (C, t, p, p) patches: a matmul, written as one."""

    def __init__(self, cfg: Any, bias: bool) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel, bias=bias)

    def forward(self, pixels_NP: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        x_NP = pixels_NP.reshape(-1, w[0].numel()).to(w.dtype)
        return F.linear(x_NP, w.flatten(1), self.proj.bias)


class VisionRotary(nn.Module):
    """2-D rotary angles: a quarter of the head's frequencies by the patch's row, a quarter by
    its column, the half repeated (rotate-half layout)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq(head_dim, theta), persistent=False)

    def forward(self, positions_N2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = (positions_N2[..., None].float() * self.inv_freq).flatten(1)  # (N, Dh / 2)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def inv_freq(head_dim: int, theta: float, device: Any = None) -> torch.Tensor:
    half = head_dim // 2
    return 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float, device=device) / half)


def _rotate(x_NHD: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor) -> torch.Tensor:
    x = x_NHD.float()
    x1, x2 = x.chunk(2, dim=-1)
    out = x * cos_ND[:, None] + torch.cat([-x2, x1], dim=-1) * sin_ND[:, None]
    return out.to(x_NHD.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x_ND, seq, cos_sin) -> torch.Tensor:
        N = x_ND.shape[0]
        q, k, v = self.qkv(x_ND).view(N, 3, self.heads, -1).unbind(1)
        q, k = _rotate(q, *cos_sin), _rotate(k, *cos_sin)
        return self.proj(attend(q, k, v, seq, causal=False).reshape(N, -1))


class GatedMLP(nn.Module):  # Qwen2.5-VL
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        D, F_ = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(D, F_), nn.Linear(D, F_)
        self.down_proj = nn.Linear(F_, D)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):  # Qwen3-VL, Qwen3.5
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: Any, windowed: bool) -> None:
        super().__init__()
        D = cfg.hidden_size
        norm = (lambda: RMSNorm(D, 1e-6)) if windowed else (lambda: nn.LayerNorm(D, eps=1e-6))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(D, cfg.num_heads)
        self.mlp = GatedMLP(cfg) if windowed else PlainMLP(cfg)

    def forward(self, x_ND, seq, cos_sin) -> torch.Tensor:
        x_ND = x_ND + self.attn(self.norm1(x_ND), seq, cos_sin)
        return x_ND + self.mlp(self.norm2(x_ND))


class WindowMerger(nn.Module):
    """Qwen2.5-VL: RMSNorm per patch, then merge^2 patches -> one row by a 2-layer MLP."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.out_hidden_size)
        )

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x_ND).view(-1, self.width))


class Merger(nn.Module):
    """Qwen3-VL / Qwen3.5: LayerNorm per patch (or, deepstack's, per merged row), 2-layer MLP."""

    def __init__(self, cfg: Any, after_shuffle: bool = False) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.after_shuffle = after_shuffle
        self.norm = nn.LayerNorm(self.width if after_shuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        x = self.norm(x_ND.view(-1, self.width) if self.after_shuffle else x_ND)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x.view(-1, self.width))))


class QwenVisionTower(nn.Module):
    """The tower (module docstring); `cfg` transformers' vision config (`vision_config`)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.geometry = VitGeometry.of(cfg)
        windowed = self.geometry.kind == "window"
        self.patch_embed = PatchEmbed(cfg, bias=not windowed)
        if not windowed:
            self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.theta = cfg.rope_parameters["rope_theta"]
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.rotary_pos_emb = VisionRotary(self.head_dim, self.theta)
        self.blocks = nn.ModuleList(VisionBlock(cfg, windowed) for _ in range(cfg.depth))
        self.merger = WindowMerger(cfg) if windowed else Merger(cfg)
        self.full_blocks = set(cfg.fullatt_block_indexes) if windowed else set(range(cfg.depth))
        self.deepstack_visual_indexes = list(getattr(cfg, "deepstack_visual_indexes", None) or ())
        if self.deepstack_visual_indexes:
            self.deepstack_merger_list = nn.ModuleList(
                Merger(cfg, after_shuffle=True) for _ in self.deepstack_visual_indexes
            )

    @classmethod
    def from_config(cls, vision: Any, model_type: str | None = None) -> QwenVisionTower:
        """From transformers' vision config object or config.json's `vision_config` dict (with
        the checkpoint's `model_type`)."""
        return cls(vision_config(vision, model_type))

    @classmethod
    def adopt(cls, hf_visual: nn.Module) -> QwenVisionTower:
        """A tower around transformers' `model.visual` parameters (the same objects: nothing
        copied; their requires_grad, device and dtype kept)."""
        with torch.device("meta"):
            tower = cls(hf_visual.config)
        theirs, ours = dict(hf_visual.named_parameters()), dict(tower.named_parameters())
        assert theirs.keys() == ours.keys(), sorted(theirs.keys() ^ ours.keys())
        for name, p in theirs.items():
            assert p.shape == ours[name].shape, (name, p.shape, ours[name].shape)
            owner, _, leaf = name.rpartition(".")
            setattr(tower.get_submodule(owner), leaf, p)
        tower.reset_buffers()
        return tower.train(hf_visual.training)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @property
    def spatial_merge_size(self) -> int:
        return self.geometry.merge

    def reset_buffers(self) -> None:
        """The rotary frequencies, recomputed (after a build on the meta device)."""
        device = self.patch_embed.proj.weight.device
        self.rotary_pos_emb.inv_freq = inv_freq(self.head_dim, self.theta, device)

    def forward(
        self, pixel_values: torch.Tensor, images: dict[str, Any] | None = None, **hf_kwargs: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """-> ((U, Do) features of every image in order, [(U, Do)] deepstack features).
        Without `images`: transformers' own call (`visual(pixels, grid_thw=...)`, from its
        `get_image_features`, e.g. in its `generate`), answered as transformers' tower does."""
        if images is None:
            return self._transformers_call(pixel_values, hf_kwargs["grid_thw"])
        x_ND = self.patch_embed(pixel_values)
        if hasattr(self, "pos_embed"):  # the learned table, resampled by host-built taps
            taps = self.pos_embed(images[INTERP_INDEX]) * images[INTERP_WEIGHT][:, :, None]
            x_ND = x_ND + taps.sum(1).to(x_ND.dtype)
        cos_sin = self.rotary_pos_emb(images[ROTARY_POSITIONS])
        full, windows = images[SEQ], images.get(WINDOW_SEQ)
        unit = self.geometry.merge**2
        if windows is not None:  # the patches of each window together (units permuted)
            x_ND = x_ND.view(-1, unit, x_ND.shape[-1]).index_select(0, images[WINDOW_INDEX])
            x_ND = x_ND.flatten(0, 1)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x_ND = block(x_ND, full if i in self.full_blocks else windows, cos_sin)
            if i in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x_ND))
        feats_UD = self.merger(x_ND)
        if windows is not None:
            feats_UD = feats_UD.index_select(0, images[WINDOW_REVERSE])
        return feats_UD, deepstack

    def _transformers_call(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        """transformers' output object for its own callers: the metadata built from
        `grid_thw` read back to the host (one sync: transformers' path, not slipstream's)."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        device = pixel_values.device
        host = vit_metadata(grid_thw.tolist(), self.geometry)
        feats, deepstack = self(pixel_values, {k: v.to(device) for k, v in host.items()})
        if not self.deepstack_visual_indexes:
            return BaseModelOutputWithPooling(pooler_output=feats)
        from transformers.models.qwen3_vl.modeling_qwen3_vl import (
            BaseModelOutputWithDeepstackFeatures,
        )

        return BaseModelOutputWithDeepstackFeatures(
            pooler_output=feats, deepstack_features=deepstack
        )
