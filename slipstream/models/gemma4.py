"""Gemma 4 family, text part: Gemma4ForCausalLM (`model_type: gemma4_text`) and the language
model of Gemma4ForConditionalGeneration (`model_type: gemma4`: E2B, E4B, 26B-A4B, 31B).

What differs from Gemma 3 (models/gemma3.py):
- per-layer attention shapes: full layers have their own head dim and KV heads
  (`per_layer_config`, or `global_head_dim` / `num_global_key_value_heads` in configs written
  before it); with `attention_k_eq_v` a full layer has no v_proj: v is k's projection;
- q_norm, k_norm and a weightless v_norm over each head; attention scale 1.0; RMSNorms scale
  by `weight` (ones init), not by 1 + weight;
- RoPE per layer type: sliding layers the default over their head dim, full layers
  "proportional" (the first partial_rotary_factor * Dh/2 frequency pairs turn, at
  theta^(-2i/Dh) over the whole head; the rest have frequency 0, i.e. pass through);
- per-layer inputs (E2B/E4B): a second embedding table (V', L*P) scaled by sqrt(P), plus a
  projection of the embeddings, normed and averaged, gives each layer a (T, P) input; the
  layer gates it by its own hidden state (`per_layer_input_gate`, gelu), projects back to D,
  norms and adds;
- K/V sharing: the last `num_kv_shared_layers` layers compute no keys or values; each reuses
  those of the last earlier layer of its type (its "source", which returns them beside its
  output). A shared layer's MLP is twice as wide with `use_double_wide_mlp`. The KV cache gives
  shared layers no cache of their own (`kv_layout`);
- MoE (26B-A4B): a dense MLP and a routed block side by side in every layer. The router sees
  the residual stream (weightless norm, times `scale` / sqrt(D), then `proj`), softmax top-k
  renormalised and times `per_expert_scale`; the experts see pre_feedforward_layernorm_2 of
  it; both outputs have their own post-norm before they are summed. One-pass routing
  (ops.moe: plan, permute, grouped GEMMs); no auxiliary loss (transformers adds none);
- every layer's output times its `layer_scalar` (a buffer in the checkpoint);
- the LM head's logits soft-capped at `final_logit_softcapping`.

Weights load by HF names (`Gemma4Weights`: the layer_scalar buffers, shared layers' unused
k/v tensors dropped, the multimodal checkpoint's prefixes; its vision tower is ours,
models/gemma4_image.py, its audio tower passed through).

Shapes: T tokens, D hidden, H heads, G kv heads, Dh head dim, L layers, P per-layer input
width, E experts, K top-k.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.common import Backbone, CausalLM, GatedMLP, ModelConfig, sliding_windows
from slipstream.models.gemma3 import GELU_APPROXIMATE, ScaledEmbedding
from slipstream.models.gemma4_image import AUDIO_PASSTHROUGH, IMAGE_TEXT_LAYOUTS, Gemma4ImageTextLM
from slipstream.models.qwen3_moe import Qwen3MoeExperts
from slipstream.models.rope import RopeConfig, apply_rope, rope_cos_sin, rope_inv_freq
from slipstream.models.spec import FamilySpec
from slipstream.models.weights import WeightMap
from slipstream.ops.attention import attend
from slipstream.ops.moe import permute, plan, route, unpermute
from slipstream.ops.packing import SeqInfo

# Gemma4TextConfig's defaults for keys a config.json may leave out.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "global_head_dim": 512,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "num_kv_shared_layers": 0,
}
ROPE_DEFAULTS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0},
}  # fmt: skip
# Where Gemma4ForConditionalGeneration holds our modules (its module tree, which its
# checkpoints and peft's keys follow); its towers and their embedders are passed through.
MULTIMODAL_LAYOUTS = ((("model.", "model.language_model."), ("lm_head.", "lm_head.")),)
MULTIMODAL_PASSTHROUGH = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                          "model.embed_audio.")  # fmt: skip
# Tensors a checkpoint may hold for shared layers (transformers ignores them too).
SHARED_UNUSED = ("k_proj.weight", "v_proj.weight", "k_norm.weight", "v_norm.weight")


@dataclass
class Gemma4Config(ModelConfig):
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    head_dims: tuple[int, ...] = ()  # per layer
    kv_heads: tuple[int, ...] = ()  # per layer
    k_eq_v: tuple[bool, ...] = ()  # per layer: v is k's projection (no v_proj)
    kv_source: tuple[int, ...] = ()  # per layer: the layer whose K/V it uses (itself: own)
    full_rope: dict[str, Any] = dataclasses.field(default_factory=dict)
    per_layer_dim: int = 0  # P (0: no per-layer inputs)
    per_layer_vocab: int = 0
    double_wide: tuple[bool, ...] = ()  # per layer: MLP of 2 * intermediate_size
    num_experts: int = 0  # 0: dense
    top_k: int = 0
    moe_intermediate_size: int = 0
    final_softcap: float | None = None
    gelu_approximate: str = "tanh"

    @property
    def stores(self) -> list[bool]:
        """Whether each layer's K/V are reused by a later one (it returns them)."""
        used = set(s for i, s in enumerate(self.kv_source) if s != i)
        return [i in used for i in range(self.num_hidden_layers)]


