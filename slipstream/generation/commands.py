"""`slipstream generate` (one prompt, or a jsonl batch with a progress bar) and
`slipstream chat` (interactive, streamed): loading a model or a run's adapter, the sampling
flags, the jsonl formats.

Every flag and every input row is checked before a model loads. jsonl in: one object a line
with `prompt` (a user message: the chat template is applied unless --raw), `messages` (a
chat; image parts' paths relative to the file) or `input_ids`, and any other fields (an
"id"); `--image PATH` puts images before the one prompt's text. jsonl out: one object a
completion, the input row's fields and `{"line", "sample", "text", "token_ids", "finish_reason"}` (+
`logprobs` with --logprobs), written batch by batch into OUT.partial and renamed to OUT when
every prompt is done (after a failure or Ctrl-C, OUT.partial holds the finished prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from slipstream.generation.options import check_options, flag

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


def load(args: argparse.Namespace, chat: bool = False, images: bool = False):
    """(model, tokenizer) of a model folder, or of an adapter folder on its base model;
    `chat`: the tokenizer must have a chat template (said before the weights load);
    `images`: prompts hold images (a type in models.IMAGE_TEXT_ON_GENERIC then loads on the
    generic image-text path)."""
    from slipstream.checkpoint.model_type import check_model_source, model_config
    from slipstream.sources import adapter_base, check_model_path

    src = Path(args.model)
    adapter = src if (src / "adapter_config.json").is_file() else None
    base = args.base or (adapter_base(adapter) if adapter else args.model)
    what = "--base" if args.base else f"the base in {adapter}" if adapter else "model"
    check_model_path(base, what)  # before torch: a missing path is said to be one at once
    check_model_source(base, what)  # and a model type we cannot build
    from slipstream.checkpoint.adapter import load_adapter, tokenizer_source
    from slipstream.checkpoint.hf import load_model
    from slipstream.checkpoint.tokenizer import load_tokenizer
    from slipstream.device import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    tokenizer = load_tokenizer(tokenizer_source(adapter, base) if adapter else base, what)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {args.model} has no chat template; use generate")
    dtype = resolve_dtype(getattr(args, "dtype", "auto"), device)
    from slipstream.models import image_text_implementation

    how = image_text_implementation(model_config(base, what)) if images else "auto"
    model = load_model(base, dtype=dtype, device=device, implementation=how)
    if adapter:
        load_adapter(model, adapter)
    return model.eval(), tokenizer


def check_args(args: argparse.Namespace) -> None:
    """The flags' values, before any model loads (a load takes seconds)."""
    check_options(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k,
                  num_return_sequences=getattr(args, "num_return_sequences", 1),
                  name=flag)  # fmt: skip
    if getattr(args, "batch_size", 1) < 1:
        raise ValueError(f"--batch-size is {args.batch_size}; give at least 1")
    if "" in (args.stop or []):
        raise ValueError("--stop is an empty string; give the text to stop at")


def cmd_generate(args: argparse.Namespace) -> int:
    check_args(args)
    if (args.prompt is None) == (args.input is None):
        raise ValueError('give one prompt ("text") or --input FILE.jsonl, not both or neither')
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError('the prompt is empty; give the text to complete: generate MODEL "text"')
    if args.input is not None and args.output is None:
        raise ValueError("--input needs --output FILE.jsonl for the completions")
    if args.input is None and args.output is not None:
        raise ValueError("--output is for a file of prompts: give --input FILE.jsonl too")
    images = check_images(args)
    if images and args.input is not None:
        raise ValueError("--image is for one prompt; in a jsonl file give image parts")
    if args.input is None:
        model, tokenizer = load(args, images=bool(images))
        from slipstream.generation.api import as_prompt, generate_rows

        prompt = as_prompt(args.prompt, tokenizer, args.raw)
        if images:  # a user turn of image parts, then the text
            prompt = with_images([{"role": "user", "content": args.prompt}], images)
        for c in generate_rows(model, [prompt], **generate_kwargs(args, tokenizer)):
            print(c.text.strip())
        return 0
    rows = read_jsonl(Path(args.input))
    out = output_path(args.output)
    from slipstream.checkpoint.atomic import staged_file
    from slipstream.data.images import images_relative_to

    with staged_file(out) as f:  # opened before the model loads, so nothing waits on it
        from slipstream.data.images import has_images

        image_rows = any(has_images(row) for _, row in rows if "messages" in row)
        model, tokenizer = load(args, images=image_rows)
        prompts = [row_prompt(row, tokenizer, args.raw) for _, row in rows]
        with images_relative_to(args.input):  # image parts' paths are relative to the file
            kw = generate_kwargs(args, tokenizer)
            written = write_completions(model, prompts, rows, f, args, kw)
    print(f"slipstream: {written} completions of {len(prompts)} prompts written to {out}")
    return 0


def check_images(args: argparse.Namespace) -> list[str]:
    """--image paths (each an existing file; one line otherwise), expanded."""
    images = [str(Path(p).expanduser()) for p in getattr(args, "image", None) or []]
    for path in images:
        if not Path(path).is_file():
            raise ValueError(f"--image {path}: no such image file")
    return images


