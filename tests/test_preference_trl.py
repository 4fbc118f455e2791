"""DPO, ORPO and SimPO against TRL 1.16 on a tiny Llama with a non-zero LoRA adapter, standard
and conversational rows: tokens, per-sequence log-probs, loss, rewards and LoRA gradients."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
from datasets import Dataset
from helpers.models import make_hf_model
from helpers.tokenizers import save_test_tokenizer
from transformers import AutoTokenizer

from slipstream.checkpoint.adapter import load_adapter
from slipstream.checkpoint.hf import load_model
from slipstream.objectives.pairs import tokenize_pairs
from slipstream.objectives.preference import pair_objective
from slipstream.objectives.reference import ReferencePolicy

trl = pytest.importorskip("trl")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY = dict(
    vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4,
    initializer_range=0.2,
)  # fmt: skip

CONVERSATIONAL = [
    {
        "prompt": [{"role": "user", "content": "What color is the sky?"}],
        "chosen": [{"role": "assistant", "content": "It is blue."}],
        "rejected": [{"role": "assistant", "content": "It is green today."}],
    },
    {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Where is the sun?"},
        ],
        "chosen": [{"role": "assistant", "content": "In the sky."}],
        "rejected": [{"role": "assistant", "content": "Under the sea, I think."}],
    },
    {
        "prompt": [{"role": "user", "content": "Do you like music?"}],
        "chosen": [{"role": "assistant", "content": "Yes, I play the guitar a little."}],
        "rejected": [{"role": "assistant", "content": "No."}],
    },
]
STANDARD = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green, they say."},
    {"prompt": "Hello, how are", "chosen": " you doing today?", "rejected": " things"},
    {"prompt": "We went hiking in the", "chosen": " mountains.", "rejected": " sea with friends."},
]
ROWS = {"conversational": CONVERSATIONAL, "standard": STANDARD}
# Native, and the generic family (transformers' modeling code: docs/generic.md) on the same
# checkpoint: both equal TRL.
IMPLEMENTATIONS = ["native", "transformers"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Llama + chatml tokenizer; adapters `start` (B != 0) and `trained` (another)."""
    root = tmp_path_factory.mktemp("pref")
    save_test_tokenizer(root / "model", "chatml", vocab_size=300)
    make_hf_model("llama", **TINY).save_pretrained(root / "model")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    for name, seed in (("start", 1), ("trained", 2)):
        model = peft.get_peft_model(make_hf_model("llama", **TINY), config)
        torch.manual_seed(seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.2)
        model.save_pretrained(root / name)
    return root


def _trl_dpo(root, rows, reference, **config):
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    policy = peft.PeftModel.from_pretrained(
        make_hf_model("llama", **TINY), root / "start", is_trainable=True
    )
    ref_model = make_hf_model("llama", **TINY) if reference == "base" else None
    args = DPOConfig(  # bf16=False: TRL defaults to bf16 autocast, on CPU too
        output_dir=str(root / "trl"), per_device_train_batch_size=len(rows), report_to="none",
        max_length=None, use_cpu=True, bf16=False, **config,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=policy, ref_model=ref_model, args=args,
            train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
        )  # fmt: skip
    # Policy != reference for `start` too: the live adapter moves on, as training would.
    _load_peft_weights(trainer.model, root / "trained")
    return trainer


def _load_peft_weights(model, adapter_dir):
    from safetensors.torch import load_file

    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in tensors.items():
            params[key.replace(".weight", ".default.weight")].copy_(value)


def _ours(root, name, reference="start", implementation="native", **options):
    model = load_model(str(root / "model"), implementation=implementation)
    load_adapter(model, root / "start")
    objective = pair_objective(name, **options)
    if name == "dpo":
        objective.reference = ReferencePolicy(model, reference)
    load_adapter(model, root / "trained")  # after the snapshot, as training moves it
    return model, objective


def _trl_grads(model) -> dict[str, torch.Tensor]:
    return {
        n.removeprefix("base_model.model.").replace(".default", ""): p.grad
        for n, p in model.named_parameters()
        if ".default." in n and p.grad is not None
    }


