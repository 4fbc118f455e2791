"""Regional torch.compile: each decoder layer's attention block and dense MLP, dynamic shapes.

Regional, not whole-model: one compiled graph per block kind serves every layer (compile
time does not grow with depth), and the checkpoint/offload wrapper around each layer stays
outside the graphs (its RNG and pool bookkeeping would make dynamo recompile per layer until
its limit, then run eager, and would keep the recompute out of compiled code).

What stays out:
- the attention kernel itself (`attend` is compiler-disabled): varlen is already one kernel,
  flex is compiled on its own with its host-built BlockMask, and tracing the `SeqInfo` would
  guard on every batch's lengths;
- MoE blocks: routing sizes depend on the data and the grouped GEMM picks its kernel by
  pointer alignment (a transformers-built MoE block is known by its stacked expert weights);
- token mixers that are not softmax attention (transformers' Gated DeltaNet, Mamba, short
  convolutions on the generic path): they run once per packed sequence, split by the
  batch's host lengths, which a graph would guard on; a layer without `self_attn` compiles
  its MLP alone.
Dynamic shapes because the packed length changes every batch.

Off by default (`train.compile`): whether it wins on a GPU is for the GPU suite to measure.
On CPU (Inductor's C++ backend) it measured no gain on a SmolLM2-shaped LoRA step (2,079 vs
2,099 ms CPU time) and it excludes prepacked frozen weights, which are worth 1.47x there
(docs/benchmarks.md, "CPU training step").
"""

from __future__ import annotations

from torch import nn

from slipstream.models.moe_block import MoEBlock

BACKEND = "inductor"  # tests swap in a cheaper backend; the trainer uses torch's default


def apply_compile(model: nn.Module, backend: str | None = None, dynamic: bool = True) -> int:
    """Compile every decoder layer's `self_attn` and dense `mlp` in place; how many."""
    from slipstream.memory.tiled_mlp import compile_tiles

    count, options = 0, {"backend": backend or BACKEND, "dynamic": dynamic}
    for layer in model.decoder_layers():
        for block in compiled_blocks(layer):
            if not compile_tiles(block, **options):  # a tiled MLP: its tile's forward
                block.compile(**options)
            count += 1
    return count


def compiled_blocks(layer: nn.Module) -> list[nn.Module]:
    """The layer's softmax-attention block and its MLP unless that is a MoE block (ours, or
    transformers': stacked (E, ., .) expert weights)."""
    blocks = [getattr(layer, "self_attn", None)]
    mlp = getattr(layer, "mlp", None)
    if mlp is not None and not isinstance(mlp, MoEBlock):
        blocks.append(None if any(p.ndim == 3 for p in mlp.parameters()) else mlp)
    return [b for b in blocks if b is not None]
