"""The objective contract: what the trainer uses of an objective, and nothing else
(docs/dev/INTERFACES.md, "Training objectives"). No torch import.

`Objective` is the offline contract (SFT, the pair objectives): rows -> examples -> packed
batches -> a summed loss. `OnlineObjective` adds generation (GRPO): the loop hands each
step's prompt batches to `rollout`, which returns the micro-batches to train on, and eval is
the objective's own `evaluate`. Objectives subclass one of the two (so they inherit the
defaults: `attach` does nothing, no metrics, `iterations` 1); `check_objective` runs once
when the run is prepared and names whatever is missing.

Hooks (`attach`, `rollout`, `evaluate`) see a `HookContext`, not the trainer's `Run`: an
objective reads its own options from the run config when it is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from slipstream.data.labels import DataReport


@dataclass(frozen=True)
class HookContext:
    """What an objective's hooks may use of a run."""

    model: torch.nn.Module  # the model itself: never the DDP wrapper; under FSDP2 sharded
    tokenizer: Any
    device: torch.device
    seed: int  # train.seed
    rank: int  # this process's data-parallel rank
    world_size: int  # data-parallel ranks


class Objective(Protocol):
    """An objective the trainer runs on packed batches built from the data (module doc)."""

    name: str  # the train.objective value
    perplexity: bool  # eval logs eval_ppl = exp(eval_loss): the loss is a mean token NLL
    online: bool = False
    metric_names: tuple[str, ...] = ()  # every key micro_batch_loss may return
    # those reduced by "min" or "max" (over micro-batches, steps and ranks), not summed
    metric_extremes: Mapping[str, str] = MappingProxyType({})
    iterations: int = 1  # optimizer steps one draw of prompt batches serves (GRPO's mu)

    def attach(self, ctx: HookContext, data: Any) -> None:
        """After the model is built, before data-parallel wrapping; `data` the RunData
        (DPO's reference policy, or its log-probs precomputed into the examples)."""

    def tokenize(self, rows: Any, tokenizer: Any, first_row: int = 0) -> tuple[list, DataReport]:
        """Rows of one source -> (examples, report); skipped rows counted, never dropped."""
        ...

    def length(self, example: Any) -> int:
        """The tokens the example takes in a packed micro-batch (what the packer packs)."""
        ...

    def collate(self, examples: list[Any]) -> Any:
        """A batch with `.input_ids (T,)`, `.seq`, `.to(device)` (one non-blocking copy)."""
        ...

    def weight(self, batch: Any) -> int:
        """Host int: the batch's share of the step's loss normaliser. No device work."""
        ...

    def micro_batch_loss(
        self, model: torch.nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss summed over the batch's weight, {metric: sum}); device tensors, no sync."""
        ...

    def report(self, sums: dict[str, float], weight: float) -> dict[str, float]:
        """The logged metrics of an interval (or an eval) from its metric sums and weight,
        host floats: by default each sum per unit of weight. An objective whose metrics are
        means over part of the batch (KTO's per-class rewards) divides them itself."""
        return {name: value / max(weight, 1) for name, value in sums.items()}

    def save(self, model: torch.nn.Module, tokenizer: Any, out: Any) -> bool:
        """Write the run's result into `out` itself (a reward model with its head) and return
        True; by default False: the trainer saves the adapter or the model."""
        return False


class OnlineObjective(Objective, Protocol):
    """An objective that generates what it trains on (GRPO)."""

    online: bool = True

    def rollout(
        self, ctx: HookContext, step: int, prompt_batches: list[Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        """-> (micro-batches to train on, on ctx.device; {"stats": {name: float}, "seconds":
        float}, or {} when the step reuses an earlier rollout). May sync with the host."""
        ...

    def evaluate(self, ctx: HookContext, examples: list[Any], batches: list[list[int]]) -> dict:
        """Held-out eval of `examples` (grouped as `batches` of indices): {"loss": ..., ...}."""
        ...


_DEFAULTS = ("online", "metric_names", "metric_extremes", "iterations", "attach", "report",
             "save")  # fmt: skip


def contract(protocol: type) -> list[str]:
    """The members a protocol asks for, in the order written (its bases' first)."""
    names: list[str] = []
    for cls in reversed(protocol.__mro__):
        if cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        for name in [*vars(cls).get("__annotations__", {}), *vars(cls)]:
            if not name.startswith("_") and name not in names:
                names.append(name)
    return names


def check_objective(objective: Any, where: str) -> None:
    """Raise TypeError naming every member of the contract `objective` lacks (a method left
    as the protocol's stub counts as missing); `where` names it ("module:Class")."""
    protocol = OnlineObjective if getattr(objective, "online", False) else Objective
    stubs = {n: v for p in (Objective, OnlineObjective) for n, v in vars(p).items()}
    missing = []
    for name in contract(protocol):
        value = getattr(objective, name, _MISSING)
        stub = name not in _DEFAULTS and getattr(value, "__func__", _MISSING) is stubs.get(name)
        if value is _MISSING or stub:
            missing.append(name)
    extremes = getattr(objective, "metric_extremes", {})
    bad = {n: k for n, k in extremes.items() if n not in objective.metric_names or k not in
           ("min", "max")}  # fmt: skip
    if bad:
        raise TypeError(f"objective {where}: metric_extremes {bad} must map names in its "
                        "metric_names to 'min' or 'max'")  # fmt: skip
    if missing:
        kind = "an online objective" if protocol is OnlineObjective else "an objective"
        raise TypeError(
            f"objective {where} lacks {', '.join(missing)}, which {kind} must have "
            "(slipstream/objectives/base.py; docs/dev/INTERFACES.md)"
        )


_MISSING = object()
