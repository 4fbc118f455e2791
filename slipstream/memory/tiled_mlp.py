"""Tiled MLP: a layer's MLP run over the packed tokens a tile at a time, so that its (T, F)
intermediates (gate, up, activation, product: ~4 T*F values, 3.5x the layer input for
SmolLM2's F = 2.67 D, 7x for Llama-3.1-8B's F = 3.5 D) never exist for the whole batch.

An MLP is per token, so tiles along the token axis give the same rows; with grad each tile is
checkpointed (`torch.utils.checkpoint`, non-reentrant): forward keeps only the tile's input
(a view of the layer's), and backward recomputes one tile at a time (the autograd engine
finishes a tile's nodes before it starts the previous tile's: they are numbered later), so
the backward of the MLP holds one tile's (T/N, F) intermediates. Weight gradients are sums
over tiles: equal to the untiled step's up to float32 summation order. Without grad
(evaluation, the offloaded layer's graph-free forward) the tiles run one after the other.

- `tiled_call(fn, x, tiles, token_dim=0, extras="sum")`: the functional form; `fn(x_tile)`
  returns a tensor or (tensor, *extras). Extras are summed over tiles (our MoE block's router
  statistics: sums over tokens) or, with extras="cat", concatenated along dim 0
  (transformers' MoE blocks that also return per-token router logits, (tokens, E)).
- `apply_mlp_tiling(model, tiles)`: every decoder layer's feed-forward (dense and MoE) tiled
  in place by swapping its class for a subclass, as checkpointing does: parameter names,
  `state_dict()` and LoRA wrappers stay as they were; `tiles` None or < 2 undoes it. On the
  generic path (transformers' layers) the feed-forward is the layer's `mlp`, `feed_forward`
  or `block_sparse_moe` (`feed_forward_of`), over (1, T, D) packed hidden states:
  token_dim=1, per-token extras concatenated. A layer without one (a Mamba mixer layer) stays
  as it is. Tiling assumes the block is per token: true of dense MLPs and of top-k routers;
  a router with a capacity per batch would differ (none of the tested types has one).
- `tile_module(module, tiles, token_dim, extras)`: the same for one module.

Shapes: T tokens, D hidden, F MLP width, N tiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def tiled_call(fn: Callable, x: torch.Tensor, tiles: int, token_dim: int = 0, extras: str = "sum"):
    """`fn(x)` computed over `tiles` near-equal slices of `x` along `token_dim`; a tuple
    output's extras summed (`extras="sum"`) or concatenated along dim 0 (`"cat"`)."""
    n = x.shape[token_dim]
    tiles = min(tiles, n)
    if tiles < 2:
        return fn(x)
    size = -(-n // tiles)  # ceil: N tiles, the last one shorter
    grad = torch.is_grad_enabled()
    outs, more = [], []
    for x_tile in x.split(size, dim=token_dim):  # split: its backward is one cat
        out = checkpoint(fn, x_tile, use_reentrant=False) if grad else fn(x_tile)
        if isinstance(out, torch.Tensor):
            outs.append(out)
            continue
        outs.append(out[0])
        more.append(list(out[1:]))
    y = torch.cat(outs, dim=token_dim)
    if not more:
        return y
    if extras == "cat":
        return (y, *(torch.cat(parts, dim=0) for parts in zip(*more, strict=True)))
    return (y, *(sum(parts[1:], parts[0]) for parts in zip(*more, strict=True)))


_CLASSES: dict[type, type] = {}


def _tiled_forward(self, x: torch.Tensor, *args, **kwargs):
    tile = self.__dict__.get("_slipstream_compiled_tile")  # `compile_tiles`: one tile's graph
    if tile is None:
        tile = functools.partial(self._slipstream_tiled_base.forward, self)
    return tiled_call(
        lambda x_tile: tile(x_tile, *args, **kwargs), x, self._slipstream_tiles,
        self._slipstream_token_dim, self._slipstream_extras,
    )  # fmt: skip


def compile_tiles(module: nn.Module, **compile_kwargs) -> bool:
    """Regional compile of a tiled MLP: its per-tile forward is compiled, the tiling and
    each tile's checkpoint stay eager around it (dynamo cannot trace
    `torch.utils.checkpoint` over LoRA's closures in torch 2.13: "lift_tracked_freevar_to_input
    should not be called on root SubgraphTracer"). False: `module` is not tiled."""
    base = type(module).__dict__.get("_slipstream_tiled_base")
    if base is None:
        return False
    module._slipstream_compiled_tile = torch.compile(
        functools.partial(base.forward, module), **compile_kwargs
    )
    return True


def _tiled_class(cls: type) -> type:
    if cls not in _CLASSES:
        attrs = {"forward": _tiled_forward, "_slipstream_tiled_base": cls}
        _CLASSES[cls] = type(f"Tiled{cls.__name__}", (cls,), attrs)
    return _CLASSES[cls]


def tile_module(
    module: nn.Module, tiles: int | None, token_dim: int = 0, extras: str = "sum"
) -> nn.Module:
    """Run `module` (a per-token MLP) in `tiles` tiles along `token_dim`, in place; tiles
    None or < 2: back to untiled. Returns the module."""
    base = type(module).__dict__.get("_slipstream_tiled_base")
    if base is not None:
        module.__class__ = base
        del module._slipstream_tiles, module._slipstream_token_dim, module._slipstream_extras
        module.__dict__.pop("_slipstream_compiled_tile", None)
    if tiles is None or tiles < 2:
        return module
    module.__class__ = _tiled_class(type(module))
    module._slipstream_tiles, module._slipstream_token_dim = int(tiles), token_dim
    module._slipstream_extras = extras
    return module


FEED_FORWARD_NAMES = ("mlp", "feed_forward", "block_sparse_moe")  # transformers' names


def feed_forward_of(layer: nn.Module) -> nn.Module | None:
    """A transformers decoder layer's per-token feed-forward block (dense or MoE), or None
    (a layer whose only mixer is a Mamba or other sequence block)."""
    for name in FEED_FORWARD_NAMES:
        if isinstance(getattr(layer, name, None), nn.Module):
            return getattr(layer, name)
    return None


def apply_mlp_tiling(model: nn.Module, tiles: int | None) -> int:
    """Tile every decoder layer's `mlp` of a slipstream CausalLM (dense or MoE) into `tiles`
    tiles of the packed tokens; None or < 2: untiled. Returns how many MLPs are tiled."""
    if not hasattr(model, "decoder_layers"):
        raise ValueError(f"{type(model).__name__} has no decoder_layers(); tiling needs a CausalLM")
    generic = getattr(model.config, "implementation", "native") == "transformers"
    count = 0
    for layer in model.decoder_layers():
        block = feed_forward_of(layer) if generic else layer.mlp
        if block is None:
            continue
        tile_module(block, tiles, token_dim=1 if generic else 0, extras="cat" if generic else "sum")
        count += 1
    return count if tiles is not None and tiles >= 2 else 0


def mlp_tiles(model: nn.Module) -> int:
    """The tiles the first tiled feed-forward runs in (1: untiled)."""
    for layer in model.decoder_layers():
        tiles = getattr(feed_forward_of(layer), "_slipstream_tiles", None)
        if tiles is not None:
            return tiles
    return 1
