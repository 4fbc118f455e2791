"""Preference objectives without TRL's trainers: data formats and bad rows, chunked token
log-probs, packed pairs vs one at a time, the reference policies, host syncs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.models import make_hf_model
from helpers.tokenizers import save_test_tokenizer
from transformers import AutoTokenizer

from slipstream.debug import count_syncs
from slipstream.objectives.pairs import check_pair_columns, extract_prompt, tokenize_pairs
from slipstream.objectives.preference import dpo_losses, pair_objective
from slipstream.objectives.reference import ReferencePolicy
from slipstream.ops.loss import linear_token_logps
from slipstream.peft.lora import apply_lora

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            initializer_range=0.2)  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref_unit")
    save_test_tokenizer(root, "chatml", vocab_size=300)
    make_hf_model("llama", **TINY).save_pretrained(root)
    return root


def _model(root, lora=True):
    from slipstream.checkpoint.hf import load_model

    model = load_model(str(root))
    if lora:
        apply_lora(model, rank=4, alpha=8)
        torch.manual_seed(3)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
    return model


def _rows(n):
    colors = ["blue", "green", "red", "black", "white", "grey"]
    return [
        {
            "prompt": [{"role": "user", "content": f"What color is thing {i}?"}],
            "chosen": [{"role": "assistant", "content": f"It is {colors[i % 6]}."}],
            "rejected": [{"role": "assistant", "content": f"Maybe {colors[(i + 1) % 6]}, or not."}],
        }
        for i in range(n)
    ]


def test_implicit_prompt_as_trl():
    from trl import extract_prompt as trl_extract

    cases = [
        ("The sky is blue.", "The sky is green."),
        ("abc", "abcd"),  # no difference within the shorter: TRL's loop leaves idx at 2
        (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go away"}],
        ),
    ]
    for chosen, rejected in cases:
        want = trl_extract({"chosen": chosen, "rejected": rejected})
        got = extract_prompt(chosen, rejected)
        assert got == (want["prompt"], want["chosen"], want["rejected"])


def test_implicit_rows_tokenize_as_explicit(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    explicit = _rows(3)
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                for r in explicit]  # fmt: skip
    a, _ = tokenize_pairs(explicit, tokenizer, max_tokens=512)
    b, _ = tokenize_pairs(implicit, tokenizer, max_tokens=512)
    assert a == b


def test_bad_rows_counted_and_skipped(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    good = _rows(2)
    bad = [
        {"prompt": "Hi", "chosen": "Same.", "rejected": "Same."},
        {"prompt": "Hi", "chosen": "Yes."},
        {"prompt": "Hi", "chosen": 3, "rejected": "No."},
        {"prompt": "Hi", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "No."},
    ]
    pairs, report = tokenize_pairs(good + bad, tokenizer, max_tokens=512)
    assert len(pairs) == report.kept == 2
    assert dict(report.skipped) == {"identical": 1, "missing_field": 1, "wrong_type": 1,
                                    "mixed_formats": 1}  # fmt: skip
    assert "row 2" in report.first_skip
    with pytest.raises(ValueError, match="data row 2: identical"):
        tokenize_pairs(good + bad, tokenizer, max_tokens=512, strict=True)
    # Over the limit: dropped, or truncated keeping the start (TRL's keep_start).
    limit = max(max(len(p.chosen), len(p.rejected)) for p in pairs)
    long = {**good[0], "chosen": [{"role": "assistant", "content": "very " * 60 + "long."}]}
    kept, report = tokenize_pairs(good + [long], tokenizer, max_tokens=limit)
    assert report.dropped == 1 and len(kept) == 2
    kept, report = tokenize_pairs([long], tokenizer, max_tokens=limit, overlong="truncate")
    assert report.truncated == 1 and len(kept[0].chosen) == limit
    full, _ = tokenize_pairs([long], tokenizer, max_tokens=1 << 20)
    assert kept[0].chosen == full[0].chosen[:limit] and kept[0].rejected == full[0].rejected


def test_overlong_rows_in_the_three_pair_tokenizers(tiny):
    """data.overlong through data/rows.py's LengthLimit, as each objective had it: a prompt
    that fills max_tokens is dropped (DPO pairs, reward) or skipped as prompt_too_long
    (DPO under truncate; KTO always: its KL sequences need the prompt); a reward pair is
    cut and re-scored (no prompt kept)."""
    from slipstream.models.score_head import pad_id_of, score_positions
    from slipstream.objectives.kto_data import tokenize_kto
    from slipstream.objectives.reward_data import tokenize_reward_pairs

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    row = {"prompt": "word " * 40, "chosen": "Yes.", "rejected": "No."}
    short = {"prompt": "Hi", "chosen": "Yes, " * 30, "rejected": "No."}
    fits, limit = {"prompt": "Hi", "chosen": "Yes.", "rejected": "No."}, 20
    outcomes = {}
    for name, fn in (("pairs", tokenize_pairs), ("kto", tokenize_kto),
                     ("reward", tokenize_reward_pairs)):  # fmt: skip
        for mode in ("drop", "truncate"):
            _, report = fn([row, short, fits], tokenizer, max_tokens=limit, overlong=mode)
            outcomes[name, mode] = (dict(report.skipped), report.dropped, report.truncated)
    assert outcomes == {
        ("pairs", "drop"): ({}, 2, 0),
        ("pairs", "truncate"): ({"prompt_too_long": 1}, 0, 1),
        ("kto", "drop"): ({"prompt_too_long": 1}, 1, 0),
        ("kto", "truncate"): ({"prompt_too_long": 1}, 0, 1),
        ("reward", "drop"): ({}, 2, 0),
        ("reward", "truncate"): ({}, 0, 2),
    }
    cut, _ = tokenize_reward_pairs([short], tokenizer, max_tokens=limit, overlong="truncate")
    whole, _ = tokenize_reward_pairs([short], tokenizer, max_tokens=1 << 20)
    assert cut[0].chosen == whole[0].chosen[:limit]
    assert [cut[0].chosen_at] == score_positions([cut[0].chosen], pad_id_of(tokenizer))
    kto, _ = tokenize_kto([short], tokenizer, max_tokens=limit, overlong="truncate")
    assert len(kto) == 2 and max(len(ex.ids) for ex in kto) == limit  # a pair cut whole


def test_sft_data_with_a_preference_objective_is_one_line(tiny):
    with pytest.raises(ValueError, match="train.objective=dpo needs .* no chosen or rejected"):
        check_pair_columns(["messages"], "dpo", "data source 'chats.jsonl'")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    with pytest.raises(ValueError, match=r"columns: \['messages'\]"):
        pair_objective("orpo").tokenize([{"messages": []}], tokenizer)


def test_preference_data_with_sft_is_one_line():
    from slipstream.data import detect_format

    with pytest.raises(ValueError, match="preference data .*train.objective"):
        detect_format(["prompt", "chosen", "rejected"])


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("with_stats", [False, True])
def test_token_logps_equal_log_softmax(chunk, with_stats, monkeypatch):
    from slipstream.ops import loss

    monkeypatch.setattr(loss, "_STATS_ELEMENTS", 5 * 50)  # the stats in blocks of 5 rows
    torch.manual_seed(0)
    h = torch.randn(23, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (23,))
    got = linear_token_logps(h, w, y, chunk_size=chunk, with_stats=with_stats)
    logp = torch.log_softmax(h @ w.T, -1)
    want = logp.gather(1, y[:, None])[:, 0]
    if with_stats:  # each row's entropy and mean logit, detached; log-probs, grads unchanged
        got, stats = got
        torch.testing.assert_close(stats["entropy"], -(logp.exp() * logp).sum(-1).detach())
        torch.testing.assert_close(stats["mean_logit"], (h @ w.T).mean(-1).detach())
        assert not any(v.requires_grad for v in stats.values())
    torch.testing.assert_close(got, want)
    g = torch.randn(23)
    got_grads = torch.autograd.grad((got * g).sum(), (h, w))
    want_grads = torch.autograd.grad((want * g).sum(), (h, w))
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["dpo", "orpo", "simpo"])
def test_packed_pairs_equal_one_at_a_time(tiny, name):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    pairs, _ = tokenize_pairs(_rows(4), tokenizer, max_tokens=512)
    model = _model(tiny)
    objective = pair_objective(name)
    objective.reference = ReferencePolicy(model, "base")
    batch = objective.collate(pairs)
    seg = objective.sequence_logps(model, batch).detach()
    ones = [objective.sequence_logps(model, objective.collate([p])).detach() for p in pairs]
    torch.testing.assert_close(seg[:8], torch.cat([x[:2] for x in ones]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(seg[8:], torch.cat([x[2:] for x in ones]), atol=1e-5, rtol=1e-5)
    if name == "orpo":  # its NLL is a token mean over the micro-batch: not additive in pairs
        return
    loss, metrics = objective.micro_batch_loss(model, batch)
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    parts = [objective.micro_batch_loss(model, objective.collate([p])) for p in pairs]
    loss_one = sum(x[0] for x in parts)
    grads_one = torch.autograd.grad(loss_one, [p for p in model.parameters() if p.requires_grad])
    torch.testing.assert_close(loss, loss_one, atol=1e-5, rtol=1e-5)
    for k, v in metrics.items():
        torch.testing.assert_close(v, sum(x[1][k] for x in parts), atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, grads_one, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_reference_policies(tiny):
    """base: the plain model's numbers; start: the snapshot's, and the live adapter back."""
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    pairs, _ = tokenize_pairs(_rows(3), tokenizer, max_tokens=512)
    plain = _model(tiny, lora=False)
    model = _model(tiny)
    objective = pair_objective("dpo")
    batch = objective.collate(pairs)
    want_base = objective.sequence_logps(plain, batch)[:6]
    start_logps = objective.sequence_logps(model, batch)[:6].detach()

    objective.reference = ReferencePolicy(model, "base")
    torch.testing.assert_close(objective.reference_logps(batch), want_base.detach())
    objective.reference = ReferencePolicy(model, "start")
    with torch.no_grad():  # training moves the live adapter on
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.05)
    live = [p.detach().clone() for p in model.parameters()]
    torch.testing.assert_close(objective.reference_logps(batch), start_logps)
    assert all(torch.equal(a, b) for a, b in zip(live, model.parameters(), strict=True))
    assert [n for n, _ in model.named_modules()] == [n for n, _ in _model(tiny).named_modules()]
    assert model.training


def test_full_fine_tuning_reference_is_a_frozen_copy(tiny):
    model = _model(tiny, lora=False).requires_grad_(True)
    ref = ReferencePolicy(model, "copy")
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with ref.active() as m:
        assert m is not model and not m.lm_head.weight.requires_grad
        assert not torch.equal(m.lm_head.weight, model.lm_head.weight)


def test_conservative_dpo_formula():
    c, r = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    rc, rr = torch.tensor([-3.5, -4.0]), torch.tensor([-3.0, -3.0])
    loss, _, _ = dpo_losses(c, r, rc, rr, beta=0.3, label_smoothing=0.2)
    delta = (c - rc) - (r - rr)
    want = -0.8 * F.logsigmoid(0.3 * delta) - 0.2 * F.logsigmoid(-0.3 * delta)
    torch.testing.assert_close(loss, want)


def test_dpo_step_has_no_host_syncs(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    pairs, _ = tokenize_pairs(_rows(3), tokenizer, max_tokens=512)
    model = _model(tiny)
    for name in ("dpo", "orpo", "simpo"):
        objective = pair_objective(name)
        objective.reference = ReferencePolicy(model, "base")
        batch = objective.collate(pairs)
        with count_syncs() as syncs:
            loss, metrics = objective.micro_batch_loss(model, batch)
            (loss / 3).backward()
        assert syncs.total == 0, (name, syncs)


def test_chitchat_pairs_are_disjoint_trl_rows(tiny, tmp_path):
    pytest.importorskip("chitchat_dataset")
    from slipstream.data.chitchat import write_chitchat_pairs

    out = write_chitchat_pairs(tmp_path, train_rows=40, eval_rows=8)
    import json

    train = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert len(train) == 40 and len(held) == 8
    assert not {json.dumps(r["prompt"]) for r in held} & {json.dumps(r["prompt"]) for r in train}
    for r in train:
        assert r["prompt"][-1]["role"] == "user" and len(r["prompt"]) % 2 == 1
        assert r["chosen"][0]["role"] == r["rejected"][0]["role"] == "assistant"
    pairs, report = tokenize_pairs(train, AutoTokenizer.from_pretrained(tiny), max_tokens=512)
    assert report.kept + sum(report.skipped.values()) + report.dropped == 40
    assert report.kept >= 36


def test_text_parts_tokenize_as_strings_and_image_parts_are_counted(tiny):
    # TRL's / OpenAI's content parts: joined as SFT joins them (data/formats.py).
    tokenizer = AutoTokenizer.from_pretrained(tiny)

    def as_parts(messages):
        return [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]

    plain = _rows(2)
    parts = [{k: as_parts(v) for k, v in row.items()} for row in plain]
    image = {**plain[0], "prompt": [{"role": "user", "content": [{"type": "image"}]}]}
    a, _ = tokenize_pairs(plain, tokenizer, max_tokens=512)
    b, report = tokenize_pairs(parts + [image], tokenizer, max_tokens=512)
    assert a == b and dict(report.skipped) == {"image_part": 1}
    assert "'prompt' message 0 part 0 is 'image': image parts need a vision model" in (
        report.first_skip
    )
