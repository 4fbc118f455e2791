"""Runs people watch and stop (issue 15): exit status and the signal's name on an interrupted
run, resume=true/auto, nothing in output_dir before the first result, report_to (TensorBoard,
W&B offline), step/total and ETA on every line off a terminal, save_best, the loss plot.
Tiny random Llama on CPU (tests/helpers/runs.py)."""

from __future__ import annotations

import json
import re
import signal

import pytest
import yaml
from helpers.runs import losses, run_config, train_until_signal

from slipstream import cli
from slipstream.config import config_from_dict
from slipstream.train import train
from slipstream.train.state import list_checkpoints


def write_yaml(path, raw):
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_run_exits_128_plus_signal_naming_it(tiny_run, tmp_path, capsys, signum, code):
    out = tmp_path / "run"
    raw = run_config(tiny_run, out, steps=6)
    config = write_yaml(tmp_path / "run.yaml", raw)
    got = train_until_signal(
        config_from_dict(raw),
        at_step=2,
        signum=signum,
        run=lambda: cli.main(["train", str(config)]),
    )
    assert got == code
    said = capsys.readouterr()
    name = signal.Signals(signum).name
    assert f"stopped by {name} at step 2; checkpoint saved" in said.err
    assert f"slipstream: interrupted by {name} at step 2" in said.out
    assert [p.name for p in list_checkpoints(out)] == ["step-000002"]
    assert json.loads((out / "summary.json").read_text())["signal"] == name


