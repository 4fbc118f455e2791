"""Building blocks shared by the model families: config, RMSNorm, attention, gated MLP,
decoder layer, backbone and the causal LM shell.

A family composes them: it passes what differs as constructor arguments (biases, q/k norms,
the norm class, an embedding module, the layers) and overrides a method only where a step
differs (fused projections, sink attention, several RoPE tables). Nothing is deleted or
replaced after construction.

Layout is the flat packed one: hidden states are (T, D) with no batch dimension; a `SeqInfo`
carries the sequence boundaries. Module and parameter names mirror Hugging Face's, so for the
dense families a checkpoint loads by name with no mapping at all.

Shapes: T tokens, D hidden, H query heads, G kv heads, Dh head dim, V vocab, F mlp width,
N labelled positions (the rows `loss` sends through the LM head when given them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.rope import RopeConfig, apply_rope, rope_cos_sin, rope_inv_freq
from slipstream.ops.attention import attend
from slipstream.ops.loss import linear_cross_entropy, linear_token_logps
from slipstream.ops.moe import load_balancing_loss
from slipstream.ops.packing import SeqInfo


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hf: dict[str, Any] = field(default_factory=dict, repr=False)
    implementation: str = "native"  # or "transformers": the generic family (models/generic.py)


def base_config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """Fields every Llama-like config.json has; families pass what differs as overrides."""
    heads = hf["num_attention_heads"]
    kwargs = dict(
        model_type=hf["model_type"],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf.get("intermediate_size", 0),
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope=RopeConfig.from_hf(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        hf=dict(hf),
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (bf16 variance loses ~3 digits), scale in the input dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with RoPE over packed sequences.

    Families vary it by constructor arguments (biases; `q_norm`/`k_norm`, modules over each
    head's Dh features applied before RoPE; the softmax `scale`) or by overriding one step:
    `make_qkv_proj` + `project_qkv` (fused projections), `attend` (sink logits).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        window: int | None = None,
        *,
        bias: bool | None = None,
        o_bias: bool | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        D, H, Dh = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, cfg.num_key_value_heads, Dh
        self.window, self.scale = window, scale
        bias = cfg.attention_bias if bias is None else bias
        self.make_qkv_proj(D, bias)
        self.o_proj = nn.Linear(H * Dh, D, bias=bias if o_bias is None else o_bias)
        self.q_norm, self.k_norm = q_norm, k_norm

    def make_qkv_proj(self, D: int, bias: bool) -> None:
        H, G, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(D, H * Dh, bias=bias)
        self.k_proj = nn.Linear(D, G * Dh, bias=bias)
        self.v_proj = nn.Linear(D, G * Dh, bias=bias)

    def project_qkv(self, x_TD: torch.Tensor):
        T = x_TD.shape[0]
        q_THD = self.q_proj(x_TD).view(T, self.num_heads, self.head_dim)
        k_TGD = self.k_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        v_TGD = self.v_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        return q_THD, k_TGD, v_TGD

    def forward(self, x_TD: torch.Tensor, seq: SeqInfo, cos_sin) -> torch.Tensor:
        q_THD, k_TGD, v_TGD = self.project_qkv(x_TD)
        if self.q_norm is not None:
            q_THD, k_TGD = self.q_norm(q_THD), self.k_norm(k_TGD)
        q_THD, k_TGD = apply_rope(q_THD, cos_sin), apply_rope(k_TGD, cos_sin)
        o_THD = self.attend(q_THD, k_TGD, v_TGD, seq)
        return self.o_proj(o_THD.reshape(x_TD.shape[0], -1))

    @torch.compiler.disable
    def attend(self, q_THD, k_TGD, v_TGD, seq: SeqInfo) -> torch.Tensor:
        # `self.window` is read here, outside regional compile's graph (compile.py): read in
        # `forward` it is a guard, and sliding and full layers compiled a variant each (6
        # graphs instead of 5 for a 4-layer Qwen3 with LoRA), nearer dynamo's limit of 8.
        return attend(q_THD, k_TGD, v_TGD, seq, window=self.window, scale=self.scale)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with the default `act`, GeGLU with gelu."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, act: Callable = F.silu) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = act

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x_TD)) * self.up_proj(x_TD))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)).

    `norm(dim, eps)` builds both norms (RMSNorm unless the family's differs).
    """

    def __init__(
        self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module, norm: Callable = RMSNorm
    ) -> None:
        super().__init__()
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x_TD: torch.Tensor, seq: SeqInfo, cos_sin):
        """-> x_TD, or (x_TD, *extras) when the MLP returns (y_TD, *extras) (a MoE block: its
        router statistics)."""
        x_TD = x_TD + self.self_attn(self.input_layernorm(x_TD), seq, cos_sin)
        y_TD, extras = split_outputs(self.mlp(self.post_attention_layernorm(x_TD)))
        return (x_TD + y_TD, *extras) if extras else x_TD + y_TD