def _check_grads(ours, theirs):
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert set(grads) == set(theirs) and len(grads) == 2 * 7 * 2
    for n, g in grads.items():
        torch.testing.assert_close(g, theirs[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("kind", ["conversational", "standard"])
@pytest.mark.parametrize("reference", ["start", "base"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dpo_matches_trl(setup, kind, reference, implementation):
    rows = ROWS[kind]
    trainer = _trl_dpo(setup, rows, reference, beta=0.1)
    tokenizer = trainer.processing_class
    pairs, report = tokenize_pairs(rows, tokenizer, max_tokens=1 << 20)
    assert report.kept == len(rows)
    for pair, row in zip(pairs, trainer.train_dataset, strict=True):  # TRL's tokens
        assert pair.chosen == row["prompt_ids"] + row["chosen_ids"]
        assert pair.rejected == row["prompt_ids"] + row["rejected_ids"]
        assert pair.prompt_len == len(row["prompt_ids"])

    # Per-pair numbers from TRL, one pair a batch: logps, reference logps, loss, rewards.
    theirs = []
    for row in trainer.train_dataset:
        batch = trainer.data_collator([row])
        with torch.no_grad():
            loss = trainer.compute_loss(trainer.model, batch)
            ref_c, ref_r = trainer.compute_ref_log_probs(trainer.ref_model or trainer.model, batch)
        m = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        theirs.append((loss.item(), m, ref_c.item(), ref_r.item()))
    # All pairs in one batch: the mean loss and its LoRA gradients.
    trainer.model.zero_grad()
    full = trainer.compute_loss(trainer.model, trainer.data_collator(list(trainer.train_dataset)))
    full.backward()

    model, objective = _ours(setup, "dpo", reference, implementation, beta=0.1)
    batch = objective.collate(pairs)
    P = len(pairs)
    ref = objective.reference_logps(batch).view(P, 2)
    loss_sum, metrics = objective.micro_batch_loss(model, batch)
    (loss_sum / P).backward()
    torch.testing.assert_close(loss_sum / P, full.detach(), atol=1e-5, rtol=1e-5)
    for i, (loss, m, ref_c, ref_r) in enumerate(theirs):
        one = objective.collate([pairs[i]])
        with torch.no_grad():
            loss_i, metrics_i = objective.micro_batch_loss(model, one)
        assert ref[i].tolist() == pytest.approx([ref_c, ref_r], abs=1e-5, rel=1e-5)
        ours_i = {k: v.item() for k, v in metrics_i.items()}
        assert loss_i.item() == pytest.approx(loss, abs=1e-5)
        for key in ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected",
                    "rewards/margins", "rewards/accuracies"):  # fmt: skip
            assert ours_i[key] == pytest.approx(m[key], abs=1e-5, rel=1e-5), key
    _check_grads(model, _trl_grads(trainer.model))
    assert abs(metrics["rewards/margins"].item()) > 1e-3  # policy and reference do differ


@pytest.mark.parametrize("loss_type", ["ipo", "hinge"])
def test_dpo_loss_types_match_trl(setup, loss_type):
    rows = CONVERSATIONAL
    trainer = _trl_dpo(setup, rows, "start", beta=0.5, loss_type=loss_type)
    trainer.model.zero_grad()
    full = trainer.compute_loss(trainer.model, trainer.data_collator(list(trainer.train_dataset)))
    full.backward()
    pairs, _ = tokenize_pairs(rows, trainer.processing_class, max_tokens=1 << 20)
    model, objective = _ours(setup, "dpo", beta=0.5, loss_type=loss_type)
    loss_sum, _ = objective.micro_batch_loss(model, objective.collate(pairs))
    (loss_sum / len(pairs)).backward()
    torch.testing.assert_close(loss_sum / len(pairs), full.detach(), atol=1e-5, rtol=1e-5)
    _check_grads(model, _trl_grads(trainer.model))


def _tokens_batch(pairs, pad_id):
    """TRL's ORPO/CPO collated batch holding exactly our tokens (their own tokenization
    differs from DPOTrainer's; both objectives here tokenize as DPOTrainer does)."""
    out = {}
    for side in ("chosen", "rejected"):
        seqs = [getattr(p, side) for p in pairs]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), pad_id)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        labels = torch.full((len(seqs), width), -100)
        for i, (s, p) in enumerate(zip(seqs, pairs, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
            labels[i, p.prompt_len : len(s)] = torch.tensor(s[p.prompt_len :])
        out |= {f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels}
    return out


@pytest.mark.parametrize("name", ["orpo", "simpo"])
@pytest.mark.parametrize("kind", ["conversational", "standard"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_orpo_simpo_match_trl(setup, name, kind, implementation):
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(setup / "model")
    rows = ROWS[kind]
    policy = peft.PeftModel.from_pretrained(
        make_hf_model("llama", **TINY), setup / "trained", is_trainable=True
    )
    common = dict(output_dir=str(setup / name), report_to="none", use_cpu=True, bf16=False,
                  beta=0.2, label_smoothing=0.1 if name == "simpo" else 0.0)  # fmt: skip
    if name == "orpo":
        common.pop("label_smoothing")
        cls, args = ORPOTrainer, ORPOConfig(**common)
    else:
        args = CPOConfig(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.7, **common)
        cls = CPOTrainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=policy, args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=tokenizer)  # fmt: skip
    pairs, _ = tokenize_pairs(rows, tokenizer, max_tokens=1 << 20)
    batch = _tokens_batch(pairs, tokenizer.pad_token_id)
    trainer.model.zero_grad()
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    loss.backward()

    model = load_model(str(setup / "model"), implementation=implementation)
    load_adapter(model, setup / "trained")
    objective = pair_objective(name, beta=0.2, simpo_gamma=0.7,
                           label_smoothing=0.1 if name == "simpo" else 0.0)  # fmt: skip
    P = len(pairs)
    loss_sum, ours = objective.micro_batch_loss(model, objective.collate(pairs))
    (loss_sum / P).backward()
    torch.testing.assert_close(loss_sum / P, loss.detach(), atol=1e-5, rtol=1e-5)
    for key, value in ours.items():
        assert value.item() / P == pytest.approx(metrics[key], abs=1e-5, rel=1e-5), key
    _check_grads(model, _trl_grads(trainer.model))
