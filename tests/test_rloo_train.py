"""RLOO through the trainer on a tiny random Llama (GRPO's rollout machinery, test_grpo_train's
data and rewards): a LoRA run with a KL penalty logs RLOO's metrics and saves an adapter; a
run stopped by a signal and resumed gives the same losses and adapter as one uninterrupted
run; malformed rloo configs are one-line errors."""

from __future__ import annotations

import json
import math

import pytest
from helpers.runs import assert_adapter_loads_in_peft, train_until_signal
from test_grpo_train import (
    assert_same_adapter,
    grpo_config,
    lines,
    tiny,  # noqa: F401 (the fixture)
)

from slipstream.config import config_from_dict
from slipstream.train.loop import train


def rloo_config(run, out, **rloo):
    raw = grpo_config(run, out)
    raw["train"]["objective"] = "rloo"
    g = raw.pop("grpo")
    raw["rloo"] = {k: g[k] for k in ("num_generations", "max_prompt_tokens",
                                     "max_completion_tokens", "rewards")} | rloo  # fmt: skip
    return raw


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("rloo_straight")
    return out, train(
        config_from_dict(rloo_config(tiny, out, beta=0.05, normalize_advantages=True))
    )


def test_an_rloo_run_logs_its_metrics_and_saves_an_adapter(straight, tiny):  # noqa: F811
    out, summary = straight
    assert summary["status"] == "completed" and summary["steps"] == 4
    steps = [r for r in lines(out) if "loss" in r]
    for r in steps:
        for key in ("reward", "kl", "clip_ratio/region_mean", "clip_ratio/low_mean",
                    "gen_tokens_per_s", "completions/mean_length"):  # fmt: skip
            assert key in r, (key, r)
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert_adapter_loads_in_peft(tiny[0], out)  # peft's logits = ours


def test_resume_after_a_signal_repeats_the_uninterrupted_run(straight, tiny, tmp_path):  # noqa: F811
    out, _ = straight
    raw = rloo_config(tiny, tmp_path / "resumed", beta=0.05, normalize_advantages=True)
    assert train_until_signal(config_from_dict(raw), at_step=3)["status"] == "interrupted"
    assert train(config_from_dict({**raw, "resume": True}))["status"] == "completed"
    want = {r["step"]: r for r in lines(out) if "loss" in r}
    got = {r["step"]: r for r in lines(tmp_path / "resumed") if "loss" in r}
    for step in (3, 4):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-6)
        assert got[step]["kl"] == pytest.approx(want[step]["kl"], abs=1e-6)
    assert_same_adapter(tmp_path / "resumed", out, atol=1e-6, rtol=1e-5)


def test_config_errors(tiny, tmp_path):  # noqa: F811
    raw = rloo_config(tiny, tmp_path)
    raw["rloo"].pop("rewards")
    with pytest.raises(ValueError, match="train.objective=rloo needs rloo.rewards"):
        config_from_dict(raw)
    with pytest.raises(ValueError, match="rloo.num_generations"):
        config_from_dict(rloo_config(tiny, tmp_path, num_generations=1))
    with pytest.raises(ValueError, match="exceeds train.tokens_per_batch"):
        config_from_dict(rloo_config(tiny, tmp_path, max_completion_tokens=400))
    assert json.dumps(rloo_config(tiny, tmp_path))  # plain data


def test_two_ranks_match_one_process(tiny, tmp_path):  # noqa: F811
    """2 gloo ranks (DDP, grad_accum 1 each) repeat one process with grad_accum 2, with a KL
    penalty and normalised advantages: each prompt batch samples with the seed of its place
    in the global window, each group's leave-one-out baselines stay within a rank, the
    advantages are normalised over every rank's completions and the normaliser (completions)
    is summed over ranks. (GRPO's slow 2-rank tests cover the shared held-out eval.)"""
    from helpers.torchrun import check, train_job

    def config(out):
        raw = rloo_config(tiny, out, beta=0.05, normalize_advantages=True)
        raw["lora"]["dropout"] = 0.0  # each rank would draw its own dropout masks
        raw["train"]["save_every"] = 0
        return raw

    train(config_from_dict(config(tmp_path / "single")))
    raw = config(tmp_path / "ddp")
    raw["train"].update(grad_accum=1, parallel="ddp", dist_timeout_s=60)
    check(train_job(raw, tmp_path, timeout=240))
    want = {r["step"]: r for r in lines(tmp_path / "single") if "loss" in r}
    got = {r["step"]: r for r in lines(tmp_path / "ddp") if "loss" in r}
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step, w in want.items():
        for key in ("loss", "kl", "reward", "completions/mean_length"):
            assert got[step][key] == pytest.approx(w[key], abs=1e-5), (step, key)
        assert got[step]["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), step
    assert_same_adapter(tmp_path / "ddp", tmp_path / "single", atol=2e-5, rtol=1e-4)
