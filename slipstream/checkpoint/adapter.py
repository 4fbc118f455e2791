"""PEFT's adapter files: `save_adapter` writes, `load_adapter` reads, `adapter_config.json` +
`adapter_model.safetensors`, so `peft.PeftModel.from_pretrained` loads ours and PEFT's load here.

Keys and `target_modules` are PEFT's names (peft/names.py); expert LoRA goes under PEFT's
`target_parameters` (peft/lora_experts.py). What an adapter we load puts LoRA on, and at
which rank and alpha, follows peft 0.21's rules (peft/matching.py); targets whose rank or alpha
is not the default are saved as exact `rank_pattern` / `alpha_pattern` keys.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from slipstream.checkpoint.atomic import atomic_write
from slipstream.models import weight_map
from slipstream.peft.embeddings import (
    adapter_embeddings,
    embedding_tensors,
    prepare_embeddings,
)
from slipstream.peft.lora import (
    check_hyperparameters,
    is_router_lora,
    linear_children,
    lora_modules,
    wrap_lora,
)
from slipstream.peft.lora_experts import (
    expert_lora_factors,
    expert_lora_modules,
    expert_lora_tensors,
    load_expert_lora_tensors,
)
from slipstream.peft.matching import adapter_targets, check_keys, model_targets
from slipstream.peft.names import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    adapter_key,
    model_layout,
    peft_path,
    target_modules,
)
from slipstream.sources import SOURCE_KEY

VOCAB_KEY = "slipstream.vocab_size"  # the weights file's metadata: the model's rows


def _lora_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT key -> parameter for the factors (and DoRA magnitudes) of the wrapped linears."""
    found = {}
    layout = model_layout(model)
    for name, module in lora_modules(model).items():
        key = adapter_key(peft_path(name, layout))
        found[f"{key}.lora_A.weight"] = module.lora_A.weight
        found[f"{key}.lora_B.weight"] = module.lora_B.weight
        magnitude = getattr(module, "lora_magnitude_vector", None)
        if magnitude is not None:
            found[f"{key}.lora_magnitude_vector"] = magnitude
    return found


def save_adapter(
    model: nn.Module,
    dir: str | os.PathLike,
    base_model_name_or_path: str | None = None,
    *,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    extra_config: dict | None = None,
    extra_metadata: dict[str, str] | None = None,
) -> Path:
    """Write adapter_config.json + adapter_model.safetensors in PEFT's layout; returns dir.

    The base recorded is `base_model_name_or_path`, else the one `load_model` noted: the hub
    id when one is known (a GGUF file's source checkpoint), so peft loads it; where slipstream
    loaded it from (a built-in name, a .gguf path) goes in the weights file's metadata under
    `slipstream.base_model`, read back by `slipstream.sources.adapter_base`. `extra_*`: what a
    caller adds (a reward model's head under modules_to_save: checkpoint/reward_model.py)."""
    cfg = getattr(model, "lora_config", None)
    if cfg is None:
        raise ValueError("save_adapter: the model has no LoRA; call apply_lora(model) first")
    out = Path(dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create adapter dir {out}: {e.strerror}") from None
    trained = {**_lora_tensors(model), **embedding_tensors(model)}
    tensors = {k: p.detach().cpu().contiguous() for k, p in trained.items()}
    if cfg.get("target_parameters"):
        tensors.update(expert_lora_tensors(model))
    unwrapped = [name for name, *_ in linear_children(model)]
    # peft wraps convolutions by name too: Qwen-VL's patch embedding is `patch_embed.proj`,
    # the name of the tower's attention output linears.
    unwrapped += [n for n, m in model.named_modules() if isinstance(m, nn.modules.conv._ConvNd)]
    # Their parents too: peft matches a short name against any module, so a module holding a
    # linear under a target's name (Gemma 4's tower: `q_proj` is a Gemma4ClippableLinear around
    # `.linear`) would be wrapped, and refused, on transformers' model.
    parents = {n.rsplit(".", 1)[0] for n in unwrapped if "." in n}
    unwrapped += sorted(parents - set(lora_modules(model)))
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(model, "name_or_path", None) or None
    tensors.update(extra_tensors or {})
    metadata = {"format": "pt", VOCAB_KEY: str(model.config.vocab_size), **(extra_metadata or {})}
    source = getattr(model, "source", None)
    if source and source != base_model_name_or_path:
        metadata[SOURCE_KEY] = str(source)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg["r"],
        "lora_alpha": cfg["lora_alpha"],
        "lora_dropout": cfg["lora_dropout"],
        "target_modules": target_modules(
            cfg["target_modules"],
            [n for n, m in lora_modules(model).items() if not is_router_lora(m)],
            unwrapped,
            model_layout(model),
        ),
        "use_rslora": cfg["use_rslora"],
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": cfg.get("modules_to_save"),
        "trainable_token_indices": cfg.get("trainable_token_indices"),
        "ensure_weight_tying": bool(cfg.get("ensure_weight_tying", False)),
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        **_patterns(model, cfg["r"], cfg["lora_alpha"]),
        "use_dora": bool(cfg.get("use_dora", False)),
        "revision": None,
    }
    if cfg.get("target_parameters"):  # only then: older PEFT versions lack the key
        config["target_parameters"] = cfg["target_parameters"]
    extra = dict(extra_config or {})
    if extra.get("modules_to_save"):  # beside the trained embeddings' own
        extra["modules_to_save"] = [*(config["modules_to_save"] or []), *extra["modules_to_save"]]
    config.update(extra)
    try:
        atomic_write(out / ADAPTER_WEIGHTS, lambda p: save_file(tensors, p, metadata=metadata))
        text = json.dumps(config, indent=2) + "\n"
        atomic_write(out / ADAPTER_CONFIG, lambda p: Path(p).write_text(text))
    except OSError as e:
        raise ValueError(f"cannot write adapter to {out}: {e.strerror}") from None
    return out