def config_from_hf(hf: dict[str, Any]) -> Gemma4Config:
    """The text model's config; from `text_config` for a multimodal (`gemma4`) config.json,
    whose `hf` is kept whole (export writes it back)."""
    if hf.get("model_type") != "gemma4":
        return _text_config_from_hf(hf)
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(
            "config.json: model_type 'gemma4' needs a text_config (the language model's "
            "config); re-save the checkpoint with transformers."
        )
    tie = hf.get("tie_word_embeddings", True)
    cfg = _text_config_from_hf({**text, "model_type": "gemma4_text", "tie_word_embeddings": tie})
    return dataclasses.replace(cfg, model_type="gemma4", hf=dict(hf))


def _text_config_from_hf(hf: dict[str, Any]) -> Gemma4Config:
    full = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    # "vision": image rows see one another on sliding layers (Gemma4Attention.attend);
    # text stays causal.
    if full.get("use_bidirectional_attention") not in (None, False, "vision"):
        raise ValueError(
            "config.json: use_bidirectional_attention="
            f"{full['use_bidirectional_attention']!r} (an embedding model); slipstream trains "
            "Gemma 4 as a causal LM: set it to null."
        )
    act = full["hidden_activation"]
    if act not in GELU_APPROXIMATE:
        raise ValueError(
            f"config.json: hidden_activation {act!r} is not supported for gemma4; "
            f"supported: {', '.join(GELU_APPROXIMATE)}."
        )
    L, H = full["num_hidden_layers"], full["num_attention_heads"]
    types = tuple(full.get("layer_types") or _default_layer_types(L))
    sliding_windows(full["sliding_window"], types, L)  # the checks, at load
    head_dims, kv_heads = _per_layer_shapes(full, types)
    k_eq_v = bool(full.get("attention_k_eq_v", False))
    ropes = {**ROPE_DEFAULTS, **(full.get("rope_parameters") or {})}
    sliding_rope = _sliding_rope(ropes["sliding_attention"], full)
    sources = _kv_sources(types, int(full["num_kv_shared_layers"]))
    moe = bool(full.get("enable_moe_block", False))
    wide = bool(full.get("use_double_wide_mlp", False))
    local = [i for i, t in enumerate(types) if t == "sliding_attention"]
    Dh_local = head_dims[local[0]] if local else full["head_dim"]
    return Gemma4Config(
        model_type=hf.get("model_type", "gemma4_text"),
        vocab_size=full["vocab_size"],
        hidden_size=full["hidden_size"],
        intermediate_size=full["intermediate_size"],
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=kv_heads[local[0]] if local else kv_heads[0],
        head_dim=Dh_local,
        rms_norm_eps=full["rms_norm_eps"],
        rope=sliding_rope,
        tie_word_embeddings=bool(full["tie_word_embeddings"]),
        attention_bias=bool(full.get("attention_bias", False)),
        hf=dict(hf),
        layer_types=types,
        sliding_window=full["sliding_window"],
        head_dims=tuple(head_dims),
        kv_heads=tuple(kv_heads),
        k_eq_v=tuple(k_eq_v and t == "full_attention" for t in types),
        kv_source=tuple(sources),
        full_rope=dict(ropes["full_attention"]),
        per_layer_dim=int(full.get("hidden_size_per_layer_input") or 0),
        per_layer_vocab=int(full.get("vocab_size_per_layer_input") or full["vocab_size"]),
        double_wide=tuple(wide and s != i for i, s in enumerate(sources)),
        num_experts=int(full.get("num_experts") or 0) if moe else 0,
        top_k=int(full.get("top_k_experts") or 0) if moe else 0,
        moe_intermediate_size=int(full.get("moe_intermediate_size") or 0) if moe else 0,
        final_softcap=full.get("final_logit_softcapping"),
        gelu_approximate=GELU_APPROXIMATE[act],
    )


