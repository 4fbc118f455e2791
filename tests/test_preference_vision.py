"""DPO, ORPO and SimPO on preference pairs whose prompt has images (TRL's vision preference
format: conversational prompt / chosen / rejected, `{"type": "image"}` parts taking the row's
`images`), on tiny random image-text models (tests/helpers/tiny_vlm.py), float32 on CPU.

- TRL 1.16's `DPOTrainer` + peft on Gemma 3 (native family), LLaVA and Idefics3 (generic
  path): our ids equal its collator's, and the per-pair log-probs, the loss and every LoRA
  gradient equal its own (1e-4 rel); the reference is the base model (TRL's `ref_model`,
  our `reference: base`).
- Qwen2.5-VL (native family) and Qwen3-VL (generic path, deepstack): TRL's vision collator needs the
  checkpoint's `AutoProcessor`, whose Qwen-VL classes need torchvision (not installed here),
  so the reference is transformers + peft directly: each sequence's summed completion
  log-prob from `PeftModel(...)(**inputs).logits`, one sequence at a time (the tower run
  for each), the reference with `disable_adapter()`, DPO's sigmoid loss on those.
- One tower pass a pair (`image_feature_index`); packed pairs equal each pair alone and a
  LoRA DPO step makes no host sync, on every type (native and generic); the reference
  precomputed equals it live. ORPO and SimPO (TRL's ORPO and CPO trainers read no images):
  the same direct reference through their formulas, ORPO's prompt NLL without image tokens,
  and a few optimizer steps lower the loss. Bad rows counted; a 2-step CLI run.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from datasets import Dataset
from helpers.image_objective_runs import (
    assert_cli_run_moves_a_tower_adapter,
    assert_two_ranks_match_one_process,
    hf_vlm,
    image_prompt_run,
    lora_vlm,
    peft_vlm,
    turn,
)
from helpers.models import randomise_lora_b
from helpers.tiny_vlm import (
    assert_lora_grads_match,
    random_image,
)

import slipstream
from slipstream.data.vision import FEATURE_INDEX, image_inputs
from slipstream.objectives.pairs import tokenize_pairs
from slipstream.objectives.preference import orpo_log_odds, pair_objective
from slipstream.objectives.reference import ReferencePolicy

trl = pytest.importorskip("trl")

BETA = 0.1


def _pair(sizes, chosen, rejected, k):
    images = [random_image(h, w, seed=h + w + k) for h, w in sizes]
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What is it?"}]
    prompt = [{"role": "user", "content": parts}]
    return {"images": images, "prompt": prompt, "chosen": turn("assistant", chosen),
            "rejected": turn("assistant", rejected)}  # fmt: skip


ROWS = [
    _pair([(50, 90)], "A cat on a mat.", "A dog, maybe.", 0),
    _pair([(100, 60), (30, 30)], "Two of them.", "None", 1),
]
TEXT_ROW = {"prompt": [{"role": "user", "content": "Hi"}], "chosen": turn("assistant", "Hello."),
            "rejected": turn("assistant", "Go away.")}  # fmt: skip


def _setup(root, kind, implementation="auto", tower_lora=False):
    """(folder, tokenizer, image side, our model with a random LoRA, its adapter folder);
    `tower_lora`: the tower's linears get adapters too (`vision.tower: lora`)."""
    folder, tok, side, model = lora_vlm(root, kind, implementation, tower_lora)
    randomise_lora_b(model, 0.2)
    slipstream.save_adapter(model, root / f"{kind}-adapter")
    return folder, tok, side, model, root / f"{kind}-adapter"


def _dpo(model, **options):
    objective = pair_objective("dpo", beta=BETA, **options)
    objective.reference = ReferencePolicy(model, "base")
    return objective