def _patterns(model: nn.Module, rank: int, alpha: float) -> dict[str, dict[str, float]]:
    """peft's `rank_pattern` / `alpha_pattern` for the targets whose rank or alpha is not the
    default: one anchored key per target (its escaped path; peft matches a key at the end of a
    path after a "."), so each reaches exactly that target."""
    layout = model_layout(model)
    found = {
        f"{n}.weight" if is_router_lora(m) else n: (m.rank, m.alpha)
        for n, m in lora_modules(model).items()
    }  # a router's LoRA is on its weight parameter: peft's key is the parameter's path
    for path, m in expert_lora_modules(model).items():
        found.update({f"{path}.{t}": (m.rank[t], m.alpha[t]) for t in m.targets})
    ranks, alphas = {}, {}
    for name, (r, a) in found.items():
        key = re.escape(peft_path(name, layout))
        if r != rank:
            ranks[key] = r
        if a != alpha:
            alphas[key] = a
    return {"rank_pattern": ranks, "alpha_pattern": alphas}


def tokenizer_source(adapter: Path, base: str) -> str:
    """The trainer saves the tokenizer beside the adapter; otherwise take the base model's."""
    return str(adapter) if any(adapter.glob("tokenizer*")) else base


def _read_adapter_config(path: Path, modules_to_save: tuple[str, ...] = ()) -> dict:
    if not path.is_file():
        raise ValueError(f"{path} not found: not a PEFT adapter directory")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg['peft_type']!r} is not supported; only LORA")
    for key in ("r", "lora_alpha"):
        if key not in cfg:
            raise ValueError(f"{path}: no {key!r}: not a LoRA adapter config")
    if modules_to_save and cfg.get("modules_to_save"):
        left = [m for m in cfg["modules_to_save"] if m not in modules_to_save]
        cfg = {**cfg, "modules_to_save": left or None}
    check_keys(cfg, path)
    adapter_embeddings(cfg, path)  # its trained embeddings: a form slipstream has
    return cfg


