"""Non-finite losses and gradient norms (bf16 overflow, a learning rate too high).

A step whose gradient norm is NaN or inf would write NaN into every weight and both Adam
moments, for good. The guard marks such a step on the device (no host sync: `isfinite` of
the grad norm the clip already computed) and skips its update on the device where the
optimizer reads `found_inf` as GradScaler feeds it (fused AdamW), else by reading the flag
before `optimizer.step()` when `train.skip_nonfinite > 0` (one sync a step on a GPU). The run
stops with exit 2, before anything is written, once more steps than `train.skip_nonfinite`
were bad. The cases and their costs: docs/reliability.md ("Non-finite steps").
"""

from __future__ import annotations

import math
from typing import Any

import torch

from slipstream import distributed as dist


class NonFiniteError(ValueError):
    """Too many non-finite steps: the run stops without writing non-finite weights (exit 2)."""


class NonFiniteGuard:
    """Counts non-finite steps on the device; skips their updates where it can."""

    num_counters = 4  # what counters() holds: count, then first bad (step, loss, norm)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        limit: int,
        skipped: int = 0,
    ) -> None:
        self.limit = limit
        self.gated = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self.host_checked = not self.gated and limit > 0
        self.skipped = skipped  # over the whole run, resumes included (host int)
        self.said = False
        self.count = torch.zeros((), dtype=torch.float64, device=device)  # since last check
        self.first = torch.zeros(3, dtype=torch.float64, device=device)  # step, loss, norm

    def step(self, optimizer: torch.optim.Optimizer, step: int, loss, grad_norm) -> torch.Tensor:
        """`optimizer.step()` unless the step is non-finite and can be skipped; returns the
        loss to log (zero for a step whose update was skipped)."""
        norm = dist.full_tensor(grad_norm).detach()
        bad = ~torch.isfinite(norm)
        self.count += bad
        new = bad & (self.first[0] == 0)
        at = torch.full((), step, dtype=torch.float64, device=norm.device)
        mark = torch.stack([at, loss.detach().double().reshape(()), norm.double()])
        self.first.copy_(torch.where(new, mark, self.first))
        if self.gated:
            optimizer.found_inf = bad.float()
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
        elif self.host_checked:
            if not self.said and norm.device.type != "cpu":
                self.said = True
                dist.print_main(
                    "slipstream: train.skip_nonfinite with this optimizer reads the grad "
                    "norm every step (one host sync a step; fused AdamW needs none)"
                )
            if bad.item():  # sync: see above
                return torch.zeros_like(loss)
            optimizer.step()
        else:
            optimizer.step()
        return torch.where(bad, torch.zeros_like(loss), loss) if self.gated else loss

    def counters(self) -> list[torch.Tensor]:
        """Device tensors a logged step reads along with its other numbers (one transfer)."""
        return [self.count.view(1), self.first]

    def check(self, values: list[float], step: int | None = None, loss: float | None = None) -> int:
        """After the read (`values`: `counters()` as host floats): NonFiniteError when more
        steps than the limit were bad (or, at a logged `step`, its mean `loss` is not
        finite); returns the steps skipped so far."""
        count, first_step, first_loss, first_norm = values
        if count:
            self.skipped += int(count)
            self.count.zero_()
            skippable = self.gated or self.host_checked
            if not skippable or self.skipped > self.limit:
                raise NonFiniteError(self.message(int(first_step), first_loss, first_norm))
            self.first.zero_()
        if loss is not None and not math.isfinite(loss):  # a non-finite loss, finite grads
            raise NonFiniteError(self.message(step, loss, float("nan")))
        return self.skipped

    def check_now(self) -> int:
        """The check with its own read (before a save: saves are rare and sync anyway)."""
        return self.check(torch.cat(self.counters()).tolist())

    def message(self, step: int, loss: float, norm: float) -> str:
        over = f"more than train.skip_nonfinite={self.limit} " if self.limit else ""
        return (
            f"non-finite {over}at step {step} (loss {_num(loss)}, grad_norm {_num(norm)}); "
            "nothing was saved from it, the latest checkpoint is the resume point; lower "
            "train.lr, set train.clip, or set train.skip_nonfinite=N to skip up to N such steps"
        )


def _num(x: Any) -> str:
    return str(x) if not isinstance(x, float) or not math.isfinite(x) else f"{x:.4g}"
