"""GRPO's loss against a direct, padded implementation of the published formulas (TRL's
layout) on a tiny Llama with fixed completions and rewards: advantages, loss and gradients for
each loss type, with clipping, the KL term and masked truncated completions; grad-accum
equivalence; no host sync in the training part; chunked log-probs over a large vocabulary;
config and data errors."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from helpers.models import make_hf_model

from slipstream.checkpoint.hf import load_model
from slipstream.config import config_from_dict
from slipstream.debug import count_syncs
from slipstream.objectives.grpo import GRPO
from slipstream.objectives.grpo_data import Sample, collate_rollouts, tokenize_prompts
from slipstream.objectives.grpo_loss import advantages
from slipstream.ops import attention
from slipstream.rewards import build_rewards
from slipstream.train.loop import accumulate_gradients

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            initializer_range=0.2)  # fmt: skip
G, MAX_LEN = 4, 9


class FixedRewards:
    """A RewardFunctions stand-in: names, weights, a call returning fixed values."""

    names, weights = ["a", "b"], [1.0, 0.5]

    def __call__(self, prompts, completions, columns, rows, **kwargs):
        return torch.tensor([[float(len(c)), math.nan] for c in completions])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    hf = make_hf_model("llama", **TINY)
    hf.save_pretrained(root)
    return hf, load_model(root, dtype=torch.float32)


def fixed_samples(seed=0, masked_every=0):
    """2 prompts x G completions of random lengths 1..MAX_LEN; fixed advantages."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for p in range(2):
        prompt = torch.randint(0, 300, (5 + 2 * p,), generator=g).tolist()
        for k in range(G):
            n = int(torch.randint(1, MAX_LEN + 1, (1,), generator=g))
            completion = torch.randint(0, 300, (n,), generator=g).tolist()
            adv = float(torch.randn((), generator=g))
            masked = bool(masked_every) and (p * G + k) % masked_every == 0
            samples.append(Sample(prompt, completion, adv, masked))
    return samples


def noisy(values, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    return values + scale * torch.randn(values.shape, generator=g)


def padded_values(values_N, samples, length: int) -> torch.Tensor:
    """(S, length): the samples' flat per-token values (completion tokens in sample order),
    right-padded with zeros as TRL's per-token tensors are."""
    out = torch.zeros(len(samples), length)
    start = 0
    for i, s in enumerate(samples):
        n = len(s.completion_ids)
        out[i, :n] = values_N[start : start + n]
        start += n
    return out


def padded_completions(samples, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(completion ids, completion mask), (S, length) each, right-padded as TRL's rollout
    hands them to its loss; a masked sample's mask is all zeros."""
    completion = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    for i, s in enumerate(samples):
        completion[i, : len(s.completion_ids)] = torch.tensor(s.completion_ids)
        mask[i, : len(s.completion_ids)] = 0 if s.masked else 1
    return completion, mask


def padded_reference(hf, samples, loss_type, *, eps=0.2, eps_high=0.28, beta=0.0, temp=1.0,
                     old_noise=None, ref_noise=None):  # fmt: skip
    """The formulas on TRL's padded (S, L) layout: per-token log-probs from each sequence run
    alone, the clipped surrogate, k3 KL weighted by the ratio, each loss type's normaliser."""
    S, L = len(samples), max(len(s.completion_ids) for s in samples)
    logps = torch.zeros(S, L)
    mask = torch.zeros(S, L)
    for i, s in enumerate(samples):
        ids = torch.tensor(s.prompt_ids + s.completion_ids)
        logits = hf(input_ids=ids[None]).logits[0] / temp
        p, n = len(s.prompt_ids), len(s.completion_ids)
        lp = logits[p - 1 : p - 1 + n].log_softmax(-1).gather(1, ids[p:, None])[:, 0]
        logps = logps.index_put((torch.tensor([i]), torch.arange(n)), lp)
        mask[i, :n] = 0.0 if s.masked else 1.0
    flat = lambda x: torch.cat([x[i, : len(s.completion_ids)] for i, s in enumerate(samples)])  # noqa: E731
    old = logps.detach() if old_noise is None else noisy(logps.detach(), old_noise)
    ref = noisy(logps.detach(), ref_noise) if ref_noise is not None else None
    adv = torch.tensor([s.advantage for s in samples])[:, None]
    ratio = torch.exp(logps - old)
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps_high) * adv)
    if beta:
        per_token = per_token + beta * (torch.exp(ref - logps) - (ref - logps) - 1) * ratio
    if loss_type == "dapo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    elif loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    else:
        loss = (per_token * mask).sum() / (S * MAX_LEN)
    return loss, flat(old), flat(ref) if ref is not None else None


