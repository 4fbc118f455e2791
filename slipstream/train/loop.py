"""The training loop: one function, `train(config)`, that reads top to bottom.

Order of work: output dir checked and config written; seeds; data tokenized and packed
(cheap errors such as a bad file or a missing chat template come before the weights load);
model loaded, LoRA applied (or every weight trainable), activation checkpointing applied;
AdamW and the schedule; resume; then the loop.

Loss normalisation: each micro-batch's loss is *summed* over its labelled tokens and divided
by the labelled-token count of the whole accumulation window (a host int from the collator,
no sync). So `grad_accum=4` with a quarter of the token budget gives the same update as one
full batch, and long and short examples weigh per token, not per batch.

Under torchrun (`slipstream.distributed`, docs/distributed.md) each global step's
`grad_accum * world` micro-batches are drawn from the same seeded stream and rank r takes
every world-th, and the divisor is the labelled-token count of the whole step over all ranks
(one all-reduce on the device): N ranks make the update one process makes with the same
global batch. Logging, the progress bar and saving happen on rank 0.

The LM head runs only on the labelled positions (`Batch.label_positions`, host-built by the
collator, selected by `index_select` in `model.loss`): with assistant-only labels most rows
carry none (chitchat: 38% labelled), and the head is the widest matmul of a small model.

Host syncs: none inside the micro-batch loop. The loss and grad norm are read to the host
once per *logged* step (`.tolist()` of two numbers; three with a MoE router aux loss, which
is reported as `aux_loss`), outside model code; evaluation reads
its total once. With `log_every=10` that is one stall every 10 optimizer steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from slipstream import distributed as dist
from slipstream.checkpoint.hf import load_tokenizer, resolve_device
from slipstream.config import RunConfig, check_output_dir, write_resolved_config
from slipstream.models.moe_block import (
    moe_aux_loss,
    router_aux_loss_coef,
)
from slipstream.train.flops import StepFlops
from slipstream.train.metrics import (
    MetricsLog,
    peak_flops,
    peak_memory_gb,
    perplexity,
    plot_losses,
    write_json,
)
from slipstream.train.optim import build_optimizer, build_schedule
from slipstream.train.setup import (
    build_data,
    build_model,
    report_dict,
    save_result,
    seed_everything,
    set_chat_template,
)
from slipstream.train.state import (
    StopSignal,
    find_resume_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


def train(cfg: RunConfig, *, model: Any = None, tokenizer: Any = None) -> dict[str, Any]:
    """Run the fine-tuning job `cfg` describes; returns the run summary (also written)."""
    t = cfg.train
    out = check_output_dir(cfg.output_dir)
    device = dist.init(resolve_device(t.device), timeout_s=t.dist_timeout_s)
    if device.type == "cuda":  # the current device: streams, RNG state, compiled kernels
        torch.cuda.set_device(device)
    world, rank = dist.world_size(), dist.rank()
    mode = dist.resolve_mode(
        t.parallel,
        method=cfg.lora.method,
        quantization=cfg.model.quantization,
        optimizer=t.optimizer,
    )
    if dist.is_main():
        write_resolved_config(cfg, out)
    seed_everything(t.seed)  # the same seed on every rank: identical initial weights

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model.path)
    set_chat_template(tokenizer, cfg.data.chat_template)
    data = build_data(cfg, tokenizer)
    model = model if model is not None else build_model(cfg, device)
    model = dist.wrap_model(model, mode, device)
    if world > 1:
        dist.print_main(f"slipstream: {world} processes, parallel={mode}, device={device.type}")
        torch.manual_seed(t.seed + rank)  # but each rank its own dropout draws
    params = [p for p in model.parameters() if p.requires_grad]
    full = cfg.lora.method == "full"

    optimizer = build_optimizer(
        model.named_parameters(),
        lr=t.lr,
        weight_decay=t.weight_decay,
        device=device,
        kind=t.optimizer,
        lora_plus_ratio=cfg.lora.plus_ratio if cfg.lora.method == "lora" else None,
    )
    epochs = t.epochs if t.epochs is not None else 1.0
    per_step = t.grad_accum * world  # micro-batches in one optimizer step, all ranks together
    total_steps = t.steps or math.ceil(epochs * len(data.train_batches) / per_step)
    scheduler = build_schedule(
        optimizer, schedule=t.schedule, warmup_steps=t.warmup_steps, total_steps=total_steps
    )
    start_step, tokens_total, eval_before = 0, 0, None
    checkpoint = find_resume_checkpoint(cfg.resume, out)
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model=model, optimizer=optimizer, scheduler=scheduler)
        start_step = state["step"]
        tokens_total = state["extra"].get("tokens", 0)
        eval_before = state["extra"].get("eval_loss_before")
        dist.print_main(f"slipstream: resuming from {checkpoint} (step {start_step})")

    log = MetricsLog(out, total_steps=total_steps, start_step=start_step, enabled=dist.is_main())
    if start_step == 0 and data.eval:
        eval_before = evaluate(model, data.eval, data.eval_batches, device)
        log.log({"step": 0, "eval_loss": eval_before, "eval_ppl": perplexity(eval_before)})

    # The data stream is a pure function of (seed, micro-batch index): resume needs no state.
    stream = micro_batch_stream(len(data.train_batches), t.seed, start=start_step * per_step)
    flop_rate = peak_flops(device)
    step_flops = StepFlops(model, lora=not full) if flop_rate else None
    clip = t.clip if t.clip is not None else math.inf
    loss_sum = torch.zeros((), device=device)
    aux_sum = torch.zeros((), device=device)  # MoE router aux loss, label-weighted
    log_aux = router_aux_loss_coef(model) > 0
    interval_labels = interval_tokens = interval_flops = 0
    last_time, run_start = time.perf_counter(), time.perf_counter()
    status, step, last_loss, stopping = "completed", start_step, None, False
    model.train()
    with StopSignal() as stop:
        for step in range(start_step + 1, total_steps + 1):
            mine = [next(stream) for _ in range(per_step)][rank::world]
            window = [collate_batch(data.train, data.train_batches[i], device) for i in mine]
            num_labels = dist.step_label_count(sum(b.num_labels for b in window), device)
            loss_sum += accumulate_gradients(model, window, aux_sum, num_labels=num_labels)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            interval_labels += sum(b.num_labels for b in window)
            interval_tokens += sum(b.input_ids.numel() for b in window)
            if step_flops:  # from the host lengths: no device work
                interval_flops += sum(step_flops(b.seq.lengths) for b in window)

            # Under torchrun ranks agree on a stop at logged steps (a signal may reach them
            # in different steps); one process stops in the step the signal came in.
            if step % t.log_every == 0 or step == total_steps or stop.requested and world == 1:
                # The one host sync of a logged step: sums over ranks (one collective under
                # torchrun) and the grad norm in one transfer.
                sums = dist.sum_over_ranks(
                    [loss_sum, aux_sum, interval_labels, interval_tokens, interval_flops,
                     stop.requested], device,
                )  # fmt: skip
                norm_1 = dist.full_tensor(grad_norm).double().view(1)
                loss_total, aux_total, labels, tokens, flops, stops, norm = torch.cat(
                    [sums, norm_1]
                ).tolist()
                last_loss = loss_total / max(labels, 1)
                aux = [aux_total / max(labels, 1)] if log_aux else []
                interval_tokens, stopping = int(tokens), stops > 0
                now = time.perf_counter()
                elapsed = max(now - last_time, 1e-9)
                tokens_per_s = interval_tokens / elapsed
                tokens_total += interval_tokens
                # Every rank's useful FLOPs over every rank's peak (train/flops.py).
                mfu = flops / elapsed / (flop_rate * world) if flop_rate else None
                log.log(
                    {
                        "step": step,
                        "loss": last_loss,
                        "lr": scheduler.get_last_lr()[0],
                        "grad_norm": norm,
                        "tokens": tokens_total,
                        "tokens_per_s": tokens_per_s,
                        "peak_mem_gb": peak_memory_gb(device),
                        "mfu": mfu,
                        **({"aux_loss": aux[0]} if aux else {}),
                    }
                )
                loss_sum.zero_()
                aux_sum.zero_()
                interval_labels = interval_tokens = interval_flops = 0
                last_time = now
            log.bar.update(1)

            if t.eval_every and step % t.eval_every == 0 and step < total_steps and data.eval:
                loss = evaluate(model, data.eval, data.eval_batches, device)
                log.log({"step": step, "eval_loss": loss, "eval_ppl": perplexity(loss)})
                last_time = time.perf_counter()  # keep eval time out of tokens/s
            saving = t.save_every and step % t.save_every == 0 and step < total_steps
            if saving or stopping:
                extra = {
                    "config": cfg.model_dump(mode="json"),
                    "tokens": tokens_total + interval_tokens,
                    "eval_loss_before": eval_before,
                }
                save_checkpoint(
                    out, step=step, model=model, optimizer=optimizer, scheduler=scheduler,
                    extra=extra, keep=t.keep_checkpoints,
                )  # fmt: skip
                last_time = time.perf_counter()  # keep save time out of tokens/s
            if stopping:
                status = "interrupted"
                dist.print_main(
                    f"\nslipstream: stopped by signal {stop.received or 'on another rank'} at "
                    f"step {step}; checkpoint saved; rerun with resume=true to continue"
                )
                break

    eval_after = None
    if status == "completed":
        if data.eval:
            eval_after = evaluate(model, data.eval, data.eval_batches, device)
            log.log({"step": step, "eval_loss": eval_after, "eval_ppl": perplexity(eval_after)})
        # FSDP2: every rank helps gather the weights; rank 0 writes them.
        result = dist.unsharded(model, lambda: build_model(cfg, torch.device("cpu")))
        if dist.is_main():
            save_result(result, tokenizer, out, cfg)
    log.close()
    plot = plot_losses(log.path, out / "loss.png") if dist.is_main() else None
    summary = {
        "status": status,
        "steps": step,
        "total_steps": total_steps,
        "method": cfg.lora.method,
        "final_train_loss": last_loss,
        "eval_loss_before": eval_before,
        "eval_loss_after": eval_after,
        "eval_ppl_before": perplexity(eval_before) if eval_before is not None else None,
        "eval_ppl_after": perplexity(eval_after) if eval_after is not None else None,
        "tokens_trained": tokens_total,
        "seconds": time.perf_counter() - run_start,
        "trainable_params": sum(p.numel() for p in params),
        "total_params": sum(p.numel() for p in model.parameters()),
        "peak_mem_gb": peak_memory_gb(device),
        "device": str(device),
        "packing_efficiency": data.packing_efficiency,
        "train_examples": len(data.train),
        "eval_examples": len(data.eval),
        "data_report": report_dict(data.report),
        "loss_plot": str(plot) if plot else None,
        "output_dir": str(out),
    }
    if dist.is_main():
        write_json(out / "summary.json", summary)
    dist.close()
    return summary


def accumulate_gradients(
    model: torch.nn.Module,
    window: list[Any],
    aux_sum: torch.Tensor | None = None,
    num_labels: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Backward over one accumulation window; returns the summed loss (a device tensor).

    Each micro-batch's summed loss is divided by the window's labelled-token count, so the
    gradient equals that of one batch holding the whole window. A MoE router's aux loss is
    added as coef * aux * (the micro-batch's labelled tokens): after that one division each
    micro-batch contributes transformers' `loss + coef * aux`. Its label-weighted sum is
    added into `aux_sum` when given. No host sync here.
    """
    if num_labels is None:  # under torchrun: the whole step's count over all ranks
        num_labels = max(sum(b.num_labels for b in window), 1)  # host ints from the collator
    coef = router_aux_loss_coef(model)  # a Python float
    world = dist.world_size()  # DDP and FSDP average gradients over ranks; we want the sum
    total = None
    for i, batch in enumerate(window):
        with dist.gradient_sync(model, enabled=i == len(window) - 1):
            loss = batch_loss(model, batch)
            aux = moe_aux_loss(model)  # None unless a MoE block recorded router stats
            objective = loss if aux is None else loss + (coef * batch.num_labels) * aux
            (objective * world / num_labels).backward()
        total = loss.detach() if total is None else total + loss.detach()
        if aux is not None and aux_sum is not None:
            aux_sum += aux.detach() * batch.num_labels
    return total