# -- TRL's DPOTrainer ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gemma3", "llava", "idefics3"])
def test_dpo_matches_trl(tmp_path, kind):
    from trl import DPOConfig, DPOTrainer

    folder, tok, side, model, adapter = _setup(tmp_path, kind)
    assert ("native family" in model.load_path) == (kind == "gemma3"), model.load_path
    args = DPOConfig(  # bf16=False: TRL defaults to bf16 autocast, on CPU too
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=2, report_to="none",
        max_length=None, use_cpu=True, bf16=False, beta=BETA,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=peft_vlm(folder, adapter), ref_model=hf_vlm(folder), args=args,
            train_dataset=Dataset.from_list(ROWS),
            processing_class=transformers.AutoProcessor.from_pretrained(folder),
        )  # fmt: skip
    pairs, report = tokenize_pairs(ROWS, tok, max_tokens=1 << 20, images=side)
    assert report.kept == 2
    batch = trainer.data_collator(list(trainer.train_dataset))
    P = len(pairs)
    for i, pair in enumerate(pairs):  # TRL's tokens: prompt (images expanded) + completion
        for row, ids in ((i, pair.chosen), (P + i, pair.rejected)):
            n = int(batch["attention_mask"][row].sum())
            assert batch["input_ids"][row, :n].tolist() == ids
            assert int(batch["completion_mask"][row].argmax()) == pair.prompt_len
    trainer.model.zero_grad()
    theirs = trainer.compute_loss(trainer.model, batch)
    theirs.backward()
    logps = {k: trainer._metrics["train"][k][-1] for k in ("logps/chosen", "logps/rejected")}

    objective = _dpo(model)
    loss_sum, metrics = objective.micro_batch_loss(model, objective.collate(pairs))
    (loss_sum / P).backward()
    torch.testing.assert_close(loss_sum / P, theirs.detach(), rtol=1e-4, atol=1e-6)
    for key, value in logps.items():
        assert metrics[key].item() / P == pytest.approx(value, rel=1e-4), key
    assert abs(metrics["rewards/margins"].item()) > 1e-3  # the adapter does move the policy
    assert_lora_grads_match(model, trainer.model)


# -- transformers + peft directly, where TRL's collator cannot build the processor ---------
def _hf_logps(peft_model, pair, side, kind):
    """Each sequence's (summed completion log-prob, summed log-prob of the prompt's non-image
    tokens after the first), from transformers' logits of that sequence alone."""
    out = []
    for ex in pair.images:
        ids = torch.tensor([ex.input_ids])
        inputs = {"input_ids": ids, **ex.model_inputs()}
        if kind.startswith("qwen"):
            inputs["mm_token_type_ids"] = (ids == side.image_token_id).int()
        logp_T = peft_model(**inputs).logits[0, :-1].log_softmax(-1)
        tok_T = logp_T.gather(1, ids[0, 1:, None])[:, 0]
        keep = torch.tensor(ex.trainable[1 : pair.prompt_len])
        out.append((tok_T[pair.prompt_len - 1 :].sum(), tok_T[: pair.prompt_len - 1][keep].sum()))
    return out


def _hf_dpo(peft_model, pairs, side, kind):
    """(mean DPO sigmoid loss, backpropagated; per-sequence logps (P, 2))."""
    with torch.no_grad(), peft_model.disable_adapter():
        ref = torch.stack([torch.stack([c for c, _ in _hf_logps(peft_model, p, side, kind)])
                           for p in pairs])  # fmt: skip
    pol = torch.stack([torch.stack([c for c, _ in _hf_logps(peft_model, p, side, kind)])
                       for p in pairs])  # fmt: skip
    z = pol - ref
    loss = -F.logsigmoid(BETA * (z[:, 0] - z[:, 1])).mean()
    loss.backward()
    return loss.detach(), pol.detach()


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen(request, tmp_path_factory):
    """Qwen2.5-VL on its native family with LoRA on the tower too (its gradient reaches the
    tower through features both sequences share); Qwen3-VL on the generic path (deepstack
    rows through forward hooks), LoRA on the language model."""
    kind = request.param
    how = "transformers" if kind == "qwen3_vl" else "auto"
    setup = _setup(tmp_path_factory.mktemp(kind), kind, how, tower_lora=kind == "qwen2_5_vl")
    assert ("native family" in setup[3].load_path) == (kind == "qwen2_5_vl")
    return kind, setup