def load_adapter(
    model: nn.Module, dir: str | os.PathLike, *, modules_to_save: tuple[str, ...] = ()
) -> nn.Module:
    """Load a PEFT LoRA adapter (ours or PEFT's) into `model`, applying LoRA first if needed.
    Expert factors (`target_parameters` on a MoE model) load in the same pass.
    `modules_to_save`: modules of the adapter's modules_to_save that the caller loads itself
    (a reward model's `score` head); their tensors are left alone here."""
    src = Path(dir)
    config = _read_adapter_config(src / ADAPTER_CONFIG, modules_to_save)
    _apply_adapter_config(model, config, src)
    weights_path = src / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise ValueError(f"{weights_path} not found: the adapter has no weights")
    tensors = load_file(weights_path)
    prepare_embeddings(model, config, tensors, _vocab_size(weights_path), weights_path)
    expected = {**_lora_tensors(model), **embedding_tensors(model)}
    has_experts = bool(model.lora_config.get("target_parameters"))
    expert_keys = set(expert_lora_factors(model)) if has_experts else set()
    own = {f"{PEFT_PREFIX}{m}.weight" for m in modules_to_save}
    for key in tensors:
        if key not in expected and key not in expert_keys and key not in own:
            _unexpected_key(model, key, weights_path)
    with torch.no_grad():
        for key, param in expected.items():
            if key not in tensors:
                raise ValueError(f"{weights_path}: missing tensor {key}")
            if tensors[key].shape != param.shape:
                raise ValueError(
                    f"{weights_path}: tensor {key} has shape {tuple(tensors[key].shape)}, "
                    f"the model expects {tuple(param.shape)}"
                )
            param.copy_(tensors[key])
    if has_experts:
        load_expert_lora_tensors(model, tensors, weights_path)
    return model


def _vocab_size(path: Path) -> int | None:
    """The vocabulary size our save recorded (None: another tool's adapter)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        value = (f.metadata() or {}).get(VOCAB_KEY)
    return int(value) if value and value.isdigit() else None


def _apply_adapter_config(model: nn.Module, cfg: dict, src: Path) -> None:
    """Wrap `model` as the adapter config says (peft's rules: peft/matching.py), or check that
    its LoRA is the same."""
    source = src / ADAPTER_CONFIG
    rank, alpha = int(cfg["r"]), cfg["lora_alpha"]
    use_rslora = bool(cfg.get("use_rslora", False))
    use_dora = bool(cfg.get("use_dora", False))
    targets = adapter_targets(cfg, model, source)
    current = getattr(model, "lora_config", None)
    if current is not None:
        differs = _difference(model, targets, use_rslora, use_dora)
        if differs:
            raise ValueError(f"{src}: the model already has a different LoRA: {differs}")
        return
    dropout = cfg.get("lora_dropout") or 0.0
    for r, a in {(rank, alpha), *targets.linears.values()}:
        check_hyperparameters(r, a, dropout, str(source))
    on_params = [
        *targets.routers.values(),
        *(ra for p in targets.experts.values() for ra in p.values()),
    ]
    for r, a in on_params:
        check_hyperparameters(r, a, dropout, str(source), experts=True)
    wrap_lora(model, targets, rank, alpha, dropout, use_rslora, use_dora)


def _difference(model: nn.Module, targets, use_rslora: bool, use_dora: bool) -> str | None:
    """How the adapter's LoRA differs from the one `model` has (None: it does not)."""
    cfg = model.lora_config
    if (cfg["use_rslora"], bool(cfg.get("use_dora"))) != (use_rslora, use_dora):
        return (
            f"adapter use_rslora={use_rslora}, use_dora={use_dora}; model "
            f"use_rslora={cfg['use_rslora']}, use_dora={bool(cfg.get('use_dora'))}"
        )
    have = model_targets(model)
    theirs = {**targets.linears, **targets.routers, **_flat(targets.experts)}
    ours = {**have.linears, **have.routers, **_flat(have.experts)}
    for name in sorted(set(theirs) | set(ours)):
        if theirs.get(name) != ours.get(name):
            show = lambda ra: "no LoRA" if ra is None else f"r={ra[0]}, lora_alpha={ra[1]}"  # noqa: E731
            return f"{name}: adapter {show(theirs.get(name))}, model {show(ours.get(name))}"
    return None


def _flat(experts: dict[str, dict[str, tuple[int, float]]]) -> dict[str, tuple[int, float]]:
    return {f"{path}.{t}": ra for path, params in experts.items() for t, ra in params.items()}


def _unexpected_key(model: nn.Module, key: str, source: Path) -> None:
    cfg = getattr(model, "config", None)
    path = key.removeprefix(PEFT_PREFIX)
    if model_layout(model) and weight_map(cfg).is_passthrough(path):
        raise ValueError(
            f"{source}: tensor {key} is LoRA on the vision side, which slipstream does not "
            "train (only the language model); make the adapter with a target_modules regex "
            r"that only matches the language model, e.g. 'model\.language_model\..*\.q_proj'"
        )
    raise ValueError(f"{source}: tensor {key} matches no LoRA module in the model")
