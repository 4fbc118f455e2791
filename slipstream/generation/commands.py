"""`slipstream generate` (one prompt, or a jsonl batch with a progress bar) and
`slipstream chat` (interactive, streamed): loading a model or a run's adapter, the sampling
flags, the jsonl formats.

jsonl in: one object a line with `prompt` (a user message: the chat template is applied
unless --raw), `messages` (a chat) or `input_ids`. jsonl out: one object a completion,
`{"line", "sample", "text", "token_ids", "finish_reason"}` (+ `logprobs` with --logprobs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: `slipstream --help` must not import torch
    from slipstream.generation.api import Completion


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model folder, .gguf file or hub id; or a run/adapter folder")
    p.add_argument("--base", help="an adapter's base model (default: its adapter_config.json's)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)  # fmt: skip


def load(args: argparse.Namespace):
    """(model, tokenizer) of a model folder, or of an adapter folder on its base model."""
    from slipstream.sources import adapter_base, check_model_path

    src = Path(args.model)
    adapter = src if (src / "adapter_config.json").is_file() else None
    base = args.base or (adapter_base(adapter) if adapter else args.model)
    what = "--base" if args.base else f"the base in {adapter}" if adapter else "model"
    check_model_path(base, what)  # before torch: a missing path is said to be one at once
    from slipstream.checkpoint.adapter import load_adapter, tokenizer_source
    from slipstream.checkpoint.hf import load_model, load_tokenizer, resolve_device, resolve_dtype

    device = resolve_device(args.device)
    tokenizer = load_tokenizer(tokenizer_source(adapter, base) if adapter else base, what)
    model = load_model(base, dtype=resolve_dtype("auto", device), device=device)
    if adapter:
        load_adapter(model, adapter)
    return model.eval(), tokenizer


def as_prompt(text: str, tokenizer: Any, raw: bool) -> Any:
    """A user message through the chat template when the tokenizer has one, else the text."""
    if raw or not getattr(tokenizer, "chat_template", None):
        return text
    return [{"role": "user", "content": text}]


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens is {args.max_new_tokens}; give at least 1")
    if (args.prompt is None) == (args.input is None):
        raise ValueError('give one prompt ("text") or --input FILE.jsonl, not both or neither')
    if args.input is not None and args.output is None:
        raise ValueError("--input needs --output FILE.jsonl for the completions")
    rows = read_jsonl(Path(args.input)) if args.input else None
    model, tokenizer = load(args)
    from slipstream.generation.api import generate_rows

    kw = dict(sampling_kwargs(args), tokenizer=tokenizer, return_logprobs=args.logprobs,
              num_return_sequences=args.num_return_sequences)  # fmt: skip
    if rows is None:
        for c in generate_rows(model, [as_prompt(args.prompt, tokenizer, args.raw)], **kw):
            print(c.text.strip())
        return 0
    prompts = [row_prompt(row, i, tokenizer, args.raw) for i, row in rows]
    write_completions(model, prompts, [i for i, _ in rows], Path(args.output), args, kw)
    return 0


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg}); give one object a line") from None
        if not isinstance(row, dict) or not {"prompt", "messages", "input_ids"} & set(row):
            raise ValueError(f"{path}:{n}: give an object with 'prompt', 'messages' or 'input_ids'")
        rows.append((n, row))
    if not rows:
        raise ValueError(f"{path} has no prompts")
    return rows


def row_prompt(row: dict, line: int, tokenizer: Any, raw: bool) -> Any:
    if "messages" in row:
        return row["messages"]
    if "input_ids" in row:
        return row["input_ids"]
    if not isinstance(row["prompt"], str):
        raise ValueError(f"line {line}: 'prompt' must be a string")
    return as_prompt(row["prompt"], tokenizer, raw)


def write_completions(model, prompts, lines, out: Path, args, kw) -> None:
    """Generate in batches of --batch-size prompts with a progress bar; write atomically."""
    from tqdm import tqdm

    from slipstream.checkpoint.atomic import atomic_write_text
    from slipstream.generation.api import generate_rows

    done: list[str] = []
    with tqdm(total=len(prompts), desc="generate", unit="prompt", file=sys.stderr) as bar:
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start : start + args.batch_size]
            n = kw["num_return_sequences"]
            for k, c in enumerate(generate_rows(model, batch, **kw)):
                line = lines[start + c.prompt_index]
                done.append(json.dumps(completion_row(c, line, k % n)))
            bar.update(len(batch))
    atomic_write_text(out, "".join(line + "\n" for line in done))
    print(f"slipstream: {len(done)} completions of {len(prompts)} prompts written to {out}")


def completion_row(c: Completion, line: int, sample: int) -> dict:
    row = {"line": line, "sample": sample, "text": c.text, "token_ids": c.token_ids,
           "finish_reason": c.finish_reason}  # fmt: skip
    if c.logprobs is not None:
        row["logprobs"] = c.logprobs
    return row


def cmd_chat(args: argparse.Namespace) -> int:
    """Read a message, stream the reply, repeat; an empty line or Ctrl-D ends the chat."""
    model, tokenizer = load(args)
    from slipstream.generation.api import generate_rows

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {args.model} has no chat template; use generate")
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    while True:
        try:
            text = input("you> ")
        except EOFError:
            break
        if not text.strip():
            break
        messages.append({"role": "user", "content": text})
        print("assistant> ", end="", flush=True)

        def show(i: int, new: str) -> None:
            print(new, end="", flush=True)

        # A stop check (one sync) every 2 tokens: the reply appears as it is written.
        reply = generate_rows(model, [messages], tokenizer=tokenizer, check_every=2,
                              on_text=show, **sampling_kwargs(args))[0]  # fmt: skip
        print()
        messages.append({"role": "assistant", "content": reply.text})
    return 0
