"""GRPO through the trainer on a tiny random Llama: a LoRA run with trivial rewards (user
functions loaded by path, tests/helpers/grpo_rewards.py) logs the
rollout and loss metrics and saves an adapter; a run stopped by a signal and resumed gives
the same losses and adapter as one uninterrupted run (rollouts are seeded per step); with
mu = 2 each rollout serves two optimizer steps; data.eval gives the mean reward of greedy
replies; FSDP2 LoRA from an adapter with mu = 2 and a KL term equals one process. Slow: 2
ranks (DDP, FSDP2; FSDP2 full fine-tuning with mu = 2 and a KL term) equal one process."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.runs import make_tiny_run, train_until_signal
from safetensors.torch import load_file

from slipstream.config import config_from_dict
from slipstream.train.loop import train

QUESTIONS = ["sky", "grass", "sun", "snow", "coal", "car", "door", "cup"]


REWARDS = str(Path(__file__).parent / "helpers" / "grpo_rewards.py")
SPECS = [{"function": f"{REWARDS}:length"}, {"function": f"{REWARDS}:has_e", "weight": 0.5}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_train")
    model_dir, _ = make_tiny_run(root)
    data = root / "prompts.jsonl"
    ask = [[{"role": "user", "content": f"What color is the {q}?"}] for q in QUESTIONS * 2]
    rows = [{"prompt": p, "answer": f"answer {i}"} for i, p in enumerate(ask)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def grpo_config(tiny, out, **grpo):
    model_dir, data = tiny
    return {
        "model": {"path": str(model_dir)},
        "data": {"train": str(data)},
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.1},
        "train": {
            "objective": "grpo", "lr": 2e-2, "steps": 4, "tokens_per_batch": 2 * 4 * 60,
            "grad_accum": 2, "log_every": 1, "save_every": 2, "device": "cpu",
            "activation_checkpointing": "none",
        },
        "grpo": {
            "num_generations": 4, "max_prompt_tokens": 48, "max_completion_tokens": 12,
            "rewards": SPECS, **grpo,
        },
        "output_dir": str(out),
    }  # fmt: skip


KEYS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/length/mean", "rewards/has_e/std",
        "completions/mean_length", "completions/min_length", "completions/max_length",
        "completions/clipped_ratio", "completions/mean_terminated_length",
        "completions/min_terminated_length", "completions/max_terminated_length",
        "clip_ratio/region_mean", "gen_time_s", "rollout_time_s", "train_time_s",
        "gen_tokens_per_s", "tokens_per_s")  # fmt: skip


def lines(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    summary = train(config_from_dict(grpo_config(tiny, out)))
    return out, summary


def test_a_grpo_run_logs_rollout_metrics_and_saves_an_adapter(straight):
    out, summary = straight
    assert summary["status"] == "completed" and summary["steps"] == 4
    steps = [r for r in lines(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        for key in KEYS:
            assert key in r, (key, r)
        c = {k.removeprefix("completions/"): v for k, v in r.items() if "completions/" in k}
        assert 1 <= c["min_length"] <= c["mean_length"] <= c["max_length"] <= 12
        assert c["min_terminated_length"] <= c["mean_terminated_length"]
        assert c["mean_terminated_length"] <= c["max_terminated_length"] <= c["max_length"]
        assert 0 < r["gen_time_s"] <= r["rollout_time_s"] and r["train_time_s"] > 0
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
    # 2 prompts a micro-batch, 2 micro-batches: 4 prompts x 4 completions a step
    assert abs(steps[0]["reward"]) < 10
    assert (out / "adapter_model.safetensors").is_file()


def test_resume_after_a_signal_repeats_the_uninterrupted_run(straight, tiny, tmp_path):
    out, _ = straight
    cfg = config_from_dict(grpo_config(tiny, tmp_path / "resumed"))
    summary = train_until_signal(cfg, at_step=3)
    assert summary["status"] == "interrupted"
    resumed = config_from_dict({**grpo_config(tiny, tmp_path / "resumed"), "resume": True})
    assert train(resumed)["status"] == "completed"
    want = {r["step"]: r for r in lines(out) if "loss" in r}
    got = {r["step"]: r for r in lines(tmp_path / "resumed") if "loss" in r}
    for step in (3, 4):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-6)
        assert got[step]["reward"] == pytest.approx(want[step]["reward"], abs=1e-6)
    assert_same_adapter(tmp_path / "resumed", out, atol=1e-6, rtol=1e-5)


def test_mu_two_reuses_each_rollout_for_two_steps(tiny, tmp_path):
    raw = grpo_config(tiny, tmp_path / "mu", iterations_per_batch=2, beta=0.05)
    raw["train"]["save_every"] = 0
    train(config_from_dict(raw))
    steps = [r for r in lines(tmp_path / "mu") if "loss" in r]
    # Rollout stats come with steps 1 and 3 only; step 2 and 4 train on the same completions.
    assert ["reward" in r for r in steps] == [True, False, True, False]
    assert all("kl" in r for r in steps)
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the start
    assert steps[1]["kl"] > 0 and steps[1]["clip_ratio/region_mean"] >= 0


def test_held_out_eval_is_the_mean_reward_of_greedy_replies(tiny, tmp_path):
    """data.eval under GRPO: eval_reward (and eval_loss = -eval_reward) at steps 0, 2 and 4;
    at step 0 (LoRA's B is zero: the base model) it equals the base's greedy replies from
    slipstream.generate scored by hand with the two rewards' formulas."""
    from slipstream.generation.api import generate
    from slipstream.generation.commands import load

    model_dir, data = tiny
    cfg = grpo_config(tiny, tmp_path / "out")
    cfg["data"]["eval"] = str(data)
    cfg["train"]["eval_every"] = 2
    summary = train(config_from_dict(cfg))
    evals = [r for r in lines(tmp_path / "out") if "eval_reward" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(r["eval_loss"] == -r["eval_reward"] for r in evals)
    assert summary["eval_loss_before"] == evals[0]["eval_loss"]

    model, tokenizer = load(SimpleNamespace(model=str(model_dir), base=None, device="cpu"))
    prompts = [json.loads(x)["prompt"] for x in data.read_text().splitlines()]
    texts = [c.text for c in generate(model, prompts, tokenizer=tokenizer, max_new_tokens=12)]
    length = [len(t) / 10 for t in texts]  # tests/helpers/grpo_rewards.py
    has_e = [None if "sun" in str(p) else float("e" in t) for p, t in zip(prompts, texts)]
    judged = [x for x in has_e if x is not None]
    total = [a + 0.5 * (b or 0.0) for a, b in zip(length, has_e)]
    assert evals[0]["eval_reward"] == pytest.approx(sum(total) / len(total), abs=1e-6)
    assert evals[0]["eval_rewards/length/mean"] == pytest.approx(sum(length) / len(length))
    assert evals[0]["eval_rewards/has_e/mean"] == pytest.approx(sum(judged) / len(judged))


def two_rank_config(tiny, out):
    raw = grpo_config(tiny, out)
    raw["lora"]["dropout"] = 0.0  # each rank draws its own dropout masks
    raw["data"]["eval"] = raw["data"]["train"]
    raw["train"]["eval_every"] = 2
    raw["train"]["sample_prompts"] = ["What color is the sky?", "Hi!"]
    return raw


@pytest.fixture(scope="module")
def single(tiny, tmp_path_factory):
    """The one-process run the 2-rank runs must repeat."""
    out = tmp_path_factory.mktemp("single")
    train(config_from_dict(two_rank_config(tiny, out)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(tiny, single, tmp_path, mode):
    """2 gloo ranks with grad_accum 1 each against one process with grad_accum 2: each prompt
    batch samples with the seed of its place in the global window, so the completions, the
    rewards, the step's normaliser and the update are the same; so is the held-out reward,
    each rank replying to its share of the eval prompts, and so are the replies to
    train.sample_prompts. Under FSDP2 the ranks decode different numbers of tokens on
    weights gathered once per rollout and eval (distributed.gathered_for_generation)."""
    from helpers.torchrun import check, train_job

    raw = two_rank_config(tiny, tmp_path / mode)
    raw["train"] = {**raw["train"], "grad_accum": 1, "parallel": mode, "dist_timeout_s": 60}
    check(train_job(raw, tmp_path, timeout=240))
    assert_same_grpo_run(tmp_path / mode, single, ("loss", "reward", "reward_std",
                                                  "completions/mean_length"))  # fmt: skip
    assert_same_adapter(tmp_path / mode, single, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_fsdp_full_finetune_with_mu_two_and_kl_matches_one_process(tiny, tmp_path):
    """Full fine-tuning (FSDP2 shards every weight) with mu = 2 (old log-probs) and beta > 0
    (the reference a frozen copy): 2 ranks equal one process, the KL and the saved model
    included."""

    def config(out):
        raw = two_rank_config(tiny, out)
        raw["grpo"].update(iterations_per_batch=2, beta=0.05)
        raw["train"]["finetune"] = "full"
        raw["train"].update(lr=1e-3, save_every=0)
        return raw

    single_and_fsdp(config, tmp_path)
    want = load_file(tmp_path / "single" / "model.safetensors")
    got = load_file(tmp_path / "fsdp" / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-4)


def test_fsdp_lora_from_an_adapter_with_kl_matches_one_process(tiny, tmp_path):
    """LoRA from a non-zero adapter with beta > 0 and mu = 2: the reference is the frozen
    start, written into each rank's shards for its forward. 2 ranks equal one process, the
    KL included."""
    from helpers.runs import run_config

    start = tmp_path / "sft"
    model_dir = tiny[0]
    raw = run_config((model_dir, model_dir.parent / "train.jsonl"), start, steps=3)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}
    train(config_from_dict(raw))

    def config(out):
        raw = two_rank_config(tiny, out)
        raw["model"]["adapter"] = str(start)
        raw["grpo"].update(iterations_per_batch=2, beta=0.05)
        raw["train"].update(save_every=0)
        return raw

    single_and_fsdp(config, tmp_path)
    kl = [r["kl"] for r in lines(tmp_path / "single") if "kl" in r]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and min(kl[2:]) > 1e-3  # the policy moved
    assert_same_adapter(tmp_path / "fsdp", tmp_path / "single", atol=2e-5, rtol=1e-4)


def single_and_fsdp(config, tmp_path) -> None:
    """`config(out)` run in one process and on 2 FSDP2 ranks (grad_accum 1): the same losses,
    KL and the rest of `assert_same_grpo_run`."""
    from helpers.torchrun import check, train_job

    train(config_from_dict(config(tmp_path / "single")))
    raw = config(tmp_path / "fsdp")
    raw["train"].update(grad_accum=1, parallel="fsdp", dist_timeout_s=60)
    check(train_job(raw, tmp_path, timeout=240))
    assert_same_grpo_run(tmp_path / "fsdp", tmp_path / "single", ("loss", "kl"))


def assert_same_grpo_run(got_dir, want_dir, keys) -> None:
    """Per-step `keys` and grad norms, eval rewards and sample replies match."""
    want = {r["step"]: r for r in lines(want_dir) if "loss" in r}
    got = {r["step"]: r for r in lines(got_dir) if "loss" in r}
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        for key in keys:
            assert (key in got[step]) == (key in want[step]), (step, key)
            if key in want[step]:  # rollout stats come with a rollout's first step only
                assert got[step][key] == pytest.approx(want[step][key], abs=1e-5), (step, key)
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-4)
    want = {r["step"]: r["eval_reward"] for r in lines(want_dir) if "eval_reward" in r}
    got = {r["step"]: r["eval_reward"] for r in lines(got_dir) if "eval_reward" in r}
    assert sorted(got) == [0, 2, 4] and got == pytest.approx(want, abs=1e-5)
    want = {r["step"]: r["samples"] for r in lines(want_dir) if "samples" in r}
    got = {r["step"]: r["samples"] for r in lines(got_dir) if "samples" in r}
    assert sorted(got) == [0, 2, 4] and got == want  # train.sample_prompts' greedy replies


def assert_same_adapter(got_dir, want_dir, *, atol: float, rtol: float) -> None:
    """Every tensor of want_dir's adapter_model.safetensors is close to got_dir's."""
    want = load_file(want_dir / "adapter_model.safetensors")
    got = load_file(got_dir / "adapter_model.safetensors")
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=rtol)


def test_a_generic_model_repeats_the_native_run(straight, tiny, tmp_path):
    """The same run on transformers' modeling code (`model.implementation: transformers`, the
    generic family: docs/generic.md): the same rollouts from our KV-cache engine (rewards,
    lengths), losses and adapter as the native family's."""
    out, _ = straight
    raw = grpo_config(tiny, tmp_path / "generic")
    raw["model"]["implementation"] = "transformers"
    assert train(config_from_dict(raw))["status"] == "completed"
    want = [r for r in lines(out) if "loss" in r]
    got = [r for r in lines(tmp_path / "generic") if "loss" in r]
    assert len(got) == len(want) == 4
    for a, b in zip(got, want, strict=True):
        for key in ("reward", "completions/mean_length", "rewards/has_e/std"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert_same_adapter(tmp_path / "generic", out, atol=1e-5, rtol=1e-4)
