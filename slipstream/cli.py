"""The `slipstream` command: train, preview, config, demo, export, push, generate, chat, score,
eval, bench (`slipstream COMMAND --help` for each one's arguments; README.md for worked
examples).

Exit status: 0 on success, 2 with one line `slipstream: error: <reason>` on a user mistake
(bad config, missing file, unwritable output dir, bad data). Our own bugs still print a
traceback; set SLIPSTREAM_DEBUG=1 to get one for user errors too.

Imports are lazy: `--help`, config errors and path errors answer before torch is imported
(it alone takes seconds), and every path is checked before a weight is read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from slipstream.checkpoint.atomic import DiskFullError

# Disk full is not the user's mistake, but it is theirs to fix: one line, exit 2.
# (pydantic's ValidationError is a ValueError.)
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, DiskFullError)
CONFIG_HELP = (
    "every config key, its default and meaning: `slipstream config [SECTION]`; "
    "example configs: configs/; see the data before training: `slipstream preview`"
)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse itself exits 2 on a bad command line
    try:
        return args.run(args)
    except USER_ERRORS as e:
        if os.environ.get("SLIPSTREAM_DEBUG"):
            raise
        print(f"slipstream: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (loading, tokenizing)
        print("slipstream: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description="Fast LLM fine-tuning.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train", help="fine-tune a model as a YAML config describes", epilog=CONFIG_HELP
    )
    p.add_argument("config", help="run config (YAML); see configs/")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.lr=1e-4")
    p.set_defaults(run=cmd_train)

    p = sub.add_parser(
        "preview",
        help="tokenize the data as a run would (tokenizer only, no model) and report",
        epilog=CONFIG_HELP,
    )
    p.add_argument("config", help="run config (YAML)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.train=x.jsonl")
    p.set_defaults(run=cmd_preview)

    p = sub.add_parser(
        "plan", help="a run's peak memory by component and the longest batch that fits, "
        "before any weight loads", epilog=CONFIG_HELP,
    )  # fmt: skip
    p.add_argument("config", help="run config (YAML)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="e.g. train.tokens_per_batch=65536")  # fmt: skip
    p.add_argument("--device", choices=["cpu", "cuda"], help="plan for this device (default: "
                   "the config's; cuda when --gpu-memory is given)")  # fmt: skip
    p.add_argument(
        "--gpu-memory",
        "--memory",
        dest="memory",
        metavar="SIZE",
        help="the device's memory, e.g. 80GB or 141GB (default: this machine's)",
    )
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("config", help="print every config key with its default and meaning")
    p.add_argument("section", nargs="?", help="model, data, lora or train (default: all)")
    p.set_defaults(run=cmd_config)

    p = sub.add_parser("demo", help="LoRA on SmolLM2-135M-Instruct with chitchat (offline)")
    p.add_argument("--output-dir", default="runs/demo")
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser(
        "export", help="merge a LoRA adapter into its base model (HF or GGUF)",
        epilog="GGUF files go to RUN/gguf/ by default (RUN/gguf/RUN.TYPE.gguf, its Ollama "
        "Modelfile RUN/gguf/RUN.TYPE.Modelfile, the LoRA alone RUN/gguf/adapter.gguf); for a "
        "checkpoint RUN/checkpoints/step-N, the same folder with -step-N in the names.",
    )  # fmt: skip
    p.add_argument("adapter_dir", help="a LoRA run/adapter folder, a run's checkpoints/step-N "
                   "folder (an unfinished run), or with --gguf a model folder")  # fmt: skip
    p.add_argument("--base", help="base model folder or GGUF file (default: the adapter's)")
    p.add_argument("--out", help="a new or empty folder for the merged model; with --gguf, "
                   "the .gguf file (or a folder for it)")  # fmt: skip
    p.add_argument("--force", action="store_true", help="replace an existing --out: a folder "
                   "whole (the new one is written beside it, then swapped in), a GGUF file "
                   "and its Modelfile")  # fmt: skip
    p.add_argument("--gguf", metavar="TYPE", help="write one GGUF: f16, bf16, q8_0, q4_k_m, ...")
    p.add_argument("--gguf-adapter", action="store_true",
                   help="the LoRA alone as a GGUF LoRA (llama.cpp --lora)")  # fmt: skip
    p.set_defaults(run=cmd_export)

    from slipstream.share.command import add_push_command

    add_push_command(sub)
    add_generation_commands(sub)
    from slipstream.evaluation.command import add_eval_command

    add_eval_command(sub)

    p = sub.add_parser(
        "score", help="score rows with a reward model (train.objective: reward)",
        description="Score each row of a data file with a reward model (a full one or a LoRA "
        "adapter): pairs (chosen, rejected) get both scores and the accuracy, other rows "
        "(prompt + completion, messages, text) one score.",
    )  # fmt: skip
    p.add_argument("model", help="the reward model's folder (a train.objective=reward run)")
    p.add_argument("data", help="jsonl/json/parquet/csv file or hub dataset id")
    p.add_argument("--output", help="write the rows with their scores here (jsonl); else stdout")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--tokens-per-batch", type=int, default=8192, help="tokens per packed batch")
    p.set_defaults(run=cmd_score)

    p = sub.add_parser("bench", help="run a benchmark script from benchmarks/")
    p.add_argument("name", nargs="?", help="bench_<name>.py to run; none: list them")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script")
    p.set_defaults(run=cmd_bench)
    return parser


def add_generation_commands(sub: Any) -> None:
    """`generate` and `chat` (their handlers live in slipstream.generation.commands)."""
    from slipstream.generation import commands as gen

    p = sub.add_parser("generate", help="complete one prompt, or a jsonl file of prompts")
    gen.add_model_args(p)
    p.add_argument("prompt", nargs="?", help="the user message (the chat template is applied)")
    gen.add_sampling_args(p)
    p.add_argument("--num-return-sequences", type=int, default=1)
    p.add_argument("--input", help='a jsonl file of prompts, a {"prompt"|"messages"|"input_ids": '
                   '...} object a line; its other fields (an "id") are copied into each output '
                   "row (batch mode; needs --output)")  # fmt: skip
    p.add_argument("--output", help="the jsonl file of completions (batch mode; its folder is "
                   "created; written as OUTPUT.partial until every prompt is done)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=32, help="prompts a batch (batch mode)")
    p.add_argument("--logprobs", action="store_true", help="write each token's log-prob")
    p.add_argument("--raw", action="store_true", help="prompts as plain text, no chat template")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image before the prompt's text (repeatable)")  # fmt: skip
    p.set_defaults(run=gen.cmd_generate)

    p = sub.add_parser(
        "chat", help="chat with a model or a run, replies streamed",
        description="Chat with a model or a run; the replies are streamed.",
        epilog=chat_commands(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    gen.add_model_args(p)
    gen.add_sampling_args(p, max_new_tokens=512)
    p.add_argument("--system", help="a system message to start the chat with")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image shown with the first message (repeatable)")  # fmt: skip
    p.set_defaults(run=gen.cmd_chat)


def chat_commands() -> str:
    from slipstream.generation.chat import COMMANDS

    return COMMANDS


def read_run_config(args: argparse.Namespace):
    """The run config of `train`/`preview`, its paths (model, data, template) and the model's
    type checked: before torch is imported, a tokenizer loads or a weight is read."""
    from slipstream.checkpoint.model_type import check_model_source
    from slipstream.config import load_config
    from slipstream.sources import check_run_paths

    cfg = load_config(args.config, args.overrides)
    check_run_paths(cfg)
    m = cfg.model
    check_model_source(m.path, "model.path", m.implementation, m.trust_remote_code)
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    from slipstream.config import check_output_dir

    cfg = read_run_config(args)
    check_output_dir(cfg.output_dir)
    import torch

    from slipstream.distributed import is_main
    from slipstream.train import train

    try:
        summary = train(cfg)
    except torch.OutOfMemoryError as e:  # the config asks more than the GPU has: say which knobs
        raise ValueError(out_of_memory_advice(cfg, e)) from None
    status = f"{summary['status']} at step {summary['steps']}"
    stopped_by = summary.get("signal") or "SIGTERM"  # unnamed: another rank's (torchrun)
    if summary["status"] == "interrupted":
        status = f"interrupted by {stopped_by} at step {summary['steps']}"
    if is_main():  # under torchrun, one line for the job rather than one per process
        print(f"slipstream: {status}; output in {cfg.output_dir}")
        if summary.get("pushed"):
            print(f"slipstream: pushed to {summary['pushed']}")
    if summary["status"] == "interrupted":  # as shells and schedulers expect: 128 + signal
        import signal

        return 128 + signal.Signals[stopped_by].value
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    for what, path in (("reward model", args.model), ("data", args.data)):
        if not Path(path).exists() and not (what == "data" and "/" in path):
            raise ValueError(f"{what} {path} does not exist")
    from slipstream.objectives.reward_scoring import score_file

    summary = score_file(args.model, args.data, args.output, device=args.device,
                         tokens_per_batch=args.tokens_per_batch)  # fmt: skip
    accuracy = f", pair accuracy {summary['accuracy']:.4f}" if summary["pairs"] else ""
    print(f"slipstream: {summary['rows']} rows scored, mean score {summary['mean_score']:.4f}"
          f"{accuracy}", file=sys.stderr)  # fmt: skip
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from slipstream.demo import run_demo

    result = run_demo(args)
    return result if isinstance(result, int) else 0


def cmd_plan(args: argparse.Namespace) -> int:
    from slipstream.config import load_config  # the data need not exist: only the model's shape
    from slipstream.memory.plan import parse_size
    from slipstream.memory.plan_report import plan_report

    cfg = load_config(args.config, args.overrides)
    budget = parse_size(args.memory) if args.memory else None
    print(plan_report(cfg, args.device, budget))
    return 0


def cmd_preview(args: argparse.Namespace) -> int:
    cfg = read_run_config(args)
    from slipstream.preview import preview

    print(preview(cfg, color=sys.stdout.isatty()))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from slipstream.config import describe_config

    print(describe_config(args.section))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from slipstream.sources import is_checkpoint_dir

    if is_checkpoint_dir(args.adapter_dir):
        return cmd_export_checkpoint(args)
    if args.gguf or args.gguf_adapter:
        return cmd_export_gguf(args)
    if not args.out:
        raise ValueError("export to the HF layout needs --out DIR (or --gguf TYPE)")
    from slipstream.checkpoint.merge_adapter import merge_adapter_dir

    return _say_merged(merge_adapter_dir(args.adapter_dir, args.out, args.base, args.force))


def _export_merged(model: Any, out: Path, tokenizer: Any, force: bool) -> int:
    from slipstream.checkpoint.export import export_merged

    return _say_merged(export_merged(model, out, tokenizer=tokenizer, force=force))


def _say_merged(out: Path) -> int:
    note = json.loads((out / "export_summary.json").read_text())["note"]
    print(f"slipstream: merged model written to {out} ({note})")
    return 0


def cmd_export_gguf(args: argparse.Namespace, default: Path | None = None) -> int:
    if args.gguf_adapter:
        from slipstream.checkpoint.gguf_lora import export_adapter_gguf

        path = export_adapter_gguf(
            args.adapter_dir, args.out, base=args.base, force=args.force, default=default
        )
        print(f"slipstream: GGUF LoRA adapter written to {path}")
        print(f"slipstream: use it on its base: llama-cli -m BASE.gguf --lora {path}")
        return 0
    from slipstream.checkpoint.gguf_export import export_run_gguf, modelfile_path

    notes: list[str] = []  # the mmproj of an image-text model, said after the text file
    path = export_run_gguf(
        args.adapter_dir, args.gguf, args.out, base=args.base, force=args.force, default=default,
        say=notes.append,
    )  # fmt: skip
    size = path.stat().st_size / 2**20
    print(f"slipstream: {args.gguf} GGUF written to {path} ({size:.1f} MiB)")
    print(f"slipstream: Ollama: ollama create NAME -f {modelfile_path(path)}; llama.cpp: "
          f"llama-cli -m {path}; transformers: from_pretrained('{path.parent}', "
          f"gguf_file='{path.name}')")  # fmt: skip
    for note in notes:
        print(f"slipstream: {note}")
    return 0


def cmd_export_checkpoint(args: argparse.Namespace) -> int:
    """A run's checkpoints/step-N: its adapter (or model) is written into a temporary folder
    in the run, then exported as a finished run's would be."""
    import tempfile

    from slipstream.checkpoint.gguf_export import GGUF_DIR, check_type
    from slipstream.sources import RUN_CHECKPOINTS

    ckpt = Path(args.adapter_dir)
    run = ckpt.parent.parent if ckpt.parent.name == RUN_CHECKPOINTS else ckpt.parent
    name = f"{run.resolve().name}-{ckpt.name}"
    default = None
    if args.gguf_adapter:
        default = run / GGUF_DIR / f"adapter-{ckpt.name}.gguf"
    elif args.gguf:
        default = run / GGUF_DIR / f"{name}.{check_type(args.gguf)}.gguf"
    elif not args.out:
        raise ValueError("export to the HF layout needs --out DIR (or --gguf TYPE)")
    if default is not None:  # what is in the way is said before the slow part
        from slipstream.checkpoint.gguf_export import gguf_output

        gguf_output(args.out, default, args.force, modelfile=not args.gguf_adapter)
    else:
        from slipstream.checkpoint.export import check_out_dir

        check_out_dir(args.out, args.force, reads=(ckpt,))
    from slipstream.train.checkpoint_result import write_result

    with tempfile.TemporaryDirectory(dir=run, prefix=".export-") as tmp:
        write_result(ckpt, Path(tmp))
        print(f"slipstream: exporting checkpoint {ckpt}")
        if default is not None:
            return cmd_export_gguf(argparse.Namespace(**{**vars(args), "adapter_dir": tmp}),
                                   default=default)  # fmt: skip
        if (Path(tmp) / "config.json").is_file():  # full fine-tuning: the model itself
            from slipstream.checkpoint.hf import load_model
            from slipstream.checkpoint.tokenizer import load_tokenizer

            return _export_merged(load_model(tmp), Path(args.out), load_tokenizer(tmp), args.force)
        return cmd_export(argparse.Namespace(**{**vars(args), "adapter_dir": tmp}))


