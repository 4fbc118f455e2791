"""Distillation (objectives/distill.py) against TRL 1.16 on the same batch: GKD's
`generalized_jsd_loss` over the two transformers models' padded logits (what
`GKDTrainer.compute_loss` computes) and `DistillationTrainer`'s chunked loss over their hidden
states; the loss and every student gradient (full fine-tuning of a tiny Llama, a wider and
deeper teacher of the same vocabulary, float32), the entropy metric; packed == one sequence
at a time; grad-accum equal to one batch; no host sync; on-policy batches (lmbda) seeded and
made of the student's own completions, whose loss equals GKD's on the same samples; an NF4
teacher against GKD with transformers' bitsandbytes 4-bit teacher, a bfloat16 teacher against
GKD with transformers' bf16 one; a LoRA student's every factor gradient against GKD on the
PeftModel; no tensor of a step larger than one chunk of logits; a different vocabulary or
tokenizer is a one-line error."""

from __future__ import annotations

import pytest
import torch
from helpers.models import make_hf_model

from slipstream.checkpoint.hf import load_model
from slipstream.data.labels import Example
from slipstream.debug import count_syncs
from slipstream.objectives.base import HookContext
from slipstream.objectives.distill import Distill, check_same_vocabulary, last_span_start
from slipstream.train.loop import accumulate_gradients

trl_gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
trl_distill = pytest.importorskip("trl.trainer.distillation_trainer")

V = 300
STUDENT = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4,
               initializer_range=0.2)  # fmt: skip
TEACHER = dict(vocab_size=V, hidden_size=48, intermediate_size=96, num_attention_heads=6,
               num_hidden_layers=3, initializer_range=0.2)  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    hf_s, hf_t = make_hf_model("llama", **STUDENT), make_hf_model("llama", seed=1, **TEACHER)
    hf_s.save_pretrained(root / "student")
    hf_t.save_pretrained(root / "teacher")
    student = load_model(root / "student", dtype=torch.float32)
    teacher = load_model(root / "teacher", dtype=torch.float32).requires_grad_(False).eval()
    return hf_s, hf_t, student, teacher


