"""The GPU suite: one script, no network, at most 8 minutes on one H200.

Run: `python benchmarks/gpu_suite.py [--out FILE] [--budget-s 450]`; `--dry-run` runs the same
code paths with tiny shapes on CPU in seconds (the test suite does, so this never rots).
Writes JSON to `--out` (default `$OUT/gpu_suite.json` when OUT is set, else gpu_suite.json)
and prints a markdown table last.

Models are random-initialised with real shapes (no weights): Qwen3-0.6B, Qwen3-8B and, when
the `gpt_oss` family exists, a GPT-OSS-20B-shaped MoE. Every row trains at 16k tokens per step
(16 packed sequences), bf16, LoRA r=16 alpha=32 on all linear layers unless it says "full".
Step = summed loss / labelled tokens, backward, clip, fused AdamW, zero_grad.
- ours: everything on (LoRA, offload with double-buffered reloads, metadata built once);
- ablations: metadata cache off (per-layer rebuild, `common.rebuild_attend`), offload single
  buffer, offload off (recompute), MoE one-pass off (per-expert loop), regional compile;
- generation: `slipstream.generate` on the Qwen3-8B shape with the LoRA adapter unmerged,
  64 prompts x 256 new tokens, generated tokens/s and host syncs per call;
- GRPO (Qwen3-0.6B shape): one rollout (16 prompts of 64..192 tokens x G=8, up to 256
  sampled tokens each, random rewards) then one optimizer step on its packed sequences
  (offload on); generation and training seconds, tokens/s of each, syncs of the training
  part, peak memory;
- transformers + PEFT on the same shapes and LoRA settings, gradient checkpointing, the best
  attention the image has (flash_attention_2 if `flash_attn` imports, else flex_attention on
  CUDA, else sdpa), packed via position_ids when a runtime check shows that gives
  per-sequence results, padded otherwise; float32 adapters (peft's default), as ours.
MFU = (4·N·T with LoRA or 6·N·T full, + attention FLOPs) / step time / 989 TFLOP/s (H200 bf16
dense); N = active parameters; the trainer's formula, `slipstream/train/flops.py`.
Syncs per step: `count_syncs()` over one audited step (after warm-up), plus the number of
`torch.cuda.set_sync_debug_mode("warn")` warnings in that step. Warm-up steps are not timed;
`torch.cuda.synchronize()` runs only at the ends of each timed region. A failing row prints
its error and the suite goes on; a global time guard skips rows that would pass the budget.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

import common
import hf_baseline
import torch

from slipstream.debug import count_syncs
from slipstream.ops.packing import SeqInfo
from slipstream.rewards.functions import RewardFunctions

H200_PEAK = 989e12
LORA = dict(rank=16, alpha=32)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

SHAPES = common.REAL_SHAPES


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
    impl: str = "ours"  # "ours" | "hf"
    lora: bool = True
    ckpt: str = "offload"  # "offload" | "recompute" | "none"
    double_buffer: Any = "auto"
    metadata_cache: bool = True
    moe_one_pass: bool = True
    compile: bool = False
    need_s: float = 30.0  # rough cost on an H200, for the time guard


def variants(has_moe_family: bool) -> list[Variant]:
    """Rows in priority order: what the targets need first, so the time guard cuts the rest."""
    rows = [  # the published targets first: Qwen3-8B vs transformers, MFU, offload cost
        Variant("ours, everything on", "qwen3-8b", need_s=45),
        Variant("transformers + PEFT", "qwen3-8b", impl="hf", need_s=60),
        Variant("offload off (recompute)", "qwen3-8b", ckpt="recompute"),
        Variant("generation: 64 prompts x 256 new tokens", "qwen3-8b", impl="generate", need_s=60),
        Variant("ours, everything on", "qwen3-0.6b", need_s=20),
        Variant("transformers + PEFT", "qwen3-0.6b", impl="hf", need_s=25),
        Variant(
            "GRPO step: 16 prompts x 8 completions x 256 tokens",
            "qwen3-0.6b",
            impl="grpo",
            need_s=60,
        ),
        Variant("metadata cache off (per-layer rebuild)", "qwen3-8b", metadata_cache=False),
        Variant("offload single buffer", "qwen3-8b", double_buffer=False),
        Variant("regional compile + everything on", "qwen3-8b", compile=True, need_s=120),
        Variant("full fine-tune, everything on", "qwen3-0.6b", lora=False),
        Variant("regional compile + everything on", "qwen3-0.6b", compile=True, need_s=60),
    ]
    moe = [
        Variant("ours, everything on", "gpt-oss-20b", need_s=90),
        Variant("MoE one-pass off (per-expert loop)", "gpt-oss-20b", moe_one_pass=False,
                need_s=90),
        Variant("transformers + PEFT", "gpt-oss-20b", impl="hf", need_s=120),
    ]  # fmt: skip
    if has_moe_family:
        return rows[:5] + moe[:1] + rows[5:] + moe[1:]
    return rows + [Variant(v.name, v.model, impl="skip") for v in moe]


# ----------------------------------------------------------------------------- ours


class OursCache:
    """The slipstream model of the last row, kept while rows share it (same model and LoRA)."""

    key: tuple | None = None
    model: Any = None

    @classmethod
    def get(cls, v: Variant, setup: Setup) -> Any:
        key = (v.model, v.lora)
        if cls.key != key:
            cls.clear()
            model = common.build_random_model(
                setup.shapes[v.model], dtype=setup.dtype, device=setup.device
            )
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
    window = [PromptBatch(examples[i : i + 4]) for i in range(0, n, 4)]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(
        model.named_parameters(), lr=1e-6, weight_decay=0.0, device=torch.device("cuda")
    )
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    batches, rollout = objective.generate_batches(
        model, _NoTextTokenizer(), window, setup.device, seeds=list(range(len(window)))
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


# ----------------------------------------------------------------------------- transformers


def hf_row(v: Variant, setup: Setup) -> dict:
    import peft

    OursCache.clear()  # weights of ours must not count in this row's peak memory
    hf = setup.shapes[v.model]
    model, attn = hf_baseline.build_hf(hf, setup)
    packed = hf_baseline.hf_packing_ok(model, setup)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = peft.LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                             target_modules=lora_targets(model), task_type="CAUSAL_LM")  # fmt: skip
    # peft's default: float32 adapters on the bf16 base, as ours (its adapter matmuls run in
    # float32, ours cast the factors to bf16).
    model = peft.get_peft_model(model, config).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True)
    inputs, computed = hf_baseline.hf_inputs(setup, hf["vocab_size"], packed)

    def step():
        model(**inputs).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # count_syncs' modes cannot wrap transformers' compiled flex call (dynamo refuses to run
    # compiled code under them); that row is audited by CUDA's sync-debug warnings alone.
    row = measure_steps(step, setup, audit=True, count=attn != "flex_attention")
    row.update(
        attention=attn,
        packing="packed (position_ids)" if packed else f"padded ({computed} tokens computed)",
        notes="gradient checkpointing, peft LoRA",
    )
    return row  # the model goes with this frame; run_row then frees the memory


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


class RowTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise RowTimeout("row ran past its share of the time budget")


def run_row(v: Variant, setup: Setup) -> dict:
    hf = setup.shapes.get(v.model, {})
    row: dict[str, Any] = {"model": v.model, "layers": hf.get("num_hidden_layers"),
                           "variant": v.name, "impl": v.impl}  # fmt: skip
    if v.impl == "skip":
        return {**row, "status": "skipped: no gpt_oss family in slipstream.models yet"}
    left = setup.deadline - time.monotonic()
    need = 0.5 if setup.dry else v.need_s
    if left < need:
        return {**row, "status": f"skipped: time guard ({left:.0f} s left, needs ~{need:.0f})"}
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, max(left, 1.0))
    t0 = time.monotonic()
    try:
        rows = {"hf": hf_row, "generate": generate_row, "grpo": grpo_row}
        row.update(rows.get(v.impl, ours_row)(v, setup))
        row["status"] = "ok"
    except Exception as e:  # one failing row must not stop the suite
        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        row["traceback"] = traceback.format_exc(limit=6)
        OursCache.clear()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        free_memory()
    row["row s"] = time.monotonic() - t0
    if "step s" in row:
        tokens = sum(setup.lengths)
        row["tokens/s"] = tokens / row["step s"]
        flops = common.step_flops(hf, lora=v.lora)
        row["n_active"] = flops.n_active
        if setup.device.type == "cuda":
            row["MFU %"] = 100 * flops(setup.lengths) / row["step s"] / H200_PEAK
    return row


# ----------------------------------------------------------------------------- main

COLUMNS = ["model", "layers", "variant", "attention", "packing", "tokens/s", "step s",
           "peak GB", "MFU %", "vs ours", "syncs/step", "cuda sync warnings", "H2D GB/s",
           "exposed copy ms/step", "status"]  # fmt: skip


def add_ratios(rows: list[dict]) -> None:
    """`vs ours`: this row's tokens/s over the same model's everything-on row."""
    base = {r["model"]: r["tokens/s"] for r in rows
            if r["variant"] == "ours, everything on" and r.get("tokens/s")}  # fmt: skip
    for r in rows:
        if r.get("tokens/s") and r["model"] in base and r["impl"] not in ("generate", "grpo"):
            r["vs ours"] = r["tokens/s"] / base[r["model"]]


def make_setup(args) -> Setup:
    deadline = time.monotonic() + args.budget_s
    if args.dry_run:
        tiny = {k: v for k, v in common.TINY.items()}
        shapes = {
            "qwen3-0.6b": common.hf_config("qwen3", **{**tiny, "tie_word_embeddings": True}),
            "qwen3-8b": common.hf_config("qwen3", **{**tiny, "num_hidden_layers": 3}),
        }
        from slipstream.models import FAMILIES

        if "gpt_oss" in FAMILIES:
            shapes["gpt-oss-20b"] = common.hf_config("gpt_oss", **tiny)
        lengths = common.split_lengths(192, 4)
        return Setup(torch.device("cpu"), torch.float32, lengths, 1, 1, True, deadline, shapes)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_suite: no CUDA device; use --dry-run for the CPU smoke run")
    shapes = {name: common.hf_config(s["model_type"], **{k: v for k, v in s.items()
                                                         if k != "model_type"})
              for name, s in SHAPES.items() if name != "gpt-oss-20b"}  # fmt: skip
    from slipstream.models import FAMILIES

    if "gpt_oss" in FAMILIES:
        s = SHAPES["gpt-oss-20b"]
        shapes["gpt-oss-20b"] = common.hf_config("gpt_oss", **{k: v for k, v in s.items()
                                                               if k != "model_type"})  # fmt: skip
    lengths = common.split_lengths(args.tokens, args.tokens // 1024)
    return Setup(torch.device("cuda"), torch.bfloat16, lengths, 2, 3, False, deadline, shapes)


def default_out() -> str:
    out = os.environ.get("OUT")
    return os.path.join(out, "gpu_suite.json") if out else "gpu_suite.json"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, seconds")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_suite.json)")
    ap.add_argument("--budget-s", type=float, default=450, help="time guard for all rows")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per step (GPU)")
    ap.add_argument("--only", default=None, help="run rows whose model contains this text")
    args = ap.parse_args(argv)
    started = time.monotonic()
    setup = make_setup(args)
    from slipstream.models import FAMILIES

    rows, paths = [], set()
    for v in variants("gpt_oss" in FAMILIES):
        if args.only and args.only not in v.model:
            continue
        path = (v.impl, v.lora, v.ckpt, v.double_buffer, v.metadata_cache, v.moe_one_pass,
                v.compile, "moe" if "oss" in v.model else "dense")  # fmt: skip
        if setup.dry and path in paths:  # same code path as a row above: seconds saved
            continue
        paths.add(path)
        row = run_row(v, setup)
        rows.append(row)
        print(f"[{time.monotonic() - started:6.1f} s] {v.model} / {v.name}: {row['status']}",
              {k: common.fmt(row.get(k)) for k in ("tokens/s", "step s", "peak GB", "MFU %")},
              flush=True)  # fmt: skip
        if row.get("traceback"):
            print(row["traceback"], flush=True)
    add_ratios(rows)
    info = common.run_info(setup.device)
    out = args.out or default_out()
    with open(out, "w") as f:
        report = {"info": info, "lengths": setup.lengths, "dry_run": setup.dry,
                  "seconds": time.monotonic() - started, "rows": rows}  # fmt: skip
        json.dump(report, f, indent=2, default=str)
    command = "python benchmarks/gpu_suite.py" + (" --dry-run" if setup.dry else "")
    print(f"\nGPU suite: {sum(setup.lengths)} tokens/step in {len(setup.lengths)} packed "
          f"sequences, {str(setup.dtype).removeprefix('torch.')}, LoRA r=16 a=32 all linear; "
          f"JSON: {out}; {time.monotonic() - started:.0f} s")  # fmt: skip
    print(common.header(info, command))
    print(common.markdown_table(rows, COLUMNS))
    return rows


if __name__ == "__main__":
    main()
