"""LoRA: low-rank adapters on frozen linear layers, in PEFT's layout.

`apply_lora` swaps each targeted `nn.Linear` for a `LoRALinear` that keeps the original as
`.base_layer`, so parameter names line up with PEFT's (peft/names.py; the files:
checkpoint/adapter.py). A is (rank, in_features), B is (out_features, rank); y = base(x) +
scale * B @ A @ dropout(x), scale = alpha / rank (alpha / sqrt(rank) for rsLoRA). The base can
be any module with `in_features`, `out_features` and a `weight` (a bitsandbytes `Linear4bit`
for QLoRA); it is never modified until `merge_lora`. The module: peft/lora_linear.py; DoRA:
peft/dora.py; LoRA on MoE experts: peft/lora_experts.py.

Factor dtype: float32 master weights whenever the base is fp16/bf16 (or quantized), as PEFT
does (`autocast_adapter_dtype=True`), so AdamW's states are float32 too. In bf16 an update
below half an ulp (0.2-0.4% of the value) rounds away: with lr 1e-5 a factor entry of 0.1 would
never move. Forward casts the factors (rank/features of the base weight's size) to the
activation dtype, so the two matmuls still run in bf16. `save_adapter` writes the float32
factors (as PEFT saves adapters it autocast; they load in PEFT at either adapter dtype);
`merge_lora` adds the delta in float32 and rounds once to the base dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from slipstream.models.moe_block import Router, expert_blocks
from slipstream.peft.dora import DoRALinear
from slipstream.peft.embeddings import merge_trainable_tokens
from slipstream.peft.lora_experts import experts_paths, merge_expert_lora, wrap_experts
from slipstream.peft.lora_linear import LoRAHead, LoRALinear, lora_modules
from slipstream.peft.names import EXPERT_TARGET_OF, model_layout, parameter_targets

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_DEFAULT_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3's names
# Added to the defaults where Gated DeltaNet layers (Qwen3.5) hold them: 3 of its 4 layers have
# no q/k/v/o_proj, and without these their token mixers would get no adapter.
DELTANET_TARGETS = ("in_proj_qkv", "in_proj_z", "out_proj")


def check_hyperparameters(
    rank: object, alpha: object, dropout: object, where: str, experts: bool = False
) -> None:
    """A one-line error naming `where` unless rank > 0 is an int, alpha > 0, dropout in [0, 1)
    (0 when LoRA goes on MoE `experts`: PEFT has no dropout on parameters)."""
    if not (isinstance(rank, int) and rank > 0) or not alpha > 0 or not 0 <= dropout < 1:
        raise ValueError(
            f"{where}: rank={rank!r}, alpha={alpha!r}, dropout={dropout!r}; need rank a "
            "positive integer, alpha > 0 and dropout in [0, 1)"
        )
    if experts and dropout > 0:
        raise ValueError(
            f"{where}: dropout={dropout} is not supported on MoE experts (PEFT has no dropout "
            "on parameters); set it to 0 or target only linear layers (e.g. q_proj)"
        )


def linear_children(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(full name, parent, attribute, module) for each nn.Linear not inside a LoRALinear nor
    an nn.MultiheadAttention: its forward (F.multi_head_attention_forward) reads
    `out_proj.weight` and `.bias` as tensors, past any wrapper, so a LoRA there would never
    run (and a wrapper without `.bias` broke it: a SigLIP tower with its attention-pooling head,
    `vision.tower: lora`)."""
    found = []

    def visit(prefix: str, module: nn.Module) -> None:
        for attr, child in module.named_children():
            name = f"{prefix}{attr}"
            if isinstance(child, nn.Linear):
                found.append((name, module, attr, child))
            elif not isinstance(child, (LoRALinear, nn.MultiheadAttention)):
                visit(name + ".", child)

    visit("", model)
    return found


def is_router_lora(module: nn.Module) -> bool:
    return isinstance(module, LoRALinear) and isinstance(module.base_layer, Router)


@dataclass
class LoraTargets:
    """Where LoRA goes and with which (rank, alpha): our module path of each linear, and of
    each MoE experts module with its targeted parameters (`gate_up_proj`, `down_proj`)."""

    linears: dict[str, tuple[int, float]] = field(default_factory=dict)
    experts: dict[str, dict[str, tuple[int, float]]] = field(default_factory=dict)
    routers: dict[str, tuple[int, float]] = field(default_factory=dict)  # MoE routers' weight


