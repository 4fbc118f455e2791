"""Generation with the KV cache: token-for-token equal to transformers' `generate` for every
family (ragged prompts in one batch, past sliding windows), with LoRA/DoRA against peft,
logprobs, sampling statistics, stops, errors and the host-sync count."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.models import make_hf_model, randomise_lora_b
from helpers.moe_models import make_hf_moe_model

import slipstream
from slipstream.generation.sampling import Sampling, sample, warp
from slipstream.ops.packing import SeqInfo

PROMPTS = [[5, 17, 3], [44, 9, 21, 60, 2 + 1, 8, 13, 71, 30, 12, 6], [88, 1 + 3, 50, 7, 19, 33, 40]]
NEW = 12  # with prompts of 3-11 tokens: positions up to 22, past every window below (4-5)

FAMILIES = {
    "llama": lambda: make_hf_model("llama"),
    "mistral-window": lambda: make_hf_model("mistral", sliding_window=5),
    "qwen2-window": lambda: make_hf_model(
        "qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1
    ),
    "qwen3": lambda: make_hf_model("qwen3"),
    "phi3-window": lambda: make_hf_model("phi3", sliding_window=5),
    "gemma3-local-global": lambda: make_hf_model(
        "gemma3_text",
        num_hidden_layers=3,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),  # fmt: skip
    "qwen3_moe": lambda: make_hf_moe_model("qwen3_moe"),
    "gpt_oss-sinks-window": lambda: make_hf_moe_model("gpt_oss"),
}


def _ours(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    return slipstream.load_model(tmp_path)


def _hf_greedy(hf, prompt, new=NEW) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _hf_logprobs(hf, prompt, tokens, warpers=()) -> torch.Tensor:
    """log p(token) of each generated token from one transformers forward of the whole text."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    ids = torch.tensor([prompt + tokens])
    for i in range(len(tokens)):
        for w in warpers:
            logits[i : i + 1] = w(ids[:, : len(prompt) + i], logits[i : i + 1])
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_generate(family, tmp_path):
    hf = FAMILIES[family]()
    ours = _ours(hf, tmp_path)
    got = slipstream.generate(ours, PROMPTS, max_new_tokens=NEW, return_logprobs=True)
    for p, c in zip(PROMPTS, got, strict=True):
        ref = _hf_greedy(hf, p)
        assert c.token_ids == ref, family
        eos = hf.generation_config.eos_token_id
        assert c.finish_reason == ("stop" if ref[-1] == eos and len(ref) <= NEW else "length")
        lp = torch.tensor(c.logprobs)
        torch.testing.assert_close(lp, _hf_logprobs(hf, p, ref), atol=1e-4, rtol=0)


def test_phi3_longrope_past_original_length_equals_transformers_generate(tmp_path):
    """Phi-3 longrope, original_max_position_embeddings=8: prompts of 3, 7 and 8 tokens
    cross it while generating (transformers' generate then drops its cache and recomputes the
    whole sequence with the long factors), one of 11 starts past it. Greedy tokens and every
    step's log-probs equal transformers' generate on each prompt alone."""
    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[0.5, 1.0, 1.5, 2.0],
                long_factor=[4.0, 16.0, 32.0, 64.0])  # fmt: skip
    hf = make_hf_model("phi3", rope_parameters=rope, original_max_position_embeddings=8,
                       max_position_embeddings=64)  # fmt: skip
    ours = _ours(hf, tmp_path)
    prompts = [*PROMPTS, list(range(1, 9))]
    got = slipstream.generate(ours, prompts, max_new_tokens=NEW, return_logprobs=True)
    for p, c in zip(prompts, got, strict=True):
        out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)  # fmt: skip
        ref = out.sequences[0, len(p) :].tolist()
        assert c.token_ids == ref, len(p)
        ref_lp = torch.stack([torch.log_softmax(x[0], -1)[t] for x, t in zip(out.logits, ref)])
        torch.testing.assert_close(torch.tensor(c.logprobs), ref_lp, atol=1e-4, rtol=0)
        if len(p) == 3:  # the factor set matters here: steps before the switch use the short one
            assert (_hf_logprobs(hf, p, ref)[:5] - ref_lp[:5]).abs().max() > 1e-4


