"""The objective contract (slipstream/objectives/base.py): checked once when the objective is
built, naming what is missing; the run config composed from the registered objectives'
own sections (a new objective touches only its module and the registry line)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from slipstream.config_section import ObjectiveSection, option
from slipstream.objectives import OBJECTIVES, Entry, build_objective
from slipstream.objectives.base import Objective, OnlineObjective, check_objective, contract
from slipstream.objectives.sft import SFT


class NoWeight(Objective):
    name = "no_weight"
    perplexity = False

    def __init__(self, cfg=None) -> None:
        self.cfg = cfg

    def tokenize(self, rows, tokenizer, first_row=0):
        return [], None

    def length(self, example):
        return 1

    def collate(self, examples):
        return examples

    def micro_batch_loss(self, model, batch):
        return None, {}


class HalfOnline(NoWeight):
    online = True

    def weight(self, batch):
        return 1

    def rollout(self, ctx, step, prompt_batches):
        return prompt_batches, {}


class ToySection(ObjectiveSection):
    key: ClassVar[str] = "toy"
    meaning: ClassVar[str] = "the toy objective's settings"

    strength: float = option(2.5, "how strong", gt=0)

    def check_run(self, cfg) -> None:
        if self.strength > cfg.train.lr * 1e6:
            raise ValueError("toy.strength must stay below train.lr * 1e6")


class Toy(SFT):
    name = "toy"

    def __init__(self, cfg=None) -> None:
        super().__init__(cfg)
        self.strength = cfg.toy.strength


def test_the_contract_lists_every_member():
    assert contract(Objective) == [
        "name", "perplexity", "online", "metric_names", "metric_extremes", "iterations", "attach",
        "tokenize", "length", "collate", "weight", "micro_batch_loss", "report", "save",
    ]  # fmt: skip
    assert contract(OnlineObjective)[-2:] == ["rollout", "evaluate"]


def test_a_missing_method_is_named_once_built():
    check_objective(SFT(), "sft")  # complete: no error
    with pytest.raises(TypeError, match=r"objective here:NoWeight lacks weight, which an obj"):
        check_objective(NoWeight(), "here:NoWeight")
    with pytest.raises(TypeError, match=r"lacks evaluate, which an online objective must"):
        check_objective(HalfOnline(), "here:HalfOnline")


class BadExtremes(SFT):
    metric_extremes: ClassVar[dict[str, str]] = {"aux_loss": "median", "elsewhere": "min"}


def test_metric_extremes_must_be_named_metrics_reduced_by_min_or_max():
    from slipstream.objectives.reward import Reward

    check_objective(Reward(), "reward")  # min_reward/max_reward: no error
    with pytest.raises(TypeError, match=r"metric_extremes .*'aux_loss': 'median'.*'elsewhere'"):
        check_objective(BadExtremes(), "here:BadExtremes")


def test_build_objective_checks_the_contract(monkeypatch):
    from slipstream.config import config_from_dict

    monkeypatch.setitem(OBJECTIVES, "no_weight", Entry(f"{__name__}:NoWeight"))
    raw = {"model": {"path": "m"}, "data": {"train": "d.jsonl"}, "output_dir": "o",
           "train": {"objective": "no_weight"}}  # fmt: skip
    with pytest.raises(TypeError, match="lacks weight"):
        build_objective(config_from_dict(raw))


def test_run_config_is_composed_from_the_registry(monkeypatch):
    """One registry line adds the objective's section: its keys, defaults, `slipstream
    config` lines and cross-section rule, with nothing written in config.py."""
    import slipstream.config as config

    monkeypatch.setitem(OBJECTIVES, "toy", Entry(f"{__name__}:Toy", f"{__name__}:ToySection"))
    monkeypatch.setattr(config, "RunConfig", config._compose())
    raw = {"model": {"path": "m"}, "data": {"train": "d.jsonl"}, "output_dir": "o",
           "train": {"objective": "toy"}}  # fmt: skip
    cfg = config.config_from_dict(raw)
    assert cfg.toy.strength == 2.5 and list(cfg.model_dump())[-3:] == ["toy", "output_dir",
                                                                       "resume"]  # fmt: skip
    assert build_objective(cfg).strength == 2.5
    assert "strength" in config.describe_config("toy") and "how strong" in config.describe_config()
    with pytest.raises(ValueError, match="toy.strength must stay below"):
        config.config_from_dict({**raw, "toy": {"strength": 1e3}})
    with pytest.raises(ValueError, match="unknown key 'toy.strenght' \\(did you mean 'toy.str"):
        config.config_from_dict({**raw, "toy": {"strenght": 1.0}})
    # The rule is the objective's own: another objective's run does not apply it.
    config.config_from_dict({**raw, "train": {"objective": "sft"}, "toy": {"strength": 1e3}})


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_every_registered_objective_meets_the_contract(name):
    """Each registry line builds an objective that passes the check, named as its line."""
    from slipstream.config import config_from_dict

    raw = {"model": {"path": "m"}, "data": {"train": "d.jsonl"}, "output_dir": "o",
           "train": {"objective": name},
           "grpo": {"rewards": [{"function": "accuracy"}]},
           "rloo": {"rewards": [{"function": "accuracy"}]},
           "distill": {"teacher": "t"}}  # fmt: skip
    objective = build_objective(config_from_dict(raw))
    assert objective.name == name


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_builds_the_class_of_its_loss_type(loss_type):
    """One pair objective, a subclass per loss: preference.loss_type picks DPO's."""
    from slipstream.config import config_from_dict
    from slipstream.objectives.preference import DPO_LOSSES, PairObjective, pair_objective

    raw = {"model": {"path": "m"}, "data": {"train": "d.jsonl"}, "output_dir": "o",
           "train": {"objective": "dpo"}, "preference": {"loss_type": loss_type}}  # fmt: skip
    objective = build_objective(config_from_dict(raw))
    assert type(objective) is DPO_LOSSES[loss_type] and isinstance(objective, PairObjective)
    assert type(pair_objective("dpo", loss_type=loss_type)) is DPO_LOSSES[loss_type]
    assert len({DPO_LOSSES[t].pair_loss for t in DPO_LOSSES}) == 3  # each its own loss
