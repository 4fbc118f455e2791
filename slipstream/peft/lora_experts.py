"""LoRA on stacked MoE experts, saved in the layout PEFT uses for `target_parameters`.

Used through `slipstream.peft.lora` (`apply_lora`, `merge_lora`) and
`slipstream.checkpoint.adapter` (`save_adapter`, `load_adapter`), which call in here when a model
has MoE blocks. `wrap_experts(model, ...)` swaps each MoE block's `experts` for a `LoRAExperts`
that keeps the original as `.base_layer` and holds, per targeted parameter (`gate_up_proj`,
`down_proj`), stacked factors A (E, r, in) and B (E, out, r). Forward adds scale * B_e A_e x to
every routed row with two more grouped GEMMs over the same routing offsets, so each expert's
factors see exactly that expert's rows: every expert that received tokens gets a gradient, an
expert that received none gets exactly zero, and nothing loops over experts or syncs the host.

PEFT layout (peft 0.21 `LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])`, `lora.ParamWrapper`), read from its source (keys: peft/names.py):
- `lora_A.weight` is (E*r, in) with rows expert-major (row e*r + j is A[e, j]);
  `lora_B.weight` is (out, r*E) with columns rank-major (column j*E + e is B[e, :, j]);
- `in` is the side the token rows multiply, for (E, out, in) experts (Qwen3-MoE,
  `is_transposed = False`) and (E, in, out) experts (GPT-OSS, `is_transposed = True`) alike;
  PEFT adds scale * B_e A_e (transposed for the latter) to the weight.
PEFT supports no dropout on parameters, and neither does this module.

Factors are float32 for a bf16/fp16 base (master weights, as in `slipstream.peft.lora`) and are
cast to the activation dtype in forward, so the grouped GEMMs run in bf16. torch's grouped GEMM
needs 16-byte strides in that dtype: in bf16, rank % 8 == 0 (other ranks take the tiled path).

Shapes: R routed rows, E experts, r rank, I/O in/out features of one expert projection.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from slipstream.models.generic_hooks import is_standard_experts, one_pass
from slipstream.models.moe_block import expert_blocks
from slipstream.ops.moe import RoutingPlan, grouped_mm
from slipstream.peft.lora_linear import lora_factor_dtype, lora_modules
from slipstream.peft.names import (
    EXPERT_TARGETS,
    expert_keys,
    model_layout,
    parameter_targets,
    peft_path,
)


class LoRAExperts(nn.Module):
    """Frozen stacked experts plus trainable stacked low-rank updates on some of their weights."""

    def __init__(
        self,
        base_layer: nn.Module,
        targets: dict[str, tuple[int, float]],
        use_rslora: bool = False,
    ) -> None:
        """targets: parameter name -> (rank, alpha), each its own (peft's rank_pattern)."""
        super().__init__()
        self.base_layer = base_layer
        self.targets = tuple(t for t in EXPERT_TARGETS if t in targets)
        self.rank = {t: targets[t][0] for t in self.targets}
        self.alpha = {t: targets[t][1] for t in self.targets}
        self.scaling = {
            t: a / math.sqrt(self.rank[t]) if use_rslora else a / self.rank[t]
            for t, a in self.alpha.items()
        }
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        for name in self.targets:
            w, rank = getattr(base_layer, name), self.rank[name]
            E, (in_f, out_f) = w.shape[0], self.in_out(name)
            kw = {"device": w.device, "dtype": lora_factor_dtype(w)}
            self.lora_A[name] = nn.Parameter(torch.empty(E, rank, in_f, **kw))
            self.lora_B[name] = nn.Parameter(torch.zeros(E, out_f, rank, **kw))
            # As PEFT (nn.Linear's default init per expert): uniform(+-1/sqrt(in)); B zero.
            bound = 1 / math.sqrt(in_f)
            nn.init.uniform_(self.lora_A[name], -bound, bound)

    def in_out(self, name: str) -> tuple[int, int]:
        _, a, b = getattr(self.base_layer, name).shape
        return (a, b) if self.base_layer.is_transposed else (b, a)

    def delta(self, name: str, x_RI: torch.Tensor, plan: RoutingPlan) -> torch.Tensor | float:
        """scale * B_e A_e x for each routed row (0 when `name` has no LoRA)."""
        if name not in self.lora_A:
            return 0.0
        # Factors down to the activation dtype (fp32 masters, bf16 GEMMs). grouped_mm decides
        # its path on these cast tensors: a fresh contiguous copy, transposed as a view.
        A_EIr = self.lora_A[name].to(x_RI.dtype).transpose(1, 2)
        B_ErO = self.lora_B[name].to(x_RI.dtype).transpose(1, 2)
        h_Rr = grouped_mm(x_RI, A_EIr, plan.offsets_E)
        return grouped_mm(h_Rr, B_ErO, plan.offsets_E) * self.scaling[name]

    def forward(self, x_RD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        base = self.base_layer
        h_RF = base.gate_up(x_RD, plan) + self.delta("gate_up_proj", x_RD, plan)
        a_RI = base.activate(h_RF)
        return base.down(a_RI, plan) + self.delta("down_proj", a_RI, plan)

    def merged_weight(self, name: str) -> torch.Tensor:
        """The base parameter plus scale * B_e A_e (in its storage orientation), in float32
        arithmetic, returned in the base dtype."""
        w = getattr(self.base_layer, name)
        delta_EOI = torch.bmm(self.lora_B[name].float(), self.lora_A[name].float())
        if self.base_layer.is_transposed:
            delta_EOI = delta_EOI.transpose(1, 2)
        return (w.float() + self.scaling[name] * delta_EOI).to(w.dtype)

    def extra_repr(self) -> str:
        return f"targets={self.targets}, rank={self.rank}, alpha={self.alpha}"


class LoRAStackedExperts(LoRAExperts):
    """Expert LoRA on transformers' standard stacked experts (the generic path), called as
    transformers calls its experts: (x_TD, ids_TK, weights_TK) -> y_TD, through the same one
    pass (`generic_hooks.one_pass`) as their forward without LoRA."""

    def forward(self, x_TD, ids_TK, weights_TK):
        return one_pass(self.base_layer, x_TD, ids_TK, weights_TK, self.delta)


def expert_lora_modules(model: nn.Module) -> dict[str, LoRAExperts]:
    """Module path -> LoRAExperts, in model order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRAExperts)}


def experts_paths(model: nn.Module) -> list[str]:
    """Our module path of each MoE block's experts, in model order."""
    experts = {id(block.experts) for block in expert_blocks(model)}
    return [name for name, m in model.named_modules() if id(m) in experts]


def wrap_experts(
    model: nn.Module, targets: dict[str, dict[str, tuple[int, float]]], use_rslora: bool = False
) -> list[str]:
    """Put LoRA on the experts at each path of `targets` (parameter -> (rank, alpha)),
    trainable; returns PEFT's `target_parameters` names. `lora.wrap_lora` calls this (its
    callers check the arguments)."""
    paths = experts_paths(model)
    assert targets and set(targets) <= set(paths) and not expert_lora_modules(model), targets
    for path, params in targets.items():
        assert params and set(params) <= set(EXPERT_TARGETS), params
        parent, _, attr = path.rpartition(".")
        base = model.get_submodule(path)
        kind = LoRAStackedExperts if is_standard_experts(base) else LoRAExperts
        wrapped = kind(base, params, use_rslora)
        setattr(model.get_submodule(parent), attr, wrapped)
        wrapped.lora_A.requires_grad_(True)
        wrapped.lora_B.requires_grad_(True)
    return parameter_targets({p: tuple(t) for p, t in targets.items()}, paths, model_layout(model))


def expert_lora_factors(model: nn.Module) -> dict[str, tuple[nn.Parameter, str]]:
    """PEFT key -> (stacked factor, "A"|"B") for every expert LoRA factor in the model (keys
    at transformers' module paths: a multimodal checkpoint's `model.language_model.`)."""
    layout = model_layout(model)
    return {
        key: (m.lora_A[name] if part == "A" else m.lora_B[name], part)
        for path, m in expert_lora_modules(model).items()
        for key, (name, part) in expert_keys(peft_path(path, layout), m.targets).items()
    }


def expert_lora_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT key -> tensor in PEFT's layout, for every expert LoRA factor in the model."""
    out = {}
    for key, (param, part) in expert_lora_factors(model).items():
        if part == "A":  # (E, r, in) -> (E*r, in)
            t = param.detach().flatten(0, 1)
        else:  # (E, out, r) -> (out, r, E) -> (out, r*E)
            t = param.detach().permute(1, 2, 0).flatten(1)
        out[key] = t.contiguous().cpu()
    return out


@torch.no_grad()
def load_expert_lora_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], source) -> None:
    """Copy PEFT-layout expert factors into the model's LoRAExperts; one-line errors. Other
    keys in `tensors` are the caller's to check."""
    for key, (param, part) in expert_lora_factors(model).items():
        if key not in tensors:
            raise ValueError(f"{source}: missing tensor {key}")
        E, rows, cols = param.shape
        shape = (E * rows, cols) if part == "A" else (rows, cols * E)
        t = tensors[key]
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{source}: tensor {key} has shape {tuple(t.shape)}, the model expects {shape}"
            )
        if part == "A":
            param.copy_(t.view(E, rows, cols))
        else:  # (out, r*E) -> (out, r, E) -> (E, out, r)
            param.copy_(t.view(rows, cols, E).permute(2, 0, 1))


def merge_expert_lora(model: nn.Module) -> nn.Module:
    """Fold every expert LoRA into its stacked weights and put the plain experts back."""
    for path, module in list(expert_lora_modules(model).items()):
        base = module.base_layer
        with torch.no_grad():
            for name in module.targets:
                getattr(base, name).copy_(module.merged_weight(name))
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, base)
    if getattr(model, "lora_config", None) is not None:
        model.lora_config.pop("target_parameters", None)
        if not lora_modules(model):
            model.lora_config = None
    return model
