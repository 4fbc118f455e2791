"""The plan as `train` and `slipstream plan` run it: a run that will not fit stops in one line
naming the setting to change, before anything loads and with nothing in output_dir;
`train.memory: auto` and `train.mlp_tiles: auto` take the planner's techniques."""

from __future__ import annotations

import pytest
import yaml
from helpers.runs import make_tiny_run, make_tiny_type_run, run_config

from slipstream.cli import main
from slipstream.config import RunConfig
from slipstream.memory import plan as planner
from slipstream.memory.tiled_mlp import mlp_tiles

RSS = 300 << 20  # the process's own memory, pinned so that budgets are exact


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("plan"))


@pytest.fixture(autouse=True)
def _fixed_rss(monkeypatch):
    monkeypatch.setattr(planner, "_rss_now", lambda: RSS)


def _cfg(tiny_run, out, **train):
    raw = run_config(tiny_run, out, tokens_per_batch=4096, **train)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8}
    return raw


def _peak(raw, mode, tiles):
    cfg = RunConfig.model_validate(raw)
    inp = planner.PlanInputs.from_config(cfg, "cpu", planner.read_hf_config(cfg.model.path))
    return planner.estimate(inp, cfg.train.tokens_per_batch, mode, tiles).peak


def test_a_run_that_does_not_fit_stops_in_one_line(tiny_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    raw = _cfg(tiny_run, out, activation_checkpointing="recompute", mlp_tiles="off")
    budget = _peak(raw, "recompute", 1) - (1 << 16)
    monkeypatch.setattr(planner, "device_budget", lambda device: budget)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    assert main(["train", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "train.tokens_per_batch=4096 needs" in err and "lower train.tokens_per_batch to" in err
    assert not out.exists()


def test_memory_auto_tiles_when_untiled_would_not_fit(tiny_run, tmp_path, monkeypatch):
    from slipstream.train.run import prepare_run

    raw = _cfg(tiny_run, tmp_path / "run", activation_checkpointing="recompute")
    untiled, tiled = _peak(raw, "recompute", 1), _peak(raw, "recompute", 2)
    assert tiled < untiled
    monkeypatch.setattr(planner, "device_budget", lambda device: (tiled + untiled) // 2)
    run = prepare_run(RunConfig.model_validate(raw))
    assert mlp_tiles(run.model) == 2
    raw["train"]["mlp_tiles"] = "off"  # an explicit setting is kept, and then it won't fit
    with pytest.raises(ValueError, match="lower train.tokens_per_batch"):
        prepare_run(RunConfig.model_validate(raw))


def test_memory_auto_picks_no_checkpointing_when_it_fits(tiny_run, tmp_path, monkeypatch):
    from slipstream.memory.offload import _CLASSES
    from slipstream.train.run import prepare_run

    raw = _cfg(tiny_run, tmp_path / "run", memory="auto")
    raw["train"].pop("activation_checkpointing")
    monkeypatch.setattr(planner, "device_budget", lambda device: 64 << 30)
    run = prepare_run(RunConfig.model_validate(raw))
    assert not any(type(layer) in _CLASSES.values() for layer in run.model.model.layers)
    assert mlp_tiles(run.model) == 1


def test_plan_command_prints_components(tiny_run, tmp_path, capsys):
    raw = _cfg(tiny_run, tmp_path / "run", activation_checkpointing="recompute")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    assert main(["plan", str(tmp_path / "c.yaml"), "--device", "cpu", "--memory", "1GB"]) == 0
    text = capsys.readouterr().out
    for part in ("weights", "adapters", "optimizer states", "checkpoints", "peak", "fits"):
        assert part in text
    assert "longest single sequence" in text
    assert main(["plan", str(tmp_path / "c.yaml"), "--gpu-memory", "lots"]) == 2


@pytest.fixture(scope="module")
def generic_run(tmp_path_factory):
    """tiny_run's counterpart with an OLMo 2 model (no native family: the generic path)."""
    root = tmp_path_factory.mktemp("plan_generic")
    return make_tiny_type_run(root, "olmo2", hidden_size=32, intermediate_size=64)


@pytest.mark.slow  # ~25 s
def test_plan_and_auto_tiling_on_a_generic_model(generic_run, tmp_path, monkeypatch, capsys):
    """`slipstream plan` and `train.mlp_tiles: auto` on transformers' layers: the plan prints,
    and a budget only the tiled step fits makes the run tile transformers' MLPs."""
    from slipstream.train.run import prepare_run

    raw = _cfg(generic_run, tmp_path / "run", activation_checkpointing="recompute")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    assert main(["plan", str(tmp_path / "c.yaml"), "--device", "cpu", "--memory", "1GB"]) == 0
    assert "longest single sequence" in capsys.readouterr().out
    untiled, tiled = _peak(raw, "recompute", 1), _peak(raw, "recompute", 2)
    assert tiled < untiled
    monkeypatch.setattr(planner, "device_budget", lambda device: (tiled + untiled) // 2)
    run = prepare_run(RunConfig.model_validate(raw))
    assert run.model.config.implementation == "transformers" and mlp_tiles(run.model) == 2
