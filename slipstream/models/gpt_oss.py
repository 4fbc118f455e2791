"""GPT-OSS family (GptOssForCausalLM): sink attention, alternating sliding windows, and a
top-k-then-softmax MoE with biased, clamped-SwiGLU experts.

What differs from the Llama decoder:
- attention has biases and one learned sink logit per head (`self_attn.sinks (H,)`) that
  joins every softmax; layers that `layer_types` marks `sliding_attention` see only the last
  `sliding_window` keys. RoPE is yarn (with `truncate: false` on the published checkpoints).
- RMSNorm multiplies by its weight in float32 before casting (transformers keeps the norms in
  float32 for this family).
- `mlp.router` has a bias; top-k of the logits, softmax over the k selected.
- experts are stored transposed, (E, in, out) per expert, with biases:
  `mlp.experts.gate_up_proj (E, D, 2I)` with gate and up interleaved along 2I (gate at even
  columns), `gate_up_proj_bias (E, 2I)`, `down_proj (E, I, D)`, `down_proj_bias (E, D)`.
  Activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit).

Weights load by name. Published checkpoints (openai/gpt-oss-20b) store the expert matrices in
MXFP4: `gate_up_proj_blocks (E, 2I, D/32, 16)` uint8 (two e2m1 values a byte, low nibble
first) and `gate_up_proj_scales (E, 2I, D/32)` uint8 (e8m0 exponents, bias 127), likewise for
down_proj; the weight map (`GptOssWeights`) dequantises each pair as soon as both halves
have arrived.

Shapes: T tokens, D hidden, H heads, E experts, I expert width, F = 2I, R routed rows,
G 32-value blocks per row.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from slipstream.models.common import (
    Attention,
    Backbone,
    CausalLM,
    DecoderLayer,
    ModelConfig,
    RMSNorm,
    base_config_from_hf,
    sliding_windows,
)
from slipstream.models.moe_block import (
    MoEBlock,
    Router,
    aux_loss_coef_from_hf,
    num_experts_from_hf,
)
from slipstream.models.spec import FamilySpec
from slipstream.models.weights import WeightMap
from slipstream.ops.attention import attend
from slipstream.ops.moe import RoutingPlan, grouped_mm
from slipstream.ops.packing import SeqInfo

# transformers' GptOssConfig default when a config.json names no RoPE scaling.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
# e2m1: sign bit, 2 exponent bits, 1 mantissa bit; nibble value -> number.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MXFP4 = re.compile(r"(.+\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hf = dict(hf)
    quant = hf.pop("quantization_config", None)  # weights are dequantised on load
    if quant is not None and quant.get("quant_method") != "mxfp4":
        raise ValueError(
            f"config.json: quantization_config.quant_method {quant.get('quant_method')!r} is "
            "not supported for gpt_oss; only 'mxfp4' (dequantised on load)."
        )
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        hf["rope_parameters"] = {**DEFAULT_ROPE, "rope_theta": hf.get("rope_theta", 150000.0)}
    num_experts_from_hf(hf)
    cfg = base_config_from_hf(
        hf,
        attention_bias=bool(hf.get("attention_bias", True)),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
    )
    layer_windows(cfg)  # a malformed layer_types fails at load, not at build
    return cfg


class GptOssRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class GptOssAttention(Attention):
    """Biased GQA attention with per-head sink logits, windowed on sliding layers."""

    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        super().__init__(cfg, window)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_attention_heads))

    @torch.compiler.disable
    def attend(self, q_THD, k_TGD, v_TGD, seq: SeqInfo) -> torch.Tensor:
        return attend(q_THD, k_TGD, v_TGD, seq, window=self.window, sinks=self.sinks)


class GptOssExperts(nn.Module):
    """E biased clamped-SwiGLU experts stacked (E, in, out); grouped GEMMs over the plan."""

    is_transposed = True  # per expert (in, out) (PEFT reads this name)

    def __init__(self, num_experts: int, hidden: int, width: int, alpha: float, limit: float):
        super().__init__()
        E, D, I = num_experts, hidden, width  # noqa: E741
        self.gate_up_proj = nn.Parameter(torch.empty(E, D, 2 * I))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, D))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, D))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        self.alpha, self.limit = alpha, limit

    def gate_up(self, x_RD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        h_RF = grouped_mm(x_RD, self.gate_up_proj, plan.offsets_E)
        return h_RF + self.gate_up_proj_bias.index_select(0, plan.expert_R)

    def activate(self, h_RF: torch.Tensor) -> torch.Tensor:
        gate_RI = h_RF[..., ::2].clamp(max=self.limit)
        up_RI = h_RF[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up_RI + 1) * gate_RI * torch.sigmoid(gate_RI * self.alpha)

    def down(self, a_RI: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        y_RD = grouped_mm(a_RI, self.down_proj, plan.offsets_E)
        return y_RD + self.down_proj_bias.index_select(0, plan.expert_R)

    def forward(self, x_RD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        return self.down(self.activate(self.gate_up(x_RD, plan)), plan)


class GptOssMLP(MoEBlock):
    """Biased router; top-k of the logits, then softmax over the k selected."""

    route_kind = "topk_softmax"

    def __init__(self, cfg: ModelConfig) -> None:
        hf, D = cfg.hf, cfg.hidden_size
        E = num_experts_from_hf(hf)
        experts = GptOssExperts(
            E,
            D,
            cfg.intermediate_size,
            alpha=float(hf.get("swiglu_alpha", 1.702)),
            limit=float(hf.get("swiglu_limit", 7.0)),
        )
        super().__init__(experts, E, hf["num_experts_per_tok"])
        self.router = Router(D, E, bias=True)

    def router_logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.router(x_TD)


def layer_windows(cfg: ModelConfig) -> list[int | None]:
    """`sliding_window` on the layers `layer_types` marks sliding (default: even layers)."""
    hf, L = cfg.hf, cfg.num_hidden_layers
    default = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
    return sliding_windows(hf.get("sliding_window"), hf.get("layer_types") or default, L)


def build(cfg: ModelConfig) -> CausalLM:
    layers = [
        DecoderLayer(cfg, GptOssAttention(cfg, window), GptOssMLP(cfg), norm=GptOssRMSNorm)
        for window in layer_windows(cfg)
    ]
    backbone = Backbone(cfg, layers, norm=GptOssRMSNorm)
    return CausalLM(cfg, backbone, aux_loss_coef_from_hf(cfg.hf))


# ------------------------------------------------------------------- MXFP4 weights


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """MXFP4 -> floats: blocks (..., G, 16) uint8, scales (..., G) uint8 -> (..., G*32).

    Each byte holds two e2m1 values (low nibble first); each 32-value block shares the scale
    2^(s - 127). Computed in float32 (every product is exact there), then cast.
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
            "expected (..., G, 16) and (..., G)."
        )
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.int64)
    values = torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1).flatten(-2)
    values = values * torch.exp2(scales.to(torch.float32) - 127)[..., None]
    return values.flatten(-2).to(dtype)


