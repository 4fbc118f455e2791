"""The generic family: transformers' own modeling code for every model_type without a native
family (or with `model.implementation: transformers`), slipstream's ideas applied from outside
through the interfaces transformers provides, as gpt-fast applies tensor parallelism to a
built model:

- packed sequences: our function in transformers' `AttentionInterface` calls `attend` with
  the batch's host-built `SeqInfo`, passed down the forward's kwargs (models/generic_hooks.py);
  no mask is built; stateful token mixers (linear attention, SSMs, short convolutions) run
  once per packed sequence, so no state crosses a boundary;
- checkpointing/offload: `decoder_layers()` are transformers' `GradientCheckpointingLayer`s,
  which `memory.offload.apply_checkpointing` wraps like native layers;
- loss: the final hidden states of the labelled positions only, then our chunked
  cross-entropy on the head's weight, with the model's logit scaling and softcapping; plus,
  where transformers' class computes one, its routers' load-balancing loss (its own
  `load_balancing_loss_func` over the router logits it records), as `CausalLM.loss` adds ours.

The module tree is transformers' ForCausalLM's own (its children are ours), so parameter
names, LoRA module paths and PEFT adapter keys are transformers' and peft loads them as is.
Weights load through transformers' `from_pretrained` (meta device first, tensors streamed,
its checkpoint conversions such as per-expert -> stacked MoE weights applied), and a merged
export is its `save_pretrained`.

Shapes: T tokens (flat, packed), D hidden, V vocab.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.common import (
    ModelConfig,
    _check_batch,
    check_loss_args,
    head_loss,
)
from slipstream.models.generic_hooks import (
    ATTENTION,
    SEQ_KWARG,
    check_packable,
    implementations,
    packed_batch,
    per_sequence_mixers,
    register,
    scope_layers,
)
from slipstream.models.generic_nf4 import forget_quantization, nf4_config, one_cpu_path
from slipstream.models.moe_block import aux_loss_coef_from_hf
from slipstream.models.rope import RopeConfig
from slipstream.models.spec import FamilySpec
from slipstream.models.weights import WeightMap
from slipstream.ops.packing import SeqInfo

log = logging.getLogger("slipstream")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The fields slipstream reads of any model (FLOPs, logs), from config.json or its
    text_config; transformers' config object is what builds the model."""
    text = {**hf, **(hf.get("text_config") or {})}
    heads = text.get("num_attention_heads") or 1
    hidden = text.get("hidden_size") or text.get("d_model") or text.get("n_embd") or 0
    return ModelConfig(
        model_type=hf.get("model_type"),
        vocab_size=text.get("vocab_size", 0),
        hidden_size=hidden,
        intermediate_size=text.get("intermediate_size") or 0,
        num_hidden_layers=text.get("num_hidden_layers") or text.get("n_layer") or 0,
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or (hidden // heads if heads else 0),
        rms_norm_eps=text.get("rms_norm_eps") or text.get("layer_norm_eps") or 1e-6,
        rope=RopeConfig(),  # unused: transformers' own rotary embedding runs
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hf=dict(hf),
        implementation="transformers",
    )


def _hf_config(cfg: ModelConfig, trust_remote_code: bool = False):
    from transformers import AutoConfig

    hf = dict(cfg.hf)
    model_type = hf.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **hf)
    except Exception as e:  # transformers' own words, on one line
        raise ValueError(f"config.json: transformers cannot build {model_type!r}: {e}") from None


