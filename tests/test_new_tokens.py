"""New tokens and trained embeddings (peft/embeddings.py; `model.add_tokens`,
`lora.train_embeddings`), tied and untied, against peft 0.21 and transformers: the grown rows
are the mean of the old ones; an adapter with trained rows (peft's trainable_token_indices)
or whole matrices (modules_to_save) loads in peft (`AutoPeftModelForCausalLM`, which grows
the base to the saved tokenizer) with the same logits and, on the same batch, the same loss
and gradients of every trained tensor; the merged export loads in transformers; a training
run trains only the new rows and resumes exactly; packed, grad-accum and one sequence a
micro-batch give the same gradients; 2 gloo DDP ranks equal one process (slow); malformed
configs and adapters are one-line errors."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers.models import make_hf_model
from helpers.runs import chat_rows, train_until_signal
from helpers.tokenizers import save_test_tokenizer

from slipstream.checkpoint.adapter import load_adapter, save_adapter
from slipstream.checkpoint.hf import load_model, save_model
from slipstream.config import config_from_dict
from slipstream.debug import count_syncs
from slipstream.ops.packing import SeqInfo
from slipstream.peft.embeddings import (
    TrainableTokens,
    apply_embedding_training,
    new_token_rows,
    resize_vocab,
)
from slipstream.peft.lora import apply_lora, merge_lora

peft = pytest.importorskip("peft")
NEW = ["<tool>", "</tool>", "<|think|>"]
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            initializer_range=0.2)  # fmt: skip


def base_dir(root, tied):
    """A tiny Llama (vocab = the tokenizer's 300) with its tokenizer files."""
    d = root / f"base-{'tied' if tied else 'untied'}"
    if not d.exists():
        save_test_tokenizer(d, "chatml", vocab_size=300)
        make_hf_model("llama", tie_word_embeddings=tied, **TINY).save_pretrained(d)
    return d


def tokenizer_with_new(d):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == 300
    tok.add_tokens(NEW)
    return tok


def batch_ids(tok):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (14,), generator=g)
    ids[[2, 5, 9]] = torch.tensor(tok.convert_tokens_to_ids(NEW))
    return ids