class GptOssWeights(WeightMap):
    """Expert matrices in MXFP4 on disk (`*_blocks`, `*_scales`); float in the model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # parameter -> halves so far

    def load(self, model: CausalLM, name: str, tensor: torch.Tensor) -> bool:
        """Collect `*_blocks` / `*_scales` pairs; dequantise into the expert parameter."""
        m = _MXFP4.match(name)
        if m is None:
            return False
        target, part = m.groups()
        param = self.split_target(model, target, name)
        parts = self.pending.setdefault(target, {})
        parts[part] = tensor
        if len(parts) < 2:
            return True
        del self.pending[target]
        blocks, scales = parts["blocks"], parts["scales"]
        E, rows, G, _ = blocks.shape
        if (E, G * 32, rows) != tuple(param.shape):
            raise ValueError(
                f"tensor {target}_blocks has shape {tuple(blocks.shape)}: it dequantises to "
                f"{(E, rows, G * 32)}, which does not transpose to {tuple(param.shape)}."
            )
        for e in range(E):  # one expert at a time: float32 scratch of one expert, not all E,
            # on the parameter's device (on a GPU that is ~100x faster than the CPU)
            b, s = blocks[e].to(param.device), scales[e].to(param.device)
            param[e].copy_(dequantize_mxfp4(b, s).T)
        return True

    def split_parts(self, param_name: str) -> list[str]:
        return [f"{param_name}_blocks", f"{param_name}_scales"]


weights = GptOssWeights
SPEC = FamilySpec("gpt_oss", config_from_hf, build, weights)
