"""Measure a training step's activation memory without memory: the run's own model, built on
the `meta` device, runs one forward and backward under the live-tensor tracker.

Meta tensors have shapes and no data, so the step costs its Python time only (~0.1 s a layer)
whatever T is, and every tensor our code allocates, saves for backward and frees is counted
as it would be on a real device: the same modules, LoRA, checkpointing wrapper, tiled MLP,
chunked loss. Two kernels have no faithful meta version and are stood in for by what they
allocate (measured against the real ones in tests/test_memory_plan.py):
- attention: meta SDPA is the math path, (T, T) scores per head; the flash kernels (CPU
  `_scaled_dot_product_flash_attention_for_cpu`, CUDA varlen) keep the output and a float32
  log-sum-exp per query and head, and backward allocates the three input gradients;
- activation offload: meta tensors cannot go to the host, so offload is probed as recompute
  and the planner moves the checkpoints (plan.py).

Shapes: T tokens, D hidden, H query heads, Dh head dim.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from slipstream.memory.host_heap import MMAP_THRESHOLD
from slipstream.memory.tracker import LiveTensors


@dataclass
class ProbeSetup:
    """What of a run shapes its step's memory."""

    hf: dict[str, Any]  # config.json
    dtype: torch.dtype
    method: str = "lora"  # lora | full
    rank: int = 16
    alpha: float = 32
    targets: Any = None
    use_dora: bool = False
    checkpointing: str = "recompute"  # none | recompute (offload is probed as recompute)
    tiles: int | None = None
    half_attention_in_float32: bool = False  # CPU without AMX: bf16 SDPA upcast (attention.py)
    device: str = "cpu"  # the device planned for: which kernels the step would take
    implementation: str = "auto"  # model.implementation: native family or transformers' code
    vision_tower: str = "frozen"  # image-text models: vision.tower frozen | lora | full
    vision_projector: str = "frozen"  # and vision.projector


@dataclass
class ProbeResult:
    params: int  # bytes of every parameter and buffer at the model's dtype
    trainable: int  # elements that require grad
    trainable_bytes: int
    frozen_linear: int  # bytes of the frozen nn.Linear weights in the decoder layers
    layers: int
    hidden: int
    step_peak: int  # most bytes alive during forward + backward beyond the parameters
    after_forward: int  # bytes alive when forward returned (saved activations, checkpoints)
    heap_held: int = 0  # freed blocks under glibc's mmap threshold held at the peak (CPU)
    # The language model's shape, as its family reads config.json (an image-text model's
    # from its text_config): the loss chunk, attention output and NF4 workspace are sized by it.
    vocab: int = 0
    heads: int = 0
    head_dim: int = 0
    intermediate: int = 0
    inputs: int = 0  # bytes of the batch's image inputs (pixels, the tower's metadata)