def build(
    cfg: ModelConfig, trust_remote_code: bool = False, auto_class: Any = None, wrapper: Any = None
) -> GenericCausalLM:
    """transformers' model of `cfg` on the current default device, randomly initialised
    (`auto_class`/`wrapper`: AutoModelForCausalLM/GenericCausalLM unless given, as the
    image-text family does: models/generic_vision.py)."""
    from transformers import AutoModelForCausalLM

    register()
    config = _hf_config(cfg, trust_remote_code)
    try:
        model = (auto_class or AutoModelForCausalLM).from_config(
            config, trust_remote_code=trust_remote_code, **_implementations(config)
        )
    except Exception as e:
        raise ValueError(
            f"config.json: transformers cannot build {cfg.model_type!r}: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    return (wrapper or GenericCausalLM)(cfg, model)


def load(
    hf, folder, dtype, device, quantize, source, trust_remote_code=False, auto_class=None,
    wrapper=None,
) -> GenericCausalLM:  # fmt: skip
    """transformers' `from_pretrained` (its loader streams the tensors into a meta-built
    model and applies its checkpoint conversions), wrapped (`auto_class`, `wrapper`: as
    `build`). quantize="nf4" (already checked by the caller, peft.qlora.check_quantize):
    QLoRA's NF4 bases (models/generic_nf4.py)."""
    from transformers import AutoModelForCausalLM

    if folder is None:
        raise ValueError(
            f"{source}: a GGUF file of model_type {hf.get('model_type')!r} has no native "
            "family; load its original Hugging Face checkpoint instead."
        )
    register()
    cfg = config_from_hf(hf)
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
        if hf.get("tie_word_embeddings") and not config.tie_word_embeddings:
            config.tie_word_embeddings = True  # no LM head in the folder (load_with_head's)
        kwargs = _implementations(config)
        dequantize_fp8(config, quantize, source)
        if quantize == "nf4" and getattr(config, "quantization_config", None) is None:
            kwargs["quantization_config"] = nf4_config(config, dtype, decoder_of, trust_remote_code)
        model = (auto_class or AutoModelForCausalLM).from_pretrained(
            str(folder), config=config, dtype=dtype, device_map={"": device},
            trust_remote_code=trust_remote_code, **kwargs,
        )  # fmt: skip
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{source}: transformers cannot load this checkpoint: {first}") from None
    one_cpu_path(model)
    return (wrapper or GenericCausalLM)(cfg, model)


def dequantize_fp8(config, quantize: str | None, source: str) -> None:
    """An FP8 checkpoint (checkpoint/fp8.py) loads dequantised to the model's dtype on every
    device: transformers' FP8 quantizer with `dequantize=True` (by default it keeps FP8
    weights and FP8 matmuls on a CUDA GPU, and dequantises only without one)."""
    qc = getattr(config, "quantization_config", None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") else qc
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return
    if quantize == "nf4":
        raise ValueError(
            f"{source}: model.quantization=nf4 on an FP8 checkpoint runs on native families "
            f"only, not on transformers' modeling code ({config.model_type}); use "
            "model.quantization=none (the FP8 weights load dequantised)."
        )
    config.quantization_config = {**qc, "dequantize": True}


def _implementations(config) -> dict[str, str]:
    """Our attention function, and our experts function where the model's experts dispatch
    through transformers' ExpertsInterface (not for remote code: its class is unknown here)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from slipstream.models.generic_types import image_text_class

    subs = getattr(config, "sub_configs", {}) or {}
    # An image-text model (one a causal LM too, Gemma 3, when it has a vision config): the
    # vision side keeps SDPA (images are not packed sequences).
    vision = image_text_class(config) is not None and "vision_config" in subs
    per_config = {n: ATTENTION if n == "text_config" else "sdpa" for n in subs}
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return {"attn_implementation": per_config if vision else ATTENTION}
    kwargs = implementations(model_class)
    return {**kwargs, "attn_implementation": per_config} if vision else kwargs


def decoder_of(hf_model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """(the backbone, its decoder layers): the first ModuleList of transformers'
    GradientCheckpointingLayers, and the module holding it; in an image-text model, of its
    language model (`language_model`, Idefics3's `text_model`: the vision tower's layers come
    first)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    inner = getattr(hf_model, "model", None)
    language = getattr(inner, "language_model", None) or getattr(inner, "text_model", None)
    for module in (language or hf_model).modules():
        for child in module.children():
            layers = isinstance(child, nn.ModuleList) and len(child) > 0
            if layers and all(isinstance(m, GradientCheckpointingLayer) for m in child):
                return module, child
    raise ValueError(
        f"{type(hf_model).__name__}: no list of decoder layers (GradientCheckpointingLayer) "
        "found; this model cannot be trained by slipstream's generic path."
    )


def head_transform(config) -> tuple[float, float | None]:
    """(scale, softcap) transformers applies to the head's logits: Granite divides by
    `logits_scaling`, Cohere multiplies by `logit_scale`, Falcon-H1 by `lm_head_multiplier`,
    Gemma 2/3 softcap by `final_logit_softcapping`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = 1.0
    if getattr(text, "logits_scaling", None):
        scale /= text.logits_scaling
    for name in ("logit_scale", "lm_head_multiplier"):
        if getattr(text, name, None):
            scale *= getattr(text, name)
    return scale, getattr(text, "final_logit_softcapping", None) or None


def router_loss(hf_model: nn.Module) -> tuple | None:
    """(transformers' `load_balancing_loss_func` of the model's class, num_experts, top-k), or
    None where its ForCausalLM adds no router loss (glm4_moe, deepseek_v3: bias balancing)."""
    fn = getattr(sys.modules[type(hf_model).__module__], "load_balancing_loss_func", None)
    if fn is None or not hasattr(hf_model, "router_aux_loss_coef"):
        return None
    return fn, hf_model.num_experts, hf_model.num_experts_per_tok


class GenericCausalLM(nn.Module):
    """transformers' causal LM under the slipstream model contract (models/contract.py):
    `model(input_ids, seq)` -> logits (T, V), `loss(...)` as `CausalLM.loss`."""

    def __init__(self, cfg: ModelConfig, hf_model: nn.Module) -> None:
        super().__init__()
        if hf_model._parameters or hf_model._buffers:
            raise ValueError(f"{type(hf_model).__name__} holds tensors outside its submodules")
        self.config = cfg
        self.__dict__["hf"] = hf_model  # not a submodule: its children are ours, names kept
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        self.__dict__["_backbone"], self.__dict__["_layers"] = decoder_of(hf_model)
        scope_layers(self._layers)
        self.per_sequence = per_sequence_mixers(self._layers)
        check_packable(self._layers, self.per_sequence, cfg.model_type)
        self.logit_scale, self.softcap = head_transform(hf_model.config)
        self.router_loss = router_loss(hf_model)
        text = hf_model.config.get_text_config().to_dict()
        self.router_aux_loss_coef = aux_loss_coef_from_hf(text) if self.router_loss else 0.0
        hf_model.config.use_cache = False
        self.train()  # from_pretrained leaves eval mode; native models start in train mode

    # The model contract.
    def decoder_layers(self) -> nn.ModuleList:
        return self._layers

    def input_embeddings(self) -> nn.Module:
        return self.hf.get_input_embeddings()

    def lm_head_weight(self) -> torch.Tensor:
        return self.hf.get_output_embeddings().weight

    def kv_layout(self) -> list[tuple[int, int, int]]:
        """(kv heads, head dim, cache layer) of each layer; per layer where the config is
        heterogeneous (Gemma 4's `per_layer_config`); every layer writes its own cache."""
        cfg, hf = self.config, self.hf.config.get_text_config()
        if not getattr(hf, "is_heterogeneous", False):
            return [(cfg.num_key_value_heads, cfg.head_dim, i) for i in range(len(self._layers))]
        layers = [hf.per_layer_config[i] for i in range(len(self._layers))]
        return [(c.num_key_value_heads, c.head_dim, i) for i, c in enumerate(layers)]

    def reset_buffers(self) -> None:
        """Non-persistent buffers (RoPE inverse frequencies) as transformers computes them."""
        for module in self.modules():
            init = getattr(module, "rope_init_fn", None)
            if init is not None and hasattr(module, "inv_freq"):
                inv_freq, _ = init(module.config, module.inv_freq.device)
                module.inv_freq.copy_(inv_freq)

    rope_switch_length = None

    def train(self, mode: bool = True) -> GenericCausalLM:
        super().train(mode)
        self.hf.training = mode
        return self

    def embed(self, input_ids_T: torch.Tensor, images: Any = None) -> torch.Tensor:
        """(T, D) input embeddings; a text model takes no images."""
        if images is not None:
            raise ValueError(f"{self.config.model_type}: this model takes no images")
        return self.input_embeddings()(input_ids_T)

    def hidden_states(
        self, input_ids_T: torch.Tensor, seq: SeqInfo, images: Any = None
    ) -> torch.Tensor:
        """(T, D) after the final norm: transformers' backbone over the packed stream
        (`images`: an image-text model's image inputs, written in by `embed`)."""
        return self._backbone_out(input_ids_T, seq, images)[0][0]

    def _backbone_out(self, input_ids_T: torch.Tensor, seq: SeqInfo, images=None, **kwargs):
        _check_batch(input_ids_T, seq)
        inputs = (
            {"input_ids": input_ids_T[None]}
            if images is None
            else {"inputs_embeds": self.embed(input_ids_T, images)[None]}
        )
        positions = kwargs.pop("position_ids", None)  # Qwen-VL's 3-D ones: generic_vision.py
        with packed_batch(seq):
            return self._backbone(
                **inputs, position_ids=seq.position_ids[None] if positions is None else positions,
                use_cache=False, **{SEQ_KWARG: seq}, **kwargs,
            )  # fmt: skip

    def forward(self, input_ids_T: torch.Tensor, seq: SeqInfo, images: Any = None) -> torch.Tensor:
        logits_TV = F.linear(self.hidden_states(input_ids_T, seq, images), self.lm_head_weight())
        return self.finish_logits(logits_TV)

    def finish_logits(self, logits_TV: torch.Tensor) -> torch.Tensor:
        """The head's raw logits as transformers outputs them (logit scaling, softcap)."""
        if self.logit_scale != 1.0:
            logits_TV = logits_TV * self.logit_scale
        if self.softcap is not None:
            logits_TV = torch.tanh(logits_TV / self.softcap) * self.softcap
        return logits_TV

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
        """As `CausalLM.loss`, the router loss transformers' (`router_loss`); `images` as
        `hidden_states`."""
        check_loss_args(input_ids_T, labels_T, seq, reduction, label_positions)
        aux_on = self.router_loss is not None and self.router_aux_loss_coef > 0
        aux_on = aux_on and reduction != "none"
        router = {"output_router_logits": True} if aux_on else {}
        out = self._backbone_out(input_ids_T, seq, images, **router)
        h_TD = out[0][0]
        if self.logit_scale != 1.0:
            h_TD = h_TD * self.logit_scale
        loss = head_loss(
            h_TD, self.lm_head_weight(), labels_T, reduction, label_positions, temperature,
            self.softcap, with_stats=return_parts and reduction == "none",
        )  # fmt: skip
        if reduction == "none":
            return loss
        parts = {"lm_loss": loss.detach()}
        if aux_on:  # one batch of the T packed tokens, as transformers' unpadded batch
            fn, num_experts, k = self.router_loss
            aux = fn(out.router_logits, num_experts, k, None)
            if reduction == "sum":
                aux = aux * (labels_T != -100).sum()  # N on the device: no sync
            loss = loss + self.router_aux_loss_coef * aux
            parts["aux_loss"] = aux.detach()
        return (loss, parts) if return_parts else loss


def save(model: GenericCausalLM, out) -> None:
    """transformers' `save_pretrained` (its inverse conversions: the checkpoint layout)."""
    forget_quantization(model.hf)  # dequantised for a merged export: full precision
    model.hf.config.use_cache = True
    try:
        model.hf.save_pretrained(str(out))
    finally:
        model.hf.config.use_cache = False


class GenericWeights(WeightMap):
    """transformers' own names; the state adds the persistent buffers transformers saves too
    (a sigmoid router's `e_score_correction_bias`: MiniMax-M2, DeepSeek-V3, GLM-4 MoE)."""

    def hf_state(self, model: nn.Module):
        yield from super().hf_state(model)
        for path, module in model.named_modules():
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers_set:
                    yield f"{path}.{name}" if path else name, buf.detach()


SPEC = FamilySpec("generic", config_from_hf, build, GenericWeights, load)
