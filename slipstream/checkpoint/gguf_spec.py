"""What a family's GGUF form is, as one object: `GGUFSpec` (the specs: gguf_families.py).

A spec names the llama.cpp architecture, refuses what llama.cpp would compute differently,
writes the family's metadata and reads it back into config.json keys, and lists the tensor
layout changes, each a `TensorTransform` holding both directions. The generic code around it
(gguf_arch.py: export; gguf_config.py and gguf.py: import; gguf_lora.py: adapters) has no
per-family branch. What most families share is here too and is a spec's default: RoPE's keys
(`rope_metadata`), llama3 RoPE's `rope_freqs` tensor, the Q/K row permutation builder
(`rotary_rows`) and fused stacked experts. No torch import at module level (the CLI reads GGUF
headers before torch loads): a transform gets tensors and uses their methods.

Shapes: tensors are (out_features, in_features) as in HF (GGUF lists dims fastest-first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# (cfg, HF name, tensor) -> [(HF-style name llama.cpp's table renames, tensor), ...]
Export = Callable[[Any, str, Any], list[tuple[str, Any]]]
# (cfg, HF name, the llama.cpp tensors it was made into, in export order) -> (HF name, tensor)s
Import = Callable[[Any, str, list[Any]], Iterator[tuple[str, Any]]]


@dataclass(frozen=True)
class TensorTransform:
    """One layout change between HF and llama.cpp for the HF tensors whose names end with one
    of `suffixes`, both ways. `rows`: it only permutes output rows, so it applies to a LoRA
    adapter's B (out, r) as well (gguf_lora.py); `cols`: only input columns, so to its A."""

    suffixes: tuple[str, ...]
    to_llama_cpp: Export
    to_hf: Import
    rows: bool = False
    cols: bool = False

    def matches(self, name: str) -> bool:
        return name.endswith(self.suffixes)


def _nothing(*args: Any) -> None:
    return None


def _rope_type(member: str) -> Any:
    import gguf

    return gguf.RopeScalingType[member]


def rope_metadata(w: Any, cfg: Any, hf: dict) -> None:
    """RoPE base, rotary dims and scaling (linear, yarn; llama3's key) as llama.cpp reads them."""
    rope = cfg.rope
    w.add_rope_freq_base(float(rope.theta))
    w.add_rope_dimension_count(cfg.head_dim)
    if rope.rope_type == "linear":
        w.add_rope_scaling_type(_rope_type("LINEAR"))
        w.add_rope_scaling_factor(float(rope.factor))
    elif rope.rope_type == "yarn":
        yarn_metadata(w, rope)
    elif rope.rope_type == "llama3":  # the divisors are the rope_freqs tensor; this key picks
        # which of the configs computing them comes back on import (llama.cpp reads it for yarn)
        w.add_rope_scaling_orig_ctx_len(int(rope.original_max_position_embeddings))


def yarn_metadata(w: Any, rope: Any) -> None:
    """YaRN's keys as llama.cpp reads them: type, factor, original context, betas and the
    attention factor where the config gives one."""
    w.add_rope_scaling_type(_rope_type("YARN"))
    w.add_rope_scaling_factor(float(rope.factor))
    w.add_rope_scaling_orig_ctx_len(int(rope.original_max_position_embeddings))
    w.add_rope_scaling_yarn_beta_fast(float(rope.beta_fast))
    w.add_rope_scaling_yarn_beta_slow(float(rope.beta_slow))
    if rope.attention_factor is not None:
        w.add_rope_scaling_yarn_attn_factor(float(rope.attention_factor))


def llama3_rope_tensors(cfg: Any) -> Iterator[tuple[str, Any]]:
    """llama3 RoPE's per-frequency divisors (`rope_freqs`), which llama.cpp wants as a tensor."""
    if cfg.rope.rope_type != "llama3":
        return
    from dataclasses import replace

    import gguf

    from slipstream.models.rope import rope_inv_freq

    plain, _ = rope_inv_freq(replace(cfg.rope, rope_type="default"), cfg.head_dim)
    scaled, _ = rope_inv_freq(cfg.rope, cfg.head_dim)
    # llama.cpp divides each frequency by its factor: factor = plain / scaled.
    yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", plain / scaled


