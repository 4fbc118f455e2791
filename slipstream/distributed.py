"""Data-parallel training under torchrun: the process group, DDP or FSDP2, and the few
collectives the trainer needs. Without torchrun (no WORLD_SIZE, or 1) every function here is
a no-op or the identity, so the single-process trainer runs exactly as before.

Modes (`train.parallel`, see `resolve_mode`) and why the step's gradient equals one
process's with the same global batch: docs/distributed.md. Collectives per optimizer step:
one (the step's weight) plus the gradient reduction; a logged step adds one. Elsewhere:
tokenizing in shards (data/row_shards.py); checkpoint shards under FSDP2 (train/fsdp_shards.py).

Teardown, in this order: DDP's reducers let go of the group, garbage is collected, the group
is destroyed, the last references to it are dropped here. `close` does it when a run ends in
`finish_run` (completed, or stopped by a signal), every rank together; on any other end the
trainer releases the wrappers at once and `teardown` destroys the group at interpreter exit.
A reducer is the one holder of the group whose Python destructor keeps the GIL. Left for last
(a finished run's wrapper freed after `destroy_process_group`, as before issue 25), it runs
~ProcessGroupGloo, which joins gloo's worker threads while holding the GIL; a worker still
freeing a finished collective's tensors waits for the GIL, and the rank hangs for ever.
Dropped from Python, the group's own holder releases the GIL before that join.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import inspect
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MODES = ("auto", "none", "ddp", "fsdp")

_OBJECT_GROUP: Any = None  # a gloo group for Python objects (NCCL would stage them on the GPU)
_WRAPPERS: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # DDP wrappers: released by teardown


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def is_main() -> bool:
    return rank() == 0


def print_main(*args: Any) -> None:
    """Print to stderr on rank 0 only (one copy of each message, not one per rank)."""
    if is_main():
        print(*args, file=sys.stderr, flush=True)


def init(device: torch.device, *, timeout_s: float) -> torch.device:
    """Join the process group torchrun describes in the environment; this rank's device.

    NCCL on CUDA (device cuda:LOCAL_RANK), gloo on CPU. `timeout_s` bounds how long a rank
    waits in a collective for a peer that died or diverged, so a failure never hangs forever.
    """
    global _OBJECT_GROUP
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # device_id binds NCCL's communicators to this rank's GPU up front (barriers and
        # collectives then need no guess of the current device).
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        # A rank leaving on an error (exit status 2) must still tear its group down: a live
        # group at interpreter exit aborts the process (SIGABRT) and hides the exit status.
        atexit.register(teardown)
    _OBJECT_GROUP = dist.new_group(backend="gloo") if device.type == "cuda" else None
    return device


def close() -> None:
    """Leave the process group at the end of a run that reached `finish_run` (every rank):
    wait for every rank and for all work already queued (gloo's barrier waits for it; CUDA:
    the device too), then `teardown`."""
    if dist.is_initialized():
        dist.barrier()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    teardown()


def teardown() -> None:
    """Release what holds the process group, then destroy it (the order: module docstring).
    No collective: at interpreter exit (registered by `init`) it ends a run that failed, its
    peers perhaps gone. Nothing to do without a group."""
    global _OBJECT_GROUP
    release_wrappers()
    if dist.is_initialized():
        # Held here so that the group's last reference is dropped below, from Python (its
        # holder releases the GIL), whatever else the collection below frees.
        groups = [dist.group.WORLD, _OBJECT_GROUP]
        dist.destroy_process_group()
        gc.collect()
        del groups
    _OBJECT_GROUP = None


def release_wrappers() -> None:
    """Make every DDP wrapper of this process let go of the group (`release_wrapper`; also
    one a traceback still holds), then collect garbage: cycles holding a reducer or pending
    work are freed while the group still lives."""
    for ddp in list(_WRAPPERS):
        release_wrapper(ddp)
    _WRAPPERS.clear()
    gc.collect()


def release_wrapper(ddp: nn.Module) -> None:
    """Make a DDP wrapper let go of the group: its reducer (and the logger that holds the
    reducer) is freed now, and its reference to the group dropped. It keeps its module."""
    for name in ("logger", "reducer", "process_group"):
        ddp.__dict__.pop(name, None)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (a list of one without torchrun)."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, value, group=_OBJECT_GROUP)
    return out


def resolve_mode(mode: str, *, method: str, quantization: str, optimizer: str = "adamw") -> str:
    """The parallel mode for this run: "none", "ddp" or "fsdp" (see the module docstring)."""
    world = world_size()
    if mode not in MODES:
        raise ValueError(f"train.parallel = {mode!r}; use one of {', '.join(MODES)}")
    if mode == "auto":
        mode = "none" if world == 1 else ("fsdp" if method == "full" else "ddp")
    if mode == "none" and world > 1:
        raise ValueError(
            f"train.parallel=none but torchrun started {world} processes; "
            "use ddp or fsdp (or auto), or run one process"
        )
    if mode == "fsdp" and quantization != "none":
        raise ValueError("train.parallel=fsdp cannot shard NF4 weights; use ddp for QLoRA")
    if mode == "fsdp" and optimizer == "adamw_8bit":
        raise ValueError(
            "train.optimizer=adamw_8bit cannot step FSDP2's sharded parameters; "
            "use train.optimizer=adamw with fsdp, or train.parallel=ddp"
        )
    return mode if world > 1 else "none"


def shards_parameters(parallel: dict[str, str] | None) -> bool:
    """True when a run's `parallel` options (`requested`, `method`, `quantization`,
    `optimizer`; None: a run without a config) resolve to FSDP2 under torchrun."""
    if not parallel or world_size() == 1:
        return False
    return resolve_mode(parallel["requested"], **{k: v for k, v in parallel.items()
                                                  if k != "requested"}) == "fsdp"  # fmt: skip


def parallel_options(cfg: Any) -> dict[str, str]:
    """What `shards_parameters` reads of a RunConfig."""
    t = cfg.train
    return dict(requested=t.parallel, method=t.finetune, quantization=cfg.model.quantization,
                optimizer=t.optimizer)  # fmt: skip


class _CallWith(nn.Module):
    """DDP reduces the gradients of what runs through its `forward`: this module's forward
    runs `fn(model, *args)` (an objective's loss), so any loss the trainer computes goes
    through DDP while the model keeps its own methods."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.model, *args)


def wrap_model(model: nn.Module, mode: str, device: torch.device) -> nn.Module | None:
    """Make `model` data-parallel; returns the DDP wrapper (mode "ddp") or None.

    DDP: the trainer runs each micro-batch's loss through the wrapper (`run_through`);
    `model` itself is unchanged (names, methods). FSDP2: the parameters of `model` become
    sharded DTensors in place (names unchanged).
    """
    if mode == "none":
        return None
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # Buffers (RoPE tables) never change: broadcasting them each forward is a collective
        # per micro-batch for nothing. Every rank loaded the same weights with the same seed,
        # so the start-up broadcast of the whole model (frozen base too) is skipped as well.
        # torch 2.13 renamed the forward switch (`broadcast_buffers` warns there).
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        switch = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
        kwargs: dict[str, Any] = {switch: False}
        if "init_sync" in params:
            kwargs["init_sync"] = False
        ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(_CallWith(model), device_ids=ids, **kwargs)
        _WRAPPERS.add(ddp)
        return ddp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    try:
        from torch.distributed.fsdp import register_fsdp_forward_method
    except ImportError:  # torch < 2.5 keeps it in the private module
        from torch.distributed._composable.fsdp import register_fsdp_forward_method
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    # cast_forward_inputs=False: FSDP would otherwise rebuild every dataclass argument at every
    # layer (dataclasses.replace), so each layer would get a fresh SeqInfo with an empty cache
    # and rebuild its masks; the hidden states already arrive in the compute dtype.
    policy = MixedPrecisionPolicy(
        param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    for layer in model.decoder_layers():
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    # The root all-gathers its own weights (embeddings, final norm, head) around `forward`;
    # the objectives call `loss`, which must get the same hooks.
    register_fsdp_forward_method(model, "loss")
    return None


def run_through(ddp: nn.Module | None, fn: Callable[..., Any], model: nn.Module, *args: Any):
    """`fn(model, *args)`, inside DDP's forward when `ddp` is the model's DDP wrapper."""
    return fn(model, *args) if ddp is None else ddp(fn, *args)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[None]:
    """Within: every FSDP2 module of `model` holds its full parameters, so generation runs any
    number of forwards with no collective. Not sharded: nothing.

    Ranks decode different numbers of tokens (rows stop at different times), and a layer's
    forward hook all-gathers its weights: one forward more on one rank would deadlock. Here
    each FSDP module all-gathers once on entry (every rank, the same order) and keeps its
    weights through the forwards within (the hooks then find them gathered: no collective);
    on exit they are freed again (TRL/DeepSpeed's "gather for generation"). Costs one full
    copy of the weights per rank for the duration.
    """
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    # Generation calls `hidden_states`, not the root's forward: the root's lazy init (which
    # module is the root) must run first, or the first layer's hook would claim the root.
    model._get_fsdp_state()._lazy_init()
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.unshard()
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        # wrap_model's policy again: the layers reshard after forward, the root keeps its
        # weights until the backward (FSDP2's default for the root).
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(False, recurse=False)
        for m in modules:
            m.reshard()


@contextmanager
def gradient_sync(model: nn.Module, ddp: nn.Module | None, enabled: bool) -> Iterator[None]:
    """Reduce gradients over ranks in this backward only if `enabled` (the window's last
    micro-batch): accumulation stays local, one reduction per optimizer step."""
    if ddp is not None:
        with nullcontext() if enabled else ddp.no_sync():
            yield
    elif is_sharded(model):
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def step_weight(weight: int, device: torch.device) -> int | torch.Tensor:
    """The objective's weight (labelled tokens for SFT) of the whole optimizer step over all
    ranks, at least 1.

    One process: the host int. Under torchrun: a device tensor, all-reduced without a host
    sync (`torch.full` writes it on the device; `torch.tensor` would copy and synchronize).
    """
    if world_size() == 1:
        return max(weight, 1)
    count = torch.full((), weight, dtype=torch.int64, device=device)
    dist.all_reduce(count)
    return count.clamp_(min=1)


def sum_over_ranks(values: list[Any], device: torch.device) -> torch.Tensor:
    """The elementwise sum over ranks of a few numbers (tensors or host numbers), in float64.

    Host numbers reach the device in one non-blocking copy from pinned memory (one pageable
    copy each would be a stream sync apiece); device tensors stay where they are.
    """
    is_tensor = [isinstance(v, torch.Tensor) for v in values]
    host = torch.tensor([float(v) for v, t in zip(values, is_tensor) if not t], dtype=torch.float64)
    if device.type == "cuda":
        host = host.pin_memory()
    from_host = iter(host.to(device, non_blocking=True))
    flat = torch.stack(
        [v.to(device, torch.float64) if t else next(from_host) for v, t in zip(values, is_tensor)]
    )
    if world_size() > 1:
        dist.all_reduce(flat)
    return flat


def extremes_over_ranks(values: list[torch.Tensor], kinds: list[str]) -> torch.Tensor:
    """The elementwise min ("min") or max ("max") over ranks of a few device tensors, in
    float64: one all-reduce (MIN, each max negated)."""
    signed = [-v if k == "max" else v for v, k in zip(values, kinds, strict=True)]
    flat = torch.stack([v.to(torch.float64) for v in signed])  # on the device: no host copy
    if world_size() > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MIN)
    return torch.stack([-x if k == "max" else x for x, k in zip(flat, kinds, strict=True)])


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2's grad norm, sharded parameters); plain tensors as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def unsharded(model: nn.Module, rebuild: Callable[[], nn.Module]) -> nn.Module | None:
    """A plain model with the trained weights, for adapter or merged export.

    Not sharded: `model` itself. FSDP2: every rank joins in gathering each trainable
    parameter (one all-gather each); rank 0 loads them into `rebuild()` (the base model built
    on the CPU) and returns it; other ranks return None.
    """
    if not is_sharded(model):
        return model
    trained = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            value = full_tensor(p.detach())
            if is_main():
                trained[name] = value.cpu()
    if not is_main():
        return None
    plain = rebuild()
    params = dict(plain.named_parameters())
    with torch.no_grad():
        for name, value in trained.items():
            params[name].copy_(value)
    return plain