def _default_layer_types(L: int) -> list[str]:
    """transformers' default: every 6th layer full, and the last one always."""
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(L)]
    return types[:-1] + ["full_attention"]


def _per_layer_shapes(hf: dict[str, Any], types) -> tuple[list[int], list[int]]:
    """Head dim and KV heads of each layer: `per_layer_config` overrides (keys are layer
    indices, zero-padded strings), else full layers take global_head_dim (and, with
    attention_k_eq_v, num_global_key_value_heads), as Gemma4TextConfig derives them."""
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        full = {"head_dim": hf["global_head_dim"]}
        if hf.get("num_global_key_value_heads") and hf.get("attention_k_eq_v", False):
            full["num_key_value_heads"] = hf["num_global_key_value_heads"]
        per_layer = {i: full for i, t in enumerate(types) if t == "full_attention"}
    per_layer = {int(k): v for k, v in per_layer.items()}
    L = len(types)
    dims = [per_layer.get(i, {}).get("head_dim", hf["head_dim"]) for i in range(L)]
    heads = [per_layer.get(i, {}).get("num_key_value_heads", hf["num_key_value_heads"])
             for i in range(L)]  # fmt: skip
    H = hf["num_attention_heads"]
    for i, G in enumerate(heads):
        if H % G:
            raise ValueError(f"config.json: layer {i} has {G} KV heads; {H} heads need a divisor.")
    return dims, heads


def _kv_sources(types, shared: int) -> list[int]:
    """The layer whose K/V each layer uses: the last `shared` layers reuse the last earlier
    layer of their type (transformers' kv_sharing_modes), the rest their own."""
    L = len(types)
    first = L - shared
    if not 0 <= shared < L:
        raise ValueError(f"config.json: num_kv_shared_layers={shared} must be in [0, {L}).")
    sources = list(range(L))
    for i in range(first, L):
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise ValueError(
                f"config.json: layer {i} ({types[i]}) shares K/V but no earlier layer of that "
                f"type computes them (num_kv_shared_layers={shared})."
            )
        sources[i] = earlier[-1]
    return sources


def _sliding_rope(params: dict[str, Any], hf: dict[str, Any]) -> RopeConfig:
    return RopeConfig.from_hf({"max_position_embeddings": hf["max_position_embeddings"],
                               "rope_parameters": dict(params)})  # fmt: skip


