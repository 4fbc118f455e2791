"""The real new-tokens run of README's "New tokens" (configs/smollm2_new_tokens.yaml): teach
SmolLM2-135M-Instruct two new special tokens, `<tool_call>` and `</tool_call>`, that wrap a
JSON tool call.

Data (synthetic, seeded): a user asks for the weather, the time or a currency conversion in
one of many phrasings; the assistant's whole reply is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. The held-out rows use cities and
amounts the training rows never show, so the call must copy them from the question.

Run:
  python benchmarks/new_tokens_run.py prepare data/tools
  slipstream train configs/smollm2_new_tokens.yaml model.path=$(python -c \
      "from slipstream.checkpoint.gguf import smollm2_gguf_path as p; print(p())")
  python benchmarks/new_tokens_run.py check runs/smollm2-new-tokens data/tools/eval.jsonl

`check` greedy-decodes every held-out question with the trained adapter (our loader, which
grows the base to the adapter's tokenizer) and counts replies that start with the new
`<tool_call>` token id, end with `</tool_call>`'s, and whose JSON equals the reference.
`peft RUN DATA` loads the adapter with peft on transformers' model of the GGUF (dequantised
to a float32 HF folder, embedding resized to the adapter's tokenizer) and compares its logits
with ours on the first 8 held-out prompts, and counts its greedy replies that open with
`<tool_call>`.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TRAIN_CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Rome", "Seoul",
                "Dakar", "Hanoi", "Lagos", "Miami", "Perth", "Porto", "Riga"]  # fmt: skip
EVAL_CITIES = ["Berlin", "Nairobi", "Madrid", "Toronto", "Manila", "Bogota", "Vienna", "Dublin"]
CURRENCIES = ["USD", "EUR", "JPY", "GBP", "INR", "BRL"]
ASK = {
    "get_weather": ["What's the weather like in {city}?", "Is it raining in {city} right now?",
                    "weather {city}", "Tell me the forecast for {city}, please."],
    "get_time": ["What time is it in {city}?", "Current local time in {city}?",
                 "time in {city} pls", "Could you tell me the time in {city}?"],
    "convert": ["Convert {amount} {src} to {dst}.", "How much is {amount} {src} in {dst}?",
                "{amount} {src} -> {dst}", "I need {amount} {src} in {dst}, how much is that?"],
}  # fmt: skip
TOKENS = ("<tool_call>", "</tool_call>")


def row(rng: random.Random, cities: list[str], amounts: range) -> dict:
    name = rng.choice(sorted(ASK))
    if name == "convert":
        src, dst = rng.sample(CURRENCIES, 2)
        args = {"amount": rng.choice(amounts), "from": src, "to": dst}
        question = rng.choice(ASK[name]).format(amount=args["amount"], src=src, dst=dst)
    else:
        args = {"city": rng.choice(cities)}
        question = rng.choice(ASK[name]).format(**args)
    reply = f"{TOKENS[0]}{json.dumps({'name': name, 'arguments': args})}{TOKENS[1]}"
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": reply}]}  # fmt: skip


def prepare(out: Path, train_rows: int, eval_rows: int) -> None:
    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    train = [row(rng, TRAIN_CITIES, range(1, 500)) for _ in range(train_rows)]
    held = [row(rng, EVAL_CITIES, range(500, 1000)) for _ in range(eval_rows)]
    for name, rows in (("train", train), ("eval", held)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{out}: {train_rows} train rows, {eval_rows} held-out rows")


def check(run: Path, data: Path, base: str | None) -> dict:
    import torch

    from slipstream.checkpoint.adapter import load_adapter
    from slipstream.checkpoint.hf import load_model
    from slipstream.checkpoint.tokenizer import load_tokenizer
    from slipstream.generation import generate
    from slipstream.sources import adapter_base

    tokenizer = load_tokenizer(str(run))
    model = load_adapter(load_model(base or adapter_base(run), dtype=torch.float32), run).eval()
    open_id, close_id = tokenizer.convert_tokens_to_ids(list(TOKENS))
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    prompts = [r["messages"][:1] for r in rows]
    with torch.no_grad():
        replies = generate(model, prompts, tokenizer=tokenizer, max_new_tokens=48)
    counts = {"rows": len(rows), "opens": 0, "closes": 0, "exact": 0}
    for r, c in zip(rows, replies, strict=True):
        ids = c.token_ids
        want = r["messages"][1]["content"]
        counts["opens"] += bool(ids) and ids[0] == open_id
        counts["closes"] += close_id in ids
        text = tokenizer.decode(ids, skip_special_tokens=False)
        exact = text.split(TOKENS[1])[0] + TOKENS[1] == want
        counts["exact"] += exact
        if not exact:
            print(json.dumps({"question": r["messages"][0]["content"], "reply": text}))
    example = tokenizer.decode(replies[0].token_ids, skip_special_tokens=False)
    print(json.dumps({**counts, "first_reply": example}))
    return counts


def peft_check(run: Path, data: Path, rows: int = 8) -> dict:
    import tempfile
    import warnings

    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from slipstream.checkpoint.adapter import load_adapter
    from slipstream.checkpoint.gguf import gguf_tokenizer, smollm2_gguf_path
    from slipstream.checkpoint.hf import load_model, save_model
    from slipstream.checkpoint.tokenizer import load_tokenizer
    from slipstream.ops.packing import SeqInfo

    gguf, folder = smollm2_gguf_path(), tempfile.mkdtemp()
    save_model(load_model(str(gguf), dtype=torch.float32), folder, tokenizer=gguf_tokenizer(gguf))
    tokenizer = load_tokenizer(str(run))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        hf.resize_token_embeddings(len(tokenizer))
        theirs = peft.PeftModel.from_pretrained(hf, run).eval()
    ours = load_adapter(load_model(str(gguf), dtype=torch.float32), run).eval()
    worst, opens = 0.0, 0
    for line in data.read_text().splitlines()[:rows]:
        ids = tokenizer.apply_chat_template(json.loads(line)["messages"][:1], tokenize=True,
                                            add_generation_prompt=True)  # fmt: skip
        ids_T = torch.tensor(ids if isinstance(ids, list) else ids["input_ids"])
        with torch.no_grad():
            want = theirs(input_ids=ids_T[None]).logits[0]
            got = ours(ids_T, SeqInfo.from_lengths([len(ids_T)]))
            worst = max(worst, float((want - got).abs().max()))
            out = theirs.generate(input_ids=ids_T[None], max_new_tokens=30, do_sample=False)
        opens += tokenizer.decode(out[0, len(ids_T) :]).startswith(TOKENS[0])
    result = {"rows": rows, "max_abs_logit_diff": worst, "peft_generate_opens": opens}
    print(json.dumps(result))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("out", type=Path)
    p.add_argument("--train-rows", type=int, default=240)
    p.add_argument("--eval-rows", type=int, default=32)
    c = sub.add_parser("check")
    c.add_argument("run", type=Path)
    c.add_argument("data", type=Path)
    c.add_argument("--base", default=None, help="the base model (default: the adapter's)")
    f = sub.add_parser("peft")
    f.add_argument("run", type=Path)
    f.add_argument("data", type=Path)
    args = ap.parse_args()
    if args.command == "prepare":
        prepare(args.out, args.train_rows, args.eval_rows)
    elif args.command == "check":
        check(args.run, args.data, args.base)
    else:
        peft_check(args.run, args.data)


if __name__ == "__main__":
    main()
