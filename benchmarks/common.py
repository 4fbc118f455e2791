"""Shared pieces of the benchmarks: random-initialised models, the per-layer metadata
baseline, timing, and markdown tables.

Scripts in this folder import it as `common` (the folder is on `sys.path` when a script runs);
importing it also puts the repository root on `sys.path`, so the benchmarks run from a
checkout without installing slipstream.

The baseline ("the old way"): every attention layer asks the device for the sequence
boundaries again (`.tolist()` of the lengths from `cu_seqlens`, `.item()` of the longest)
and rebuilds its mask in a Python loop over the sequences. `per_layer_metadata()` swaps it
in for `slipstream.ops.attention.attend` wherever the models call it, for one block only.

Shapes: T tokens, H query heads, G kv heads, Dh head dim.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from slipstream.ops import attention  # noqa: E402
from slipstream.ops.packing import SeqInfo  # noqa: E402

# Tiny shapes every family accepts; MoE keys are ignored by dense configs.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    experts_per_token=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

REAL_SHAPES = {  # real shapes, from the published config.json files
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       rope_theta=1e6, max_position_embeddings=40960),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                     rope_theta=1e6, max_position_embeddings=40960),
    "gpt-oss-20b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
                        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, num_local_experts=32,
                        num_experts_per_tok=4, experts_per_token=4, sliding_window=128,
                        layer_types=["sliding_attention", "full_attention"] * 12,
                        tie_word_embeddings=False, max_position_embeddings=131072,
                        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                                      "rope_theta": 150000.0}),
    # Qwen3.5 (text): 3 Gated DeltaNet layers to 1 gated attention layer; Qwen3_5TextConfig's
    # and Qwen3_5MoeTextConfig's defaults, which are the 9B and 35B-A3B shapes.
    "qwen3.5-9b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096,
                       intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                        "partial_rotary_factor": 0.25},
                       max_position_embeddings=262144),
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048,
                            num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                            linear_key_head_dim=128, linear_value_head_dim=128,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            num_experts=256, num_experts_per_tok=8, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                             "partial_rotary_factor": 0.25},
                            max_position_embeddings=262144),
}  # fmt: skip
# Gemma 4 text models. These shapes come from public descriptions of the published configs,
# not the config.json files (no network here): check them against the hub before quoting
# figures per model.
REAL_SHAPES["gemma4-e4b"] = dict(
    model_type="gemma4_text",
    vocab_size=262144,
    hidden_size=2560,
    intermediate_size=10240,
    num_hidden_layers=42,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    global_head_dim=512,
    sliding_window=512,
    hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=262144,
    num_kv_shared_layers=18,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
)
REAL_SHAPES["gemma4-26b-a4b"] = dict(
    model_type="gemma4_text", vocab_size=262144, hidden_size=2816, intermediate_size=2112,
    num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    global_head_dim=512, num_global_key_value_heads=2, attention_k_eq_v=True,
    sliding_window=1024, hidden_size_per_layer_input=0, enable_moe_block=True,
    num_experts=128, top_k_experts=8, moe_intermediate_size=704, final_logit_softcapping=30.0,
    tie_word_embeddings=True, max_position_embeddings=262144,
)  # fmt: skip


# ----------------------------------------------------------------------------- models


def optional(module: str, attr: str | None = None) -> Any:
    """`module` (or `module.attr`) if it can be imported, else None: parts land over time."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    return getattr(mod, attr, None) if attr else mod


