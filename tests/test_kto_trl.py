"""KTO against TRL 1.16's KTOTrainer on a tiny Llama with a non-zero LoRA adapter (reference:
the starting adapter, as TRL's "ref" copy), unpaired and paired rows, standard and
conversational, both loss types and unequal class weights: tokens, the KL pairs, loss,
TRL's metrics and every LoRA gradient."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import peft
import pytest
import torch
from datasets import Dataset
from helpers.models import make_hf_model
from helpers.tokenizers import save_test_tokenizer
from transformers import AutoTokenizer

from slipstream.checkpoint.adapter import load_adapter
from slipstream.checkpoint.hf import load_model
from slipstream.objectives.kto import KTO
from slipstream.objectives.reference import ReferencePolicy

trl = pytest.importorskip("trl")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            initializer_range=0.2)  # fmt: skip

UNPAIRED_CHAT = [
    {"prompt": [{"role": "user", "content": "What color is the sky?"}],
     "completion": [{"role": "assistant", "content": "It is blue."}], "label": True},
    {"prompt": [{"role": "user", "content": "Where is the sun?"}],
     "completion": [{"role": "assistant", "content": "Under the sea, I think."}], "label": False},
    {"prompt": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Do you like music?"}],
     "completion": [{"role": "assistant", "content": "Yes, the guitar."}], "label": True},
    {"prompt": [{"role": "user", "content": "Name a fruit."}],
     "completion": [{"role": "assistant", "content": "A chair."}], "label": False},
    {"prompt": [{"role": "user", "content": "Is snow cold?"}],
     "completion": [{"role": "assistant", "content": "Yes, very."}], "label": True},
]  # fmt: skip
UNPAIRED_TEXT = [
    {"prompt": "The sky is", "completion": " blue.", "label": True},
    {"prompt": "Hello, how are", "completion": " things going, friend?", "label": False},
    {"prompt": "We went hiking in the", "completion": " mountains.", "label": True},
    {"prompt": "Two plus two is", "completion": " five", "label": False},
]
PAIRED_TEXT = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green, they say."},
    {"prompt": "We went hiking in the", "chosen": " mountains.", "rejected": " sea."},
    {"prompt": "Two plus two is", "chosen": " four.", "rejected": " five"},
]
ROWS = {"unpaired_chat": UNPAIRED_CHAT, "unpaired_text": UNPAIRED_TEXT, "paired": PAIRED_TEXT}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Llama + chatml tokenizer; adapters `start` (B != 0, the reference) and
    `trained` (the policy, moved off the start)."""
    root = tmp_path_factory.mktemp("kto")
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


def _trl_kto(root, rows, **config):
    from trl import KTOConfig, KTOTrainer

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    policy = peft.PeftModel.from_pretrained(
        make_hf_model("llama", **TINY), root / "start", is_trainable=True
    )  # TRL copies it into a frozen "ref" adapter: the reference is the start
    n = len(rows) * (2 if "chosen" in rows[0] else 1)
    args = KTOConfig(output_dir=str(root / "trl"), per_device_train_batch_size=n,
                     report_to="none", max_length=None, use_cpu=True, bf16=False,
                     **config)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = KTOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer)  # fmt: skip
    from safetensors.torch import load_file

    params = dict(trainer.model.named_parameters())
    with torch.no_grad():  # the live adapter moves on, as training would
        for key, value in load_file(root / "trained" / "adapter_model.safetensors").items():
            params[key.replace(".weight", ".default.weight")].copy_(value)
    return trainer


def _ours(root, implementation="native", **options):
    model = load_model(str(root / "model"), implementation=implementation)
    load_adapter(model, root / "start")
    objective = KTO(**options)
    objective.reference = ReferencePolicy(model, "start")
    load_adapter(model, root / "trained")
    return model, objective


def _trl_order(examples, rows):
    """TRL's unpaired order of a paired dataset: every chosen, then every rejected."""
    if "chosen" not in rows[0]:
        return examples
    return examples[0::2] + examples[1::2]


CASES = [
    ("unpaired_chat", {}),
    ("unpaired_text", {"desirable_weight": 1.3, "undesirable_weight": 0.7, "beta": 0.3}),
    ("paired", {}),
    ("unpaired_chat", {"loss_type": "apo_zero_unpaired", "beta": 0.5}),
]


@pytest.mark.parametrize(("kind", "options"), CASES)
@pytest.mark.parametrize("implementation", ["native", "transformers"])  # generic: docs/generic.md
def test_kto_matches_trl(setup, kind, options, implementation):
    rows = ROWS[kind]
    trainer = _trl_kto(setup, rows, **options)
    model, objective = _ours(setup, implementation, **options)
    examples, report = objective.tokenize(rows, trainer.processing_class)
    examples = _trl_order(examples, rows)
    assert report.kept == len(examples) == len(trainer.train_dataset)
    for ex, row in zip(examples, trainer.train_dataset, strict=True):  # TRL's tokens
        assert ex.ids == row["prompt_ids"] + row["completion_ids"]
        assert ex.prompt_len == len(row["prompt_ids"]) and ex.desirable == row["label"]

    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(list(trainer.train_dataset)))
    loss.backward()
    theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    batch = objective.collate(examples)
    if objective.with_kl:  # the same mismatched sequences as TRL's KL_completion_ids
        kl_ids = batch.kl.input_ids.tolist()
        want = [t for row in trainer.train_dataset
                for t in row["prompt_ids"] + row["KL_completion_ids"]]  # fmt: skip
        assert kl_ids == want
    loss_sum, sums = objective.micro_batch_loss(model, batch)
    n = len(examples)
    (loss_sum / n).backward()
    torch.testing.assert_close(loss_sum / n, loss.detach(), atol=1e-6, rtol=1e-5)
    ours = objective.report({k: v.item() for k, v in sums.items()}, n)
    keys = ["kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected"]  # fmt: skip
    for key in keys:
        assert ours[key] == pytest.approx(theirs[key], abs=1e-5, rel=1e-5), key
    assert "entropy" in theirs and ("logits/chosen" in theirs or "logits/rejected" in theirs)
    for key in ("entropy", "logits/chosen", "logits/rejected"):  # from the chunked head
        assert (key in ours) == (key in theirs), key
        if key in theirs:
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5, rel=1e-5), key
    if objective.with_kl:  # in play for the chat and paired rows; clamped to 0 for the text
        assert (theirs["kl"] > 0) == (kind != "unpaired_text"), theirs["kl"]
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    want = {
        k.removeprefix("base_model.model.").replace(".default", ""): p.grad
        for k, p in trainer.model.named_parameters()
        if ".default." in k
    }
    assert set(grads) == set(want) and len(grads) == 2 * 7 * 2
    for name, g in grads.items():
        torch.testing.assert_close(g, want[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


def test_attach_builds_the_reference_from_the_config(setup):
    model = load_model(str(setup / "model"))
    load_adapter(model, setup / "start")
    objective = KTO()
    objective.from_adapter = True
    objective.attach(SimpleNamespace(model=model), None)
    assert objective.reference.kind == "start"