class _FlashStandIn(torch.autograd.Function):
    """What a flash attention kernel allocates: out + float32 lse, then the input grads."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _, lse = ctx.saved_tensors
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # CPU flash backward peaks one query-sized buffer less the lse above its three
        # gradients (measured, float32 and bf16, GQA or not: test_memory_plan.py).
        extra = q.numel() * q.element_size() - lse.numel() * lse.element_size()
        torch.empty(max(extra, 0), dtype=torch.uint8, device=q.device)
        return grads


def _sdpa_stand_in(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
    return _FlashStandIn.apply(q, k, v)


def _per_sequence_stand_in(real):
    """ops/attention.py's `_sdpa_per_sequence` as one stand-in call where it has no window:
    the sequences' outputs and lse add up to the whole batch's, and `torch.cat` of the outputs
    is one more (T, H, Dh) copy; one Python call, not one a sequence (a Qwen2.5-VL-7B tower's
    30,900 windows in a 16k-token image batch took 7.3 s of its probe's 9.5 s: `slipstream
    plan` ran 10 minutes). A sliding window builds its (n, n) masks: the real call."""

    def attend(q_THD, k_TGD, v_TGD, seq, window, scale, causal=True):
        if window is not None:
            return real(q_THD, k_TGD, v_TGD, seq, window, scale, causal)
        heads_first = (x.transpose(0, 1)[None] for x in (q_THD, k_TGD, v_TGD))
        return _FlashStandIn.apply(*heads_first)[0].clone().transpose(0, 1)

    return attend


class _GroupedStandIn(torch.autograd.Function):
    """`torch._grouped_mm` for float32 on meta (its meta kernel takes bf16 only): the output,
    then the input gradients, as the CPU kernel allocates them."""

    @staticmethod
    def forward(ctx, x_RD, w_EDF):
        ctx.save_for_backward(x_RD, w_EDF)
        return x_RD.new_empty((x_RD.shape[0], w_EDF.shape[2]))

    @staticmethod
    def backward(ctx, grad_RF):
        x_RD, w_EDF = ctx.saved_tensors
        return torch.empty_like(x_RD), torch.empty_like(w_EDF)


def _grouped_mm_stand_in(real):
    def grouped_mm(x_RD, w_EDF, offs=None, **kw):
        if x_RD.dtype == torch.bfloat16:
            return real(x_RD, w_EDF, offs=offs, **kw)
        return _GroupedStandIn.apply(x_RD, w_EDF)

    return grouped_mm


def _grouped_mm_on(device: str):
    """`ops.moe._grouped_mm_supported` as the target device would answer (meta tensors have
    no data pointer to check the alignment of; the strides still are)."""
    from slipstream.ops import moe

    def supported(x_RD: torch.Tensor, w_EDF: torch.Tensor) -> bool:
        if not moe._HAS_GROUPED_MM or x_RD.dtype != w_EDF.dtype:
            return False
        if device == "cpu":
            ok = moe._GROUPED_MM_CPU and x_RD.dtype in moe._GROUPED_DTYPES_CPU
        else:  # CUTLASS bf16 kernels on sm90/sm100, the GPUs long runs plan for
            ok = x_RD.dtype == torch.bfloat16
        size = x_RD.element_size()
        aligned = (x_RD.shape[1] * size) % 16 == 0 and (w_EDF.shape[2] * size) % 16 == 0
        dense_w = w_EDF.is_contiguous() or w_EDF.transpose(1, 2).is_contiguous()
        return ok and aligned and x_RD.is_contiguous() and dense_w

    return supported


@contextlib.contextmanager
def _meta_kernels(half_in_float32: bool, device: str):
    from slipstream.ops import attention, moe

    real = F.scaled_dot_product_attention, attention.CPU_HALF_IN_FLOAT32, moe._grouped_mm_supported
    per_sequence = attention._sdpa_per_sequence
    F.scaled_dot_product_attention = _sdpa_stand_in
    attention._sdpa_per_sequence = _per_sequence_stand_in(per_sequence)
    attention.CPU_HALF_IN_FLOAT32 = half_in_float32
    moe._grouped_mm_supported = _grouped_mm_on(device)
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is not None:
        torch._grouped_mm = _grouped_mm_stand_in(grouped)
    try:
        yield
    finally:
        F.scaled_dot_product_attention, attention.CPU_HALF_IN_FLOAT32 = real[:2]
        attention._sdpa_per_sequence = per_sequence
        moe._grouped_mm_supported = real[2]
        if grouped is not None:
            torch._grouped_mm = grouped


def meta_model(setup: ProbeSetup):
    """The run's model on the meta device: the vision settings, LoRA (or all trainable),
    tiling, checkpointing: train/setup.py's `build_model` order."""
    from slipstream.memory.offload import apply_checkpointing
    from slipstream.memory.tiled_mlp import apply_mlp_tiling
    from slipstream.models import family_for
    from slipstream.peft.vision import vision_training

    hf = setup.hf  # with its vision_config: Gemma 3 / 4, Qwen3.5 under transformers too
    family = family_for(hf.get("model_type"), "config.json", setup.implementation, hf)
    cfg = family.config_from_hf(dict(setup.hf))
    with torch.device("meta"):
        model = family.build(cfg).to(setup.dtype)
    vision = SimpleNamespace(tower=setup.vision_tower, projector=setup.vision_projector)
    vision_training(model, vision, setup.method, before_lora=True)
    if setup.method == "lora":
        from slipstream.peft.lora import apply_lora

        apply_lora(
            model, rank=setup.rank, alpha=setup.alpha, targets=setup.targets,
            use_dora=setup.use_dora,
        )  # fmt: skip
    else:
        model.requires_grad_(True)
    vision_training(model, vision, setup.method, before_lora=False)
    apply_mlp_tiling(model, setup.tiles)
    if setup.checkpointing != "none":
        apply_checkpointing(model, "recompute")
    return model


def frozen_linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the frozen nn.Linear weights inside the decoder layers (what NF4 and the CPU
    prepack act on)."""
    total = 0
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}" and not w.requires_grad:
            total += w.numel() * w.element_size()
    return total


def probe_step(setup: ProbeSetup, lengths: list[int], model=None, batch=None) -> ProbeResult:
    """One forward + backward of `model` (default `meta_model(setup)`) over a packed batch of
    `lengths`, or over `batch` (memory/probe_images.py: a micro-batch with images), every
    position labelled; the tracker's bytes, parameters excluded (the batch's inputs held)."""
    from slipstream.ops.packing import SeqInfo

    model = model if model is not None else meta_model(setup)
    if batch is None:
        seq = SeqInfo.from_lengths(list(lengths), device="meta")
        ids, images, inputs = torch.zeros(sum(lengths), dtype=torch.long, device="meta"), None, []
    else:
        seq, ids, images = batch.seq, batch.ids, {"images": batch.images}
        inputs = batch.tensors()
    positions = torch.zeros(ids.shape[0], dtype=torch.long, device="meta")
    tensors = list(model.parameters()) + list(model.buffers())
    held = tensors + [ids, positions, seq.position_ids] + inputs
    with (
        _meta_kernels(setup.half_attention_in_float32, setup.device),
        LiveTensors("meta", include=held, small_bytes=MMAP_THRESHOLD) as live,
    ):
        loss = model.loss(
            ids, ids, seq, reduction="sum", label_positions=positions, **(images or {})
        )
        after_forward = live.current - live.start
        loss.backward()
        del loss
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ProbeResult(
        params=sum(t.numel() * t.element_size() for t in tensors),
        trainable=sum(p.numel() for p in trainable),
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
        frozen_linear=frozen_linear_bytes(model),
        layers=len(model.decoder_layers()),
        hidden=model.config.hidden_size,
        step_peak=live.peak - live.start,
        after_forward=after_forward,
        heap_held=live.heap_held,
        vocab=model.config.vocab_size,
        heads=model.config.num_attention_heads,
        head_dim=model.config.head_dim,
        intermediate=model.config.intermediate_size,
        inputs=sum(t.numel() * t.element_size() for t in inputs),
    )