def test_resume_true_on_an_empty_dir_is_an_error_and_auto_starts_fresh(tiny_run, tmp_path, capsys):
    out = tmp_path / "run"
    raw = {**run_config(tiny_run, out, steps=2), "resume": True}
    assert cli.main(["train", str(write_yaml(tmp_path / "run.yaml", raw))]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"slipstream: error: resume=true but output_dir '{out}' holds no checkpoint; set "
        "resume=auto to resume when there is one and start fresh otherwise"
    )
    assert not out.exists()  # nothing left behind
    raw = {**run_config(tiny_run, out, steps=4, save_every=2), "resume": "auto"}
    assert cli.main(["train", str(write_yaml(tmp_path / "run.yaml", raw))]) == 0
    assert sorted(losses(out)) == [1, 2, 3, 4]
    raw["train"]["steps"] = 6  # auto with a checkpoint: resumes from it
    assert cli.main(["train", str(write_yaml(tmp_path / "run.yaml", raw))]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert sorted(losses(out)) == list(range(1, 7))


def test_a_failed_run_leaves_no_folder(tiny_run, tmp_path, capsys):
    """Fails after the tokenizer and data loaded (no example fits 3 tokens): no output_dir,
    not even config.yaml; a run that gets to a result writes config.yaml with it."""
    out = tmp_path / "deep" / "run"
    raw = run_config(tiny_run, out, steps=1, tokens_per_batch=3)
    assert cli.main(["train", str(write_yaml(tmp_path / "run.yaml", raw))]) == 2
    capsys.readouterr()
    assert not (tmp_path / "deep").exists()
    train(config_from_dict(run_config(tiny_run, out, steps=1)))
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["steps"] == 1


def test_report_to_tensorboard_and_wandb_offline(tiny_run, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "watched"
    raw = run_config(tiny_run, out, steps=3)
    raw["train"]["report_to"] = ["tensorboard", "wandb"]
    train(config_from_dict(raw))
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    board = {e.step: e.value for e in events.Scalars("loss")}
    assert board == pytest.approx({r["step"]: r["loss"] for r in steps})
    assert [e.step for e in events.Scalars("eval_loss")] == [0, 3]

    (run_dir,) = (out / "wandb").glob("offline-run-*")
    (log,) = run_dir.glob("run-*.wandb")
    raw_log = log.read_bytes()  # the transaction log keeps each value as its JSON text
    assert b"watched" in raw_log  # the run is named after the output dir
    for key in (b"eval_loss", b"tokens_per_s", b"grad_norm"):
        assert key in raw_log
    for r in steps:
        assert json.dumps(r["loss"]).encode() in raw_log


def test_report_to_a_missing_package_is_one_line_before_the_load(tiny_run, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    raw = run_config(tiny_run, tmp_path / "run", steps=1)
    raw["train"]["report_to"] = "wandb"  # one name for a list of one
    with pytest.raises(ValueError, match=r"train.report_to lists wandb but it is not installed"):
        train(config_from_dict(raw))
    assert not (tmp_path / "run").exists()


def test_lines_off_a_terminal_carry_step_total_and_eta(tiny_run, tmp_path, capsys):
    train(config_from_dict(run_config(tiny_run, tmp_path / "run", steps=3)))
    lines = [x for x in capsys.readouterr().err.splitlines() if "loss=" in x]
    assert lines[0].startswith("[0/3] step=0 eval_loss=")  # before training: no pace yet
    for step in (1, 2, 3):
        assert re.search(rf"^\[{step}/3 eta \d+:\d\d:\d\d\] step={step} loss=", lines[step], re.M)
    assert lines[-1].startswith("[3/3 eta 0:00:00] step=3 eval_loss=")


def test_save_best_keeps_the_best_checkpoint_beside_the_latest(tiny_run, tmp_path, monkeypatch):
    from slipstream.train import loop

    scripted = iter([3.0, 2.0, 1.0, 1.5, 1.7, 1.2])  # before, steps 2, 4, 6, 8, end
    monkeypatch.setattr(loop, "evaluate", lambda run: {"loss": next(scripted)})
    out = tmp_path / "run"
    raw = run_config(tiny_run, out, steps=10, eval_every=2, save_every=2, keep_checkpoints=1)
    raw["train"]["save_best"] = True
    summary = train(config_from_dict(raw))
    assert [p.name for p in list_checkpoints(out)] == ["step-000004", "step-000008"]
    assert summary["best"] == {"step": 4, "eval_loss": 1.0, "final": False,
                               "path": str(out / "checkpoints" / "step-000004")}  # fmt: skip

    # The final model is the best: it is said so; nothing else changes.
    scripted = iter([3.0, 2.0, 1.0, 1.5, 1.7, 0.5])
    summary = train(config_from_dict({**raw, "output_dir": str(tmp_path / "again")}))
    assert summary["best"]["final"] is True and summary["best"]["path"] == str(tmp_path / "again")


def test_save_best_needs_evals():
    base = {"model": {"path": "m"}, "data": {"train": "d.jsonl"}, "output_dir": "o"}
    with pytest.raises(ValueError, match="train.save_best needs train.eval_every > 0"):
        config_from_dict({**base, "train": {"save_best": True}})
    with pytest.raises(ValueError, match="train.save_best needs eval data"):
        config_from_dict({**base, "train": {"save_best": True, "eval_every": 5}})


def test_loss_plot_has_whole_step_ticks_and_eval_markers(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from slipstream.train.metrics import plot_losses

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval_loss": 3.0}] + [{"step": s, "loss": 3.0 - s / 3} for s in (1, 2, 3)]
    rows.append({"step": 3, "eval_loss": 2.1})
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert plot_losses(metrics, tmp_path / "loss.png").is_file()
    (ax,) = figures[0].axes
    ticks = [t for t in ax.get_xticks() if 0 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)
    train_line, eval_line = ax.get_lines()
    assert eval_line.get_marker() == "o" and eval_line.get_linestyle() == "None"
    assert list(eval_line.get_xdata()) == [0, 3] and train_line.get_linestyle() == "-"


def test_reward_plot_draws_total_running_mean_and_each_function(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from slipstream.train.metrics import plot_rewards

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 0.1, "reward": r, "rewards/accuracy/mean": r / 2,
             "rewards/format/mean": r} for s, r in ((1, 0.0), (2, 1.0), (3, 2.0))]  # fmt: skip
    evals = [{"step": s, "eval_loss": -r, "eval_reward": r} for s, r in ((0, 0.25), (3, 1.75))]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [evals[0], *rows, evals[1]]))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert plot_rewards(metrics, tmp_path / "reward.png", window=2).is_file()
    (ax,) = figures[0].axes
    total, running, accuracy, fmt, held_out = ax.get_lines()
    assert list(running.get_ydata()) == [0.0, 0.5, 1.5]  # running mean over 2 logged steps
    assert list(accuracy.get_ydata()) == [0.0, 0.5, 1.0] and list(fmt.get_ydata()) == [0, 1, 2]
    assert list(held_out.get_xdata()) == [0, 3] and list(held_out.get_ydata()) == [0.25, 1.75]
    legend = [t.get_text() for t in ax.get_legend().get_texts()][2:]
    assert legend == ["accuracy", "format", "held-out reward (greedy)"]
    no_rewards = tmp_path / "sft.jsonl"
    no_rewards.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert plot_rewards(no_rewards, tmp_path / "none.png") is None  # SFT runs draw no reward plot
