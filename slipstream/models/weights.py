"""Names at the checkpoint boundary: each family's `weights(cfg)` returns a `WeightMap`, the one
object that knows its parameters' names and layout on disk (docs/dev/INTERFACES.md).

The base class is the identity: where our module tree matches transformers' the names are
equal. A map lives for one load (or save) and holds what that load has in flight (parameters
that arrive split into several tensors, MXFP4 halves waiting for their pair), so nothing is
left on the model.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

# ((our prefix, the checkpoint's prefix), ...): where a checkpoint holds our modules.
Layout = tuple[tuple[str, str], ...]


def to_hf_name(name: str, layout: Layout) -> str:
    """The checkpoint's name for our `name` under `layout` (unchanged outside it)."""
    for ours, theirs in layout:
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name


def check_shape(name: str, shape, expected, source: str = "", hint: str = "") -> None:
    """A one-line error when a checkpoint tensor's shape is not the one config.json implies."""
    if tuple(shape) != tuple(expected):
        raise ValueError(
            f"{source}{': ' if source else ''}tensor {name!r} has shape {tuple(shape)}, "
            f"expected {tuple(expected)} from config.json{hint}."
        )


def from_hf_name(name: str, layouts: tuple[Layout, ...]) -> str | None:
    """Our name for a checkpoint name in any of `layouts`; None when it is none of ours."""
    for layout in layouts:
        for ours, theirs in layout:
            if name.startswith(theirs):
                return ours + name[len(theirs) :]
    return None


class WeightMap:
    """The identity map: checkpoint names are our parameter names (module docstring)."""

    # Where a checkpoint holds our modules under other prefixes, transformers' module tree
    # first (peft's adapter keys follow it); () when the names are ours.
    layouts: tuple[Layout, ...] = ()

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.split: set[str] = set()  # parameters filled from several checkpoint tensors

    def is_passthrough(self, name: str) -> bool:
        """A checkpoint tensor we do not hold (a vision tower): skipped at load, copied at save."""
        return False

    def our_name(self, name: str) -> str | None:
        """Our name for a checkpoint tensor; None for one we do not hold (`is_passthrough`)."""
        if not self.layouts:
            return name
        ours = from_hf_name(name, self.layouts)
        if ours is None and self.is_passthrough(name):
            return None
        return ours or name

    def load(self, model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
        """Place a tensor that is no parameter of ours by name; False: the loader copies it."""
        return False

    def hf_state(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in the on-disk layout, before `layouts` renames."""
        for name, p in model.named_parameters():
            yield name, p.detach()

    def split_parts(self, param_name: str) -> list[str]:
        """The checkpoint names a parameter that arrived split is stored under."""
        return [param_name]

    def expected_names(self, model: nn.Module) -> Iterator[str]:
        """The names a complete load fills: each parameter that arrived split, its parts."""
        for name, _ in model.named_parameters():
            if name in self.split:
                yield from self.split_parts(name)
            else:
                yield name

    def split_target(self, model: nn.Module, param_name: str, tensor_name: str) -> nn.Parameter:
        """The stacked parameter a checkpoint part fills (recorded as arriving split), or a
        one-line error."""
        try:
            param = model.get_parameter(param_name)
        except AttributeError:
            raise ValueError(
                f"unexpected tensor {tensor_name!r}: the model has no {param_name!r} "
                "(check num_hidden_layers, mlp_only_layers and decoder_sparse_step in "
                "config.json)."
            ) from None
        self.split.add(param_name)
        return param
