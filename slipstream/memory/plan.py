"""The memory planner: a run's peak memory by component, before a weight loads; the longest
batch that fits; the techniques it needs.

`plan_for_run(cfg, device, budget)` reads config.json (and an image-text model's image
processor). The step's activations are measured, not modelled: `memory.probe` runs the run's
own model on the meta device under the live-tensor tracker (no memory, ~0.1 s a layer); an
image-text model's over the worst-case image micro-batch (memory/probe_images.py), the
language model's shape read by its family from `text_config`. Around that the planner adds
what the probe does not hold: the weights at their storage dtype (NF4: 0.516 bytes a
weight, blocksize 64 with double-quantised absmax), the optimizer states, the moved
checkpoints of activation offload, oneDNN's prepacked copies (CPU, float32), the process
itself (CPU: its current RSS) and, under torchrun, DDP's gradient buckets and NCCL's
buffers (an estimate).

On CUDA the peak is what `torch.cuda.max_memory_allocated` would read; a device fits it when
peak <= (total - 1 GiB for the CUDA context and cuBLAS workspace) * 0.97 (the caching
allocator's rounding and fragmentation). On CPU it is the RSS, against the machine's memory.
Those two margins are estimates until the GPU suite's `plan` row measures them.

Techniques, cheapest first: no checkpointing, recompute, offload (CUDA), then the MLP in
2, 4, ... 64 tiles. `train.memory: auto` takes the first that fits; `check` (the default)
keeps the configured ones (`train.mlp_tiles: auto` still tiles when untiled would not fit).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GiB = 1 << 30
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)  # packed 4 bits, uint8 absmax, fp32 nested
CUDA_RESERVE = 1 * GiB
ALLOCATOR_FRACTION = 0.97
NCCL_BUFFERS = 512 << 20  # per process, an estimate: NCCL's channels' buffers and DDP's state
TILE_CHOICES = (2, 4, 8, 16, 32, 64)


@dataclass
class Plan:
    device: str
    tokens: int  # the micro-batch the plan is for (one sequence)
    mode: str  # checkpointing: none | recompute | offload
    tiles: int  # MLP tiles (1: untiled)
    components: dict[str, int]  # bytes
    budget: int | None
    host: dict[str, int] = field(default_factory=dict)  # host memory beside a GPU
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return sum(self.components.values())

    @property
    def usable(self) -> int | None:
        if self.budget is None:
            return None
        if self.device == "cuda":
            return int((self.budget - CUDA_RESERVE) * ALLOCATOR_FRACTION)
        return self.budget

    @property
    def fits(self) -> bool:
        return self.usable is None or self.peak <= self.usable

    @property
    def techniques(self) -> list[str]:
        out = [] if self.mode == "none" else [self.mode]
        return out + ([f"tiled MLP x{self.tiles}"] if self.tiles > 1 else [])


@dataclass
class PlanInputs:
    """What of a run config the plan reads, with the device's dtype resolved."""

    hf: dict[str, Any]
    device: str  # cpu | cuda
    dtype: Any
    quantization: str
    method: str
    rank: int
    alpha: float
    targets: Any
    use_dora: bool
    optimizer: str
    tokens: int
    mode: str  # configured: auto | none | recompute | offload
    tiles: str | int  # configured: auto | off | N
    prepack: bool
    world: int
    sequence_parallel: int = 1  # ranks a micro-batch's tokens are split over
    implementation: str = "auto"  # model.implementation: auto | native | transformers
    vision_tower: str = "frozen"  # image-text models: vision.tower, vision.projector
    vision_projector: str = "frozen"
    model_path: str | None = None  # model.path: the image processor (image-text models)

    @classmethod
    def from_config(cls, cfg, device: str, hf: dict[str, Any]) -> PlanInputs:
        import torch

        from slipstream.device import choose_dtype

        t, lo = cfg.train, cfg.lora
        dtype = choose_dtype(cfg.model.dtype, torch.device(device))[0]
        return cls(
            hf=hf, device=device, dtype=dtype, quantization=cfg.model.quantization,
            method=t.finetune, rank=lo.rank, alpha=lo.alpha, targets=lo.targets,
            use_dora=lo.use_dora, optimizer=t.optimizer, tokens=t.tokens_per_batch,
            mode=t.activation_checkpointing, tiles=t.mlp_tiles,
            prepack=t.prepack and not t.compile and t.parallel != "fsdp",
            world=int(os.environ.get("WORLD_SIZE", "1")), sequence_parallel=t.sequence_parallel,
            implementation=cfg.model.implementation, vision_tower=cfg.vision.tower,
            vision_projector=cfg.vision.projector, model_path=str(cfg.model.path),
        )  # fmt: skip


