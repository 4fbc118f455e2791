"""The GPU suite's rows (gpu_suite.py runs them in order under its time guard): what a row
is (`Setup`, `Variant`), slipstream's training step with its ablations, generation and one
GRPO step, and how a step is measured (warm-up, one sync-audited step, timed reps, peak
memory, offload copy stats). The transformers + PEFT row is in hf_baseline.py.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import common
import torch

from slipstream.debug import count_syncs
from slipstream.ops.packing import SeqInfo
from slipstream.rewards.functions import RewardFunctions

LORA = dict(rank=16, alpha=32)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype
    lengths: list[int]
    warmup: int
    reps: int
    dry: bool
    deadline: float
    shapes: dict[str, dict] = field(default_factory=dict)


@dataclass
class Variant:
    name: str
    model: str
    impl: str = "ours"  # "ours" | "generic" (ours on transformers' modeling code) | "hf" | ...
    lora: bool = True
    ckpt: str = "offload"  # "offload" | "recompute" | "none"
    double_buffer: Any = "auto"
    metadata_cache: bool = True
    moe_one_pass: bool = True
    compile: bool = False
    need_s: float = 30.0  # rough cost on an H200, for the time guard


# ----------------------------------------------------------------------------- ours


class OursCache:
    """The slipstream model of the last row, kept while rows share it (same model and LoRA)."""

    key: tuple | None = None
    model: Any = None

    @classmethod
    def get(cls, v: Variant, setup: Setup) -> Any:
        generic = v.impl == "generic"
        key = (v.model, v.lora, generic)
        if cls.key != key:
            cls.clear()
            model = common.build_random_model(
                setup.shapes[v.model], dtype=setup.dtype, device=setup.device,
                implementation="transformers" if generic else "native",
            )  # fmt: skip
            if v.lora:
                from slipstream.peft.lora import apply_lora

                apply_lora(model, **LORA, targets=lora_targets(model))
            else:
                model.requires_grad_(True)
            cls.key, cls.model = key, model
        return cls.model

    @classmethod
    def clear(cls) -> None:
        cls.key = cls.model = None
        free_memory()


def lora_targets(model: torch.nn.Module) -> list[str]:
    """TARGETS that are nn.Linear modules here (MoE experts are stacked tensors, not Linear)."""
    present = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)}  # fmt: skip
    return [t for t in TARGETS if t in present]


def ours_row(v: Variant, setup: Setup) -> dict:
    from slipstream.train.optim import build_optimizer

    hf = setup.shapes[v.model]
    model = OursCache.get(v, setup).train()
    pool = None
    checkpointing = common.optional("slipstream.memory.offload", "apply_checkpointing")
    if checkpointing is None:
        note = "no slipstream.memory.offload: no checkpointing"
    else:
        force = setup.dry and v.ckpt == "offload"  # CPU: run the real offload schedule
        pool = checkpointing(model, v.ckpt, double_buffer=v.double_buffer,
                             timing=setup.device.type == "cuda", force=force)  # fmt: skip
        note = f"checkpointing={v.ckpt}" + (f", buffers={v.double_buffer}" if pool else "")
    if v.compile:
        backend = "eager" if setup.dry else "inductor"  # CPU dry run: dynamo without a compiler
        # What `train.compile=true` does: attention and dense MLP blocks, dynamic shapes.
        from slipstream.compile import apply_compile

        apply_compile(model, backend=backend)
        OursCache.key = None  # compiled layers are not reused by later rows
    params = [p for p in model.parameters() if p.requires_grad]
    # device "cuda" selects the trainer's fused AdamW, also in the CPU dry run (fused AdamW
    # runs on CPU; the foreach one would `.item()` its host step counters).
    optimizer = build_optimizer(
        model.named_parameters(), lr=1e-5, weight_decay=0.0, device=torch.device("cuda")
    )
    ids, labels, _ = common.random_batch(setup.lengths, hf["vocab_size"], setup.device)
    num_labels = sum(n - 1 for n in setup.lengths)

    def step():
        seq = SeqInfo.from_lengths(setup.lengths, setup.device)  # a new batch's metadata
        loss = model.loss(ids, labels, seq, reduction="sum")
        (loss / num_labels).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    switches = contextlib.ExitStack()
    if not v.metadata_cache:
        switches.enter_context(common.per_layer_metadata())
    if not v.moe_one_pass:
        switches.enter_context(common.per_expert_loop())
    with switches:
        row = measure_steps(step, setup, audit=not v.compile, offload_pool=pool)
    row.update(notes=note, packing="packed (varlen)")
    row["attention"] = attention_backend(setup.device, hf)
    return row


def attention_backend(device: torch.device, hf: dict) -> str:
    if device.type != "cuda":
        return "sdpa (cpu)"
    from slipstream.ops import attention

    if hf.get("model_type") == "gpt_oss":  # sink attention: always the flex path
        return "flex"
    return "varlen" if attention._varlen_supports() else "flex"


def generate_row(v: Variant, setup: Setup) -> dict:
    """`slipstream.generate` with the LoRA adapter applied unmerged (as GRPO rollouts run):
    64 prompts of 64..512 tokens (dry run: 4 of 4..16), 256 new tokens (dry: 12), greedy;
    tokens/s over the tokens actually generated (a random model may emit eos)."""
    import math

    import slipstream

    model = OursCache.get(v, setup).eval()
    n, lo, hi, new = (4, 4, 16, 12) if setup.dry else (64, 64, 512, 256)
    g = torch.Generator().manual_seed(0)
    vocab = setup.shapes[v.model]["vocab_size"]
    prompts = [torch.randint(0, vocab, (int(k),), generator=g).tolist()
               for k in torch.linspace(lo, hi, n).round()]  # fmt: skip
    slipstream.generate(model, prompts[:2], max_new_tokens=8)  # warm-up
    if setup.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with count_syncs() as syncs:
        t0 = time.perf_counter()
        out = slipstream.generate(model, prompts, max_new_tokens=new)
        seconds = time.perf_counter() - t0  # generate reads its last tokens back: synced
    tokens = sum(len(c.token_ids) for c in out)
    row = {"tokens/s": tokens / seconds, "generate s": seconds, "generated": tokens,
           "syncs/generate": syncs.total, "checks bound": math.ceil(new / 8),
           "packing": f"packed prefill, {n} prompts x {new} new tokens",
           "attention": "prefill: " + attention_backend(setup.device, setup.shapes[v.model])
                        + "; decode: sdpa over the kv cache",
           "notes": f"{syncs.total} host syncs for {new} tokens (one per stop check)"}  # fmt: skip
    if setup.device.type == "cuda":
        row["peak GB"] = torch.cuda.max_memory_allocated() / 1e9
    return row


class _NoTextTokenizer:
    """What a rollout asks of a tokenizer, for a random model: no stop tokens, no text."""

    eos_token_id = pad_token_id = None

    def get_vocab(self) -> dict:
        return {}

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


class _RandomRewards:
    """One reward function of random scores; summed as the trainer's rewards are."""

    names, weights = ["random"], [1.0]
    total = RewardFunctions.total

    def __call__(self, prompts, completions, columns, rows, **kwargs):
        return torch.rand(len(completions), 1, generator=torch.Generator().manual_seed(0))


