"""Sample replies at each eval (`train.sample_prompts`): a few fixed prompts answered greedily
by the model being trained, written to the log and to metrics.jsonl, so a run shows what the
model says as well as its loss.

Each prompt is a user message through the tokenizer's chat template (plain text when the
tokenizer has none). Greedy, so replies change only when the weights do. Under torchrun every
rank generates (FSDP2 gathers the weights on all of them first, `gathered_for_generation`) and
rank 0 logs.
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.distributed import gathered_for_generation
from slipstream.generation.api import as_prompt, generate


def sample_replies(
    model: torch.nn.Module, tokenizer: Any, prompts: list[str], max_new_tokens: int = 64
) -> list[dict[str, str]]:
    """[{"prompt", "reply"}] for each prompt: the model's greedy reply (eval mode inside)."""
    if not prompts:
        return []
    chats = [as_prompt(p, tokenizer, raw=False) for p in prompts]
    with gathered_for_generation(model):
        out = generate(model, chats, tokenizer=tokenizer, max_new_tokens=max_new_tokens)
    return [{"prompt": p, "reply": c.text.strip()} for p, c in zip(prompts, out, strict=True)]


def log_samples(log: Any, step: int, model, tokenizer: Any, prompts: list[str],
                max_new_tokens: int = 64) -> None:  # fmt: skip
    """One metrics record `{"step", "samples": [{"prompt", "reply"}, ...]}`."""
    if prompts:
        replies = sample_replies(model, tokenizer, prompts, max_new_tokens)
        log.log({"step": step, "samples": replies})
