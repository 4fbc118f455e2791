"""What a model family becomes in llama.cpp: its GGUF architecture, metadata and tensors.

Names come from the `gguf` package's own tables (`gguf.get_tensor_name_map(arch, n_blocks)`,
the `MODEL_ARCH` enum and `GGUFWriter.add_*` keys). Everything family-specific (which
architecture, what llama.cpp cannot run, the family's metadata, its extra tensors and its
layout changes) is the family's `GGUFSpec` (gguf_families.py); here is only what every family
shares: the common hyperparameters and the renaming.

Every function takes the merged model's HF-named tensors (what `export_merged` writes), one
at a time; only a MoE layer's experts are held together until the layer is complete.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from slipstream.checkpoint.gguf_families import BY_MODEL_TYPE
from slipstream.checkpoint.gguf_generic import GENERIC_SPECS
from slipstream.checkpoint.gguf_spec import IMAGE_TEXT_LM, GGUFSpec, text_hf
from slipstream.models.qwen3_moe import PER_EXPERT

# Our names (hf_state's, before a multimodal layout's prefixes) of a native image-text
# family's vision side.
VISION_SIDE = (
    "vision_tower.",
    "embed_vision.",  # Gemma 4's
    "multi_modal_projector.",
    "visual.",
    "model.visual.",
)  # Qwen-VL: ours
# model_type -> llama.cpp architecture (gguf.MODEL_ARCH member name).
ARCHS = {model_type: spec.arch for model_type, spec in BY_MODEL_TYPE.items()}
# llama.cpp's BPE pre-tokenizer names (its vocab loader refuses names it does not know) for
# the tokenizers these families ship; others get "default" (GPT-2 rules).
PRE_TOKENIZER = {spec.arch: spec.pre_tokenizer for spec in BY_MODEL_TYPE.values()
                 if spec.pre_tokenizer != "default"}  # fmt: skip


# Native families llama.cpp runs (or the gguf package names) but whose GGUF layout slipstream
# does not write (yet): model_type -> why, said after the type. None now: every native
# family's layout is written.
NOT_WRITTEN: dict[str, str] = {}


def gguf_arch(model_type: str) -> Any:
    """The gguf.MODEL_ARCH of a family (native, or built by transformers' modeling code:
    gguf_generic.py), or a one-line error naming the supported ones. An image-text type
    whose language model exports alone (IMAGE_TEXT_LM) has its text family's: `model_arch`."""
    import gguf

    if model_type in IMAGE_TEXT_LM:
        return gguf.MODEL_ARCH[BY_MODEL_TYPE.get(model_type, BY_MODEL_TYPE["llama"]).arch]
    if model_type in NOT_WRITTEN:
        raise ValueError(f"GGUF export: model_type {model_type!r} {NOT_WRITTEN[model_type]}")
    arch = ARCHS.get(model_type) or getattr(GENERIC_SPECS.get(model_type), "arch", None)
    if arch is None:
        raise ValueError(
            f"GGUF export: model_type {model_type!r} has no llama.cpp architecture here; "
            f"supported: {', '.join(sorted({*ARCHS, *GENERIC_SPECS}))}."
        )
    return gguf.MODEL_ARCH[arch]


def spec_for(cfg: Any) -> GGUFSpec:
    """The GGUF spec of a built model: its native family's, or for a model of transformers'
    modeling code the generic one of its type (gguf_generic.py); an image-text model's
    language model's (IMAGE_TEXT_LM); else a one-line error."""
    if cfg.model_type in BY_MODEL_TYPE and cfg.model_type in IMAGE_TEXT_LM:
        return BY_MODEL_TYPE[cfg.model_type]  # its own spec, which checks its language model
    if cfg.model_type in IMAGE_TEXT_LM:
        kind = text_hf(cfg).get("model_type")
        if kind != "llama":
            raise ValueError(
                f"GGUF export: {cfg.model_type} with a {kind!r} language model: only a Llama "
                "one is written here."
            )
        return BY_MODEL_TYPE[kind]
    if getattr(cfg, "implementation", "native") != "transformers":
        gguf_arch(cfg.model_type)
        return BY_MODEL_TYPE[cfg.model_type]
    spec = GENERIC_SPECS.get(cfg.model_type)
    if spec is None:
        also = " (load it with model.implementation: auto)" if cfg.model_type in ARCHS else ""
        raise ValueError(
            f"GGUF export: model_type {cfg.model_type!r} built by transformers' modeling code "
            f"has no llama.cpp mapping here{also}; supported there: "
            f"{', '.join(sorted(GENERIC_SPECS))}."
        )
    return spec


