"""Merged export: fold the LoRA deltas into the base weights and write a plain HF checkpoint.

A QLoRA base is first dequantised (to the compute dtype) and never re-quantised (an FP8
base was dequantised while it loaded: checkpoint/fp8.py), so the merged model is a
full-precision checkpoint that `transformers` loads unchanged. What was done is written
beside it in `export_summary.json`.

The text model of a multimodal checkpoint (Gemma 3 4B+) exports as that multimodal model:
save_model copies the vision tower, the projector and the image processor's files from the
source checkpoint; the summary says how many tensors came from where. A failed export leaves
nothing behind: it is written into a hidden folder and moved into place when complete. A
non-empty target folder is refused, or with `force` replaced whole (swapped, never merged
file by file: that once left an old model's files mixed with a new one's).
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


def export_merged(
    model: CausalLM, directory: str | os.PathLike, tokenizer: Any = None, force: bool = False
) -> Path:
    """Merge LoRA (if any) into `model` in place; save it and the tokenizer at `directory`.
    Without `tokenizer`, the tokenizer of the checkpoint `load_model` read the model from.
    `directory` must be new or empty; with `force` a non-empty one is replaced whole."""
    out = check_out_dir(directory, force)
    if tokenizer is None and getattr(model, "source", None):
        from slipstream.checkpoint.tokenizer import load_tokenizer

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
        replace_folder(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def check_out_dir(
    directory: str | os.PathLike, force: bool, reads: tuple[str | os.PathLike, ...] = ()
) -> Path:
    """The export's folder: new or empty, or with `force` any folder but one that holds what
    the export reads (`reads`: the adapter, the base), which replacing it would delete."""
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ValueError(f"export: --out '{out}' is a file; give a folder for the merged model")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return out
    if not force:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ValueError(
            f"export: --out '{out}' is not empty ({len(entries)} entries: {shown}); give a new "
            "folder, or pass --force (force=True) to replace it whole"
        )
    mine = out.resolve()
    for source in reads:
        source = Path(source).expanduser().resolve()
        if source == mine or mine in source.parents:
            raise ValueError(
                f"export: --out '{out}' holds {source}, which this export reads; "
                "--force would delete it: give another folder"
            )
    return out


def replace_folder(new: Path, out: Path) -> None:
    """Put folder `new` at `out`: an existing `out` is renamed aside, `new` renamed in, then
    the old one removed; if the second rename fails the old folder is put back. A reader sees
    the old folder or the new one, never a mix of their files."""
    if not out.exists():
        os.replace(new, out)
        fsync_path(out.parent)  # the rename itself survives a crash
        return
    old = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
    os.rename(out, old)
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(old, out)
        raise
    fsync_path(out.parent)
    shutil.rmtree(old, ignore_errors=True)


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
            if merged
            else f"no LoRA to merge: the {dtype} weights as they are."
        ),
    }
    fp8 = getattr(model, "base_quantization", None)  # checkpoint/fp8.py: dequantised at load
    if fp8:
        summary["base_dequantized_from_fp8"] = fp8
        summary["note"] = f"base was {fp8}, not re-quantised; " + summary["note"]
    if copied:
        summary["copied_from_source"] = {
            "checkpoint": str(model.checkpoint_path),
            "tensors": len(copied),
            "note": "not trained (vision tower, projector): copied unchanged",
        }
    atomic_write_text(out / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