def examples(seed=0, n=3):
    """Prompt + completion examples (targets: the completion), some multi-span."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(3, 8, (1,), generator=g))
        c = int(torch.randint(2, 9, (1,), generator=g))
        ids = torch.randint(0, V, (p + c,), generator=g).tolist()
        trainable = [False] * p + [True] * c
        if i == 1:
            trainable[1] = True  # an earlier labelled span: still a target off-policy
        out.append(Example(ids, trainable))
    return out


def padded(exs):
    """TRL's layout: right-padded ids, labels = ids at target tokens, -100 elsewhere."""
    L = max(len(e.input_ids) for e in exs)
    ids = torch.zeros(len(exs), L, dtype=torch.long)
    labels = torch.full((len(exs), L), -100)
    mask = torch.zeros(len(exs), L, dtype=torch.long)
    for i, e in enumerate(exs):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        mask[i, :n] = 1
        labels[i, :n] = torch.where(torch.tensor(e.trainable), ids[i, :n], -100)
    return ids, labels, mask


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_loss_and_gradients_equal_trl(models, beta, temperature):
    hf_s, hf_t, student, teacher = models
    exs = examples()
    ids, labels, mask = padded(exs)
    hf_s.zero_grad(set_to_none=True)
    student.zero_grad(set_to_none=True)
    s_logits = hf_s(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        t_logits = hf_t(input_ids=ids, attention_mask=mask).logits
    want = trl_gkd.GKDTrainer.generalized_jsd_loss(
        s_logits[:, :-1], t_logits[:, :-1], labels=labels[:, 1:], beta=beta,
        temperature=temperature,
    )  # fmt: skip
    want.backward()
    objective = Distill(teacher=teacher, beta=beta, temperature=temperature, lmbda=0.0)
    batch = objective.collate(exs)
    loss, metrics = objective.micro_batch_loss(student, batch)
    (loss / objective.weight(batch)).backward()
    assert objective.weight(batch) == int((labels[:, 1:] != -100).sum())
    torch.testing.assert_close(loss / objective.weight(batch), want, atol=1e-6, rtol=1e-5)
    expected, got = grads(hf_s), grads(student)
    assert expected.keys() == got.keys() and len(got) > 10
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-4, msg=name)
    # TRL's DistillationTrainer: the same loss and its entropy, from the hidden states
    with torch.no_grad():
        h_s = hf_s.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        h_t = hf_t.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        ref, entropy, n = trl_distill._chunked_divergence_loss(
            h_s, h_t, hf_s.lm_head.weight, hf_t.lm_head.weight, labels[:, 1:] != -100, beta,
            temperature=temperature,
        )  # fmt: skip
    torch.testing.assert_close(loss.detach() / n, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(metrics["entropy"], entropy, atol=1e-5, rtol=1e-5)


def test_an_nf4_teacher_equals_trl_with_a_bitsandbytes_teacher(models, tmp_path):
    """distill.teacher_quantization=nf4 through load_teacher: the loss and every student
    gradient equal TRL's GKD loss with the same teacher loaded by transformers in 4 bits
    (BitsAndBytesConfig nf4, double quantisation: what TRL's teacher_model_init_kwargs
    give it), float32 compute."""
    pytest.importorskip("bitsandbytes")
    from test_qlora import _hf_nf4

    from slipstream.objectives.distill import load_teacher
    from slipstream.objectives.distill_config import DistillSection
    from slipstream.peft.qlora import has_4bit_weights

    hf_s, _, student, _ = models
    # dims in the 64-wide NF4 blocks (and bitsandbytes' 32-wide packed CPU layout)
    make_hf_model("llama", seed=2, **{**TEACHER, "hidden_size": 64, "intermediate_size": 128,
                  "num_attention_heads": 4}).save_pretrained(tmp_path)  # fmt: skip
    options = DistillSection.from_options(
        "Distill", dict(teacher=str(tmp_path), teacher_quantization="nf4")
    )
    teacher = load_teacher(options, "float32", torch.device("cpu"), prepack=False)
    assert has_4bit_weights(teacher) and not any(p.requires_grad for p in teacher.parameters())
    hf_t = _hf_nf4(tmp_path)
    exs = examples(4)
    ids, labels, mask = padded(exs)
    hf_s.zero_grad(set_to_none=True)
    student.zero_grad(set_to_none=True)
    with torch.no_grad():
        t_logits = hf_t(input_ids=ids, attention_mask=mask).logits
    want = trl_gkd.GKDTrainer.generalized_jsd_loss(
        hf_s(input_ids=ids, attention_mask=mask).logits[:, :-1], t_logits[:, :-1],
        labels=labels[:, 1:], beta=0.5,
    )  # fmt: skip
    want.backward()
    objective = Distill(teacher=teacher, beta=0.5, lmbda=0.0)
    batch = objective.collate(exs)
    loss, _ = objective.micro_batch_loss(student, batch)
    (loss / objective.weight(batch)).backward()
    torch.testing.assert_close(loss / objective.weight(batch), want, atol=1e-6, rtol=1e-5)
    expected, got = grads(hf_s), grads(student)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-4, msg=name)


def test_lora_student_gradients_equal_trl(models, tmp_path):
    """A LoRA student (random factors on every linear, as peft loads it for TRL's GKD) with
    beta 0.5 and temperature 0.7: the loss and every LoRA factor's gradient equal
    `generalized_jsd_loss` over the PeftModel's and the teacher's logits."""
    import peft
    from helpers.tiny_hf import random_lora
    from transformers import AutoModelForCausalLM

    from slipstream.checkpoint.adapter import load_adapter

    hf_s, hf_t, _, teacher = models
    hf_s.save_pretrained(tmp_path / "student")
    random_lora(load_model(tmp_path / "student", dtype=torch.float32), tmp_path / "lora",
                "all-linear", std=0.1)  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "student", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "lora", is_trainable=True)
    student = load_adapter(load_model(tmp_path / "student", dtype=torch.float32),
                           tmp_path / "lora")  # fmt: skip
    exs = examples(6)
    ids, labels, mask = padded(exs)
    s_logits = theirs(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        t_logits = hf_t(input_ids=ids, attention_mask=mask).logits
    want = trl_gkd.GKDTrainer.generalized_jsd_loss(
        s_logits[:, :-1], t_logits[:, :-1], labels=labels[:, 1:], beta=0.5, temperature=0.7
    )
    want.backward()
    objective = Distill(teacher=teacher, beta=0.5, temperature=0.7, lmbda=0.0)
    batch = objective.collate(exs)
    loss, _ = objective.micro_batch_loss(student, batch)
    (loss / objective.weight(batch)).backward()
    torch.testing.assert_close(loss / objective.weight(batch), want, atol=1e-6, rtol=1e-5)
    expected = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad
                for n, p in theirs.named_parameters() if p.grad is not None}  # fmt: skip
    got = grads(student)
    assert expected.keys() == got.keys() and len(got) == 2 * 7 * 2
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-4, msg=name)


