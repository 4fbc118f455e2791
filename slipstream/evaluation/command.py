"""`slipstream eval MODEL_OR_RUN_DIR --tasks T1,T2 [--limit N] [--num-fewshot K]
[--include-path DIR] [--output FILE]`: lm-evaluation-harness tasks on slipstream's forward.

The model is loaded as `slipstream generate` loads it (a model folder, GGUF file or hub id;
a run or adapter folder on its base). Flags, the output path and the task names are checked
before it loads. Prints lm-eval's results table; `--output` gets lm-eval's results JSON
(written atomically).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_eval_command(sub: Any) -> None:
    from slipstream.generation.commands import add_model_args

    p = sub.add_parser(
        "eval", help="score a model or a run on lm-evaluation-harness tasks",
        description="Run lm-evaluation-harness tasks (lm-eval, an optional extra: pip install "
        "'slipstream[eval]') with slipstream's packed forward and generation engine.",
    )  # fmt: skip
    add_model_args(p)
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (or "
                   "groups, tags, globs, YAML files)")  # fmt: skip
    p.add_argument("--limit", type=float, help="documents a task (a fraction < 1: of each)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (default: the task's)")
    p.add_argument("--include-path", help="a folder of your own task YAMLs")
    p.add_argument("--output", help="write lm-eval's results JSON here")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' dtype (auto: as `slipstream generate`)")  # fmt: skip
    p.add_argument("--max-length", type=int, help="the model's window (default: its config's)")
    p.add_argument("--tokens-per-batch", type=int, default=8192,
                   help="tokens a log-likelihood batch, packed without padding")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=32, help="prompts a generation batch")
    p.set_defaults(run=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from slipstream.evaluation.tasks import require_lm_eval

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks is empty; give lm-eval task names, e.g. --tasks hellaswag")
    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit is {args.limit:g}; give a count (>= 1) or a fraction < 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num-fewshot is {args.num_fewshot}; give 0 or more")
    for flag in ("max_length", "tokens_per_batch", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} is {value}; give at least 1")
    out = output_file(args.output) if args.output else None
    require_lm_eval("slipstream eval")
    from slipstream.evaluation.tasks import load_for_eval, run_cli, task_manager

    manager = task_manager(tasks, args.include_path)  # unknown names: before the model loads
    model, tokenizer = load_for_eval(args.model, base=args.base, device=args.device,
                                     dtype=args.dtype)  # fmt: skip
    from slipstream.evaluation.lm import SlipstreamLM

    lm = SlipstreamLM(
        model, tokenizer, max_length=args.max_length, tokens_per_batch=args.tokens_per_batch,
        batch_size=args.batch_size,
    )  # fmt: skip
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = run_cli(lm, tasks, manager, limit=limit, num_fewshot=args.num_fewshot)
    from lm_eval.utils import make_table

    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if out is not None:
        write_results(out, results)
        print(f"slipstream: results written to {out}", file=sys.stderr)
    return 0


def output_file(text: str) -> Path:
    """--output as a file; its folder is created (before any work)."""
    from slipstream.generation.commands import output_path

    return output_path(text, example="results.json")


def write_results(path: Path, results: dict) -> None:
    from lm_eval.utils import handle_non_serializable

    from slipstream.checkpoint.atomic import atomic_write_text

    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    atomic_write_text(path, text + "\n")