def our_loss(model, samples, loss_type, old=None, ref=None, **options):
    objective = GRPO(rewards=FixedRewards(), num_generations=G, loss_type=loss_type,
                     max_completion_tokens=MAX_LEN, **options)  # fmt: skip
    batch = collate_rollouts(samples, loss_type, MAX_LEN)
    batch.old_logps, batch.ref_logps = old, ref
    loss, metrics = objective.micro_batch_loss(model, batch)
    return loss / objective.weight(batch), metrics, batch


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("case", ["on_policy", "clipped_kl_masked"])
def test_loss_and_gradients_equal_the_formulas(models, loss_type, case):
    hf, model = models
    off = case != "on_policy"
    samples = fixed_samples(masked_every=3 if off else 0)
    options = dict(epsilon=0.2, epsilon_high=0.28, beta=0.04 if off else 0.0, temperature=0.7)
    hf.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    ref_loss, old, ref = padded_reference(
        hf, samples, loss_type, eps=0.2, eps_high=0.28, beta=options["beta"], temp=0.7,
        old_noise=1 if off else None, ref_noise=2 if off else None,
    )  # fmt: skip
    ref_loss.backward()
    loss, metrics, _ = our_loss(model, samples, loss_type, old if off else None, ref, **options)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    expected, got = grads(hf), grads(model)
    assert expected.keys() == got.keys() and len(got) > 10
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4)
    clip = metrics["clip_ratio/region_mean"]
    assert (clip > 0) == off  # noise 0.3 in the old log-probs clips some tokens
    assert ("kl" in metrics) == off


def nan_std(values):
    kept = [v for v in values if not math.isnan(v)]
    return statistics.stdev(kept) if len(kept) > 1 else math.nan


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_the_direct_computation(scale):
    g = torch.Generator().manual_seed(3)
    r_SF = torch.randn(12, 2, generator=g)
    r_SF[1, 1] = r_SF[5, 0] = math.nan
    r_SF[6] = math.nan  # every function None: no reward, advantage 0
    r_SF[8:12, 0] = 1.0  # a group with no spread in total reward
    r_SF[8:12, 1] = 2.0
    specs = [{"function": "accuracy"}, {"function": "format", "pattern": "x", "weight": 0.5}]
    total = build_rewards(specs).total(r_SF)
    adv, zero = advantages(total, 4, scale)
    rows = [[x for x in row.tolist()] for row in r_SF]
    want_total = [
        math.nan if all(math.isnan(x) for x in r) else sum(w * x for w, x in zip((1, 0.5), r)
                                                          if not math.isnan(x))
        for r in rows
    ]  # fmt: skip
    assert torch.allclose(total, torch.tensor(want_total), equal_nan=True)
    batch_std = nan_std(want_total)
    for i, r in enumerate(want_total):
        group = want_total[i // 4 * 4 : i // 4 * 4 + 4]
        mean = statistics.fmean(v for v in group if not math.isnan(v))
        std = batch_std if scale == "batch" else nan_std(group)
        a = r - mean if scale == "none" else (r - mean) / (std + 1e-4)
        assert adv[i].item() == pytest.approx(0.0 if math.isnan(a) else a, abs=1e-5)
        assert bool(zero[i]) == (abs(std) < 1e-8)
    assert bool(zero[8]) == (scale != "batch")


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_grad_accum_equals_one_batch(models, loss_type, monkeypatch):
    _, model = models
    # One CPU attention path for the whole window and its parts (their lengths could pick
    # the dense mask for one and per-sequence calls for the other: another summation order).
    monkeypatch.setattr(attention, "per_sequence_wins", lambda lengths: True)
    samples = fixed_samples(seed=4, masked_every=5)
    objective = GRPO(rewards=FixedRewards(), num_generations=G, loss_type=loss_type,
                     max_completion_tokens=MAX_LEN, mask_truncated_completions=True)  # fmt: skip
    whole = [collate_rollouts(samples, loss_type, MAX_LEN)]
    parts = [collate_rollouts(samples[:3], loss_type, MAX_LEN),
             collate_rollouts(samples[3:], loss_type, MAX_LEN)]  # fmt: skip
    out = []
    for window in (whole, parts):
        model.zero_grad(set_to_none=True)
        loss, metrics = accumulate_gradients(model, window, objective)
        out.append((loss, grads(model)))
    assert sum(objective.weight(b) for b in parts) == objective.weight(whole[0])
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-5, rtol=1e-5)
    for name, g in out[0][1].items():
        torch.testing.assert_close(out[1][1][name], g, atol=1e-6, rtol=1e-4)


