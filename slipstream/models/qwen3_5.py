"""Qwen3.5 family, dense (Qwen3_5ForCausalLM, `model_type: qwen3_5_text`) and the language
model of Qwen3_5ForConditionalGeneration (`qwen3_5`): a hybrid of Gated DeltaNet layers
(`layer_types` "linear_attention", 3 of every 4 by default) and gated softmax attention
("full_attention").

What differs from the Qwen3 decoder:
- a DeltaNet layer's token mixer is `linear_attn` (models/gated_deltanet.py): no KV, a
  recurrent state restarting at each packed sequence;
- an attention layer's q_proj is twice as wide: per head [query | gate], and the attention
  output is multiplied by sigmoid(gate) before o_proj; q/k norms per head; RoPE on the first
  `partial_rotary_factor` (0.25) of each head's features (text positions: the M-RoPE
  sections coincide);
- every RMSNorm but the mixer's gated one stores its weight as an offset from 1
  (`Gemma3RMSNorm`'s form: x_norm * (1 + w) in float32).
Multimodal checkpoints (`qwen3_5`): the same text model built from `text_config`, held under
`model.language_model.*` (+ `lm_head`), with the image side of models/qwen_vl.py when
config.json has a `vision_config`: the vision tower under `model.visual.*`, the embedding stage
writing its features into host-found rows, RoPE by the host-built 3-D positions with the
sections interleaved (Qwen3-VL's; no deepstack). The multi-token-prediction head (`mtp.*`,
which transformers never loads) is passed through by save and export.

Shapes: T tokens, D hidden, H heads, G kv heads, Dh head dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slipstream.models.common import (
    Attention,
    Backbone,
    CausalLM,
    GatedMLP,
    ModelConfig,
    base_config_from_hf,
    split_outputs,
)
from slipstream.models.gated_deltanet import GatedDeltaNet
from slipstream.models.gemma3 import Gemma3RMSNorm as OffsetRMSNorm
from slipstream.models.qwen_vl import (
    MODULE_TREE,
    ImageTextBackbone,
    ImageTextLM,
    mrope_section,
    text_config,
    vision_tower,
)
from slipstream.models.rope import apply_rope
from slipstream.models.spec import FamilySpec
from slipstream.models.weights import WeightMap
from slipstream.ops.packing import SeqInfo

# Qwen3_5TextConfig's defaults for keys a config.json may leave out.
DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
KINDS = ("linear_attention", "full_attention")
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
MULTIMODAL_LAYOUTS = ((("model.", "model.language_model."), ("lm_head.", "lm_head.")),)
PASSTHROUGH = ("model.visual.", "mtp.")  # without a vision config: no tower held


@dataclass
class Qwen35Config(ModelConfig):
    layer_types: tuple[str, ...] = ()
    linear: dict[str, int] = dataclasses.field(default_factory=dict)


def config_from_hf(hf: dict[str, Any]) -> Qwen35Config:
    """The text model's config; from `text_config` for a multimodal config.json, whose `hf`
    is kept whole (export writes it back)."""
    text = hf
    if hf.get("model_type") in MULTIMODAL:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(
                f"config.json: model_type {hf['model_type']!r} needs a text_config (the "
                "language model's config); re-save the checkpoint with transformers."
            )
        tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        text = {**text, "model_type": MULTIMODAL[hf["model_type"]], "tie_word_embeddings": tie}
    text = {**DEFAULTS, **text}
    if text["hidden_act"] != "silu":
        raise ValueError(
            f"config.json: hidden_act {text['hidden_act']!r} is not supported; use 'silu'."
        )
    rope = dict(text.get("rope_parameters") or {})
    rope.setdefault("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    cfg = base_config_from_hf({**text, "rope_parameters": rope})
    linear = {k.removeprefix("linear_"): int(text[k]) for k in DEFAULTS if k.startswith("linear_")}
    cfg = Qwen35Config(**vars(cfg), layer_types=_layer_types(text), linear=linear)
    return dataclasses.replace(cfg, model_type=hf["model_type"], hf=dict(hf))


def _layer_types(hf: dict[str, Any]) -> tuple[str, ...]:
    L = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is None:
        every = hf.get("full_attention_interval", 4)
        kinds = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(L)]
    other = set(kinds) - set(KINDS)
    if len(kinds) != L or other:
        problem = f"{len(kinds)} entries for {L} layers" if len(kinds) != L else sorted(other)
        raise ValueError(
            f"config.json: layer_types has {problem}; each of num_hidden_layers entries is "
            "'linear_attention' or 'full_attention'."
        )
    return tuple(kinds)


class GatedAttention(Attention):
    """Attention whose q_proj also gives a per-feature output gate: o * sigmoid(gate)."""

    def make_qkv_proj(self, D: int, bias: bool) -> None:
        H, G, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(D, 2 * H * Dh, bias=bias)
        self.k_proj = nn.Linear(D, G * Dh, bias=bias)
        self.v_proj = nn.Linear(D, G * Dh, bias=bias)

    def forward(self, x_TD: torch.Tensor, seq: SeqInfo, cos_sin) -> torch.Tensor:
        T, H, G, Dh = x_TD.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q_THD, gate_THD = self.q_proj(x_TD).view(T, H, 2 * Dh).chunk(2, dim=-1)
        q_THD = apply_rope(self.q_norm(q_THD), cos_sin)
        k_TGD = apply_rope(self.k_norm(self.k_proj(x_TD).view(T, G, Dh)), cos_sin)
        v_TGD = self.v_proj(x_TD).view(T, G, Dh)
        o_THD = self.attend(q_THD, k_TGD, v_TGD, seq) * torch.sigmoid(gate_THD)
        return self.o_proj(o_THD.reshape(T, H * Dh))


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual block whose token mixer is `linear_attn` (Gated DeltaNet) or
    `self_attn` (gated attention), as HF names them; the MLP may return extras (MoE stats)."""

    def __init__(self, cfg: Qwen35Config, kind: str, mlp: nn.Module) -> None:
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(D, eps)
        if kind == "linear_attention":
            lin = cfg.linear
            self.linear_attn = GatedDeltaNet(
                D, lin["num_value_heads"], lin["num_key_heads"], lin["key_head_dim"],
                lin["value_head_dim"], lin["conv_kernel_dim"], eps,
            )  # fmt: skip
        else:
            q_norm, k_norm = OffsetRMSNorm(cfg.head_dim, eps), OffsetRMSNorm(cfg.head_dim, eps)
            self.self_attn = GatedAttention(cfg, None, q_norm=q_norm, k_norm=k_norm)
        self.mixer = "linear_attn" if kind == "linear_attention" else "self_attn"
        self.post_attention_layernorm = OffsetRMSNorm(D, eps)
        self.mlp = mlp

    def forward(self, x_TD: torch.Tensor, seq: SeqInfo, cos_sin):
        x_TD = x_TD + getattr(self, self.mixer)(self.input_layernorm(x_TD), seq, cos_sin)
        y_TD, extras = split_outputs(self.mlp(self.post_attention_layernorm(x_TD)))
        return (x_TD + y_TD, *extras) if extras else x_TD + y_TD