def test_dpo_matches_transformerspeft_vlm(qwen):
    kind, (folder, tok, side, model, adapter) = qwen
    pairs, _ = tokenize_pairs(ROWS, tok, max_tokens=1 << 20, images=side)
    model.zero_grad()
    objective = _dpo(model)
    batch = objective.collate(pairs)
    images = image_inputs(batch.packed.fields)
    # One tower pass a pair: the batch holds the three images once, and both sequences' rows.
    assert images["image_grid_thw"].shape[0] == 3
    assert images[FEATURE_INDEX].shape == images["image_rows"].shape
    assert images["image_rows"].numel() == 2 * sum(sum(p.images[0].image_tokens) for p in pairs)
    loss_sum, metrics = objective.micro_batch_loss(model, batch)
    (loss_sum / len(pairs)).backward()
    peft_model = peft_vlm(folder, adapter)
    loss, pol = _hf_dpo(peft_model, pairs, side, kind)
    torch.testing.assert_close(loss_sum / len(pairs), loss, rtol=1e-4, atol=1e-6)
    assert metrics["logps/chosen"].item() == pytest.approx(pol[:, 0].sum().item(), rel=1e-4)
    assert metrics["logps/rejected"].item() == pytest.approx(pol[:, 1].sum().item(), rel=1e-4)
    assert_lora_grads_match(model, peft_model)
    on_tower = [p.grad for n, p in model.named_parameters() if ".visual." in n and "lora_" in n]
    assert bool(on_tower) == (kind == "qwen2_5_vl")
    assert all(g is not None and g.abs().max() > 0 for g in on_tower)


def test_packed_pairs_equal_each_alone_without_host_syncs(qwen):
    kind, (folder, tok, side, model, _) = qwen
    pairs, _ = tokenize_pairs([*ROWS, TEXT_ROW], tok, max_tokens=1 << 20, images=side)
    assert [p.images is not None for p in pairs] == [True, True, False]
    objective = _dpo(model)
    model.zero_grad()
    batch, loss_sum, _ = _packed_step_equals_each_alone(objective, model, pairs)
    # The reference precomputed once (attach) gives the live reference's loss.
    pre = pair_objective("dpo", beta=BETA, reference="base", precompute_reference=True)
    data = SimpleNamespace(train=pairs, train_batches=[[0, 1], [2]], eval=[], eval_batches=[])
    pre.attach(SimpleNamespace(model=model, device=torch.device("cpu")), data)
    assert all(p.ref is not None for p in pairs)
    with torch.no_grad():
        pre_sum, _ = pre.micro_batch_loss(model, pre.collate(pairs))
    torch.testing.assert_close(pre_sum, loss_sum.detach(), rtol=1e-5, atol=1e-6)
    for p in pairs:
        p.ref = None
    # Features gathered per image row, not the tower's rows in order: another pairing of
    # rows and features gives other log-probs.
    fields = batch.packed.fields
    index = fields[FEATURE_INDEX]
    fields[FEATURE_INDEX] = index.flip(0)
    with torch.no_grad():
        other = objective.sequence_logps(model, batch)
    fields[FEATURE_INDEX] = index
    assert not torch.allclose(other, objective.sequence_logps(model, batch).detach())


# Every image-text type (native and generic): a batch of two image pairs and a text pair
# gives each pair's numbers alone, with no host sync over a LoRA step.
OTHER_TYPES = ["gemma3:native", "llava", "idefics3", "mistral3", "gemma4", "gemma4:transformers",
               "qwen3_5", "qwen3_5_moe", "smolvlm", "qwen3_vl:native", "gemma3:transformers",
               "qwen2_5_vl:transformers"]  # fmt: skip


