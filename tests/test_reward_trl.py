"""Reward modelling against TRL 1.16's RewardTrainer on a tiny Llama with a non-zero LoRA adapter
and head, standard and conversational rows, with and without margins and the centring term:
tokens, loss, accuracy/margin/mean_reward and every LoRA and head gradient. The reward model
saved by slipstream loads in transformers (full) and in peft (adapter) with the same scores.
The same on three types with no native family, built by transformers' modeling code (the
generic family, docs/generic.md): OLMo 2, Gemma 2 (sliding window, softcaps) and Qwen3-Next
(Gated DeltaNet run per sequence, MoE; LoRA on its attention only)."""

from __future__ import annotations

import json
import warnings

import peft
import pytest
import torch
from datasets import Dataset
from helpers.models import make_hf_model
from helpers.tiny_hf import save_tiny
from helpers.tokenizers import pad_is_eos, save_test_tokenizer
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from slipstream.checkpoint.reward_model import (
    load_reward_model,
    save_reward_adapter,
    save_reward_model,
    sequence_classifier_class,
)
from slipstream.models.score_head import pad_id_of
from slipstream.objectives.reward import Reward
from slipstream.objectives.reward_data import tokenize_reward_pairs

trl = pytest.importorskip("trl")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# model_type -> LoRA targets; the generic ones at tiny_config's sizes (2 layers)
TYPES = {"llama": TARGETS, "olmo2": TARGETS, "gemma2": TARGETS,
         "qwen3_next": ["q_proj", "k_proj", "v_proj", "o_proj"]}  # fmt: skip
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            initializer_range=0.2)  # fmt: skip

CONVERSATIONAL = [  # explicit prompts
    {
        "prompt": [{"role": "user", "content": "What color is the sky?"}],
        "chosen": [{"role": "assistant", "content": "It is blue."}],
        "rejected": [{"role": "assistant", "content": "It is green today."}],
        "margin": 0.5,
    },
    {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Where is the sun?"},
        ],
        "chosen": [{"role": "assistant", "content": "In the sky."}],
        "rejected": [{"role": "assistant", "content": "Under the sea, I think."}],
        "margin": 0.0,
    },  # fmt: skip
    {
        "prompt": [{"role": "user", "content": "Do you like music?"}],
        "chosen": [{"role": "assistant", "content": "Yes, I play the guitar a little."}],
        "rejected": [{"role": "assistant", "content": "No."}],
        "margin": 1.5,
    },
]
STANDARD = [  # implicit prompts: whole texts
    {"chosen": "The sky is blue.", "rejected": "The sky is green, they say.", "margin": 1.0},
    {
        "chosen": "Hello, how are you doing today?",
        "rejected": "Hello, how are things",
        "margin": 0.25,
    },  # fmt: skip
    {
        "chosen": "We went hiking in the mountains.",
        "rejected": "We went hiking in the sea.",
        "margin": 0.0,
    },  # fmt: skip
]
ROWS = {"conversational": CONVERSATIONAL, "standard": STANDARD}


@pytest.fixture(scope="module", params=list(TYPES))
def setup(tmp_path_factory, request):
    """A tiny model + chatml tokenizer (eos = pad = <|im_end|>, as SmolLM2's: a standard text
    ends in the pad, so its score is read one token earlier), and a TRL-made LoRA reward
    adapter with non-zero factors and head."""
    root = tmp_path_factory.mktemp(f"reward_{request.param}")
    save_test_tokenizer(root / "model", "chatml", vocab_size=300)
    pad_is_eos(root / "model")
    if request.param == "llama":
        make_hf_model("llama", **TINY).save_pretrained(root / "model")
    else:
        save_tiny(root / "model", request.param, vocab_size=300, sliding_window=4)
    model = _hf_classifier(root)
    targets = TYPES[request.param]
    config = peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=targets)
    model = peft.get_peft_model(model, config)
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n or "score" in n:
                p.normal_(0, 0.3)
    model.save_pretrained(root / "adapter")
    return root


def _hf_classifier(root):
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForSequenceClassification.from_pretrained(
            root / "model", num_labels=1, pad_token_id=pad_id_of(tokenizer), dtype=torch.float32
        )


def _trl_reward(root, rows, **config):
    from trl import RewardConfig, RewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    model = peft.PeftModel.from_pretrained(_hf_classifier(root), root / "adapter",
                                           is_trainable=True)  # fmt: skip
    args = RewardConfig(output_dir=str(root / "trl"), report_to="none", use_cpu=True,
                        bf16=False, max_length=None, **config)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer)  # fmt: skip


def _trl_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        name = n.removeprefix("base_model.model.").replace(".default", "")
        out[name.replace("score.modules_to_save", "score")] = p.grad
    return out