def grpo_row(v: Variant, setup: Setup) -> dict:
    """One GRPO step as the trainer runs it (objectives/grpo.py): rollout, then the
    accumulation over its packed micro-batches, clip, AdamW. Random weights emit no stop
    token, so every completion runs to the limit (the longest rollout)."""
    from slipstream.objectives.grpo import GRPO
    from slipstream.objectives.grpo_data import PromptBatch, PromptExample
    from slipstream.train.loop import accumulate_gradients
    from slipstream.train.optim import build_optimizer

    model = OursCache.get(v, setup).train()
    checkpointing = common.optional("slipstream.memory.offload", "apply_checkpointing")
    if checkpointing is not None:
        checkpointing(model, "offload", force=setup.dry)
    n, lo, hi, G, new = (2, 4, 8, 2, 4) if setup.dry else (16, 64, 192, 8, 256)
    budget = 4 * G * (hi + new)  # 4 prompts a micro-batch
    objective = GRPO(rewards=_RandomRewards(), num_generations=G, max_prompt_tokens=hi,
                     max_completion_tokens=new)  # fmt: skip
    objective.budget = budget
    g = torch.Generator().manual_seed(0)
    vocab = setup.shapes[v.model]["vocab_size"]
    examples = [PromptExample(torch.randint(0, vocab, (int(k),), generator=g).tolist(), "", {}, i)
                for i, k in enumerate(torch.linspace(lo, hi, n).round())]  # fmt: skip
    prompt_batches = [PromptBatch(examples[i : i + 4]) for i in range(0, n, 4)]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(
        model.named_parameters(), lr=1e-6, weight_decay=0.0, device=torch.device("cuda")
    )
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    batches, rollout = objective.generate_batches(
        model,
        _NoTextTokenizer(),
        prompt_batches,
        setup.device,
        seeds=list(range(len(prompt_batches))),
    )
    gen_s, rollout_s = rollout["stats"]["gen_time_s"], rollout["seconds"]  # synced ends

    def step():
        weight = sum(objective.weight(b) for b in batches)
        accumulate_gradients(model, batches, objective, weight)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    syncs, cuda_warnings, where = audit_syncs(step)
    train_s = common.time_per_call(step, reps=setup.reps, warmup=0, device=setup.device)
    trained = sum(b.num_tokens for b in batches)
    generated = sum(b.completion_tokens for b in batches)
    row = {"train s": train_s, "generate s": gen_s, "rollout s": rollout_s,
           "train tokens/s": trained / train_s, "gen tokens/s": generated / gen_s,
           "tokens/s": trained / (train_s + rollout_s),
           "gen share %": 100 * gen_s / (rollout_s + train_s), "syncs/step": syncs,
           "cuda sync warnings": cuda_warnings, "sync sites": where,
           "micro-batches": len(batches),
           "packing": f"{n} prompts x G={G}, <= {new} new tokens, {len(batches)} micro-batches",
           "attention": attention_backend(setup.device, setup.shapes[v.model]),
           "notes": f"syncs/step: the training part; rollout {rollout_s:.1f} s of which "
                    f"sampling {gen_s:.1f} s"}  # fmt: skip
    if setup.device.type == "cuda":
        row["peak GB"] = torch.cuda.max_memory_allocated() / 2**30
    return row


