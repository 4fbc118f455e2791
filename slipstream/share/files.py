"""Which files of a run go to the Hub, and the staged folder they go from.

A run folder holds more than its model: checkpoints (optimizer state, gigabytes), the lock,
TensorBoard and W&B logs, GGUF exports, a summary with local paths. `run_files(run, logs=)`
names exactly what is uploaded, by rule: the result (the adapter, or the full model's config
and weights), the tokenizer and processor files, the run's config (as
`slipstream_config.yaml`) and plots; with `logs`, `metrics.jsonl` and `tensorboard/` too.
`stage_links(files, folder)` links them into a fresh folder outside the run (symbolic links:
nothing copied, nothing in the run written), beside what `push` writes there itself (the
model card, a merged model, GGUF files); `upload_folder` then sends that folder whole.

No torch import here.
"""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# A full model as save_model / save_pretrained writes it (sharded or not).
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors",
               "model.safetensors.index.json", "model-*-of-*.safetensors")  # fmt: skip
# What tokenizer.save_pretrained / a processor writes, for every tokenizer kind.
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model", "sentencepiece.bpe.model",
                   "preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json")  # fmt: skip
PLOTS = ("loss.png", "reward.png")
RUN_CONFIG = "config.yaml"  # the resolved run config the trainer writes
RUN_CONFIG_IN_REPO = "slipstream_config.yaml"  # its name on the Hub: whose config it is
LOG_FILES = ("metrics.jsonl",)
TENSORBOARD_DIR = "tensorboard"
GGUF_IN_REPO = "gguf"  # as in the run (train/export): never beside adapter_config.json


def result_kind(run: Path) -> str:
    """ "adapter" or "model": what the finished run holds; a one-line error otherwise."""
    from slipstream.sources import unfinished_run

    if not run.is_dir():
        raise ValueError(f"push: '{run}' is not a folder (give a run's output_dir)")
    if all((run / f).is_file() for f in ADAPTER_FILES):
        return "adapter"
    if (run / "config.json").is_file() and _matches(run, MODEL_FILES[2:]):
        return "model"
    said = unfinished_run(run, "push")
    raise ValueError(
        said
        or f"push: '{run}' holds no adapter (adapter_config.json and "
        "adapter_model.safetensors) nor model (config.json and *.safetensors)"
    )


def run_files(run: Path, *, result: bool = True, logs: bool = False) -> dict[str, Path]:
    """{path in the repo: file in the run} of everything a push of `run` uploads from the run
    itself (`result=False`: all but the adapter or model, which a merged export replaces)."""
    kind = result_kind(run)
    patterns = [*TOKENIZER_FILES, *PLOTS]
    if result:
        patterns += ADAPTER_FILES if kind == "adapter" else MODEL_FILES
    if logs:
        patterns += LOG_FILES
    files = {p.name: p for p in sorted(run.iterdir()) if p.is_file() and _any(p.name, patterns)}
    if (run / RUN_CONFIG).is_file():
        files[RUN_CONFIG_IN_REPO] = run / RUN_CONFIG
    if logs and (run / TENSORBOARD_DIR).is_dir():
        for p in sorted((run / TENSORBOARD_DIR).rglob("*")):
            if p.is_file():
                files[p.relative_to(run).as_posix()] = p
    return files


def stage_links(files: dict[str, Path], folder: Path) -> None:
    """Link each file into `folder` under its repo path (symbolic links to absolute paths:
    `upload_folder` reads through them). A path already there (written by push) wins."""
    for name, source in files.items():
        dest = folder / name
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(source.resolve(), dest)


def staged_files(folder: Path) -> list[str]:
    """Every file under `folder` as the upload sees it (repo paths, sorted)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def existing_gguf(run: Path, name: str) -> Path | None:
    """`RUN/gguf/NAME` when `slipstream export RUN --gguf` wrote it after the run's result
    (so it is of these weights), else None."""
    path = run / GGUF_IN_REPO / name
    if not path.is_file():
        return None
    newest = max((run / f).stat().st_mtime for f in _result_names(run))
    return path if path.stat().st_mtime >= newest else None


def _result_names(run: Path) -> list[str]:
    if result_kind(run) == "adapter":
        return list(ADAPTER_FILES)
    return [p.name for p in run.iterdir() if _any(p.name, MODEL_FILES)]


def read_json(path: Path) -> dict:
    """A JSON object from `path`, {} when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _any(name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _matches(run: Path, patterns: tuple[str, ...]) -> bool:
    return any(_any(p.name, patterns) for p in run.iterdir())
