"""`train.warmup_steps`: whole steps or a fraction of the run. The example configs give a
fraction, so a short try of one (the README's `train.steps=5`) trains at its lr; a warmup
as long as the run is a warning line."""

from pathlib import Path

import pytest
import yaml
from helpers.runs import run_config

from slipstream import cli
from slipstream.config import load_config
from slipstream.train.optim import lr_factor, warmup_steps_for

ROOT = Path(__file__).resolve().parent.parent
BASE = {
    "model": {"path": "some/model"},
    "data": {"train": "train.jsonl"},
    "output_dir": "out",
}


@pytest.mark.parametrize(("given", "kept"), [("20", 20), ("20.0", 20), ("0.05", 0.05), ("0", 0)])
def test_warmup_steps_takes_whole_steps_or_a_fraction(tmp_path, given, kept):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(BASE))
    got = load_config(path, [f"train.warmup_steps={given}"]).train.warmup_steps
    assert got == kept and type(got) is type(kept)


@pytest.mark.parametrize("given", ["2.5", "-1"])
def test_a_warmup_that_is_neither_is_one_line(tmp_path, given):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(BASE))
    with pytest.raises(ValueError) as e:
        load_config(path, [f"train.warmup_steps={given}"])
    assert str(e.value).startswith("config: train.warmup_steps:") and "\n" not in str(e.value)


def test_a_fraction_is_that_share_of_the_steps_rounded_down():
    assert [warmup_steps_for(0.05, n) for n in (1, 5, 19, 20, 100, 2000)] == [0, 0, 0, 1, 5, 100]
    assert warmup_steps_for(20, 5) == 20 and warmup_steps_for(0, 5) == 0


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=str)
def test_example_configs_reach_their_lr_on_a_short_run(config):
    t = load_config(config).train
    for steps in (1, 5):
        warmup = warmup_steps_for(t.warmup_steps, steps)
        first = lr_factor(0, schedule=t.schedule, warmup_steps=warmup, total_steps=steps)
        assert first == 1.0, (config.name, t.warmup_steps, steps)
    # ...and keep a warmup on a full-length run.
    assert t.warmup_steps == 0 or warmup_steps_for(t.warmup_steps, 2000) >= 20


def warnings_of_a_run(tiny_run, tmp_path, capsys, warmup) -> list[str]:
    raw = run_config(tiny_run, tmp_path / f"run-{warmup}", steps=3, warmup_steps=warmup)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert cli.main(["train", str(tmp_path / "run.yaml")]) == 0
    return [x for x in capsys.readouterr().err.splitlines() if "warning:" in x]


def test_a_warmup_as_long_as_the_run_is_a_warning(tiny_run, tmp_path, capsys):
    said = warnings_of_a_run(tiny_run, tmp_path, capsys, 3)
    assert len(said) == 1 and said[0].startswith("slipstream: warning: "), said
    assert "train.warmup_steps=3 is not shorter than the run's 3 steps" in said[0], said
    assert "(at most 75% of it)" in said[0], said  # step 3 of a 3-step warmup: 3/4
    assert warnings_of_a_run(tiny_run, tmp_path, capsys, 0.5) == []  # 1 step of 3