@pytest.mark.parametrize("kind", ["conversational", "standard"])
@pytest.mark.parametrize("options", [{}, {"margin": True, "center_rewards_coefficient": 0.05}])
@pytest.mark.parametrize("implementation", ["native", "transformers"])  # the head on either
def test_reward_matches_trl(setup, kind, options, implementation):
    model_type = json.loads((setup / "model" / "config.json").read_text())["model_type"]
    if model_type != "llama" and implementation == "native":
        pytest.skip(f"{model_type} has no native family")
    options = dict(options)
    rows = (
        ROWS[kind]
        if options.pop("margin", False)
        else [{k: v for k, v in r.items() if k != "margin"} for r in ROWS[kind]]
    )
    trainer = _trl_reward(setup, rows, **options)
    tokenizer = trainer.processing_class
    pairs, report = tokenize_reward_pairs(rows, tokenizer, max_tokens=1 << 20)
    assert report.kept == len(rows)
    for pair, row in zip(pairs, trainer.train_dataset, strict=True):  # TRL's tokens
        assert pair.chosen == row["chosen_ids"] and pair.rejected == row["rejected_ids"]
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(list(trainer.train_dataset)))
    loss.backward()
    theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    model = load_reward_model(setup / "adapter", implementation=implementation)
    assert (type(model).__name__ == "GenericCausalLM") == (implementation == "transformers")
    model.requires_grad_(False)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n or n == "score.weight")
    objective = Reward(center_rewards_coefficient=options.get("center_rewards_coefficient"))
    loss_sum, metrics = objective.micro_batch_loss(model, objective.collate(pairs))
    P = len(pairs)
    (loss_sum / P).backward()
    torch.testing.assert_close(loss_sum / P, loss.detach(), atol=1e-6, rtol=1e-5)
    for key in ("accuracy", "margin", "mean_reward"):
        assert metrics[key].item() / P == pytest.approx(theirs[key], abs=1e-6, rel=1e-5), key
    for key in ("min_reward", "max_reward"):  # extremes: not per pair
        assert metrics[key].item() == pytest.approx(theirs[key], abs=1e-6, rel=1e-5), key
    assert theirs["min_reward"] < theirs["max_reward"]
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    want = _trl_grads(trainer.model)
    lora = [n for n in want if "lora_" in n]
    assert set(grads) == set(want) and len(lora) >= 2 * 4 and "score.weight" in grads
    for n, g in grads.items():
        torch.testing.assert_close(g, want[n], atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    assert 0 < theirs["accuracy"] < 1 or abs(theirs["margin"]) > 1e-3  # not a degenerate case


def _hf_scores(model, tokenizer, sequences):
    """transformers' scores of each sequence, one padded batch (right padding)."""
    batch = tokenizer.pad({"input_ids": sequences}, return_tensors="pt", padding_side="right")
    with torch.no_grad():
        return model(**batch).logits[:, 0]


def _our_scores(model, pairs):
    objective = Reward()
    batch = objective.collate(pairs)
    from slipstream.models.score_head import sequence_scores

    with torch.no_grad():
        return sequence_scores(model, batch.input_ids, batch.seq, batch.score_positions)


def test_saved_reward_models_load_in_transformers_and_peft_with_our_scores(setup, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(setup / "model")
    pairs, _ = tokenize_reward_pairs(CONVERSATIONAL + STANDARD, tokenizer, max_tokens=1 << 20)
    sequences = [s for p in pairs for s in (p.chosen, p.rejected)]
    ours = load_reward_model(setup / "adapter")
    want = _our_scores(ours, pairs)
    assert want.std() > 1e-3
    pad = pad_id_of(tokenizer)

    # The adapter route: saved by us, loaded by peft on transformers' classifier.
    save_reward_adapter(ours, tmp_path / "adapter", pad, str(setup / "model"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    hf = peft.PeftModel.from_pretrained(_hf_classifier(setup), tmp_path / "adapter").eval()
    torch.testing.assert_close(_hf_scores(hf, tokenizer, sequences), want, atol=1e-5, rtol=1e-5)
    back = load_reward_model(tmp_path / "adapter")
    assert back.score_pad_token_id == pad
    torch.testing.assert_close(_our_scores(back, pairs), want, atol=1e-6, rtol=1e-6)

    # The full route: merged, saved as a *ForSequenceClassification checkpoint.
    from slipstream.peft.lora import merge_lora

    merge_lora(ours)
    save_reward_model(ours, tmp_path / "full", pad)
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    model_type = config["model_type"]
    assert config["architectures"] == [sequence_classifier_class(model_type)]
    assert config["pad_token_id"] == pad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "full").eval()
    assert hf.config.num_labels == 1
    torch.testing.assert_close(_hf_scores(hf, tokenizer, sequences), want, atol=1e-5, rtol=1e-5)
    back = load_reward_model(tmp_path / "full")
    torch.testing.assert_close(_our_scores(back, pairs), want, atol=1e-5, rtol=1e-5)