def apply_lora(
    model: nn.Module,
    rank: int = 16,
    alpha: float = 32,
    dropout: float = 0.0,
    targets: str | Iterable[str] | None = None,
    use_rslora: bool = False,
    use_dora: bool = False,
) -> nn.Module:
    """Wrap the targeted linear layers (and MoE experts) in LoRA and freeze everything else.

    targets: short module names (`q_proj`, ...) or "all-linear" (every nn.Linear but lm_head,
    and on a MoE model the experts' `gate_up_proj` and `down_proj`); None: the attention and
    MLP projections (DEFAULT_TARGETS, or FUSED_DEFAULT_TARGETS on a fused-projection model),
    plus a Gated DeltaNet's projections (DELTANET_TARGETS) where the model has them.
    use_dora: DoRA's trained magnitude per output row on each wrapped linear (peft/dora.py).
    """
    generic = getattr(model.config, "implementation", "") == "transformers"
    has_experts = bool(expert_blocks(model))
    if targets is None and generic:
        # transformers' module names vary (fc1/dense, ...): the default names the model has,
        # else every linear but the head. On a MoE model the MLP names reach the stacked
        # experts (as natively) where they have the standard layout; other experts get none.
        # A model with none: every linear but the head and those inside stateful token
        # mixers (peft refuses Mamba's out_proj and conv1d).
        present = linear_names(model)
        names = FUSED_DEFAULT_TARGETS if "qkv_proj" in present else DEFAULT_TARGETS
        moe = any(n.endswith(".experts") for n, _ in model.named_modules())
        mlp = set(EXPERT_TARGET_OF) if moe else set()
        targets = [t for t in names if (t in present and t not in mlp) or
                   (t in mlp and has_experts)]  # fmt: skip
        if not targets:
            mixers = tuple(f".{path}." for path in getattr(model, "per_sequence", ()))
            targets = {
                attr for name, _, attr, _ in linear_children(model)
                if attr != "lm_head" and not any(m in f".{name}" for m in mixers)
            }  # fmt: skip
    if targets is None:
        present = linear_names(model)
        targets = FUSED_DEFAULT_TARGETS if "qkv_proj" in present else DEFAULT_TARGETS
        if "in_proj_qkv" in present:
            targets = targets + DELTANET_TARGETS
    if getattr(model, "lora_config", None) is not None:
        raise ValueError("LoRA is already applied to this model; apply_lora once per model")
    present = linear_names(model)
    if generic and has_experts:
        # peft 0.21 turns these names into `target_parameters` of the stacked experts on
        # transformers' MoE models (dropping them from target_modules), so a shared expert's
        # or a dense layer's linear of that name would get no LoRA in peft: experts only.
        present -= set(EXPERT_TARGET_OF)
    if generic and targets == "all-linear":
        present -= all_linear_exclusions(model, has_experts)
    if targets == "all-linear":
        linear, experts = (
            present - {"lm_head"},
            set(EXPERT_TARGET_OF.values()) if has_experts else set(),
        )
    else:
        wanted = {targets} if isinstance(targets, str) else set(targets)
        expert_names = set(EXPERT_TARGET_OF) if has_experts else set()
        linear = wanted & present
        experts = {EXPERT_TARGET_OF[n] for n in wanted & expert_names}
        missing = sorted(wanted - present - expert_names)
        if "lm_head" in missing and getattr(model.config, "tie_word_embeddings", False):
            raise ValueError(
                "lora targets lm_head: this model ties its head to embed_tokens "
                "(tie_word_embeddings), so there is no separate head to adapt; train it with "
                "lora.train_embeddings=[lm_head] or drop lm_head from the targets"
            )
        if missing or not wanted:
            also = f"; MoE expert names: {sorted(expert_names)}" if expert_names else ""
            raise ValueError(
                f"lora targets {missing or sorted(wanted)} match no nn.Linear in the model; "
                f"linear module names present: {sorted(present)}{also}"
            )
    check_hyperparameters(rank, alpha, dropout, "lora", experts=bool(experts))
    # An image-text model's vision tower and projector: no LoRA unless vision.train asks.
    skip = tuple(getattr(model, "no_lora_prefixes", ()))
    chosen = LoraTargets(
        {
            name: (rank, alpha)
            for name, _, attr, _ in linear_children(model)
            if attr in linear and not (skip and name.startswith(skip))
        },
        {path: {t: (rank, alpha) for t in experts} for path in experts_paths(model)}
        if experts
        else {},
    )
    return wrap_lora(model, chosen, rank, alpha, dropout, use_rslora, use_dora)


