"""GRPO's loss against TRL 1.16's `GRPOTrainer._compute_loss` on the same fixed completions,
advantages, old and reference log-probs, for each loss type: the loss and every parameter's
gradient (full fine-tuning of a tiny Llama, float32, temperature 0.7)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.models import make_hf_model
from helpers.tokenizers import save_test_tokenizer
from test_grpo import TINY, FixedRewards, grads, noisy, padded_completions, padded_values

from slipstream.checkpoint.hf import load_model
from slipstream.objectives.grpo import GRPO
from slipstream.objectives.grpo_data import Sample, collate_rollouts

trl = pytest.importorskip("trl")

G, MAX_LEN, TEMP = 4, 9, 0.7


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("grpo_trl")
    save_test_tokenizer(root, "chatml", vocab_size=300)
    hf = make_hf_model("llama", **TINY)
    hf.save_pretrained(root)
    args = trl.GRPOConfig(
        output_dir=str(root / "out"), per_device_train_batch_size=8, num_generations=G,
        max_completion_length=MAX_LEN, temperature=TEMP, epsilon=0.2, epsilon_high=0.28,
        beta=0.0, report_to=[], use_cpu=True, bf16=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.GRPOTrainer(
            model=hf, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
            args=args, train_dataset=Dataset.from_list([{"prompt": "hi"}] * 8),
            processing_class=AutoTokenizer.from_pretrained(root),
        )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1
    # native, and the generic family (transformers' modeling code) on the same checkpoint
    impls = ("native", "transformers")
    return trainer, {i: load_model(root, dtype=torch.float32, implementation=i) for i in impls}


def samples_and_inputs(masked: bool):
    """8 completions of 2 prompts of equal length (TRL left-pads prompts; HF positions would
    then shift), right-padded completions as TRL batches them."""
    g = torch.Generator().manual_seed(7)
    samples = []
    for p in range(2):
        prompt = torch.randint(0, 300, (6,), generator=g).tolist()
        for k in range(G):
            n = int(torch.randint(1, MAX_LEN + 1, (1,), generator=g))
            ids = torch.randint(0, 300, (n,), generator=g).tolist()
            samples.append(Sample(prompt, ids, float(torch.randn((), generator=g)),
                                  masked and (p * G + k) % 3 == 0))  # fmt: skip
    S = len(samples)
    completion, mask = padded_completions(samples, MAX_LEN)
    inputs = {
        "prompt_ids": torch.tensor([s.prompt_ids for s in samples]),
        "prompt_mask": torch.ones(S, 6, dtype=torch.long),
        "completion_ids": completion, "completion_mask": mask,
        "advantages": torch.tensor([s.advantage for s in samples]),
        "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    return samples, inputs


def flat(x_SL, samples):
    return torch.cat([x_SL[i, : len(s.completion_ids)] for i, s in enumerate(samples)])


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("implementation", ["native", "transformers"])
def test_loss_and_gradients_equal_trl(setup, loss_type, off_policy, implementation):
    trainer, models = setup
    model = models[implementation]
    trainer.loss_type, trainer.beta = loss_type, 0.04 if off_policy else 0.0
    samples, inputs = samples_and_inputs(masked=off_policy)
    batch = collate_rollouts(samples, loss_type, MAX_LEN)
    if off_policy:  # stored old log-probs (mu > 1) and a reference, both near the policy's
        with torch.no_grad():
            logps_N = -model.loss(batch.input_ids, batch.labels, batch.seq, reduction="none",
                                  label_positions=batch.positions, temperature=TEMP)  # fmt: skip
        padded = padded_values(logps_N, samples, MAX_LEN)
        inputs["old_per_token_logps"] = noisy(padded, 1)
        inputs["ref_per_token_logps"] = noisy(padded, 2)
        batch.old_logps = flat(inputs["old_per_token_logps"], samples)
        batch.ref_logps = flat(inputs["ref_per_token_logps"], samples)
    trainer.model.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    trainer.model.train()
    want = trainer._compute_loss(trainer.model, inputs)
    want.backward()
    objective = GRPO(rewards=FixedRewards(), num_generations=G, loss_type=loss_type,
                     max_completion_tokens=MAX_LEN, temperature=TEMP, epsilon=0.2,
                     epsilon_high=0.28, beta=trainer.beta)  # fmt: skip
    loss, metrics = objective.micro_batch_loss(model, batch)
    (loss / objective.weight(batch)).backward()
    # float32 log-prob differences (~1e-6, TRL chunks its head) grow through exp() of ratios
    torch.testing.assert_close(loss / objective.weight(batch), want, atol=1e-5, rtol=1e-4)
    expected, got = grads(trainer.model), grads(model)
    assert expected.keys() == got.keys() and len(got) > 10
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4)
    if off_policy:  # TRL's logged token means over unmasked tokens
        m = trainer._metrics["train"]
        clip = metrics["clip_ratio/region_mean"] / batch.weight
        assert clip.item() == pytest.approx(m["clip_ratio/region_mean"][-1], abs=1e-6)
        assert (metrics["kl"] / batch.weight).item() == pytest.approx(m["kl"][-1], rel=1e-5)
