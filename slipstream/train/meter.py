"""The step meter: the sums a logged step reports, kept on the device between logged steps
and read to the host once per logged step.

Between logged steps the meter adds each step's loss and metric sums (device tensors, no
sync) and its host counts (weight, tokens, FLOPs from the host lengths). A logged step sums
them over ranks and reads them with the grad norm in one transfer (`.tolist()` of a few
numbers): with `log_every=10` one stall every 10 optimizer steps. Logged values are sums
divided by the interval's weight (labelled tokens for SFT), so they average per unit of
weight, not per micro-batch.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import slipstream.train.extremes as extremes
from slipstream import distributed as dist
from slipstream.config import dump_config
from slipstream.train.flops import StepFlops
from slipstream.train.metrics import MetricsLog, peak_flops, peak_memory_gb, perplexity


class StepMeter:
    """Interval counters, the logged-step read, the metrics log and the progress bar."""

    def __init__(self, run: Any) -> None:
        t = run.cfg.train
        self.device, self.world = run.device, dist.world_size()
        self.log_every, self.total_steps = t.log_every, run.total_steps
        self.perplexity = run.objective.perplexity
        self.metric_names = set(run.objective.metric_names)
        self.extremes = dict(run.objective.metric_extremes)  # {name: "min" | "max"}
        self.report = run.objective.report  # the logged values from the interval's sums
        self.guard = run.guard
        config = run.cfg.model_dump(mode="json")
        self.log = MetricsLog(
            run.out, total_steps=run.total_steps, start_step=run.start_step,
            enabled=dist.is_main(), report_to=run.report_to, config=config,
            first_files={"config.yaml": dump_config(run.cfg)},
        )  # fmt: skip
        self.flop_rate = peak_flops(run.device)
        full = run.cfg.train.finetune == "full"
        self.step_flops = StepFlops(run.model, lora=not full) if self.flop_rate else None
        self.tokens_total = run.tokens  # over all ranks, up to the last logged step
        self.last_loss: float | None = None
        self.loss = torch.zeros((), device=run.device)
        self.metrics: dict[str, torch.Tensor] = {}
        self.weight = self.tokens = self.flops = 0
        self.rollout_s = 0.0
        self.rollout_stats: dict[str, list[float]] = {}
        self.last_time = time.perf_counter()

    def add(self, micro_batches: list[Any], weight: int, loss: torch.Tensor, metrics: dict) -> None:
        """One optimizer step's micro-batches of this rank: `weight` a host int, `loss` and
        `metrics` device sums."""
        unknown = metrics.keys() - self.metric_names
        if unknown:  # the names are the objective's contract (objectives/base.py)
            raise RuntimeError(f"objective returned metrics {sorted(unknown)} that its "
                               f"metric_names {sorted(self.metric_names)} lack")  # fmt: skip
        self.loss += loss
        for name, value in metrics.items():  # summed, or a min/max (train/extremes.py)
            kind = extremes.kind_of(self.extremes, name)
            self.metrics[name] = extremes.fold(kind, self.metrics.get(name), value)
        self.weight += weight
        self.tokens += sum(b.input_ids.numel() for b in micro_batches)
        if self.step_flops:  # from the host lengths: no device work
            self.flops += sum(self._flops(b.seq) for b in micro_batches)

    def _flops(self, seq: Any) -> float:
        """A micro-batch's FLOPs; a sequence-parallel shard's: its 1/N of the whole batch's
        (its pieces' lengths would drop the attention across the cut)."""
        if seq.shard is None:
            return self.step_flops(seq.lengths)
        return self.step_flops(seq.shard.full.lengths) / len(seq.shard.sizes)

    def add_rollout(self, rollout: dict[str, Any]) -> None:
        """An objective's rollout (GRPO): `{"stats": {name: value}, "seconds": s}`, host
        values already the same on every rank (or {} for a step without one). A logged step
        shows each stat's mean over the interval's rollouts, `rollout_time_s` (their seconds)
        and `train_time_s` (the rest of the interval); tokens_per_s and mfu are then of
        the training part alone."""
        for name, value in rollout.get("stats", {}).items():
            self.rollout_stats.setdefault(name, []).append(value)
        self.rollout_s += rollout.get("seconds", 0.0)

    def end_step(self, step: int, grad_norm: torch.Tensor, lr: float, stop: bool) -> bool:
        """Log `step` if it is due; returns True when a rank asked to stop (under torchrun
        ranks agree at logged steps; a signal may reach them in different steps)."""
        due = step % self.log_every == 0 or step == self.total_steps
        stopping = False
        if due or stop and self.world == 1:  # one process stops in the step the signal came
            stopping = self._log_step(step, grad_norm, lr, stop)
        self.log.bar.update(1)
        return stopping

    def _log_step(self, step: int, grad_norm: torch.Tensor, lr: float, stop: bool) -> bool:
        # the same names on every rank: the objective reports them
        summed, mins_maxes = extremes.split(self.metrics, self.extremes)
        names, ext = sorted(summed), sorted(mins_maxes)
        values = [self.loss, *(summed[n] for n in names)]
        # The one host sync of a logged step: sums over ranks (one collective under
        # torchrun; a second, MIN, for the objective's extremes) and the grad norm in one
        # transfer.
        sums = dist.sum_over_ranks([*values, self.weight, self.tokens, self.flops, stop],
                                   self.device)  # fmt: skip
        kinds = [self.extremes[n] for n in ext]
        reduced = [dist.extremes_over_ranks([mins_maxes[n] for n in ext], kinds)] if ext else []
        norm_1 = dist.full_tensor(grad_norm).double().view(1)
        read = torch.cat([sums, *reduced, norm_1, *self.guard.counters()]).tolist()
        loss, *means, weight, tokens, flops, stops = read[: len(sums)]
        *ext_values, norm = read[len(sums) : len(sums) + len(ext) + 1]
        weight = max(weight, 1)
        # Non-finite steps since the last read: skipped and counted, or exit 2 (nonfinite.py)
        skipped = self.guard.check(read[-self.guard.num_counters :], step, loss / weight)
        now = time.perf_counter()
        elapsed = max(now - self.last_time - self.rollout_s, 1e-9)  # the training part
        rollout = {}
        if self.rollout_stats or self.rollout_s:
            rollout = {n: sum(v) / len(v) for n, v in self.rollout_stats.items()}
            rollout.update(rollout_time_s=self.rollout_s, train_time_s=elapsed)
        self.tokens_total += int(tokens)
        self.last_loss = loss / weight
        # Every rank's useful FLOPs over every rank's peak (train/flops.py).
        mfu = flops / elapsed / (self.flop_rate * self.world) if self.flop_rate else None
        self.log.log(
            {
                "step": step,
                "loss": self.last_loss,
                "lr": lr,
                "grad_norm": norm,
                "tokens": self.tokens_total,
                "tokens_per_s": tokens / elapsed,
                "peak_mem_gb": peak_memory_gb(self.device),
                "mfu": mfu,
                **({"skipped_steps": skipped} if self.guard.limit else {}),
                **self.report(dict(zip(names, means, strict=True)), weight),
                **dict(zip(ext, ext_values, strict=True)),  # the interval's min / max
                **rollout,
            }
        )
        self.rollout_s, self.rollout_stats = 0.0, {}
        self.loss.zero_()
        self.metrics = {}
        self.weight = self.tokens = self.flops = 0
        self.last_time = now
        return stops > 0

    def log_eval(self, step: int, result: dict[str, float]) -> float:
        """One eval line (`eval_loss`, `eval_ppl` for token losses, `eval_<metric>`); the
        time it took stays out of tokens/s. Returns the eval loss."""
        loss = result["loss"]
        ppl = {"eval_ppl": perplexity(loss)} if self.perplexity else {}
        rest = {f"eval_{k}": v for k, v in result.items() if k != "loss"}
        self.log.log({"step": step, "eval_loss": loss, **ppl, **rest})
        self.pause()
        return loss

    def pause(self) -> None:
        """Restart the interval clock (after an eval or a save)."""
        self.last_time = time.perf_counter()
        self.rollout_s = 0.0  # rollout seconds count within the clock's interval

    @property
    def tokens_trained(self) -> int:
        """Tokens so far: logged steps over all ranks, plus this rank's since the last one."""
        return self.tokens_total + self.tokens

    def close(self) -> None:
        self.log.close()
