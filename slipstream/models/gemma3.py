"""Gemma 3 family: Gemma3ForCausalLM (`model_type: gemma3_text`: Gemma-3-270M and 1B) and the
language model of Gemma3ForConditionalGeneration (`model_type: gemma3`: 4B, 12B, 27B).

What differs from the Llama decoder:
- the embeddings are multiplied by sqrt(hidden_size), rounded to the embedding dtype first as
  transformers does (in bf16, sqrt(1152) = 33.94 becomes 34.0); the tied LM head is unscaled;
- RMSNorm stores an offset: x_norm * (1 + weight), both in float32, then cast (zero init);
- four norms a layer: `post_attention_layernorm` normalises the attention OUTPUT before the
  residual add, `pre_feedforward_layernorm`/`post_feedforward_layernorm` wrap the MLP;
- q_norm/k_norm over each head's Dh features; attention scale query_pre_attn_scalar**-0.5;
- GeGLU MLP (gelu, tanh approximation);
- `layer_types` marks sliding layers: they see the last `sliding_window` keys and use the
  local RoPE (base 10k, no scaling); full layers use the global one (base 1M, linear factor 8
  on 4B+). `Gemma3Backbone` builds both cos/sin pairs once per forward; each layer is called
  with its own type's pair, so a layer is still `layer(x_TD, seq, cos_sin)`.
Weights load by name (HF names throughout).

Multimodal checkpoints (`gemma3`): the same text model, built from `text_config`, plus the
SigLIP tower and the projector (models/siglip.py) as `Gemma3ImageTextLM`: its embedding stage
`embed(ids, images)` runs the tower once over the micro-batch's images and writes their pooled
features into the rows the collator found on the host (`images["image_rows"]`, index_copy; no
search for the image token on the device); each image's rows attend to one another through
`seq.image_spans` (ops/attention.py). Only names differ at the checkpoint boundary:
transformers holds the parts under `model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*` (+ `lm_head`), its saved checkpoints under
`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`, the published ones the
tower under `vision_tower.vision_model.*` (`MULTIMODAL_LAYOUTS`). SigLIP's pooling head,
unused by Gemma 3, is passed through (save and export copy it from the source checkpoint);
`config.json` is written back whole.

Shapes: T tokens, D hidden, H heads, G kv heads, Dh head dim, F mlp width.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.common import (
    Attention,
    Backbone,
    CausalLM,
    GatedMLP,
    ModelConfig,
    _check_batch,
    base_config_from_hf,
    sliding_windows,
    write_image_features,
)
from slipstream.models.rope import RopeConfig, rope_cos_sin, rope_inv_freq
from slipstream.models.siglip import Gemma3MultiModalProjector, SiglipConfig, SiglipVisionTower
from slipstream.models.spec import FamilySpec
from slipstream.models.weights import WeightMap
from slipstream.ops.packing import SeqInfo

# Gemma3TextConfig's defaults for the keys a config.json may leave out (the published 1B one
# has no tie_word_embeddings and no layer_types).
DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
}
GLOBAL_THETA, LOCAL_THETA, SLIDING_WINDOW_PATTERN = 1_000_000.0, 10_000.0, 6
# hidden_activation -> F.gelu's `approximate`
GELU_APPROXIMATE = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass
class Gemma3Config(ModelConfig):
    local_rope: RopeConfig = field(default_factory=RopeConfig)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    query_pre_attn_scalar: float = 256.0
    gelu_approximate: str = "tanh"


# Gemma3TextConfig's defaults for the rest: a multimodal config.json's text_config lists only
# what differs from them (the published 4B one: hidden_size, intermediate_size, layers, RoPE
# scaling, window).
TEXT_CONFIG_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 131_072,
}
# Where Gemma3ForConditionalGeneration holds our modules (our prefix -> theirs): first
# transformers' module tree, which peft's adapter keys follow; then the published checkpoints'
# layout (the tower under `vision_model`), then the one transformers' save_pretrained writes
# (ties at save: the last). Any of them loads.
_VISION = ("vision_tower.", "multi_modal_projector.")
MULTIMODAL_LAYOUTS = (
    (
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("model.", "model.language_model."),
        ("lm_head.", "lm_head."),
    ),
    (
        ("vision_tower.", "vision_tower.vision_model."),
        ("multi_modal_projector.", "multi_modal_projector."),
        ("model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    ),
    (
        *((p, p) for p in _VISION),
        ("model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    ),
)
# Its tensors that are not ours, in any layout: SigLIP's pooling head (Gemma 3 uses none).
MULTIMODAL_PASSTHROUGH = (
    "model.vision_tower.head.",
    "vision_tower.vision_model.head.",
    "vision_tower.head.",
)


def config_from_hf(hf: dict[str, Any]) -> Gemma3Config:
    """The text model's config; from `text_config` for a multimodal (`gemma3`) config.json,
    whose `hf` is kept whole (export writes it back)."""
    if hf.get("model_type") != "gemma3":
        return _text_config_from_hf(hf)
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(
            "config.json: model_type 'gemma3' needs a text_config (the language model's "
            "config); re-save the checkpoint with transformers."
        )
    # Transformers ties the LM head by the top-level flag on this model (default true).
    tie = hf.get("tie_word_embeddings", True)
    text = {**TEXT_CONFIG_DEFAULTS, **text, "model_type": "gemma3_text"}
    cfg = _text_config_from_hf({**text, "tie_word_embeddings": tie})
    return dataclasses.replace(cfg, model_type="gemma3", hf=dict(hf))


def _text_config_from_hf(hf: dict[str, Any]) -> Gemma3Config:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError(
                f"config.json: {key}={hf[key]} is not supported (logit soft-capping is Gemma 2; "
                "Gemma 3 has it null)."
            )
    if hf.get("use_bidirectional_attention"):
        raise ValueError(
            "config.json: use_bidirectional_attention=true (an embedding model) is not "
            "supported; slipstream trains causal LMs."
        )
    full = {**DEFAULTS, **hf}
    act = hf.get("hidden_activation") or hf.get("hidden_act") or DEFAULTS["hidden_activation"]
    if act not in GELU_APPROXIMATE:
        raise ValueError(
            f"config.json: hidden_activation {act!r} is not supported for gemma3_text; "
            f"supported: {', '.join(GELU_APPROXIMATE)}."
        )
    global_rope, local_rope = _ropes(full)
    base = base_config_from_hf(
        full, rope=global_rope, tie_word_embeddings=bool(full["tie_word_embeddings"])
    )
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
    return Gemma3Config(
        **{**fields, "hf": dict(hf)},  # config.json as read (export writes it back)
        local_rope=local_rope,
        layer_types=_layer_types(full),
        sliding_window=full["sliding_window"],
        query_pre_attn_scalar=float(full["query_pre_attn_scalar"]),
        gelu_approximate=GELU_APPROXIMATE[act],
    )


def _ropes(hf: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) RoPE: `rope_parameters` by layer type (transformers 5), or 4.x's
    `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq` (local, unscaled)."""
    params = hf.get("rope_parameters") or {}
    common = {"max_position_embeddings": hf.get("max_position_embeddings")}
    if "full_attention" in params or "sliding_attention" in params:
        full = {"rope_theta": GLOBAL_THETA, **(params.get("full_attention") or {})}
        local = {"rope_theta": LOCAL_THETA, **(params.get("sliding_attention") or {})}
        return (
            RopeConfig.from_hf({**common, "rope_parameters": full}),
            RopeConfig.from_hf({**common, "rope_parameters": local}),
        )
    flat = {**common, "rope_theta": hf.get("rope_theta", GLOBAL_THETA)}
    flat.update(rope_scaling=hf.get("rope_scaling"), rope_parameters=params or None)
    local_theta = hf.get("rope_local_base_freq", LOCAL_THETA)
    return RopeConfig.from_hf(flat), RopeConfig(theta=float(local_theta))


