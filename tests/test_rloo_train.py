"""RLOO through the trainer on a tiny random Llama (GRPO's rollout machinery, test_grpo_train's
data and rewards): a LoRA run with a KL penalty logs RLOO's metrics and saves an adapter
that peft loads; a run stopped by a signal and resumed gives the same losses and adapter as
one uninterrupted run; malformed rloo configs are one-line errors; a reward model
(`rewards: [model:DIR]`) scores the completions as transformers' classifier; 2 gloo ranks
equal one process."""

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
                    "gen_tokens_per_s", "completions/mean_length", "completions/min_length",
                    "completions/max_terminated_length"):  # fmt: skip
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


@pytest.mark.slow  # ~21 s (torchrun); GRPO's 2-rank test (the same engine) runs by default
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
        for key in ("loss", "kl", "reward", "completions/mean_length", "completions/min_length",
                    "completions/max_length", "completions/min_terminated_length",
                    "completions/max_terminated_length", "completions/clipped_ratio"):  # fmt: skip
            assert got[step][key] == pytest.approx(w[key], abs=1e-5), (step, key)
        assert got[step]["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), step
    assert_same_adapter(tmp_path / "ddp", tmp_path / "single", atol=2e-5, rtol=1e-4)


def test_a_reward_model_as_the_reward(tiny, tmp_path, monkeypatch):  # noqa: F811
    """rloo.rewards: [model:DIR] with a reward model saved by slipstream: a 2-step run scores
    every completion with it (each rollout's scores equal the reward model's own, through
    transformers' AutoModelForSequenceClassification, on the chat of prompt and completion)
    and logs them as rewards/<DIR's name>/mean."""
    import warnings

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from slipstream.checkpoint.hf import load_model
    from slipstream.checkpoint.reward_model import save_reward_model
    from slipstream.models.score_head import add_score_head, pad_id_of
    from slipstream.objectives.rloo import RLOO

    model_dir, _ = tiny
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rm = load_model(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    add_score_head(rm).weight.data.normal_(0, 0.5)
    save_reward_model(rm, tmp_path / "rm", pad_id_of(tokenizer))
    tokenizer.save_pretrained(tmp_path / "rm")
    raw = rloo_config(tiny, tmp_path / "run", rewards=[f"model:{tmp_path / 'rm'}"])
    raw["train"]["steps"] = 2
    assert config_from_dict(raw).rloo.rewards == [{"function": f"model:{tmp_path / 'rm'}"}]
    seen, real = [], RLOO.score

    def recorded(self, tok, examples, completions, per_prompt=None):
        out = real(self, tok, examples, completions, per_prompt)
        G = per_prompt or self.G
        prompts = [examples[i // G].prompt for i in range(len(completions))]
        seen.append((prompts, [tok.decode(c, skip_special_tokens=True) for c in completions], out))
        return out

    monkeypatch.setattr(RLOO, "score", recorded)
    assert train(config_from_dict(raw))["status"] == "completed"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert len(seen) == 2  # one rollout a step
    for prompts, texts, scores in seen:
        chats = [
            tokenizer.apply_chat_template(p + [{"role": "assistant", "content": t}], tokenize=False)
            for p, t in zip(prompts, texts, strict=True)
        ]
        batch = tokenizer(chats, return_tensors="pt", padding=True, padding_side="right",
                          add_special_tokens=False)  # fmt: skip
        with torch.no_grad():
            want = hf(**batch).logits[:, 0]
        torch.testing.assert_close(scores[:, 0], want, atol=1e-5, rtol=1e-5)
    steps = [r for r in lines(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r, (_, _, scores) in zip(steps, seen, strict=True):
        assert r["rewards/rm/mean"] == pytest.approx(float(scores[:, 0].mean()), abs=1e-6)