def hf_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    """A full config.json dict for `model_type`: transformers' defaults plus `overrides`."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **overrides).to_dict()
    cfg["model_type"] = model_type
    return cfg


def build_random_model(
    hf: dict[str, Any], *, dtype: torch.dtype = torch.float32, device: Any = "cpu", seed: int = 0,
    implementation: str = "native",
) -> torch.nn.Module:  # fmt: skip
    """A slipstream model of `hf`'s shapes with random weights, built directly on `device`.

    Uses the family's `config_from_hf` + `build` (`implementation="transformers"`: the generic
    family's, transformers' modeling code); the modules' own initialisers fill the weights
    (seeded), the embedding is rescaled to std 0.02 so tied heads give sane logits.
    """
    from slipstream.models import family_for, generic

    if implementation == "transformers":
        family = generic
    else:
        family = family_for(hf.get("model_type"), "benchmark config")
    cfg = family.config_from_hf(hf)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = family.build(cfg)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        model.input_embeddings().weight.normal_(0, 0.02)
    model.reset_buffers()
    return model


def random_batch(
    lengths: Sequence[int], vocab: int, device: Any = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, SeqInfo]:
    """input_ids (T,), labels (T,) shifted within each sequence (-100 at each end), SeqInfo."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    labels = torch.roll(ids, -1).clone()
    ends = torch.tensor(list(lengths)).cumsum(0) - 1
    labels[ends] = -100
    return ids.to(device), labels.to(device), SeqInfo.from_lengths(list(lengths), device)


