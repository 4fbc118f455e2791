"""Measure a real training step's memory: what the planner's estimates are checked against
(tests/test_memory_plan.py, benchmarks/bench_memory.py, the GPU suite's `plan` row).

`measure_step(model, optimizer, lengths)` runs two steps (forward, backward, optimizer step,
zero_grad) over one packed batch of random tokens, every position labelled; the first makes
the optimizer's states, the second is measured: the most bytes of live tensors (the model's
parameters and buffers, the optimizer's states, the batch, everything the step allocates)
on the model's device at any op, by `LiveTensors`, and on CUDA `max_memory_allocated`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.memory.tracker import LiveTensors


@dataclass
class MeasuredStep:
    live_peak: int  # bytes: the live-tensor tracker's peak, parameters and states included
    cuda_peak: int | None  # torch.cuda.max_memory_allocated over the step (CUDA only)


def measure_step(
    model, optimizer, lengths: list[int], track: bool = True, batch=None
) -> MeasuredStep:
    """`batch` (memory/probe_images.py ImageBatch, on the model's device): a micro-batch with
    images in place of random tokens of `lengths`."""
    from slipstream.ops.packing import SeqInfo

    device = next(model.parameters()).device
    images, inputs = {}, []
    if batch is None:
        vocab, T = model.config.vocab_size, sum(lengths)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (T,), generator=gen).to(device)
        seq = SeqInfo.from_lengths(list(lengths), device=device)
    else:
        ids, seq, images = batch.ids, batch.seq, {"images": batch.images}
        inputs = batch.tensors()
    positions = torch.arange(ids.shape[0], device=device)

    def step() -> None:
        loss = model.loss(ids, ids, seq, reduction="sum", label_positions=positions, **images)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    held = list(model.parameters()) + list(model.buffers()) + [ids, positions] + inputs
    held += [seq.position_ids] + [
        t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    if track:
        with LiveTensors(device, include=held) as live:
            step()
        live_peak = live.peak
    else:
        step()
        live_peak = 0
    cuda_peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return MeasuredStep(live_peak, cuda_peak)