@pytest.mark.parametrize("spec", OTHER_TYPES)
def test_every_type_packs_image_pairs_as_each_alone(tmp_path, spec):
    kind, how = (*spec.split(":"), "auto")[:2]
    folder, tok, side, model, _ = _setup(tmp_path, kind, "auto" if how == "native" else how)
    if how != "auto":
        assert ("native family" in model.load_path) == (how == "native"), model.load_path
    pairs, _ = tokenize_pairs([*ROWS, TEXT_ROW], tok, max_tokens=1 << 20, images=side)
    _, _, metrics = _packed_step_equals_each_alone(_dpo(model), model, pairs)
    assert abs(metrics["rewards/margins"].item()) > 1e-3


def _packed_step_equals_each_alone(objective, model, pairs):
    """A LoRA step over the packed pairs (0 host syncs, backward run): its loss and log-prob
    and margin sums equal each pair's alone -> (batch, loss sum, metrics)."""
    batch = objective.collate(pairs)
    with slipstream.count_syncs() as syncs:
        loss_sum, metrics = objective.micro_batch_loss(model, batch)
        loss_sum.backward()
    assert syncs.total == 0, syncs
    with torch.no_grad():
        alone = [objective.micro_batch_loss(model, objective.collate([p])) for p in pairs]
    torch.testing.assert_close(loss_sum.detach(), sum(loss for loss, _ in alone), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    for key in ("logps/chosen", "logps/rejected", "rewards/margins"):
        torch.testing.assert_close(metrics[key], sum(m[key] for _, m in alone), rtol=1e-5,
                                   atol=1e-5)  # fmt: skip
    return batch, loss_sum, metrics


# -- ORPO and SimPO -----------------------------------------------------------------------
@pytest.mark.parametrize("qwen", ["qwen2_5_vl"], indirect=True)
@pytest.mark.parametrize("name", ["orpo", "simpo"])
def test_orpo_simpo_on_image_pairs(qwen, name):
    kind, (folder, tok, side, model, adapter) = qwen
    pairs, _ = tokenize_pairs(ROWS, tok, max_tokens=1 << 20, images=side)
    objective = pair_objective(name, beta=0.2, simpo_gamma=0.7)
    batch = objective.collate(pairs)
    with torch.no_grad():
        loss_sum, metrics = objective.micro_batch_loss(model, batch)
        peft_model = peft_vlm(folder, adapter)
        seqs = [_hf_logps(peft_model, p, side, kind) for p in pairs]
    n = torch.tensor([[len(s) - p.prompt_len for s in (p.chosen, p.rejected)] for p in pairs])
    sums = torch.tensor([[c for c, _ in s] for s in seqs])
    avg = sums / n
    if name == "simpo":
        expected = -F.logsigmoid(0.2 * (avg[:, 0] - avg[:, 1]) - 0.7).sum()
    else:  # NLL over the chosen sequences' tokens, the images' own tokens left out
        prompt = torch.tensor([s[0][1] for s in seqs])
        tokens = sum(n[i, 0] + sum(p.images[0].trainable[1 : p.prompt_len])
                     for i, p in enumerate(pairs))  # fmt: skip
        assert batch.num_chosen_tokens == tokens
        # every chosen token but the first and the image tokens
        assert tokens == sum(len(p.chosen) - 1 - sum(p.images[0].image_tokens) for p in pairs)
        nll = -(sums[:, 0].sum() + prompt.sum()) / tokens
        expected = -0.2 * F.logsigmoid(orpo_log_odds(avg[:, 0], avg[:, 1])).sum() + 2 * nll
        assert metrics["nll_loss"].item() / 2 == pytest.approx(nll.item(), rel=1e-4)
    torch.testing.assert_close(loss_sum, expected.float(), rtol=1e-4, atol=1e-5)
    # A few steps on the LoRA adapter lower the loss.
    trained = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in trained]
    opt = torch.optim.Adam(trained, lr=1e-2)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss, _ = objective.micro_batch_loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        for p, s in zip(trained, saved, strict=True):
            p.copy_(s)
    assert losses[-1] < losses[0] - 1e-3, losses