def all_linear_exclusions(model: nn.Module, has_experts: bool) -> set[str]:
    """Linear names "all-linear" leaves out on transformers' modeling code, where an adapter
    could not round-trip through peft or train: linears inside Mamba2 mixers (transformers'
    fused training path reads their out_proj weight directly, past LoRA), nn.Linear
    subclasses with their own forward (Llama 4's router returns a tuple), and on a MoE model
    whose experts take no expert LoRA the MLP names (peft 0.21 reads them as the stacked
    experts' parameters, not the dense or shared-expert linears: other logits)."""
    mamba = [f"{n}." for n, m in model.named_modules()
             if all(hasattr(m, a) for a in ("in_proj", "out_proj", "dt_bias"))]  # fmt: skip
    dropped = {
        attr for name, _, attr, module in linear_children(model)
        if type(module).forward is not nn.Linear.forward or name.startswith(tuple(mamba))
    }  # fmt: skip
    moe = any(n.endswith(".experts") for n, _ in model.named_modules())
    if moe and not has_experts:
        dropped |= set(EXPERT_TARGET_OF)
    return dropped


def linear_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, *_ in linear_children(model)}


def router_paths(model: nn.Module) -> list[str]:
    """Our module path of each MoE router (a LoRA-wrapped one too), in model order."""
    return [
        n
        for n, m in model.named_modules()
        if (isinstance(m, Router) and not n.endswith(".base_layer")) or is_router_lora(m)
    ]


def wrap_lora(
    model: nn.Module,
    targets: LoraTargets,
    rank: int,
    alpha: float,
    dropout: float,
    use_rslora: bool,
    use_dora: bool = False,
) -> nn.Module:
    """Wrap `targets` (each at its own rank and alpha); record `model.lora_config` (PEFT's
    names; `rank` and `alpha` are its defaults) and leave only the LoRA factors trainable."""
    if use_dora and (targets.experts or targets.routers):
        raise ValueError(
            f"DoRA on MoE experts or routers {sorted(targets.experts or targets.routers)} is "
            "not supported (PEFT has none on parameters); name linear layers as lora targets "
            "(e.g. q_proj, v_proj, o_proj) or drop use_dora"
        )
    wrapper = DoRALinear if use_dora else LoRALinear
    head = [name for name in targets.linears if name.rsplit(".", 1)[-1] == "lm_head"]
    if head and (use_dora or dropout > 0):
        # The loss, log-probs and generation read the head's weight (`lm_head_weight`), the
        # effective W + s B A of a LoRAHead: no per-input dropout, no DoRA norm there.
        raise ValueError(
            f"LoRA on lm_head takes no {'use_dora' if use_dora else 'lora.dropout'} (the loss "
            "reads the head's effective weight, not its input); set it off or drop lm_head "
            "from the lora targets"
        )
    for name, parent, attr, module in linear_children(model):
        if name in targets.linears:
            r, a = targets.linears[name]
            kind = LoRAHead if name in head else wrapper
            setattr(parent, attr, kind(module, r, a, dropout, use_rslora))
    for name, (r, a) in targets.routers.items():  # y = x W^T + s x A^T B^T, as for a linear
        parent, _, attr = name.rpartition(".")
        router = LoRALinear(model.get_submodule(name), r, a, 0.0, use_rslora)
        setattr(model.get_submodule(parent), attr, router)
    model.requires_grad_(False)
    for module in lora_modules(model).values():  # the factors (and DoRA's magnitude)
        for name, param in module.named_parameters():
            if not name.startswith("base_layer."):
                param.requires_grad_(True)
    model.lora_config = {
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n in targets.linears}),
        "use_rslora": use_rslora,
        "use_dora": use_dora,
    }
    params = []
    if targets.experts:
        params = wrap_experts(model, targets.experts, use_rslora)
    if targets.routers:
        wrapped = {name: ("weight",) for name in targets.routers}
        params += parameter_targets(wrapped, router_paths(model), model_layout(model))
    if params:
        model.lora_config["target_parameters"] = params
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold scale * B @ A into each base weight (expert LoRA too) and put the plain base
    modules back."""
    if (getattr(model, "lora_config", None) or {}).get("target_parameters"):
        merge_expert_lora(model)
    merge_trainable_tokens(model)  # trained embedding rows into their matrices
    for name, module in list(lora_modules(model).items()):
        base = module.base_layer
        if not base.weight.is_floating_point():
            raise ValueError(f"cannot merge LoRA into {name}: its base weight is quantized")
        with torch.no_grad():
            base.weight.copy_(module.merged_weight())
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, base)
    model.lora_config = None
    return model