def ours(d, tok, *, full=(), rows=True):
    model = load_model(d, dtype=torch.float32)
    resize_vocab(model, len(tok))
    apply_lora(model, rank=4, alpha=8)
    ids = tok.convert_tokens_to_ids(NEW) if rows else []
    apply_embedding_training(model, rows=new_token_rows(model, ids, list(full)), full=full)
    with torch.no_grad():  # trained values: away from the init, so a lost tensor shows
        g = torch.Generator().manual_seed(5)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def peft_load(adapter, trainable=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.AutoPeftModelForCausalLM.from_pretrained(
            str(adapter), is_trainable=trainable, torch_dtype=torch.float32
        )


def test_grown_rows_are_the_mean(tmp_path):
    from transformers import AutoModelForCausalLM

    d = base_dir(tmp_path, tied=False)
    model = load_model(d, dtype=torch.float32)
    old_e, old_h = model.model.embed_tokens.weight.clone(), model.lm_head.weight.clone()
    assert resize_vocab(model, 303) == 3 and resize_vocab(model, 300) == 0
    assert model.config.vocab_size == 303 and model.config.hf["vocab_size"] == 303
    for new, old in ((model.model.embed_tokens.weight, old_e), (model.lm_head.weight, old_h)):
        assert torch.equal(new[:300], old)
        torch.testing.assert_close(new[300:], old.mean(0).expand(3, -1), rtol=0, atol=1e-7)
    hf = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    hf.resize_token_embeddings(303)  # mean_resizing: the mean plus noise of 1e-9 x cov
    theirs = hf.get_input_embeddings().weight.detach()
    torch.testing.assert_close(model.model.embed_tokens.weight[300:], theirs[300:], atol=1e-3,
                               rtol=0)  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("full", [(), ("embed_tokens",), ("embed_tokens", "lm_head")])
def test_adapter_loads_in_peft_with_equal_logits_and_gradients(tmp_path, tied, full):
    d = base_dir(tmp_path, tied)
    tok = tokenizer_with_new(d)
    model = ours(d, tok, full=full)
    kinds = {type(m) for m in model.modules()}
    assert (TrainableTokens in kinds) == (not tied and len(full) < 2 or tied and not full)
    out = save_adapter(model, tmp_path / "adapter")
    tok.save_pretrained(out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    ids = batch_ids(tok)
    seq = SeqInfo.from_lengths([len(ids)])
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    loss = model.loss(ids, labels, seq)
    loss.backward()
    theirs = peft_load(out, trainable=True)
    assert theirs.get_input_embeddings().weight.shape[0] == 303
    got = theirs(input_ids=ids[None], labels=ids[None])
    torch.testing.assert_close(got.logits[0], model(ids, seq), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, loss, atol=1e-6, rtol=1e-5)
    got.loss.backward()
    peft_grads = {
        n.replace(".default", "").replace(".modules_to_save", ""): p.grad
        for n, p in theirs.named_parameters() if p.requires_grad
    }  # fmt: skip
    our_grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert len(peft_grads) == len(our_grads) > 8
    names = {n.removeprefix("base_model.model.").replace(".base_layer", ""): g
             for n, g in peft_grads.items()}  # fmt: skip
    for name, grad in our_grads.items():
        key = name.replace(".base_layer", "").replace(".original_module", "")
        torch.testing.assert_close(grad, names[key], atol=1e-6, rtol=1e-4, msg=name)
    for m in model.modules():  # the trained rows got gradients
        if isinstance(m, TrainableTokens):
            assert m.delta.grad.abs().sum() > 0 and cfg["trainable_token_indices"]
    # ours loads back the same; the merged export loads in transformers the same
    again = load_adapter(load_model(d, dtype=torch.float32), out)
    torch.testing.assert_close(again(ids, seq), model(ids, seq), atol=1e-6, rtol=1e-6)
    from transformers import AutoModelForCausalLM

    save_model(merge_lora(again), tmp_path / "merged")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32)
    torch.testing.assert_close(hf(input_ids=ids[None]).logits[0], model(ids, seq).detach(),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_trained_rows_forward_backward_without_host_sync(tmp_path):
    d = base_dir(tmp_path, tied=False)
    tok = tokenizer_with_new(d)
    model = ours(d, tok)
    ids = batch_ids(tok)
    seq = SeqInfo.from_lengths([6, 8])
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    with count_syncs() as c:
        model.loss(ids, labels, seq, reduction="sum").backward()
    assert c.total == 0
    # only the new rows train: the embedding and head bases stay frozen
    assert not model.model.embed_tokens.original_module.weight.requires_grad
    assert model.lm_head.delta.grad.shape == (3, 32)


def tool_rows(n):
    rows = chat_rows(n)
    for r in rows:
        r["messages"][1]["content"] = f"<tool>{r['messages'][1]['content']}</tool>"
    return rows


def run_cfg(tmp_path, out, **train):
    d = base_dir(tmp_path, tied=False)
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in tool_rows(24)))
    return config_from_dict({
        "model": {"path": str(d), "add_tokens": NEW[:2]},
        "data": {"train": str(data)},
        "lora": {"rank": 4, "alpha": 8},
        "train": {"lr": 1e-2, "steps": 4, "tokens_per_batch": 128, "log_every": 1,
                  "device": "cpu", "activation_checkpointing": "none", **train},
        "output_dir": str(out),
    })  # fmt: skip


@pytest.mark.slow
def test_training_run_trains_new_rows_and_resumes_exactly(tmp_path):
    from safetensors.torch import load_file

    from slipstream.train import train

    train(run_cfg(tmp_path, tmp_path / "straight"))
    cut = run_cfg(tmp_path, tmp_path / "cut", save_every=2)
    assert train_until_signal(cut, at_step=3)["status"] == "interrupted"
    assert train(cut.model_copy(update={"resume": True}))["status"] == "completed"
    a = load_file(tmp_path / "straight" / "adapter_model.safetensors")
    b = load_file(tmp_path / "cut" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    key = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
    assert a[key].shape == (2, 32)
    base = load_model(base_dir(tmp_path, tied=False), dtype=torch.float32)
    mean = base.model.embed_tokens.weight.mean(0)
    assert (a[key] - mean).abs().max() > 1e-3  # the rows moved from their start
    theirs = peft_load(tmp_path / "straight")
    tok = tokenizer_with_new(base_dir(tmp_path, tied=False))
    ids = batch_ids(tok)
    ids[ids >= 302] = 5
    model = load_adapter(load_model(base_dir(tmp_path, tied=False), dtype=torch.float32),
                         tmp_path / "straight")  # fmt: skip
    with torch.no_grad():
        got = model(ids, SeqInfo.from_lengths([14]))
        torch.testing.assert_close(theirs(input_ids=ids[None]).logits[0], got, atol=1e-5,
                                   rtol=1e-5)  # fmt: skip


def test_config_and_adapter_errors(tmp_path):
    d = base_dir(tmp_path, tied=False)
    base = {"model": {"path": str(d)}, "data": {"train": "x.jsonl"}, "output_dir": "o"}
    with pytest.raises(ValueError, match="lora.train_embeddings is for train.finetune=lora"):
        config_from_dict(
            {**base, "train": {"finetune": "full"}, "lora": {"train_embeddings": ["lm_head"]}}
        )
    with pytest.raises(ValueError, match="model.add_tokens: give each token once"):
        config_from_dict({**base, "model": {"path": str(d), "add_tokens": ["<a>", "<a>"]}})
    with pytest.raises(ValueError, match="lora.train_embeddings"):
        config_from_dict({**base, "lora": {"train_embeddings": ["q_proj"]}})
    model = load_model(d, dtype=torch.float32)
    apply_lora(model, rank=4, alpha=8)
    out = save_adapter(model, tmp_path / "a")
    cfg = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, "modules_to_save": ["q_proj"]}))
    with pytest.raises(ValueError, match=r"modules_to_save=\['q_proj'\] is not supported"):
        load_adapter(load_model(d, dtype=torch.float32), out)


