"""Training checkpoints under torchrun (train/state.py writes the rest): FSDP2 shards of the
trainable parameters and the optimizer state, written and read with
`torch.distributed.checkpoint`, each rank its own, beside `state.pt`; and the world-size
check a resume needs.

torch.distributed.checkpoint reads two kinds of pickle: `.metadata` (plain `pickle.load`)
and the non-tensor entries in the `.distcp` files (the optimizer's param_groups: lr, betas,
parameter names; `torch.load(weights_only=False)`). Either could run code planted in a
checkpoint someone shipped, so resume reads `.metadata` through an unpickler that builds only
checkpoint-metadata classes, torch sizes and dtypes, and each entry with `weights_only=True`
first (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import re
import sys
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
    """Restore what save_shards wrote; a planted pickle raises UnsafePickle (never runs)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = _sharded_state(model, optimizer)
    read_shards(path, state)
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


class UnsafePickle(pickle.UnpicklingError):
    """A checkpoint file holding a pickled object beyond plain checkpoint data: args are
    (file, what it calls)."""


def read_shards(path: Path, state: dict[str, Any]) -> None:
    """`dcp.load(state)` from `path` without running anything a pickle in it asks for."""
    import torch.distributed.checkpoint as dcp

    reader = _reader_class()(str(path))
    reader.read_metadata()  # here, not inside dcp.load, which retries and wraps failures
    try:
        dcp.load(state, storage_reader=reader, planner=_planner_class()(Path(path)))
    except dcp.CheckpointException as e:  # a rank's failure, gathered on every rank
        for failure in e.failures.values():
            if isinstance(failure[0], UnsafePickle):
                raise failure[0] from None
        raise


# The classes a `.metadata` pickle may build beyond dataclasses and enums of
# torch.distributed.checkpoint (Metadata, TensorStorageMetadata, BytesStorageMetadata,
# ChunkStorageMetadata, TensorProperties and its memory-format enum, MetadataIndex,
# StorageMeta, filesystem._StorageInfo; whatever torch adds there next): torch.Size, the
# layout lookup, paths (StorageMeta.checkpoint_id) and containers. dtypes, layouts and
# memory formats are torch attributes of those types. Nothing that calls, imports or opens.
_ALLOWED = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"),
    ("builtins", "slice"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),
}  # fmt: skip
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
DCP = "torch.distributed.checkpoint."


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only checkpoint-metadata names (see _ALLOWED)."""

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed(module, name)
        if found is None:
            raise UnsafePickle(f"{module}.{name}")
        return found

    @staticmethod
    def _allowed(module: str, name: str) -> Any:
        if "." in name or name.startswith("__"):
            return None  # no attribute paths (`Metadata.__init__.__globals__`)
        if (module, name) in _ALLOWED:
            return getattr(sys.modules.get(module), name, None)
        if module == "torch":
            value = getattr(torch, name, None)
            return value if isinstance(value, _TORCH_VALUES) else None
        # Only modules torch has imported already: resolving a name imports nothing.
        source = sys.modules.get(module) if module.startswith(DCP) else None
        value = getattr(source, name, None)
        if isinstance(value, type) and (
            dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)
        ):
            return value
        return None


def read_metadata_file(file: Path) -> Any:
    """A `.metadata` pickle through MetadataUnpickler; UnsafePickle names `file`."""
    with open(file, "rb") as f:
        try:
            return MetadataUnpickler(f).load()
        except UnsafePickle as e:
            raise UnsafePickle(str(file), f"it calls {e.args[0]}") from None


def what_it_calls(e: Exception) -> str:
    """The global a refused `torch.load(weights_only=True)` names, for a one-line error."""
    found = re.search(r"GLOBAL (\S+)", str(e))
    return f"it calls {found.group(1)}" if found else str(e).splitlines()[0][:200]


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """FileSystemReader whose metadata comes from read_metadata_file, read once."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, "_safe_metadata", None) is None:
                metadata = read_metadata_file(Path(self.path) / ".metadata")
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                self._safe_metadata = metadata
            return self._safe_metadata

    return SafeReader


def _planner_class() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner that loads a non-tensor entry only if weights_only=True can."""

        def __init__(self, path: Path) -> None:
            super().__init__()
            self.path = path

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                info = self.metadata.storage_data.get(read_item.storage_index)
                file = self.path / getattr(info, "relative_path", "")
                raise UnsafePickle(
                    str(file), f"entry {read_item.dest_index.fqn}: {what_it_calls(e)}"
                ) from None
            # It holds only what weights_only allows, so torch's own load of it (with
            # weights_only=False) builds the same plain data; this keeps torch's placement
            # of the value (flattened or not) ours without copying it.
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafePlanner


def check_world_size(saved: int, path: Any) -> None:
    """Resume needs the world size the checkpoint was written with: the data stream's split
    over ranks and (FSDP2) the shards depend on it."""
    world = dist.world_size()
    if saved != world:
        raise ValueError(
            f"resume: checkpoint {path} was written by {saved} process(es) but this run has "
            f"{world}; resume with --nproc_per_node/--nnodes giving {saved} processes"
        )
