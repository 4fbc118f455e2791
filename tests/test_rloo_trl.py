"""RLOO against TRL 1.16's `RLOOTrainer`: its rollout math (`_generate_and_score_completions`
on fixed completions and rewards: the leave-one-out advantages, with unscorable completions,
a group with one scorable completion, normalisation) and its loss (`_compute_loss`: value,
clip metrics and every parameter's gradient, full fine-tuning) on the same batch, with no
host sync in the loss and its backward; and LoRA with a KL penalty against both of TRL's
PEFT references (adapters off, the starting adapter): our rollout's advantages, `kl` and
reward metrics, then the loss and every LoRA gradient. Grad-accum and one sequence a
micro-batch equal one packed batch."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from helpers.models import make_hf_model
from helpers.tokenizers import save_test_tokenizer
from test_grpo import FixedRewards

from slipstream.debug import count_syncs
from slipstream.objectives.rloo_loss import leave_one_out, normalise
from slipstream.rewards.functions import RewardFunctions

trl = pytest.importorskip("trl")

G, MAX_LEN, TEMP, PROMPT = 4, 9, 0.7, 6
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            initializer_range=0.2)  # fmt: skip


def make_trainer(root, model=None, peft_config=None, **args):
    """TRL's RLOOTrainer on `model` (default: a tiny random Llama saved in `root`)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    save_test_tokenizer(root, "chatml", vocab_size=300)
    hf = model
    if hf is None:
        hf = make_hf_model("llama", **TINY)
        hf.save_pretrained(root)
    config = trl.RLOOConfig(
        output_dir=str(root / "out"), per_device_train_batch_size=8, num_generations=G,
        max_completion_length=MAX_LEN, temperature=TEMP, report_to=[], use_cpu=True,
        bf16=False, **args,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.RLOOTrainer(
            model=hf, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
            args=config, train_dataset=Dataset.from_list([{"prompt": "hi"}] * 8),
            processing_class=AutoTokenizer.from_pretrained(root), peft_config=peft_config,
        )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def fixed_completions(seed=7):
    """2 prompts x G completions (equal-length prompts: TRL left-pads them)."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for _ in range(2):
        prompt = torch.randint(0, 300, (PROMPT,), generator=g).tolist()
        for _ in range(G):
            n = int(torch.randint(1, MAX_LEN + 1, (1,), generator=g))
            prompts.append(prompt)
            completions.append(torch.randint(0, 300, (n,), generator=g).tolist())
    return prompts, completions


# Rewards per function (S, 2): NaN = the function returned None. Group 0 has an unscorable
# completion; group 1 has only one scorable completion (its baseline is 0/0).
REWARDS = torch.tensor(
    [[1.5, 0.5], [0.0, math.nan], [math.nan, math.nan], [2.0, 1.0],
     [math.nan, math.nan], [3.0, math.nan], [math.nan, math.nan], [math.nan, math.nan]]
)  # fmt: skip
WEIGHTS = torch.tensor([1.0, 0.5])


def trl_rollout(trainer, prompts, completions):
    """TRL's `_generate_and_score_completions` with generation and rewards fixed."""
    trainer._generate = lambda p: (prompts, completions, ["x"] * len(completions))
    trainer._calculate_rewards = lambda *a, **k: REWARDS.clone()
    trainer.reward_weights = WEIGHTS
    trainer.model.train()
    return trainer._generate_and_score_completions([{"prompt": "hi"}] * len(prompts))


@pytest.mark.parametrize("normalize", [False, True])
def test_advantages_equal_trl(tmp_path, normalize):
    trainer = make_trainer(tmp_path, beta=0.0, normalize_advantages=normalize)
    out = trl_rollout(trainer, *fixed_completions())
    total = (REWARDS * WEIGHTS).nansum(1)
    total[REWARDS.isnan().all(1)] = math.nan
    adv = leave_one_out(total, G)
    if normalize:
        adv = normalise(adv)
    torch.testing.assert_close(torch.nan_to_num(adv, nan=0.0), out["advantages"])
    assert out["advantages"][5] == 0 and out["advantages"][0] != 0  # the cases are there


def noisy(values, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    return values + scale * torch.randn(values.shape, generator=g)


@pytest.mark.parametrize("case", ["on_policy", "off_policy_masked"])
@pytest.mark.parametrize("implementation", ["native", "transformers"])  # generic: docs/generic.md
def test_loss_and_gradients_equal_trl(tmp_path, case, implementation):
    """TRL's `_compute_loss` on fixed completions, advantages and old log-probs: the loss,
    every parameter's gradient and the clip metrics (full fine-tuning, temperature 0.7)."""
    from slipstream.checkpoint.hf import load_model
    from slipstream.objectives.grpo_data import Sample
    from slipstream.objectives.rloo import RLOO, collate_samples

    off = case != "on_policy"
    trainer = make_trainer(tmp_path, beta=0.0, epsilon=0.2, epsilon_high=0.28)
    model = load_model(tmp_path, dtype=torch.float32, implementation=implementation)
    prompts, completions = fixed_completions()
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(len(completions), generator=g)
    masked = [off and i % 3 == 0 for i in range(len(completions))]
    samples = [Sample(p, c, 0.0, m) for p, c, m in zip(prompts, completions, masked, strict=True)]
    batch = collate_samples(samples, list(range(len(samples))))
    batch.packed.fields["advantages"] = adv
    S = len(samples)
    completion = torch.zeros(S, MAX_LEN, dtype=torch.long)
    mask = torch.zeros(S, MAX_LEN, dtype=torch.long)
    for i, c in enumerate(completions):
        completion[i, : len(c)] = torch.tensor(c)
        mask[i, : len(c)] = 0 if masked[i] else 1
    inputs = {"prompt_ids": torch.tensor(prompts), "completion_ids": completion,
              "prompt_mask": torch.ones(S, PROMPT, dtype=torch.long), "completion_mask": mask,
              "advantages": adv}  # fmt: skip
    with torch.no_grad():
        logps_N = -model.loss(batch.input_ids, batch.labels, batch.seq, reduction="none",
                              label_positions=batch.positions, temperature=TEMP)  # fmt: skip
    old_N = logps_N
    if off:  # near the policy, and on even completions pushed out of the clip range
        push = (adv.sign() * (torch.arange(S) % 2 == 0))[batch.segments]
        old_N = noisy(logps_N, 1, 0.05) - 0.3 * push
    batch.old_logps = old_N
    from slipstream.objectives.logps import segment_sums

    inputs["old_logps"] = segment_sums(old_N * batch.mask, batch.segments, S)
    trainer.model.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    trainer.model.train()
    want = trainer._compute_loss(trainer.model, inputs)
    want.backward()
    objective = RLOO(rewards=FixedRewards(), num_generations=G, max_completion_tokens=MAX_LEN,
                     temperature=TEMP, epsilon=0.2, epsilon_high=0.28, beta=0.0)  # fmt: skip
    loss, metrics = objective.micro_batch_loss(model, batch)
    (loss / objective.weight(batch)).backward()
    assert objective.weight(batch) == S
    torch.testing.assert_close(loss / S, want, atol=1e-5, rtol=1e-4)
    expected = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert expected.keys() == got.keys() and len(got) > 10
    # The ratio is exp() of a sum of up to 9 token log-probs: their float32 differences from
    # TRL's (~1e-6; it chunks its head) add up; measured worst 1.4e-5 on one of 512 entries.
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=3e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
    m = trainer._metrics["train"]
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert (metrics[key] / S).item() == pytest.approx(m[key][-1], abs=1e-6), key
    logged = objective.report({k: v.item() for k, v in metrics.items()}, S)
    assert logged["entropy"] == pytest.approx(m["entropy"][-1], abs=1e-5, rel=1e-5)
    assert "entropy/tokens" not in logged and 0 < logged["entropy"] < math.log(300)
    if off:
        assert 0 < m["clip_ratio/region_mean"][-1] < 1  # the off-policy case clips some
    model.zero_grad(set_to_none=True)
    with count_syncs() as c:  # the step itself: no host sync
        loss, _ = objective.micro_batch_loss(model, batch)
        loss.backward()
    assert c.total == 0, c


class WeightedRewards:
    """REWARDS as two reward functions of weights WEIGHTS (RewardFunctions' total)."""

    names, weights = ["a", "b"], WEIGHTS.tolist()
    total = RewardFunctions.total


def our_rollout(model, objective, prompts, completions):
    """RLOO.generate_batches with the sampling and the reward functions fixed (prompt-major
    as TRL's: G completions of each prompt in turn)."""
    examples = [SimpleNamespace(prompt_ids=p, image=None) for p in prompts[::G]]
    rows = [SimpleNamespace(token_ids=c, finish_reason="stop") for c in completions]
    objective.sample = lambda *a, **k: (examples, rows, 0.0)
    objective.score = lambda *a, **k: REWARDS.clone()
    batches = [SimpleNamespace(examples=examples)]
    return objective.generate_batches(model, None, batches, "cpu", seeds=[0])


@pytest.mark.parametrize("reference", ["base", "start"])
def test_lora_with_a_kl_penalty_equals_trl(tmp_path, reference):
    """LoRA with beta 0.05 and normalised advantages, against TRL's two references for a PEFT
    model: a fresh adapter (`base`: TRL disables the adapters) and a starting adapter loaded
    from a folder (`start`: TRL keeps a frozen copy named "ref"). The adapter is then moved
    (the same random step on both sides) so that policy != reference. Our rollout (the
    policy's and the reference's log-probs, sum_t (old - ref) taken off the reward,
    leave-one-out, normalised) gives TRL's advantages and its `kl` and reward metrics; TRL's
    `_compute_loss` on its rollout and ours on our batches give the same loss and every LoRA
    gradient."""
    import peft
    from helpers.tiny_hf import random_lora
    from transformers import AutoModelForCausalLM

    from slipstream.checkpoint.adapter import load_adapter
    from slipstream.checkpoint.hf import load_model
    from slipstream.objectives.reference import build_reference
    from slipstream.objectives.rloo import RLOO
    from slipstream.peft.lora import apply_lora

    save_test_tokenizer(tmp_path, "chatml", vocab_size=300)
    make_hf_model("llama", **TINY).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    options = dict(beta=0.05, normalize_advantages=True, epsilon=0.2, epsilon_high=0.28)
    if reference == "start":
        random_lora(load_model(tmp_path, dtype=torch.float32), tmp_path / "lora", "all-linear",
                    std=0.1)  # fmt: skip
        hf = peft.PeftModel.from_pretrained(hf, tmp_path / "lora", is_trainable=True)
        trainer = make_trainer(tmp_path, model=hf, **options)
        assert set(trainer.model.peft_config) == {"default", "ref"}
        model = load_adapter(load_model(tmp_path, dtype=torch.float32), tmp_path / "lora")
    else:
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
        trainer = make_trainer(tmp_path, model=hf, peft_config=lora, **options)
        assert set(trainer.model.peft_config) == {"default"}
        model = apply_lora(load_model(tmp_path, dtype=torch.float32), rank=4, alpha=8,
                           targets="all-linear")  # fmt: skip
    objective = RLOO(rewards=WeightedRewards(), num_generations=G, max_completion_tokens=MAX_LEN,
                     temperature=TEMP, **options)  # fmt: skip
    objective.reference = build_reference(model, full=False, reference=reference,
                                          from_adapter=reference == "start")  # fmt: skip
    assert objective.reference.kind == reference
    ours = dict(model.named_parameters())
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # the same step on both sides, away from the reference
        for n, p in trainer.model.named_parameters():
            if ".default." in n:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
                ours[trl_name(n)].copy_(p)
    assert trainer.ref_model is None  # TRL's reference: adapters off, or the "ref" adapter
    prompts, completions = fixed_completions()
    out = trl_rollout(trainer, prompts, completions)
    m = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    model.train()
    batches, rollout = our_rollout(model, objective, prompts, completions)
    S = len(completions)
    adv_S = torch.zeros(S)
    for b in batches:
        adv_S[b.sample] = b.advantages
    torch.testing.assert_close(adv_S, out["advantages"], atol=1e-5, rtol=1e-5)
    stats = rollout["stats"]
    assert abs(m["kl"]) > 1e-3  # the step moved the policy off the reference: a real penalty
    m["rewards/a/mean"] = m["rewards/<lambda>/mean"]  # TRL names its one function so
    for key in ("kl", "reward", "reward_std", "frac_reward_zero_std", "rewards/a/mean"):
        assert stats[key] == pytest.approx(m[key], abs=1e-6, rel=1e-5), key
    plain = leave_one_out(torch.tensor([(r * WEIGHTS).nansum() for r in REWARDS]), G)
    assert not torch.allclose(torch.nan_to_num(normalise(plain)), adv_S, atol=1e-3)

    trainer.model.zero_grad(set_to_none=True)
    want = trainer._compute_loss(trainer.model, out)
    want.backward()
    model.zero_grad(set_to_none=True)
    results = [objective.micro_batch_loss(model, b) for b in batches]
    loss = sum(r[0] for r in results) / S
    loss.backward()
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)
    sums = {k: sum(float(r[1][k]) for r in results) for k in results[0][1]}
    entropy = objective.report(sums, S)["entropy"]
    assert entropy == pytest.approx(trainer._metrics["train"]["entropy"][-1], abs=1e-5, rel=1e-5)
    expected = {trl_name(n): p.grad for n, p in trainer.model.named_parameters()
                if p.grad is not None}  # fmt: skip
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert expected.keys() == got.keys() and len(got) == 2 * 7 * 2, sorted(got)[:4]
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


def trl_name(name: str) -> str:
    """peft's parameter name as ours: no `base_model.model.` prefix, no adapter name."""
    return name.removeprefix("base_model.model.").replace(".default", "")


COMPLETION_STATS = [f"{k}_length" for k in ("mean", "min", "max", "mean_terminated",
                                             "min_terminated", "max_terminated")]  # fmt: skip
COMPLETION_STATS.append("clipped_ratio")


def test_completion_stats_equal_trl(tmp_path):
    """TRL's `completions/*` metrics (its `_generate`, the sampling fixed) and our rollout's
    on the same completions: some end in the eos (the eos counted in the length), the rest
    are cut; then none ends (TRL logs 0 for the terminated lengths)."""
    from slipstream.objectives.rloo import RLOO

    trainer = make_trainer(tmp_path, beta=0.0)
    eos = trainer.eos_token_ids[0]
    other = next(t for t in range(300) if t not in (*trainer.eos_token_ids,
                                                     trainer._tokenizer.pad_token_id))  # fmt: skip
    prompts, completions = fixed_completions()
    examples = [SimpleNamespace(prompt_ids=p, image=None) for p in prompts[::G]]
    for ended in ([0, 3, 4, 6], []):
        completions = [[*c[:-1], eos if i in ended else other] for i, c in enumerate(completions)]
        trainer._tokenize_prompts = lambda p: (prompts, None, None)
        trainer._generate_single_turn = lambda *a, c=completions: c
        trainer.model.train()
        trainer._generate([{"prompt": "hi"}] * len(prompts))
        theirs = {k: trainer._metrics["train"][f"completions/{k}"][-1] for k in COMPLETION_STATS}

        objective = RLOO(rewards=WeightedRewards(), num_generations=G,
                         max_completion_tokens=MAX_LEN, temperature=TEMP, beta=0.0)  # fmt: skip
        rows = [SimpleNamespace(token_ids=c, finish_reason="stop" if i in ended else "length")
                for i, c in enumerate(completions)]  # fmt: skip
        objective.sample = lambda *a, r=rows, **k: (examples, r, 0.0)
        objective.score = lambda *a, **k: REWARDS.clone()
        _, rollout = objective.generate_batches(None, None, [SimpleNamespace(examples=examples)],
                                                "cpu", seeds=[0])  # fmt: skip
        ours = {k: rollout["stats"][f"completions/{k}"] for k in COMPLETION_STATS}
        assert ours == pytest.approx(theirs, abs=1e-6), ended
        lengths = [len(c) for c in completions]
        assert theirs["clipped_ratio"] == 1 - len(ended) / len(completions)
        assert theirs["min_length"] < theirs["max_length"] and max(lengths) > min(lengths)
        if ended:  # the terminated lengths are a part's: not every completion's
            assert theirs["mean_terminated_length"] != theirs["mean_length"]
    assert theirs["max_terminated_length"] == 0  # the last case: none ended


def test_grad_accum_and_packing_equal_one_batch(tmp_path, monkeypatch):
    """A rollout's completions in one packed micro-batch, in two (grad-accum) and one per
    micro-batch (each sequence alone): the same loss, clip counts and every gradient. Old
    log-probs off the policy (some ratios clipped), normalised weight = the completions."""
    from slipstream.checkpoint.hf import load_model
    from slipstream.objectives.grpo_data import Sample
    from slipstream.objectives.logps import token_logps
    from slipstream.objectives.rloo import RLOO, collate_samples
    from slipstream.ops import attention
    from slipstream.train.loop import accumulate_gradients

    # One CPU attention path for every split (the dense mask and per-sequence calls sum in
    # another order).
    monkeypatch.setattr(attention, "per_sequence_wins", lambda lengths: True)
    make_hf_model("llama", **TINY).save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    prompts, completions = fixed_completions(seed=9)
    S = len(completions)
    adv_S = torch.randn(S, generator=torch.Generator().manual_seed(4))
    samples = [Sample(p, c, 0.0, False) for p, c in zip(prompts, completions, strict=True)]
    objective = RLOO(rewards=FixedRewards(), num_generations=G, max_completion_tokens=MAX_LEN,
                     temperature=TEMP, epsilon=0.2, epsilon_high=0.28, beta=0.0)  # fmt: skip

    def micro_batch(indices):
        b = collate_samples(samples, indices)
        b.packed.fields["advantages"] = adv_S[b.sample]
        with torch.no_grad():  # old = policy -/+ 0.06 a token by the completion's parity
            logps = token_logps(model, b.input_ids, b.labels, b.seq, b.positions, TEMP)
        b.old_logps = logps + 0.06 * (2 * (b.sample[b.segments] % 2) - 1)
        return b

    splits = ([list(range(S))], [[0, 5, 2], [1, 3, 4, 6, 7]], [[i] for i in range(S)])
    out = []
    for split in splits:
        window = [micro_batch(ix) for ix in split]
        model.zero_grad(set_to_none=True)
        loss, metrics = accumulate_gradients(model, window, objective)
        out.append((loss, metrics, {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert 0 < out[0][1]["clip_ratio/region_mean"] < S  # some clipped, not all
    for loss, metrics, grads in out[1:]:
        torch.testing.assert_close(loss, out[0][0], atol=1e-5, rtol=1e-5)
        for key, value in metrics.items():
            torch.testing.assert_close(value, out[0][1][key])
        for name, g in grads.items():
            torch.testing.assert_close(g, out[0][2][name], atol=1e-6, rtol=1e-4, msg=name)