def test_packed_and_grad_accum_equal_each_sequence_alone(tmp_path, monkeypatch):
    """Trained new rows (embedding and head) and LoRA: three sequences that use the new
    tokens, packed in one micro-batch, in two (grad-accum), and one a micro-batch: the same
    summed loss and gradients of every trained tensor (the new rows' deltas included)."""
    from slipstream.data.labels import Example
    from slipstream.objectives.sft import SFT
    from slipstream.ops import attention
    from slipstream.train.loop import accumulate_gradients

    monkeypatch.setattr(attention, "per_sequence_wins", lambda lengths: True)  # one path
    d = base_dir(tmp_path, tied=False)
    tok = tokenizer_with_new(d)
    model = ours(d, tok)
    new = tok.convert_tokens_to_ids(NEW)
    g = torch.Generator().manual_seed(8)
    examples = []
    for n in (7, 11, 5):
        ids = torch.randint(0, 300, (n,), generator=g).tolist()
        ids[1], ids[-2] = new[len(examples)], new[(len(examples) + 1) % 3]
        examples.append(Example(ids, [False] * 2 + [True] * (n - 2)))
    objective = SFT()
    out = []
    for split in ([examples], [examples[:1], examples[1:]], [[e] for e in examples]):
        model.zero_grad(set_to_none=True)
        loss, _ = accumulate_gradients(model, [objective.collate(x) for x in split], objective)
        out.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.requires_grad}))  # fmt: skip
    deltas = [n for n in out[0][1] if "delta" in n]
    assert len(deltas) == 2 and all(out[0][1][n].abs().sum() > 0 for n in deltas)
    for loss, grads in out[1:]:
        torch.testing.assert_close(loss, out[0][0], atol=1e-5, rtol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, out[0][1][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path):
    """model.add_tokens with LoRA under DDP: 2 gloo ranks with grad_accum 1 against one
    process with grad_accum 2: the same losses and the same adapter, new rows included."""
    from helpers.torchrun import check, train_job
    from safetensors.torch import load_file

    from slipstream.train import train

    def raw(out, **train_options):
        cfg = run_cfg(tmp_path, out, **train_options).model_dump(mode="json")
        cfg["lora"]["dropout"] = 0.0  # each rank would draw its own masks
        return cfg

    train(config_from_dict(raw(tmp_path / "single", grad_accum=2)))
    check(train_job(raw(tmp_path / "ddp", grad_accum=1, parallel="ddp", dist_timeout_s=60),
                    tmp_path, timeout=300))  # fmt: skip
    records = lambda out: {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl")  # noqa: E731
                           .read_text().splitlines()) if "loss" in r}  # fmt: skip
    want, got = records(tmp_path / "single"), records(tmp_path / "ddp")
    assert sorted(want) == sorted(got) == [1, 2, 3, 4]
    for step, w in want.items():
        assert got[step]["loss"] == pytest.approx(w["loss"], abs=1e-5), step
        assert got[step]["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), step
    a = load_file(tmp_path / "single" / "adapter_model.safetensors")
    b = load_file(tmp_path / "ddp" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any("trainable_tokens_delta" in k for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-5, rtol=1e-4, msg=k)
