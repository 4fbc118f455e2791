"""A run before and after its loop: `prepare_run(cfg)` builds everything the loop needs (device
and parallel mode, objective, data, model, optimizer and schedule, the resumed state) into
one `Run`; `save(run, ...)` writes a checkpoint; `finish_run` evaluates, saves the result
and writes the summary. Cheap errors (a bad file, a missing chat template) come before the
weights load.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slipstream import distributed as dist
from slipstream.checkpoint.tokenizer import load_tokenizer
from slipstream.config import RunConfig, check_output_dir
from slipstream.device import resolve_device
from slipstream.objectives import build_objective
from slipstream.objectives.base import HookContext, Objective
from slipstream.sequence_parallel import Mesh, build_mesh, check_model, check_objective
from slipstream.sources import check_adapter_dir
from slipstream.train.eval_tasks import EvalTasks
from slipstream.train.fixed_settings import check_resume_settings, say_adapter_overrides
from slipstream.train.meter import StepMeter
from slipstream.train.metrics import (
    peak_memory_gb,
    perplexity,
    plot_losses,
    plot_rewards,
    write_json,
)
from slipstream.train.nonfinite import NonFiniteGuard
from slipstream.train.optim import build_optimizer, build_schedule, warmup_steps_for
from slipstream.train.report_to import resolve_report_to
from slipstream.train.setup import (
    RunData,
    add_tokens,
    build_data,
    build_model,
    image_implementation,
    report_dict,
    save_result,
    seed_everything,
    set_chat_template,
)
from slipstream.train.state import (
    CHECKPOINT_DIR,
    find_resume_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


@dataclass
class Run:
    """What the loop works with. `ddp` is the DDP wrapper the losses run through (None
    without DDP); `model` is the model itself (under FSDP2, sharded in place)."""

    cfg: RunConfig
    out: Path
    device: torch.device
    objective: Objective
    context: HookContext  # what the objective's hooks see of the run
    tokenizer: Any
    data: RunData
    model: torch.nn.Module
    ddp: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    total_steps: int
    per_step: int  # micro-batches in one optimizer step, all data-parallel ranks together
    mesh: Mesh = field(default_factory=Mesh)  # data x sequence-parallel ranks
    report_to: list[str] = field(default_factory=list)
    start_step: int = 0
    tokens: int = 0  # tokens trained before this process started (resume)
    eval_before: float | None = None
    guard: NonFiniteGuard | None = None  # non-finite steps: counted, skipped, stopped at
    best: tuple[float, int] | None = None  # (eval loss, step) of the best checkpoint kept
    eval_tasks: EvalTasks | None = None  # train.eval_tasks (train/eval_tasks.py)
    started: float = field(default_factory=time.perf_counter)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def prepare_run(cfg: RunConfig, *, model: Any = None, tokenizer: Any = None) -> Run:
    """Everything before the first step; `model`/`tokenizer` given skip their loading."""
    t = cfg.train
    out = check_output_dir(cfg.output_dir)  # nothing is written there before a result
    checkpoint = find_resume_checkpoint(cfg.resume, out)  # before the slow loads
    if checkpoint is not None:
        check_resume_settings(cfg, checkpoint)
    report_to = resolve_report_to(t.report_to) if dist.is_main() else []
    if t.push_to_hub and dist.is_main():  # a missing token is said now, not after the run
        from slipstream.share.upload import check_push

        check_push(t.push_to_hub, "train.push_to_hub")
    device = dist.init(resolve_device(t.device), timeout_s=t.dist_timeout_s)
    if device.type == "cuda":  # the current device: streams, RNG state, compiled kernels
        torch.cuda.set_device(device)
    else:  # activations in host memory: reuse freed blocks instead of faulting in new pages
        from slipstream.memory.host_heap import keep_freed_memory

        keep_freed_memory()
    plan = None
    if model is None:  # before a tokenizer, data or weight loads; refuses what won't fit
        from slipstream.memory.plan import plan_for_run

        plan = plan_for_run(cfg, device.type, say=dist.print_main)
    world = dist.world_size()
    mesh = build_mesh(t.sequence_parallel)  # data x sequence ranks (sequence_parallel.py)
    mode = dist.resolve_mode(
        t.parallel, method=cfg.train.finetune, quantization=cfg.model.quantization,
        optimizer=t.optimizer,
    )  # fmt: skip
    seed_everything(t.seed)  # the same seed on every rank: identical initial weights

    objective = build_objective(cfg)
    check_objective(objective, mesh.sp_size)
    if cfg.model.adapter is not None:  # a wrong path is said before the data and weights load
        say_adapter_overrides(cfg, check_adapter_dir(cfg.model.adapter, "model.adapter"))
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model.path)
    set_chat_template(tokenizer, cfg.data.chat_template)
    add_tokens(tokenizer, cfg.model.add_tokens)
    data = build_data(cfg, tokenizer, objective)
    if model is None and (implementation := image_implementation(cfg, data.train)):
        dist.print_main(
            "slipstream: image rows: the image side trains on transformers' image-text code "
            "(model.implementation=transformers; the native family is text only)"
        )
        cfg.model.implementation = implementation  # later loads (saving, export) take it too
    eval_tasks = EvalTasks.of(t)  # lm-eval's tasks found before the weights load
    if device.type == "cpu":  # hyperthread siblings share a core's matrix unit
        from slipstream.cpu import set_threads

        dist.print_main(f"slipstream: {set_threads(t.threads)} on the CPU")
    model = model if model is not None else build_model(cfg, device, tokenizer, plan)
    check_model(model, mesh.sp_size)
    context = HookContext(model, tokenizer, device, t.seed, mesh.dp_rank, mesh.dp_size)
    objective.attach(context, data)  # e.g. DPO's reference policy, before any sharding
    ddp = dist.wrap_model(model, mode, device)
    if world > 1:
        sp = f", sequence_parallel={mesh.sp_size}" if mesh.sp_size > 1 else ""
        dist.print_main(f"slipstream: {world} processes, parallel={mode}{sp}, device={device.type}")
        torch.manual_seed(t.seed + dist.rank())  # but each rank its own dropout draws

    optimizer = build_optimizer(
        model.named_parameters(), lr=t.lr, weight_decay=t.weight_decay, device=device,
        kind=t.optimizer,
        lora_plus_ratio=cfg.lora.plus_ratio if cfg.train.finetune == "lora" else None,
    )  # fmt: skip
    epochs = t.epochs if t.epochs is not None else 1.0
    per_step = t.grad_accum * mesh.dp_size  # a sequence-parallel group shares its batches
    repeat = objective.iterations  # GRPO: steps per draw of prompts
    total_steps = t.steps or math.ceil(epochs * len(data.train_batches) / per_step) * repeat
    warmup = warmup_steps_for(t.warmup_steps, total_steps)
    if warmup >= total_steps:
        dist.print_main(
            f"slipstream: warning: train.warmup_steps={t.warmup_steps} is not shorter than the "
            f"run's {total_steps} steps, so the lr never reaches train.lr (at most "
            f"{total_steps / (warmup + 1):.0%} of it); give a fraction, e.g. warmup_steps=0.05"
        )
    scheduler = build_schedule(
        optimizer, schedule=t.schedule, warmup_steps=warmup, total_steps=total_steps
    )
    run = Run(cfg, out, device, objective, context, tokenizer, data, model, ddp, optimizer,
              scheduler, total_steps, per_step, mesh, report_to)  # fmt: skip
    run.guard = NonFiniteGuard(optimizer, device, limit=t.skip_nonfinite)
    run.eval_tasks = eval_tasks
    if checkpoint is not None:
        resume(run, checkpoint)
    return run


def resume(run: Run, checkpoint: Path) -> None:
    """Restore `checkpoint` into `run`: weights, optimizer, schedule, RNG, loop state."""
    state = load_checkpoint(
        checkpoint, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler
    )
    run.start_step = state["step"]
    run.tokens = state["extra"].get("tokens", 0)
    run.eval_before = state["extra"].get("eval_loss_before")
    run.guard.skipped = state["extra"].get("skipped_steps", 0)
    best = state["extra"].get("best")
    run.best = (best[0], best[1]) if best else None
    dist.print_main(f"slipstream: resuming from {checkpoint} (step {run.start_step})")


def save(run: Run, meter: StepMeter, step: int) -> Path:
    """A resumable checkpoint of step `step` (every rank calls this; see train/state.py).
    Never of non-finite weights: the guard's counters are read first (exit 2 if over).
    Rotation keeps the best one (`train.save_best`) beside the newest."""
    meter.log.open()  # config.yaml comes with the first result, at the latest here
    extra = {
        "config": run.cfg.model_dump(mode="json"),
        "tokens": meter.tokens_trained,
        "eval_loss_before": run.eval_before,
        "skipped_steps": run.guard.check_now(),
        "best": list(run.best) if run.best else None,
    }
    path = save_checkpoint(
        run.out, step=step, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler,
        extra=extra, keep=run.cfg.train.keep_checkpoints,
        keep_step=run.best[1] if run.best else None,
    )  # fmt: skip
    meter.pause()  # keep save time out of tokens/s
    return path


def is_new_best(run: Run, step: int, eval_loss: float) -> bool:
    """With `train.save_best`: is this the best eval loss yet (then its step is kept)?"""
    if not run.cfg.train.save_best or run.best is not None and eval_loss >= run.best[0]:
        return False
    run.best = (eval_loss, step)
    return True


def finish_run(
    run: Run, meter: StepMeter, *, stopped_by: str | None, step: int, eval_after: float | None
) -> dict[str, Any]:
    """Close the log, save the result of a completed run, plot, write the summary.
    `stopped_by`: the signal that interrupted the run ("SIGTERM", or "" when another rank's)."""
    cfg, out = run.cfg, run.out
    status = "completed" if stopped_by is None else "interrupted"
    meter.log.open()
    meter.close()
    if status == "completed" and eval_after is not None:
        is_new_best(run, step, eval_after)  # the final model itself, in output_dir
    if status == "completed":
        # FSDP2: every rank helps gather the weights; rank 0 writes them.
        result = dist.unsharded(
            run.model, lambda: build_model(cfg, torch.device("cpu"), run.tokenizer)
        )
        # An objective may write its own result (a reward model with its head).
        if dist.is_main() and not run.objective.save(result, run.tokenizer, out):
            save_result(result, run.tokenizer, out, cfg)
    plot = plot_losses(meter.log.path, out / "loss.png") if dist.is_main() else None
    if dist.is_main():
        plot_rewards(meter.log.path, out / "reward.png")  # GRPO; None (nothing) otherwise
    before = run.eval_before
    ppl = perplexity if run.objective.perplexity else lambda loss: None  # as the eval lines
    summary = {
        "status": status,
        "signal": stopped_by or None,
        "steps": step,
        "total_steps": run.total_steps,
        "method": cfg.train.finetune,
        "final_train_loss": meter.last_loss,
        "eval_loss_before": before,
        "eval_loss_after": eval_after,
        "eval_ppl_before": ppl(before) if before is not None else None,
        "eval_ppl_after": ppl(eval_after) if eval_after is not None else None,
        "tokens_trained": meter.tokens_total,
        "skipped_steps": run.guard.skipped,
        "seconds": time.perf_counter() - run.started,
        "trainable_params": sum(p.numel() for p in run.params),
        "total_params": sum(p.numel() for p in run.model.parameters()),
        "peak_mem_gb": peak_memory_gb(run.device),
        "device": str(run.device),
        "packing_efficiency": run.data.packing_efficiency,
        "train_examples": len(run.data.train),
        "eval_examples": len(run.data.eval),
        "data_report": report_dict(run.data.report),
        "loss_plot": str(plot) if plot else None,
        "best": _best(run, step) if run.best else None,
        "output_dir": str(out),
    }
    if dist.is_main():
        write_json(out / "summary.json", summary)
    dist.close()
    return summary


def _best(run: Run, last_step: int) -> dict[str, Any]:
    """Where the best-eval weights are: a kept checkpoint, or the final model."""
    loss, step = run.best
    final = step == last_step
    path = run.out if final else run.out / CHECKPOINT_DIR / f"step-{step:06d}"
    return {"step": step, "eval_loss": loss, "path": str(path), "final": final}
