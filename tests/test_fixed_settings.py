"""What a run cannot change: a resumed checkpoint's LoRA shape (one line naming each key,
before the weights load) and a starting adapter's settings (they win, said once)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers.runs import losses, run_config

from slipstream import cli
from slipstream.train.state import list_checkpoints, write_manifest

LORA = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def lora_run(tiny_run, tmp_path_factory):
    """A LoRA run of 4 steps with checkpoints at 2 and 4 (its output is an adapter too)."""
    out = tmp_path_factory.mktemp("fixed") / "run"
    raw = {**run_config(tiny_run, out, steps=4, save_every=2, finetune="lora"), "lora": dict(LORA)}
    assert cli.main(["train", write(out.parent / "run.yaml", raw)]) == 0
    return raw


def write(path, raw) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def train_again(raw, tmp_path, capsys, finetune=None, **lora):
    raw = {**raw, "lora": {**raw["lora"], **lora}, "resume": True}
    if finetune is not None:
        raw["train"] = {**raw["train"], "finetune": finetune}
    capsys.readouterr()
    code = cli.main(["train", write(tmp_path / "again.yaml", raw)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"rank": 8}, "lora.rank: 4 in the checkpoint, 8 now"),
        ({"alpha": 16}, "lora.alpha: 8.0 in the checkpoint, 16.0 now"),
        ({"targets": ["q_proj"]}, "lora.targets: ['q_proj', 'v_proj'] in the checkpoint, "
                                  "['q_proj'] now"),
        ({"use_dora": True}, "lora.use_dora: False in the checkpoint, True now"),
        ({"finetune": "full"}, "train.finetune: 'lora' in the checkpoint, 'full' now"),
        ({"rank": 8, "alpha": 16}, "lora.rank: 4 in the checkpoint, 8 now; lora.alpha: 8.0"),
    ],
)  # fmt: skip
def test_resume_with_another_lora_shape_names_what_differs(
    lora_run, tmp_path, capsys, change, said
):
    log = Path(lora_run["output_dir"]) / "metrics.jsonl"
    before = log.read_text()
    code, err = train_again(lora_run, tmp_path, capsys, **change)
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("slipstream: error: resume: checkpoint "), err
    assert said in lines[-1] and "Traceback" not in err, err
    assert "loading the model weights" not in err  # said before the slow loads
    assert log.read_text() == before  # nothing trained


def test_resume_with_the_same_shape_still_resumes(lora_run, tmp_path, capsys):
    out = tmp_path / "copy"  # a copy: the other tests keep the run as it was
    shutil.copytree(lora_run["output_dir"], out)
    raw = {**lora_run, "output_dir": str(out), "train": {**lora_run["train"], "steps": 5}}
    code, err = train_again(raw, tmp_path, capsys, dropout=0.1)  # dropout shapes nothing
    assert code == 0, err
    assert "(step 2)" in err and sorted(losses(out)) == [1, 2, 3, 4, 5], err


def test_an_old_checkpoint_without_its_config_gets_the_shape_in_one_line(
    tiny_run, tmp_path, capsys
):
    out = tmp_path / "old"
    raw = {**run_config(tiny_run, out, steps=3, save_every=2, finetune="lora"), "lora": dict(LORA)}
    assert cli.main(["train", write(tmp_path / "run.yaml", raw)]) == 0
    checkpoint = list_checkpoints(out)[-1]
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    del state["extra"]["config"]  # as checkpoints written before it was saved there
    torch.save(state, checkpoint / "state.pt")
    write_manifest(checkpoint, 2)
    code, err = train_again(raw, tmp_path, capsys, rank=8)
    line = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err, err
    assert "lora_A.weight' of shape (4, " in line and "this model's is (8, " in line, line


def test_a_starting_adapters_settings_win_and_are_said_once(lora_run, tmp_path, capsys):
    adapter = lora_run["output_dir"]
    raw = {
        **run_config(lora_run_tiny(lora_run), tmp_path / "next", steps=1, finetune="lora"),
        "model": {**lora_run["model"], "adapter": adapter},
        "lora": {"rank": 32, "alpha": 8, "dropout": 0.1},
    }
    capsys.readouterr()
    assert cli.main(["train", write(tmp_path / "next.yaml", raw)]) == 0
    err = capsys.readouterr().err
    said = [x for x in err.splitlines() if "trains with its own LoRA settings" in x]
    assert len(said) == 1, err
    assert "lora.rank=32 (the adapter's r=4)" in said[0], said
    assert "lora.dropout=0.1 (the adapter's lora_dropout=0.0)" in said[0], said
    assert "lora.alpha" not in said[0]  # the same as the adapter's: nothing to say
    assert "lora.targets" not in said[0]  # not set by the user: no surprise
    saved = json.loads((tmp_path / "next" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 8


def test_an_adapter_without_conflicting_settings_says_nothing(lora_run, tmp_path, capsys):
    raw = {
        **run_config(lora_run_tiny(lora_run), tmp_path / "next", steps=1, finetune="lora"),
        "model": {**lora_run["model"], "adapter": lora_run["output_dir"]},
        "lora": {},
    }
    capsys.readouterr()
    assert cli.main(["train", write(tmp_path / "next.yaml", raw)]) == 0
    assert "its own LoRA settings" not in capsys.readouterr().err


def lora_run_tiny(raw):
    """run_config's (model folder, data) from a raw config."""
    return raw["model"]["path"], raw["data"]["train"]