def split_lengths(total: int, num_seqs: int, seed: int = 0) -> list[int]:
    """`num_seqs` random lengths (each >= 16) summing to exactly `total`."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(num_seqs, generator=g) + 0.25
    lengths = [max(16, int(w)) for w in (weights / weights.sum() * total).tolist()]
    lengths[-1] += total - sum(lengths)
    if lengths[-1] < 1:
        raise ValueError(f"split_lengths: cannot split {total} tokens into {num_seqs} >= 16")
    return lengths


# ----------------------------------------------------------------------------- baseline

_ORIGINAL_ATTEND = attention.attend


class RebuildStats:
    """How many times the baseline rebuilt the metadata (once per attention call)."""

    rebuilds = 0


def rebuild_lengths(seq: SeqInfo) -> list[int]:
    """The old way to learn the boundaries: ask the device (two host syncs)."""
    seqlens = seq.cu_seqlens[1:] - seq.cu_seqlens[:-1]
    lengths = seqlens.tolist()
    max_len = int(seqlens.max().item())  # what the old varlen call was handed
    assert max_len == max(lengths)
    return lengths


def rebuild_mask(seq: SeqInfo, window: int | None = None, device: Any = None) -> torch.Tensor:
    """The old way to build the dense (T, T) block-causal mask: syncs, then a Python loop."""
    lengths = rebuild_lengths(seq)
    device = device if device is not None else seq.device
    T = sum(lengths)
    mask_TT = torch.zeros(T, T, dtype=torch.bool, device=device)
    start = 0
    for n in lengths:
        block = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        if window is not None:
            block &= ~torch.ones_like(block).tril(-window)
        mask_TT[start : start + n, start : start + n] = block
        start += n
    return mask_TT


def rebuild_attend(q_THD, k_TGD, v_TGD, seq, window=None, sinks=None, scale=None):
    """The old way, in every layer: read the boundaries back from the device, rebuild masks.

    Two host syncs a call (`.tolist()`, `.item()`). On CPU the dense block-causal mask is
    built in a Python loop; on CUDA (and with sinks) a fresh, uncached SeqInfo goes to the
    real kernel, so its block mask (flex path) is rebuilt in every layer too.
    """
    RebuildStats.rebuilds += 1
    if q_THD.is_cuda or sinks is not None:
        fresh = SeqInfo.from_lengths(rebuild_lengths(seq), q_THD.device)
        return _ORIGINAL_ATTEND(q_THD, k_TGD, v_TGD, fresh, window, sinks, scale)
    mask_TT = rebuild_mask(seq, window, q_THD.device)
    return attention.sdpa_masked(q_THD, k_TGD, v_TGD, mask_TT, scale)


@contextlib.contextmanager
def swap_function(original: Callable, replacement: Callable) -> Iterator[None]:
    """Within the block, every loaded slipstream module that holds `original` (by any import
    style: `from x import f` or the defining module itself) holds `replacement` instead."""
    patched = [
        (mod, attr)
        for name, mod in list(sys.modules.items())
        if name.startswith("slipstream")
        for attr, value in list(vars(mod).items())
        if value is original
    ]
    for mod, attr in patched:
        setattr(mod, attr, replacement)
    try:
        yield
    finally:
        for mod, attr in patched:
            setattr(mod, attr, original)


@contextlib.contextmanager
def per_layer_metadata() -> Iterator[type[RebuildStats]]:
    """Within the block, every module of slipstream that calls `attend` calls the baseline."""
    RebuildStats.rebuilds = 0
    with swap_function(_ORIGINAL_ATTEND, rebuild_attend):
        yield RebuildStats


@contextlib.contextmanager
def per_expert_loop() -> Iterator[None]:
    """Within the block, MoE blocks loop over experts (`moe_loop_reference`: `torch.where(ids
    == e)`, a host sync and one GEMM pair per expert) instead of routing in one pass. Each
    expert runs through the block's own experts module, so biases and expert LoRA apply
    exactly as in the one-pass path."""
    from slipstream.ops import moe as ops

    def loop_moe(x_TD, logits_TE, experts, k, *, kind, norm_topk_prob):
        weights_TK, ids_TK = ops.route(logits_TE, k, kind=kind, norm_topk_prob=norm_topk_prob)
        E = logits_TE.shape[-1]
        y_TD = ops.moe_loop_reference(x_TD, weights_TK, ids_TK, experts, E)
        return y_TD, ops.plan(ids_TK, E)  # the plan's counts feed the router statistics

    with swap_function(ops.moe, loop_moe):
        yield


# ----------------------------------------------------------------------------- FLOPs


def step_flops(hf: dict[str, Any], lora: bool):
    """The trainer's FLOP formula (`slipstream.train.flops.StepFlops`) for a model of `hf`'s
    shape, counted on a meta-device build: no memory, the same N for ours and transformers."""
    from slipstream.models import family_for
    from slipstream.train.flops import StepFlops

    family = family_for(hf.get("model_type"), "benchmark config")
    with torch.device("meta"):
        model = family.build(family.config_from_hf(hf))
    return StepFlops(model, lora=lora)


# ----------------------------------------------------------------------------- timing


def time_per_call(
    fn: Callable[[], Any], *, reps: int, warmup: int = 1, device: Any = "cpu"
) -> float:
    """Seconds per call of `fn`, warm-up calls excluded.

    CPU: median of the individual calls (2 shared cores are noisy). CUDA: one timed region of
    `reps` calls with `torch.cuda.synchronize()` only at its two ends, mean per call.
    """
    for _ in range(warmup):
        fn()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_interleaved(fns: dict[str, Callable[[], Any]], *, reps: int, warmup: int = 1):
    """Median seconds per call of each of `fns` (CPU), calls alternating between them.

    On 2 shared cores the load drifts over seconds; alternating A, B, A, B, ... puts the same
    drift into every contender, so their ratio holds even when the absolute numbers move.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


# ----------------------------------------------------------------------------- reporting


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], digits: int = 3) -> str:
    """A markdown table of `rows` (dicts) in `columns` order; missing cells print '-'."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [fmt(row.get(c), digits).replace("|", "/").replace("\n", " ") for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_info(device: Any = "cpu") -> dict[str, str]:
    """Date, commit, hardware, torch version: the header every results table carries."""
    dev = torch.device(device)
    if dev.type == "cuda":
        hardware = torch.cuda.get_device_name(dev)
    else:
        cores = os.cpu_count()
        hardware = f"{cores}-core CPU (no GPU), {torch.get_num_threads()} torch thread(s)"
    return {
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "run_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(),
        "hardware": hardware,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def header(info: dict[str, str], command: str) -> str:
    return (
        f"date {info['date']} · commit {info['commit']} · {info['hardware']} · "
        f"torch {info['torch']} · `{command}`"
    )