def with_images(messages: list[dict], images: list[str]) -> list[dict]:
    """The messages with `images` as image parts before the first user message's text."""
    if not images:
        return messages
    out, done = [], False
    for m in messages:
        if m["role"] == "user" and not done:
            parts = [{"type": "image", "path": p} for p in images]
            m, done = {**m, "content": [*parts, {"type": "text", "text": m["content"]}]}, True
        out.append(m)
    return out


def generate_kwargs(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    return dict(sampling_kwargs(args), tokenizer=tokenizer, return_logprobs=args.logprobs,
                num_return_sequences=args.num_return_sequences)  # fmt: skip


def output_path(text: str, example: str = "gen.jsonl") -> Path:
    """--output as a file path; its folder is created when missing (before any work)."""
    out = Path(text).expanduser()
    if out.is_dir():
        raise ValueError(f"--output '{out}' is a folder; give a file such as {out / example}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"--output: cannot create the folder {out.parent} ({e.strerror})"
        ) from None
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise ValueError(f"--output: the folder {out.parent} is not writable; give another path")
    return out


# Keys of an output row: an input row's own fields keep their names beside them, so these
# must not be among them.
OUTPUT_KEYS = ("line", "sample", "text", "token_ids", "finish_reason", "logprobs")


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) of each prompt row, every row checked before a model loads."""
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
        check_row(row, f"{path}:{n}")
        rows.append((n, row))
    if not rows:
        raise ValueError(f"{path} has no prompts")
    return rows


def check_row(row: dict, where: str) -> None:
    clash = [k for k in OUTPUT_KEYS if k in row]
    if clash:
        raise ValueError(
            f"{where}: field '{clash[0]}' is also an output field ({', '.join(OUTPUT_KEYS)}); "
            "the output keeps the input's fields, so rename it"
        )
    key = next(k for k in ("messages", "input_ids", "prompt") if k in row)
    value = row[key]
    ok = {
        "messages": isinstance(value, list) and value and all(isinstance(m, dict) for m in value),
        "input_ids": isinstance(value, list) and value and all(type(t) is int for t in value),
        "prompt": isinstance(value, str) and value.strip(),
    }[key]
    if not ok:
        what = {"messages": "a non-empty list of {'role': ..., 'content': ...} objects",
                "input_ids": "a non-empty list of token ids",
                "prompt": "a non-empty string"}[key]  # fmt: skip
        raise ValueError(f"{where}: '{key}' must be {what}")


def row_prompt(row: dict, tokenizer: Any, raw: bool) -> Any:
    from slipstream.generation.api import as_prompt

    if "messages" in row:
        return row["messages"]
    if "input_ids" in row:
        return row["input_ids"]
    return as_prompt(row["prompt"], tokenizer, raw)


def write_completions(model, prompts, rows, f: TextIO, args, kw) -> int:
    """Generate in batches of --batch-size prompts with a progress bar, each batch's rows
    written (and flushed) as it finishes: after a failure or Ctrl-C they are in OUT.partial.
    Returns the completions written."""
    from tqdm import tqdm

    from slipstream.generation.api import generate_rows

    written, n = 0, kw["num_return_sequences"]
    try:
        with tqdm(total=len(prompts), desc="generate", unit="prompt", file=sys.stderr) as bar:
            for start in range(0, len(prompts), args.batch_size):
                batch = prompts[start : start + args.batch_size]
                for k, c in enumerate(generate_rows(model, batch, **kw)):
                    line, row = rows[start + c.prompt_index]
                    f.write(json.dumps({**row, **completion_row(c, line, k % n)}) + "\n")
                    written += 1
                f.flush()
                bar.update(len(batch))
    except BaseException:
        if written:
            print(f"slipstream: stopped after {written // n} of {len(prompts)} prompts; their "
                  f"completions are in {f.name}", file=sys.stderr)  # fmt: skip
        raise
    return written


def completion_row(c: Completion, line: int, sample: int) -> dict:
    row = {"line": line, "sample": sample, "text": c.text, "token_ids": c.token_ids,
           "finish_reason": c.finish_reason}  # fmt: skip
    if c.logprobs is not None:
        row["logprobs"] = c.logprobs
    return row


def cmd_chat(args: argparse.Namespace) -> int:
    """Read a message, stream the reply, repeat (generation/chat.py: the loop, its commands)."""
    check_args(args)
    images = check_images(args)
    model, tokenizer = load(args, chat=True, images=bool(images))
    from slipstream.generation.api import generate_rows
    from slipstream.generation.chat import chat_loop

    def respond(messages: list[dict], on_text) -> str:
        messages = with_images(messages, images)  # --image: before the first user message
        # A stop check (one sync) every 2 tokens: the reply appears as it is written.
        return generate_rows(model, [messages], tokenizer=tokenizer, check_every=2,
                             on_text=lambda i, new: on_text(new),
                             **sampling_kwargs(args))[0].text  # fmt: skip

    chat_loop(respond, system=args.system)
    return 0
