"""KTO on rows whose prompt has images (TRL's vision KTO format: a conversational prompt with
`{"type": "image"}` parts taking the row's `images`, a completion, a label), on tiny random
image-text models (tests/helpers/tiny_vlm.py), float32 on CPU.

- TRL 1.16's `KTOTrainer` (its vision collator) + peft on Gemma 3 (native family) and LLaVA
  (generic path): our ids and KL sequences equal its collator's, and the loss, the KL
  estimate, chosen / rejected log-probs and every LoRA gradient equal its own (1e-4 rel);
  the reference is the base model (TRL's `ref_model`, our `reference: base`).
- Qwen2.5-VL (native family, LoRA on the tower too) and Qwen3-VL (generic, deepstack): TRL's
  vision collator needs the checkpoint's `AutoProcessor`, whose Qwen-VL classes need
  torchvision (not installed here), so the reference is transformers + peft directly: each
  sequence's summed completion log-prob from `PeftModel(...)(**inputs).logits`, one sequence
  at a time (KL sequences with their prompt's images), the reference with
  `disable_adapter()`, KTO's formula on those.
- Packed examples equal each alone; a LoRA KTO step makes no host sync; the KL sequences take
  their prompt's features (`kl_image_feature_index`). Bad rows counted; a 2-step CLI run.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import transformers
from datasets import Dataset
from helpers.image_objective_runs import (
    assert_cli_run_moves_a_tower_adapter,
    assert_two_ranks_match_one_process,
    image_prompt_run,
    lora_vlm,
    peft_vlm,
    turn,
)
from helpers.models import randomise_lora_b
from helpers.tiny_vlm import (
    assert_lora_grads_match,
    random_image,
    vlm_folder,
)

import slipstream
from slipstream.data.vision import FEATURE_INDEX, ImageProcessing
from slipstream.objectives.kto import KTO, kl_estimate, kto_losses
from slipstream.objectives.kto_data import collate_kto, kl_sequences, tokenize_kto
from slipstream.objectives.reference import ReferencePolicy

trl = pytest.importorskip("trl")

BETA = 0.1


def _row(sizes, completion, label, k, question="What is it?"):
    images = [random_image(h, w, seed=h + w + k) for h, w in sizes]
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    return {"images": images, "prompt": [{"role": "user", "content": parts}],
            "completion": turn("assistant", completion), "label": label}  # fmt: skip


ROWS = [
    _row([(50, 90)], "A cat on a mat.", True, 0),
    _row([(100, 60), (30, 30)], "None, I think", False, 1),
    _row([(40, 40)], "A red square.", True, 2, "Describe it."),
]
TEXT_ROW = {"prompt": [{"role": "user", "content": "Hi"}],
            "completion": turn("assistant", "Go away."), "label": False}  # fmt: skip


# A seed per type whose two random adapters put the KL estimate above 0 (TRL clamps it at 0,
# which would leave the KL sequences out of the loss).
SEEDS = {"gemma3": 3, "llava": 1, "qwen2_5_vl": 4, "qwen3_vl": 1}


def _setup(root, kind, implementation="auto", tower_lora=False):
    """(folder, tokenizer, image side, our model, its KTO objective, adapter folders): random
    LoRA adapters `start` (the reference, as TRL's "ref" copy) and `trained` (the policy, the
    model's live adapter)."""
    folder, tok, side, model = lora_vlm(root, kind, implementation, tower_lora)
    seed, adapters = SEEDS.get(kind, 0), {}
    for name, s in (("start", seed), ("trained", seed + 100)):
        torch.manual_seed(s)
        randomise_lora_b(model, 0.2)
        adapters[name] = root / f"{kind}-{name}"
        slipstream.save_adapter(model, adapters[name])
    slipstream.load_adapter(model, adapters["start"])
    objective = KTO(beta=BETA, desirable_weight=1.3)
    objective.reference = ReferencePolicy(model, "start")
    slipstream.load_adapter(model, adapters["trained"])
    return folder, tok, side, model, objective, adapters


def _move_live_adapter(peft_model, adapter):
    """The peft model's live ("default") adapter set to `adapter`'s tensors."""
    from safetensors.torch import load_file

    params = dict(peft_model.named_parameters())
    with torch.no_grad():
        for key, value in load_file(adapter / "adapter_model.safetensors").items():
            params[key.replace(".weight", ".default.weight")].copy_(value)


# -- TRL's KTOTrainer ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gemma3", "llava"])
def test_kto_matches_trl(tmp_path, kind):
    from trl import KTOConfig, KTOTrainer

    folder, tok, side, model, objective, adapters = _setup(tmp_path, kind)
    assert ("native family" in model.load_path) == (kind == "gemma3"), model.load_path
    args = KTOConfig(  # bf16=False: TRL defaults to bf16 autocast, on CPU too
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(ROWS),
        report_to="none", max_length=None, use_cpu=True, bf16=False, beta=BETA,
        desirable_weight=1.3,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = KTOTrainer(  # the peft model's start is copied to a frozen "ref" adapter
            model=peft_vlm(folder, adapters["start"]), args=args,
            train_dataset=Dataset.from_list(ROWS),
            processing_class=transformers.AutoProcessor.from_pretrained(folder),
        )  # fmt: skip
    _move_live_adapter(trainer.model, adapters["trained"])
    examples, report = tokenize_kto(ROWS, tok, max_tokens=1 << 20, images=side)
    assert report.kept == len(examples) == len(ROWS)
    batch = trainer.data_collator(list(trainer.train_dataset))
    ours = objective.collate(examples)
    kl_at = 0
    for i, ex in enumerate(examples):  # TRL's tokens: prompt (images expanded) + completion
        n = int(batch["attention_mask"][i].sum())
        assert batch["input_ids"][i, :n].tolist() == ex.ids
        assert int(batch["completion_mask"][i].argmax()) == ex.prompt_len
        n = int(batch["KL_attention_mask"][i].sum())  # and the mismatched KL sequence
        kl = batch["KL_input_ids"][i, :n].tolist()
        assert ours.kl.input_ids[kl_at : kl_at + n].tolist() == kl
        kl_at += n
    assert kl_at == ours.kl.input_ids.numel()
    trainer.model.zero_grad()
    theirs = trainer.compute_loss(trainer.model, batch)
    theirs.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    n = len(examples)
    loss_sum, sums = objective.micro_batch_loss(model, ours)
    (loss_sum / n).backward()
    torch.testing.assert_close(loss_sum / n, theirs.detach(), rtol=1e-4, atol=1e-6)
    mine = objective.report({k: v.item() for k, v in sums.items()}, n)
    for key in ("kl", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"):
        assert mine[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    assert metrics["kl"] > 0  # the KL term is in play
    assert abs(mine["rewards/margins"]) > 1e-3  # the adapter does move the policy
    assert_lora_grads_match(model, trainer.model)


# -- transformers + peft directly, where TRL's collator cannot build the processor ---------
def _hf_logps(peft_model, examples, side, kind):
    """(n,) each sequence's summed completion log-prob from transformers' logits of that
    sequence alone (its prompt's images processed for it)."""
    out = []
    for ex in examples:
        ids = torch.tensor([ex.ids])
        inputs = {"input_ids": ids, **ex.images.model_inputs()}
        if kind.startswith("qwen"):
            inputs["mm_token_type_ids"] = (ids == side.image_token_id).int()
        logp_T = peft_model(**inputs).logits[0, :-1].log_softmax(-1)
        out.append(logp_T.gather(1, ids[0, 1:, None])[ex.prompt_len - 1 :, 0].sum())
    return torch.stack(out)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen(request, tmp_path_factory):
    """Qwen2.5-VL on its native family with LoRA on the tower too; Qwen3-VL on the generic
    path (deepstack rows through forward hooks), LoRA on the language model."""
    kind = request.param
    how = "transformers" if kind == "qwen3_vl" else "auto"
    setup = _setup(tmp_path_factory.mktemp(kind), kind, how, tower_lora=kind == "qwen2_5_vl")
    assert ("native family" in setup[3].load_path) == (kind == "qwen2_5_vl")
    return kind, setup


def test_kto_matches_transformerspeft_vlm(qwen):
    kind, (folder, tok, side, model, objective, adapters) = qwen
    examples, _ = tokenize_kto(ROWS, tok, max_tokens=1 << 20, images=side)
    n = len(examples)
    model.zero_grad()
    batch = objective.collate(examples)
    loss_sum, sums = objective.micro_batch_loss(model, batch)
    (loss_sum / n).backward()
    kl_examples = kl_sequences(examples, 1 << 20)
    with torch.no_grad():
        start = peft_vlm(folder, adapters["start"])
        ref, ref_kl = (_hf_logps(start, e, side, kind) for e in (examples, kl_examples))
    policy = peft_vlm(folder, adapters["trained"])
    with torch.no_grad():
        kl = kl_estimate(_hf_logps(policy, kl_examples, side, kind), ref_kl)
    logps = _hf_logps(policy, examples, side, kind)
    desirable = torch.tensor([float(ex.desirable) for ex in examples])
    loss, _ = kto_losses(logps, ref, desirable, kl, beta=BETA, desirable_weight=1.3)
    loss.mean().backward()
    torch.testing.assert_close(loss_sum / n, loss.mean().detach(), rtol=1e-4, atol=1e-6)
    assert kl > 0 and sums["kl"].item() / n == pytest.approx(kl.item(), rel=1e-4)
    mine = objective.report({k: v.item() for k, v in sums.items()}, n)
    d = desirable.bool()
    assert mine["logps/chosen"] == pytest.approx(logps[d].mean().item(), rel=1e-4)
    assert mine["logps/rejected"] == pytest.approx(logps[~d].mean().item(), rel=1e-4)
    assert_lora_grads_match(model, policy)
    on_tower = [p.grad for n, p in model.named_parameters() if ".visual." in n and "lora_" in n]
    assert bool(on_tower) == (kind == "qwen2_5_vl")
    assert all(g is not None and g.abs().max() > 0 for g in on_tower)


# -- packing, shared features, host syncs ----------------------------------------------------
def _paired(row, chosen, rejected):
    out = {k: v for k, v in row.items() if k not in ("completion", "label")}
    return {**out, "chosen": turn("assistant", chosen), "rejected": turn("assistant", rejected)}


PAIRED = [_paired(ROWS[0], "A cat.", "A dog on a log."), _paired(ROWS[1], "Two.", "Three")]
TEXT_PAIR = {"prompt": [{"role": "user", "content": "Hi"}], "chosen": turn("assistant", "Hello."),
             "rejected": turn("assistant", "Go away.")}  # fmt: skip


def _packed_equals_alone(objective, model, examples):
    """A LoRA KTO step over the packed examples makes no host sync; the policy's log-probs
    of the examples and of their KL sequences equal each sequence's alone -> the batch."""
    n = len(examples)
    batch = objective.collate(examples)
    with slipstream.count_syncs() as syncs:
        loss_sum, _ = objective.micro_batch_loss(model, batch)
        loss_sum.backward()
    assert syncs.total == 0, syncs
    with torch.no_grad():
        packed = [objective.sequence_logps(model, s, n) for s in (batch.main, batch.kl)]
        for got, seqs in zip(packed, (examples, kl_sequences(examples, 1 << 20)), strict=True):
            alone = [objective.sequence_logps(model, collate_kto([s], with_kl=False,
                                                                 max_tokens=1 << 20).main, 1)
                     for s in seqs]  # fmt: skip
            torch.testing.assert_close(got, torch.cat(alone), rtol=1e-5, atol=1e-5)
    return batch


def test_packed_kto_equals_each_alone_without_host_syncs(qwen):
    kind, (folder, tok, side, model, objective, _) = qwen
    examples, _ = tokenize_kto([*ROWS, TEXT_ROW], tok, max_tokens=1 << 20, images=side)
    assert [ex.images is not None for ex in examples] == [True, True, True, False]
    model.zero_grad()
    batch = _packed_equals_alone(objective, model, examples)
    fields = batch.packed.fields
    # Each prompt's images once in the batch; the KL sequences take prompt i's features.
    images = batch.kl.images
    assert images["image_grid_thw"].shape[0] == 4 and FEATURE_INDEX not in batch.main.images
    rows = [len(ex.images.feature_rows()) for ex in examples[:3]]
    want = [k for i, r in enumerate(rows) for k in range(sum(rows[:i]), sum(rows[: i + 1]))]
    assert images[FEATURE_INDEX].tolist() == want
    # KL sequence 0 is prompt 0 with the text row's completion: its rows hold prompt 0's.
    assert fields["kl_image_rows"][: rows[0]].tolist() == examples[0].images.feature_rows()
    index = fields[f"kl_{FEATURE_INDEX}"]
    fields[f"kl_{FEATURE_INDEX}"] = index.flip(0)  # another pairing: other log-probs
    with torch.no_grad():
        other = objective.sequence_logps(model, batch.kl, len(examples))
    fields[f"kl_{FEATURE_INDEX}"] = index
    assert not torch.allclose(other, objective.sequence_logps(model, batch.kl, 4).detach())


@pytest.mark.parametrize("kind", ["gemma3", "idefics3"])
def test_paired_image_rows_share_their_prompt(tmp_path, kind):
    """Pairs unpaired as text KTO unpairs them: a pair's two examples take their prompt's
    features once (`image_feature_index` in the examples' stream too)."""
    folder, tok, side, model, objective, _ = _setup(tmp_path, kind)
    examples, report = tokenize_kto([*PAIRED, TEXT_PAIR], tok, max_tokens=1 << 20, images=side)
    assert report.kept == 6 and [ex.desirable for ex in examples] == [True, False] * 3
    assert examples[0].row == examples[1].row == 0 and examples[2].row == 1
    batch = _packed_equals_alone(objective, model, examples)
    rows = [len(ex.images.feature_rows()) for ex in examples[:4]]
    a, b = rows[0], rows[2]
    assert batch.main.images[FEATURE_INDEX].tolist() == [*range(a), *range(a), *range(a, a + b),
                                                          *range(a, a + b)]  # fmt: skip
    assert batch.main.images["pixel_values"].shape == side_pixels(examples, [0, 2]).shape
    # Rows of two sources may share a number: only the same images are shared.
    clash = objective.collate([replace(ex, row=0) for ex in examples])
    assert clash.main.images[FEATURE_INDEX].tolist() == batch.main.images[FEATURE_INDEX].tolist()


def side_pixels(examples, owners):
    from slipstream.data.vision import cat_inputs

    return cat_inputs([examples[i].images.model_inputs() for i in owners])["pixel_values"]


# -- bad rows ------------------------------------------------------------------------------
def test_bad_image_rows_are_counted_skips(tmp_path):
    folder = vlm_folder(tmp_path / "gemma3", "gemma3")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    side = ImageProcessing.from_model(str(folder), tok)
    one = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}
    two = {"role": "user", "content": [{"type": "image"}, {"type": "image"}]}
    base = {"completion": turn("assistant", "Yes."), "label": True}
    pic, image_reply = random_image(30, 30), {"role": "assistant", "content": [{"type": "image"}]}
    rows = [
        {**base, "prompt": [one], "images": [str(tmp_path / "gone.png")]},  # image_missing
        {**base, "prompt": [two], "images": [pic]},  # more parts than images
        {**base, "prompt": [one], "images": [pic, pic]},  # fewer
        {"prompt": "What?", "completion": " Yes.", "label": True, "images": [pic]},  # strings
        {**base, "prompt": [one], "images": [pic], "completion": [image_reply]},
        {**base, "prompt": [one], "images": ["https://example.com/a.png"]},
        {**base, "prompt": [one], "images": [pic], "label": "yes"},
        ROWS[0],
    ]
    examples, report = tokenize_kto(rows, tok, max_tokens=1 << 20, images=side)
    assert len(examples) == 1 and report.kept == 1
    assert dict(report.skipped) == {
        "image_missing": 1, "image_count": 2, "image_format": 1, "completion_image": 1,
        "remote_image": 1, "label": 1,
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"^data row 0: image_count: [^\n]*$"):
        tokenize_kto(rows[1:2], tok, max_tokens=1 << 20, images=side, strict=True)
    # Image rows under a text checkpoint: counted, never trained as text.
    _, report = tokenize_kto([ROWS[0], TEXT_ROW], tok, max_tokens=1 << 20)
    assert dict(report.skipped) == {"image_part": 1}
    # A cut keeps the prompt (and its images) whole; a prompt over the limit is skipped.
    (ex,), _ = tokenize_kto([ROWS[0]], tok, max_tokens=1 << 20, images=side)
    (cut,), report = tokenize_kto([ROWS[0]], tok, max_tokens=ex.prompt_len + 2,
                                  overlong="truncate", images=side)  # fmt: skip
    assert report.truncated == 1 and cut.ids == cut.images.input_ids == ex.ids[: ex.prompt_len + 2]
    _, report = tokenize_kto([ROWS[0], TEXT_ROW], tok, max_tokens=ex.prompt_len - 1,
                             overlong="truncate", images=side)  # fmt: skip
    assert dict(report.skipped) == {"prompt_too_long": 1}


# -- the CLI -------------------------------------------------------------------------------
def _kto_run(tmp_path, name, **train):
    """A tiny Qwen2.5-VL, six image rows (three desirable) and a 2-step LoRA kto run's YAML
    with `vision.tower: lora`; (model folder, config path)."""

    def answer(i):
        return {"completion": turn("assistant", f"Picture {(i + i // 3) % 3}."), "label": i < 3}

    return image_prompt_run(tmp_path, name, "kto", answer, **train)


def test_cli_kto_on_image_rows_then_the_adapter_loads_inpeft_vlm(tmp_path, capsys):
    assert_cli_run_moves_a_tower_adapter(*_kto_run(tmp_path, "run"), capsys, "kl")


def test_two_ranks_train_image_rows_as_one_process(tmp_path):
    """Each rank tokenizes its share of the rows and collates examples another rank made
    (their images travel as sources): two DDP ranks at grad_accum 1 make the losses one
    process makes at grad_accum 2 (KTO's KL estimate is each micro-batch's own)."""
    assert_two_ranks_match_one_process(tmp_path, _kto_run)
