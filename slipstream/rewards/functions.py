"""`RewardFunctions`: reward functions called TRL's way on one batch of completions, their
values checked and gathered into an (N, F) float32 tensor; `total` is their weighted sum.

Conventions (as TRL 1.16's `GRPOTrainer._calculate_rewards`): every function gets keyword
arguments `prompts`, `completions`, `completion_ids`, one list per other dataset column (each
already repeated per completion), `trainer_state`, `log_extra` and `log_metric`; it returns one
float or None per completion (None -> NaN: the function does not judge that completion). A
function without `**kwargs` gets only the arguments it names (TRL would fail on the others).
`log_extra`/`log_metric` are accepted and ignored: a TRL function may call them.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# What a reward function is passed besides the dataset's columns.
TRL_ARGUMENTS = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
)


class RewardError(ValueError):
    """A reward function failed on a batch: one line naming the function and the row."""


@dataclass(frozen=True)
class Reward:
    name: str  # unique within a RewardFunctions; metrics use it
    spec: str  # the `function` text of the config, for errors
    fn: Callable[..., Any]
    weight: float
    accepts: frozenset[str] | None  # the keyword names it takes; None: any (**kwargs)
    columns: tuple[str, ...]  # dataset columns it cannot do without


def _ignore(*args: Any, **kwargs: Any) -> None:
    """Stands in for TRL's `log_extra` / `log_metric`."""


def _rows_text(rows: Sequence[int]) -> str:
    """'dataset row 3' or 'dataset rows 3, 4, 9, ... (12 in all)' for distinct rows in order."""
    distinct = list(dict.fromkeys(rows))
    if len(distinct) == 1:
        return f"dataset row {distinct[0]}"
    shown = ", ".join(str(r) for r in distinct[:4])
    more = f", ... ({len(distinct)} in all)" if len(distinct) > 4 else ""
    return f"dataset rows {shown}{more}"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    text = text[0] if text else ""
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _value(v: Any) -> float | None:
    """A returned value as a float (None stays None); ValueError for anything else."""
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or not hasattr(v, "__float__"):
        raise ValueError(f"{v!r} ({type(v).__name__})")
    f = float(v)  # int, bool, numpy and 0-d torch values
    if not math.isfinite(f):
        raise ValueError(repr(f))
    return f


class RewardFunctions:
    """The reward functions of a run, called together: `self(prompts, completions, columns,
    rows) -> (N, F)` float32 CPU tensor, NaN where a function returned None."""

    def __init__(self, rewards: Sequence[Reward]) -> None:
        self.rewards = list(rewards)
        self.names: list[str] = [r.name for r in self.rewards]
        self.weights: list[float] = [r.weight for r in self.rewards]

    def __len__(self) -> int:
        return len(self.rewards)

    @property
    def columns_needed(self) -> set[str]:
        """Dataset columns some function cannot do without (e.g. `answer` for accuracy)."""
        return {c for r in self.rewards for c in r.columns}

    def __call__(
        self,
        prompts: list,
        completions: list,
        columns: dict[str, list],
        rows: list[int],
        *,
        completion_ids: list[list[int]] | None = None,
        trainer_state: Any = None,
    ) -> Any:
        """Score N completions. `columns`: the dataset's other columns, one value per
        completion; `rows`: each completion's dataset row (for errors); `completion_ids`
        and `trainer_state` are handed on to functions that take them, as TRL does."""
        import torch

        n = len(completions)
        lists = {"prompts": prompts, "rows": rows, **columns}
        if completion_ids is not None:
            lists["completion_ids"] = completion_ids
        for key, values in lists.items():
            if len(values) != n:
                raise ValueError(f"rewards: {len(values)} {key} for {n} completions; give one each")
        args = {
            "prompts": list(prompts),
            "completions": list(completions),
            "completion_ids": completion_ids,
            **{k: list(v) for k, v in columns.items()},
            "trainer_state": trainer_state,
            "log_extra": _ignore,
            "log_metric": _ignore,
        }
        scores = [self._score(r, args, rows) for r in self.rewards]
        values = [[math.nan if v is None else v for v in col] for col in scores]
        return (
            torch.tensor(values, dtype=torch.float32).reshape(len(self.rewards), n).T.contiguous()
        )

    def total(self, r_NF: Any) -> Any:
        """(N,) weighted sum over functions, NaN (None) ignored: TRL's `nansum`. A completion
        every function returned None for is unscorable: NaN, as TRL 1.16 marks it (not 0,
        which would bias its group's baseline)."""
        import torch

        w_F = torch.tensor(self.weights, dtype=r_NF.dtype, device=r_NF.device)
        return (r_NF * w_F).nansum(dim=1).masked_fill(r_NF.isnan().all(dim=1), math.nan)

    def _score(self, r: Reward, args: dict[str, Any], rows: list[int]) -> list[float | None]:
        missing = [c for c in r.columns if c not in args]
        if missing:
            have = ", ".join(k for k in args if k not in TRL_ARGUMENTS) or "none"
            raise RewardError(
                f"reward {r.spec!r} reads the dataset column {missing[0]!r}, which the data "
                f"lacks (its other columns: {have})"
            )
        kwargs = args if r.accepts is None else {k: v for k, v in args.items() if k in r.accepts}
        n = len(args["completions"])
        try:
            out = _run(r.fn, kwargs)
        except Exception as e:
            raise RewardError(
                f"reward {r.spec!r} raised {_one_line(e)} on {_failing_rows(r, kwargs, rows)}"
            ) from e
        if not isinstance(out, (list, tuple)) and not hasattr(out, "tolist"):
            raise RewardError(
                f"reward {r.spec!r} returned a {type(out).__name__} on {_rows_text(rows)}; "
                f"return a list of {n} values (one float or None per completion)"
            )
        out = out.tolist() if hasattr(out, "tolist") else list(out)
        if len(out) != n:
            raise RewardError(
                f"reward {r.spec!r} returned {len(out)} values for {n} completions "
                f"({_rows_text(rows)}); return one float or None per completion"
            )
        values = []
        for i, v in enumerate(out):
            try:
                values.append(_value(v))
            except ValueError as e:
                raise RewardError(
                    f"reward {r.spec!r} returned {e} for completion {i} (dataset row {rows[i]}); "
                    "return a finite float, or None to skip that completion"
                ) from None
        return values


def _run(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    out = fn(**kwargs)
    return asyncio.run(out) if inspect.isawaitable(out) else out  # TRL's async functions


def _failing_rows(r: Reward, kwargs: dict[str, Any], rows: list[int]) -> str:
    """The first dataset row on which the function raises when called on that completion
    alone; the batch's rows when it raises only on the whole batch."""
    n = len(kwargs["completions"])
    for i in range(n):
        one = {
            k: v[i : i + 1] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()
        }
        try:
            _run(r.fn, one)
        except Exception:
            return f"dataset row {rows[i]} (completion {i})"
    return _rows_text(rows)