def read_hf_config(source: str) -> dict[str, Any] | None:
    """config.json of a model folder (or of a hub id in the local cache); None: not readable
    without a download or a weight file (a GGUF)."""
    from slipstream.checkpoint.model_type import _cached_hub_config
    from slipstream.sources import is_hub_id, resolve_model

    local = Path(resolve_model(source, "model.path"))
    config = local / "config.json"
    if not local.exists() and is_hub_id(str(source)):
        config = _cached_hub_config(str(source))
    if config is None or not config.is_file():
        return None
    return json.loads(config.read_text(encoding="utf-8"))


def _setup(inp: PlanInputs, mode: str, tiles: int):
    from slipstream.memory.probe import ProbeSetup

    return ProbeSetup(
        hf=inp.hf, dtype=inp.dtype, method=inp.method, rank=inp.rank, alpha=inp.alpha,
        targets=inp.targets, use_dora=inp.use_dora,
        checkpointing="none" if mode == "none" else "recompute",
        tiles=tiles if tiles > 1 else None,
        half_attention_in_float32=inp.device == "cpu" and _cpu_upcasts(inp.dtype),
        device=inp.device, implementation=inp.implementation, vision_tower=inp.vision_tower,
        vision_projector=inp.vision_projector,
    )  # fmt: skip


def _probe(inp: PlanInputs, tokens: int, mode: str, tiles: int):
    """(the meta step's result, its image-side note or None), memoised per setting and length
    (a probe of an 8B model takes ~2 s, its meta model as long to build). An image-text
    model's step runs over the worst-case image micro-batch (memory/probe_images.py)."""
    from slipstream.memory.probe import meta_model, probe_step

    setup = _setup(inp, mode, tiles)
    key = json.dumps([repr(v) for v in vars(setup).values()] + [inp.model_path], default=str)
    if key not in _PROBES and len(_PROBES) >= 16:  # a process planning many runs (tests)
        _PROBES.clear()
    cache = _PROBES.setdefault(key, {"model": None})
    if tokens not in cache:
        if cache["model"] is None:
            cache["model"] = meta_model(setup)
        model, result, note = cache["model"], None, None
        if getattr(model, "vision", None):
            result, note = _image_probe(inp, setup, model, tokens)
        cache[tokens] = result or probe_step(setup, [tokens], model=model), note
    return cache[tokens]


def _image_probe(inp: PlanInputs, setup, model, tokens: int):
    """(the meta step over the worst-case image micro-batch, its note); (None, why) when it
    cannot run: the plan still covers the text side, and says what it leaves out."""
    from slipstream.memory.probe import probe_step

    try:
        batch = _image_batch(inp.model_path, tokens)
        if batch is None:
            return None, "image side: no image fits the micro-batch; probed as text"
        tower = inp.vision_tower
        kept = "transient (no autograd state)" if tower == "frozen" else "saved for backward"
        note = f"{batch.note}; vision.tower={tower}: its activations {kept}"
        return probe_step(setup, [tokens], model=model, batch=batch), note
    except Exception as e:  # a processor or tower the meta step cannot run
        first = (str(e).splitlines() or [""])[0]
        return None, (
            "the vision tower's activations are NOT included (its meta step could not run: "
            f"{type(e).__name__}: {first}); the plan covers the text side"
        )


_PROBES: dict[tuple, dict] = {}
_IMAGE_SIDES: dict[str, Any] = {}  # model.path -> (ImageProcessing, tokenizer) or None


