"""GRPO (and RLOO) on prompts with images (TRL's vision format: conversational `prompt` with
`{"type": "image"}` parts and a row-level `images` list), on tiny random image-text models
(tests/helpers/tiny_vlm.py), float32 on CPU.

- TRL 1.16's `GRPOTrainer._compute_loss` + peft on LLaVA (generic path) and Gemma 3 (native
  family), given the same prompts, completions and advantages: TRL's processor's prompt ids
  equal ours, and the loss and every LoRA gradient equal its own (1e-4 rel), on policy and
  off policy (stored old and reference log-probs, beta > 0, a masked truncated completion).
  TRL's inputs are built as its `_generate_and_score_completions` builds them: the processor
  over the prompts' template text and images, each completion carrying its prompt's images,
  Gemma's `token_type_ids` extended with zeros over the completion.
- The rollout with images is `slipstream.generate`'s greedy output on those prompts (and not
  the output without the image); sampled rollouts pack one set of images a prompt.
- Packed completions of several prompts equal each group alone (loss, metrics, gradients) with
  no host sync over a LoRA step with a KL term, on Qwen2.5-VL (native, 3-D positions), Gemma 3
  (native, bidirectional image rows) and LLaVA (generic); RLOO's loss too. Bad rows counted;
  a 2-step CLI run; (slow) 2 DDP ranks equal one process.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from datasets import Dataset
from helpers.image_objective_runs import (
    assert_cli_run_moves_a_tower_adapter,
    assert_two_ranks_match_one_process,
    image_prompt_run,
    peft_vlm,
)
from helpers.models import randomise_lora_b
from helpers.tiny_vlm import (
    assert_lora_grads_match,
    random_image,
    randomise_constant_tensors,
    vlm_folder,
)
from test_grpo import noisy, padded_completions, padded_values

import slipstream
from slipstream.data.vision import FEATURE_INDEX, ImageProcessing
from slipstream.generation.sampling import Sampling
from slipstream.objectives.grpo import GRPO
from slipstream.objectives.grpo_data import (
    PromptBatch,
    Sample,
    collate_rollouts,
    tokenize_prompts,
)
from slipstream.objectives.reference import ReferencePolicy
from slipstream.objectives.rloo import RLOO

trl = pytest.importorskip("trl")

G, MAX_LEN, TEMP = 3, 7, 0.7
REWARDS = str(Path(__file__).parent / "helpers" / "grpo_rewards.py")


def _row(k, sizes, text="What is it?"):
    parts = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": text}]
    return {"prompt": [{"role": "user", "content": parts}],
            "images": [random_image(h, w, seed=10 * k + h) for h, w in sizes]}  # fmt: skip


# Two prompts of equal length (TRL left-pads prompts, which would shift HF's positions).
ROWS = [_row(0, [(50, 90)]), _row(1, [(60, 40)])]
TEXT_ROW = {"prompt": [{"role": "user", "content": "Hi there"}]}


class Length:
    """A RewardFunctions stand-in: one function, the completion's length."""

    names, weights = ["length"], [1.0]

    def __call__(self, prompts, completions, columns, rows, **kwargs):
        return torch.tensor([[float(len(c[0]["content"]))] for c in completions])

    def total(self, r_SF):
        return r_SF[:, 0]


