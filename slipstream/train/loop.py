"""The training loop: `train(config)`, one function that reads top to bottom.

Set-up is `prepare_run` (train/run.py); the loss is the objective's (slipstream/objectives/,
`train.objective`); logging is the step meter's (train/meter.py).

Loss normalisation: each micro-batch's loss is *summed* (over its labelled tokens for SFT)
and divided by the weight of the optimizer step's micro-batches (the objective's host int
from the collator, no sync). So `grad_accum=4` with a quarter of the token budget gives the same
update as one full batch, and long and short examples weigh per token, not per batch.

Under torchrun (docs/distributed.md) each global step's `grad_accum * world` micro-batches
are drawn from the same seeded stream and rank r takes every world-th, and the divisor is
the weight of the whole step over all ranks (one all-reduce on the device): N ranks make
the update one process makes with the same global batch. Under `train.sequence_parallel`
"rank" and "world" are the data-parallel ones, and each rank keeps its shard of every
micro-batch (sequence_parallel.py). Logging, the progress bar and
saving happen on rank 0.

Host syncs: none inside the micro-batch loop; the meter reads once per *logged* step and
evaluation once at its end.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Iterator
from typing import Any

import torch

import slipstream.train.extremes as extremes
from slipstream import distributed as dist
from slipstream.config import RunConfig
from slipstream.train.lock import OutputDirLock
from slipstream.train.meter import StepMeter
from slipstream.train.run import Run, finish_run, is_new_best, prepare_run, save
from slipstream.train.samples import log_samples
from slipstream.train.state import StopSignal


def train(cfg: RunConfig, *, model: Any = None, tokenizer: Any = None) -> dict[str, Any]:
    """Run the fine-tuning job `cfg` describes; returns the run summary (also written)."""
    # One run per output dir: its lock is held until this returns or raises (train/lock.py).
    with OutputDirLock(cfg.output_dir):
        try:
            summary = run_steps(prepare_run(cfg, model=model, tokenizer=tokenizer))
        except BaseException as e:
            # Every end but a completed one (that one leaves the group with every rank, in
            # finish_run): an error, a signal, an exception on this rank. What the run made
            # (model, wrappers, optimizer, objective) goes now, not with the traceback, which
            # would keep it to interpreter exit; the traceback keeps its lines. The group
            # itself goes at exit (distributed.init), once the error has been printed: its
            # end brings the other ranks down, and torchrun may then stop this one.
            traceback.clear_frames(e.__traceback__)
            dist.release_wrappers()
            raise
    repo = cfg.train.push_to_hub
    if repo and summary["status"] == "completed" and dist.is_main():  # train.push_to_hub
        from slipstream.share.push import push_trained

        summary["pushed"] = push_trained(cfg.output_dir, repo, cfg.train.push_private)["url"]
    return summary


def run_steps(run: Run) -> dict[str, Any]:
    """The loop over a prepared run's steps, then its result and summary."""
    t, objective = run.cfg.train, run.objective
    meter = StepMeter(run)
    if run.start_step == 0 and evaluates(run):
        run.eval_before = eval_point(run, meter, 0)
    # The data stream is a pure function of (seed, micro-batch index): resume needs no state.
    # An online objective (GRPO) trains `iterations` steps on one draw of prompt batches.
    repeat = objective.iterations
    start = run.start_step // repeat * run.per_step
    stream = micro_batch_stream(len(run.data.train_batches), t.seed, start)
    step_batches: list[Any] = []  # micro-batches, or an online objective's prompt batches
    clip = t.clip if t.clip is not None else math.inf
    step, stopped_by = run.start_step, None
    run.model.train()
    with StopSignal() as stop:
        for step in range(run.start_step + 1, run.total_steps + 1):
            if (step - 1) % repeat == 0 or not step_batches:
                mine = [next(stream) for _ in range(run.per_step)]
                step_batches = [collate_batch(run, run.data.train, run.data.train_batches[i])
                                for i in mine[run.mesh.dp_rank :: run.mesh.dp_size]]  # fmt: skip
            batches = step_batches
            if objective.online:  # generation (GRPO): prompt batches -> sequences
                batches, rollout = objective.rollout(run.context, step, step_batches)
                meter.add_rollout(rollout)
            weight = sum(objective.weight(b) for b in batches)
            loss, metrics = accumulate_gradients(
                run.model, batches, objective, dist.step_weight(weight, run.device), run.ddp
            )
            grad_norm = torch.nn.utils.clip_grad_norm_(run.params, clip)
            loss = run.guard.step(run.optimizer, step, loss, grad_norm)  # NaN/inf: nonfinite.py
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            meter.add(batches, weight, loss, metrics)
            stopping = meter.end_step(
                step, grad_norm, run.scheduler.get_last_lr()[0], stop.requested
            )

            last, best = step == run.total_steps, False
            if t.eval_every and step % t.eval_every == 0 and not last and evaluates(run):
                eval_loss = eval_point(run, meter, step)
                best = eval_loss is not None and is_new_best(run, step, eval_loss)
            if t.save_every and step % t.save_every == 0 and not last or stopping or best:
                save(run, meter, step)
            if stopping:
                stopped_by = stop.name or ""  # "": another rank's signal (torchrun)
                dist.print_main(
                    f"\nslipstream: stopped by {stopped_by or 'a signal on another rank'} at step "
                    f"{step}; checkpoint saved; rerun with resume=true to continue"
                )
                break

    eval_after = None
    if stopped_by is None and evaluates(run):
        eval_after = eval_point(run, meter, step)
    return finish_run(run, meter, stopped_by=stopped_by, step=step, eval_after=eval_after)


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: list[Any],
    objective: Any,
    weight: int | torch.Tensor | None = None,
    ddp: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Backward over one optimizer step's micro-batches; returns the summed loss and metric sums
    (the objective's `metric_extremes` their min or max; detached device tensors). No host
    sync here.

    Each micro-batch's summed loss is divided by `weight`, their (or under torchrun
    the whole step's) total of `objective.weight`, so the gradient equals that of one batch
    holding them all. `ddp`: the DDP wrapper the loss runs through, if any.
    """
    if weight is None:
        weight = max(sum(objective.weight(b) for b in micro_batches), 1)  # host ints
    world = dist.world_size()  # DDP and FSDP average gradients over ranks; we want the sum
    loss_sum, metric_sums = None, {}
    for i, batch in enumerate(micro_batches):
        with dist.gradient_sync(model, ddp, enabled=i == len(micro_batches) - 1):
            loss, metrics = dist.run_through(ddp, objective.micro_batch_loss, model, batch)
            (loss * world / weight).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        for name, value in metrics.items():  # summed, or a min/max (train/extremes.py)
            kind = extremes.kind_of(objective.metric_extremes, name)
            metric_sums[name] = extremes.fold(kind, metric_sums.get(name), value.detach())
    return loss_sum, metric_sums


def evaluates(run: Run) -> bool:
    return bool(run.data.eval or run.cfg.train.sample_prompts or run.eval_tasks)


def eval_point(run: Run, meter: StepMeter, step: int) -> float | None:
    """The eval line (with eval data), the lm-eval tasks' line (`train.eval_tasks`), then
    replies to `train.sample_prompts`; returns the eval loss or None."""
    loss = meter.log_eval(step, evaluate(run)) if run.data.eval else None
    t = run.cfg.train
    if run.eval_tasks is not None:
        meter.log.log({"step": step, **run.eval_tasks(run.model, run.tokenizer)})
        meter.pause()  # keep eval time out of tokens/s
    if t.sample_prompts:
        log_samples(meter.log, step, run.model, run.tokenizer, t.sample_prompts,
                    t.sample_max_new_tokens)  # fmt: skip
        meter.pause()  # keep sampling time out of tokens/s
    return loss


@torch.no_grad()  # else `total` keeps every eval batch's autograd graph alive until the end
def evaluate(run: Run) -> dict[str, float]:
    """Loss and metrics per unit of weight over the eval set (one host sync, at the end);
    an objective with its own `evaluate` (GRPO: the reward of greedy replies) runs that.

    Under torchrun each rank evaluates its share (`eval_share`) and one all-reduce sums the
    losses, metrics and weights: the same numbers as one process, in 1/world of the time.
    """
    model, objective, device = run.model, run.objective, run.device
    if objective.online:
        return objective.evaluate(run.context, run.data.eval, run.data.eval_batches)
    was_training = model.training
    model.eval()
    total, metrics, count = torch.zeros((), device=device), {}, 0
    batches = run.data.eval_batches
    for i, counted in eval_share(len(batches), run.mesh.dp_rank, run.mesh.dp_size):
        batch = collate_batch(run, run.data.eval, batches[i])
        loss, parts = objective.micro_batch_loss(model, batch)
        for name, value in parts.items():  # every rank the same names, counted or not
            kind = extremes.kind_of(objective.metric_extremes, name)
            metrics.setdefault(name, extremes.start(kind, device))
            if counted:
                metrics[name] = extremes.fold(kind, metrics[name], value.float())
        if counted:
            total += loss.float()
            count += objective.weight(batch)
    model.train(was_training)
    sums, mins_maxes = extremes.split(metrics, objective.metric_extremes)
    names, ext = sorted(sums), sorted(mins_maxes)
    values = [dist.sum_over_ranks([total, *(sums[n] for n in names), count], device)]
    if ext:  # one more collective, the same host read
        kinds = [objective.metric_extremes[n] for n in ext]
        values.append(dist.extremes_over_ranks([mins_maxes[n] for n in ext], kinds))
    loss, *read = torch.cat(values).tolist()
    count = max(read[len(names)], 1)
    return {"loss": loss / count,
            **objective.report(dict(zip(names, read[: len(names)], strict=True)), count),
            **dict(zip(ext, read[len(names) + 1 :], strict=True))}  # fmt: skip


def eval_share(num_batches: int, rank: int, world: int) -> list[tuple[int, bool]]:
    """(batch index, counted) pairs rank `rank` evaluates: every world-th batch, then padding
    entries (batch 0, not counted) so every rank runs the same number of forwards, as FSDP
    needs (each forward gathers the weights from all ranks)."""
    mine = [(i, True) for i in range(rank, num_batches, world)]
    rounds = -(-num_batches // world)
    return mine + [(0, False)] * (rounds - len(mine))


def micro_batch_stream(num_batches: int, seed: int, start: int = 0) -> Iterator[int]:
    """Batch indices forever, epoch after epoch in seeded orders, skipping the first `start`."""
    from slipstream.data import epoch_order

    epoch, pos = divmod(start, num_batches)
    while True:
        yield from epoch_order(num_batches, seed=seed, epoch=epoch)[pos:]
        epoch, pos = epoch + 1, 0


def collate_batch(run: Run, examples: list[Any], indices: list[int]) -> Any:
    """The objective's batch of `examples[indices]` (this rank's shard of it under sequence
    parallelism), on the run's device."""
    return run.mesh.shard(run.objective.collate([examples[i] for i in indices])).to(run.device)
