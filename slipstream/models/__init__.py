"""Model families, one file each, looked up by config.json's `model_type`.

A family module exports `SPEC` (models/spec.py): `config_from_hf(hf) -> ModelConfig`,
`build(cfg) -> model` and `weights(cfg) -> WeightMap`: how its parameters are named and laid
out in a checkpoint (models/weights.py; the identity map where the names are Hugging Face's).
A `model_type` without a native family takes the generic one (models/generic.py:
transformers' own modeling code); `model.implementation` forces either.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported here: `check_model_type` answers before torch loads
    from slipstream.models.spec import FamilySpec
    from slipstream.models.weights import WeightMap

# model_type -> module name under slipstream.models
FAMILIES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen2_5_vl": "qwen2_5_vl",  # Qwen2_5_VLForConditionalGeneration: tower + language model
    "phi3": "phi3",
    "qwen3": "qwen3",
    "qwen3_vl": "qwen3_vl",  # Qwen3VLForConditionalGeneration: tower + language model
    "qwen3_moe": "qwen3_moe",
    "gpt_oss": "gpt_oss",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # Gemma3ForConditionalGeneration: its text model
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",  # Qwen3_5ForConditionalGeneration: its text model
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_5_moe": "qwen3_5_moe",
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",  # Gemma4ForConditionalGeneration: text model + vision tower
}


IMPLEMENTATIONS = ("auto", "native", "transformers")  # `model.implementation`
GENERIC = "generic"  # the family module for transformers' own modeling code
GENERIC_VISION = "generic_vision"  # and for its image-text models (AutoModelForImageTextToText)
# Native families of image-text checkpoints whose `implementation: transformers` is
# transformers' image-text model (the generic image-text path: the reference for tests).
IMAGE_TEXT_REFERENCE = ("gemma3", "gemma4", "qwen3_5", "qwen3_5_moe")
# Native text families of image-text checkpoints whose image side runs on the generic
# image-text path: `implementation: transformers` (and `auto` with image rows: train/setup.py,
# generation/commands.py) takes it. None now: Gemma 3's, Gemma 4's and Qwen3.5's native
# families train their image side (models/gemma3.py + siglip.py, gemma4.py + gemma4_image.py,
# qwen3_5.py + qwen_vl.py).
IMAGE_TEXT_ON_GENERIC: tuple[str, ...] = ()


def choose_family(
    model_type: str | None,
    source: str = "config.json",
    implementation: str = "auto",
    hf: dict | None = None,
    trust_remote_code: bool = False,
) -> tuple[str, str]:
    """(family module name, why) for `model_type`: the native family where there is one
    (unless `implementation` is "transformers"), else the generic family when transformers
    builds it as a causal LM, or when config.json (`hf`) names its own modeling code
    (`auto_map`) and `trust_remote_code` allows it; a one-line error otherwise. The one place
    that decides it: `family_spec` and the early checks
    (`checkpoint.model_type.check_model_source`) call it. Torch-free for native types; an
    unknown type imports transformers to ask it."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"model.implementation={implementation!r}; use one of {', '.join(IMPLEMENTATIONS)}."
        )
    native = FAMILIES.get(model_type)
    if implementation == "native":
        if native is None:
            raise ValueError(
                f"{source}: model.implementation=native but model_type {model_type!r} has no "
                f"native family (native: {', '.join(sorted(FAMILIES))}); use auto or "
                "transformers."
            )
        return native, "native family, as model.implementation=native asks"
    if native is not None and implementation == "auto":
        return native, f"native family slipstream/models/{native}.py"
    if model_type in IMAGE_TEXT_REFERENCE + IMAGE_TEXT_ON_GENERIC and "vision_config" in (hf or {}):
        return GENERIC_VISION, f"transformers' image-text modeling code for {model_type!r}"
    from slipstream.models.generic_types import builds_image_text, transformers_builds

    builds, version = transformers_builds(model_type)
    if not builds and builds_image_text(model_type):
        return GENERIC_VISION, f"transformers' image-text modeling code for {model_type!r}"
    remote = "AutoModelForCausalLM" in ((hf or {}).get("auto_map") or {})
    if not builds and remote:
        if not trust_remote_code:
            raise ValueError(
                f"{source}: model_type {model_type!r} needs the checkpoint's own modeling code "
                "(auto_map); it runs arbitrary Python: set model.trust_remote_code: true to "
                "allow it."
            )
        return GENERIC, f"the checkpoint's own modeling code (trust_remote_code) for {model_type!r}"
    if not builds:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported: it has no native family "
            f"({', '.join(sorted(FAMILIES))}) and transformers {version} builds no causal LM "
            "of that type (AutoModelForCausalLM)."
        )
    if native is not None:
        return GENERIC, "transformers' modeling code, as model.implementation=transformers asks"
    return GENERIC, f"transformers' modeling code: no native family for {model_type!r}"


def image_text_implementation(hf: dict | None) -> str:
    """`model.implementation` for image+text work on a checkpoint (config.json `hf`):
    "transformers" where its native family is text only and the generic image-text path runs
    its image side (IMAGE_TEXT_ON_GENERIC, with a vision config), else "auto"."""
    hf = hf or {}
    on_generic = hf.get("model_type") in IMAGE_TEXT_ON_GENERIC and "vision_config" in hf
    return "transformers" if on_generic else "auto"


def check_model_type(model_type: str | None, source: str = "config.json", *args) -> str:
    """A one-line error for a model_type slipstream cannot build; else why the path it takes
    (`args`: choose_family's implementation, hf, trust_remote_code)."""
    return choose_family(model_type, source, *args)[1]


def family_spec(model_type: str | None, source: str = "config.json", *args) -> FamilySpec:
    """The family spec (models/spec.py) that builds `model_type`, native or generic."""
    name, _ = choose_family(model_type, source, *args)
    return importlib.import_module(f"slipstream.models.{name}").SPEC


def family_for(model_type: str | None, source: str = "config.json", *args):
    """The family module (its SPEC and helpers such as `layer_windows`) for `model_type`."""
    name, _ = choose_family(model_type, source, *args)
    return importlib.import_module(f"slipstream.models.{name}")


def weight_map(cfg) -> WeightMap:
    """A fresh weight map for a model of `cfg` (one per load or save: it holds load state)."""
    generic = getattr(cfg, "implementation", "native") == "transformers"
    implementation = "transformers" if generic else "auto"
    return family_spec(cfg.model_type, "config.json", implementation).weights(cfg)