def test_a_bfloat16_teacher_runs_in_bfloat16(models, tmp_path):
    """distill.teacher_dtype=bfloat16 through load_teacher: the teacher's weights are bf16
    and a float32 student's loss and gradients equal GKD's with transformers' bf16 teacher
    (its logits upcast), closer than to the float32 teacher's loss."""
    from transformers import AutoModelForCausalLM

    from slipstream.objectives.distill import load_teacher
    from slipstream.objectives.distill_config import DistillSection

    hf_s, hf_t, student, _ = models
    hf_t.save_pretrained(tmp_path)
    options = DistillSection.from_options(
        "Distill", dict(teacher=str(tmp_path), teacher_dtype="bfloat16")
    )
    teacher = load_teacher(options, "float32", torch.device("cpu"), prepack=False)
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16}
    hf_bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    exs = examples(7)
    ids, labels, mask = padded(exs)
    hf_s.zero_grad(set_to_none=True)
    student.zero_grad(set_to_none=True)
    s_logits = hf_s(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        t16 = hf_bf16(input_ids=ids, attention_mask=mask).logits.float()
        t32 = hf_t(input_ids=ids, attention_mask=mask).logits
    gkd = trl_gkd.GKDTrainer.generalized_jsd_loss
    want = gkd(s_logits[:, :-1], t16[:, :-1], labels=labels[:, 1:], beta=0.5)
    fp32 = gkd(s_logits[:, :-1].detach(), t32[:, :-1], labels=labels[:, 1:], beta=0.5)
    want.backward()
    objective = Distill(teacher=teacher, beta=0.5, lmbda=0.0)
    batch = objective.collate(exs)
    loss, _ = objective.micro_batch_loss(student, batch)
    loss = loss / objective.weight(batch)
    loss.backward()
    # bf16 kernels round differently in the two implementations: measured 5.6e-5 apart, the
    # float32 teacher's loss 3.9e-4 away
    torch.testing.assert_close(loss, want, atol=2e-4, rtol=0)
    assert abs(loss.item() - want.item()) < abs(loss.item() - fp32.item())  # it is bf16's
    expected, got = grads(hf_s), grads(student)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=2e-3, rtol=2e-2, msg=name)


def test_the_loss_never_holds_the_logits_of_every_token(tmp_path, monkeypatch):
    """Memory: with 32 rows of logits a chunk, no tensor of a distillation step (forward and
    backward) is larger than one chunk of (rows, V) logits, at 100 or 400 labelled tokens:
    neither model's (T, V) logits exist whole."""
    from test_grpo import LargestTensor

    from slipstream.ops import jsd

    V, rows = 20_000, 32
    small = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                 num_key_value_heads=1)  # fmt: skip
    make_hf_model("llama", **small).save_pretrained(tmp_path / "s")
    make_hf_model("llama", seed=1, **{**small, "hidden_size": 24}).save_pretrained(tmp_path / "t")
    student = load_model(tmp_path / "s", dtype=torch.float32)
    teacher = load_model(tmp_path / "t", dtype=torch.float32).requires_grad_(False).eval()
    monkeypatch.setattr(jsd, "_CHUNK_ELEMENTS", V * rows)
    objective = Distill(teacher=teacher, beta=0.5, lmbda=0.0)
    largest = []
    for n in (100, 400):
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, V, (n + 4,), generator=g).tolist()
        batch = objective.collate([Example(ids, [False] * 4 + [True] * n)])
        student.zero_grad(set_to_none=True)
        with LargestTensor() as mode:
            loss, _ = objective.micro_batch_loss(student, batch)
            loss.backward()
        largest.append(mode.largest)
        assert mode.largest <= rows * V < n * V // 3, (n, mode.largest)
    assert largest[0] == largest[1]  # one chunk of logits, whatever the token count