def _image_batch(path: str | None, tokens: int):
    """The worst-case image micro-batch of `tokens` (memory/probe_images.py), its processor
    read once per checkpoint; a ValueError where the checkpoint has no image processor."""
    from slipstream.memory.probe_images import image_side, worst_case_batch

    if path is None:
        raise ValueError("no model.path to read the image processor from")
    if path not in _IMAGE_SIDES:
        _IMAGE_SIDES[path] = image_side(path)
    if _IMAGE_SIDES[path] is None:
        raise ValueError(f"{path} has no preprocessor_config.json")
    return worst_case_batch(*_IMAGE_SIDES[path], tokens)


def estimate(inp: PlanInputs, tokens: int, mode: str, tiles: int) -> Plan:
    """The peak of one training step over one sequence of `tokens` with checkpointing `mode`
    and `tiles` MLP tiles. Under sequence parallelism a rank holds 1/N of the tokens (and,
    in attention, all of them for 1/N of the heads: the same bytes)."""
    import torch

    whole, tokens = tokens, -(-tokens // inp.sequence_parallel)
    r, image_note = _probe(inp, tokens, mode, tiles)
    act = torch.empty((), dtype=inp.dtype).element_size()
    checkpoint = tokens * r.hidden * act  # one layer's input
    grads = r.trainable_bytes
    c: dict[str, int] = {}
    frozen = r.frozen_linear if inp.method == "lora" else 0
    weights = r.params - (r.trainable_bytes if inp.method == "lora" else 0)
    if inp.quantization == "nf4":
        weights += int(frozen / act * NF4_BYTES_PER_WEIGHT) - frozen
    c["weights"] = weights
    if inp.method == "lora":
        c["adapters"] = r.trainable_bytes
    c["gradients"] = grads
    c["optimizer states"] = _optimizer_bytes(inp.optimizer, r.trainable, r.trainable_bytes)
    if r.inputs:
        c["image inputs (pixels, tower metadata)"] = r.inputs
    if inp.device == "cpu" and inp.prepack and inp.dtype == torch.float32 and frozen:
        c["prepacked weights (oneDNN)"] = frozen
    activations = r.step_peak - grads
    host = {}
    if mode in ("recompute", "offload"):
        kept = r.layers * checkpoint
        if mode == "offload" and inp.device == "cuda":
            host["offloaded checkpoints (pinned)"] = kept
            c["checkpoints (2 reload buffers)"] = 2 * checkpoint
        else:
            c["checkpoints (layer inputs)"] = kept + (2 * checkpoint if mode == "offload" else 0)
        activations -= kept
    vocab = r.vocab
    chunk = min(tokens, max(1, (1 << 26) // vocab)) * vocab * 4
    c["loss chunk (float32 logits)"] = min(chunk, max(activations, 0))
    activations -= c["loss chunk (float32 logits)"]
    heads, head_dim = r.heads, r.head_dim
    attention = tokens * heads * (head_dim * act + 4)  # the kernel's output + float32 lse
    c["attention workspace"] = min(attention, max(activations, 0))
    activations -= c["attention workspace"]
    what = "activations" if mode == "none" else "activations (one layer's recompute + backward)"
    c[what] = activations
    notes = [image_note] if image_note else []
    # The optimizer step holds no activations but, on CPU, foreach AdamW's temporaries (one
    # copy of the trainable tensors: measured; CUDA's fused AdamW none): with full
    # fine-tuning of short batches that is the step's peak.
    temporaries = r.trainable_bytes if inp.device == "cpu" and inp.optimizer == "adamw" else 0
    transient = [k for k in c if k.startswith(("checkpoints", "loss chunk", "attention", "activ"))]
    if temporaries > sum(c[k] for k in transient):
        for k in transient:
            del c[k]
        c["optimizer step temporaries (foreach AdamW)"] = temporaries
        notes.append("the peak is in the optimizer step, after backward freed the activations")
    if inp.quantization == "nf4":
        c["NF4 dequantize workspace"] = r.intermediate * r.hidden * act
    if inp.world > 1:
        c["DDP buckets + NCCL buffers (estimate)"] = grads + NCCL_BUFFERS
    if inp.device == "cpu":
        # glibc keeps freed blocks under its mmap threshold (memory/host_heap.py) for reuse:
        # at the peak (a loss chunk, mapped afresh) it still holds the layers' freed ones.
        c["freed heap blocks glibc keeps (< 32 MiB each)"] = r.heap_held
        c["process (libraries, heap)"] = _rss_now()
    if inp.device == "cpu" and mode == "offload":
        notes.append("on CPU offload means recompute (nothing to move to)")
    return Plan(inp.device, whole, mode, tiles, c, None, host, notes)


def _cpu_upcasts(dtype) -> bool:
    import torch

    from slipstream.ops.attention import CPU_HALF_IN_FLOAT32

    return CPU_HALF_IN_FLOAT32 and dtype in (torch.bfloat16, torch.float16)


def _optimizer_bytes(kind: str, trainable: int, trainable_bytes: int) -> int:
    if kind == "adamw_8bit":  # two uint8 moments + a float32 absmax per 256 values each
        return int(trainable * 2 * (1 + 4 / 256))
    return 2 * trainable_bytes  # exp_avg, exp_avg_sq: zeros_like(param)


def _rss_now() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def device_budget(device: str) -> int | None:
    """The memory of the device a run trains on: a CUDA device's total, or the host's."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def candidates(inp: PlanInputs, auto: bool) -> list[tuple[str, int]]:
    """(mode, tiles) to try, cheapest first. A setting given explicitly stays; `auto`
    (train.memory) picks the checkpointing mode where train.activation_checkpointing is auto,
    and train.mlp_tiles: auto tiles only when untiled would not fit."""
    if inp.mode != "auto":
        modes = [inp.mode]
    elif auto:
        modes = ["none", "recompute"] + (["offload"] if inp.device == "cuda" else [])
    else:
        modes = ["offload" if inp.device == "cuda" else "recompute"]
    if inp.tiles == "auto":
        tiles = [1, *TILE_CHOICES]
    else:
        tiles = [1 if inp.tiles == "off" else int(inp.tiles)]
    return [(m, n) for n in tiles for m in modes]


def choose(inp: PlanInputs, budget: int | None, auto: bool) -> Plan:
    """The first candidate that fits the micro-batch in `budget`; the last tried when none."""
    plan = None
    for mode, tiles in candidates(inp, auto):
        plan = estimate(inp, inp.tokens, mode, tiles)
        plan.budget = budget
        if plan.fits:
            break
    return plan


def longest(inp: PlanInputs, plan: Plan) -> int | None:
    """The longest single sequence that fits `plan`'s budget with its techniques (a multiple
    of 64). The peak is piecewise affine in T (the phase that peaks changes with T), so the
    secant through the last two probes is followed until a probe lands within 1% below the
    budget; the longest probed length that fits is the answer."""
    usable = plan.usable
    if usable is None:
        return None

    def peak(T: int) -> int:
        return estimate(inp, T, plan.mode, plan.tiles).peak

    points = [(1024, peak(1024)), (8192, peak(8192))]
    for _ in range(8):
        (a, pa), (b, pb) = points[-2], points[-1]
        if pb == pa:
            break
        T = max(64, int(b + (usable - pb) * (b - a) / (pb - pa)) // 64 * 64)
        if T in dict(points):
            break
        points.append((T, peak(T)))
        if 0.99 * usable <= points[-1][1] <= usable:
            break
    fitting = [T for T, p in points if p <= usable]
    return max(fitting) if fitting else 0


def format_plan(plan: Plan, longest_tokens: int | None = None) -> str:
    lines = [
        f"memory plan for one micro-batch of {plan.tokens:,} tokens on {plan.device} "
        f"(checkpointing {plan.mode}, MLP tiles {plan.tiles}):"
    ]
    width = max(len(k) for k in plan.components)
    for name, n in plan.components.items():
        lines.append(f"  {name:<{width}}  {n / GiB:9.3f} GiB")
    lines.append(f"  {'peak':<{width}}  {plan.peak / GiB:9.3f} GiB")
    for name, n in plan.host.items():
        lines.append(f"  host: {name} {n / GiB:.3f} GiB")
    if plan.budget is not None:
        verdict = "fits" if plan.fits else "does NOT fit"
        lines.append(
            f"budget {plan.budget / GiB:.1f} GiB ({plan.usable / GiB:.1f} usable): {verdict}"
        )
    lines.append(f"techniques: {', '.join(plan.techniques) or 'none needed'}")
    if longest_tokens is not None:
        lines.append(
            f"longest single sequence (= tokens_per_batch) that fits with these: "
            f"{longest_tokens:,} tokens"
        )
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def parse_size(text: str) -> int:
    """'80GB', '141GiB', '512MB', '8e9' -> bytes (GB and GiB both 2**30: cards are sold so)."""
    units = {"tib": 1 << 40, "tb": 1 << 40, "gib": GiB, "gb": GiB, "mib": 1 << 20, "mb": 1 << 20}
    s = text.strip().lower()
    for unit, scale in units.items():
        if s.endswith(unit):
            try:
                return int(float(s[: -len(unit)]) * scale)
            except ValueError:
                break
    try:
        return int(float(s))
    except ValueError:
        raise ValueError(f"--gpu-memory {text!r}: give a size such as 80GB or 512MiB") from None


def plan_for_run(cfg, device: str, budget: int | None = None, *, say=print) -> Plan | None:
    """The plan `train` runs first: None when it cannot be made from config.json alone (a
    GGUF, a hub id not cached, remote modeling code) or transformers' layers cannot run its
    meta-device step (the generic path: said, and the run goes on); a ValueError naming the
    setting to change when the run will not fit."""
    t = cfg.train
    if t.memory == "off":
        return None
    generic = False
    try:
        hf = read_hf_config(cfg.model.path)
        if hf is None:
            say("slipstream: memory plan skipped (no config.json to read before the weights)")
            return None
        from slipstream.models import choose_family

        family = choose_family(hf.get("model_type"), "config.json", cfg.model.implementation, hf)
        generic = family[0] == "generic"
        if generic and hf.get("auto_map"):  # its classes exist only once its code is loaded
            say(f"slipstream: memory plan skipped ({hf.get('model_type')!r}: remote modeling code)")
            return None
        inp = PlanInputs.from_config(cfg, device, hf)
        budget = budget if budget is not None else device_budget(device)
        plan = choose(inp, budget, auto=t.memory == "auto")
    except ValueError as e:
        if not generic:
            raise
        say(f"slipstream: memory plan skipped (transformers' {hf.get('model_type')}: {e})")
        return None
    except Exception as e:  # the plan advises; a probe our code cannot run must not stop a run
        say(f"slipstream: memory plan skipped ({type(e).__name__}: {e})")
        return None
    if not plan.fits:
        raise ValueError(refusal(inp, plan, auto=t.memory == "auto"))
    if t.memory == "auto" or plan.tiles > 1:  # said when the plan chose something
        say(
            f"slipstream: memory plan: peak {plan.peak / GiB:.2f} GiB of {plan.usable / GiB:.1f} "
            f"GiB usable on {device} ({', '.join(plan.techniques) or 'no checkpointing'})"
        )
    return plan


def refusal(inp: PlanInputs, plan: Plan, auto: bool) -> str:
    """One line: what the run needs, what the device has, which setting to change."""
    need = (
        f"train.tokens_per_batch={inp.tokens} needs {plan.peak / GiB:.2f} GiB on "
        f"{inp.device} ({', '.join(plan.techniques) or 'no checkpointing'}) but "
        f"{plan.usable / GiB:.2f} GiB is usable"
    )
    fixes = []
    if not auto:
        best = choose(inp, plan.budget, auto=True)
        if best.fits:
            fixes.append(f"set train.memory=auto (fits with {', '.join(best.techniques)})")
        plan = best
    n = longest(inp, plan)
    if n:
        fixes.append(f"lower train.tokens_per_batch to {n}")
    if not fixes:
        fixes.append("use a device with more memory, model.quantization=nf4 or LoRA")
    return f"{need}: {' or '.join(fixes)} (slipstream plan CONFIG shows the components)"
