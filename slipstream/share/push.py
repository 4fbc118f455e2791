"""`push_run(run, repo_id, ...)`: a finished run to a Hub repo, in one commit.

Order: the cheap checks (repo id, token, offline mode, the endpoint answers: one line each,
in seconds), then the staged folder in a temporary directory outside the run (a merged
model and GGUF files written there, the run's own files linked: `files.py`), then the repo
(created if new), the model card (`card.py`, which needs the repo's full id), the upload.
Whatever fails, the run folder is as it was: nothing of a push is ever written into it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from slipstream.share.base import run_base
from slipstream.share.card import build_card, run_config
from slipstream.share.files import (
    GGUF_IN_REPO,
    existing_gguf,
    result_kind,
    run_files,
    stage_links,
    staged_files,
)
from slipstream.share.upload import check_push, check_reachable, check_repo_id, create, send


def push_run(
    run: str | Path, repo_id: str, *, private: bool = False, merged: bool = False,
    gguf: list[str] | tuple[str, ...] = (), revision: str | None = None, logs: bool = False,
    stage: str | Path | None = None, what: str = "push",
) -> dict[str, Any]:  # fmt: skip
    """Upload `run` (its adapter, or with `merged` the adapter merged into its base; the
    tokenizer; a GGUF of each type in `gguf`; the card; with `logs` metrics and TensorBoard
    events) to `repo_id`. With `stage`, the folder is written there and nothing is uploaded.
    Returns {"url", "commit", "files"} (url and commit None for a stage)."""
    run = Path(run)
    if stage is None:
        check_push(repo_id, what)
    else:
        check_repo_id(repo_id, what)
    kind = result_kind(run)
    if gguf:
        from slipstream.checkpoint.gguf_export import check_type

        gguf = list(dict.fromkeys(check_type(t) for t in gguf))
    if stage is not None:
        return _stage_only(run, repo_id, Path(stage), kind, merged, gguf, logs)
    check_reachable(what)
    with tempfile.TemporaryDirectory(prefix="slipstream-push-") as tmp:
        folder = Path(tmp) / "repo"
        note = _stage(run, folder, kind, merged, gguf, logs)
        full_id = create(repo_id, private=private, revision=revision)
        _write_card(run, folder, full_id, kind, merged, note, online=True)
        commit = send(folder, full_id, revision=revision)
        return {"url": commit[0], "commit": commit[1], "files": staged_files(folder)}


def _stage_only(run: Path, repo_id: str, folder: Path, kind: str, merged: bool,
                gguf: list[str], logs: bool) -> dict[str, Any]:  # fmt: skip
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"push: --stage '{folder}' exists and is not an empty folder")
    if folder.resolve().is_relative_to(run.resolve()):
        raise ValueError(f"push: --stage '{folder}' is inside the run; give a folder outside it")
    note = _stage(run, folder, kind, merged, gguf, logs)
    _write_card(run, folder, repo_id, kind, merged, note, online=False)
    return {"url": None, "commit": None, "files": staged_files(folder)}


def _stage(run: Path, folder: Path, kind: str, merged: bool, gguf: list[str],
           logs: bool) -> str | None:  # fmt: skip
    """Fill `folder` with what goes: a merged model (returns its note), GGUFs, links."""
    note = None
    if merged and kind == "adapter":
        note = _write_merged(run, folder)
    folder.mkdir(parents=True, exist_ok=True)
    for t in gguf:
        _stage_gguf(run, folder / GGUF_IN_REPO, t)
    stage_links(run_files(run, result=not (merged and kind == "adapter"), logs=logs), folder)
    return note


def _write_merged(run: Path, folder: Path) -> str:
    """The adapter merged into its base, written as the HF model folder `folder`."""
    from slipstream.checkpoint.export import SUMMARY_FILE
    from slipstream.checkpoint.merge_adapter import merge_adapter_dir

    out = merge_adapter_dir(run, folder)
    summary = out / SUMMARY_FILE
    note = json.loads(summary.read_text())["note"]
    summary.unlink()  # the card says it; the repo holds the model alone
    return note


def _stage_gguf(run: Path, folder: Path, type: str) -> None:
    """`NAME.TYPE.gguf` and its Modelfile: `slipstream export`'s own (RUN/gguf/) when it is
    of these weights, else exported here."""
    from slipstream.checkpoint.gguf_export import export_run_gguf, modelfile_path

    name = f"{run.resolve().name}.{type}.gguf"
    folder.mkdir(parents=True, exist_ok=True)
    made = existing_gguf(run, name)
    if made is None:
        export_run_gguf(run, type, folder / name)
        return
    files = {name: made}
    if modelfile_path(made).is_file():
        files[modelfile_path(made).name] = modelfile_path(made)
    stage_links(files, folder)


def _write_card(run: Path, folder: Path, repo_id: str, kind: str, merged: bool,
                note: str | None, online: bool) -> None:  # fmt: skip
    card_kind = "merged" if merged and kind == "adapter" else kind
    base = run_base(run, run_config(run), online=online)
    staged = [*staged_files(folder), "README.md"]
    build_card(run, repo_id, staged, base, kind=card_kind, merge_note=note).save(
        folder / "README.md"
    )


def push_trained(output_dir: str | Path, repo_id: str, private: bool) -> dict[str, Any]:
    """`train.push_to_hub`: the finished run pushed; a failure says the run is kept."""
    try:
        return push_run(output_dir, repo_id, private=private, what="train.push_to_hub")
    except ValueError as e:
        raise ValueError(f"{e} (the run itself is complete in {output_dir}; retry with "
                         f"`slipstream push {output_dir} {repo_id}`)") from None  # fmt: skip
