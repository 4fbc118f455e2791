"""PEFT's names for our LoRA, spelled here only: the adapter files, the tensor keys
(`base_model.model.<transformers' module path>.lora_A.weight`, `.lora_B.weight`,
`.lora_magnitude_vector` for DoRA), `target_modules` and `target_parameters`. Transformers' path
is ours but where its tree holds our modules under another prefix (a multimodal Gemma 3's text
model at `model.language_model.*`): the first layout of the family's weight map.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from slipstream.models import FAMILIES, weight_map
from slipstream.models.weights import Layout, to_hf_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
EXPERT_TARGETS = ("gate_up_proj", "down_proj")  # the stacked expert parameters, in order
# Target names that reach the stacked experts of a MoE model: the dense MLP's names map to the
# fused expert parameter that holds them.
EXPERT_TARGET_OF = {
    "gate_up_proj": "gate_up_proj",
    "down_proj": "down_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def model_layout(model: nn.Module) -> Layout:
    """Our prefix -> transformers' module path prefix, where they differ (multimodal Gemma 3)."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in FAMILIES:
        return ()
    layouts = weight_map(cfg).layouts
    return layouts[0] if layouts else ()


def peft_path(name: str, layout: Layout) -> str:
    """Transformers' module path for our module `name` (the path peft's keys and targets use)."""
    return to_hf_name(name, layout)


def adapter_key(path: str) -> str:
    """The key stem of the module at transformers' `path`; `.lora_A.weight` etc. follow."""
    return PEFT_PREFIX + path


def expert_keys(path: str, targets: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """PEFT key -> (target, "A"|"B") for the experts at `path` with LoRA on `targets` (in
    EXPERT_TARGETS order). peft nests one wrapper per parameter, the first innermost, so the
    i-th of n is keyed `<path>` + `.base_layer` * (n-1-i) + `.lora_A.weight`."""
    keys = {}
    n = len(targets)
    for i, name in enumerate(targets):
        stem = adapter_key(path) + ".base_layer" * (n - 1 - i)
        keys[f"{stem}.lora_A.weight"] = (name, "A")
        keys[f"{stem}.lora_B.weight"] = (name, "B")
    return keys


def parameter_targets(
    wrapped: dict[str, tuple[str, ...]], paths: list[str], layout: Layout
) -> list[str]:
    """PEFT's `target_parameters` for LoRA on `wrapped` (module path -> parameters) of the
    modules at `paths` (all of the model's of that kind, e.g. every MoE experts module):
    `<parent>.<module>.<parameter>` (`mlp.experts.gate_up_proj`; `experts.gate_up_proj` where
    the module hangs off the numbered layer itself, Gemma 4: a layer number would match that
    layer alone) where every one has it, else the full path of each that has it."""
    names = []
    params = [p for p in (*EXPERT_TARGETS, "weight") if any(p in w for w in wrapped.values())]
    for t in params:
        having = [p for p in paths if t in wrapped.get(p, ())]
        if having == paths:
            parent, module = ([""] + paths[0].split("."))[-2:]
            names.append(
                f"{module}.{t}" if parent.isdigit() or not parent else f"{parent}.{module}.{t}"
            )
        else:
            names += [f"{peft_path(p, layout)}.{t}" for p in having]
    return names


def target_modules(
    names: list[str], wrapped: list[str], unwrapped: list[str], layout: Layout
) -> list[str] | str:
    """`target_modules` for adapter_config.json: the short `names`, unless peft would wrap more
    with them on transformers' model (its tree holds more than ours: a `layout`, e.g. the vision
    tower; or some `unwrapped` linears share a name); then a regex of exactly the `wrapped`
    paths (ours), which peft full-matches."""
    left = [peft_path(p, layout) for p in unwrapped]
    if not layout and not {p.rsplit(".", 1)[-1] for p in left} & set(names):
        return names
    wrapped = [peft_path(p, layout) for p in wrapped]
    regex = paths_regex(wrapped)
    if any(re.fullmatch(regex, p) for p in left):  # some layers were left out: list them all
        regex = "|".join(re.escape(p) for p in wrapped)
    return regex


def paths_regex(paths: Iterable[str]) -> str:
    """A regex full-matching these module paths at any layer number: one alternative per
    parent path, its last names grouped. A last name that is a number stays that number
    (`merger.mlp.0`, a Sequential's linear: `mlp.1` is its activation)."""
    groups: dict[str, set[str]] = {}
    for path in paths:
        *parents, last = path.split(".")
        parts = [r"\d+" if p.isdigit() else re.escape(p) for p in parents]
        groups.setdefault(r"\.".join(parts), set()).add(re.escape(last))
    alternatives = []
    for parent, last in sorted(groups.items()):
        tail = next(iter(last)) if len(last) == 1 else f"(?:{'|'.join(sorted(last))})"
        alternatives.append(rf"{parent}\.{tail}" if parent else tail)
    return "|".join(alternatives)