# -- bad rows ------------------------------------------------------------------------------
@pytest.mark.parametrize("qwen", ["qwen2_5_vl"], indirect=True)
def test_bad_image_pairs_are_counted_skips(tmp_path, qwen):
    kind, (folder, tok, side, model, _) = qwen
    one = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}
    two = {"role": "user", "content": [{"type": "image"}, {"type": "image"}]}
    base = {"chosen": turn("assistant", "Yes."), "rejected": turn("assistant", "No.")}
    pic, image_reply = random_image(30, 30), {"role": "assistant", "content": [{"type": "image"}]}
    rows = [
        {**base, "prompt": [one], "images": [str(tmp_path / "gone.png")]},  # image_missing
        {**base, "prompt": [two], "images": [pic]},  # more parts than images
        {**base, "prompt": [one], "images": [pic, pic]},  # fewer
        # a placeholder string in the text
        {**base, "prompt": [turn("user", "<|image_pad|> hi")[0]], "images": [pic]},
        {"prompt": "What?", "chosen": " Yes.", "rejected": " No.", "images": [pic]},  # strings
        {**base, "prompt": [one], "images": [pic], "chosen": [image_reply]},
        {**base, "prompt": [one], "images": ["https://example.com/a.png"]},
        ROWS[0],
    ]
    pairs, report = tokenize_pairs(rows, tok, max_tokens=1 << 20, images=side)
    assert len(pairs) == 1 and report.kept == 1
    assert dict(report.skipped) == {"image_missing": 1, "image_count": 3, "image_format": 1,
                                    "completion_image": 1, "remote_image": 1}  # fmt: skip
    with pytest.raises(ValueError, match=r"data row 0: image_count: .*'images' has 1"):
        tokenize_pairs(rows[1:2], tok, max_tokens=1 << 20, images=side, strict=True)
    # Image pairs under a text checkpoint: counted, never trained as text.
    _, report = tokenize_pairs([ROWS[0], TEXT_ROW], tok, max_tokens=1 << 20)
    assert dict(report.skipped) == {"image_part": 1}
    # A cut keeps the prompt (and its images) whole; a prompt over the limit is skipped.
    (pair,), _ = tokenize_pairs([ROWS[0]], tok, max_tokens=1 << 20, images=side)
    (cut,), report = tokenize_pairs([ROWS[0]], tok, max_tokens=pair.prompt_len + 2,
                                    overlong="truncate", images=side)  # fmt: skip
    assert report.truncated == 1 and cut.chosen == pair.chosen[: pair.prompt_len + 2]
    assert cut.images[1].positions_3d[0] == pair.images[1].positions_3d[0][: pair.prompt_len + 2]
    _, report = tokenize_pairs([ROWS[0], TEXT_ROW], tok, max_tokens=pair.prompt_len - 1,
                               overlong="truncate", images=side)  # fmt: skip
    assert dict(report.skipped) == {"prompt_too_long": 1}


# -- the CLI -------------------------------------------------------------------------------
def _pair_run(tmp_path, name, **train):
    """A tiny Qwen2.5-VL, six image pairs and a 2-step LoRA dpo run's YAML with
    `vision.tower: lora`; (model folder, config path)."""

    def answer(i):
        return {"chosen": turn("assistant", f"Picture {i % 3}."),
                "rejected": turn("assistant", f"Picture {(i + 1) % 3}, I think.")}  # fmt: skip

    return image_prompt_run(tmp_path, name, "dpo", answer, **train)


def test_cli_dpo_on_image_pairs_with_tower_lora_then_the_adapter_loads_inpeft_vlm(tmp_path, capsys):
    assert_cli_run_moves_a_tower_adapter(*_pair_run(tmp_path, "run"), capsys, "rewards/margins")


def test_two_ranks_train_image_pairs_as_one_process(tmp_path):
    """Each rank tokenizes its share of the pairs and collates pairs another rank made (their
    images travel as sources): two DDP ranks at grad_accum 1 make the losses one process
    makes at grad_accum 2."""
    assert_two_ranks_match_one_process(tmp_path, _pair_run)
