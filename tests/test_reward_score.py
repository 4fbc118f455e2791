"""`slipstream score` and GRPO's `model:DIR` reward on reward models saved by slipstream (full
and LoRA adapter): the scores equal transformers' AutoModelForSequenceClassification's on the
same text (TRL's GRPO reward-model path for `model:DIR`); bad input is one line, exit 2."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers.models import make_hf_model
from helpers.tokenizers import pad_is_eos, save_test_tokenizer
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from slipstream import cli
from slipstream.checkpoint.hf import load_model
from slipstream.checkpoint.reward_model import save_reward_adapter, save_reward_model
from slipstream.models.score_head import add_score_head, pad_id_of
from slipstream.peft.lora import apply_lora, merge_lora
from slipstream.rewards import build_rewards

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            initializer_range=0.2)  # fmt: skip
ROWS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {
        "prompt": [{"role": "user", "content": "Hi there"}],
        "completion": [{"role": "assistant", "content": "Hello, friend."}],
    },  # fmt: skip
    {
        "messages": [
            {"role": "user", "content": "Name a fruit"},
            {"role": "assistant", "content": "An apple."},
        ]
    },  # fmt: skip
    {"text": "Snow is cold and white."},
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A reward model as an adapter (`adapter`) and merged in full (`full`), tokenizer saved."""
    root = tmp_path_factory.mktemp("score")
    save_test_tokenizer(root / "base", "chatml", vocab_size=300)
    pad_is_eos(root / "base")
    make_hf_model("llama", **TINY).save_pretrained(root / "base")
    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    model = load_model(str(root / "base"))
    torch.manual_seed(0)
    apply_lora(model, rank=4, alpha=8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    add_score_head(model).weight.data.normal_(0, 0.5)
    pad = pad_id_of(tokenizer)
    save_reward_adapter(model, root / "adapter", pad)
    tokenizer.save_pretrained(root / "adapter")
    merge_lora(model)
    save_reward_model(model, root / "full", pad)
    tokenizer.save_pretrained(root / "full")
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return root, data


def _hf(root):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForSequenceClassification.from_pretrained(root / "full").eval()


def _hf_scores(hf, tokenizer, texts, **kwargs):
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", **kwargs)
    with torch.no_grad():
        return hf(**batch).logits[:, 0].tolist()


@pytest.mark.parametrize("kind", ["full", "adapter"])
def test_score_cli_writes_transformers_scores(models, tmp_path, kind, capsys):
    root, data = models
    out = tmp_path / "scored.jsonl"
    assert cli.main(["score", str(root / kind), str(data), "--output", str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4 rows scored" in err[0] and "pair accuracy" in err[0]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(root / "full")
    eos = tokenizer.eos_token
    chat = tokenizer.apply_chat_template
    texts = [
        "The sky is blue." + eos, "The sky is green." + eos,
        chat(ROWS[1]["prompt"] + ROWS[1]["completion"], tokenize=False),
        chat(ROWS[2]["messages"], tokenize=False),
        ROWS[3]["text"] + eos,
    ]  # fmt: skip
    want = _hf_scores(_hf(root), tokenizer, texts)
    got = [rows[0]["chosen_score"], rows[0]["rejected_score"]] + [r["score"] for r in rows[1:]]
    assert got == pytest.approx(want, abs=1e-5)
    assert rows[1]["completion"] == ROWS[1]["completion"]  # the row's own fields kept


def test_score_cli_bad_input_is_one_line(models, tmp_path, capsys):
    root, _ = models
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"answer": 3}) + "\n")
    assert cli.main(["score", str(root / "full"), str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "row 1" in err[0] and "messages or text" in err[0]
    assert cli.main(["score", str(tmp_path / "nowhere"), str(bad)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["score", str(root / "base"), str(bad)]) == 2  # a causal LM, no head
    assert "not a reward model" in capsys.readouterr().err


def test_model_reward_in_grpo_scores_as_trl(models):
    """`model:DIR` scores (prompt, completion) as TRL's GRPOTrainer scores with a reward model:
    chats through the chat template, texts joined, no special tokens added."""
    root, _ = models
    rewards = build_rewards([{"function": f"model:{root / 'adapter'}", "weight": 2.0}])
    prompts = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]]
    completions = [[{"role": "assistant", "content": "Hello!"}],
                   [{"role": "assistant", "content": "See you soon."}]]  # fmt: skip
    values = rewards.rewards[0].fn(prompts=prompts, completions=completions)
    tokenizer = AutoTokenizer.from_pretrained(root / "full")
    texts = [tokenizer.apply_chat_template(p + c, tokenize=False)
             for p, c in zip(prompts, completions, strict=True)]  # fmt: skip
    want = _hf_scores(_hf(root), tokenizer, texts, add_special_tokens=False)
    assert values == pytest.approx(want, abs=1e-5)
    text = rewards.rewards[0].fn(prompts=["The sky is"], completions=[" blue."])
    assert text == pytest.approx(
        _hf_scores(_hf(root), tokenizer, ["The sky is blue."], add_special_tokens=False), abs=1e-5
    )
    with pytest.raises(ValueError, match=r"grpo.rewards\[0\].*not a folder"):
        build_rewards(["model:/nowhere/rm"])
