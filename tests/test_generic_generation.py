"""Generation on generic models: layers slipstream's KV cache holds no state for (Gated
DeltaNet, short convolutions, Mamba2) run on transformers' `generate` with our adapter in its
module tree; softmax-attention models on our engine. Compared with transformers + peft."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.tiny_hf import random_lora
from test_generic import _pair, quiet  # noqa: F401 (quiet: a fixture, used by all)

from slipstream.generation import engine

PROMPTS = [[5, 9, 11, 4], [7, 3, 8, 20, 21, 22]]
pytestmark = pytest.mark.usefixtures("quiet")
STATEFUL = ["qwen3_next", "lfm2"] + [
    pytest.param(t, marks=pytest.mark.slow)
    for t in ("falcon_h1", "qwen3_5_text", "qwen3_5_moe_text")
]  # not nemotron_h: its 2-layer tiny config has no attention layer, where transformers'
# own generate fails (DynamicCache.get_seq_length finds no attention layer)


def _with_adapter(tmp_path, model_type):
    """(ours with a random LoRA adapter, transformers' model + peft with the same adapter)."""
    from peft import PeftModel

    ref, ours = _pair(tmp_path, model_type)
    random_lora(ours, tmp_path / "adapter")
    return ours, PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()


@pytest.mark.parametrize("model_type", STATEFUL)
def test_stateful_layers_generate_as_transformers_with_peft(tmp_path, model_type, caplog):
    """Greedy rows equal peft's `generate` token for token; the log names the engine and the
    layer kinds; sampling with a seed repeats; stop ids end a row with the stop token."""
    ours, theirs = _with_adapter(tmp_path, model_type)
    greedy = engine.Sampling(0.0, 1.0, 0)
    with caplog.at_level(logging.INFO, logger="slipstream"):
        rows = engine.run(ours, PROMPTS, max_new_tokens=7, sampling=greedy, stop_ids=[2])
    said = [r.message for r in caplog.records if r.message.startswith("generation:")]
    assert len(said) == 1 and "on transformers' generate" in said[0], said
    assert "softmax attention" in said[0] and ours.per_sequence[0] in said[0]
    for row, p in zip(rows, PROMPTS, strict=True):
        want = theirs.generate(input_ids=torch.tensor([p]), max_new_tokens=7, do_sample=False,
                               eos_token_id=2, pad_token_id=0)  # fmt: skip
        assert row.token_ids == want[0, len(p) :].tolist()
        # greedy log-probs: the model's softmax at each chosen token
        logits = theirs(input_ids=want[:, :-1]).logits[0, len(p) - 1 :]
        lp = logits.log_softmax(-1).gather(1, want[0, len(p) :, None])[:, 0]
        torch.testing.assert_close(torch.tensor(row.logprobs), lp, atol=1e-4, rtol=1e-4)
    assert ours.training  # the mode is restored
    i, longest = max(enumerate(rows), key=lambda r: len(r[1].token_ids))
    assert len(longest.token_ids) >= 3
    stop = longest.token_ids[2]
    cut = engine.run(ours, PROMPTS[i : i + 1], max_new_tokens=7, sampling=greedy, stop_ids=[stop])
    assert cut[0].token_ids[-1] == stop and cut[0].finish_reason == "stop"
    assert cut[0].token_ids == longest.token_ids[: len(cut[0].token_ids)]
    hot = engine.Sampling(1.0, 0.9, 20)
    runs = [
        engine.run(ours, PROMPTS, samples_per_prompt=3, max_new_tokens=5, sampling=hot,
                   generator=torch.Generator().manual_seed(7))
        for _ in range(2)
    ]  # fmt: skip
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert len({tuple(r.token_ids) for r in runs[0]}) > 1  # the samples differ


def test_softmax_attention_models_stay_on_our_engine(tmp_path, caplog):
    _, ours = _pair(tmp_path, "olmo2")
    with caplog.at_level(logging.INFO, logger="slipstream"):
        engine.run(ours, PROMPTS, max_new_tokens=2, sampling=engine.Sampling())
    said = [r.message for r in caplog.records if r.message.startswith("generation:")]
    assert said == [
        "generation: olmo2 on slipstream's KV-cache engine (layers: 2 softmax attention)"
    ]


@pytest.mark.parametrize("model_type", ["olmo2", "qwen3_next"])
def test_chat_replies_as_transformers_generate(tmp_path, model_type, monkeypatch, capsys):
    """`slipstream chat` on a generic model, our engine (OLMo 2) or transformers' generate
    (Qwen3-Next): each streamed reply is transformers' greedy reply to the chat so far."""
    import io

    from helpers.tiny_hf import tiny_config
    from helpers.tokenizers import save_test_tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slipstream import cli
    from slipstream.generation.api import stop_token_ids

    folder = tmp_path / "model"
    save_test_tokenizer(folder, "chatml", vocab_size=300)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=300)).eval()
    ref.save_pretrained(folder)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi there\nWhat now?\n/exit\n"))
    assert cli.main(["chat", str(folder), "--max-new-tokens", "9"]) == 0
    replies = [r.split("\n")[0] for r in capsys.readouterr().out.split("assistant> ")[1:]]
    assert len(replies) == 2 and all(replies), replies
    tok = AutoTokenizer.from_pretrained(folder)
    history = []
    for question, reply in zip(["Hi there", "What now?"], replies, strict=True):
        history.append({"role": "user", "content": question})
        ids = tok.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
        out = ref.generate(ids, max_new_tokens=9, do_sample=False,
                           eos_token_id=list(stop_token_ids(tok)))  # fmt: skip
        want = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert reply == want.strip() or reply == want
        history.append({"role": "assistant", "content": reply})
