"""The Gated DeltaNet token mixer of Qwen3.5 / Qwen3-Next (`linear_attn` in HF's tree).

x -> in_proj_qkv -> causal depthwise conv (kernel W, per packed sequence) -> SiLU -> split
q (Hk, K), k (Hk, K), v (H, V); beta = sigmoid(in_proj_b x), log decay
g = -exp(A_log) * softplus(in_proj_a x + dt_bias); the gated delta rule over each packed
sequence (ops/gated_delta.py); a per-head RMSNorm gated by SiLU(in_proj_z x); out_proj.
Parameter names are transformers' (`Qwen3_5GatedDeltaNet`), so checkpoints load by name and
LoRA on its five linears gets peft's keys.

Shapes: T tokens, D hidden, H value heads, Hk key heads, K key head dim, V value head dim,
C = 2 Hk K + H V conv channels, W conv width, J = W - 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.ops.gated_delta import causal_conv, gated_delta_rule
from slipstream.ops.packing import SeqInfo


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's V features (plain weight, ones init), times SiLU(gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * x32.to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden: int,
        heads: int,
        key_heads: int,
        key_dim: int,
        value_dim: int,
        conv_width: int,
        eps: float,
    ) -> None:
        super().__init__()
        if heads % key_heads:
            raise ValueError(
                f"config.json: linear_num_value_heads={heads} must be a multiple of "
                f"linear_num_key_heads={key_heads}."
            )
        self.num_v_heads, self.num_k_heads = heads, key_heads
        self.head_k_dim, self.head_v_dim = key_dim, value_dim
        self.key_size, self.value_size = key_heads * key_dim, heads * value_dim
        C = 2 * self.key_size + self.value_size
        self.conv1d = nn.Conv1d(C, C, conv_width, bias=False, groups=C, padding=conv_width - 1)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.empty(heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = nn.Linear(self.value_size, hidden, bias=False)
        self.in_proj_qkv = nn.Linear(hidden, C, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_size, bias=False)
        self.in_proj_b = nn.Linear(hidden, heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, heads, bias=False)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One row's generation state: conv (C, J) and recurrent (H, K, V)."""
        C, W = self.conv1d.weight.shape[0], self.conv1d.weight.shape[-1]
        return (C, W - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, x_TD: torch.Tensor, seq: SeqInfo, cos_sin=None) -> torch.Tensor:
        T, H, Hk = x_TD.shape[0], self.num_v_heads, self.num_k_heads
        mixed_TC = F.silu(causal_conv(self.in_proj_qkv(x_TD), self.conv1d.weight[:, 0], seq))
        q_TC, k_TC, v_TC = mixed_TC.split([self.key_size, self.key_size, self.value_size], -1)
        q_THK = q_TC.reshape(T, Hk, self.head_k_dim).repeat_interleave(H // Hk, dim=1)
        k_THK = k_TC.reshape(T, Hk, self.head_k_dim).repeat_interleave(H // Hk, dim=1)
        v_THV = v_TC.reshape(T, H, self.head_v_dim)
        beta_TH = self.in_proj_b(x_TD).sigmoid()
        g_TH = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x_TD).float() + self.dt_bias)
        o_THV = gated_delta_rule(q_THK, k_THK, v_THV, g_TH, beta_TH, seq)
        z_THV = self.in_proj_z(x_TD).view(T, H, self.head_v_dim)
        return self.out_proj(self.norm(o_THV, z_THV).reshape(T, -1))


def recurrent_state_shapes(model: nn.Module) -> list[tuple[tuple[int, int], tuple[int, int, int]]]:
    """One row's (conv, recurrent) state shape for each Gated DeltaNet layer, in layer order:
    what a generation cache holds beside the attention layers' keys and values."""
    return [
        m.state_shapes()
        for layer in model.decoder_layers()
        for m in layer.modules()
        if isinstance(m, GatedDeltaNet)
    ]