def test_packed_equals_one_at_a_time_and_grad_accum(models):
    _, _, student, teacher = models
    objective = Distill(teacher=teacher, beta=0.3, temperature=0.9, lmbda=0.0)
    exs = examples(1, n=4)
    whole = [objective.collate(exs)]
    parts = [objective.collate(exs[:1]), objective.collate(exs[1:])]
    singles = [objective.collate([e]) for e in exs]
    results = []
    for window in (whole, parts, singles):
        student.zero_grad(set_to_none=True)
        loss, metrics = accumulate_gradients(student, window, objective)
        results.append((loss, metrics["entropy"], grads(student)))
    for loss, entropy, g in results[1:]:
        torch.testing.assert_close(loss, results[0][0], atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(entropy, results[0][1], atol=1e-5, rtol=1e-6)
        for name in g:
            torch.testing.assert_close(g[name], results[0][2][name], atol=1e-6, rtol=1e-5)


def test_no_host_sync_in_the_loss(models):
    _, _, student, teacher = models
    objective = Distill(teacher=teacher, lmbda=0.0)
    batch = objective.collate(examples(2))
    with count_syncs() as c:
        loss, _ = objective.micro_batch_loss(student, batch)
        loss.backward()
    assert c.total == 0


class Tok:
    eos_token_id, pad_token_id = 0, None

    def get_vocab(self):
        return {}


def test_on_policy_batches_are_the_students_seeded_completions(models):
    _, _, student, teacher = models
    objective = Distill(teacher=teacher, lmbda=1.0, max_completion_tokens=5)
    exs = examples(3)
    run = HookContext(student, Tok(), torch.device("cpu"), seed=0, rank=0, world_size=1)
    window = [objective.collate(exs)]
    a, stats = objective.rollout(run, 1, window)
    b, _ = objective.rollout(run, 1, window)
    c, _ = objective.rollout(run, 2, window)
    assert stats["stats"]["on_policy"] == 1.0
    assert torch.equal(a[0].input_ids, b[0].input_ids)  # seeded by (seed, step, place)
    assert not torch.equal(a[0].input_ids, c[0].input_ids)
    for ex, new in zip(exs, a[0].examples, strict=True):
        p = last_span_start(ex.trainable)
        assert new.input_ids[:p] == ex.input_ids[:p] and not any(new.trainable[:p])
        assert 1 <= sum(new.trainable) <= 5 and all(new.trainable[p:])
        assert objective.length(ex) == max(len(ex.input_ids), p + 5)
    off = Distill(teacher=teacher, lmbda=0.0)
    assert objective.online and not off.online  # lmbda 0: no rollout, the loop's own eval


def test_on_policy_loss_equals_trl_gkd_on_the_same_samples(models):
    """An on-policy micro-batch (lmbda 1) against TRL's GKD on the same student samples:
    `GKDTrainer.generate_on_policy_outputs` given our completions as its model's `generate`
    output (prompt, then the completion right-padded with the eos, as transformers pads a
    finished row) masks and labels them (the first eos scored, what follows not, the prompt
    not), and `generalized_jsd_loss` over the two transformers models gives our loss and
    student gradients. One example's completion ends at a stop token. Per example, as TRL's
    forward takes no position ids (left-padded prompts would shift its positions)."""
    from types import SimpleNamespace

    hf_s, hf_t, student, teacher = models
    objective = Distill(teacher=teacher, beta=0.5, temperature=1.0, lmbda=1.0,
                        max_completion_tokens=6)  # fmt: skip
    exs = examples(5)
    window = [objective.collate(exs)]

    class Stops(Tok):
        def __init__(self, eos):
            self.eos_token_id = eos

    ctx = HookContext(student, Stops(V + 7), torch.device("cpu"), seed=3, rank=0, world_size=1)
    free, _ = objective.rollout(ctx, 1, window)  # no stop token: 6 tokens each
    first = free[0].examples[0]
    eos = first.input_ids[last_span_start(exs[0].trainable) + 2]  # example 0's 3rd token
    ctx = HookContext(student, Stops(eos), torch.device("cpu"), seed=3, rank=0, world_size=1)
    (batch,), _ = objective.rollout(ctx, 1, window)
    ended = batch.examples[0]
    assert ended.input_ids[-1] == eos and sum(ended.trainable) <= 3  # stopped, eos a target
    hf_s.zero_grad(set_to_none=True)
    student.zero_grad(set_to_none=True)
    total, want = 0, 0.0
    for ex, new in zip(exs, batch.examples, strict=True):
        p = last_span_start(ex.trainable)
        completion = new.input_ids[p:] + [eos] * (6 - len(new.input_ids[p:]))
        sequences = torch.tensor([new.input_ids[:p] + completion])
        inputs = {"prompts": torch.tensor([ex.input_ids[:p]]),
                  "prompt_attention_mask": torch.ones(1, p, dtype=torch.long)}  # fmt: skip
        generator = SimpleNamespace(generate=lambda s=sequences, **kw: SimpleNamespace(sequences=s))
        ids, mask, labels = trl_gkd.GKDTrainer.generate_on_policy_outputs(
            generator, inputs, SimpleNamespace(eos_token_id=eos)
        )
        n = int((labels[:, 1:] != -100).sum())
        assert n == sum(new.trainable)
        s_logits = hf_s(input_ids=ids, attention_mask=mask).logits
        with torch.no_grad():
            t_logits = hf_t(input_ids=ids, attention_mask=mask).logits
        loss = trl_gkd.GKDTrainer.generalized_jsd_loss(
            s_logits[:, :-1], t_logits[:, :-1], labels=labels[:, 1:], beta=0.5
        )
        (loss * n).backward()
        total, want = total + n, want + loss.detach() * n
    loss, _ = objective.micro_batch_loss(student, batch)
    (loss / objective.weight(batch)).backward()
    assert objective.weight(batch) == total
    for p in hf_s.parameters():
        p.grad /= total
    torch.testing.assert_close(loss.detach(), want, atol=1e-5, rtol=1e-5)
    expected, got = grads(hf_s), grads(student)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-4, msg=name)


