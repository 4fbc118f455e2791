"""`slipstream push` and `train.push_to_hub`: the staged folder is exactly the intended file
set, the model card parses with huggingface_hub's own metadata reader and has its fields,
the upload goes through huggingface_hub against a LOCAL STAND-IN for the Hub
(tests/helpers/hub_standin.py: not the Hub; nothing here contacts it), and every failure is
one line with exit 2 and the run folder untouched."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.hub_standin import HubStandIn
from helpers.runs import run_config
from huggingface_hub import metadata_load

from slipstream.config import config_from_dict
from slipstream.share.push import push_run

ROOT = Path(__file__).resolve().parent.parent
# What a push of a LoRA run sends, and nothing else (its checkpoints, lock, TensorBoard
# events, metrics, summary and GGUF exports stay home).
ADAPTER_PUSH = {"README.md", "adapter_config.json", "adapter_model.safetensors",
                "chat_template.jinja", "loss.png", "slipstream_config.yaml", "tokenizer.json",
                "tokenizer_config.json"}  # fmt: skip


@pytest.fixture(scope="module")
def lora_run(tiny_run, tmp_path_factory):
    """A finished tiny LoRA run with a mid-run checkpoint and TensorBoard events; its base
    folder's card says `license: mit`."""
    from slipstream.train import train

    model_dir, _ = tiny_run
    (model_dir / "README.md").write_text("---\nlicense: mit\n---\n# tiny base\n")
    out = tmp_path_factory.mktemp("push") / "run"
    raw = run_config(tiny_run, out, save_every=3, report_to=["tensorboard"])
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8}
    train(config_from_dict(raw))
    return out


def snapshot(folder: Path) -> dict[str, tuple[int, float]]:
    """Every file and folder under `folder` with its size and mtime."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}  # fmt: skip


def copy_run(run: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "run"
    shutil.copytree(run, dest)
    return dest


def test_staged_folder_is_exactly_the_intended_files(lora_run, tmp_path):
    run = copy_run(lora_run, tmp_path)
    assert (run / "checkpoints").is_dir() and any((run / "tensorboard").iterdir())
    (run / ".slipstream.lock").write_text("{}")  # as a run in progress leaves it
    (run / "notes.txt").write_text("mine")
    (run / "gguf").mkdir()
    (run / "gguf" / "old.q8_0.gguf").write_bytes(b"GGUF")  # not asked for: stays home
    before = snapshot(run)

    done = push_run(run, "me/tiny", stage=tmp_path / "stage")
    assert set(done["files"]) == ADAPTER_PUSH
    assert done["url"] is None  # nothing uploaded
    staged = tmp_path / "stage"
    assert (staged / "adapter_model.safetensors").read_bytes() == (
        run / "adapter_model.safetensors"
    ).read_bytes()
    assert (staged / "slipstream_config.yaml").read_text() == (run / "config.yaml").read_text()

    logs = push_run(run, "me/tiny", stage=tmp_path / "logs", logs=True)["files"]
    events = {f"tensorboard/{p.name}" for p in (run / "tensorboard").iterdir()}
    assert set(logs) == ADAPTER_PUSH | {"metrics.jsonl"} | events
    assert snapshot(run) == before  # the run folder untouched


def test_model_card_metadata_and_figures(lora_run, tmp_path):
    run = copy_run(lora_run, tmp_path)
    with (run / "metrics.jsonl").open("a") as f:  # as train.eval_tasks logs them
        f.write(json.dumps({"step": 3, "eval/tiny_mc/acc,none": 0.25}) + "\n")
        f.write(json.dumps({"step": 6, "eval/tiny_mc/acc,none": 0.5,
                            "eval/tiny_mc/acc_stderr,none": 0.125,
                            "eval/tiny_ppl/word_perplexity,none": 17.5}) + "\n")  # fmt: skip
        # evaluation.tasks.task_metrics' own keys: ",none" dropped, another filter kept
        f.write(json.dumps({"step": 6, "eval/tiny_gen/exact_match,strict-match": 0.75,
                            "eval/tiny_mc2/acc": 0.375}) + "\n")  # fmt: skip
    push_run(run, "me/tiny-chat", stage=tmp_path / "stage")
    readme = tmp_path / "stage" / "README.md"
    meta = metadata_load(readme)
    assert meta["library_name"] == "peft"
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["license"] == "mit"  # the base's
    assert {"slipstream", "sft", "lora"} <= set(meta["tags"])
    assert "base_model" not in meta and "datasets" not in meta  # local base, local data
    text = readme.read_text()
    summary = json.loads((run / "summary.json").read_text())
    before, after = summary["eval_loss_before"], summary["eval_loss_after"]
    assert f"| loss | {before:.4g} | {after:.4g} |" in text
    assert "| tiny_mc | acc | 0.5 ± 0.125 | 6 |" in text  # the last eval, with its stderr
    assert "| tiny_ppl | word_perplexity | 17.5 | 6 |" in text
    assert "| tiny_gen | exact_match,strict-match | 0.75 | 6 |" in text
    assert "| tiny_mc2 | acc | 0.375 | 6 |" in text
    assert f"| train examples | {summary['train_examples']} examples" in text
    assert "![training and held-out loss](loss.png)" in text
    assert 'AutoPeftModelForCausalLM.from_pretrained("me/tiny-chat")' in text


def test_card_names_a_hub_base_its_license_and_hub_datasets(tmp_path, monkeypatch):
    """A base recorded as a hub id: base_model is it, the license comes from the hub cache's
    copy of its card; data sources that are hub ids become `datasets`."""
    from huggingface_hub import constants

    from slipstream.share.base import run_base
    from slipstream.share.card import build_card, run_config

    cache = tmp_path / "hub"
    snap = cache / "models--acme--base-7b" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    (cache / "models--acme--base-7b" / "refs").mkdir()
    (cache / "models--acme--base-7b" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    run = tmp_path / "adapter"
    run.mkdir()
    adapter = {"base_model_name_or_path": "acme/base-7b"}
    (run / "adapter_config.json").write_text(json.dumps(adapter))
    (run / "config.yaml").write_text(
        "model: {path: acme/base-7b}\ndata: {train: [acme/chats, local.jsonl], eval: acme/held}\n"
        "lora: {method: lora, rank: 8, alpha: 16}\ntrain: {objective: dpo}\n"
    )
    base = run_base(run, run_config(run))
    assert (base.hub_id, base.license) == ("acme/base-7b", "apache-2.0")
    build_card(run, "me/x", ["adapter_config.json"], base, kind="adapter").save(run / "card.md")
    meta = metadata_load(run / "card.md")
    assert meta["base_model"] == "acme/base-7b"
    assert meta["license"] == "apache-2.0"
    assert meta["datasets"] == ["acme/chats", "acme/held"]
    assert "dpo" in meta["tags"]


def test_merged_push_stages_the_merged_model(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    run = copy_run(lora_run, tmp_path)
    before = snapshot(run)
    files = set(push_run(run, "me/tiny", merged=True, stage=tmp_path / "stage")["files"])
    adapter = {"adapter_config.json", "adapter_model.safetensors"}
    assert files == ADAPTER_PUSH - adapter | {"config.json", "generation_config.json",
                                              "model.safetensors"}  # fmt: skip
    assert metadata_load(tmp_path / "stage" / "README.md")["library_name"] == "transformers"
    AutoModelForCausalLM.from_pretrained(tmp_path / "stage")  # a whole model, loadable
    assert snapshot(run) == before


def test_gguf_of_the_run_is_reused_when_current(lora_run, tmp_path):
    """--gguf TYPE takes RUN/gguf/RUN.TYPE.gguf when `slipstream export` made it after the
    run's result (linked, not rebuilt), into gguf/ of the repo with its Modelfile."""
    from slipstream.cli import main

    run = copy_run(lora_run, tmp_path)
    assert main(["export", str(run), "--gguf", "f16"]) == 0
    made = run / "gguf" / "run.f16.gguf"
    files = push_run(run, "me/tiny", gguf=["F16"], stage=tmp_path / "stage")["files"]
    assert set(files) == ADAPTER_PUSH | {"gguf/run.f16.gguf", "gguf/run.f16.Modelfile"}
    assert (tmp_path / "stage" / "gguf" / "run.f16.gguf").resolve() == made.resolve()
    assert "gguf" in metadata_load(tmp_path / "stage" / "README.md")["tags"]


