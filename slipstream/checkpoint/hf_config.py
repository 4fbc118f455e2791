"""config.json and generation_config.json of a saved checkpoint, in current transformers keys.

config.json is written as the installed transformers writes the same config (its config
class's `to_dict()`: `dtype`, not the deprecated `torch_dtype`; `rope_parameters`, not
`rope_theta` + `rope_scaling`), so it loads without deprecation warnings; a model type that
transformers does not know keeps its keys, with `dtype` set. Our own loader reads both spellings.

generation_config.json carries the token ids generation stops and pads with (eos, pad, bos)
and the source checkpoint's sampling defaults (temperature, top_p, ...) when it had any.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Keys of a source generation_config.json worth carrying over (the rest are transformers'
# bookkeeping, or defaults it fills in itself).
SAMPLING_KEYS = (
    "do_sample", "temperature", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty",
    "no_repeat_ngram_size", "max_new_tokens", "max_length",
)  # fmt: skip
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def current_config(hf: dict, dtype: str) -> dict:
    """`hf` (a config.json dict) as the installed transformers would write it."""
    hf = {k: v for k, v in hf.items() if k != "torch_dtype"}
    hf["dtype"] = dtype
    try:
        from transformers import AutoConfig

        config = AutoConfig.for_model(**hf)
    except Exception:  # an unknown model type, or a transformers that rejects a value
        return hf
    out = config.to_dict()
    out.pop("transformers_version", None)  # not written by transformers itself: us
    out["dtype"] = dtype
    return out


def generation_config(hf: dict, source: Path | None, tokenizer: Any = None) -> dict:
    """eos/pad/bos ids (the source's generation_config.json, else config.json, else the
    tokenizer's; pad falls back to eos, as transformers' generate does) plus the source's
    sampling defaults."""
    src: dict = {}
    if source is not None and (Path(source) / "generation_config.json").is_file():
        try:
            src = json.loads((Path(source) / "generation_config.json").read_text())
        except (OSError, ValueError):
            src = {}
    out = {k: src[k] for k in SAMPLING_KEYS if k in src}
    text = hf.get("text_config") or {}
    for key in TOKEN_KEYS:
        value = src.get(key, hf.get(key, text.get(key)))
        if value is None and tokenizer is not None:
            value = getattr(tokenizer, key, None)
        if value is not None:
            out[key] = value
    if "pad_token_id" not in out and "eos_token_id" in out:
        eos = out["eos_token_id"]
        out["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    return dict(sorted(out.items()))
