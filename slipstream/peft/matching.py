"""Which modules and parameters an adapter_config.json puts LoRA on, with which rank and alpha:
peft 0.21's rules, spelled once here (peft/tuners/tuners_utils.py `check_target_module_exists`,
`_maybe_include_all_linear_layers`, `BaseTuner._inject_parameters`; peft/utils/other.py
`get_pattern_key`; peft/utils/transformers_weight_conversion.py for Qwen3-MoE).

Names are transformers' module paths (`peft_path`: ours, but under a multimodal Gemma 3's
`model.language_model.` prefix). For each module, as peft:
- `exclude_modules` first: a list entry excludes a path equal to it or ending in "." + it, a
  string excludes the paths it full-matches (`re.fullmatch`);
- `target_modules`: a string is a regex the whole path must match ("all-linear", any case, is
  every nn.Linear but the output head); a list entry matches a path equal to it (then
  `layers_to_transform` does not apply) or ending in "." + it;
- `layers_to_transform` keeps a suffix-matched module only in the listed layers; the layer is
  the number after `layers_pattern` (any of them), or after the first name followed by one;
- `target_parameters` (a list) matches `<module path>.<parameter>` equal to or ending in
  "." + an entry, with neither exclude_modules nor layers_to_transform;
- a target's rank and alpha: the value of the first `rank_pattern` / `alpha_pattern` key K
  (a regex) with `re.match(rf"(.*\\.)?({K})$", path)`, else `r` / `lora_alpha`; for a parameter
  the path is `<module path>.<parameter>`.
On Qwen3-MoE, peft first rewrites transformers-v4 names to the fused v5 experts (`gate_proj` +
`up_proj` -> parameter `gate_up_proj` at twice the rank and alpha, `down_proj` -> parameter
`down_proj`, `gate` -> the router's `gate.weight`): `convert_moe_names`, as it does.

slipstream puts LoRA on nn.Linear layers, MoE experts' `gate_up_proj` / `down_proj` and MoE
routers' `weight`, and trains `modules_to_save` / `trainable_token_indices` on the embedding
and head (peft/embeddings.py, which checks them); any other match, and any key whose value
would change the model in peft but has no form here (LoftQ, ...), is a one-line error naming
it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from torch import nn

from slipstream.models.moe_block import Router, expert_blocks
from slipstream.peft.lora import LoraTargets, is_router_lora
from slipstream.peft.lora_experts import LoRAExperts
from slipstream.peft.lora_linear import LoRALinear
from slipstream.peft.names import EXPERT_TARGETS, model_layout, peft_path

# Keys slipstream reads (the rules above, r, lora_alpha, lora_dropout, use_rslora, use_dora)
# and keys that do not change the adapted model (records, and settings that only act together
# with another key that is checked: megatron_core with megatron_config, qalora_group_size
# with use_qalora, the tie of embedding targets that are refused anyway, the settings of an
# init_lora_weights method).
READ = {
    "r", "lora_alpha", "lora_dropout", "use_rslora", "use_dora", "target_modules",
    "exclude_modules", "target_parameters", "layers_to_transform", "layers_pattern",
    "rank_pattern", "alpha_pattern", "modules_to_save", "trainable_token_indices",
}  # fmt: skip
INERT = {
    "peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode",
    "auto_mapping", "peft_version", "megatron_core", "qalora_group_size", "ensure_weight_tying",
    "runtime_config", "eva_config", "corda_config", "lora_ga_config",
}  # fmt: skip
# The other keys whose value is harmless: peft's default, or one that changes nothing here.
# init_lora_weights only initialises factors that the file then overwrites, except the inits
# that also rewrite the base weight (pissa, olora, corda, loftq, lora_ga, mica).
HARMLESS = {
    "bias": ("none",),
    "fan_in_fan_out": (False,),
    "lora_bias": (False,),
    "use_qalora": (False,),
    "init_lora_weights": (True, False, "gaussian", "eva", "orthogonal"),
}
# transformers v5 fused Qwen3-MoE's experts; peft 0.21 maps the v4 names (as qwen2_moe's).
MOE_RENAMES = {
    "qwen3_moe": {
        "gate": "gate.weight",
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
        "down_proj": "down_proj",
    }
}
MIN_TARGETS_CUT = 20  # peft's MIN_TARGET_MODULES_FOR_OPTIMIZATION
MOE_FUSED = {"qwen3_moe": {"gate_up_proj": ("gate_proj", "up_proj")}}


def check_keys(cfg: dict, source: Path | str) -> None:
    """A one-line error for the first key whose value slipstream cannot represent."""
    for key, value in cfg.items():
        if key in READ or key in INERT:
            continue
        ok = HARMLESS.get(key, ())
        if value in (None, False, [], {}, "") or any(_same(value, o) for o in ok):
            continue
        raise ValueError(
            f"{source}: {key}={value!r} is not supported by slipstream (peft would change the "
            f"model with it); remove it or make the adapter without {key}"
        )
    targets = cfg.get("target_modules")
    if isinstance(targets, str) and cfg.get("layers_to_transform") is not None:
        raise ValueError(
            f"{source}: layers_to_transform needs a list target_modules, not a regex string"
        )
    if cfg.get("layers_pattern") and cfg.get("layers_to_transform") is None:
        raise ValueError(f"{source}: layers_pattern is set but layers_to_transform is not")
    if isinstance(cfg.get("target_parameters"), str):
        raise ValueError(f"{source}: target_parameters must be a list of names, not a string")
    for key in ("target_modules", "exclude_modules"):
        if isinstance(cfg.get(key), str):
            try:
                re.compile(cfg[key])
            except re.error as e:
                raise ValueError(f"{source}: {key} {cfg[key]!r} is no valid regex: {e}") from None


def _same(value, default) -> bool:
    return value == default and type(value) is type(default)  # True is not "gaussian", 1 not True


def in_list(key: str, names) -> bool:
    """peft's list rule: `key` equals an entry or ends in "." + one."""
    return key in names or any(key.endswith(f".{n}") for n in names)


