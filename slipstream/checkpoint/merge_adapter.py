"""`merge_adapter_dir`: a PEFT adapter folder merged into its base and exported (what
`slipstream export ADAPTER --out DIR` and `slipstream push --merged` do). Torch is imported
only after every path is checked, so a wrong one is said in a second."""

from __future__ import annotations

import os
from pathlib import Path

from slipstream.sources import adapter_base, check_adapter_dir, check_model_path


def merge_adapter_dir(
    adapter_dir: str | os.PathLike, directory: str | os.PathLike, base: str | None = None,
    force: bool = False,
) -> Path:  # fmt: skip
    """`slipstream export ADAPTER --out DIR`: a PEFT adapter folder merged into its base (the
    one it records, or `base`) and exported to `directory`; every path is checked before a
    weight loads."""
    adapter = check_adapter_dir(adapter_dir, "export")
    base_given = base is not None
    base = base or adapter_base(adapter)
    check_model_path(base, "--base" if base_given else f"export: the base in {adapter}")
    from slipstream.checkpoint.adapter import load_adapter, tokenizer_source
    from slipstream.checkpoint.export import check_out_dir, export_merged
    from slipstream.checkpoint.hf import load_model
    from slipstream.checkpoint.tokenizer import load_tokenizer

    out = check_out_dir(directory, force, reads=(adapter, Path(base)))  # before loading
    tokenizer = load_tokenizer(tokenizer_source(adapter, base))
    model = load_model(base)
    load_adapter(model, adapter)
    return export_merged(model, out, tokenizer=tokenizer, force=force)  # whole, or not at all
