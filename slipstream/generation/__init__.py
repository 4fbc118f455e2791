"""Generation beside the models: a KV cache every family shares (cache.py), the prefill and
decode loop (engine.py), sampling (sampling.py) and the `generate` API (api.py)."""

from slipstream.generation.api import (
    Completion,
    chat_reply,
    generate,
    greedy_generate,
    stop_token_ids,
)

__all__ = ["Completion", "chat_reply", "generate", "greedy_generate", "stop_token_ids"]
