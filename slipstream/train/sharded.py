"""Training checkpoints under torchrun (train/state.py writes the rest): FSDP2 shards of the
trainable parameters and the optimizer state, written and read with
`torch.distributed.checkpoint`, each rank its own, beside `state.pt`; and the world-size
check a resume needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from slipstream import distributed as dist


def save_shards(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Trainable parameters and optimizer state with torch.distributed.checkpoint (every
    rank writes its own shards into `path`)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(model, optimizer), checkpoint_id=str(path))


def load_shards(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = _sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    weights = {k: v for k, v in get_model_state_dict(model).items() if k in trainable}
    return {"model": weights, "optimizer": get_optimizer_state_dict(model, optimizer)}


def check_world_size(saved: int, path: Any) -> None:
    """Resume needs the world size the checkpoint was written with: the data stream's split
    over ranks and (FSDP2) the shards depend on it."""
    world = dist.world_size()
    if saved != world:
        raise ValueError(
            f"resume: checkpoint {path} was written by {saved} process(es) but this run has "
            f"{world}; resume with --nproc_per_node/--nnodes giving {saved} processes"
        )
