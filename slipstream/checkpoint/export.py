"""Merged export: fold the LoRA deltas into the base weights and write a plain HF checkpoint.

A QLoRA base is first dequantised (to the compute dtype: bf16 on GPU, float32 on CPU) and
never re-quantised, so the merged model is a full-precision checkpoint that `transformers`
loads unchanged. What was done is written beside it in `export_summary.json`.

The text model of a multimodal checkpoint (Gemma 3 4B+) exports as that multimodal model:
save_model copies the vision tower, the projector and the image processor's files from the
source checkpoint; the summary says how many tensors came from where. A failed export leaves
nothing behind: it is written into a hidden folder and moved into place when complete.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from slipstream.checkpoint.atomic import atomic_write_text, fsync_path
from slipstream.checkpoint.hf import passthrough_names, save_model
from slipstream.models.common import CausalLM

SUMMARY_FILE = "export_summary.json"


def export_merged(model: CausalLM, directory: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Merge LoRA (if any) into `model` in place; save it and the tokenizer at `directory`.
    Without `tokenizer`, the tokenizer of the checkpoint `load_model` read the model from."""
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ValueError(f"export: '{out}' is a file; give a folder for the merged model")
    if tokenizer is None and getattr(model, "source", None):
        from slipstream.checkpoint.hf import load_tokenizer

        try:
            tokenizer = load_tokenizer(model.source)
        except ValueError:  # a checkpoint folder without tokenizer files: weights only
            tokenizer = None
    out.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its folder is private (0700); this one gets the umask's mode.
    partial = out.parent / f".{out.name}.partial-{secrets.token_hex(4)}"
    partial.mkdir()
    try:
        _write_export(model, partial, tokenizer)
        if out.exists():  # an existing folder: each file replaced whole
            for item in partial.iterdir():
                os.replace(item, out / item.name)
        else:
            os.replace(partial, out)
        fsync_path(out.parent)  # the renames themselves survive a crash
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def _write_export(model: CausalLM, out: Path, tokenizer: Any) -> None:
    from slipstream.peft.lora import lora_modules, merge_lora
    from slipstream.peft.lora_experts import expert_lora_modules
    from slipstream.peft.qlora import dequantize_model, has_4bit_weights

    dequantized = has_4bit_weights(model)
    if dequantized:
        dequantize_model(model)
    merged = [*lora_modules(model), *expert_lora_modules(model)]
    if merged:
        merge_lora(model)  # expert LoRA too
    save_model(model, out, tokenizer=tokenizer)
    copied = passthrough_names(model)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    summary = {
        "lora_modules_merged": len(merged),
        "base_dequantized_from_nf4": dequantized,
        "dtype": dtype,
        "note": (
            f"NF4 base dequantised to {dtype}, LoRA delta added in float32 and rounded once "
            f"to {dtype}; not re-quantised."
            if dequantized
            else f"LoRA delta added in float32, rounded once into the {dtype} base weights."
        ),
    }
    if copied:
        summary["copied_from_source"] = {
            "checkpoint": str(model.checkpoint_path),
            "tensors": len(copied),
            "note": "not trained (vision tower, projector): copied unchanged",
        }
    atomic_write_text(out / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