def test_a_different_vocabulary_is_one_line(models, tmp_path):
    _, _, student, _ = models
    other = make_hf_model("llama", **{**TEACHER, "vocab_size": V + 4})
    other.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary of 304 tokens, the student 300") as e:
        check_same_vocabulary(student, load_model(tmp_path), None, str(tmp_path))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="Distill options"):
        Distill(teacher_path="x")
    # the same size, another tokenizer (its special tokens): refused too, in one line
    from helpers.tokenizers import save_test_tokenizer
    from transformers import AutoTokenizer

    save_test_tokenizer(tmp_path / "ours", "chatml", vocab_size=V)
    save_test_tokenizer(tmp_path / "theirs", "llama3", vocab_size=V)
    make_hf_model("llama", **TEACHER).save_pretrained(tmp_path / "theirs")
    ours = AutoTokenizer.from_pretrained(tmp_path / "ours")
    same = load_model(tmp_path / "theirs")
    with pytest.raises(ValueError, match="its tokenizer differs from the student's") as e:
        check_same_vocabulary(student, same, ours, str(tmp_path / "theirs"))
    assert "\n" not in str(e.value)
    check_same_vocabulary(student, same, AutoTokenizer.from_pretrained(tmp_path / "theirs"),
                          str(tmp_path / "theirs"))  # fmt: skip


def distill_config(tiny_run, teacher_dir, out, **distill):
    from helpers.runs import run_config

    raw = run_config(
        tiny_run, out, objective="distill", steps=4, save_every=2, grad_accum=2, finetune="lora"
    )
    raw.pop("lora", None)
    raw["lora"] = {"rank": 4, "alpha": 8}
    raw["distill"] = {"teacher": str(teacher_dir), "lmbda": 0.5, "max_completion_tokens": 8,
                      **distill}  # fmt: skip
    return raw


@pytest.fixture(scope="module")
def teacher_dir(tiny_run, tmp_path_factory):
    import shutil

    d = tmp_path_factory.mktemp("teacher")
    model_dir, _ = tiny_run
    make_hf_model("llama", seed=1, **TEACHER).save_pretrained(d)
    for f in model_dir.glob("tokenizer*"):
        shutil.copy(f, d / f.name)
    return d