def build_hybrid(cfg: Qwen35Config, mlp, router_aux_loss_coef: float = 0.0) -> CausalLM:
    """The hybrid model, `mlp(cfg)` building each layer's MLP (dense here, MoE in
    qwen3_5_moe.py)."""
    layers = [HybridDecoderLayer(cfg, kind, mlp(cfg)) for kind in cfg.layer_types]
    if not has_vision(cfg):
        return CausalLM(cfg, Backbone(cfg, layers, norm=OffsetRMSNorm), router_aux_loss_coef)
    section = mrope_section(text_config(cfg.hf), cfg.model_type)
    backbone = ImageTextBackbone(cfg, layers, vision_tower(cfg.hf), section, interleaved=True,
                                 norm=OffsetRMSNorm)  # fmt: skip
    return ImageTextLM(cfg, backbone, router_aux_loss_coef=router_aux_loss_coef)


def has_vision(cfg: Qwen35Config) -> bool:
    """A multimodal checkpoint with its vision config: the image side is built."""
    return cfg.model_type in MULTIMODAL and isinstance(cfg.hf.get("vision_config"), dict)


def build(cfg: Qwen35Config) -> CausalLM:
    return build_hybrid(cfg, lambda c: GatedMLP(c.hidden_size, c.intermediate_size))


class Qwen35Layout:
    """A WeightMap mixin: a multimodal checkpoint holds the language model under
    `model.language_model.`; the vision tower and the MTP head are never loaded (passed
    through at save). Put before the WeightMap it adapts (dense here, MoE in qwen3_5_moe)."""

    def __init__(self, cfg: Qwen35Config) -> None:
        super().__init__(cfg)
        self.layouts = MULTIMODAL_LAYOUTS if cfg.model_type in MULTIMODAL else ()
        self.passthrough = PASSTHROUGH
        if has_vision(cfg):  # the tower is ours (models/qwen_vl.py's module tree)
            self.layouts, self.passthrough = (MODULE_TREE,), ("mtp.",)

    def is_passthrough(self, name: str) -> bool:
        return name.startswith(self.passthrough)

    def our_name(self, name: str) -> str | None:
        return None if self.is_passthrough(name) else super().our_name(name)


class Qwen35Weights(Qwen35Layout, WeightMap):
    """HF names under Qwen3.5's multimodal layout and pass-through."""


weights = Qwen35Weights
SPEC = FamilySpec("qwen3_5", config_from_hf, build, weights)
