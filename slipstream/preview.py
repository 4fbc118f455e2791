"""`slipstream preview CONFIG`: the data as a run will see it, before any weight is loaded.

Loads the tokenizer and the data only (the same `build_data` the trainer calls, so the
numbers are the run's), then prints each source's row format, one tokenized example with its
trained tokens marked (green on a terminal, [brackets] otherwise), the data report, token
counts, packing efficiency and the steps an epoch takes.
"""

from __future__ import annotations

import math
from typing import Any

GREEN, RESET = "\033[32m", "\033[0m"


def preview(cfg: Any, *, color: bool = False) -> str:
    """The preview text for run config `cfg` (RunConfig)."""
    from slipstream.checkpoint.tokenizer import load_tokenizer
    from slipstream.train.setup import add_tokens, build_data, set_chat_template

    tokenizer = load_tokenizer(cfg.model.path)
    set_chat_template(tokenizer, cfg.data.chat_template)
    add_tokens(tokenizer, cfg.model.add_tokens)
    data = build_data(cfg, tokenizer)
    t, report = cfg.train, data.report
    from slipstream.checkpoint.model_type import check_model_source

    m = cfg.model
    path = check_model_source(m.path, "model.path", m.implementation, m.trust_remote_code)
    lines = [f"model {path or m.path + ': model_type known after download'}"]
    lines += [f"source {src}: format {fmt}" for src, fmt in data.formats.items()]
    marks = "green" if color else "[brackets]"
    lines += ["", f"example 1 of {len(data.train)}, trained tokens in {marks}:"]
    lines += [marked_text(tokenizer, data.train[0], color=color).rstrip("\n"), ""]
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(report.skipped.items())) or "none"
    lines.append(
        f"rows {report.rows}: kept {report.kept}, skipped {sum(report.skipped.values())} "
        f"({skipped}), truncated {report.truncated}, dropped {report.dropped} as too long"
    )
    if report.first_skip:
        lines.append(f"first skipped: {report.first_skip}")
    lengths = sorted(len(ex) for ex in data.train)
    lines.append(
        f"tokens: {report.tokens:,} in {len(lengths):,} train examples "
        f"({100.0 * report.target_tokens / max(report.tokens, 1):.0f}% trained), "
        f"shortest {lengths[0]}, median {lengths[len(lengths) // 2]}, longest {lengths[-1]}; "
        f"{len(data.eval):,} eval examples"
    )
    lines.append(
        f"packing: {len(data.train_batches):,} micro-batches of up to {t.tokens_per_batch:,} "
        f"tokens, {data.packing_efficiency:.1%} full"
    )
    per_epoch = math.ceil(len(data.train_batches) / t.grad_accum)
    plan = f"steps: an epoch is {per_epoch:,} optimizer steps (grad_accum {t.grad_accum}"
    plan += ", one process; N processes under torchrun divide it by N)"
    if t.steps:
        plan += f"; train.steps = {t.steps} is {t.steps / per_epoch:.2f} epochs"
    else:
        epochs = t.epochs or 1.0
        plan += f"; {epochs:g} epochs = {math.ceil(epochs * per_epoch):,} steps"
    lines.append(plan)
    return "\n".join(lines)


def marked_text(tokenizer: Any, example: Any, *, color: bool = False) -> str:
    """The example's text, decoded in runs of trained / untrained tokens, the trained runs
    marked. `trainable[t]` says token t is a target."""
    pieces, start = [], 0
    flags = example.trainable
    # An image's feature rows show as one marker each: its size after resizing, its rows.
    image_id = getattr(example, "image_token_id", None)
    kinds = [(f, i == image_id) for f, i in zip(flags, example.input_ids)]
    markers = _image_markers(example, image_id)
    for i in range(1, len(flags) + 1):
        if i == len(flags) or kinds[i] != kinds[start]:
            if kinds[start][1]:
                pieces += [markers[t] for t in range(start, i) if t in markers]
                start = i
                continue
            text = tokenizer.decode(example.input_ids[start:i])
            if flags[start]:
                text = f"{GREEN}{text}{RESET}" if color else f"[{text}]"
            pieces.append(text)
            start = i
    return "".join(pieces)


def _image_markers(example: Any, image_id: int | None) -> dict[int, str]:
    """{first feature row of each image: its marker (size after resizing, rows)}."""
    if image_id is None:
        return {}
    rows = [t for t, i in enumerate(example.input_ids) if i == image_id]
    out, offset = {}, 0
    for k, ((h, w), n) in enumerate(zip(example.sizes, example.image_tokens)):
        if offset + n <= len(rows):
            out[rows[offset]] = (
                f"<image {k + 1}: {h}x{w}, rows {rows[offset]}-{rows[offset + n - 1]}>"
            )
        offset += n
    return out