def test_training_part_has_no_host_sync(models):
    _, model = models
    samples = fixed_samples(seed=5)
    batch = collate_rollouts(samples, "dapo", MAX_LEN)
    batch.old_logps = torch.zeros(batch.positions.numel()) - 3.0
    objective = GRPO(rewards=FixedRewards(), num_generations=G, beta=0.1, max_completion_tokens=9)
    batch.ref_logps = torch.zeros(batch.positions.numel()) - 2.0
    model.zero_grad(set_to_none=True)
    with count_syncs() as syncs:
        loss, metrics = objective.micro_batch_loss(model, batch)
        (loss / objective.weight(batch)).backward()
    assert syncs.total == 0, syncs
    assert set(metrics) == {"clip_ratio/region_mean", "kl"}


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements any op's output had inside the block."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_loss_memory_does_not_grow_with_vocab_times_tokens(tmp_path, monkeypatch):
    from slipstream.ops import loss as loss_mod

    V, rows = 20_000, 32
    hf = make_hf_model("llama", vocab_size=V, hidden_size=16, intermediate_size=32,
                       num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    monkeypatch.setattr(loss_mod, "_CHUNK_ELEMENTS", V * rows)  # 32 rows of logits a chunk
    objective = GRPO(rewards=FixedRewards(), num_generations=2, max_completion_tokens=64)
    largest = []
    for n in (100, 400):  # completion tokens: 4x more
        g = torch.Generator().manual_seed(n)
        samples = [Sample([1, 2, 3], torch.randint(0, V, (n // 4,), generator=g).tolist(),
                          0.5 - k % 2, False) for k in range(4)]  # fmt: skip
        batch = collate_rollouts(samples, "dapo", 64)
        model.zero_grad(set_to_none=True)
        with LargestTensor() as mode:
            loss, _ = objective.micro_batch_loss(model, batch)
            loss.backward()
        largest.append(mode.largest)
        assert mode.largest <= rows * V < n * V // 3, (n, mode.largest)
    assert largest[0] == largest[1]  # one chunk of logits, whatever the token count


def raw_config(**grpo):
    return {
        "model": {"path": "m"}, "data": {"train": "d.jsonl"}, "output_dir": "o",
        "train": {"objective": "grpo", "tokens_per_batch": 4096},
        "grpo": {"rewards": [{"function": "accuracy"}], **grpo},
    }  # fmt: skip


def test_config_errors_are_one_line():
    from slipstream.config import describe_config

    listed = {line.split()[0]: line.split()[1] for line in describe_config("grpo").splitlines()[1:]}
    assert listed["rewards"] == "[]" and listed["num_generations"] == "8"
    cfg = config_from_dict(raw_config())
    assert cfg.grpo.num_generations == 8 and cfg.grpo.loss_type == "dapo"
    cases = {
        "num_generations": (dict(num_generations=1), "grpo.num_generations"),
        "fits": (dict(max_completion_tokens=1024), "exceeds train.tokens_per_batch=4096"),
        "rewards": (dict(rewards=[]), "needs grpo.rewards"),
        "loss": (dict(loss_type="bnpo"), "grpo.loss_type"),
    }
    for what, (options, text) in cases.items():
        with pytest.raises(ValueError) as e:
            config_from_dict(raw_config(**options))
        assert text in str(e.value) and "\n" not in str(e.value), (what, e.value)


def test_prompt_rows_tokenize_and_a_missing_prompt_column_is_one_line(tmp_path):
    from helpers.tokenizers import save_test_tokenizer
    from transformers import AutoTokenizer

    save_test_tokenizer(tmp_path, "chatml", vocab_size=300)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    objective = GRPO(rewards=FixedRewards(), num_generations=2, max_prompt_tokens=12)
    with pytest.raises(ValueError, match="needs a 'prompt' column") as e:
        objective.tokenize([{"question": "1+1?", "answer": "2"}], tok)
    assert "\n" not in str(e.value)
    rows = [
        {"prompt": [{"role": "user", "content": "What is 1+1?"}], "answer": "2"},
        {"prompt": "The sky is", "answer": "blue"},
        {"prompt": "word " * 60, "answer": "x"},  # over max_prompt_tokens: dropped, counted
        {"prompt": 3, "answer": "y"},
    ]
    examples, report = tokenize_prompts(rows, tok, max_prompt_tokens=30, first_row=10)
    assert [ex.row for ex in examples] == [10, 11] and report.dropped == 1
    assert report.skipped["bad_prompt"] == 1 and "row 13" in report.first_skip
    chat = tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=True)
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    assert examples[0].prompt_ids == list(chat) and examples[0].columns == {"answer": "2"}
    assert objective.length(examples[1]) == 2 * (len(examples[1].prompt_ids) + 256)


def test_keyword_defaults_equal_the_config_sections():
    from slipstream.objectives.grpo_config import GRPOSection

    assert GRPO(rewards=FixedRewards()).options.model_dump() == GRPOSection().model_dump()
    assert GRPO(rewards=FixedRewards(), beta=0.5).options.beta == 0.5
    with pytest.raises(ValueError, match="GRPO options \\['bogus'\\]"):
        GRPO(rewards=FixedRewards(), bogus=1)


def test_prompt_text_parts_are_joined_and_image_parts_counted(tmp_path):
    from helpers.tokenizers import save_test_tokenizer
    from transformers import AutoTokenizer

    from slipstream.generation.api import prompt_ids

    tok = AutoTokenizer.from_pretrained(save_test_tokenizer(tmp_path, "chatml", vocab_size=300))
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "1+1?"}]
    image = [{"type": "image", "url": "cat.png"}, {"type": "text", "text": "What is it?"}]
    rows = [
        {"prompt": [{"role": "user", "content": parts}], "answer": "2"},
        {"prompt": [{"role": "user", "content": image}], "answer": "cat"},
    ]
    examples, report = tokenize_prompts(rows, tok, max_prompt_tokens=64)
    plain = [{"role": "user", "content": "What is 1+1?"}]
    assert [ex.prompt_ids for ex in examples] == [prompt_ids(plain, tok)]
    assert examples[0].prompt == rows[0]["prompt"]  # the rewards get the row's own prompt
    assert dict(report.skipped) == {"image_part": 1} and "need a vision model" in (
        report.first_skip
    )
    # generate() and the generate command read parts the same way.
    assert prompt_ids(rows[0]["prompt"], tok) == prompt_ids(plain, tok)
    with pytest.raises(ValueError, match="prompt 0: message 0 part 0 is 'image': image parts"):
        prompt_ids(rows[1]["prompt"], tok)