def hub_env(hub: HubStandIn, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": hub.token, "HF_HOME":
           str(tmp_path / "hf_home"), "HF_HUB_DISABLE_XET": "1", "PYTHONPATH": str(ROOT),
           "HF_HUB_DISABLE_TELEMETRY": "1", **extra}  # fmt: skip
    env.pop("HF_HUB_OFFLINE", None)
    return env


def slipstream(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slipstream", *args], env=env, text=True,
                          capture_output=True, timeout=120)  # fmt: skip


def test_push_uploads_one_commit_to_the_standin(lora_run, tmp_path):
    before = snapshot(lora_run)
    with HubStandIn() as hub:
        hub.model_info["acme/none"] = {}
        env = hub_env(hub, tmp_path)
        done = slipstream("push", str(lora_run), "tiny-chat", "--private", env=env)
        assert done.returncode == 0, done.stderr
        assert f"pushed 8 files to {hub.url}/standin-user/tiny-chat" in done.stdout
        again = slipstream("push", str(lora_run), "standin-user/tiny-chat", "--revision", "dev",
                           env=env)  # fmt: skip
        assert again.returncode == 0, again.stderr
    assert hub.repos == {"standin-user/tiny-chat": {"private": True, "branches": {"main", "dev"}}}
    first, second = hub.commits
    assert first.repo == second.repo == "standin-user/tiny-chat"
    assert (first.revision, second.revision) == ("main", "dev")
    assert set(first.files) == ADAPTER_PUSH
    for name, data in first.files.items():  # the bytes of the run's own files
        source = lora_run / ("config.yaml" if name == "slipstream_config.yaml" else name)
        if name != "README.md":
            assert hashlib.sha256(data).digest() == hashlib.sha256(source.read_bytes()).digest()
    (tmp_path / "README.md").write_bytes(first.files["README.md"])
    meta = metadata_load(tmp_path / "README.md")
    assert meta["library_name"] == "peft" and meta["license"] == "mit"
    assert b'from_pretrained("standin-user/tiny-chat")' in first.files["README.md"]
    assert any(r.endswith("lfs/objects/batch") for r in hub.requests)  # the weights went LFS
    assert snapshot(lora_run) == before


