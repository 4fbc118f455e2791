"""RLOO against TRL 1.16's `RLOOTrainer`: its rollout math (`_generate_and_score_completions`
on fixed completions and rewards: the leave-one-out advantages, with unscorable completions,
a group with one scorable completion, normalisation, the KL penalty in the reward) and its
loss (`_compute_loss`: value and every parameter's gradient) on the same batch."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from helpers.models import make_hf_model
from helpers.tokenizers import save_test_tokenizer

from slipstream.objectives.rloo_loss import leave_one_out, normalise

trl = pytest.importorskip("trl")

G, MAX_LEN, TEMP, PROMPT = 4, 9, 0.7, 6
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            initializer_range=0.2)  # fmt: skip


def make_trainer(root, **args):
    from datasets import Dataset
    from transformers import AutoTokenizer

    save_test_tokenizer(root, "chatml", vocab_size=300)
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
            processing_class=AutoTokenizer.from_pretrained(root),
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