class Backbone(nn.Module):
    """Embeddings, the decoder layers, the final norm (HF's `model.` prefix).

    `embed_tokens` defaults to a plain nn.Embedding, `norm(dim, eps)` to RMSNorm. One RoPE
    (`cfg.rope`) serves every layer; a family with several overrides `rope_tables`.
    """

    # The sequence length at which a sequence's RoPE tables change for every position
    # (Phi-3 longrope: original_max_position_embeddings + 1), so generation recomputes the
    # cached prefix there, as transformers does; None: positions never change tables.
    rope_switch_length: int | None = None

    def __init__(
        self,
        cfg: ModelConfig,
        layers: list[nn.Module],
        norm: Callable = RMSNorm,
        embed_tokens: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens or nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope_config, self.head_dim = cfg.rope, cfg.head_dim
        self.num_kv_heads = cfg.num_key_value_heads
        inv_freq, self.rope_scale = rope_inv_freq(cfg.rope, cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def kv_layout(self) -> list[tuple[int, int, int]]:
        """(kv heads, head dim, cache layer) of each layer: every layer its own cache."""
        return [(self.num_kv_heads, self.head_dim, i) for i in range(len(self.layers))]

    def reset_rope(self) -> None:
        """Recompute the RoPE buffers (after `to_empty` left them uninitialised)."""
        inv_freq, self.rope_scale = rope_inv_freq(self.rope_config, self.head_dim)
        self.inv_freq.copy_(inv_freq)

    def rope_tables(self, seq: SeqInfo, dtype: torch.dtype) -> list:
        """One (cos, sin) pair per layer; each distinct pair built once per forward."""
        cos_sin = rope_cos_sin(seq.position_ids, self.inv_freq, self.rope_scale, dtype)
        return [cos_sin] * len(self.layers)

    def forward(self, input_ids_T: torch.Tensor, seq: SeqInfo, x_TD: torch.Tensor | None = None):
        """-> (h_TD after the final norm, the layers' extra outputs in layer order: the MoE
        blocks' router statistics). `x_TD`: the input embeddings when the model's embedding
        stage gave them (Gemma 3: image features in their rows), else the token embeddings."""
        x_TD = self.embed_tokens(input_ids_T) if x_TD is None else x_TD
        extras = []
        for layer, cos_sin in zip(self.layers, self.rope_tables(seq, x_TD.dtype), strict=True):
            x_TD, more = split_outputs(layer(x_TD, seq, cos_sin))
            extras += more
        return self.norm(x_TD), extras


def split_outputs(out) -> tuple[torch.Tensor, tuple]:
    """A module's output -> (its main tensor, its extra outputs): a lone tensor has none."""
    return (out, ()) if isinstance(out, torch.Tensor) else (out[0], tuple(out[1:]))


def sliding_windows(
    window: int | None, layer_types: Sequence[str], num_layers: int
) -> list[int | None]:
    """Per-layer attention window: `window` on the layers `layer_types` marks
    'sliding_attention', None (full causal) on 'full_attention' ones; checked at load."""
    if window is not None and not (isinstance(window, int) and window > 0):
        raise ValueError(
            f"config.json: sliding_window={window!r} must be a positive integer or null."
        )
    n, other = len(layer_types), set(layer_types) - {"full_attention", "sliding_attention"}
    if n != num_layers or other:
        problem = f"{n} entries but num_hidden_layers is {num_layers}" if n != num_layers else ""
        raise ValueError(
            f"config.json: layer_types has {problem or f'unknown kinds {sorted(other)}'}; "
            "each is 'full_attention' or 'sliding_attention'."
        )
    return [window if t == "sliding_attention" else None for t in layer_types]


class CausalLM(nn.Module):
    """`model(input_ids, seq)` -> logits (T, V); `model.loss(...)` without full fp32 logits.

    `router_aux_loss_coef` > 0 (MoE): `loss` adds coef * the router load-balancing loss.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        backbone: Backbone,
        router_aux_loss_coef: float = 0.0,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = backbone
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.router_aux_loss_coef = router_aux_loss_coef
        self.logit_softcap = logit_softcap  # logits -> c * tanh(logits / c) (Gemma 4)

    # The model contract (models/contract.py): what code outside models/ may use.
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    # An image-text family's backbone takes `images` (models/qwen_vl.py: its `embed` writes
    # the tower's features into their rows); a text family's refuses them.
    takes_images = False

    def embed(self, input_ids_T: torch.Tensor, images: Any = None) -> torch.Tensor:
        """(T, D): the embedding stage (models/contract.py)."""
        if images is None:
            return self.model.embed_tokens(input_ids_T)
        if not self.takes_images:
            raise ValueError(f"{self.config.model_type}: slipstream's native model takes no images")
        return self.model.embed(input_ids_T, images)[0]

    def reset_buffers(self) -> None:
        self.model.reset_rope()

    @property
    def rope_switch_length(self) -> int | None:
        return self.model.rope_switch_length

    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def kv_layout(self) -> list[tuple[int, int, int]]:
        """(kv heads, head dim, layer whose cache it reads) of each layer, for the KV cache."""
        return self.model.kv_layout()

    def hidden_states(
        self, input_ids_T: torch.Tensor, seq: SeqInfo, images: Any = None
    ) -> torch.Tensor:
        """(T, D) after the final norm (`images`: an image-text family's image inputs)."""
        return self._backbone_out(input_ids_T, seq, images)[0]

    def _backbone_out(self, input_ids_T: torch.Tensor, seq: SeqInfo, images: Any = None):
        _check_batch(input_ids_T, seq)
        if images is None:
            return self.model(input_ids_T, seq)
        if not self.takes_images:
            raise ValueError(f"{self.config.model_type}: slipstream's native model takes no images")
        return self.model(input_ids_T, seq, images)  # an image-text backbone (models/qwen_vl.py)

    def forward(self, input_ids_T: torch.Tensor, seq: SeqInfo, images: Any = None) -> torch.Tensor:
        return self.finish_logits(
            F.linear(self.hidden_states(input_ids_T, seq, images), self.lm_head_weight())
        )

    def finish_logits(self, logits_TV: torch.Tensor) -> torch.Tensor:
        """The head's raw logits as the model outputs them (final softcap, where it has one):
        what generation and scoring apply after their own head matmul."""
        if self.logit_softcap is None:
            return logits_TV
        return torch.tanh(logits_TV / self.logit_softcap) * self.logit_softcap

    def loss(
        self,
        input_ids_T: torch.Tensor,
        labels_T: torch.Tensor,
        seq: SeqInfo,
        reduction: str = "mean",
        label_positions: torch.Tensor | None = None,
        return_parts: bool = False,
        temperature: float = 1.0,
        images: Any = None,
    ):
        """Cross-entropy over positions whose label is not -100 (labels already shifted),
        plus, as transformers adds it, `router_aux_loss_coef * aux` when that is > 0 (MoE;
        with reduction "sum" times the labelled-token count N, so that after one division by
        the step's count each micro-batch contributes transformers' `loss + coef * aux`).

        `label_positions` (N,) int64: indices of (at least) the labelled positions, built on
        the host (`Batch.label_positions`). Only those rows go through the LM head; the
        result and gradients equal the full computation's (up to summation order).
        `reduction="none"` (needs `label_positions`, every one labelled): the (N,) float32
        cross-entropy of each of those positions, i.e. minus its target's log-prob, for
        objectives that weigh tokens or sequences (slipstream/objectives/logps.py); no aux.
        `return_parts`: -> (loss, parts), parts detached for logging: `lm_loss` (the
        cross-entropy) and, when added, `aux_loss` (aux, times N for "sum").
        `temperature` (reduction "none" only): log-probs of logits / temperature (GRPO scores
        completions under the distribution they were sampled from, as TRL does).
        With reduction "none", `return_parts` -> (cross-entropy_N, {"entropy", "mean_logit":
        (N,) each scored position's (tempered) softmax entropy and mean logit, detached}).
        `images`: as `hidden_states`.
        """
        check_loss_args(input_ids_T, labels_T, seq, reduction, label_positions)
        h_TD, router_stats = self._backbone_out(input_ids_T, seq, images)
        loss = head_loss(
            h_TD, self.lm_head_weight(), labels_T, reduction, label_positions, temperature,
            self.logit_softcap, with_stats=return_parts and reduction == "none",
        )  # fmt: skip
        if reduction == "none":
            return loss
        parts = {"lm_loss": loss.detach()}
        if router_stats and self.router_aux_loss_coef > 0:  # a Python float: no sync
            aux = load_balancing_loss(router_stats, input_ids_T.shape[0])
            if reduction == "sum":
                aux = aux * (labels_T != -100).sum()  # N on the device: no sync
            loss = loss + self.router_aux_loss_coef * aux
            parts["aux_loss"] = aux.detach()
        return (loss, parts) if return_parts else loss


def check_loss_args(input_ids_T, labels_T, seq, reduction, label_positions) -> None:
    """The one-line errors of `loss`'s arguments (shapes only: no host sync)."""
    if labels_T.shape != input_ids_T.shape:
        raise ValueError(
            f"labels has shape {tuple(labels_T.shape)} but input_ids has "
            f"{tuple(input_ids_T.shape)}; they must match (flat packed layout)."
        )
    if reduction == "none" and label_positions is None:
        raise ValueError("reduction='none' needs label_positions (the rows to score)")
    _check_batch(input_ids_T, seq)


def head_loss(
    h_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    reduction: str,
    label_positions: torch.Tensor | None,
    temperature: float = 1.0,
    softcap: float | None = None,
    with_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss`'s cross-entropy of the final hidden states (see CausalLM.loss); a head whose
    logits are scaled takes `h_TD` pre-scaled (no bias: (s h) W^T = s logits).
    `with_stats` (reduction "none"): -> (cross-entropy_N, {"entropy", "mean_logit": (N,)})."""
    if label_positions is not None:
        _check_positions(label_positions, labels_T)
        # The head costs 6*V*D FLOPs a row in training (V*D = 28M for SmolLM2, 156M for
        # Qwen3-0.6B); with 38% of rows labelled (chitchat) 62% of that fed losses of 0.
        # index_select by host-built indices has a known output shape, no host sync;
        # `h_TD[labels_T != -100]` would sync to size its output.
        h_TD = h_TD.index_select(0, label_positions)
        labels_T = labels_T.index_select(0, label_positions)
    if reduction == "none":
        if temperature != 1.0 and softcap is not None:
            raise ValueError("log-probs at a temperature of a softcapped head: not supported")
        if temperature != 1.0:  # the head has no bias: (h / T) W^T = logits / T
            h_TD = h_TD / temperature
        out = linear_token_logps(h_TD, weight_VD, labels_T, softcap=softcap,
                                 with_stats=with_stats)  # fmt: skip
        return (-out[0], out[1]) if with_stats else -out
    return linear_cross_entropy(h_TD, weight_VD, labels_T, reduction=reduction, softcap=softcap)


# data/vision.py FEATURE_INDEX: which feature row each image row takes, where sequences share
# their images (a preference pair's chosen and rejected: one prompt, the tower run once).
FEATURE_INDEX = "image_feature_index"


def image_row_features(feats_PD: torch.Tensor, images: dict[str, Any]) -> torch.Tensor:
    """(R, D): the feature row each of `images["image_rows"]` (R,) takes: the tower's rows in
    order, or, when sequences of the batch share their images, gathered by the host-built
    `images["image_feature_index"]` (R,) (an `index_select`: the rows' gradients add up in
    the shared features, as two tower passes' would in the tower's weights)."""
    index_R = images.get(FEATURE_INDEX)
    return feats_PD if index_R is None else feats_PD.index_select(0, index_R)


def write_image_features(
    x_TD: torch.Tensor, feats_PD: torch.Tensor, images: dict[str, Any]
) -> torch.Tensor:
    """The embedding stage of an image-text model: the tower's feature rows written into the
    packed rows the collator found on the host (`images["image_rows"]`, data/vision.py) by
    `index_copy` (through `image_row_features`): no `input_ids == image_token_id` on the
    device, no boolean mask, no sync (the check compares shapes)."""
    rows_R, feats_RD = images["image_rows"], image_row_features(feats_PD, images)
    if feats_RD.shape[0] != rows_R.shape[0]:
        raise ValueError(
            f"the vision tower gave {feats_RD.shape[0]} feature rows for {rows_R.shape[0]} "
            "image tokens; the data's image processor does not match this model"
        )
    return x_TD.index_copy(0, rows_R, feats_RD.to(x_TD.dtype))


def _check_batch(input_ids_T: torch.Tensor, seq: SeqInfo) -> None:
    if input_ids_T.dim() != 1:
        raise ValueError(
            f"input_ids has shape {tuple(input_ids_T.shape)}; slipstream uses the flat packed "
            "layout (T,): concatenate the sequences and describe them with a SeqInfo."
        )
    if input_ids_T.shape[0] != seq.total_tokens:
        raise ValueError(
            f"input_ids has {input_ids_T.shape[0]} tokens but sum(seq.lengths) = "
            f"{seq.total_tokens}; they must be equal."
        )


def _check_positions(label_positions: torch.Tensor, labels_T: torch.Tensor) -> None:
    # Shape and dtype only: checking the values would read them back (a host sync).
    if label_positions.dim() != 1 or label_positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"label_positions has shape {tuple(label_positions.shape)} and dtype "
            f"{label_positions.dtype}; it must be (N,) int64 indices into labels "
            "(collate builds it as Batch.label_positions)."
        )
    if label_positions.device != labels_T.device:
        raise ValueError(
            f"label_positions is on {label_positions.device} but labels on {labels_T.device}; "
            "move the batch with Batch.to(device)."
        )