def full_inv_freq(params: dict[str, Any], head_dim: int) -> torch.Tensor:
    """(Dh/2,) inverse frequencies of the full layers' RoPE ("proportional", or any type
    RopeConfig reads, then zero-padded to Dh/2)."""
    if params.get("rope_type", "default") != "proportional":
        inv_freq, _ = rope_inv_freq(RopeConfig.from_hf({"rope_parameters": dict(params)}), head_dim)
        return inv_freq
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    turned = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** turned)
    inv_freq = torch.cat([inv_freq, torch.zeros(head_dim // 2 - angles)])
    return inv_freq / params.get("factor", 1.0)


class Gemma4RMSNorm(nn.Module):
    """x / rms(x) (* weight), in float32, then cast; `scaled=False`: no weight (v_norm)."""

    def __init__(self, dim: int, eps: float, scaled: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scaled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            x32 = x32 * self.weight.float()
        return x32.to(x.dtype)


class Gemma4Attention(nn.Module):
    """GQA with per-head q/k/v norms, scale 1; a shared layer holds only q and o."""

    def __init__(self, cfg: Gemma4Config, i: int, window: int | None) -> None:
        super().__init__()
        D, H, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.rms_norm_eps
        bias = cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = H, cfg.kv_heads[i], cfg.head_dims[i]
        G, Dh = self.num_kv_heads, self.head_dim
        self.window = window
        self.q_proj = nn.Linear(D, H * Dh, bias=bias)
        self.q_norm = Gemma4RMSNorm(Dh, eps)
        self.owns_kv = cfg.kv_source[i] == i
        if self.owns_kv:
            self.k_proj = nn.Linear(D, G * Dh, bias=bias)
            self.v_proj = None if cfg.k_eq_v[i] else nn.Linear(D, G * Dh, bias=bias)
            self.k_norm = Gemma4RMSNorm(Dh, eps)
            self.v_norm = Gemma4RMSNorm(Dh, eps, scaled=False)
        self.o_proj = nn.Linear(H * Dh, D, bias=bias)

    def forward(self, x_TD: torch.Tensor, seq: SeqInfo, cos_sin, shared_kv=None):
        """-> (o_TD, (k_TGD, v_TGD)): the keys and values used (`shared_kv` when given)."""
        T = x_TD.shape[0]
        q_THD = apply_rope(self.q_norm(self.q_proj(x_TD).view(T, self.num_heads, -1)), cos_sin)
        if shared_kv is None:
            G = self.num_kv_heads
            k_TGD = self.k_proj(x_TD).view(T, G, -1)
            v_TGD = k_TGD if self.v_proj is None else self.v_proj(x_TD).view(T, G, -1)
            k_TGD, v_TGD = apply_rope(self.k_norm(k_TGD), cos_sin), self.v_norm(v_TGD)
        else:
            k_TGD, v_TGD = shared_kv
        o_THD = self.attend(q_THD, k_TGD, v_TGD, seq)
        return self.o_proj(o_THD.reshape(T, -1)), (k_TGD, v_TGD)

    @torch.compiler.disable
    def attend(self, q_THD, k_TGD, v_TGD, seq: SeqInfo) -> torch.Tensor:
        """Image rows (`seq.image_spans`) see their whole image on sliding layers only, as
        transformers' Gemma 4 mask (`use_bidirectional_attention: "vision"`)."""
        return attend(q_THD, k_TGD, v_TGD, seq, window=self.window, scale=1.0,
                      image_spans=self.window is not None)  # fmt: skip


class Gemma4Router(nn.Module):
    """Expert logits of the residual stream: proj(rms(x) * scale / sqrt(D)); top-k weights
    renormalised, times `per_expert_scale`."""

    def __init__(self, cfg: Gemma4Config) -> None:
        super().__init__()
        D, E = cfg.hidden_size, cfg.num_experts
        self.norm = Gemma4RMSNorm(D, cfg.rms_norm_eps, scaled=False)
        self.proj = nn.Linear(D, E, bias=False)
        self.scale = nn.Parameter(torch.ones(D))
        self.per_expert_scale = nn.Parameter(torch.ones(E))
        self.k, self.root = cfg.top_k, D**-0.5

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights_TK, ids_TK)."""
        logits_TE = self.proj(self.norm(x_TD) * self.scale * self.root)
        weights_TK, ids_TK = route(logits_TE.float(), self.k, norm_topk_prob=True)
        return weights_TK * self.per_expert_scale[ids_TK], ids_TK


class Gemma4Experts(Qwen3MoeExperts):
    """Stacked GeGLU experts (Qwen3-MoE's layout and grouped GEMMs, gelu for silu)."""

    def __init__(self, cfg: Gemma4Config) -> None:
        super().__init__(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.act = functools.partial(F.gelu, approximate=cfg.gelu_approximate)

    def activate(self, h_RF: torch.Tensor) -> torch.Tensor:
        gate_RI, up_RI = h_RF.chunk(2, dim=-1)
        return self.act(gate_RI) * up_RI


class Gemma4DecoderLayer(nn.Module):
    """Gemma 3's sandwich norms, plus (when configured) the routed block beside the MLP, the
    gated per-layer input and the layer scalar."""

    def __init__(self, cfg: Gemma4Config, i: int, window: int | None) -> None:
        super().__init__()
        D, eps, P = cfg.hidden_size, cfg.rms_norm_eps, cfg.per_layer_dim
        self.self_attn = Gemma4Attention(cfg, i, window)
        self.stores_kv = cfg.stores[i]
        act = functools.partial(F.gelu, approximate=cfg.gelu_approximate)
        width = cfg.intermediate_size * (2 if cfg.double_wide[i] else 1)
        self.mlp = GatedMLP(D, width, act=act)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):  # fmt: skip
            setattr(self, name, Gemma4RMSNorm(D, eps))
        self.register_buffer("layer_scalar", torch.ones(1))
        self.act = act
        if P:
            self.per_layer_input_gate = nn.Linear(D, P, bias=False)
            self.per_layer_projection = nn.Linear(P, D, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(D, eps)
        self.has_moe = cfg.num_experts > 0
        if self.has_moe:
            self.router = Gemma4Router(cfg)
            self.experts = Gemma4Experts(cfg)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(D, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(D, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(D, eps)

    def forward(self, x_TD, seq: SeqInfo, cos_sin, per_layer_TP=None, shared_kv=None):
        """-> x_TD, or (x_TD, k_TGD, v_TGD) for a layer whose K/V later layers reuse."""
        attn_TD, kv = self.self_attn(self.input_layernorm(x_TD), seq, cos_sin, shared_kv)
        x_TD = x_TD + self.post_attention_layernorm(attn_TD)
        y_TD = self.mlp(self.pre_feedforward_layernorm(x_TD))
        if self.has_moe:
            y_TD = self.post_feedforward_layernorm_1(y_TD) + self.routed(x_TD)
        x_TD = x_TD + self.post_feedforward_layernorm(y_TD)
        if per_layer_TP is not None:
            gate_TP = self.act(self.per_layer_input_gate(x_TD)) * per_layer_TP
            x_TD = x_TD + self.post_per_layer_input_norm(self.per_layer_projection(gate_TP))
        x_TD = x_TD * self.layer_scalar
        return (x_TD, *kv) if self.stores_kv else x_TD

    def routed(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The MoE branch: one-pass routing of the residual stream's normed copy."""
        weights_TK, ids_TK = self.router(x_TD)
        p = plan(ids_TK, self.router.per_expert_scale.shape[0])
        h_TD = self.pre_feedforward_layernorm_2(x_TD)
        y_TD = unpermute(self.experts(permute(h_TD, p), p), p, weights_TK)
        return self.post_feedforward_layernorm_2(y_TD)


class Gemma4Backbone(Backbone):
    """Scaled embeddings, per-layer inputs, two RoPEs (sliding: the inherited `inv_freq`;
    full: `full_inv_freq`) and the K/V hand-over from source layers to shared ones."""

    def __init__(self, cfg: Gemma4Config, layers: list[nn.Module]) -> None:
        embed = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        super().__init__(cfg, layers, norm=Gemma4RMSNorm, embed_tokens=embed)
        self.cfg = cfg
        L, P, D = cfg.num_hidden_layers, cfg.per_layer_dim, cfg.hidden_size
        if P:
            self.embed_tokens_per_layer = ScaledEmbedding(cfg.per_layer_vocab, L * P, scale_dim=P)
            self.per_layer_model_projection = nn.Linear(D, L * P, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(P, cfg.rms_norm_eps)
        full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
        self.full_head_dim = cfg.head_dims[full[0]] if full else cfg.head_dim
        self.register_buffer("full_inv_freq", self._full_inv_freq(), persistent=False)
        self.sliding = [t == "sliding_attention" for t in cfg.layer_types]

    def _full_inv_freq(self) -> torch.Tensor:
        return full_inv_freq(self.cfg.full_rope, self.full_head_dim)

    def reset_rope(self) -> None:
        super().reset_rope()
        self.full_inv_freq.copy_(self._full_inv_freq())
        for layer in self.layers:  # persistent, but a checkpoint without them means 1
            layer.layer_scalar.fill_(1.0)

    def kv_layout(self) -> list[tuple[int, int, int]]:
        cfg = self.cfg
        return list(zip(cfg.kv_heads, cfg.head_dims, cfg.kv_source, strict=True))

    def rope_tables(self, seq: SeqInfo, dtype: torch.dtype) -> list:
        pos_T = seq.position_ids
        local = rope_cos_sin(pos_T, self.inv_freq, self.rope_scale, dtype)
        full = rope_cos_sin(pos_T, self.full_inv_freq, 1.0, dtype)
        return [local if sliding else full for sliding in self.sliding]

    def per_layer_inputs(self, input_ids_T, x_TD) -> torch.Tensor | None:
        """(T, L, P): (norm(proj(x) / sqrt(D)) + per-layer embedding) / sqrt(2)."""
        L, P = self.cfg.num_hidden_layers, self.cfg.per_layer_dim
        if not P:
            return None
        T = x_TD.shape[0]
        token_TLP = self.embed_tokens_per_layer(input_ids_T).view(T, L, P)
        proj_TLP = (self.per_layer_model_projection(x_TD) * x_TD.shape[-1] ** -0.5).view(T, L, P)
        return (self.per_layer_projection_norm(proj_TLP) + token_TLP) * 2.0**-0.5

    def forward(self, input_ids_T: torch.Tensor, seq: SeqInfo, x_TD=None, ple_ids_T=None):
        """`x_TD`: the embedding stage's output (image features in their rows,
        models/gemma4_image.py), `ple_ids_T` the ids the per-layer inputs look up (the pad
        token at image rows); by default both from `input_ids_T`."""
        x_TD = self.embed_tokens(input_ids_T) if x_TD is None else x_TD
        ple_ids_T = input_ids_T if ple_ids_T is None else ple_ids_T
        ple_TLP = self.per_layer_inputs(ple_ids_T, x_TD)
        tables = self.rope_tables(seq, x_TD.dtype)
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            ple_TP = None if ple_TLP is None else ple_TLP[:, i]
            out = layer(x_TD, seq, tables[i], ple_TP, shared.get(self.cfg.kv_source[i]))
            if isinstance(out, tuple):
                x_TD, shared[i] = out[0], (out[1], out[2])
            else:
                x_TD = out
        return self.norm(x_TD), []


def build(cfg: Gemma4Config) -> CausalLM:
    """The text model; with its vision tower (models/gemma4_image.py) for a `gemma4`
    config.json with a `vision_config`."""
    windows = sliding_windows(cfg.sliding_window, cfg.layer_types, cfg.num_hidden_layers)
    layers = [Gemma4DecoderLayer(cfg, i, w) for i, w in enumerate(windows)]
    if has_image_side(cfg):
        return Gemma4ImageTextLM(cfg, Gemma4Backbone(cfg, layers))
    return CausalLM(cfg, Gemma4Backbone(cfg, layers), logit_softcap=cfg.final_softcap)


def has_image_side(cfg: Gemma4Config) -> bool:
    return cfg.model_type == "gemma4" and bool(cfg.hf.get("vision_config"))


class Gemma4Weights(WeightMap):
    """HF names, plus: the `layer_scalar` buffers, shared layers' unused k/v tensors (dropped
    at load, as transformers does), and a multimodal checkpoint's prefixes and towers."""

    def __init__(self, cfg: Gemma4Config) -> None:
        super().__init__(cfg)
        self.layouts = MULTIMODAL_LAYOUTS if cfg.model_type == "gemma4" else ()
        self.passthrough = MULTIMODAL_PASSTHROUGH
        if has_image_side(cfg):  # the tower and its embedder are ours (gemma4_image.py)
            self.layouts, self.passthrough = IMAGE_TEXT_LAYOUTS, AUDIO_PASSTHROUGH

    def is_passthrough(self, name: str) -> bool:
        return bool(self.layouts) and name.startswith(self.passthrough)

    def load(self, model: CausalLM, name: str, tensor: torch.Tensor) -> bool:
        if name.endswith(".layer_scalar"):
            model.get_buffer(name).copy_(tensor)
            return True
        prefix, _, attn = name.rpartition(".self_attn.")
        if attn in SHARED_UNUSED and prefix.startswith("model.layers."):
            i = int(prefix.rsplit(".", 1)[1])
            return self.cfg.kv_source[i] != i  # a shared layer's: dropped
        return False

    def hf_state(self, model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
        yield from super().hf_state(model)
        for name, buf in model.named_buffers():
            if name.endswith(".layer_scalar"):
                yield name, buf.detach()

    def expected_names(self, model: CausalLM) -> Iterator[str]:
        yield from super().expected_names(model)
        yield from (n for n, _ in model.named_buffers() if n.endswith(".layer_scalar"))


weights = Gemma4Weights
SPEC = FamilySpec("gemma4", config_from_hf, build, weights)
