"""Generation beside the models: a KV cache every family shares (cache.py), the prefill and
decode loop (engine.py), sampling (sampling.py) and the `generate` API (api.py).

The names are imported on first use, so the CLI can import `commands` without torch."""

from typing import Any

__all__ = ["Completion", "chat_reply", "generate", "greedy_generate", "stop_token_ids"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from slipstream.generation import api

        return getattr(api, name)
    raise AttributeError(f"module 'slipstream.generation' has no attribute {name!r}")