def cmd_bench(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    scripts = sorted(root.glob("bench_*.py")) + sorted(root.glob("gpu_suite.py"))
    if not scripts:
        raise FileNotFoundError(f"no benchmark scripts in '{root}' (needs a source checkout)")
    if args.name is None:
        print("benchmarks (run: slipstream bench NAME):")
        for s in scripts:
            print(f"  {s.stem.removeprefix('bench_')}")
        return 0
    by_name = {s.stem.removeprefix("bench_"): s for s in scripts}
    if args.name not in by_name:
        raise ValueError(f"unknown benchmark '{args.name}' (one of: {', '.join(by_name)})")
    return subprocess.call([sys.executable, str(by_name[args.name]), *args.args])


def out_of_memory_advice(cfg, e: BaseException) -> str:
    """One line: torch's own words (what it tried to allocate, what was free), then the
    settings of this run that lower peak memory, most effective first."""
    t = cfg.train
    said = one_line(e).split(" Including non-PyTorch memory")[0].split(" If reserved")[0]
    tips = [f"lower train.tokens_per_batch (now {t.tokens_per_batch}) and raise "
            "train.grad_accum to keep the tokens per step"]  # fmt: skip
    if t.activation_checkpointing in ("none", "recompute"):
        tips.append("set train.activation_checkpointing=offload")
    if cfg.train.finetune == "full":
        if t.optimizer == "adamw":
            tips.append("set train.optimizer=adamw_8bit")
        tips.append("use train.finetune=lora")
    elif cfg.model.quantization == "none":
        tips.append("set model.quantization=nf4 (QLoRA)")
    return f"out of GPU memory ({said}); " + ", or ".join(tips)


def one_line(e: BaseException) -> str:
    if type(e).__name__ == "ValidationError" and hasattr(e, "errors"):  # pydantic's
        from slipstream.config import format_validation_error

        return format_validation_error(e)
    text = str(e).strip() or type(e).__name__
    if isinstance(e, FileNotFoundError) and e.filename and e.strerror:
        text = f"{e.strerror}: {e.filename}"
    return " ".join(text.split())  # one line, whatever the message held