def _setup(root, kind):
    """(folder, tokenizer, image side, our model with a random LoRA, its adapter folder): as
    helpers' `lora_vlm`, but the checkpoint's constant tensors randomised before it loads
    (Gemma 3's projector starts at zero: its images would not count)."""
    folder = vlm_folder(root / kind, kind)
    randomise_constant_tensors(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    side = ImageProcessing.from_model(str(folder), tok)
    model = slipstream.load_model(folder)
    torch.manual_seed(0)
    slipstream.apply_lora(model, rank=4, alpha=8)
    randomise_lora_b(model, 0.2)
    slipstream.save_adapter(model, root / f"{kind}-adapter")
    return folder, tok, side, model, root / f"{kind}-adapter"


def _grpo(**options):
    defaults = dict(num_generations=G, max_completion_tokens=MAX_LEN, temperature=TEMP,
                    epsilon=0.2, epsilon_high=0.28)  # fmt: skip
    return GRPO(rewards=Length(), **{**defaults, **options})


def _completions(prompts, seed=7, vocab=250, masked=False):
    """Samples: G completions of random lengths (ids < vocab: no special or image token) of
    each prompt example, fixed advantages."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for p, ex in enumerate(prompts):
        for k in range(G):
            n = int(torch.randint(1, MAX_LEN + 1, (1,), generator=g))
            ids = torch.randint(3, vocab, (n,), generator=g).tolist()
            samples.append(Sample(ex.prompt_ids, ids, float(torch.randn((), generator=g)),
                                  masked and (p * G + k) % 4 == 1, ex.image))  # fmt: skip
    return samples


# -- TRL's GRPOTrainer ----------------------------------------------------------------------
def _trl_inputs(trainer, samples, rows):
    """TRL's training inputs for these completions of `rows` (G each, in order), as its
    `_generate_and_score_completions` builds them (module docstring)."""
    from trl.data_utils import apply_chat_template

    processor = trainer.processing_class
    texts = [apply_chat_template({"prompt": r["prompt"]}, processor)["prompt"] for r in rows]
    texts = [t for t in texts for _ in range(G)]
    images = [r["images"] for r in rows for _ in range(G)]
    prompt = processor(images=images, text=texts, padding=True, return_tensors="pt")
    completion, mask = padded_completions(samples, MAX_LEN)
    extra = {k: v for k, v in prompt.items() if k not in ("input_ids", "attention_mask")}
    if "token_type_ids" in extra:  # zeros over the completion, as TRL extends them
        extra["token_type_ids"] = torch.cat([extra["token_type_ids"], torch.zeros_like(mask)], 1)
    inputs = {
        "prompt_ids": prompt["input_ids"], "prompt_mask": prompt["attention_mask"],
        "completion_ids": completion, "completion_mask": mask,
        "advantages": torch.tensor([s.advantage for s in samples]),
        "num_items_in_batch": mask.sum(), "num_images": [len(i) for i in images], **extra,
    }  # fmt: skip
    return inputs


def _flat(x_SL, samples):
    return torch.cat([x_SL[i, : len(s.completion_ids)] for i, s in enumerate(samples)])


@pytest.mark.parametrize("kind", ["llava", "gemma3"])
@pytest.mark.parametrize("case", ["dapo_on_policy", "grpo_off_policy_kl_masked"])
def test_grpo_loss_and_lora_grads_equal_trl(tmp_path, kind, case):
    folder, tok, side, model, adapter = _setup(tmp_path, kind)
    assert ("native family" in model.load_path) == (kind == "gemma3"), model.load_path
    loss_type, off = case.split("_")[0], "off_policy" in case
    beta = 0.04 if off else 0.0
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=2 * G, num_generations=G,
        max_completion_length=MAX_LEN, temperature=TEMP, epsilon=0.2, epsilon_high=0.28,
        beta=beta, loss_type=loss_type, report_to=[], use_cpu=True, bf16=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.GRPOTrainer(
            model=peft_vlm(folder, adapter),
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
            train_dataset=Dataset.from_list(ROWS),
            processing_class=transformers.AutoProcessor.from_pretrained(folder),
        )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1
    prompts, report = tokenize_prompts(ROWS, tok, max_prompt_tokens=1 << 20, images=side)
    assert report.kept == 2 and all(p.image is not None for p in prompts)
    samples = _completions(prompts, masked=off)
    inputs = _trl_inputs(trainer, samples, ROWS)
    assert bool(inputs["prompt_mask"].all())  # equal prompt lengths: no left padding
    for i, s in enumerate(samples):  # TRL's processor's prompt ids are ours
        assert inputs["prompt_ids"][i].tolist() == s.prompt_ids
    objective = _grpo(loss_type=loss_type, beta=beta)
    batch = collate_rollouts(samples, loss_type, MAX_LEN)
    assert batch.packed.fields["pixel_values"].shape[0] == 2  # one image a prompt, not G
    if off:  # stored old log-probs (mu > 1) and a reference, both near the policy's
        with torch.no_grad():
            logps_N = GRPO.token_logps(model, batch, TEMP)
        inputs["old_per_token_logps"] = noisy(padded_values(logps_N, samples, MAX_LEN), 1, 0.1)
        inputs["ref_per_token_logps"] = noisy(padded_values(logps_N, samples, MAX_LEN), 2, 0.1)
        batch.old_logps = _flat(inputs["old_per_token_logps"], samples)
        batch.ref_logps = _flat(inputs["ref_per_token_logps"], samples)
    trainer.loss_type, trainer.beta = loss_type, beta
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    want = trainer._compute_loss(trainer.model, inputs)
    want.backward()
    model.zero_grad(set_to_none=True)
    loss, metrics = objective.micro_batch_loss(model, batch)
    (loss / objective.weight(batch)).backward()
    torch.testing.assert_close(loss / objective.weight(batch), want.detach(), rtol=1e-4,
                               atol=1e-6)  # fmt: skip
    assert_lora_grads_match(model, trainer.model)
    if off:  # TRL's logged token means over unmasked tokens
        m = trainer._metrics["train"]
        kl = (metrics["kl"] / batch.weight).item()
        assert kl == pytest.approx(m["kl"][-1], rel=1e-4) and kl > 0
        clip = (metrics["clip_ratio/region_mean"] / batch.weight).item()
        assert clip == pytest.approx(m["clip_ratio/region_mean"][-1], abs=1e-6)


# -- the rollout ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _setup(tmp_path_factory.mktemp("grpo_vision"), "qwen2_5_vl")


def _inline(row):
    """The row's prompt with its images inline (what `slipstream.generate` reads)."""
    images = iter(row["images"])
    return [{**m, "content": [{"type": "image", "image": next(images)} if p["type"] == "image"
                              else p for p in m["content"]]} for m in row["prompt"]]  # fmt: skip


def test_rollout_with_images_is_generates_greedy_output(qwen):
    folder, tok, side, model, _ = qwen
    rows = [ROWS[0], _row(2, [(40, 40), (30, 30)], "Which two?"), TEXT_ROW]
    prompts, _ = tokenize_prompts(rows, tok, max_prompt_tokens=1 << 20, images=side)
    objective = _grpo()
    ours = [r.token_ids for r in objective._complete(model, tok, prompts, Sampling(0.0))]
    generated = slipstream.generate(
        model, [_inline(rows[0]), _inline(rows[1]), TEXT_ROW["prompt"]], tokenizer=tok,
        max_new_tokens=MAX_LEN, temperature=0.0,
    )  # fmt: skip
    assert ours == [c.token_ids for c in generated]
    # Without its image the same prompt continues otherwise.
    bare = [{**m, "content": [p for p in m["content"] if p["type"] != "image"]}
            for m in ROWS[0]["prompt"]]  # fmt: skip
    (text_only,), _ = tokenize_prompts([{"prompt": bare}], tok, max_prompt_tokens=1 << 20)
    assert objective._complete(model, tok, [text_only], Sampling(0.0))[0].token_ids != ours[0]
    # A sampled rollout: G completions a prompt, rewarded, packed with one set of images a prompt.
    batches, stats = objective.generate_batches(model, tok, [PromptBatch(prompts)], "cpu",
                                                seeds=[3])  # fmt: skip
    (batch,) = batches
    assert batch.num_sequences == 3 * G and stats["stats"]["completions/max_length"] <= MAX_LEN
    fields = batch.packed.fields
    assert fields["image_grid_thw"].shape[0] == 3  # the prompts' 3 images, not 3 * G
    assert fields["image_rows"].shape == fields[FEATURE_INDEX].shape
    rows = sum(len(p.image.feature_rows()) for p in prompts[:2])
    assert fields["image_rows"].shape[0] == G * rows


# -- packing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen2_5_vl", "gemma3", "llava"])
def test_packed_groups_equal_each_alone_without_host_syncs(tmp_path, kind):
    folder, tok, side, model, _ = _setup(tmp_path, kind)
    rows = [ROWS[0], _row(2, [(40, 40), (30, 30)], "Which two?"), TEXT_ROW]
    prompts, _ = tokenize_prompts(rows, tok, max_prompt_tokens=1 << 20, images=side)
    objective = _grpo(beta=0.04)
    objective.reference = ReferencePolicy(model, "base")
    samples = _completions(prompts, seed=3)

    def step(batch):
        objective.add_logps(model, [batch])
        model.zero_grad(set_to_none=True)
        loss, metrics = objective.micro_batch_loss(model, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), metrics, grads

    packed = collate_rollouts(samples, "dapo", MAX_LEN)
    objective.add_logps(model, [packed])
    model.zero_grad(set_to_none=True)
    with slipstream.count_syncs() as syncs:
        loss, metrics = objective.micro_batch_loss(model, packed)
        loss.backward()
    assert syncs.total == 0, syncs
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    alone = [step(collate_rollouts(samples[i : i + G], "dapo", MAX_LEN))
             for i in range(0, len(samples), G)]  # fmt: skip
    torch.testing.assert_close(loss.detach(), sum(a[0] for a in alone), rtol=1e-5, atol=1e-6)
    for key in ("kl", "clip_ratio/region_mean"):
        torch.testing.assert_close(metrics[key], sum(a[1][key] for a in alone), rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
    assert metrics["kl"] > 0
    assert got and got.keys() == alone[0][2].keys()
    for name, grad in got.items():
        want = sum(a[2][name] for a in alone)
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-5 * want.abs().max())
    # The tower ran on each prompt's images once; its features are gathered per image row
    # (another pairing of rows and features gives other log-probs).
    fields = packed.packed.fields
    assert fields[FEATURE_INDEX].shape[0] == G * fields[FEATURE_INDEX].unique().shape[0]
    with torch.no_grad():
        base = GRPO.token_logps(model, packed, TEMP)
        index = fields[FEATURE_INDEX]
        fields[FEATURE_INDEX] = index.flip(0)
        other = GRPO.token_logps(model, packed, TEMP)
        fields[FEATURE_INDEX] = index
    assert not torch.allclose(base, other)


def test_rloo_packed_groups_equal_each_alone(qwen):
    folder, tok, side, model, _ = qwen
    prompts, _ = tokenize_prompts([ROWS[0], ROWS[1], TEXT_ROW], tok, max_prompt_tokens=1 << 20,
                                  images=side)  # fmt: skip
    objective = RLOO(rewards=Length(), num_generations=G, max_completion_tokens=MAX_LEN,
                     temperature=TEMP)  # fmt: skip
    samples = _completions(prompts, seed=5)
    adv = torch.randn(len(samples), generator=torch.Generator().manual_seed(0))

    def collate(indices):  # host work: the batch and its advantages
        b = objective.collate_samples(samples, indices)
        b.packed.fields["advantages"] = adv.index_select(0, b.sample)
        return b

    packed = collate(list(range(len(samples))))
    assert packed.packed.fields["image_grid_thw"].shape[0] == 2  # one image a prompt, not G
    with slipstream.count_syncs() as syncs:
        loss, metrics = objective.micro_batch_loss(model, packed)
        loss.backward()
    assert syncs.total == 0, syncs
    with torch.no_grad():
        alone = [objective.micro_batch_loss(model, collate(list(range(i, i + G))))
                 for i in range(0, len(samples), G)]  # fmt: skip
    torch.testing.assert_close(loss.detach(), sum(a[0] for a in alone), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["entropy"], sum(a[1]["entropy"] for a in alone),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


# -- bad rows ---------------------------------------------------------------------------------
def test_bad_image_prompts_are_counted_skips(tmp_path, qwen):
    folder, tok, side, model, _ = qwen
    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]
    pic = random_image(30, 30)
    video = [{"role": "user", "content": [{"type": "video"}, *one[0]["content"]]}]
    rows = [
        {"prompt": one, "images": [str(tmp_path / "gone.png")]},  # image_missing
        {"prompt": two, "images": [pic]},  # more parts than images
        {"prompt": one, "images": [pic, pic]},  # fewer
        {"prompt": "What is it?", "images": [pic]},  # images beside a string prompt
        {"prompt": one, "images": ["https://example.com/a.png"]},  # remote_image
        {"prompt": video, "images": [pic]},  # unsupported_part
        ROWS[0],
    ]
    prompts, report = tokenize_prompts(rows, tok, max_prompt_tokens=1 << 20, images=side)
    assert len(prompts) == 1 and report.kept == 1
    assert dict(report.skipped) == {"image_missing": 1, "image_count": 2, "image_format": 1,
                                    "remote_image": 1, "unsupported_part": 1}  # fmt: skip
    with pytest.raises(ValueError, match=r"^data row 0: image_count: [^\n]*$"):
        tokenize_prompts(rows[1:2], tok, max_prompt_tokens=1 << 20, images=side, strict=True)
    # Under a text checkpoint (no image side) an image prompt is counted, never read as text.
    _, report = tokenize_prompts([ROWS[0], TEXT_ROW], tok, max_prompt_tokens=1 << 20)
    assert dict(report.skipped) == {"image_part": 1}
    # Over max_prompt_tokens: dropped (drop), or counted (truncate never cuts an image).
    n = len(prompts[0].prompt_ids)
    kept, report = tokenize_prompts([ROWS[0], TEXT_ROW], tok, max_prompt_tokens=n - 1,
                                    images=side)  # fmt: skip
    assert len(kept) == 1 and report.dropped == 1
    kept, report = tokenize_prompts([ROWS[0], TEXT_ROW], tok, max_prompt_tokens=n - 1,
                                    overlong="truncate", images=side)  # fmt: skip
    assert len(kept) == 1 and dict(report.skipped) == {"image_truncated": 1}


# -- the CLI ----------------------------------------------------------------------------------
GRPO_SECTION = {"num_generations": 2, "max_prompt_tokens": 64, "max_completion_tokens": 6,
                "rewards": [{"function": f"{REWARDS}:length"}]}  # fmt: skip


def _prompt_run(tmp_path, name, **train):
    """The shared six-row tiny Qwen2.5-VL run (helpers/image_objective_runs.py) as GRPO, G = 2:
    (model folder, config path)."""
    return image_prompt_run(tmp_path, name, "grpo", lambda i: {}, {"grpo": GRPO_SECTION},
                            **train)  # fmt: skip


def test_cli_grpo_on_image_prompts_then_the_adapter_loads_in_peft(tmp_path, capsys):
    folder, config = _prompt_run(tmp_path, "run")
    assert_cli_run_moves_a_tower_adapter(folder, config, capsys, "rewards/length/mean")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert all(r["completions/max_length"] <= 6 for r in map(json.loads, lines) if "loss" in r)


@pytest.mark.slow
def test_two_ranks_train_image_prompts_as_one_process(tmp_path):
    """Two DDP ranks at grad_accum 1 roll out, reward and train as one process at grad_accum
    2 (each prompt batch sampled with the seed of its place in the step): the same losses,
    and the same rewards and grad norms."""
    assert_two_ranks_match_one_process(tmp_path, _prompt_run)

    def steps(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}

    one, two = steps("single"), steps("ddp")
    for step in one:
        assert two[step]["reward"] == pytest.approx(one[step]["reward"], abs=1e-5), step
        assert two[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-4), step