def module_targeted(cfg: dict, key: str) -> bool:
    """peft's `check_target_module_exists` for transformers' module path `key`."""
    exclude = cfg.get("exclude_modules")
    if exclude and (
        re.fullmatch(exclude, key) if isinstance(exclude, str) else in_list(key, exclude)
    ):
        return False
    targets = cfg.get("target_modules")
    if targets is None:
        return False
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    found = any(key.endswith(f".{t}") for t in targets)
    layers = cfg.get("layers_to_transform")
    if not found or layers is None or (isinstance(layers, list) and not layers):
        return found
    index = layer_index(key, cfg.get("layers_pattern"))
    if index is None:
        return False
    return index == layers if isinstance(layers, int) else index in layers


def layer_index(key: str, layers_pattern) -> int | None:
    """The layer number in `key`: after `layers_pattern` (any of a list), else after the first
    name followed by a number (the first, not an expert index deeper down)."""
    if not layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        patterns = [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern
        for pattern in patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
    return int(match["idx"]) if match else None


def pattern_value(patterns: dict | None, key: str, default):
    """peft's `get_pattern_key`: the value of the first key matching the end of `key`."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def rank_alpha(cfg: dict, key: str) -> tuple[int, float]:
    """(rank, alpha) of the target at transformers' path `key`."""
    rank = pattern_value(cfg.get("rank_pattern"), key, cfg["r"])
    return int(rank), pattern_value(cfg.get("alpha_pattern"), key, cfg["lora_alpha"])


def unwrapped_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(our path, module) for every module, a LoRA wrapper standing for the layer it wraps."""

    def visit(prefix: str, module: nn.Module):
        yield prefix, module
        for attr, child in module.named_children():
            if isinstance(child, (LoRALinear, LoRAExperts)):
                child = child.base_layer
            yield from visit(f"{prefix}.{attr}" if prefix else attr, child)

    yield from visit("", model)


def convert_moe_names(cfg: dict, model: nn.Module, source: Path | str) -> dict:
    """`cfg` as peft 0.21 rewrites it on transformers v5 (Qwen3-MoE's fused experts); others
    unchanged. peft's `_convert_peft_config_moe`."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    renames = MOE_RENAMES.get(model_type)
    if renames is None:
        return cfg
    cfg = dict(cfg)
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = _leaf_names(cfg, model, renames) or targets
    if isinstance(targets, str):  # nothing matched: left for the no-match error
        return cfg
    params = set(cfg.get("target_parameters") or [])
    kept, seen = set(), set()
    for target in targets or []:
        old = next((o for o in renames if target == o or target.endswith(f".{o}")), None)
        if old is None:
            kept.add(target)
        else:
            params.add(renames[old])
            seen.add(old)
    rank_pattern = dict(cfg.get("rank_pattern") or {})
    alpha_pattern = dict(cfg.get("alpha_pattern") or {})
    for fused, parts in MOE_FUSED[model_type].items():
        have = seen & set(parts)
        if have and have != set(parts):
            raise ValueError(
                f"{source}: target_modules {sorted(have)} without {sorted(set(parts) - have)}: "
                f"on this model they are one fused parameter, {fused}; name both or neither"
            )
        if have:
            rank_pattern[rf".*\.{fused}"] = cfg["r"] * len(parts)
            alpha_pattern[rf".*\.{fused}"] = cfg["lora_alpha"] * len(parts)
    cfg.update(
        target_modules=kept,
        target_parameters=sorted(params),
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
    )
    return cfg


def _leaf_names(cfg: dict, model: nn.Module, renames: dict) -> set[str]:
    """peft's `_resolve_string_target_modules`: the last names of what the string targets."""
    layout = model_layout(model)
    modules = list(unwrapped_modules(model))
    if cfg["target_modules"].lower() == "all-linear":
        return {n.rsplit(".", 1)[-1] for n in _all_linear(modules)} | set(renames)
    keys = [peft_path(n, layout) for n, _ in modules]
    keys += [
        f"{k}.{p}"
        for k, (_, m) in zip(keys, modules, strict=True)
        for p, _ in m.named_parameters(recurse=False)
    ]
    found = {k.rsplit(".", 1)[-1] for k in keys if module_targeted(cfg, k)}
    for old, new in renames.items():  # v4 names inside a fused parameter's module
        containers = [k.rpartition(".")[0] for k in keys if k.rpartition(".")[2] == new]
        if old not in found and any(module_targeted(cfg, f"{c}.{old}") for c in containers):
            found.add(old)
    return found


def _all_linear(modules: list[tuple[str, nn.Module]]) -> list[str]:
    """Our paths of every nn.Linear but the output head (peft's "all-linear")."""
    return [n for n, m in modules if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] != "lm_head"]


def resolve_targets(cfg: dict, paths: dict[str, nn.Module]) -> dict:
    """`cfg` with target_modules as peft matches them: "all-linear" -> the set of those paths,
    and a list of 20 or more cut to the suffixes that tell them apart from the other modules
    (peft does; it matters with layers_to_transform, which only acts on suffix matches)."""
    targets = cfg.get("target_modules")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = set(_all_linear(list(paths.items())))
    if isinstance(targets, str) or targets is None or len(targets) < MIN_TARGETS_CUT:
        return {**cfg, "target_modules": targets}
    targets = set(targets)
    others = {
        p for p in paths if p not in targets and not any(p.endswith(f".{t}") for t in targets)
    }
    cut = minimal_suffixes(targets, others)
    return {**cfg, "target_modules": cut if len(cut) < len(targets) else targets}


def minimal_suffixes(targets: set[str], others: set[str]) -> set[str]:
    """peft's `_find_minimal_target_modules`: the fewest dotted suffixes of `targets` that
    no name in `others` ends with, shortest first."""

    def suffixes(name: str) -> list[str]:
        parts = name.split(".")
        return [".".join(parts[i:]) for i in range(len(parts))][::-1]

    taken = {s for other in others for s in suffixes(other)}
    required: set[str] = set()
    for item, options in sorted(((t, suffixes(t)) for t in targets), key=lambda x: x[1]):
        for suffix in options:
            if suffix in required or suffix in taken:
                continue
            if not any(item.endswith(f".{r}") for r in required):
                required.add(suffix)
                break
    return required or set(targets)


def adapter_targets(cfg: dict, model: nn.Module, source: Path | str) -> LoraTargets:
    """What `cfg` (an adapter_config.json, checked by `check_keys`) puts LoRA on in `model`, by
    peft's rules (module docstring); one-line errors for what slipstream cannot represent."""
    cfg = convert_moe_names(cfg, model, source)
    layout = model_layout(model)
    modules = list(unwrapped_modules(model))
    shown = cfg.get("target_modules")
    cfg = resolve_targets(cfg, {peft_path(n, layout): m for n, m in modules})
    linears, experts, routers = {}, {}, {}
    expert_modules = {
        id(b.experts.base_layer if isinstance(b.experts, LoRAExperts) else b.experts)
        for b in expert_blocks(model)
    }
    params = cfg.get("target_parameters") or []
    if params and not expert_modules:
        raise ValueError(f"{source}: target_parameters {params} need a MoE model (no MoE layers)")
    for name, module in modules:
        path = peft_path(name, layout)
        if name and module_targeted(cfg, path):
            if not isinstance(module, nn.Linear):
                raise ValueError(
                    f"{source}: target_modules matches {path}, a {type(module).__name__}; "
                    "slipstream puts LoRA on nn.Linear layers and MoE experts only"
                )
            linears[name] = rank_alpha(cfg, path)
        for param, _ in module.named_parameters(recurse=False):
            key = f"{path}.{param}"
            if not in_list(key, params):
                continue
            if isinstance(module, Router) and param == "weight":
                routers[name] = rank_alpha(cfg, key)
            elif id(module) in expert_modules and param in EXPERT_TARGETS:
                experts.setdefault(name, {})[param] = rank_alpha(cfg, key)
            else:
                raise ValueError(
                    f"{source}: target_parameters matches {key}; slipstream puts LoRA on the "
                    f"MoE experts' {' and '.join(EXPERT_TARGETS)} and the routers' weight only"
                )
    if params and not experts and not routers:
        raise ValueError(f"{source}: target_parameters {params} match no parameter of the model")
    if not linears and not experts and not routers:
        linear = _all_linear(modules)
        present = sorted({n.rsplit(".", 1)[-1] for n in linear})
        example = peft_path(linear[0], layout) if linear else "none"
        raise ValueError(
            f"{source}: target_modules {_shown(shown)} match no nn.Linear in the model "
            f"(peft's rules, on paths such as {example!r}); linear module names present: "
            f"{present}"
        )
    return LoraTargets(linears, experts, routers)


def _shown(targets) -> object:
    return sorted(targets) if isinstance(targets, (set, list, tuple)) else targets


def model_targets(model: nn.Module) -> LoraTargets:
    """The LoRA a wrapped `model` holds, in `adapter_targets`' form."""
    found = LoraTargets()
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            (found.routers if is_router_lora(m) else found.linears)[name] = (m.rank, m.alpha)
        elif isinstance(m, LoRAExperts):
            found.experts[name] = {t: (m.rank[t], m.alpha[t]) for t in m.targets}
    return found