@dataclass(frozen=True)
class GGUFSpec:
    """A family's GGUF form. `model_types`: the model_types exported as this architecture,
    the first being what import gives back. `arch`: the `gguf.MODEL_ARCH` member, `name`
    llama.cpp's `general.architecture`."""

    arch: str
    name: str
    model_types: tuple[str, ...]
    check: Callable[[Any, dict], None] = _nothing  # (cfg, text config.json): ValueError or None
    # (writer, cfg, hf): what follows the common hyperparameters; default: RoPE's keys
    write_metadata: Callable[[Any, Any, dict], None] = rope_metadata
    # config llama.cpp wants as tensors; default: llama3 RoPE's divisors when the model has it
    extra_tensors: Callable[[Any], Iterator[tuple[str, Any]]] = llama3_rope_tensors
    read_config: Callable[[dict, Any, set[str]], None] = _nothing  # (config, reader, names)
    complete: bool = True  # fill transformers' defaults for the model type after read_config
    transforms: tuple[TensorTransform, ...] = ()
    pre_tokenizer: str = "default"  # llama.cpp's BPE pre-tokenizer name for its tokenizers
    # modules llama.cpp multiplies without its LoRA hook: a GGUF LoRA on them is refused
    no_lora: tuple[str, ...] = ()

    @property
    def model_type(self) -> str:
        return self.model_types[0]

    def transform(self, name: str) -> TensorTransform | None:
        """The layout change for HF tensor `name`: the family's own, else the generic one for
        fused stacked experts, else None (the tensor is the same in both)."""
        return next((tr for tr in (*self.transforms, *FUSED_EXPERTS) if tr.matches(name)), None)

    def to_llama_cpp(self, cfg: Any, name: str, t: Any) -> list[tuple[str, Any]]:
        """(HF-style name for llama.cpp's table, tensor) for one HF tensor."""
        tr = self.transform(name)
        return [(name, t)] if tr is None else tr.to_llama_cpp(cfg, name, t)

    def to_hf(self, cfg: Any, name: str, parts: list[Any]) -> Iterator[tuple[str, Any]]:
        """The HF tensor(s) for `name` from its llama.cpp parts: `to_llama_cpp` inverted."""
        tr = self.transform(name)
        return iter([(name, parts[0])]) if tr is None else tr.to_hf(cfg, name, parts)

    def lora_b(self, cfg: Any, module: str, b: Any) -> Any:
        """A LoRA B (out, r) of `module` in llama.cpp's row order."""
        tr = self._lora_transform(module)
        return tr.to_llama_cpp(cfg, module + ".weight", b)[0][1] if tr and tr.rows else b

    def lora_a(self, cfg: Any, module: str, a: Any) -> Any:
        """A LoRA A (r, in) of `module` in llama.cpp's column order."""
        tr = self._lora_transform(module)
        return tr.to_llama_cpp(cfg, module + ".weight", a)[0][1] if tr and tr.cols else a

    def _lora_transform(self, module: str) -> TensorTransform | None:
        tr = self.transform(module + ".weight")
        if tr is not None and not (tr.rows or tr.cols):
            raise ValueError(
                f"GGUF LoRA: {module} is laid out otherwise in llama.cpp's {self.name} (not a "
                "row or column permutation), so its adapter has no GGUF form; export it merged "
                "(--gguf)."
            )
        return tr


# Image-text types whose language model exports as its own family: model_type -> the prefix
# of the language model's names in transformers' module tree (hf_state's names). Llama's
# spec, or the type's own where it has one (mistral3: gguf_families.MISTRAL3).
IMAGE_TEXT_LM = {"idefics3": "model.text_model.", "smolvlm": "model.text_model.",
                 "mistral3": "model.language_model."}  # fmt: skip


# Native image-text types whose language model exports alone (gguf_qwen_vl.py, gguf_qwen35.py).
QWEN_VL_TEXT = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")


def text_hf(cfg: Any) -> dict:
    """config.json of the language model (a multimodal Gemma 3's, Idefics3's text_config)."""
    hf = cfg.hf
    if cfg.model_type in ("gemma3", "gemma4"):
        return {**hf.get("text_config", {}), "model_type": cfg.model_type + "_text"}
    if cfg.model_type in IMAGE_TEXT_LM:
        return {"model_type": "llama", **hf.get("text_config", {})}
    if cfg.model_type in QWEN_VL_TEXT:  # the text part, its mRoPE sections kept
        return {**hf, **(hf.get("text_config") or {}), "model_type": cfg.model_type}
    return hf


def permute_rotary(w: Any, num_heads: int) -> Any:
    """HF's rotate-half rows -> llama.cpp's interleaved pairs, per head (inverse of import)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rotary(w: Any, num_heads: int) -> Any:
    """Undo llama.cpp's Q/K row permutation: per head, interleaved pairs -> two halves."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rotary_rows(suffixes: tuple[str, ...], heads: Callable[[Any], int]) -> TensorTransform:
    """Q or K rows permuted per head (`heads(cfg)` of them): llama.cpp runs its llama
    architecture with GPT-J-style RoPE (interleaved pairs), HF rotates halves."""
    return TensorTransform(
        suffixes,
        lambda cfg, name, t: [(name, permute_rotary(t, heads(cfg)))],
        lambda cfg, name, parts: iter([(name, unpermute_rotary(parts[0], heads(cfg)))]),
        rows=True,
    )


def _split_fused(cfg: Any, name: str, t: Any) -> list[tuple[str, Any]]:
    half = t.shape[1] // 2  # fused (E, 2F, D): gate rows first
    base = name.removesuffix("gate_up_proj")
    return [(base + "gate_proj.weight", t[:, :half]), (base + "up_proj.weight", t[:, half:])]


def _join_fused(cfg: Any, name: str, parts: list[Any]) -> Iterator[tuple[str, Any]]:
    import torch

    yield name, torch.cat(parts, dim=1)


# Stacked experts with a fused gate_up (E, 2F, D) and down (E, D, F), for any family whose
# own spec has no other rule for them.
FUSED_EXPERTS = (
    TensorTransform(("mlp.experts.gate_up_proj",), _split_fused, _join_fused),
    TensorTransform(
        ("mlp.experts.down_proj",),
        lambda cfg, name, t: [(name + ".weight", t)],
        lambda cfg, name, parts: iter([(name, parts[0])]),
    ),
)
