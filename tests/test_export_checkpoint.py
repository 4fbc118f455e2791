"""A run stopped before its end: `generate`/`export` on it say so (and that resume=true
continues it), and `export` takes its checkpoint folder: the merged model it writes is the
base plus the checkpoint's weights, computed here from state.pt on its own."""

from __future__ import annotations

import torch
from helpers.runs import run_config, train_until_signal
from safetensors.torch import load_file

from slipstream import cli
from slipstream.config import config_from_dict
from slipstream.train.state import list_checkpoints, read_state


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def interrupted(tiny_run, out, method: str):
    raw = run_config(tiny_run, out, steps=6, save_every=2)
    if method == "lora":  # run_config's default is full fine-tuning
        raw["train"]["finetune"] = "lora"
        raw["lora"] = {"rank": 4, "alpha": 8}
    summary = train_until_signal(config_from_dict(raw), at_step=3)
    assert summary["status"] == "interrupted" and summary["steps"] == 3
    return list_checkpoints(out)[-1]


def test_unfinished_run_is_said_and_its_lora_checkpoint_exports(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    ckpt = interrupted(tiny_run, run, "lora")
    assert ckpt.name == "step-000003"
    capsys.readouterr()
    commands = [["generate", "hi"], ["export", "--out", str(tmp_path / "m")],
                ["export", "--gguf", "f16"], ["export", "--gguf-adapter"]]  # fmt: skip
    for command, *rest in commands:
        argv = [command, str(run), *rest]
        assert cli.main(argv) == 2, argv
        err = one_line(capsys)
        assert "is an unfinished run (stopped at step 3 of 6" in err, (argv, err)
        assert f"{run / 'config.yaml'} resume=true" in err and f"export {ckpt} --out" in err
    assert cli.main(["generate", str(ckpt), "hi"]) == 2
    err = one_line(capsys)
    assert (
        "is a training checkpoint, not a model: `slipstream export" in err and "resume=true" in err
    )

    merged = tmp_path / "merged"
    assert cli.main(["export", str(ckpt), "--out", str(merged)]) == 0
    got = load_file(merged / "model.safetensors")
    base = load_file(tiny_run[0] / "model.safetensors")
    lora = read_state(ckpt)["model"]
    changed = 0
    for name, w in base.items():
        a = lora.get(name.replace(".weight", ".lora_A.weight"))
        want = w if a is None else w + 2.0 * lora[name.replace(".weight", ".lora_B.weight")] @ a
        torch.testing.assert_close(got[name], want, atol=1e-5, rtol=1e-5)
        changed += int(not torch.equal(got[name], w))
    assert changed > 0  # the checkpoint's LoRA is in it (alpha / r = 2)
    assert not [p for p in run.iterdir() if p.name.startswith(".export-")]  # temp folder gone

    assert cli.main(["export", str(ckpt), "--gguf", "f32"]) == 0
    assert (run / "gguf" / "run-step-000003.f32.gguf").is_file()
    assert (run / "gguf" / "run-step-000003.f32.Modelfile").is_file()


def test_full_fine_tuning_checkpoint_exports_its_weights(tiny_run, tmp_path):
    ckpt = interrupted(tiny_run, tmp_path / "run", "full")
    assert cli.main(["export", str(ckpt), "--out", str(tmp_path / "m")]) == 0
    got = load_file(tmp_path / "m" / "model.safetensors")
    state = read_state(ckpt)["model"]
    assert set(state) <= set(got) and len(state) > 10
    for name, w in state.items():
        assert torch.equal(got[name], w), name


def test_run_stopped_before_its_first_checkpoint(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("output_dir: x\n")
    (run / "metrics.jsonl").write_text("")
    assert cli.main(["export", str(run), "--out", str(tmp_path / "m")]) == 2
    assert "stopped before its first checkpoint" in one_line(capsys)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert cli.main(["export", str(plain), "--gguf", "f16"]) == 2  # a plain folder: as before
    assert "neither an adapter" in one_line(capsys)