# ----------------------------------------------------------------------------- measuring


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def audit_syncs(step, count: bool = True) -> tuple[int | None, int | None, str]:
    """(count_syncs total or None, CUDA sync-debug warnings, where) over one step."""
    cuda = torch.cuda.is_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with count_syncs() if count else contextlib.nullcontext() as counts:
                step()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    cuda_warnings = sum("synchroniz" in str(w.message).lower() for w in caught)
    if counts is None:
        return None, cuda_warnings if cuda else None, "count_syncs not applicable"
    where = "; ".join(f"{op} x{n} at {counts.sites[op]}" for op, n in counts.by_op.items())
    return counts.total, cuda_warnings if cuda else None, where


def measure_steps(
    step, setup: Setup, audit: bool, offload_pool: Any = None, count: bool = True
) -> dict:
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    row: dict[str, Any] = {}
    for _ in range(setup.warmup):
        step()
    if audit:
        row["syncs/step"], row["cuda sync warnings"], row["sync sites"] = audit_syncs(step, count)
    if offload_pool is not None:
        offload_pool.reset_stats()
    row["step s"] = common.time_per_call(step, reps=setup.reps, warmup=0, device=setup.device)
    if setup.device.type == "cuda":
        row["peak GB"] = torch.cuda.max_memory_allocated() / 2**30
    if offload_pool is not None:
        stats = offload_pool.stats()
        row["H2D GB/s"] = stats.h2d_gbps
        if stats.exposed_ms is not None:
            row["exposed copy ms/step"] = stats.exposed_ms / max(stats.steps, 1)
    return row
