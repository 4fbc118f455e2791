"""Phi-3 family (Phi3ForCausalLM: Phi-3/3.5-mini, Phi-3-medium, Phi-4, Phi-4-mini).

What differs from the Llama decoder:
- fused projections, under Hugging Face's names so weights and PEFT adapters match by name:
  `self_attn.qkv_proj` (D -> H*Dh + 2*G*Dh: q rows, then k, then v) and `mlp.gate_up_proj`
  (D -> 2F: gate rows, then up); no biases.
- partial rotary (`partial_rotary_factor`, 0.75 on Phi-4-mini; `rope.py` handles it).
- `longrope` scaling (Phi-3.5-mini, Phi-4-mini; legacy names `su`, `yarn`): inverse
  frequencies 1 / (ext * theta^(2i/R)) with ext = `short_factor` for a sequence of at most
  `original_max_position_embeddings` tokens and `long_factor` beyond, cos/sin scaled by
  sqrt(1 + ln(s) / ln(original)), s = max_position_embeddings / original (or `factor`).
  transformers picks the set once per forward by the batch's largest position + 1; here each
  packed sequence gets the set its own largest position + 1 picks (what transformers gives
  it alone), so packing never changes a sequence's result. Without a KV cache that is the
  sequence's length, read from the host; in generation (`seq.kv` set, decode positions
  continue a cached prefix) it is read per token on the device. Either way a batch with
  sequences on both sides blends per token on the device: no host sync. Generation that
  grows a sequence past `original_max_position_embeddings` recomputes it in full with the
  long set (`rope_switch_length`), as transformers' generate drops its cache there.
- `sliding_window` (2047 on Phi-3-mini-4k) on every layer, as for Mistral.

Shapes: T tokens, D hidden, H heads, G kv heads, Dh head dim, R rotary dims, F mlp width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.common import (
    Attention,
    Backbone,
    CausalLM,
    DecoderLayer,
    ModelConfig,
    base_config_from_hf,
    sliding_windows,
)
from slipstream.models.rope import RopeConfig, rope_cos_sin
from slipstream.models.spec import FamilySpec
from slipstream.models.weights import WeightMap
from slipstream.ops.packing import SeqInfo

LONGROPE_NAMES = ("longrope", "su", "yarn")  # transformers maps the legacy names to longrope


@dataclass(frozen=True)
class Phi3Rope:
    theta: float
    rotary_dim: int
    short_factor: tuple[float, ...] | None = None  # None: plain RoPE
    long_factor: tuple[float, ...] | None = None
    original_max: int = 4096
    attention_factor: float = 1.0
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Phi3Rope:
        """`rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x)."""
        params = dict(hf.get("rope_scaling") or {})
        params.update(hf.get("rope_parameters") or {})
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rotary_dim = RopeConfig(partial_rotary_factor=factor).rotary_dim(head_dim)
        rope_type = params.get("rope_type", params.get("type")) or "default"
        if rope_type == "default":
            return cls(theta, rotary_dim, partial_rotary_factor=factor)
        if rope_type not in LONGROPE_NAMES:
            raise ValueError(
                f"config.json: rope type {rope_type!r} is not supported for phi3; "
                "supported: default, longrope."
            )
        short, long = params.get("short_factor"), params.get("long_factor")
        for key, value in (("short_factor", short), ("long_factor", long)):
            if not isinstance(value, list) or len(value) != rotary_dim // 2:
                raise ValueError(
                    f"config.json: rope {key} must be a list of {rotary_dim // 2} numbers "
                    f"(rotary dims / 2), got {value!r:.60}."
                )
        # transformers lets the top-level key win over the one in the rope dict.
        original = hf.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings", 4096
        )
        scale = params.get("factor") or hf.get("max_position_embeddings", 4096) / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        return cls(
            theta, rotary_dim, tuple(short), tuple(long), int(original), float(attention), factor
        )

    def inv_freq(self, ext: tuple[float, ...] | None) -> torch.Tensor:
        """(R/2,) float32: 1 / (ext * theta^(2i/R)); ext None: plain RoPE."""
        R = self.rotary_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, R, 2, dtype=torch.int64).float() / R))
        return inv_freq if ext is None else inv_freq / torch.tensor(ext, dtype=torch.float32)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    rope = Phi3Rope.from_hf(hf)  # the checks, at load
    # The shared config gets plain RoPE over the rotary dims (its parser does not know
    # longrope); Phi3Backbone builds longrope's factor sets from `cfg.hf`.
    plain = {
        **hf,
        "rope_scaling": None,
        "rope_parameters": {"rope_theta": rope.theta},
        "partial_rotary_factor": rope.partial_rotary_factor,
    }
    # transformers' Phi3 has no biases whatever attention_bias/mlp_bias say (Phi-4-mini
    # writes both false).
    cfg = base_config_from_hf(
        plain, attention_bias=False, mlp_bias=False, rms_norm_eps=hf.get("rms_norm_eps", 1e-5)
    )
    cfg.hf = dict(hf)
    layer_windows(cfg)  # a malformed sliding_window fails at load, not at build
    return cfg


def layer_windows(cfg: ModelConfig) -> list[int | None]:
    """`sliding_window` (or None) on every layer, as for Mistral."""
    L = cfg.num_hidden_layers
    return sliding_windows(cfg.hf.get("sliding_window"), ["sliding_attention"] * L, L)


class Phi3Attention(Attention):
    """GQA attention with one fused `qkv_proj`: q rows, then k, then v."""

    def make_qkv_proj(self, D: int, bias: bool) -> None:
        H, G, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        self.qkv_proj = nn.Linear(D, (H + 2 * G) * Dh, bias=bias)

    def project_qkv(self, x_TD: torch.Tensor):
        T, H, G, Dh = x_TD.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x_TD).split([H * Dh, G * Dh, G * Dh], dim=-1)
        return q.view(T, H, Dh), k.view(T, G, Dh), v.view(T, G, Dh)


class Phi3MLP(nn.Module):
    """SwiGLU with gate and up fused in one `gate_up_proj` (gate first)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        gate_TF, up_TF = self.gate_up_proj(x_TD).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate_TF) * up_TF)


class Phi3Backbone(Backbone):
    """The shared backbone with longrope's two factor sets (short: the inherited `inv_freq`)."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module]) -> None:
        super().__init__(cfg, layers)
        self.phi3_rope = Phi3Rope.from_hf(cfg.hf)
        self.register_buffer("long_inv_freq", torch.empty_like(self.inv_freq), persistent=False)
        if self.phi3_rope.long_factor is not None:
            self.rope_switch_length = self.phi3_rope.original_max + 1
        self.reset_rope()

    def reset_rope(self) -> None:
        rope = self.phi3_rope
        self.rope_scale = rope.attention_factor
        with torch.no_grad():
            self.inv_freq.copy_(rope.inv_freq(rope.short_factor))
            self.long_inv_freq.copy_(rope.inv_freq(rope.long_factor))

    def rope_tables(self, seq: SeqInfo, dtype: torch.dtype) -> list:
        """(T, R) cos and sin for every layer; each sequence's factor set picked by its largest
        position + 1 (module docstring)."""
        return [self.cos_sin(seq, dtype)] * len(self.layers)

    def cos_sin(self, seq: SeqInfo, dtype: torch.dtype):
        rope, original = self.phi3_rope, self.phi3_rope.original_max
        # Without a cache, positions start at 0: the host lengths decide.
        if rope.long_factor is None or (seq.kv is None and seq.max_seqlen <= original):
            return rope_cos_sin(seq.position_ids, self.inv_freq, self.rope_scale, dtype)
        long = rope_cos_sin(seq.position_ids, self.long_inv_freq, self.rope_scale, dtype)
        if seq.kv is None and min(seq.lengths) > original:
            return long
        short = rope_cos_sin(seq.position_ids, self.inv_freq, self.rope_scale, dtype)
        # Per token, from device tensors (no host sync): each sequence's last position + 1.
        last_N = seq.position_ids.index_select(0, seq.cu_seqlens[1:].long() - 1)
        long_T1 = (last_N + 1 > original).index_select(0, seq.seq_ids)[:, None]
        return tuple(torch.where(long_T1, lo, sh) for lo, sh in zip(long, short, strict=True))


def build(cfg: ModelConfig) -> CausalLM:
    layers = [
        DecoderLayer(
            cfg, Phi3Attention(cfg, window), Phi3MLP(cfg.hidden_size, cfg.intermediate_size)
        )
        for window in layer_windows(cfg)
    ]
    return CausalLM(cfg, Phi3Backbone(cfg, layers))


weights = WeightMap  # checkpoint names are Hugging Face's: the identity map
SPEC = FamilySpec("phi3", config_from_hf, build, weights)