def error_of(done: subprocess.CompletedProcess) -> str:
    lines = [x for x in done.stderr.splitlines() if x.startswith("slipstream: error: ")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    return lines[0]


def test_bad_arguments_are_one_line(lora_run, tmp_path, capsys):
    from slipstream.cli import main

    before = snapshot(lora_run)
    for bad in ("a/b/c", "me/bad--name", "me/-x", "x" * 97, "me/"):
        assert main(["push", str(lora_run), bad, "--stage", str(tmp_path / "s")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"push: '{bad}' is not a Hub repo id" in err[0], err
    assert main(["push", str(tmp_path), "me/x", "--stage", str(tmp_path / "s")]) == 2
    assert "holds no adapter" in capsys.readouterr().err
    assert main(["push", str(lora_run), "me/x", "--gguf", "q9", "--stage", str(tmp_path)]) == 2
    assert "unknown GGUF type 'q9'" in capsys.readouterr().err
    assert main(["push", str(lora_run), "me/x", "--stage", str(lora_run / "stage")]) == 2
    assert "inside the run" in capsys.readouterr().err
    assert not (tmp_path / "s").exists() and snapshot(lora_run) == before


def test_push_failures_are_one_line(lora_run, tmp_path):
    """A bad repo id, no token, a refused token, offline mode, an unreachable endpoint: one
    line each, exit 2, nothing created on the stand-in, the run untouched."""
    before = snapshot(lora_run)
    with HubStandIn() as hub:
        env = hub_env(hub, tmp_path)
        run = str(lora_run)
        assert "is not a Hub repo id" in error_of(slipstream("push", run, "a/b/c", env=env))
        no_token = {k: v for k, v in env.items() if k != "HF_TOKEN"}
        said = error_of(slipstream("push", run, "me/x", env=no_token))
        assert "no Hugging Face token" in said and "hf auth login" in said
        said = error_of(slipstream("push", run, "me/x", env={**env, "HF_TOKEN": "hf_wrong"}))
        assert "refused the token (401" in said
        said = error_of(slipstream("push", run, "me/x", env={**env, "HF_HUB_OFFLINE": "1"}))
        assert "HF_HUB_OFFLINE" in said
        assert hub.commits == [] and hub.repos == {}
    # The stand-in is gone: nothing listens on its port any more.
    said = error_of(slipstream("push", run, "me/x", env=env))
    assert "the Hub cannot be reached" in said and hub.url in said
    assert snapshot(lora_run) == before


def test_push_error_names_the_cause_inside_a_wrapper():
    """huggingface_hub wraps a failed LFS upload in RuntimeError("Error while uploading");
    the line says the HTTP error under it."""
    from huggingface_hub.utils import HfHubHTTPError

    from slipstream.share.upload import push_error

    class Response:
        status_code = 403
        headers: dict = {}
        request = None

    try:
        try:
            raise HfHubHTTPError("403 Forbidden", response=Response(), server_message="no")
        except HfHubHTTPError as e:
            raise RuntimeError("Error while uploading 'a' to the Hub.") from e
    except RuntimeError as wrapped:
        said = push_error(wrapped, "org/x")
    assert said.startswith("push: the token may not write to 'org/x' (403: no)")


def test_train_push_to_hub(tiny_run, tmp_path, monkeypatch):
    """train.push_to_hub: a missing token stops the run before it starts; with one, the
    finished run is pushed (rank 0) and its summary says where."""
    from huggingface_hub import constants

    from slipstream.train import train

    with pytest.raises(ValueError, match="push_to_hub: 'a/b/c' is not a Hub repo id"):
        config_from_dict(run_config(tiny_run, tmp_path / "x", push_to_hub="a/b/c"))
    raw = run_config(tiny_run, tmp_path / "out", push_to_hub="me/pushed", push_private=True,
                     report_to=[])  # fmt: skip
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(ValueError, match="train.push_to_hub: no Hugging Face token"):
        train(config_from_dict(raw))
    assert not (tmp_path / "out").exists()  # said before the run, nothing written
    with HubStandIn() as hub:
        monkeypatch.setenv("HF_TOKEN", hub.token)
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        summary = train(config_from_dict(raw))
    assert summary["pushed"] == f"{hub.url}/me/pushed"
    assert hub.repos["me/pushed"]["private"]
    (commit,) = hub.commits
    assert {"config.json", "model.safetensors", "README.md"} <= set(commit.files)
    assert not any(f.startswith(("checkpoints", "tensorboard")) for f in commit.files)
    assert b"library_name: transformers" in commit.files["README.md"]