def _layer_types(hf: dict[str, Any]) -> tuple[str, ...]:
    """`layer_types`, or every `sliding_window_pattern`-th layer full (older configs)."""
    L = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
    pattern = pattern or SLIDING_WINDOW_PATTERN
    default = [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(L)
    ]
    types = tuple(hf.get("layer_types") or default)
    sliding_windows(hf["sliding_window"], types, L)  # the checks, at load
    return types


class Gemma3RMSNorm(nn.Module):
    """RMSNorm with the weight stored as an offset from 1 (zeros init), scaled in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """Embeddings times sqrt(D) as the embedding dtype holds it (transformers multiplies by
    a tensor of that dtype), looked up by dtype in forward: rounding there would be a host
    read. The tied LM head reads `weight` unscaled."""

    def __init__(self, num_embeddings: int, dim: int, scale_dim: int | None = None) -> None:
        super().__init__(num_embeddings, dim)
        # sqrt(scale_dim): Gemma 4's per-layer table packs L rows of P, scaled by sqrt(P).
        root = torch.tensor((scale_dim or dim) ** 0.5, dtype=torch.float32, device="cpu")
        dtypes = (torch.float32, torch.bfloat16, torch.float16)
        self.scale = {dt: root.to(dt).item() for dt in dtypes}

    def forward(self, input_ids_T: torch.Tensor) -> torch.Tensor:
        x_TD = super().forward(input_ids_T)
        return x_TD * self.scale.get(x_TD.dtype, self.scale[torch.float32])


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: x + post_norm(attn(norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, cfg: Gemma3Config, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = Gemma3RMSNorm(D, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = Gemma3RMSNorm(D, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(D, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = Gemma3RMSNorm(D, eps)

    def forward(self, x_TD: torch.Tensor, seq: SeqInfo, cos_sin) -> torch.Tensor:
        attn_TD = self.self_attn(self.input_layernorm(x_TD), seq, cos_sin)
        x_TD = x_TD + self.post_attention_layernorm(attn_TD)
        mlp_TD = self.mlp(self.pre_feedforward_layernorm(x_TD))
        return x_TD + self.post_feedforward_layernorm(mlp_TD)


class Gemma3Backbone(Backbone):
    """Scaled embeddings, Gemma norms, and two RoPEs: global (the inherited `inv_freq`) on
    full layers, local on sliding ones."""

    def __init__(self, cfg: Gemma3Config, layers: list[nn.Module]) -> None:
        embed = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        super().__init__(cfg, layers, norm=Gemma3RMSNorm, embed_tokens=embed)
        self.local_rope = cfg.local_rope
        local_inv_freq, self.local_rope_scale = rope_inv_freq(cfg.local_rope, cfg.head_dim)
        self.register_buffer("local_inv_freq", local_inv_freq, persistent=False)
        self.sliding = [t == "sliding_attention" for t in cfg.layer_types]

    def reset_rope(self) -> None:
        super().reset_rope()
        local_inv_freq, self.local_rope_scale = rope_inv_freq(self.local_rope, self.head_dim)
        self.local_inv_freq.copy_(local_inv_freq)

    def rope_tables(self, seq: SeqInfo, dtype: torch.dtype) -> list:
        """Each RoPE built once per forward, shared by every layer of its type."""
        pos_T = seq.position_ids
        full = rope_cos_sin(pos_T, self.inv_freq, self.rope_scale, dtype)
        local = rope_cos_sin(pos_T, self.local_inv_freq, self.local_rope_scale, dtype)
        return [local if sliding else full for sliding in self.sliding]


class Gemma3ImageTextLM(CausalLM):
    """The text model plus SigLIP and the projector: `embed(ids, images)` writes each image's
    `mm_tokens_per_image` features into its rows; `hidden_states`, `loss` and `forward` take
    the same `images=` (models/contract.py). The tower and projector sit beside the backbone,
    as in transformers' tree, so the backbone takes `embed`'s output (`x_TD`)."""

    takes_images = True

    def __init__(self, cfg: Gemma3Config, backbone: Gemma3Backbone) -> None:
        super().__init__(cfg, backbone)
        vision = SiglipConfig.from_hf(cfg.hf.get("vision_config") or {})
        tokens = int(cfg.hf.get("mm_tokens_per_image", 256))
        self.vision_tower = SiglipVisionTower(vision)
        norm = Gemma3RMSNorm(vision.hidden_size, vision.layer_norm_eps)
        projector = Gemma3MultiModalProjector(vision, tokens, cfg.hidden_size, norm)
        self.multi_modal_projector = projector
        # The parts `vision.tower` / `vision.projector` name (train/setup.py); LoRA stays off
        # them unless those settings ask for it.
        self.vision = {"tower": "vision_tower", "projector": "multi_modal_projector"}
        self.no_lora_prefixes = tuple(f"{p}." for p in self.vision.values())

    def image_features(self, images: dict[str, torch.Tensor]) -> torch.Tensor:
        """(P, D): the tower and projector over every image of the batch, in order."""
        feats_NMD = self.multi_modal_projector(self.vision_tower(images["pixel_values"]))
        return feats_NMD.flatten(0, 1)

    def embed(self, input_ids_T: torch.Tensor, images: Any = None) -> torch.Tensor:
        """(T, D) scaled token embeddings, image features (unscaled, as transformers writes
        them) in the rows `images["image_rows"]` names."""
        x_TD = self.model.embed_tokens(input_ids_T)
        if images is None:
            return x_TD
        return write_image_features(x_TD, self.image_features(images), images)

    def _backbone_out(self, input_ids_T: torch.Tensor, seq: SeqInfo, images: Any = None):
        if images is None:
            return super()._backbone_out(input_ids_T, seq)
        _check_batch(input_ids_T, seq)  # what the inherited step checks first
        return self.model(input_ids_T, seq, x_TD=self.embed(input_ids_T, images))


def build(cfg: Gemma3Config) -> CausalLM:
    Dh, eps = cfg.head_dim, cfg.rms_norm_eps
    gelu = functools.partial(F.gelu, approximate=cfg.gelu_approximate)
    layers = [
        Gemma3DecoderLayer(
            cfg,
            Attention(
                cfg,
                window,
                q_norm=Gemma3RMSNorm(Dh, eps),
                k_norm=Gemma3RMSNorm(Dh, eps),
                scale=cfg.query_pre_attn_scalar**-0.5,
            ),
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, act=gelu),
        )
        for window in sliding_windows(cfg.sliding_window, cfg.layer_types, cfg.num_hidden_layers)
    ]
    if cfg.model_type == "gemma3" and "vision_config" in cfg.hf:
        return Gemma3ImageTextLM(cfg, Gemma3Backbone(cfg, layers))
    return CausalLM(cfg, Gemma3Backbone(cfg, layers))


class Gemma3Weights(WeightMap):
    """HF names; a multimodal checkpoint holds them under its own prefixes (MULTIMODAL_LAYOUTS)
    beside SigLIP's unused pooling head (MULTIMODAL_PASSTHROUGH), which we pass through."""

    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__(cfg)
        self.layouts = MULTIMODAL_LAYOUTS if cfg.model_type == "gemma3" else ()

    def is_passthrough(self, name: str) -> bool:
        """A checkpoint tensor (or module path) we do not hold: SigLIP's pooling head."""
        return bool(self.layouts) and name.startswith(MULTIMODAL_PASSTHROUGH)

    def our_name(self, name: str) -> str | None:
        return None if self.is_passthrough(name) else super().our_name(name)


weights = Gemma3Weights
SPEC = FamilySpec("gemma3", config_from_hf, build, weights)