def test_a_run_resumes_exactly_and_logs_its_metrics(tiny_run, teacher_dir, tmp_path, monkeypatch):
    import json
    import os
    import signal

    from helpers.runs import assert_adapter_loads_in_peft
    from safetensors.torch import load_file

    from slipstream.config import config_from_dict
    from slipstream.train.loop import train

    raw = distill_config(tiny_run, teacher_dir, tmp_path / "straight")
    assert train(config_from_dict(raw))["status"] == "completed"
    cut = distill_config(tiny_run, teacher_dir, tmp_path / "cut")
    real, calls = Distill.micro_batch_loss, {"n": 0}

    def signalled(self, model, batch):  # SIGTERM during step 3 (2 micro-batches a step)
        if model.training:
            calls["n"] += 1
            if calls["n"] == 3 * 2:
                os.kill(os.getpid(), signal.SIGTERM)
        return real(self, model, batch)

    monkeypatch.setattr(Distill, "micro_batch_loss", signalled)
    assert train(config_from_dict(cut))["status"] == "interrupted"
    monkeypatch.setattr(Distill, "micro_batch_loss", real)
    assert train(config_from_dict({**cut, "resume": True}))["status"] == "completed"

    def logged(out):
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in rows if "loss" in r}

    want, got = logged(tmp_path / "straight"), logged(tmp_path / "cut")
    assert {"entropy", "on_policy"} <= set(want[4])
    text = (tmp_path / "straight" / "metrics.jsonl").read_text()
    assert "eval_loss" in text and "eval_entropy" in text
    assert 0 < sum(r["on_policy"] for r in want.values()) < 4  # some steps on-, some off-policy
    for step in (3, 4):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-6)
    a = load_file(tmp_path / "straight" / "adapter_model.safetensors")
    b = load_file(tmp_path / "cut" / "adapter_model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    assert_adapter_loads_in_peft(tiny_run[0], tmp_path / "straight")  # peft's logits = ours


def test_config_errors(tiny_run, teacher_dir, tmp_path):
    from slipstream.config import config_from_dict

    raw = distill_config(tiny_run, teacher_dir, tmp_path)
    raw["distill"].pop("teacher")
    with pytest.raises(ValueError, match="needs distill.teacher"):
        config_from_dict(raw)
    with pytest.raises(ValueError, match="distill.beta"):
        config_from_dict(distill_config(tiny_run, teacher_dir, tmp_path, beta=2))
    with pytest.raises(ValueError, match="max_completion_tokens=500 does not fit"):
        config_from_dict(distill_config(tiny_run, teacher_dir, tmp_path, max_completion_tokens=500))


@pytest.mark.slow
def test_two_ranks_match_one_process(tiny_run, teacher_dir, tmp_path):
    """2 gloo ranks (DDP, grad_accum 1 each) repeat one process with grad_accum 2: each
    micro-batch's on-policy draw and samples are seeded by its place in the step's global
    window, the normaliser is the step's labelled tokens over both ranks, and each rank
    evaluates its share of the held-out batches."""
    import json

    from helpers.torchrun import check, train_job
    from safetensors.torch import load_file

    from slipstream.config import config_from_dict
    from slipstream.train.loop import train

    single = distill_config(tiny_run, teacher_dir, tmp_path / "single")
    train(config_from_dict(single))
    two = distill_config(tiny_run, teacher_dir, tmp_path / "two")
    two["train"] = {**two["train"], "grad_accum": 1, "parallel": "ddp", "dist_timeout_s": 60}
    check(train_job(two, tmp_path, timeout=300))

    def logged(out):
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r.get("loss"), r.get("eval_loss"), r.get("on_policy")) for r in rows
                if "loss" in r or "eval_loss" in r]  # fmt: skip

    want, got = logged(tmp_path / "single"), logged(tmp_path / "two")
    assert [w[0] for w in want] == [g[0] for g in got]
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w[1:], g[1:], strict=True):
            assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, abs=1e-5))
    a = load_file(tmp_path / "single" / "adapter_model.safetensors")
    b = load_file(tmp_path / "two" / "adapter_model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)