@torch.no_grad()
def evaluate(model: torch.nn.Module, examples: list[Any], batches: list[list[int]], device):
    """Mean loss per labelled token over the eval set (one host sync, at the end).

    Under torchrun each rank evaluates its share (`eval_share`) and one all-reduce sums the
    losses and label counts: the same number as one process, in 1/world of the time.
    """
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for i, counted in eval_share(len(batches), dist.rank(), dist.world_size()):
        batch = collate_batch(examples, batches[i], device)
        loss = batch_loss(model, batch).float()
        if counted:
            total += loss
            count += batch.num_labels
    model.train(was_training)
    total_all, count_all = dist.sum_over_ranks([total, count], device).tolist()
    return total_all / max(count_all, 1)


def eval_share(num_batches: int, rank: int, world: int) -> list[tuple[int, bool]]:
    """(batch index, counted) pairs rank `rank` evaluates: every world-th batch, then padding
    entries (batch 0, not counted) so every rank runs the same number of forwards, as FSDP
    needs (each forward gathers the weights from all ranks)."""
    mine = [(i, True) for i in range(rank, num_batches, world)]
    rounds = -(-num_batches // world)
    return mine + [(0, False)] * (rounds - len(mine))


def batch_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Summed loss of one batch; the LM head runs on its labelled positions only (exact: the
    same loss and gradients). Hand-built batches without positions take the full path."""
    positions = getattr(batch, "label_positions", None)
    return model.loss(
        batch.input_ids, batch.labels, batch.seq, reduction="sum", label_positions=positions
    )


def micro_batch_stream(num_batches: int, seed: int, start: int = 0) -> Iterator[int]:
    """Batch indices forever, epoch after epoch in seeded orders, skipping the first `start`."""
    from slipstream.data import epoch_order

    epoch, pos = divmod(start, num_batches)
    while True:
        yield from epoch_order(num_batches, seed=seed, epoch=epoch)[pos:]
        epoch, pos = epoch + 1, 0


def collate_batch(examples: list[Any], indices: list[int], device: torch.device) -> Any:
    from slipstream.data import collate

    return collate([examples[i] for i in indices]).to(device)