def language_model(cfg: Any) -> Any:
    """The config the spec reads: an image-text type's (IMAGE_TEXT_LM) with its language
    model's RoPE from config.json, since transformers' rotary embedding runs it and the
    generic config holds a placeholder (its base 1e4 went into the GGUF: Mistral Small 3.1's
    is 1e9, SmolVLM's 1e5)."""
    if cfg.model_type not in IMAGE_TEXT_LM:
        return cfg
    from dataclasses import replace

    from slipstream.models.rope import RopeConfig

    return replace(cfg, rope=RopeConfig.from_hf(text_hf(cfg)))


def check_supported(cfg: Any) -> None:
    """Refuse what llama.cpp would run differently from us (one line: what and why)."""
    spec_for(cfg).check(language_model(cfg), text_hf(cfg))


def block_count(cfg: Any) -> int:
    """The decoder layers: config.json's num_hidden_layers, or where it has none (Nemotron-H:
    transformers counts its layers_block_type) the length of that list."""
    return cfg.num_hidden_layers or len(text_hf(cfg).get("layers_block_type") or [])


def write_metadata(w: Any, cfg: Any, arch: Any) -> None:
    """Hyperparameters under llama.cpp's keys (`GGUFWriter.add_*`), as its converter writes them."""
    hf, cfg = text_hf(cfg), language_model(cfg)
    w.add_block_count(block_count(cfg))
    w.add_context_length(int(hf.get("max_position_embeddings") or 4096))
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    spec_for(cfg).write_metadata(w, cfg, hf)


def extra_tensors(cfg: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors llama.cpp wants that HF derives from config.json (RoPE factors)."""
    yield from spec_for(cfg).extra_tensors(language_model(cfg))


def hf_named_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors under transformers' text-model names (no vision tower):
    the family's weight map (models/weights.py) without a multimodal layout's prefixes. A
    native image-text family holds its tower and projector too (Gemma 3's SigLIP): they go
    to the mmproj file (gguf_mmproj.py), not here."""
    from slipstream.models import weight_map

    lm = IMAGE_TEXT_LM.get(model.config.model_type)
    for name, t in weight_map(model.config).hf_state(model):
        if lm is not None:  # the language model's names as its own family's checkpoint
            if name.startswith(lm):
                yield "model." + name[len(lm) :], t
            elif name.startswith("lm_head."):
                yield name, t
        elif not name.startswith(VISION_SIDE):
            yield name, t


def gguf_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(llama.cpp name, tensor in llama.cpp's layout), one at a time, float32 or model dtype."""
    import gguf

    cfg = model.config
    spec = spec_for(cfg)
    arch = gguf.MODEL_ARCH[spec.arch]
    names = gguf.get_tensor_name_map(arch, block_count(cfg))
    experts: dict[str, dict[int, torch.Tensor]] = {}
    num_experts = getattr(cfg, "num_experts", None) or _num_experts(cfg)

    def rename(hf_name: str) -> str:
        out = names.get_name(hf_name, try_suffixes=(".weight", ".bias", ".scale"))
        if out is None:
            raise ValueError(
                f"GGUF export: no llama.cpp name for tensor {hf_name!r} ({spec.arch})."
            )
        return out

    yield from extra_tensors(cfg)
    for name, t in hf_named_tensors(model):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        m = PER_EXPERT.match(name)
        if m is not None:  # qwen3_moe: stack a layer's experts once all have come
            key = f"{m.group(1)}.{m.group(3)}.weight"
            experts.setdefault(key, {})[int(m.group(2))] = t
            if len(experts[key]) == num_experts:
                parts = experts.pop(key)
                yield rename(key), torch.stack([parts[e] for e in range(num_experts)])
            continue
        yield from to_llama_cpp(spec, cfg, name, t, rename)
    assert not experts, f"incomplete experts: {sorted(experts)[:3]}"


def _num_experts(cfg: Any) -> int:
    from slipstream.models.moe_block import num_experts_from_hf

    try:
        return num_experts_from_hf(text_hf(cfg))
    except (KeyError, ValueError, TypeError):
        return 0


def to_llama_cpp(
    spec: GGUFSpec, cfg: Any, name: str, t: torch.Tensor, rename
) -> Iterator[tuple[str, Any]]:
    """(llama.cpp name, tensor) for one HF tensor (`GGUFSpec.to_hf` is the inverse)."""
    for hf_name, x in spec.to_llama_cpp(cfg, name, t):
        yield rename(hf_name), x