@pytest.mark.parametrize("use_dora", [False, True])
def test_unmerged_lora_equals_peft_generate(use_dora, tmp_path):
    from peft import PeftModel

    hf = make_hf_model("qwen3")
    ours = _ours(hf, tmp_path / "base")
    slipstream.apply_lora(ours, rank=4, alpha=8, targets="all-linear", use_dora=use_dora)
    randomise_lora_b(ours, std=0.3)
    slipstream.save_adapter(ours, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    got = slipstream.generate(ours, PROMPTS, max_new_tokens=NEW)
    refs = [_hf_greedy(peft_model, p) for p in PROMPTS]
    assert [c.token_ids for c in got] == refs
    with peft_model.disable_adapter():
        base_refs = [_hf_greedy(peft_model, p) for p in PROMPTS]
    assert base_refs != refs  # the adapter changed the replies: the comparison could fail


def _greedy_without_cache(model, prompt, new):
    """Reference: the whole sequence through the packed forward for every new token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor(ids), SeqInfo.from_lengths([len(ids)]))
            ids.append(int(logits[-1].argmax()))
    return ids[len(prompt) :]


def test_nf4_base_with_lora_equals_recompute(tmp_path):
    pytest.importorskip("bitsandbytes")
    hf = make_hf_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, eos_token_id=None)  # fmt: skip
    hf.save_pretrained(tmp_path)
    ours = slipstream.load_model(tmp_path, quantize="nf4")
    slipstream.apply_lora(ours, rank=4, alpha=8)
    randomise_lora_b(ours, std=0.3)
    ours.eval()
    got = slipstream.generate(ours, PROMPTS, max_new_tokens=NEW)
    assert [c.token_ids for c in got] == [_greedy_without_cache(ours, p, NEW) for p in PROMPTS]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = make_hf_model("llama", eos_token_id=None)
    return hf, _ours(hf, tmp_path_factory.mktemp("llama"))


def test_sampled_logprobs_equal_transformers_warpers(llama):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    hf, ours = llama
    kw = dict(temperature=0.7, top_k=20, top_p=0.9)
    got = slipstream.generate(ours, PROMPTS, max_new_tokens=NEW, seed=3, return_logprobs=True, **kw)
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)]
    for p, c in zip(PROMPTS, got, strict=True):
        ref = _hf_logprobs(hf, p, c.token_ids, warpers)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def test_seeded_sampling_reproducible_and_top_k_1_is_greedy(llama):
    _, ours = llama
    kw = dict(max_new_tokens=NEW, temperature=1.0, num_return_sequences=3)
    a = slipstream.generate(ours, PROMPTS, seed=7, **kw)
    b = slipstream.generate(ours, PROMPTS, seed=7, **kw)
    c = slipstream.generate(ours, PROMPTS, seed=8, **kw)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    assert [x.prompt_index for x in a] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len({tuple(x.token_ids) for x in a[:3]}) > 1  # the samples of a prompt differ
    greedy = slipstream.generate(ours, PROMPTS, max_new_tokens=NEW)
    top1 = slipstream.generate(ours, PROMPTS, max_new_tokens=NEW, temperature=1.0, top_k=1, seed=1)
    assert [x.token_ids for x in top1] == [x.token_ids for x in greedy]


# chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails one
# run in a thousand (and the seed is fixed).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


@pytest.mark.parametrize(
    "params",
    [Sampling(1.0), Sampling(0.5), Sampling(1.3, top_k=4), Sampling(1.0, top_p=0.8)],
    ids=["t1", "t0.5", "top_k4", "top_p0.8"],
)
def test_sampled_frequencies_match_the_distribution(params):
    """Chi-square of 40,000 draws over a 6-token vocabulary against softmax(warped logits)."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.5]])
    n = 40_000
    g = torch.Generator().manual_seed(0)
    tokens, logprobs = sample(logits.expand(n, -1), params, g)
    p = torch.softmax(warp(logits, params), -1)[0]
    counts = torch.bincount(tokens, minlength=6).float()
    kept = p > 0
    assert counts[~kept].sum() == 0  # filtered tokens are never drawn
    expected = n * p[kept]
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999[int(kept.sum()) - 1], (chi2, counts, expected)
    torch.testing.assert_close(logprobs, p.log()[tokens])
    # Temperature and filters change the distribution the way they should.
    if params.top_k == 4:
        assert int(kept.sum()) == 4
    if params.top_p == 0.8:  # smallest set reaching 0.8 of the softmax
        full = torch.softmax(logits[0], -1)
        order = full.argsort(descending=True)
        need = int((full[order].cumsum(0) < 0.8).sum()) + 1
        assert set(torch.nonzero(kept).flatten().tolist()) == set(order[:need].tolist())


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from helpers.tokenizers import save_test_tokenizer
    from transformers import AutoTokenizer

    tok_dir = save_test_tokenizer(tmp_path_factory.mktemp("tok"), "chatml")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    hf = make_hf_model("llama", vocab_size=len(tokenizer), eos_token_id=None)
    return _ours(hf, tmp_path_factory.mktemp("chat")), tokenizer


def test_stop_strings_stop_tokens_and_max_new_tokens(chat_model):
    model, tok = chat_model
    prompts = ["Hello, how are", [{"role": "user", "content": "Do you like music?"}]]
    full = slipstream.generate(model, prompts, tokenizer=tok, max_new_tokens=20)
    for c in full:
        assert c.finish_reason == "length" and len(c.token_ids) == 20
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    # A stop string from the middle of the first reply ends it where the string completes.
    text = full[0].text
    s = text[len(text) // 2 : len(text) // 2 + 3]
    cut = slipstream.generate(model, prompts[:1], tokenizer=tok, max_new_tokens=20, stop=[s])[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(s)]
    ids = cut.token_ids
    assert ids == full[0].token_ids[: len(ids)]
    assert s in tok.decode(ids) and s not in tok.decode(ids[:-1])
    # A stop token ends the reply at its first occurrence, the token included.
    t = full[1].token_ids[5]
    first = full[1].token_ids.index(t)
    by_id = slipstream.generate(model, prompts[1:], tokenizer=tok, max_new_tokens=20, stop=t)[0]
    assert by_id.token_ids == full[1].token_ids[: first + 1] and by_id.finish_reason == "stop"
    short = slipstream.generate(model, prompts, tokenizer=tok, max_new_tokens=3)
    assert [len(c.token_ids) for c in short] == [3, 3]
    assert [c.token_ids for c in short] == [c.token_ids[:3] for c in full]


def test_chat_reply_and_greedy_generate_use_the_engine(chat_model):
    model, tok = chat_model
    msgs = [{"role": "user", "content": "hi there"}]
    ref = slipstream.generate(model, [msgs], tokenizer=tok, max_new_tokens=10)[0]
    assert slipstream.generation.chat_reply(model, tok, "hi there", 10) == ref.text.strip()


def test_user_errors_are_one_line(llama):
    _, ours = llama
    cases = [
        ([], "empty list"),
        ([[]], "prompt 0 is empty"),
        ([[1, 2], ""], "prompt 1 is an empty string"),
        (["text"], "pass tokenizer="),
        ([[3] * 256], "context is 256"),
        ("a string", "must be a list"),
    ]
    for prompts, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            slipstream.generate(ours, prompts)
        assert "\n" not in str(e.value)
    bad = [(dict(max_new_tokens=0), "max_new_tokens"), (dict(top_p=0), "top_p"),
           (dict(temperature=-1), "temperature"), (dict(stop=["x"]), "tokenizer")]  # fmt: skip
    for kw, message in bad:
        with pytest.raises(ValueError, match=message):
            slipstream.generate(ours, [[1, 2]], **kw)


def test_context_limit_ends_with_length(llama):
    _, ours = llama
    c = slipstream.generate(ours, [[3] * 250, [4, 5]], max_new_tokens=10)
    assert [len(x.token_ids) for x in c] == [6, 10]  # 250 + 6 = the context of 256
    assert [x.finish_reason for x in c] == ["length", "length"]


def test_one_host_sync_per_stop_check(llama):
    """No sync per token: ceil(new / 8) reads back, each at a stop check."""
    _, ours = llama
    slipstream.generate(ours, PROMPTS, max_new_tokens=2)  # warm-up
    for new in (1, 8, 20):
        with slipstream.count_syncs() as c:
            out = slipstream.generate(ours, PROMPTS, max_new_tokens=new, temperature=1.0, seed=0)
        assert all(x.finish_reason == "length" for x in out)
        assert c.total == math.ceil(new / 8), (new, c)


def test_sample_replies_for_the_training_log(chat_model):
    from slipstream.train.samples import log_samples

    model, tok = chat_model
    records = []

    class Log:
        def log(self, record):
            records.append(record)

    model.train()
    log_samples(Log(), 7, model, tok, ["hi there", "Do you like music?"], max_new_tokens=10)
    assert model.training  # eval inside, the training mode restored
    msgs = [[{"role": "user", "content": p}] for p in ("hi there", "Do you like music?")]
    ref = slipstream.generate(model, msgs, tokenizer=tok, max_new_tokens=10)
    assert records == [{"step": 7, "samples": [
        {"prompt": "hi there", "reply": ref[0].text.strip()},
        {"prompt": "Do you like music?", "reply": ref[1].text.strip()},
    ]}]  # fmt: skip


def test_trainer_logs_sample_replies_at_each_eval(tiny_run, tmp_path):
    import json

    from helpers.runs import run_config
    from transformers import AutoTokenizer

    from slipstream.config import RunConfig

    prompts = ["Hi!", "What color is the sky?"]
    raw = run_config(tiny_run, tmp_path / "out", steps=2, eval_every=1,
                     sample_prompts=prompts, sample_max_new_tokens=5)  # fmt: skip
    slipstream.train(RunConfig.model_validate(raw))
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    samples = {r["step"]: r["samples"] for r in lines if "samples" in r}
    assert sorted(samples) == [0, 1, 2]  # before training, at the eval of step 1, at the end
    assert [s["prompt"] for s in samples[2]] == ["Hi!", "What color is the sky?"]
    # The last replies are those of the saved model.
    model = slipstream.load_model(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    msgs = [[{"role": "user", "content": s["prompt"]}] for s in samples[2]]
    ref = slipstream.generate(model, msgs, tokenizer=tok, max_new_tokens=5)
    assert [s["reply"] for s in samples[2]] == [c.text.strip() for c in ref]
